"""The CUDA-graph timing helpers of `launch.bench.common` (graph_time, step_time, input_copies),
their control flow on CPU with a stand-in for graph capture: which calls a timed graph holds, in
what turn, and what each reports (the GPU runs them for real in `megapar bench`)."""

from __future__ import annotations

import pytest
import torch

from launch.bench import common


class _Graph:
    """A captured graph as a replay of the calls made while capturing."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(common.BenchContext, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(common, "capture_graph", lambda fn: (_Graph(fn), None))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    ctx = common.BenchContext(suite="t", device=torch.device("cpu"), quick=True)
    clock = [0.0]                        # a fake clock: each call advances it by its duration

    def time_fn(fn, iters=None, **_):
        before = clock[0]
        fn()
        return clock[0] - before
    monkeypatch.setattr(ctx, "time_fn", time_fn)
    return ctx, clock


def _call(name, us, calls, clock):
    def fn():
        calls.append(name)
        clock[0] += us
    return fn


def test_step_time_rotates_the_input_copies_and_reports_per_call(fake_cuda):
    ctx, clock = fake_cuda
    calls: list[str] = []
    fns = [_call("a", 40.0, calls, clock), _call("b", 60.0, calls, clock), _call("c", 50.0, calls, clock)]
    us, cols = common.step_time(ctx, fns, reps=6)
    # warm-up a; one-call graph a (replay_us); six calls in turn a b c a b c
    assert calls == ["a", "a", "a", "b", "c", "a", "b", "c"]
    assert us == pytest.approx(50.0) and cols["replay_us"] == pytest.approx(40.0)
    assert cols["timing"] == "graph x6" and cols["input_sets"] == 3


def test_graph_time_reps_short_calls_only(fake_cuda):
    ctx, clock = fake_cuda
    calls: list[str] = []
    assert common.graph_time(ctx, _call("long", 45.0, calls, clock)) == (pytest.approx(45.0), "graph")
    assert calls == ["long", "long"]
    calls.clear()
    us, how = common.graph_time(ctx, _call("short", 7.0, calls, clock))
    assert (us, how) == (pytest.approx(7.0), f"graph x{common.GRAPH_REPS}")
    assert calls == ["short"] * (2 + common.GRAPH_REPS)


def test_timing_falls_back_to_eager_and_says_why(fake_cuda, monkeypatch):
    ctx, clock = fake_cuda

    def no_capture(fn):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(common, "capture_graph", no_capture)
    calls: list[str] = []
    us, cols = common.step_time(ctx, [_call("a", 9.0, calls, clock)])
    assert us == pytest.approx(9.0) and cols["timing"] == "eager (RuntimeError)" and "replay_us" not in cols
    assert common.graph_time(ctx, _call("b", 3.0, calls, clock)) == (pytest.approx(3.0), "eager (RuntimeError)")


def test_input_copies_cover_three_l2s(monkeypatch):
    ctx = common.BenchContext(suite="t", device=torch.device("cpu"), quick=True)
    made = []
    assert common.input_copies(ctx, lambda: made.append(1) or len(made), lambda c: 1 << 20) == [1]   # CPU: one
    monkeypatch.setattr(common.BenchContext, "is_cuda", property(lambda self: True))

    class Props:
        L2_cache_size = 50 << 20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props)
    made.clear()
    # 40 MiB copies: 4 give 3x the L2 between two uses, but 4 does not divide the ten calls of a graph: 5
    assert common.input_copies(ctx, lambda: made.append(1) or len(made), lambda c: 40 << 20) == [1, 2, 3, 4, 5]
    assert common.l2_sets(ctx, 1 << 30) == 1 and common.l2_sets(ctx, 1) == common.GRAPH_REPS


@pytest.mark.parametrize("mib", [1, 8, 20, 30, 40, 50, 60, 70, 100, 149, 150, 151, 400])
def test_l2_sets_keep_three_l2s_between_uses_across_replays(monkeypatch, mib):
    """A graph of GRAPH_REPS calls takes the copies in turn (call i: copy i mod n) and is replayed back
    to back: from one use of a copy to the next, counted over the replay boundary too, at least 3x the
    L2 is read (that copy and the others between; or n is the most there may be)."""
    ctx = common.BenchContext(suite="t", device=torch.device("cpu"), quick=True)
    monkeypatch.setattr(common.BenchContext, "is_cuda", property(lambda self: True))
    l2 = 50 << 20

    class Props:
        L2_cache_size = l2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: Props)
    nbytes = mib << 20
    n = common.l2_sets(ctx, nbytes)
    assert 1 <= n <= common.GRAPH_REPS
    order = [i % n for i in range(common.GRAPH_REPS)] * 3          # three replays of one graph
    gaps = [next(j for j in range(i + 1, len(order)) if order[j] == order[i]) - i - 1
            for i in range(len(order) - common.GRAPH_REPS)]
    least = (min(gaps) + 1) * nbytes                               # bytes read from one use to the next
    assert least >= 3 * l2 or n == common.GRAPH_REPS, (n, gaps)


def test_step_time_takes_whole_turns_of_the_copies_in_one_graph(fake_cuda, monkeypatch):
    """Replays back to back: the copy a replay starts with is not the one the replay before ended with."""
    ctx, clock = fake_cuda
    calls: list[str] = []
    replays: list[int] = []

    def time_fn(fn, iters=None, **_):               # three replays of the graph, back to back
        replays.append(len(calls))
        before = clock[0]
        for _ in range(3):
            fn()
        return (clock[0] - before) / 3
    monkeypatch.setattr(ctx, "time_fn", time_fn)
    fns = [_call(name, 10.0, calls, clock) for name in "abc"]
    us, cols = common.step_time(ctx, fns)          # the default reps (10) is no multiple of 3
    seq = calls[replays[-1]:]                       # the last graph's replays
    reps = len(seq) // 3
    assert reps >= common.GRAPH_REPS and reps % 3 == 0 and cols["timing"] == f"graph x{reps}"
    assert all(seq[i] != seq[i + 1] and seq[i] != seq[i + 2] for i in range(len(seq) - 2))
    assert seq == ["a", "b", "c"] * (len(seq) // 3) and us == pytest.approx(10.0)


def test_decode_time_times_each_config_variant_and_restores_it(fake_cuda):
    from launch.bench import cp
    from parallel.cp import triton_decode, triton_merge

    ctx, clock = fake_cuda
    configs = {"triton_decode": triton_decode.CONFIG, "triton_merge": triton_merge.CONFIG}
    keys = [(configs[module], key) for module, change in cp.DECODE_VARIANTS.values() for key in change]
    assert len(keys) == len(cp.DECODE_VARIANTS) >= 4
    before = [config[key] for config, key in keys]
    calls: list[tuple] = []
    cost = {"no_pdl_us": 5.0, "unpaired_store_us": 1.0, "ids_after_us": 0.5, "ids_ahead_fp8_us": -2.0}

    def call():      # 30 µs, and each variant's own change
        state = tuple(config[key] for config, key in keys)
        calls.append(state)
        clock[0] += 30.0 + sum(cost.get(name, -0.25) for (name, (_, change)), (config, key)
                               in zip(cp.DECODE_VARIANTS.items(), keys) if config[key] == change[key])
    installed = {(id(config), key): 1 - change[key] for (_, (_, change)), (config, key)
                 in zip(cp.DECODE_VARIANTS.items(), keys)}
    for config, key in keys:
        config[key] = installed[(id(config), key)]
    try:
        us, cols = cp._decode_time(ctx, [call])
        assert us == pytest.approx(30.0) and cols["eager_us"] == pytest.approx(30.0)
        for name in cp.DECODE_VARIANTS:
            assert cols[name] == pytest.approx(30.0 + cost.get(name, -0.25)), name
        # (a row's fixed part carries the same columns, renamed fixed_<column>)
        assert cp._fixed_variants(cols) == {f"fixed_{name}": cols[name] for name in cp.DECODE_VARIANTS}
        base = tuple(installed[(id(config), key)] for config, key in keys)
        assert set(calls) == {base} | {tuple(1 - v if j == i else v for j, v in enumerate(base))
                                      for i in range(len(keys))}            # one option changed at a time
        assert tuple(config[key] for config, key in keys) == base
        # where the CONFIG already has the variant's value, the column is time_us itself (not timed again)
        triton_decode.CONFIG["ids_ahead_direct_fp8"] = 1
        calls.clear()
        us, cols = cp._decode_time(ctx, [call])
        assert cols["ids_ahead_fp8_us"] == us == pytest.approx(28.0) and base not in calls
    finally:
        for (config, key), value in zip(keys, before):
            config[key] = value


class _FakeGPU:
    """One CUDA stream on a simulated clock (µs): the host queues kernels and goes on; a kernel
    starts when both the host has launched it and the stream is free; an event completes when the
    work queued before it is done; synchronize waits for the stream."""

    def __init__(self):
        self.host = 0.0            # the host's clock
        self.free = 0.0            # when the stream has run everything queued so far

    def launch(self, us):
        self.free = max(self.host, self.free) + us

    def synchronize(self, *args, **kwargs):
        self.host = max(self.host, self.free)

    def event_class(self):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = max(gpu.host, gpu.free)

            def synchronize(self):
                gpu.host = max(gpu.host, self.at)

            def elapsed_time(self, end):      # ms, as torch's
                return (end.at - self.at) / 1e3
        return Event


def test_time_fn_flush_keeps_the_calls_host_work_in_the_time(monkeypatch):
    """CUDA timing of an eager call (100 µs of host work, then a 10 µs kernel) from an idle GPU is
    110 µs, with or without the L2 flush before it: the flush (an 80 µs memset) must be over before
    the start event, not queued ahead of it (the event then fired when the memset ended, while
    the host was already 80 µs into the call: 30 µs)."""
    gpu = _FakeGPU()
    monkeypatch.setattr(common.BenchContext, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(torch.cuda, "Event", gpu.event_class())
    real_empty = torch.empty
    flushes = []

    class FlushBuffer:
        def zero_(self):
            flushes.append(gpu.host)
            gpu.launch(80.0)

    def empty(*size, **kwargs):
        if kwargs.get("dtype") == torch.int32 and size and size[0] * 4 >= 128 << 20:   # the L2 flush buffer
            return FlushBuffer()
        return real_empty(*size, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    ctx = common.BenchContext(suite="t", device=torch.device("cpu"))
    calls = []

    def call():
        calls.append(gpu.host)
        gpu.host += 100.0                  # Python and launch work
        gpu.launch(10.0)                   # the kernel
    assert ctx.time_fn(call, warmup=1, iters=5) == pytest.approx(110.0)
    calls.clear()
    assert ctx.time_fn(call, warmup=1, iters=5, flush_l2=True) == pytest.approx(110.0)
    assert len(flushes) == 5 and len(calls) == 6          # one flush before each timed call


@pytest.mark.parametrize("name,tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA H20", "h20"), ("NVIDIA H800", "h800"), ("NVIDIA B200", "b200"),
                                      ("NVIDIA GB200", "gb200"), ("NVIDIA GH200 480GB", "gh200"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "nvidia_l40s")])
def test_device_tag_names_the_device(monkeypatch, name, tag):
    """The device in result files' names and `device` field: a GB200 is not a B200, a GH200 not an H200."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert common.device_tag(torch.device("cuda")) == tag
    assert common.device_tag(torch.device("cpu")) == "cpu"


