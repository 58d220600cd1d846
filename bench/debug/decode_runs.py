"""MLA 128 heads over a bf16 latent cache under a token-run plan (`gluon_mla_runs`, CONFIG runs_wide:
each program an equal run of key tiles across sequence boundaries, one wave) against the installed
length plan (one (sequence, chunk) item a program) and the capacity's split plan (max_seq_len the
batch's longest length, as bench cp's mixed rows give it; the run of 2026-12-06 23:40 gave it 128K
for every batch, so its uniform 8K / 32K capacity_us timed a grid sized for 128K), B = 32, rank 0 of
4: uniform batches at L = 8K / 32K / 128K and the mixed rows' two batches
(`launch.bench.cp.mixed_batches`). Each call timed as `megapar bench cp` times one (`common.step_time`:
ten calls a CUDA graph over rotated copies of the cache), the plans made outside the graph, the
token-run plan at each overhead of DECODE_RUNS_OVERHEADS (default 0,2,5,8 tiles a sequence: CONFIG
runs_overhead_wide, runs_choose_wide 0) and with the charge the plan chooses (column chosen_us: CONFIG
runs_choose_wide 1, a segment costing the installed runs_overhead_wide); then the kernels' device
times of one eager call (torch.profiler: the decode kernel and the segment merge apart; under programmatic dependent launch the merge's time holds its
wait for the kernel), and the runs plan's largest difference from the length plan's output.

    python bench/debug/decode_runs.py OUT.json        # on the GPU (DECODE_RUNS_HEADS=64,128 for more)
"""

from __future__ import annotations

import os
import sys

import torch
from _rows import dump_rows
from mixed_probe import kernel_times

from megapar.launch.bench.common import BenchContext, input_copies, step_time
from megapar.launch.bench.cp import _mla_decode_setup, mixed_batches
from megapar.parallel.cp import triton_decode
from megapar.parallel.cp.dcp import DCPLayout
from megapar.parallel.cp.mla import MLADims
from megapar.parallel.cp.paged import paged_decode_attention, plan_paged_decode


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    batch, block, n, context = 32, 64, 4, 131072
    dims = MLADims()
    layout = DCPLayout(size=n, rank=0, block_size=block)
    batches = {f"uniform {c // 1024}K": [c] * batch for c in (8192, 32768, 131072)}
    batches.update(mixed_batches(batch, context))
    rows: list = []
    saved = triton_decode.CONFIG["runs_overhead_wide"]
    saved_on, saved_choose = triton_decode.CONFIG["runs_wide"], triton_decode.CONFIG["runs_choose_wide"]
    for heads in [int(h) for h in os.environ.get("DECODE_RUNS_HEADS", "128").split(",")]:
        make = lambda: (*_mla_decode_setup(batch, context, dims, block, n, ctx.device, torch.bfloat16),
                        torch.randn(batch, heads, dims.latent_dim, device=ctx.device, dtype=torch.bfloat16))
        sets = input_copies(ctx, make, lambda c: c[0].kv.numel() * c[0].kv.element_size())
        for name, lens in batches.items():
            seq = torch.tensor(lens, device=ctx.device)
            tokens = int(layout.local_lengths(seq).sum())
            call = lambda c, t, q, plan=None: paged_decode_attention(q, c.paged, t, seq, layout=layout,
                                                                     scale=dims.scale, backend="triton",
                                                                     max_seq_len=max(lens), plan=plan)
            row = {"heads": heads, "batch": name, "local_tokens": tokens}
            outs = {}
            overheads = [int(f) for f in os.environ.get("DECODE_RUNS_OVERHEADS", "0,2,5,8").split(",")]
            # (runsF: the charge F a sequence; chosen: the installed choice among gluon_mla_runs.RUNS_CHARGES with
            # a segment costing `saved` tiles, CONFIG runs_choose_wide)
            ways = ([("capacity", None, 0), ("items", 0, 0)] + [(f"runs{f}", 1, f) for f in overheads]
                    + [("chosen", 1, saved)])
            for how, runs, overhead in ways:
                if runs is not None:
                    triton_decode.CONFIG.update(runs_wide=runs, runs_overhead_wide=overhead,
                                                runs_choose_wide=int(how == "chosen"))
                plans = [None if runs is None else plan_paged_decode(q, c.paged, t, seq, layout=layout)
                         for c, t, q in sets]
                us, cols = step_time(ctx, [lambda c=c, t=t, q=q, p=p: call(c, t, q, p)
                                           for (c, t, q), p in zip(sets, plans)])
                row[f"{how}_us"] = round(us, 2)
                row[f"{how}_replay_us"] = round(cols.get("replay_us", float("nan")), 2)
                c, t, q = sets[0]
                row[f"{how}_kernels_us"] = kernel_times(lambda: call(c, t, q, plans[0]))
                if runs == 1:
                    row[f"{how}_segments"] = int(plans[0].segments[-1])
                    row["programs"] = dict(plans[0].key)["runs"]
                elif runs == 0:
                    row["items"] = int(plans[0].segments[-1])
                outs[how] = call(c, t, q, plans[0])
            triton_decode.CONFIG.update(runs_wide=saved_on, runs_overhead_wide=saved, runs_choose_wide=saved_choose)
            runs_ways = [how for how, runs, _ in ways if runs == 1 and how != "chosen"]
            row["runs_max_abs_diff"] = max((outs[h].out - outs["items"].out).abs().max().item() for h in runs_ways)
            row["runs_lse_max_abs_diff"] = max((outs[h].lse - outs["items"].lse).abs().max().item() for h in runs_ways)
            best = min(runs_ways, key=lambda h: row[f"{h}_us"])
            row["best_runs"] = best
            row["speedup_best_runs_vs_items"] = round(row["items_us"] / row[f"{best}_us"], 3)
            row["speedup_chosen_vs_items"] = round(row["items_us"] / row["chosen_us"], 3)
            rows.append(row)
            print(row, flush=True)
        del sets
    dump_rows(path, "decode_runs.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-runs.json")
