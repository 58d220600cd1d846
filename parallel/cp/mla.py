"""Multi-head latent attention (MLA, DeepSeek-V2/V3/V4) with a latent paged cache, DCP decode and CP prefill.

Notation (DeepSeek-V3 paper, §2.1.1), per token, H heads:
    c_kv = RMSNorm(W_DKV h)[:r]          latent, r = kv_lora_rank (512)
    k_pe = RoPE((W_DKV h)[r:])           one RoPE key shared by all heads, d_r = qk_rope_head_dim (64)
    k_nope[h] = W_UK[h] c_kv             [d_n] (qk_nope_head_dim, 128)
    v[h]      = W_UV[h] c_kv             [d_v] (v_head_dim, 128)
    q[h] = [q_nope[h], RoPE(q_pe[h])]    [d_n + d_r]
    o[h] = softmax(scale * (q_nope[h] . k_nope[h] + q_pe[h] . k_pe)) @ v[h],  scale = (d_n + d_r)^-1/2
`kv_b_proj.weight` [H * (d_n + d_v), r] holds W_UK and W_UV per head (`split_kv_b`).

Absorbed decode: q_nope[h] . (W_UK[h] c_kv) = (W_UK[h]^T q_nope[h]) . c_kv, so with the latent
query q_lat[h] = W_UK[h]^T q_nope[h] [r] the scores read only the cache, which holds per token the
vector [c_kv, k_pe] (r + d_r = 576 values; DeepSeek's layout), and
    o_lat[h] = softmax(scale * [q_lat[h], q_pe[h]] . [c_kv, k_pe]) @ c_kv,   o[h] = W_UV[h] o_lat[h].
That is GQA with ONE kv head of dim r + d_r and v = its first r values: `MLACache.paged` is a
`PagedKVCache` whose v is the view k[..., :r], so the paged decode kernel (`paged.py`) and DCP
(`dcp.dcp_decode_attention`) run on it unchanged, and the kernel reads each cached token once.
fp8 caches keep one fp32 scale per token over the 576 values.

Prefill (non-absorbed): k = [k_nope[h], k_pe], v[h] up-projected for the local tokens, then the
ring / all-gather context-parallel attention of `ring.py` (`mla_prefill_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..comm import GroupLike
from .dcp import (DCPComm, PagedKVCache, _layout, _quantize_fp8, dcp_decode_attention, insert_slots, keep,
                  plan_dcp_decode, skip_free_slots)
from .ring import ring_attention
from .state import AttnState

if TYPE_CHECKING:
    from .triton_decode import LengthPlan


@dataclass(frozen=True)
class MLADims:
    """Head dims of an MLA layer (DeepSeek-V3 defaults)."""

    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def latent_dim(self) -> int:
        """Values cached per token: r + d_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.qk_head_dim ** -0.5


def split_kv_b(kv_b_weight: Tensor, heads: int, dims: MLADims) -> tuple[Tensor, Tensor]:
    """kv_b_proj.weight [H * (d_n + d_v), r] -> (W_UK [H, d_n, r], W_UV [H, d_v, r])."""
    expect = (heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank)
    if tuple(kv_b_weight.shape) != expect:
        raise ValueError(f"kv_b weight {tuple(kv_b_weight.shape)} must be {expect} for {heads} heads and {dims}")
    w = kv_b_weight.view(heads, dims.qk_nope_head_dim + dims.v_head_dim, dims.kv_lora_rank)
    return w[:, : dims.qk_nope_head_dim], w[:, dims.qk_nope_head_dim:]


# ---------------------------------------------------------------------------------------------
# cache


