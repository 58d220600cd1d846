"""QuantizedTensor storage that does not match its format is refused with a ValueError that
names what it got, instead of being decoded (wrongly) or failing deep inside a reshape."""

from __future__ import annotations

import pytest
import torch

from moe.quant import QuantizedTensor, dequantize


def test_fp4_scale_of_the_other_fp4_format_is_refused():
    """An E4M3 scale given to an mxfp4 tensor (or an E8M0 one to nvfp4) was viewed as uint8 and its
    bits read as the other format's: E4M3 1.0 (0x38) decoded as E8M0 2^-71."""
    data = torch.full((2, 16), 0x22, dtype=torch.uint8)              # every element 1.0
    e4m3 = torch.ones(2, 1).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize(QuantizedTensor(data, e4m3, "mxfp4", torch.Size((2, 32))))
    e8m0 = torch.full((2, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        dequantize(QuantizedTensor(data, e8m0, "nvfp4", torch.Size((2, 32)), torch.tensor(1.0)))
    # each format's own torch dtype is still a view of its uint8 storage: 1.0 * 2^0 and 1.0 * 1.0
    assert (dequantize(QuantizedTensor(data, e8m0[:, :1], "mxfp4", torch.Size((2, 32)))) == 1.0).all()
    assert (dequantize(QuantizedTensor(data, e4m3.expand(2, 2), "nvfp4", torch.Size((2, 32)),
                                       torch.tensor(1.0))) == 1.0).all()


def test_logical_shape_that_the_format_cannot_hold_is_refused():
    """mxfp4 K = 48 passed the storage check (data [.., 24], scale [.., 48 // 32 = 1]) and failed
    inside dequantize's reshape with a RuntimeError (nvfp4 K = 40 too); the fold failed the same way."""
    from moe.quant import mxfp4_to_fp8_block

    for fmt, k, gs in (("mxfp4", 48, None), ("nvfp4", 40, torch.tensor(1.0))):   # 48 // 32 = 1, 40 // 16 = 2
        blk = 32 if fmt == "mxfp4" else 16
        q = QuantizedTensor(torch.zeros(4, k // 2, dtype=torch.uint8), torch.zeros(4, k // blk, dtype=torch.uint8),
                            fmt, torch.Size((4, k)), gs)
        with pytest.raises(ValueError, match=rf"{fmt} of shape \(4, {k}\).*K \({k}\).*block size {blk}"):
            dequantize(q)
    q = QuantizedTensor(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "mxfp4",
                        torch.Size((4, 48)))
    with pytest.raises(ValueError, match=r"K \(48\)"):
        mxfp4_to_fp8_block(q)
    # a scale of the wrong shape reached the fold's arithmetic too
    q = QuantizedTensor(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "mxfp4",
                        torch.Size((4, 64)))
    with pytest.raises(ValueError, match=r"needs scale torch.uint8\(4, 2\)"):
        mxfp4_to_fp8_block(q)
    # fp8_block of a 1-d shape: "not enough values to unpack" before
    q = QuantizedTensor(torch.zeros(64).to(torch.float8_e4m3fn), torch.ones(1), "fp8_block", torch.Size((64,)))
    with pytest.raises(ValueError, match=r"fp8_block needs a shape with >= 2 dims, got \(64,\)"):
        dequantize(q)


def test_global_scale_on_a_format_without_one_is_refused():
    """global_scale is nvfp4's alone (the QuantizedTensor docstring); an mxfp4 or fp8 tensor that
    carried one dequantized without it, silently (x2 here), and the fold dropped it the same way.
    load_fp4_checkpoint already refuses an mxfp4 weight_scale_2."""
    from moe.quant import mxfp4_to_fp8_block, quantize

    x = torch.randn(3, 64)
    for fmt in ("mxfp4", "fp8_token", "fp8_group", "fp8_block"):
        q = quantize(x, fmt, backend="torch")
        bad = QuantizedTensor(q.data, q.scale, fmt, q.shape, torch.tensor(2.0))
        with pytest.raises(ValueError, match=rf"{fmt} has no global_scale \(nvfp4 only\), got torch.float32 \(\)"):
            dequantize(bad, backend="torch")
        assert torch.equal(dequantize(q, backend="torch"), dequantize(QuantizedTensor(q.data, q.scale, fmt, q.shape),
                                                                       backend="torch"))
    q = quantize(x, "mxfp4", backend="torch")
    with pytest.raises(ValueError, match=r"mxfp4 has no global_scale"):
        mxfp4_to_fp8_block(QuantizedTensor(q.data, q.scale, "mxfp4", q.shape, torch.ones(1)))
