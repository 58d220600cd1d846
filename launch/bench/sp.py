"""`megapar bench sp`: what decomposing the TP collectives costs, and how much of them it hides.

1. Decomposition cost (one device; docs/performance.md target <= 1.05x). The "decomposed" backend
   replaces one matmul by P block matmuls. Measured by running the op's own engines
   (`parallel.sp.ops.decomposed_all_gather_matmul` / `decomposed_matmul_reduce_scatter`,
   what `all_gather_matmul` / `matmul_reduce_scatter` call) on a loopback peer set
   (`RingPeers.loopback_of`): the same allocations and kernels, sends and receives skipped
   (the gather's receive buffer is passed in holding random data, so the block matmuls see
   realistic operands: GEMM clocks depend on the data). all-gather-matmul: this rank's
   [M/P, K] shard multiplied straight from the input, then each arriving block into its
   rows of the output. matmul-reduce-scatter: P partials [M/P, K'] @ [K', N] into the send
   / receive buffers, then one reduction over the [P, M/P, N] receive buffer. Shapes: the
   FFN of the issue, M = 8192 tokens, K = 8192, N = 28672/P (column-parallel up projection;
   the row-parallel down projection is [M, 28672/P] @ [28672/P, 8192]) for P = 2, 4, 8,
   against one matmul of the same total size, with the GEMM roofline (bf16 at the measured
   799 TFLOP/s). `blocks_ratio`: the P block matmuls alone on one stream (the GEMM part of
   the cost; the rest is the reduction of matmul-reduce-scatter). On CUDA the op also runs
   with the other number of compute lanes (`parallel.sp.ops.COMPUTE_LANES`; rows
   "... lanes=2": block matmuls rotated over 2 streams, so one's last partial wave overlaps
   the next). Everything of one shape is timed interleaved (a, b, c, c, b, a, ...), several
   calls a sample, after a GPU sleep that lets the host queue them, so clock drift and host
   launch latency count the same for all.
2. Overlap (>= 2 GPUs, NCCL; target: >= 80% of the smaller of comm and GEMM time hidden).
   For each op and backend: time of the op, of its collective alone and of its GEMM alone;
   hidden fraction = (comm + gemm - op) / min(comm, gemm). The anchor is the plain
   un-overlapped collective + matmul ("reference"). PyTorch's symmetric-memory ops run as
   another backend. tp = 2, 4, 8 up to the GPU count; `--world-size N`: tp = N alone (on CPU:
   N gloo processes instead of 2). With fewer than 2 GPUs these cases are skipped with a note.
`--quick`: tiny shapes on CPU, decomposition cost only (the overlap code runs on 2 gloo
processes in tests/test_sp_multirank.py; `megapar bench sp` on CPU without --quick runs it
too, a smoke test whose CPU times say nothing about GPUs).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from megapar.launch.bench.common import BenchContext, ceilings

if TYPE_CHECKING:
    from megapar.parallel.groups import Group

FFN_HIDDEN, FFN_INTER = 8192, 28672
_SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU spin before each timed sample: the host queues the calls meanwhile


def _gemm_floor_us(ctx: BenchContext, m: int, k: int, n: int) -> float | None:
    return 2.0 * m * k * n / (ceilings(ctx.device).bf16_tflops * 1e12) * 1e6 if ctx.is_cuda else None


def _shapes(ctx: BenchContext) -> tuple[int, int, int, tuple[int, ...]]:
    """(tokens M, hidden, intermediate, TP sizes)."""
    if ctx.quick:
        return 64, 64, 224, (2, 4)
    if not ctx.is_cuda:
        return 1024, 1024, 3584, (2, 4, 8)
    return 8192, FFN_HIDDEN, FFN_INTER, (2, 4, 8)


def time_interleaved(ctx: BenchContext, fns: list[Callable[[], object]], *, samples: int | None = None,
                     calls: int | None = None) -> list[float]:
    """Median µs per call of each fn, sampled in rotation (fn0, fn1, ..., fn1, fn0, ...).

    One sample = `calls` back-to-back calls between two CUDA events (perf_counter on CPU);
    on CUDA a spin kernel runs first so the host has queued the calls before the start
    event fires (host overhead is not counted unless it exceeds the GPU time of a call).
    """
    samples = (3 if ctx.quick else (30 if ctx.is_cuda else 10)) if samples is None else samples
    calls = (1 if ctx.quick or not ctx.is_cuda else 3) if calls is None else calls
    for fn in fns:  # warm up: allocator, cuBLAS handles and heuristics
        for _ in range(2 if ctx.quick else 3):
            fn()
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)
    got: list[list[float]] = [[] for _ in fns]
    sleep = getattr(torch.cuda, "_sleep", None)
    for i in range(samples):
        order = list(range(len(fns))) if i % 2 == 0 else list(reversed(range(len(fns))))
        for j in order:
            if ctx.is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if sleep is not None:
                    sleep(_SLEEP_CYCLES)
                start.record()
                for _ in range(calls):
                    fns[j]()
                end.record()
                end.synchronize()
                got[j].append(start.elapsed_time(end) * 1e3 / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fns[j]()
                got[j].append((time.perf_counter() - t0) * 1e6 / calls)
    return [statistics.median(g) for g in got]


def _record_pair(ctx: BenchContext, op: str, P: int, ours: Callable[[int], Callable[[], object]],
                 one: Callable[[], object], blocks: Callable[[], object], floor_us: float | None,
                 shape: dict[str, int], check: Callable[[Callable[[], object]], bool]) -> None:
    """Time the op (default lanes; on CUDA also 2 lanes), one matmul and the bare block matmuls, interleaved.
    check(call): whether the op's result (each lane count's, computed once before timing) is right."""
    from megapar.parallel.sp.ops import COMPUTE_LANES

    variants = [COMPUTE_LANES] + ([2 if COMPUTE_LANES == 1 else 1] if ctx.is_cuda else [])
    ok = {lanes: check(ours(lanes)) for lanes in variants}
    times = time_interleaved(ctx, [one, blocks] + [ours(lanes) for lanes in variants])
    one_us, blocks_us = times[0], times[1]
    for lanes, us in zip(variants, times[2:]):
        suffix = "" if lanes == COMPUTE_LANES else f" lanes={lanes}"
        ctx.record(f"decomposition {op} tp={P}{suffix}", us, anchor="one matmul", anchor_us=one_us, floor_us=floor_us,
                   ratio_vs_one=us / one_us, blocks_ratio=blocks_us / one_us, target_ratio=1.05, lanes=lanes,
                   matches_reference=ok[lanes], **shape)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """How far a sum of block matmuls may sit from one matmul (or the reference backend's
    collective + matmul): bf16 outputs round apart in the last bit (2^-8 relative); fp32 sums in
    another order by a few ulps of the K-long dot products."""
    return dict(rtol=2e-2, atol=2e-2) if dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-4, atol=1e-4)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), **tolerance(want.dtype)))


class _Delivered:
    """While active, a loopback exchanger delivers each send into the receive posted beside it
    (as if every peer were this rank), so the engine's result becomes checkable: the timed loopback
    run posts nothing and its receive buffers keep whatever they held."""

    def __enter__(self) -> "_Delivered":
        from megapar.parallel.p2p import P2PWork
        from megapar.parallel.sp import ring

        real = self.real = ring.P2PExchanger

        class Delivering(real):  # type: ignore[misc, valid-type]
            def post(self, sends=(), recvs=(), *, after_compute=True):
                if not self.peers.loopback:
                    return super().post(sends, recvs, after_compute=after_compute)
                for (_, t), (_, r) in zip(sends, recvs, strict=True):
                    r.copy_(t)
                return P2PWork(done=True)

        ring.P2PExchanger = Delivering
        return self

    def __exit__(self, *exc) -> None:
        from megapar.parallel.sp import ring

        ring.P2PExchanger = self.real


def _decomposition_cost(ctx: BenchContext) -> None:
    from megapar.parallel.sp.ops import decomposed_all_gather_matmul, decomposed_matmul_reduce_scatter
    from megapar.parallel.sp.ring import RingPeers

    M, H, inter, tps = _shapes(ctx)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    for P in tps:
        n, m = inter // P, M // P
        peers = RingPeers.loopback_of(0, P)  # every rank runs the same kernels; rank 0 stands for all
        # all-gather-matmul: this rank's x_shard [M/P, H], w [H, n]; anchor: the gathered [M, H] @ w
        x_full = torch.randn(M, H, generator=g).to(ctx.device, dtype)
        w = (torch.randn(H, n, generator=g) / H ** 0.5).to(ctx.device, dtype)
        x_shard = x_full[:m].clone()
        received = x_full.clone()  # what the ring would have received (loopback receives nothing)
        out_blocks = torch.empty(M, n, device=ctx.device, dtype=dtype).view(P, m, n)

        def ag_blocks() -> None:
            for src in range(P):
                torch.mm(x_full[src * m:(src + 1) * m], w, out=out_blocks[src])

        def ag_op(lanes: int) -> Callable[[], object]:
            return lambda: decomposed_all_gather_matmul(x_shard, [w], peers, need_gathered=False, gathered=received,
                                                        lanes=lanes)

        # the loopback gather's receive buffer holds x_full (the own block, rows 0..m, is x_shard):
        # the op's output is x_full @ w, what the reference backend (gather, one matmul) computes
        ag_want = torch.mm(x_full, w)
        _record_pair(ctx, "all_gather_matmul", P, ag_op, lambda: torch.mm(x_full, w), ag_blocks,
                     _gemm_floor_us(ctx, M, H, n), dict(M=M, K=H, N=n),
                     lambda call: _close(call()[1][0], ag_want))
        del ag_want
        del x_full, w, x_shard, received, out_blocks
        # matmul-reduce-scatter: x [M, n] @ w [n, H], P destination blocks, then the reduction
        x2 = torch.randn(M, n, generator=g).to(ctx.device, dtype)
        w2 = (torch.randn(n, H, generator=g) / n ** 0.5).to(ctx.device, dtype)
        parts = torch.empty(P, m, H, device=ctx.device, dtype=dtype)

        def rs_blocks() -> None:
            for d in range(P):
                torch.mm(x2[d * m:(d + 1) * m], w2, out=parts[d])

        def rs_op(lanes: int) -> Callable[[], object]:
            return lambda: decomposed_matmul_reduce_scatter(x2, w2, peers, lanes=lanes)

        # the loopback reduction sums receive buffers nothing was sent to: checked with each send
        # delivered into its receive (`_Delivered`), which makes the result the sum of this rank's
        # P partials, x2 @ w2 summed over the P row blocks
        rs_want = torch.mm(x2, w2).view(P, m, H).sum(0)

        def rs_check(call: Callable[[], object]) -> bool:
            with _Delivered():
                return _close(call(), rs_want)

        _record_pair(ctx, "matmul_reduce_scatter", P, rs_op, lambda: torch.mm(x2, w2), rs_blocks,
                     _gemm_floor_us(ctx, M, n, H), dict(M=M, K=n, N=H), rs_check)
        del rs_want
        del x2, w2, parts


def _overlap_rank(rank: int, M: int, H: int, inter: int, quick: bool) -> list[dict]:
    """One rank of the overlap cases; returns rank 0's rows (times are per-rank medians)."""
    from megapar.parallel import ParallelConfig, destroy_parallel, init_parallel

    world = int(os.environ["WORLD_SIZE"])
    groups = init_parallel(ParallelConfig(world_size=world, tp=world))
    try:
        rows = overlap_rows(groups.tp, M, H, inter, quick=quick)
    finally:
        destroy_parallel()
    return rows if rank == 0 else []