def test_results_record_the_environment_that_picks_what_ran(tmp_path, monkeypatch):
    """The sections, sizes and kernel settings that MEGAPAR_* variables choose are in the result
    files beside the command (JSON `env`, and the Markdown), the output folder's variable aside."""
    import json

    monkeypatch.setenv("MEGAPAR_BENCH_CP_SECTIONS", "dcp,decode")
    monkeypatch.setenv("MEGAPAR_BENCH_CP_DCP_CONTEXT", "8192")
    monkeypatch.setenv("MEGAPAR_BENCH_DIR", str(tmp_path))
    ctx = common.BenchContext(suite="cp", device=torch.device("cpu"))
    ctx.record("a", 1.0)
    path = common.write_results(ctx, tmp_path, "megapar bench cp --device cpu")
    data = json.loads(path.read_text())
    assert data["command"] == "megapar bench cp --device cpu"
    assert data["env"]["MEGAPAR_BENCH_CP_SECTIONS"] == "dcp,decode"
    assert data["env"]["MEGAPAR_BENCH_CP_DCP_CONTEXT"] == "8192" and "MEGAPAR_BENCH_DIR" not in data["env"]
    md = path.with_suffix(".md").read_text()
    assert "`MEGAPAR_BENCH_CP_SECTIONS=dcp,decode`" in md and "`MEGAPAR_BENCH_CP_DCP_CONTEXT=8192`" in md
    from launch.bench.summary import write_summary
    assert "`MEGAPAR_BENCH_CP_SECTIONS=dcp,decode`" in write_summary(tmp_path).read_text()


