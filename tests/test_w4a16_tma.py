"""The W4A16 kernel's opt-in TMA weight loads (`W4A16Config(tma=True)`, oct packing).

Under the interpreter (CPU, tests/conftest.py sets TRITON_INTERPRET=1): Triton 3.6's interpreter
runs device-side tensor descriptors (bounds -> zero padding included), so tma=True must give the
same bits as the pointer loads and match the torch reference, in every weight layout (rows in
order: 2-D boxes; row tiles larger / smaller than the program's rows: 3-D boxes), both layouts
of x, empty experts, partial row and token tiles, both FP4 formats, SwiGLU (+ fp8 output).
Without a GPU: an sm_90 compile shows the TMA variant really issues UTMALDG and does not spill.
On the GPU (`pytest -m gpu`): the same bit equality on the V3 decode shape.
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


def _weight(fmt: str, E: int, N: int, K: int, seed: int, tile_n: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-3, 3, (E, N, 1), generator=g).float())
    q = quantize(w.to(device), fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {}))
    return prepare_weights(q, packing="oct", tile_n=tile_n)


def _both(x, pw, rows, cfg, **kw):
    """(pointer loads, TMA) outputs of the same launch."""
    from moe.kernels.triton_w4a16 import launch_w4a16
    return [launch_w4a16(x, pw, rows, config=dataclasses.replace(cfg, tma=t), **kw) for t in (False, True)]


# ---- interpreter: TMA == pointer loads == reference ---------------------------------------------

@interp
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("N,tile_n,block_n", [
    (41, 0, 32),     # odd N, rows in order: 2-D boxes, the last one 23 rows past N (zeros)
    (40, 8, 32),     # 8-row tiles under 32-row programs: [4, 8, BLOCK] boxes, the last one partly past N
    (64, 64, 16),    # one 64-row tile holds four programs' rows: [1, 16, BLOCK] boxes
], ids=["untiled-oddN", "tile8-bn32", "tile64-bn16"])
def test_interp_tma_matches_pointer_loads_and_reference(fmt, N, tile_n, block_n):
    E, K = 3, 512
    pw = _weight(fmt, E, N, K, seed=N + tile_n, tile_n=tile_n)
    assert pw.tile_n == tile_n
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([5, 0, 19])   # an empty expert; 19 rows = a full and a partial 16-token tile
    x = torch.randn(int(counts.sum()), K, generator=g)
    rows = expert_rows(x, E, counts, None, "contiguous")
    ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    ptr, tma = _both(x, pw, rows, _cfg(block_n=block_n), out_dtype=torch.float32)
    assert torch.equal(tma, ptr)
    assert _rel(tma, ref) < 1e-5
    # slab [E, C, K]: rows past each count stay zero
    xs = torch.randn(E, 20, K, generator=g)
    slab_counts = torch.tensor([5, 0, 20])
    rows_s = expert_rows(xs, E, slab_counts, None, "slab")
    ref_s = grouped_gemm(xs, pw, counts=slab_counts, layout="slab", backend="torch", out_dtype=torch.float32)
    ptr_s, tma_s = _both(xs, pw, rows_s, _cfg(block_n=block_n, block_m=32), out_dtype=torch.float32)
    assert torch.equal(tma_s, ptr_s)
    assert _rel(tma_s, ref_s) < 1e-5
    assert (tma_s[0, 5:] == 0).all() and (tma_s[1] == 0).all()
    # fp16 activations and operands (the fast mode), and MXFP4's prescaled operands
    xh = x.half()
    ref_h = grouped_gemm(xh.float(), pw, counts=counts, backend="torch", out_dtype=torch.float32)
    ptr_h, tma_h = _both(xh, pw, rows, _cfg(block_n=block_n, mode="f16", prescale=fmt == "mxfp4"),
                         out_dtype=torch.float32)
    assert torch.equal(tma_h, ptr_h)
    assert _rel(tma_h, ref_h) < 2e-3


@interp
@pytest.mark.parametrize("tile_n", [0, 16])
def test_interp_tma_swiglu_reads_the_up_half_through_its_own_descriptor(tile_n):
    """W13 rows [gate I | up I], I = 48 (not a multiple of the 32-row program: the gate tile's
    last rows would be up rows without the descriptor's own bound)."""
    E, I, K = 2, 48, 256
    pw = _weight("mxfp4", E, 2 * I, K, seed=31, tile_n=tile_n)
    counts = torch.tensor([7, 18])
    x = torch.randn(25, K, generator=torch.Generator().manual_seed(32))
    rows = expert_rows(x, E, counts, None, "contiguous")
    h = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
    gate, up = h[:, :I], h[:, I:]
    want = gate * torch.sigmoid(gate) * up
    ptr, tma = _both(x, pw, rows, _cfg(), out_dtype=torch.float32, swiglu=(None, 1.0, 0.0))
    assert torch.equal(tma, ptr)
    assert _rel(tma, want) < 1e-5


@interp
def test_interp_tma_swiglu_with_fp8_group_output_is_bit_identical():
    from moe.kernels.triton_w4a16 import launch_w4a16

    E, I, K = 2, 128, 256
    pw = _weight("nvfp4", E, 2 * I, K, seed=41, tile_n=64)
    counts = torch.tensor([3, 0])
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(42))
    rows = expert_rows(x, E, counts, None, "contiguous")
    outs = [launch_w4a16(x, pw, rows, out_dtype=torch.float32, swiglu=(7.0, 1.702, 1.0), quant_out=True,
                         config=_cfg(tma=t)) for t in (False, True)]
    (q0, s0), (q1, s1) = outs
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
    assert (q1.view(torch.uint8) != 0).any()       # a real output, not two empty ones


