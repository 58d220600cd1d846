"""What the GPU ran at while `megapar bench` timed a row: its SM clock, power and temperature.

A sustained tensor-core load can pull the SM clock below its boost value (power or thermal
limits), and a row timed under a lower clock reads slower for a reason that is not its kernel's.
`ClockSampler` runs `nvidia-smi` beside the suite, one sample every `INTERVAL_MS`;
`BenchContext.record` keeps the spans of each row's timed loops (`time_fn`, which every graph
timing goes through: ours, its variants and its anchors), and once the suite has run `finish`
gives each row the columns sm_clock_mhz_min / sm_clock_mhz_median / power_w_max / temp_c_max of
the samples inside them, and time_sm_clock_mhz_min / time_sm_clock_mhz_median of those inside the
loop that gave its time_us alone, where `step_time` timed it (its clock_span). Off with
MEGAPAR_BENCH_CLOCKS=0; absent off CUDA, without nvidia-smi, or where the device cannot be named to
it unambiguously.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"
INTERVAL_MS = 20


@dataclass(frozen=True)
class Sample:
    t: float                 # when it was taken (time.time() seconds)
    sm_mhz: float
    power_w: float | None
    temp_c: float | None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:        # ("[N/A]", "[Not Supported]")
        return None


def parse(line: str, read_at: float) -> Sample | None:
    """One `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` line, or None for any other.
    Its time is nvidia-smi's own timestamp (local time, to the millisecond), `read_at` where that
    does not parse: a pipe may deliver the lines late and several at once."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4 or _number(parts[1]) is None:
        return None
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        t = read_at
    return Sample(t, _number(parts[1]), _number(parts[2]), _number(parts[3]))


def gpu_id(device: torch.device) -> str | None:
    """How nvidia-smi names `device`: its UUID, or its index where no CUDA_VISIBLE_DEVICES renumbers
    the devices; None where neither is known (sampling every GPU would mix them up)."""
    try:
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    except Exception:  # noqa: BLE001 - no name, no samples
        uuid = None
    if uuid:
        text = str(uuid)
        return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return str(device.index if device.index is not None else torch.cuda.current_device())
    return None


class ClockSampler:
    """`command`'s output lines read as `Sample`s by a daemon thread until `stop()`."""

    def __init__(self, command: Sequence[str]):
        self.command = list(command)
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                      bufsize=1)
        self._thread = threading.Thread(target=self._read, name="megapar-clocks", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, device: torch.device) -> ClockSampler | None:
        """A sampler of `device` through nvidia-smi, or None (see the module's doc)."""
        if device.type != "cuda" or os.environ.get("MEGAPAR_BENCH_CLOCKS", "1") == "0":
            return None
        exe = shutil.which("nvidia-smi")
        target = gpu_id(device) if exe else None
        if target is None:
            return None
        try:
            return cls([exe, "-i", target, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                        "-lms", str(INTERVAL_MS)])
        except OSError:
            return None

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse(line, time.time())
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)

    def window(self, spans: Sequence[tuple[float, float]]) -> dict[str, float]:
        """The columns of the samples taken inside any of `spans` ((start, end) in time.time() seconds),
        {} when there is none."""
        with self._lock:
            inside = [s for s in self.samples if any(t0 <= s.t <= t1 for t0, t1 in spans)]
        if not inside:
            return {}
        cols = {"sm_clock_mhz_min": min(s.sm_mhz for s in inside),
                "sm_clock_mhz_median": statistics.median(s.sm_mhz for s in inside)}
        power = [s.power_w for s in inside if s.power_w is not None]
        temp = [s.temp_c for s in inside if s.temp_c is not None]
        if power:
            cols["power_w_max"] = max(power)
        if temp:
            cols["temp_c_max"] = max(temp)
        return cols

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._thread.join(timeout=5)


def finish(ctx) -> None:
    """Stop `ctx.clocks`, give each row it sampled the columns of its timed loops (only now: a pipe
    may hold nvidia-smi's last lines back until it ends), and say in a note what they are, or that
    the sampler gave none."""
    sampler = ctx.clocks
    sampler.stop()
    for row, spans, own in ctx.clocked:
        row.update(sampler.window(spans))
        if own is not None:       # the clock of the loop that gave time_us alone
            row.update({f"time_{k}": v for k, v in sampler.window([own]).items() if k.startswith("sm_clock")})
    timed = [span for _, spans, _ in ctx.clocked for span in spans]
    ctx.clocked = []
    if not sampler.samples:
        ctx.note(f"no clock columns: `{' '.join(sampler.command)}` gave no sample")
        return
    mhz = [s.sm_mhz for s in sampler.samples]
    busy = [s.sm_mhz for s in sampler.samples if any(t0 <= s.t <= t1 for t0, t1 in timed)]
    during = f"{min(busy):.0f}-{max(busy):.0f} MHz in {len(busy)} samples" if busy else "not sampled"
    ctx.note(f"sm_clock_mhz_min / sm_clock_mhz_median, power_w_max, temp_c_max: nvidia-smi every {INTERVAL_MS} ms "
             f"during a row's timed loops (ours, its variants and anchors, warm-ups included); time_sm_clock_mhz_min "
             f"/ _median: inside the loop that gave time_us alone (a row whose loops all fit between two samples "
             f"has none); inside the rows' timed loops the SM clock was {during}, over the whole run (idle and "
             f"set-up included) {min(mhz):.0f}-{max(mhz):.0f} MHz in {len(mhz)} samples")
