"""The decode-kernel tuning: `triton_decode.apply_tuning` (GQA keys to CONFIG, MLA's to the *_wide
entries, validation), MEGAPAR_DECODE_TUNING at import, the probe's CPU dry run under the
interpreter (its file installs, and the kernel with it still matches the torch path), and on the
GPU the decode call captured in a CUDA graph and replayed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from parallel.cp import triton_decode as td  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _restore_config():
    saved = dict(td.CONFIG)
    yield
    td.CONFIG.clear()
    td.CONFIG.update(saved)


def test_apply_tuning_maps_mla_keys_to_wide_entries():
    before = dict(td.CONFIG)
    td.apply_tuning({"gqa": {"block_n": 32, "num_stages": 3, "min_split": 128},
                     "mla": {"block_n": 16, "block_m": 128, "num_warps": 4, "num_stages": 1},
                     "device": "x", "results": [], "notes": []})
    assert td.CONFIG == {**before, "block_n": 32, "num_stages": 3, "min_split": 128, "block_n_wide": 16,
                         "block_m_wide": 128, "num_warps_wide": 4, "num_stages_wide": 1,
                         "min_split_fp8": 128}       # (gqa's min_split also serves gqa_fp8 unless it has its own)
    td.apply_tuning({"config": {"num_warps_wide": 16, "target_programs": 528}})
    assert td.CONFIG["num_warps_wide"] == 16 and td.CONFIG["target_programs"] == 528
    assert td.CONFIG["block_m"] == before["block_m"] and td.CONFIG["num_warps"] == before["num_warps"]
    td.apply_tuning({"gqa_fp8": {"f16": 0, "maxnreg": 160}})
    assert (td.CONFIG["f16_fp8"], td.CONFIG["maxnreg_fp8"]) == (0, 160)
    fp8 = td.launch_settings(128, torch.bfloat16, torch.float8_e4m3fn, 8)
    bf16 = td.launch_settings(128, torch.bfloat16, torch.bfloat16, 8)
    mla = td.launch_settings(576, torch.bfloat16, torch.float8_e4m3fn, 128)
    assert (fp8["f16"], fp8["maxnreg"]) == (0, 160) and (bf16["f16"], bf16["maxnreg"]) == (0, 0)
    assert (mla["f16"], mla["maxnreg"]) == (td.CONFIG["f16_wide_fp8"], 0)   # (its own f16; no register cap)
    td.apply_tuning({"gqa_fp8": {"stage16": 2}, "mla_narrow": {"stage16": 1}})
    assert (td.CONFIG["stage16_fp8"], td.CONFIG["stage16_wide_narrow"]) == (2, 1)
    assert td.launch_settings(128, torch.bfloat16, torch.float8_e4m3fn, 8)["stage16"] == 2
    assert td.launch_settings(128, torch.bfloat16, torch.bfloat16, 8)["stage16"] == 0      # (bf16 GQA has none)
    assert td.launch_settings(576, torch.bfloat16, torch.float8_e4m3fn, 16)["stage16"] == 1
    assert td.launch_settings(576, torch.bfloat16, torch.float8_e4m3fn, 128)["stage16"] == 0  # (halves: MLA fp8)


@pytest.mark.parametrize("tuning,match", [
    ({"gpa": {}}, r"unknown decode tuning entries \['gpa'\]; valid: gqa, gqa_fp8, mla, mla_fp8, mla_narrow, config"),
    ({"gqa": {"block_k": 64}}, r"unknown decode tuning key gqa.block_k; valid: target_programs, min_split, block_n"),
    ({"mla": {"block_n": 48}}, r"mla.block_n = 48 is invalid; valid: 16, 32, 64, 128, 256"),
    ({"gqa": {"num_warps": 3}}, r"gqa.num_warps = 3 is invalid; valid: 1, 2, 4, 8, 16"),
    ({"gqa": {"num_stages": True}}, r"gqa.num_stages = True is invalid"),
    ({"gqa": {"min_split": 0}}, r"gqa.min_split = 0 is invalid; valid: an int in \[1, "),
    ({"gqa": {"target_programs": "264"}}, r"gqa.target_programs = '264' is invalid"),
    ({"gqa": [64]}, r"decode tuning 'gqa' must be a dict"),
    ({"mla": {"target_programs": 0}}, r"mla.target_programs = 0 is invalid; valid: an int in \[1, "),
    ({"mla_fp8": {"min_split": 0}}, r"mla_fp8.min_split = 0 is invalid; valid: an int in \[1, "),
    ({"gqa_fp8": {"min_split": 512.0}}, r"gqa_fp8.min_split = 512.0 is invalid"),
    ({"config": {"min_split_wide": -1}}, r"decode CONFIG min_split_wide = -1 is invalid"),
    ({"gqa_fp8": {"lazy_rescale": 1}}, r"unknown decode tuning key gqa_fp8.lazy_rescale; valid: block_n, num_stages"),
    ({"config": {"num_stages_fp8": 9}}, r"decode CONFIG num_stages_fp8 = 9 is invalid"),
    ({"config": {"block_q": 16}}, r"unknown decode CONFIG key 'block_q'; valid: target_programs"),
    ({"config": {"block_m_wide": 24}}, r"decode CONFIG block_m_wide = 24 is invalid"),
    ({"gqa": {"f16": 1}}, r"decode tuning gqa.f16: an fp8-cache option; give it under 'gqa_fp8'"),
    ({"mla": {"maxnreg": 168}}, r"decode tuning mla.maxnreg: an fp8-cache option"),
    ({"gqa_fp8": {"maxnreg": 100}}, r"gqa_fp8.maxnreg = 100 is invalid; valid: 0, 64, 72"),
    ({"gqa_fp8": {"f16": 2}}, r"gqa_fp8.f16 = 2 is invalid; valid: 0, 1"),
    ({"gqa_fp8": {"stage16": 3}}, r"gqa_fp8.stage16 = 3 is invalid; valid: 0, 1, 2"),
    ({"mla": {"block_n_fp8": 32}}, r"decode tuning mla.block_n_fp8: the key tile of MLA's narrow tiles over fp8; "
                                   r"give it under 'mla_narrow'"),
    ({"gqa": {"block_n_fp8": 32}}, r"decode tuning gqa.block_n_fp8: .* give it under 'mla_narrow'"),
    ({"gqa": {"stage16": 1}}, r"decode tuning gqa.stage16: an fp8-cache option; give it under 'gqa_fp8' \(or 'mla_narrow'\)"),
    ({"mla_fp8": {"stage16": 1}}, r"unknown decode tuning key mla_fp8.stage16"),
    # a valid setting name with no entry for the family (the Gluon GQA kernel's ring takes "config")
    ({"gqa": {"stages": 3}}, r"decode tuning gqa.stages: no such setting for gqa \(CONFIG has no 'stages'\); "
                             r"set CONFIG entries directly under 'config'"),
    ({"gqa": {"at_most": 1}}, r"decode tuning gqa.at_most: no such setting for gqa"),
    ({"mla": {"swap": 1}}, r"decode tuning mla.swap: no such setting for mla"),
])
def test_apply_tuning_rejects_bad_entries_and_installs_nothing(tuning, match):
    before = dict(td.CONFIG)
    bad = {"gqa": {"block_n": 16}, **tuning} if "gqa" not in tuning else tuning
    with pytest.raises(ValueError, match=match):
        td.apply_tuning(bad)
    assert td.CONFIG == before


FAMILY_KEYS = {"gqa": "min_split", "gqa_fp8": "min_split_fp8", "mla": "min_split_wide", "mla_fp8": "min_split_wide_fp8"}


def _settings(kind: str) -> dict[str, int]:
    """launch_settings of a family's problem (GQA D = 128, MLA 576; bf16 queries, 128 rows per kv head)."""
    cache = torch.float8_e4m3fn if kind.endswith("fp8") else torch.bfloat16
    return td.launch_settings(576 if kind.startswith("mla") else 128, torch.bfloat16, cache, 128)


