"""EPLB placement against DeepSeek's reference semantics (deepseek-ai/EPLB eplb.py, as vLLM uses it).

`reference_rebalance` below restates the reference in plain torch, one layer at a time, with
float32 scalars (the reference casts loads to float32 and does every sum and division there):

- policy: hierarchical when num_groups % num_nodes == 0, else global (1 group, 1 node);
- pack groups onto nodes by group load; per node, list its groups in packing order and
  replicate: every extra slot goes to the expert whose load / replicas is largest;
- pack the node's replicas (load / replicas each) onto its GPUs; slot = gpu * per_gpu + position;
- packing: heaviest item first into the lightest pack that still has room, exactly
  items / packs per pack; one item per pack -> item i in pack i;
- log2phy lists an expert's replicas in the order they were created (the original slot first).

Where the project differs on purpose (documented in parallel/ep/eplb_placement.py and
docs/numerics.md §6), the tests assert what it claims instead:

- ties: the reference sorts with torch's unstable sort, whose order among equal loads is not
  specified (on CPU it already changes above 16 items); the project breaks ties by lowest index,
  which is what `reference_rebalance` does too, so ties compare exactly;
- log2phy: the project lists each expert's slots in ascending order (same sets as the reference);
- old_phy2log (vLLM's slot-preserving step, extended to relabel nodes and ranks): the same
  per-rank expert multisets as the reference up to renaming ranks inside a node and nodes,
  hence the same per-rank loads and the same max GPU load.
"""

from __future__ import annotations

import pytest
import torch

from parallel.ep import eplb_placement
from parallel.ep.eplb import rank_loads, rebalance_experts

# ---------------------------------------------------------------------------------------
# the reference, restated (one layer; float32 arithmetic through 0-dim tensors)


def _pack(load: torch.Tensor, packs: int) -> tuple[list[int], list[int]]:
    """Items of `load` [n] float32 -> (pack, position in pack), n / packs items per pack."""
    n = load.numel()
    per = n // packs
    if per == 1:
        return list(range(n)), [0] * n
    total = torch.zeros(packs, dtype=torch.float32)
    count = [0] * packs
    pack, pos = [0] * n, [0] * n
    for item in sorted(range(n), key=lambda i: (-load[i].item(), i)):
        room = [p for p in range(packs) if count[p] < per]
        best = min(room, key=lambda p: (total[p].item(), p))
        pack[item], pos[item] = best, count[best]
        total[best] += load[item]
        count[best] += 1
    return pack, pos


def _replicate(load: torch.Tensor, slots: int) -> tuple[list[int], list[int], torch.Tensor]:
    """-> (expert of each slot, replica rank of each slot, replica count per expert)."""
    n = load.numel()
    count = torch.ones(n, dtype=torch.int64)
    expert, rank = list(range(n)), [0] * n
    while len(expert) < slots:
        ratio = load / count                                    # float32 / int64 -> float32
        hot = max(range(n), key=lambda e: (ratio[e].item(), -e))
        expert.append(hot)
        rank.append(int(count[hot]))
        count[hot] += 1
    return expert, rank, count


