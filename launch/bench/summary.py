"""BENCHMARKS.md: one table per result file in bench/results, newest numbers, with the command."""

from __future__ import annotations

import json
from pathlib import Path

_KEEP = ("case", "time_us", "anchor", "anchor_us", "speedup_vs_anchor", "floor_us", "roofline_fraction")


def write_summary(results_dir: str | Path = "bench/results", out: str | Path = "BENCHMARKS.md") -> Path:
    results_dir = Path(results_dir)
    parts = ["# Benchmarks", "",
             "Generated from bench/results/*.json by `megapar bench` (launch/bench/summary.py).",
             "Times are medians in µs; `speedup_vs_anchor` = anchor time / our time; `roofline_fraction` =",
             "floor time / our time, the floor from the H200's measured ceilings (ANCHORS.md).",
             "Files ending in `-quick` are CI-sized smoke runs on CPU, not performance results.", ""]
    files = sorted(results_dir.glob("*.json"), key=lambda p: ("quick" in p.name, p.name))
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows = data.get("rows", [])
        parts += [f"## {data.get('suite', path.stem)} on {data.get('device', '?')} ([{path.name}](bench/results/{path.name}))",
                  "", f"Command: `{data.get('command', '?')}`, {data.get('date', '')}", ""]
        cols = [c for c in _KEEP if any(c in r for r in rows)]
        extra = []
        for r in rows:
            for k in r:
                if k not in _KEEP and k not in extra and len(extra) < 4:
                    extra.append(k)
        cols += extra
        if rows:
            parts.append("| " + " | ".join(cols) + " |")
            parts.append("|" + "---|" * len(cols))
            for r in rows[:60]:
                parts.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
            if len(rows) > 60:
                parts.append(f"\n({len(rows) - 60} more rows in the JSON)")
        for n in data.get("notes", []):
            parts.append(f"- {n}")
        parts.append("")
    out = Path(out)
    out.write_text("\n".join(parts) + "\n")
    return out
