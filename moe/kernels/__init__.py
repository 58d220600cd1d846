"""Grouped expert GEMMs and the fused expert FFN (FP4/FP8 weights on Hopper, torch reference).

    from megapar.moe.kernels import grouped_gemm, expert_ffn, prepare_weights
    w13 = prepare_weights(w13_bf16, fmt="mxfp4", gate_up="interleaved")   # once, at load time
    w2 = prepare_weights(w2_bf16, fmt="mxfp4")
    y = expert_ffn(x, w13, w2, counts=counts, swiglu_limit=10.0)          # x [M, H], rows grouped by expert

Triton kernels live in `triton_w4a16` / `triton_w4a8` / `triton_expand` (their shared device
helpers in `triton_common`; none imports another kernel module), imported only when a CUDA
(or TRITON_INTERPRET=1) path runs; importing this package needs torch alone. `routing.py`
(the fused top-k kernel) belongs to the router; `RouteResult` lives in `route_result.py` so
that the kernel does not import the router.
"""

from megapar.moe.kernels.ffn import expert_ffn, expert_ffn_reference, swiglu
from megapar.moe.kernels.grouped_gemm import BACKENDS, ExpertRows, expert_rows, grouped_gemm, grouped_gemm_reference
from megapar.moe.kernels.prepare import (PreparedWeight, dequantize_prepared, fold_plan, packing_for, prepare_weights,
                                         to_quantized)

__all__ = [
    "BACKENDS", "ExpertRows", "PreparedWeight", "dequantize_prepared", "expert_ffn", "expert_ffn_reference",
    "expert_rows", "fold_plan", "grouped_gemm", "grouped_gemm_reference", "packing_for", "prepare_weights", "swiglu",
    "to_quantized",
]
