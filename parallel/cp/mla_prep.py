"""Fused MLA prep: query RMSNorm + RoPE, latent KV norm + RoPE + fp8 quantization + DCP cache insert.

The unfused torch sequence (`mla_prep_reference`, the definition) for T new tokens:
    q      [T, H, d_n + d_r] (the projected query): optional per-head RMSNorm (weight [d_n + d_r]),
           then RoPE on q[..., d_n:]                                 -> q_out, in q's dtype
    kv     [T, r + d_r] (kv_a_proj output): RMSNorm of kv[:, :r] (weight [r], DeepSeek's
           kv_a_layernorm), RoPE on kv[:, r:]                         -> c_kv, k_pe in kv's dtype
    cache  `mla.mla_kv_insert(cache, c_kv, k_pe, positions, block_table, layout)`: only the tokens
           this DCP rank owns; fp8 caches store e4m3 with one fp32 scale per token (fp8_token).
RMSNorm: x * rsqrt(mean(x^2) + eps) * w in fp32, rounded to the input dtype. RoPE: pairs
(2i, 2i+1) rotated by the angle table `cos_sin [max_pos, d_r]` (cos in the first half, sin in
the second; `rope_table`) gathered by position, in fp32, rounded to the input dtype.

`mla_prep(..., backend="triton")` does all of it in one kernel (`triton_mla_prep.py`, op
"cp.mla_prep"): the same fp32 operations in the same order, except the mean of squares, which
sums in a different order, so a norm may differ by one fp32 ulp before the rounding to the
input dtype (and, rarely, one step of that dtype or of e4m3). Everything else is bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import impl
from .dcp import DCPLayout, insert_slots
from .mla import MLACache, mla_write_slots


def rope_table(max_pos: int, rope_dim: int, theta: float = 10000.0, *,
               device: torch.device | str | None = None) -> Tensor:
    """[max_pos, d_r] fp32: cos(p * theta^(-2i/d_r)) in [:, :d_r/2], sin in [:, d_r/2:]."""
    if rope_dim < 2 or rope_dim % 2 or max_pos < 0:   # (an odd d_r gave a table d_r + 1 wide)
        raise ValueError(f"rope_dim ({rope_dim}) must be even and >= 2, max_pos ({max_pos}) >= 0")
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = (torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq).to(torch.float32)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


def rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (2i, 2i+1) of x [..., d_r] by cos/sin [..., d_r/2] (broadcast) in fp32 -> x's dtype."""
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@dataclass
class MLAPrep:
    """Result of the prep: the query ready for `absorb_query` and the slots written ([T], -1 elsewhere)."""

    q: Tensor
    slots: Tensor


MLA_PREP = impl.Op("cp.mla_prep", [
    impl.Impl("triton", impl.triton_kernel(impl.forward_only)),
    impl.Impl("torch"),
])


