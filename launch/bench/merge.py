"""`megapar bench merge`: the LSE merge kernel against the copy ceiling, with the torch anchor.

Cases (full GPU run): N-way merges of bf16 outs `[N, T, H, D]` with fp32 LSEs at the anchor
shape of docs/performance.md (N=4, T=8192, H=128, D=128; eager torch 3855 µs there) and neighbours, plus
the ring's in-place two-way merge (fp32 accumulator + bf16 block). Ours is `merge_attn_states`
(Triton on CUDA); the anchor is the torch reference on the same device, both timed as CUDA-graph
replays (`graph_time`: the device's time, as a captured step runs them) and again launched from
Python (eager_us / anchor_eager_us: the host's launch work included); the floor is the bytes
that must move (N outs + N LSEs read, one out + one LSE written) at the copy ceiling; target
>= 70% of it. Each row also says whether the result matches the reference (the ring step's
in-place call too). DCP's all-gather + reduce-scatter combine, one rank's rescale of its fp32 local
out by the N ranks' lses (`rescale_to_merged`) at decode shapes (B = 32: GQA 32 heads x 128, MLA 128
heads x 512 latent; N = 2 / 4 / 8), timed as a decode step runs it, in a CUDA graph, ours and the
torch form alike. On CUDA (full run) a sweep of tile size x warps follows, to check
`parallel.cp.triton_merge.CONFIG`.
"""

from __future__ import annotations

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps, graph_time
from megapar.parallel.cp import merge_attn_states, merge_two_attn_states, rescale_to_merged

TARGET = 0.70


def _states(n: int, t: int, h: int, d: int, device: torch.device, dtype: torch.dtype):
    g = torch.Generator().manual_seed(n * t + h)
    outs = torch.randn(n, t, h, d, generator=g).to(device, dtype)
    lses = (torch.randn(n, t, h, generator=g) * 3).to(device)
    lses[0, :: 7] = float("-inf")      # some empty partials, as real kernels produce
    return outs, lses


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return bool(((a.float() - b.float()).abs().nan_to_num(0.0) <= tol + tol * b.float().abs().nan_to_num(0.0)).all())


def _bytes(n: int, rows: int, d: int, in_size: int, out_size: int, lse_size: int = 4) -> int:
    return n * rows * (d * in_size + lse_size) + rows * (d * out_size + 4)