# ---- config and layout checks ----------------------------------------------------------------------

def test_tma_config_is_validated_and_off_by_default():
    from moe.kernels.triton_w4a16 import W4A16Config, pick_config

    assert W4A16Config().tma is False
    for rows in (1, 8, 32, 64, 512):
        for fmt in ("mxfp4", "nvfp4"):
            # under the interpreter (no inline PTX) the measured TMA settings never apply
            assert pick_config(rows, torch.bfloat16, "oct", fmt=fmt).tma is False
    with pytest.raises(ValueError, match="packing 'oct'.*paired"):
        W4A16Config(tma=True)                            # the default packing is paired
    with pytest.raises(ValueError, match="True or False"):
        W4A16Config(packing="oct", tma=1)


def test_pick_config_takes_tma_where_measured_best(monkeypatch):
    """On the GPU (inline-PTX expansion) the defaults are the probes' winners. bf16 activations
    over MXFP4 (decode7): mode bf16asm, prescaled, TMA with 128 rows and 3 stages from 0.5 to 32
    rows per expert, pointer loads with 4 stages when most experts are empty (< 0.5 rows per
    expert), the fused SwiGLU with 64 rows and pointer loads. fp16 activations (decode4): f16asm
    with the same TMA rule, prescaled outside 2-16 rows. NVFP4, paired packing, > 32 rows: no TMA."""
    from moe.kernels import triton_w4a16 as t

    monkeypatch.setattr(t, "USE_ASM", True)
    monkeypatch.setattr(t.impl, "interpreting", lambda: False)
    for rows, prescale, block_m in ((0.5, True, 16), (1, True, 16), (2, True, 16), (8, False, 16),
                                    (16, False, 16), (32, True, 32)):
        cfg = t.pick_config(rows, torch.bfloat16, "oct")
        assert (cfg.tma, cfg.block_n, cfg.num_stages, cfg.prescale, cfg.block_m, cfg.mode) == (
            True, 128, 3, True, block_m, "bf16asm")
        cfg = t.pick_config(rows, torch.float16, "oct")
        assert (cfg.tma, cfg.block_n, cfg.num_stages, cfg.prescale, cfg.block_m, cfg.mode) == (
            True, 128, 3, prescale, block_m, "f16asm")
    few = t.pick_config(0.25, torch.bfloat16, "oct")
    assert (few.tma, few.num_stages, few.prescale, few.mode) == (False, 4, True, "bf16asm")
    sw = t.pick_config(1, torch.bfloat16, "oct", swiglu=True)
    assert (sw.tma, sw.block_n, sw.num_stages, sw.prescale, sw.mode) == (False, 64, 4, True, "bf16asm")
    nv = t.pick_config(1, torch.bfloat16, "oct", fmt="nvfp4")
    assert (nv.tma, nv.mode) == (False, "f16asm")
    assert t.pick_config(1, torch.bfloat16, "paired").tma is False
    assert t.pick_config(64, torch.bfloat16, "oct").tma is False
    assert t.pick_config(64, torch.bfloat16, "oct").mode == "f16asm"


def test_tuning_carries_tma():
    from moe.kernels import triton_w4a16 as t

    before = dict(t.TUNED)
    try:
        fields = dict(block_n=128, block_m=16, chunks=1, num_warps=4, num_stages=6, mode="f16", packing="oct",
                      tma=True)
        t.apply_tuning(json.loads(json.dumps({"w4a16": {"16": fields}})))   # as read from gemm-tuning.json
        assert t.TUNED[16] == t.W4A16Config(**fields)
        assert t.pick_config(1, torch.bfloat16, "oct").tma is True
        assert t.pick_config(1, torch.bfloat16, "paired").tma is False     # a tuned oct config never applies there
    finally:
        t.TUNED.clear()
        t.TUNED.update(before)


