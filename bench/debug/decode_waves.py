"""How many waves of CTAs the Gluon decode kernels' split planning asks for: MLA's narrow head tiles
(16 heads, bf16 and fp8 latent caches; CONFIG target_programs_wide / _wide_fp8, which the Gluon MLA
kernels take) and GQA's Gluon kernel
(Hq 32, Hkv 4, D 128; target_programs_gluon_gqa), B = 32 over 1/4 of L = 8K / 32K / 128K, each
target timed as `megapar bench cp` times the paged rows (`common.step_time`), with the fixed part
(one page per rank, the same grid and merge). These kernels hold one CTA per SM: 132 programs are
one wave on the H200, 264 two.

    python bench/debug/decode_waves.py OUT.json        # on the GPU (DWAVES_SET=mla|gqa: one family)
"""

from __future__ import annotations

import os
import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.common import BenchContext, input_copies, step_time
from megapar.launch.bench.cp import _decode_setup, _mla_decode_setup
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention

TARGETS = (132, 264)
# (the Gluon MLA kernels plan their splits with the full head tiles' targets, narrow or not)
FAMILIES = {"mla16": ("target_programs_wide", "target_programs_wide_fp8"), "gqa": ("target_programs_gluon_gqa",)}


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, block, n = 32, 64, 4
    dims = MLADims()
    only = os.environ.get("DWAVES_SET")
    saved = dict(triton_decode.CONFIG)
    rows: list = []
    for family, key in FAMILIES.items():
        if only and not family.startswith(only):
            continue
        for cache_dtype in (torch.float8_e4m3fn, torch.bfloat16):
            for context in (8192, 32768, 131072):
                if family == "gqa":
                    heads, d, scale = 32, 128, 128 ** -0.5
                    make = lambda: _decode_setup(batch, context, heads, 4, d, block, n, ctx.device, cache_dtype)[:3]
                else:
                    heads, d, scale = 16, dims.latent_dim, dims.scale

                    def make():
                        latent, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                        return latent.paged, table, torch.randn(batch, heads, d, device=ctx.device,
                                                                dtype=torch.bfloat16)
                sets = input_copies(ctx, make, lambda c: c[0].k.numel() * c[0].k.element_size())
                layout = DCPLayout(size=n, rank=0, block_size=block)
                seq = torch.full((batch,), context, device=ctx.device)
                short = torch.full_like(seq, n * block)
                call = lambda c, t, q, lens: paged_decode_attention(q, c, t, lens, layout=layout, scale=scale,
                                                                    backend="triton", max_seq_len=context)
                for target in TARGETS:
                    triton_decode.CONFIG.update(saved)
                    for k in key:
                        triton_decode.CONFIG[k] = target
                    us = step_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, seq) for c, t, q in sets])[0]
                    c, t, q = sets[0]
                    fixed = step_time(ctx, [lambda: call(c, t, q, short)])[0]
                    rows.append({"family": family, "cache": str(cache_dtype).replace("torch.", ""), "L": context,
                                 "target_programs": target, "us": round(us, 2), "fixed_us": round(fixed, 2)})
                    print(rows[-1], flush=True)
                del sets
    triton_decode.CONFIG.update(saved)
    dump_rows(path, "decode_waves.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-waves.json")
