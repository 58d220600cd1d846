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


def test_report_answers_for_capabilities_not_for_inputs_it_does_not_have():
    # `megapar env` on a GPU machine: report() gives only the device, so a check of the inputs read
    # None for their dtype / head dim / group size. The kernels were listed as unable to run there
    # ("got None"), and a size comparison raised TypeError (sp.matmul's check: `megapar env` crashed).
    def fits(f):
        return None if f.dtype in (torch.float16, torch.bfloat16) else impl.Unusable(f"needs fp16/bf16, got {f.dtype}")

    def group(f):
        return None if f.size >= 2 else impl.Unusable("a group of one")

    op = impl.Op("test.op6", [
        impl.Impl("kernel", impl.all_of(impl.needs_cuda_tensor, fits)),
        impl.Impl("lib", impl.all_of(fits, impl.needs_package("no_such_pkg_megapar", "pip install no-such-pkg"))),
        impl.Impl("fused", impl.all_of(impl.needs_cuda_tensor, group)),
        impl.Impl("torch"),
    ])
    cuda = torch.device("cuda")
    rep = op.usable(device=cuda)
    assert rep["kernel"] is None and rep["fused"] is None and rep["torch"] is None, rep
    assert "no-such-pkg" in rep["lib"]        # a capability after an input check still counts
    assert op.usable(device="cpu")["kernel"] == "needs CUDA tensors, got cpu"
    # facts that are given count, in usable() and resolve(); resolve() reads absent ones as None
    assert "got torch.float32" in op.usable(device=cuda, dtype=torch.float32)["kernel"]
    assert op.usable(device=cuda, size=1)["fused"] == "a group of one"
    assert op.resolve(device=cuda, dtype=torch.bfloat16, size=2) == "kernel"
    assert op.resolve(device=cuda, dtype=torch.float32, size=2) == "fused"
    with pytest.raises(ValueError, match="needs fp16/bf16, got None"):
        op.resolve("kernel", device=cuda)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("On", True), ("yes", True), ("0", False),
                                      ("false", False), ("", False)])
def test_interpreting_reads_triton_interpret_as_triton_does(monkeypatch, value, on):
    # only "1" counted: TRITON_INTERPRET=true ran Triton's interpreter while a named Triton backend on
    # CPU tensors was refused as if it were off
    from parallel import impl

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert impl.interpreting() is on
