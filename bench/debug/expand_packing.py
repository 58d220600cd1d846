"""FP4 -> FP8 / bf16 expansion (the W4A8 prefill path's per-call step) from the same MXFP4 weight
in packing "oct" and "octb", side by side, CUDA-graph replays (GPU):

    python bench/debug/expand_packing.py [OUT.json]

The MoE layer prepares MXFP4 in octb for its bf16 decode kernel (moe.kernels.packing_for); this
says what that costs its prefill, which expands the weight on every call unless resident_fp8.
Each (shape, fold) is timed oct, octb, oct, octb; the median of each pair is reported.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch


def _time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    from megapar.launch.bench.gemm import random_mxfp4
    from megapar.moe.kernels import prepare_weights
    from megapar.moe.kernels.triton_expand import expand_fp4

    dev = torch.device("cuda")
    rows = []
    for label, (E, N, K) in {"V3 L1": (32, 4096, 7168), "V3 L2": (32, 7168, 2048)}.items():
        q = random_mxfp4(E, N, K, dev, 1)
        packs = {p: prepare_weights(q, packing=p) for p in ("oct", "octb")}
        for fold in ("row", None):
            ref = expand_fp4(packs["oct"], fold=fold)
            got = expand_fp4(packs["octb"], fold=fold)
            same = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                                   if b.dtype.itemsize == 1 else b)
                       for a, b in zip(ref if isinstance(ref, tuple) else (ref,), got if isinstance(got, tuple) else (got,)))
            us = {p: [] for p in packs}
            for _ in range(2):
                for p, w in packs.items():
                    us[p].append(_time(lambda w=w: expand_fp4(w, fold=fold)))
            out_bytes = E * N * K * (1 if fold else 2)
            row = {"shape": label, "fold": fold or "bf16", "same_bits": same,
                   **{f"{p}_us": round(statistics.median(v), 1) for p, v in us.items()},
                   "octb_over_oct": round(statistics.median(us["octb"]) / statistics.median(us["oct"]), 3),
                   "bytes": E * N * K // 2 + out_bytes}
            rows.append(row)
            print(row, flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows,
                       "command": "python bench/debug/expand_packing.py OUT.json"}, f, indent=1)


if __name__ == "__main__":
    main()
