"""The pace of a decode kernel's streamed part when its keys come from L2 instead of DRAM: what bounds
a row on a card with more DRAM bandwidth than this one (the H200's 4.8 TB/s against the H100's 3.35)
when only this one is lent. B = 32, rank 0 of 4, 1/4 of L = DECODE_L2PACE_CONTEXT (default 32K; a comma list: each) a
sequence, each family as bench cp builds it (`_rows.family_case`: GQA Hq 32 / Hkv 4 / D 128, MLA 16
and 128 heads; fp8 and bf16), each call timed as `megapar bench cp` times one (`common.step_time`,
ten calls a CUDA graph), three ways:

- dram: the bench's block table (every page its own);
- l2: the same lengths and grid, the block ids taken modulo a pool of pages of DECODE_L2PACE_POOL_MB
  (default 12 MB, a quarter of an H100's L2; `launch.bench.cp.pooled_table`, which bench cp's decode
  rows time too: columns l2_us, paced_by), so that after the first touches every tile is an L2 hit;
- one page: one page per rank (the call's fixed part: launch, the dependent loads, the split merge).

Columns: the µs of each; streamed GB/s = the local KV's bytes / (µs - one page µs), for dram and l2;
ns a tile an SM = (µs - one page µs) x SMs / (64-key tiles x head tiles of 64 (MLA 128: 2)). Where
l2's streamed rate is under a card's DRAM rate, that card's row is paced by the kernel, not its
reads. The MLA 16 fp8 rows also run with the narrow kernel's fp8 value MMAs (CONFIG
values8_narrow_fp8 1, kernel "v8") and with its softmax's two maxima a tile (one_max_narrow_fp8 0,
"two max"; installed since 2026-12-07: one).

    python bench/debug/decode_l2pace.py OUT.json        # on the GPU (DECODE_FIXED_FAMILIES-like:
                                                        # DECODE_L2PACE_FAMILIES=mla16,gqa picks some)
"""

from __future__ import annotations

import os
import sys

import torch
from _rows import dump_rows, family_case, kv_bytes_per_page

from megapar.launch.bench.common import BenchContext, step_time
from megapar.launch.bench.cp import pooled_table
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.paged import paged_decode_attention


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, block, n = 32, 64, 4
    contexts = [int(c) for c in os.environ.get("DECODE_L2PACE_CONTEXT", "32768").split(",")]
    pool_bytes = float(os.environ.get("DECODE_L2PACE_POOL_MB", "12")) * 2 ** 20
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    saved = dict(triton_decode.CONFIG)
    rows: list = []
    layout = DCPLayout(size=n, rank=0, block_size=block)
    for family in os.environ.get("DECODE_L2PACE_FAMILIES", "mla16,mla128,gqa").split(","):
        for cache_dtype, context in ((d, c) for d in (torch.float8_e4m3fn, torch.bfloat16) for c in contexts):
            cache, table, q, scale = family_case(family, cache_dtype, batch, context, block, n, ctx.device)
            page = kv_bytes_per_page(cache)
            pooled = pooled_table(table, page, pool_bytes)
            pool = int(pooled.max()) + 1
            full = torch.full((batch,), context, device=ctx.device)
            one = torch.full((batch,), n * block, device=ctx.device)
            local = int(layout.local_lengths(full).sum())
            head_tiles = max(1, q.shape[-2] // 64) if family != "gqa" else 1
            tiles = -(-local // 64) * head_tiles
            forms = [("installed", {})]
            if family == "mla16" and cache_dtype == torch.float8_e4m3fn:
                forms += [("v8", {"values8_narrow_fp8": 1}), ("two max", {"one_max_narrow_fp8": 0})]
            for kernel, entries in forms:
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(entries)
                call = lambda t, lens: paged_decode_attention(q, cache, t, lens, layout=layout, scale=scale,
                                                              backend="triton", max_seq_len=context)
                row = {"family": family, "cache": str(cache_dtype).replace("torch.", ""), "kernel": kernel,
                       "L": context, "local_tokens": local, "kv_bytes": local * page // block,
                       "pool_pages": pool, "pool_mb": round(pool * page / 2 ** 20, 1), "sms": sms, "tiles": tiles}
                for way, fn in (("dram", lambda: call(table, full)), ("l2", lambda: call(pooled, full)),
                                ("one_page", lambda: call(table, one))):
                    fn()
                    torch.cuda.synchronize()
                    row[f"{way}_us"] = round(step_time(ctx, [fn])[0], 2)
                for way in ("dram", "l2"):
                    streamed = row[f"{way}_us"] - row["one_page_us"]
                    row[f"{way}_streamed_GBps"] = round(row["kv_bytes"] / streamed / 1e3, 0) if streamed > 0 else None
                    row[f"{way}_ns_per_tile_sm"] = round(streamed * 1e3 * sms / tiles, 1)
                # (a pooled table reads other pages than the bench's: only a finite, shaped result is asked)
                row["l2_out_finite"] = bool(torch.isfinite(call(pooled, full).out).all())
                rows.append(row)
                print(row, flush=True)
            triton_decode.CONFIG.update(saved)
            del cache, table, q, pooled
            torch.cuda.empty_cache()
    dump_rows(path, "decode_l2pace.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-l2pace.json")