def test_ceilings_are_the_devices_own(monkeypatch, tmp_path):
    """Roofline fractions use the ceilings of the GPU that ran: the H200's measured constants on an
    H200, numbers measured once on any other GPU (an H100 given the H200's copy rate read ~30% low),
    MEGAPAR_BENCH_CEILINGS over both; the results name the ceilings their floors used."""
    import json

    measured = []

    def measure(device):
        measured.append(device)
        return common.Ceilings(3000.0, 700.0, 1300.0, "measured stand-in")

    monkeypatch.setattr(common, "measure_ceilings", measure)
    monkeypatch.setattr(common, "_measured", {})
    monkeypatch.setattr(common, "_consulted", {})
    monkeypatch.delenv(common.CEILINGS_ENV, raising=False)
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: names[torch.device(d).index])
    h100, h200 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert common.ceilings(h200) == common.H200_CEILINGS and measured == []
    assert common.ceilings(h100).copy_gbps == 3000.0 and common.copy_ceiling_gbps(h100) == 3000.0
    assert measured == [h100]                          # measured once, then kept
    assert common.ceilings(torch.device("cpu")) == common.CPU_CEILINGS
    ctx = common.BenchContext(suite="t", device=h100)
    ctx.record("a", 1.0)
    data = json.loads(common.write_results(ctx, tmp_path, "megapar bench t").read_text())
    assert data["device"] == "h100" and data["ceilings"]["copy_gbps"] == 3000.0
    assert "roofline ceilings: measured stand-in" in data["notes"]
    monkeypatch.setenv(common.CEILINGS_ENV, "1000, 400,800")
    got = common.ceilings(h200)
    assert (got.copy_gbps, got.bf16_tflops, got.fp8_tflops) == (1000.0, 400.0, 800.0)
    for bad in ("1000,400", "1000,x,800", "1000,-1,800", "1000,inf,800"):
        monkeypatch.setenv(common.CEILINGS_ENV, bad)
        with pytest.raises(ValueError, match="MEGAPAR_BENCH_CEILINGS"):
            common.ceilings(h100)


