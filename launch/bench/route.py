"""`megapar bench route`: the fused Triton routing kernel against the torch eager path.

Presets (SPEC §1-2): V3 (E=256, K=8, sigmoid + bias, 8 groups keep 4, scale 2.5),
V4-Flash (E=256, K=6, sqrt(softplus) + bias), V4-Pro (E=384, K=6, sqrt(softplus) + bias,
scale 2.5). T = 1..16384 tokens, fp32 logits. Targets (ANCHORS.md): V4 <= 10 µs and V3
grouped <= 15 µs for T <= 4096. The floor is the logits read + ids/weights written at the
copy ceiling. On CPU only the torch path runs (the kernel needs CUDA).

With `--device cuda` (full run) a small sweep of (BLOCK_T, num_warps) is recorded too, so
the launch heuristic in moe/kernels/routing.py can be checked against the best config.
"""

from __future__ import annotations

import torch

from launch.bench.common import BenchContext, copy_ceiling_gbps
from moe.router import route

PRESETS: dict[str, tuple[int, dict]] = {
    "v3": (256, dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, scaling=2.5)),
    "v4flash": (256, dict(top_k=6, scoring="sqrt_softplus", scaling=1.5)),
    "v4pro": (384, dict(top_k=6, scoring="sqrt_softplus", scaling=2.5)),
}
TARGET_US = {"v3": 15.0, "v4flash": 10.0, "v4pro": 10.0}


def _inputs(ctx: BenchContext, T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(T * 1000 + E)
    logits = torch.randn(T, E, generator=g).to(ctx.device)
    bias = (torch.randn(E, generator=g) * 0.1).to(ctx.device)
    return logits, bias


def run(ctx: BenchContext) -> None:
    if ctx.quick:
        tokens = [1, 64]
    elif ctx.is_cuda:
        tokens = [1, 4, 16, 64, 256, 1024, 4096, 16384]
    else:
        tokens = [1, 64, 1024, 4096]
    fused = ctx.is_cuda
    if not fused:
        ctx.note("CPU: only the torch eager path runs (the fused kernel needs CUDA)")
    for name, (E, kw) in PRESETS.items():
        for T in tokens:
            logits, bias = _inputs(ctx, T, E)
            eager_us = ctx.time_fn(lambda: route(logits, bias=bias, backend="torch", **kw))
            floor_us = (T * E * 4 + T * kw["top_k"] * 12) / (copy_ceiling_gbps(ctx.device) * 1e3)
            if not fused:
                ctx.record(f"{name} T={T} torch", eager_us, floor_us=floor_us, E=E, K=kw["top_k"], T=T)
                continue
            fast_us = ctx.time_fn(lambda: route(logits, bias=bias, backend="triton", **kw))
            ctx.record(f"{name} T={T} triton", fast_us, anchor="torch eager route", anchor_us=eager_us,
                       floor_us=floor_us, target_us=TARGET_US[name] if T <= 4096 else None,
                       meets_target=(fast_us <= TARGET_US[name]) if T <= 4096 else None,
                       E=E, K=kw["top_k"], T=T)
    if fused and not ctx.quick:
        _sweep_launch_configs(ctx)


def _sweep_launch_configs(ctx: BenchContext) -> None:
    from moe.kernels.routing import _launch_config, route_triton

    for name, (E, kw) in PRESETS.items():
        for T in (1, 4096, 16384):
            logits, bias = _inputs(ctx, T, E)
            block_e = 1 << (E - 1).bit_length()
            default = _launch_config(T, block_e, None, None)
            best = None
            for block_t in (1, 2, 4, 8, 16, 32):
                if block_t > max(T, 1) or block_t * block_e > 16384:
                    continue
                for warps in (1, 2, 4, 8):
                    us = ctx.time_fn(lambda: route_triton(logits, bias=bias, block_t=block_t, num_warps=warps, **kw),
                                     warmup=2, iters=20)
                    if best is None or us < best[0]:
                        best = (us, block_t, warps)
            default_us = ctx.time_fn(lambda: route_triton(logits, bias=bias, **kw), warmup=2, iters=20)
            ctx.record(f"sweep {name} T={T}", best[0], anchor="default launch config", anchor_us=default_us,
                       best_block_t=best[1], best_warps=best[2], default_block_t=default[0], default_warps=default[1])
