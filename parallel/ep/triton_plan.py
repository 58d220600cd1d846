"""One-launch device plan for decode sizes (the Triton form of `parallel.ep.static.plan_static_torch`).

A single program walks the T*K pairs twice in blocks of BLOCK: first it histograms them by
local slot (a [BLOCK, S] one-hot summed over the block), then, with the exclusive prefix sum of
the counts as each slot's running write position, it places every pair: its row is the slot's
running position plus the number of earlier pairs of the same slot in the block (an exclusive
cumulative sum of the one-hot down the block), which keeps (token, k) order inside a slot, as
the stable sort of the reference does. One program is right for decode, where there are a few
hundred pairs and the launch is what costs; `plan_static` sends larger counts to the torch plan.
The block count is a compile-time constant (one specialization per decode size; the Triton
interpreter cannot loop to a run-time bound).
Imported only when used (CUDA, or the Triton interpreter in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapar.parallel.ep.static import StaticPlan


@triton.jit
def _load_ids(ids_ptr, offs, live):
    """Expert ids as int32; an int64 id outside int32 is clamped first (to -2 or int32 max: still out
    of range, counted as bad) rather than wrapped onto a valid slot by the narrowing."""
    return tl.minimum(tl.maximum(tl.load(ids_ptr + offs, mask=live, other=-1), -2), 2147483647).to(tl.int32)


@triton.jit
def _plan_kernel(ids_ptr, pair_pos_ptr, row_token_ptr, counts_ptr, offsets_ptr, bad_ptr,
                 num_pairs, K, first_slot, num_slots, num_slots_total,
                 S_POW2: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr, COUNT_BAD: tl.constexpr):
    slots = tl.arange(0, S_POW2)
    counts = tl.zeros([S_POW2], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(NUM_BLOCKS):  # pass 1: pairs per slot
        offs = b * BLOCK + tl.arange(0, BLOCK)
        live = offs < num_pairs
        gid = _load_ids(ids_ptr, offs, live)
        if COUNT_BAD:
            bad += (live & ((gid < -1) | (gid >= num_slots_total))).to(tl.int32)
        local = gid - first_slot
        mine = live & (gid >= 0) & (gid < num_slots_total) & (local >= 0) & (local < num_slots)
        key = tl.where(mine, local, S_POW2)  # matches no slot column
        onehot = (key[:, None] == slots[None, :]).to(tl.int32)
        counts += tl.sum(onehot, 0)
    ends = tl.cumsum(counts, 0)
    running = ends - counts  # exclusive prefix sum: each slot's first row
    tl.store(counts_ptr + slots, counts, mask=slots < num_slots)
    tl.store(offsets_ptr + slots, running, mask=slots < num_slots)
    valid_rows = tl.sum(counts, 0)
    tl.store(offsets_ptr + num_slots, valid_rows)
    if COUNT_BAD:
        tl.atomic_add(bad_ptr, tl.sum(bad, 0))
    for b in range(NUM_BLOCKS):  # pass 2: each pair's row
        offs = b * BLOCK + tl.arange(0, BLOCK)
        live = offs < num_pairs
        gid = _load_ids(ids_ptr, offs, live)
        local = gid - first_slot
        mine = live & (gid >= 0) & (gid < num_slots_total) & (local >= 0) & (local < num_slots)
        key = tl.where(mine, local, S_POW2)
        hit = key[:, None] == slots[None, :]
        onehot = hit.to(tl.int32)
        before = tl.cumsum(onehot, 0) - onehot  # earlier pairs of the same slot in this block
        row = tl.sum(tl.where(hit, before + running[None, :], 0), 1)
        tl.store(pair_pos_ptr + offs, tl.where(mine, row, -1).to(tl.int64), mask=live)
        tl.store(row_token_ptr + row, (offs // K).to(tl.int64), mask=mine)
        running += tl.sum(onehot, 0)
    for b in range(NUM_BLOCKS):  # rows after the last block: unused
        offs = b * BLOCK + tl.arange(0, BLOCK)
        tl.store(row_token_ptr + offs, tl.full([BLOCK], -1, tl.int64), mask=(offs >= valid_rows) & (offs < num_pairs))


def plan_static(topk_ids: torch.Tensor, num_slots: int, first_slot: int, num_slots_total: int,
                bad_ids: torch.Tensor | None) -> StaticPlan:
    """Same arguments and result as `parallel.ep.static.plan_static_torch`; one launch."""
    t, k = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.contiguous()
    n = t * k
    pair_pos = torch.empty((t, k), dtype=torch.int64, device=device)
    row_token = torch.empty(n, dtype=torch.int64, device=device)
    counts = torch.empty(num_slots, dtype=torch.int32, device=device)
    offsets = torch.empty(num_slots + 1, dtype=torch.int32, device=device)
    s_pow2 = triton.next_power_of_2(max(num_slots, 2))
    block = max(16, min(128, 8192 // s_pow2))  # the [BLOCK, S] one-hot stays in registers
    _plan_kernel[(1,)](ids, pair_pos, row_token, counts, offsets, bad_ids if bad_ids is not None else counts,
                       n, k, first_slot, num_slots, num_slots_total,
                       S_POW2=s_pow2, BLOCK=block, NUM_BLOCKS=triton.cdiv(n, block), COUNT_BAD=bad_ids is not None, num_warps=4)
    return StaticPlan(pair_pos=pair_pos, row_token=row_token, counts=counts, offsets=offsets)
