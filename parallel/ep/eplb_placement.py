"""EPLB placement: the algorithm, replica routing and balance metrics (pure torch, no communication).

Hot experts make one EP rank the straggler of every MoE layer. EPLB gives the model more
physical expert slots `P` than logical experts `E` (`P - E` redundant slots, `P / num_ranks`
slots per rank), replicates the hottest experts into the spare slots, and packs the replicas
onto ranks so that the busiest rank carries close to the mean (docs/numerics.md, after DeepSeek's EPLB):

1. hierarchical policy when `num_groups % num_nodes == 0`: expert groups are packed onto
   nodes by group load, then inside each node the experts are replicated and the replicas
   packed onto the node's ranks; otherwise the global policy (one group, one node);
2. replication is greedy: the next replica goes to the expert with the largest
   `load / replicas`; packing is "largest item into the lightest pack that is not full",
   every pack getting exactly `items / packs` items; when a pack holds exactly one item
   (`num_groups == num_nodes`, or one slot per rank) item i goes to pack i, as DeepSeek's
   reference does;
3. with `old_phy2log`, packs are matched to the nodes/ranks they overlap most (any such
   relabeling is equally balanced) and an expert that stays on a rank keeps its slot, so a
   migration copies as little as possible.

The one idea: every loop runs over items (replicas, slots), never over layers; all layers are
handled at once as a batch dimension, so L=61, E=256, P=288 takes milliseconds on a CPU.

Precision and parity: loads are cast to float32 on the CPU, as DeepSeek's reference
(deepseek-ai/EPLB, eplb.py) and vLLM's EPLB do, and every derived quantity (group loads, load per
replica, pack loads accumulated item by item) is the same float32 operation in the same order,
so on loads without ties `phy2log` and `logcnt` equal the reference's placement for placement
(float32 holds integer token counts exactly up to 2^24 per expert; above that, loads closer than
one part in 1.7e7 may tie). Integer loads go to float32 in one rounding, as in the reference.
vLLM's numpy port of the reference divides and sums packs in float64, so it can part from
DeepSeek's (and this) placement where float32 cannot tell two loads apart. Ties go to the
lowest index (the reference's sort is unstable there: torch's CPU order among equal loads is
unspecified and already shuffles rows above 16 items), so every rank computes the same plan
from the same loads. `log2phy` lists an expert's slots in ascending order; the reference lists
them in the order the replicas were created (the same slots). tests/test_eplb_reference.py
checks all of this against a restatement of the reference.

Input checks (ValueError, before any work): loads finite and >= 0; num_physical >= E and a
multiple of num_ranks; num_ranks a multiple of num_nodes under either policy (ranks are numbered
node-major; the references state it at their entry point); num_groups dividing E under the
hierarchical policy (the global one ignores groups, as the reference does).

Conventions: physical slot `p` lives on rank `p // (P // num_ranks)`; ranks `n * R/N ..
(n+1) * R/N - 1` form node `n`. Within a rank, new slots are ordered by packing order (heaviest
replica first) unless an old slot is kept. A (token, k) pair picks among an expert's replicas
by (token position + k) mod the replica count (`logical_to_physical`).

Tracking, migration and the state object the MoE layer holds live next door
(`eplb_migrate`, `eplb_state`, which build on this module); `parallel.ep.eplb` gathers all of it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

__all__ = [
    "EplbPlan",
    "Balance",
    "rebalance_experts",
    "plan_from_phy2log",
    "default_phy2log",
    "logical_to_physical",
    "balancedness",
    "rank_loads",
]



@dataclass
class EplbPlan:
    """A placement of logical experts on physical slots, for every layer.

    phy2log: [L, P] int64, the logical expert held by each physical slot.
    log2phy: [L, E, max_replicas] int64, the physical slots of each expert in ascending
        order, padded with -1 (max_replicas = the largest replica count of any layer).
    logcnt: [L, E] int64, replicas per logical expert (>= 1).
    """

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]


@dataclass
class Balance:
    """Balancedness = mean per-rank load / max per-rank load (1.0 = perfect).

    per_layer: [L] float64 (1.0 for a layer with no load).
    overall: sum over layers of the mean rank load / sum over layers of the max rank load,
        i.e. the fraction of the MoE time left when every layer waits for its busiest rank.
    """

    per_layer: torch.Tensor
    overall: float

    @property
    def max_over_mean(self) -> float:
        """Busiest rank / mean rank load, summed over layers (the straggler factor)."""
        return 1.0 / self.overall if self.overall > 0 else float("inf")


# --------------------------------------------------------------------------------------
# validation


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a [num_layers, num_logical] tensor of expert loads, got {shape}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise ValueError(f"weight must hold real loads (int or float), got dtype {weight.dtype}")
    w = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise ValueError(f"weight must be finite; weight[{bad[0]}, {bad[1]}] = {w[bad[0], bad[1]].item()}")
    if (w < 0).any():
        bad = (w < 0).nonzero()[0].tolist()
        raise ValueError(f"weight must be non-negative; weight[{bad[0]}, {bad[1]}] = {w[bad[0], bad[1]].item()}")
    return w


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _as_int(name: str, value) -> int:
    """`value` as an int (Python, numpy or 0-dim torch integer); ValueError naming it otherwise
    (a float such as 8.0 from a division failed later inside torch with a TypeError)."""
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def _check_integer(name: str, t: torch.Tensor) -> None:
    """ValueError unless `t` holds integers (a float id or count was truncated silently)."""
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_sizes(num_logical: int, num_physical: int, num_ranks: int) -> None:
    if num_logical < 1:
        raise ValueError(f"num_logical ({num_logical}) must be >= 1")
    if num_ranks < 1:
        raise ValueError(f"num_ranks ({num_ranks}) must be >= 1")
    if num_physical < num_logical:
        raise ValueError(f"num_physical ({num_physical}) must be >= num_logical ({num_logical}): "
                         f"every logical expert needs at least one slot")
    if num_physical % num_ranks != 0:
        raise ValueError(f"num_physical ({num_physical}) must be divisible by num_ranks ({num_ranks}); "
                         f"valid num_ranks: {_divisors(num_physical)}")


def _check_policy(num_logical: int, num_groups: int, num_nodes: int, num_ranks: int) -> tuple[int, int]:
    """ValueError for groups/nodes the policy cannot use; returns the (num_groups, num_nodes) it
    runs with: as given for the hierarchical policy, (1, 1) for the global one."""
    if num_groups < 1 or num_nodes < 1:
        raise ValueError(f"num_groups ({num_groups}) and num_nodes ({num_nodes}) must be >= 1")
    # ranks are numbered node-major, R / N to a node: a topology whatever the policy (DeepSeek's
    # entry point states num_gpus must be a multiple of num_nodes; its global branch only asserts
    # it for N = 1, so e.g. 4 GPUs on 3 nodes went through there)
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_ranks ({num_ranks}); "
                         f"valid num_nodes: {_divisors(num_ranks)}")
    if num_groups % num_nodes != 0:  # global policy: one group, one node; groups unused (as in the reference)
        return 1, 1
    if num_logical % num_groups != 0:
        raise ValueError(f"num_groups ({num_groups}) must divide the number of logical experts "
                         f"({num_logical}); valid num_groups: {_divisors(num_logical)}")
    return num_groups, num_nodes


def _check_phy2log(phy2log: torch.Tensor, num_layers: int, num_logical: int, num_physical: int,
                   name: str = "old_phy2log") -> torch.Tensor:
    if phy2log.dim() == 1:
        phy2log = phy2log.unsqueeze(0)
    if tuple(phy2log.shape) != (num_layers, num_physical):
        raise ValueError(f"{name} has shape {tuple(phy2log.shape)}; expected [num_layers, num_physical] = "
                         f"[{num_layers}, {num_physical}]")
    _check_integer(name, phy2log)
    p = phy2log.detach().to("cpu", torch.int64)
    if p.numel() and (p.min() < 0 or p.max() >= num_logical):
        raise ValueError(f"{name} values must lie in [0, {num_logical}); got min {p.min().item()}, "
                         f"max {p.max().item()}")
    return p


# --------------------------------------------------------------------------------------
# the three steps, batched over rows (layers, or layers x nodes)


def _balanced_packing(load: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack `n` items per row into `num_packs` packs of exactly `n / num_packs` items each.

    load: [B, n] float32. Items are taken heaviest first (ties: lower index first) and each
    goes to the lightest pack that is not full (ties: lower pack index); with one item per
    pack, item i goes to pack i (DeepSeek's rule, whatever the loads).
    Returns (pack [B, n] int64, position in pack [B, n] int64).
    """
    rows, n = load.shape
    capacity = n // num_packs
    assert capacity * num_packs == n
    if capacity == 1:   # one item per pack: the identity, not heaviest-first
        return torch.arange(n).expand(rows, n).contiguous(), torch.zeros(rows, n, dtype=torch.int64)
    order = torch.sort(load, dim=1, descending=True, stable=True).indices
    if num_packs == 1:  # one pack: positions in heaviest-first order
        rank_of_item = torch.empty_like(order)
        rank_of_item.scatter_(1, order, torch.arange(n).expand(rows, n).contiguous())
        return torch.zeros_like(order), rank_of_item
    sorted_load = load.gather(1, order)
    pack_load = torch.zeros(rows, num_packs, dtype=load.dtype)
    pack_count = torch.zeros(rows, num_packs, dtype=torch.int64)
    pack_of_sorted = torch.empty(rows, n, dtype=torch.int64)
    pos_of_sorted = torch.empty(rows, n, dtype=torch.int64)
    row_ids = torch.arange(rows)
    inf = torch.tensor(float("inf"), dtype=load.dtype)
    for i in range(n):
        free = pack_count < capacity
        chosen = torch.where(free, pack_load, inf).argmin(dim=1)  # [B]
        # a float32 load can overflow to inf: then every free pack ties with the full ones at
        # inf, and the first free pack is the lightest (as in the reference), not pack 0
        chosen = torch.where(free[row_ids, chosen], chosen, free.to(torch.int8).argmax(dim=1))
        pack_of_sorted[:, i] = chosen
        pos_of_sorted[:, i] = pack_count[row_ids, chosen]
        pack_load[row_ids, chosen] += sorted_load[:, i]
        pack_count[row_ids, chosen] += 1
    pack = torch.empty_like(order).scatter_(1, order, pack_of_sorted)
    pos = torch.empty_like(order).scatter_(1, order, pos_of_sorted)
    return pack, pos


