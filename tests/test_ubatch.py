"""Micro-batch overlap runner (parallel/ubatch.py): splitting, strict turn order, hooks, failure
handling and reuse in one process; EP dispatch/combine and collectives at 2 gloo ranks; the
CUDA stream path on one GPU."""

from __future__ import annotations

import random
import threading
import time
import traceback

import pytest
import torch

from parallel.ubatch import (
    UBatchError,
    UBatchRunner,
    get_optional_ubatch,
    get_ubatch,
    register_recv_hook,
    split_tokens,
    switch_to_comm,
    ubatch_yield,
    yield_and_switch_to_comm,
    yield_and_switch_to_compute,
)


def _live_ubatch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ubatch-")]


def test_split_tokens_is_near_equal_and_ordered():
    assert split_tokens(7, 2) == [4, 3]
    assert split_tokens(10, 3) == [4, 3, 3]
    assert split_tokens(1, 2) == [1, 0]
    assert split_tokens(0, 2) == [0, 0]
    with pytest.raises(ValueError, match="num_ubatches"):
        split_tokens(4, 0)


def test_thresholds_for_decode_and_prefill():
    runner = UBatchRunner(2)
    assert (runner.threshold("decode"), runner.threshold("prefill")) == (32, 512)
    assert not runner.should_split(31, "decode") and runner.should_split(32, "decode")
    assert not runner.should_split(511, "prefill") and runner.should_split(512, "prefill")
    custom = UBatchRunner(2, decode_min_tokens=4, prefill_min_tokens=100)
    assert custom.should_split(4, "decode") and not custom.should_split(99)
    forced = UBatchRunner(3, min_tokens=1)
    assert forced.should_split(3, "decode") and not forced.should_split(2, "prefill")  # fewer tokens than ubatches
    assert not UBatchRunner(1, min_tokens=1).should_split(1000)
    with pytest.raises(ValueError, match="mode"):
        runner.should_split(10, "train")
    with pytest.raises(ValueError, match="num_ubatches"):
        UBatchRunner(0)


def test_below_threshold_runs_once_on_the_calling_thread():
    runner = UBatchRunner(2, decode_min_tokens=8)
    seen = []

    def fn(x):
        seen.append((threading.current_thread() is threading.main_thread(), get_optional_ubatch(), x.shape[0]))
        return x + ubatch_yield(lambda: 1.0)  # outside a runner the hook runs at once

    out = runner.run(fn, torch.zeros(7), mode="decode")
    assert seen == [(True, None, 7)] and torch.equal(out, torch.ones(7))
    seen.clear()
    runner.run(fn, torch.zeros(8), mode="decode")
    assert [(main, ctx.ubatch_id, n) for main, ctx, n in seen] == [(False, 0, 4), (False, 1, 4)]


def _token_fn(x, idx, *, weight):
    """Per-token work with yields; float64 on small integers, so every order gives exact results."""
    ctx = get_optional_ubatch()
    offset = ctx.token_offset if ctx is not None else 0
    h = x @ weight
    h = ubatch_yield(lambda: h + 1)
    pos = torch.arange(offset, offset + x.shape[0], dtype=x.dtype)[:, None]
    yield_and_switch_to_comm()
    h = h * 2 + pos
    register_recv_hook(lambda: None)
    h = yield_and_switch_to_compute(lambda: h - idx[:, None])
    return h @ weight.T, idx * 10


