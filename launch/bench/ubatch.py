"""`megapar bench ubatch`: what micro-batch overlap buys on a MoE forward.

A MoE-like forward of L layers, each: x @ [H, r] @ [r, H] (stand-in for attention), EP
dispatch, two expert matmuls per local expert, EP combine, residual add. Dispatch and
combine are launched asynchronously and the micro-batch yields with their `wait` as receive
hook (what `moe/layer.py` does), so with n micro-batches one's transfer is in flight while
another computes. Two transports:
- "ep": `parallel.ep.make_dispatcher` (census, packing, layout: the real layer's path);
- "a2a": plain `all_to_all_single` of fixed halves (no census, no packing): the transfer alone.

Rows: the forward with `UBatchRunner(n)` against the same forward unsplit (the anchor;
speedup = anchor / time), with the time of the communication alone and of the compute alone,
`hidden_fraction = (unsplit - split) / min(comm, compute)` (1 = the smaller fully hidden) and
`comm_cpu_cores`: CPU seconds per second of the communication-only pass. Overlap pays only
when the transfer leaves the CPU idle: loopback gloo copies through the kernel, so on a machine
with no spare cores (e.g. 2 ranks on 2 cores, where `comm_cpu_cores` ~ 0.7) there is nothing to
overlap into, and splitting only adds its per-collective latency. Since async dispatch/combine
run census, transfer and layout on a communication thread (`parallel.ep.dispatch`), the caller
never blocks on a collective; measured here (2 cores, 2 ranks, H = 4096 and 8192, T = 256 and
512) the split forward is still 0.8-1.0x of the unsplit one, for the plain all-to-all too:
the loopback copies (comm_cpu_cores ~0.5-0.8 per rank) and the dispatcher's memory-bound
permutes compete with the other micro-batch's compute for the same two cores.

CPU: 2 gloo processes, 1 compute thread each. CUDA: NCCL over all visible GPUs (2, 4, 8) when
there are >= 2; with one GPU only the EP = 1 case runs (the runner's overhead; nothing to hide)
and a note says so. `--world-size N`: N processes (ranks) alone.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megapar.launch.bench.common import BenchContext


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
        # At H = 4096 the loopback all-to-alls take about as long as this much compute.
        return _Shape(tokens=256, hidden=4096, inter=64, experts_per_rank=2, top_k=2, layers=3, attn_rank=64)
    return _Shape(tokens=4096, hidden=7168, inter=2048, experts_per_rank=8, top_k=8, layers=4, attn_rank=1024)


class _MoEForward:
    """The forward on one rank; `__call__(x, topk_ids, topk_weights)` is what the runner splits.

    transport: "ep" | "a2a" | None (no communication: every expert local, the same compute);
    compute=False: the communication alone.
    """

    def __init__(self, shape: _Shape, group: dist.ProcessGroup | None, size: int, seed: int, device: torch.device,
                 dtype: torch.dtype, *, transport: str | None, compute: bool = True) -> None:
        from megapar.parallel.ep import make_dispatcher

        g = torch.Generator().manual_seed(seed)
        h, i, e, r = shape.hidden, shape.inter, shape.experts_per_rank, shape.attn_rank
        self.shape, self.group, self.size, self.transport, self.compute = shape, group, size, transport, compute
        self.w_attn_in = (torch.randn(shape.layers, h, r, generator=g) / h ** 0.5).to(device, dtype)
        self.w_attn_out = (torch.randn(shape.layers, r, h, generator=g) / r ** 0.5).to(device, dtype)
        self.w_up = (torch.randn(shape.layers, e, h, i, generator=g) / h ** 0.5).to(device, dtype)
        self.w_down = (torch.randn(shape.layers, e, i, h, generator=g) / i ** 0.5).to(device, dtype)
        self.dispatcher = make_dispatcher(group, num_experts=e * size, hidden=h) if transport == "ep" else None

    def _experts(self, layer: int, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if not self.compute:
            return rows
        outs, start = [], 0
        for e, n in enumerate(counts):
            outs.append(torch.relu(rows[start:start + n] @ self.w_up[layer, e]) @ self.w_down[layer, e])
            start += n
        return torch.cat(outs)

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Fixed halves to every rank and back ("a2a"): launch, yield, wait."""
        from megapar.parallel.ubatch import ubatch_yield

        out = torch.empty_like(t)
        work = dist.all_to_all_single(out, t.contiguous(), group=self.group, async_op=True)
        return ubatch_yield(lambda: (work.wait(), out)[1])

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from megapar.parallel.ubatch import ubatch_yield

        e = self.shape.experts_per_rank
        for layer in range(self.shape.layers):
            h = (x @ self.w_attn_in[layer]) @ self.w_attn_out[layer] if self.compute else x
            if self.transport == "ep":
                res = ubatch_yield(self.dispatcher.dispatch(h, topk_ids, topk_weights, async_op=True).wait)
                out = self._experts(layer, res.x, res.counts.tolist())
                y = ubatch_yield(self.dispatcher.combine(out, res.handle, async_op=True).wait)
            else:
                recv = self._exchange(h) if self.transport == "a2a" else h
                rows = recv.shape[0]
                out = self._experts(layer, recv, [rows // e + (1 if k < rows % e else 0) for k in range(e)])
                y = self._exchange(out) if self.transport == "a2a" else out
            x = x + y
        return x


def _interleaved_medians(ctx: BenchContext, cases: dict[str, Callable[[], object]], pg) -> dict[str, float]:
    """Median µs per case. On CPU the cases alternate within each iteration, so a load change
    on a shared machine hits all of them alike; on CUDA each is timed with events."""
    if ctx.is_cuda:
        out = {}
        for name, fn in cases.items():
            dist.barrier(group=pg)
            out[name] = ctx.time_fn(fn)
        return out
    warmup, iters = (1, 3) if ctx.quick else (2, 15)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for it in range(warmup + iters):
        for name, fn in cases.items():
            dist.barrier(group=pg)
            start = time.perf_counter()
            fn()
            if it >= warmup:
                samples[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def _cpu_cores_used(fn: Callable[[], object], pg) -> float:
    """CPU seconds of this process (all its threads) per wall second while `fn` runs."""
    dist.barrier(group=pg)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.process_time() - cpu) / (time.perf_counter() - wall)


def _rank(rank: int, shape: _Shape, ubatch_counts: tuple[int, ...], quick: bool) -> list[dict]:
    from megapar.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megapar.parallel.comm import resolve_group
    from megapar.parallel.ubatch import UBatchRunner

    world = int(os.environ["WORLD_SIZE"])
    groups = init_parallel(ParallelConfig(world_size=world))
    pg, _, size = resolve_group(groups.ep)
    cuda = groups.backend == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)  # the ranks share the cores; gloo's threads need some too
    ctx = BenchContext(suite="ubatch", device=device, quick=quick)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(rank)
    num_experts = shape.experts_per_rank * size
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(device, dtype)
    topk_ids = torch.stack([torch.randperm(num_experts, generator=g)[:shape.top_k]
                            for _ in range(shape.tokens)]).to(device)
    topk_weights = torch.full((shape.tokens, shape.top_k), 1.0 / shape.top_k, device=device)
    local_ids = topk_ids % shape.experts_per_rank
    singletons = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes every group
    seed = 1234 + rank
    rows: list[dict] = []
    for transport in ("ep", "a2a"):
        forward = _MoEForward(shape, pg, size, seed, device, dtype, transport=transport)
        comm_only = _MoEForward(shape, pg, size, seed, device, dtype, transport=transport, compute=False)
        compute_only = _MoEForward(shape, singletons[rank], 1, seed, device, dtype,
                                   transport="ep" if transport == "ep" else None)
        ids = topk_ids
        runners = {n: UBatchRunner(n) for n in ubatch_counts}
        cases: dict[str, Callable[[], object]] = {
            "plain": lambda: forward(x, ids, topk_weights),
            "comm": lambda: comm_only(x, ids, topk_weights),
            "compute": lambda: compute_only(x, local_ids, topk_weights),
        }
        for n, runner in runners.items():
            cases[f"split{n}"] = lambda runner=runner: runner.run(forward, x, ids, topk_weights, split=True)
        with torch.no_grad():
            want = forward(x, ids, topk_weights)
            # "a2a" splits rows by position, so its result depends on the split; only "ep" is checked.
            errors = {n: (r.run(forward, x, ids, topk_weights, split=True).float() - want.float()).abs().max().item()
                      for n, r in runners.items()} if transport == "ep" else {}
            times = _interleaved_medians(ctx, cases, pg)
            comm_cores = None if cuda else _cpu_cores_used(cases["comm"], pg)
        plain_us, comm_us, compute_us = times["plain"], times["comm"], times["compute"]
        for n in runners:
            split_us = times[f"split{n}"]
            extra = {"max_abs_diff": errors[n]} if n in errors else {}
            if comm_cores is not None:
                extra["comm_cpu_cores"] = comm_cores
            rows.append(dict(case=f"moe fwd {transport} ep={size} ubatches={n}", time_us=split_us,
                             anchor="same forward, unsplit", anchor_us=plain_us, comm_us=comm_us,
                             compute_us=compute_us, hidden_fraction=(plain_us - split_us) / min(comm_us, compute_us),
                             tokens=shape.tokens, hidden=shape.hidden, inter=shape.inter, experts=num_experts,
                             top_k=shape.top_k, layers=shape.layers, attn_rank=shape.attn_rank, **extra))
    destroy_parallel()
    return rows if rank == 0 else []


def _single_device(ctx: BenchContext, shape: _Shape) -> None:
    """EP = 1 in this process: no communication, so this is the runner's overhead."""
    from megapar.parallel.ubatch import UBatchRunner

    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape.tokens, shape.hidden, generator=g).to(ctx.device, dtype)
    topk_ids = torch.randint(0, shape.experts_per_rank, (shape.tokens, shape.top_k), generator=g).to(ctx.device)
    topk_weights = torch.full((shape.tokens, shape.top_k), 1.0 / shape.top_k, device=ctx.device)
    forward = _MoEForward(shape, None, 1, 0, ctx.device, dtype, transport="ep")
    runner = UBatchRunner(2)
    with torch.no_grad():
        plain = ctx.time_fn(lambda: forward(x, topk_ids, topk_weights))
        split = ctx.time_fn(lambda: runner.run(forward, x, topk_ids, topk_weights, split=True))
    ctx.record("moe fwd ep=1 ubatches=2 (overhead, nothing to overlap)", split, anchor="same forward, unsplit",
               anchor_us=plain, tokens=shape.tokens, hidden=shape.hidden, layers=shape.layers)


