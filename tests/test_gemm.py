"""Grouped expert GEMM: the torch reference against an independent float64 loop, weight
preparation, argument checks, and the Triton kernels under the interpreter (CPU).

The interpreter cases run where TRITON_INTERPRET=1 was set before triton's first import
(tests/conftest.py does so on machines without CUDA); GPU cases live in test_gemm_gpu.py.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from moe.kernels import expert_rows, grouped_gemm, grouped_gemm_reference, prepare_weights
from moe.kernels.prepare import dequantize_prepared, fold_plan, pair_fp4, to_quantized, unpair_fp4
from moe.quant import QuantizedTensor, quantize
from tests.helpers import weight_values

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 from the start (conftest sets it on CPU)")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# ---- independent float64 implementation (numpy; tables in tests/helpers.py, docs/numerics.md §4) ----

def loop_gemm(x: np.ndarray, wv: np.ndarray, counts: list[int], layout: str) -> np.ndarray:
    """Row by row: find the row's expert, multiply; rows without an expert stay 0."""
    if layout == "slab":
        out = np.zeros((*x.shape[:-1], wv.shape[1]))
        for e, c in enumerate(counts):
            for r in range(c):
                out[e, r] = wv[e] @ x[e, r]
        return out
    out = np.zeros((x.shape[0], wv.shape[1]))
    ends = np.cumsum(counts)
    for r in range(x.shape[0]):
        e = int(np.searchsorted(ends, r, side="right"))
        out[r] = wv[e] @ x[r]
    return out


def rel_err(a: torch.Tensor, b) -> float:
    a = a.double().cpu()
    b = torch.as_tensor(b).double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_weight(fmt: str, E: int, N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-3, 3, (E, N, 1), generator=g).float())
    if fmt == "bf16":
        return w.to(torch.bfloat16), w.to(torch.bfloat16).double().numpy()
    q = quantize(w, fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {}))
    return q, weight_values(q)


# ---- reference vs loop --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block", "bf16"])
def test_reference_matches_independent_loop_contiguous(fmt):
    E, N, K = 6, 48, 128 if fmt != "fp8_block" else 160
    counts = [0, 5, 1, 0, 9, 3]
    w, wv = random_weight(fmt, E, N, K, seed=1)
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(2))
    y = grouped_gemm(x, w, counts=torch.tensor(counts), backend="torch")
    assert y.dtype == torch.float32 and y.shape == (sum(counts), N)
    assert rel_err(y, loop_gemm(x.double().numpy(), wv, counts, "contiguous")) < 1e-6


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_reference_slab_ignores_rows_beyond_counts(fmt):
    E, C, N, K = 3, 7, 32, 64
    counts = [0, 3, 7]
    w, wv = random_weight(fmt, E, N, K, seed=3)
    x = torch.randn(E, C, K, generator=torch.Generator().manual_seed(4))
    x[0, :] = float("nan")                      # rows past the count: never read
    x[1, 3:] = float("nan")
    y = grouped_gemm(x.to(torch.bfloat16), w, counts=torch.tensor(counts), layout="slab", backend="torch")
    assert y.dtype == torch.bfloat16 and y.shape == (E, C, N)
    assert not torch.isnan(y).any()
    assert (y[0] == 0).all() and (y[1, 3:] == 0).all()
    ref = loop_gemm(x.to(torch.bfloat16).double().nan_to_num().numpy(), wv, counts, "slab")
    assert rel_err(y, ref) < 4e-3                # one bf16 rounding of the output


# ---- the reference against a hand decode of the bits ---------------------------------------------

