"""`megapar bench sp`: what decomposing the TP collectives costs, and how much of them it hides.

1. Decomposition cost (one device; ANCHORS.md target <= 1.05x). The decomposed ops replace one
   matmul by P block matmuls: all-gather-matmul multiplies each rank's [M/P, K] block into its
   rows of the output (after copying the own shard into the gathered buffer);
   matmul-reduce-scatter multiplies each destination's [M/P, K'] block and adds the running
   sum that arrived. Measured at the FFN of the issue: M = 8192 tokens, K = 8192, N = 28672/P
   (column-parallel up projection; the row-parallel down projection is [M, 28672/P] @
   [28672/P, 8192]) for P = 2, 4, 8, against one matmul of the same total size, with the
   GEMM roofline (bf16 at the measured 799 TFLOP/s).
2. Overlap (>= 2 GPUs, NCCL; target: >= 80% of the smaller of comm and GEMM time hidden).
   For each op and backend: time of the op, of its collective alone and of its GEMM alone;
   hidden fraction = (comm + gemm - op) / min(comm, gemm). The anchor is the plain
   un-overlapped collective + matmul ("reference"). PyTorch's symmetric-memory ops run as
   another backend. With fewer than 2 GPUs these cases are skipped with a note.
`--quick`: tiny shapes on CPU, plus the overlap cases on 2 gloo processes (a smoke test of
this code path; CPU times say nothing about GPUs).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from launch.bench.common import H200_BF16_TFLOPS, BenchContext

FFN_HIDDEN, FFN_INTER = 8192, 28672


def _gemm_floor_us(ctx: BenchContext, m: int, k: int, n: int) -> float | None:
    return 2.0 * m * k * n / (H200_BF16_TFLOPS * 1e12) * 1e6 if ctx.is_cuda else None


def _shapes(ctx: BenchContext) -> tuple[int, int, int, tuple[int, ...]]:
    """(tokens M, hidden, intermediate, TP sizes)."""
    if ctx.quick:
        return 64, 64, 224, (2, 4)
    if not ctx.is_cuda:
        return 1024, 1024, 3584, (2, 4, 8)
    return 8192, FFN_HIDDEN, FFN_INTER, (2, 4, 8)


def _decomposition_cost(ctx: BenchContext) -> None:
    M, H, inter, tps = _shapes(ctx)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    for P in tps:
        n = inter // P
        # all-gather-matmul: x [M, H] gathered block by block, w [H, n]
        x = torch.randn(M, H, generator=g).to(ctx.device, dtype)
        w = torch.randn(H, n, generator=g).to(ctx.device, dtype) / H ** 0.5
        gathered = torch.empty_like(x).view(P, M // P, H)
        out = torch.empty(M, n, device=ctx.device, dtype=dtype).view(P, M // P, n)
        own = x[: M // P].clone()

        def ag_blocks() -> None:
            gathered[0].copy_(own)
            for src in range(P):
                torch.mm(gathered[src], w, out=out[src])

        one_us = ctx.time_fn(lambda: torch.mm(x, w))
        ours_us = ctx.time_fn(ag_blocks)
        ctx.record(f"decomposition all_gather_matmul tp={P}", ours_us, anchor="one matmul", anchor_us=one_us,
                   floor_us=_gemm_floor_us(ctx, M, H, n), ratio_vs_one=ours_us / one_us, target_ratio=1.05,
                   M=M, K=H, N=n)
        # matmul-reduce-scatter: x [M, n] @ w [n, H], block d then += the arriving running sum
        x2 = torch.randn(M, n, generator=g).to(ctx.device, dtype)
        w2 = torch.randn(n, H, generator=g).to(ctx.device, dtype) / n ** 0.5
        incoming = torch.randn(M // P, H, generator=g).to(ctx.device, dtype)
        m = M // P

        def rs_blocks() -> None:
            for d in range(P):
                part = x2[d * m:(d + 1) * m] @ w2
                if d:
                    part.add_(incoming)

        one_us = ctx.time_fn(lambda: x2 @ w2)
        ours_us = ctx.time_fn(rs_blocks)
        ctx.record(f"decomposition matmul_reduce_scatter tp={P}", ours_us, anchor="one matmul", anchor_us=one_us,
                   floor_us=_gemm_floor_us(ctx, M, n, H), ratio_vs_one=ours_us / one_us, target_ratio=1.05,
                   M=M, K=n, N=H)
        del x, w, gathered, out, x2, w2


def _overlap_rank(rank: int, M: int, H: int, inter: int, quick: bool) -> list[dict]:
    """One rank of the overlap cases; returns rank 0's rows (times are per-rank medians)."""
    from parallel import ParallelConfig, destroy_parallel, init_parallel
    from parallel.comm import resolve_group
    from parallel.sp import all_gather_matmul, matmul_reduce_scatter
    from parallel.sp.ops import symm_mem_unavailable_reason

    world = int(os.environ["WORLD_SIZE"])
    groups = init_parallel(ParallelConfig(world_size=world, tp=world))
    tp = groups.tp
    pg, _, P = resolve_group(tp)
    device = torch.device("cuda", torch.cuda.current_device()) if groups.backend == "nccl" else torch.device("cpu")
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
            times = {}
            for b in backends:
                try:
                    times[b] = timed(lambda: call(b))
                except Exception as e:  # a backend that fails here is reported, not fatal
                    rows.append(dict(case=f"{op} tp={P} {b}", error=f"{type(e).__name__}: {e}"[:300]))
            for b, us in times.items():
                hidden = (comm_us + gemm_us - us) / min(comm_us, gemm_us)
                rows.append(dict(case=f"{op} tp={P} {b}", time_us=us, anchor="reference (plain collective + matmul)",
                                 anchor_us=times.get("reference"), comm_us=comm_us, gemm_us=gemm_us,
                                 hidden_fraction=hidden, target_hidden=0.8, **shape))
    if reason is not None and device.type == "cuda":
        rows.append(dict(case=f"symm_mem tp={P}", error=f"not run: {reason}"))
    destroy_parallel()
    return rows if rank == 0 else []


def _overlap(ctx: BenchContext) -> None:
    from launch.local import launch_local

    M, H, inter, tps = _shapes(ctx)
    if ctx.is_cuda:
        available = torch.cuda.device_count()
        if available < 2:
            ctx.note(f"overlap cases skipped: they need >= 2 GPUs (found {available}); on a multi-GPU machine "
                     "`megapar bench sp --device cuda` runs them for tp = 2, 4, 8 up to the GPU count "
                     "(--world-size N picks one size)")
            return
        limit = ctx.options.get("world_size") or available
        sizes = [p for p in tps if p <= min(limit, available)]
        backend = "nccl"
    else:
        sizes, backend = [2], "gloo"
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
    _decomposition_cost(ctx)
    _overlap(ctx)
