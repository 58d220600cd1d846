"""Micro-batch overlap (dual-batch overlap): one micro-batch communicates while another computes.

`UBatchRunner.run(fn, *token_inputs)` splits the token inputs along dim 0 into micro-batches
and calls `fn` once per micro-batch, each in its own thread. The threads and the calling
thread meet at a `threading.Barrier(n + 1)` before and after; in between, exactly one
micro-batch thread holds *the turn* and issues work, and the turn moves in a fixed cyclic
order 0, 1, ..., n-1, 0, ... only at the yield points below. Because the order of every
collective a rank issues is then fixed by the program, all ranks issue the same collectives
in the same order (the precondition for gloo and NCCL), while the communication of one
micro-batch is in flight during another's compute.

Yield points, called by layers (all of them are no-ops outside a runner, so a layer calls
them unconditionally; a `recv_hook` then simply runs at once):

    ubatch_yield(recv_hook=None)          hand the turn to the next micro-batch; when it comes
                                          back, run `recv_hook()` and return its result.
    register_recv_hook(hook)              queue a hook for when this micro-batch next resumes
                                          (its next yield, or its end).
    switch_to_comm() / switch_to_compute()
                                          CUDA: continue on the other stream, after the work
                                          issued so far on this one (an event).
    yield_and_switch_to_comm(recv_hook=None) / yield_and_switch_to_compute(recv_hook=None)
                                          record, yield, then switch; the hook runs after the
                                          switch and its result is returned.

How the MoE layer yields around EP dispatch and combine (`parallel.ep` dispatchers take
`async_op=True` and return a handle whose `wait()` gives the result):

    pending = dispatcher.dispatch(x, topk_ids, topk_weights, async_op=True)
    res = ubatch_yield(recv_hook=pending.wait)         # the other micro-batch computes meanwhile
    expert_out = experts(res)
    pending = dispatcher.combine(expert_out, res.handle, async_op=True)
    y = ubatch_yield(recv_hook=pending.wait)

Collectives of torch.distributed (gloo, NCCL) run on their own threads/streams once launched
asynchronously, so this needs no stream switch and is where the overlap comes from (a
synchronous collective would block the thread that holds the turn). Communication issued
as kernels on the current stream (symmetric memory, DeepEP-style) goes on the comm stream:

    switch_to_comm()
    pending = launch_dispatch_kernels(...)
    res = yield_and_switch_to_compute(recv_hook=pending.wait)

Streams (CUDA): the compute stream is the caller's current stream on the token inputs' device
when `run` is called (so the outputs are ordered after the micro-batches without extra
synchronization); one comm stream per device is shared by all micro-batches. The token inputs
must all be on one device: `run` refuses others with a ValueError naming each input's device,
split or not, before any thread starts. An event is recorded *before* yielding, never after:
after the turn comes back the stream also holds the other micro-batch's work, and waiting on
that would serialize the two. The tensors a hook returns to `yield_and_switch_to_compute` are
marked as used on the compute stream; any other tensor made on one stream and used on the other
needs `record_stream(...)` (or to stay alive until the next switch back), as in any
multi-stream code.

Splitting: only when the batch has at least `min_tokens` tokens (defaults: 32 for decode,
512 for prefill); below that `fn` runs once on the calling thread with no runner active.
In a multi-rank job every rank of the group must take the same decision and have the same
number of micro-batches (pass `split=` computed from a max over ranks); micro-batches may
then be empty on some ranks and still take part in the collectives.

Failure: an exception in any micro-batch aborts the barrier and wakes every waiting thread,
which unwinds; the caller gets `UBatchError` (with `.ubatch_id`, the original exception as
`__cause__`), no thread is left behind, and the runner can be used again. The other
micro-batches stopped at arbitrary points, so collectives they left in flight are out of step
with the peers' (whose micro-batches did not stop): before raising, the runner calls the
listeners registered with `add_failure_listener` (the EP dispatcher poisons its communication
there, so that its next use raises rather than pairing with the peers' old collectives). An
exception in the calling thread while it waits (KeyboardInterrupt) stops the micro-batches the
same way at their next yield; the listeners get that exception, and it propagates unchanged (a
thread whose `start()` the interrupt cut short is not joined: it finds its run aborted and ends
on its own, without touching the runner's next run).
The listeners run on the caller's thread once every micro-batch thread has ended and the runner
is released, so a listener may run this runner (or another) again; see `add_failure_listener`
for what happens when a listener raises or its own run fails.

Thread-local state of the caller is reproduced in every micro-batch thread, as a layer sees it
unsplit: grad and inference mode, autocast, the default device, torch's thread count, the
innermost `torch.autograd.graph.saved_tensors_hooks` pair (activation offloading and
checkpointing pack through it) and `disable_saved_tensors_hooks`, and the active TorchFunctionMode
and TorchDispatchMode stacks (the caller's mode objects themselves; the concatenation of the
outputs, on the caller's thread, also runs under them).

Outputs: every micro-batch must return the same structure (a tensor, or a tuple/list of the same
length and kinds, or None); a mismatch raises ValueError naming both. Each tensor output must have
the same dtype, device and shape past dim 0 in every micro-batch (torch.cat would promote mixed
dtypes silently); a mismatch raises ValueError naming the micro-batches, the output's place
("output[1]") and the two values, before anything is concatenated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch

from .comm import even_split
from .log import get_logger

__all__ = [
    "UBatchRunner",
    "UBatchContext",
    "UBatchError",
    "split_tokens",
    "get_ubatch",
    "get_optional_ubatch",
    "ubatch_yield",
    "register_recv_hook",
    "yield_and_switch_to_comm",
    "yield_and_switch_to_compute",
    "switch_to_comm",
    "switch_to_compute",
    "record_stream",
    "add_failure_listener",
]

log = get_logger(__name__)

Mode = Literal["decode", "prefill"]
_MODES = ("decode", "prefill")


class UBatchError(RuntimeError):
    """A micro-batch raised. `ubatch_id` names it; the original exception is `__cause__`."""

    def __init__(self, ubatch_id: int, num_ubatches: int, error: BaseException) -> None:
        super().__init__(f"micro-batch {ubatch_id} of {num_ubatches} failed: {type(error).__name__}: {error}")
        self.ubatch_id = ubatch_id
        self.num_ubatches = num_ubatches
        self.error = error

    def __reduce__(self):
        # pickle's default rebuilds an exception from its message alone, which this __init__ refuses
        # (a UBatchError sent between processes, e.g. by Ray or multiprocessing, failed to load).
        return (type(self), (self.ubatch_id, self.num_ubatches, self.error))


class _Aborted(BaseException):
    """Unwinds a micro-batch thread after another one failed (BaseException: user code that
    catches Exception must not swallow it and go on issuing work out of turn)."""


@dataclass
class UBatchContext:
    """What a layer may ask about the micro-batch it runs in (`get_ubatch()`)."""

    ubatch_id: int
    """0-based index; the turn order."""
    num_ubatches: int
    token_offset: int
    """First token of this micro-batch in the full batch."""
    num_tokens: int
    total_tokens: int
    """Tokens of the full batch."""
    _runner: UBatchRunner = field(repr=False)
    _hooks: list[Callable[[], Any]] = field(default_factory=list, repr=False)
    _on_comm: bool = field(default=False, repr=False)
    _barrier: threading.Barrier | None = field(default=None, repr=False)
    """The barrier of this micro-batch's run (each run has its own; see `UBatchRunner._reset`)."""
    _generation: int = field(default=0, repr=False)

    @property
    def token_slice(self) -> slice:
        """Rows of this micro-batch in full-batch tensors (e.g. per-token metadata)."""
        return slice(self.token_offset, self.token_offset + self.num_tokens)


