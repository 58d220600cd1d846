"""`megapar bench ep`: EP dispatch/combine time and bandwidth.

1. Local permute/unpermute (EP = 1, one device): on a GPU at T=4096, H=7168, K=8, E=256 bf16
   (docs/performance.md target: >= 60% of the copy ceiling), small sizes on CPU. Rows: the data
   movers alone (Triton on CUDA) against the torch eager movers (anchor) and the copy floor, then
   the whole `dispatch` / `combine` (routing plan + movers + the one host sync). Floors: permute
   (T + R) * H * 2 bytes (each source row read once, each of the R layout rows written once,
   padding rows as zeros); unpermute (P + T) * H * 2 (the P = T * K pairs' rows read once, each
   token's row written once: the padding rows of align > 1 are not read). The movers' rows say
   whether ours match the torch movers on the same inputs (`matches_reference`).
2. Multi-rank dispatch + combine for T tokens per rank: gloo ranks on CPU (launch_local), or
   NCCL with one rank per GPU when >= 2 GPUs exist (else a note). World size:
   `--world-size N` or MEGAPAR_BENCH_EP_WORLD (default 2 with --quick, 4 on CPU, all GPUs).
   Anchor: what a user would write with torch alone (every (token, k) pair sent on its own
   with all_to_all_single, combined with index_add_). Bandwidth: logical bytes = valid
   pairs * H * 2 each way; physical = bytes this rank sends to other ranks (deduplicated
   rows, packed with scales/ids/weights) in dispatch plus the partial rows of combine.
   GPU target (8 ranks, 4K tokens): >= 80% of 450 GB/s NVLink per direction. Each row says whether
   every rank's round trip (identity experts) matched the anchor's result on that rank, x times
   the token's summed routing weights (`matches_reference`).
3. NVSHMEM on one GPU (only with MEGAPAR_NVSHMEM_MPG=1, which bench/run_nvshmem_mpg.sh sets,
   under MPS): W = 2 and 4 processes share cuda:0 and bootstrap NVSHMEM over a gloo group.
   Dispatch + combine at T = 128 (decode: the low-latency `NvshmemTransport`, and the
   normal-mode Dispatcher) and T = 4096 (prefill: the normal-mode Dispatcher), H = 7168, K = 8,
   E = 256, next to the all_to_all Dispatcher on the same ranks (gloo, CPU tensors: NCCL
   refuses two ranks on one GPU). Every rank shares one HBM and one set of SMs, so these rows
   measure software overhead and kernel cost, never NVLink bandwidth.
4. DeepEP on one GPU (only with MEGAPAR_DEEPEP_MPG=1, which bench/run_deepep_mpg.sh sets when
   DEEPEP_BENCH names an output folder, under MPS): W = 2 processes on cuda:0, the deepep
   Dispatcher (normal mode, DeepEP's intranode kernels) at T = 128 and 4096 and, with a
   DeepEP built with NVSHMEM (MEGAPAR_DEEPEP_LL=1), `DeepEPLowLatency` at T = 128; same shapes
   and anchor as section 3, and the same caveat: overhead and kernel cost, not NVLink.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps

NVLINK_GBPS = 450.0


def _routing(t: int, e: int, k: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] int64 distinct experts per token (uniform), [T, K] fp32 softmax weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return ids.to(device), w.to(device)


def _local_cases(ctx: BenchContext) -> None:
    from megapar.parallel.ep import gather_reduce, gather_rows, make_dispatcher
    from megapar.parallel.ep.layout import gather_reduce_torch, gather_rows_torch

    if ctx.quick:
        t, h, k, e = 64, 256, 4, 16
    elif ctx.is_cuda:
        t, h, k, e = 4096, 7168, 8, 256
    else:
        t, h, k, e = 512, 1024, 8, 64
    dev = ctx.device
    x = torch.randn(t, h, device=dev).to(torch.bfloat16)
    ids, w = _routing(t, e, k, dev, 0)
    ceiling = copy_ceiling_gbps(dev)
    for align in (1, 128):
        d = make_dispatcher(None, e, h, align=align)
        res = d.dispatch(x, ids, w)
        plan = res.handle.plan
        rows = plan.num_rows
        nbytes, back_bytes = mover_bytes(plan, t, h, x.element_size())
        floor, back_floor = nbytes / (ceiling * 1e3), back_bytes / (ceiling * 1e3)
        shape = f"T={t} H={h} K={k} E={e} align={align}"
        flush = ctx.is_cuda

        def copy_us_of(moved: int) -> float:   # a copy reading and writing `moved` bytes in all
            copy_src = torch.empty(moved // 4, dtype=torch.int16, device=dev)
            return ctx.time_fn(lambda: copy_src.clone(), flush_l2=flush)
        copy_us = copy_us_of(nbytes)
        ok = torch.equal(gather_rows(x, plan.row_src), gather_rows_torch(x, plan.row_src))
        ours = ctx.time_fn(lambda: gather_rows(x, plan.row_src), flush_l2=flush)
        eager = ctx.time_fn(lambda: gather_rows_torch(x, plan.row_src), flush_l2=flush)
        ctx.record(f"local permute rows {shape}", ours, anchor="torch index_select + mask", anchor_us=eager,
                   floor_us=floor, gbps=nbytes / ours / 1e3, copy_same_bytes_us=copy_us, rows=rows,
                   matches_reference=ok)
        full = ctx.time_fn(lambda: d.dispatch(x, ids, w), flush_l2=flush)
        ctx.record(f"local dispatch (plan + permute) {shape}", full, anchor="permute rows only", anchor_us=ours,
                   floor_us=floor, gbps=nbytes / full / 1e3)
        y = res.x
        wf = w.float()
        back_ref = gather_reduce_torch(y, plan.pair_pos, wf).float()
        ok = bool(torch.allclose(gather_reduce(y, plan.pair_pos, wf).float(), back_ref, rtol=1e-2, atol=1e-2))
        ours = ctx.time_fn(lambda: gather_reduce(y, plan.pair_pos, wf), flush_l2=flush)
        eager = ctx.time_fn(lambda: gather_reduce_torch(y, plan.pair_pos, wf), flush_l2=flush)
        back_copy_us = copy_us if back_bytes == nbytes else copy_us_of(back_bytes)
        ctx.record(f"local unpermute rows {shape}", ours, anchor="torch K x (index_select, mul, add)",
                   anchor_us=eager, floor_us=back_floor, gbps=back_bytes / ours / 1e3, copy_same_bytes_us=back_copy_us,
                   matches_reference=ok)
        del back_ref
        full = ctx.time_fn(lambda: d.combine(y, res.handle), flush_l2=flush)
        ctx.record(f"local combine {shape}", full, anchor="unpermute rows only", anchor_us=ours, floor_us=back_floor,
                   gbps=back_bytes / full / 1e3)
        if not ctx.is_cuda:
            ctx.note("CPU: the movers are the torch reference itself (Triton runs on CUDA), so ours vs anchor "
                     "is 1x up to noise; the GPU rows are the ones that count")
            break  # align only matters for GPU grouped GEMMs


def mover_bytes(plan, t: int, h: int, elem: int) -> tuple[int, int]:
    """(permute, unpermute) bytes that must move for `t` tokens of width `h` (`elem` bytes each)
    and a layout plan: the permute reads each token's row once and writes every layout row
    (padding rows of align > 1 as zeros); the unpermute reads only the rows of the pairs (the
    padding rows hold no pair) and writes each token's row once."""
    pairs = int((plan.pair_pos >= 0).sum())
    return (t + plan.num_rows) * h * elem, (pairs + t) * h * elem


