"""Where the time of a planned MLA decode over a batch of very different lengths goes: per-kernel
device times (torch.profiler, eager calls) of the decode kernel, the segment merge and the planner,
for MLA 128 heads over the mixed rows' batches (`launch.bench.cp.mixed_batches`, 1/4 of the KV),
under the installed length plan and with one setting changed (items target, order, chunk rule),
and over the batch's long rows and short rows alone; then (MIXED_PROBE_MERGE=1, bf16 only) the
segment merge alone (launched without programmatic dependent launch, so that its time holds no wait
for the kernel before) under segment_unroll x min_programs settings (`triton_merge.CONFIG`), for
MLA 128 heads and GQA (Hq 32, Hkv 4, D 128).

    python bench/debug/mixed_probe.py OUT.json        # on the GPU (MIXED_PROBE_DTYPE=fp8: fp8 cache)
"""

from __future__ import annotations

import os
import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.cp import _decode_setup, _mla_decode_setup, mixed_batches
from megapar.parallel.cp import triton_decode, triton_merge
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention, plan_paged_decode

CHANGES = {"installed": {}, "target 66": {"target_programs_wide": 66, "target_programs_wide_fp8": 66},
           "target 198": {"target_programs_wide": 198, "target_programs_wide_fp8": 198},
           "target 264": {"target_programs_wide": 264, "target_programs_wide_fp8": 264},
           "row order": {"plan_order": 0}, "fit": {"plan_fit_wide": 1}}


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """µs per call of each CUDA kernel `fn` launches (mean over `reps` eager calls)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:60]
            out[name] = out.get(name, 0.0) + e.device_time / reps
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main(path: str) -> None:
    device = torch.device("cuda")
    dtype = torch.float8_e4m3fn if os.environ.get("MIXED_PROBE_DTYPE") == "fp8" else torch.bfloat16
    batch, context, block, n, heads = 32, 131072, 64, 4, 128
    dims = MLADims()
    layout = DCPLayout(size=n, rank=0, block_size=block)
    latent, table = _mla_decode_setup(batch, context, dims, block, n, device, dtype)
    cache = latent.paged
    q = torch.randn(batch, heads, dims.latent_dim, device=device, dtype=torch.bfloat16)
    saved = dict(triton_decode.CONFIG)
    rows: list = []
    for name, lens in mixed_batches(batch, context).items():
        seq = torch.tensor(lens, device=device)
        order = sorted(range(batch), key=lambda r: -lens[r])
        subsets = {"all": list(range(batch)), "long rows": order[:2], "short rows": order[2:]}
        for change_name, change in CHANGES.items():
            for subset, idx in subsets.items():
                if change_name != "installed" and subset != "all":
                    continue
                triton_decode.CONFIG.update(saved)
                triton_decode.CONFIG.update(change)
                ix = torch.tensor(idx, device=device)
                qs, ts, ss = q[ix].contiguous(), table[ix].contiguous(), seq[ix].contiguous()
                plan = plan_paged_decode(qs, cache, ts, ss, layout=layout)
                call = lambda: paged_decode_attention(qs, cache, ts, ss, layout=layout, scale=dims.scale,
                                                      max_seq_len=context, plan=plan)
                times = kernel_times(call)
                rows.append({"batch": name, "change": change_name, "rows": subset, "dtype": str(dtype),
                             "chunk": int(plan.items_table[0]), "items_used": int(plan.segments[-1]),
                             "slots": plan.items, "kernels_us": times, "sum_us": round(sum(times.values()), 2)})
                print(rows[-1], flush=True)
    triton_decode.CONFIG.update(saved)
    if os.environ.get("MIXED_PROBE_MERGE") and dtype == torch.bfloat16:
        gqa_cache, gqa_table, gqa_q, _ = _decode_setup(batch, context, 32, 4, 128, block, n, device, dtype)
        families = {"mla128": (cache, table, q, dims.scale), "gqa": (gqa_cache, gqa_table, gqa_q, 128 ** -0.5)}
        merge_saved = dict(triton_merge.CONFIG)
        triton_decode.CONFIG["pdl"] = 0
        for family, (c, t, qf, scale) in families.items():
            for name, lens in mixed_batches(batch, context).items():
                seq = torch.tensor(lens, device=device)
                plan = plan_paged_decode(qf, c, t, seq, layout=layout)
                for unroll in (1, 4, 8):
                    for least in (528, 2048, 8192):
                        triton_merge.CONFIG.update(merge_saved)
                        triton_merge.CONFIG.update(segment_unroll=unroll, min_programs=least)
                        call = lambda: paged_decode_attention(qf, c, t, seq, layout=layout, scale=scale,
                                                              max_seq_len=context, plan=plan)
                        times = kernel_times(call)
                        merge = sum(v for k, v in times.items() if "merge" in k)
                        rows.append({"merge_sweep": family, "batch": name, "segment_unroll": unroll,
                                     "min_programs": least, "merge_us": round(merge, 2), "kernels_us": times})
                        print(rows[-1], flush=True)
        triton_merge.CONFIG.update(merge_saved)
        triton_decode.CONFIG.update(saved)
    dump_rows(path, "mixed_probe.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mixed-probe.json")
