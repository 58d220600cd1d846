"""MLA decode with narrow head tiles (16 heads: TP 8, DeepSeek's DCP deployment; 32 and 8 too):
the swapped-operand Gluon kernel (`parallel.cp.gluon_mla_narrow`, CONFIG swap_wide_narrow*) against
the padded-tile Gluon kernel and the Triton kernel, whole `paged_decode_attention` calls timed with
`common.step_time` (CUDA-graph replays, alternating, two rounds) over rank 0's 1/4 of B = 32
sequences of L = 8K, 32K, 128K, fp8 and bf16 latent caches, and a speculative step's 2 query
tokens at 32K (the swapped kernel against the Triton one); each row's max difference against the
first row's result (the Triton kernel's).

    python bench/debug/decode_narrow.py OUT.json        # on the GPU (DECODE_NARROW_MTP=1: tq > 1 rows only;
                                                        # DECODE_NARROW_FP8=1: fp8, one token, the Gluon forms;
                                                        # DECODE_NARROW_FORMS=a,b: those forms only)
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _mla_decode_setup
from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention

# (name, CONFIG entries) per cache dtype (two programs per SM in the split plan, target_programs 264,
# lost: decode-narrow-h200.json, decode-narrow2-h200.log; two consumer warpgroups: decode-narrow3)
FORMS = {
    "fp8": (("triton", {"gluon_wide_narrow_fp8": 0}), ("padded", {"swap_wide_narrow_fp8": 0}),
            ("direct raw5", {"direct_wide_narrow_fp8": 5, "pipe_wide_narrow_fp8": 0}),
            ("direct raw3", {"direct_wide_narrow_fp8": 3, "pipe_wide_narrow_fp8": 0}),
            ("direct raw3 pipe", {"direct_wide_narrow_fp8": 3, "pipe_wide_narrow_fp8": 1}),
            ("direct raw5 pipe", {"direct_wide_narrow_fp8": 5, "pipe_wide_narrow_fp8": 1}),
            # (the value MMAs in fp8 against the weights' e4m3 hi + lo parts, values8_narrow_fp8)
            ("direct raw5 pipe v8", {"direct_wide_narrow_fp8": 5, "pipe_wide_narrow_fp8": 1, "values8_narrow_fp8": 1}),
            ("direct raw3 pipe v8", {"direct_wide_narrow_fp8": 3, "pipe_wide_narrow_fp8": 1, "values8_narrow_fp8": 1}),
            # (the softmax's two maxima a tile, one_max_narrow_fp8 0: one is installed since 2026-12-07)
            ("direct raw5 pipe two max", {"direct_wide_narrow_fp8": 5, "pipe_wide_narrow_fp8": 1,
                                          "one_max_narrow_fp8": 0})),
    "bf16": (("triton", {"gluon_wide_narrow": 0}), ("padded", {"swap_wide_narrow": 0}), ("swap", {})),
}
PROBLEMS = ((torch.float8_e4m3fn, 8192, 16, 1), (torch.float8_e4m3fn, 32768, 16, 1),
            (torch.float8_e4m3fn, 131072, 16, 1), (torch.bfloat16, 8192, 16, 1), (torch.bfloat16, 32768, 16, 1),
            (torch.bfloat16, 131072, 16, 1), (torch.float8_e4m3fn, 32768, 32, 1), (torch.float8_e4m3fn, 32768, 8, 1),
            (torch.float8_e4m3fn, 32768, 16, 2), (torch.bfloat16, 32768, 16, 2))
# a speculative step's query tokens (tq > 1): the Triton kernel served them before the swapped one
MTP_FORMS = {"fp8": (("triton 4 warps", {"swap_wide_narrow_fp8": 0, "num_warps_wide_narrow_fp8_32": 4}),
                     ("triton", {"swap_wide_narrow_fp8": 0}), ("swap", {})),
             "bf16": (("triton", {"swap_wide_narrow": 0}), ("swap", {}))}


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows: list = []
    saved = dict(triton_decode.CONFIG)
    base = {"gluon_wide_narrow": 1, "gluon_wide_narrow_fp8": 1, "swap_wide_narrow": 1, "swap_wide_narrow_fp8": 1}
    dims = MLADims()
    import os

    only_mtp = bool(os.environ.get("DECODE_NARROW_MTP"))      # (only the speculative-step problems)
    only_fp8 = bool(os.environ.get("DECODE_NARROW_FP8"))      # (only fp8, one token, the Gluon forms)
    only = [n for n in os.environ.get("DECODE_NARROW_FORMS", "").split(",") if n]   # (these forms only)
    for dtype, context, heads, tq in PROBLEMS:
        if (only_mtp and tq == 1) or (only_fp8 and (dtype != torch.float8_e4m3fn or tq > 1)):
            continue
        fp8 = dtype == torch.float8_e4m3fn
        latent, table = _mla_decode_setup(32, context, dims, 64, 4, ctx.device, dtype)
        layout = DCPLayout(size=4, rank=0, block_size=64)
        seq = torch.full((32,), context, device=ctx.device)
        q = torch.randn(32, tq, heads, dims.latent_dim, device=ctx.device, dtype=torch.bfloat16)
        call = lambda: paged_decode_attention(q, latent.paged, table, seq, layout=layout, scale=dims.scale,
                                              backend="triton", max_seq_len=context)
        ref = None
        for rep in range(2):
            for name, entries in (MTP_FORMS if tq > 1 else FORMS)["fp8" if fp8 else "bf16"]:
                if only_fp8 and name in ("triton", "padded"):
                    continue
                if only and name not in only:
                    continue
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(base)
                triton_decode.CONFIG.update(entries)
                got = call()
                ref = got if ref is None else ref
                err = max((got.out - ref.out).abs().max().item(), (got.lse - ref.lse).abs().max().item())
                us, cols = step_time(ctx, [call])
                row = {"cache": str(dtype), "L": context, "heads": heads, "tq": tq, "kernel": name, "rep": rep,
                       "us": round(us, 1), "max_diff_vs_triton": err, "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        del latent, table
        torch.cuda.empty_cache()
    dump_rows(path, "decode_narrow.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-narrow.json")