_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@dataclass
class MLACache:
    """One rank's latent paged cache: per token [c_kv (r), k_pe (d_r)], fp8 with one scale per token."""

    kv: Tensor
    """[num_blocks, block_size, 1, r + d_r]; fp32/bf16/fp16 or float8_e4m3fn."""
    kv_lora_rank: int
    scale: Tensor | None = None
    """[num_blocks, block_size, 1] fp32 when fp8."""

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, dims: MLADims = MLADims(), *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> "MLACache":
        kv = torch.zeros(num_blocks, block_size, 1, dims.latent_dim, dtype=dtype, device=device)
        scale = (torch.ones(num_blocks, block_size, 1, dtype=torch.float32, device=device)
                 if dtype == torch.float8_e4m3fn else None)
        return cls(kv, dims.kv_lora_rank, scale)

    def __post_init__(self) -> None:
        if self.kv.dim() != 4 or self.kv.shape[2] != 1 or not 0 < self.kv_lora_rank < self.kv.shape[-1]:
            raise ValueError(f"kv {tuple(self.kv.shape)} must be [num_blocks, block_size, 1, r + d_r] with "
                             f"0 < kv_lora_rank ({self.kv_lora_rank}) < last dim")
        if self.kv.dtype not in _CACHE_DTYPES:
            raise ValueError(f"latent cache dtype {self.kv.dtype} not supported; valid: "
                             f"{', '.join(str(d).replace('torch.', '') for d in _CACHE_DTYPES)}")
        fp8 = self.kv.dtype == torch.float8_e4m3fn
        if fp8 != (self.scale is not None):
            raise ValueError(f"an fp8 latent cache needs a scale [num_blocks, block_size, 1]; other dtypes take "
                             f"none (dtype {self.kv.dtype}, scale {None if self.scale is None else 'given'})")
        if fp8 and (tuple(self.scale.shape) != tuple(self.kv.shape[:3]) or self.scale.dtype != torch.float32):
            raise ValueError(f"an fp8 latent cache needs a float32 scale {tuple(self.kv.shape[:3])}, got "
                             f"{tuple(self.scale.shape)} {self.scale.dtype}")

    @property
    def block_size(self) -> int:
        return self.kv.shape[1]

    @property
    def paged(self) -> PagedKVCache:
        """The GQA view: one kv head, k = [c_kv, k_pe], v = c_kv = k[..., :r] (same memory)."""
        return PagedKVCache(self.kv, self.kv[..., : self.kv_lora_rank], self.scale, self.scale)


def mla_write_slots(cache: MLACache, c_kv: Tensor, k_pe: Tensor, slots: Tensor) -> None:
    """Store [c_kv, k_pe] of T tokens at cache slots [T] int64 (-1 = skip); fp8 quantizes per token.
    No host sync (`dcp.skip_free_slots`): a decode step's insert is captured with the step."""
    if slots.numel() == 0:
        return
    latent = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)                # [T, 1, r + d_r]
    idx, src, written = skip_free_slots(slots)
    # (block, offset) indexing, not a flat view: a strided cache (one layer's kv of a joint buffer) has none
    blk, off = idx // cache.block_size, idx % cache.block_size
    if cache.scale is not None:
        data, scale = _quantize_fp8(latent[src])
        bytes_ = cache.kv.view(torch.uint8)
        bytes_[blk, off] = keep(written, data.view(torch.uint8), bytes_[blk, off])
        cache.scale[blk, off] = keep(written, scale, cache.scale[blk, off])
    else:
        cache.kv[blk, off] = keep(written, latent[src].to(cache.kv.dtype), cache.kv[blk, off])


def mla_kv_insert(cache: MLACache, c_kv: Tensor, k_pe: Tensor, positions: Tensor, block_table: Tensor,
                  group: GroupLike = None, *, interleave: int = 1, pcp_group: GroupLike | None = None) -> Tensor:
    """Insert the latent KV of new tokens into this rank's DCP shard (tokens it owns only).

    c_kv: [T, r] (after the kv norm), k_pe: [T, d_r] (after RoPE), positions: [T] global,
    block_table: [T, max_blocks] or [max_blocks]. pcp_group: with PCP > 1, the cache is sharded
    over pcp * dcp ranks (as `dcp_kv_insert`). Returns the slots [T] int64 (-1 elsewhere, or not
    written: invalid on CUDA). ValueError (CPU tensors) for a position outside the table or a
    block id outside the cache."""
    r, dr = cache.kv_lora_rank, cache.kv.shape[-1] - cache.kv_lora_rank
    if c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.shape[1] != r or k_pe.shape[1] != dr \
            or c_kv.shape[0] != k_pe.shape[0] or positions.shape != c_kv.shape[:1]:
        raise ValueError(f"c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)}, positions {tuple(positions.shape)} "
                         f"must be [T, {r}], [T, {dr}], [T]")
    if c_kv.device != cache.kv.device:
        raise ValueError(f"c_kv on {c_kv.device} but the cache is on {cache.kv.device}")
    layout = _layout(group, cache.block_size, interleave, pcp_group)
    slots = insert_slots(layout, positions.to(c_kv.device), block_table.to(c_kv.device), cache.kv.shape[0])
    mla_write_slots(cache, c_kv, k_pe, slots)
    return slots


