"""Split-K in the W4A16 kernel (`W4A16Config(split_k=S)`): K over S programs, fp32 partials, an
ordered sum plus the epilogue in a second kernel.

Under the interpreter (CPU, tests/conftest.py sets TRITON_INTERPRET=1): split_k 2 and 4 against
split_k=1 and the torch reference in the layouts the kernel takes (contiguous rows by counts or
offsets, slab, empty experts, partial token tiles, odd expert counts), both FP4 formats, both
packings, TMA and pointer loads, prescaled operands, uneven splits (S not dividing the K steps),
SwiGLU and its fp8 group output. Without a GPU: an sm_90 compile of the split variants (no
spills). On the GPU (`pytest -m gpu`): the V3 L1 decode shape with few experts hit, CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe.kernels import expert_rows, grouped_gemm, prepare_weights
from moe.quant import quantize
from tests.helpers import rel_error as _rel, w4a16_config as _cfg

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from the start (conftest sets it on CPU)")
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _weight(fmt: str, E: int, N: int, K: int, seed: int, packing: str = "oct", tile_n: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-3, 3, (E, N, 1), generator=g).float())
    q = quantize(w.to(device), fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {}))
    return prepare_weights(q, packing=packing, tile_n=tile_n)


def _launch(x, pw, rows, cfg, splits, **kw):
    """Outputs of the same launch at split_k=1 and each of `splits`."""
    from moe.kernels.triton_w4a16 import launch_w4a16
    return [launch_w4a16(x, pw, rows, config=dataclasses.replace(cfg, split_k=s), **kw) for s in (1, *splits)]


# ---- interpreter: split-K == one pass (to fp32 rounding) == reference ----------------------------

@interp
@pytest.mark.parametrize("fmt,packing,K,tma,splits", [
    ("mxfp4", "oct", 1024, False, (2, 4)),     # 4 oct steps: even splits
    ("nvfp4", "oct", 640, True, (2, 4)),       # 5 steps: uneven (3 + 2; 2 + 1 + 1 + 1), TMA boxes
    ("mxfp4", "paired", 320, False, (4,)),     # 5 paired steps over 4 parts
], ids=["mxfp4-oct-even", "nvfp4-oct-tma-uneven", "mxfp4-paired-uneven"])
def test_interp_splitk_matches_one_pass_and_reference(fmt, packing, K, tma, splits):
    E, N = 3, 20                                 # odd expert count; N not a multiple of the 32-row program
    pw = _weight(fmt, E, N, K, seed=K, packing=packing, tile_n=0)
    g = torch.Generator().manual_seed(K + 1)
    counts = torch.tensor([5, 0, 9])            # an empty expert; partial 16-token tiles
    x = torch.randn(int(counts.sum()), K, generator=g)
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    cfg = _cfg(packing=packing, tma=tma)
    rows = expert_rows(x, E, counts, None, "contiguous")
    one, *split = _launch(x, pw, rows, cfg, splits, out_dtype=torch.float32)
    assert _rel(one, ref) < 1e-5
    for s, y in zip(splits, split):
        assert _rel(y, one) < 1e-6, s            # the same products, summed in another order
        assert _rel(y, ref) < 1e-5, s
        assert not torch.equal(y, one), s        # (really split: the fp32 order differs)
    if fmt == "mxfp4" and packing == "oct":     # rows by offsets: the same tiles
        rows_o = expert_rows(x, E, None, torch.tensor([0, 5, 5, 14]), "contiguous")
        assert torch.equal(_launch(x, pw, rows_o, cfg, (splits[-1],), out_dtype=torch.float32)[1], split[-1])


@interp
def test_interp_splitk_slab_fp16_prescaled():
    """Slab [E, C, K] (rows past each count written as zeros; an expert over two 16-token tiles),
    fp16 operands with MXFP4 prescale."""
    E, N, K = 3, 20, 512
    pw = _weight("mxfp4", E, N, K, seed=7)
    g = torch.Generator().manual_seed(8)
    xs = torch.randn(E, 18, K, generator=g)
    counts = torch.tensor([5, 0, 18])
    rows = expert_rows(xs, E, counts, None, "slab")
    ref = grouped_gemm(xs, pw, counts=counts, layout="slab", backend="torch", out_dtype=torch.float32)
    one, split = _launch(xs, pw, rows, _cfg(mode="f16", prescale=True), (2,), out_dtype=torch.float32)
    assert _rel(one, ref) < 2e-3 and _rel(split, ref) < 2e-3
    assert _rel(split, one) < 1e-6
    assert (split[0, 5:] == 0).all() and (split[1] == 0).all()


@interp
def test_interp_splitk_swiglu_and_fp8_group_output():
    """W13 rows [gate I | up I], I = 128: the SwiGLU runs after the sum over parts (gate and up
    partials kept apart); the fp8 group output quantizes that sum, parallel.quant's bits."""
    from moe.kernels.triton_w4a16 import launch_w4a16

    E, I, K = 3, 128, 768                        # 3 oct steps over 2 parts: 2 + 1
    pw = _weight("nvfp4", E, 2 * I, K, seed=41)
    counts = torch.tensor([3, 0, 6])
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(42))
    rows = expert_rows(x, E, counts, None, "contiguous")
    h = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    gate, up = h[:, :I].clamp(max=7.0), h[:, I:].clamp(-7.0, 7.0)
    want = gate * torch.sigmoid(1.702 * gate) * (up + 1.0)
    act = (7.0, 1.702, 1.0)
    cfg = _cfg(block_n=128)
    one, split = _launch(x, pw, rows, cfg, (2,), out_dtype=torch.float32, swiglu=act)
    assert _rel(one, want) < 1e-5 and _rel(split, want) < 1e-5
    assert _rel(split, one) < 1e-6
    q, s = launch_w4a16(x, pw, rows, out_dtype=torch.float32, swiglu=act, quant_out=True,
                        config=dataclasses.replace(cfg, split_k=2))
    ref_q = quantize(split, "fp8_group", backend="torch")
    assert torch.equal(q.view(torch.uint8), ref_q.data.view(torch.uint8)) and torch.equal(s, ref_q.scale)
    assert (q.view(torch.uint8) != 0).any()


# ---- config checks ------------------------------------------------------------------------------

def test_split_k_is_validated_and_off_by_default():
    from moe.kernels.triton_w4a16 import W4A16Config, pick_config

    assert W4A16Config().split_k == 1
    for bad in (0, 3, 16, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match=r"split_k must be one of \(1, 2, 4, 8\), got " + repr(bad).replace(".", r"\.")):
            W4A16Config(split_k=bad)
    for rows in (0.25, 1, 8, 32, 64, 512):
        for kw in ({}, {"swiglu": True}, {"fmt": "nvfp4"}):
            assert pick_config(rows, torch.bfloat16, "oct", **kw).split_k == 1
    assert W4A16Config(**json.loads(json.dumps({"packing": "oct", "split_k": 4}))).split_k == 4   # a tuning file


def test_split_parts_lowers_to_the_k_steps():
    from moe.kernels.triton_w4a16 import split_parts

    assert [split_parts(8, n) for n in (28, 8, 7, 4, 3, 2, 1)] == [8, 8, 4, 4, 2, 2, 1]
    assert [split_parts(s, 28) for s in (1, 2, 4, 8)] == [1, 2, 4, 8]


@interp
def test_interp_splitk_beyond_the_k_steps_still_right():
    """K 512 in oct packing is 2 steps: split_k 8 runs as 2 parts."""
    E, N, K = 2, 32, 512
    pw = _weight("mxfp4", E, N, K, seed=61)
    counts = torch.tensor([0, 9])
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(62))
    rows = expert_rows(x, E, counts, None, "contiguous")
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    one, eight = _launch(x, pw, rows, _cfg(), (8,), out_dtype=torch.float32)
    assert _rel(eight, ref) < 1e-5 and _rel(eight, one) < 1e-6


# ---- sm_90 code without a GPU -------------------------------------------------------------------

_SASS = """
import importlib, json, runpy, sys
ks = runpy.run_path("bench/debug/kernel_sass.py")     # compiles for sm_90a on the CPU, prints one line a case
ks["report"].__globals__["_load"] = lambda path: importlib.import_module("megapar.moe.kernels.triton_w4a16")
ks["report"]({label: tuple(case) for label, case in json.loads(sys.argv[1]).items()}, "moe/kernels/triton_w4a16.py")
"""


def test_splitk_variants_compile_for_sm90_without_spills():
    """V3 L1 decode (K 7168 = 28 oct steps, MXFP4, inline-PTX expansion, prescaled, 16 tokens):
    split 4 with pointer loads (7 steps a part), split 8 with TMA (uneven: 4 or 3 steps), and the
    reduce kernel with SwiGLU + fp8 group output (bench/debug/kernel_sass.py's report)."""
    ptrs = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*i64", gs_ptr="*fp32", rmax_ptr="*u8", part_ptr="*fp32",
                out_ptr="*bf16", out_scale_ptr="*fp32", counts_ptr="*i32", offsets_ptr="*i32", limit="fp32",
                alpha="fp32", beta="fp32")
    base = dict(K=7168, E_POW2=32, SLAB=False, HAS_OFFSETS=False, BLOCK_N=128, BLOCK_M=16, CHUNKS=1, BLOCK=32,
                NVFP4=False, MODE=3, SWIGLU=False, PACK=1, TILE=64, DIAG=0, PRESCALE=True, stride_re=4096, TMA=False,
                num_warps=4, num_stages=4)
    red = dict(E_POW2=32, SLAB=False, HAS_OFFSETS=False, BLOCK_N=128, BLOCK_M=16, SPLIT_K=8, SWIGLU=True,
               HAS_LIMIT=True, QUANT_OUT=True, num_warps=4, num_stages=1)
    cases = {"split4 pointer s4": ("_w4a16_splitk_kernel", ptrs, {**base, "SPLIT_K": 4}),
             "split8 tma s3": ("_w4a16_splitk_kernel", ptrs, {**base, "TMA": True, "SPLIT_K": 8, "num_stages": 3}),
             "reduce swiglu fp8": ("_w4a16_splitk_reduce", ptrs, red)}
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _SASS, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {label: line for line in proc.stdout.splitlines() for label in cases if f"  {label}: " in line}
    assert set(lines) == set(cases), proc.stdout
    for label, line in lines.items():
        assert " 0 B spilled" in line, line
        assert ("HGMMA" in line) == label.startswith("split"), line


