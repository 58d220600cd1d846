"""`megapar bench mhc`: the mHC pre/post mixing against the copy ceiling and the torch reference.

Cases (M = 4 streams, bf16 residual [T, M, H], fp32 parameters, 20 Sinkhorn iterations):
- pre: read the residual (and fn, from L2 after the first programs), write the layer input.
- post: read the residual and the sublayer output, write the new residual.
- post+pre fused (`mhc_post_pre`) against post followed by pre (our kernels, unfused), the
  saving being one read of the residual and one launch. Above FUSE_MAX_TOKENS (2048)
  `mhc_post_pre` itself runs post then pre (the fused projection loses there), so both rows
  time the same code.
- CUDA graph (T <= 128): pre, post and post+pre captured once and replayed, against the same
  calls launched eagerly. At small T the eager numbers are host launch time (Python + Triton's
  launcher); inside a decode CUDA graph only the GPU time remains.
Floor = bytes read + written / the measured copy ceiling (4264 GB/s on the H200), `case_bytes`:
with R the residual [T, M, H], W a row [T, H], F the parameters fn [(2+M)M, M H] + base + scale
(fp32; at T = 1 they outweigh R) and S the mixing weights post [T, M] + comb [T, M, M] (fp32):
pre R + F + W + S; post 2R + W + S (R, the sublayer output and S read, R written); post+pre
2R + 2W + 2S + F (post's bytes, F and pre's outputs: fusing saves pre's read of the new
residual, so the floor does not pay it, also above FUSE_MAX_TOKENS where `mhc_post_pre` runs
post then pre; as in pre's floor, the streams' weighted sum for the layer input is not counted
as a second read). Anchor =
the torch reference (`backend="torch"`) on the same inputs. L2 is flushed before each timed
call (small cases would otherwise be served from L2 and beat the HBM floor).
T = 1 .. 16384 and H = 4096 (V4-Flash), 7168 (V4-Pro) on CUDA; `--quick`: tiny, CPU, the
torch reference only (Triton needs CUDA).
"""

from __future__ import annotations

from typing import Callable

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps

M = 4