def test_min_split_is_per_family_and_old_shared_files_keep_their_meaning():
    assert {k: td.CONFIG[v] for k, v in FAMILY_KEYS.items()} == {"gqa": 512, "gqa_fp8": 512, "mla": 1024,
                                                                 "mla_fp8": 1024}
    # the same local length, grid and tile: GQA (512) cuts it finer than MLA (1024)
    # (1/8 of 8K = 1024 tokens over B x Hkv = 128 programs: 2 splits against 1; 1/4 of 8K: 3 against 2)
    for capacity, want in ((1024, (2, 1)), (2048, (3, 2))):
        got = tuple(td.plan_splits(capacity, 128, 64, _settings(k)["min_split"])[0] for k in ("gqa", "mla"))
        assert got == want, (capacity, got)
        assert td.plan_splits(capacity, 128, 128, _settings("gqa_fp8")["min_split"])[0] == want[0]
    td.apply_tuning({"gqa": {"min_split": 128}, "gqa_fp8": {"min_split": 256}, "mla": {"min_split": 2048},
                     "mla_fp8": {"min_split": 4096}})
    assert {k: td.CONFIG[v] for k, v in FAMILY_KEYS.items()} == {"gqa": 128, "gqa_fp8": 256, "mla": 2048,
                                                                 "mla_fp8": 4096}
    assert {k: _settings(k)["min_split"] for k in FAMILY_KEYS} == {"gqa": 128, "gqa_fp8": 256, "mla": 2048,
                                                                   "mla_fp8": 4096}
    for q_dtype in (torch.bfloat16, torch.float32):
        # fp32 queries with a full head tile: MLA's; 16 heads (narrow tiles): their own key, any dtype
        assert td.launch_settings(576, q_dtype, torch.bfloat16, 128)["min_split"] == 2048
        for cache in (torch.bfloat16, torch.float8_e4m3fn):
            assert td.launch_settings(576, q_dtype, cache, 16)["min_split"] == td.CONFIG["min_split_wide_narrow"]
    # 16 heads at 1/4 of 8K (2048 local tokens, B = 32 programs per split): 8 splits, not MLA's 2;
    # at 1/4 of 32K 8 (256 programs, within target_programs 264), where rounding up would give 9
    narrow = td.launch_settings(576, torch.bfloat16, torch.bfloat16, 16)
    assert narrow["at_most"] == 1 and _settings("gqa")["at_most"] == 0
    assert _settings("mla")["at_most"] == td.CONFIG["at_most_wide"]
    assert td.plan_splits(2048, 32, 64, narrow["min_split"], bool(narrow["at_most"])) == (8, 256)
    assert td.plan_splits(8192, 32, 64, narrow["min_split"], True)[0] == 8
    assert td.plan_splits(8192, 32, 64, narrow["min_split"], False)[0] == 9
    # a file from before (one shared value under gqa and mla): every family takes it, as it did then
    td.apply_tuning({"gqa": {"min_split": 1024, "block_n": 64}, "mla": {"min_split": 1024}})
    assert {k: _settings(k)["min_split"] for k in FAMILY_KEYS} == dict.fromkeys(FAMILY_KEYS, 1024)


