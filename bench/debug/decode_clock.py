"""Why GQA over fp8 took 385.6 µs in `megapar bench cp`'s dcp section and 428.0 in its decode
section over the same 32768 local tokens per sequence (docs/gpu.md §15): the two setups (dcp:
group of 1, L = 32K, seed 1; decode: rank 0 of 4, L = 128K, seed 4) and the dcp setup's data
read as rank 0 of 4 at L = 128K (the same slots) timed alternately with `common.step_time`, the
bf16 cache as control, with the SM clock (NVML, MHz) read after each; the decode setup again with
CONFIG dcp_constexpr (the group size built into the kernel).

    python bench/debug/decode_clock.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _decode_setup
from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.paged import paged_decode_attention


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, heads, kv_heads, d, block = 32, 32, 4, 128, 64
    rows = []
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        setups = {}
        for name, size, context in (("dcp full", 1, 32768), ("decode 1/4", 4, 131072)):
            cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, block, size, ctx.device, dtype)
            layout = DCPLayout(size=size, rank=0, block_size=block)
            seq = torch.full((batch,), context, device=ctx.device)
            setups[name] = lambda c=cache, t=table, q=q, s=seq, lay=layout, L=context: paged_decode_attention(
                q, c, t, s, layout=lay, scale=d ** -0.5, backend="triton", max_seq_len=L)
            if size == 1:   # the same cache, table and query read as rank 0 of 4 at L = 128K: the same
                lay4 = DCPLayout(size=4, rank=0, block_size=block)        # 32768 slots of each row
                seq4 = torch.full((batch,), 4 * context, device=ctx.device)
                setups["dcp data as 1/4"] = lambda c=cache, t=table, q=q: paged_decode_attention(
                    q, c, t, seq4, layout=lay4, scale=d ** -0.5, backend="triton", max_seq_len=4 * context)
        setups["decode 1/4, dcp_constexpr"] = setups["decode 1/4"]
        for rep in range(2):
            for name, call in setups.items():
                triton_decode.CONFIG["dcp_constexpr"] = int(name.endswith("dcp_constexpr"))
                us, cols = step_time(ctx, [call])
                row = {"cache": str(dtype), "setup": name, "rep": rep, "us": round(us, 1),
                       "sm_clock_mhz": torch.cuda.clock_rate(), "timing": cols["timing"]}
                rows.append(row)
                print(row, flush=True)
        del setups
        torch.cuda.empty_cache()
    triton_decode.CONFIG["dcp_constexpr"] = 0
    dump_rows(path, "decode_clock.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-clock.json")
