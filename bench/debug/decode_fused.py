"""The split merge inside the decode kernel (CONFIG fused_merge) against the merge kernel after it:
rank 0 of a DCP group's paged cache (B = 32, page 64), GQA (Hq = 32, Hkv = 4, D = 128) at 1/4 of
L = 8K and 32K and 1/8 of 32K, and MLA with 16 heads (TP 8: the narrow head tile, also merged in
the kernel) at 1/4 of 8K and 32K, bf16 and fp8 caches, each call timed with `common.step_time`
(ten calls a CUDA graph; settings alternating, two rounds), with its max abs difference from the
merge kernel's out / lse and whether the split counters are all zero after the graph replays.

    python bench/debug/decode_fused.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _decode_setup, _mla_decode_setup
from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.paged import paged_decode_attention

SETTINGS = {  # name -> CONFIG overrides
    "merge kernel": {"fused_merge": 0},
    "fused": {"fused_merge": 1},
    "fused, bf16 GQA at 96 registers": {"fused_merge": 1, "maxnreg": 96},
}


def _problems(device):
    batch, block = 32, 64
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for size, context in ((4, 8192), (4, 32768), (8, 32768)):
            cache, table, q, _ = _decode_setup(batch, context, 32, 4, 128, block, size, device, dtype)
            layout = DCPLayout(size=size, rank=0, block_size=block)
            seq = torch.full((batch,), context, device=device)
            yield (f"GQA {dtype} 1/{size} of {context}", lambda c=cache, t=table, q=q, s=seq, lay=layout, L=context:
                   paged_decode_attention(q, c, t, s, layout=lay, scale=128 ** -0.5, backend="triton", max_seq_len=L))
        from megapar.parallel.cp.mla import MLADims
        dims = MLADims()
        for context in (8192, 32768):
            latent, table = _mla_decode_setup(batch, context, dims, block, 4, device, dtype)
            layout = DCPLayout(size=4, rank=0, block_size=block)
            seq = torch.full((batch,), context, device=device)
            q = torch.randn(batch, 16, dims.latent_dim, device=device, dtype=torch.bfloat16)
            yield (f"MLA16 {dtype} 1/4 of {context}", lambda c=latent.paged, t=table, q=q, s=seq, lay=layout, L=context:
                   paged_decode_attention(q, c, t, s, layout=lay, scale=dims.scale, backend="triton", max_seq_len=L))


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    saved = dict(triton_decode.CONFIG)
    rows = []
    for name, call in _problems(ctx.device):
        triton_decode.CONFIG.update(saved)
        ref = call()
        for rep in range(2):
            for setting, over in SETTINGS.items():
                if "bf16 GQA" in setting and not ("GQA" in name and "bfloat16" in name):
                    continue
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(over)
                got = call()
                err = max((got.out - ref.out).abs().max().item(), (got.lse - ref.lse).abs().max().item())
                us, cols = step_time(ctx, [call])
                torch.cuda.synchronize()
                zero = all(int(b.abs().sum()) == 0 for b in triton_decode._COUNTERS.values())
                row = {"problem": name, "setting": setting, "rep": rep, "us": round(us, 1),
                       "max_diff_vs_merge_kernel": err, "counters_zero": zero, "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        triton_decode.CONFIG.update(saved)
        torch.cuda.empty_cache()
    dump_rows(path, "decode_fused.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-fused.json")