_local = threading.local()

_failure_listeners: list[Callable[[BaseException], None]] = []
_notifying = threading.local()
"""`.active`: the listeners running on this thread now (see `_notify_failure`)."""


def add_failure_listener(listener: Callable[[BaseException], None]) -> None:
    """Call `listener(ubatch_error)` whenever a split run fails, before the caller sees the
    `UBatchError`; when the caller itself is interrupted while it waits (e.g. KeyboardInterrupt),
    `listener(that exception)`. For layers that keep collective state across calls.

    Listeners run on the caller's thread after every micro-batch thread ended and after the
    runner was released, so a listener may call `UBatchRunner.run` again (a recovery forward, a
    retry): that run works as any other. If that run fails too, the other listeners hear its
    `UBatchError` first, but the listener itself is not called again for it (it gets the error
    from its own `run` call; calling it again would recurse for as long as the retry fails).

    A listener that raises an Exception does not stop the others and does not replace the
    failure the caller sees: its exception is logged (logger "megapar.parallel.ubatch") and added
    as a note to the failure. One that raises a BaseException that is not an Exception
    (KeyboardInterrupt, SystemExit) also lets the remaining listeners run, then propagates in
    place of the failure, which stays reachable as its `__context__`.
    """
    if listener not in _failure_listeners:
        _failure_listeners.append(listener)


