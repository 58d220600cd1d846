"""EPLB weight migration: move expert weights between EP ranks after a new placement.

`rearrange_weights(old_phy2log, new_phy2log, tensors, group)` moves one layer. Every rank
derives the same transfer plan from the two maps (no plan exchange): a slot whose expert
does not change is skipped; a slot whose new expert the rank already held is a local copy;
anything else is received once per expert from one rank that held it (spread over holders by
destination rank) and copied into each slot that needs it. All tensors of an expert (bf16
weights, packed fp4/fp8 data, scales) travel as raw bytes in ONE buffer per peer pair,
exchanged in one batch (`parallel.p2p.P2PExchanger`, posted from the current stream), so dtype
does not matter (gloo rejects fp8) and results are bit-exact.

All-or-nothing: the new rows are staged in fresh buffers built from the OLD weights, and the
old contents of the changed rows are kept aside; only when an all-reduce of the per-rank
failure flags says every rank succeeded are the new rows copied into the caller's tensors (in
place, so parameters keep their identity and addresses: CUDA graphs stay valid). A failure in
preparation is agreed on before any transfer; a failure after the transfer is agreed on before
the commit; a failure inside the commit (any tensor) restores that rank's old rows and is
agreed on once more, and then every rank restores its old rows. Either way every rank raises
`MigrationError` naming the failed ranks and ends with all its tensors old (or, on success,
all new), never some of each. A transport that fails (a peer killed mid-migration) also
raises `MigrationError` on the ranks that can still run: a failed agreement leaves the
tensors old (before the commit) or restores them (after it), since the peers' outcome is
unknown. The first agreement also checks that every rank passed the same two maps and the
same tensor layout (dtype and per-slot shape of each tensor, compared by a digest; only when the
digests differ are the values gathered, to name them): ranks that disagree would derive
different plans, and their transfers would pair wrong rows silently, hang or abort; instead
every rank raises MigrationError naming the odd ranks and values. So an unchanged map is agreed
on too (one small all-reduce, no transfer). `fault_hook(stage)` is called at stages "prepare",
"unpack" and "commit" (between two tensors' commits) so tests can inject failures.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import GroupLike, resolve_group
from ..p2p import P2PExchanger, Peers

__all__ = ["MigrationError", "MigrationStats", "rearrange_weights", "migration_plan"]


class MigrationError(RuntimeError):
    """A migration was abandoned on every rank; `failed_ranks` are the group ranks that failed.
    `transport_failed`: the group's communication itself failed (a peer died); the ranks could
    not agree, so the group is unusable for further migrations."""

    def __init__(self, message: str, failed_ranks: list[int], *, transport_failed: bool = False) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks
        self.transport_failed = transport_failed


@dataclass
class MigrationStats:
    """What one rank did for one layer's migration (bytes over all tensors)."""

    slots_changed: int = 0
    """local slots whose expert changed"""
    slots_received: int = 0
    """changed local slots filled from another rank"""
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    peers: int = 0
    """ranks exchanged with (send or receive)"""
    seconds: float = 0.0

    def __iadd__(self, other: "MigrationStats") -> "MigrationStats":
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


@dataclass
class _Plan:
    """One rank's share of the migration of one layer (local slot indices)."""

    changed: list[int]
    """local slots to rewrite, ascending"""
    local: list[tuple[int, int]]
    """(dst slot, src slot) copies of old local rows"""
    recv: dict[int, list[list[int]]]
    """src rank -> for each expert received (ascending id): the dst slots it fills"""
    send: dict[int, list[int]]
    """dst rank -> src slot of each expert sent (ascending expert id)"""


def migration_plan(old: Sequence[int], new: Sequence[int], num_ranks: int, rank: int) -> _Plan:
    """Rank `rank`'s transfers for one layer; every rank derives the others' plans identically."""
    slots = len(old) // num_ranks
    old_by_rank = [list(old[r * slots : (r + 1) * slots]) for r in range(num_ranks)]
    holders: dict[int, list[int]] = {}
    for r, experts in enumerate(old_by_rank):
        for e in experts:
            if not holders.get(e) or holders[e][-1] != r:
                holders.setdefault(e, []).append(r)
    plan = _Plan(changed=[], local=[], recv={}, send={})
    for dst in range(num_ranks):
        needs: dict[int, list[int]] = {}
        for j in range(slots):
            p = dst * slots + j
            if new[p] != old[p]:
                needs.setdefault(new[p], []).append(j)
        if dst == rank:
            plan.changed = sorted(j for js in needs.values() for j in js)
        for e in sorted(needs):
            if e in old_by_rank[dst]:
                if dst == rank:
                    src_slot = old_by_rank[dst].index(e)
                    plan.local += [(j, src_slot) for j in needs[e]]
                continue
            src = holders[e][dst % len(holders[e])]
            if dst == rank:
                plan.recv.setdefault(src, []).append(needs[e])
            if src == rank:
                plan.send.setdefault(dst, []).append(old_by_rank[rank].index(e))
    return plan


