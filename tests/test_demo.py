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


def test_demo_world1_job_error_exits_3_with_one_message_not_1(capsys, monkeypatch):
    # the in-process rank's exception escaped main() (a traceback, and exit code 1, which means FAIL)
    import launch.demo as demo

    def broken(groups, spec):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(demo, "run_rank", broken)
    code, out = _run(capsys, "--world-size", "1", "--layers", "1", "--new-tokens", "1")
    assert code == 3, out
    assert "megapar demo: the job failed: rank 0 failed:\nRuntimeError: kernel exploded" in out
    assert "PASS" not in out and "FAIL" not in out


def test_demo_launcher_ray_without_ray_is_an_argument_error(capsys, monkeypatch):
    # the ImportError escaped main() as a traceback with exit code 1 (FAIL)
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    code, out = _run(capsys, "--launcher", "ray", "--world-size", "1", "--layers", "1")
    assert code == 2, out
    assert "launch_on_ray needs Ray: pip install 'megapar[ray]'" in out and "Traceback" not in out


def test_demo_check_fails_on_nan_or_slightly_wrong_logits():
    # the check itself, on a real one-rank run (in this process): NaN logits at a decode step, or
    # on a second rank of the replica, were dropped by a Python max() and the run PASSED
    import dataclasses
    import math

    from launch.demo import _rank_entry, build_parser, check_results, spec_from_args

    spec = spec_from_args(build_parser().parse_args(["--world-size", "1", "--layers", "1", "--new-tokens", "3"]), 1)
    good = _rank_entry(0, spec)
    tol = 1e-4
    assert check_results(spec, [good], tol).passed

    def with_logits(change, rank=0):
        logits = good.logits.clone()
        change(logits)
        return dataclasses.replace(good, rank=rank, logits=logits)

    def nan_at_step_2(logits):
        logits[2, 0, 5] = math.nan

    check = check_results(spec, [with_logits(nan_at_step_2)], tol)
    assert not check.passed and math.isnan(check.max_abs_error)
    check = check_results(spec, [good, with_logits(nan_at_step_2, rank=1)], tol)   # same replica
    assert not check.passed and check.rank_disagreement == math.inf
    # a wrong logit 3x the tolerance (relative to the largest reference logit) fails; a 0.1x one passes
    scale = good.logits.abs().max().item()
    for factor, passed in ((3.0, False), (0.1, True)):
        def off(logits, factor=factor):
            logits[-1, 1, 7] += factor * tol * scale
        assert check_results(spec, [with_logits(off)], tol).passed is passed, factor


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
    # 0 was read as "unset": --world-size 0 ran the default 4 ranks, --tp 0 ran tp 1
    (["--world-size", "0"], "world_size must be a positive int, got 0"),
    (["--world-size", "4", "--tp", "0"], "tp must be a positive int, got 0"),
    (["--world-size", "2", "--pcp", "0"], "pcp must be a positive int, got 0"),
    (["--tolerance", "-1"], "--tolerance must be a finite number > 0, got -1"),
    (["--tolerance", "nan"], "--tolerance must be a finite number > 0, got nan"),
    # a negative count reached EplbConfig inside the ranks (a traceback, exit 1 = FAIL, at one rank);
    # -1 was the flag-alone marker and ran one slot per EP rank
    (["--world-size", "1", "--eplb", "-2"], "--eplb (-2) must be >= 0 extra expert slots"),
    (["--world-size", "1", "--eplb", "-1"], "--eplb (-1) must be >= 0 extra expert slots"),
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
