"""One GQA decode call over bf16 and one over fp8 (B = 32, Hq = 32, Hkv = 4, D = 128, rank 0's 1/4
of L = 32K, page 64, CONFIG as installed), then MLA with 128 heads over bf16 (1/4 of 8K), inside
cudaProfilerStart / Stop, for Nsight Compute:

    ncu --profile-from-start off --kernel-name regex:_paged_decode --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python bench/debug/decode_ncu.py

(bash bench/run_owed.sh ncu runs it with the sections that say where the warps stall.)

    python bench/debug/decode_ncu.py gluon-gqa

profiles the Gluon GQA kernel (`parallel.cp.gluon_gqa`) over bf16 and over fp8 (CONFIG
gluon_gqa_fp8 forced on) instead, same problem (`bash bench/run_owed.sh ncugqa`). DECODE_NCU_CONFIG
(JSON) sets CONFIG entries first; DECODE_NCU_MLA_FP8=1 gives the MLA call an fp8 cache,
DECODE_NCU_MLA_HEADS its head count (128; 16: the narrow kernel, `parallel.cp.gluon_mla_narrow`),
DECODE_NCU_MLA_CONTEXT its L (8192; DECODE_NCU_MLA_LEN: the sequences' lengths, L unless given, e.g. 0 or
one page per rank for the fixed part of a call), DECODE_NCU_POOL_MB a pool its block ids are taken
modulo (that many MB of pages: after the first touches every tile an L2 hit, the kernel's own pace
without DRAM's, as bench/debug/decode_l2pace.py times it).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from _rows import kv_bytes_per_page

from megapar.launch.bench.cp import _decode_setup, _mla_decode_setup, pooled_table
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention


def main(gluon_gqa: bool) -> None:
    dev = torch.device("cuda")
    if gluon_gqa:
        triton_decode.CONFIG.update(gluon_gqa=1, gluon_gqa_fp8=1)
    # e.g. DECODE_NCU_CONFIG='{"ids_ahead": 1}': CONFIG entries for the profiled calls
    triton_decode.CONFIG.update(json.loads(os.environ.get("DECODE_NCU_CONFIG", "{}")))
    batch, heads, kv_heads, d, page, n, context = 32, 32, 4, 128, 64, 4, 32768
    layout = DCPLayout(size=n, rank=0, block_size=page)
    seq = torch.full((batch,), context, device=dev)
    calls = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, page, n, dev, dtype)
        calls.append(lambda cache=cache, table=table, q=q: paged_decode_attention(
            q, cache, table, seq, layout=layout, scale=d ** -0.5, backend="triton", max_seq_len=context))
    if not gluon_gqa:
        dims, mla_context = MLADims(), int(os.environ.get("DECODE_NCU_MLA_CONTEXT", "8192"))
        mla_dtype = torch.float8_e4m3fn if os.environ.get("DECODE_NCU_MLA_FP8") else torch.bfloat16
        latent, table = _mla_decode_setup(batch, mla_context, dims, page, n, dev, mla_dtype)
        pool_mb = float(os.environ.get("DECODE_NCU_POOL_MB", "0"))
        if pool_mb > 0:
            table = pooled_table(table, kv_bytes_per_page(latent.paged), pool_mb * 2 ** 20)
        mla_heads = int(os.environ.get("DECODE_NCU_MLA_HEADS", "128"))
        q_mla = torch.randn(batch, mla_heads, dims.latent_dim, device=dev, dtype=torch.bfloat16)
        seq_mla = torch.full((batch,), int(os.environ.get("DECODE_NCU_MLA_LEN", mla_context)), device=dev)
        calls.append(lambda: paged_decode_attention(q_mla, latent.paged, table, seq_mla, layout=layout,
                                                    scale=dims.scale, backend="triton", max_seq_len=mla_context))
    for call in calls:   # compile and warm up outside the profiled range
        call()
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled: GQA decode over bf16, over fp8" + (" (Gluon kernel)" if gluon_gqa
                                                          else ", MLA over " + str(mla_dtype)))


if __name__ == "__main__":
    main(sys.argv[1:] == ["gluon-gqa"])
