"""FP4/FP8 formats for weights, activations and wire payloads: `quantize(x, fmt)` / `dequantize(q)`.

The bottom of the dependency graph: every package (sp, cp, ep payloads, moe) takes its
low-precision formats from here, so there is one implementation, one amax floor, one
E4M3_MAX and one container (`QuantizedTensor`). `moe.quant` re-exports these names.

The torch reference (`parallel.quant.reference`) is the specification; on CUDA the Triton
kernels (`parallel.quant.triton_quant`, imported only when used) produce the same bits.
`backend="auto"` picks Triton for CUDA tensors when triton imports and the format has a
kernel, else torch (the choice is made by `parallel.impl`, op "quant.quantize").

    q = quantize(w, "mxfp4")            # QuantizedTensor(data uint8 [..., K/2], scale uint8 [..., K/32])
    w_hat = dequantize(q, torch.bfloat16)
"""

from __future__ import annotations

import torch

from megapar.parallel import impl
from megapar.parallel.quant.checkpoint import load_fp4_checkpoint, prepare_weight
from megapar.parallel.quant.fold import Fp8FoldPlan, mxfp4_fold_plan, mxfp4_to_fp8_block
from megapar.parallel.quant.formats import (
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
from megapar.parallel.quant.reference import (
    DEFAULT_AMAX_FLOOR,
    dequantize_reference,
    e8m0_to_float,
    quantize_reference,
    round_to_e2m1,
)

__all__ = [
    "FORMATS", "FormatInfo", "QuantizedTensor", "quantize", "dequantize", "e2m1_to_float", "e8m0_to_float",
    "pack_fp4", "unpack_fp4", "round_to_e2m1", "mxfp4_to_fp8_block", "mxfp4_fold_plan", "Fp8FoldPlan",
    "load_fp4_checkpoint", "prepare_weight", "E2M1_MAGNITUDES", "E2M1_MAX", "E4M3_MAX", "TRITON_FORMATS",
    "DEFAULT_AMAX_FLOOR",
]

TRITON_FORMATS = ("mxfp4", "nvfp4", "fp8_token", "fp8_group", "fp8_block")


def _has_kernel(f: impl.Facts) -> impl.Unusable | None:
    if f.fmt is None or f.fmt in TRITON_FORMATS:      # (None: impl.report(), no inputs)
        return None
    return impl.Unusable(f"no triton kernel for {f.fmt!r}; triton formats: {', '.join(TRITON_FORMATS)}")


QUANT = impl.Op("quant.quantize", [
    impl.Impl("triton", impl.triton_kernel(_has_kernel, impl.cuda_unless_asked)),
    impl.Impl("torch"),
])
BACKENDS = QUANT.names


def _pick_backend(backend: str, fmt: str, device: torch.device) -> str:
    return QUANT.resolve(backend, device=device, fmt=fmt)


def quantize(x: torch.Tensor, fmt: str, *, backend: str = "auto", **opts) -> QuantizedTensor:
    """Quantize `x` ([..., K] float; fp8_block: [..., N, K]) to `fmt` (one of FORMATS).

    opts: mxfp4: scale_rule="ceil"|"floor"; nvfp4: global_scale (fp32 scalar, default
    amax/2688); fp8_*: ue8m0=False (power-of-two scales), amax_floor=DEFAULT_AMAX_FLOOR.
    """
    get_format(fmt)
    if _pick_backend(backend, fmt, x.device) == "triton":
        from megapar.parallel.quant import triton_quant
        return triton_quant.quantize(x, fmt, **opts)
    return quantize_reference(x, fmt, **opts)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, backend: str = "auto") -> torch.Tensor:
    """`q` -> tensor of `q.shape` in `dtype` (fp32 math, one rounding to `dtype` at the end)."""
    if _pick_backend(backend, q.fmt, q.device) == "triton":
        from megapar.parallel.quant import triton_quant
        return triton_quant.dequantize(q, dtype)
    return dequantize_reference(q, dtype)
