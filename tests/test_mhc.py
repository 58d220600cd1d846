"""mHC (model/mhc.py): torch reference against plain per-token loops, Sinkhorn, broadcast entry,
head, sequence-parallel sharding; Triton kernels under the interpreter (CPU) and on CUDA."""

from __future__ import annotations

import importlib
import math
import os
import re

import numpy as np
import pytest
import torch

from model.mhc import (MHC, MHCHead, mhc_broadcast, mhc_head, mhc_post, mhc_post_pre, mhc_pre, mhc_pre_broadcast,
                       sinkhorn)

EPS = 1e-6

if not torch.cuda.is_available():
    # Triton decides at import whether kernels are interpreted; without a GPU nothing else can run
    # them, so ask for the interpreter before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def make_params(m: int, h: int, *, seed: int = 0, device: str = "cpu", spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    n = (2 + m) * m
    fn = (torch.randn(n, m * h, generator=g) * 0.5 / math.sqrt(m * h) * 8 * spread).to(device)
    base = (torch.randn(n, generator=g) * 0.5).to(device)
    scale = torch.tensor([0.7, 1.3, 0.9 * spread]).to(device)
    return fn, base, scale


# ---- an independent plain implementation: per token, python loops, float64 ----

def plain_pre(residual, fn, base, scale, iters=20, eps=EPS, rms_eps=EPS):
    t_count, m, h = residual.shape
    res = residual.double()
    fn, base, scale = fn.double(), base.double(), scale.double()
    sig = lambda v: 1.0 / (1.0 + math.exp(-v))
    layer_input = torch.zeros(t_count, h, dtype=torch.float64)
    posts = torch.zeros(t_count, m, dtype=torch.float64)
    combs = torch.zeros(t_count, m, m, dtype=torch.float64)
    for t in range(t_count):
        flat = torch.cat([res[t, i] for i in range(m)])
        rstd = 1.0 / math.sqrt(float((flat * flat).sum()) / (m * h) + rms_eps)
        mix = [float(torch.dot(flat, fn[r])) * rstd for r in range(fn.shape[0])]
        pre = [sig(mix[i] * scale[0].item() + base[i].item()) + eps for i in range(m)]
        for j in range(m):
            posts[t, j] = 2 * sig(mix[m + j] * scale[1].item() + base[m + j].item())
        c = [[0.0] * m for _ in range(m)]
        for i in range(m):
            row = [mix[2 * m + i * m + j] * scale[2].item() + base[2 * m + i * m + j].item() for j in range(m)]
            top = max(row)
            ex = [math.exp(v - top) for v in row]
            for j in range(m):
                c[i][j] = ex[j] / sum(ex) + eps

        def norm_cols():
            for j in range(m):
                s = sum(c[i][j] for i in range(m)) + eps
                for i in range(m):
                    c[i][j] /= s

        def norm_rows():
            for i in range(m):
                s = sum(c[i]) + eps
                c[i] = [v / s for v in c[i]]

        norm_cols()
        for _ in range(iters - 1):
            norm_rows()
            norm_cols()
        combs[t] = torch.tensor(c, dtype=torch.float64)
        for i in range(m):
            layer_input[t] += pre[i] * res[t, i]
    return layer_input, posts, combs


def plain_post(out, residual, post, comb):
    t_count, m, h = residual.shape
    new = torch.zeros(t_count, m, h, dtype=torch.float64)
    for t in range(t_count):
        for j in range(m):
            new[t, j] = post[t, j].double() * out[t].double()
            for i in range(m):
                new[t, j] += comb[t, i, j].double() * residual[t, i].double()
    return new


def plain_head(residual, fn, base, scale, eps=EPS, rms_eps=EPS):
    t_count, m, h = residual.shape
    want = torch.zeros(t_count, h, dtype=torch.float64)
    for k in range(t_count):
        flat = residual[k].reshape(-1).double()
        rstd = 1 / math.sqrt(float((flat * flat).mean()) + rms_eps)
        for i in range(m):
            logit = float(fn[i].double() @ flat) * rstd * float(scale[0]) + float(base[i])
            want[k] += (1 / (1 + math.exp(-logit)) + eps) * residual[k, i].double()
    return want


# ---- torch reference ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_matches_plain_loops(dtype):
    torch.manual_seed(1)
    t, m, h = 5, 4, 24
    residual = torch.randn(t, m, h).to(dtype)
    fn, base, scale = make_params(m, h)
    got = mhc_pre(residual, fn, base, scale, backend="torch")
    want_x, want_post, want_comb = plain_pre(residual, fn, base, scale)
    assert got.layer_input.dtype == dtype and got.post.dtype == torch.float32 and got.comb.dtype == torch.float32
    torch.testing.assert_close(got.post.double(), want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.comb.double(), want_comb, rtol=1e-5, atol=1e-6)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.layer_input.double(), want_x, **tol)


def test_pre_with_three_streams_and_few_iterations_matches_plain_loops():
    torch.manual_seed(2)
    residual = torch.randn(3, 3, 10)
    fn, base, scale = make_params(3, 10, seed=3)
    got = mhc_pre(residual, fn, base, scale, sinkhorn_iters=3, eps=1e-3, rms_eps=1e-4)
    want = plain_pre(residual, fn, base, scale, iters=3, eps=1e-3, rms_eps=1e-4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_post_matches_plain_loops_with_transposed_comb(dtype):
    torch.manual_seed(3)
    t, m, h = 4, 4, 16
    residual = torch.randn(t, m, h).to(dtype)
    out = torch.randn(t, h).to(dtype)
    post = torch.rand(t, m) * 2
    comb = torch.rand(t, m, m)  # not symmetric: a missing transpose fails
    got = mhc_post(out, residual, post, comb, backend="torch")
    assert got.dtype == dtype and got.shape == (t, m, h)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=2e-2)
    torch.testing.assert_close(got.double(), plain_post(out, residual, post, comb), **tol)