def _params(m: int, h: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = (2 + m) * m
    fn = (torch.randn(n, m * h, generator=g) / (m * h) ** 0.5).to(device)
    base = (torch.randn(n, generator=g) * 0.1).to(device)
    scale = torch.tensor([1.0, 1.0, 1.0], device=device)
    return fn, base, scale


def case_bytes(case: str, t: int, h: int, m: int = M, elem: int = 2) -> int:
    """Bytes a case must read and write (module docstring): R, W in the residual's dtype (`elem`
    bytes), F and S fp32."""
    res, row = t * m * h * elem, t * h * elem
    params = ((2 + m) * m * (m * h + 1) + 3) * 4          # fn, base, scale
    mix = t * (m + m * m) * 4                             # post, comb
    return {"pre": res + params + row + mix,
            "post": row + res + mix + res,
            "post+pre fused": row + res + mix + params + res + row + mix}[case]


def run(ctx: BenchContext) -> None:
    if ctx.is_cuda:
        _run(ctx)
        return
    with ctx.single_thread():
        _run(ctx)


def _run(ctx: BenchContext) -> None:
    from megapar.model.mhc import mhc_post, mhc_post_pre, mhc_pre

    if ctx.quick:
        tokens, hiddens = (1, 8), (64,)
    elif ctx.is_cuda:
        tokens, hiddens = (1, 16, 128, 1024, 4096, 16384), (4096, 7168)
    else:
        tokens, hiddens = (1, 16, 128), (1024,)
    dtype = torch.bfloat16
    ours = "triton" if ctx.is_cuda else "torch"
    if not ctx.is_cuda:
        ctx.note("CPU: the torch reference only, one thread (the Triton kernels need CUDA); no anchor")
    if ctx.is_cuda:
        from megapar.model import triton_mhc

        ctx.note(f"Triton pre: one launch up to T={triton_mhc.SINGLE_LAUNCH_MAX_TOKENS} (projection, Sinkhorn "
                 f"and layer input; the last split of each token block finishes it), two above; "
                 f"mhc_post_pre fused up to T={triton_mhc.FUSE_MAX_TOKENS}, post then pre above")
    gbps = copy_ceiling_gbps(ctx.device)
    time_kw = dict(flush_l2=ctx.is_cuda)
    for h in hiddens:
        fn, base, scale = _params(M, h, ctx.device)
        for t in tokens:
            g = torch.Generator().manual_seed(t)
            residual = torch.randn(t, M, h, generator=g).to(ctx.device, dtype)
            out = torch.randn(t, h, generator=g).to(ctx.device, dtype)
            with torch.no_grad():
                first = mhc_pre(residual, fn, base, scale, backend=ours)
                post_w, comb = first.post, first.comb
                cases = {
                    "pre": (lambda b: mhc_pre(residual, fn, base, scale, backend=b), case_bytes("pre", t, h)),
                    "post": (lambda b: mhc_post(out, residual, post_w, comb, backend=b), case_bytes("post", t, h)),
                    "post+pre fused": (lambda b: mhc_post_pre(out, residual, post_w, comb, fn, base, scale, backend=b),
                                       case_bytes("post+pre fused", t, h)),
                }
                shape = dict(T=t, H=h, M=M)
                for name, (call, nbytes) in cases.items():
                    us = ctx.time_fn(lambda: call(ours), **time_kw)
                    floor = nbytes / (gbps * 1e9) * 1e6
                    if ctx.is_cuda:
                        anchor_us = ctx.time_fn(lambda: call("torch"), **time_kw)
                        ctx.record(f"{name} T={t} H={h}", us, anchor="torch reference", anchor_us=anchor_us,
                                   floor_us=floor, gbps=nbytes / us / 1e3, **shape)
                    else:
                        ctx.record(f"{name} T={t} H={h} (torch)", us, floor_us=floor, gbps=nbytes / us / 1e3, **shape)
                if ctx.is_cuda:
                    unfused = ctx.time_fn(lambda: mhc_pre(mhc_post(out, residual, post_w, comb, backend=ours),
                                                          fn, base, scale, backend=ours), **time_kw)
                    fused = ctx.time_fn(lambda: mhc_post_pre(out, residual, post_w, comb, fn, base, scale,
                                                             backend=ours), **time_kw)
                    ctx.record(f"post+pre fused vs unfused T={t} H={h}", fused, anchor="our post then our pre",
                               anchor_us=unfused, **shape)
                    if t in SWITCH_CHECK_TOKENS:
                        _record_switch(ctx, t, h, cases["pre"][0], cases["pre"][1], gbps, time_kw, shape)
                    if t <= GRAPH_MAX_TOKENS:
                        for name, (call, nbytes) in cases.items():
                            try:
                                replay = _graph_replay(lambda: call(ours))
                            except RuntimeError as exc:  # keep the eager rows of a run that cannot capture
                                ctx.note(f"{name} T={t} H={h}: CUDA graph capture failed: {exc}")
                                continue
                            eager = ctx.time_fn(lambda: call(ours), **time_kw)
                            us = ctx.time_fn(replay, **time_kw)
                            ctx.record(f"{name} T={t} H={h} (CUDA graph)", us, anchor="same call, eager",
                                       anchor_us=eager, floor_us=nbytes / (gbps * 1e9) * 1e6,
                                       gbps=nbytes / us / 1e3, **shape)


GRAPH_MAX_TOKENS = 128
SWITCH_CHECK_TOKENS = (128, 1024, 4096)


def _record_switch(ctx: BenchContext, t: int, h: int, call: Callable[[str], object], nbytes: int, gbps: float,
                   time_kw: dict, shape: dict) -> None:
    """Where pre switches from one launch to two (triton_mhc.SINGLE_LAUNCH_MAX_TOKENS): time the
    other path at the same T, to place the switch from measurements."""
    from megapar.model import triton_mhc

    saved = triton_mhc.SINGLE_LAUNCH_MAX_TOKENS
    single = t <= saved
    try:
        triton_mhc.SINGLE_LAUNCH_MAX_TOKENS = t - 1 if single else t
        other = ctx.time_fn(lambda: call("triton"), **time_kw)
    finally:
        triton_mhc.SINGLE_LAUNCH_MAX_TOKENS = saved
    default = ctx.time_fn(lambda: call("triton"), **time_kw)
    ctx.record(f"pre T={t} H={h} {'two launches' if single else 'one launch'} (not the default)", other,
               anchor=f"default: {'one launch' if single else 'two launches'}", anchor_us=default,
               floor_us=nbytes / (gbps * 1e9) * 1e6, gbps=nbytes / other / 1e3, **shape)


def _graph_replay(call: Callable[[], object]) -> Callable[[], None]:
    """Capture `call` (already compiled: warmed up on a side stream first) and return the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay
