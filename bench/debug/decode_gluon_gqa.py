"""The warp-specialized Gluon GQA decode kernel (`parallel.cp.gluon_gqa`, CONFIG gluon_gqa /
gluon_gqa_fp8) against the Triton kernel: max abs error of both against the torch path on
awkward lengths (0, 1, 63, 64, 65 tokens, long ones; DCP group of 1 and rank 1 of 2; NaN in every
unheld slot, and NaN scales there over fp8; a bad block id), then whole calls timed with
`common.step_time` (ten a CUDA graph, alternating, two rounds): Hq 32 / Hkv 4, D 128, rank 0's
1/4 of B = 32 sequences of L = 8K, 32K, 128K, bf16 and fp8, and B = 4 at 32K (several splits); the
Triton kernel also with its whole tiles unmasked (CONFIG even / even_fp8). DGQA_SET=fp8-even times
only the fp8 Triton kernel's forms with whole tiles unmasked (`fp8_even`) at B = 32; DGQA_SET=fp8 the fp8
rows only (the Triton kernel and the direct Gluon one with 8 / 10 / 12 raw stages);
DGQA_SET=mtp a speculative step's DGQA_TQ (2) tokens at 1/4 of 32K, the Triton kernel against the direct one.

    python bench/debug/decode_gluon_gqa.py OUT.json        # on the GPU
"""

from __future__ import annotations

import math
import os
import sys

import torch
from _rows import check_row, dump_rows

from megapar.launch.bench.cp import _decode_setup
from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.paged import PagedKVCache, paged_decode_attention

KEYS = {torch.bfloat16: "gluon_gqa", torch.float8_e4m3fn: "gluon_gqa_fp8"}