# ---------------------------------------------------------------------------------------------
# attention


def absorb_query(q_nope: Tensor, q_pe: Tensor, w_uk: Tensor) -> Tensor:
    """[W_UK[h]^T q_nope[h], q_pe[h]]: q_nope [..., H, d_n], q_pe [..., H, d_r], W_UK [H, d_n, r]
    -> [..., H, r + d_r] in q_nope's dtype (fp32 accumulation). ValueError for shapes that disagree
    (einsum would broadcast a one-head W_UK over every head)."""
    if (q_nope.dim() < 2 or w_uk.dim() != 3 or q_pe.shape[:-1] != q_nope.shape[:-1]
            or tuple(w_uk.shape[:2]) != tuple(q_nope.shape[-2:])):
        raise ValueError(f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)} must be [..., H, d] with the "
                         f"same leading dims and W_UK {tuple(w_uk.shape)} [H, d_n, r] with H and d_n of q_nope")
    q_lat = torch.einsum("...hn,hnr->...hr", q_nope.float(), w_uk.float())
    return torch.cat([q_lat, q_pe.float()], dim=-1).to(q_nope.dtype)


def mla_output(o_lat: Tensor, w_uv: Tensor) -> Tensor:
    """o[h] = W_UV[h] o_lat[h]: o_lat [..., H, r], W_UV [H, d_v, r] -> [..., H, d_v] fp32. ValueError
    for shapes that disagree (einsum would broadcast a one-head W_UV over every head)."""
    if o_lat.dim() < 2 or w_uv.dim() != 3 or w_uv.shape[0] != o_lat.shape[-2] or w_uv.shape[-1] != o_lat.shape[-1]:
        raise ValueError(f"o_lat {tuple(o_lat.shape)} must be [..., H, r] and W_UV {tuple(w_uv.shape)} [H, d_v, r] "
                         f"with the same H and r")
    return torch.einsum("...hr,hvr->...hv", o_lat.float(), w_uv.float())


def mla_decode_attention(q_nope: Tensor, q_pe: Tensor, cache: MLACache, w_uk: Tensor, w_uv: Tensor,
                         block_table: Tensor, seq_lens: Tensor, group: GroupLike = None, *, interleave: int = 1,
                         comm: DCPComm = "ag_rs", scale: float | None = None, backend: str = "auto",
                         return_lse: bool = False, pcp_group: GroupLike | None = None,
                         plan: "LengthPlan | None" = None) -> Tensor | AttnState:
    """One absorbed MLA decode step over a DCP-sharded latent cache.

    q_nope: [S, H_local, d_n], q_pe: [S, H_local, d_r] (RoPE applied); W_UK [H_local, d_n, r],
    W_UV [H_local, d_v, r] (this rank's heads); seq_lens [S] global lengths with the new token
    inserted. scale: default (d_n + d_r)^-1/2. pcp_group: with PCP > 1, the PCP group (the cache
    is sharded over pcp * dcp ranks; partial results merged over both, `dcp_decode_attention`). plan:
    this rank's length plan (`plan_mla_decode`, once a decode step for every layer). Returns o [S,
    H_local, d_v] in q_nope's dtype (or AttnState with the lse [S, H_local] fp32)."""
    if q_nope.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2] or w_uk.shape[0] != q_nope.shape[1] \
            or w_uv.shape[0] != q_nope.shape[1]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)} must be [S, H, d] and "
                         f"W_UK {tuple(w_uk.shape)} / W_UV {tuple(w_uv.shape)} [H, d, r] with the same H")
    if w_uk.shape[-1] != cache.kv_lora_rank or q_pe.shape[-1] != cache.kv.shape[-1] - cache.kv_lora_rank:
        raise ValueError(f"W_UK rank {w_uk.shape[-1]} / q_pe dim {q_pe.shape[-1]} do not match the cache "
                         f"(r = {cache.kv_lora_rank}, d_r = {cache.kv.shape[-1] - cache.kv_lora_rank})")
    if w_uk.dim() != 3 or w_uv.dim() != 3 or w_uk.shape[1] != q_nope.shape[-1] \
            or w_uv.shape[-1] != cache.kv_lora_rank:
        raise ValueError(f"W_UK {tuple(w_uk.shape)} must be [H, d_n = {q_nope.shape[-1]}, r] and W_UV "
                         f"{tuple(w_uv.shape)} [H, d_v, r = {cache.kv_lora_rank}]")
    if scale is None:
        scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    q = absorb_query(q_nope, q_pe, w_uk)                                    # [S, H, r + d_r]
    state = dcp_decode_attention(q, cache.paged, block_table, seq_lens, group, interleave=interleave, comm=comm,
                                 scale=scale, return_lse=True, backend=backend, pcp_group=pcp_group, plan=plan)
    out = mla_output(state.out, w_uv).to(q_nope.dtype)
    return AttnState(out, state.lse) if return_lse else out


