"""EPLB weight migration and the Eplb state object on 4 real gloo ranks (ONE launch_local call).

Every rank holds rows of a canonical per-expert table (bf16 weights, packed-fp4 uint8 data,
E8M0 scales as uint8, fp8 scales); after a migration each local slot must hold exactly the
canonical rows of the expert its new map names, bit for bit. Failures injected on some ranks,
before or after the transfer, must leave every rank's weights and maps as they were.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from launch.local import launch_local
from parallel import ParallelConfig, init_parallel
from parallel.ep.eplb import rebalance_experts
from parallel.ep.eplb_migrate import MigrationError, rearrange_weights
from parallel.ep.eplb_state import Eplb, EplbConfig

WORLD = 4
NUM_LOGICAL, NUM_PHYSICAL = 8, 12
SLOTS = NUM_PHYSICAL // WORLD


def canonical_tables(seed: int, num_experts: int) -> list[torch.Tensor]:
    """Per logical expert: bf16 [5, 7], packed fp4 uint8 [5, 4], E8M0 uint8 [5], fp8 [2, 3]."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_experts, 5, 7, generator=g).to(torch.bfloat16),
        torch.randint(0, 256, (num_experts, 5, 4), generator=g, dtype=torch.uint8),
        torch.randint(100, 140, (num_experts, 5), generator=g, dtype=torch.uint8),
        (torch.randn(num_experts, 2, 3, generator=g) * 4).to(torch.float8_e4m3fn),
    ]


def random_placement(g: torch.Generator) -> torch.Tensor:
    """[P] int64: every logical expert once plus random replicas, shuffled."""
    extra = torch.randint(0, NUM_LOGICAL, (NUM_PHYSICAL - NUM_LOGICAL,), generator=g)
    slots = torch.cat([torch.arange(NUM_LOGICAL), extra])
    return slots[torch.randperm(NUM_PHYSICAL, generator=g)]


def local_rows(tables: list[torch.Tensor], phy2log: torch.Tensor, rank: int) -> list[torch.Tensor]:
    mine = phy2log[rank * SLOTS:(rank + 1) * SLOTS]
    return [t[mine].clone() for t in tables]


def bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(t.shape[0], -1).view(torch.uint8) for t in tensors]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b)))


def fail_on(ranks: tuple[int, ...], stage: str, me: int):
    def hook(s: str) -> None:
        if s == stage and me in ranks:
            raise RuntimeError(f"injected failure at {s}")
    return hook


def moe_output(eplb: Eplb, layer: int, weights: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
               gate: torch.Tensor) -> torch.Tensor:
    """A stand-in MoE layer: route to physical slots, gather every rank's slot weights (in place of
    dispatch), y = sum_k gate_k * x @ W[slot_k]."""
    physical = eplb.route(layer, ids)
    everyone = [torch.empty_like(weights) for _ in range(WORLD)]
    dist.all_gather(everyone, weights)
    slot_weights = torch.cat(everyone).float()  # [P, H, H]
    return torch.einsum("tk,tkh->th", gate, torch.einsum("th,tkhj->tkj", x, slot_weights[physical]))


