"""Local permutation around the EP collective: where each (token, expert) pair lands.

Everything here runs on one rank, without communication. `plan_layout` turns the local expert
ids of the rows a rank holds into positions in the layout the expert GEMMs consume:

- ``contiguous``: rows grouped by local expert; expert ``e`` owns rows
  ``offsets[e] : offsets[e] + counts[e]`` and its block is padded with zero rows up to a
  multiple of ``align`` (padding rows have ``expert_ids == -1``, as DeepGEMM's m-grouped
  contiguous kernels expect).
- ``slab``: ``[E_local, capacity, H]``, expert ``e``'s rows first in ``slab[e]``, the rest zero;
  fixed shapes for CUDA graphs. More than ``capacity`` rows is an error naming the capacity
  needed, unless the caller chose ``drop_policy="drop"`` (then the last arrivals are dropped).

Within an expert, rows keep the order of the rows they come from, then the top-k slot: by
source rank, then token index, then k. The two data movers, `gather_rows` (permute) and
`gather_reduce` (weighted unpermute, fp32 accumulation), have a torch reference here and a
Triton kernel (`parallel.ep.triton_permute`) used for CUDA tensors (ops "ep.gather_rows" and
"ep.gather_reduce" of `parallel.impl`; MEGAPAR_EP_TRITON=0 turns them off). `plan_layout` synchronizes the device only for a host value it was not given; the
Triton movers never do (the torch ones use `nonzero`, a sync on CUDA without Triton).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from .. import impl
from .words import as_words, word_size

LayoutName = Literal["contiguous", "slab"]
LAYOUTS: tuple[str, ...] = ("contiguous", "slab")
DROP_POLICIES: tuple[str, ...] = ("drop",)


@dataclass
class LayoutPlan:
    """Where the pairs of `n` rows x `K` top-k slots go in a layout of `R` rows.

    `R` is the number of layout rows: the padded total for ``contiguous``, ``E_local * capacity``
    for ``slab`` (whose layout tensors are views of shape ``[E_local, capacity, ...]``).
    """

    pair_pos: torch.Tensor  # [n, K] int64: layout row of pair (row, k); -1 = no local expert or dropped
    row_src: torch.Tensor  # [R] int64: source row of each layout row; -1 = padding
    row_slot: torch.Tensor  # [R] int64: top-k slot k of each layout row; -1 = padding
    expert_ids: torch.Tensor  # [R] int32: local expert of each layout row; -1 = padding
    counts: torch.Tensor  # [E_local] int32: rows per local expert (after drops, without padding)
    offsets: torch.Tensor  # [E_local + 1] int32: first layout row of each expert's block; offsets[-1] = R
    layout: str
    capacity: int | None  # slab only
    num_dropped: int | None  # slab with drop_policy="drop": pairs dropped (None when not counted on host)

    @property
    def num_rows(self) -> int:
        return self.row_src.shape[0]

    def shape(self, *trailing: int) -> tuple[int, ...]:
        """Shape of a layout tensor with the given trailing dims."""
        if self.layout == "slab":
            return (self.counts.shape[0], self.capacity, *trailing)  # type: ignore[return-value]
        return (self.num_rows, *trailing)


def check_layout_args(layout: str, align: int, capacity: int | None, drop_policy: str | None) -> None:
    """ValueError for a bad layout choice; shared by `plan_layout` and `make_dispatcher`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not known; valid layouts: {', '.join(LAYOUTS)}")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align ({align!r}) must be an int >= 1")
    if drop_policy is not None and drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r} is not known; valid: None (overflow is an error), "
                         + ", ".join(repr(p) for p in DROP_POLICIES))
    if layout == "slab":
        if capacity is None or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"layout='slab' needs capacity >= 1 rows per expert, got capacity={capacity!r}")
        if align != 1:
            raise ValueError(f"align ({align}) applies to layout='contiguous' only; the slab has fixed capacity")
    else:
        if capacity is not None:
            raise ValueError(f"capacity ({capacity}) applies to layout='slab' only (layout={layout!r})")
        if drop_policy is not None:
            raise ValueError(f"drop_policy ({drop_policy!r}) applies to layout='slab' only (layout={layout!r})")


def count_values(key: torch.Tensor, num_bins: int) -> torch.Tensor:
    """key: [N] int64 in [0, num_bins) -> [num_bins] int64 counts. Unlike torch.bincount on
    CUDA, no device-to-host sync (bincount reads the max first)."""
    counts = torch.zeros(num_bins, dtype=torch.int64, device=key.device)
    return counts.scatter_add_(0, key, torch.ones_like(key))


