"""Where an eager decode call's host time goes: `paged_decode_attention` launched from Python, B = 32,
rank 0 of 4, L = 8K (bench cp's decode rows), for GQA (Hq 32, Hkv 4, D 128) and MLA 16 / 128 heads,
bf16 and fp8, with and without a length plan. Per case: host_us (the Python time of a call, calls
issued back to back without a sync: the GPU runs behind; the least of five runs), host_unkept_us (the
same with `impl.Memo` keeping nothing: the kernel choice and the backend worked out every call, as
before 2026-12-06), gpu_us (the same call ten a CUDA graph,
`step_time`), and the cProfile of EAGER_HOST_PROFILE calls (the functions with the most own time and
the most time under them). EAGER_HOST_CASES picks some of gqa,mla16,mla128.

    python bench/debug/eager_host.py OUT.json        # on the GPU
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch
from _rows import dump_rows, family_case

from megapar.launch.bench.common import BenchContext, step_time
from megapar.parallel import impl
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.paged import paged_decode_attention, plan_paged_decode

def _top(prof: cProfile.Profile, calls: int, key: str, n: int = 18) -> list[dict]:
    st = pstats.Stats(prof)
    st.sort_stats(key)
    out = []
    for func in st.fcn_list[:n]:
        cc, nc, tt, ct, _ = st.stats[func]
        out.append({"fn": f"{os.path.basename(func[0])}:{func[1]}:{func[2]}", "calls_per_call": round(nc / calls, 2),
                    "tottime_us": round(tt / calls * 1e6, 2), "cumtime_us": round(ct / calls * 1e6, 2)})
    return out


def _host_us(fn, calls: int, repeats: int = 5) -> float:
    """The Python time of one call: the least over `repeats` runs of `calls` calls issued back to back
    (the GPU behind them), each run after a sync."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, block, n, context = 32, 64, 4, 8192
    calls = int(os.environ.get("EAGER_HOST_PROFILE", "200"))
    rows: list = []
    for family in os.environ.get("EAGER_HOST_CASES", "gqa,mla16,mla128").split(","):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            cache, table, q, scale = family_case(family, cache_dtype, batch, context, block, n, ctx.device)
            layout = DCPLayout(size=n, rank=0, block_size=block)
            lens = torch.full((batch,), context, device=ctx.device)
            for planned in (False, True):
                plan = plan_paged_decode(q, cache, table, lens, layout=layout) if planned else None
                fn = lambda: paged_decode_attention(q, cache, table, lens, layout=layout, scale=scale,  # noqa: E731
                                                    backend="triton", max_seq_len=context, plan=plan,
                                                    out_dtype=torch.bfloat16)
                host = _host_us(fn, calls)
                kept = impl.Memo.get
                impl.Memo.get = lambda self, key, make: make()      # (the host work of every call, as before)
                try:
                    unkept = _host_us(fn, calls)
                finally:
                    impl.Memo.get = kept
                gpu, _ = step_time(ctx, [fn])
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                row = {"family": family, "cache": str(cache_dtype).replace("torch.", ""), "plan": planned,
                       "host_us": round(host, 1), "host_unkept_us": round(unkept, 1), "gpu_us": round(gpu, 1),
                       "own": _top(prof, calls, "tottime"), "under": _top(prof, calls, "cumulative")}
                rows.append(row)
                print({k: row[k] for k in ("family", "cache", "plan", "host_us", "host_unkept_us", "gpu_us")}, flush=True)
                for r in row["own"][:10]:
                    print("   ", r, flush=True)
    dump_rows(path, "eager_host.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "eager-host.json")