_E2M1_BY_HAND = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_by_hand(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * _E2M1_BY_HAND[code & 7]


def _e4m3_by_hand(byte: int) -> float:
    """OCP E4M3 (the 'fn' variant NVFP4 block scales use): bias 7, subnormals at exponent 0, only
    S.1111.111 is NaN (no infinities)."""
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return math.nan
    mag = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if byte & 0x80 else mag


def _e8m0_by_hand(byte: int) -> float:
    """OCP MX E8M0: 2^(byte - 127) for 0..254 (byte 0 is 2^-127), 255 is NaN."""
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def _dequant_by_hand(data: torch.Tensor, scale: torch.Tensor, fmt: str, gs: list[float] | None) -> torch.Tensor:
    """[E, N, K] float64 from the raw bytes, one element at a time: element k is the low nibble of
    byte k // 2 when k is even, the high one when odd; times its block's scale (nvfp4: times the
    expert's global scale too)."""
    E, N, half = data.shape
    block = 32 if fmt == "mxfp4" else 16
    d, s = data.tolist(), scale.tolist()
    out = torch.empty(E, N, 2 * half, dtype=torch.float64)
    for e in range(E):
        for n in range(N):
            for k in range(2 * half):
                byte = d[e][n][k // 2]
                v = _e2m1_by_hand(byte & 15 if k % 2 == 0 else byte >> 4)
                sb = s[e][n][k // block]
                out[e, n, k] = v * (_e8m0_by_hand(sb) if fmt == "mxfp4" else _e4m3_by_hand(sb) * gs[e])
    return out


def _edge_weight(fmt: str, seed: int) -> tuple[QuantizedTensor, torch.Tensor]:
    """Random bytes with the scale bytes at the edges of each format: E8M0 0 (2^-127), 1, 254 (on
    small codes: no fp32 overflow), 255 (NaN); E4M3 subnormals, the largest (448), a negative scale,
    0 and NaN; nvfp4 global scales of different magnitudes per expert."""
    g = torch.Generator().manual_seed(seed)
    E, N, K = 3, 8, 64
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    if fmt == "mxfp4":
        scale = torch.randint(115, 140, (E, N, K // 32), generator=g, dtype=torch.uint8)
        scale[0, 0, 0], scale[0, 1, 1], scale[1, 2, 0], scale[2, 3, 1] = 0, 1, 254, 255
        data[1, 2, :16] = 0                                        # one 0.5 under 2^127: 2^126, finite in fp32
        data[1, 2, 0] = 0x01
        gs = None
    else:
        scale = torch.randint(0x20, 0x60, (E, N, K // 16), generator=g, dtype=torch.uint8)
        for (e, n, b), byte in {(0, 0, 0): 0x01, (0, 1, 1): 0x07, (0, 2, 2): 0x7E, (1, 3, 3): 0xB8,
                                (1, 4, 0): 0x00, (2, 5, 1): 0x7F}.items():
            scale[e, n, b] = byte
        gs = torch.tensor([0.5, 3.0e-3, 7.0])
    return QuantizedTensor(data, scale, fmt, torch.Size((E, N, K)), gs), data


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_reference_matches_a_hand_decode_of_the_bits_in_every_layout(fmt):
    """grouped_gemm(backend="torch") against the bits decoded by hand (OCP E2M1 / E8M0 / E4M3 as
    above; NVFP4 = e2m1 * e4m3 block scale * the expert's fp32 global scale, as ModelOpt / vLLM
    dequantize), a per-expert loop and float64 matmuls: contiguous counts and offsets (an empty
    expert, rows after the last expert: zero), the slab (rows past the counts: zero, NaN there
    ignored), fp32 and bf16 activations, NaN block scales giving NaN in their rows' columns only."""
    q, data = _edge_weight(fmt, seed=60)
    E, N, K = q.shape
    gs = None if q.global_scale is None else q.global_scale.tolist()
    w = _dequant_by_hand(data, q.scale, fmt, gs)
    g = torch.Generator().manual_seed(61)
    counts = [2, 0, 3]

    def by_hand(x: torch.Tensor, layout: str) -> torch.Tensor:
        out = torch.zeros(*x.shape[:-1], N, dtype=torch.float64)
        start = 0
        for e, c in enumerate(counts):
            for r in range(c):
                row = (e, r) if layout == "slab" else (start + r,)
                out[row] = w[e] @ x[row].double()
            start += c
        return out

    def same(y: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(y), nan)
        scale = want[~nan].abs().max()
        assert float((y.double()[~nan] - want[~nan]).abs().max() / scale) < tol

    x = torch.randn(7, K, generator=g) * 0.25                      # 2 spare rows after the last expert
    for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -8)):
        xd = x.to(dt)
        want = by_hand(xd, "contiguous")
        assert torch.isnan(want).any()
        for kw in ({"counts": torch.tensor(counts)}, {"offsets": [0, 2, 2, 5]}):
            y = grouped_gemm(xd, q, backend="torch", **kw)
            assert y.dtype == dt and y.shape == (7, N)
            same(y, want, tol)
            assert (y[5:] == 0).all()
        xs = torch.randn(E, 4, K, generator=g).to(dt)
        xs[0, 2:] = float("nan")
        xs[1] = float("nan")
        want = by_hand(xs, "slab")
        y = grouped_gemm(xs, q, counts=torch.tensor(counts), layout="slab", backend="torch")
        same(y, want, tol)
        assert (y[0, 2:] == 0).all() and (y[1] == 0).all() and (y[2, 3:] == 0).all()


@interp
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_interp_w4a16_matches_a_hand_decode_of_the_edge_scales(fmt):
    """The fused W4A16 kernel (fp32 and fp16 operands) on the edge-scale weights above, against the
    hand decode. Left out: the interpreter decodes an E4M3 NaN byte as a number (hardware: NaN);
    fp16 operands carry 2^22 in their fp32 block scale, so an E8M0 scale of 2^127 overflows there
    (weights near 1e38). E8M0 byte 0 is 2^-127 in both (below fp32 resolution next to the row's
    other blocks here; rows of byte 0 blocks: the test after the expansion one)."""
    from moe.kernels.triton_w4a16 import launch_w4a16
    from tests.helpers import w4a16_config

    q, data = _edge_weight(fmt, seed=62)
    E, N, K = q.shape
    gs = None if q.global_scale is None else q.global_scale.tolist()
    w = _dequant_by_hand(data, q.scale, fmt, gs)
    counts = [2, 1, 3]
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(63)) * 0.25
    want = torch.cat([x[0:2].double() @ w[0].T, x[2:3].double() @ w[1].T, x[3:6].double() @ w[2].T])
    rows = expert_rows(x, E, torch.tensor(counts), None, "contiguous")
    pw = prepare_weights(q)
    for mode, tol in (("f32", 1e-6), ("f16", 2e-3)):
        y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=w4a16_config(mode=mode, packing="paired"))
        if fmt == "mxfp4":
            assert torch.isnan(y[3:, 3]).all() and torch.isfinite(y[:3, :2]).all()
        cols = torch.ones(N, dtype=torch.bool)
        cols[5 if fmt == "nvfp4" else 2] = fmt == "mxfp4" and mode == "f32"
        got, ref = y[:, cols].double(), want[:, cols]
        keep = ~torch.isnan(ref)
        assert torch.equal(torch.isnan(got), ~keep)
        assert float((got[keep] - ref[keep]).abs().max() / ref[keep].abs().max()) < tol, mode


def test_offsets_and_counts_give_the_same_result():
    w, _ = random_weight("mxfp4", 4, 32, 64, seed=5)
    counts = torch.tensor([2, 0, 5, 1])
    x = torch.randn(8, 64)
    a = grouped_gemm(x, w, counts=counts, backend="torch")
    b = grouped_gemm(x, w, offsets=torch.tensor([0, 2, 2, 7, 8]), backend="torch")
    assert torch.equal(a, b)


def test_empty_input_and_all_empty_experts():
    w, _ = random_weight("mxfp4", 3, 32, 64, seed=6)
    y = grouped_gemm(torch.empty(0, 64), w, counts=torch.zeros(3, dtype=torch.int64), backend="torch")
    assert y.shape == (0, 32)
    ys = grouped_gemm(torch.randn(3, 4, 64), w, counts=torch.zeros(3, dtype=torch.int32), layout="slab")
    assert ys.shape == (3, 4, 32) and (ys == 0).all()


def test_torch_grouped_mm_backend_matches_reference():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    w, wv = random_weight("mxfp4", 4, 32, 64, seed=7)
    counts = [3, 0, 6, 2]
    x = torch.randn(11, 64).to(torch.bfloat16)
    try:
        y = grouped_gemm(x, w, counts=torch.tensor(counts), backend="torch_grouped_mm")
    except RuntimeError as e:  # CPU build without the grouped-mm kernel
        pytest.skip(f"torch._grouped_mm unavailable here: {e}")
    assert rel_err(y, loop_gemm(x.double().numpy(), wv, counts, "contiguous")) < 1e-2
    xs = torch.randn(4, 6, 64).to(torch.bfloat16)
    ys = grouped_gemm(xs, w, counts=torch.tensor(counts), layout="slab", backend="torch_grouped_mm")
    assert rel_err(ys, loop_gemm(xs.double().numpy(), wv, counts, "slab")) < 1e-2
    assert (ys[1] == 0).all() and (ys[0, 3:] == 0).all()



def test_torch_grouped_mm_slab_ignores_nonfinite_rows_beyond_counts():
    """Slab rows past the count are not data (a slab's spare rows may hold anything). The
    torch_grouped_mm path masked them by multiplying by 0, so an inf or NaN there gave NaN rows
    instead of the zeros the reference and the contract give."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    E, C, N, K = 3, 5, 32, 64
    counts = [0, 2, 5]
    w, wv = random_weight("bf16", E, N, K, seed=8)
    x = torch.randn(E, C, K, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x[0] = float("nan")
    x[1, 2:] = float("inf")
    y = grouped_gemm(x, w, counts=torch.tensor(counts), layout="slab", backend="torch_grouped_mm")
    assert not torch.isnan(y).any()
    assert (y[0] == 0).all() and (y[1, 2:] == 0).all()
    ref = loop_gemm(x.double().nan_to_num(posinf=0.0).numpy(), wv, counts, "slab")
    assert rel_err(y, ref) < 1e-2

# ---- preparation ------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [32, 16])
def test_paired_packing_puts_element_j_and_j_plus_block_in_one_byte(block):
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 16, (3, 4 * block), generator=g, dtype=torch.uint8)
    natural = codes[:, 0::2] | (codes[:, 1::2] << 4)
    paired = pair_fp4(natural, block)
    for c in range(2):                                   # two chunks of 2*block elements
        base = 2 * block * c
        for j in range(block):
            assert torch.equal(paired[:, block * c + j] & 0xF, codes[:, base + j])
            assert torch.equal(paired[:, block * c + j] >> 4, codes[:, base + block + j])
    assert torch.equal(unpair_fp4(paired, block), natural)


def test_prepare_keeps_values_and_reorders_interleaved_rows():
    w = torch.randn(2, 8, 64)
    for fmt in ("mxfp4", "nvfp4", None):
        pw = prepare_weights(w, fmt=fmt, dtype=torch.float32)
        ref = quantize(w, fmt, **({"global_scale": "matrix"} if fmt == "nvfp4" else {})) if fmt else None
        want = torch.as_tensor(weight_values(ref)).float() if fmt else w
        assert torch.equal(dequantize_prepared(pw), want)
        pi = prepare_weights(w, fmt=fmt, gate_up="interleaved", dtype=torch.float32)
        assert pi.gate_up == "split"
        assert torch.equal(dequantize_prepared(pi), torch.cat((want[:, 0::2], want[:, 1::2]), dim=1))
    q = quantize(w, "mxfp4")
    back = to_quantized(prepare_weights(q))
    assert torch.equal(back.data, q.data) and torch.equal(back.scale, q.scale)


def test_prepare_from_checkpoint_dict():
    q = quantize(torch.randn(2, 4, 64), "nvfp4", global_scale="matrix")
    ckpt = {"weight": q.data, "weight_scale": q.scale.view(torch.float8_e4m3fn), "weight_scale_2": q.global_scale}
    pw = prepare_weights(ckpt)
    assert pw.fmt == "nvfp4" and pw.packing == "paired"   # K=64: too short for "oct" (128)
    assert torch.equal(dequantize_prepared(pw), torch.as_tensor(weight_values(q)).float())
    with pytest.raises(ValueError, match="weight_scale"):
        prepare_weights({"weight": q.data})


def test_quantized_weights_with_storage_of_another_shape_or_dtype_are_refused_by_name():
    """prepare_weights / grouped_gemm read a QuantizedTensor's data and scales by its format's
    strides. A scale of another dtype (E8M0 exponents as floats or int32) or shape (an nvfp4 weight
    holding one scale per 32) was prepared silently and the kernels read it wrongly; a missing or
    mis-sized nvfp4 global scale raised AttributeError / RuntimeError. Now ValueError, naming them,
    on every path (the torch reference's own check raised first only there)."""
    E, N, K = 2, 64, 256
    q = quantize(torch.randn(E, N, K, generator=torch.Generator().manual_seed(30)), "mxfp4")
    qn = quantize(torch.randn(E, N, K, generator=torch.Generator().manual_seed(31)), "nvfp4", global_scale="matrix")
    bad = [
        (QuantizedTensor(q.data, q.scale.float(), "mxfp4", q.shape),
         r"scale uint8 E8M0 bytes \(2, 64, 8\), got torch.float32"),
        (QuantizedTensor(q.data, q.scale.to(torch.int32), "mxfp4", q.shape), r"got torch.int32 \(2, 64, 8\)"),
        (QuantizedTensor(q.data, q.scale[..., :4], "mxfp4", q.shape), r"got torch.uint8 \(2, 64, 4\)"),
        (QuantizedTensor(q.data[:, :32], q.scale, "mxfp4", q.shape), r"needs data uint8 \(2, 64, 128\), got"),
        (QuantizedTensor(qn.data, qn.scale[..., ::2], "nvfp4", qn.shape, qn.global_scale),
         r"scale uint8 E4M3 bytes \(2, 64, 16\), got torch.uint8 \(2, 64, 8\)"),
        (QuantizedTensor(qn.data, qn.scale, "nvfp4", qn.shape, None), r"global_scale .* \[E=2\], got None"),
        (QuantizedTensor(qn.data, qn.scale, "nvfp4", qn.shape, torch.ones(3)), r"\[E=2\], got torch.float32 \(3,\)"),
    ]
    fq = quantize(torch.randn(E, N, 160), "fp8_block")
    bad.append((QuantizedTensor(fq.data.view(torch.uint8), fq.scale, "fp8_block", fq.shape),
                r"needs data float8_e4m3fn \(2, 64, 160\), got torch.uint8"))
    x = torch.randn(3, K)
    for w, msg in bad:
        with pytest.raises(ValueError, match=msg):
            prepare_weights(w)
        with pytest.raises(ValueError, match=msg):
            grouped_gemm(x if w.shape[-1] == K else torch.randn(3, 160), w, counts=torch.tensor([1, 2]),
                         backend="torch")
    # the storage torch's own dtypes give (fp4x2 data, e8m0 / e4m3 scales), a 0-d or [E, 1] global scale: as before
    ok = [QuantizedTensor(q.data, q.scale.view(torch.float8_e8m0fnu), "mxfp4", q.shape),
          QuantizedTensor(qn.data, qn.scale.view(torch.float8_e4m3fn), "nvfp4", qn.shape, qn.global_scale[:, None]),
          QuantizedTensor(qn.data, qn.scale, "nvfp4", qn.shape, qn.global_scale[0])]
    for w in ok:
        want = torch.as_tensor(weight_values(QuantizedTensor(w.data, w.scale, w.fmt, w.shape,
                                                             None if w.global_scale is None
                                                             else w.global_scale.reshape(-1).expand(E))))
        assert torch.equal(dequantize_prepared(prepare_weights(w)), want.float())


def test_fold_plan_flags_exactness_by_block_exponent_spread():
    def plan(spread: int) -> tuple[bool, bool]:
        codes = torch.full((1, 2, 256), 0x2, dtype=torch.uint8)          # all 1.0
        data = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scale = torch.full((1, 2, 8), 127, dtype=torch.uint8)
        scale[0, 0, 5] = 127 - spread                                     # row 0: second 128-group
        scale[0, 1, 1] = 127 - spread                                     # row 1: first group
        q = QuantizedTensor(data, scale, "mxfp4", torch.Size((1, 2, 256)))
        p = fold_plan(prepare_weights(q))
        return p.rowwise_exact, p.group_exact
    assert plan(14) == (True, True)
    assert plan(15) == (False, False)
    codes = torch.zeros(1, 1, 64, dtype=torch.uint8)                       # an all-zero block may sit anywhere
    scale = torch.tensor([[[127, 0]]], dtype=torch.uint8)
    q = QuantizedTensor(codes[..., 0::2] | (codes[..., 1::2] << 4), scale, "mxfp4", torch.Size((1, 1, 64)))
    assert fold_plan(prepare_weights(q)).rowwise_exact


# ---- argument checks --------------------------------------------------------------------------

def test_bad_arguments_raise_value_errors_naming_the_choices():
    w, _ = random_weight("mxfp4", 2, 16, 64, seed=9)
    x = torch.randn(4, 64)
    c = torch.tensor([1, 3])
    with pytest.raises(ValueError, match="layout"):
        grouped_gemm(x, w, counts=c, layout="masked")
    with pytest.raises(ValueError, match="valid: auto"):
        grouped_gemm(x, w, counts=c, backend="cutlass")
    with pytest.raises(ValueError, match="exactly one of counts"):
        grouped_gemm(x, w)
    with pytest.raises(ValueError, match="K=32"):
        grouped_gemm(torch.randn(4, 32), w, counts=c)
    with pytest.raises(ValueError, match=r"counts must be an int tensor \[E=2\]"):
        grouped_gemm(x, w, counts=torch.tensor([4]))
    with pytest.raises(ValueError, match="sum to 5"):
        grouped_gemm(x, w, counts=torch.tensor([2, 3]), backend="torch")
    with pytest.raises(ValueError, match="slab layout needs x"):
        grouped_gemm(x, w, counts=c, layout="slab")
    if not INTERPRET:
        with pytest.raises(ValueError, match="CUDA"):
            grouped_gemm(x, w, counts=c, backend="triton_w4a16")
    with pytest.raises(ValueError, match="mxfp4 or fp8_block"):
        grouped_gemm(x, prepare_weights(torch.randn(2, 16, 64), fmt="nvfp4"), counts=c, backend="triton_w4a8")
    with pytest.raises(ValueError, match="'deep_gemm' cannot run here: needs CUDA tensors, got cpu"):
        grouped_gemm(x, w, counts=c, backend="deep_gemm")        # a known name, unusable on CPU (tests/test_deep_gemm.py)
    from moe.kernels import BACKENDS
    assert set(BACKENDS) == {"auto", "torch", "torch_grouped_mm", "triton_w4a16", "triton_w4a8", "deep_gemm"}


@pytest.mark.parametrize("backend", ["triton_w4a16", "triton_w4a8", "torch"])
def test_host_counts_past_the_rows_are_refused_before_any_kernel_runs(backend, monkeypatch):
    """Counts / offsets on the host (a CPU tensor or a list) are checked by value when the rows are
    described, before any kernel reads them: the Triton kernels trust the counts, and counts summing
    past M made them read x and write the output past their ends (heap corruption under the
    interpreter) while the reference raised. ValueError naming the values on every backend (and in
    the fused FFN); the valid edges still run: counts summing to M or below (spare rows), offsets
    ending before M, a slab expert filled to its capacity."""
    import importlib

    from moe.kernels import expert_ffn, triton_w4a8, triton_w4a16

    gg = importlib.import_module("moe.kernels.grouped_gemm")

    def launched(*a, **k):
        raise AssertionError("a kernel ran on counts past the rows")

    if backend != "torch":
        for mod, name in ((triton_w4a16, "w4a16_grouped_gemm"), (triton_w4a16, "launch_w4a16"),
                          (triton_w4a8, "w4a8_grouped_gemm"), (triton_w4a8, "fp8_grouped_gemm")):
            monkeypatch.setattr(mod, name, launched)
        monkeypatch.setattr(gg, "_gemm_grouped_mm", launched)
    E, N, K = 2, 32, 256
    w, _ = random_weight("mxfp4", E, N, K, seed=40)
    pw = prepare_weights(w)
    x = torch.randn(5, K)
    bad = [({"counts": torch.tensor([4, 9])}, "counts sum to 13 but x has only 5 rows"),
           ({"counts": [2, 4]}, "counts sum to 6 but x has only 5 rows"),
           ({"counts": torch.tensor([-3, 8])}, r"counts must be >= 0, got \[-3, 8\]"),
           ({"offsets": torch.tensor([0, 4, 9])}, r"offsets must rise from 0 to at most M=5, got \[0, 4, 9\]"),
           ({"offsets": [1, 2, 5]}, r"offsets must rise from 0 to at most M=5, got \[1, 2, 5\]"),
           ({"offsets": torch.tensor([0, 4, 3])}, r"got \[0, 4, 3\]")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            expert_rows(x, E, kw.get("counts"), kw.get("offsets"), "contiguous")
        with pytest.raises(ValueError, match=msg):
            grouped_gemm(x, pw, backend=backend, **kw)
    w13, _ = random_weight("mxfp4", E, 2 * 128, K, seed=41)
    w2, _ = random_weight("mxfp4", E, K, 128, seed=42)
    with pytest.raises(ValueError, match="counts sum to 13"):
        expert_ffn(x, prepare_weights(w13), prepare_weights(w2), counts=torch.tensor([4, 9]), backend=backend)
    xs = torch.randn(E, 3, K)
    with pytest.raises(ValueError, match=r"slab counts \[5, 1\] exceed the capacity 3"):
        grouped_gemm(xs, pw, counts=torch.tensor([5, 1]), layout="slab", backend=backend)
    # the valid edges describe their rows as given
    for kw, ranges in (({"counts": torch.tensor([2, 3])}, [(0, 2), (2, 3)]), ({"counts": [0, 4]}, [(0, 0), (0, 4)]),
                       ({"offsets": torch.tensor([0, 0, 4])}, [(0, 0), (0, 4)])):
        assert expert_rows(x, E, kw.get("counts"), kw.get("offsets"), "contiguous").host_ranges(5) == ranges
    assert expert_rows(xs, E, torch.tensor([3, 0]), None, "slab").host_ranges(0) == [(0, 3), (3, 0)]


def test_auto_backend_on_cpu_is_the_reference():
    w, wv = random_weight("nvfp4", 2, 16, 64, seed=10)
    x = torch.randn(5, 64)
    y = grouped_gemm(x, w, counts=torch.tensor([2, 3]))
    assert rel_err(y, loop_gemm(x.double().numpy(), wv, [2, 3], "contiguous")) < 1e-6


# ---- Triton kernels under the interpreter ---------------------------------------------------------

def _f32_config(block_m: int = 16):
    from moe.kernels.triton_w4a16 import W4A16Config
    return W4A16Config(block_n=32, block_m=block_m, chunks=2, num_warps=4, num_stages=1, mode="f32")


@interp
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_interp_w4a16_kernel_matches_loop_in_every_layout(fmt):
    from moe.kernels.triton_w4a16 import launch_w4a16

    E, N, K = 3, 48, 256                     # N not a multiple of the 32-row tile
    q, wv = random_weight(fmt, E, N, K, seed=11)
    pw = prepare_weights(q)
    g = torch.Generator().manual_seed(12)
    counts = [5, 0, 19]                      # empty expert, odd counts, more than one 16-row tile
    x = torch.randn(sum(counts), K, generator=g)
    for kw in ({"counts": torch.tensor(counts)}, {"offsets": torch.tensor([0, 5, 5, 24])}):
        rows = expert_rows(x, E, kw.get("counts"), kw.get("offsets"), "contiguous")
        y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=_f32_config())
        assert rel_err(y, loop_gemm(x.double().numpy(), wv, counts, "contiguous")) < 1e-5
    xs = torch.randn(E, 20, K, generator=g)
    rows = expert_rows(xs, E, torch.tensor([5, 0, 20]), None, "slab")
    y = launch_w4a16(xs, pw, rows, out_dtype=torch.float32, config=_f32_config())
    assert rel_err(y, loop_gemm(xs.double().numpy(), wv, [5, 0, 20], "slab")) < 1e-5
    assert (y[0, 5:] == 0).all() and (y[1] == 0).all()
    # fp16 operands (the fast mode): x rounded to fp16 after the 2^-8 pre-scale
    from moe.kernels.triton_w4a16 import W4A16Config
    cfg = W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16")
    y = launch_w4a16(x, pw, expert_rows(x, E, torch.tensor(counts), None, "contiguous"), out_dtype=torch.float32,
                     config=cfg)
    assert rel_err(y, loop_gemm(x.double().numpy(), wv, counts, "contiguous")) < 2e-3


@interp
def test_interp_w4a16_prescaled_operands_match_loop_with_wide_block_exponents():
    """PRESCALE: block scales folded into the fp16 operand relative to each row's largest, one
    chained accumulator. Rows whose blocks spread over 2^-30..2^0, swiglu rows, a NaN block."""
    from moe.kernels.triton_w4a16 import W4A16Config, launch_w4a16

    E, N, K = 2, 40, 256
    g = torch.Generator().manual_seed(21)
    w = torch.randn(E, N, K, generator=g)
    w = w * torch.exp2(-torch.randint(0, 31, (E, N, K // 32, 1), generator=g).float()).repeat_interleave(
        32, -1).reshape(E, N, K)   # every 32-block its own exponent, down to 2^-30
    q = quantize(w, "mxfp4")
    wv = weight_values(q)
    pw = prepare_weights(q, packing="oct")
    counts = [7, 18]
    x = torch.randn(sum(counts), K, generator=g)
    rows = expert_rows(x, E, torch.tensor(counts), None, "contiguous")
    ref = loop_gemm(x.double().numpy(), wv, counts, "contiguous")
    for prescale in (False, True):
        cfg = W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16", packing="oct",
                          prescale=prescale)
        y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
        assert rel_err(y, ref) < 2e-3, prescale
    # a NaN block scale makes its row NaN, and only its row
    q.scale.view(torch.uint8)[1, 3, 2] = 255
    pw = prepare_weights(q, packing="oct")
    y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
    assert torch.isnan(y[7:, 3]).all() and not torch.isnan(y[:7]).any() and not torch.isnan(y[7:, 4]).any()
    # swiglu over W13 rows (gate rows then up rows), prescaled per half
    from moe.kernels.triton_w4a16 import launch_w4a16 as launch
    q2 = quantize(w[:, :32], "mxfp4")
    pw2 = prepare_weights(q2, packing="oct")
    wv2 = weight_values(q2)
    h = loop_gemm(x.double().numpy(), wv2, counts, "contiguous")
    gate, up = torch.as_tensor(h[:, :16]), torch.as_tensor(h[:, 16:])
    want = gate * torch.sigmoid(gate) * up
    got = launch(x, pw2, rows, out_dtype=torch.float32, swiglu=(None, 1.0, 0.0), config=cfg)
    assert rel_err(got, want) < 3e-3


@interp
def test_interp_slab_rows_past_the_count_stay_zero_under_a_nan_weight_scale():
    """Slab rows past an expert's count are zero by contract (the reference, torch_grouped_mm and
    deep_gemm zero them). The Triton kernels computed them as 0 times the row's scales, so a NaN
    block scale (MXFP4 byte 255, a NaN fp8_block scale) made them NaN in that column: in the W4A16
    kernel (per-block and prescaled scales, split-K) and the W4A8 kernels (one-tile and persistent).
    The expert's own rows still get NaN in that column, as in the reference."""
    from moe.kernels.triton_w4a8 import FP8Config, fp8_grouped_gemm
    from moe.kernels.triton_w4a16 import launch_w4a16
    from tests.helpers import w4a16_config

    E, C, N, K = 2, 4, 32, 256
    g = torch.Generator().manual_seed(70)
    q = quantize(torch.randn(E, N, K, generator=g), "mxfp4")
    q.scale[0, 5, 3] = 255
    pw = prepare_weights(q)
    xs = torch.randn(E, C, K, generator=g)
    counts = torch.tensor([2, 0])
    rows = expert_rows(xs, E, counts, None, "slab")
    ref = grouped_gemm(xs, q, counts=counts, layout="slab", backend="torch")
    assert torch.isnan(ref[0, :2, 5]).all() and (ref[0, 2:] == 0).all() and (ref[1] == 0).all()

    def check(y: torch.Tensor) -> None:
        assert torch.isnan(y[0, :2, 5]).all() and (y[0, 2:] == 0).all() and (y[1] == 0).all()

    for cfg in (w4a16_config(), w4a16_config(mode="f16", prescale=True), w4a16_config(mode="f16", split_k=2)):
        check(launch_w4a16(xs, pw, rows, out_dtype=torch.float32, config=cfg))
    f = quantize(torch.randn(E, N, K, generator=g), "fp8_block")
    f.scale[0, 0, 1] = float("nan")                          # rows 0..31, second 128 of K
    pf = prepare_weights(f)
    a = quantize(xs.reshape(-1, K), "fp8_token", backend="torch")
    for persistent in (0, 2):
        for bs in (pf.scale, pf.scale[..., 1:].contiguous()):   # group scales / row scales (the NaN one)
            cfg = FP8Config(block_m=16, block_n=32, num_warps=4, num_stages=1, persistent=persistent)
            y = fp8_grouped_gemm(a.data, a.scale, pf.data, bs, rows, out_dtype=torch.float32, config=cfg)
            check(y.view(E, C, N))
            assert torch.isnan(y[:2]).all()


@interp
def test_interp_expansion_is_exact():
    from moe.kernels.triton_w4a16 import expand_fp4
    from moe.quant import mxfp4_to_fp8_block

    for fmt in ("mxfp4", "nvfp4"):
        q, wv = random_weight(fmt, 2, 8, 256, seed=13)
        assert torch.equal(expand_fp4(prepare_weights(q), torch.float32), torch.as_tensor(wv).float())
    q, wv = random_weight("mxfp4", 2, 8, 256, seed=14)
    pw = prepare_weights(q)
    data, scale = expand_fp4(pw, fold="group")
    ref = mxfp4_to_fp8_block(q, tile_rows=1)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)
    data, scale = expand_fp4(pw, fold="row")
    assert scale.shape == (2, 8)
    assert torch.equal(data.float() * scale[..., None], torch.as_tensor(wv).float())
    # a caller's out buffer: written in place when it is the copy's own shape and dtype; any other is
    # refused by name (the kernel writes rows of K at r * K: a bf16 buffer took fp8 bits' values, a
    # smaller one was written past its end)
    buf = torch.empty(2, 8, 256, dtype=torch.float8_e4m3fn)
    assert expand_fp4(pw, fold="row", out=buf)[0] is buf and torch.equal(buf.view(torch.uint8), data.view(torch.uint8))
    for bad in (torch.empty(2, 8, 256, dtype=torch.bfloat16), torch.empty(2, 4, 256, dtype=torch.float8_e4m3fn),
                torch.empty(2, 256, 8, dtype=torch.float8_e4m3fn).transpose(1, 2)):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float8_e4m3fn tensor \[E=2, N=8, K=256\]"
                           r" on cpu, got torch\.\w+ \(2, \d+, \d+\)"):
            expand_fp4(pw, fold="row", out=bad)


def _e8m0_ldexp(byte: int, shift: int = 0) -> float:
    """Independent E8M0 decode: 2^(byte - 127 + shift) from math.ldexp in float64 (byte 0 is
    2^-127, not 0), NaN for 255; rounded to fp32 by the caller."""
    return math.nan if byte == 255 else math.ldexp(1.0, byte - 127 + shift)


def _same_f32(got: torch.Tensor, want: list[float]) -> None:
    """got (fp32) equals want (float64 values, each exact in fp32 or inf) bit for bit, NaN included."""
    w = torch.tensor(want, dtype=torch.float64).float()
    nan = torch.isnan(w)
    assert torch.equal(torch.isnan(got), nan)
    bad = (got[~nan].view(torch.int32) != w[~nan].view(torch.int32)).nonzero().flatten().tolist()
    assert not bad, [(i, float(got[~nan][i]), float(w[~nan][i])) for i in bad[:4]]


if INTERPRET:
    import triton
    import triton.language as tl

    @triton.jit
    def _e8m0_helpers_kernel(s_ptr, out_ptr, N: tl.constexpr):
        from megapar.moe.kernels.triton_common import block_scale
        from megapar.moe.kernels.triton_w4a16 import _prescale_factor
        i = tl.arange(0, N)
        s = tl.load(s_ptr + i)
        r = s.to(tl.int32)
        tl.store(out_ptr + i, block_scale(s, False, 2))
        tl.store(out_ptr + N + i, block_scale(s, False, 0))
        tl.store(out_ptr + 2 * N + i, _prescale_factor(r, 0))
        tl.store(out_ptr + 3 * N + i, _prescale_factor(r, 5))
        tl.store(out_ptr + 4 * N + i, _prescale_factor(r, 7))


@interp
def test_interp_e8m0_device_decodes_every_byte_exactly():
    """The kernels' E8M0 decodes against math.ldexp, every byte: block_scale read byte 0 as 0
    (its bits b << 23), not 2^-127; _prescale_factor took 2^(r_max - 127) from exp2, an ulp off at
    r_max 254 in the interpreter (and an approximate instruction on the GPU). fp16 operand modes
    carry 2^22 (block_scale) / 2^7 (prescale) in the factor; MODE 7 reads r_max at most 253."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(5, 256, dtype=torch.float32)
    _e8m0_helpers_kernel[(1,)](every, out, N=256)
    b = range(256)
    _same_f32(out[0], [_e8m0_ldexp(i) for i in b])                                 # MODE 1 / 2
    _same_f32(out[1], [_e8m0_ldexp(i, 22) for i in b])                             # MODE 0, 3, 4
    _same_f32(out[2], [_e8m0_ldexp(i, 7) for i in b])                              # prescale, fp16
    _same_f32(out[3], [_e8m0_ldexp(i) for i in b])                                 # prescale, bf16
    _same_f32(out[4], [_e8m0_ldexp(min(i, 253)) if i < 255 else math.nan for i in b])   # MODE 7


@interp
def test_interp_e8m0_byte_0_blocks_in_expansion_and_w4a16_match_ldexp_decode():
    """Blocks with E8M0 byte 0 (2^-127) on rows of their own (all blocks 0, or next to byte 1 / 2 of
    comparable size) and random bytes elsewhere, edge bytes 1, 254, 255 in the dense expansion.
    The kernels read byte 0 as 0: those rows expanded to zeros and multiplied to zeros. Checked
    per column against float64 products of an ldexp decode, so tiny rows are not hidden by big ones."""
    from moe.kernels.triton_w4a16 import W4A16Config, expand_fp4, launch_w4a16

    g = torch.Generator().manual_seed(71)
    E, N, K = 2, 8, 256
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 136, (E, N, K // 32), generator=g, dtype=torch.uint8)
    scale[0, 0] = 0
    scale[0, 1] = torch.tensor([0, 1] * 4, dtype=torch.uint8)
    scale[1, 2] = torch.tensor([2, 0, 0, 1, 0, 2, 1, 0], dtype=torch.uint8)
    q = QuantizedTensor(data, scale, "mxfp4", torch.Size((E, N, K)))
    codes = torch.stack((data & 15, data >> 4), -1).reshape(E, N, K).long()
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    mag = e2m1[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    mult = torch.tensor([[[_e8m0_ldexp(int(b)) for b in row] for row in ex] for ex in scale.tolist()],
                        dtype=torch.float64).repeat_interleave(32, -1)
    w = vals * mult                                                     # [E, N, K] float64

    # dense expansion (fp32 holds every product exactly, 2^-128 .. 6 * 2^-127 as subnormals)
    edge = scale.clone()
    edge[1, 5] = torch.tensor([254, 1, 255, 0, 0, 254, 1, 0], dtype=torch.uint8)
    qe = QuantizedTensor(data, edge, "mxfp4", torch.Size((E, N, K)))
    multe = torch.tensor([[[_e8m0_ldexp(int(b)) for b in row] for row in ex] for ex in edge.tolist()],
                         dtype=torch.float64).repeat_interleave(32, -1)
    dense = expand_fp4(prepare_weights(qe), torch.float32)
    _same_f32(dense.reshape(-1), (vals * multe).reshape(-1).tolist())
    assert (dense[0, 0] != 0).any() and dense[0, 0].abs().max() < 2.0 ** -124

    counts = [5, 3]
    x = torch.randn(sum(counts), K, generator=g)
    rows = expert_rows(x, E, torch.tensor(counts), None, "contiguous")
    want = torch.cat([x[:5].double() @ w[0].T, x[5:].double() @ w[1].T])
    for mode, packing, prescale, tol in (("f32", "paired", False, 1e-5), ("f32", "oct", False, 1e-5),
                                         ("f16", "paired", False, 2e-3), ("f16", "oct", False, 2e-3),
                                         ("f16", "oct", True, 2e-3)):
        cfg = W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode=mode, packing=packing,
                          prescale=prescale)
        y = launch_w4a16(x, prepare_weights(q, packing=cfg.packing), rows, out_dtype=torch.float32, config=cfg)
        err = (y.double() - want).abs().amax(0) / want.abs().amax(0)   # per output column
        assert float(err.max()) < tol, (mode, packing, prescale, err.tolist())


@interp
def test_interp_fp8_gemm_with_row_and_group_scales():
    from moe.kernels.triton_w4a16 import expand_fp4
    from moe.kernels.triton_w4a8 import FP8Config, fp8_grouped_gemm, quantize_act

    q, wv = random_weight("mxfp4", 3, 40, 256, seed=15)
    pw = prepare_weights(q)
    counts = [4, 0, 13]
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(16))
    rows = expert_rows(x, 3, torch.tensor(counts), None, "contiguous")
    cfg = FP8Config(block_m=16, block_n=32, num_warps=4, num_stages=1)
    for fold in ("row", "group"):
        b, bs = expand_fp4(pw, fold=fold)
        for act in ("fp8_token", "fp8_group"):
            xq = quantize(x, act, backend="torch")   # exact inputs (the interpreter's fp8 rounding is not RNE)
            y = fp8_grouped_gemm(xq.data, xq.scale, b, bs, rows, out_dtype=torch.float32, config=cfg)
            xd = (xq.data.float() * (xq.scale if act == "fp8_token" else xq.scale.repeat_interleave(128, -1)))
            assert rel_err(y, loop_gemm(xd.double().numpy(), wv, counts, "contiguous")) < 1e-5
    for group in (False, True):
        a, s = quantize_act(x, group=group)
        ref = quantize(x, "fp8_group" if group else "fp8_token", backend="torch")
        assert torch.equal(s, ref.scale) and torch.equal(a.view(torch.uint8), ref.data.view(torch.uint8))
        b, bs = expand_fp4(pw, fold="group")
        y = fp8_grouped_gemm(a, s, b, bs, rows, out_dtype=torch.float32, config=cfg)
        xd = a.float() * (s.repeat_interleave(128, -1) if group else s)
        assert rel_err(y, loop_gemm(xd.double().numpy(), wv, counts, "contiguous")) < 1e-5


@interp
def test_interp_one_scale_per_128_with_k_not_a_multiple_of_128():
    """1x128 scales along a K that ends in a partial group: an fp8_block weight with K = 160 and an
    MXFP4 weight with K = 192 whose rows span more than 14 block exponents (no rowwise fold; one
    scale per 1x128 group is exact). "auto" on CUDA sends both to triton_w4a8, which refused them
    ("per-128 scales need K % 128 == 0", "the 1x128 fold needs K % 128 == 0"): the default backend
    raised for weights parallel.quant makes and the reference takes. The group fold of a row's last,
    partial group reads that row's blocks only (bit-identical to parallel.quant's fold, a NaN
    scale there included), and the fp8 GEMM applies the partial group's scale; results match a
    float64 loop. Scales of another shape or dtype are refused by name."""
    import importlib

    from moe.kernels.triton_w4a8 import fp8_grouped_gemm, fp8_weight
    from moe.kernels.triton_w4a16 import expand_fp4
    from moe.quant import mxfp4_to_fp8_block

    gg = importlib.import_module("moe.kernels.grouped_gemm")
    g = torch.Generator().manual_seed(50)
    E, N = 2, 16
    counts = [3, 5]
    # fp8_block, K = 160: two groups of 128 and 32
    pf = prepare_weights(torch.randn(E, N, 160, generator=g), fmt="fp8_block")
    assert pf.scale.shape == (E, N, 2) and gg.resolve_backend("auto", torch.device("cuda"), pf, 40.0) == "triton_w4a8"
    x = torch.randn(8, 160, generator=g)
    xq = quantize(x, "fp8_token", backend="torch")            # (what quantize_act gives, bit for bit)
    want = loop_gemm((xq.data.float() * xq.scale).double().numpy(), dequantize_prepared(pf).double().numpy(),
                     counts, "contiguous")
    y = grouped_gemm(x, pf, counts=torch.tensor(counts), backend="triton_w4a8", out_dtype=torch.float32)
    assert rel_err(y, want) < 1e-5
    # mxfp4, K = 192: 6 blocks, groups of 4 and 2; each row's second group ~60 exponents below its
    # first (no rowwise fold) and below the next row's first group (a read past the row would show)
    K = 192
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 135, (E, N, K // 32), generator=g, dtype=torch.uint8)
    scale[..., 4:] = torch.randint(60, 70, (E, N, 2), generator=g, dtype=torch.uint8)
    q = QuantizedTensor(data, scale, "mxfp4", torch.Size((E, N, K)))
    pw = prepare_weights(q)
    assert pw.fp8_fold == "group" and gg.resolve_backend("auto", torch.device("cuda"), pw, 40.0) == "triton_w4a8"
    b, bs = expand_fp4(pw, fold="group")
    assert torch.equal(fp8_weight(pw)[0].view(torch.uint8), b.view(torch.uint8))
    for nan in (False, True):                                # (and a NaN block in a partial group)
        qn = QuantizedTensor(data, scale.clone().index_put_((torch.tensor(1), torch.tensor(3), torch.tensor(5)),
                                                            torch.tensor(255, dtype=torch.uint8)) if nan else scale,
                             "mxfp4", q.shape)
        b, bs = expand_fp4(prepare_weights(qn), fold="group")
        ref = mxfp4_to_fp8_block(qn, tile_rows=1)
        assert bs.shape == ref.scale.shape == (E, N, 2)
        assert torch.equal(b.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(bs.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0)) and bool(torch.isnan(bs[1, 3, 1])) == nan
    x = torch.randn(8, K, generator=g)
    xq = quantize(x, "fp8_token", backend="torch")
    want = loop_gemm((xq.data.float() * xq.scale).double().numpy(), weight_values(q), counts, "contiguous")
    y = grouped_gemm(x, pw, counts=torch.tensor(counts), backend="triton_w4a8", out_dtype=torch.float32)
    assert rel_err(y, want) < 1e-5
    # scales the kernel would read wrongly
    b, bs = expand_fp4(pw, fold="group")
    a, s = xq.data, xq.scale
    rows = expert_rows(x, E, torch.tensor(counts), None, "contiguous")
    for args, msg in (((a, s[:4], b, bs), r"a_scale must be fp32 \[M=8, 1\] .* got torch.float32\(4, 1\)"),
                      ((a, s.double(), b, bs), r"a_scale .* got torch.float64\(8, 1\)"),
                      ((a, s, b, bs[..., :1].expand(E, N, 3)), r"b_scale .* \[E, N, ceil\(K/128\)=2\], got"),
                      ((a, s, b[..., :128], bs), r"a \(8, 192\), b \(2, 16, 128\)")):
        with pytest.raises(ValueError, match=msg):
            fp8_grouped_gemm(*args, rows, out_dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_auto_takes_weights_whose_k_ends_in_a_partial_128_group():
    """On CUDA "auto" sends an fp8_block weight (K = 160) and a group-folded MXFP4 weight (K = 192)
    to triton_w4a8 (compiled, not interpreted): it runs and matches the reference on the same fp8
    activations. (Not yet run on a GPU when written: no device was lent to that session.)"""
    from moe.kernels.grouped_gemm import quantize_dequantize_act

    g = torch.Generator().manual_seed(51)
    E, N, counts = 4, 256, [40, 0, 70, 50]
    scale = torch.randint(120, 135, (E, N, 6), generator=g, dtype=torch.uint8)
    scale[..., 4:] -= 60
    q = QuantizedTensor(torch.randint(0, 256, (E, N, 96), generator=g, dtype=torch.uint8), scale, "mxfp4",
                        torch.Size((E, N, 192)))
    for w in (prepare_weights(torch.randn(E, N, 160, generator=g), fmt="fp8_block"), prepare_weights(q)):
        w = w.to("cuda")
        x = torch.randn(sum(counts), w.k, generator=g).to("cuda", torch.bfloat16)
        c = torch.tensor(counts, device="cuda")
        y = grouped_gemm(x, w, counts=c, out_dtype=torch.float32)
        ref = grouped_gemm_reference(quantize_dequantize_act(x, "fp8_token"), dequantize_prepared(w), expert_rows(
            x, E, c, None, "contiguous"))
        assert rel_err(y, ref) < 2e-3, w.fmt          # (Hopper's FP8 MMA accumulates with fewer bits)


def _act_quant_inputs(dtype: torch.dtype) -> torch.Tensor:
    """[12, 384] with the rows that differ between quantizers if any: zero, huge, tiny (fp32/bf16
    subnormal scales), NaN, +-inf, -0.0, a whole-group NaN, one nonzero value."""
    x = torch.randn(12, 384, generator=torch.Generator().manual_seed(41)) * 3
    x[1] = 0.0
    x[2, 5] = 3.0e38                                # amax near fp32 max: scale ~6.7e35
    x[3, 7] = float("nan")
    x[4, 300] = float("inf")
    x[5, 11] = -float("inf")
    x[6] *= 1e-30
    x[7, 3] = -0.0
    x[7, 200:] = -0.0
    x[8] *= 1e-42 if dtype == torch.float32 else 1e-38     # below the amax floor: scale = floor / 448
    x[9, 128:256] = float("nan")
    x[10] = 0.0
    x[10, 129] = -5.0
    x[11] *= 448.0 * 1.5                            # quotients at the saturation edge
    return x.to(dtype)


def _same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same fp32 bits, or NaN in both (a NaN's payload is not part of the format)."""
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [False, True])
def test_interp_quantize_act_is_parallel_quant_bit_for_bit(dtype, group):
    """quantize_act == parallel.quant fp8_token / fp8_group (torch reference) in every bit: data,
    scales (NaN where the row / group has one), shape and the strides the fp8 GEMM reads."""
    from moe.kernels.triton_w4a8 import quantize_act

    x = _act_quant_inputs(dtype)
    a, s = quantize_act(x, group=group)
    ref = quantize(x, "fp8_group" if group else "fp8_token", backend="torch")
    assert a.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == ref.scale.shape == ((12, 3) if group else (12, 1)) and s.stride() == ((3, 1) if group else (1, 1))
    assert a.is_contiguous() and a.shape == x.shape
    assert _same_floats(s, ref.scale)
    assert torch.equal(a.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.isnan(s[3]).all() and (a[3].view(torch.uint8) == 0x7F).all() if not group else torch.isnan(s[9, 1])
    assert s[8].eq(torch.tensor(1e-12) / 448).all() and s[10, 0 if not group else 1].item() == torch.tensor(5.0).div(448).item()
    # the GEMM's view: a strided input row (stride(0) > K) quantizes the same
    wide = torch.zeros(12, 512, dtype=dtype)
    wide[:, :384] = x
    a2, s2 = quantize_act(wide[:, :384], group=group)
    assert torch.equal(a2.view(torch.uint8), a.view(torch.uint8)) and _same_floats(s2, s)


@interp
def test_interp_quantize_act_num_warps_maps_to_quant_config():
    from moe.kernels.triton_w4a8 import quantize_act
    from parallel.quant import triton_quant

    x = _act_quant_inputs(torch.float32)
    before = dict(triton_quant.CONFIG)
    a, s = quantize_act(x, num_warps=16)
    assert triton_quant.CONFIG == before                     # restored after the call
    ref = quantize(x, "fp8_token", backend="torch")
    assert torch.equal(a.view(torch.uint8), ref.data.view(torch.uint8))
    from moe.kernels.triton_w4a16 import apply_tuning
    try:   # a tuning file's act_quant_warps tunes the quant CONFIG itself
        apply_tuning({"act_quant_warps": 2})
        assert triton_quant.CONFIG["fp8_token"][1] == triton_quant.CONFIG["fp8_group"][1] == 2
        a, s = quantize_act(x, group=True)
    finally:
        triton_quant.CONFIG.clear()
        triton_quant.CONFIG.update(before)
    assert torch.equal(a.view(torch.uint8), quantize(x, "fp8_group", backend="torch").data.view(torch.uint8))
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quantize_act(x[None])


def test_prepared_weight_knows_its_kernel_layout():
    q, _ = random_weight("mxfp4", 2, 128, 256, seed=21)
    pw = prepare_weights(q)
    assert pw.packing == "oct" and pw.tile_n == 64 and pw.fused_fp4_fits and pw.kernel_packing == "oct"
    assert pw.fp8_fold in ("row", "group") and pw.fp8_exact
    st = pw.strides()
    assert (st.expert, st.tile, st.row, st.chunk, st.tile_n) == (128 * 32, 64 * 32, 32, 64 * 32, 64)
    assert st.row_offset(64) == 64 * 32
    assert pw.in_layout("oct") is pw                          # already in the kernels' layout: no copy
    natural = prepare_weights(q, packing="natural")
    with pytest.raises(ValueError, match="paired/oct"):
        natural.strides()
    paired = natural.in_layout("paired")                      # one-time copy, cached on the weight
    assert paired is natural.in_layout("paired") and paired.packing == "paired"
    assert torch.equal(dequantize_prepared(paired), dequantize_prepared(natural))
    nv = prepare_weights(random_weight("nvfp4", 2, 16, 64, seed=22)[0])
    assert nv.fp8_fold is None and not nv.fp8_exact
    assert prepare_weights(torch.randn(2, 16, 64)).fp8_fold is None


@interp
def test_interp_launch_does_not_repack_a_prepared_weight(monkeypatch):
    from moe.kernels import prepare
    from moe.kernels.triton_w4a16 import launch_w4a16

    def no_repack(*a, **k):
        raise AssertionError("repack at call time")

    E, N, K = 2, 64, 256
    q, wv = random_weight("mxfp4", E, N, K, seed=23)
    pw = prepare_weights(q)
    monkeypatch.setattr(prepare, "repack", no_repack)
    counts = [3, 4]
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(24))
    rows = expert_rows(x, E, torch.tensor(counts), None, "contiguous")
    from dataclasses import replace
    for cfg in (None, replace(_f32_config(), packing="oct", chunks=1)):   # heuristic and explicit configs
        y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
        assert rel_err(y, loop_gemm(x.double().numpy(), wv, counts, "contiguous")) < 1e-5


@interp
def test_interp_rows_hint_picks_the_fused_kernel_for_a_sparse_slab(monkeypatch):
    """A decode slab sized for the worst case (C = 96) with a few rows per expert: by default the
    capacity decides (above the expansion threshold: bf16-expanded weights); rows_hint = the
    expected count sends it through the fused W4A16 kernel. Both match the reference; bad
    hints are refused by name."""
    import importlib

    gg = importlib.import_module("moe.kernels.grouped_gemm")   # (the package attribute is the function)
    from moe.kernels import triton_w4a16

    E, N, K = 3, 48, 256
    q, wv = random_weight("mxfp4", E, N, K, seed=5)
    pw = prepare_weights(q)
    g = torch.Generator().manual_seed(6)
    xs = torch.randn(E, 96, K, generator=g)
    counts = [2, 0, 3]
    picked = []
    pick = triton_w4a16.pick_config
    monkeypatch.setattr(triton_w4a16, "pick_config", lambda hint, *a, **k: picked.append(hint) or pick(hint, *a, **k))
    expanded = []
    mm = gg._gemm_grouped_mm
    monkeypatch.setattr(gg, "_gemm_grouped_mm", lambda *a, **k: expanded.append(1) or mm(*a, **k))
    want = loop_gemm(xs.double().numpy(), wv, counts, "slab")
    y = grouped_gemm(xs, pw, counts=torch.tensor(counts), layout="slab", backend="triton_w4a16")
    assert expanded == [1] and picked == [] and rel_err(y, want) < 1e-2    # bf16-expanded weights and x
    y = grouped_gemm(xs, pw, counts=torch.tensor(counts), layout="slab", backend="triton_w4a16", rows_hint=3)
    assert expanded == [1] and picked == [3.0] and rel_err(y, want) < 1e-5  # fp32 operands, exact products
    assert (y[0, 2:] == 0).all() and (y[1] == 0).all()
    for bad in (-1, "3", True, float("nan")):
        with pytest.raises(ValueError, match="rows_hint must be a number of rows per expert >= 0"):
            grouped_gemm(xs, pw, counts=torch.tensor(counts), layout="slab", rows_hint=bad)


@interp
def test_interp_fp8_gemm_tma_store_and_persistent_variants_match_pointer_stores():
    """The TMA-store epilogue (FP8Config.tma_store) and the persistent kernel (FP8Config.persistent,
    flattened and not, fewer programs than tiles) write the same bits as the one-tile kernel,
    with experts of 0 rows, rows not a multiple of the tile, a tile past the last expert's rows
    and N not a multiple of block_n; contiguous and slab layouts."""
    from moe.kernels.triton_w4a16 import expand_fp4
    from moe.kernels.triton_w4a8 import FP8Config, fp8_grouped_gemm

    VARIANTS = ("pointer", "tma", "persistent", "persistent unflattened", "persistent tma loads")
    q, _ = random_weight("mxfp4", 4, 40, 256, seed=17)
    b, bs = expand_fp4(prepare_weights(q), fold="row")
    counts = torch.tensor([4, 0, 13, 20])
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(18))
    xq = quantize(x, "fp8_token", backend="torch")
    slab = torch.full((4, 24, 256), float("nan"))
    for e, (lo, n) in enumerate(zip(torch.cumsum(counts, 0) - counts, counts)):
        slab[e, :n] = x[lo:lo + n]
    sq = quantize(slab.view(-1, 256), "fp8_token", backend="torch")
    for layout, a, s in (("contiguous", xq.data, xq.scale), ("slab", sq.data, sq.scale)):
        rows = expert_rows(a if layout == "contiguous" else a.view(4, 24, 256), 4, counts, None, layout)
        got = {}
        for variant in VARIANTS:
            cfg = FP8Config(block_m=16, block_n=32, num_warps=4, num_stages=1, tma_store=variant == "tma",
                            persistent={"persistent": 3, "persistent unflattened": 5, "persistent tma loads": 4}
                            .get(variant, 0), flatten=variant != "persistent unflattened",
                            tma_load=variant == "persistent tma loads")
            got[variant] = fp8_grouped_gemm(a, s, b, bs, rows, out_dtype=torch.float32, config=cfg)
        # the one-tile kernel against float64 math on the same fp8 operands and scales
        ref = torch.zeros(a.shape[0], 40, dtype=torch.float64)
        af = a.to(torch.float64) * s.to(torch.float64).reshape(-1, 1)
        bf = b.to(torch.float64) * bs.to(torch.float64).reshape(4, 40, 1)
        for e, (lo, n) in enumerate(zip((torch.cumsum(counts, 0) - counts).tolist(), counts.tolist())):
            r0 = lo if layout == "contiguous" else e * 24
            ref[r0:r0 + n] = af[r0:r0 + n] @ bf[e].T
        torch.testing.assert_close(got["pointer"].double(), ref, rtol=1e-5, atol=1e-4)
        # slab rows past the counts are zero in every variant; contiguous: every row belongs to an expert
        keep = torch.ones(a.shape[0], dtype=torch.bool)
        for variant in VARIANTS[1:]:
            assert torch.equal(got[variant][keep], got["pointer"][keep]), (layout, variant)
        if layout == "slab":   # (slab padding rows hold NaN here: TMA loads read them, the output stays 0)
            pad = ~(torch.arange(24)[None, :] < counts[:, None]).reshape(-1)
            assert (got["persistent"][pad] == 0).all() and (got["persistent tma loads"][pad] == 0).all()
    empty = xq.data[:0]                        # no rows at all: every variant returns [0, N]
    rows = expert_rows(empty, 4, torch.zeros(4, dtype=torch.int64), None, "contiguous")
    for opts in ({}, {"persistent": 3}, {"persistent": 3, "tma_load": True}, {"tma_store": True}):
        cfg = FP8Config(block_m=16, block_n=32, num_warps=4, num_stages=1, **opts)
        assert fp8_grouped_gemm(empty, xq.scale[:0], b, bs, rows, out_dtype=torch.float32, config=cfg).shape == (0, 40)
