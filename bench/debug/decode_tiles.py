"""MLA over an fp8 latent cache with more than 32 query columns (128 heads at TP 1, 64 at TP 2, a
speculative step's tokens): the narrow direct kernel in head tiles of 32 columns (CONFIG
tiles_wide_fp8, `parallel.cp.gluon_mla_narrow.head_tiles`) at several raw depths and split targets,
against the converter's Gluon kernel (full 64-head tiles; tq = 1) or the Triton kernel (tq > 1), and
the bf16 Gluon kernel over the same tokens for scale. Whole `paged_decode_attention` calls timed
with `common.step_time` (CUDA-graph replays over input copies taken in turn: no call finds its KV
in L2), two rounds, over rank 0's 1/4 of B = 32 sequences of L = 8K, 32K, 128K; each row's max
difference against the problem's first row (the installed form before tiles).

    python bench/debug/decode_tiles.py OUT.json        # on the GPU (DECODE_TILES_FORMS=a,b: those forms only)
"""

from __future__ import annotations

import os
import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _mla_decode_setup
from megapar.launch.bench.common import BenchContext, input_copies, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention

FORMS = (("before", {"tiles_wide_fp8": 0}),
         ("tiles raw3 t132", {"tiles_wide_fp8": 1, "direct_tiles_fp8": 3, "target_programs_tiles_fp8": 132}),
         ("tiles raw5 t132", {"tiles_wide_fp8": 1, "direct_tiles_fp8": 5, "target_programs_tiles_fp8": 132}),
         ("tiles raw3 t264", {"tiles_wide_fp8": 1, "direct_tiles_fp8": 3, "target_programs_tiles_fp8": 264}),
         ("tiles raw5 t264", {"tiles_wide_fp8": 1, "direct_tiles_fp8": 5, "target_programs_tiles_fp8": 264}))
# (cache dtype, L, heads, query tokens); the bf16 rows time the installed bf16 kernel only
PROBLEMS = ((torch.float8_e4m3fn, 8192, 128, 1), (torch.float8_e4m3fn, 32768, 128, 1),
            (torch.float8_e4m3fn, 131072, 128, 1), (torch.float8_e4m3fn, 32768, 64, 1),
            (torch.float8_e4m3fn, 32768, 128, 2), (torch.float8_e4m3fn, 32768, 16, 3),
            (torch.bfloat16, 8192, 128, 1), (torch.bfloat16, 32768, 128, 1))


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows: list = []
    saved = dict(triton_decode.CONFIG)
    dims = MLADims()
    only = [n for n in os.environ.get("DECODE_TILES_FORMS", "").split(",") if n]
    for dtype, context, heads, tq in PROBLEMS:
        fp8 = dtype == torch.float8_e4m3fn
        layout = DCPLayout(size=4, rank=0, block_size=64)
        seq = torch.full((32,), context, device=ctx.device)

        def make():
            latent, table = _mla_decode_setup(32, context, dims, 64, 4, ctx.device, dtype)
            q = torch.randn(32, tq, heads, dims.latent_dim, device=ctx.device, dtype=torch.bfloat16)
            return latent, table, q

        sets = input_copies(ctx, make, lambda s: s[0].kv.numel() * s[0].kv.element_size())
        calls = [lambda s=s: paged_decode_attention(s[2], s[0].paged, s[1], seq, layout=layout, scale=dims.scale,
                                                    backend="triton", max_seq_len=context) for s in sets]
        ref = None
        for rep in range(2):
            for name, entries in FORMS if fp8 else (("bf16", {}),):
                if only and name not in only and name != "before":
                    continue
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(entries)
                got = calls[0]()
                ref = got if ref is None else ref
                fin = torch.isfinite(ref.lse)
                err = max((got.out - ref.out).abs().max().item(), (got.lse[fin] - ref.lse[fin]).abs().max().item())
                us, cols = step_time(ctx, calls)
                row = {"cache": str(dtype), "L": context, "heads": heads, "tq": tq, "kernel": name, "rep": rep,
                       "us": round(us, 1), "max_diff_vs_before": err, "input_sets": len(sets),
                       "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        del sets, calls, ref
        torch.cuda.empty_cache()
    dump_rows(path, "decode_tiles.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-tiles.json")
