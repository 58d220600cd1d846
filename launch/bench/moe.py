"""`megapar bench moe`: the MoE layer and the sum of its parts, and EP plain vs overlapped.

EP = 1, one GPU: a layer holding the 32 experts of one EP = 8 shard (V3: H 7168, I 2048,
top-8 with 8 groups keep 4; V4-Flash: H 4096, I 2048, top-6, clamped SwiGLU), for 1..4096
tokens, MXFP4 and bf16 experts. Each row is the whole layer (`time_us`), next to its parts
each timed alone on the same inputs: routing (gate linear + route), local dispatch work
(permute into expert blocks), the expert GEMMs (fused FFN), combine (weighted un-permute) and
the shared expert. `anchor_us` is the sum of the parts, so `speedup_vs_anchor` < 1 shows the
layer's own overhead. The floor is the bytes of the experts' weights that the tokens touch
plus the activations, at the copy ceiling.

EP > 1 (when this machine has >= 2 GPUs, or `--world-size` ranks on CPU/gloo in a full
CPU run): the full model layer (256 experts) at EP = 2, 4, 8 over NCCL, T tokens per rank,
plain (`overlap_chunks=1`) against the overlapped pipeline (2 and 4 chunks); the slowest
rank's median is recorded.
"""

from __future__ import annotations

import torch

from launch.bench.common import BenchContext, copy_ceiling_gbps
from moe.layer import MoEConfig, MoELayer

SHARD_EXPERTS = 32  # experts per rank of an EP = 8 job


def _shard_config(name: str, fmt: str, dtype: torch.dtype) -> MoEConfig:
    if name == "v3":
        return MoEConfig.deepseek_v3(num_experts=SHARD_EXPERTS, expert_format=fmt, dtype=dtype)
    return MoEConfig.deepseek_v4_flash(num_experts=SHARD_EXPERTS, expert_format=fmt, dtype=dtype)


def _quick_config(fmt: str) -> MoEConfig:
    return MoEConfig(hidden=256, inter=128, num_experts=8, top_k=2, n_group=4, topk_group=2, expert_format=fmt,
                     dtype=torch.float32)


def _weight_bytes(layer: MoELayer, counts: torch.Tensor) -> float:
    """Bytes of the expert weights the routed rows touch."""
    per_slot = sum(t.numel() * t.element_size() for t in layer.experts.slot_tensors()) / layer.experts.num_slots
    return per_slot * int((counts > 0).sum())


def bench_layer(ctx: BenchContext, name: str, layer: MoELayer, num_tokens: int) -> None:
    cfg = layer.config
    x = torch.randn(num_tokens, cfg.hidden, device=ctx.device).to(cfg.dtype)
    d = layer.dispatcher
    with torch.no_grad():
        r = layer.gate(x)
        res = d.dispatch(x, r.topk_ids, r.topk_weights)
        y = layer.experts(res.x, res.counts)
        parts = {
            "routing_us": ctx.time_fn(lambda: layer.gate(x)),
            "dispatch_us": ctx.time_fn(lambda: d.dispatch(x, r.topk_ids, r.topk_weights)),
            "gemm_us": ctx.time_fn(lambda: layer.experts(res.x, res.counts)),
            "combine_us": ctx.time_fn(lambda: d.combine(y, res.handle)),
            "shared_us": ctx.time_fn(lambda: layer.shared_experts(x)) if layer.shared_experts is not None else 0.0,
        }
        full_us = ctx.time_fn(lambda: layer(x))
    total = sum(parts.values())
    act_bytes = 2 * num_tokens * cfg.hidden * x.element_size() * (1 + cfg.top_k)
    floor_us = (_weight_bytes(layer, res.counts) + act_bytes) / (copy_ceiling_gbps(ctx.device) * 1e3)
    ctx.record(f"{name} T={num_tokens}", full_us, anchor="sum of parts measured alone", anchor_us=total,
               floor_us=floor_us, overhead_us=full_us - total, T=num_tokens, **parts)


