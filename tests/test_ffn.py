"""Fused expert FFN: the reference against an independent float64 loop (SwiGLU with clamp,
alpha, beta; split and interleaved W13), the fused kernels under the interpreter (CPU), and
every backend on the GPU (`-m gpu`)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moe.kernels import expert_ffn, expert_rows, prepare_weights
from moe.quant import quantize
from tests.helpers import weight_values

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _values(q) -> np.ndarray:
    return weight_values(q)


def loop_ffn(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, counts: list[int], *, limit, alpha, beta,
             interleaved: bool, round_h=None) -> np.ndarray:
    """Token by token, float64: gate/up rows picked by the W13 layout."""
    inter = w13.shape[1] // 2
    out = np.zeros((x.shape[0], w2.shape[1]))
    ends = np.cumsum(counts)
    for r in range(x.shape[0]):
        e = int(np.searchsorted(ends, r, side="right"))
        y = w13[e] @ x[r]
        g, u = (y[0::2], y[1::2]) if interleaved else (y[:inter], y[inter:])
        if limit is not None:
            g = np.minimum(g, limit)
            u = np.clip(u, -limit, limit)
        h = g / (1 + np.exp(-alpha * g)) * (u + beta)
        if round_h is not None:
            h = round_h(h)
        out[r] = w2[e] @ h
    return out


def _rel(a, b) -> float:
    a = torch.as_tensor(a).double().cpu()
    b = torch.as_tensor(b).double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm())


def _weights(fmt, E, H, inter, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter ** 0.5
    opts = {"global_scale": "matrix"} if fmt == "nvfp4" else {}
    q13, q2 = quantize(w13, fmt, **opts), quantize(w2, fmt, **opts)
    return q13, q2, _values(q13), _values(q2)


ACTS = [dict(limit=None, alpha=1.0, beta=0.0), dict(limit=7.0, alpha=1.702, beta=1.0), dict(limit=0.5, alpha=1.0, beta=0.0)]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("gate_up", ["split", "interleaved"])
def test_reference_ffn_matches_token_loop(fmt, gate_up):
    E, H, inter = 4, 64, 32
    counts = [3, 0, 6, 1]
    q13, q2, v13, v2 = _weights(fmt, E, H, inter, seed=1)
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(2)) * 3
    for act in ACTS:
        y = expert_ffn(x, q13, q2, counts=torch.tensor(counts), gate_up=gate_up, backend="torch",
                       swiglu_limit=act["limit"], alpha=act["alpha"], beta=act["beta"])
        ref = loop_ffn(x.double().numpy(), v13, v2, counts, interleaved=gate_up == "interleaved", **act)
        assert _rel(y, ref) < 1e-5, act


def test_prepared_interleaved_w13_equals_split_and_slab_rows_stay_zero():
    E, H, inter, C = 3, 64, 32, 5
    q13, q2, v13, v2 = _weights("mxfp4", E, H, inter, seed=3)
    p13 = prepare_weights(q13, gate_up="interleaved")
    counts = torch.tensor([2, 5, 0])
    x = torch.randn(E, C, H, generator=torch.Generator().manual_seed(4))
    x[0, 2:] = float("nan")
    y = expert_ffn(x, p13, q2, counts=counts, layout="slab", swiglu_limit=2.0)
    assert (y[0, 2:] == 0).all() and (y[2] == 0).all() and torch.isfinite(y).all()
    ref = loop_ffn(x[1].double().numpy(), v13[1:2], v2[1:2], [5], limit=2.0, alpha=1.0, beta=0.0, interleaved=True)
    assert _rel(y[1], ref) < 1e-5
    with pytest.raises(ValueError, match="gate_up"):
        expert_ffn(x, q13, q2, counts=counts, layout="slab", gate_up="fused")
    with pytest.raises(ValueError, match="disagree"):
        expert_ffn(x, q13, q13, counts=counts, layout="slab")
    with pytest.raises(ValueError, match="interleaved"):
        expert_ffn(x, prepare_weights(q13), q2, counts=counts, layout="slab", gate_up="interleaved")


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest on CPU)")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_interp_fused_swiglu_epilogue_and_fp8_group_output(fmt):
    from moe.kernels.triton_w4a16 import W4A16Config, launch_w4a16
    from moe.kernels.triton_w4a8 import FP8Config, fp8_grouped_gemm

    E, H, inter = 3, 256, 256        # inter = 2 x 128: two fp8 groups per row of h (one group would hide
    counts = [5, 0, 12]              # a scale written to the wrong group column)
    q13, q2, v13, v2 = _weights(fmt, E, H, inter, seed=5)
    p13 = prepare_weights(q13, packing="oct")
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(6)) * 4
    rows = expert_rows(x, E, torch.tensor(counts), None, "contiguous")
    act = ACTS[1]
    y1 = loop_ffn(x.double().numpy(), v13, np.stack([np.eye(inter)] * E), counts, interleaved=False, **act)
    cfg = W4A16Config(block_n=128, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f32", packing="oct")
    h = launch_w4a16(x, p13, rows, out_dtype=torch.float32, swiglu=(act["limit"], act["alpha"], act["beta"]),
                     config=cfg)
    assert _rel(h, y1) < 1e-5
    hq, hs = launch_w4a16(x, p13, rows, out_dtype=torch.float32, swiglu=(act["limit"], act["alpha"], act["beta"]),
                          quant_out=True, config=cfg)
    assert hs.shape == (sum(counts), inter // 128)
    assert _rel(hq.float() * hs.repeat_interleave(128, -1), y1) < 0.1   # fp8 rounding of h (the interpreter's cast is coarse)
    ref_s = torch.as_tensor(np.abs(y1).reshape(sum(counts), inter // 128, 128).max(axis=2) / 448).float()
    assert not torch.allclose(ref_s[:, 0], ref_s[:, 1], rtol=1e-2)      # the two groups' scales differ
    assert torch.allclose(hs, ref_s, rtol=1e-5)
    hr = quantize(h, "fp8_group", backend="torch")      # the epilogue is parallel.quant's fp8_group, bit for bit
    assert torch.equal(hq.view(torch.uint8), hr.data.view(torch.uint8)) and torch.equal(hs, hr.scale)
    xn = x.clone()
    xn[3, 7] = float("nan")                             # a NaN token: NaN scale and 0x7F bytes, as the reference
    hn = launch_w4a16(xn, p13, rows, out_dtype=torch.float32, swiglu=(act["limit"], act["alpha"], act["beta"]),
                      config=cfg)
    hnq, hns = launch_w4a16(xn, p13, rows, out_dtype=torch.float32, swiglu=(act["limit"], act["alpha"], act["beta"]),
                            quant_out=True, config=cfg)
    hnr = quantize(hn, "fp8_group", backend="torch")
    assert torch.isnan(hns[3]).all() and torch.equal(hns.nan_to_num(-1.0), hnr.scale.nan_to_num(-1.0))
    assert torch.equal(hnq.view(torch.uint8), hnr.data.view(torch.uint8))
    if fmt == "mxfp4":                                  # the fp8 GEMM's SwiGLU epilogue, on exact fp8 inputs
        from moe.kernels.triton_w4a16 import expand_fp4
        b, bs = expand_fp4(p13, fold="row")
        xq = quantize(x, "fp8_token", backend="torch")
        h8 = fp8_grouped_gemm(xq.data, xq.scale, b, bs, rows, out_dtype=torch.float32,
                              swiglu=(act["limit"], act["alpha"], act["beta"]),
                              config=FP8Config(block_m=16, block_n=128, num_warps=4, num_stages=1))
        ref8 = loop_ffn((xq.data.float() * xq.scale).double().numpy(), v13, np.stack([np.eye(inter)] * E), counts,
                        interleaved=False, **act)
        assert _rel(h8, ref8) < 1e-5
        h8q, h8s = fp8_grouped_gemm(xq.data, xq.scale, b, bs, rows, out_dtype=torch.float32,
                                    swiglu=(act["limit"], act["alpha"], act["beta"]), quant_out=True,
                                    config=FP8Config(block_m=16, block_n=128, num_warps=4, num_stages=1))
        h8r = quantize(h8, "fp8_group", backend="torch")
        assert torch.equal(h8q.view(torch.uint8), h8r.data.view(torch.uint8)) and torch.equal(h8s, h8r.scale)


# ---- GPU -----------------------------------------------------------------------------------------

def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.as_tensor(a).to(torch.bfloat16).double().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton_w4a16", "triton_w4a8", "torch_grouped_mm", "auto"])
@pytest.mark.parametrize("layout", ["contiguous", "slab"])
def test_gpu_ffn_backends_match_reference(backend, layout):
    from moe.kernels import expert_ffn_reference

    E, H, inter = 5, 512, 256
    counts = [9, 0, 1, 40, 17]
    q13, q2, _, _ = _weights("mxfp4", E, H, inter, seed=7)
    tile = 128 if layout == "slab" else 0          # row-tiled weights (the decode layout) on one of the two
    p13 = prepare_weights(q13.to("cuda"), gate_up="interleaved", tile_n=tile)
    p2 = prepare_weights(q2.to("cuda"), tile_n=tile)
    c = torch.tensor(counts, device="cuda")
    if layout == "slab":
        x = torch.randn(E, 48, H, device="cuda").to(torch.bfloat16)
    else:
        x = torch.randn(sum(counts), H, device="cuda").to(torch.bfloat16)
    rows = expert_rows(x, E, c, None, layout)
    from moe.kernels.grouped_gemm import resolve_backend

    hint = rows.capacity if layout == "slab" else x.shape[0] / E
    for act in ACTS[:2]:
        # "auto" takes W4A8 above the fused kernel's rows per expert: then hold it to W4A8's reference
        w4a8 = backend == "triton_w4a8" or (backend == "auto" and resolve_backend("auto", x, p13, hint) == "triton_w4a8")
        ref = expert_ffn_reference(x, p13, p2, rows, swiglu_limit=act["limit"], alpha=act["alpha"], beta=act["beta"],
                                   act_quant="fp8_token" if w4a8 else None, h_quant="fp8_token" if w4a8 else None)
        torch.full((1 << 26,), float("nan"), device="cuda")   # poison the allocator's free blocks
        y = expert_ffn(x, p13, p2, counts=c, layout=layout, swiglu_limit=act["limit"], alpha=act["alpha"],
                       beta=act["beta"], backend=backend)
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        tol = 3e-2 if w4a8 else 1e-2       # W4A8: h's bf16/fp8 roundings can differ where h lands near a tie
        assert _rel(y, ref) < tol, (backend, act)
        if layout == "slab":
            assert (y[1] == 0).all() and (y[2, 1:] == 0).all()


def test_prequantized_fp8_token_rows(monkeypatch):
    """x as an fp8_token QuantizedTensor: the W4A8 path (interpreter) gives exactly what it gives
    for the bf16 rows it would quantize itself; the torch path computes on the dequantized rows;
    other formats and the slab layout are refused by name."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moe.kernels import expert_ffn_reference
    from moe.quant import dequantize

    E, H, inter = 3, 128, 64
    q13, q2, _, _ = _weights("mxfp4", E, H, inter, seed=11)
    p13, p2 = prepare_weights(q13), prepare_weights(q2)
    counts = torch.tensor([5, 0, 9])
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(14, H, generator=g) * 3).to(torch.bfloat16)
    x[3] = 0.0                                                  # an all-zero row (the amax floor)
    xq = quantize(x, "fp8_token")
    for act in ACTS[:2]:
        want = expert_ffn(x, p13, p2, counts=counts, backend="triton_w4a8", swiglu_limit=act["limit"],
                          alpha=act["alpha"], beta=act["beta"])
        got = expert_ffn(xq, p13, p2, counts=counts, backend="triton_w4a8", swiglu_limit=act["limit"],
                         alpha=act["alpha"], beta=act["beta"])
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), act
    rows = expert_rows(x, E, counts, None, "contiguous")
    ref = expert_ffn_reference(dequantize(xq, torch.bfloat16), p13, p2, rows).to(torch.float32)
    got = expert_ffn(xq, p13, p2, counts=counts, backend="torch", out_dtype=torch.float32)
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="fp8_token QuantizedTensor.*fmt='fp8_group'"):
        expert_ffn(quantize(x, "fp8_group"), p13, p2, counts=counts, backend="triton_w4a8")
    with pytest.raises(ValueError, match="layout 'slab'"):
        expert_ffn(xq, p13, p2, counts=counts, layout="slab", backend="torch")