def overlap_rows(tp: Group, M: int, H: int, inter: int, *, quick: bool) -> list[dict]:
    """The overlap cases on an initialized TP group (a `Group`): one row dict per op and backend.

    Every rank must call it (it times collectives); rows carry case, time_us, anchor, ... or
    case and error.
    """
    from megapar.parallel.comm import resolve_group
    from megapar.parallel.sp import all_gather_matmul, matmul_reduce_scatter
    from megapar.parallel.sp.ops import symm_mem_unavailable_reason

    pg, rank, P = resolve_group(tp)
    backend_name = str(dist.get_backend(pg))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend_name else torch.device("cpu")
    ctx = BenchContext(suite="sp", device=device, quick=quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(rank)
    n = inter // P
    x_shard = torch.randn(M // P, H, generator=g).to(device, dtype)
    w_col = (torch.randn(H, n, generator=g) / H ** 0.5).to(device, dtype)
    x_row = torch.randn(M, n, generator=g).to(device, dtype)
    w_row = (torch.randn(n, H, generator=g) / n ** 0.5).to(device, dtype)
    gathered = torch.empty(M, H, device=device, dtype=dtype)
    partial = torch.zeros(M, H, device=device, dtype=dtype)
    scattered = torch.empty(M // P, H, device=device, dtype=dtype)
    backends = ["decomposed", "reference"]
    reason = symm_mem_unavailable_reason(x_shard, pg, P)
    if reason is None:
        backends.append("symm_mem")

    def timed(fn) -> float:
        dist.barrier(group=pg)
        return ctx.time_fn(fn)

    ag_comm = timed(lambda: dist.all_gather_into_tensor(gathered, x_shard, group=pg))
    ag_gemm = timed(lambda: torch.mm(gathered, w_col))
    rs_comm = timed(lambda: dist.reduce_scatter_tensor(scattered, partial, group=pg)
                    if dist.get_backend(pg) != "gloo" else dist.all_reduce(partial, group=pg))
    rs_gemm = timed(lambda: torch.mm(x_row, w_row))
    rows: list[dict] = []
    ops = {
        "all_gather_matmul": (lambda b: all_gather_matmul(x_shard, [w_col], tp, backend=b), ag_comm, ag_gemm,
                              dict(M=M, K=H, N=n)),
        "matmul_reduce_scatter": (lambda b: matmul_reduce_scatter(x_row, w_row, tp, backend=b), rs_comm, rs_gemm,
                                  dict(M=M, K=n, N=H)),
    }
    with torch.no_grad():
        for op, (call, comm_us, gemm_us, shape) in ops.items():
            times, results = {}, {}
            for b in backends:
                try:
                    results[b] = _output(call(b))   # once before timing, for the check below
                    times[b] = timed(lambda: call(b))
                except Exception as e:  # a backend that fails here is reported, not fatal
                    rows.append(dict(case=f"{op} tp={P} {b}", error=f"{type(e).__name__}: {e}"[:300]))
            # each backend's result against the reference backend's on this rank; a row (rank 0's)
            # says whether every rank matched (every rank takes part in each all_reduce)
            want = results.get("reference")
            matched = {}
            for b in backends:
                if b == "reference":
                    continue
                mine = torch.tensor([int(want is not None and b in results and _close(results[b], want))],
                                    dtype=torch.int32, device=device)
                dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=pg)
                matched[b] = bool(mine.item())
            del results, want
            for b, us in times.items():
                hidden = (comm_us + gemm_us - us) / min(comm_us, gemm_us)
                extra = {"matches_reference": matched[b]} if b in matched else {}
                rows.append(dict(case=f"{op} tp={P} {b}", time_us=us, anchor="reference (plain collective + matmul)",
                                 anchor_us=times.get("reference"), comm_us=comm_us, gemm_us=gemm_us,
                                 hidden_fraction=hidden, target_hidden=0.8, **extra, **shape))
    if reason is not None and device.type == "cuda":
        rows.append(dict(case=f"symm_mem tp={P}", error=f"not run: {reason}"))
    return rows


def _output(result) -> torch.Tensor:
    """The op's output: all_gather_matmul returns [outputs...] (+ gathered), matmul_reduce_scatter a tensor."""
    return result if isinstance(result, torch.Tensor) else result[0]


def _overlap(ctx: BenchContext) -> None:
    from megapar.launch.local import launch_local

    M, H, inter, tps = _shapes(ctx)
    if ctx.is_cuda:
        available = torch.cuda.device_count()
        if available < 2:
            ctx.note(f"overlap cases skipped: they need >= 2 GPUs (found {available}); on a multi-GPU machine "
                     "`megapar bench sp --device cuda` runs them for tp = 2, 4, 8 up to the GPU count "
                     "(--world-size N picks one size)")
            return
        sizes = ctx.world_sizes([p for p in tps if p <= available], available)
        backend = "nccl"
    else:
        sizes, backend = ctx.world_sizes([2]), "gloo"
        ctx.note("CPU: overlap cases run on 2 gloo processes as a smoke test; the numbers say nothing about GPUs")
    for P in sizes:
        rows = launch_local(_overlap_rank, P, backend=backend, args=(M, H, inter, ctx.quick), timeout=600)[0]
        for row in rows:
            case = row.pop("case")
            if "error" in row:
                ctx.note(f"{case}: {row['error']}")
                continue
            ctx.record(case, row.pop("time_us"), anchor=row.pop("anchor"), anchor_us=row.pop("anchor_us"), **row)


def run(ctx: BenchContext) -> None:
    if ctx.quick and not ctx.is_cuda:
        with ctx.single_thread():   # a descheduled worker thread makes tiny matmuls wait ms
            _decomposition_cost(ctx)
        ctx.note("--quick on CPU: overlap cases not run (tests/test_sp_multirank.py runs their code on 2 gloo "
                 "processes; `megapar bench sp` without --quick runs them here)")
        return
    _decomposition_cost(ctx)
    _overlap(ctx)