def run(ctx: BenchContext) -> None:
    from megapar.launch.local import launch_local

    shape = _shape(ctx)
    if ctx.is_cuda:
        _single_device(ctx, shape)
        available = torch.cuda.device_count()
        if available < 2:
            ctx.note(f"multi-GPU overlap cases skipped: they need >= 2 GPUs (found {available}); on a multi-GPU "
                     "machine `megapar bench ubatch --device cuda` runs EP = 2, 4, 8 over NCCL")
            return
        sizes, backend, counts = ctx.world_sizes([p for p in (2, 4, 8) if p <= available], available), "nccl", (2, 3)
    else:
        sizes, backend, counts = ctx.world_sizes([2]), "gloo", ((2,) if ctx.quick else (2, 3))
        ctx.note(f"CPU: 2 gloo processes with 1 compute thread each on a machine with {os.cpu_count()} cores; "
                 "the all-to-all goes over loopback TCP (see comm_cpu_cores)")
    for p in sizes:
        rows = launch_local(_rank, p, backend=backend, args=(shape, counts, ctx.quick), timeout=600)[0]
        for row in rows:
            case = row.pop("case")
            ctx.record(case, row.pop("time_us"), anchor=row.pop("anchor"), anchor_us=row.pop("anchor_us"), **row)
