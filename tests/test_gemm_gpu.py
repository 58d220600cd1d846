"""Grouped expert GEMM kernels on the GPU (`pytest -m gpu`) against the fp32 reference.

Fresh random inputs, outputs poisoned with NaN through the caching allocator (an unwritten
element shows up), empty experts and odd counts, both layouts. Tolerances: fp32 operands
1e-5; 16-bit operands 1e-2 (one bf16 output rounding is ~2e-3); W4A8 against the reference fed
the same fp8 activations 1e-2. NaN never passes: every check first requires finite outputs.
"""

from __future__ import annotations

import pytest
import torch

from moe.kernels import expert_rows, grouped_gemm, grouped_gemm_reference, prepare_weights
from moe.kernels.prepare import dequantize_prepared, to_quantized
from moe.quant import dequantize, mxfp4_to_fp8_block, quantize

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _poison(nbytes: int = 1 << 28) -> None:
    junk = torch.full((nbytes // 4,), float("nan"), device=DEV)
    del junk


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output"
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _weight(fmt: str, E: int, N: int, K: int, seed: int, packing: str = "oct"):
    """packing "oct-tiled": oct with rows in tiles of 128 (PreparedWeight.tile_n)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(E, N, K, generator=g) * torch.exp2(torch.randint(-4, 3, (E, N, 1), generator=g).float())
    opts = {"global_scale": "matrix"} if fmt == "nvfp4" else {}
    tile = 128 if packing.endswith("-tiled") else 0
    return prepare_weights(quantize(w.to(DEV), fmt, **opts), packing=packing.removesuffix("-tiled"), tile_n=tile)


CASES = [  # (E, N, K, counts)
    (6, 256, 512, [0, 7, 1, 33, 0, 16]),
    (4, 384, 256, [64, 3, 0, 130]),
]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("packing", ["oct", "oct-tiled", "paired"])
def test_gpu_w4a16_matches_reference_contiguous(fmt, packing):
    for i, (E, N, K, counts) in enumerate(CASES):
        pw = _weight(fmt, E, N, K, seed=i, packing=packing)
        wf = dequantize_prepared(pw)
        x = torch.randn(sum(counts), K, device=DEV).to(torch.bfloat16)
        c = torch.tensor(counts, device=DEV)
        ref = grouped_gemm_reference(x, wf, expert_rows(x, E, c, None, "contiguous"))
        _poison()
        y = grouped_gemm(x, pw, counts=c, backend="triton_w4a16")
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(counts).cumsum(0)]).to(DEV)
        _poison()
        y2 = grouped_gemm(x, pw, offsets=offs, backend="triton_w4a16")
        assert torch.equal(y, y2)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_w4a16_fp32_operands_are_exact_to_fp32(fmt):
    from moe.kernels.triton_w4a16 import W4A16Config, launch_w4a16

    E, N, K, counts = CASES[0]
    pw = _weight(fmt, E, N, K, seed=5, packing="paired")
    x = torch.randn(sum(counts), K, device=DEV)
    rows = expert_rows(x, E, torch.tensor(counts, device=DEV), None, "contiguous")
    ref = grouped_gemm_reference(x.double(), dequantize_prepared(pw).double(), rows)
    _poison()
    cfg = W4A16Config(block_n=64, block_m=16, chunks=1, num_warps=4, num_stages=2, mode="f32", packing="paired")
    y = launch_w4a16(x, pw, rows, out_dtype=torch.float32, config=cfg)
    assert _rel(y, ref) < 1e-5


def test_gpu_w4a16_slab_zeroes_rows_beyond_counts():
    E, C, N, K = 5, 40, 256, 512
    counts = torch.tensor([0, 40, 17, 1, 3], device=DEV)
    pw = _weight("mxfp4", E, N, K, seed=7, packing="oct-tiled")
    x = torch.randn(E, C, K, device=DEV).to(torch.bfloat16)
    x[0] = float("nan")                                  # never read: count 0
    x[2, 17:] = float("nan")
    ref = grouped_gemm_reference(x.float().nan_to_num(), dequantize_prepared(pw),
                                 expert_rows(x, E, counts, None, "slab"))
    _poison()
    y = grouped_gemm(x, pw, counts=counts, layout="slab", backend="triton_w4a16")
    assert _rel(y, ref) < 1e-2
    assert (y[0] == 0).all() and (y[2, 17:] == 0).all() and (y[3, 1:] == 0).all()


def test_gpu_w4a16_nan_input_row_gives_nan_output_row():
    E, N, K, counts = CASES[0]
    pw = _weight("mxfp4", E, N, K, seed=8)
    x = torch.randn(sum(counts), K, device=DEV).to(torch.bfloat16)
    x[3, 100] = float("nan")
    y = grouped_gemm(x, pw, counts=torch.tensor(counts, device=DEV), backend="triton_w4a16")
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(y.shape[0], device=DEV) != 3]).all()


def test_gpu_w4a8_matches_reference_with_the_same_fp8_activations():
    for i, (E, N, K, counts) in enumerate(CASES):
        pw = _weight("mxfp4", E, N, K, seed=10 + i)
        x = torch.randn(sum(counts), K, device=DEV).to(torch.bfloat16)
        c = torch.tensor(counts, device=DEV)
        xq = dequantize(quantize(x, "fp8_token", backend="torch"))
        ref = grouped_gemm_reference(xq, dequantize_prepared(pw), expert_rows(x, E, c, None, "contiguous"))
        _poison()
        y = grouped_gemm(x, pw, counts=c, backend="triton_w4a8")
        assert _rel(y, ref) < 1e-2
    fp8w = prepare_weights(torch.randn(4, 256, 384, device=DEV), fmt="fp8_block")
    x = torch.randn(50, 384, device=DEV).to(torch.bfloat16)
    c = torch.tensor([20, 0, 29, 1], device=DEV)
    xq = dequantize(quantize(x, "fp8_token", backend="torch"))
    ref = grouped_gemm_reference(xq, dequantize_prepared(fp8w), expert_rows(x, 4, c, None, "contiguous"))
    _poison()
    assert _rel(grouped_gemm(x, fp8w, counts=c, backend="triton_w4a8"), ref) < 1e-2


def test_gpu_fp8_gemm_variants_are_bit_identical_to_the_one_tile_kernel():
    """FP8Config.tma_store and the persistent kernel (flattened or not, TMA operand loads) at the
    prefill tile (128 x 256, 3 stages) against the one-tile kernel with pointer stores: the same bits on every row an expert owns (empty experts, counts not a multiple of
    128, N not a multiple of 256), and no write outside the experts' rows (rows before the first
    and after the last expert of an offsets layout keep the NaN they were given)."""
    from moe.kernels.triton_w4a16 import expand_fp4
    from moe.kernels.triton_w4a8 import FP8Config, fp8_grouped_gemm, quantize_act

    E, N, K = 5, 7168 - 64, 1024
    b, bs = expand_fp4(_weight("mxfp4", E, N, K, seed=31), fold="row")
    counts = torch.tensor([300, 0, 129, 1, 511], device=DEV)
    gap = 7                                  # rows before the first expert and after the last: nobody's
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]) + gap
    M = int(offsets[-1]) + gap
    x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
    a, s = quantize_act(x)
    rows = expert_rows(a, E, None, offsets, "contiguous")
    owned = torch.zeros(M, dtype=torch.bool, device=DEV)
    owned[gap:M - gap] = True
    variants = {"pointer": {}, "tma store": {"tma_store": True}, "persistent": {"persistent": 132},
                "persistent unflattened": {"persistent": 132, "flatten": False},
                "persistent tma loads": {"persistent": 100, "tma_load": True}}
    got = {}
    for name, opts in variants.items():
        junk = torch.full((M, N), -1, dtype=torch.int16, device=DEV)   # all-ones bits: bf16 NaN
        del junk                                                       # (the output reuses the block)
        got[name] = fp8_grouped_gemm(a, s, b, bs, rows, out_dtype=torch.bfloat16,
                                     config=FP8Config(block_m=128, block_n=256, num_warps=8, num_stages=3, **opts))
    assert torch.isfinite(got["pointer"][owned]).all()
    for name in variants:
        assert torch.equal(got[name][owned], got["pointer"][owned]), name
        assert torch.isnan(got[name][~owned]).all(), f"{name}: wrote rows no expert owns"


def test_gpu_expansion_and_activation_quantization_are_bit_exact():
    from moe.kernels.triton_w4a16 import expand_fp4
    from moe.kernels.triton_w4a8 import quantize_act

    for fmt in ("mxfp4", "nvfp4"):
        for packing in ("oct", "oct-tiled", "paired"):
            pw = _weight(fmt, 3, 128, 512, seed=20, packing=packing)
            _poison()
            assert torch.equal(expand_fp4(pw, torch.bfloat16), dequantize_prepared(pw, torch.bfloat16))
            if fmt == "mxfp4":
                ref = mxfp4_to_fp8_block(to_quantized(pw), tile_rows=1)
                data, scale = expand_fp4(pw, fold="group")
                assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)
                data, scale = expand_fp4(pw, fold="row")
                assert torch.equal(data.float() * scale[..., None], dequantize_prepared(pw))
    x = torch.randn(37, 7168, device=DEV).to(torch.bfloat16) * 3
    x[5] = 0.0
    for group in (False, True):
        q, s = quantize_act(x, group=group)
        # the reference runs on the CPU: torch on CUDA divides by a Python scalar as a multiply by
        # its reciprocal (amax * (1/448)), one ulp off IEEE amax / 448 at times
        ref = quantize(x.cpu(), "fp8_group" if group else "fp8_token", backend="torch")
        bad = (q.view(torch.uint8).cpu() != ref.data.view(torch.uint8)).sum().item()
        assert bad == 0 and torch.equal(s.cpu(), ref.scale), (group, bad)


def test_gpu_torch_grouped_mm_backend_and_auto():
    E, N, K, counts = CASES[1]
    pw = _weight("mxfp4", E, N, K, seed=30)
    x = torch.randn(sum(counts), K, device=DEV).to(torch.bfloat16)
    c = torch.tensor(counts, device=DEV)
    ref = grouped_gemm_reference(x, dequantize_prepared(pw), expert_rows(x, E, c, None, "contiguous"))
    from moe.kernels.grouped_gemm import resolve_backend

    auto = resolve_backend("auto", x, pw, x.shape[0] / E)
    for backend in ("torch_grouped_mm", "auto", "torch"):
        _poison()
        # "auto" may choose W4A8 here (many rows per expert): fp8 activations, its own tolerance
        tol = 3e-2 if backend == "auto" and auto == "triton_w4a8" else 1e-2
        assert _rel(grouped_gemm(x, pw, counts=c, backend=backend), ref) < tol, (backend, auto)
