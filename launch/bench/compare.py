"""Compare two result files of one `megapar bench` suite, row by row (is a new run slower?).

    megapar bench cp --device cuda --out OUT --compare bench/results/cp-h200.json
    python -m megapar.launch.bench.compare NEW.json OLD.json [--out OUT/cp-compare.md]

A result file (`launch.bench.common.write_results`) holds `suite`, `command`, `device`,
`versions`, `date` and `rows`: one dict per case with its name (`case`), parameters (strings,
ints, bools) and timings in microseconds (columns ending in `_us`). Rows match by `case`; when a
file repeats a case name, by `case` plus every parameter. For each matched row and each timing
column both files measured, the ratio new/old is reported (> 1: slower). Floors and targets
(columns with `floor` or `target` in the name) are models, not measurements, and are left out.

A regression is a ratio above 1 + threshold (5 %) in a *flagged* column: `time_us`, the time of
our code in every suite; other timing columns (anchors, breakdowns) are shown with their ratios
and marked when over the threshold, but decide nothing. Rows present in only one file are
listed. Files of different devices (`device`: h100 against h200, cpu-quick against cpu) are
compared, and the verdict says that the ratios hold the devices' difference too. `compare` returns a `Comparison`; `to_markdown` renders it as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

THRESHOLD = 0.05
FLAGGED = ("time_us",)
Key = tuple[tuple[str, Any], ...]


def timing_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Measured timing columns in first-seen order: numeric `*_us` without floor/target."""
    cols: list[str] = []
    for r in rows:
        for k, v in r.items():
            if (k.endswith("_us") and "floor" not in k and "target" not in k and k not in cols
                    and isinstance(v, (int, float)) and not isinstance(v, bool)):
                cols.append(k)
    return cols


def _param(value: Any) -> bool:
    return isinstance(value, (str, int, bool)) or value is None


def row_key(row: dict[str, Any], *, with_params: bool) -> Key:
    """The identifying fields of a row: its case name (and, with_params, every parameter)."""
    if "case" in row and not with_params:
        return (("case", row["case"]),)
    fields = sorted((k, v) for k, v in row.items() if _param(v) and not k.endswith("_us"))
    return tuple(sorted(fields, key=lambda kv: (kv[0] != "case", kv[0].lower())))


def _keyed(rows: Sequence[dict[str, Any]], with_params: bool, path: str) -> dict[Key, dict[str, Any]]:
    out: dict[Key, dict[str, Any]] = {}
    for r in rows:
        key = row_key(r, with_params=with_params)
        if key in out:
            raise ValueError(f"{path}: two rows share the identifying fields {dict(key)}; cannot match rows")
        out[key] = r
    return out


@dataclass
class RowComparison:
    """One matched row: new/old per timing column both files measured."""

    key: Key
    old: dict[str, Any]
    new: dict[str, Any]
    ratios: dict[str, float]  # column -> new / old
    regressions: list[str]  # flagged columns over the threshold

    @property
    def name(self) -> str:
        d = dict(self.key)
        return str(d["case"]) if len(d) == 1 and "case" in d else ", ".join(f"{k}={v}" for k, v in self.key)


@dataclass
class Comparison:
    """A new result file against an old one of the same suite."""

    suite: str
    new_path: str
    old_path: str
    new_meta: dict[str, Any]
    old_meta: dict[str, Any]
    columns: list[str]  # timing columns compared
    rows: list[RowComparison]
    only_new: list[str] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    threshold: float = THRESHOLD
    flagged: tuple[str, ...] = FLAGGED

    @property
    def regressions(self) -> list[RowComparison]:
        return [r for r in self.rows if r.regressions]

    @property
    def devices(self) -> tuple[Any, Any]:
        """(new, old) device tags of the files."""
        return self.new_meta.get("device"), self.old_meta.get("device")

    def verdict(self) -> str:
        n = len(self.rows)
        cols = ", ".join(self.flagged)
        new_dev, old_dev = self.devices
        if new_dev != old_dev:   # the ratios then hold the devices' difference, not only the code's
            caveat = f"different devices (new {new_dev}, old {old_dev}): ratios compare the devices too; "
            return caveat + self._verdict(n, cols)
        return self._verdict(n, cols)

    def _verdict(self, n: int, cols: str) -> str:
        if not n:
            return "no rows in common: nothing compared"
        if self.regressions:
            names = "; ".join(f"{r.name} ({', '.join(f'{c} x{r.ratios[c]:.3f}' for c in r.regressions)})"
                              for r in self.regressions)
            return f"{len(self.regressions)} of {n} rows slower by > {self.threshold:.0%} in {cols}: {names}"
        worst = max((r.ratios[c] for r in self.rows for c in self.flagged if c in r.ratios), default=None)
        tail = f" (largest new/old {worst:.3f})" if worst is not None else ""
        return f"no regression: {n} rows, {cols} within {self.threshold:.0%} of the old run{tail}"


def _load(path: str | os.PathLike) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such result file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON result file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: not a `megapar bench` result file (expected an object with a 'rows' list)")
    return data