def _replicate(load: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy replication: each extra slot goes to the expert with the largest load per replica.

    load: [B, n] float32. Returns (slot2expert [B, num_slots] int64 with slot i = expert i for
    i < n, count [B, n] int64).
    """
    rows, n = load.shape
    slot2expert = torch.empty(rows, num_slots, dtype=torch.int64)
    slot2expert[:, :n] = torch.arange(n)
    count = torch.ones(rows, n, dtype=torch.int64)
    row_ids = torch.arange(rows)
    for i in range(n, num_slots):
        hottest = (load / count).argmax(dim=1)  # first index on ties
        slot2expert[:, i] = hottest
        count[row_ids, hottest] += 1
    return slot2expert, count


def _match_packs(new_members: torch.Tensor, old_members: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Relabel packs so each new pack lands where the old placement had most of its experts.

    new_members, old_members: [B, m, k] int64 logical experts of each pack. Greedy maximum
    overlap (count of distinct shared experts; ties: lowest new pack, then lowest old pack).
    Returns perm [B, m] int64: new pack a becomes pack perm[b, a].
    """
    rows, m, _ = new_members.shape

    def presence(members: torch.Tensor) -> torch.Tensor:
        hist = torch.zeros(rows, m, num_logical, dtype=torch.float32)
        return hist.scatter_(2, members, 1.0)

    overlap = torch.bmm(presence(new_members), presence(old_members).transpose(1, 2))  # [B, m, m]
    perm = torch.empty(rows, m, dtype=torch.int64)
    row_ids = torch.arange(rows)
    for _ in range(m):
        flat = overlap.reshape(rows, m * m).argmax(dim=1)
        a, b = flat // m, flat % m
        perm[row_ids, a] = b
        overlap[row_ids, a, :] = -1.0
        overlap[row_ids, :, b] = -1.0
    return perm


def _keep_slots(new_rank: torch.Tensor, old_rank: torch.Tensor) -> torch.Tensor:
    """Order each rank's new experts so that experts the rank already held keep their old slot.

    new_rank, old_rank: [B, S] int64 experts of one rank (B = layers x ranks) in slot order.
    Each new item takes the first free old slot holding the same expert; the remaining items,
    in their order, fill the remaining slots in slot order. Returns [B, S] int64.
    """
    rows, slots = new_rank.shape
    taken = torch.zeros(rows, slots, dtype=torch.bool)
    placed = torch.zeros(rows, slots, dtype=torch.bool)
    out = torch.full_like(new_rank, -1)
    row_ids = torch.arange(rows)
    for i in range(slots):
        match = (old_rank == new_rank[:, i : i + 1]) & ~taken  # [B, S]
        has = match.any(dim=1)
        j = match.to(torch.int8).argmax(dim=1)  # first True
        r, jj = row_ids[has], j[has]
        out[r, jj] = new_rank[r, i]
        taken[r, jj] = True
        placed[r, i] = True
    # leftovers: k-th unplaced item -> k-th free slot (both in ascending order)
    items = torch.sort(placed.to(torch.int8), dim=1, stable=True).indices
    free = torch.sort(taken.to(torch.int8), dim=1, stable=True).indices
    num_left = (~placed).sum(dim=1, keepdim=True)
    use = torch.arange(slots).expand(rows, slots) < num_left
    r = row_ids[:, None].expand(rows, slots)[use]
    out[r, free[use]] = new_rank.gather(1, items)[use]
    assert (out >= 0).all()
    return out


# --------------------------------------------------------------------------------------
# public entry points


def plan_from_phy2log(phy2log: torch.Tensor, num_logical: int) -> EplbPlan:
    """Derive `log2phy` and `logcnt` from a placement.

    phy2log: [L, P] (or [P]) integer, values in [0, num_logical); every expert must have a slot.
    """
    if phy2log.dim() not in (1, 2):
        raise ValueError(f"phy2log must be [L, P] or [P], got shape {tuple(phy2log.shape)}")
    num_logical = _as_int("num_logical", num_logical)
    p2l = phy2log if phy2log.dim() == 2 else phy2log.unsqueeze(0)
    if p2l.shape[0] < 1 or num_logical < 1:
        raise ValueError(f"phy2log needs at least one layer and num_logical >= 1; got shape "
                         f"{tuple(phy2log.shape)} and num_logical {num_logical}")
    p2l = _check_phy2log(p2l, p2l.shape[0], num_logical, p2l.shape[1], name="phy2log")
    num_layers, num_physical = p2l.shape
    logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64)
    logcnt.scatter_add_(1, p2l, torch.ones_like(p2l))
    if (logcnt == 0).any():
        layer, expert = (logcnt == 0).nonzero()[0].tolist()
        raise ValueError(f"phy2log leaves logical expert {expert} of layer {layer} without a physical slot")
    max_replicas = int(logcnt.max())
    # slots sorted by (expert, slot); the replica index is the position inside the expert's run
    order = torch.sort(p2l, dim=1, stable=True).indices  # [L, P]
    experts_sorted = p2l.gather(1, order)
    first = torch.cumsum(logcnt, dim=1) - logcnt  # [L, E] start of each expert's run
    replica = torch.arange(num_physical).expand(num_layers, -1) - first.gather(1, experts_sorted)
    log2phy = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    log2phy.scatter_(1, experts_sorted * max_replicas + replica, order)
    return EplbPlan(phy2log=p2l, log2phy=log2phy.view(num_layers, num_logical, max_replicas), logcnt=logcnt)


