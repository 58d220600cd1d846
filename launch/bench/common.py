"""Shared machinery of `megapar bench`: timing, recording cases, writing results.

A suite is a module `launch.bench.<name>` with `run(ctx: BenchContext) -> None`. It times
our code and its anchor in the same run (`ctx.time_fn`) and records one row per case
(`ctx.record`). The runner writes `<out>/<suite>-<device>[-quick].json` and `.md` with the
command line, the MEGAPAR_* environment (`run_env`), versions and device, and prints the rows
as an aligned table. Times are medians in microseconds. A run at reduced sizes (`--quick`, or a
suite that has no full size on this device: `ctx.label_quick`) is tagged `-quick`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def device_tag(device: torch.device) -> str:
    """Short device name for result files: 'cpu', 'h200', 'h100', ... The first tag found in the
    name wins, so a tag that holds another (gb200 holds b200, gh200 holds h200) comes first."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for tag in ("gh200", "h200", "h100", "h800", "h20", "gb200", "b200", "a100"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


CORRECTNESS_FLAGS = ("matches_reference", "bit_identical")
"""row fields by which a suite says whether the timed call's output matched its reference"""


@dataclass
class BenchContext:
    """What a suite gets: where to run, how big, and where its rows go."""

    suite: str
    device: torch.device
    quick: bool = False
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    sizes_quick: bool = False
    """the suite ran reduced sizes without --quick (no full size on this device)"""
    wrong: list[str] = field(default_factory=list)
    """cases whose result did not match their reference (`record`): the run fails"""
    clocks: Any = field(default=None, repr=False)
    """a `clocks.ClockSampler` of the device, or None: `clocks.finish` gives each row the clock
    columns of its timed loops once the suite has run"""
    spans: list[tuple[float, float]] = field(default_factory=list, repr=False)
    """the (start, end) of each timed loop (`time_fn`, its warm-up included; time.time() seconds)
    since the last `record`"""
    clocked: list[tuple[dict[str, Any], list[tuple[float, float]], tuple[float, float] | None]] = field(
        default_factory=list, repr=False)
    """(row, the spans of its timed loops, the span of the loop that gave its time_us where `step_time`
    said which: its `clock_span` column) of each row recorded while `clocks` sampled"""

    @property
    def tag(self) -> str:
        """'h200', 'cpu-quick', ...: the device, and '-quick' for reduced sizes."""
        return device_tag(self.device) + ("-quick" if self.quick or self.sizes_quick else "")

    def label_quick(self, why: str) -> None:
        """Mark the results as reduced sizes (tagged -quick) although --quick was not given."""
        if not self.quick and not self.sizes_quick:
            self.sizes_quick = True
            self.note(f"reduced sizes ({why}): results tagged -quick")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_fn(self, fn: Callable[[], Any], *, warmup: int | None = None, iters: int | None = None,
                flush_l2: bool = False) -> float:
        """Median time of `fn()` in microseconds (CUDA events on GPU, perf_counter on CPU), each
        call started from an idle GPU, so that the host's work for the call (Python, launches)
        counts. flush_l2 (CUDA): a 256 MiB memset before each call evicts its inputs from L2; the
        clock starts once the memset has finished (were the start event queued behind it, it
        would fire while the host is already running `fn`, and up to the memset's duration of
        that host work would go uncounted)."""
        warmup = (1 if self.quick else 3) if warmup is None else warmup
        iters = (3 if self.quick else (50 if self.is_cuda else 10)) if iters is None else iters
        began = time.time()
        for _ in range(warmup):
            fn()
        samples: list[float] = []
        if self.is_cuda:
            cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=self.device) if flush_l2 else None
            torch.cuda.synchronize(self.device)
            for _ in range(iters):
                if cache is not None:
                    cache.zero_()
                    torch.cuda.synchronize(self.device)
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
        self.spans.append((began, time.time()))
        return statistics.median(samples)

    def record(self, case: str, time_us: float, *, anchor: str | None = None, anchor_us: float | None = None,
               floor_us: float | None = None, **extra: Any) -> dict[str, Any]:
        """One result row. `anchor_us / time_us` is the speedup over the anchor; `floor_us /
        time_us` the fraction of the roofline (floor = bytes/bandwidth or flops/rate)."""
        own_span = extra.pop("clock_span", None)      # (`step_time`'s: not a column of its own)
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
        if self.clocks is not None:     # (what the GPU ran at in this row's timed loops: `clocks.finish`)
            self.clocked.append((row, self.spans, own_span))
        self.spans = []
        # a fast wrong result is not a result: the row stays (its time says what ran), marked, and
        # `megapar bench` fails the suite
        if any(extra.get(k) is False for k in CORRECTNESS_FLAGS):
            row["case"] = f"{case} [WRONG RESULT]"
            self.wrong.append(case)
            self.note(f"WRONG RESULT: {case!r} does not match its reference "
                      f"({', '.join(f'{k}=False' for k in CORRECTNESS_FLAGS if extra.get(k) is False)}): "
                      "its time is not a result")
        self.rows.append(row)
        print("  " + progress_line(row), flush=True)
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

    def world_sizes(self, default: Sequence[int], available: int | None = None) -> list[int]:
        """Rank counts of the suite's multi-process cases: `--world-size N` runs N ranks alone, else
        `default`; with `available` (GPUs), an N above it is not run (a note says so)."""
        n = self.options.get("world_size")
        if not n:
            return list(default)
        if available is not None and n > available:
            self.note(f"--world-size {n} > {available} GPUs here: the multi-process cases are not run")
            return []
        return [int(n)]

    def note(self, text: str) -> None:
        """Add a line to the results' notes, once: a suite's loops may reach the same note for
        several rows (the rows' own columns already tell them apart)."""
        if text in self.notes:
            return
        self.notes.append(text)
        print(f"  note: {text}", flush=True)


