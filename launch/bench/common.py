"""Shared machinery of `megapar bench`: timing, recording cases, writing results.

A suite is a module `launch.bench.<name>` with `run(ctx: BenchContext) -> None`. It times
our code and its anchor in the same run (`ctx.time_fn`) and records one row per case
(`ctx.record`). The runner writes `bench/results/<suite>-<device>.json` and `.md` with the
command line, versions and device. Times are medians in microseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


def device_tag(device: torch.device) -> str:
    """Short device name for result files: 'cpu', 'h200', 'h100', ..."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for tag in ("h200", "h100", "h800", "h20", "b200", "gb200", "a100"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


@dataclass
class BenchContext:
    """What a suite gets: where to run, how big, and where its rows go."""

    suite: str
    device: torch.device
    quick: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_fn(self, fn: Callable[[], Any], *, warmup: int | None = None, iters: int | None = None,
                flush_l2: bool = False) -> float:
        """Median time of `fn()` in microseconds (CUDA events on GPU, perf_counter on CPU)."""
        warmup = (1 if self.quick else 3) if warmup is None else warmup
        iters = (3 if self.quick else (50 if self.is_cuda else 10)) if iters is None else iters
        for _ in range(warmup):
            fn()
        samples: list[float] = []
        if self.is_cuda:
            cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=self.device) if flush_l2 else None
            torch.cuda.synchronize(self.device)
            for _ in range(iters):
                if cache is not None:
                    cache.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)

    def record(self, case: str, time_us: float, *, anchor: str | None = None, anchor_us: float | None = None,
               floor_us: float | None = None, **extra: Any) -> dict[str, Any]:
        """One result row. `anchor_us / time_us` is the speedup over the anchor; `floor_us /
        time_us` the fraction of the roofline (floor = bytes/bandwidth or flops/rate)."""
        row: dict[str, Any] = {"case": case, "time_us": round(time_us, 3)}
        if anchor is not None:
            row["anchor"] = anchor
        if anchor_us is not None:
            row["anchor_us"] = round(anchor_us, 3)
            row["speedup_vs_anchor"] = round(anchor_us / time_us, 3) if time_us > 0 else None
        if floor_us is not None:
            row["floor_us"] = round(floor_us, 3)
            row["roofline_fraction"] = round(floor_us / time_us, 3) if time_us > 0 else None
        for k, v in extra.items():
            row[k] = round(v, 4) if isinstance(v, float) else v
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        return row

    @contextlib.contextmanager
    def single_thread(self):
        """One intra-op thread for the block: tiny CPU ops on a shared box stall for ms in
        OpenMP regions, so one thread gives shorter and more reproducible numbers."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)


# Measured ceilings of the H200 test machine (ANCHORS.md); used for roofline fractions.
H200_COPY_GBPS = 4264.0
H200_BF16_TFLOPS = 799.0
H200_FP8_TFLOPS = 1459.0


def copy_ceiling_gbps(device: torch.device) -> float:
    """Bytes read + written per second that a device-to-device copy reaches (GB/s)."""
    return H200_COPY_GBPS if device.type == "cuda" else 10.0


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "deep_ep", "deep_gemm", "ray"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "unknown")
        except Exception:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _markdown(ctx: BenchContext, command: str) -> str:
    cols: list[str] = []
    for row in ctx.rows:
        for k in row:
            if k not in cols:
                cols.append(k)
    lines = [f"# bench {ctx.suite} on {device_tag(ctx.device)}", "", f"Command: `{command}`", ""]
    if cols:
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in ctx.rows:
            lines.append("| " + " | ".join(str(row.get(c, "")) for c in cols) + " |")
    if ctx.notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in ctx.notes]
    return "\n".join(lines) + "\n"


def write_results(ctx: BenchContext, out_dir: str | os.PathLike | None = None,
                  command: str | None = None) -> Path:
    """Write `<suite>-<device>.json` and `.md`; return the JSON path."""
    out = Path(out_dir or os.environ.get("MEGAPAR_BENCH_DIR", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    command = command or "megapar " + " ".join(sys.argv[1:])
    tag = device_tag(ctx.device) + ("-quick" if ctx.quick else "")
    payload = {
        "suite": ctx.suite,
        "command": command,
        "device": tag,
        "versions": versions(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "options": ctx.options,
        "rows": ctx.rows,
        "notes": ctx.notes,
    }
    path = out / f"{ctx.suite}-{tag}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"{ctx.suite}-{tag}.md").write_text(_markdown(ctx, command))
    return path
