"""Sum Nsight Compute's per-instruction stall samples (`bash bench/run_owed.sh ncusrc`: the source
page as csv, SASS) over a kernel's loops: runs of instructions executed at least HOT times (a
partition's steady-state loop), each with its samples, warp instructions, top stall reasons and
hottest lines. In a warp-specialized kernel the loops are the partitions: the one whose warps
issue ("selected") while the others wait at their mbarriers is the bound.

    python bench/debug/ncu_regions.py ncusrc.log [HOT]
"""

from __future__ import annotations

import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _rows(path: str) -> tuple[dict[str, int], list[list[str]]]:
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    header, rows = None, []
    for row in csv.reader(lines):
        if row[0] == "Kernel Name":
            continue
        if row[0] == "Address":
            header = {name: i for i, name in enumerate(row)}
        else:
            rows.append(row)
    if header is None:
        raise SystemExit(f"{path}: no source page (csv) in it")
    return header, rows


def main(path: str, hot: int = 10000) -> None:
    col, rows = _rows(path)
    reasons = [name for name in col if name.startswith("stall_") and "Not Issued" not in name]
    samples = lambda r: int(r[col[SAMPLES]])
    executed = lambda r: int(r[col[EXECUTED]])
    loops, start = [], None
    for i, row in enumerate(rows + [None]):
        inside = row is not None and executed(row) >= hot
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            if i - start > 5:
                loops.append((start, i - 1))
            start = None
    for a, b in loops:
        part = rows[a:b + 1]
        stalls = {name[6:]: sum(int(r[col[name]]) for r in part) for name in reasons}
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
        print(f"lines {a}-{b}: samples {sum(map(samples, part))}, warp instructions {sum(map(executed, part))}, "
              f"{executed(part[0])} executions a line, {top}")
        for i in sorted(range(a, b + 1), key=lambda i: -samples(rows[i]))[:3]:
            print(f"      {i} {rows[i][1].strip()[:70]} {samples(rows[i])}")
    print("all samples", sum(map(samples, rows)))


if __name__ == "__main__":
    main(sys.argv[1], *(int(x) for x in sys.argv[2:3]))