# ---------------------------------------------------------------------------------------------
# Multi-rank: runs inside launch_local ranks (module-level so it pickles).


def _naive_dispatch_combine(x, ids, w, group, world: int, experts_per_rank: int) -> torch.Tensor:
    """Anchor: each (token, k) pair sent on its own with torch collectives, identity experts."""
    import torch.distributed as dist

    t, k = ids.shape
    flat = ids.reshape(-1)
    dest = torch.where(flat >= 0, flat // experts_per_rank, torch.full_like(flat, world))
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=world + 1)[:world]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    pairs = order[: sum(send)]
    payload = x.index_select(0, pairs // k)
    got = payload.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(got, payload, recv, send, group=group)
    back = payload.new_empty(payload.shape)
    dist.all_to_all_single(back, got, send, recv, group=group)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, pairs // k, back.float() * w.reshape(-1)[pairs, None])
    return out.to(x.dtype)


def _rank_bench(rank: int, world: int, cases: list[dict], iters: int, warmup: int) -> list[dict]:
    import torch.distributed as dist

    from megapar.parallel import ParallelConfig, init_parallel
    from megapar.parallel.ep import make_dispatcher

    groups = init_parallel(ParallelConfig(world_size=world))
    cuda = groups.backend == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    probe = torch.zeros(1, device=dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        samples = []
        for i in range(warmup + iters):
            dist.all_reduce(probe, group=groups.ep.group)  # start together
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)

    out = []
    for case in cases:
        t, h, k, e = case["t"], case["h"], case["k"], case["e"]
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        ids, w = _routing(t, e, k, dev, 100 + rank)
        row = {"case": case, "pairs": int((ids >= 0).sum())}
        # identity experts: the naive anchor's round trip is x times each token's summed weights;
        # each backend's round trip is compared with it on this rank (`round_trip_matches`)
        want = _naive_dispatch_combine(x, ids, w, groups.ep.group, world, e // world)
        for backend in ("all_to_all", "allgather"):
            d = make_dispatcher(groups.ep, e, h, backend=backend)
            res = d.dispatch(x, ids, w)
            route = res.handle.route
            packed_row = _aligned(h * 2) + 2 * _aligned(k * 4)  # x, ids, weights as sent
            if backend == "all_to_all":  # deduplicated rows to other ranks, partial rows back
                remote_rows = sum(route.send_splits) - route.send_splits[rank]
                row["a2a_phys_bytes"] = remote_rows * (packed_row + h * 2)
            else:  # every token to every other rank; fp32 partial sums reduce-scattered back
                row["ag_phys_bytes"] = (world - 1) * t * (packed_row + h * 4)
            row[f"{backend}_matches"] = round_trip_matches(_round_trip(d, x, ids, w), want)
            row[f"{backend}_dispatch_us"] = timed(lambda: d.dispatch(x, ids, w))
            row[f"{backend}_combine_us"] = timed(lambda: d.combine(res.x, res.handle))
            row[f"{backend}_us"] = timed(lambda: _round_trip(d, x, ids, w))
        row["naive_us"] = timed(lambda: _naive_dispatch_combine(x, ids, w, groups.ep.group, world, e // world))
        out.append(row)
    return out


def round_trip_matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    """combine(dispatch(x)) with identity experts against the naive anchor's (x times the token's
    summed weights, both rounded to x's bf16 once from an fp32 sum): bf16 rounding apart at most
    (2^-8 relative; the sums may run in another order)."""
    return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def _round_trip(d, x, ids, w) -> torch.Tensor:
    res = d.dispatch(x, ids, w)
    return d.combine(res.x, res.handle)


def _world_size(ctx: BenchContext, default: int) -> int:
    value = ctx.options.get("world_size") or os.environ.get("MEGAPAR_BENCH_EP_WORLD")
    return int(value) if value else default


def _multirank_cases(ctx: BenchContext) -> None:
    from megapar.launch.local import launch_local

    if ctx.is_cuda:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            ctx.note(f"multi-GPU NCCL dispatch/combine skipped: {gpus} GPU here (needs >= 2; "
                     "run `megapar bench ep --device cuda --world-size 8` on an 8-GPU host)")
            return
        world = _world_size(ctx, gpus)
        if world > gpus:
            ctx.note(f"--world-size {world} > {gpus} GPUs; using {gpus}")
            world = gpus
        cases = [dict(t=4096, h=7168, k=8, e=256), dict(t=128, h=7168, k=8, e=256)]
        backend, iters, warmup, link = "nccl", 20, 5, NVLINK_GBPS
    else:
        world = _world_size(ctx, 2 if ctx.quick else 4)
        cases = [dict(t=32, h=128, k=4, e=16)] if ctx.quick else [dict(t=256, h=1024, k=8, e=64),
                                                                    dict(t=32, h=1024, k=8, e=64)]
        backend, iters, warmup, link = "gloo", (3 if ctx.quick else 10), 1, None
    per_rank = launch_local(_rank_bench, world, backend=backend, args=(world, cases, iters, warmup), timeout=600)
    for ci, case in enumerate(cases):
        rows = [r[ci] for r in per_rank]
        naive = max(r["naive_us"] for r in rows)
        logical = max(2 * r["pairs"] * case["h"] * 2 for r in rows)
        for backend_name, key in (("all_to_all", "a2a_phys_bytes"), ("allgather", "ag_phys_bytes")):
            total = max(r[f"{backend_name}_us"] for r in rows)
            phys = max(r[key] for r in rows)
            extra = {}
            if link:
                extra["link_fraction"] = phys / total / 1e3 / link
            ctx.record(f"{backend_name} dispatch+combine W={world} T={case['t']}/rank H={case['h']} K={case['k']} "
                       f"E={case['e']} ({backend})", total, anchor="torch all_to_all_single per (token, k) pair",
                       anchor_us=naive, dispatch_us=max(r[f"{backend_name}_dispatch_us"] for r in rows),
                       combine_us=max(r[f"{backend_name}_combine_us"] for r in rows),
                       logical_gbps=logical / total / 1e3, physical_gbps=phys / total / 1e3,
                       matches_reference=all(r[f"{backend_name}_matches"] for r in rows), **extra)


def _mpg_setup(world: int) -> tuple:
    """A process of a one-GPU run: cuda:0, and the process groups over gloo (NCCL refuses two
    ranks on one GPU). Returns (groups, the EP group, the device)."""
    from megapar.parallel import ParallelConfig, init_parallel

    torch.cuda.set_device(0)
    groups = init_parallel(ParallelConfig(world_size=world))
    return groups, groups.ep.group, torch.device("cuda", 0)


def _timed_together(pg, fn, iters: int, warmup: int) -> float:
    """Median µs of fn on every rank of pg, started together by a host barrier (limited MPG has
    no stream collectives) and synchronized on the device after each call."""
    import torch.distributed as dist

    samples = []
    for i in range(warmup + iters):
        torch.cuda.synchronize()
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _anchor_row(groups, case: dict, rank: int, dev: torch.device, timed) -> tuple:
    """This rank's inputs of `case` on `dev` and a row holding the all_to_all anchor's time (gloo,
    CPU tensors: NCCL refuses two ranks on one GPU)."""
    from megapar.parallel.ep import make_dispatcher

    t, h, k, e = case["t"], case["h"], case["k"], case["e"]
    x_cpu = torch.randn(t, h).to(torch.bfloat16)
    ids_cpu, w_cpu = _routing(t, e, k, torch.device("cpu"), 100 + rank)
    ref = make_dispatcher(groups.ep, e, h, backend="all_to_all")
    row = {"pairs": int((ids_cpu >= 0).sum()),
           "all_to_all_us": timed(lambda: _round_trip(ref, x_cpu, ids_cpu, w_cpu))}
    return x_cpu.to(dev), ids_cpu.to(dev), w_cpu.to(dev), row


def _mpg_rank(rank: int, world: int, cases: list[dict], iters: int, warmup: int) -> list[dict]:
    """One NVSHMEM process of several on cuda:0 (section 3 of the module docstring)."""
    import torch.distributed as dist

    from megapar.parallel import destroy_parallel
    from megapar.parallel.ep import make_dispatcher
    from megapar.parallel.ep.nvshmem import NvshmemBuffer, NvshmemConfig, NvshmemTransport

    groups, pg, dev = _mpg_setup(world)
    timed = functools.partial(_timed_together, pg, iters=iters, warmup=warmup)
    keeper = NvshmemBuffer(pg, NvshmemConfig(max_tokens=1, hidden=4, top_k=1, num_experts=world), device=dev)

    out = []
    try:
        for case in cases:
            t, h, k, e = case["t"], case["h"], case["k"], case["e"]
            x, ids, w, row = _anchor_row(groups, case, rank, dev, timed)
            d = make_dispatcher(groups.ep, e, h, backend="nvshmem")
            row["nvshmem_us"] = timed(lambda: _round_trip(d, x, ids, w))
            for b in (d.backend, getattr(d, "_worker_backend", None)):
                if b is not None:
                    b.destroy()
            if case.get("low_latency"):
                with NvshmemBuffer(pg, NvshmemConfig(max_tokens=t, hidden=h, top_k=k, num_experts=e), device=dev) as buf:
                    tr = NvshmemTransport(buf)
                    partial = torch.zeros(world * t, h, dtype=torch.float32, device=dev)

                    def low_latency() -> torch.Tensor:
                        batch = tr.dispatch(x, ids, w)
                        return tr.combine(partial, batch)

                    row["nvshmem_ll_us"] = timed(low_latency)
                    tr.check()
                    torch.cuda.synchronize()
                    dist.barrier(group=pg)
            out.append(row)
    finally:
        torch.cuda.synchronize()
        dist.barrier(group=pg)
        keeper.destroy()
        destroy_parallel()
    return out


def _record_mpg(ctx: BenchContext, backend: str, world: int, cases: list[dict], per_rank: list[list[dict]]) -> None:
    """Rows of a one-GPU multi-process run: the slowest rank's time of `backend` (and of its
    low-latency path where the case has one) beside the slowest rank's all_to_all anchor."""
    for ci, case in enumerate(cases):
        rows = [r[ci] for r in per_rank]
        anchor = max(r["all_to_all_us"] for r in rows)
        shape = f"W={world} T={case['t']}/rank H={case['h']} K={case['k']} E={case['e']}"
        where = "(one GPU, MPG: overhead + kernel cost, not NVLink)"
        for path, key in (("Dispatcher", f"{backend}_us"), ("low-latency", f"{backend}_ll_us")):
            if key in rows[0]:
                ctx.record(f"{backend} {path} dispatch+combine {shape} {where}", max(r[key] for r in rows),
                           anchor="all_to_all Dispatcher, gloo CPU tensors, same ranks", anchor_us=anchor)


def _nvshmem_mpg_cases(ctx: BenchContext) -> None:
    if not ctx.is_cuda:
        return
    if os.environ.get("MEGAPAR_NVSHMEM_MPG") != "1":
        ctx.note("nvshmem rows skipped: they run several NVSHMEM processes on one GPU under MPS; "
                 "start them with `bash bench/run_nvshmem_mpg.sh INSTALL_SH --bench OUTDIR`")
        return
    from megapar.launch.local import launch_local

    cases = [dict(t=128, h=7168, k=8, e=256, low_latency=True), dict(t=4096, h=7168, k=8, e=256)]
    for world in (2, 4):
        per_rank = launch_local(_mpg_rank, world, backend="gloo", args=(world, cases, 20, 3), timeout=500,
                                env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // world)})
        _record_mpg(ctx, "nvshmem", world, cases, per_rank)


def _deepep_mpg_rank(rank: int, world: int, cases: list[dict], iters: int, warmup: int) -> list[dict]:
    """One DeepEP process of `world` on cuda:0 under MPS (section 4 of the module docstring):
    the deepep Dispatcher (normal mode, intranode kernels) and DeepEPLowLatency."""
    import torch.distributed as dist

    from megapar.parallel import destroy_parallel
    from megapar.parallel.ep import DeepEPConfig, make_dispatcher
    from megapar.parallel.ep.deepep import DeepEPLowLatency

    groups, pg, dev = _mpg_setup(world)
    timed = functools.partial(_timed_together, pg, iters=iters, warmup=warmup)

    out = []
    try:
        for case in cases:
            t, h, k, e = case["t"], case["h"], case["k"], case["e"]
            x, ids, w, row = _anchor_row(groups, case, rank, dev, timed)
            d = make_dispatcher(groups.ep, e, h, backend="deepep", comm_thread=False)
            row["deepep_us"] = timed(lambda: _round_trip(d, x, ids, w))
            d.backend.destroy()
            if case.get("low_latency"):
                ll = DeepEPLowLatency(pg, DeepEPConfig(low_latency_mode=True, max_dispatch_tokens_per_rank=t,
                                                       hidden=h, num_experts=e))
                try:
                    def low_latency() -> torch.Tensor:
                        got = ll.dispatch(x, ids, w)
                        return ll.combine(got.x, got)

                    row["deepep_ll_us"] = timed(low_latency)
                finally:
                    torch.cuda.synchronize()
                    dist.barrier(group=pg)
                    ll.destroy()
            out.append(row)
    finally:
        torch.cuda.synchronize()
        destroy_parallel()
    return out


def _deepep_mpg_cases(ctx: BenchContext) -> None:
    if not ctx.is_cuda:
        return
    if os.environ.get("MEGAPAR_DEEPEP_MPG") != "1":
        ctx.note("deepep rows skipped: they run two DeepEP processes on one GPU under MPS; start them with "
                 "`DEEPEP_BENCH=OUTDIR bash bench/run_deepep_mpg.sh DEEPEP_SRC_TARBALL OUTDIR`")
        return
    from megapar.launch.local import launch_local

    world = 2
    # low-latency rows: a DeepEP built with NVSHMEM, unless MEGAPAR_DEEPEP_BENCH_LL=0 (on one GPU under
    # MPS its E = 256 dispatch timed out waiting for the other rank: DeepEP sizes that kernel's grid
    # for the whole GPU, and each process holds half of it)
    ll = os.environ.get("MEGAPAR_DEEPEP_LL") == "1" and os.environ.get("MEGAPAR_DEEPEP_BENCH_LL") != "0"
    cases = [dict(t=128, h=7168, k=8, e=256, low_latency=ll),
             dict(t=4096, h=7168, k=8, e=256)]
    per_rank = launch_local(_deepep_mpg_rank, world, backend="gloo", args=(world, cases, 20, 3), timeout=300,
                            env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(100 // world)})
    _record_mpg(ctx, "deepep", world, cases, per_rank)


def run(ctx: BenchContext) -> None:
    """MEGAPAR_BENCH_EP_SECTIONS (comma list of local, multirank, nvshmem, deepep; default all) picks
    sections."""
    sections = set(os.environ.get("MEGAPAR_BENCH_EP_SECTIONS", "local,multirank,nvshmem,deepep").split(","))
    unknown = sections - {"local", "multirank", "nvshmem", "deepep"}
    if unknown:
        raise ValueError(f"MEGAPAR_BENCH_EP_SECTIONS: unknown sections {sorted(unknown)}; "
                         "valid: local, multirank, nvshmem, deepep")
    if "local" in sections:
        _local_cases(ctx)
    if "multirank" in sections:
        _multirank_cases(ctx)
    if "nvshmem" in sections:
        _nvshmem_mpg_cases(ctx)
    if "deepep" in sections:
        _deepep_mpg_cases(ctx)
