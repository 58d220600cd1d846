"""The fused MLA prep's launch settings swept on the GPU (CUDA-graph replays), beside the CONFIG
in force, at the decode batch sizes of `megapar bench cp` (H 128, bf16 inputs, bf16 and fp8
caches):

    python bench/debug/mla_prep_sweep.py [OUT.json]

Per (T, cache dtype, block_elems, num_warps): µs of one call as a graph replays it (what bench cp
reports), µs per call with 20 calls in one graph (the kernel without the replay's own cost), and
the fraction of the copy ceiling of the bytes the call moves. Every setting's output is checked
against the CONFIG's (same bits). The last lines name the best setting per T.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch


def main() -> None:
    from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps, graph_time
    from megapar.parallel.cp import triton_mla_prep as tmp
    from megapar.parallel.cp.mla import MLACache, MLADims
    from megapar.parallel.cp.mla_prep import mla_prep, rope_table

    dev = torch.device("cuda")
    ctx = BenchContext(suite="mla-prep-sweep", device=dev, quick=False)
    ceiling = copy_ceiling_gbps(dev)
    default = dict(tmp.CONFIG)
    dims, heads = MLADims(), 128
    rows = []
    for tokens, cache_dtype in itertools.product((1, 16, 64, 256), (torch.bfloat16, torch.float8_e4m3fn)):
        cache = MLACache.allocate(tokens // 64 + 64, 64, dims, dtype=cache_dtype, device=dev)
        q = torch.randn(tokens, heads, dims.qk_head_dim, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(tokens, dims.latent_dim, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(tokens, device=dev)
        table = torch.arange(cache.kv.shape[0], device=dev, dtype=torch.int32).expand(tokens, -1)
        cos_sin = rope_table(max(tokens, 64), dims.qk_rope_head_dim, device=dev)
        w_kv = torch.rand(dims.kv_lora_rank, device=dev) + 0.5
        moved = (2 * q.numel() * q.element_size() + kv.numel() * kv.element_size()
                 + tokens * (dims.latent_dim * cache.kv.element_size() + (4 if cache.scale is not None else 0)))
        run = lambda: mla_prep(q, kv, pos, cache, table, cos_sin, w_kv, backend="triton")
        tmp.CONFIG.update(default)
        want_q = run().q
        want_cache = cache.kv.clone()
        tag = str(cache_dtype).replace("torch.", "")
        for elems, warps in itertools.product((4096, 8192, 16384, 32768), (2, 4, 8)):
            tmp.CONFIG.update(block_elems=elems, num_warps=warps)
            row = dict(tokens=tokens, cache=tag, block_elems=elems, num_warps=warps,
                       default=(elems, warps) == (default["block_elems"], default["num_warps"]))
            try:
                cache.kv.zero_()
                got_q = run().q
                torch.cuda.synchronize()
                row["same_bits"] = bool(torch.equal(got_q, want_q) and torch.equal(cache.kv.view(torch.uint8),
                                                                                    want_cache.view(torch.uint8)))
                row["us"], row["timing"] = graph_time(ctx, run)

                def twenty():
                    for _ in range(20):
                        run()
                row["us_in_graph_of_20"] = graph_time(ctx, twenty)[0] / 20
                row["copy_fraction"] = round(moved / (ceiling * 1e3) / row["us"], 3)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(row, flush=True)
        del cache, q, kv
    tmp.CONFIG.update(default)
    for tokens in (1, 16, 64, 256):
        mine = [r for r in rows if r["tokens"] == tokens and "us" in r and r["same_bits"]]
        for tag in ("bfloat16", "float8_e4m3fn"):
            sub = [r for r in mine if r["cache"] == tag]
            if sub:
                best = min(sub, key=lambda r: r["us"])
                base = next(r for r in sub if r["default"])
                print(f"T={tokens} {tag}: default {base['us']:.1f} us ({base['copy_fraction']}), best "
                      f"{best['us']:.1f} us ({best['copy_fraction']}) block_elems={best['block_elems']} "
                      f"num_warps={best['num_warps']}; 20 per graph {base['us_in_graph_of_20']:.1f} -> "
                      f"{best['us_in_graph_of_20']:.1f} us")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"default": default, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
