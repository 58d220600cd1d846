"""Where a decode call's time goes, and what the timing methods of `megapar bench cp` see (GPU):

    python bench/debug/decode_timing.py [OUT.json]      # DECODE_TIMING_FP8=1: an fp8 cache;
                                                        # DECODE_TIMING_MLA=H: MLA with H query heads;
                                                        # DECODE_TIMING_CONFIG=JSON: decode CONFIG entries

GQA bf16 (or fp8: the Triton split kernel and its merge; B 32, Hq 32, Hkv 4, D 128, rank 0's 1/4 of the paged KV, L = 8K and 32K) and the same
launch over one page per rank, against SDPA over a contiguous copy (and over one page), each:
- kernels: the GPU kernels of one eager call and their durations (torch profiler, CUPTI: GPU
  time only, no launch);
- single: one call per CUDA-graph replay (the host's launch of the replay included);
- x10: ten calls in one graph, per call (what `common.step_time` reports);
- x10 dep: ten calls in one graph with a one-element kernel after each that reads the call's
  output (no two calls can overlap, whatever the launch attributes), per call, minus that
  kernel's own per-call time in a graph of ten alone.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch


def _events(fn) -> float:
    from megapar.launch.bench.common import BenchContext

    return BenchContext(suite="cp", device=torch.device("cuda")).time_fn(fn, iters=30)


def _graph(fn) -> torch.cuda.CUDAGraph:
    from megapar.launch.bench.common import capture_graph

    return capture_graph(fn)[0]


def _kernels(fn, reps: int = 10) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:90]] += e.device_time / reps
    return {k: round(v, 2) for k, v in total.items()}


def _methods(fn, sink) -> dict[str, float]:
    single = _graph(fn)
    out = {"single": _events(single.replay)}

    def ten():
        for _ in range(10):
            fn()
    g10 = _graph(ten)
    out["x10"] = _events(g10.replay) / 10
    flag = torch.zeros(1, device="cuda")

    def ten_dep():
        for _ in range(10):
            r = fn()
            flag.add_(sink(r))
    gdep = _graph(ten_dep)

    def ten_sink_only():
        for _ in range(10):
            flag.add_(1.0)
    gsink = _graph(ten_sink_only)
    out["x10 dep"] = (_events(gdep.replay) - _events(gsink.replay)) / 10
    out["sink alone"] = _events(gsink.replay) / 10
    return {k: round(v, 2) for k, v in out.items()}


def triton_decode_config() -> dict:
    from megapar.parallel.cp import triton_decode

    return triton_decode.CONFIG


def _mla(heads: int, dtype: torch.dtype) -> list:
    """The MLA rows: the paged latent decode over rank 0's 1/4 (and over one page per rank)."""
    from megapar.launch.bench.cp import _mla_decode_setup
    from megapar.parallel.cp import DCPLayout
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import paged_decode_attention

    dims, batch, block, n, rows = MLADims(), 32, 64, 4, []
    with torch.no_grad():
        for context in (8192, 32768):
            latent, table = _mla_decode_setup(batch, context, dims, block, n, torch.device("cuda"), dtype)
            layout = DCPLayout(size=n, rank=0, block_size=block)
            seq = torch.full((batch,), context, device="cuda")
            short = torch.full_like(seq, n * block)
            q = torch.randn(batch, 1, heads, dims.latent_dim, device="cuda", dtype=torch.bfloat16)
            for name, lens in (("mla", seq), ("mla one page", short)):
                fn = lambda lens=lens: paged_decode_attention(q, latent.paged, table, lens, layout=layout,
                                                              scale=dims.scale, backend="triton", max_seq_len=context)
                row = {"L": context, "cache": str(dtype), "heads": heads, "case": name, "kernels": _kernels(fn),
                       **_methods(fn, lambda r: r.out.view(-1)[0])}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del latent, table
    return rows


def main() -> None:
    from megapar.launch.bench.cp import _decode_setup, _sdpa_contiguous
    from megapar.parallel.cp import DCPLayout
    from megapar.parallel.cp.paged import paged_decode_attention

    import os

    batch, heads, kv_heads, d, block, n = 32, 32, 4, 128, 64, 4
    dtype = torch.float8_e4m3fn if os.environ.get("DECODE_TIMING_FP8") else torch.bfloat16
    rows = []
    # e.g. DECODE_TIMING_CONFIG='{"gluon_gqa_fp8": 0}': decode CONFIG entries for every call
    triton_decode_config().update(json.loads(os.environ.get("DECODE_TIMING_CONFIG", "{}")))
    if os.environ.get("DECODE_TIMING_MLA"):
        rows = _mla(int(os.environ["DECODE_TIMING_MLA"]), dtype)
    with torch.no_grad():
        for context in (() if rows else (8192, 32768)):
            cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, block, n, torch.device("cuda"),
                                               dtype)
            layout = DCPLayout(size=n, rank=0, block_size=block)
            seq = torch.full((batch,), context, device="cuda")
            short = torch.full_like(seq, n * block)
            local = context // n
            kc = torch.randn(batch, kv_heads, local, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            k1, v1 = kc[:, :, :block].contiguous(), vc[:, :, :block].contiguous()
            cases = {
                "ours": lambda: paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton",
                                                       max_seq_len=context),
                "ours one page": lambda: paged_decode_attention(q, cache, table, short, layout=layout,
                                                                backend="triton", max_seq_len=context),
                "sdpa": lambda: _sdpa_contiguous(q.unsqueeze(2), kc, vc),
                "sdpa one page": lambda: _sdpa_contiguous(q.unsqueeze(2), k1, v1),
            }
            sinks = {"ours": lambda r: r.out.view(-1)[0], "sdpa": lambda r: r.view(-1)[0].float()}
            for name, fn in cases.items():
                row = {"L": context, "cache": str(dtype), "case": name, "kernels": _kernels(fn),
                       **_methods(fn, sinks[name.split()[0]])}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del cache, table, kc, vc
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