def test_comb_is_doubly_stochastic_after_the_iterations():
    torch.manual_seed(4)
    m, h = 4, 32
    residual = torch.randn(64, m, h)
    fn, base, scale = make_params(m, h, spread=0.5)  # logits of std ~2: columns far from stochastic
    comb = mhc_pre(residual, fn, base, scale).comb
    assert (comb > 0).all()
    torch.testing.assert_close(comb.sum(-2), torch.ones(64, m), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(64, m), rtol=0, atol=1e-4)
    # One iteration only normalizes columns: the rows are visibly off, so the check above means something.
    one = mhc_pre(residual, fn, base, scale, sinkhorn_iters=1).comb
    torch.testing.assert_close(one.sum(-2), torch.ones(64, m), rtol=0, atol=1e-5)
    assert (one.sum(-1) - 1).abs().max() > 0.05


def test_sinkhorn_leaves_a_doubly_stochastic_matrix_almost_unchanged():
    perm = torch.eye(4)[[2, 0, 3, 1]] * 0.7 + 0.3 / 4  # rows and columns sum to 1
    torch.testing.assert_close(sinkhorn(perm[None], 20, 1e-9)[0], perm, rtol=0, atol=1e-6)


def test_broadcast_entry_equals_general_path_on_equal_streams():
    torch.manual_seed(5)
    t, m, h = 6, 4, 20
    x = torch.randn(t, h)
    fn, base, scale = make_params(m, h, seed=6)
    streams = mhc_broadcast(x, m)
    assert streams.shape == (t, m, h) and torch.equal(streams[:, 2], x)
    general = mhc_pre(streams.contiguous(), fn, base, scale)
    entry = mhc_pre_broadcast(x, fn, base, scale)
    for a, b in zip(entry, general):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    out = torch.randn(t, h)
    torch.testing.assert_close(mhc_post(out, streams, entry.post, entry.comb),
                               mhc_post(out, streams.contiguous(), entry.post, entry.comb), rtol=0, atol=0)


def test_head_is_the_weighted_stream_sum():
    torch.manual_seed(7)
    t, m, h = 5, 4, 12
    residual = torch.randn(t, m, h)
    fn = torch.randn(m, m * h) * 0.2
    base = torch.randn(m)
    scale = torch.tensor([0.6])
    got = mhc_head(residual, fn, base, scale)
    torch.testing.assert_close(got.double(), plain_head(residual, fn, base, scale), rtol=1e-5, atol=1e-5)
    # With fn = 0 the weights are the constants sigmoid(base) + eps.
    const = mhc_head(residual, torch.zeros_like(fn), base, scale)
    torch.testing.assert_close(const, ((torch.sigmoid(base) + EPS)[None, :, None] * residual).sum(1),
                               rtol=1e-6, atol=1e-6)


def test_sequence_parallel_shards_give_the_full_result():
    torch.manual_seed(8)
    t, m, h = 37, 4, 48
    residual = torch.randn(t, m, h).bfloat16()
    out = torch.randn(t, h).bfloat16()
    fn, base, scale = make_params(m, h, seed=9)
    full = mhc_pre(residual, fn, base, scale)
    new_full = mhc_post(out, residual, full.post, full.comb)
    bounds = [(0, 1), (1, 20), (20, 37)]  # uneven shards, one of a single token
    shards = [mhc_pre(residual[a:b], fn, base, scale) for a, b in bounds]
    for k in range(3):
        # Per token; only the BLAS blocking of x @ fn^T may differ with the shard size.
        torch.testing.assert_close(torch.cat([s[k] for s in shards]), full[k], rtol=1e-6, atol=1e-6)
    new_shards = torch.cat([mhc_post(out[a:b], residual[a:b], full.post[a:b], full.comb[a:b]) for a, b in bounds])
    assert torch.equal(new_shards, new_full)
    empty = mhc_pre(residual[:0], fn, base, scale)  # a rank may hold no tokens
    assert empty.layer_input.shape == (0, h) and empty.comb.shape == (0, m, m)


def test_bad_shapes_and_backend_raise_value_error():
    fn, base, scale = make_params(4, 8)
    with pytest.raises(ValueError, match="residual must be"):
        mhc_pre(torch.randn(3, 32), fn, base, scale)
    with pytest.raises(ValueError, match="fn must have shape"):
        mhc_pre(torch.randn(3, 4, 9), fn, base, scale)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc_pre(torch.randn(3, 4, 8), fn, base, scale, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="unknown implementation 'cuda'; valid: auto, triton, torch"):
        mhc_pre(torch.randn(3, 4, 8), fn, base, scale, backend="cuda")
    with pytest.raises(ValueError, match="out"):
        mhc_post(torch.randn(3, 7), torch.randn(3, 4, 8), torch.rand(3, 4), torch.rand(3, 4, 4))
    with pytest.raises(ValueError, match=r"H=0 >= 1"):  # was a ZeroDivisionError
        mhc_pre_broadcast(torch.randn(3, 0), fn, base, scale)
    with pytest.raises(ValueError, match=r"M >= 1; got shape \(0, 0\)"):  # no stream: returned zeros
        mhc_pre_broadcast(torch.randn(3, 8), torch.zeros(0, 0), torch.zeros(0), scale)