def _notify_failure(error: BaseException) -> None:
    """Call every failure listener with `error` (see `add_failure_listener` for the rules).

    Skips the listeners already running on this thread: `error` is then the failure of a run
    that one of them started, and that listener sees it raised by its own call."""
    active: list[Callable[[BaseException], None]] = getattr(_notifying, "active", None) or []
    _notifying.active = active
    interrupt: BaseException | None = None
    for listener in list(_failure_listeners):
        if any(listener is running for running in active):
            continue
        active.append(listener)
        try:
            listener(error)
        except Exception as exc:  # noqa: BLE001 - the failure is what the caller must see
            name = getattr(listener, "__qualname__", repr(listener))
            log.warning("ubatch failure listener %s raised while handling %s: %s: %s", name,
                        type(error).__name__, type(exc).__name__, exc, exc_info=exc)
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"ubatch failure listener {name} raised {type(exc).__name__}: {exc}")
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: raised after the others ran
            if interrupt is None:
                interrupt = exc
        finally:
            active.pop()
    if interrupt is not None:
        if interrupt.__context__ is None:
            interrupt.__context__ = error
        raise interrupt


def get_optional_ubatch() -> UBatchContext | None:
    """The micro-batch the calling thread runs, or None outside a runner."""
    return getattr(_local, "ctx", None)


def get_ubatch() -> UBatchContext:
    """The micro-batch the calling thread runs; raises RuntimeError outside a runner."""
    ctx = get_optional_ubatch()
    if ctx is None:
        raise RuntimeError("get_ubatch() called outside a UBatchRunner micro-batch")
    return ctx


def split_tokens(num_tokens: int, num_ubatches: int) -> list[int]:
    """Near-equal micro-batch sizes, earlier ones larger: split_tokens(7, 2) == [4, 3] (`comm.even_split`)."""
    if num_ubatches < 1:
        raise ValueError(f"need num_ubatches >= 1, got {num_ubatches}")
    return even_split(num_tokens, num_ubatches)


# ---- yield points (no-ops outside a runner) -------------------------------------------------

def ubatch_yield(recv_hook: Callable[[], Any] | None = None) -> Any:
    """Hand the turn to the next micro-batch; on return run `recv_hook` (and queued hooks).

    Returns `recv_hook()`'s result (None without a hook). Outside a runner: runs the hook now.
    """
    ctx = get_optional_ubatch()
    if ctx is None:
        return recv_hook() if recv_hook is not None else None
    if recv_hook is not None:
        ctx._hooks.append(recv_hook)
    ctx._runner._yield_turn(ctx)
    return _run_hooks(ctx, recv_hook)


def register_recv_hook(hook: Callable[[], Any]) -> None:
    """Queue `hook` to run when this micro-batch next resumes (next yield, or when it ends).

    Outside a runner nothing will resume later, so the hook runs now.
    """
    ctx = get_optional_ubatch()
    if ctx is None:
        hook()
    else:
        ctx._hooks.append(hook)


