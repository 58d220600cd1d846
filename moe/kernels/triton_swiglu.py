"""One-launch SwiGLU for dense activations (the shared expert's, on CUDA): h = act(g, u) in fp32,
rounded once to the output dtype, with the same clamp and alpha/beta as `moe.kernels.ffn.swiglu`
(g' = min(g, L), u' = clamp(u, -L, L), h = g' * sigmoid(alpha g') * (u' + beta)). The torch form
takes seven elementwise launches; at decode sizes each costs more than the arithmetic.
Forward only (no autograd); imported when used."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, alpha, beta, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:   # (NaN propagates, as torch's clamp: min / max without it return the other operand)
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    h = g * tl.sigmoid(alpha * g) * (u + beta)
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, limit: float | None = None, alpha: float = 1.0,
           beta: float = 0.0, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate, up: same shape, contiguous, any float dtype -> act(gate, up) in out_dtype (default gate's)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=out_dtype or gate.dtype, device=gate.device)
    n = gate.numel()
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](gate, up, out, n, float(limit) if limit is not None else 0.0,
                                                 float(alpha), float(beta), HAS_LIMIT=limit is not None,
                                                 BLOCK=block, num_warps=4)
    return out
