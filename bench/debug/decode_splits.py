"""The split planning of the GQA decode kernel over fp8 (the Triton kernel: CONFIG
target_programs_fp8, at_most (GQA's, both caches), min_split_fp8) against what `megapar bench cp`'s DCP section
asks of it: rank 0's local attention over 1/N of B = 32 sequences of 32K tokens (Hq 32, Hkv 4,
D 128) for N = 1, 4, 8, timed as the bench times it (`common.step_time`), and the ratio N x local
/ full (target <= 1.15 at every N). Each setting's rows, then the ratio at N = 4 and 8.

    python bench/debug/decode_splits.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _decode_setup
from megapar.launch.bench.common import BenchContext, input_copies, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.paged import paged_decode_attention

SETTINGS = {"now": {}, "p132": {"target_programs_fp8": 132}, "p396": {"target_programs_fp8": 396},
            "p528": {"target_programs_fp8": 528}, "at_most": {"at_most": 1},
            "min1024": {"min_split_fp8": 1024}, "min2048": {"min_split_fp8": 2048},
            "gluon direct8": {"gluon_gqa_fp8": 1, "direct_gluon_gqa_fp8": 8},
            "gluon direct8 p264": {"gluon_gqa_fp8": 1, "direct_gluon_gqa_fp8": 8, "target_programs_gluon_gqa": 264}}
if __import__("os").environ.get("DSPLITS_SET") == "direct":     # (now against the direct Gluon form only)
    SETTINGS = {k: v for k, v in SETTINGS.items() if k in ("now", "gluon direct8", "gluon direct8 p264")}


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, context, hq, hkv, d, block = 32, 32768, 32, 4, 128, 64
    seq = torch.full((batch,), context, device=ctx.device)
    saved = dict(triton_decode.CONFIG)
    rows: list = []
    caches = {}
    for n in (1, 4, 8):
        caches[n] = input_copies(ctx, lambda n=n: _decode_setup(batch, context, hq, hkv, d, block, n, ctx.device,
                                                                torch.float8_e4m3fn)[:3],
                                 lambda c: c[0].k.numel() * 2)
    for name, change in SETTINGS.items():
        triton_decode.CONFIG.update(saved)
        triton_decode.CONFIG.update(change)
        us = {}
        for n, copies in caches.items():
            layout = DCPLayout(size=n, rank=0, block_size=block)
            fns = [lambda c=c, t=t, q=q: paged_decode_attention(q, c, t, seq, layout=layout, scale=d ** -0.5,
                                                                backend="triton", max_seq_len=context)
                   for c, t, q in copies]
            us[n] = step_time(ctx, fns)[0]
            rows.append({"setting": name, "N": n, "us": round(us[n], 2)})
            print(rows[-1], flush=True)
        for n in (4, 8):
            rows.append({"setting": name, "N": n, "ratio_x_n": round(n * us[n] / us[1], 3)})
            print(rows[-1], flush=True)
    triton_decode.CONFIG.update(saved)
    dump_rows(path, "decode_splits.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-splits.json")