def default_phy2log(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """The placement before any load is known: slot p holds expert p % E. [L, P] int64.

    Slots 0..E-1 are the experts in order (contiguous blocks per rank when P == E); the
    redundant slots E..P-1 replicate experts 0..P-E-1.
    """
    num_layers, num_logical = _as_int("num_layers", num_layers), _as_int("num_logical", num_logical)
    num_physical = _as_int("num_physical", num_physical)
    _check_sizes(num_logical, num_physical, 1)
    return (torch.arange(num_physical) % num_logical).expand(num_layers, num_physical).contiguous()


def rebalance_experts(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int,
                      old_phy2log: torch.Tensor | None = None) -> EplbPlan:
    """Place `E` logical experts on `num_physical` slots over `num_ranks` ranks, per layer.

    weight: [L, E] int or float, load of each logical expert (e.g. tokens over a window);
        finite and >= 0.
    num_groups: expert groups of the router (DeepSeek `n_group`; 1 if none); the hierarchical
        policy keeps whole groups on one node and is used when num_groups % num_nodes == 0.
    num_nodes: nodes the ranks span (ranks are numbered node-major).
    old_phy2log: [L, P] (or [P] for L == 1) int, the current placement; when given, packs are
        relabeled to overlap it most and experts that stay on a rank keep their slot.
    Returns an EplbPlan on the CPU (int64 tensors). Deterministic. Loads are used in float32
    (DeepSeek's and vLLM's precision; see the module docstring).
    """
    num_physical, num_ranks = _as_int("num_physical", num_physical), _as_int("num_ranks", num_ranks)
    num_groups, num_nodes = _as_int("num_groups", num_groups), _as_int("num_nodes", num_nodes)
    _check_weight(weight)
    # one rounding, straight to float32 as the reference does: int64 loads above 2^53 rounded
    # first to float64 could land on a float32 midpoint and round the other way (double rounding)
    w = weight.detach().to("cpu").float()
    num_layers, num_logical = w.shape
    if num_layers < 1 or num_logical < 1:
        raise ValueError(f"weight must have at least one layer and one logical expert; got shape "
                         f"[num_layers, num_logical] = [{num_layers}, {num_logical}]")
    _check_sizes(num_logical, num_physical, num_ranks)
    num_groups, num_nodes = _check_policy(num_logical, num_groups, num_nodes, num_ranks)
    old = None if old_phy2log is None else _check_phy2log(old_phy2log, num_layers, num_logical, num_physical)
    phy2log = _hierarchical(w, num_physical, num_groups, num_nodes, num_ranks, old)
    return plan_from_phy2log(phy2log, num_logical)


def _hierarchical(w: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int,
                  old: torch.Tensor | None) -> torch.Tensor:
    num_layers, num_logical = w.shape
    experts_per_group = num_logical // num_groups
    experts_per_node = num_logical // num_nodes
    ranks_per_node = num_ranks // num_nodes
    slots_per_node = num_physical // num_nodes
    slots_per_rank = num_physical // num_ranks

    # 1. groups -> nodes. "node-local" experts (nl) list a node's groups in packing order.
    group_load = w.view(num_layers, num_groups, experts_per_group).sum(dim=2)
    group_node, group_pos = _balanced_packing(group_load, num_nodes)  # [L, G]
    group_nl = group_node * (num_groups // num_nodes) + group_pos  # group's position in node-major order
    log2nl = (group_nl.unsqueeze(2) * experts_per_group + torch.arange(experts_per_group)).view(num_layers, -1)
    nl2log = torch.empty_like(log2nl).scatter_(1, log2nl, torch.arange(num_logical).expand(num_layers, -1))

    # 2. replicate inside each node: rows are (layer, node)
    nl_load = w.gather(1, nl2log).view(num_layers * num_nodes, experts_per_node)
    slot2nl, nl_count = _replicate(nl_load, slots_per_node)  # [L*N, P/N], [L*N, E/N]

    # 3. pack the node's replicas onto its ranks
    replica_load = (nl_load / nl_count).gather(1, slot2nl)
    rank_in_node, pos_in_rank = _balanced_packing(replica_load, ranks_per_node)  # [L*N, P/N]

    # members[l, n, r, s]: node-local expert (global nl index) at position s of rank r of node n
    nl_global = slot2nl + (torch.arange(num_layers * num_nodes) % num_nodes).unsqueeze(1) * experts_per_node
    members = torch.empty(num_layers * num_nodes, slots_per_node, dtype=torch.int64)
    members.scatter_(1, rank_in_node * slots_per_rank + pos_in_rank, nl_global)
    members = nl2log.gather(1, members.view(num_layers, num_physical))  # logical ids, [L, P] by new pack
    if old is None:
        return members

    # 4. relabel nodes, then ranks within nodes, to overlap the old placement; keep slots
    by_node = members.view(num_layers, num_nodes, slots_per_node)
    if num_nodes > 1:
        perm = _match_packs(by_node, old.view(num_layers, num_nodes, slots_per_node), num_logical)
        by_node = torch.empty_like(by_node).scatter_(1, perm.unsqueeze(2).expand_as(by_node), by_node)
    rows = num_layers * num_nodes
    by_rank = by_node.reshape(rows, ranks_per_node, slots_per_rank)
    old_by_rank = old.view(rows, ranks_per_node, slots_per_rank)
    if ranks_per_node > 1:
        perm = _match_packs(by_rank, old_by_rank, num_logical)
        by_rank = torch.empty_like(by_rank).scatter_(1, perm.unsqueeze(2).expand_as(by_rank), by_rank)
    kept = _keep_slots(by_rank.reshape(-1, slots_per_rank), old_by_rank.reshape(-1, slots_per_rank))
    return kept.view(num_layers, num_physical)


def logical_to_physical(topk_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                        token_index: torch.Tensor | None = None) -> torch.Tensor:
    """Map routed logical experts to physical slots; a (token, k) pair picks a replica by position.

    topk_ids: [T, K] int32/int64 logical experts in [0, E), -1 = no expert (stays -1). Other
        values raise ValueError for CPU tensors; on CUDA (no host sync: graph-capturable) they
        index out of range and trip the device-side bounds assertion instead of mapping anywhere.
    log2phy: [E, R] int64 physical slots of each expert (-1 padded); logcnt: [E] int replicas.
    token_index: [T] int, each token's position (default arange(T)); pass positions that differ
        across ranks (each rank's own tokens) to spread replicas across ranks as well.
    Replica = (token_index[t] + k) mod logcnt[expert]: consecutive tokens take an expert's
    replicas in turn, whichever slot k names it. (vLLM takes the pair's flattened position,
    (t * K + k) mod count: with K a multiple of the count, K = 8 over 2, 4 or 8 replicas, every
    token's slot-0 pair, its top expert's, goes to replica 0.)
    Returns [T, K] physical slot ids in topk_ids' dtype and device. Graph-capturable.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if log2phy.dim() != 2 or logcnt.dim() != 1 or logcnt.shape[0] != log2phy.shape[0]:
        raise ValueError(f"log2phy must be [E, R] and logcnt [E] for one layer; got {tuple(log2phy.shape)} "
                         f"and {tuple(logcnt.shape)}")
    _check_integer("topk_ids", topk_ids)
    num_tokens = topk_ids.shape[0]
    if token_index is None:
        token_index = torch.arange(num_tokens, device=topk_ids.device)
    elif token_index.shape != (num_tokens,):
        raise ValueError(f"token_index must be [T] = [{num_tokens}], got {tuple(token_index.shape)}")
    else:
        _check_integer("token_index", token_index)
    ids = topk_ids.long()
    num_logical = log2phy.shape[0]
    out_of_range = (ids < -1) | (ids >= num_logical)
    if ids.device.type == "cpu" and bool(out_of_range.any()):
        t, k = out_of_range.nonzero()[0].tolist()
        raise ValueError(f"topk_ids[{t}, {k}] = {int(ids[t, k])} is not a logical expert: valid ids are "
                         f"[0, {num_logical}) and -1 (no expert)")
    valid = ids >= 0
    safe = torch.where(ids == -1, 0, torch.where(out_of_range, num_logical, ids))   # bad ids stay out of range
    pair = token_index.to(ids.device, torch.int64).unsqueeze(1) + torch.arange(ids.shape[1], device=ids.device)
    replica = pair % logcnt.to(ids.device, torch.int64)[safe]  # [T, K]
    physical = log2phy.to(ids.device)[safe, replica]
    return torch.where(valid, physical, torch.full_like(physical, -1)).to(topk_ids.dtype)


def rank_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Expected per-rank load when each expert's load splits evenly over its replicas.

    weight: [L, E] loads; phy2log: [L, P] (or [P]) placement. Returns [L, num_ranks] float64.
    """
    num_ranks = _as_int("num_ranks", num_ranks)
    w = _check_weight(weight)
    num_layers, num_logical = w.shape
    p2l = phy2log.detach().to("cpu", torch.int64)
    if p2l.dim() == 1:
        p2l = p2l.unsqueeze(0).expand(num_layers, -1)
    p2l = _check_phy2log(p2l, num_layers, num_logical, p2l.shape[1], name="phy2log")
    _check_sizes(num_logical, p2l.shape[1], num_ranks)
    logcnt = torch.zeros(num_layers, num_logical, dtype=torch.int64).scatter_add_(1, p2l, torch.ones_like(p2l))
    per_slot = (w / logcnt.clamp(min=1)).gather(1, p2l)  # an expert without a slot contributes nothing
    return per_slot.view(num_layers, num_ranks, p2l.shape[1] // num_ranks).sum(dim=2)  # -1 fails for L = 0


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> Balance:
    """Mean / max per-rank load of a placement, per layer and overall (see `Balance`).

    weight: [L, E] loads; phy2log: [L, P] (or [P]) placement over num_ranks ranks.
    """
    loads = rank_loads(weight, phy2log, num_ranks)
    mean, peak = loads.mean(dim=1), loads.amax(dim=1)
    per_layer = torch.where(peak > 0, mean / peak.clamp(min=1e-300), torch.ones_like(mean))
    total_peak = float(peak.sum())
    overall = float(mean.sum()) / total_peak if total_peak > 0 else 1.0
    return Balance(per_layer=per_layer, overall=overall)