def _check_maps(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor, num_ranks: int) -> tuple[list[int], list[int]]:
    if old_phy2log.dim() != 1 or new_phy2log.shape != old_phy2log.shape:
        raise ValueError(f"old_phy2log and new_phy2log must both be [P] for one layer; got "
                         f"{tuple(old_phy2log.shape)} and {tuple(new_phy2log.shape)}")
    num_physical = old_phy2log.shape[0]
    if num_physical % num_ranks != 0:
        raise ValueError(f"num_physical ({num_physical}) must be divisible by the group size ({num_ranks})")
    old, new = old_phy2log.tolist(), new_phy2log.tolist()
    if min(old + new) < 0:
        raise ValueError("phy2log values must be >= 0 (logical expert ids)")
    missing = sorted(set(new) - set(old))
    if missing:
        raise ValueError(f"new_phy2log places experts {missing[:8]} that no slot of old_phy2log holds; "
                         f"a migration can only move experts that exist")
    return old, new


def _same_map(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor) -> bool:
    """The two maps are equal (then this rank moves nothing, and neither do its peers once the
    group has agreed on the maps); False for maps that cannot be compared, which the checks reject."""
    return old_phy2log.shape == new_phy2log.shape and old_phy2log.tolist() == new_phy2log.tolist()


def _byte_rows(t: torch.Tensor, slots_per_rank: int, index: int) -> torch.Tensor:
    """[slots_per_rank, bytes_per_slot] uint8 view sharing t's storage."""
    if t.dim() == 0 or t.shape[0] != slots_per_rank:
        raise ValueError(f"tensors[{index}] has shape {tuple(t.shape)}; its first dim must be the "
                         f"{slots_per_rank} local slots (num_physical / group size)")
    if not t.is_contiguous():
        raise ValueError(f"tensors[{index}] must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    t = t.detach()
    return t.reshape(slots_per_rank, -1).view(torch.uint8)


_NO_SIGNATURE = -(2**62)


def _signature(old: list[int], new: list[int], tensors: list[torch.Tensor]) -> tuple:
    """What every rank of the group must agree on before a transfer: both maps and the layout
    (dtype, per-slot shape) of each tensor. Ranks that disagree derive different plans: their
    transfers mismatch (a hang, or rows landing under the wrong expert with no error)."""
    return (old, new, [(str(t.dtype), tuple(t.shape[1:])) for t in tensors])


def _fingerprint(signature: tuple) -> int:
    """56-bit digest of a signature (deterministic across processes)."""
    return int.from_bytes(hashlib.blake2b(repr(signature).encode(), digest_size=7).digest(), "little")


def _disagreement(signature: tuple | None, failed: list[int], size: int,
                  pg: dist.ProcessGroup | None) -> tuple[list[int], str]:
    """(ranks whose signature differs from the majority's, a message naming the values); collective.
    Only called when the fingerprints differ, which every rank sees alike."""
    everyone: list = [None] * size
    dist.all_gather_object(everyone, signature, group=pg)
    candidates = [r for r in range(size) if r not in failed and everyone[r] is not None]
    if not candidates:
        return [], ""
    counts = {r: sum(everyone[q] == everyone[r] for q in candidates) for r in candidates}
    ref = max(candidates, key=lambda r: (counts[r], -r))
    same = [q for q in candidates if everyone[q] == everyone[ref]]
    odd = [r for r in candidates if everyone[r] != everyone[ref]]
    parts = []
    for r in odd:
        for k, name in enumerate(("old_phy2log", "new_phy2log")):
            mine, theirs = everyone[r][k], everyone[ref][k]
            if mine != theirs:
                if len(mine) != len(theirs):
                    parts.append(f"rank {r}'s {name} has {len(mine)} slots, ranks {same}'s {len(theirs)}")
                else:
                    p = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                    parts.append(f"rank {r} has {name}[{p}] = {mine[p]}, ranks {same} have {theirs[p]}")
        if everyone[r][2] != everyone[ref][2]:
            parts.append(f"rank {r}'s tensors are (dtype, per-slot shape) {everyone[r][2]}, "
                         f"ranks {same}'s {everyone[ref][2]}")
    return odd, "; ".join(parts)


def _agree(failed: bool, rank: int, size: int, pg: dist.ProcessGroup | None, device: torch.device,
           stage: str, failure: BaseException | None, restore: Callable[[], None] | None = None,
           signature: tuple | None = None) -> tuple[list[int], str]:
    """All-reduce of per-rank failure flags; returns (the failed group ranks, a message naming the
    values the ranks disagree on, or "") (the same on all ranks).

    With `signature` (this rank's maps and tensor layout, None where its input is bad), the ranks
    also agree on it: ranks whose signature differs from the majority's count as failed (one
    more collective, only then, to name the values).
    When the all-reduce itself fails (a peer died), `restore()` runs (if given) and
    MigrationError names the stage: no rank can learn the others' outcome any more."""
    fp = _NO_SIGNATURE if signature is None else _fingerprint(signature)
    # MAX of [flags, fp, -fp]: the flags, and the largest and smallest fingerprint
    flags = torch.zeros(size + 2, dtype=torch.int64, device=device)
    flags[rank] = int(failed)
    flags[size], flags[size + 1] = fp, (_NO_SIGNATURE if signature is None else -fp)
    if size > 1:
        try:
            dist.all_reduce(flags, group=pg, op=dist.ReduceOp.MAX)
            result = flags.tolist()
            ranks = [r for r in range(size) if result[r]]
            if result[size] != _NO_SIGNATURE and result[size] != -result[size + 1]:
                odd, message = _disagreement(signature, ranks, size, pg)
                return sorted(set(ranks) | set(odd)), message
        except Exception as exc:  # noqa: BLE001 - the transport is gone: fail as a migration
            if restore is not None:
                restore()
            kept = "old weights restored" if restore is not None else "old weights kept"
            raise MigrationError(f"EPLB migration abandoned {stage}: the agreement among the group's ranks failed "
                                 f"({type(exc).__name__}: {exc}); a peer may have died; this rank's {kept} "
                                 f"(this rank's own failure: {failure!r})", [], transport_failed=True) from exc
        return ranks, ""
    return flags[:size].nonzero().flatten().tolist(), ""


def rearrange_weights(old_phy2log: torch.Tensor, new_phy2log: torch.Tensor, tensors: list[torch.Tensor],
                      group: GroupLike = None, *,
                      fault_hook: Callable[[str], None] | None = None) -> MigrationStats:
    """Move one layer's expert rows so that local slot j holds expert new_phy2log[rank * S + j].

    old_phy2log, new_phy2log: [P] int, the layer's placement before and after (same on every
        rank of `group`); P must divide by the group size; S = P / group size.
    tensors: this rank's per-slot tensors, each [S, ...] contiguous, any dtype (bf16 weights,
        uint8 packed fp4, fp8 data, scales); modified in place only if every rank succeeds.
    group: the EP group (Group, ProcessGroup, or None = world / single process).
    fault_hook: test hook called with "prepare", "unpack" and "commit"; an exception it raises
        counts as this rank's failure.
    Returns this rank's MigrationStats; raises MigrationError on every rank if any rank failed
    or the ranks' maps or tensor layouts differ (collective even when nothing moves),
    except that a rank whose own input is wrong (maps, tensor shapes) raises its ValueError
    (after the agreement, so that its peers raise MigrationError naming it instead of waiting).
    """
    pg, rank, size = resolve_group(group)
    if tensors:
        device = tensors[0].device
    elif size > 1 and str(dist.get_backend(pg)) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    stats = MigrationStats()
    # The input checks are agreed on like any other preparation failure: a rank whose own
    # tensors are wrong must not raise alone while its peers wait in the first agreement.
    bad_input: ValueError | None = None
    signature: tuple | None = None
    try:
        old, new = _check_maps(old_phy2log, new_phy2log, size)
        slots_per_rank = len(old) // size
        rows = [_byte_rows(t, slots_per_rank, i) for i, t in enumerate(tensors)]
        if any(t.device != device for t in tensors):
            raise ValueError(f"tensors must share one device; got {sorted({str(t.device) for t in tensors})}")
        signature = _signature(old, new, tensors)
    except ValueError as exc:
        bad_input = exc
    # nothing to move here; the group still agrees (below) that it is so everywhere: a rank
    # whose maps or tensors differ from its peers' must not return while they wait in a transfer
    nothing_to_move = not tensors or _same_map(old_phy2log, new_phy2log)
    if size == 1 and (bad_input is not None or nothing_to_move):
        if bad_input is not None:
            raise bad_input
        return stats
    start = time.perf_counter()

    failure: BaseException | None = bad_input
    try:
        if bad_input is not None:
            raise bad_input
        if not nothing_to_move:
            plan = migration_plan(old, new, size, rank)
            peers = Peers.of(group)
            if fault_hook is not None:
                fault_hook("prepare")
            pos = {slot: i for i, slot in enumerate(plan.changed)}
            staged = [torch.empty(len(plan.changed), r.shape[1], dtype=torch.uint8, device=device) for r in rows]
            send_bufs = {dst: torch.cat([r[src_slots] for r in rows], dim=1) for dst, src_slots in plan.send.items()}
            bytes_per_expert = sum(r.shape[1] for r in rows)
            recv_bufs = {src: torch.empty(len(slot_lists), bytes_per_expert, dtype=torch.uint8, device=device)
                         for src, slot_lists in plan.recv.items()}
    except Exception as exc:  # noqa: BLE001 - any local failure must be agreed on, not raised alone
        failure = exc
    failed, disagreement = _agree(failure is not None, rank, size, pg, device, "before transfer", failure,
                                  signature=signature)
    if bad_input is not None:
        raise bad_input  # this rank's own input error; its peers raise MigrationError naming it
    if failed:
        why = (f"the ranks disagree on the maps or the tensors' layout ({disagreement}); "
               if disagreement else "")
        raise MigrationError(f"EPLB migration abandoned before transfer: {why}group ranks {failed} failed "
                             f"(this rank: {failure!r})", failed) from failure
    if nothing_to_move:
        return stats

    try:
        P2PExchanger(peers, device).post(list(send_bufs.items()), list(recv_bufs.items())).wait()
        if fault_hook is not None:
            fault_hook("unpack")
        if plan.local:
            to_row = torch.tensor([pos[dst] for dst, _ in plan.local], device=device)
            from_slot = torch.tensor([src for _, src in plan.local], device=device)
            for r, stage in zip(rows, staged):
                stage[to_row] = r[from_slot]
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r.shape[1])
        for src, slot_lists in plan.recv.items():
            # received expert k fills every slot in slot_lists[k]
            from_row = torch.tensor([k for k, js in enumerate(slot_lists) for _ in js], device=device)
            to_row = torch.tensor([pos[j] for js in slot_lists for j in js], device=device)
            for i, stage in enumerate(staged):
                stage[to_row] = recv_bufs[src][from_row, offsets[i] : offsets[i + 1]]
        changed = torch.tensor(plan.changed, dtype=torch.int64, device=device)
        backup = [r[changed] for r in rows]  # the old changed rows: a failed commit puts them back
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # asynchronous errors of the staging surface here
    except Exception as exc:  # noqa: BLE001
        failure = exc
    failed, _ = _agree(failure is not None, rank, size, pg, device, "after transfer", failure)
    if failed:
        raise MigrationError(f"EPLB migration abandoned after transfer, old weights kept: group ranks "
                             f"{failed} failed (this rank: {failure!r})", failed) from failure

    def restore() -> None:
        with torch.no_grad():
            for r, old_rows in zip(rows, backup):
                r.index_copy_(0, changed, old_rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        with torch.no_grad():
            for i, (r, stage) in enumerate(zip(rows, staged)):
                if i and fault_hook is not None:
                    fault_hook("commit")
                r.index_copy_(0, changed, stage)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - put every tensor back, then let the others know
        failure = exc
        restore()
    failed, _ = _agree(failure is not None, rank, size, pg, device, "during the commit", failure, restore)
    if failed:
        if failure is None:
            restore()  # a peer could not commit: every rank goes back to the old rows
        raise MigrationError(f"EPLB migration abandoned during the commit, old weights restored: group ranks "
                             f"{failed} failed (this rank: {failure!r})", failed) from failure
    stats.slots_changed = len(plan.changed)
    stats.slots_received = sum(len(js) for lists in plan.recv.values() for js in lists)
    stats.bytes_sent = sum(b.numel() for b in send_bufs.values())
    stats.bytes_received = sum(b.numel() for b in recv_bufs.values())
    stats.bytes_copied_locally = len(plan.local) * sum(r.shape[1] for r in rows)
    stats.peers = len(set(plan.send) | set(plan.recv))
    stats.seconds = time.perf_counter() - start
    return stats
