"""UBatchRunner.run (parallel/ubatch.py): token inputs on one device, micro-batch outputs that
torch.cat must not join silently, and the caller's thread-local autograd hooks and torch modes
inside the micro-batch threads. CPU (and meta) only."""

from __future__ import annotations

import threading
from typing import NamedTuple

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from parallel.ubatch import UBatchError, UBatchRunner, get_optional_ubatch, get_ubatch, ubatch_yield


def _where() -> str:
    ctx = get_optional_ubatch()
    return f"ubatch {ctx.ubatch_id}" if ctx is not None else threading.current_thread().name


def test_token_inputs_on_different_devices_are_refused_before_any_thread_starts():
    # The streams and the threads' current device came from input 0 alone: a second input on
    # another device went into the micro-batches unnoticed (and on CUDA onto another device's work
    # ordered by the wrong streams).
    runner = UBatchRunner(2, min_tokens=1)
    calls = []

    def fn(x, *rest):
        calls.append(_where())
        return x

    for split in (True, False):
        with pytest.raises(ValueError, match=r"token inputs are on different devices: token input 0 on cpu, "
                                             r"token input 1 on meta, token input 2 on cpu"):
            runner.run(fn, torch.zeros(4), torch.zeros(4, device="meta"), torch.zeros(4), split=split)
    assert calls == []
    assert torch.equal(runner.run(fn, torch.zeros(4), torch.ones(4), split=True), torch.zeros(4))


def test_outputs_differing_in_dtype_device_or_shape_are_refused():
    # torch.cat promoted bf16 from micro-batch 0 and fp32 from micro-batch 1 to an fp32 result.
    runner = UBatchRunner(2, min_tokens=1)

    def by_ubatch(first, other):
        return lambda x: first(x) if get_ubatch().ubatch_id == 0 else other(x)

    x = torch.arange(4.0)
    cases = [
        (by_ubatch(lambda t: t.bfloat16(), lambda t: t), r"differ in dtype at output: micro-batch 0 returned "
                                                         r"torch.bfloat16, micro-batch 1 returned torch.float32"),
        (by_ubatch(lambda t: (t, [t, t.double()]), lambda t: (t, [t, t])),
         r"dtype at output\[1\]\[1\]: micro-batch 0 returned torch.float64, micro-batch 1 returned torch.float32"),
        (by_ubatch(lambda t: t, lambda t: t.to("meta")),
         r"differ in device at output: micro-batch 0 returned cpu, micro-batch 1 returned meta"),
        (by_ubatch(lambda t: t[:, None].expand(2, 3), lambda t: t[:, None].expand(2, 4)),
         r"shape past dim 0 at output: micro-batch 0 returned \(2, 3\), micro-batch 1 returned \(2, 4\)"),
        (by_ubatch(lambda t: t[:, None], lambda t: torch.zeros(0)),  # torch.cat skipped a (0,) tensor
         r"shape past dim 0 at output: micro-batch 0 returned \(2, 1\), micro-batch 1 returned \(0,\)"),
        (by_ubatch(lambda t: t, lambda t: t.sum()), r"micro-batch 1 returned a 0-dim tensor as output"),
    ]
    for fn, message in cases:
        with pytest.raises(ValueError, match=message):
            runner.run(fn, x, split=True)

    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    with pytest.raises(ValueError, match=r"dtype at output\.b: micro-batch 0 returned torch.float32, micro-batch 1 "
                                         r"returned torch.float16"):
        runner.run(by_ubatch(lambda t: Pair(t, t), lambda t: Pair(t, t.half())), x, split=True)
    out = runner.run(lambda t: (t.bfloat16(), None), x, split=True)  # same dtypes: concatenated as before
    assert out[0].dtype == torch.bfloat16 and torch.equal(out[0].float(), x) and out[1] is None


def test_callers_saved_tensors_hooks_pack_and_unpack_the_ubatches_activations():
    # saved_tensors_hooks is thread-local: around run() (activation offloading and checkpointing do
    # this) no micro-batch thread saw the hooks, and every activation was kept as it was.
    runner = UBatchRunner(2, min_tokens=1)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(6, 4)
    packed, unpacked = [], []

    def pack(t):
        packed.append(_where())
        return ("packed", t.clone())

    def unpack(box):
        unpacked.append(box[0])
        return box[1]

    def fn(t):
        h = (t @ w).sin()  # sin saves its input, mm saves w (and t)
        return ubatch_yield(lambda: h * 2)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = runner.run(fn, x)
    assert {"ubatch 0", "ubatch 1"} <= set(packed) and "MainThread" not in packed
    out.sum().backward()
    assert unpacked and set(unpacked) == {"packed"}
    torch.testing.assert_close(w.grad, x.T @ (2 * (x @ w.detach()).cos()))
    packed.clear()
    runner.run(fn, x)  # and none stay behind for the next run
    assert packed == []


def test_callers_disable_saved_tensors_hooks_holds_inside_the_ubatches():
    runner = UBatchRunner(2, min_tokens=1)

    def fn(t):
        with torch.autograd.graph.saved_tensors_hooks(lambda s: s, lambda s: s):
            return t + 1

    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks under this test"):
        with pytest.raises(UBatchError) as info:
            runner.run(fn, torch.zeros(4))
    assert "no hooks under this test" in str(info.value.__cause__)
    assert torch.equal(runner.run(fn, torch.zeros(4)), torch.ones(4))  # enabled again after it


class _RecordDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((_where(), func.__name__))
        return func(*args, **(kwargs or {}))


class _RecordFunction(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append((_where(), getattr(func, "__name__", str(func))))
        return func(*args, **(kwargs or {}))


def test_callers_dispatch_and_function_modes_see_the_ubatches_ops():
    # The mode stacks are thread-local: a TorchDispatchMode or TorchFunctionMode around run() saw
    # only the concatenation on the caller's thread, none of the micro-batches' own ops.
    runner = UBatchRunner(2, min_tokens=1)
    stacks = []

    def fn(t):
        stacks.append(([type(m).__name__ for m in _get_current_function_mode_stack()],
                       [type(m).__name__ for m in _get_current_dispatch_mode_stack()], torch.ones(1).device.type))
        return torch.mul(ubatch_yield(lambda: t), 3)

    dispatch, function = _RecordDispatch(), _RecordFunction()
    with torch.device("meta"), function, dispatch:
        want = ([type(m).__name__ for m in _get_current_function_mode_stack()],
                [type(m).__name__ for m in _get_current_dispatch_mode_stack()])
        out = runner.run(fn, torch.zeros(6, 2))
    assert want == (["DeviceContext", "_RecordFunction"], ["_RecordDispatch"])  # no second DeviceContext
    assert stacks == [(*want, "meta")] * 2 and out.device.type == "meta"
    for mode, op in ((dispatch, "mul.Tensor"), (function, "mul")):
        assert (("ubatch 0", op) in mode.seen and ("ubatch 1", op) in mode.seen), mode.seen
    stacks.clear()
    runner.run(fn, torch.zeros(6, 2))  # none leaks into the next run
    assert stacks == [([], [], "cpu")] * 2
