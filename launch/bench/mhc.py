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
the torch reference (`backend="torch"`) on the same inputs. On CUDA every Triton row says whether
its result matches the reference's on its inputs (`matches_reference`, checked once before timing
at the GPU tests' tolerances: `check_against_reference`); until 2026-12-05 they were timed unchecked. L2 is flushed before each timed
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
                # ours against the torch reference on these inputs, once before timing (CUDA: Triton)
                checks = check_against_reference(residual, out, fn, base, scale, post_w, comb) if ctx.is_cuda else {}
                for name, (call, nbytes) in cases.items():
                    us = ctx.time_fn(lambda: call(ours), **time_kw)
                    floor = nbytes / (gbps * 1e9) * 1e6
                    if ctx.is_cuda:
                        anchor_us = ctx.time_fn(lambda: call("torch"), **time_kw)
                        ctx.record(f"{name} T={t} H={h}", us, anchor="torch reference", anchor_us=anchor_us,
                                   floor_us=floor, gbps=nbytes / us / 1e3, matches_reference=checks[name], **shape)
                    else:
                        ctx.record(f"{name} T={t} H={h} (torch)", us, floor_us=floor, gbps=nbytes / us / 1e3, **shape)
                if ctx.is_cuda:
                    unfused = ctx.time_fn(lambda: mhc_pre(mhc_post(out, residual, post_w, comb, backend=ours),
                                                          fn, base, scale, backend=ours), **time_kw)
                    fused = ctx.time_fn(lambda: mhc_post_pre(out, residual, post_w, comb, fn, base, scale,
                                                             backend=ours), **time_kw)
                    ctx.record(f"post+pre fused vs unfused T={t} H={h}", fused, anchor="our post then our pre",
                               anchor_us=unfused, matches_reference=checks["post+pre fused"], **shape)
                    if t in SWITCH_CHECK_TOKENS:
                        _record_switch(ctx, t, h, cases["pre"][0], cases["pre"][1], gbps, time_kw, shape,
                                       checks["pre reference"])
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
                                       gbps=nbytes / us / 1e3, matches_reference=checks[name], **shape)


# Tolerances of the GPU tests (tests/test_mhc.py, test_triton_kernels_match_reference_on_gpu): bf16
# outputs (layer input, new residual; 2^-8 relative spacing, fp32 sums that differ in the last bits
# may round apart) 2e-2; pre's fp32 mixing weights (post, comb) 1e-4 / 1e-5 against a reference in
# true fp32 (TF32 off while it runs). The fused call's pre is checked against the torch pre of the
# torch post's residual at 2e-2 throughout, as the GPU test does (its input may differ in a last bit).
BF16_TOL = dict(rtol=2e-2, atol=2e-2)
MIX_TOL = dict(rtol=1e-4, atol=1e-5)


def _close(got: torch.Tensor, want: torch.Tensor, tol: dict) -> bool:
    return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), **tol))


def _pre_matches(got, want, mix_tol: dict) -> bool:
    return (_close(got.layer_input, want.layer_input, BF16_TOL) and _close(got.post, want.post, mix_tol)
            and _close(got.comb, want.comb, mix_tol))


def _fp32_reference(fn: Callable[[], object]) -> object:
    """The torch reference with its matmul in true fp32 (TF32 would put ~1e-3 into post / comb)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return fn()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def check_against_reference(residual, out, fn, base, scale, post_w, comb, backend: str = "triton") -> dict[str, bool]:
    """Whether `backend`'s pre, post and fused post+pre match the torch reference on these inputs
    (tolerances above); key "pre reference" holds the torch pre, for the switch rows' check."""
    from megapar.model.mhc import mhc_post, mhc_post_pre, mhc_pre

    want_pre = _fp32_reference(lambda: mhc_pre(residual, fn, base, scale, backend="torch"))
    want_new = _fp32_reference(lambda: mhc_post(out, residual, post_w, comb, backend="torch"))
    want_next = _fp32_reference(lambda: mhc_pre(want_new, fn, base, scale, backend="torch"))
    got_new, got_next = mhc_post_pre(out, residual, post_w, comb, fn, base, scale, backend=backend)
    return {"pre": _pre_matches(mhc_pre(residual, fn, base, scale, backend=backend), want_pre, MIX_TOL),
            "post": _close(mhc_post(out, residual, post_w, comb, backend=backend), want_new, BF16_TOL),
            "post+pre fused": _close(got_new, want_new, BF16_TOL) and _pre_matches(got_next, want_next, BF16_TOL),
            "pre reference": want_pre}


GRAPH_MAX_TOKENS = 128
SWITCH_CHECK_TOKENS = (128, 1024, 4096)


def _record_switch(ctx: BenchContext, t: int, h: int, call: Callable[[str], object], nbytes: int, gbps: float,
                   time_kw: dict, shape: dict, want=None) -> None:
    """Where pre switches from one launch to two (triton_mhc.SINGLE_LAUNCH_MAX_TOKENS): time the
    other path at the same T, to place the switch from measurements. want: the torch reference's
    pre on these inputs (the other path's result is compared with it: matches_reference)."""
    from megapar.model import triton_mhc

    saved = triton_mhc.SINGLE_LAUNCH_MAX_TOKENS
    single = t <= saved
    ok = None
    try:
        triton_mhc.SINGLE_LAUNCH_MAX_TOKENS = t - 1 if single else t
        if want is not None:
            ok = _pre_matches(call("triton"), want, MIX_TOL)
        other = ctx.time_fn(lambda: call("triton"), **time_kw)
    finally:
        triton_mhc.SINGLE_LAUNCH_MAX_TOKENS = saved
    default = ctx.time_fn(lambda: call("triton"), **time_kw)
    ctx.record(f"pre T={t} H={h} {'two launches' if single else 'one launch'} (not the default)", other,
               anchor=f"default: {'one launch' if single else 'two launches'}", anchor_us=default,
               floor_us=nbytes / (gbps * 1e9) * 1e6, gbps=nbytes / other / 1e3, matches_reference=ok, **shape)


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