@interp
def test_interp_tma_refuses_layouts_it_cannot_describe():
    from moe.kernels.triton_w4a16 import launch_w4a16

    x = torch.randn(4, 256)
    rows = expert_rows(x, 2, torch.tensor([4, 0]), None, "contiguous")
    pw = _weight("mxfp4", 2, 96, 256, seed=51, tile_n=48)          # 48-row tiles vs 32-row programs
    with pytest.raises(ValueError, match=r"block_n \(32\).*tile_n \(48\)"):
        launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=_cfg(tma=True))
    pw = _weight("mxfp4", 2, 32, 256, seed=52, tile_n=0)
    n = pw.data.numel()
    buf = torch.empty(n + 32, dtype=torch.uint8)
    start = (4 - buf.data_ptr()) % 16                              # the same bytes, 4 bytes past a 16-byte boundary
    raw = buf[start:start + n]
    raw.copy_(pw.data.reshape(-1))
    odd = dataclasses.replace(pw, data=raw.view(pw.data.shape))
    assert odd.data.data_ptr() % 16 != 0
    with pytest.raises(ValueError, match="16-byte aligned.*data pointer"):
        launch_w4a16(x, odd, rows, out_dtype=torch.float32, config=_cfg(tma=True))
    assert torch.equal(launch_w4a16(x, odd, rows, out_dtype=torch.float32, config=_cfg()),
                       launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=_cfg()))   # pointer loads: fine
    x64 = torch.randn(4, 64)                                        # K = 64: no oct unit (8 x 32)
    w64 = _weight("mxfp4", 2, 32, 64, seed=53, tile_n=0)
    with pytest.raises(ValueError, match="tma=True needs oct packing"):
        launch_w4a16(x64, w64, expert_rows(x64, 2, torch.tensor([4, 0]), None, "contiguous"),
                     out_dtype=torch.float32, config=_cfg(tma=True))


# ---- sm_90 code without a GPU -------------------------------------------------------------------

_SASS = """
import inspect, json, re, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megapar.moe.kernels.triton_w4a16 import _w4a16_kernel as kernel
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
names = list(inspect.signature(kernel.fn).parameters)
ptrs = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*i64", gs_ptr="*fp32", rmax_ptr="*u8", out_ptr="*bf16",
            out_scale_ptr="*bf16", counts_ptr="*i32", offsets_ptr="*i32", limit="fp32", alpha="fp32", beta="fp32")
report = {}
for label, cons, num_warps, num_stages in json.loads(sys.argv[1]):
    sig = {n: "constexpr" if n in cons else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr"}
    c = triton.compile(ASTSource(kernel, sig, {(names.index(k),): v for k, v in cons.items()}, attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(c.asm["ptx"])
        Path(tmp, "k.cubin").write_bytes(c.asm["cubin"])
        info = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", Path(tmp, "k.ptx"), "-o", Path(tmp, "k.o")],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([BIN / "cuobjdump", "-sass", Path(tmp, "k.cubin")], capture_output=True, text=True).stdout
    ops = re.findall(r"/\\*[0-9a-f]{4}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z0-9_.]+)", sass)
    report[label] = dict(spill=int(re.search(r"(\\d+) bytes spill stores", info).group(1)),
                         utmaldg=sum(o.startswith("UTMALDG") for o in ops),
                         hgmma=sum(o.startswith("HGMMA") for o in ops),
                         scratch=c.metadata.global_scratch_size)
print(json.dumps(report))
"""


