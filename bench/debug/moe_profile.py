"""Kernel-time breakdown of one MoE layer forward replayed from a CUDA graph (H200 notes).
python3 bench/debug/moe_profile.py  -> per kernel: name, count, total us."""
import collections, torch
from torch.profiler import ProfilerActivity, profile
from moe import MoELayer
from launch.bench.moe import _shard_config

for name in ("v4flash", "v3"):
    layer = MoELayer(_shard_config(name, "mxfp4", torch.bfloat16), device="cuda")
    for t in (1, 16, 64, 256):
        x = torch.randn(t, layer.config.hidden, device="cuda").bfloat16()
        with torch.inference_mode():
            layer(x); layer(x); torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                layer(x)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    g.replay()
                torch.cuda.synchronize()
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                a = agg[e.name[:50]]; a[0] += 1; a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total = sum(v[1] for v in agg.values()) / 10
        print(f"== {name} T={t}: sum of kernel times per replay {total:.1f} us")
        for k, (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"   {us / 10:8.1f} us  x{n // 10:<2d} {k}")
    del layer; torch.cuda.empty_cache()