def local_expert_ids(topk_ids: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    """topk_ids: [n, K] int, global expert ids, -1 = none -> [n, K] int64 ids local to `rank`, -1 elsewhere."""
    ids = topk_ids.long()
    first = rank * experts_per_rank
    mine = (ids >= first) & (ids < first + experts_per_rank)
    return torch.where(mine, ids - first, torch.full_like(ids, -1))


def plan_layout(local_ids: torch.Tensor, num_local_experts: int, *, layout: str = "contiguous", align: int = 1,
                capacity: int | None = None, drop_policy: str | None = None,
                counts_host: list[int] | None = None) -> LayoutPlan:
    """Positions of the pairs of `local_ids` in the chosen layout.

    local_ids: [n, K] int64 (int32 is widened), local expert of each (row, k) pair; -1 = not on this rank.
    counts_host: pairs per local expert when the caller already knows them on the host (the
    all-to-all count exchange does); otherwise they are read from the device once (one sync),
    except for a slab with a drop policy, which needs no host value at all.
    """
    check_layout_args(layout, align, capacity, drop_policy)
    n, k = local_ids.shape
    device = local_ids.device
    num_e = num_local_experts
    flat = local_ids.reshape(-1).long()  # (the scatters below take int64 indices and values)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_e))  # invalid pairs sort last
    sorted_key, order = torch.sort(key, stable=True)  # pairs by expert, then (row, k)
    all_counts = count_values(key, num_e + 1)  # [E_local + 1] int64
    counts = all_counts[:num_e]
    starts = torch.cumsum(all_counts, 0) - all_counts  # exclusive prefix sum
    rank_in_expert = torch.empty_like(key)
    rank_in_expert[order] = torch.arange(n * k, device=device) - starts[sorted_key]

    num_dropped: int | None = None
    if layout == "slab":
        assert capacity is not None
        if drop_policy is None:
            needed = max(counts_host) if counts_host is not None else (int(counts.max()) if num_e else 0)
            if needed > capacity:
                raise ValueError(f"slab capacity ({capacity}) is too small: an expert received {needed} rows; "
                                 f"pass capacity >= {needed}, or drop_policy='drop' to drop the overflow")
        elif counts_host is not None:
            num_dropped = sum(max(0, c - capacity) for c in counts_host)
        kept = (key < num_e) & (rank_in_expert < capacity)
        pos = key * capacity + rank_in_expert
        num_rows = num_e * capacity
        kept_counts = counts.clamp(max=capacity)
        block_starts = torch.arange(num_e + 1, device=device) * capacity
    else:
        host = counts_host if counts_host is not None else counts.tolist()
        padded_host = [-(-c // align) * align for c in host]
        num_rows = sum(padded_host)
        padded = torch.tensor(padded_host, dtype=torch.int64).to(device, non_blocking=True) if align > 1 else counts
        block_starts = torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])
        kept = key < num_e
        pos = block_starts[key.clamp(max=num_e - 1)] + rank_in_expert
        kept_counts = counts

    pos = torch.where(kept, pos, torch.full_like(pos, -1))
    # scatter kept pairs into the layout rows; dropped/invalid ones land in a spare last row
    # (no boolean indexing: that would sync the device)
    target = torch.where(kept, pos, torch.full_like(pos, num_rows))
    pair = torch.arange(n * k, device=device)
    row_src = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device).scatter_(0, target, pair // k)
    row_slot = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device).scatter_(0, target, pair % k)
    expert_ids = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device).scatter_(0, target, key)
    row_src, row_slot, expert_ids = row_src[:num_rows], row_slot[:num_rows], expert_ids[:num_rows].to(torch.int32)
    return LayoutPlan(
        pair_pos=pos.view(n, k),
        row_src=row_src,
        row_slot=row_slot,
        expert_ids=expert_ids,
        counts=kept_counts.to(torch.int32),
        offsets=block_starts.to(torch.int32),
        layout=layout,
        capacity=capacity,
        num_dropped=num_dropped,
    )


# ---------------------------------------------------------------------------------------------
# Data movers: torch reference + Triton on CUDA.


def _ep_triton_on(f: impl.Facts) -> impl.Unusable | None:
    if os.environ.get("MEGAPAR_EP_TRITON", "1") == "0":
        return impl.Unusable("turned off by MEGAPAR_EP_TRITON=0")
    return None


def _unit_stride(f: impl.Facts) -> impl.Unusable | None:
    return None if f.unit_stride else impl.Unusable("the kernel needs rows with unit last stride")