# ---------------------------------------------------------------------------------------------
# CUDA-graph timing and parallel Triton compiles (shared by the suites and the tuning probes)


def capture_graph(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, fn's output in the graph's memory): one warm-up call on a side stream (lazy
    allocations and compiles stay out of the capture), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


GRAPH_SHORT_US = 30.0    # a call under this per replay is timed as GRAPH_REPS calls in one graph
GRAPH_REPS = 10


def _per_call_in_graph(ctx: BenchContext, fns: Sequence[Callable[[], Any]], reps: int,
                       iters: int | None) -> float:
    """Median µs per call of `reps` calls (`fns` taken in turn) captured in one CUDA graph."""
    def calls() -> None:
        for i in range(reps):
            fns[i % len(fns)]()
    graph, _ = capture_graph(calls)
    us = ctx.time_fn(graph.replay, iters=iters) / reps
    del graph
    return us


def _timed_in_graphs(ctx: BenchContext, fns: Sequence[Callable[[], Any]], how: Callable[[], tuple[float, Any]],
                     iters: int | None) -> tuple[float, Any]:
    """`how()` (the graph timings) after a warm-up call; eager on CPU ("eager") and where capture
    fails ("eager (ExceptionName)")."""
    fns[0]()
    if not ctx.is_cuda:
        return ctx.time_fn(fns[0], iters=iters), "eager"
    torch.cuda.synchronize()
    try:
        return how()
    except Exception as e:  # noqa: BLE001 - fall back, and say so
        torch.cuda.synchronize()
        return ctx.time_fn(fns[0], iters=iters), f"eager ({type(e).__name__})"


def graph_time(ctx: BenchContext, fn: Callable[[], Any], iters: int | None = None) -> tuple[float, str]:
    """Median µs of fn as a CUDA-graph replay (eager on CPU or when capture fails). A call shorter
    than GRAPH_SHORT_US per replay is timed again as GRAPH_REPS calls captured in one graph, per
    call (timing "graph xN"): the events around one replay also hold the host's launch of it
    (5-10 µs, varying with the host), which a decode step's graph of many kernels does not pay
    per kernel."""
    def how() -> tuple[float, str]:
        us = _per_call_in_graph(ctx, [fn], 1, iters)
        if us < GRAPH_SHORT_US:
            return _per_call_in_graph(ctx, [fn], GRAPH_REPS, iters), f"graph x{GRAPH_REPS}"
        return us, "graph"
    return _timed_in_graphs(ctx, [fn], how, iters)


