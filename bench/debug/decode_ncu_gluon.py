"""The Gluon GQA decode kernel (`parallel.cp.gluon_gqa`) over bf16 and over fp8 (CONFIG
gluon_gqa_fp8 forced on; B = 32, Hq = 32, Hkv = 4, D = 128, rank 0's 1/4 of L = 32K, page 64),
inside cudaProfilerStart / Stop, for Nsight Compute (`bash bench/run_owed.sh ncugqa`: sections
and shared-memory bank-conflict metrics of the `_gqa_decode_ws` kernels)."""

from __future__ import annotations

import torch

from megapar.launch.bench.cp import _decode_setup
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.paged import paged_decode_attention


def main() -> None:
    dev = torch.device("cuda")
    batch, heads, kv_heads, d, page, n, context = 32, 32, 4, 128, 64, 4, 32768
    layout = DCPLayout(size=n, rank=0, block_size=page)
    seq = torch.full((batch,), context, device=dev)
    triton_decode.CONFIG.update(gluon_gqa=1, gluon_gqa_fp8=1)
    calls = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, page, n, dev, dtype)
        calls.append(lambda cache=cache, table=table, q=q: paged_decode_attention(
            q, cache, table, seq, layout=layout, scale=d ** -0.5, backend="triton", max_seq_len=context))
    for call in calls:   # compile and warm up outside the profiled range
        call()
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled: Gluon GQA decode over bf16, over fp8")


if __name__ == "__main__":
    main()