def compare(new: str | os.PathLike | dict[str, Any], old: str | os.PathLike | dict[str, Any], *,
            threshold: float = THRESHOLD, flagged: Sequence[str] = FLAGGED) -> Comparison:
    """Compare result `new` against `old` (paths or loaded dicts) row by row."""
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 <= threshold < 10:
        raise ValueError(f"threshold ({threshold!r}) must be a fraction >= 0, e.g. 0.05 for 5 %")
    new_path = "<new>" if isinstance(new, dict) else new
    old_path = "<old>" if isinstance(old, dict) else old
    new_d = new if isinstance(new, dict) else _load(new)
    old_d = old if isinstance(old, dict) else _load(old)
    if new_d.get("suite") != old_d.get("suite"):
        raise ValueError(f"the files are of different suites: {new_path} is {new_d.get('suite')!r}, {old_path} is "
                         f"{old_d.get('suite')!r}")
    new_rows, old_rows = new_d["rows"], old_d["rows"]
    with_params = any(len({r.get("case") for r in rows}) < len(rows) or any("case" not in r for r in rows)
                      for rows in (new_rows, old_rows))
    new_k = _keyed(new_rows, with_params, str(new_path))
    old_k = _keyed(old_rows, with_params, str(old_path))
    cols = [c for c in timing_columns(old_rows) if c in timing_columns(new_rows)]
    matched = []
    for key, n in new_k.items():
        o = old_k.get(key)
        if o is None:
            continue
        ratios = {c: n[c] / o[c] for c in cols if _number(n.get(c)) and _number(o.get(c)) and o[c] > 0}
        matched.append(RowComparison(key, o, n, ratios,
                                     [c for c in flagged if c in ratios and ratios[c] > 1 + threshold]))
    name = lambda k: RowComparison(k, {}, {}, {}, []).name  # noqa: E731
    meta = lambda d: {k: d.get(k) for k in ("command", "device", "date", "versions")}  # noqa: E731
    return Comparison(suite=str(new_d.get("suite")), new_path=str(new_path), old_path=str(old_path),
                      new_meta=meta(new_d), old_meta=meta(old_d), columns=cols, rows=matched,
                      only_new=[name(k) for k in new_k if k not in old_k],
                      only_old=[name(k) for k in old_k if k not in new_k], threshold=threshold,
                      flagged=tuple(flagged))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _us(v: Any) -> str:
    return f"{v:.1f}" if _number(v) else ""


def to_markdown(c: Comparison) -> str:
    """The comparison as Markdown: header, verdict, one table row per matched case."""
    def source(label: str, path: str, m: dict[str, Any]) -> str:
        v = m.get("versions") or {}
        versions = ", ".join(f"{k} {v[k]}" for k in ("gpu", "torch", "triton") if v.get(k))
        return (f"- {label}: `{path}` (device {m.get('device') or '?'}; {m.get('date') or 'no date'}; "
                f"{versions or 'no versions'})")

    lines = [f"# bench {c.suite}: new vs old", "", source("new", c.new_path, c.new_meta),
             source("old", c.old_path, c.old_meta), "",
             f"Ratios are new/old (> 1: slower). A regression is > {1 + c.threshold:.2f} in "
             f"{', '.join(f'`{f}`' for f in c.flagged)}; other columns marked `!` over it decide nothing.", "",
             f"**Verdict: {c.verdict()}**", ""]
    head = ["case"]
    for col in c.columns:
        head += [f"{col} old", f"{col} new", f"{col} new/old"] if col in c.flagged else [f"{col} new/old"]
    head.append("regression")
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in c.rows:
        cells = [r.name.replace("|", "\\|")]
        for col in c.columns:
            ratio = r.ratios.get(col)
            text = "" if ratio is None else f"{ratio:.3f}" + ("!" if ratio > 1 + c.threshold else "")
            cells += [_us(r.old.get(col)), _us(r.new.get(col)), text] if col in c.flagged else [text]
        cells.append("**yes**" if r.regressions else "")
        lines.append("| " + " | ".join(cells) + " |")
    for label, names in (("Only in the new file", c.only_new), ("Only in the old file", c.only_old)):
        if names:
            lines += ["", f"{label} ({len(names)}):"] + [f"- {n}" for n in names]
    return "\n".join(lines) + "\n"


def write_comparison(c: Comparison, out: str | os.PathLike) -> Path:
    """Write the Markdown table to `out` (a file, or a folder: `<suite>-compare.md` in it)."""
    path = Path(out)
    if path.is_dir() or not path.suffix:
        path = path / f"{c.suite}-compare.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(c))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megapar.launch.bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("new", help="the new result JSON")
    p.add_argument("old", help="the old result JSON (e.g. bench/results/SUITE-h200.json)")
    p.add_argument("--out", default=None, help="write the Markdown table here (a file, or a folder)")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="regression above 1 + this (default 0.05)")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a row regressed")
    args = p.parse_args(argv)
    try:
        c = compare(args.new, args.old, threshold=args.threshold)
    except ValueError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print(to_markdown(c))
    if args.out:
        print(f"   wrote {write_comparison(c, args.out)}")
    return 1 if args.fail_on_regression and c.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
