"""Device-driven expert dispatch: static shapes, no host synchronization, CUDA-graph capturable.

The host-synced `Dispatcher` (parallel.ep.dispatch) learns every split size on the host (one
census per dispatch) so that its layout holds exactly the rows received. This module is the
other design: every shape is fixed by the token count alone, and counts and offsets stay on
the device, so a decode step can be captured in a CUDA graph and replayed.

Two pieces:

- `plan_static(topk_ids, num_slots, first_slot)`: the permutation of the T*K (token, top-k)
  pairs into rows grouped by local expert slot. The layout always has T*K rows (the upper
  bound); slot e owns rows ``offsets[e] : offsets[e] + counts[e]``, and the rows after the last
  slot's block are unused (their token index is -1: a gather writes zeros there, and the
  grouped GEMMs, which size their grid from T*K and read the counts on the device, never
  compute them). Within a slot, rows keep (token, k) order, as in the host-synced layout.
  One Triton launch on CUDA for decode sizes (`parallel.ep.triton_plan`); a sort-based torch
  version (also sync-free) otherwise and on CPU, where it is the reference.
- Transports, which decide which tokens this rank's experts see and how their partial outputs
  come back (`DeviceTransport`):
  - `LocalTransport`: EP = 1; nothing moves.
  - `ReplicatedTransport`: every EP rank holds the same tokens; partial outputs are
    all-reduced (one collective of fixed shape).
  - `AllGatherTransport`: each rank brings up to `max_tokens` tokens; the padded tokens and
    their routing are all-gathered (one fixed-size collective), every rank runs its experts on
    all of them, and the fp32 partial sums are reduce-scattered back. A rank with no tokens
    takes part with the same shapes, so ranks stay in lockstep by construction.
  A device-initiated transport (NVSHMEM low-latency) implements the same two methods.

Ids: global slot ids in [0, num_slots_total) or -1 (no expert). Ids outside that range are
treated as -1 and counted into a device-side flag (`bad_ids`, int32 [1]) that the caller reads
when it is allowed to synchronize (`raise_on_bad_ids`): checking them on the host would cost
the sync this module exists to avoid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megapar.parallel import comm, impl

# The single-launch Triton plan serves up to this many (token, k) pairs; above it the sort-based
# torch plan (a few launches, still sync-free) is as fast relative to the GEMMs it feeds.
TRITON_PLAN_MAX_PAIRS = 4096


@dataclass
class StaticPlan:
    """Where the T*K pairs go. R = T*K layout rows (static)."""

    pair_pos: torch.Tensor  # [T, K] int64: layout row of pair (t, k); -1 = not on this rank / invalid
    row_token: torch.Tensor  # [R] int64: token of each layout row; -1 = unused row (after the last block)
    counts: torch.Tensor  # [S] int32: rows per local slot
    offsets: torch.Tensor  # [S + 1] int32: first row of each slot's block; offsets[S] = valid rows

    @property
    def num_rows(self) -> int:
        return self.row_token.shape[0]


def _check_ids_arg(topk_ids: torch.Tensor, num_slots: int, first_slot: int, num_slots_total: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids dtype {topk_ids.dtype} is not int32 or int64")
    if num_slots < 1 or first_slot < 0 or first_slot + num_slots > num_slots_total:
        raise ValueError(f"local slots [{first_slot}, {first_slot + num_slots}) must lie in "
                         f"[0, num_slots_total={num_slots_total})")


PLAN = impl.Op("ep.plan_static", [
    impl.Impl("triton", impl.triton_kernel()),
    impl.Impl("torch"),
])


def plan_static(topk_ids: torch.Tensor, num_slots: int, *, first_slot: int = 0, num_slots_total: int | None = None,
                bad_ids: torch.Tensor | None = None, backend: str = "auto") -> StaticPlan:
    """Group the pairs of `topk_ids` by local slot, on the device (see the module docstring).

    topk_ids: [T, K] int32/int64 global slot ids, -1 = no expert. num_slots: S, slots of this
    rank, ids [first_slot, first_slot + S). num_slots_total: valid ids are [0, this) (default
    first_slot + S). bad_ids: int32 [1] to which the number of ids outside [-1, num_slots_total)
    is added (they are skipped). backend: "auto" | "triton" | "torch".
    """
    total = first_slot + num_slots if num_slots_total is None else num_slots_total
    _check_ids_arg(topk_ids, num_slots, first_slot, total)
    if bad_ids is not None and (bad_ids.shape != (1,) or bad_ids.dtype != torch.int32):
        raise ValueError(f"bad_ids must be an int32 [1] tensor, got {bad_ids.dtype}{tuple(bad_ids.shape)}")
    chosen = PLAN.resolve(backend, device=topk_ids.device)
    if chosen == "triton" and (backend == "triton" or topk_ids.numel() <= TRITON_PLAN_MAX_PAIRS):
        from megapar.parallel.ep import triton_plan

        return triton_plan.plan_static(topk_ids, num_slots, first_slot, total, bad_ids)
    return plan_static_torch(topk_ids, num_slots, first_slot, total, bad_ids)


def plan_static_torch(topk_ids: torch.Tensor, num_slots: int, first_slot: int, num_slots_total: int,
                      bad_ids: torch.Tensor | None = None) -> StaticPlan:
    """The reference plan: a stable sort of the pairs by local slot. No host sync on any device."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    if bad_ids is not None:
        bad_ids += ((ids < -1) | (ids >= num_slots_total)).sum().to(torch.int32)
    local = ids - first_slot
    mine = (ids >= 0) & (ids < num_slots_total) & (local >= 0) & (local < num_slots)
    key = torch.where(mine, local, torch.full_like(local, num_slots))  # other ranks' and invalid pairs last
    sorted_key, order = torch.sort(key, stable=True)
    all_counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=ids.device)
    all_counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(num_slots + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(all_counts[:num_slots], 0, out=offsets[1:])
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=ids.device)
    pair_pos = torch.where(mine, pos, torch.full_like(pos, -1)).view(t, k)
    row_token = torch.where(sorted_key < num_slots, order // k, torch.full_like(order, -1))
    return StaticPlan(pair_pos=pair_pos, row_token=row_token, counts=all_counts[:num_slots].to(torch.int32),
                      offsets=offsets.to(torch.int32))


def raise_on_bad_ids(bad_ids: torch.Tensor, num_slots_total: int, what: str = "topk_ids") -> None:
    """Raise (and reset the flag) when a forward saw ids outside [-1, num_slots_total). Reads the
    flag on the host: a device sync; call it where the caller synchronizes anyway."""
    n = int(bad_ids.item())
    if n:
        bad_ids.zero_()
        raise ValueError(f"{what}: {n} id(s) outside [-1, {num_slots_total}) were routed nowhere "
                         f"(num_slots={num_slots_total}; -1 = no expert)")


# ---- transports ----------------------------------------------------------------------------------


@dataclass
class DeviceBatch:
    """The tokens this rank's experts see, with their routing (static shapes)."""

    x: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, K] global slot ids, -1 = none
    topk_weights: torch.Tensor  # [N, K] fp32
    num_tokens: int  # T: this rank's own tokens (the rows combine returns)