def switch_to_comm() -> None:
    """Continue on the comm stream, after everything issued so far on the compute stream."""
    ctx = get_optional_ubatch()
    if ctx is not None and not ctx._on_comm:
        ctx._runner._switch(ctx, to_comm=True, event=ctx._runner._record())


def switch_to_compute() -> None:
    """Continue on the compute stream, after everything issued so far on the comm stream."""
    ctx = get_optional_ubatch()
    if ctx is not None and ctx._on_comm:
        ctx._runner._switch(ctx, to_comm=False, event=ctx._runner._record())


def yield_and_switch_to_comm(recv_hook: Callable[[], Any] | None = None) -> Any:
    """Yield (another micro-batch computes meanwhile), then continue on the comm stream.

    Returns `recv_hook()`'s result, run after the switch (None without a hook)."""
    return _yield_and_switch(to_comm=True, recv_hook=recv_hook)


def yield_and_switch_to_compute(recv_hook: Callable[[], Any] | None = None) -> Any:
    """Yield (another micro-batch issues work meanwhile), then continue on the compute stream.

    `recv_hook` (e.g. the `wait` of an async dispatch) runs after the switch, so a collective's
    `wait()` orders the compute stream after it; tensors it returns (directly, in a tuple or in
    a dataclass) are marked as used on the compute stream (`record_stream`). Returns its result.
    """
    return _yield_and_switch(to_comm=False, recv_hook=recv_hook)


def record_stream(*tensors: torch.Tensor) -> None:
    """Tell the CUDA caching allocator that `tensors` are used on the current stream (so
    freeing them on their allocation stream waits for that use). No-op off CUDA/outside a runner."""
    ctx = get_optional_ubatch()
    if ctx is None or ctx._runner._streams is None:
        return
    stream = torch.cuda.current_stream()
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)


def _yield_and_switch(*, to_comm: bool, recv_hook: Callable[[], Any] | None) -> Any:
    ctx = get_optional_ubatch()
    if ctx is None:
        return recv_hook() if recv_hook is not None else None
    runner = ctx._runner
    event = runner._record()  # before yielding: only this micro-batch's work (see docstring)
    if recv_hook is not None:
        ctx._hooks.append(recv_hook)
    runner._yield_turn(ctx)
    runner._switch(ctx, to_comm=to_comm, event=event)
    result = _run_hooks(ctx, recv_hook)
    if runner._streams is not None and not to_comm:
        _record_tensors(result, torch.cuda.current_stream(), depth=2)
    return result


def _record_tensors(obj: Any, stream: Any, depth: int) -> None:
    """record_stream on the CUDA tensors in obj (a tensor, tuple/list or dataclass, nested `depth` deep)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif depth > 0 and isinstance(obj, (tuple, list)):
        for item in obj:
            _record_tensors(item, stream, depth - 1)
    elif depth > 0 and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _record_tensors(getattr(obj, f.name), stream, depth - 1)


def _run_hooks(ctx: UBatchContext, recv_hook: Callable[[], Any] | None = None) -> Any:
    """Run the queued hooks in order; return `recv_hook`'s result (None without one: the results
    of hooks queued by `register_recv_hook` are not the yield's)."""
    result = None
    while ctx._hooks:
        hook = ctx._hooks.pop(0)
        value = hook()
        if recv_hook is not None and hook is recv_hook:
            result = value
    return result


# ---- the runner -----------------------------------------------------------------------------

@dataclass
class _Streams:
    device: torch.device
    compute: Any  # torch.cuda.Stream
    comm: Any


