"""Does the paged cache's physical layout bound GQA decode? The same decode call (B = 32, Hq = 32,
Hkv = 4, D = 128, rank 0's 1/4 of L = 8K / 32K, page 64) over the cache as PagedKVCache allocates
it, token-major within a page ([blocks, page, kv heads, D]: one head's key of a token is D
contiguous elements, the next token's D * Hkv further on), and over a head-major copy of it
([blocks, kv heads, page, D] in memory, handed to the kernel as the same 4-d view with other
strides: a head's page is one contiguous run). Outputs must agree bit for bit (same kernel, same
order of operations); times are `common.step_time` (ten calls per CUDA graph over copies).

    python bench/debug/decode_layout.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps, input_copies, step_time
from megapar.launch.bench.cp import _decode_setup, _floor, kv_read_bytes_of
from megapar.parallel.cp import triton_decode as td
from megapar.parallel.cp.dcp import DCPLayout, PagedKVCache
from megapar.parallel.cp.paged import paged_decode_attention


def head_major(cache: PagedKVCache) -> PagedKVCache:
    """The same cache, each (block, kv head)'s page stored contiguously; the 4-d view keeps its shape."""
    def move(t):
        return None if t is None else t.movedim(2, 1).contiguous().movedim(1, 2)
    return PagedKVCache(move(cache.k), move(cache.v), move(cache.k_scale), move(cache.v_scale))


def main(path: str) -> None:
    ctx = BenchContext("decode-layout", torch.device("cuda"))
    batch, heads, kv_heads, d, page, n = 32, 32, 4, 128, 64, 4
    layout = DCPLayout(size=n, rank=0, block_size=page)
    ceiling = copy_ceiling_gbps(ctx.device)
    default = dict(td.CONFIG)
    variants = {"installed": {}, "fp8 64 keys / 2 warps / 528": {"gqa_fp8": {"block_n": 64, "num_warps": 2,
                                                                             "target_programs": 528}},
                "fp8 64 keys": {"gqa_fp8": {"block_n": 64}}, "bf16 128 keys": {"gqa": {"block_n": 128}}}
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for context in (8192, 32768):
            local = int(layout.local_lengths(context))
            seq = torch.full((batch,), context, device=ctx.device)

            def make(dtype=dtype, context=context):
                return _decode_setup(batch, context, heads, kv_heads, d, page, n, ctx.device, dtype)[:3]

            sets = input_copies(ctx, make, lambda c: kv_read_bytes_of(c[0], batch * local, kv_heads, d, d, False))
            nbytes = kv_read_bytes_of(sets[0][0], batch * local, kv_heads, d, d, False)
            for name, tuning in variants.items():
                if ("fp8" in name and dtype != torch.float8_e4m3fn) or ("bf16" in name and dtype != torch.bfloat16):
                    continue
                td.CONFIG.clear()
                td.CONFIG.update(default)
                td.apply_tuning(tuning)
                outs = {}
                for lay, conv in (("token-major", lambda c: c), ("head-major", head_major)):
                    caches = [(conv(c), t, q) for c, t, q in sets]
                    calls = [lambda c=c, t=t, q=q: paged_decode_attention(
                        q, c, t, seq, layout=layout, scale=d ** -0.5, backend="triton", max_seq_len=context)
                        for c, t, q in caches]
                    outs[lay] = calls[0]()
                    us, cols = step_time(ctx, calls)
                    row = {"dtype": str(dtype).replace("torch.", ""), "L": context, "local": local, "layout": lay,
                           "settings": name, "us": round(us, 2), "floor_frac": round(_floor(nbytes, ceiling) / us, 3),
                           "timing": cols["timing"], "input_sets": cols["input_sets"]}
                    rows.append(row)
                    print(row, flush=True)
                    del caches, calls
                a, b = outs["token-major"], outs["head-major"]
                same = torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
                rows[-1]["equal_to_token_major"] = same
                print(f"  {name}: head-major output equal to token-major: {same}", flush=True)
            del sets
            torch.cuda.empty_cache()
    td.CONFIG.clear()
    td.CONFIG.update(default)
    dump_rows(path, "decode_layout.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-layout.json")