def test_the_kernel_launch_splits_by_its_family_min_split(monkeypatch):
    """paged_decode_triton plans with the family's min_split: the same 48-token table gives GQA
    (min_split 16) 3 splits and MLA-like wide keys (288 > 256, v = k's prefix; 2 query heads, so
    min_split_wide_narrow 32, not min_split_wide 64) 2; both match the torch path (interpreter, tiny)."""
    from parallel.cp import PagedKVCache
    from parallel.cp.paged import paged_decode_attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(td.CONFIG, "min_split", 16)
    monkeypatch.setitem(td.CONFIG, "min_split_wide", 64)
    monkeypatch.setitem(td.CONFIG, "min_split_wide_narrow", 32)   # 2 query heads: a narrow head tile
    for key in ("block_n", "block_n_wide_f32", "block_m_wide_f32"):
        monkeypatch.setitem(td.CONFIG, key, 16)
    planned = []
    plan = td.plan_splits
    monkeypatch.setattr(td, "plan_splits", lambda *a: planned.append((a[3], plan(*a)[0])) or plan(*a))
    g = torch.Generator().manual_seed(0)
    table, seq = torch.tensor([[2, 0, 1]], dtype=torch.int32), torch.tensor([40])
    for d, dv in ((16, 16), (288, 256)):
        kv = torch.randn(3, 16, 1, d, generator=g)
        cache = PagedKVCache(kv, kv[..., :dv]) if dv < d else PagedKVCache(kv, torch.randn(3, 16, 1, dv, generator=g))
        q = torch.randn(1, 2, d, generator=g)
        got = paged_decode_attention(q, cache, table, seq, backend="triton")
        ref = paged_decode_attention(q, cache, table, seq, backend="torch")
        torch.testing.assert_close(got.out, ref.out, atol=1e-4, rtol=0)
        torch.testing.assert_close(got.lse, ref.lse, atol=1e-4, rtol=0)
    assert planned == [(16, 3), (32, 2)]


