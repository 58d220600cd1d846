"""The bench's clock columns (launch/bench/clocks.py): nvidia-smi's lines parsed, a sampler over a
stand-in command that prints such lines, and `BenchContext.record` giving each row the samples of
its own timed loops only."""

from __future__ import annotations

import datetime
import sys
import time

import pytest
import torch

from megapar.launch.bench import clocks
from megapar.launch.bench.common import BenchContext, step_time


def stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_parse_takes_nvidia_smis_own_timestamp_and_leaves_out_what_is_not_a_sample():
    t = time.time()
    s = clocks.parse(f"{stamp(t)}, 1755, 612.40, 71\n", read_at=t + 5)
    assert s is not None and s.sm_mhz == 1755 and s.power_w == pytest.approx(612.4) and s.temp_c == 71
    assert s.t == pytest.approx(t, abs=2e-3)          # its own time, not when the pipe delivered it
    na = clocks.parse(f"{stamp(t)}, 1980, [N/A], [N/A]", read_at=t)
    assert na is not None and na.power_w is None and na.temp_c is None
    odd = clocks.parse("not a time, 1980, 100, 40", read_at=123.0)
    assert odd is not None and odd.t == 123.0
    for line in ("timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu",
                 "Field \"clocks.sm\" is not a valid field to query.", "", f"{stamp(t)}, 1980, 100"):
        assert clocks.parse(line, read_at=t) is None, line


def test_sampler_reads_a_commands_lines_and_a_window_keeps_its_own_samples(tmp_path):
    # a stand-in for nvidia-smi: 1980 MHz for 10 samples, then 1500 MHz for 10, 10 ms apart
    script = tmp_path / "fake_smi.py"
    script.write_text(
        "import datetime, sys, time\n"
        "for i in range(20):\n"
        "    now = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{now}, {1980 if i < 10 else 1500}, {300 + i}.0, {40 + i}', flush=True)\n"
        "    time.sleep(0.01)\n")
    t0 = time.time()
    sampler = clocks.ClockSampler([sys.executable, str(script)])
    sampler._thread.join(timeout=30)
    sampler.stop()
    t1 = time.time()
    assert len(sampler.samples) == 20
    everything = sampler.window([(t0, t1)])
    assert everything["sm_clock_mhz_min"] == 1500 and everything["sm_clock_mhz_median"] == pytest.approx(1740)
    assert everything["power_w_max"] == 319 and everything["temp_c_max"] == 59
    first = sampler.samples[:10]
    early = sampler.window([(first[0].t, first[-1].t)])
    assert early["sm_clock_mhz_min"] == 1980 and early["power_w_max"] == 309
    assert sampler.window([(t0 - 10, t0 - 5)]) == {}      # no sample in the span: no columns


def test_a_row_gets_the_samples_of_its_own_timed_loops_once_the_suite_has_run():
    ctx = BenchContext(suite="t", device=torch.device("cpu"), quick=True)
    sampler = clocks.ClockSampler([sys.executable, "-c", "pass"])
    ctx.clocks = sampler
    ctx.time_fn(lambda: None)
    time.sleep(0.02)
    ctx.time_fn(lambda: None)
    a = ctx.record("a", 1.0)
    time.sleep(0.02)
    b = ctx.record("b", 1.0)                           # no timed loop of its own
    ctx.clocks = None
    ctx.time_fn(lambda: None)
    c = ctx.record("c", 1.0)                           # recorded without a sampler
    (first, second), = [spans for row, spans, _ in ctx.clocked if row is a]
    assert first[1] < second[0] and [spans for row, spans, _ in ctx.clocked if row is b] == [[]]
    # samples inside a's two loops, one between them, one while b was recorded
    inside = [(first[0] + first[1]) / 2, (second[0] + second[1]) / 2]
    sampler.samples = [clocks.Sample(inside[0], 1500.0, 300.0, 40.0), clocks.Sample(inside[1], 1900.0, 350.0, 45.0),
                       clocks.Sample((first[1] + second[0]) / 2, 900.0, 100.0, 30.0),
                       clocks.Sample(second[1] + 0.01, 800.0, 100.0, 30.0)]
    ctx.clocks = sampler
    clocks.finish(ctx)
    assert a["sm_clock_mhz_min"] == 1500 and a["sm_clock_mhz_median"] == 1700 and a["power_w_max"] == 350
    assert "time_sm_clock_mhz_median" not in a        # (no step_time said which loop gave its time)
    assert "sm_clock_mhz_min" not in b and "sm_clock_mhz_min" not in c and ctx.clocked == []
    # the range inside the rows' loops leaves out the samples taken between them
    assert any("timed loops the SM clock was 1500-1900 MHz in 2 samples" in n and "800-1900 MHz in 4 samples" in n
               for n in ctx.notes)


def test_start_needs_cuda_nvidia_smi_and_does_not_sample_when_turned_off(monkeypatch):
    assert clocks.ClockSampler.start(torch.device("cpu")) is None
    monkeypatch.setenv("MEGAPAR_BENCH_CLOCKS", "0")
    assert clocks.ClockSampler.start(torch.device("cuda", 0)) is None
    monkeypatch.delenv("MEGAPAR_BENCH_CLOCKS")
    monkeypatch.setenv("PATH", "")
    assert clocks.ClockSampler.start(torch.device("cuda", 0)) is None


def test_finish_says_when_the_sampler_gave_nothing():
    ctx = BenchContext(suite="t", device=torch.device("cpu"), quick=True)
    ctx.clocks = clocks.ClockSampler([sys.executable, "-c", "pass"])
    ctx.time_fn(lambda: None)
    row = ctx.record("a", 1.0)
    clocks.finish(ctx)
    assert "sm_clock_mhz_min" not in row and any("gave no sample" in n for n in ctx.notes)


def test_step_time_says_which_loop_gave_the_rows_time_and_only_its_samples_make_time_sm_clock():
    """A row recorded with `step_time`'s columns gets time_sm_clock_mhz_* from the samples of the loop
    that gave its time_us alone, not of the anchor timed after it; clock_span is no column of its own."""
    ctx = BenchContext(suite="t", device=torch.device("cpu"), quick=True)
    sampler = clocks.ClockSampler([sys.executable, "-c", "pass"])
    ctx.clocks = sampler
    us, cols = step_time(ctx, [lambda: time.sleep(0.002)])
    time.sleep(0.02)
    anchor_us, anchor_cols = step_time(ctx, [lambda: time.sleep(0.002)])
    row = ctx.record("a", us, anchor="b", anchor_us=anchor_us, **cols)
    assert "clock_span" not in row
    (spans, own), = [(spans, own) for r, spans, own in ctx.clocked if r is row]
    assert own == cols["clock_span"] and own in spans and anchor_cols["clock_span"] in spans
    t_own, t_anchor = sum(own) / 2, sum(anchor_cols["clock_span"]) / 2
    sampler.samples = [clocks.Sample(t_own, 1400.0, 600.0, 50.0), clocks.Sample(t_anchor, 1980.0, 300.0, 40.0)]
    clocks.finish(ctx)
    assert row["time_sm_clock_mhz_min"] == row["time_sm_clock_mhz_median"] == 1400
    assert row["sm_clock_mhz_min"] == 1400 and row["sm_clock_mhz_median"] == 1690 and row["power_w_max"] == 600
    assert "time_power_w_max" not in row