class UBatchRunner:
    """Runs a forward over `num_ubatches` micro-batches with strict turn-taking.

    num_ubatches: micro-batches per split batch (>= 1; 1 never splits).
    min_tokens: split only batches of at least this many tokens; overrides the two below.
    decode_min_tokens / prefill_min_tokens: the thresholds per `mode` when min_tokens is None.
    """

    def __init__(self, num_ubatches: int = 2, *, min_tokens: int | None = None,
                 decode_min_tokens: int = 32, prefill_min_tokens: int = 512) -> None:
        # Integers only: NaN passed `< 1` and then never split (every comparison with it is False),
        # and a float num_ubatches failed inside as a TypeError about list repetition.
        for name, value in (("num_ubatches", num_ubatches), ("min_tokens", min_tokens),
                            ("decode_min_tokens", decode_min_tokens), ("prefill_min_tokens", prefill_min_tokens)):
            if value is None and name == "min_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_ubatches = num_ubatches
        self.min_tokens = min_tokens
        self.decode_min_tokens = decode_min_tokens
        self.prefill_min_tokens = prefill_min_tokens
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # one run at a time
        self._comm_streams: dict[torch.device, Any] = {}
        self._generation = 0
        self._reset()

    def _reset(self) -> None:
        # A fresh barrier and generation per run: a thread of an interrupted run that was started
        # but never recorded (the interrupt landed inside Thread.start, after the OS thread existed)
        # still finds its own run's barrier broken and leaves, instead of parking at a barrier the
        # next run waits at (as a surplus party) and then running its stale fn in that run's turns.
        with self._cond:
            self._generation += 1
            self._barrier = threading.Barrier(self.num_ubatches + 1)
            self._turn = 0
            self._finished = [False] * self.num_ubatches
            self._aborted = False
            self._error: tuple[int, BaseException] | None = None
            self._streams: _Streams | None = None

    # -- splitting --

    def threshold(self, mode: Mode = "prefill") -> int:
        """Smallest batch (tokens) that is split in `mode`."""
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if self.min_tokens is not None:
            return self.min_tokens
        return self.decode_min_tokens if mode == "decode" else self.prefill_min_tokens

    def should_split(self, num_tokens: int, mode: Mode = "prefill") -> bool:
        """True when a batch of `num_tokens` is split into micro-batches."""
        return self.num_ubatches > 1 and num_tokens >= max(self.threshold(mode), self.num_ubatches)

    # -- running --

    def run(self, fn: Callable[..., Any], *token_inputs: torch.Tensor, mode: Mode = "prefill",
            split: bool | None = None, **kwargs: Any) -> Any:
        """Call `fn(*slices, **kwargs)` per micro-batch and concatenate the outputs along dim 0.

        token_inputs: tensors [T, ...] sharing T and a device; each micro-batch gets rows of its token range.
        kwargs: passed unchanged to every call. split: force the decision (same on all ranks);
        None = `should_split(T, mode)`. fn returns a tensor [t, ...], a tuple/list of them,
        or None; the result has the same structure over the whole batch.
        """
        if mode not in _MODES:  # also with split= given, where should_split does not look at it
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if not token_inputs:
            raise ValueError("run() needs at least one token input tensor [T, ...]")
        for i, t in enumerate(token_inputs):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"token input {i} is {got}; token inputs must be tensors [T, ...] with the "
                                 "tokens along dim 0 (pass other arguments to fn as keyword arguments)")
        num_tokens = token_inputs[0].shape[0]
        for i, t in enumerate(token_inputs):
            if t.shape[0] != num_tokens:
                raise ValueError(f"token input {i} has shape {tuple(t.shape)}; every token input needs "
                                 f"dim 0 = {num_tokens} (the token count of input 0)")
        device = token_inputs[0].device
        if any(t.device != device for t in token_inputs):
            # The streams (the caller's current stream and the comm stream) and the micro-batch threads'
            # current CUDA device are those of one device; input 0's were used for all of them.
            each = ", ".join(f"token input {i} on {t.device}" for i, t in enumerate(token_inputs))
            raise ValueError(f"token inputs are on different devices: {each}; every token input must be on one "
                             "device (its streams are the micro-batches' streams)")
        if split is None:
            split = self.should_split(num_tokens, mode)
        if not split or self.num_ubatches == 1:
            return fn(*token_inputs, **kwargs)
        if get_optional_ubatch() is not None:
            raise RuntimeError("UBatchRunner.run() cannot be nested inside a micro-batch")
        with self._lock:
            result, failure = self._run_split(fn, token_inputs, kwargs, device)
        if failure is not None:
            # Outside the lock: a listener that runs this runner again would otherwise wait
            # forever for the lock its own caller holds.
            _notify_failure(failure)
            raise failure
        return _concat(result)

    def _run_split(self, fn: Callable[..., Any], token_inputs: Sequence[torch.Tensor], kwargs: dict[str, Any],
                   device: torch.device) -> tuple[list[Any], BaseException | None]:
        """Run the micro-batches; return (their outputs, None), or (_, the exception `run` must
        raise after calling the failure listeners): a UBatchError, or what interrupted the caller."""
        n = self.num_ubatches
        num_tokens = token_inputs[0].shape[0]
        sizes = split_tokens(num_tokens, n)
        self._reset()
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._streams = _Streams(device, torch.cuda.current_stream(device), self._comm_stream(device))
        barrier = self._barrier
        results: list[Any] = [None] * n
        modes = _thread_modes()
        threads = []
        offset = 0
        for i, size in enumerate(sizes):
            ctx = UBatchContext(ubatch_id=i, num_ubatches=n, token_offset=offset, num_tokens=size,
                                total_tokens=num_tokens, _runner=self, _barrier=barrier,
                                _generation=self._generation)
            slices = tuple(t[offset:offset + size] for t in token_inputs)
            threads.append(threading.Thread(target=self._worker, args=(ctx, fn, slices, kwargs, results, modes),
                                            name=f"ubatch-{i}", daemon=True))
            offset += size
        started: list[threading.Thread] = []
        try:
            for t in threads:
                t.start()
                started.append(t)
            barrier.wait()  # every micro-batch is set up
            barrier.wait()  # every micro-batch is done
        except threading.BrokenBarrierError:
            pass
        except BaseException as interrupt:
            # The caller was interrupted while it waited (KeyboardInterrupt, a signal handler), or a
            # thread could not start ("can't start new thread"): stop the micro-batches at their next
            # yield as after a failure, so that none runs on or stays parked at the barrier (where it
            # would count as a party of the next run).
            with self._cond:
                self._aborted = True
                self._cond.notify_all()
            barrier.abort()
            self._end(started)
            return results, interrupt
        self._end(threads)
        error = self._error
        if error is not None:
            ubatch_id, exc = error
            failure = UBatchError(ubatch_id, n, exc)
            failure.__cause__ = exc  # as `raise failure from exc`
            return results, failure
        return results, None

    def _end(self, threads: list[threading.Thread]) -> None:
        for t in threads:
            t.join()
        self._streams = None  # the barrier stays as it is: the next run makes its own

    def _worker(self, ctx: UBatchContext, fn: Callable[..., Any], slices: tuple[torch.Tensor, ...],
                kwargs: dict[str, Any], results: list[Any], modes: dict[str, Any]) -> None:
        _local.ctx = ctx
        streams = self._streams
        torch.set_grad_enabled(modes["grad"])  # grad mode is thread-local: copy the caller's
        torch.set_num_threads(modes["threads"])  # OpenMP's count is per OS thread; a new one uses every core
        try:
            # Only a caller in inference mode is followed into it: torch.inference_mode(False) is not a
            # no-op but switches grad mode on, which would undo a caller's no_grad.
            inference = torch.inference_mode() if modes["inference"] else contextlib.nullcontext()
            with inference, contextlib.ExitStack() as autocast:
                for device_type, dtype, cache in modes["autocast"]:  # autocast is thread-local too
                    autocast.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
                if modes["device"] is not None:  # and so is the default device of factory calls
                    autocast.enter_context(torch.device(modes["device"]))
                if streams is not None:
                    torch.cuda.set_device(streams.device)
                    torch.cuda.set_stream(streams.compute)
                _enter_mode_stacks(autocast, modes)
                try:
                    ctx._barrier.wait()
                except threading.BrokenBarrierError:  # ours only: one raised by fn is a failure
                    raise _Aborted() from None
                self._wait_turn(ctx)
                results[ctx.ubatch_id] = fn(*slices, **kwargs)
                _run_hooks(ctx)
                switch_to_compute()
        except _Aborted:
            pass
        except BaseException as exc:  # surfaces in the caller as UBatchError
            self._abort(ctx, exc)
        finally:
            _local.ctx = None
            self._finish(ctx)
        try:
            ctx._barrier.wait()
        except threading.BrokenBarrierError:
            pass

    def _wait_turn(self, ctx: UBatchContext) -> None:
        with self._cond:
            while self._turn != ctx.ubatch_id and not self._aborted and ctx._generation == self._generation:
                self._cond.wait()
            if self._aborted or ctx._generation != self._generation:
                raise _Aborted()

    def _next_live(self, ubatch_id: int) -> int:
        n = self.num_ubatches
        for step in range(1, n + 1):
            j = (ubatch_id + step) % n
            if not self._finished[j]:
                return j
        return ubatch_id

    def _yield_turn(self, ctx: UBatchContext) -> None:
        with self._cond:
            if self._aborted or ctx._generation != self._generation:
                raise _Aborted()
            self._turn = self._next_live(ctx.ubatch_id)
            self._cond.notify_all()
        self._wait_turn(ctx)

    def _finish(self, ctx: UBatchContext) -> None:
        ubatch_id = ctx.ubatch_id
        with self._cond:
            if ctx._generation != self._generation:  # a thread of an earlier run: not this run's state
                return
            self._finished[ubatch_id] = True
            if self._turn == ubatch_id:
                self._turn = self._next_live(ubatch_id)
            self._cond.notify_all()

    def _abort(self, ctx: UBatchContext, exc: BaseException) -> None:
        with self._cond:
            if ctx._generation != self._generation:  # a thread of an earlier run: not this run's state
                return
            if self._error is None:
                self._error = (ctx.ubatch_id, exc)
            self._aborted = True
            self._cond.notify_all()
        ctx._barrier.abort()

    # -- CUDA streams --

    def _comm_stream(self, device: torch.device) -> Any:
        if device not in self._comm_streams:
            self._comm_streams[device] = torch.cuda.Stream(device)
        return self._comm_streams[device]

    def _record(self) -> Any:
        """An event at the end of the current stream's work (None off CUDA)."""
        if self._streams is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event

    def _switch(self, ctx: UBatchContext, *, to_comm: bool, event: Any) -> None:
        ctx._on_comm = to_comm
        if self._streams is None:
            return
        stream = self._streams.comm if to_comm else self._streams.compute
        stream.wait_event(event)
        torch.cuda.set_stream(stream)