@pytest.mark.parametrize("num_ubatches,num_tokens", [(2, 9), (3, 10), (4, 4)])
def test_results_equal_with_and_without_microbatching(num_ubatches, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randint(-5, 6, (num_tokens, 6), generator=g).double()
    idx = torch.arange(num_tokens, dtype=torch.float64) * 3
    weight = torch.randint(-3, 4, (6, 5), generator=g).double()
    want_h, want_i = _token_fn(x, idx, weight=weight)
    got_h, got_i = UBatchRunner(num_ubatches, min_tokens=1).run(_token_fn, x, idx, weight=weight)
    assert torch.equal(got_h, want_h) and torch.equal(got_i, want_i)


def test_per_ubatch_metadata():
    runner = UBatchRunner(3, min_tokens=1)
    metas = []

    def fn(x):
        ctx = get_ubatch()
        metas.append((ctx.ubatch_id, ctx.num_ubatches, ctx.token_offset, ctx.num_tokens, ctx.total_tokens))
        assert torch.equal(x, torch.arange(11)[ctx.token_slice])
        return x

    assert torch.equal(runner.run(fn, torch.arange(11)), torch.arange(11))
    assert sorted(metas) == [(0, 3, 0, 4, 11), (1, 3, 4, 4, 11), (2, 3, 8, 3, 11)]
    with pytest.raises(RuntimeError, match="outside"):
        get_ubatch()


def test_forced_split_runs_empty_ubatches_too():
    # In an EP group every rank must run every micro-batch (collectives), even with no tokens.
    runner = UBatchRunner(3)
    seen = []

    def fn(x):
        seen.append((get_ubatch().ubatch_id, x.shape[0]))
        return ubatch_yield(lambda: x + 1)

    out = runner.run(fn, torch.zeros(2, 3), split=True)
    assert torch.equal(out, torch.ones(2, 3)) and seen == [(0, 1), (1, 1), (2, 0)]


def test_interleaving_order_is_strict_and_deterministic():
    yields = [3, 1, 2]  # micro-batches that finish early drop out of the rotation
    runner = UBatchRunner(3, min_tokens=1)

    def fn(x):
        me = get_ubatch().ubatch_id
        for step in range(yields[me] + 1):
            time.sleep(random.random() * 2e-3)  # perturb the OS scheduling; the order must not move
            trace.append((me, step))
            if step < yields[me]:
                ubatch_yield()
        return x

    expected = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 3)]
    for _ in range(5):
        trace: list[tuple[int, int]] = []
        runner.run(fn, torch.zeros(3))
        assert trace == expected


@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("where", ["before_first_yield", "between_yields", "after_last_yield", "in_recv_hook"])
def test_exception_in_a_ubatch_surfaces_with_its_id_and_releases_everyone(failing, where):
    runner = UBatchRunner(2, min_tokens=1)

    def boom():
        raise KeyError(f"ubatch {failing} at {where}")

    def fn(x):
        me = get_ubatch().ubatch_id
        fail = me == failing
        if fail and where == "before_first_yield":
            boom()
        ubatch_yield(boom if fail and where == "in_recv_hook" else None)
        if fail and where == "between_yields":
            boom()
        yield_and_switch_to_comm()
        yield_and_switch_to_compute()
        if fail and where == "after_last_yield":
            boom()
        return x * 2

    with pytest.raises(UBatchError, match=f"micro-batch {failing} of 2") as info:
        runner.run(fn, torch.ones(6))
    assert info.value.ubatch_id == failing
    assert isinstance(info.value.__cause__, KeyError) and where in str(info.value.__cause__)
    assert _live_ubatch_threads() == []
    # The runner is usable again.
    assert torch.equal(runner.run(lambda x: x * 3, torch.ones(6)), torch.full((6,), 3.0))


def test_exception_swallowing_code_cannot_keep_running_after_an_abort():
    runner = UBatchRunner(2, min_tokens=1)
    after_abort = []

    def fn(x):
        me = get_ubatch().ubatch_id
        if me == 1:
            raise ValueError("first")
        try:
            ubatch_yield()
            ubatch_yield()
        except Exception:  # the abort is not an Exception: this must not catch it
            after_abort.append(me)
        return x

    with pytest.raises(UBatchError) as info:
        runner.run(fn, torch.ones(4))
    assert info.value.ubatch_id == 1 and after_abort == []


def test_runner_is_reusable_and_leaves_no_threads():
    runner = UBatchRunner(2, min_tokens=1)
    for i in range(30):
        x = torch.arange(float(i + 2))
        out = runner.run(lambda t: ubatch_yield(lambda: t * 2) + 1, x)
        assert torch.equal(out, x * 2 + 1)
    assert _live_ubatch_threads() == []


