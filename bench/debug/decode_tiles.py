"""MLA with more than 32 query columns (128 heads at TP 1, a speculative step's tokens): the swapped
narrow kernels in head tiles (CONFIG tiles_wide / tiles_wide_fp8, `parallel.cp.gluon_mla_narrow.
head_tiles`) of 32 and 16 columns and a speculative step over full 64-head tiles as one-token decodes
(CONFIG expand_wide / expand_wide_fp8), against the Triton kernel. Whole `paged_decode_attention` calls timed
with `common.step_time` (CUDA-graph replays over input copies taken in turn: no call finds its KV
in L2), two rounds, over rank 0's 1/4 of B = 32 sequences of L = 8K and 32K; each row's max
difference against the problem's first row (the Triton kernel's).

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

# (name, CONFIG entries): "untiled" the tiles and the expansion off (the full-head-tile Gluon kernels at
# one token, the Triton kernel over several), the tiles everywhere (2) at 32 and 16 columns, and a
# speculative step over full head tiles as one-token decodes (expand)
FORMS = {"fp8": (("untiled", {"tiles_wide_fp8": 0, "expand_wide_fp8": 0}),
                 ("w32 raw3", {"tiles_wide_fp8": 2, "tile_columns_fp8": 32, "direct_tiles_fp8": 3,
                               "expand_wide_fp8": 0}),
                 ("w16 raw5", {"tiles_wide_fp8": 2, "tile_columns_fp8": 16, "direct_tiles_fp8": 5,
                               "expand_wide_fp8": 0}),
                 ("expand", {"expand_wide_fp8": 1})),
         "bf16": (("untiled", {"tiles_wide": 0, "expand_wide": 0}),
                  ("w32", {"tiles_wide": 2, "tile_columns": 32, "expand_wide": 0}),
                  ("w16", {"tiles_wide": 2, "tile_columns": 16, "expand_wide": 0}),
                  ("expand", {"expand_wide": 1}))}
# (cache dtype, L, heads, query tokens): "expand" applies to the full 64-head tiles' speculative steps
PROBLEMS = ((torch.float8_e4m3fn, 8192, 128, 2), (torch.float8_e4m3fn, 32768, 128, 2),
            (torch.bfloat16, 8192, 128, 2), (torch.bfloat16, 32768, 128, 2), (torch.bfloat16, 32768, 128, 4),
            (torch.bfloat16, 32768, 64, 3), (torch.float8_e4m3fn, 32768, 64, 3))


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
            for name, entries in FORMS["fp8" if fp8 else "bf16"]:
                if only and name not in only and name != "untiled":
                    continue
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(entries)
                got = calls[0]()
                ref = got if ref is None else ref
                fin = torch.isfinite(ref.lse)
                err = max((got.out - ref.out).abs().max().item(), (got.lse[fin] - ref.lse[fin]).abs().max().item())
                us, cols = step_time(ctx, calls)
                row = {"cache": str(dtype), "L": context, "heads": heads, "tq": tq, "kernel": name, "rep": rep,
                       "us": round(us, 1), "max_diff_vs_untiled": err, "input_sets": len(sets),
                       "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        del sets, calls, ref
        torch.cuda.empty_cache()
    dump_rows(path, "decode_tiles.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-tiles.json")