def _thread_modes() -> dict[str, Any]:
    """Thread-local torch modes of the caller, to be reproduced in the micro-batch threads."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return {"grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
            "threads": torch.get_num_threads(),
            # a new thread's default device is the CPU; follow the caller's only where it is not
            "device": None if (device := torch.get_default_device()).type == "cpu" else device,
            "autocast": [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
                         for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)],
            # torch.autograd.graph.saved_tensors_hooks (activation offloading, checkpointing): only the
            # innermost pair applies, so it is all a thread needs; and disable_saved_tensors_hooks' message
            "saved_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
            "saved_hooks_disabled": torch._C._autograd._saved_tensors_hooks_get_disabled_error_message(),
            # TorchDispatchMode / TorchFunctionMode stacks, bottom first. The default device's
            # DeviceContext is a function mode too; "device" above enters it (it sits at the bottom).
            "dispatch_modes": _get_current_dispatch_mode_stack(),
            "function_modes": [m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext)]}


def _enter_mode_stacks(stack: contextlib.ExitStack, modes: dict[str, Any]) -> None:
    """Push the caller's torch function and dispatch modes and saved-tensor hooks (`_thread_modes`)
    on this thread, undone by `stack`.

    The mode objects are the caller's own, pushed as they are (not entered again: a mode's
    `__enter__` may reset its state, e.g. a counter's); turn-taking means no two micro-batches run
    in a mode's Python code at once. They are popped before the thread ends, while Python can
    still release them."""
    from torch import overrides
    from torch.utils import _python_dispatch

    for mode in modes["function_modes"]:
        overrides._push_mode(mode)
        stack.callback(overrides._pop_mode)
    for mode in modes["dispatch_modes"]:
        _python_dispatch._push_mode(mode)
        # an infrastructure mode (FakeTensorMode, ...) has its own slot, named by its _mode_key
        stack.callback(_python_dispatch._pop_mode, getattr(mode, "_mode_key", None))
    if modes["saved_hooks"] is not None:
        torch._C._autograd._push_saved_tensors_default_hooks(*modes["saved_hooks"])
        stack.callback(torch._C._autograd._pop_saved_tensors_default_hooks)
    if modes["saved_hooks_disabled"] is not None:
        torch._C._autograd._saved_tensors_hooks_disable(modes["saved_hooks_disabled"])
        stack.callback(torch._C._autograd._saved_tensors_hooks_enable)


def _structure(obj: Any) -> Any:
    """The shape of an output tree: 'tensor', None, or (type name, children); else the type name."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_structure(item) for item in obj))
    return type(obj).__name__