def _rank_main(rank: int) -> dict:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: spinning intra-op threads stall gloo
    groups = init_parallel(ParallelConfig(world_size=WORLD))
    ep = groups.ep
    out: dict = {"stats": []}
    tables = canonical_tables(0, NUM_LOGICAL)
    g = torch.Generator().manual_seed(1)  # same stream on every rank -> same maps

    # 1. migrations between random placements, a rebalance plan, a no-op; bit-exact each time
    old = random_placement(g)
    weights = local_rows(tables, old, rank)
    targets = [random_placement(g) for _ in range(5)]
    load = torch.rand(1, NUM_LOGICAL, generator=g) ** 4 * 1000
    targets.append(rebalance_experts(load, NUM_PHYSICAL, 1, 1, WORLD, old_phy2log=targets[-1]).phy2log[0])
    targets.append(targets[-1].clone())
    for new in targets:
        stats = rearrange_weights(old, new, weights, ep)
        assert same_bits(weights, local_rows(tables, new, rank)), (old.tolist(), new.tolist())
        out["stats"].append((stats.bytes_sent, stats.bytes_received, stats.slots_changed, stats.slots_received))
        old = new

    # 2. failures injected before and after the transfer: everyone raises, nothing changes
    failures = []
    for failing, stage in (((2,), "prepare"), ((2,), "unpack"), ((1, 3), "unpack")):
        new = random_placement(g)
        before = [t.clone() for t in weights]
        try:
            rearrange_weights(old, new, weights, ep, fault_hook=fail_on(failing, stage, rank))
            failures.append(None)
        except MigrationError as exc:
            failures.append(exc.failed_ranks)
        assert same_bits(weights, before)
    # a rank whose own tensors are wrong (here rank 1's first tensor lacks a slot) raises its
    # ValueError after the agreement; its peers raise MigrationError naming it, not a timeout
    new = random_placement(g)
    before = [t.clone() for t in weights]
    wrong = [t[:-1].clone() for t in weights[:1]] + weights[1:] if rank == 1 else weights
    try:
        rearrange_weights(old, new, wrong, ep)
        failures.append(None)
    except ValueError as exc:
        failures.append(("ValueError", "first dim must be the 3 local slots" in str(exc)))
    except MigrationError as exc:
        failures.append(exc.failed_ranks)
    assert same_bits(weights, before)
    out["failures"] = failures
    # ranks that disagree on the maps or the tensors' layout: every rank raises MigrationError
    # naming the odd rank and the values, nothing moves (before: rank 1's swap of two of its own
    # new slots "succeeded" with rows under the wrong expert per its peers' maps; rank 3 seeing
    # no change returned while its peers waited; a float32 table on rank 2 aborted the process)
    disagree = []
    new = random_placement(g)
    mine = new[SLOTS:2 * SLOTS]
    j, k = next((j, k) for j in range(SLOTS) for k in range(SLOTS) if int(mine[j]) != int(mine[k]))
    swapped = new.clone()
    swapped[SLOTS + j], swapped[SLOTS + k] = new[SLOTS + k], new[SLOTS + j]
    p = SLOTS + min(j, k)
    cases = [
        ({1: swapped}, {}, f"rank 1 has new_phy2log[{p}] = {int(swapped[p])}, ranks [0, 2, 3] have {int(new[p])}"),
        ({3: old.clone()}, {}, None),
        ({}, {2: 3}, "rank 2's tensors are (dtype, per-slot shape) [('torch.bfloat16', (5, 7)), "
                     "('torch.uint8', (5, 4)), ('torch.uint8', (5,)), ('torch.float32', (2, 3))], ranks [0, 1, 3]'s "
                     "[('torch.bfloat16', (5, 7)), ('torch.uint8', (5, 4)), ('torch.uint8', (5,)), "
                     "('torch.float8_e4m3fn', (2, 3))]"),
    ]
    for maps, widened, text in cases:
        before = [t.clone() for t in weights]
        mine_new = maps.get(rank, new)
        mine_tensors = [t.float() if i == widened.get(rank) else t for i, t in enumerate(weights)]
        try:
            rearrange_weights(old, mine_new, mine_tensors, ep)
            disagree.append(None)
        except MigrationError as exc:
            disagree.append((exc.failed_ranks, text is None or text in str(exc)))
        assert same_bits(weights, before)
    out["disagree"] = disagree
    new = random_placement(g)  # the group still works after aborted migrations
    rearrange_weights(old, new, weights, ep)
    assert same_bits(weights, local_rows(tables, new, rank))

    # 3. the Eplb object end to end: tracker all-reduce, rebalance, outputs unchanged
    num_layers, hidden = 2, 8
    eplb = Eplb(num_layers, NUM_LOGICAL, group=ep, config=EplbConfig(num_redundant=4, window=4, interval=2))
    canon = torch.randn(num_layers, NUM_LOGICAL, hidden, hidden, generator=torch.Generator().manual_seed(2))
    canon = canon.to(torch.bfloat16)
    layer_weights = [canon[layer][eplb.local_experts(layer)].clone() for layer in range(num_layers)]
    for layer in range(num_layers):
        eplb.register_weights(layer, [layer_weights[layer]])
    mine = torch.Generator().manual_seed(10 + rank)
    tokens = 48
    x = torch.randn(tokens, hidden, generator=mine)
    bias = torch.tensor([0.0, 0, 0, 0, 0, 3.0, 2.5, 0])  # experts 5, 6 are hot
    ids = [torch.topk(torch.rand(tokens, NUM_LOGICAL, generator=mine) * 2 + bias.roll(layer), 2).indices
           for layer in range(num_layers)]
    ids[0][:5, 1] = -1  # padding slots
    raw_gate = torch.rand(tokens, 2, generator=mine)
    gate = [raw_gate * (i >= 0) for i in ids]
    reference = [torch.einsum("tk,tkh->th", gate[l],
                              torch.einsum("th,tkhj->tkj", x, canon[l].float()[ids[l].clamp(min=0)]))
                 for l in range(num_layers)]
    outputs, reports = [], []
    for _ in range(2):
        outputs.append([moe_output(eplb, l, layer_weights[l], x, ids[l], gate[l]) for l in range(num_layers)])
        reports.append(eplb.step())
    outputs.append([moe_output(eplb, l, layer_weights[l], x, ids[l], gate[l]) for l in range(num_layers)])
    assert reports[0] is None and reports[1] is not None
    report = reports[1]
    out["report"] = (report.layers_moved, report.layers_failed, report.overall_before, report.overall_after)
    for step_out in outputs:
        for l in range(num_layers):
            assert torch.equal(step_out[l], reference[l]), l
    for l in range(num_layers):
        assert torch.equal(layer_weights[l], canon[l][eplb.local_experts(l)])
    # the window is the sum over ranks of the logical tokens of both steps
    own = torch.stack([torch.bincount(i[i >= 0], minlength=NUM_LOGICAL) for i in ids]) * 2
    dist.all_reduce(own)
    assert torch.equal(eplb.tracker.window_load(ep), own)
    maps = [torch.empty_like(eplb.phy2log) for _ in range(WORLD)]
    dist.all_gather(maps, eplb.phy2log)
    assert all(torch.equal(m, maps[0]) for m in maps)

    # 4. a failure inside Eplb.rebalance: every layer keeps its maps and weights on every rank
    maps_before = eplb.phy2log.clone()
    weights_before = [w.clone() for w in layer_weights]
    eplb.fault_hook = fail_on((1,), "unpack", rank)
    flipped = torch.ones(num_layers, NUM_LOGICAL)
    flipped[:, 0] = 50.0
    report = eplb.rebalance(flipped)
    out["failed_report"] = (report.layers_moved, report.layers_failed, report.overall_after == report.overall_before)
    assert torch.equal(eplb.phy2log, maps_before)
    assert all(torch.equal(a, b) for a, b in zip(layer_weights, weights_before))
    for l in range(num_layers):
        assert torch.equal(moe_output(eplb, l, layer_weights[l], x, ids[l], gate[l]), reference[l])
    eplb.fault_hook = None
    # 5. ranks given different loads would place differently: a rank whose map did not change skipped a
    # layer's migration its peers waited in. Refused on every rank before any transfer
    other = flipped.clone()
    other[:, 1] = 80.0
    try:
        eplb.rebalance(other if rank == 2 else flipped)
    except ValueError as exc:
        out["load_disagreement"] = str(exc)
    assert torch.equal(eplb.phy2log, maps_before)
    assert all(torch.equal(a, b) for a, b in zip(layer_weights, weights_before))
    # 6. one rank's own tensors of layer 0 are wrong: it raised its ValueError at once while its peers
    # (a MigrationError: layer 0 kept) went on to wait in layer 1's migration; now every rank goes
    # through every layer first
    if rank == 3:
        eplb.weights[0] = [layer_weights[0][:-1]]
    try:
        report = eplb.rebalance(flipped)
        out["own_bad"] = (report.layers_moved, report.layers_failed)
    except ValueError as exc:
        out["own_bad"] = str(exc)
    eplb.weights[0] = [layer_weights[0]]
    report = eplb.rebalance(flipped)
    out["retry"] = (report.layers_moved, eplb.logcnt[:, 0].tolist())
    for l in range(num_layers):
        assert torch.equal(layer_weights[l], canon[l][eplb.local_experts(l)])
        assert torch.equal(moe_output(eplb, l, layer_weights[l], x, ids[l], gate[l]), reference[l])
    return out


