"""Loading FP4 checkpoint tensors into QuantizedTensor and preparing weights for the GEMMs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe.quant import (
    QuantizedTensor,
    dequantize,
    e2m1_to_float,
    load_fp4_checkpoint,
    prepare_weight,
    quantize,
    unpack_fp4,
)
from tests.helpers import e4m3_values, weight_values


def _manual_dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss layout [E, N, K/32, 16] bytes + [E, N, K/32] E8M0 -> float64 [E, N, K], by loops."""
    e_, n_, nb, _ = blocks.shape
    out = torch.empty(e_, n_, nb * 32, dtype=torch.float64)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for e in range(e_):
        for n in range(n_):
            for b in range(nb):
                s = 2.0 ** (int(scales[e, n, b]) - 127)
                for i in range(16):
                    byte = int(blocks[e, n, b, i])
                    for j, c in enumerate((byte & 0xF, byte >> 4)):
                        out[e, n, b * 32 + 2 * i + j] = (-1.0 if c & 8 else 1.0) * table[c & 7] * s
    return out


def test_gpt_oss_style_mxfp4_blocks_load_and_decode():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 140, (2, 3, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    q = load_fp4_checkpoint(blocks, scales.view(torch.float8_e8m0fnu))
    assert q.fmt == "mxfp4" and q.shape == (2, 3, 64) and q.data.shape == (2, 3, 32)
    assert torch.equal(dequantize(q, torch.float64), _manual_dequant_mxfp4(blocks, scales))


def test_mxfp4_checkpoint_made_with_the_ocp_floor_rule_round_trips():
    w = torch.randn(4, 8, 64)
    ref = quantize(w, "mxfp4", scale_rule="floor")
    q = load_fp4_checkpoint(ref.data.view(torch.int8), ref.scale)   # int8 storage, uint8 scales
    assert q.fmt == "mxfp4" and torch.equal(dequantize(q), dequantize(ref))
    assert (dequantize(q) - w).abs().max() < 2.5                    # floor rule clips some values


def test_nvfp4_modelopt_checkpoint_with_per_expert_tensor_scales():
    w = torch.randn(3, 16, 64) * torch.tensor([1.0, 10.0, 0.1]).reshape(3, 1, 1)
    ref = quantize(w, "nvfp4", global_scale="matrix")
    q = load_fp4_checkpoint(ref.data, ref.scale.view(torch.float8_e4m3fn), ref.global_scale)
    assert q.fmt == "nvfp4" and q.global_scale.shape == (3,)
    deq = dequantize(q, torch.float64)
    # independent decode: e2m1 * e4m3 * per-expert scale, in fp32 steps
    vals = e2m1_to_float(unpack_fp4(ref.data))
    s = ref.scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    want = (vals * s) * ref.global_scale.reshape(3, 1, 1)
    assert torch.equal(deq, want.double())
    # compressed-tensors stores the reciprocal tensor scale
    q2 = load_fp4_checkpoint(ref.data, ref.scale, 1.0 / ref.global_scale.reshape(3, 1),
                             fmt="nvfp4", global_scale_is_reciprocal=True)
    assert torch.allclose(dequantize(q2), dequantize(q), rtol=1e-6, atol=0)


def test_checkpoint_shape_and_dtype_errors():
    data = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="disagree"):
        load_fp4_checkpoint(data, torch.zeros(4, 3, dtype=torch.uint8), fmt="mxfp4")
    with pytest.raises(ValueError, match="disagree"):
        load_fp4_checkpoint(data, torch.zeros(5, 2, dtype=torch.uint8), fmt="mxfp4")
    with pytest.raises(ValueError, match="weight_scale_2"):
        load_fp4_checkpoint(data, torch.zeros(4, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="one per matrix"):
        load_fp4_checkpoint(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.zeros(2, 4, 4, dtype=torch.uint8),
                            torch.ones(3), fmt="nvfp4")
    with pytest.raises(ValueError, match="dtype"):
        load_fp4_checkpoint(data.float(), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="no tensor scale"):
        load_fp4_checkpoint(data, torch.zeros(4, 2, dtype=torch.uint8), torch.ones(()))
    with pytest.raises(ValueError, match="'mxfp4' or 'nvfp4'"):
        load_fp4_checkpoint(data, torch.zeros(4, 2, dtype=torch.uint8), fmt="fp8_block")
    # a uint8 scale with one scale per 16 elements and a tensor scale is NVFP4
    q = load_fp4_checkpoint(data, torch.zeros(4, 4, dtype=torch.uint8), torch.tensor([0.5]))
    assert q.fmt == "nvfp4" and q.global_scale.dim() == 0


def test_prepare_weight_conversions():
    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    q = prepare_weight(w, "mxfp4")
    assert isinstance(q, QuantizedTensor) and q.fmt == "mxfp4"
    assert prepare_weight(q, "mxfp4") is q
    # the values, decoded by the bit tables of tests/helpers.py (not the library's dequantize,
    # which prepare_weight itself calls)
    want = torch.as_tensor(weight_values(q)).float()
    for fmt in ("fp8_group", "fp8_block"):
        f = prepare_weight(q, fmt, strict=True)
        if fmt == "fp8_block":
            got = weight_values(f)
        else:
            got = e4m3_values(f.data.view(torch.uint8).numpy()) * np.repeat(f.scale.numpy().astype(np.float64), 128, -1)
        assert f.fmt == fmt and torch.equal(torch.as_tensor(got).float(), want)   # exact W4A8 fold
    assert torch.equal(prepare_weight(q, "bf16"), want.bfloat16())
    n = prepare_weight(q, "nvfp4")                                          # lossy re-quantization
    assert n.fmt == "nvfp4" and torch.equal(n.data, quantize(dequantize(q), "nvfp4").data)
    assert prepare_weight(w, "bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="valid: mxfp4"):
        prepare_weight(w, "int4")


def test_nvfp4_tensor_scale_that_is_negative_or_not_finite_is_refused():
    """A negative weight_scale_2 loaded silently (every value of the matrix negated), a NaN or inf
    one made it all NaN (e2m1 * 0 * inf); a stored reciprocal of 0 is an inf scale."""
    data = torch.full((2, 4, 8), 0x22, dtype=torch.uint8)             # every element 1.0
    scale = torch.ones(2, 4, 1).to(torch.float8_e4m3fn)
    for bad in (torch.tensor(-0.5), torch.tensor([0.5, float("nan")]), torch.tensor([float("inf"), 0.5])):
        with pytest.raises(ValueError, match=r"weight_scale_2 must be finite and >= 0; got \["):
            load_fp4_checkpoint(data, scale, bad)
    with pytest.raises(ValueError, match=r"1 / weight_scale_2 must be finite and >= 0; got \[inf\]"):
        load_fp4_checkpoint(data, scale, torch.tensor(0.0), global_scale_is_reciprocal=True)
    # 0 (an all-zero weight's amax / 2688) and positive scales load; one per matrix here
    q = load_fp4_checkpoint(data, scale, torch.tensor([0.0, 0.25]))
    assert dequantize(q)[0].eq(0).all() and dequantize(q)[1].eq(0.25).all()
