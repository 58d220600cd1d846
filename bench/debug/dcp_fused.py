"""A DCP rank's decode work around the combine, two ways, each timed as `megapar bench cp` times a
call (`common.step_time`: ten calls a CUDA graph over copies of the KV), B = 32, L = 32K, rank 0:
- ag_rs, N = 4 and 8: the kernel, its split merge and the rescale (`rescale_to_merged`: what
  `dcp_decode_attention` ran before) against the kernel's splits unmerged and merged with the
  rescale in one kernel (`rescale_parts_to_merged`: what it runs now); the other ranks' lses made up;
- one rank (N = 1): the call's fp32 out cast to bf16 after it, against the merge (or one split's
  kernel) writing bf16 (`out_dtype`).
The short form of bench cp's dcp columns ag_rs_step_us / ag_rs_fused_us and cast_out_us /
q_dtype_out_us, for a device call with little time (MLA 128 and 16 heads, GQA Hq 32 Hkv 4).

    python bench/debug/dcp_fused.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.common import BenchContext, input_copies, step_time
from megapar.launch.bench.cp import _decode_setup, _mla_decode_setup
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.merge import rescale_parts_to_merged, rescale_to_merged
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention


def main(path: str) -> None:
    cuda = torch.cuda.is_available()       # (off a GPU: tiny sizes through the torch path, a smoke run)
    ctx = BenchContext("cp", torch.device("cuda" if cuda else "cpu"))
    batch, block, context = (32, 64, 32768) if cuda else (2, 16, 256)
    dims = MLADims()
    rows: list = []
    for family, heads in (("mla", 128), ("mla", 16), ("gqa", 32)):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for n in (1, 4, 8):
                def setup(n=n):
                    if family == "gqa":
                        cache, table, q, _ = _decode_setup(batch, context, heads, 4, 128, block, n, ctx.device,
                                                           cache_dtype)
                        return cache, table, q
                    latent, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                    q = torch.randn(batch, heads, dims.latent_dim, device=ctx.device, dtype=torch.bfloat16)
                    return latent.paged, table, q
                scale = 128 ** -0.5 if family == "gqa" else dims.scale
                layout = DCPLayout(size=n, rank=0, block_size=block)
                copies = input_copies(ctx, setup, lambda c: c[0].k.numel() * c[0].k.element_size())
                call = lambda c, t, q, **kw: paged_decode_attention(q, c, t, torch.full((batch,), context,
                                                                                        device=ctx.device),
                                                                    layout=layout, scale=scale,
                                                                    max_seq_len=context, **kw)
                tag = {"family": family, "heads": heads, "cache": str(cache_dtype).replace("torch.", ""), "n": n}
                if n == 1:
                    forms = {"cast_out_us": lambda c, t, q: call(c, t, q).out.to(torch.bfloat16),
                             "q_dtype_out_us": lambda c, t, q: call(c, t, q, out_dtype=torch.bfloat16)}
                else:
                    parts = call(*copies[0], merge=False)
                    p = parts.lse.shape[0]
                    lses = torch.randn(n, *parts.lse.shape[1:], device=ctx.device)
                    split_lses = torch.randn(n, *parts.lse.shape, device=ctx.device)
                    tag["splits"] = p
                    forms = {"ag_rs_step_us": lambda c, t, q: rescale_to_merged(call(c, t, q).out, lses, 0),
                             "ag_rs_fused_us": lambda c, t, q: rescale_parts_to_merged(
                                 call(c, t, q, merge=False).out, split_lses, 0)}
                row = dict(tag)
                for name, fn in forms.items():
                    row[name] = round(step_time(ctx, [lambda c=c, fn=fn: fn(*c) for c in copies])[0], 2)
                rows.append(row)
                print(row, flush=True)
                del copies
    dump_rows(path, "dcp_fused.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dcp-fused.json")
