"""The benchmark summary: one table per result file of a folder, with the command that made it.

Written only when asked (`megapar bench ... --summary [PATH]`; the repository's BENCHMARKS.md
comes from `megapar bench --out bench/results --summary BENCHMARKS.md`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .common import columns, format_table

MAX_ROWS = 60


def write_summary(results_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the summary of `results_dir/*.json` to `out` (default `results_dir/BENCHMARKS.md`)."""
    results_dir = Path(results_dir)
    out = Path(out) if out is not None else results_dir / "BENCHMARKS.md"
    parts = ["# Benchmarks", "",
             f"Generated from {results_dir.as_posix()}/*.json by `megapar bench --summary` (launch/bench/summary.py).",
             "Times are medians in µs; `speedup_vs_anchor` = anchor time / our time; `roofline_fraction` =",
             "floor time / our time, the floor from the measured ceilings of the GPU that ran (the H200's",
             "constants on an H200, measured at the run's start elsewhere: each file's notes name them).",
             "Files ending in `-quick` ran reduced sizes (CI-sized smoke runs on CPU), not performance results.", ""]
    files = sorted(results_dir.glob("*.json"), key=lambda p: ("quick" in p.name, p.name))
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or "rows" not in data:
            continue
        rows = data.get("rows", [])
        link = Path(os.path.relpath(path, out.parent)).as_posix()
        parts += [f"## {data.get('suite', path.stem)} on {data.get('device', '?')} ([{path.name}]({link}))",
                  "", f"Command: `{data.get('command', '?')}`, {data.get('date', '')}", ""]
        if data.get("env"):
            parts += ["Environment: " + " ".join(f"`{k}={v}`" for k, v in data["env"].items()), ""]
        if rows:
            parts.append(format_table(rows[:MAX_ROWS], columns(rows, extra=4), markdown=True))
            if len(rows) > MAX_ROWS:
                parts.append(f"\n({len(rows) - MAX_ROWS} more rows in the JSON)")
        for n in data.get("notes", []):
            parts.append(f"- {n}")
        parts.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts) + "\n")
    return out
