"""Local attention that also returns the log-sum-exp: the building block of ring and DCP attention.

Layout (the whole package uses it): `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`,
or the same without the batch dim (`[T, H, D]`, packed tokens, vLLM-style); the result is
`AttnState(out [.., Tq, Hq, Dv] in q's dtype, lse [.., Tq, Hq] fp32, natural log)`. Grouped-query
attention: query head h reads kv head `h // (Hq // Hkv)`.

Masks are given by positions: with `causal=True`, query i (global position `q_offset + i`) sees
key j (global position `k_offset + j`) iff `k_offset + j <= q_offset + i`; rows that see no key
give `out = 0, lse = -inf`. This is the block-causal mask of one ring step. On the math path a row
with a NaN or +inf score (NaN in q or in a key it sees, or an inf there that makes a score +inf)
gives out and lse NaN, never -inf, so that an LSE merge cannot take it for empty and drop it.

Backends. `math` is exact torch math (scores in fp32 or wider), runs anywhere and is differentiable
through autograd (out and lse): it is the specification. On CUDA, `flash` (bf16/fp16) and
`efficient` (fp32/bf16/fp16) call PyTorch's fused kernels that return the LSE
(`aten._scaled_dot_product_flash_attention` / `_efficient_attention`); those only know "no mask"
and square top-left causal, so an offset mask is cut into at most three blocks (rows that see
nothing, a band = full prefix + square causal block, rows that see everything) merged by LSE.
"auto" takes the first that fits (op "cp.attention" of `parallel.impl`).

`block_attention_forward` / `block_attention_backward` are the kernel-level pair the ring uses
(`[B, H, T, D]` views, square causal only): the backward takes the final (merged) `out` and `lse`,
which is what makes per-block gradients of a ring exact (FlashAttention's `D = rowsum(dO * O)`).
"""

from __future__ import annotations

import math
import numbers
from typing import Literal

import torch
from torch import Tensor

from .. import impl
from .merge import merge_two_attn_states
from .state import AttnState

AttnBackend = Literal["auto", "math", "flash", "efficient"]