_TRITON_MOVER = impl.all_of(impl.needs_cuda_tensor, _ep_triton_on, _unit_stride, impl.needs_triton)
GATHER_ROWS = impl.Op("ep.gather_rows", [impl.Impl("triton", _TRITON_MOVER), impl.Impl("torch")])
GATHER_REDUCE = impl.Op("ep.gather_reduce", [impl.Impl("triton", _TRITON_MOVER), impl.Impl("torch")])


def gather_rows_torch(src: torch.Tensor, idx: torch.Tensor, row_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference permute. src: [N, C] any dtype; idx: [M] int, -1 = zero row;
    row_scale: [M] fp32 or None (multiplies each output row, in fp32); out: [M, C] to write
    into or None -> [M, C] in src's dtype."""
    moved = src
    if row_scale is None and src.dim() == 2 and src.stride(-1) == 1 and src.shape[1] > 0:
        moved = as_words(src, word_size(src, widest=8))  # whole words, whatever the payload dtype
    if src.shape[0] == 0:
        rows = moved.new_zeros((idx.shape[0], moved.shape[1]))
    else:
        rows = moved.index_select(0, idx.clamp(min=0))
    padding = (idx < 0).nonzero().reshape(-1)
    rows.index_fill_(0, padding, 0)  # exact zeros whatever src row 0 holds
    rows = rows.view(torch.uint8).view(src.dtype) if moved is not src else rows
    if row_scale is not None:
        rows = (rows.float() * row_scale[:, None]).to(src.dtype)
    return rows if out is None else out.copy_(rows)


def gather_reduce_torch(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference weighted unpermute: out[m] = sum_k weights[m, k] * src[idx[m, k]] over idx >= 0,
    accumulated in fp32. src: [N, C] float; idx: [M, K] int, -1 = skip; weights: [M, K] fp32 or
    None (= 1) -> [M, C] in `out_dtype` (default src's dtype)."""
    out = torch.zeros(idx.shape[0], src.shape[1], dtype=torch.float32, device=src.device)
    rows_of, slots = (idx >= 0).nonzero(as_tuple=True)  # valid (m, k) in m-major order
    if rows_of.numel():
        picked = src.index_select(0, idx[rows_of, slots]).float()  # skipped slots are never read
        if weights is not None:
            picked *= weights[rows_of, slots, None].float()
        out.index_add_(0, rows_of, picked)
    return out.to(out_dtype or src.dtype)


def scatter_add_rows(src: torch.Tensor, dst: torch.Tensor, num_out: int, row_scale: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The inverse-map form of `gather_reduce` (torch, for CPU): out[dst[j]] += row_scale[j] * src[j],
    accumulated in fp32. src: [N, C] float; dst: [N] int, -1 = skip; row_scale: [N] fp32 or None
    (= 1) -> [num_out, C] in `out_dtype` (default src's dtype). When every output row's sources
    are given by `gather_reduce`'s idx, the two agree, except that sums of more than two terms
    add in `dst` order: one pass over src and no [M, K, C] staging copy."""
    out = torch.zeros(num_out + 1, src.shape[1], dtype=torch.float32, device=src.device)
    if src.shape[0]:
        rows = src.float() if row_scale is None else src.float() * row_scale[:, None].float()
        out.index_add_(0, torch.where(dst >= 0, dst, torch.full_like(dst, num_out)), rows)
    out = out[:num_out]
    return out if (out_dtype or src.dtype) == torch.float32 else out.to(out_dtype or src.dtype)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, row_scale: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Permute: out[m] = src[idx[m]] (zero where idx == -1), times row_scale[m] when given.
    src: [N, C]; idx: [M] int; row_scale: [M] fp32 or None; out: [M, C] of src's dtype with
    unit last stride to write into (e.g. columns of a packed buffer) -> [M, C] in src's dtype."""
    unit = src.stride(-1) == 1 and (out is None or out.stride(-1) == 1)
    if GATHER_ROWS.resolve(device=src.device, unit_stride=unit) == "triton":
        from megapar.parallel.ep import triton_permute

        return triton_permute.gather_rows(src, idx, row_scale, out)
    return gather_rows_torch(src, idx, row_scale, out)


def gather_reduce(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpermute: out[m] = sum_k weights[m, k] * src[idx[m, k]] over idx >= 0, fp32 accumulation.
    src: [N, C] float; idx: [M, K] int (-1 = skip); weights: [M, K] fp32 or None -> [M, C]."""
    if GATHER_REDUCE.resolve(device=src.device, unit_stride=src.stride(-1) == 1) == "triton":
        from megapar.parallel.ep import triton_permute

        return triton_permute.gather_reduce(src, idx, weights, out_dtype)
    return gather_reduce_torch(src, idx, weights, out_dtype)
