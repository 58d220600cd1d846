"""GQA decode with two kv heads a program (CONFIG pair / pair_fp8) against the installed kernel:
rank 0 of 4's paged cache (B = 32, Hq = 32, Hkv = 4, D = 128, page 64) at L = 8K and 32K, bf16
and fp8, each setting timed with `common.step_time` (alternating, two rounds) and its max abs
difference from the installed call's out / lse.

    python bench/debug/decode_pair.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _decode_setup
from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.paged import paged_decode_attention

SETTINGS = {  # name -> CONFIG overrides (the fp8 cache's keys carry _fp8)
    "installed": {},
    "pair": {"pair": 1, "pair_fp8": 1},
    "pair, bf16 8 warps": {"pair": 1, "num_warps": 8},
    "pair, fp8 no register cap": {"pair_fp8": 1, "maxnreg_fp8": 0},
    "pair, fp8 8 warps": {"pair_fp8": 1, "num_warps_fp8": 8, "maxnreg_fp8": 0},
    "pair, 2x programs": {"pair": 1, "pair_fp8": 1, "target_programs": 528, "target_programs_fp8": 528},
    "stage16 fp8 (value tile)": {"stage16_fp8": 1},
}


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, heads, kv_heads, d, block, size = 32, 32, 4, 128, 64, 4
    saved = dict(triton_decode.CONFIG)
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for context in (8192, 32768):
            cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, block, size, ctx.device, dtype)
            layout = DCPLayout(size=size, rank=0, block_size=block)
            seq = torch.full((batch,), context, device=ctx.device)

            def call():
                return paged_decode_attention(q, cache, table, seq, layout=layout, scale=d ** -0.5,
                                              backend="triton", max_seq_len=context)
            ref = call()
            for rep in range(2):
                for name, over in SETTINGS.items():
                    if dtype == torch.bfloat16 and "fp8" in name or dtype != torch.bfloat16 and "bf16" in name:
                        continue
                    triton_decode.CONFIG.update(saved)
                    triton_decode.CONFIG.update(over)
                    got = call()
                    err = max((got.out - ref.out).abs().max().item(), (got.lse - ref.lse).abs().max().item())
                    us, cols = step_time(ctx, [call])
                    row = {"cache": str(dtype), "L": context, "setting": name, "rep": rep, "us": round(us, 1),
                           "max_diff_vs_installed": err, "timing": cols["timing"]}
                    rows.append(row)
                    print(row, flush=True)
            triton_decode.CONFIG.update(saved)
            del cache, table, q
            torch.cuda.empty_cache()
    dump_rows(path, "decode_pair.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-pair.json")
