"""What the fixed part of a Gluon decode call is made of (the time that does not scale with L: one
page per rank): B = 32, rank 0 of 4, L = 8K's grid, each timed as `megapar bench cp` times a call
(`common.step_time`: ten calls a CUDA graph), for MLA 16 and 128 heads (fp8 and bf16) and GQA (Hq 32,
Hkv 4, D 128, fp8 and bf16; DECODE_FIXED_FAMILIES picks some of mla16, mla128, gqa):
- call: the public call over one page per rank (kernel + split merge; call 132: one wave's splits);
- kernel: the same with the split merge kernel replaced by nothing (the kernel alone);
- empty: the kernel over zero tokens (launch, lengths, the -inf / zero partials);
- one split: the kernel over one page with one split (grid B x kv heads; no merge);
- merge: the split merge alone over the call's partials;
- noop: a one-element kernel, the graph's own per-launch floor;
- full / full kernel: the call / the kernel alone over the whole 1/4 of L = 8K (what the fixed part
  is measured against: at 128 heads the bytes and the MMAs weigh alike, and the queries and the first
  tiles of every CTA load at once before any MMA; the same KV every call, not bench cp's rotated
  copies: fp8's 38 MB at 128 heads may partly stay in L2 between calls).

    python bench/debug/decode_fixed.py OUT.json        # on the GPU
"""

from __future__ import annotations

import os
import sys

import torch
from _rows import dump_rows, family_case

from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.paged import paged_decode_attention
from megapar.parallel.cp.state import AttnState
from megapar.parallel.cp.triton_merge import merge_states_triton

# (the Gluon MLA kernels plan their splits with the full head tiles' targets, narrow or not)
SPLIT_KEYS = {"mla16": ("target_programs_wide", "target_programs_wide_fp8"),
              "mla128": ("target_programs_wide", "target_programs_wide_fp8"), "gqa": ("target_programs_gluon_gqa",)}


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, block, n, context = 32, 64, 4, 8192
    rows: list = []
    saved = dict(triton_decode.CONFIG)
    real_merge = triton_decode.merge_states_triton
    flag = torch.zeros(1, device=ctx.device)
    rows.append({"what": "noop", "us": round(step_time(ctx, [lambda: flag.add_(1)])[0], 2)})
    print(rows[-1], flush=True)
    families = os.environ.get("DECODE_FIXED_FAMILIES", "mla16,mla128,gqa").split(",")
    for family in families:
        for cache_dtype in (torch.float8_e4m3fn, torch.bfloat16):
            cache, table, q, scale = family_case(family, cache_dtype, batch, context, block, n, ctx.device)
            layout = DCPLayout(size=n, rank=0, block_size=block)
            one = torch.full((batch,), n * block, device=ctx.device)
            zero = torch.zeros_like(one)
            full = torch.full((batch,), context, device=ctx.device)
            call = lambda lens: paged_decode_attention(q, cache, table, lens, layout=layout, scale=scale,
                                                       backend="triton", max_seq_len=context)
            partials = {}

            def kernel_only(outs, lses, **kw):
                partials["o"], partials["lse"] = outs, lses
                return AttnState(outs[0], lses[0])
            tag = {"family": family, "cache": str(cache_dtype).replace("torch.", "")}
            for what in ("call", "call 132", "kernel", "empty", "one split", "merge", "full", "full kernel"):
                triton_decode.CONFIG.update(saved)
                triton_decode.merge_states_triton = real_merge if what in ("call", "call 132", "full") else kernel_only
                if what in ("one split", "call 132"):
                    for key in SPLIT_KEYS[family]:
                        triton_decode.CONFIG[key] = 1 if what == "one split" else 132
                fn = {"empty": lambda: call(zero), "merge": None, "full": lambda: call(full),
                      "full kernel": lambda: call(full)}.get(what, lambda: call(one))
                if what == "merge":
                    if "o" not in partials:
                        continue
                    o, lse = partials["o"], partials["lse"]
                    fn = lambda: real_merge(o, lse, pdl=True)
                fn()
                torch.cuda.synchronize()
                us, cols = step_time(ctx, [fn])
                splits = what in ("kernel", "full kernel") and "o" in partials
                rows.append({**tag, "what": what, "us": round(us, 2), "timing": cols["timing"],
                             **({"splits": int(partials["o"].shape[0])} if splits else {})})
                print(rows[-1], flush=True)
            triton_decode.merge_states_triton = real_merge
    triton_decode.CONFIG.update(saved)
    dump_rows(path, "decode_fixed.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-fixed.json")