def test_env_tuning_is_read_at_import(tmp_path):
    path, bad_path = tmp_path / "decode-tuning.json", tmp_path / "bad.json"
    path.write_text(json.dumps({"gqa": {"block_n": 128}, "mla": {"block_m": 64, "num_warps": 4}}))
    bad_path.write_text(json.dumps({"mla": {"num_warps": 5}}))
    # one interpreter (a start costs seconds): the first import installs the file; a second import
    # of the module (reload) with a bad file fails
    code = ("import importlib, json, os, sys; from parallel.cp import triton_decode as t; print(json.dumps(t.CONFIG)); "
            "os.environ['MEGAPAR_DECODE_TUNING'] = sys.argv[1]; importlib.reload(t)")
    env = {**os.environ, "MEGAPAR_DECODE_TUNING": str(path)}
    out = subprocess.run([sys.executable, "-c", code, str(bad_path)], cwd=REPO, env=env, capture_output=True, text=True)
    config = json.loads(out.stdout.strip().splitlines()[-1])
    assert config == {**td.CONFIG, "block_n": 128, "block_m_wide": 64, "num_warps_wide": 4}
    assert out.returncode != 0 and "mla.num_warps = 5 is invalid" in out.stderr, out.stderr[-2000:]


def test_probe_dry_run_writes_a_tuning_that_installs(tmp_path, monkeypatch):
    """`python -m megapar.launch.bench.cp --probe` on CPU under the interpreter: every tiny setting
    matches the torch path, the chosen one is the fastest of its family,
    and the file installs (MLA -> *_wide) with the kernel still matching the torch path."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from launch.bench.cp import main
    from launch.bench.decode_probe import KEYS, TINY_VARIANTS

    before = dict(td.CONFIG)
    assert main(["--probe", "--out", str(tmp_path)]) == 0
    assert td.CONFIG == before                                   # the probe restores CONFIG
    tuning = json.loads((tmp_path / "decode-tuning.json").read_text())
    partial = json.loads((tmp_path / "decode-tuning.partial.json").read_text())   # kept after each family
    kinds = ("gqa", "mla", "mla_narrow")                      # (the dry run has no fp8 families)
    assert tuple(partial["done"]) == kinds and len(partial["results"]) > 0
    rows = tuning["results"]
    assert len(rows) >= sum(len(TINY_VARIANTS[k]) for k in kinds)
    assert all(r["valid"] and r["max_err"] < 1e-4 and r["us"] > 0 for r in rows), [r for r in rows if not r["valid"]]
    for kind in kinds:
        chosen = tuning[kind]
        assert set(chosen) == set(KEYS[kind])
        mine = [r for r in rows if r["kind"] == kind]
        assert any(r["settings"] == chosen for r in mine)
        assert min(mine, key=lambda r: r["us"])["settings"] == chosen
    assert any(r["splits"] > 1 for r in rows) and any(r["splits"] == 1 for r in rows)   # split + merge ran too

    td.apply_tuning(tuning)
    assert td.CONFIG["block_n"] == tuning["gqa"]["block_n"] and td.CONFIG["block_n_wide"] == tuning["mla"]["block_n"]
    assert td.CONFIG["block_m_wide"] == tuning["mla"]["block_m"]
    assert td.CONFIG["num_warps_wide"] == tuning["mla"]["num_warps"]
    assert td.CONFIG["maxnreg_wide_narrow"] == tuning["mla_narrow"]["maxnreg"]
    assert td.CONFIG["min_split_wide_narrow"] == tuning["mla_narrow"]["min_split"]
    # the tuned launch against an independent dense reference (wide key dim, v = k's prefix)
    from parallel.cp import PagedKVCache
    from parallel.cp.paged import paged_decode_attention

    g = torch.Generator().manual_seed(3)
    n, d, dv, heads = 70, 288, 256, 4
    k = torch.randn(n, 1, d, generator=g)
    cache = PagedKVCache.allocate(5, 16, 1, d, dtype=torch.float32)
    cache.k.view(-1, 1, d)[:n] = k
    cache = PagedKVCache(cache.k, cache.k[..., :dv], None, None)
    q = torch.randn(1, heads, d, generator=g)
    got = paged_decode_attention(q, cache, torch.arange(5, dtype=torch.int32)[None], torch.tensor([n]),
                                 scale=0.05, backend="triton")
    p = torch.softmax(q[0] @ k[:, 0].T * 0.05, -1)
    torch.testing.assert_close(got.out[0], p @ k[:, 0, :dv], atol=1e-4, rtol=0)


def test_probe_family_filter(tmp_path, monkeypatch):
    """MEGAPAR_DECODE_PROBE_FAMILIES probes only the families it names (and sets up only their
    problems); an unknown name is a ValueError naming it, before anything runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from launch.bench.decode_probe import TINY_VARIANTS, probe

    monkeypatch.setenv("MEGAPAR_DECODE_PROBE_FAMILIES", "mla_narrow")
    before = dict(td.CONFIG)
    tuning = probe(tmp_path)
    assert td.CONFIG == before
    assert {k for k in tuning if k in ("gqa", "gqa_fp8", "mla", "mla_fp8", "mla_narrow")} == {"mla_narrow"}
    assert {r["kind"] for r in tuning["results"]} == {"mla_narrow"}
    assert len(tuning["results"]) >= len(TINY_VARIANTS["mla_narrow"])
    assert all(r["valid"] for r in tuning["results"])
    monkeypatch.setenv("MEGAPAR_DECODE_PROBE_FAMILIES", "mla_narrow,gqa8")
    with pytest.raises(ValueError, match=r"unknown families \['gqa8'\]"):
        probe(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", ["gqa", "gqa tma", "mla", "mla halves tma lazy", "mla narrow"])
def test_decode_captures_in_a_cuda_graph(kind, cache_dtype, monkeypatch):
    """Decode is done only when it captures: the kernel (and its split merge) in a CUDA graph,
    replayed on new queries, equals the eager call on them. "mla halves tma lazy": the MLA
    structure options on (device-side TMA descriptors take their scratch inside the capture);
    "gqa tma": GQA's TMA tiles (64-key tiles inside the 64-token pages, fp8 too); "mla narrow":
    16 heads (TP 8), over fp8 with its fp16 operands and stage16 tiles as installed."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    heads = 16 if kind == "mla narrow" else 128
    if kind == "mla narrow":
        kind = "mla"
    elif kind == "gqa tma":
        for key, value in (("tma", 1), ("tma_fp8", 1), ("block_n_fp8", 64)):
            monkeypatch.setitem(td.CONFIG, key, value)
        kind = "gqa"
    elif kind != "gqa" and kind != "mla":
        for key in ("halves_wide", "tma_wide", "lazy_rescale_wide", "halves_wide_fp8", "tma_wide_fp8",
                    "lazy_rescale_wide_fp8"):
            monkeypatch.setitem(td.CONFIG, key, 1)
        kind = "mla"
    from launch.bench.common import capture_graph
    from launch.bench.cp import _decode_setup, _mla_decode_setup
    from parallel.cp import DCPLayout
    from parallel.cp.mla import MLADims
    from parallel.cp.paged import paged_decode_attention

    dev, batch, context, block, n = torch.device("cuda"), 8, 8192, 64, 4
    if kind == "gqa":
        cache, table, q, _ = _decode_setup(batch, context, 32, 4, 128, block, n, dev, cache_dtype)
        scale = 128 ** -0.5
    else:
        dims = MLADims()
        latent, table = _mla_decode_setup(batch, context, dims, block, n, dev, cache_dtype)
        cache, scale = latent.paged, dims.scale
        q = torch.randn(batch, heads, dims.latent_dim, device=dev, dtype=torch.bfloat16)
    layout = DCPLayout(size=n, rank=0, block_size=block)
    seq = torch.full((batch,), context, device=dev)
    call = lambda: paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="triton",  # noqa: E731
                                          max_seq_len=context)
    graph, static = capture_graph(call)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    eager = call()
    torch.testing.assert_close(static.out, eager.out, atol=0, rtol=0)
    torch.testing.assert_close(static.lse, eager.lse, atol=0, rtol=0)
    ref = paged_decode_attention(q[:2], cache, table[:2], seq[:2], layout=layout, scale=scale, backend="torch")
    torch.testing.assert_close(eager.out[:2], ref.out, atol=2e-2, rtol=0)


def test_mla_narrow_family_installs_on_its_own_keys():
    """A tuning file's mla_narrow entry reaches MLA launches with a head tile that is not full
    (16 heads), bf16 and fp8 caches, and leaves full tiles (128 heads) and GQA as they were;
    a key the family does not have is refused with nothing installed."""
    full_before = {cd: td.launch_settings(576, torch.bfloat16, cd, 128) for cd in (torch.bfloat16, torch.float8_e4m3fn)}
    gqa_before = td.launch_settings(128, torch.bfloat16, torch.bfloat16, 8)
    td.apply_tuning({"mla_narrow": {"maxnreg": 128, "f16": 1, "num_warps": 4, "at_most": 0, "min_split": 512}})
    for cd in (torch.bfloat16, torch.float8_e4m3fn):
        got = td.launch_settings(576, torch.bfloat16, cd, 16)
        assert (got["maxnreg"], got["f16"], got["num_warps"], got["at_most"], got["min_split"]) == (128, 1, 4, 0, 512)
        assert td.launch_settings(576, torch.bfloat16, cd, 128) == full_before[cd]
    assert td.launch_settings(128, torch.bfloat16, torch.bfloat16, 8) == gqa_before
    before = dict(td.CONFIG)
    with pytest.raises(ValueError, match=r"mla_narrow\.block_m"):
        td.apply_tuning({"mla_narrow": {"num_warps": 8, "block_m": 32}})
    assert td.CONFIG == before


def test_target_programs_is_per_family():
    """gqa's target_programs goes to CONFIG target_programs, gqa_fp8's (with its num_warps) to
    target_programs_fp8, mla's to target_programs_wide and
    mla_fp8's to target_programs_wide_fp8 (it was one shared value): each reaches its own launches
    and plan_splits takes it; narrow MLA tiles keep theirs."""
    td.apply_tuning({"gqa": {"target_programs": 200}, "mla": {"target_programs": 132},
                     "mla_fp8": {"target_programs": 528}, "gqa_fp8": {"target_programs": 396, "num_warps": 8}})
    assert (td.CONFIG["target_programs"], td.CONFIG["target_programs_wide"],
            td.CONFIG["target_programs_wide_fp8"], td.CONFIG["target_programs_fp8"]) == (200, 132, 528, 396)
    assert _settings("gqa")["target_programs"] == 200 and _settings("gqa")["num_warps"] == td.CONFIG["num_warps"]
    assert (_settings("gqa_fp8")["target_programs"], _settings("gqa_fp8")["num_warps"]) == (396, 8)
    assert _settings("mla")["target_programs"] == 132 and _settings("mla_fp8")["target_programs"] == 528
    narrow = td.launch_settings(576, torch.bfloat16, torch.bfloat16, 16)
    assert narrow["target_programs"] == td.CONFIG["target_programs_wide_narrow"]
    # 8192 tokens over 64 programs a split (32 sequences x 2 head tiles), min_split 1024, rounded down
    assert td.plan_splits(8192, 64, 64, 1024, True, 132)[0] == 2
    assert td.plan_splits(8192, 64, 64, 1024, True, 264)[0] == 4
    assert td.plan_splits(8192, 64, 64, 1024, False, 264)[0] == 5
