"""`megapar bench eplb`: placement time, balance gained on skewed routing, migration cost.

1. Rebalance time for L=61 layers, E=256 logical experts, P=288 slots, 32 ranks (hierarchical:
   8 groups on 4 nodes; global), fresh and with the old placement (slot preservation).
   Anchor: the same algorithm called once per layer (what a per-layer port does).
2. Busiest rank / mean rank load at EP = 8, 16, 32 (E=256, top-8) on Zipf routing, simulated
   from token counts (no processes): before = contiguous blocks of E/EP experts per rank;
   after = EPLB with one redundant slot per rank, planned on one window of tokens and
   measured on a fresh window routed through `logical_to_physical` (so hash imbalance across
   replicas and window-to-window noise count).
3. Migration of one MoE layer between two placements over gloo (CPU processes via
   launch_local, 4 of them, 2 with --quick, `--world-size N`: N; MXFP4-like uint8 weights + E8M0
   scales, scaled-down H/I): bytes moved and time, against the naive all-gather of every slot's
   weights.
The time column is the placement / migration time (medians); balance rows carry the ratios as
extras.
"""

from __future__ import annotations

import statistics
import time

import torch

from megapar.launch.bench.common import BenchContext
from megapar.parallel.ep.eplb import balancedness, logical_to_physical, rebalance_experts

NUM_LAYERS, NUM_LOGICAL, NUM_PHYSICAL, NUM_RANKS = 61, 256, 288, 32