def test_prequantized_rows_with_storage_of_another_shape_or_dtype_are_refused(monkeypatch):
    """A pre-quantized x whose tensors disagree with its fp8_token shape: the torch path refused it
    (dequantize checks the storage), the W4A8 path read it as it was: a scale of half the rows was
    read past its end, a bf16 scale's bits as fp32, data of 10 rows under a shape of 14 gave 10 output
    rows. ValueError naming the shapes and dtypes on every path (interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moe.quant import QuantizedTensor

    E, H, inter = 2, 128, 64
    q13, q2, _, _ = _weights("mxfp4", E, H, inter, seed=12)
    p13, p2 = prepare_weights(q13), prepare_weights(q2)
    x = torch.randn(14, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    xq = quantize(x, "fp8_token")
    bad = [(QuantizedTensor(xq.data, xq.scale[:7], "fp8_token", xq.shape), torch.tensor([5, 9]),
            r"needs scale torch.float32\(14, 1\), got torch.float32\(7, 1\)"),
           (QuantizedTensor(xq.data, xq.scale.to(torch.bfloat16), "fp8_token", xq.shape), torch.tensor([5, 9]),
            r"got torch.bfloat16\(14, 1\)"),
           (QuantizedTensor(xq.data[:10], xq.scale[:10], "fp8_token", xq.shape), torch.tensor([4, 6]),
            r"needs data torch.float8_e4m3fn\(14, 128\), got torch.float8_e4m3fn\(10, 128\)")]
    for xb, counts, msg in bad:
        for backend in ("triton_w4a8", "torch"):
            with pytest.raises(ValueError, match=msg):
                expert_ffn(xb, p13, p2, counts=counts, backend=backend)


def test_resident_fp8_weights_give_the_same_w4a8_output(monkeypatch):
    """`PreparedWeight.keep_fp8`: the W4A8 path reads the resident exact FP8 copy (the same
    tensors `fp8_weight` returns from then on) and gives bit for bit what it gives when it expands
    the FP4 weight per call (interpreter); formats without an exact FP8 form are refused by name."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moe.experts import Experts
    from moe.kernels.triton_w4a8 import fp8_weight

    E, H, inter = 3, 128, 64
    q13, q2, _, _ = _weights("mxfp4", E, H, inter, seed=5)
    p13, p2 = prepare_weights(q13), prepare_weights(q2)
    counts = torch.tensor([4, 0, 7])
    x = (torch.randn(11, H, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    want = expert_ffn(x, p13, p2, counts=counts, backend="triton_w4a8", swiglu_limit=7.0)
    r13, r2 = prepare_weights(q13).keep_fp8(), prepare_weights(q2).keep_fp8()
    b13, s13 = fp8_weight(r13)
    assert b13 is r13.cache["fp8_resident"][0] and s13 is r13.cache["fp8_resident"][1]
    e13, es13 = fp8_weight(p13)                        # expanded now: the same bits
    assert torch.equal(b13.view(torch.uint8), e13.view(torch.uint8)) and torch.equal(s13, es13)
    got = expert_ffn(x, r13, r2, counts=counts, backend="triton_w4a8", swiglu_limit=7.0)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="keep_fp8 needs an mxfp4 weight.*'nvfp4'"):
        prepare_weights(quantize(torch.randn(2, 32, 64), "nvfp4")).keep_fp8()
    with pytest.raises(ValueError, match="resident_fp8 keeps an mxfp4 weight's exact FP8 form; fmt is 'bf16'"):
        Experts(2, 64, 32, fmt="bf16", resident_fp8=True)
    with pytest.raises(ValueError, match="resident_fp8 must be True or False, got 1"):
        Experts(2, 64, 32, fmt="mxfp4", resident_fp8=1)


@pytest.mark.gpu
def test_gpu_experts_with_resident_fp8_match_per_call_expansion():
    """Experts(resident_fp8=True) on CUDA: the W4A8 prefill path (512 rows per expert) gives the
    same output as with the per-call expansion, and the copy stays resident across calls."""
    from moe.experts import Experts

    torch.manual_seed(0)
    a = Experts(4, 1024, 512, fmt="mxfp4", device="cuda", backend="triton_w4a8")
    b = Experts(4, 1024, 512, fmt="mxfp4", device="cuda", backend="triton_w4a8", resident_fp8=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4 * 512, 1024, device="cuda", dtype=torch.bfloat16)
    counts = [512] * 4
    want, got = a(x, counts), b(x, counts)
    assert torch.equal(got, want)
    w13, _ = b.prepared()
    assert "fp8_resident" in w13.cache and b(x, counts).equal(want)


_SWIGLU_PTX = """
import inspect, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megapar.moe.kernels.triton_swiglu import _swiglu_kernel as k
types = dict(g_ptr="*bf16", u_ptr="*bf16", out_ptr="*bf16", n="i32", limit="fp32", alpha="fp32", beta="fp32")
names = list(inspect.signature(k.fn).parameters)
sig = {n: types.get(n, "constexpr") for n in names}
consts = {(names.index("HAS_LIMIT"),): True, (names.index("BLOCK"),): 1024}
ptx = triton.compile(ASTSource(k, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(json.dumps(sorted(set(re.findall(r"\\b(?:min|max)\\.[\\w.]+", ptx)))))
"""


def test_dense_swiglu_kernel_clamps_propagate_nan_on_sm90():
    """The one-launch SwiGLU of the shared expert (moe.kernels.triton_swiglu, CUDA) clamps with
    min / max. Without NaN propagation they compile to PTX min.f32 / max.f32, which return the
    other operand for a NaN: a NaN gate became the limit and a NaN up -limit, a finite output
    where torch's clamp (moe.kernels.ffn.swiglu, the CPU / autograd path) and the routed experts'
    SwiGLU epilogue give NaN. (The interpreter's min / max propagate NaN either way, so the sm_90
    code is what is checked: compiled on the CPU, as tests/test_triton_compile.py does.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(repo))
    proc = subprocess.run([sys.executable, "-c", _SWIGLU_PTX], env=env, capture_output=True, text=True, timeout=240,
                          cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ops = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ops and all(".NaN." in op for op in ops), ops