def plan_mla_decode(q_nope: Tensor, cache: MLACache, block_table: Tensor, seq_lens: Tensor, group: GroupLike = None,
                    *, interleave: int = 1, backend: str = "auto", pcp_group: GroupLike | None = None) -> "LengthPlan":
    """`mla_decode_attention`'s length plan on this rank (`dcp.plan_dcp_decode` for its absorbed queries:
    [S, H_local, r + d_r] in q_nope's dtype; no value of q_nope is read). Once a decode step, after the
    lengths are written; every layer's call takes it (plan=)."""
    if q_nope.dim() != 3:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} must be [S, H_local, d_n], as mla_decode_attention's")
    absorbed = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], cache.kv.shape[-1])
    return plan_dcp_decode(absorbed, cache.paged, block_table, seq_lens, group, interleave=interleave,
                           backend=backend, pcp_group=pcp_group)


def mla_prefill_attention(q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor,
                          group: GroupLike = None, *, causal: bool = True, scale: float | None = None,
                          variant: str = "ring", return_lse: bool = False) -> Tensor | AttnState:
    """Non-absorbed MLA over a zigzag-sharded sequence (context-parallel prefill, `ring_attention`).

    q_nope [B, T, H, d_n], q_pe [B, T, H, d_r] (RoPE applied), c_kv [B, T, r], k_pe [B, T, d_r]
    (RoPE applied): this rank's zigzag shard. Returns o [B, T, H, d_v] in q's dtype."""
    if q_nope.dim() != 4 or c_kv.dim() != 3 or k_pe.dim() != 3:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} must be [B, T, H, d_n]; c_kv {tuple(c_kv.shape)} and k_pe "
                         f"{tuple(k_pe.shape)} [B, T, d]")
    heads = q_nope.shape[2]
    k_nope = torch.einsum("btr,hnr->bthn", c_kv, w_uk.to(c_kv.dtype))
    v = torch.einsum("btr,hvr->bthv", c_kv, w_uv.to(c_kv.dtype))
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return ring_attention(q, k.to(q.dtype), v.to(q.dtype), group, causal=causal, scale=scale, variant=variant,
                          return_lse=return_lse)


def mla_reference(q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor, *,
                  causal: bool = True, scale: float | None = None, q_offset: int = 0) -> Tensor:
    """The paper's equations in fp64 (tests): q [B, Tq, H, d], c_kv [B, Tk, r], k_pe [B, Tk, d_r];
    query i sits at position q_offset + i, key j at j. Returns o [B, Tq, H, d_v] fp64."""
    qn, qp, c, kp = (x.double() for x in (q_nope, q_pe, c_kv, k_pe))
    k_nope = torch.einsum("btr,hnr->bthn", c, w_uk.double())
    v = torch.einsum("btr,hvr->bthv", c, w_uv.double())
    if scale is None:
        scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    s = (torch.einsum("bihn,bjhn->bhij", qn, k_nope) + torch.einsum("bihd,bjd->bhij", qp, kp)) * scale
    if causal:
        i = torch.arange(s.shape[2]).unsqueeze(1) + q_offset
        j = torch.arange(s.shape[3]).unsqueeze(0)
        s = s.masked_fill(j > i, float("-inf"))
    return torch.einsum("bhij,bjhv->bihv", s.softmax(-1), v)
