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
    assert common.input_copies(ctx, lambda: made.append(1) or len(made), lambda c: 40 << 20) == [1, 2, 3, 4]
    assert common.l2_sets(ctx, 1 << 30) == 1 and common.l2_sets(ctx, 1) == common.GRAPH_REPS


def test_decode_time_times_each_config_variant_and_restores_it(fake_cuda):
    from launch.bench import cp
    from parallel.cp import triton_decode, triton_merge

    ctx, clock = fake_cuda
    keys = [(triton_decode.CONFIG, "pdl"), (triton_merge.CONFIG, "one_round"),
            (triton_decode.CONFIG, "paired_store_wide_narrow_fp8")]
    before = [config[key] for config, key in keys]
    calls: list[tuple] = []

    def call():      # 30 µs, +5 without PDL, -2 with the merge's one-round loads, -1 with paired stores
        state = tuple(config[key] for config, key in keys)
        calls.append(state)
        clock[0] += 30.0 + 5.0 * (not state[0]) - 2.0 * bool(state[1]) - 1.0 * bool(state[2])
    for (config, key), value in zip(keys, (1, 0, 0)):
        config[key] = value
    try:
        us, cols = cp._decode_time(ctx, [call])
        assert us == pytest.approx(30.0) and cols["eager_us"] == pytest.approx(30.0)
        assert cols["no_pdl_us"] == pytest.approx(35.0) and cols["merge_one_round_us"] == pytest.approx(28.0)
        assert cols["paired_store_us"] == pytest.approx(29.0)
        assert set(calls) == {(1, 0, 0), (0, 0, 0), (1, 1, 0), (1, 0, 1)}     # one option changed at a time
        assert [config[key] for config, key in keys] == [1, 0, 0]
        # where the CONFIG already has the variant's value, the column is time_us itself (not timed again)
        triton_merge.CONFIG["one_round"] = 1
        calls.clear()
        us, cols = cp._decode_time(ctx, [call])
        assert cols["merge_one_round_us"] == us == pytest.approx(28.0) and (1, 0, 0) not in calls
    finally:
        for (config, key), value in zip(keys, before):
            config[key] = value