def run(ctx: BenchContext) -> None:
    if ctx.quick or not ctx.is_cuda:
        tokens = [1, 16] if ctx.quick else [1, 16, 128, 512]
        for fmt in ("fp32", "mxfp4"):
            layer = MoELayer(_quick_config(fmt), device=ctx.device)
            for t in tokens:
                bench_layer(ctx, f"tiny {fmt}", layer, t)
        ctx.note("CPU: tiny shapes (H 256, I 128, 8 experts); the V3/V4-Flash shard shapes run on CUDA")
        world = ctx.options.get("world_size")
        if not ctx.quick and world and world > 1:
            _bench_ep(ctx, [world], backend="gloo")
        return
    for name in ("v3", "v4flash"):
        for fmt in ("mxfp4", "bf16"):
            layer = MoELayer(_shard_config(name, fmt, torch.bfloat16), device=ctx.device)
            for t in (1, 4, 16, 64, 256, 1024, 4096):
                bench_layer(ctx, f"{name} {fmt} EP=1 ({SHARD_EXPERTS} experts)", layer, t)
            del layer
            torch.cuda.empty_cache()
    n = torch.cuda.device_count()
    worlds = [w for w in (2, 4, 8) if w <= n]
    if worlds:
        _bench_ep(ctx, worlds, backend="nccl")
    else:
        ctx.note(f"EP > 1 not run: {n} GPU(s) here; on a machine with >= 2 GPUs this suite runs EP = 2..8 "
                 "plain vs overlapped")


# ---- EP > 1 --------------------------------------------------------------------------------

def _bench_ep(ctx: BenchContext, worlds: list[int], *, backend: str) -> None:
    from launch.local import launch_local

    on_gpu = backend == "nccl"
    tokens = [128, 1024, 4096] if on_gpu else [256]
    presets = ["v3", "v4flash"] if on_gpu else ["tiny"]
    for world in worlds:
        for preset in presets:
            rows = launch_local(_ep_rank, world, backend=backend, args=(world, preset, tokens, on_gpu, ctx.quick),
                                timeout=600)
            for case, times in rows[0].items():
                plain = times["plain_us"]
                for chunks, us in times.items():
                    if chunks == "plain_us":
                        continue
                    ctx.record(f"{preset} EP={world} {case} {chunks}", us, anchor="plain (overlap_chunks=1)",
                               anchor_us=plain, world=world)


def _ep_rank(rank: int, world: int, preset: str, tokens: list[int], on_gpu: bool, quick: bool) -> dict:
    """One rank of the EP benchmark; returns {case: {"plain_us", "chunks=2_us", ...}} (slowest rank)."""
    import torch.distributed as dist

    from parallel import ParallelConfig, destroy_parallel, init_parallel

    groups = init_parallel(ParallelConfig(world_size=world))
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    ctx = BenchContext(suite="moe", device=device, quick=quick)
    if preset == "tiny":
        cfg = MoEConfig(hidden=2048, inter=512, num_experts=8 * world, top_k=4, dtype=torch.float32,
                        expert_format="fp32")
    elif preset == "v3":
        cfg = MoEConfig.deepseek_v3(expert_format="mxfp4")
    else:
        cfg = MoEConfig.deepseek_v4_flash(expert_format="mxfp4")
    out: dict[str, dict[str, float]] = {}
    try:
        layers = {c: MoELayer(cfg, groups.ep, tokens="sequence_parallel", overlap_chunks=c, device=device)
                  for c in (1, 2, 4)}
        for c in (2, 4):
            layers[c].load_state_dict(layers[1].state_dict())
        for t in tokens:
            x = torch.randn(t, cfg.hidden, device=device).to(cfg.dtype)
            times: dict[str, float] = {}
            with torch.no_grad():
                for c, layer in layers.items():
                    dist.barrier()
                    us = torch.tensor([ctx.time_fn(lambda: layer(x), warmup=2, iters=10 if on_gpu else 3)],
                                      device=device)
                    dist.all_reduce(us, op=dist.ReduceOp.MAX)
                    times["plain_us" if c == 1 else f"chunks={c}"] = float(us)
            out[f"T={t}/rank {cfg.expert_format}"] = times
    finally:
        destroy_parallel()
    return out
