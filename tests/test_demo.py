"""`megapar demo` end to end: real gloo ranks, every step checked against the reference.

`--attention mla` (DeepSeek-V3 latent attention) runs the default layout and a corrupted weight.
Four multi-rank runs (each spawns processes): the default layout (tp 2, pcp 2, dcp 2, ep 4,
MXFP4; the KV cache sharded over pcp x dcp = 4 ranks as in vLLM), two KV heads per rank in a
cache sharded over PCP, sequence
parallelism with micro-batches and EPLB on 2 ranks, and a corrupted weight on one rank that must
turn the verdict into FAIL. The rest runs in this process."""

from __future__ import annotations

import pytest

from launch.demo import main


def _run(capsys, *argv: str) -> tuple[int, str]:
    """capsys, or capfd to see what the rank processes print too."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_demo_default_layout_passes(capsys):
    code, out = _run(capsys, "--new-tokens", "3")
    assert code == 0, out
    assert "PASS: max error" in out
    assert "4 rank(s), launcher local, backend gloo" in out
    assert "dcp      2      2  [0, 1]  [2, 3]" in out                  # the layout table: DCP inside TP (vLLM)
    for primitive in ("attn.ring", "attn.dcp", "attn.kv_fill", "moe.dispatch", "moe.experts", "moe.combine",
                      "moe.tp_gather", "mhc", "lm_head"):
        assert f"\n{primitive} " in out, primitive
    assert "tokens/s" in out and "\nprefill " in out and "\ndecode " in out
    assert "greedy tokens equal to the reference's argmax" in out


def test_demo_mla_default_layout_passes(capsys):
    # tp 2, pcp 2, dcp 2, ep 4: ring prefill (non-absorbed) over PCP, absorbed decode over a latent cache
    # sharded over pcp x dcp = 4 ranks, the fused prep's torch path, against the fp64 per-head reference
    code, out = _run(capsys, "--attention", "mla", "--new-tokens", "3")
    assert code == 0, out
    assert "PASS: max error" in out and "4 rank(s), launcher local, backend gloo" in out
    assert "MLA 4 heads (latent r 32 + rope 16" in out
    for primitive in ("attn.ring", "attn.kv_fill", "attn.mla_prep", "attn.dcp", "moe.dispatch"):
        assert f"\n{primitive} " in out, primitive


def test_demo_mla_fails_when_one_rank_holds_a_corrupted_weight(capsys):
    code, out = _run(capsys, "--attention", "mla", "--world-size", "4", "--tp", "4", "--dcp", "2", "--heads", "8",
                     "--layers", "1", "--new-tokens", "2", "--corrupt-rank", "3")
    assert code == 1, out
    assert "FAIL: max error" in out and "PASS" not in out


def test_demo_dcp_cache_with_several_kv_heads_per_rank_passes(capsys):
    # tp 2 x 4 KV heads: each rank's one cache holds 2 KV heads, sharded over the 2 PCP ranks (which hold
    # the same query heads) and decoded in one call merged over PCP.
    code, out = _run(capsys, "--world-size", "4", "--tp", "2", "--pcp", "2", "--kv-heads", "4",
                     "--heads", "8", "--layers", "1", "--new-tokens", "2")
    assert code == 0, out
    assert "\nattn.dcp " in out and "PASS: max error" in out


def test_demo_sequence_parallel_with_ubatch_and_eplb_passes(capsys):
    code, out = _run(capsys, "--world-size", "2", "--tp", "2", "--sp", "--ubatch", "--eplb", "--quant", "nvfp4",
                     "--batch", "3", "--prompt-len", "7", "--new-tokens", "3")
    assert code == 0, out
    assert "sp on" in out and "ubatch 2" in out and "eplb +2 slots" in out
    assert "EPLB step" in out
    assert "PASS: max error" in out


def test_demo_fails_when_one_rank_holds_a_corrupted_weight(capfd):
    code, out = _run(capfd, "--world-size", "2", "--pcp", "2", "--new-tokens", "2",
                     "--corrupt-rank", "1")
    assert code == 1, out
    assert "CORRUPTED weight on rank 1" in out
    assert "FAIL: max error" in out and "PASS" not in out
    # the phases were shown as they happened (rank 0 prints them), before the report
    marks = ["starting 2 local processes", "rank 0: started", "rank 0: prefill done", "rank 0: decode step 1/2",
             "rank 0: decode step 2/2", "ranks finished", "megapar demo: 2 rank(s)"]
    at = [out.find(m) for m in marks]
    assert -1 not in at and at == sorted(at), list(zip(marks, at))


def test_demo_timeout_is_one_message_not_a_traceback(capsys):
    code, out = _run(capsys, "--world-size", "2", "--pcp", "2", "--timeout", "1")
    assert code == 3, out
    assert "megapar demo: the job failed: timed out after 1s waiting for ranks [0, 1]" in out
    assert "Traceback" not in out and "During handling" not in out


def test_demo_world1_runs_in_process(capsys):
    code, out = _run(capsys, "--world-size", "1", "--quant", "fp8_block", "--new-tokens", "2", "--layers", "1")
    assert code == 0, out
    assert "attn.local" in out and "attn.paged" in out and "PASS" in out
    for line in ("rank 0: prefill done", "rank 0: decode step 1/2", "rank 0: decode step 2/2", "ranks finished"):
        assert f"megapar demo: {line}" in out, line


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "2", "--tp", "2", "--dcp", "2", "--kv-heads", "2"], "holds different KV heads"),
    (["--world-size", "4", "--pcp", "2", "--dcp", "2"], "dcp (2) must divide tp (1)"),
    (["--world-size", "4", "--prompt-len", "6"], "multiple of 2 * pcp"),
    (["--world-size", "3", "--experts", "8"], "multiple of ep"),
    (["--launcher", "torchrun"], "torchrun environment"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, got 0"),
    (["--attention", "mla", "--kv-heads", "2"], "--kv-heads (2) does not apply to --attention mla"),
    (["--attention", "mla", "--kv-lora-rank", "0"], "kv_lora_rank (0) must be >= 1"),
    (["--timeout", "-5"], "--timeout must be > 0 seconds, got -5"),
])
def test_demo_rejects_bad_arguments_before_starting(capsys, argv, message):
    code, out = _run(capsys, *argv)
    assert code == 2
    assert message in out


@pytest.mark.gpu
def test_demo_on_one_gpu(capsys):
    code, out = _run(capsys, "--world-size", "1", "--device", "cuda")
    assert code == 0, out
    assert "backend nccl, device cuda" in out and "PASS" in out


@pytest.mark.gpu
def test_demo_mla_on_one_gpu(capsys):
    # the fused MLA prep and the paged decode kernel (Triton), the efficient SDPA kernel in prefill
    code, out = _run(capsys, "--attention", "mla", "--world-size", "1", "--device", "cuda")
    assert code == 0, out
    assert "backend nccl, device cuda" in out and "attn.mla_prep" in out and "PASS" in out


@pytest.mark.multigpu
def test_demo_on_two_gpus_with_sequence_parallel(capsys):
    code, out = _run(capsys, "--world-size", "2", "--tp", "2", "--sp", "--device", "cuda")
    assert code == 0, out
    assert "PASS" in out