def _check(rows: list, dtype: torch.dtype) -> None:
    key = KEYS[dtype]
    saved = dict(triton_decode.CONFIG)
    gen = torch.Generator(device="cuda").manual_seed(5)
    lens = [0, 1, 63, 64, 65, 700, 2500, 129, 5000]
    hq, hkv, d = 32, 4, 128
    for size, rank in ((1, 0), (2, 1)):
        block = 64
        layout = DCPLayout(size=size, rank=rank, block_size=block)
        per_seq = -(-max(lens) // (block * size)) + 1
        nb = len(lens) * per_seq + 5
        k = torch.full((nb, block, hkv, d), float("nan"), device="cuda")
        v = torch.full((nb, block, hkv, d), float("nan"), device="cuda")
        ks = torch.full((nb, block, hkv), float("nan"), device="cuda")
        vs = torch.full((nb, block, hkv), float("nan"), device="cuda")
        k0, v0, ks0, vs0 = torch.zeros_like(k), torch.zeros_like(v), torch.ones_like(ks), torch.ones_like(vs)
        table = torch.randperm(nb, device="cuda", generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int()
        for s, n in enumerate(lens):
            if n:
                slots = layout.slot_mapping(torch.arange(n, device="cuda"), table[s])
                mine = slots >= 0
                for dst, clean, sdst, sclean in ((k, k0, ks, ks0), (v, v0, vs, vs0)):
                    x = torch.randn(n, hkv, d, device="cuda", generator=gen)[mine]
                    amax = x.abs().amax(-1)
                    dst.view(-1, hkv, d)[slots[mine]] = x
                    clean.view(-1, hkv, d)[slots[mine]] = x
                    sdst.view(-1, hkv)[slots[mine]] = amax / 448.0
                    sclean.view(-1, hkv)[slots[mine]] = amax / 448.0
        if dtype == torch.float8_e4m3fn:
            q8 = lambda x, sc: (x / sc[..., None]).to(torch.float8_e4m3fn)
            cache = PagedKVCache(q8(k, ks), q8(v, vs), ks, vs)
            ref_cache = PagedKVCache(q8(k0, ks0), q8(v0, vs0), ks0, vs0)
        else:
            cache = PagedKVCache(k.to(dtype), v.to(dtype))
            ref_cache = PagedKVCache(k0.to(dtype), v0.to(dtype))
        q = torch.randn(len(lens), hq, d, device="cuda", generator=gen).to(torch.bfloat16)
        seq = torch.tensor(lens, device="cuda")
        scale = 1 / math.sqrt(d)
        ref = paged_decode_attention(q, ref_cache, table, seq, layout=layout, scale=scale, backend="torch")
        even = "even_fp8" if dtype == torch.float8_e4m3fn else "even"
        forms = [("triton", {key: 0}), ("triton even", {key: 0, even: 1})]
        if dtype == torch.float8_e4m3fn:
            forms += [("gluon direct8", {key: 1, "direct_gluon_gqa_fp8": 8}),
                      ("gluon direct9", {key: 1, "direct_gluon_gqa_fp8": 9})]
        else:
            forms += [("gluon", {key: 1})]
        for name, change in forms:
            triton_decode.CONFIG.update(saved)
            triton_decode.CONFIG.update(change)
            call = lambda t: paged_decode_attention(q, cache, t, seq, layout=layout, scale=scale, backend="triton",
                                                    validate=False)
            rows.append(check_row(f"{dtype} dcp {size} rank {rank}", name, call, ref, table, nb + 3))
    triton_decode.CONFIG.update(saved)


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows: list = []
    saved = dict(triton_decode.CONFIG)
    for dtype in ((torch.float8_e4m3fn, ) if os.environ.get("DGQA_SET") == "fp8" else (torch.bfloat16,
                                                                                        torch.float8_e4m3fn)):
        try:
            _check(rows, dtype)
        except Exception as e:  # (a failing build or launch: said, the timings still run)
            rows.append({"check": str(dtype), "error": repr(e)[:2000]})
            print(rows[-1], flush=True)
    g, g8 = {"gluon_gqa": 1}, {"gluon_gqa_fp8": 1}
    bf16 = {"triton": {"gluon_gqa": 0}, "triton even": {"gluon_gqa": 0, "even": 1},
            "gluon s3": dict(g, stages_gluon_gqa=3)}
    fp8 = {"triton": {"gluon_gqa_fp8": 0}, "triton even": {"gluon_gqa_fp8": 0, "even_fp8": 1},
           "direct8": dict(g8, direct_gluon_gqa_fp8=8),
           "direct10": dict(g8, direct_gluon_gqa_fp8=10), "direct12": dict(g8, direct_gluon_gqa_fp8=12)}
    # the Triton kernel's whole tiles (even_fp8) with its tiles staged as 16-bit (stage16_fp8), more stages,
    # 64-key tiles over more programs (fewer registers: 4 CTAs per SM)
    e8 = {"gluon_gqa_fp8": 0, "even_fp8": 1}
    fp8_even = {"triton": e8, "even s16": dict(e8, stage16_fp8=1),
                "even s16 st3": dict(e8, stage16_fp8=1, num_stages_fp8=3),
                "even s16 n64 t528": dict(e8, stage16_fp8=1, block_n_fp8=64, target_programs_fp8=528),
                "even n64 t396": dict(e8, block_n_fp8=64, target_programs_fp8=396)}
    only = lambda d, *names: {n: d[n] for n in names}
    sets = ((torch.bfloat16, 8192, 32, bf16), (torch.bfloat16, 32768, 32, bf16),
            (torch.float8_e4m3fn, 8192, 32, only(fp8, "triton", "direct8", "direct10")),
            (torch.float8_e4m3fn, 32768, 32, only(fp8, "triton", "direct8", "direct10")),
            (torch.float8_e4m3fn, 131072, 32, only(fp8, "triton", "direct8", "direct10")),
            (torch.float8_e4m3fn, 32768, 4, only(fp8, "triton", "direct8")))
    if os.environ.get("DGQA_SET") == "fp8":          # (the fp8 rows only)
        sets = tuple(x for x in sets if x[0] == torch.float8_e4m3fn)
    tq = 1
    if os.environ.get("DGQA_SET") == "mtp":          # (a speculative step's 2 and 4 tokens, fp8, at 32K)
        sets = ((torch.float8_e4m3fn, 32768, 32, only(fp8, "triton", "direct10")), )
        tq = int(os.environ.get("DGQA_TQ", "2"))
    if os.environ.get("DGQA_SET") == "fp8-even":     # (the 2026-12-04 13:35 run: decode-gluon-gqa13-h200.json)
        sets = ((torch.float8_e4m3fn, 8192, 32, fp8_even), (torch.float8_e4m3fn, 32768, 32, fp8_even),
                (torch.float8_e4m3fn, 131072, 32, fp8_even))
    for dtype, context, batch, variants in sets:
        cache, table, q, _ = _decode_setup(batch, context, 32, 4, 128, 64, 4, ctx.device, dtype)
        if tq > 1:
            q = torch.randn(batch, tq, 32, 128, device=ctx.device, dtype=torch.bfloat16)
        layout = DCPLayout(size=4, rank=0, block_size=64)
        seq = torch.full((batch,), context, device=ctx.device)
        call = lambda: paged_decode_attention(q, cache, table, seq, layout=layout, scale=128 ** -0.5,
                                              backend="triton", max_seq_len=context)
        triton_decode.CONFIG.update(saved)
        triton_decode.CONFIG.update(variants["triton"])
        ref = call()
        for rep in range(2):
            for name, change in variants.items():
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(change)
                try:
                    got = call()
                    err = max((got.out - ref.out).abs().max().item(), (got.lse - ref.lse).abs().max().item())
                    us, cols = step_time(ctx, [call])
                    row = {"cache": str(dtype), "L": context, "B": batch, "tq": tq, "kernel": name, "rep": rep,
                           "us": round(us, 1), "max_diff_vs_triton": err, "timing": cols["timing"]}
                except Exception as e:
                    row = {"cache": str(dtype), "L": context, "B": batch, "kernel": name, "error": repr(e)[:1000]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        del cache, table
        torch.cuda.empty_cache()
    dump_rows(path, "decode_gluon_gqa.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-gluon-gqa.json")