class DeviceTransport(Protocol):
    """How tokens reach this rank's experts and their partial outputs come back, with static
    shapes and no host sync. `combine` takes the fp32 partial sums [N, H] of the batch's rows
    (each row: sum over its pairs on this rank of w * expert output) and returns [T, H] fp32."""

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DeviceBatch: ...

    def combine(self, partial: torch.Tensor, batch: DeviceBatch) -> torch.Tensor: ...


class LocalTransport:
    """EP = 1: the experts see this rank's tokens; nothing moves."""

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DeviceBatch:
        return DeviceBatch(x, topk_ids, topk_weights, x.shape[0])

    def combine(self, partial: torch.Tensor, batch: DeviceBatch) -> torch.Tensor:
        return partial


class ReplicatedTransport(LocalTransport):
    """Every EP rank holds the same tokens; partial outputs are summed with one all-reduce."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def combine(self, partial: torch.Tensor, batch: DeviceBatch) -> torch.Tensor:
        return comm.all_reduce(partial.contiguous(), self.group)


def int32_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """Expert ids ready to narrow to int32 (the transports' wire type): an int64 id outside int32 is
    clamped to -2 or int32 max, so it stays out of range (skipped and counted), where narrowing
    would wrap it onto a valid expert (2**32 + 1 -> 1). A device op, no host read. Other dtypes
    are refused: a float id would be truncated onto an expert by the narrowing copy."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids dtype {topk_ids.dtype} is not int32 or int64")
    if topk_ids.dtype == torch.int64:
        return topk_ids.clamp(-2, torch.iinfo(torch.int32).max)
    return topk_ids


class AllGatherTransport:
    """Fixed-size all-gather of each rank's padded tokens; reduce-scatter of the partial sums.

    max_tokens: C, the most tokens any rank brings to one call (every rank pads to C, so the
    collectives have the same shapes everywhere, whatever each rank holds)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, max_tokens: int) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens ({max_tokens!r}) must be an int >= 1")
        self.group, self.size, self.max_tokens = group, size, max_tokens

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DeviceBatch:
        t, h = x.shape
        c = self.max_tokens
        if t > c:
            raise ValueError(f"{t} tokens on this rank exceed max_tokens ({c}) of the allgather transport; "
                             f"build the layer with max_tokens >= {t}")
        k = topk_ids.shape[1]
        # one uint8 row per token: x bytes | ids int32 | weights fp32, every rank padded to C rows
        x_bytes = h * x.element_size()
        row = x_bytes + 8 * k
        packed = torch.zeros(c, row, dtype=torch.uint8, device=x.device)
        packed[:t, :x_bytes] = comm.to_wire(x.contiguous()).view(torch.uint8).reshape(t, x_bytes)
        ids = torch.full((c, k), -1, dtype=torch.int32, device=x.device)
        ids[:t] = int32_ids(topk_ids)
        packed[:, x_bytes:x_bytes + 4 * k] = ids.view(torch.uint8)
        weights = torch.zeros(c, k, dtype=torch.float32, device=x.device)
        weights[:t] = topk_weights
        packed[:, x_bytes + 4 * k:] = weights.view(torch.uint8)
        gathered = comm.all_gather_uneven(packed, self.group, sizes=[c] * self.size)  # [W * C, row]
        all_x = gathered[:, :x_bytes].contiguous().view(x.dtype).view(-1, h)
        all_ids = gathered[:, x_bytes:x_bytes + 4 * k].contiguous().view(torch.int32)
        all_w = gathered[:, x_bytes + 4 * k:].contiguous().view(torch.float32)
        return DeviceBatch(all_x, all_ids, all_w, t)

    def combine(self, partial: torch.Tensor, batch: DeviceBatch) -> torch.Tensor:
        mine = comm.reduce_scatter_uneven(partial.float().contiguous(), [self.max_tokens] * self.size, self.group)
        return mine[:batch.num_tokens]
