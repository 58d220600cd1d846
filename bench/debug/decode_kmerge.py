"""The full-tile direct fp8 MLA kernel with its splits merged in the kernel (CONFIG merge_wide_fp8 1)
against the merge kernel after it (0): first the two against each other and the torch path on awkward
lengths (0, 1, 63, 64, 65 tokens, long ones; DCP group of 1 and rank 1 of 2; a bad block id) at B = 8 and
B = 7 (8 and 9 splits a head tile), then public calls timed with `common.step_time` (ten a CUDA graph,
the two forms alternating, two rounds): 128 heads, B = 32, rank 0's 1/4 of L = 8K / 32K / 128K, one page
per rank (the fixed part) and 1/8 of 32K (DCP N = 8); and the bf16 kernel's in-kernel merge (CONFIG
merge_wide) against the merge kernel, checked and timed at 8K / its one page / 1/8 of 32K.

    python bench/debug/decode_kmerge.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import check_row, dump_rows, family_case, mla_awkward_cache

from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention

# CONFIG merge_wide_fp8: the merge kernel after the kernel; the last split merging every split's stored
# partial (2); the last split merging its own registers with the others' stored partials (1: its order,
# hence its rounding, depends on which split comes last)
FORMS = (("merge kernel", 0), ("stored merge", 2), ("register merge", 1))


def _check(rows: list, lens: list[int]) -> None:
    dims = MLADims()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for size, rank in ((1, 0), (2, 1)):
        layout = DCPLayout(size=size, rank=rank, block_size=64)
        cache, ref_cache, table, nb = mla_awkward_cache(lens, layout, True, gen)
        q = torch.randn(len(lens), 128, dims.latent_dim, device="cuda", generator=gen).to(torch.bfloat16)
        seq = torch.tensor(lens, device="cuda")
        ref = paged_decode_attention(q, ref_cache, table, seq, layout=layout, scale=dims.scale, backend="torch")
        outs = {}
        for name, merge in FORMS:
            triton_decode.CONFIG["merge_wide_fp8"] = merge
            call = lambda t: paged_decode_attention(q, cache, t, seq, layout=layout, scale=dims.scale,
                                                    backend="triton", validate=False)
            rows.append(check_row(f"fp8 128 heads B={len(lens)} dcp {size} rank {rank}", name, call, ref, table,
                                  nb + 3))
            outs[name] = call(table)
            again = call(table)      # (the counters put back to 0: the same result a second time)
            rows[-1]["repeat_equal"] = bool(torch.equal(again.out, outs[name].out))
        a, b = outs["stored merge"], outs["merge kernel"]
        fin = torch.isfinite(a.lse)
        rows.append({"check": f"B={len(lens)} dcp {size} rank {rank}", "stored_vs_kernel_out": (a.out - b.out)
                     .abs().max().item(), "stored_vs_kernel_lse": (a.lse[fin] - b.lse[fin]).abs().max().item(),
                     "lse_inf_same": bool(torch.equal(torch.isfinite(a.lse), torch.isfinite(b.lse)))})
        print(rows[-1], flush=True)


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows: list = []
    saved = dict(triton_decode.CONFIG)
    _check(rows, [0, 1, 63, 64, 65, 700, 2500, 129])
    _check(rows, [2500, 65, 0, 1, 3000, 4096, 700])     # (7 sequences: 9 splits a head tile)
    triton_decode.CONFIG.update(saved)
    # the bf16 kernel's in-kernel merge (CONFIG merge_wide) against the merge kernel, bit for bit
    for name, on in (("bf16 merge kernel", 0), ("bf16 merged in the kernel", 1)):
        triton_decode.CONFIG["merge_wide"] = on
        cache, table, q, scale = family_case("mla128", torch.bfloat16, 7, 8192, 64, 2, ctx.device)
        lens = torch.tensor([3000, 0, 77, 1, 640, 4096, 129], device=ctx.device)
        got = paged_decode_attention(q, cache, table, lens, layout=DCPLayout(size=2, rank=1, block_size=64),
                                     scale=scale, backend="triton", max_seq_len=8192)
        if on:
            rows.append({"check": "bf16 merged vs merge kernel", "out": (got.out - base.out).abs().max().item(),
                         "lse": (got.lse - base.lse).nan_to_num(0.0, 0.0, 0.0).abs().max().item()})
            print(rows[-1], flush=True)
        base = got
    triton_decode.CONFIG.update(saved)
    for context, n, short, dtype in ((8192, 4, False, torch.float8_e4m3fn), (8192, 4, True, torch.float8_e4m3fn),
                                     (32768, 4, False, torch.float8_e4m3fn), (32768, 8, False, torch.float8_e4m3fn),
                                     (131072, 4, False, torch.float8_e4m3fn), (8192, 4, False, torch.bfloat16),
                                     (8192, 4, True, torch.bfloat16), (32768, 8, False, torch.bfloat16)):
        fp8 = dtype == torch.float8_e4m3fn
        cache, table, q, scale = family_case("mla128", dtype, 32, context, 64, n, ctx.device)
        layout = DCPLayout(size=n, rank=0, block_size=64)
        seq = torch.full((32,), n * 64 if short else context, device=ctx.device)
        call = lambda: paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="triton",
                                              max_seq_len=context, )
        for rep in range(2):
            for name, merge in FORMS if fp8 else (("merge kernel", 0), ("stored merge", 1)):
                triton_decode.CONFIG["merge_wide_fp8" if fp8 else "merge_wide"] = merge
                us, cols = step_time(ctx, [call])
                row = {"cache": str(dtype), "L": context, "n": n, "one_page": short, "form": name, "rep": rep,
                       "us": round(us, 2), "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        del cache, table
        torch.cuda.empty_cache()
    dump_rows(path, "decode_kmerge.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-kmerge.json")