def zipf_probs(num_experts: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """[E] float64 routing probabilities: Zipf over a random permutation of the experts."""
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    return (p / p.sum())[torch.argsort(torch.randperm(num_experts, generator=generator))]


def sample_topk(probs: torch.Tensor, tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """[T, K] int64 distinct experts per token drawn from `probs` (Gumbel top-k)."""
    gumbel = -torch.log(-torch.log(torch.rand(tokens, probs.numel(), generator=generator, dtype=torch.float64)))
    return torch.topk(probs.log() + gumbel, top_k, dim=1).indices


def _bench_rebalance_time(ctx: BenchContext) -> None:
    layers = 4 if ctx.quick else NUM_LAYERS
    g = torch.Generator().manual_seed(0)
    load = torch.stack([zipf_probs(NUM_LOGICAL, 1.0, g) for _ in range(layers)]) * 1e6
    old = rebalance_experts(load.flip(1), NUM_PHYSICAL, 8, 4, NUM_RANKS).phy2log
    for policy, groups, nodes in (("hierarchical", 8, 4), ("global", 1, 1)):
        for with_old in (False, True):
            prev = old if with_old else None
            ours = ctx.time_fn(lambda: rebalance_experts(load, NUM_PHYSICAL, groups, nodes, NUM_RANKS, prev))
            per_layer = ctx.time_fn(lambda: [
                rebalance_experts(load[i:i + 1], NUM_PHYSICAL, groups, nodes, NUM_RANKS,
                                  None if prev is None else prev[i:i + 1]) for i in range(layers)],
                iters=1 if ctx.quick else 3)
            ctx.record(f"rebalance {policy} L={layers} E={NUM_LOGICAL} P={NUM_PHYSICAL} R={NUM_RANKS}"
                       + (" +old" if with_old else ""), ours, anchor="same algorithm, one layer per call",
                       anchor_us=per_layer, layers=layers)


def _rank_of(physical: torch.Tensor, slots_per_rank: int, num_ranks: int) -> torch.Tensor:
    ids = physical.flatten()
    return torch.bincount(ids[ids >= 0] // slots_per_rank, minlength=num_ranks).double()


def _bench_balance(ctx: BenchContext) -> None:
    tokens, top_k = (2048, 8) if ctx.quick else (16384, 8)
    layers = 2 if ctx.quick else 8
    for exponent in (1.2,) if ctx.quick else (0.8, 1.2):
        for ep in (8, 16, 32):
            g = torch.Generator().manual_seed(ep * 100 + int(exponent * 10))
            probs = [zipf_probs(NUM_LOGICAL, exponent, g) for _ in range(layers)]
            window = [sample_topk(p, tokens, top_k, g) for p in probs]
            fresh = [sample_topk(p, tokens, top_k, g) for p in probs]
            load = torch.stack([torch.bincount(w.flatten(), minlength=NUM_LOGICAL) for w in window]).double()
            blocks = torch.arange(NUM_LOGICAL).expand(layers, -1)
            num_physical = NUM_LOGICAL + ep
            nodes = max(1, ep // 8)
            for policy, groups in (("global", 1), ("hierarchical", 8)):
                plan = rebalance_experts(load, num_physical, groups, nodes, ep)
                plan_us = ctx.time_fn(lambda: rebalance_experts(load, num_physical, groups, nodes, ep))
                before = balancedness(load, blocks, ep)
                planned = balancedness(load, plan.phy2log, ep)
                spr, old_spr = num_physical // ep, NUM_LOGICAL // ep
                measured_before, measured_after = [], []
                for layer in range(layers):
                    phys = logical_to_physical(fresh[layer], plan.log2phy[layer], plan.logcnt[layer])
                    after_counts = _rank_of(phys, spr, ep)
                    before_counts = _rank_of(fresh[layer], old_spr, ep)
                    measured_after.append(after_counts.max() / after_counts.mean())
                    measured_before.append(before_counts.max() / before_counts.mean())
                ctx.record(f"balance zipf{exponent} EP={ep} {policy}", plan_us,
                           ep=ep, num_physical=num_physical, nodes=nodes, layers=layers,
                           max_over_mean_before=before.max_over_mean,
                           max_over_mean_planned=planned.max_over_mean,
                           max_over_mean_fresh_before=statistics.mean(float(x) for x in measured_before),
                           max_over_mean_fresh_after=statistics.mean(float(x) for x in measured_after))


def _migration_rank(rank: int, world: int, slots_per_rank: int, hidden: int, inter: int, iters: int) -> dict:
    import torch.distributed as dist

    from megapar.parallel import ParallelConfig, init_parallel
    from megapar.parallel.ep.eplb import default_phy2log
    from megapar.parallel.ep.eplb_migrate import rearrange_weights

    import os

    # ranks share the host's cores: oversubscribed intra-op threads spin and stall gloo's transfers
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    groups = init_parallel(ParallelConfig(world_size=world))
    num_physical = slots_per_rank * world
    num_logical = num_physical - world  # one redundant slot per rank
    g = torch.Generator().manual_seed(rank)
    # MXFP4 layout: w13 [2I, H/2] + scales [2I, H/32], w2 [H, I/2] + scales [H, I/32]
    tensors = [torch.randint(0, 256, (slots_per_rank, 2 * inter, hidden // 2), generator=g, dtype=torch.uint8),
               torch.randint(0, 256, (slots_per_rank, 2 * inter, hidden // 32), generator=g, dtype=torch.uint8),
               torch.randint(0, 256, (slots_per_rank, hidden, inter // 2), generator=g, dtype=torch.uint8),
               torch.randint(0, 256, (slots_per_rank, hidden, inter // 32), generator=g, dtype=torch.uint8)]
    shared = torch.Generator().manual_seed(1234)
    load = (1.0 / torch.arange(1, num_logical + 1, dtype=torch.float64))[torch.randperm(num_logical, generator=shared)]
    old = default_phy2log(1, num_logical, num_physical)[0]
    new = rebalance_experts(load[None] * 1e6, num_physical, 1, 1, world, old_phy2log=old).phy2log[0]
    times, stats = [], None
    for i in range(2 * iters + 2):  # the first round trip warms up the peer connections
        src, dst = (old, new) if i % 2 == 0 else (new, old)
        dist.barrier()
        start = time.perf_counter()
        s = rearrange_weights(src, dst, tensors, groups.ep)
        if i >= 2:
            times.append(time.perf_counter() - start)
        stats = stats or s
    # anchor: every rank all-gathers every slot's bytes
    flat = torch.cat([t.reshape(slots_per_rank, -1) for t in tensors], dim=1)
    out = torch.empty(world * flat.shape[0], flat.shape[1], dtype=torch.uint8)
    gather_times = []
    for _ in range(iters + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_gather_into_tensor(out, flat)  # noqa: the deprecated name works on torch 2.11-2.13
        gather_times.append(time.perf_counter() - start)
    gather_times = gather_times[1:]
    return {"us": statistics.median(times) * 1e6, "allgather_us": statistics.median(gather_times) * 1e6,
            "sent": stats.bytes_sent, "received": stats.bytes_received, "changed": stats.slots_changed,
            "slot_bytes": flat.shape[1], "slots": num_physical}


def _bench_migration(ctx: BenchContext) -> None:
    from megapar.launch.local import launch_local

    if ctx.quick:
        world, slots, hidden, inter, iters = 2, 5, 256, 128, 3
    else:
        world, slots, hidden, inter, iters = 4, 9, 2048, 1024, 5
    world = ctx.world_sizes([world])[0]
    results = launch_local(_migration_rank, world, args=(world, slots, hidden, inter, iters), timeout=300)
    slowest = max(r["us"] for r in results)
    anchor = max(r["allgather_us"] for r in results)
    moved = sum(r["received"] for r in results)
    ctx.record(f"migrate 1 layer gloo world={world} slots={results[0]['slots']} "
               f"slot={results[0]['slot_bytes'] / 2**20:.2f}MiB", slowest,
               anchor="all-gather of every slot", anchor_us=anchor, bytes_moved=moved,
               max_rank_bytes=max(r["received"] for r in results),
               slots_changed=sum(r["changed"] for r in results),
               gbps=moved / slowest / 1e3)
    ctx.note("migration runs on CPU gloo processes regardless of --device (one H200 cannot host an EP group)")


def run(ctx: BenchContext) -> None:
    _bench_rebalance_time(ctx)
    _bench_balance(ctx)
    _bench_migration(ctx)
