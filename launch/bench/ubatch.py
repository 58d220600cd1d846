"""`megapar bench ubatch`: what micro-batch overlap buys on a MoE forward.

A MoE-like forward of L layers, each: x @ [H, r] @ [r, H] (stand-in for attention), EP
dispatch (`parallel.ep.make_dispatcher`, all-to-all), two expert matmuls per local expert,
EP combine, residual add. The dispatch and combine are launched asynchronously and the
micro-batch yields with their `wait` as receive hook (exactly what `moe/layer.py` does), so
with 2 micro-batches one's all-to-all is in flight while the other computes.

Rows: the forward with `UBatchRunner(n)` for n = 2 (and 3 on larger runs) against the same
forward unsplit (the anchor: speedup = anchor / time), plus the time of the communication
alone and of the compute alone, and the hidden fraction
`(unsplit - split) / min(comm, compute)` (1 = the smaller one fully hidden).

CPU: 2 gloo processes, a large hidden size so that the loopback all-to-all is slow (it is
the case the issue asks for: overlap pays when communication costs as much as compute).
CUDA: NCCL over all visible GPUs (2, 4, 8) when there are >= 2; with one GPU only the EP = 1
case runs (the runner's overhead; no communication to hide) and a note says so.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from launch.bench.common import BenchContext


@dataclass(frozen=True)
class _Shape:
    tokens: int  # per rank
    hidden: int
    inter: int  # expert intermediate size
    experts_per_rank: int
    top_k: int
    layers: int
    attn_rank: int  # the attention stand-in is x @ [H, r] @ [r, H]


def _shape(ctx: BenchContext) -> _Shape:
    if ctx.quick:
        return _Shape(tokens=32, hidden=64, inter=32, experts_per_rank=2, top_k=2, layers=1, attn_rank=16)
    if not ctx.is_cuda:
        # Loopback gloo moves ~0.2-0.5 GB/s here: at H = 4096 the all-to-alls take about as
        # long as this much single-thread compute.
        return _Shape(tokens=256, hidden=4096, inter=64, experts_per_rank=2, top_k=2, layers=3, attn_rank=64)
    return _Shape(tokens=4096, hidden=7168, inter=2048, experts_per_rank=8, top_k=8, layers=4, attn_rank=1024)


class _MoEForward:
    """The forward on one rank; `__call__(x, topk_ids, topk_weights)` is what the runner splits.

    comm=False: `group` must be a group of one (every expert local: the same compute, no
    transfer); compute=False: the dispatch/combine alone.
    """

    def __init__(self, shape: _Shape, group, rank: int, size: int, device: torch.device, dtype: torch.dtype,
                 *, comm: bool = True, compute: bool = True) -> None:
        from parallel.ep import make_dispatcher

        g = torch.Generator().manual_seed(1234 + rank)
        h, i, e = shape.hidden, shape.inter, shape.experts_per_rank
        self.shape, self.comm, self.compute = shape, comm, compute
        r = shape.attn_rank
        self.w_attn_in = (torch.randn(shape.layers, h, r, generator=g) / h ** 0.5).to(device, dtype)
        self.w_attn_out = (torch.randn(shape.layers, r, h, generator=g) / r ** 0.5).to(device, dtype)
        self.w_up = (torch.randn(shape.layers, e, h, i, generator=g) / h ** 0.5).to(device, dtype)
        self.w_down = (torch.randn(shape.layers, e, i, h, generator=g) / i ** 0.5).to(device, dtype)
        self.dispatcher = make_dispatcher(group, num_experts=e * size, hidden=h, backend="auto")

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from parallel.ubatch import ubatch_yield

        if not self.comm:
            topk_ids = topk_ids % self.shape.experts_per_rank  # every expert local, same work
        for layer in range(self.shape.layers):
            h = (x @ self.w_attn_in[layer]) @ self.w_attn_out[layer] if self.compute else x
            res = ubatch_yield(self.dispatcher.dispatch(h, topk_ids, topk_weights, async_op=True).wait)
            if self.compute:
                outs, start = [], 0
                for e, n in enumerate(res.counts.tolist()):
                    rows = res.x[start:start + n]
                    outs.append(torch.relu(rows @ self.w_up[layer, e]) @ self.w_down[layer, e])
                    start += n
                expert_out = torch.cat(outs) if outs else res.x
            else:
                expert_out = res.x
            y = ubatch_yield(self.dispatcher.combine(expert_out, res.handle, async_op=True).wait)
            x = x + y
        return x


def _rank(rank: int, shape: _Shape, ubatch_counts: tuple[int, ...], quick: bool) -> list[dict]:
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.comm import resolve_group
    from parallel.ubatch import UBatchRunner

    world = int(os.environ["WORLD_SIZE"])
    groups = init_parallel(ParallelConfig(world_size=world))
    pg, _, size = resolve_group(groups.ep)
    cuda = groups.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # two ranks share the cores; gloo's own threads need some too
    ctx = BenchContext(suite="ubatch", device=device, quick=quick)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(rank)
    num_experts = shape.experts_per_rank * size
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(device, dtype)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:shape.top_k]
                            for _ in range(shape.tokens)]).to(device)
    topk_weights = torch.full((shape.tokens, shape.top_k), 1.0 / shape.top_k, device=device)
    forward = _MoEForward(shape, groups.ep, rank, size, device, dtype)
    comm_only = _MoEForward(shape, groups.ep, rank, size, device, dtype, compute=False)
    singletons = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    compute_only = _MoEForward(shape, singletons[rank], rank, 1, device, dtype, comm=False)

    runners = {n: UBatchRunner(n) for n in ubatch_counts}
    cases = {"plain": lambda: forward(x, topk_ids, topk_weights),
             "comm": lambda: comm_only(x, topk_ids, topk_weights),
             "compute": lambda: compute_only(x, topk_ids, topk_weights)}
    for n, runner in runners.items():
        cases[n] = lambda runner=runner: runner.run(forward, x, topk_ids, topk_weights, split=True)
    rows: list[dict] = []
    with torch.no_grad():
        want = forward(x, topk_ids, topk_weights)
        errors = {n: (runners[n].run(forward, x, topk_ids, topk_weights, split=True).float() - want.float())
                  .abs().max().item() for n in runners}
        times = _interleaved_medians(ctx, cases, pg)
    plain_us, comm_us, compute_us = times["plain"], times["comm"], times["compute"]
    for n in runners:
        rows.append(dict(case=f"moe fwd ep={size} ubatches={n}", time_us=times[n], anchor="same forward, unsplit",
                         anchor_us=plain_us, comm_us=comm_us, compute_us=compute_us,
                         hidden_fraction=(plain_us - times[n]) / min(comm_us, compute_us), max_abs_diff=errors[n],
                         tokens=shape.tokens, hidden=shape.hidden, inter=shape.inter,
                         experts=num_experts, top_k=shape.top_k, layers=shape.layers))
    destroy_parallel()
    return rows if rank == 0 else []


def _interleaved_medians(ctx: BenchContext, cases: dict, pg) -> dict:
    """Median µs per case. On CPU the cases alternate within each iteration, so a load change
    on a shared machine hits all of them alike; on CUDA each is timed with events."""
    if ctx.is_cuda:
        out = {}
        for name, fn in cases.items():
            dist.barrier(group=pg)
            out[name] = ctx.time_fn(fn)
        return out
    warmup, iters = (1, 3) if ctx.quick else (2, 9)
    samples: dict = {name: [] for name in cases}
    for it in range(warmup + iters):
        for name, fn in cases.items():
            dist.barrier(group=pg)
            start = time.perf_counter()
            fn()
            if it >= warmup:
                samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def _single_device(ctx: BenchContext, shape: _Shape) -> None:
    """EP = 1 in this process: no communication, so this is the runner's overhead."""
    from parallel.ubatch import UBatchRunner

    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(ctx.device, dtype)
    topk_ids = torch.randint(0, shape.experts_per_rank, (shape.tokens, shape.top_k), generator=g).to(ctx.device)
    topk_weights = torch.full((shape.tokens, shape.top_k), 1.0 / shape.top_k, device=ctx.device)
    forward = _MoEForward(shape, None, 0, 1, ctx.device, dtype, comm=False)
    runner = UBatchRunner(2)
    with torch.no_grad():
        plain = ctx.time_fn(lambda: forward(x, topk_ids, topk_weights))
        split = ctx.time_fn(lambda: runner.run(forward, x, topk_ids, topk_weights, split=True))
    ctx.record("moe fwd ep=1 ubatches=2 (overhead, nothing to overlap)", split, anchor="same forward, unsplit",
               anchor_us=plain, tokens=shape.tokens, hidden=shape.hidden, layers=shape.layers)


def run(ctx: BenchContext) -> None:
    from launch.local import launch_local

    shape = _shape(ctx)
    if ctx.is_cuda:
        _single_device(ctx, shape)
        available = torch.cuda.device_count()
        if available < 2:
            ctx.note(f"multi-GPU overlap cases skipped: they need >= 2 GPUs (found {available}); on a multi-GPU "
                     "machine `megapar bench ubatch --device cuda` runs EP = 2, 4, 8 over NCCL")
            return
        sizes, backend, counts = [p for p in (2, 4, 8) if p <= available], "nccl", (2, 3)
    else:
        sizes, backend, counts = [2], "gloo", ((2,) if ctx.quick else (2, 3))
        ctx.note("CPU: 2 gloo processes, 1 compute thread each; the all-to-all goes over loopback TCP")
    for p in sizes:
        rows = launch_local(_rank, p, backend=backend, args=(shape, counts, ctx.quick), timeout=600)[0]
        for row in rows:
            case = row.pop("case")
            ctx.record(case, row.pop("time_us"), anchor=row.pop("anchor"), anchor_us=row.pop("anchor_us"), **row)