def test_recv_hooks_run_in_their_own_ubatch_when_it_resumes():
    runner = UBatchRunner(2, min_tokens=1)
    log: list[str] = []

    def fn(x):
        me = get_ubatch().ubatch_id
        register_recv_hook(lambda: log.append(f"hook{me}@{get_ubatch().ubatch_id}"))
        log.append(f"yield{me}")
        ubatch_yield()
        log.append(f"resume{me}")
        register_recv_hook(lambda: log.append(f"end{me}"))  # pending at the end: runs before finishing
        return x

    runner.run(fn, torch.zeros(2))
    assert log == ["yield0", "yield1", "hook0@0", "resume0", "end0", "hook1@1", "resume1", "end1"]
    outside: list[int] = []
    register_recv_hook(lambda: outside.append(1))
    assert outside == [1]


def test_grad_mode_reaches_ubatch_threads_and_backward_works():
    runner = UBatchRunner(2, min_tokens=1)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert not runner.run(lambda t: t @ w, x).requires_grad
    out = runner.run(lambda t: ubatch_yield(lambda: t @ w), x)
    out.square().sum().backward()
    torch.testing.assert_close(w.grad, 2 * x.T @ (x @ w.detach()))


def test_callers_grad_mode_holds_inside_the_ubatches():
    """The worker entered torch.inference_mode(False) for a caller outside inference mode, and that
    context switches grad mode ON: under torch.no_grad() every micro-batch recorded autograd graphs
    (and layers that ask `impl.grad_needed`, e.g. mHC's or MoE's inference-only kernels, took their
    autograd path or refused). The test above only looked at the concatenation, made on the caller's
    thread under no_grad."""
    from parallel.impl import grad_needed

    runner = UBatchRunner(2, min_tokens=1)
    w = torch.randn(4, 3, requires_grad=True)
    seen = []

    def fn(t):
        y = t @ w
        seen.append((torch.is_grad_enabled(), y.requires_grad, grad_needed(w), torch.is_inference_mode_enabled()))
        return y

    for mode, want in ((torch.no_grad, (False, False, False, False)), (torch.enable_grad, (True, True, True, False)),
                       (torch.inference_mode, (False, False, False, True))):
        seen.clear()
        with mode():
            runner.run(fn, torch.randn(6, 4))
        assert seen == [want, want], mode.__name__
    seen.clear()
    with torch.inference_mode(), torch.inference_mode(False), torch.no_grad():  # out of inference, no grad
        runner.run(fn, torch.randn(6, 4))
    assert seen == [(False, False, False, False)] * 2


def test_split_run_keeps_the_callers_default_device():
    """The default device (torch.set_default_device, `with torch.device(...)`) is thread-local like
    grad mode: a factory call without device= in a micro-batch made CPU tensors where the unsplit
    run, on the caller's thread, made them on the caller's default device."""
    runner = UBatchRunner(2, min_tokens=1)
    seen = []

    def fn(t):
        made = torch.ones(t.shape[0], 1)
        seen.append(made.device.type)
        return t + made

    with torch.device("meta"):
        x = torch.zeros(6, 3)
        want = fn(x)
        got = runner.run(fn, x, split=True)
    assert want.device.type == got.device.type == "meta" and got.shape == (6, 3)
    assert seen == ["meta"] * 3
    seen.clear()
    runner.run(fn, torch.zeros(6, 3), split=True)  # and none leaks into the next run
    assert seen == ["cpu"] * 2 and torch.get_default_device().type == "cpu"


def test_bad_inputs_raise_value_error():
    runner = UBatchRunner(2, min_tokens=1)
    with pytest.raises(ValueError, match="dim 0 = 4"):
        runner.run(lambda a, b: a, torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="at least one"):
        runner.run(lambda: None)
    with pytest.raises(UBatchError) as info:
        runner.run(lambda x: runner.run(lambda y: y, x), torch.zeros(4))
    assert isinstance(info.value.__cause__, RuntimeError) and "nested" in str(info.value.__cause__)


# ---- two gloo ranks: real collectives issued from micro-batch threads ----

