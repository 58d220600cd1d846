"""The split merge's grid on decode-sized merges: the decode probe's problems (GQA bf16 / fp8 and
MLA with 128 and 16 heads, rank 0's 1/4 of L = 8K and 32K, B = 32), each whole call (kernel +
merge) timed with `common.step_time` at triton_merge.CONFIG["min_programs"] = 0 (the default
tile: 32 rows a program, 32 programs for B 32 x Hq 32), 264, 528, 1056, then 0 again (run-to-run
noise). Outputs must not change (same arithmetic per row).

    python bench/debug/decode_merge.py OUT.json        # on the GPU
"""

from __future__ import annotations

import sys

import torch
from _rows import dump_rows

from megapar.launch.bench.common import BenchContext, step_time
from megapar.launch.bench.decode_probe import _problems
from megapar.parallel.cp import triton_merge


def main(path: str) -> None:
    ctx = BenchContext("cp", torch.device("cuda"))
    rows = []
    for p in _problems(ctx, ("gqa", "gqa_fp8", "mla", "mla_narrow")):
        base = None
        for i, minimum in enumerate((0, 264, 528, 1056, 0)):
            triton_merge.CONFIG["min_programs"] = minimum
            got = p.call()
            if base is None:
                base = got
            same = torch.equal(got.out, base.out) and torch.equal(got.lse, base.lse)
            us, cols = step_time(ctx, p.calls or [p.call])
            row = {"problem": p.label, "min_programs": minimum, "repeat": i == 4, "us": round(us, 2),
                   "same_output": same, "timing": cols["timing"]}
            rows.append(row)
            print(row, flush=True)
    triton_merge.CONFIG["min_programs"] = 0
    dump_rows(path, "decode_merge.py", rows)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "decode-merge.json")