def _concat(results: list[Any]) -> Any:
    first = results[0]
    want = _structure(first)
    for i, r in enumerate(results[1:], start=1):
        if _structure(r) != want:
            raise ValueError(f"micro-batch outputs differ in structure: micro-batch 0 returned {want}, "
                             f"micro-batch {i} returned {_structure(r)}; every micro-batch must return the same "
                             "structure (a tensor, a tuple/list of them, or None)")
    _check_tensors(results, "output")  # all of it before any torch.cat
    return _concat_same(results)


def _check_tensors(results: list[Any], where: str) -> None:
    """Refuse tensors that torch.cat would not join as one output: a 0-dim one, or ones that differ
    in dtype (torch.cat promotes: bf16 from micro-batch 0 and fp32 from 1 gave fp32), device or
    shape past dim 0 (torch.cat's own message names neither the micro-batch nor the output).
    `where` names the output's place in the structure, e.g. "output[1][0]"."""
    first = results[0]
    if isinstance(first, torch.Tensor):
        for i, r in enumerate(results):
            if r.dim() == 0:
                raise ValueError(f"micro-batch {i} returned a 0-dim tensor as {where}; outputs need the "
                                 "tokens along dim 0")
        for i, r in enumerate(results[1:], start=1):
            for what, a, b, same in (("dtype", first.dtype, r.dtype, first.dtype == r.dtype),
                                     ("device", first.device, r.device, first.device == r.device),
                                     ("shape past dim 0", tuple(first.shape), tuple(r.shape),
                                      first.shape[1:] == r.shape[1:])):
                if not same:
                    raise ValueError(f"micro-batch outputs differ in {what} at {where}: micro-batch 0 returned "
                                     f"{a}, micro-batch {i} returned {b}; every micro-batch must return the same "
                                     "dtype, device and shape past dim 0 for each output")
    elif isinstance(first, (tuple, list)):
        fields = getattr(first, "_fields", None) if isinstance(first, tuple) else None
        for k in range(len(first)):
            _check_tensors([r[k] for r in results], f"{where}.{fields[k]}" if fields else f"{where}[{k}]")


def _concat_same(results: list[Any]) -> Any:
    first = results[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(results, dim=0)
    if isinstance(first, (tuple, list)):
        items = [_concat_same([r[k] for r in results]) for k in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # a NamedTuple takes its fields as arguments
            return type(first)(*items)
        return type(first)(items)
    raise TypeError(f"micro-batch fn must return a tensor, a tuple/list of tensors, or None; got {type(first).__name__}")
