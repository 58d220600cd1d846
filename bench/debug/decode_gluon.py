"""The Gluon MLA decode kernels over full 64-head tiles against the Triton kernel: max abs error of
each against the torch path on awkward lengths (0, 1, 63, 64, 65 tokens, long ones; DCP group of 1
and rank 1 of 2; a bad block id), 128 heads over fp8, then whole calls timed with
`common.step_time` (ten a CUDA graph, alternating, two rounds) over rank 0's 1/4 of B = 32
sequences: 128 heads over fp8 at L = 8K, 32K, 128K in the converter's installed form and the direct
kernel's (`FP8_FORMS`: CONFIG raw_ring_wide_fp8 raw stages, keys_wide_fp8 keys a tile,
ring_wide_fp8 fp16 stages, direct_wide_fp8 the direct kernel's raw stages), and 128 heads over bf16
at the same lengths in the bf16 kernel's installed form and its split form (`BF16_FORMS`, CONFIG
split_wide).

    python bench/debug/decode_gluon.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import check_row, dump_rows, mla_awkward_cache

from megapar.launch.bench.cp import _mla_decode_setup
from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention

# (name, Gluon on, raw_ring_wide_fp8, keys_wide_fp8, ring_wide_fp8, direct_wide_fp8): the Triton kernel,
# 64-key tiles with one fp16 stage, 32-key tiles with two (the converter's installed form; 2-4 raw stages
# and 3 fp16 stages measured slower, decode-gluon8-h200.json), the direct kernel (`gluon_mla_direct`: no
# converter) with 3 and 2 raw stages
FP8_FORMS = (("triton", 0, 0, 64, 1, 0), ("gluon raw1", 1, 1, 64, 1, 0), ("gluon k32 ring2 raw2", 1, 2, 32, 2, 0),
             ("direct raw3", 1, 2, 32, 2, 3), ("direct raw2", 1, 2, 32, 2, 2))
TIMED = ("gluon k32 ring2 raw2", "direct raw3", "direct raw2")     # (the forms timed over fp8)
# over bf16: (name, Gluon on, split_wide): the Gluon kernel as installed, and in its split form
BF16_FORMS = (("gluon", 1, 0), ("gluon split", 1, 1))


def _form(key: str, on: int, raw: int, keys: int, ring: int, direct: int = 0) -> None:
    triton_decode.CONFIG.update({key: on, "raw_ring_wide_fp8": raw, "keys_wide_fp8": keys, "ring_wide_fp8": ring,
                                 "direct_wide_fp8": direct})


def _form16(key: str, on: int, split: int) -> None:
    triton_decode.CONFIG.update({key: on, "split_wide": split})


def _check(rows: list, dtype: torch.dtype, heads: int = 128) -> None:
    dims = MLADims()
    fp8 = dtype == torch.float8_e4m3fn
    key = "gluon_wide_fp8" if fp8 else "gluon_wide"
    saved = dict(triton_decode.CONFIG)
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = [0, 1, 63, 64, 65, 700, 2500, 129]
    for size, rank in ((1, 0), (2, 1)):
        layout = DCPLayout(size=size, rank=rank, block_size=64)
        cache, ref_cache, table, nb = mla_awkward_cache(lens, layout, fp8, gen)
        q = torch.randn(len(lens), heads, dims.latent_dim, device="cuda", generator=gen).to(torch.bfloat16)
        seq = torch.tensor(lens, device="cuda")
        ref = paged_decode_attention(q, ref_cache, table, seq, layout=layout, scale=dims.scale, backend="torch")
        for name, *form in FP8_FORMS[:2] if not fp8 else FP8_FORMS:
            _form(key, *form)
            call = lambda t: paged_decode_attention(q, cache, t, seq, layout=layout, scale=dims.scale,
                                                    backend="triton", validate=False)
            rows.append(check_row(f"{dtype} {heads} heads dcp {size} rank {rank}", name, call, ref, table, nb + 3))
    triton_decode.CONFIG.update(saved)


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows: list = []
    saved = dict(triton_decode.CONFIG)
    triton_decode.CONFIG["gluon_wide_narrow"] = 1
    for dtype in (torch.float8_e4m3fn,):
        for heads in (128,):
            _check(rows, dtype, heads)
            triton_decode.CONFIG["gluon_wide_narrow"] = 1
    dims = MLADims()
    for dtype, context, heads in ((torch.float8_e4m3fn, 8192, 128), (torch.float8_e4m3fn, 32768, 128),
                                  (torch.float8_e4m3fn, 131072, 128), (torch.bfloat16, 8192, 128),
                                  (torch.bfloat16, 32768, 128), (torch.bfloat16, 131072, 128)):
        key = "gluon_wide_fp8" if dtype == torch.float8_e4m3fn else "gluon_wide"
        latent, table = _mla_decode_setup(32, context, dims, 64, 4, ctx.device, dtype)
        layout = DCPLayout(size=4, rank=0, block_size=64)
        seq = torch.full((32,), context, device=ctx.device)
        q = torch.randn(32, heads, dims.latent_dim, device=ctx.device, dtype=torch.bfloat16)
        call = lambda: paged_decode_attention(q, latent.paged, table, seq, layout=layout, scale=dims.scale,
                                              backend="triton", max_seq_len=context)
        triton_decode.CONFIG.update(saved)
        triton_decode.CONFIG[key] = 0
        ref = call()
        for rep in range(2):
            fp8 = dtype == torch.float8_e4m3fn
            for name, on, *form in [f for f in FP8_FORMS if f[0] in TIMED] if fp8 else BF16_FORMS:
                (_form if fp8 else _form16)(key, on, *form)
                triton_decode.CONFIG["gluon_wide_narrow"] = on
                triton_decode.CONFIG["gluon_wide_narrow_fp8"] = on
                got = call()
                err = max((got.out - ref.out).abs().max().item(), (got.lse - ref.lse).abs().max().item())
                us, cols = step_time(ctx, [call])
                row = {"cache": str(dtype), "L": context, "heads": heads, "kernel": name, "rep": rep, "us": round(us, 1),
                       "max_diff_vs_triton": err, "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        del latent, table
        torch.cuda.empty_cache()
    dump_rows(path, "decode_gluon.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-gluon.json")
