"""Wall-clock accounting per phase (prefill, decode) and per primitive (ring, dcp, dispatch, ...).

`Timer.span(name)` adds the time of a block to `(phase, name)`; `wrap` / `wrap_async` time a
callable (for async ones, the call and the handle's `wait()` are both counted, so an overlapped
transfer shows only its exposed part). Spans from micro-batch threads overlap in wall time and
are summed, so with `--ubatch` the per-primitive total can exceed the phase time.

On CUDA every span synchronizes the device at its start and end, so each primitive's time is
its own and not that of queued kernels; this serializes the GPU (the demo is a correctness
run; the benchmarks measure speed).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


@dataclass
class Timer:
    """Accumulated seconds and call counts per (phase, primitive)."""

    sync_cuda: bool = False
    phase: str = "setup"
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _sync(self) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize()

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[(self.phase, name)] += seconds
            self.calls[(self.phase, name)] += 1

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.add(name, time.perf_counter() - start)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, timed under `name`."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.span(name):
                return fn(*args, **kwargs)

        return timed

    def wrap_async(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn returning a handle with `wait()`: times the call and the wait under `name`."""
        timer = self

        class _TimedHandle:
            def __init__(self, handle: Any) -> None:
                self._handle = handle

            def wait(self) -> Any:
                with timer.span(name):
                    return self._handle.wait()

            def __getattr__(self, item: str) -> Any:
                return getattr(self._handle, item)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.span(name):
                out = fn(*args, **kwargs)
            return _TimedHandle(out) if kwargs.get("async_op") else out

        return timed

    def as_dict(self) -> dict[str, dict[str, tuple[float, int]]]:
        """{phase: {primitive: (seconds, calls)}} (plain data, picklable)."""
        out: dict[str, dict[str, tuple[float, int]]] = {}
        for (phase, name), secs in self.seconds.items():
            out.setdefault(phase, {})[name] = (secs, self.calls[(phase, name)])
        return out