def test_results_without_floors_name_no_ceilings(monkeypatch, tmp_path):
    import json

    monkeypatch.setattr(common, "_consulted", {})
    ctx = common.BenchContext(suite="t", device=torch.device("cpu"))
    ctx.record("a", 1.0)
    data = json.loads(common.write_results(ctx, tmp_path, "megapar bench t").read_text())
    assert "ceilings" not in data and not any("ceilings" in n for n in data["notes"])


@pytest.mark.gpu
def test_measured_ceilings_are_plausible():
    """The run-time measurement on the GPU at hand: positive rates in a Hopper-class range."""
    c = common.measure_ceilings(torch.device("cuda"), copy_mib=256, n=4096, iters=5)
    assert 500 < c.copy_gbps < 10000 and 50 < c.bf16_tflops < 3000 and c.fp8_tflops > 0, c
    assert "measured on this" in c.source


def test_a_row_that_does_not_match_its_reference_fails_the_suite(tmp_path, monkeypatch, capsys):
    """A fast wrong kernel is not a result: a row recorded with matches_reference=False (or
    bit_identical=False) is marked in its case and the notes, and `megapar bench` exits 1 naming
    the suite; rows that match are untouched."""
    import sys
    import types

    from launch.cli import main as cli_main

    def run(ctx):
        ctx.record("good", 2.0, matches_reference=True)
        ctx.record("fast but wrong", 1.0, anchor="torch", anchor_us=5.0, matches_reference=False)
        ctx.record("bits", 1.0, bit_identical=False)

    monkeypatch.setitem(sys.modules, "megapar.launch.bench.merge", types.SimpleNamespace(run=run))
    assert cli_main(["bench", "merge", "--device", "cpu", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "failed suites: merge (wrong results)" in err and "fast but wrong, bits" in err
    import json

    data = json.loads((tmp_path / "merge-cpu.json").read_text())
    assert [r["case"] for r in data["rows"]] == ["good", "fast but wrong [WRONG RESULT]", "bits [WRONG RESULT]"]
    assert sum("WRONG RESULT" in n for n in data["notes"]) == 2


def test_decode_time_times_only_the_variants_asked_for(fake_cuda, monkeypatch):
    """`row_variants` names the options that reach a row's kernel (ids_ahead not the 128-head MLA
    kernel, the seesaw form only it over bf16, the paired stores only the direct fp8 kernels), and
    `_decode_time` times those alone: no column and no graph for the rest."""
    from launch.bench import cp

    assert cp.row_variants("gqa", 32, False) == ("no_pdl_us", "ids_after_us")
    assert cp.row_variants("gqa", 32, True) == ("no_pdl_us", "unpaired_store_us", "ids_ahead_fp8_us")
    # (a speculative step over bf16: the Triton kernel beside the Gluon one, triton_tokens_us; over fp8 the
    # direct kernel serves both)
    assert cp.row_variants("gqa", 32, False, 4) == ("no_pdl_us", "ids_after_us", "triton_tokens_us")
    assert cp.row_variants("gqa", 32, True, 2) == cp.row_variants("gqa", 32, True)
    # (two softmax maxima a tile, two_max_us: MLA's swapped fp8 kernel, narrow tiles and head tiles)
    assert cp.row_variants("mla", 32, True) == ("pdl_narrow_us", "unpaired_store_us", "ids_after_narrow_fp8_us",
                                                "two_max_us")
    assert cp.row_variants("mla", 128, False) == ("no_pdl_us", "seesaw_us")
    assert cp.row_variants("mla", 128, True) == ("no_pdl_us", "converter_fp8_us")
    assert cp.row_variants("mla", 16, False) == ("pdl_narrow_us", "ids_after_us")
    # (the fp8 value MMAs: MLA's narrow direct fp8 kernel at most 16 columns)
    assert cp.row_variants("mla", 16, True) == ("pdl_narrow_us", "unpaired_store_us", "ids_after_narrow_fp8_us",
                                                "values8_us", "two_max_us")
    # wider speculative steps (more than 32 columns) run the swapped kernels in head tiles: untiled_us
    assert cp.row_variants("mla", 16, True, 3) == ("no_pdl_us", "unpaired_store_us", "ids_after_narrow_fp8_us",
                                                   "untiled_fp8_us", "two_max_us")
    # and those over full 64-head tiles, which the installed CONFIG may run as one-token decodes through
    # the full-tile kernels (expand_wide*): expanded_us either way, the other columns those of the kernel
    # that runs
    from parallel.cp import triton_decode
    for on in (0, 1):
        monkeypatch.setitem(triton_decode.CONFIG, "expand_wide", on)
        monkeypatch.setitem(triton_decode.CONFIG, "expand_wide_fp8", on)
        assert cp.row_variants("mla", 128, False, 2) == (("no_pdl_us", "seesaw_us", "expanded_us") if on else
                                                         ("no_pdl_us", "ids_after_us", "untiled_us", "expanded_us"))
        assert cp.row_variants("mla", 128, True, 2) == (
            ("no_pdl_us", "expanded_fp8_us", "converter_fp8_us") if on else
            ("no_pdl_us", "unpaired_store_us", "ids_after_narrow_fp8_us", "untiled_fp8_us", "expanded_fp8_us",
             "two_max_us"))
    assert cp.row_variants("mla", 48, False, 2) == ("no_pdl_us", "ids_after_us", "untiled_us")
    assert cp.row_variants("mla", 16, False, 2) == cp.row_variants("mla", 16, False)
    ctx, clock = fake_cuda
    calls = []

    def call():
        calls.append(1)
        clock[0] += 30.0
    cp._decode_time(ctx, [call])
    every = len(calls)
    calls.clear()
    us, cols = cp._decode_time(ctx, [call], ("no_pdl_us",))
    assert set(cols) & set(cp.DECODE_VARIANTS) == {"no_pdl_us"} and cols["no_pdl_us"] == pytest.approx(30.0)
    assert 0 < len(calls) < every
    calls.clear()
    us, cols = cp._decode_time(ctx, [call], ())
    assert not set(cols) & set(cp.DECODE_VARIANTS) and us == pytest.approx(30.0)
