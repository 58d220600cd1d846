"""FP4/FP8 formats for MoE weights and activations: `quantize(x, fmt)` / `dequantize(q)`.

The torch reference (`moe.quant.reference`) is the specification; on CUDA the Triton kernels
(`moe.quant.triton_quant`, imported only when used) produce the same bits. `backend="auto"`
picks Triton for CUDA tensors when triton imports and the format has a kernel, else torch.

    q = quantize(w, "mxfp4")            # QuantizedTensor(data uint8 [..., K/2], scale uint8 [..., K/32])
    w_hat = dequantize(q, torch.bfloat16)
"""

from __future__ import annotations

import logging
import os

import torch

from moe.quant.checkpoint import load_fp4_checkpoint, prepare_weight
from moe.quant.fold import Fp8FoldPlan, mxfp4_fold_plan, mxfp4_to_fp8_block
from moe.quant.formats import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E4M3_MAX,
    FORMATS,
    FormatInfo,
    QuantizedTensor,
    e2m1_to_float,
    get_format,
    pack_fp4,
    unpack_fp4,
)
from moe.quant.reference import (
    dequantize_reference,
    e8m0_to_float,
    quantize_reference,
    round_to_e2m1,
)

__all__ = [
    "FORMATS", "FormatInfo", "QuantizedTensor", "quantize", "dequantize", "e2m1_to_float", "e8m0_to_float",
    "pack_fp4", "unpack_fp4", "round_to_e2m1", "mxfp4_to_fp8_block", "mxfp4_fold_plan", "Fp8FoldPlan",
    "load_fp4_checkpoint", "prepare_weight", "E2M1_MAGNITUDES", "E2M1_MAX", "E4M3_MAX", "TRITON_FORMATS",
]

BACKENDS = ("auto", "torch", "triton")
TRITON_FORMATS = ("mxfp4", "nvfp4", "fp8_token", "fp8_group", "fp8_block")

_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pick_backend(backend: str, fmt: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if fmt not in TRITON_FORMATS:
            raise ValueError(f"no triton kernel for {fmt!r}; triton formats: {', '.join(TRITON_FORMATS)}")
        if not _triton_importable():
            raise ValueError("backend='triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got device {device}")
        return "triton"
    if device.type != "cuda" or fmt not in TRITON_FORMATS:
        return "torch"
    if not _triton_importable():
        if "triton" not in _warned:
            _warned.add("triton")
            _log.warning("moe.quant: triton not importable, quantize/dequantize fall back to torch on CUDA")
        return "torch"
    return "triton"


def quantize(x: torch.Tensor, fmt: str, *, backend: str = "auto", **opts) -> QuantizedTensor:
    """Quantize `x` ([..., K] float; fp8_block: [..., N, K]) to `fmt` (one of FORMATS).

    opts: mxfp4: scale_rule="ceil"|"floor"; nvfp4: global_scale (fp32 scalar, default
    amax/2688); fp8_*: ue8m0=False (power-of-two scales), amax_floor=1e-12.
    """
    get_format(fmt)
    if _pick_backend(backend, fmt, x.device) == "triton":
        from moe.quant import triton_quant
        return triton_quant.quantize(x, fmt, **opts)
    return quantize_reference(x, fmt, **opts)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, backend: str = "auto") -> torch.Tensor:
    """`q` -> tensor of `q.shape` in `dtype` (fp32 math, one rounding to `dtype` at the end)."""
    if _pick_backend(backend, q.fmt, q.device) == "triton":
        from moe.quant import triton_quant
        return triton_quant.dequantize(q, dtype)
    return dequantize_reference(q, dtype)
