"""`megapar bench route`: the fused Triton routing kernel against the torch eager path.

Presets (docs/numerics.md §1-2): V3 (E=256, K=8, sigmoid + bias, 8 groups keep 4, scale 2.5),
V4-Flash (E=256, K=6, sqrt(softplus) + bias), V4-Pro (E=384, K=6, sqrt(softplus) + bias,
scale 2.5). fp32 logits. Targets (docs/performance.md): V4 <= 10 µs and V3 grouped <= 15 µs for
T <= 4096. The floor is the logits read + ids/weights written at the copy ceiling. On CPU only
the torch path runs (the kernel needs CUDA).

Routing is launch-bound, so on CUDA every case is timed three ways, each call made the way a
model makes it (`route(logits, bias=..., backend=...)`, fresh outputs every call):
- row "<preset> T=<T> triton": events around ONE call on an idle GPU, i.e. host work +
  launch + kernel (what an eager, launch-bound decode step pays); column `loop_us`: the
  per-call time of 50 back-to-back calls (host and device overlap: max of the two).
- row "<preset> T=<T> triton graph": the same call captured 20 times in a CUDA graph and
  replayed, per call (device time only: what a graph-captured decode step pays). Its anchor
  is the torch path captured the same way.
Each fused row says whether the kernel's routing matches the torch path's on its inputs
(`matches_reference`: the same experts per token, weights id by id to fp32 rounding).
With `--device cuda` a short (BLOCK_T, num_warps) sweep at T=4096 follows if time allows. The
suite keeps itself under ~40 s (each new kernel specialization compiles first): cases left
when the budget is spent are skipped with a note.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps
from megapar.moe.router import route

PRESETS: dict[str, tuple[int, dict]] = {
    "v3": (256, dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, scaling=2.5)),
    "v4flash": (256, dict(top_k=6, scoring="sqrt_softplus", scaling=1.5)),
    "v4pro": (384, dict(top_k=6, scoring="sqrt_softplus", scaling=2.5)),
}
TARGET_US = {"v3": 15.0, "v4flash": 10.0, "v4pro": 10.0}
# T=1 and T=7 compile their own specializations (num_tokens == 1 is a constant; 7 is not a
# multiple of 16); 64..16384 share one, so the sweep costs 2-3 compiles per preset.
CUDA_TOKENS = (1, 7, 64, 1024, 4096, 16384)
GRAPH_CALLS = 20  # calls per captured graph
LOOP_CALLS = 50  # calls per back-to-back loop
BUDGET_S = 38.0  # main cases stop here (the CLI adds torch import + CUDA init)
SWEEP_START_BEFORE_S = 25.0  # the sweep runs only if the main cases ended before this
SWEEP_CONFIGS = ((4, 2), (8, 2), (16, 4), (16, 8))  # (BLOCK_T, num_warps) tried at T=4096


def _inputs(ctx: BenchContext, T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(T * 1000 + E)
    logits = torch.randn(T, E, generator=g).to(ctx.device)
    bias = (torch.randn(E, generator=g) * 0.1).to(ctx.device)
    return logits, bias


def matches(fast, ref) -> bool:
    """The fused kernel's routing against the torch path's: per token the same experts (as sets:
    the order among the top-k is free) with the same weights id by id, to fp32 rounding."""
    ids, order = fast.topk_ids.sort(dim=1)
    rids, rorder = ref.topk_ids.sort(dim=1)
    if not torch.equal(ids, rids):
        return False
    return bool(torch.allclose(fast.topk_weights.gather(1, order), ref.topk_weights.gather(1, rorder),
                               rtol=1e-5, atol=1e-6))


def _loop_us(fn: Callable[[], Any], calls: int = LOOP_CALLS, repeats: int = 5) -> float:
    """Per-call µs of `calls` back-to-back calls (events around the loop), median of `repeats`."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def _graph_us(ctx: BenchContext, fn: Callable[[], Any], calls: int = GRAPH_CALLS) -> float | None:
    """Per-call µs of `fn` captured `calls` times in one CUDA graph and replayed (median of
    event-timed replays); None (with a note) if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture (compiles, allocator pools)
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        us = ctx.time_fn(graph.replay, warmup=3, iters=20) / calls
        del graph
        return us
    except Exception as exc:  # report and go on: the other rows still count
        ctx.note(f"CUDA graph capture failed: {type(exc).__name__}: {exc}")
        return None


def run(ctx: BenchContext) -> None:
    t0 = time.perf_counter()
    if ctx.quick:
        tokens: tuple[int, ...] = (1, 64)
    elif ctx.is_cuda:
        tokens = CUDA_TOKENS
    else:
        tokens = (1, 64, 1024, 4096)
    fused = ctx.is_cuda
    if not fused:
        ctx.note("CPU: only the torch eager path runs (the fused kernel needs CUDA)")
    else:
        ctx.note("'triton' rows: events around one call (host + launch + kernel); loop_us: per call of "
                 f"{LOOP_CALLS} back-to-back calls; 'triton graph' rows: per call of {GRAPH_CALLS} calls "
                 "replayed from one CUDA graph (device time), anchor = torch path in a graph")
    skipped: list[str] = []
    for name, (E, kw) in PRESETS.items():
        for T in tokens:
            if fused and time.perf_counter() - t0 > BUDGET_S:
                skipped.append(f"{name} T={T}")
                continue
            logits, bias = _inputs(ctx, T, E)
            eager = lambda: route(logits, bias=bias, backend="torch", **kw)  # noqa: E731
            floor_us = (T * E * 4 + T * kw["top_k"] * 12) / (copy_ceiling_gbps(ctx.device) * 1e3)
            eager_us = ctx.time_fn(eager)
            if not fused:
                ctx.record(f"{name} T={T} torch", eager_us, floor_us=floor_us, E=E, K=kw["top_k"], T=T)
                continue
            fast = lambda: route(logits, bias=bias, backend="triton", **kw)  # noqa: E731
            target = TARGET_US[name] if T <= 4096 else None
            ok = matches(fast(), eager())
            fast_us = ctx.time_fn(fast)
            ctx.record(f"{name} T={T} triton", fast_us, anchor="torch eager route", anchor_us=eager_us,
                       floor_us=floor_us, target_us=target, meets_target=(fast_us <= target) if target else None,
                       loop_us=_loop_us(fast), E=E, K=kw["top_k"], T=T, matches_reference=ok)
            graph_us = _graph_us(ctx, fast)
            if graph_us is not None:
                ctx.record(f"{name} T={T} triton graph", graph_us, anchor="torch route (graph)",
                           anchor_us=_graph_us(ctx, eager), floor_us=floor_us, target_us=target,
                           meets_target=(graph_us <= target) if target else None, E=E, K=kw["top_k"], T=T,
                           matches_reference=ok)
    if skipped:
        ctx.note(f"time budget ({BUDGET_S:.0f} s) spent: skipped {', '.join(skipped)}")
    if fused and not ctx.quick:
        if time.perf_counter() - t0 < SWEEP_START_BEFORE_S:
            _sweep_launch_configs(ctx, t0)
        else:
            ctx.note("launch-config sweep skipped (time budget)")


def _sweep_launch_configs(ctx: BenchContext, t0: float) -> None:
    """A few (BLOCK_T, num_warps) at T=4096 against the default heuristic (device time, graph
    replay), so `_launch_config` in moe/kernels/routing.py can be checked. Each config compiles."""
    from megapar.moe.kernels.routing import _launch_config, _next_pow2, route_triton

    T = 4096
    for name in ("v3", "v4pro"):
        E, kw = PRESETS[name]
        logits, bias = _inputs(ctx, T, E)
        default = _launch_config(T, _next_pow2(E), None, None)
        default_us = _graph_us(ctx, lambda: route_triton(logits, bias=bias, **kw))
        best = (default_us, default[0], default[1])
        for block_t, warps in SWEEP_CONFIGS:
            if (block_t, warps) == default or block_t * _next_pow2(E) > 16384:
                continue
            if time.perf_counter() - t0 > BUDGET_S:
                ctx.note(f"sweep {name}: stopped at the time budget")
                break
            us = _graph_us(ctx, lambda: route_triton(logits, bias=bias, block_t=block_t, num_warps=warps, **kw))
            if us is not None and (best[0] is None or us < best[0]):
                best = (us, block_t, warps)
        if best[0] is not None:
            ctx.record(f"sweep {name} T={T}", best[0], anchor="default launch config (graph)", anchor_us=default_us,
                       best_block_t=best[1], best_warps=best[2], default_block_t=default[0],
                       default_warps=default[1])