def reference_rebalance(weight: torch.Tensor, replicas: int, groups: int, nodes: int, gpus: int):
    """-> (phy2log [L, P], log2phy [L, E, max count] in creation order, -1 padded, logcnt [L, E])."""
    w = weight.float()
    layers, experts = w.shape
    if groups % nodes:
        groups, nodes = 1, 1
    size = experts // groups
    per_node, per_gpu = replicas // nodes, replicas // gpus
    phy2log = torch.full((layers, replicas), -1, dtype=torch.int64)
    phyrank = torch.full((layers, replicas), -1, dtype=torch.int64)
    logcnt = torch.zeros(layers, experts, dtype=torch.int64)
    for layer in range(layers):
        node_of, pos_of = _pack(w[layer].view(groups, size).sum(-1), nodes)
        for node in range(nodes):
            mine = sorted((g for g in range(groups) if node_of[g] == node), key=lambda g: pos_of[g])
            ids = [g * size + j for g in mine for j in range(size)]
            load = w[layer, ids]
            slot_expert, slot_rank, count = _replicate(load, per_node)
            gpu, pos = _pack(torch.stack([load[e] / count[e] for e in slot_expert]), gpus // nodes)
            for s, e in enumerate(slot_expert):
                p = node * per_node + gpu[s] * per_gpu + pos[s]
                phy2log[layer, p], phyrank[layer, p] = ids[e], slot_rank[s]
            logcnt[layer, ids] = count
    log2phy = torch.full((layers, experts, int(logcnt.max())), -1, dtype=torch.int64)
    for layer in range(layers):
        for p in range(replicas):
            log2phy[layer, phy2log[layer, p], phyrank[layer, p]] = p
    return phy2log, log2phy, logcnt


def ascending(log2phy: torch.Tensor) -> torch.Tensor:
    """Each expert's slots in ascending order, -1 padding kept last (the project's convention)."""
    big = torch.iinfo(torch.int64).max
    out = torch.where(log2phy < 0, big, log2phy).sort(dim=-1).values
    return torch.where(out == big, -1, out)


def assert_same_as_reference(weight: torch.Tensor, replicas: int, groups: int, nodes: int, gpus: int):
    plan = rebalance_experts(weight, replicas, groups, nodes, gpus)
    phy2log, log2phy, logcnt = reference_rebalance(weight, replicas, groups, nodes, gpus)
    assert torch.equal(plan.phy2log, phy2log)
    assert torch.equal(plan.logcnt, logcnt)
    assert torch.equal(plan.log2phy, ascending(log2phy))
    return plan


# ---------------------------------------------------------------------------------------
# random loads

CONFIGS = [  # (experts, replicas, groups, nodes, gpus)
    (8, 8, 1, 1, 8),      # num_replicas == num_experts, one slot per GPU
    (16, 16, 4, 2, 4),    # num_replicas == num_experts, hierarchical
    (16, 24, 4, 2, 4),    # hierarchical
    (32, 48, 8, 4, 16),
    (64, 80, 8, 2, 8),    # 32 replicas a node: torch's unstable sort is no longer ordered on ties
    (24, 30, 6, 1, 6),    # one node, hierarchical
    (20, 25, 5, 1, 5),    # one node, groups of 4
    (16, 32, 4, 4, 4),    # one GPU per node
    (12, 24, 2, 2, 2),    # one GPU per node, one group per node
    (10, 30, 5, 1, 1),    # one GPU
    (12, 18, 3, 2, 6),    # 3 groups over 2 nodes: global policy
    (16, 24, 3, 2, 4),    # global, and 3 groups do not divide 16 experts (unused there)
    (18, 24, 6, 4, 8),    # global: 6 groups over 4 nodes
    (9, 12, 3, 3, 12),    # one group per node, one slot per GPU
    (6, 18, 1, 1, 3),     # three replicas per expert
]


def random_loads(experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([
        torch.rand(2, experts, generator=g, dtype=torch.float64) * 1000,        # uniform
        torch.exp(torch.randn(2, experts, generator=g, dtype=torch.float64) * 2.5),  # heavy tail
        torch.randint(2 ** 24, 2 ** 26, (1, experts), generator=g),             # float32 rounds
    ])


@pytest.mark.parametrize("experts,replicas,groups,nodes,gpus", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_loads_place_exactly_like_the_reference(experts, replicas, groups, nodes, gpus, seed):
    plan = assert_same_as_reference(random_loads(experts, seed * 1000 + replicas), replicas, groups, nodes, gpus)
    assert plan.phy2log.shape == (5, replicas)


def tie_loads(experts: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(experts)
    hot = torch.zeros(1, experts)
    hot[0, experts // 2] = 100.0
    return torch.cat([
        torch.zeros(1, experts),                                   # no load at all
        torch.full((1, experts), 3.0),                             # all equal
        hot,                                                       # one expert, the rest idle
        torch.randint(0, 3, (2, experts), generator=g).float(),    # small integers: ties everywhere
        (torch.rand(1, experts, generator=g) < 0.5) * torch.rand(1, experts, generator=g),  # half idle
    ])


@pytest.mark.parametrize("experts,replicas,groups,nodes,gpus", CONFIGS)
def test_ties_and_idle_experts_place_like_the_reference_with_lowest_index_first(experts, replicas, groups,
                                                                             nodes, gpus):
    weight = tie_loads(experts)
    plan = assert_same_as_reference(weight, replicas, groups, nodes, gpus)
    # the idle layer: every redundant slot of a node replicates its first expert
    if groups % nodes == 0 and replicas > experts:
        first = plan.phy2log[0].view(nodes, -1)
        assert (plan.logcnt[0] > 1).sum() == nodes
        for node in range(nodes):
            assert torch.bincount(first[node]).amax() == 1 + (replicas - experts) // nodes


def test_integer_and_float_loads_of_one_count_place_alike():
    weight = random_loads(16, 7)[4:5]   # integer counts near 2^25: float32 rounds them
    base = rebalance_experts(weight, 24, 4, 2, 4).phy2log
    for dtype in (torch.int64, torch.float64, torch.float32):
        assert torch.equal(rebalance_experts(weight.to(dtype), 24, 4, 2, 4).phy2log, base), dtype


def test_int64_loads_round_once_to_float32_like_the_reference():
    """The reference casts int64 loads straight to float32. 2^54 + 2^30 + 1 lies just above the
    float32 midpoint 2^54 + 2^30 and rounds up to 2^54 + 2^31; rounded first to float64 (the old
    validation path) it became the midpoint itself, then 2^54 (ties to even): a tie with expert 0
    instead of the heaviest expert, and another placement."""
    big = 2 ** 54
    weight = torch.tensor([[big, big + 2 ** 30 + 1, 1, 0]], dtype=torch.int64)
    plan = assert_same_as_reference(weight, 4, 1, 1, 2)
    assert plan.phy2log.tolist() == [[1, 3, 0, 2]]     # the old code gave [[0, 2, 1, 3]]


# ---------------------------------------------------------------------------------------
# the deliberate extension: an old placement


@pytest.mark.parametrize("experts,replicas,groups,nodes,gpus", [
    (16, 24, 4, 2, 4), (32, 48, 8, 4, 16), (12, 18, 3, 2, 6), (16, 32, 4, 4, 4), (10, 30, 5, 1, 1),
])
def test_old_placement_only_renames_the_reference_ranks(experts, replicas, groups, nodes, gpus):
    old = rebalance_experts(random_loads(experts, 5), replicas, groups, nodes, gpus).phy2log
    weight = random_loads(experts, 6)
    plan = rebalance_experts(weight, replicas, groups, nodes, gpus, old_phy2log=old)
    ref, _, logcnt = reference_rebalance(weight, replicas, groups, nodes, gpus)
    assert torch.equal(plan.logcnt, logcnt)
    per_gpu = replicas // gpus
    hier = groups % nodes == 0
    for layer in range(weight.shape[0]):
        def racks(p2l):   # node -> sorted list of its GPUs' sorted expert lists
            gpus_ = [sorted(p2l[r * per_gpu:(r + 1) * per_gpu].tolist()) for r in range(gpus)]
            per_node = gpus // nodes if hier else gpus
            return sorted(sorted(gpus_[i:i + per_node]) for i in range(0, gpus, per_node))
        assert racks(plan.phy2log[layer]) == racks(ref[layer])
    ours, theirs = rank_loads(weight, plan.phy2log, gpus), rank_loads(weight, ref, gpus)
    # same replicas per GPU, summed in another slot order: equal up to float64 rounding
    torch.testing.assert_close(ours.sort(dim=1).values, theirs.sort(dim=1).values, rtol=1e-12, atol=0)
    torch.testing.assert_close(ours.amax(dim=1), theirs.amax(dim=1), rtol=1e-12, atol=0)  # max GPU load


# ---------------------------------------------------------------------------------------
# bad input: a ValueError naming the values, raised before any placement work


BAD = [
    (torch.tensor([[1.0, -2.0, 3.0, 4.0]]), 4, 1, 1, 2, "weight[0, 1] = -2.0"),
    (torch.tensor([[1.0, 2.0, float("nan"), 4.0]]), 4, 1, 1, 2, "weight[0, 2] = nan"),
    (torch.tensor([[1.0, 2.0, 3.0, float("inf")]]), 4, 1, 1, 2, "weight[0, 3] = inf"),
    (torch.ones(2, 8), 10, 1, 1, 4, "num_physical (10) must be divisible by num_ranks (4)"),
    (torch.ones(2, 8), 6, 1, 1, 2, "num_physical (6) must be >= num_logical (8)"),
    (torch.ones(1, 12), 12, 2, 2, 3, "num_nodes (2) must divide num_ranks (3)"),
    # the global policy (1 % 3 != 0) too: 4 GPUs cannot be numbered node-major over 3 nodes
    (torch.ones(1, 8), 8, 1, 3, 4, "num_nodes (3) must divide num_ranks (4)"),
    (torch.ones(1, 8), 8, 3, 1, 2, "num_groups (3) must divide the number of logical experts (8)"),
    (torch.ones(1, 8), 8, 0, 1, 2, "num_groups (0) and num_nodes (1) must be >= 1"),
    (torch.ones(1, 8), 8, 1, 0, 2, "num_groups (1) and num_nodes (0) must be >= 1"),
    (torch.ones(1, 8), 8, 1, 1, 0, "num_ranks (0) must be >= 1"),
    (torch.ones(1, 8), 8.0, 1, 1, 2, "num_physical must be an integer, got 8.0"),
    (torch.ones(8), 8, 1, 1, 2, "got (8,)"),
    (torch.ones(1, 8, dtype=torch.bool), 8, 1, 1, 2, "torch.bool"),
]


@pytest.mark.parametrize("weight,replicas,groups,nodes,gpus,message", BAD)
def test_bad_input_is_a_value_error_before_any_work(monkeypatch, weight, replicas, groups, nodes, gpus, message):
    def no_work(*args, **kwargs):
        raise AssertionError("placement started on bad input")
    for name in ("_hierarchical", "_balanced_packing", "_replicate"):
        monkeypatch.setattr(eplb_placement, name, no_work)
    with pytest.raises(ValueError) as err:
        rebalance_experts(weight, replicas, groups, nodes, gpus)
    assert message in str(err.value)


def test_groups_that_cannot_split_the_experts_are_fine_in_the_global_policy_only():
    # the reference ignores groups in the global policy (3 % 2 != 0) and asserts E % G otherwise
    weight = random_loads(16, 9)
    assert_same_as_reference(weight, 24, 3, 2, 4)
    with pytest.raises(ValueError, match=r"num_groups \(3\) must divide the number of logical experts \(16\)"):
        rebalance_experts(weight, 24, 3, 1, 4)