def _check(q: Tensor, kv: Tensor, positions: Tensor, cache: MLACache, cos_sin: Tensor, block_table: Tensor,
           q_norm_weight: Tensor | None, kv_norm_weight: Tensor, nope: int) -> None:
    r = cache.kv_lora_rank
    dr = cache.kv.shape[-1] - r
    t = q.shape[0] if q.dim() == 3 else -1
    if q.dim() != 3 or q.shape[-1] != nope + dr:
        raise ValueError(f"q {tuple(q.shape)} must be [T, heads, {nope} + {dr}]")
    if tuple(kv.shape) != (t, r + dr) or tuple(positions.shape) != (t,):
        raise ValueError(f"kv {tuple(kv.shape)} and positions {tuple(positions.shape)} must be [{t}, {r + dr}], [{t}]")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != dr or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} {cos_sin.dtype} must be float32 [max_pos, {dr}]")
    if tuple(kv_norm_weight.shape) != (r,) or (q_norm_weight is not None and
                                              tuple(q_norm_weight.shape) != (nope + dr,)):
        raise ValueError(f"kv_norm_weight {tuple(kv_norm_weight.shape)} must be [{r}] and q_norm_weight "
                         f"{None if q_norm_weight is None else tuple(q_norm_weight.shape)} [{nope + dr}] or None")
    for name, x in (("positions", positions), ("block_table", block_table)):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:   # (truncated, or the kernel)
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != t:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [T = {t}, max_blocks] (each token's row)")
    if dr % 2:
        raise ValueError(f"rope dim ({dr}) must be even")
    if positions.device.type == "cpu" and t > 0:
        if int(positions.max()) >= cos_sin.shape[0] or int(positions.min()) < 0:
            raise ValueError(f"positions in [{int(positions.min())}, {int(positions.max())}] outside the rope "
                             f"table's [0, {cos_sin.shape[0]})")


def mla_prep_reference(q: Tensor, kv: Tensor, positions: Tensor, cache: MLACache, block_table: Tensor,
                       cos_sin: Tensor, kv_norm_weight: Tensor, *, layout: DCPLayout, q_norm_weight: Tensor | None,
                       nope: int, eps: float) -> MLAPrep:
    """The unfused torch sequence (module docstring)."""
    r, half = cache.kv_lora_rank, cos_sin.shape[1] // 2
    pos = positions.long()
    # (CUDA, no host check: a position outside the rope table reads row 0 and gets NaN angles, so
    # its query's rope part is NaN and its latent is not written; CPU tensors raised in _check)
    in_rope = (pos >= 0) & (pos < cos_sin.shape[0])
    cs = torch.where(in_rope[:, None], cos_sin[torch.where(in_rope, pos, 0)], torch.nan)    # [T, d_r]
    cos, sin = cs[:, :half], cs[:, half:]
    if q_norm_weight is not None:
        q = _rms(q, q_norm_weight, eps)
    q_out = torch.cat([q[..., :nope], rope_pairs(q[..., nope:], cos[:, None], sin[:, None])], dim=-1)
    c_kv = _rms(kv[:, :r], kv_norm_weight, eps)
    k_pe = rope_pairs(kv[:, r:], cos, sin)
    slots = insert_slots(layout, positions, block_table, cache.kv.shape[0])    # -1: elsewhere / invalid
    slots = torch.where(in_rope, slots, -1)
    mla_write_slots(cache, c_kv, k_pe, slots)
    return MLAPrep(q_out, slots)


def mla_prep(q: Tensor, kv: Tensor, positions: Tensor, cache: MLACache, block_table: Tensor, cos_sin: Tensor,
             kv_norm_weight: Tensor, *, layout: DCPLayout | None = None, q_norm_weight: Tensor | None = None,
             nope: int = 128, eps: float = 1e-6, backend: str = "auto") -> MLAPrep:
    """Prepare the new tokens of an MLA layer and insert their latent KV into this rank's cache.

    q: [T, H, nope + d_r]; kv: [T, r + d_r]; positions: [T] int global; block_table: [T, max_blocks]
    (each token's sequence row); cos_sin: `rope_table(...)`; layout: this rank's DCP layout
    (default one rank). Returns MLAPrep(q [T, H, nope + d_r] in q's dtype, slots [T] int64).
    ValueError for CPU tensors with a position outside the block table or the rope table or a
    block id outside the cache. On CUDA (no host sync) such a token is not written (slot -1) and,
    for a position outside the rope table, its query's rope part is NaN, so its decode row is."""
    layout = DCPLayout(size=1, rank=0, block_size=cache.block_size) if layout is None else layout
    if layout.block_size != cache.block_size:
        raise ValueError(f"layout.block_size ({layout.block_size}) must equal the cache's block size "
                         f"({cache.block_size})")
    _check(q, kv, positions, cache, cos_sin, block_table, q_norm_weight, kv_norm_weight, nope)
    if block_table.device.type == "cpu" and positions.device.type == "cpu":
        insert_slots(layout, positions, block_table, cache.kv.shape[0])   # ValueError: bad table or position
    chosen = MLA_PREP.resolve(backend, device=q.device, needs_grad=impl.grad_needed(q, kv))
    if chosen == "triton":
        from .triton_mla_prep import mla_prep_triton

        return MLAPrep(*mla_prep_triton(q, kv, positions, cache, block_table, cos_sin, kv_norm_weight, layout,
                                        q_norm_weight, nope, eps))
    return mla_prep_reference(q, kv, positions, cache, block_table, cos_sin, kv_norm_weight, layout=layout,
                              q_norm_weight=q_norm_weight, nope=nope, eps=eps)