_LSE_ALIGN = 32   # the efficient kernel pads its LSE rows to a multiple of 32
_ATTN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# checks and backend choice


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Validate shapes/dtypes/devices of an attention call (layout in the module docstring)."""
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"q, k, v must all be [T, H, D] or all [B, T, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.dtype not in _ATTN_DTYPES:   # fp8 is floating point, but no path computes with it (no promotion)
        raise ValueError(f"attention needs {', '.join(str(d) for d in _ATTN_DTYPES)} inputs, got {q.dtype}")
    if q.dim() == 4 and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on all but the last dim")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head dim ({q.shape[-1]}) != k head dim ({k.shape[-1]})")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        valid = [h for h in range(1, hq + 1) if hq % h == 0]
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv}); valid kv heads: {valid}")


def resolve_scale(scale: float | Tensor | None, head_dim: int) -> float:
    """The softmax scale as a Python float: 1/sqrt(head_dim) for None, else `scale` read as a number.

    Accepted: None; a real number (int, float, a numpy integer or float scalar, Fraction); a 0-dim
    real tensor or numpy array (read on the host: a CUDA tensor synchronizes). Refused with a
    ValueError naming the value: NaN or infinity (every output would be NaN), bools and strings (an
    argument slip, not a scale), complex values, tensors / arrays with dims (even of one element: a
    per-head scale is not supported, and a [1] shape is more likely a bug than a scalar), and a tensor
    that requires grad while grad mode is on: no attention path differentiates the scale (the ring's
    and the fused kernels' backwards take it as a constant), so its gradient would be dropped
    silently and the scale would stop training. Pass a float or a detached tensor instead (under
    torch.no_grad() / inference_mode no gradient is asked for, so a trainable scale is read as is).
    Every refusal is a ValueError, never a TypeError or RuntimeError: ring_attention turns a
    ValueError on one rank into an error on every rank, anything else would leave the others waiting.
    """
    if scale is None:
        if head_dim < 1:   # (0 ** -0.5: a ZeroDivisionError, which the ranks' agreements do not report)
            raise ValueError(f"head dim D = {head_dim}: the default scale 1/sqrt(D) is undefined; pass scale= "
                             f"explicitly")
        return head_dim ** -0.5
    if type(scale) is float and math.isfinite(scale):   # the common case, on every decode step: no more work
        return scale
    given = scale
    bad = lambda: f"scale must be a finite number or None, got {given!r}"   # lazy: a tensor repr is ~50 us
    if isinstance(scale, Tensor):
        if scale.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"scale {scale!r} requires grad, but attention does not differentiate the softmax "
                             "scale (its gradient would be dropped silently); pass a float (scale.item()) or a "
                             "detached tensor, or call under torch.no_grad()")
        if scale.dim() != 0 or scale.dtype == torch.bool or scale.is_complex():
            raise ValueError(f"{bad()}: a tensor scale must be a 0-dim real tensor (shape {tuple(scale.shape)}, "
                             f"{scale.dtype})")
        scale = scale.item()
    elif not isinstance(scale, numbers.Real) and getattr(scale, "shape", None) == () and hasattr(scale, "item"):
        scale = scale.item()                            # a 0-dim numpy array (a numpy scalar is a Real already)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):   # np.bool_ is no Real either
        raise ValueError(f"{bad()} (a real number: int, float, numpy scalar or 0-dim tensor)")
    try:
        value = float(scale)
    except OverflowError:                               # an int or Fraction beyond the float range
        raise ValueError(bad()) from None
    if not math.isfinite(value):
        raise ValueError(bad())
    return value


def _flash_fits(f: impl.Facts) -> impl.Unusable | None:
    d, dv = f.head_dim, f.v_head_dim
    if f.dtype in (torch.float16, torch.bfloat16) and d == dv and d % 8 == 0 and d <= 256:
        return None
    return impl.Unusable(f"needs bf16/fp16 and equal head dims, a multiple of 8 up to 256; got {f.dtype} "
                         f"head dims {d}/{dv}")


def _efficient_fits(f: impl.Facts) -> impl.Unusable | None:
    d, dv = f.head_dim, f.v_head_dim
    if f.dtype in (torch.float16, torch.bfloat16, torch.float32) and d % 8 == 0 and dv % 8 == 0:
        return None
    return impl.Unusable(f"needs fp32/bf16/fp16 and head dims that are multiples of 8; got {f.dtype} "
                         f"head dims {d}/{dv}")


ATTENTION = impl.Op("cp.attention", [
    impl.Impl("flash", impl.all_of(impl.needs_cuda_tensor, _flash_fits)),
    impl.Impl("efficient", impl.all_of(impl.needs_cuda_tensor, _efficient_fits)),
    impl.Impl("math"),
])
"""PyTorch's fused kernels that return the LSE, then the exact torch math (runs anywhere)."""


def resolve_backend(backend: str, q: Tensor, k: Tensor, v: Tensor) -> str:
    """'auto' -> flash, else efficient, else math; a fused backend asked for by name must fit."""
    return ATTENTION.resolve(backend, device=q.device, dtype=q.dtype, head_dim=q.shape[-1],
                             v_head_dim=v.shape[-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _causal_allowed(tq: int, tk: int, delta: int, device: torch.device) -> Tensor:
    """[tq, tk] bool: key j visible from query i iff j <= i + delta."""
    i = torch.arange(tq, device=device).unsqueeze(1)
    j = torch.arange(tk, device=device).unsqueeze(0)
    return j <= i + delta


# ---------------------------------------------------------------------------------------------
# math path ([B, H, T, D] views)


def _math_scores(q: Tensor, k: Tensor, scale: float, allowed: Tensor | None) -> Tensor:
    """Masked scores [B, Hkv, G, Tq, Tk] in the compute dtype (k may be wider than q's dtype)."""
    ct = torch.promote_types(_compute_dtype(q.dtype), k.dtype)
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    qg = q.to(ct).reshape(b, hkv, hq // hkv, tq, d)
    s = torch.matmul(qg, k.to(ct).unsqueeze(2).transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return s


def _causal_or_none(q: Tensor, k: Tensor, delta: int | None) -> Tensor | None:
    return None if delta is None else _causal_allowed(q.shape[2], k.shape[2], delta, q.device)


def masked_attention_math(q: Tensor, k: Tensor, v: Tensor, scale: float,
                          allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Exact attention on [B, H, T, D] views with an optional boolean mask `allowed` that
    broadcasts to [B, Hkv, G, Tq, Tk] (G = Hq // Hkv). Returns out [B, Hq, Tq, Dv] in q's dtype
    and lse [B, Hq, Tq] fp32 (-inf, out 0 where no key is allowed; NaN, out NaN, on a row with a
    NaN or +inf score, so that no merge takes it for empty); differentiable in both."""
    b, hq, tq, _ = q.shape
    tk, dv = v.shape[2], v.shape[3]
    if tk == 0:
        return q.new_zeros(b, hq, tq, dv), torch.full((b, hq, tq), -math.inf, device=q.device)
    s = _math_scores(q, k, scale, allowed)
    m = s.amax(-1, keepdim=True).detach()
    # Only a row whose scores are all -inf (no key visible) is empty. A NaN score (NaN in q or a
    # visible key) or a +inf one (an inf in them) makes the row's max, weights, out and lse NaN: an
    # lse of -inf (or +inf) would mark the row empty, and the LSE merge would drop the NaN silently.
    m = torch.where(m == -math.inf, 0.0, m)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    empty = total == 0
    safe = torch.where(empty, 1.0, total)
    out = torch.matmul(e / safe, v.to(s.dtype).unsqueeze(2))
    lse = torch.where(empty, -math.inf, m + torch.log(safe)).squeeze(-1)
    return out.reshape(b, hq, tq, dv).to(q.dtype), lse.reshape(b, hq, tq).float()


def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, delta: int | None) -> tuple[Tensor, Tensor]:
    """Causal (key j visible iff j <= i + delta) or unmasked (delta None) exact attention."""
    return masked_attention_math(q, k, v, scale, _causal_or_none(q, k, delta))


def _math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                   delta: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-style backward from the (final) out and lse; grads in the compute dtype."""
    b, hq, tq, d = q.shape
    hkv, tk, dv = v.shape[1], v.shape[2], v.shape[3]
    g = hq // hkv
    s = _math_scores(q, k, scale, _causal_or_none(q, k, delta))
    ct = s.dtype
    lse_g = lse.to(ct).reshape(b, hkv, g, tq, 1)
    p = torch.where(torch.isfinite(lse_g), torch.exp(s - torch.where(torch.isfinite(lse_g), lse_g, 0.0)), 0.0)
    do = dout.to(ct).reshape(b, hkv, g, tq, dv)
    o = out.to(ct).reshape(b, hkv, g, tq, dv)
    dv_ = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.to(ct).unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(ct).unsqueeze(2)).reshape(b, hq, tq, d) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(ct).reshape(b, hkv, g, tq, d)).sum(2) * scale
    return dq, dk, dv_


# ---------------------------------------------------------------------------------------------
# fused kernels ([B, H, T, D] views of [B, T, H, D] memory, square causal only)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _flash_rng(q: Tensor) -> tuple[Tensor, Tensor]:
    # dropout is 0: the kernels never read the RNG state; pass placeholders of the forward's kind.
    return (torch.empty(2, dtype=torch.int64, device=q.device), torch.empty((), dtype=torch.int64, device=q.device))


def block_attention_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                            backend: str) -> tuple[Tensor, Tensor]:
    """One block. q [B, Hq, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv] (views); `causal` is
    square top-left (Tq == Tk). Returns out [B, Hq, Tq, Dv] (q dtype), lse [B, Hq, Tq] fp32."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"block causal attention needs Tq == Tk, got {q.shape[2]} and {k.shape[2]}")
    if backend == "math":
        return _math_forward(q, k, v, scale, 0 if causal else None)
    if backend == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]
    if backend == "efficient":
        groups = q.shape[1] // k.shape[1]
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _repeat_kv(k, groups), _repeat_kv(v, groups), None, True, 0.0, causal, scale=scale)
        return res[0], res[1][..., : q.shape[2]]
    raise ValueError(f"unknown attention backend {backend!r}")


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                             causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the FINAL out [B, Hq, Tq, Dv] and lse [B, Hq, Tq] of the rows
    (the merged result when the block is one of several). Returns dq, dk, dv ([B, H, T, D])."""
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, scale, 0 if causal else None)
    lse = lse.float().contiguous()
    if backend == "flash":
        seed, offset = _flash_rng(q)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    if backend == "efficient":
        groups = q.shape[1] // k.shape[1]
        tq = q.shape[2]
        padded = lse.new_zeros(lse.shape[:-1] + (-(-tq // _LSE_ALIGN) * _LSE_ALIGN,))
        padded[..., :tq] = lse
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _repeat_kv(k, groups), _repeat_kv(v, groups), None, out, padded, empty, empty, 0.0,
            [True, True, True, False], causal, scale=scale)
        if groups > 1:
            b, hkv, tk = k.shape[0], k.shape[1], k.shape[2]
            dk = dk.reshape(b, hkv, groups, tk, -1).sum(2)
            dv = dv.reshape(b, hkv, groups, tk, -1).sum(2)
        return dq, dk, dv
    raise ValueError(f"unknown attention backend {backend!r}")


class _FusedBlock(torch.autograd.Function):
    """Autograd for one fused block, gradients through out AND lse.

    The lse term (dS += P * g) is a second backward call with v = 0, out = e_0 and
    dout = -g e_0: then dP = 0 and rowsum(dout * out) = -g, so dS = P * g exactly.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str):
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, lse = block_attention_forward(qh, kh, vh, causal=causal, scale=scale, backend=backend)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.args = (causal, scale, backend)
        ctx.set_materialize_grads(False)
        return out.transpose(1, 2), lse.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        qh, kh, vh, out, lse = ctx.saved_tensors
        causal, scale, backend = ctx.args
        dq = dk = dv = None
        if dout is not None:
            dq, dk, dv = block_attention_backward(dout.transpose(1, 2).to(out.dtype), qh, kh, vh, out, lse,
                                                  causal=causal, scale=scale, backend=backend)
        if dlse is not None:
            unit = torch.zeros_like(out)
            unit[..., 0] = 1
            d_unit = torch.zeros_like(out)
            d_unit[..., 0] = -dlse.transpose(1, 2).to(out.dtype)
            dq2, dk2, _ = block_attention_backward(d_unit, qh, kh, torch.zeros_like(vh), unit, lse,
                                                   causal=causal, scale=scale, backend=backend)
            dq = dq2 if dq is None else dq + dq2
            dk = dk2 if dk is None else dk + dk2
            dv = torch.zeros_like(vh) if dv is None else dv
        if dq is None:
            return None, None, None, None, None, None
        return (dq.transpose(1, 2).to(qh.dtype), dk.transpose(1, 2).to(kh.dtype), dv.transpose(1, 2).to(vh.dtype),
                None, None, None)


def _block(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str) -> AttnState:
    """One block on [B, T, H, D] tensors, differentiable; empty query or key sets handled here."""
    b, tq, hq, _ = q.shape
    if tq == 0 or k.shape[1] == 0:
        return AttnState(q.new_zeros(b, tq, hq, v.shape[-1]), torch.full((b, tq, hq), -math.inf, device=q.device))
    if backend == "math":
        out, lse = _math_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale,
                                 0 if causal else None)
        return AttnState(out.transpose(1, 2), lse.transpose(1, 2))
    out, lse = _FusedBlock.apply(q, k, v, causal, scale, backend)
    return AttnState(out, lse)


def _offset_causal_by_blocks(q: Tensor, k: Tensor, v: Tensor, delta: int, scale: float,
                             backend: str) -> AttnState:
    """Causal attention with key j visible from query i iff j <= i + delta, from square-causal
    and unmasked blocks only. Rows [0, i0) see nothing; rows [i0, i1) see a full prefix of
    i0 + delta keys plus a square causal block; rows [i1, Tq) see every key."""
    tq, tk = q.shape[1], k.shape[1]
    if tq == 0:   # no part below: the empty result (a one-token sequence's first zigzag chunk, say)
        return _block(q, k, v, False, scale, backend)
    i0 = min(max(0, -delta), tq)
    i1 = min(max(tk - delta, i0), tq)       # row i < tk - delta still has unseen keys (or just its last)
    parts_out, parts_lse = [], []
    if i0 > 0:
        b, _, hq, _ = q.shape
        parts_out.append(q.new_zeros(b, i0, hq, v.shape[-1]))
        parts_lse.append(torch.full((b, i0, hq), -math.inf, device=q.device))
    if i1 > i0:
        qb = q[:, i0:i1]
        band = _block(qb, k[:, i0 + delta:i1 + delta], v[:, i0 + delta:i1 + delta], True, scale, backend)
        if i0 + delta > 0:
            prefix = _block(qb, k[:, : i0 + delta], v[:, : i0 + delta], False, scale, backend)
            band = merge_two_attn_states(prefix.out, prefix.lse, band.out, band.lse)
        parts_out.append(band.out.to(q.dtype))
        parts_lse.append(band.lse)
    if i1 < tq:
        full = _block(q[:, i1:], k, v, False, scale, backend)
        parts_out.append(full.out)
        parts_lse.append(full.lse)
    if len(parts_out) == 1:
        return AttnState(parts_out[0], parts_lse[0])
    return AttnState(torch.cat(parts_out, dim=1), torch.cat(parts_lse, dim=1))


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, q_offset: int = 0,
                       k_offset: int = 0, scale: float | None = None, backend: AttnBackend = "auto") -> AttnState:
    """Attention of q over k/v that also returns the log-sum-exp.

    q: [B, Tq, Hq, D] or [Tq, Hq, D]; k: [B, Tk, Hkv, D]; v: [B, Tk, Hkv, Dv]; Hq % Hkv == 0.
    causal: mask by global positions `q_offset + i` (queries) and `k_offset + j` (keys).
    scale: default 1/sqrt(D).
    backend: "auto" (flash, else efficient on CUDA, else math), "math", "flash", "efficient".
    Returns AttnState(out [.., Tq, Hq, Dv] q.dtype, lse [.., Tq, Hq] fp32, natural log; -inf and
    out 0 on rows that see no key). Differentiable in q, k, v through out and lse.
    """
    check_qkv(q, k, v)
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    scale = resolve_scale(scale, q.shape[-1])
    backend = resolve_backend(backend, q, k, v)
    delta = int(q_offset) - int(k_offset)
    if backend == "math":
        out, lse = _math_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale,
                                 delta if causal else None)
        state = AttnState(out.transpose(1, 2), lse.transpose(1, 2))
    elif not causal:
        state = _block(q, k, v, False, scale, backend)
    else:
        state = _offset_causal_by_blocks(q, k, v, delta, scale, backend)
    if squeeze:
        state = AttnState(state.out.squeeze(0), state.lse.squeeze(0))
    return state
