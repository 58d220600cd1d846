"""The implementation resolver: auto order, named requests, warnings once, report."""

import logging

import pytest
import torch

from parallel import impl


def _op(name):
    return impl.Op(name, [
        impl.Impl("fast", impl.all_of(impl.needs_cuda_tensor, impl.forward_only)),
        impl.Impl("lib", impl.needs_package("no_such_pkg_megapar", "pip install no-such-pkg")),
        impl.Impl("torch"),
    ])


def test_auto_takes_first_usable_and_named_raise_with_reason():
    op = _op("test.op1")
    assert op.names == ("auto", "fast", "lib", "torch")
    assert op.resolve("auto", device="cpu") == "torch"
    assert op.resolve("torch", device="cpu") == "torch"
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        op.resolve("fast", device="cpu")
    with pytest.raises(ValueError, match="pip install no-such-pkg"):
        op.resolve("lib", device="cpu")
    with pytest.raises(ValueError, match="unknown implementation 'nope'; valid: auto, fast, lib, torch"):
        op.resolve("nope", device="cpu")


def test_fallback_warns_once_only_for_installable(caplog):
    op = _op("test.op2")
    with caplog.at_level(logging.WARNING, logger="megapar.impl"):
        for _ in range(3):
            assert op.resolve(device="cpu") == "torch"
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "'lib'" in msgs[0] and "no-such-pkg" in msgs[0]  # 'fast' (inapplicable) is silent


def test_forward_only_and_register_order(monkeypatch):
    op = impl.Op("test.op3", [impl.Impl("a", impl.forward_only), impl.Impl("b")])
    assert op.resolve(device="cpu") == "a"
    assert op.resolve(device="cpu", needs_grad=True) == "b"
    op.register(impl.Impl("c"), before="a")
    assert op.names == ("auto", "c", "a", "b")
    assert op.resolve(device="cpu") == "c"
    op.register(impl.Impl("hidden", auto=False), before="c")
    assert op.resolve(device="cpu") == "c" and op.resolve("hidden") == "hidden"
    x = torch.zeros(2, requires_grad=True)
    assert impl.grad_needed(x) and not impl.grad_needed(x.detach())
    with torch.no_grad():
        assert not impl.grad_needed(x)


def test_interpreter_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert impl.needs_gpu_tensor(impl.Facts(torch.device("cpu"), asked=True)) is None
    assert impl.needs_gpu_tensor(impl.Facts(torch.device("cpu"))) is not None  # "auto" keeps CPU on torch
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert impl.needs_gpu_tensor(impl.Facts(torch.device("cpu"), asked=True)) is not None
    op = impl.Op("test.op5", [impl.Impl("kernel", impl.needs_gpu_tensor), impl.Impl("torch")])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert op.resolve("auto", device="cpu") == "torch" and op.resolve("kernel", device="cpu") == "kernel"


def test_no_usable_and_report():
    op = impl.Op("test.op4", [impl.Impl("gpu", impl.needs_cuda_tensor)])
    with pytest.raises(ValueError, match="no implementation can run here"):
        op.resolve(device="cpu")
    rep = impl.report("cpu")
    assert "test.op4" in rep and rep["test.op4"]["gpu"].startswith("needs CUDA")
    with pytest.raises(ValueError, match="unique"):
        impl.Op("test.bad", [impl.Impl("x"), impl.Impl("x")])