def test_modules_apply_their_own_settings_like_plain_loops():
    """MHC / MHCHead against the plain loops with non-default, pairwise different eps, rms_eps and
    sinkhorn_iters per module (the defaults eps == rms_eps == 1e-6 hide a swap of the two, and two
    modules configured alike hide post_pre using this module's settings instead of next_mhc's)."""
    torch.manual_seed(21)
    t, m, h = 5, 4, 16
    cfg1 = dict(sinkhorn_iters=4, eps=1e-3, rms_eps=0.3)
    cfg2 = dict(sinkhorn_iters=2, eps=0.02, rms_eps=0.05)
    first, second = MHC(h, m, **cfg1), MHC(h, m, **cfg2)
    head = MHCHead(h, m, eps=0.01, rms_eps=0.4)
    for module, seed in ((first, 22), (second, 23)):
        with torch.no_grad():
            for p, v in zip((module.fn, module.base, module.scale), make_params(m, h, seed=seed)):
                p.copy_(v)
    with torch.no_grad():
        head.fn.copy_(torch.randn(m, m * h) * 0.2)
        head.base.copy_(torch.randn(m))
        head.scale.fill_(0.6)
    p1 = [p.detach() for p in (first.fn, first.base, first.scale)]
    p2 = [p.detach() for p in (second.fn, second.base, second.scale)]
    iters1, iters2 = cfg1.pop("sinkhorn_iters"), cfg2.pop("sinkhorn_iters")
    residual, out, x = torch.randn(t, m, h), torch.randn(t, h), torch.randn(t, h)
    tol = dict(rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        want = plain_pre(residual, *p1, iters=iters1, **cfg1)
        for a, b in zip(first.pre(residual), want):
            torch.testing.assert_close(a.double(), b, **tol)
        for a, b in zip(first.pre_broadcast(x), plain_pre(mhc_broadcast(x, m), *p1, iters=iters1, **cfg1)):
            torch.testing.assert_close(a.double(), b, **tol)
        post, comb = want[1].float(), want[2].float()
        new_want = plain_post(out, residual, post, comb)
        torch.testing.assert_close(first.post(out, residual, post, comb).double(), new_want, **tol)
        new, nxt = first.post_pre(out, residual, post, comb, second)
        torch.testing.assert_close(new.double(), new_want, **tol)
        for a, b in zip(nxt, plain_pre(new_want.float(), *p2, iters=iters2, **cfg2)):
            torch.testing.assert_close(a.double(), b, **tol)
        li, po, co = plain_pre(residual, *p2, iters=iters2, **cfg2)
        torch.testing.assert_close(second(residual, torch.tanh).double(),
                                   plain_post(torch.tanh(li), residual, po, co), **tol)
        torch.testing.assert_close(head(residual).double(), plain_head(residual, *[p.detach() for p in
                                   (head.fn, head.base, head.scale)], eps=0.01, rms_eps=0.4), **tol)


def test_module_forward_post_pre_and_gradients():
    torch.manual_seed(10)
    t, m, h = 4, 4, 16
    first, second = MHC(h, m), MHC(h, m)
    head = MHCHead(h, m)
    x = torch.randn(t, h, requires_grad=True)
    lin = torch.nn.Linear(h, h)
    pre1 = first.pre_broadcast(x)
    residual = mhc_broadcast(x, m)
    new_fused, pre2 = first.post_pre(lin(pre1.layer_input), residual, pre1.post, pre1.comb, second)
    new_plain = first.post(lin(pre1.layer_input), residual, pre1.post, pre1.comb)
    torch.testing.assert_close(new_fused, new_plain, rtol=0, atol=0)
    for a, b in zip(pre2, second.pre(new_plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    final = second(new_plain, torch.tanh)
    li, po, co = second.pre(new_plain)
    torch.testing.assert_close(final, second.post(torch.tanh(li), new_plain, po, co), rtol=0, atol=0)
    head(final).square().sum().backward()
    for p in (x, first.fn, first.base, first.scale, second.fn, head.fn, lin.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


# ---- Triton, under the interpreter on CPU ----

@pytest.fixture(scope="module")
def interpreted_kernels():
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run where there is no GPU; the gpu tests cover CUDA")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # before triton is first imported: it decides at import
        pytest.importorskip("triton")
        import model.triton_mhc as kernels
        from triton.runtime.interpreter import InterpretedFunction

        import triton.language.standard as tl_standard

        if not isinstance(tl_standard.zeros, InterpretedFunction):
            pytest.skip("triton was imported without TRITON_INTERPRET=1 earlier in this session")
        if not isinstance(kernels._mix_kernel, InterpretedFunction):
            importlib.reload(kernels)
        yield kernels


def _check_triton_against_torch(residual, out, fn, base, scale, fn_head, base_head, scale_head, tol):
    kw = dict(sinkhorn_iters=20)
    want = mhc_pre(residual, fn, base, scale, backend="torch", **kw)
    got = mhc_pre(residual, fn, base, scale, backend="triton", **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    new_want = mhc_post(out, residual, want.post, want.comb, backend="torch")
    new_got = mhc_post(out, residual, want.post, want.comb, backend="triton")
    torch.testing.assert_close(new_got.float(), new_want.float(), **tol)
    fused_new, fused_pre = mhc_post_pre(out, residual, want.post, want.comb, fn, base, scale, backend="triton", **kw)
    torch.testing.assert_close(fused_new.float(), new_want.float(), **tol)
    for a, b in zip(fused_pre, mhc_pre(new_want, fn, base, scale, backend="torch", **kw)):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    torch.testing.assert_close(mhc_head(residual, fn_head, base_head, scale_head, backend="triton").float(),
                               mhc_head(residual, fn_head, base_head, scale_head, backend="torch").float(), **tol)


@pytest.mark.parametrize("t,m,h", [(1, 4, 40), (37, 4, 72), (5, 2, 24)])
def test_triton_kernels_match_reference_in_interpreter(interpreted_kernels, t, m, h):
    torch.manual_seed(t + h)
    residual = torch.randn(t, m, h)
    out = torch.randn(t, h)
    fn, base, scale = make_params(m, h, seed=t)
    fn_head, base_head, scale_head = torch.randn(m, m * h) * 0.1, torch.randn(m), torch.tensor([0.8])
    _check_triton_against_torch(residual, out, fn, base, scale, fn_head, base_head, scale_head,
                                dict(rtol=2e-5, atol=2e-5))


def test_triton_many_hidden_splits_match_reference_in_interpreter(interpreted_kernels, monkeypatch):
    # As on a GPU with many SMs: ~20 splits of H, more than one step of the coefficient kernel's loop.
    monkeypatch.setattr(interpreted_kernels, "_num_sms", lambda device: 64)
    t, m, h = 3, 4, 1280
    assert triton_splits(interpreted_kernels, t, m, h) > 16
    torch.manual_seed(13)
    residual = torch.randn(t, m, h)
    fn, base, scale = make_params(m, h, seed=14)
    for a, b in zip(mhc_pre(residual, fn, base, scale, backend="triton"),
                    mhc_pre(residual, fn, base, scale, backend="torch")):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_triton_two_launch_path_and_unfused_post_pre_in_interpreter(interpreted_kernels, monkeypatch):
    # Above SINGLE_LAUNCH_MAX_TOKENS: 64-token blocks, coefficients in the projection launch, the
    # layer input in a second kernel; post_pre runs post then pre. Lowered here to reach it cheaply.
    monkeypatch.setattr(interpreted_kernels, "SINGLE_LAUNCH_MAX_TOKENS", 8)
    monkeypatch.setattr(interpreted_kernels, "FUSE_MAX_TOKENS", 8)
    monkeypatch.setattr(interpreted_kernels, "_num_sms", lambda device: 16)
    t, m, h = 70, 4, 72  # two token blocks, the second partial; 2 splits of H
    assert interpreted_kernels._mix_config(t, m, h, torch.device("cpu"))[0] == 64 and triton_splits(
        interpreted_kernels, t, m, h) == 2
    torch.manual_seed(15)
    residual, out = torch.randn(t, m, h), torch.randn(t, h)
    fn, base, scale = make_params(m, h, seed=16)
    fn_head, base_head, scale_head = torch.randn(m, m * h) * 0.1, torch.randn(m), torch.tensor([0.8])
    _check_triton_against_torch(residual, out, fn, base, scale, fn_head, base_head, scale_head,
                                dict(rtol=2e-5, atol=2e-5))
    # Every launch leaves the per-block counters of the last-split election at zero.
    assert interpreted_kernels._counters and all(int(c.abs().sum()) == 0 for c in interpreted_kernels._counters.values())


def test_triton_bf16_residual_in_interpreter(interpreted_kernels):
    torch.manual_seed(17)
    t, m, h = 9, 4, 72
    residual, out = torch.randn(t, m, h).bfloat16(), torch.randn(t, h).bfloat16()
    fn, base, scale = make_params(m, h, seed=18)
    got = mhc_pre(residual, fn, base, scale, backend="triton")
    want = mhc_pre(residual, fn, base, scale, backend="torch")
    assert got.layer_input.dtype == torch.bfloat16
    torch.testing.assert_close(got.post, want.post, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.comb, want.comb, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.layer_input.float(), want.layer_input.float(), rtol=1e-2, atol=1e-2)
    new, nxt = mhc_post_pre(out, residual, want.post, want.comb, fn, base, scale, backend="triton")
    new_want = mhc_post(out, residual, want.post, want.comb, backend="torch")
    torch.testing.assert_close(new.float(), new_want.float(), rtol=1e-2, atol=1e-2)
    nxt_want = mhc_pre(new, fn, base, scale, backend="torch")  # from our new residual: same bf16 inputs
    torch.testing.assert_close(nxt.comb, nxt_want.comb, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(nxt.layer_input.float(), nxt_want.layer_input.float(), rtol=1e-2, atol=1e-2)


def test_fused_post_pre_checks_out_post_comb_shapes_on_every_backend(interpreted_kernels):
    # The fused Triton post_pre read out / post / comb unchecked: a wrong shape ran the kernel
    # (reading past the tensors or other tokens' coefficients) instead of raising.
    torch.manual_seed(19)
    t, m, h = 5, 4, 24
    residual = torch.randn(t, m, h)
    fn, base, scale = make_params(m, h, seed=20)
    good = (torch.randn(t, h), torch.rand(t, m) * 2, torch.rand(t, m, m))
    bad = {"out": (torch.randn(t, h + 8), good[1], good[2]),
           "post": (good[0], torch.rand(t - 1, m), good[2]),
           "comb": (good[0], good[1], torch.rand(t, m, 2))}
    for what, (out, post, comb) in bad.items():
        for backend in ("torch", "triton"):
            with pytest.raises(ValueError, match=r"need out \[5, 24\], post \[5, 4\], comb \[5, 4, 4\]"):
                mhc_post_pre(out, residual, post, comb, fn, base, scale, backend=backend)
    new, nxt = mhc_post_pre(*good[:1], residual, *good[1:], fn, base, scale, backend="triton")
    want = mhc_post(good[0], residual, good[1], good[2], backend="torch")
    torch.testing.assert_close(new, want, rtol=2e-5, atol=2e-5)
    for a, b in zip(nxt, mhc_pre(want, fn, base, scale, backend="torch")):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def triton_splits(kernels, t, m, h):
    _, _, h_per_split = kernels._mix_config(t, m, h, torch.device("cpu"))
    return -(-h // h_per_split)


def test_triton_handles_strided_and_broadcast_residual_in_interpreter(interpreted_kernels):
    torch.manual_seed(11)
    t, m, h = 6, 4, 24
    fn, base, scale = make_params(m, h, seed=12)
    strided = torch.randn(t, h, m).transpose(1, 2)  # [T, M, H] with H not innermost
    for a, b in zip(mhc_pre(strided, fn, base, scale, backend="triton"),
                    mhc_pre(strided.contiguous(), fn, base, scale, backend="torch")):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    x = torch.randn(t, h)
    for a, b in zip(mhc_pre_broadcast(x, fn, base, scale, backend="triton"),
                    mhc_pre_broadcast(x, fn, base, scale, backend="torch")):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        fn3, base3, scale3 = make_params(3, h)
        mhc_pre(torch.randn(t, 3, h), fn3, base3, scale3, backend="triton")


# ---- Triton on CUDA ----

@pytest.fixture
def fp32_matmul():
    """The reference's x @ fn^T in true fp32, whatever another test left set (TF32 is ~1e-3)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 300, 512, 513, 4133])  # 513 on: the two-launch pre, unfused post_pre
@pytest.mark.parametrize("h", [4096, 7168])
def test_triton_kernels_match_reference_on_gpu(fp32_matmul, t, h):
    m = 4
    torch.manual_seed(t + h)
    residual = torch.randn(t, m, h, device="cuda").bfloat16()
    out = torch.randn(t, h, device="cuda").bfloat16()
    fn, base, scale = make_params(m, h, seed=t, device="cuda")
    fn_head = torch.randn(m, m * h, device="cuda") * 0.01
    base_head, scale_head = torch.randn(m, device="cuda"), torch.tensor([0.8], device="cuda")
    # bf16 outputs (2^-8 relative spacing): fp32 sums that differ in the last bits may round apart.
    _check_triton_against_torch(residual, out, fn, base, scale, fn_head, base_head, scale_head,
                                dict(rtol=2e-2, atol=2e-2))
    got = mhc_pre(residual, fn, base, scale, backend="triton")
    want = mhc_pre(residual, fn, base, scale, backend="torch")
    torch.testing.assert_close(got.comb, want.comb, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.post, want.post, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_auto_backend_uses_triton_on_gpu_and_torch_under_autograd(fp32_matmul, monkeypatch):
    import model.triton_mhc as kernels

    calls = []
    real_pre = kernels.pre
    monkeypatch.setattr(kernels, "pre", lambda *a: calls.append(1) or real_pre(*a))
    m, h = 4, 256
    module = MHC(h, m, device="cuda")
    residual = torch.randn(8, m, h, device="cuda").bfloat16()
    with torch.no_grad():
        fast = module.pre(residual)
    assert calls == [1]
    slow = mhc_pre(residual, module.fn.detach(), module.base.detach(), module.scale.detach(), backend="torch")
    torch.testing.assert_close(fast.comb, slow.comb, rtol=1e-4, atol=1e-5)
    graded = module.pre(residual)  # parameters require grad: torch path, differentiable
    assert calls == [1]
    graded.post.sum().backward()
    assert module.fn.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 512, 513, 2048, 4097])  # pre: one launch up to 512 (SINGLE_LAUNCH_MAX_TOKENS)
def test_triton_is_deterministic_and_replays_in_a_cuda_graph(fp32_matmul, t):
    # The last split of a token block finishes it (atomic counter): a missing barrier or a stale
    # read would show as results that move between identical calls, or differ under graph replay.
    m, h = 4, 7168
    torch.manual_seed(t)
    residual = torch.randn(t, m, h, device="cuda").bfloat16()
    out = torch.randn(t, h, device="cuda").bfloat16()
    fn, base, scale = make_params(m, h, seed=t, device="cuda")
    first = mhc_pre(residual, fn, base, scale, backend="triton")
    want = mhc_pre(residual, fn, base, scale, backend="torch")
    torch.testing.assert_close(first.comb, want.comb, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first.layer_input.float(), want.layer_input.float(), rtol=2e-2, atol=2e-2)
    fused = mhc_post_pre(out, residual, first.post, first.comb, fn, base, scale, backend="triton")
    for _ in range(3):
        again = mhc_pre(residual, fn, base, scale, backend="triton")
        for a, b in zip(again, first):
            assert torch.equal(a, b)
        fused2 = mhc_post_pre(out, residual, first.post, first.comb, fn, base, scale, backend="triton")
        assert torch.equal(fused2[0], fused[0]) and all(torch.equal(a, b) for a, b in zip(fused2[1], fused[1]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mhc_pre(residual, fn, base, scale, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mhc_pre(residual, fn, base, scale, backend="triton")
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, first):
            assert torch.equal(a, b)


def test_residual_without_streams_or_hidden_raises_value_error():
    # H = 0 gave NaN post / comb (the RMS of nothing), M = 0 a reshape error or, on Triton, a
    # ZeroDivisionError; the broadcast entry already refused both.
    for shape in ((3, 4, 0), (3, 0, 5), (0, 0, 5)):
        t, m, h = shape
        fn, base, scale = torch.zeros((2 + m) * m, m * h), torch.zeros((2 + m) * m), torch.ones(3)
        with pytest.raises(ValueError, match=rf"M >= 1 streams and H >= 1; got shape \({t}, {m}, {h}\)"):
            mhc_pre(torch.randn(shape), fn, base, scale)
        with pytest.raises(ValueError, match="M >= 1 streams"):
            mhc_head(torch.randn(shape), torch.zeros(m, m * h), torch.zeros(m), torch.ones(1))
        with pytest.raises(ValueError, match="M >= 1 streams"):
            mhc_post(torch.randn(t, h), torch.randn(shape), torch.zeros(t, m), torch.zeros(t, m, m))
    empty = mhc_pre(torch.randn(0, 4, 8), *make_params(4, 8))  # no tokens is fine (an SP shard)
    assert empty.post.shape == (0, 4)


@pytest.mark.parametrize("t,m,h", [(17, 4, 65), (1, 1, 3), (3, 8, 20)])
def test_triton_with_distinct_eps_rms_eps_and_iterations_matches_plain_loops_in_interpreter(
        interpreted_kernels, t, m, h):
    """The other interpreter tests use eps == rms_eps == 1e-6 and 20 iterations, which hide a swap of
    the two epsilons or a wrong iteration count in the launchers. Here all three differ, on shapes
    that are not multiples of the blocks (17 tokens: a second 16-token block of one; H = 65; M = 1
    and 8), against the float64 loops, with a strided `out` in post and the fused post_pre."""
    torch.manual_seed(100 + t * m + h)
    cfg = dict(eps=0.03, rms_eps=0.5)
    iters = 2
    residual = torch.randn(t, m, h) * 0.5
    out = torch.randn(h, t).t()  # [T, H] with H not innermost
    fn, base, scale = make_params(m, h, seed=t + h)
    tol = dict(rtol=2e-5, atol=2e-5)
    want = plain_pre(residual, fn, base, scale, iters=iters, **cfg)
    for a, b in zip(mhc_pre(residual, fn, base, scale, sinkhorn_iters=iters, backend="triton", **cfg), want):
        torch.testing.assert_close(a.double(), b, **tol)
    post, comb = want[1].float(), want[2].float()
    new_want = plain_post(out, residual, post, comb)
    torch.testing.assert_close(mhc_post(out, residual, post, comb, backend="triton").double(), new_want, **tol)
    new, nxt = mhc_post_pre(out, residual, post, comb, fn, base, scale, sinkhorn_iters=iters + 1,
                            backend="triton", **cfg)
    torch.testing.assert_close(new.double(), new_want, **tol)
    for a, b in zip(nxt, plain_pre(new_want.float(), fn, base, scale, iters=iters + 1, **cfg)):
        torch.testing.assert_close(a.double(), b, **tol)
    fn_head, base_head, scale_head = torch.randn(m, m * h) * 0.2, torch.randn(m), torch.tensor([0.6])
    torch.testing.assert_close(mhc_head(residual, fn_head, base_head, scale_head, backend="triton", **cfg).double(),
                               plain_head(residual, fn_head, base_head, scale_head, **cfg), **tol)


def test_auto_backend_passes_over_triton_for_streams_not_a_power_of_two(monkeypatch):
    """On CUDA "auto" chose the Triton kernels whatever M, and they refuse an M that is not a power
    of two (their stream index is a tl.arange): with M = 3, model.mhc's functions (and the demo
    model, whose mhc_streams may be 3) raised instead of taking the torch path. The registry's
    CUDA choice is emulated (the device it is told is CUDA); nothing runs a kernel here."""
    pytest.importorskip("triton")
    from model.mhc import MHC_OP

    assert MHC_OP.resolve("auto", device=torch.device("cuda"), streams=4) == "triton"
    assert MHC_OP.resolve("auto", device=torch.device("cuda"), streams=3) == "torch"
    real = MHC_OP.resolve
    monkeypatch.setattr(MHC_OP, "resolve", lambda backend="auto", *, device=None, **facts:
                        real(backend, device=torch.device("cuda"), **facts))
    m, h, t = 3, 12, 5
    fn, base, scale = make_params(m, h, seed=60)
    g = torch.Generator().manual_seed(61)
    residual, out = torch.randn(t, m, h, generator=g), torch.randn(t, h, generator=g)
    tol = dict(rtol=1e-5, atol=1e-5)
    pre = mhc_pre(residual, fn, base, scale)
    for a, b in zip(pre, plain_pre(residual, fn, base, scale)):
        torch.testing.assert_close(a.double(), b, **tol)
    new = mhc_post(out, residual, pre.post, pre.comb)
    torch.testing.assert_close(new.double(), plain_post(out, residual, pre.post, pre.comb), **tol)
    fused, nxt = mhc_post_pre(out, residual, pre.post, pre.comb, fn, base, scale)
    torch.testing.assert_close(fused, new, rtol=0, atol=0)
    for a, b in zip(nxt, plain_pre(new, fn, base, scale)):
        torch.testing.assert_close(a.double(), b, **tol)
    x = torch.randn(t, h, generator=g)
    for a, b in zip(mhc_pre_broadcast(x, fn, base, scale), plain_pre(mhc_broadcast(x, m), fn, base, scale)):
        torch.testing.assert_close(a.double(), b, **tol)
    fh, bh, sh = fn[:m], base[:m], scale[:1]
    torch.testing.assert_close(mhc_head(residual, fh, bh, sh).double(), plain_head(residual, fh, bh, sh), **tol)
    with pytest.raises(ValueError, match=r"'triton' cannot run here: the Triton mHC kernels need a power-of-two "
                                         r"number of streams, got M=3"):
        mhc_pre(residual, fn, base, scale, backend="triton")


# ---- gradients of the torch path against autograd of HF transformers' formulas in float64 ----

def _hf_pre(res, fn, base, scale, iters, eps, rms_eps):
    """DeepseekV4HyperConnection.forward (transformers 5.x, models/deepseek_v4), written for [T, M, H]."""
    t, m, h = res.shape
    flat = res.reshape(t, m * h)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    pre_w, post_w, comb_w = (flat @ fn.t()).split([m, m, m * m], dim=-1)
    pre_b, post_b, comb_b = base.split([m, m, m * m])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(t, m, m) * comb_s + comb_b.view(m, m), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return (pre.unsqueeze(-1) * res).sum(dim=1), post, comb


def _hf_post(out, res, post, comb):
    """DeepseekV4DecoderLayer's mixing: post * out + comb^T @ residual."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), res)


def _hf_head(res, fn, base, scale, eps, rms_eps):
    """DeepseekV4HyperHead.forward."""
    t, m, h = res.shape
    flat = res.reshape(t, m * h)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(flat @ fn.t() * scale + base) + eps
    return (pre.unsqueeze(-1) * res).sum(dim=1)


def _grads(f, inputs, weights):
    """Gradients of sum_k <f(*inputs)[k], weights[k]> w.r.t. inputs (float64 weights)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    outs = f(*leaves)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    return outs, torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("t,m,h,iters,eps,rms_eps,dtype", [
    (5, 4, 8, 20, 1e-6, 1e-6, torch.float32), (1, 1, 3, 1, 1e-3, 0.3, torch.float32),
    (3, 3, 5, 2, 0.05, 0.1, torch.float32), (0, 4, 8, 3, 1e-6, 1e-6, torch.float32),
    (4, 2, 7, 1, 0.0, 1e-6, torch.float32), (6, 4, 10, 20, 1e-6, 1e-6, torch.bfloat16)])
def test_torch_path_gradients_match_hf_formulas_in_float64(t, m, h, iters, eps, rms_eps, dtype):
    """Forward and every input's gradient of mhc_pre / mhc_pre_broadcast / mhc_post / mhc_head
    (torch path) against autograd of HF's DeepseekV4 formulas in float64, on M = 1 and odd M, T = 0
    and 1, odd H, one Sinkhorn iteration, eps = 0 and a non-contiguous bf16 residual and fn."""
    g = torch.Generator().manual_seed(t * 100 + m * 10 + h)
    n = (2 + m) * m
    residual = torch.randn(t, h, m, generator=g).transpose(1, 2).to(dtype)  # [T, M, H], H not innermost
    fn = (torch.randn(m * h, n, generator=g) * 0.3).t()  # non-contiguous
    base, scale = torch.randn(n, generator=g) * 0.5, torch.tensor([0.7, 1.3, 0.9])
    x, out = torch.randn(t, h, generator=g).to(dtype), torch.randn(t, h, generator=g).to(dtype)
    post, comb = torch.rand(t, m, generator=g) * 2, torch.rand(t, m, m, generator=g)
    fh, bh, sh = torch.randn(m, m * h, generator=g) * 0.3, torch.randn(m, generator=g), torch.tensor([0.6])
    w3 = [torch.randn(t, h, generator=g, dtype=torch.float64), torch.randn(t, m, generator=g, dtype=torch.float64),
          torch.randn(t, m, m, generator=g, dtype=torch.float64)]
    w_new, w_head = torch.randn(t, m, h, generator=g, dtype=torch.float64), w3[0]
    kw = dict(sinkhorn_iters=iters, eps=eps, rms_eps=rms_eps, backend="torch")
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-5)
    else:  # bf16 outputs and input gradients: compare the float64 formula on the same bf16 values
        tol = dict(rtol=2e-2, atol=2e-2)
    cases = [
        (lambda *a: mhc_pre(*a, **kw), lambda *a: _hf_pre(*a, iters, eps, rms_eps), (residual, fn, base, scale), w3),
        (lambda *a: mhc_pre_broadcast(*a, **kw),
         lambda xx, *a: _hf_pre(xx.unsqueeze(1).expand(t, m, h), *a, iters, eps, rms_eps), (x, fn, base, scale), w3),
        (lambda *a: mhc_post(*a, backend="torch"), _hf_post, (out, residual, post, comb), [w_new]),
        (lambda *a: mhc_head(*a, eps=eps, rms_eps=rms_eps, backend="torch"),
         lambda *a: _hf_head(*a, eps, rms_eps), (residual, fh, bh, sh), [w_head]),
    ]
    for ours, hf, inputs, weights in cases:
        got, got_grads = _grads(ours, inputs, weights)
        want, want_grads = _grads(hf, [v.double() for v in inputs], weights)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b.detach(), **tol)
        for v, a, b in zip(inputs, got_grads, want_grads):
            assert a.dtype == v.dtype and a.shape == v.shape
            torch.testing.assert_close(a.double(), b, **tol)


def test_torch_path_stays_fp32_under_autocast():
    """Under torch.autocast (bf16) the torch path's matmul / bmm / einsum ran in bf16: on an fp32
    residual the mix logits, post, comb, the layer input and the new residual were ~1e-2 off (the
    Triton kernels ignore autocast, so training and inference disagreed). Against the float64 loops."""
    g = torch.Generator().manual_seed(70)
    t, m, h = 6, 4, 64
    fn, base, scale = make_params(m, h, seed=71)
    residual, out, x = torch.randn(t, m, h, generator=g), torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    fh, bh, sh = torch.randn(m, m * h, generator=g) * 0.2, torch.randn(m, generator=g), torch.tensor([0.6])
    tol = dict(rtol=1e-5, atol=1e-5)
    want = plain_pre(residual, fn, base, scale)
    post, comb = want[1].float(), want[2].float()
    new_want = plain_post(out, residual, post, comb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mhc_pre(residual, fn, base, scale, backend="torch")
        new = mhc_post(out, residual, post, comb, backend="torch")
        fused, nxt = mhc_post_pre(out, residual, post, comb, fn, base, scale, backend="torch")
        entry = mhc_pre_broadcast(x, fn, base, scale, backend="torch")
        collapsed = mhc_head(residual, fh, bh, sh, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **tol)
    torch.testing.assert_close(new.double(), new_want, **tol)
    torch.testing.assert_close(fused.double(), new_want, **tol)
    for a, b in zip(nxt, plain_pre(new_want.float(), fn, base, scale)):
        torch.testing.assert_close(a.double(), b, **tol)
    for a, b in zip(entry, plain_pre(mhc_broadcast(x, m), fn, base, scale)):
        torch.testing.assert_close(a.double(), b, **tol)
    torch.testing.assert_close(collapsed.double(), plain_head(residual, fh, bh, sh), **tol)


def test_non_integer_iterations_and_integer_residual_raise_value_error():
    """sinkhorn_iters=20.0 was a TypeError inside range() (a compile error on Triton); an integer
    residual ran and truncated the fp32 layer input / new residual to integers."""
    m, h = 4, 8
    fn, base, scale = make_params(m, h, seed=80)
    residual = torch.randn(3, m, h, generator=torch.Generator().manual_seed(81))
    for iters in (20.0, 2.5, "3"):
        with pytest.raises(ValueError, match=rf"sinkhorn_iters must be an integer >= 1, got {iters!r}"):
            mhc_pre(residual, fn, base, scale, sinkhorn_iters=iters)
        with pytest.raises(ValueError, match="sinkhorn_iters must be an integer"):
            MHC(h, m, sinkhorn_iters=iters)
    want = plain_pre(residual, fn, base, scale, iters=3)
    for a, b in zip(mhc_pre(residual, fn, base, scale, sinkhorn_iters=np.int64(3)), want):  # numpy ints are fine
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    ints = torch.randint(-3, 4, (3, m, h), generator=torch.Generator().manual_seed(82))
    with pytest.raises(ValueError, match="residual must be floating point, got torch.int64"):
        mhc_pre(ints, fn, base, scale)
    with pytest.raises(ValueError, match="residual must be floating point, got torch.int64"):
        mhc_post(torch.randn(3, h), ints, torch.rand(3, m), torch.rand(3, m, m))
    with pytest.raises(ValueError, match="residual must be floating point"):
        mhc_head(ints, torch.zeros(m, m * h), torch.zeros(m), torch.ones(1))
    with pytest.raises(ValueError, match=r"x must be a floating-point \[T, H\], got shape \(3, 8\), torch.int64"):
        mhc_pre_broadcast(ints[:, 0], fn, base, scale)


def test_triton_offsets_within_a_token_past_int32_use_int64_in_interpreter(interpreted_kernels, monkeypatch):
    """On a residual [T, M, H] whose H is not innermost (or whose streams are outermost), or a
    transposed out [T, H], h * s_rh (j * s_rm, h * s_oh) can pass 2^31 - 1 elements; the kernels
    computed them in int32 (only the token offsets in int64), which wrapped to addresses before the
    tensor. Nothing that large is allocated here: the launchers see small tensors, each launch gets
    huge strides in place of theirs (and the launchers' choice for such a layout, from meta
    tensors), and the interpreter's loads record their addresses instead of reading them."""
    from triton.runtime import interpreter

    kernels = interpreted_kernels
    meta = lambda shape, stride: torch.empty_strided(shape, stride, device="meta")
    # The launchers' choice: contiguous residuals keep the int32 kernels (their token offsets were
    # int64 already), whatever their size.
    assert not kernels._needs_int64(meta((2**16, 4, 2**14), (2**16, 2**14, 1)))
    assert kernels._needs_int64(meta((2**16, 4, 2**14), (4, 1, 2**18)))  # stored [H, T, M]
    assert kernels._needs_int64(meta((2**16, 4, 2**14), (2**14, 2**30, 1)))  # stored [M, T, H]
    assert kernels._needs_int64(meta((2**18, 2**14), (1, 2**18)))  # out stored [H, T]

    t, m, h = 3, 4, 3
    big = 2**30  # (h - 1) * big and (m - 1) * big pass 2^31 - 1
    layouts = {"[H, T, M]": (m, 1, big), "[M, T, H]": (h, big, 1)}
    out_strides = (1, big)  # out [T, H] stored [H, T]
    loads = []

    def record(self, ptrs, mask, other, *args):
        dtype = ptrs.get_element_ty()
        loads.append((str(dtype), ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]))
        return interpreter.TensorHandle(np.zeros(ptrs.data.shape, interpreter._get_np_dtype(dtype)), dtype)

    class Launch:  # kernel[grid](residual, *strides, out, *strides, ...) with the huge strides
        def __init__(self, kernel, strides):
            self.kernel, self.strides = kernel, strides

        def __getitem__(self, grid):
            def launch(*args, **kw):
                args = list(args)
                args[1:4] = self.strides
                fake = [meta((t, m, h), self.strides)]
                if kw.get("FUSE_POST"):
                    args[5:7] = out_strides
                    fake.append(meta((t, h), out_strides))
                return self.kernel[grid](*args, **{**kw, "WIDE": kernels._needs_int64(*fake)})
            return launch

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", record)
    residual = torch.zeros(t, m, h, dtype=torch.float16)
    out = torch.zeros(t, h, dtype=torch.bfloat16)
    post, comb = torch.rand(t, m), torch.rand(t, m, m)
    fn, base, scale = make_params(m, h)
    fn_head, base_head, scale_head = torch.randn(m, m * h), torch.randn(m), torch.ones(1)
    real = {name: getattr(kernels, name) for name in ("_mix_kernel", "_streams_sum_kernel")}
    for name, (s_t, s_m, s_h) in layouts.items():
        for kernel, fn_ in real.items():
            monkeypatch.setattr(kernels, kernel, Launch(fn_, (s_t, s_m, s_h)))
        loads.clear()
        mhc_pre(residual, fn, base, scale, backend="triton")  # projection + layer input in one launch
        mhc_head(residual, fn_head, base_head, scale_head, backend="triton")  # + the weighted-sum kernel
        mhc_post(out, residual, post, comb, backend="triton")  # (the fused post_pre's loads are post's)
        s_ot, s_oh = out_strides
        for dtype, base_ptr, want in (
                ("fp16", residual.data_ptr(), {i * s_t + j * s_m + k * s_h
                                               for i in range(t) for j in range(m) for k in range(h)}),
                ("bf16", out.data_ptr(), {i * s_ot + k * s_oh for i in range(t) for k in range(h)})):
            got = [((a - np.uint64(base_ptr)).view(np.int64) // 2) for d, a in loads if d == dtype]
            assert got, (name, dtype)
            assert set(np.concatenate(got).tolist()) == want, (name, dtype)


@pytest.mark.parametrize("value", [-1e-6, float("nan"), float("inf"), -float("inf"), "1e-6", None])
def test_negative_or_non_finite_eps_and_rms_eps_raise_value_error(value):
    """A negative, NaN or infinite eps (pre, softmax and Sinkhorn) or rms_eps (the RMS's rsqrt), or
    one that is no number, was accepted: eps = -0.05 gave comb entries near -15, rms_eps < 0 NaN on
    a token of small RMS, inf / NaN NaN coefficients (rms_eps = inf: a zero projection), without an
    error. Zero stays valid (ModelConfig allows it)."""
    m, h = 4, 8
    fn, base, scale = make_params(m, h, seed=90)
    residual = torch.randn(3, m, h, generator=torch.Generator().manual_seed(91))
    out, post, comb = torch.randn(3, h), torch.rand(3, m), torch.rand(3, m, m)
    head = (torch.randn(m, m * h), torch.randn(m), torch.ones(1))
    backends = ["torch"] + (["triton"] if not torch.cuda.is_available() else [])  # the checks precede any launch
    for name in ("eps", "rms_eps"):
        kw = {name: value}
        msg = rf"^{name} must be a finite number >= 0, got {re.escape(repr(value))}"
        for backend in backends:
            with pytest.raises(ValueError, match=msg):
                mhc_pre(residual, fn, base, scale, backend=backend, **kw)
            with pytest.raises(ValueError, match=msg):
                mhc_post_pre(out, residual, post, comb, fn, base, scale, backend=backend, **kw)
            with pytest.raises(ValueError, match=msg):
                mhc_pre_broadcast(residual[:, 0], fn, base, scale, backend=backend, **kw)
            with pytest.raises(ValueError, match=msg):
                mhc_head(residual, *head, backend=backend, **kw)
        with pytest.raises(ValueError, match=msg):
            MHC(h, m, **kw)
        with pytest.raises(ValueError, match=msg):
            MHCHead(h, m, **kw)
    with pytest.raises(ValueError, match=rf"^eps must be a finite number >= 0, got {re.escape(repr(value))}"):
        sinkhorn(torch.rand(2, m, m), 3, value)
    zero = mhc_pre(residual, fn, base, scale, eps=0, rms_eps=0.0, backend="torch")
    assert torch.isfinite(zero.comb).all()
