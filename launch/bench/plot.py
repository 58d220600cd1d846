"""`megapar bench SUITE --plot`: a PNG beside the JSON.

gemm: the grouped-GEMM roofline per (shape, gemm) panel: time against tokens per expert for our
kernels, torch bf16 `_grouped_mm`, torch fp8 `_scaled_grouped_mm` and the FP4 floor (log-log).
The reference lines come from the main rows (every expert given `tok` rows: anchor "torch bf16
_grouped_mm"); the routed rows (only the experts hit, x = rows per expert hit) are series of
their own, and the DeepGEMM section's rows carry their own floors and anchors (not drawn).
Other suites: the speedup over the anchor per case, bars from 1.0 with the values printed.
"""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'megapar[plot]'") from e
    return plt


MAIN_ANCHOR = "torch bf16 _grouped_mm"


def _routed(row: dict) -> bool:
    """A routed row (`gemm._routed_rows`): only the experts hit, tok_per_expert = rows per expert hit."""
    return "experts_hit" in row or " routed " in str(row.get("case", ""))


def plot_gemm(rows: list[dict], out: Path, title: str) -> Path:
    plt = _pyplot()
    panels = sorted({(r["shape"], r["gemm"]) for r in rows if "tok_per_expert" in r})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5 * max(1, len(panels)), 4), squeeze=False)
    for ax, (shape, gemm) in zip(axes[0], panels):
        mine = [r for r in rows if r.get("shape") == shape and r.get("gemm") == gemm and "tok_per_expert" in r]
        for routed in (False, True):      # the same impl routed is another problem: a series of its own
            for impl in sorted({r["impl"] for r in mine if _routed(r) == routed}):
                pts = sorted((r["tok_per_expert"], r["time_us"]) for r in mine
                             if r["impl"] == impl and _routed(r) == routed)
                ax.plot(*zip(*pts), marker="x" if routed else "o", linestyle=":" if routed else "-",
                        label=f"ours: {impl}" + (" routed (x: rows per expert hit)" if routed else ""))
        # the reference lines of the main rows only: the routed rows' floors count the experts hit
        # alone, the DeepGEMM rows' are FP8 rooflines and their decode anchor a whole-slab bmm
        main = [r for r in mine if not _routed(r) and r.get("anchor") == MAIN_ANCHOR]
        for key, label, style in (("anchor_us", MAIN_ANCHOR, "k--"),
                                  ("fp8_anchor_us", "torch fp8 _scaled_grouped_mm", "k:"),
                                  ("floor_us", "FP4 floor (bytes / copy bw)", "g-")):
            pts = sorted({(r["tok_per_expert"], r[key]) for r in main if r.get(key) is not None})
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per expert")
        ax.set_ylabel("µs (median)")
        ax.set_title(f"{shape} {gemm}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_speedups(rows: list[dict], out: Path, title: str) -> Path:
    fig = speedup_figure(rows, title)
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def speedup_figure(rows: list[dict], title: str):
    """One bar per case from 1.0 (parity) to its speedup on a log axis, so that a bar's length
    is the factor won or lost; the value is printed at the bar's end; labels wrap, not clip."""
    import textwrap

    plt = _pyplot()
    pts = [(str(r["case"]), float(r["speedup_vs_anchor"])) for r in rows if r.get("speedup_vs_anchor")]
    labels = ["\n".join(textwrap.wrap(c, 48)) or c for c, _ in pts]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.5 + 0.22 * lines + 0.12 * len(pts))))
    values = [v for _, v in pts]
    y = list(range(len(pts)))
    colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
    ax.barh(y, [v - 1.0 for v in values], left=1.0, color=colors, height=0.6)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xscale("log")
    if values:
        lo, hi = min(values + [1.0]), max(values + [1.0])
        ax.set_xlim(lo / 1.8, hi * 1.8)   # room for the printed values
    for yi, v in zip(y, values):
        ax.text(v * (1.05 if v >= 1 else 1 / 1.05), yi, f"{v:.2f}x", va="center",
                ha="left" if v >= 1 else "right", fontsize=7)
    ax.set_yticks(y, labels)
    ax.set_xlabel("anchor time / our time (log; bars start at 1.0 = parity)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def plot_results(json_path: str | Path, out: str | Path | None = None) -> Path:
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    out = Path(out) if out else json_path.with_suffix(".png")
    title = f"{data.get('suite')} on {data.get('device')}"
    if data.get("suite") == "gemm":
        return plot_gemm(data["rows"], out, title)
    return plot_speedups(data["rows"], out, title)


if __name__ == "__main__":
    import sys

    for p in sys.argv[1:]:
        print(plot_results(p))