def test_migration_bit_exact_atomic_and_eplb_end_to_end_on_4_gloo_ranks():
    results = launch_local(_rank_main, WORLD, timeout=90)
    # every byte sent by some rank was received by another
    for case in range(len(results[0]["stats"])):
        sent = sum(r["stats"][case][0] for r in results)
        received = sum(r["stats"][case][1] for r in results)
        assert sent == received
    changed = [sum(r["stats"][case][2] for r in results) for case in range(len(results[0]["stats"]))]
    assert all(c > 0 for c in changed[:-1]) and changed[-1] == 0  # the last target repeats the map
    assert any(r["stats"][0][3] > 0 for r in results)  # something crossed ranks
    for rank, r in enumerate(results):
        bad_input = ("ValueError", True) if rank == 1 else [1]
        assert r["failures"] == [[2], [2], [1, 3], bad_input]
        assert r["disagree"] == [([1], True), ([3], True), ([2], True)]
        moved, failed, before, after = r["report"]
        assert moved and not failed and after > before
        assert r["failed_report"] == ([], [0, 1], True)
        assert r["retry"][0] == [0] and min(r["retry"][1]) >= 2
        assert r["own_bad"] == ([1], [0]) if rank != 3 else "tensors[0] has shape (2, 8, 8)" in r["own_bad"], (rank, r["own_bad"])
        msg = r.get("load_disagreement", "")
        assert "EPLB rebalance: the ranks of the group disagree" in msg and "new phy2log checksum" in msg, (rank, msg)
        assert "old phy2log checksum" not in msg, msg       # only the new maps differ
    assert all(r["report"] == results[0]["report"] for r in results)


def test_rebalance_with_a_load_of_the_wrong_shape_raises_naming_it():
    eplb = Eplb(2, NUM_LOGICAL, config=EplbConfig(num_redundant=4))
    before = eplb.phy2log.clone()
    for load, got in ((torch.ones(NUM_LOGICAL, 2), "(8, 2)"), (torch.ones(2, NUM_LOGICAL + 1), "(2, 9)"),
                      (torch.ones(NUM_LOGICAL), "(8,)"), ([[1.0] * NUM_LOGICAL] * 2, "list")):
        with pytest.raises(ValueError, match=rf"load must be a tensor \[num_layers, num_logical\] = \[2, 8\], "
                                             rf"got {re.escape(got)}"):
            eplb.rebalance(load)
    assert torch.equal(eplb.phy2log, before)
    report = eplb.rebalance(torch.arange(2 * NUM_LOGICAL, dtype=torch.float32).view(2, NUM_LOGICAL))
    assert report.layers_moved == [0, 1]