def test_tma_variant_compiles_for_sm90_with_tma_loads_and_no_spills():
    """V3 L1 decode launches (K 7168, MXFP4, inline-PTX expansion, prescaled operands, 16 tokens):
    64-row weight tiles under 128-row programs (3-D boxes), rows in order (2-D), SwiGLU (two
    descriptors), NVFP4; the pointer-load build beside them issues no UTMALDG."""
    base = dict(K=7168, E_POW2=32, SLAB=False, HAS_OFFSETS=False, BLOCK_N=128, BLOCK_M=16, CHUNKS=1, BLOCK=32,
                NVFP4=False, MODE=3, SWIGLU=False, HAS_LIMIT=False, QUANT_OUT=False, PACK=1, TILE=64, DIAG=0,
                PRESCALE=True, stride_re=4096, TMA=True)
    cases = [("pointer", {**base, "TMA": False}, 4, 4), ("tma tile64 bn128", base, 4, 4),
             ("tma untiled bn128 s6", {**base, "TILE": 1 << 30}, 4, 6),
             ("tma tile64 bn64 w8 swiglu", {**base, "BLOCK_N": 64, "SWIGLU": True, "PRESCALE": False}, 8, 3),
             ("tma nvfp4", {**base, "BLOCK": 16, "NVFP4": True, "PRESCALE": False}, 4, 4)]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _SASS, json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["pointer"]["utmaldg"] == 0 and report["pointer"]["scratch"] == 0
    for label, r in report.items():
        assert r["spill"] == 0, (label, r)
        assert r["hgmma"] > 0, (label, r)
        if label != "pointer":
            assert r["utmaldg"] > 0, (label, r)
            assert r["scratch"] == 128 * (2 if "swiglu" in label else 1), (label, r)   # one descriptor per half


# ---- the probe's decode4 section, dry run ----------------------------------------------------------

@interp
def test_interp_probe_decode4_dry_run(tmp_path, capsys):
    from launch.bench.gemm import probe, tma_verdict

    probe(str(tmp_path), ["decode4"])
    rows = json.loads((tmp_path / "gemm-probe.json").read_text())["results"]
    assert rows and all(r["section"] == "decode4" for r in rows)
    assert not [r for r in rows if "error" in r]
    assert {r["cfg"]["tma"] for r in rows} == {False, True}
    assert {r["tile_n"] for r in rows} == {0, 64}                    # tiled (3-D boxes) and untiled (2-D)
    assert any("swiglu" in r["name"] for r in rows)
    checked = [r for r in rows if "rel_err" in r]
    assert checked and all(r["rel_err"] < 1e-2 for r in checked)
    assert all("floor_frac" in r for r in rows)
    verdicts = tma_verdict(rows)                                     # one line per problem, the swiglu one too
    assert len(verdicts) == 3 and all(v.endswith(("tma wins", "pointer loads win")) for v in verdicts)
    assert "\n".join(verdicts) in capsys.readouterr().out


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tok", [1, 8, 32])
def test_gpu_tma_is_bit_identical_on_the_v3_decode_shape(fmt, tok):
    """V3 L1 (N 4096, K 7168) with 4 experts: today's default config with tma=True, at 64 and
    128 rows, 64-row tiles and rows in order, against the pointer loads bit for bit."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 4, 4096, 7168
    x = torch.randn(E * tok, K, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((E,), tok, device="cuda", dtype=torch.int32)
    counts[1] = 0
    x = x[: int(counts.sum())].contiguous()
    rows = expert_rows(x, E, counts, None, "contiguous")
    for tile_n in (64, 0):
        pw = _weight(fmt, E, N, K, seed=tok, tile_n=tile_n, device="cuda")
        ref = grouped_gemm(x, pw, counts=counts, backend="torch", out_dtype=torch.float32)
        base = pick_config(tok, torch.bfloat16, "oct", fmt=fmt)
        for cfg in (base, dataclasses.replace(base, block_n=64, num_stages=6),
                    dataclasses.replace(base, block_n=128, num_warps=8, num_stages=3)):
            ptr = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=cfg)
            tma = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, config=dataclasses.replace(cfg, tma=True))
            torch.cuda.synchronize()
            assert torch.equal(tma, ptr), (tile_n, cfg)
            assert _rel(tma, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_tma_swiglu_and_cuda_graph_replay():
    """The fused L1 + SwiGLU (two descriptors per program) bit for bit, and a CUDA-graph replay of
    the TMA launch (the scratch comes from the graph's pool) gives the eager result."""
    from moe.kernels.triton_w4a16 import launch_w4a16, pick_config

    E, N, K = 8, 4096, 7168
    pw = _weight("mxfp4", E, N, K, seed=3, tile_n=64, device="cuda")
    counts = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1], device="cuda", dtype=torch.int32)
    x = torch.randn(int(counts.sum()), K, device="cuda", dtype=torch.bfloat16)
    rows = expert_rows(x, E, counts, None, "contiguous")
    cfg = pick_config(1, torch.bfloat16, "oct", swiglu=True)
    ptr = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, swiglu=(None, 1.0, 0.0), config=cfg)
    tma_cfg = dataclasses.replace(cfg, tma=True)
    eager = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, swiglu=(None, 1.0, 0.0), config=tma_cfg)
    assert torch.equal(eager, ptr)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch_w4a16(x, pw, rows, out_dtype=torch.bfloat16, swiglu=(None, 1.0, 0.0), config=tma_cfg)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ptr)
