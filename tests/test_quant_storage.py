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