def _copy_buffers(moved: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) whose copy reads and writes `moved` bytes in all: moved / 2 bytes each."""
    src = torch.empty(moved // 2 // 4, dtype=torch.float32, device=device)
    return src, torch.empty_like(src)


def run(ctx: BenchContext) -> None:
    if ctx.quick:
        shapes = [(2, 64, 8, 32), (4, 64, 8, 32)]
    elif ctx.is_cuda:
        shapes = [(2, 8192, 128, 128), (4, 8192, 128, 128), (8, 4096, 128, 128), (4, 32768, 32, 128), (4, 8192, 16, 64)]
    else:
        shapes = [(4, 1024, 32, 128)]
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    if not ctx.is_cuda:
        ctx.note("CPU: the Triton kernel needs CUDA; 'ours' is the torch reference here (speedup 1 by construction)")
    ceiling = copy_ceiling_gbps(ctx.device)
    anchor_iters = 3 if ctx.quick else 10
    for n, t, h, d in shapes:
        outs, lses = _states(n, t, h, d, ctx.device, dtype)
        ref = merge_attn_states(outs, lses, backend="torch")
        got = merge_attn_states(outs, lses)
        ok = _close(got.out, ref.out, 1e-2) and _close(got.lse, ref.lse, 1e-5)
        moved = _bytes(n, t * h, d, outs.element_size(), outs.element_size())
        ours_us, how = graph_time(ctx, lambda: merge_attn_states(outs, lses))
        anchor_us, anchor_how = graph_time(ctx, lambda: merge_attn_states(outs, lses, backend="torch"),
                                           iters=anchor_iters)
        eager = _eager_columns(ctx, lambda: merge_attn_states(outs, lses),
                               lambda: merge_attn_states(outs, lses, backend="torch"), anchor_iters)
        floor_us = moved / (ceiling * 1e3)
        ctx.record(f"merge N={n} T={t} H={h} D={d} {str(dtype).replace('torch.', '')}", ours_us,
                   anchor="torch reference", anchor_us=anchor_us, floor_us=floor_us,
                   gbps=moved / ours_us / 1e3, meets_target=floor_us / ours_us >= TARGET, matches_reference=ok,
                   timing=how, anchor_timing=anchor_how, **eager)
        del outs, lses, ref, got
    # the ring's step: fp32 accumulator merged in place with a bf16 block
    t, h, d = (64, 8, 32) if ctx.quick else ((8192, 128, 128) if ctx.is_cuda else (1024, 32, 128))
    outs, lses = _states(2, t, h, d, ctx.device, dtype)
    acc, acc_lse = outs[0].float().clone(), lses[0].clone()
    new, new_lse = outs[1], lses[1]
    moved = t * h * (d * 4 + 4) * 2 + t * h * (d * outs.element_size() + 4)
    # the in-place call as timed, on a copy of the accumulator, against the torch reference
    ref = merge_two_attn_states(acc, acc_lse, new, new_lse, backend="torch")
    got_out, got_lse = acc.clone(), acc_lse.clone()
    got = merge_two_attn_states(got_out, got_lse, new, new_lse, out=got_out, out_lse=got_lse)
    ok = _close(got.out, ref.out, 1e-2) and _close(got.lse, ref.lse, 1e-5)
    del ref, got, got_out, got_lse
    step = lambda: merge_two_attn_states(acc, acc_lse, new, new_lse, out=acc, out_lse=acc_lse)
    step_torch = lambda: merge_two_attn_states(acc, acc_lse, new, new_lse, out=acc, out_lse=acc_lse, backend="torch")
    ours_us, how = graph_time(ctx, step)
    anchor_us, anchor_how = graph_time(ctx, step_torch, iters=anchor_iters)
    eager = _eager_columns(ctx, step, step_torch, anchor_iters)
    floor_us = moved / (ceiling * 1e3)
    ctx.record(f"ring step: in-place fp32 acc += {str(dtype).replace('torch.', '')} block T={t} H={h} D={d}",
               ours_us, anchor="torch reference", anchor_us=anchor_us, floor_us=floor_us,
               gbps=moved / ours_us / 1e3, meets_target=floor_us / ours_us >= TARGET, matches_reference=ok,
               timing=how, anchor_timing=anchor_how, **eager)
    if ctx.is_cuda:
        copy_src, copy_dst = _copy_buffers(moved, ctx.device)
        copy_us = ctx.time_fn(lambda: copy_dst.copy_(copy_src))
        ctx.record(f"copy of the ring step's bytes ({moved / 2**20:.0f} MiB read+written)", copy_us,
                   floor_us=floor_us, gbps=moved / copy_us / 1e3)
        del copy_src, copy_dst
    del outs, lses, acc, acc_lse
    _dcp_rescale(ctx, ceiling)
    if ctx.is_cuda and not ctx.quick:
        _sweep(ctx, dtype)


def _eager_columns(ctx: BenchContext, ours, anchor, anchor_iters: int) -> dict:
    """eager_us / anchor_eager_us: the calls launched from Python with events around them (the host's
    launch work included, which the graph rows leave out: on the GPU machines' hosts a merge call's
    Python and Triton launch took longer than the kernel of the small shapes)."""
    if not ctx.is_cuda:
        return {}
    return {"eager_us": ctx.time_fn(ours), "anchor_eager_us": ctx.time_fn(anchor, iters=anchor_iters)}


def _dcp_rescale(ctx: BenchContext, ceiling: float) -> None:
    """DCP ag_rs's local step: this rank's fp32 out [B, H, D] scaled by its weight among the N
    ranks' lses [N, B, H], and the merged lse; floor: out and N lses read, out and lse written."""
    batch = 2 if ctx.quick else 32
    shapes = [(4, 16), (8, 32)] if ctx.quick else [(32, 128), (128, 512)]
    for heads, d in shapes:
        for n in (2, 4, 8):
            outs, lses = _states(n, batch, heads, d, ctx.device, torch.float32)
            ref = rescale_to_merged(outs[0], lses, 0, backend="torch")
            got = rescale_to_merged(outs[0], lses, 0)
            ok = _close(got.out, ref.out, 1e-5) and _close(got.lse, ref.lse, 1e-5)
            moved = batch * heads * (d * 4 * 2 + 4 * (n + 1))
            ours_us, how = graph_time(ctx, lambda: rescale_to_merged(outs[0], lses, 0))
            anchor_us, anchor_how = graph_time(ctx, lambda: rescale_to_merged(outs[0], lses, 0, backend="torch"))
            floor_us = moved / (ceiling * 1e3)
            ctx.record(f"dcp ag_rs rescale N={n} B={batch} H={heads} D={d} fp32", ours_us,
                       anchor="its torch form (elementwise ops per rank)", anchor_us=anchor_us, floor_us=floor_us,
                       timing=how, anchor_timing=anchor_how, matches_reference=ok)
            del outs, lses, ref, got


def _sweep(ctx: BenchContext, dtype: torch.dtype) -> None:
    """Tile elements x warps for the N=4 anchor shape and the ring's pair merge."""
    from megapar.parallel.cp import triton_merge as tm

    default = dict(tm.CONFIG)
    outs, lses = _states(4, 8192, 128, 128, ctx.device, dtype)
    acc, acc_lse = outs[0].float().clone(), lses[0].clone()
    cases = {"merge N=4": lambda: tm.merge_states_triton(outs, lses),
             "pair in place": lambda: tm.merge_states_triton([acc, outs[1]], [acc_lse, lses[1]], out=acc,
                                                             out_lse=acc_lse)}
    try:
        for name, fn in cases.items():
            tm.CONFIG.update(default)
            default_us = ctx.time_fn(fn, warmup=2, iters=20)
            best = None
            for elems in (1024, 2048, 4096, 8192, 16384):
                for warps in (2, 4, 8, 16):
                    tm.CONFIG.update(block_elems=elems, num_warps=warps)
                    us = ctx.time_fn(fn, warmup=2, iters=20)
                    if best is None or us < best[0]:
                        best = (us, elems, warps)
            ctx.record(f"sweep {name}", best[0], anchor="default CONFIG", anchor_us=default_us,
                       best_block_elems=best[1], best_warps=best[2], default_block_elems=default["block_elems"],
                       default_warps=default["num_warps"])
    finally:
        tm.CONFIG.update(default)