# ---- the probe's decode6 section, dry run ----------------------------------------------------------

@interp
def test_interp_probe_decode6_dry_run(tmp_path, capsys, monkeypatch):
    """The section's code on tiny problems (interpreter: one problem, split 2, one timed call per row)."""
    from launch.bench import gemm

    monkeypatch.setattr(gemm, "graph_time", lambda ctx, fn, iters=None: (fn(), (1.0, "stub"))[1])
    gemm.probe(str(tmp_path), ["decode6"])
    rows = json.loads((tmp_path / "gemm-probe.json").read_text())["results"]
    assert rows and all(r["section"] == "decode6" for r in rows)
    assert not [r for r in rows if "error" in r]
    assert {r["cfg"]["split_k"] for r in rows} == {1, 2}
    assert {r["cfg"]["tma"] for r in rows} == {False, True}
    assert any("swiglu" in r["name"] for r in rows)
    assert all(r["rel_err"] < 1e-2 for r in rows)                   # every row checked, the swiglu ones too
    out = capsys.readouterr().out
    assert out.count("decode6 ") >= 2 and ("split-K wins" in out or "default wins" in out)


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_splitk_on_v3_decode_with_few_experts_hit(fmt):
    """V3 L1 (N 4096, K 7168, 32 experts) with 1 token routed to 8 of them: the default config
    (as launch_w4a16 picks it) and with split 2 / 4 / 8, pointer and TMA loads, against the
    reference and the one-pass result; SwiGLU + fp8 output too."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 32, 4096, 7168
    pw = _weight(fmt, E, N, K, seed=5, tile_n=64, device="cuda")
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    counts[torch.randperm(E, generator=torch.Generator().manual_seed(6))[:8].cuda()] = 1
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    rows = expert_rows(x, E, counts, None, "contiguous")
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    base = pick_config(rows.rows_hint, torch.bfloat16, "oct", fmt=fmt)
    one = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=base)
    assert _rel(one, ref) < 1e-2
    for tma in (False, True):
        for s in (2, 4, 8):
            cfg = dataclasses.replace(base, split_k=s, tma=tma)
            y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
            torch.cuda.synchronize()
            assert _rel(y, one) < 1e-5, cfg
            assert _rel(y, ref) < 1e-2, cfg
            assert torch.equal(launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg), y)   # deterministic
    sw = pick_config(rows.rows_hint, torch.bfloat16, "oct", swiglu=True, fmt=fmt)
    act = (None, 1.0, 0.0)
    h1 = launch_w4a16(x, pw, rows, out_dtype=torch.float32, swiglu=act, config=sw)
    h4 = launch_w4a16(x, pw, rows, out_dtype=torch.float32, swiglu=act, config=dataclasses.replace(sw, split_k=4))
    assert _rel(h4, h1) < 1e-5
    q, s = launch_w4a16(x, pw, rows, out_dtype=torch.float32, swiglu=act, quant_out=True,
                        config=dataclasses.replace(sw, split_k=4))
    hq = quantize(launch_w4a16(x, pw, rows, out_dtype=torch.float32, swiglu=act,
                               config=dataclasses.replace(sw, split_k=4, block_n=128)), "fp8_group", backend="torch")
    assert torch.equal(q.view(torch.uint8), hq.data.view(torch.uint8)) and torch.equal(s, hq.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_splitk_cuda_graph_replay(tma):
    """Both kernels and the partial buffer captured in one CUDA graph: new inputs copied in, the
    replay gives the eager result bit for bit (the counts, and so the experts hit, change too)."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 32, 4096, 7168
    pw = _weight("mxfp4", E, N, K, seed=9, tile_n=64, device="cuda")
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    counts[:8] = 1
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    rows = expert_rows(x, E, counts, None, "contiguous")
    cfg = dataclasses.replace(pick_config(rows.rows_hint, torch.bfloat16, "oct"), split_k=8, tma=tma)
    launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=cfg)      # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=cfg)
    x.copy_(torch.randn_like(x))
    counts.zero_()
    counts[torch.arange(3, 32, 4, device="cuda")] = 1                   # 8 other experts
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=cfg))
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    assert _rel(out, ref) < 1e-2