def _ep_forward(x, topk_ids, topk_weights, *, dispatcher, w_up, w_down, group):
    """A MoE-like forward: dispatch -> per-expert matmuls -> combine, plus an all-reduce."""
    from parallel import comm

    res = ubatch_yield(dispatcher.dispatch(x, topk_ids, topk_weights, async_op=True).wait)
    rows = []
    start = 0
    for e, n in enumerate(res.counts.tolist()):
        rows.append(torch.relu(res.x[start:start + n] @ w_up[e]) @ w_down[e])
        start += n
    y = ubatch_yield(dispatcher.combine(torch.cat(rows), res.handle, async_op=True).wait)
    ctx = get_optional_ubatch()
    tag = torch.full((1,), float(ctx.ubatch_id + 1 if ctx else 0))
    total = ubatch_yield(comm.all_reduce(tag, group, async_op=True).wait)  # matched across ranks only in order
    return y, total.expand(x.shape[0])


def _rank_ep_cases(rank: int) -> list[str | None]:
    from parallel import ParallelConfig, init_parallel
    from parallel.ep import make_dispatcher

    groups = init_parallel(ParallelConfig(world_size=2))
    failures: list[str | None] = []
    try:
        hidden, inter, experts, top_k, tokens = 16, 8, 4, 2, 13 + rank  # ranks hold different token counts
        g = torch.Generator().manual_seed(100)
        w_up = torch.randint(-2, 3, (experts, hidden, inter), generator=g).float()
        w_down = torch.randint(-2, 3, (experts, inter, hidden), generator=g).float()
        lo = rank * (experts // 2)
        g_rank = torch.Generator().manual_seed(rank)
        x = torch.randint(-3, 4, (tokens, hidden), generator=g_rank).float()
        topk_ids = torch.stack([torch.randperm(experts, generator=g_rank)[:top_k] for _ in range(tokens)])
        topk_weights = torch.tensor([0.5, 0.25]).expand(tokens, top_k).contiguous()
        dispatcher = make_dispatcher(groups.ep, num_experts=experts, hidden=hidden)
        kw = dict(dispatcher=dispatcher, w_up=w_up[lo:lo + 2], w_down=w_down[lo:lo + 2], group=groups.world)
        want_y, _ = _ep_forward(x, topk_ids, topk_weights, **kw)
        for n in (2, 3):
            runner = UBatchRunner(n, min_tokens=1)
            for _ in range(3):
                try:
                    got_y, tags = runner.run(_ep_forward, x, topk_ids, topk_weights, split=True, **kw)
                    assert torch.equal(got_y, want_y), f"{n} ubatches: EP output differs"
                    sizes = split_tokens(tokens, n)
                    want_tags = torch.cat([torch.full((s,), 2.0 * (i + 1)) for i, s in enumerate(sizes)])
                    assert torch.equal(tags, want_tags), f"{n} ubatches: all-reduces matched out of order: {tags}"
                    failures.append(None)
                except Exception:
                    failures.append(traceback.format_exc())
    finally:
        from parallel import destroy_parallel

        destroy_parallel()
    return failures


def test_ep_forward_at_two_ranks_equals_unsplit_with_collectives_in_order():
    from launch.local import launch_local

    results = launch_local(_rank_ep_cases, 2, timeout=90)
    for rank, failures in enumerate(results):
        errors = [f for f in failures if f is not None]
        assert not errors, f"rank {rank}:\n{errors[0]}"
        assert len(failures) == 6


# ---- CUDA streams, one GPU ----

@pytest.mark.gpu
def test_cuda_streams_order_comm_after_compute_and_back():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(4096, 1024, device=dev)
    w = torch.randn(1024, 1024, device=dev) / 32
    streams_seen = []

    def fn(t):
        torch.cuda._sleep(20_000_000)  # a long kernel first: a missing event wait reads h too early
        h = t @ w
        switch_to_comm()
        streams_seen.append(("comm", torch.cuda.current_stream()))
        sent = h * 2  # stand-in for communication kernels on the comm stream
        got = yield_and_switch_to_compute(lambda: sent)
        streams_seen.append(("compute", torch.cuda.current_stream()))
        yield_and_switch_to_comm()
        back = got + 1
        out = yield_and_switch_to_compute(lambda: back)
        return out @ w

    want = ((x @ w) * 2 + 1) @ w
    runner = UBatchRunner(2, min_tokens=1)
    main_stream = torch.cuda.current_stream()
    for _ in range(3):
        streams_seen.clear()
        got = runner.run(fn, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(streams_seen) == 4
    for kind, stream in streams_seen:
        assert (stream == main_stream) == (kind == "compute"), kind
    assert torch.cuda.current_stream() == main_stream


@pytest.mark.gpu
def test_cuda_runner_with_ep1_dispatcher_on_the_comm_stream_equals_unsplit():
    from parallel.ep import make_dispatcher

    torch.manual_seed(1)
    dev = torch.device("cuda")
    tokens, hidden, inter, experts, top_k = 1000, 512, 256, 4, 2
    x = torch.randn(tokens, hidden, device=dev)
    topk_ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(dev)
    topk_weights = torch.rand(tokens, top_k, device=dev)
    w_up = torch.randn(experts, hidden, inter, device=dev) / hidden ** 0.5
    w_down = torch.randn(experts, inter, hidden, device=dev) / inter ** 0.5
    dispatcher = make_dispatcher(None, num_experts=experts, hidden=hidden)

    def forward(t, ids, w):
        h = torch.tanh(t)
        switch_to_comm()  # the documented pattern for communication issued on the current stream
        res = yield_and_switch_to_compute(dispatcher.dispatch(h, ids, w, async_op=True).wait)
        outs, start = [], 0
        for e, n in enumerate(res.counts.tolist()):
            outs.append(torch.relu(res.x[start:start + n] @ w_up[e]) @ w_down[e])
            start += n
        switch_to_comm()
        y = yield_and_switch_to_compute(dispatcher.combine(torch.cat(outs), res.handle, async_op=True).wait)
        return t + y

    with torch.no_grad():
        want = forward(x, topk_ids, topk_weights)
        runner = UBatchRunner(2, min_tokens=1)
        for _ in range(3):
            torch.testing.assert_close(runner.run(forward, x, topk_ids, topk_weights), want, rtol=1e-4, atol=1e-4)


def test_outputs_of_differing_structure_raise_instead_of_being_dropped():
    runner = UBatchRunner(2, min_tokens=1)

    def fn(x):
        first = get_ubatch().ubatch_id == 0
        return (x, x + 1) if first else (x, x + 1, x + 2)  # micro-batch 1 returns one more output

    with pytest.raises(ValueError, match=r"micro-batch 0 returned \('tuple', \('tensor', 'tensor'\)\), "
                                         r"micro-batch 1 returned \('tuple', \('tensor', 'tensor', 'tensor'\)\)"):
        runner.run(fn, torch.zeros(4), split=True)
    with pytest.raises(ValueError, match="micro-batch 1 returned None"):
        runner.run(lambda x: x if get_ubatch().ubatch_id == 0 else None, torch.zeros(4), split=True)
    out = runner.run(lambda x: [x, (x * 2, None)], torch.arange(4.0), split=True)  # same nested structure: kept
    assert torch.equal(out[0], torch.arange(4.0)) and torch.equal(out[1][0], torch.arange(4.0) * 2)


def test_named_tuple_outputs_are_concatenated_field_by_field():
    # A NamedTuple (e.g. model.mhc.MHCPre) was rebuilt from one generator argument: TypeError.
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor | None

    runner = UBatchRunner(3, min_tokens=1)
    x = torch.randn(7, 2)
    out = runner.run(lambda t: Pair(ubatch_yield(lambda: t * 2), None), x)
    assert type(out) is Pair and out.b is None and torch.equal(out.a, x * 2)
    nested = runner.run(lambda t: [Pair(t, t + 1)], x)
    assert type(nested[0]) is Pair and torch.equal(nested[0].b, x + 1)


def test_broken_barrier_error_raised_by_fn_is_a_failure_not_an_abort():
    # fn's own threading.BrokenBarrierError was taken for the runner's abort and dropped: the
    # run returned as if micro-batch 1 had succeeded.
    runner = UBatchRunner(2, min_tokens=1)
    done = []

    def fn(x):
        if get_ubatch().ubatch_id == 1:
            raise threading.BrokenBarrierError("fn's own barrier")
        done.append(0)

    with pytest.raises(UBatchError, match="micro-batch 1 of 2 failed: BrokenBarrierError") as info:
        runner.run(fn, torch.zeros(4))
    assert isinstance(info.value.__cause__, threading.BrokenBarrierError) and done == [0]
    assert _live_ubatch_threads() == []
    assert torch.equal(runner.run(lambda x: x + 1, torch.zeros(4)), torch.ones(4))


def test_yield_returns_its_own_hooks_result_not_a_registered_hooks():
    # Documented: ubatch_yield returns recv_hook()'s result, None without a hook. A hook queued by
    # register_recv_hook leaked its result into the next bare yield.
    runner = UBatchRunner(2, min_tokens=1)
    got = []

    def fn(x):
        register_recv_hook(lambda: "registered")
        got.append(ubatch_yield())
        register_recv_hook(lambda: "registered")
        got.append(yield_and_switch_to_comm())
        register_recv_hook(lambda: "registered")
        got.append(yield_and_switch_to_compute(lambda: "mine"))
        got.append(ubatch_yield(lambda: None))
        return x

    runner.run(fn, torch.zeros(4))
    assert got == [None, None, None, None, "mine", "mine", None, None]


def test_ubatch_error_survives_pickling():
    # Exceptions cross processes pickled (multiprocessing, Ray); the default reduce rebuilt
    # UBatchError from its message alone and loading raised TypeError.
    import pickle

    runner = UBatchRunner(2, min_tokens=1)
    with pytest.raises(UBatchError) as info:
        runner.run(lambda x: x if get_ubatch().ubatch_id == 0 else 1 / 0, torch.zeros(2))
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is UBatchError and str(back) == str(info.value) == (
        "micro-batch 1 of 2 failed: ZeroDivisionError: division by zero")
    assert (back.ubatch_id, back.num_ubatches, type(back.error)) == (1, 2, ZeroDivisionError)


def test_interrupted_caller_stops_the_ubatches_and_leaves_the_runner_usable(monkeypatch):
    # An exception raised in the calling thread while it waits (KeyboardInterrupt, a signal handler)
    # left the micro-batch threads running and then parked at the runner's barrier, where they
    # counted as parties of the next run. Now they stop at their next yield, as after a failure.
    import os
    import signal

    import parallel.ubatch as ubatch_module

    class Interrupt(Exception):
        pass

    def raise_interrupt(signum, frame):
        raise Interrupt()

    heard: list[BaseException] = []
    monkeypatch.setattr(ubatch_module, "_failure_listeners", [heard.append])
    runner = UBatchRunner(2, min_tokens=1)
    reached: list[int] = []

    def fn(x):
        me = get_ubatch().ubatch_id
        if me == 0:
            time.sleep(0.3)  # the caller is interrupted meanwhile
        reached.append(me)
        ubatch_yield()
        reached.append(me)
        return x

    previous = signal.signal(signal.SIGUSR1, raise_interrupt)
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupt):
            runner.run(fn, torch.zeros(4))
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert _live_ubatch_threads() == [] and reached == [0]  # micro-batch 1 never got the turn
    assert len(heard) == 1 and isinstance(heard[0], Interrupt)  # out-of-step collectives: listeners hear
    out: list[torch.Tensor] = []
    again = threading.Thread(target=lambda: out.append(runner.run(lambda x: ubatch_yield(lambda: x + 1),
                                                                  torch.zeros(4))), daemon=True)
    again.start()
    again.join(10)  # a hang (stale threads at the barrier) fails here instead of blocking the suite
    assert out and torch.equal(out[0], torch.ones(4))


# ---- failure listeners ----

def _failing(x):
    """A micro-batch fn whose micro-batch 1 raises ZeroDivisionError after one yield."""
    ubatch_yield()
    if get_ubatch().ubatch_id == 1:
        raise ZeroDivisionError("micro-batch 1 divides by zero")
    return x


def _in_thread(call, timeout: float = 10.0) -> list:
    """Run `call()` in a daemon thread; return [("ok", value)] or [("raised", exc)], or [] if it
    hangs past `timeout` (a deadlock fails the test instead of blocking the suite)."""
    out: list = []

    def target():
        try:
            out.append(("ok", call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(("raised", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return out


def test_a_failure_listener_may_run_the_runner_again(monkeypatch):
    # The listeners were called while the failed run still held the runner's (non-reentrant)
    # lock: a listener that ran the runner again, e.g. a recovery forward, deadlocked for good.
    import parallel.ubatch as ubatch_module

    runner = UBatchRunner(2, min_tokens=1)
    retried: list[torch.Tensor] = []
    heard: list[BaseException] = []

    def retry(error):
        retried.append(runner.run(lambda x: ubatch_yield(lambda: x + 1), torch.zeros(4)))

    monkeypatch.setattr(ubatch_module, "_failure_listeners", [retry, heard.append])
    out = _in_thread(lambda: runner.run(_failing, torch.zeros(4)))
    assert out, "the run whose failure listener re-entered the runner deadlocked"
    kind, error = out[0]
    assert kind == "raised" and isinstance(error, UBatchError) and error.ubatch_id == 1
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert len(retried) == 1 and torch.equal(retried[0], torch.ones(4))
    assert heard == [error] and _live_ubatch_threads() == []
    assert torch.equal(runner.run(lambda x: x * 2, torch.ones(4)), torch.full((4,), 2.0))


def test_a_listener_is_not_called_again_for_the_failure_of_its_own_retry(monkeypatch):
    # A listener whose own run fails sees that UBatchError itself; calling it again for it would
    # recurse (retry, fail, retry, ...) until the stack ran out. The other listeners hear both.
    import parallel.ubatch as ubatch_module

    runner = UBatchRunner(2, min_tokens=1)
    calls: list[BaseException] = []
    retry_errors: list[BaseException] = []
    heard: list[BaseException] = []

    def retry(error):
        calls.append(error)
        try:
            runner.run(_failing, torch.zeros(4))
        except UBatchError as again:
            retry_errors.append(again)

    monkeypatch.setattr(ubatch_module, "_failure_listeners", [retry, heard.append])
    out = _in_thread(lambda: runner.run(_failing, torch.zeros(4)))
    assert out and out[0][0] == "raised"
    outer = out[0][1]
    assert calls == [outer] and len(retry_errors) == 1
    assert heard == [retry_errors[0], outer]


def test_a_raising_listener_neither_stops_the_others_nor_masks_the_failure(monkeypatch, caplog):
    import parallel.ubatch as ubatch_module

    runner = UBatchRunner(2, min_tokens=1)
    heard: list[BaseException] = []

    def broken(error):
        raise RuntimeError("listener bug")

    monkeypatch.setattr(ubatch_module, "_failure_listeners", [broken, heard.append])
    with caplog.at_level("WARNING", logger="megapar"):
        with pytest.raises(UBatchError) as info:
            runner.run(_failing, torch.zeros(4))
    assert isinstance(info.value.__cause__, ZeroDivisionError) and heard == [info.value]
    assert any("listener bug" in note for note in getattr(info.value, "__notes__", [])) or not hasattr(
        info.value, "add_note")  # Python < 3.11 has no notes; the log below still says it
    assert "listener bug" in caplog.text and "broken" in caplog.text

    # A listener interrupted by a BaseException (KeyboardInterrupt, SystemExit): the others still
    # hear the failure (the EP dispatcher must poison its communication), then the interrupt
    # propagates with the failure as its context.
    class Stop(BaseException):
        pass

    def interrupted(error):
        raise Stop("ctrl-c in a listener")

    heard.clear()
    monkeypatch.setattr(ubatch_module, "_failure_listeners", [interrupted, heard.append])
    with pytest.raises(Stop) as stop:
        runner.run(_failing, torch.zeros(4))
    assert len(heard) == 1 and isinstance(heard[0], UBatchError)
    assert stop.value.__context__ is heard[0] and isinstance(heard[0].__cause__, ZeroDivisionError)
    assert _live_ubatch_threads() == []
    assert torch.equal(runner.run(lambda x: x + 1, torch.zeros(4)), torch.ones(4))


def test_a_thread_that_cannot_start_leaves_no_ubatch_parked(monkeypatch):
    # Thread.start() failing for micro-batch 1 ("can't start new thread") left micro-batch 0,
    # already started, waiting at the barrier forever, a party of the next run's barrier.
    import parallel.ubatch as ubatch_module

    monkeypatch.setattr(ubatch_module, "_failure_listeners", [])
    runner = UBatchRunner(2, min_tokens=1)
    real_start = threading.Thread.start

    def start(self):
        if self.name == "ubatch-1":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    x = torch.arange(6.0).unsqueeze(1)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        runner.run(lambda t: t * 2, x)
    assert not [t for t in threading.enumerate() if t.name.startswith("ubatch-")]
    monkeypatch.setattr(threading.Thread, "start", real_start)
    torch.testing.assert_close(runner.run(lambda t: t * 2, x), x * 2)   # the runner is usable again


def test_an_interrupt_inside_thread_start_leaves_no_stale_ubatch_for_the_next_run(monkeypatch):
    # The interrupt (Ctrl-C in a notebook, a signal handler) can land inside Thread.start after the
    # OS thread exists but before start() returns: that thread was not among those the caller
    # joined, and the caller reset the shared barrier behind it, so it parked at the barrier of
    # the next runs (a surplus party) and stayed alive for good.
    import parallel.ubatch as ubatch_module

    class Interrupt(Exception):
        pass

    heard: list[BaseException] = []
    monkeypatch.setattr(ubatch_module, "_failure_listeners", [heard.append])
    runner = UBatchRunner(2, min_tokens=1)
    real_start = threading.Thread.start

    def start(self):
        if self.name == "ubatch-0" and not getattr(start, "done", False):
            start.done = True
            target = self._target

            def scheduled_late(*args):
                time.sleep(0.2)  # created, not yet scheduled when the interrupt lands
                target(*args)

            self._target = scheduled_late
            real_start(self)
            raise Interrupt("signal in Thread.start")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    stale_ran: list[int] = []
    x = torch.arange(6.0)
    try:
        with pytest.raises(Interrupt):
            runner.run(lambda t: stale_ran.append(1) or t, x)
        assert len(heard) == 1 and isinstance(heard[0], Interrupt)
        # The next run, while the stale thread has not even started its work yet.
        out = _in_thread(lambda: runner.run(lambda t: ubatch_yield(lambda: t * (get_ubatch().ubatch_id + 1)), x))
        assert out and out[0][0] == "ok", out
        assert torch.equal(out[0][1], torch.tensor([0.0, 1, 2, 6, 8, 10]))
        deadline = time.monotonic() + 1.0
        while _live_ubatch_threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _live_ubatch_threads() == [] and stale_ran == []
        out = _in_thread(lambda: runner.run(lambda t: ubatch_yield(lambda: t + 1), x))
        assert out and out[0][0] == "ok" and torch.equal(out[0][1], x + 1), out
    finally:
        runner._barrier.abort()  # on failure, frees a thread parked there for the rest of the session


def test_malformed_arguments_raise_value_error_naming_them():
    # A 0-dim input 0 raised IndexError (its dim-0 check came after reading shape[0]); a non-tensor
    # token input (an argument meant for fn) raised AttributeError; mode was not looked at when
    # split= was given; min_tokens=NaN passed `< 1` and then never split; num_ubatches=2.0 was a
    # TypeError about list repetition, True a runner of one micro-batch.
    runner = UBatchRunner(2, min_tokens=1)
    with pytest.raises(ValueError, match=r"token input 0 is shape \(\)"):
        runner.run(lambda x: x, torch.tensor(1.0))
    with pytest.raises(ValueError, match="token input 1 is int; token inputs must be tensors"):
        runner.run(lambda x, k: x, torch.zeros(4), 3)
    with pytest.raises(ValueError, match="token input 0 is list"):
        runner.run(lambda x: x, [1.0, 2.0])
    for split in (True, False):
        with pytest.raises(ValueError, match=r"mode must be one of \('decode', 'prefill'\), got 'train'"):
            runner.run(lambda x: x, torch.zeros(4), mode="train", split=split)
    for kwargs, name in (({"min_tokens": float("nan")}, "min_tokens"), ({"min_tokens": 2.5}, "min_tokens"),
                         ({"num_ubatches": 2.0}, "num_ubatches"), ({"num_ubatches": True}, "num_ubatches"),
                         ({"decode_min_tokens": 0}, "decode_min_tokens")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1, got {kwargs[name]!r}"):
            UBatchRunner(**kwargs)
    assert torch.equal(runner.run(lambda x: x + 1, torch.zeros(4), mode="decode", split=True), torch.ones(4))