def step_time(ctx: BenchContext, fns: Sequence[Callable[[], Any]], reps: int = GRAPH_REPS,
              iters: int | None = None) -> tuple[float, dict[str, Any]]:
    """A decode-step call timed as a decode step's CUDA graph runs it: µs per call of `reps` calls
    captured in one graph, the input sets `fns` (the same call over separate copies of its inputs,
    `input_copies`) taken in turn, so that a call reads its inputs from DRAM and not from the L2
    the call before left them in. One replay of a graph holding a single call also holds the
    host's launch of that replay (5-10 µs on the H200's host), which a step's graph of a whole
    model's kernels pays once, not per kernel: that time is kept as `replay_us`. Returns (µs,
    columns timing / replay_us / input_sets, and clock_span: when the loop that gave the µs ran, which
    `BenchContext.record` takes from a row's columns for its time_sm_clock_* columns); eager on CPU,
    and where capture fails (timing "eager (ExceptionName)")."""
    fns = list(fns)
    cols: dict[str, Any] = {"input_sets": len(fns)}
    # whole turns of the copies in one graph: the replays run back to back, so a graph that ended
    # part way through a turn would start the next replay on a copy it read a call or two before
    reps = -(-reps // len(fns)) * len(fns)

    def how() -> tuple[float, str]:
        cols["replay_us"] = _per_call_in_graph(ctx, fns[:1], 1, iters)
        return _per_call_in_graph(ctx, fns, reps, iters), f"graph x{reps}"
    us, timing = _timed_in_graphs(ctx, fns, how, iters)
    # (the last loop timed gave `us`; none where a stand-in took time_fn's place)
    return us, {**cols, "timing": timing, "clock_span": ctx.spans[-1] if ctx.spans else None}


def input_copies(ctx: BenchContext, make: Callable[[], Any], nbytes: Callable[[Any], int]) -> list[Any]:
    """`make()` called as often as `step_time` needs copies of a call's inputs (`l2_sets` of the
    first copy's `nbytes`)."""
    first = make()
    return [first] + [make() for _ in range(l2_sets(ctx, nbytes(first)) - 1)]


def l2_sets(ctx: BenchContext, nbytes: int, most: int = GRAPH_REPS) -> int:
    """Copies of a call's inputs (`nbytes` each) that `step_time` takes in turn so that at least 3x
    the L2 is read between two uses of one copy (1 on CPU, at most `most`). The count divides
    `most` (the calls a graph holds), so that the turn also holds from one replay to the next."""
    if not ctx.is_cuda or nbytes <= 0:
        return 1
    l2 = torch.cuda.get_device_properties(ctx.device).L2_cache_size
    need = max(1, min(most, -(-3 * l2 // nbytes)))
    return next(n for n in range(need, most + 1) if most % n == 0)


@contextlib.contextmanager
def precompile():
    """Inside: Triton launches only compile (16 threads, in parallel) and do not run; on exit
    every compile has finished and sits in the in-memory kernel cache."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001 - older triton: compile lazily
        yield
        return
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return orig(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = run
    try:
        with ThreadPoolExecutor(16) as pool, AsyncCompileMode(pool, ignore_errors=True):
            yield
    finally:
        JITFunction.run = orig


def probe_main(suite: str, doc: str, probe: Callable[..., Any], writes: str, argv: list[str] | None = None) -> int:
    """`python -m megapar.launch.bench.<suite> [--probe] [--out DIR] [--device D]`: the suite's tuning
    probe `probe(out_dir, device=...)` (which writes DIR/<writes>) with --probe, else the suite."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--probe", action="store_true", help=f"run the kernel-tuning probe (writes DIR/{writes})")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if args.probe:
        probe(args.out, device=args.device)
        return 0
    from megapar.launch.cli import main as cli_main
    return cli_main(["bench", suite, "--out", args.out] + (["--device", args.device] if args.device else []))


@dataclass(frozen=True)
class Ceilings:
    """What the GPU can reach, the denominators of every roofline fraction: a device-to-device
    copy's bytes read + written per second (GB/s), and dense bf16 / fp8 matmul rates (TFLOP/s)."""

    copy_gbps: float
    bf16_tflops: float
    fp8_tflops: float
    source: str
    """where the numbers come from (written into the results' notes)"""


H200_CEILINGS = Ceilings(4264.0, 799.0, 1459.0, "the H200 test machine's measured ceilings "
                         "(docs/performance.md: copy 4264 GB/s, bf16 799 TFLOP/s, fp8 1459 TFLOP/s)")
# the CPU has no meaningful ceiling: nominal numbers, so that the CPU runs' rows keep their columns
CPU_CEILINGS = Ceilings(10.0, H200_CEILINGS.bf16_tflops, H200_CEILINGS.fp8_tflops,
                        "nominal CPU numbers (copy 10 GB/s; roofline fractions on the CPU mean nothing)")
H200_COPY_GBPS = H200_CEILINGS.copy_gbps
H200_BF16_TFLOPS = H200_CEILINGS.bf16_tflops
H200_FP8_TFLOPS = H200_CEILINGS.fp8_tflops
CEILINGS_ENV = "MEGAPAR_BENCH_CEILINGS"
"""'copy_gbps,bf16_tflops,fp8_tflops': ceilings to use instead of the known or measured ones"""
_measured: dict[int, Ceilings] = {}
_consulted: dict[str, Ceilings] = {}
"""the ceilings each device type's rows were given this process (written into its results)"""


def ceilings(device: torch.device) -> Ceilings:
    """The ceilings of `device`'s roofline fractions: MEGAPAR_BENCH_CEILINGS where set; the H200's
    measured constants on an H200; on any other GPU, measured on it once per process
    (`measure_ceilings`): the H200's numbers would make an H100's fractions ~30% low."""
    device = torch.device(device)
    tag = device_tag(device)
    if os.environ.get(CEILINGS_ENV):
        found = parse_ceilings(os.environ[CEILINGS_ENV])
    elif device.type != "cuda":
        found = CPU_CEILINGS
    elif tag == "h200":
        found = H200_CEILINGS
    else:
        index = torch.cuda.current_device() if device.index is None else device.index
        if index not in _measured:
            _measured[index] = measure_ceilings(torch.device("cuda", index))
        found = _measured[index]
    _consulted[tag] = found
    return found


def parse_ceilings(text: str) -> Ceilings:
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3 or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{CEILINGS_ENV}={text!r}: want three positive numbers 'copy_gbps,bf16_tflops,fp8_tflops'")
    return Ceilings(*values, source=f"given by {CEILINGS_ENV}={text}")


def measure_ceilings(device: torch.device, copy_mib: int = 1024, n: int = 8192, iters: int = 20) -> Ceilings:
    """Measure the ceilings on this GPU as the H200's were measured: the median of `iters` timed
    runs (CUDA events, after warm-up) of a `copy_mib` MiB device-to-device copy (bytes read +
    written over the time), an n x n x n bf16 matmul and the same over fp8 e4m3 (torch._scaled_mm,
    per-tensor scales, bf16 out). A rate that cannot be measured (no fp8 matmul) falls back to the
    H200's, and the source says so."""

    def median_ms(fn) -> float:
        return event_median_us(fn, iters, warmup=3) / 1e3

    with torch.cuda.device(device):
        src = torch.empty(copy_mib << 20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_gbps = 2 * src.numel() / (median_ms(lambda: dst.copy_(src)) * 1e6)
        del src, dst
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        bf16 = 2.0 * n ** 3 / (median_ms(lambda: a @ b) * 1e9)
        note = ""
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=device)
            fp8 = 2.0 * n ** 3 / (median_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
                                  * 1e9)
        except Exception as e:  # (an fp8 matmul this torch / GPU does not have)
            fp8, note = H200_CEILINGS.fp8_tflops, f"; fp8 not measurable ({type(e).__name__}): the H200's"
        name = torch.cuda.get_device_name(device)
    return Ceilings(round(copy_gbps, 1), round(bf16, 1), round(fp8, 1),
                    f"measured on this {name} at the start of the run (copy of {copy_mib} MiB, "
                    f"{n}^3 matmuls): copy {copy_gbps:.0f} GB/s, bf16 {bf16:.0f} TFLOP/s, fp8 {fp8:.0f} TFLOP/s"
                    + note)


def event_median_us(fn: Callable[[], Any], iters: int, warmup: int = 1) -> float:
    """Median µs of fn() between CUDA events on the current stream, each call started from an
    idle GPU (so the host's Python and launch time before its first kernel counts)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def copy_ceiling_gbps(device: torch.device) -> float:
    """Bytes read + written per second that a device-to-device copy reaches (GB/s)."""
    return ceilings(device).copy_gbps


DEFAULT_OUT = "megapar-bench"
"""the output folder when neither --out nor MEGAPAR_BENCH_DIR is given (the recorded results in
a checkout's bench/results are written only when asked: --out bench/results)"""


def default_out_dir() -> Path:
    return Path(os.environ.get("MEGAPAR_BENCH_DIR") or DEFAULT_OUT)


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


MAIN_COLUMNS = ("case", "time_us", "anchor", "anchor_us", "speedup_vs_anchor", "floor_us", "roofline_fraction")


def columns(rows: list[dict[str, Any]], *, extra: int | None = None) -> list[str]:
    """The main columns that occur, then the suite's own (at most `extra` of them; None: all)."""
    cols = [c for c in MAIN_COLUMNS if any(c in r for r in rows)]
    more: list[str] = []
    for r in rows:
        for k in r:
            if k not in MAIN_COLUMNS and k not in more:
                more.append(k)
    return cols + (more if extra is None else more[:extra])


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def format_table(rows: list[dict[str, Any]], cols: list[str], *, markdown: bool = False) -> str:
    """Rows as a Markdown table, or as aligned text (numbers right-aligned) for the console."""
    if markdown:   # the recorded values as they are
        cells = [["" if r.get(c) is None else str(r.get(c)) for c in cols] for r in rows]
        return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                         + ["| " + " | ".join(row) + " |" for row in cells])
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    width = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in cols]
    fmt = lambda row: "  ".join(v.rjust(w) if num else v.ljust(w)    # noqa: E731
                                for v, w, num in zip(row, width, numeric)).rstrip()
    return "\n".join([fmt(cols), fmt(["-" * w for w in width])] + [fmt(row) for row in cells])


def progress_line(row: dict[str, Any]) -> str:
    """One short line per recorded case while a suite runs (the full table comes at the end)."""
    parts = [f"{str(row.get('case', '')):<44}", f"{_cell(row.get('time_us')):>10} us"]
    if row.get("anchor_us") is not None:
        parts.append(f"anchor {_cell(row['anchor_us']):>10} us")
    if row.get("speedup_vs_anchor") is not None:
        parts.append(f"x{_cell(row['speedup_vs_anchor'])}")
    return "  ".join(parts)


def run_env() -> dict[str, str]:
    """The environment that changes what a run measures, recorded with its command: every MEGAPAR_*
    variable set (sections, sizes, tuning files, backends, kernel thresholds; the output folder's
    MEGAPAR_BENCH_DIR aside) and TRITON_INTERPRET."""
    return {k: v for k, v in sorted(os.environ.items())
            if (k.startswith("MEGAPAR_") and k != "MEGAPAR_BENCH_DIR") or k == "TRITON_INTERPRET"}


def _markdown(ctx: BenchContext, command: str, env: dict[str, str]) -> str:
    cols = columns(ctx.rows)
    lines = [f"# bench {ctx.suite} on {ctx.tag}", "", f"Command: `{command}`", ""]
    if env:
        lines += ["Environment: " + " ".join(f"`{k}={v}`" for k, v in env.items()), ""]
    if cols:
        lines.append(format_table(ctx.rows, cols, markdown=True))
    if ctx.notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in ctx.notes]
    return "\n".join(lines) + "\n"


def write_results(ctx: BenchContext, out_dir: str | os.PathLike | None = None,
                  command: str | None = None) -> Path:
    """Write `<suite>-<tag>.json` and `.md` into the output folder; return the JSON path."""
    out = Path(out_dir or default_out_dir())
    out.mkdir(parents=True, exist_ok=True)
    command = command or "megapar " + " ".join(sys.argv[1:])
    tag = ctx.tag
    env = run_env()
    payload = {
        "suite": ctx.suite,
        "command": command,
        "env": env,
        "device": tag,
        "versions": versions(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "options": ctx.options,
        "rows": ctx.rows,
        "notes": ctx.notes,
    }
    used = _consulted.get(device_tag(ctx.device))
    if used is not None:     # (the suite computed roofline floors: say over which ceilings)
        payload["ceilings"] = {"copy_gbps": used.copy_gbps, "bf16_tflops": used.bf16_tflops,
                               "fp8_tflops": used.fp8_tflops, "source": used.source}
        note = f"roofline ceilings: {used.source}"
        if note not in ctx.notes:
            ctx.notes.append(note)
    path = out / f"{ctx.suite}-{tag}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    (out / f"{ctx.suite}-{tag}.md").write_text(_markdown(ctx, command, env))
    return path
