"""Sequence parallelism and overlapped TP ops on real gloo processes (1, 2 and 4 ranks).

One launch per world size runs every case (spawning is the slow part); each case returns
None or the failure's traceback, and one pytest item per (world size, case) reports it.
Every rank builds the same full tensors from a shared seed and checks its own slice of an
independent dense computation (plain matmuls over the full tensors, loops over ranks).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_case_passed, assert_value_error, launch_once, run_tp_cases
from parallel.sp import (
    FP8_REL_TOL,
    ColumnParallelLinear,
    Fp8Activation,
    RowParallelLinear,
    all_gather_fp8,
    all_gather_matmul,
    all_gather_matmul_fp8,
    matmul_reduce_scatter,
    matmul_reduce_scatter_fp8,
    quantize_fp8_per_token,
    quantize_fp8_weight,
    rms_norm_quantize_all_gather,
    rms_norm_quantize_fp8,
    sp_all_gather,
    sp_reduce_scatter,
    sp_shard,
)

WORLD_SIZES = (1, 2, 4)
OURS = ("decomposed", "reference")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# cases: (tp group, rank, world size) -> raises AssertionError on a wrong value


def all_gather_matmul_matches_dense_product_for_several_weights(tp, r, P):
    m, K = 3, 8
    g = _gen(1)
    x_full = torch.randn(P * m, K, generator=g)
    ws = [torch.randn(K, 5, generator=g), torch.randn(K, 2, generator=g)]
    x = x_full[r * m:(r + 1) * m]
    for backend in OURS:
        outs = all_gather_matmul(x, ws, tp, backend=backend)
        assert len(outs) == 2
        for i, (o, w) in enumerate(zip(outs, ws)):
            _close(o, x_full @ w, f"{backend} output {i}")
        gathered, *outs2 = all_gather_matmul(x, ws, tp, return_gathered=True, backend=backend)
        assert torch.equal(gathered, x_full), backend
        for o, o2 in zip(outs, outs2):
            assert torch.equal(o, o2)
    dec = all_gather_matmul(x, ws, tp, backend="decomposed")
    ref = all_gather_matmul(x, ws, tp, backend="reference")
    for a, b in zip(dec, ref):
        _close(a, b, "decomposed vs reference", 1e-6)
    # a raw ProcessGroup (None for the world of a 1-process job) works as well as a Group
    raw = all_gather_matmul(x, ws, tp.group, backend="decomposed")
    for a, b in zip(raw, dec):
        assert torch.equal(a, b)


def all_gather_matmul_gathers_along_a_middle_dim(tp, r, P):
    B, m, K, N = 2, 3, 6, 4
    g = _gen(2)
    x_full = torch.randn(B, P * m, K, generator=g)
    w = torch.randn(K, N, generator=g)
    x = x_full[:, r * m:(r + 1) * m]  # non-contiguous shard
    for backend in OURS:
        for dim in (1, -2):
            gathered, out = all_gather_matmul(x, [w], tp, gather_dim=dim, return_gathered=True, backend=backend)
            assert torch.equal(gathered, x_full), (backend, dim)
            _close(out, torch.einsum("bsk,kn->bsn", x_full, w), f"{backend} gather_dim={dim}")
        # gather_dim 0 of a 3D shard: [m, B, K] shards concatenated along dim 0
        y_full = torch.randn(P * m, B, K, generator=_gen(3))
        (out,) = all_gather_matmul(y_full[r * m:(r + 1) * m], [w], tp, backend=backend)
        _close(out, y_full @ w, f"{backend} 3D gather_dim=0")


def matmul_reduce_scatter_matches_sum_of_rank_products(tp, r, P):
    m, K, N = 2, 5, 7
    g = _gen(4)
    xs = torch.randn(P, P * m, K, generator=g)   # rank q's partial-sum input
    ws = torch.randn(P, K, N, generator=g)       # rank q's weight shard
    expected = sum(xs[q] @ ws[q] for q in range(P))[r * m:(r + 1) * m]
    results = {}
    for backend in OURS:
        results[backend] = matmul_reduce_scatter(xs[r], ws[r], tp, backend=backend)
        _close(results[backend], expected, f"{backend} scatter_dim=0")
        # scatter along dim 1 of [B, P*m, K]
        x3 = torch.stack([xs[r], 2 * xs[r]])
        out = matmul_reduce_scatter(x3, ws[r], tp, scatter_dim=1, backend=backend)
        _close(out, torch.stack([expected, 2 * expected]), f"{backend} scatter_dim=1")
    _close(results["decomposed"], results["reference"], "decomposed vs reference (sum order differs)", 1e-5)


def all_gather_matmul_gradients_match_dense(tp, r, P):
    m, K, n1, n2 = 3, 6, 2, 3
    g = _gen(5)
    X = torch.randn(P * m, K, generator=g, dtype=torch.float64)
    W1 = torch.randn(K, P * n1, generator=g, dtype=torch.float64)   # column-parallel: rank r holds cols
    W2 = torch.randn(K, P * n2, generator=g, dtype=torch.float64)
    G1 = torch.randn(P * m, P * n1, generator=g, dtype=torch.float64)
    G2 = torch.randn(P * m, P * n2, generator=g, dtype=torch.float64)
    H = torch.randn(P, P * m, K, generator=g, dtype=torch.float64)   # rank q's weight on the gathered x
    Xd, W1d, W2d = (t.clone().requires_grad_() for t in (X, W1, W2))
    dense = ((Xd @ W1d) * G1).sum() + ((Xd @ W2d) * G2).sum() + (Xd * H.sum(0)).sum()
    dense.backward()
    c1, c2 = slice(r * n1, (r + 1) * n1), slice(r * n2, (r + 1) * n2)
    rows = slice(r * m, (r + 1) * m)
    for backend in OURS:
        x = X[rows].clone().requires_grad_()
        w1, w2 = W1[:, c1].clone().requires_grad_(), W2[:, c2].clone().requires_grad_()
        gathered, o1, o2 = all_gather_matmul(x, [w1, w2], tp, return_gathered=True, backend=backend)
        ((o1 * G1[:, c1]).sum() + (o2 * G2[:, c2]).sum() + (gathered * H[r]).sum()).backward()
        _close(x.grad, Xd.grad[rows], f"{backend} grad x (gathered used)")
        _close(w1.grad, W1d.grad[:, c1], f"{backend} grad w1")
        _close(w2.grad, W2d.grad[:, c2], f"{backend} grad w2")
        # without return_gathered (the weight gradient re-gathers x), and an output left unused
        x = X[rows].clone().requires_grad_()
        w1, w2 = W1[:, c1].clone().requires_grad_(), W2[:, c2].clone().requires_grad_()
        o1, _ = all_gather_matmul(x, [w1, w2], tp, backend=backend)
        (o1 * G1[:, c1]).sum().backward()
        assert w2.grad is None, backend
        Xd1 = X.clone().requires_grad_()
        ((Xd1 @ W1) * G1).sum().backward()
        _close(x.grad, Xd1.grad[rows], f"{backend} grad x")
        _close(w1.grad, W1d.grad[:, c1], f"{backend} grad w1 (re-gathered)")


def matmul_reduce_scatter_gradients_match_dense(tp, r, P):
    m, k, N = 2, 3, 4
    g = _gen(6)
    X = torch.randn(P * m, P * k, generator=g, dtype=torch.float64)  # row-parallel: rank r holds K cols
    W = torch.randn(P * k, N, generator=g, dtype=torch.float64)
    G = torch.randn(P * m, N, generator=g, dtype=torch.float64)
    Xd, Wd = X.clone().requires_grad_(), W.clone().requires_grad_()
    ((Xd @ Wd) * G).sum().backward()
    ks, rows = slice(r * k, (r + 1) * k), slice(r * m, (r + 1) * m)
    for backend in OURS:
        x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
        out = matmul_reduce_scatter(x, w, tp, backend=backend)
        _close(out, (X @ W)[rows], f"{backend} forward")
        (out * G[rows]).sum().backward()
        _close(x.grad, Xd.grad[:, ks], f"{backend} grad x")
        _close(w.grad, Wd.grad[ks], f"{backend} grad w")


def sp_helpers_round_trip_uneven_tokens_with_gradients(tp, r, P):
    H = 3
    for T in sorted({0, 1, P + 1, 2 * P - 1, 13, 2 * P}):  # 0: a batch with no tokens, every rank holds 0
        m = -(-T // P)
        g = _gen(100 + T)
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        padded = torch.cat([x, torch.zeros(P * m - T, H, dtype=torch.float64)])
        # shard of a replicated tensor; backward all-gathers the shard gradients
        xl = x.clone().requires_grad_()
        s = sp_shard(xl, tp)
        assert s.shape == (m, H) and torch.equal(s, padded[r * m:(r + 1) * m]), T
        Gs = torch.randn(P * m, H, generator=g, dtype=torch.float64)
        (s * Gs[r * m:(r + 1) * m]).sum().backward()
        _close(xl.grad, Gs[:T], f"T={T} sp_shard grad")
        # gather drops the padding; backward reduce-scatters (tensor-parallel consumers) or slices
        for reduce_grad in (True, False):
            sl = s.detach().clone().requires_grad_()
            y = sp_all_gather(sl, tp, num_tokens=T, reduce_grad=reduce_grad)
            assert torch.equal(y, x), T
            Gq = torch.randn(P, T, H, generator=_gen(7 + T), dtype=torch.float64)  # rank q's loss weights
            (y * (Gq[r] if reduce_grad else Gq[0])).sum().backward()
            exp = torch.cat([Gq.sum(0) if reduce_grad else Gq[0], torch.zeros(P * m - T, H, dtype=torch.float64)])
            _close(sl.grad, exp[r * m:(r + 1) * m], f"T={T} sp_all_gather grad reduce_grad={reduce_grad}")
        # reduce-scatter of per-rank partial sums
        parts = torch.randn(P, T, H, generator=_gen(9 + T), dtype=torch.float64)
        pl = parts[r].clone().requires_grad_()
        out = sp_reduce_scatter(pl, tp)
        summed = torch.cat([parts.sum(0), torch.zeros(P * m - T, H, dtype=torch.float64)])
        _close(out, summed[r * m:(r + 1) * m], f"T={T} sp_reduce_scatter")
        (out * Gs[r * m:(r + 1) * m]).sum().backward()
        _close(pl.grad, Gs[:T], f"T={T} sp_reduce_scatter grad")


def parallel_linears_match_dense_mlp_with_uneven_tokens(tp, r, P):
    T, Hd, F_ = 13, 8, 12
    torch.manual_seed(11)
    lin1 = torch.nn.Linear(Hd, 2 * F_, dtype=torch.float64)   # fused [gate; up]
    lin2 = torch.nn.Linear(F_, Hd, dtype=torch.float64)
    x = torch.randn(T, Hd, dtype=torch.float64)
    G = torch.randn(T, Hd, dtype=torch.float64)

    def mlp(gate, up, row):
        return row(F.silu(gate) * up)

    xd = x.clone().requires_grad_()
    gd, ud = lin1(xd).split(F_, dim=-1)
    yd = lin2(F.silu(gd) * ud)
    (yd * G).sum().backward()
    f = F_ // P
    own = torch.cat([torch.arange(r * f, (r + 1) * f), F_ + torch.arange(r * f, (r + 1) * f)])
    for sp in (True, False):
        for overlap in ((True, False) if sp else (True,)):
            what = f"sequence_parallel={sp} overlap={overlap}"
            col = ColumnParallelLinear.from_full(lin1.weight.detach(), lin1.bias.detach(), tp, out_features=[F_, F_],
                                                 sequence_parallel=sp, overlap=overlap)
            row = RowParallelLinear.from_full(lin2.weight.detach(), lin2.bias.detach(), tp,
                                              sequence_parallel=sp, overlap=overlap)
            assert col.weight.shape == (2 * f, Hd) and row.weight.shape == (Hd, f), what
            xl = x.clone().requires_grad_()
            if sp:
                gate, up = col(sp_shard(xl, tp))
                y = sp_all_gather(mlp(gate, up, row), tp, num_tokens=T, reduce_grad=False)
            else:
                gate, up = col(xl)
                y = mlp(gate, up, row)
            _close(y, yd.detach(), f"{what} forward")
            (y * G).sum().backward()
            _close(xl.grad, xd.grad, f"{what} grad x")
            _close(col.weight.grad, lin1.weight.grad[own], f"{what} grad column weight")
            _close(col.bias.grad, lin1.bias.grad[own], f"{what} grad column bias")
            _close(row.weight.grad, lin2.weight.grad[:, r * f:(r + 1) * f], f"{what} grad row weight")
            row_bias_grad = row.bias.grad.clone()
            if sp:  # per-rank partial: the trainer all-reduces it over TP (see modules.py)
                assert getattr(row.bias, "sequence_parallel", False)
                if P > 1:
                    torch.distributed.all_reduce(row_bias_grad, group=tp.group)
            _close(row_bias_grad, lin2.bias.grad, f"{what} grad row bias")


def fp8_all_gather_matmul_matches_dequantized_and_fp32_products(tp, r, P):
    m, K = 4, 32
    g = _gen(12)
    x_full = torch.randn(P * m, K, generator=g)
    ws = [torch.randn(K, 16, generator=g), torch.randn(K, 8, generator=g)]
    qws = [quantize_fp8_weight(w) for w in ws]
    x = x_full[r * m:(r + 1) * m]
    q_full = quantize_fp8_per_token(x_full)  # per-token: quantizing the full tensor = quantizing shards
    for backend in OURS:
        for given in ("float", "fp8"):
            arg = x if given == "float" else quantize_fp8_per_token(x)
            res = all_gather_matmul_fp8(arg, qws, tp, return_gathered=True, out_dtype=torch.float32,
                                        backend=backend)
            assert torch.equal(res.gathered.data.view(torch.uint8), q_full.data.view(torch.uint8)), backend
            assert torch.equal(res.gathered.scale, q_full.scale), backend
            for i, (o, w, qw) in enumerate(zip(res.outputs, ws, qws)):
                _close(o, q_full.dequantize() @ qw.dequantize(), f"{backend} {given} output {i} vs dequantized")
                err = ((o - x_full @ w).norm() / (x_full @ w).norm()).item()
                assert err < FP8_REL_TOL, f"{backend} output {i} fp8 error {err:.4f} >= {FP8_REL_TOL}"
        # gather along dim 1 of [B, P*m, K]
        x3 = torch.stack([x_full, -x_full])
        res = all_gather_matmul_fp8(x3[:, r * m:(r + 1) * m], qws[:1], tp, gather_dim=1, out_dtype=torch.float32,
                                    backend=backend)
        q3 = quantize_fp8_per_token(x3)
        _close(res.outputs[0], q3.dequantize() @ qws[0].dequantize(), f"{backend} fp8 gather_dim=1")
        assert res.gathered is None


def fp8_rms_norm_quantize_all_gather_equals_quantized_full_norm(tp, r, P):
    m, Hd = 3, 16
    g = _gen(13)
    x_full = torch.randn(P * m, Hd, generator=g) * 3
    nw = torch.rand(Hd, generator=g) + 0.5
    eps = 1e-6
    normed = x_full / torch.sqrt((x_full ** 2).mean(-1, keepdim=True) + eps) * nw
    expect = quantize_fp8_per_token(normed)
    got = rms_norm_quantize_all_gather(x_full[r * m:(r + 1) * m], nw, tp, eps=eps)
    assert got.data.dtype == torch.float8_e4m3fn
    # same fp8 bytes except where fp32 rounding of the norm flips a rounding decision
    mismatch = (got.data.view(torch.uint8) != expect.data.view(torch.uint8)).float().mean().item()
    assert mismatch < 0.02, mismatch
    _close(got.scale, expect.scale, "scales", 1e-5)
    err = ((got.dequantize() - normed).norm() / normed.norm()).item()
    assert err < FP8_REL_TOL, err
    # the SP-region sequence feeding an fp8 column-parallel matmul
    w = torch.randn(Hd, 16, generator=g)
    q_shard = rms_norm_quantize_fp8(x_full[r * m:(r + 1) * m], nw, eps)
    (out,) = all_gather_matmul_fp8(q_shard, [quantize_fp8_weight(w)], tp, out_dtype=torch.float32).outputs
    err = ((out - normed @ w).norm() / (normed @ w).norm()).item()
    assert err < FP8_REL_TOL, err


def fp8_matmul_reduce_scatter_matches_dequantized_sum(tp, r, P):
    m, K, N = 2, 32, 16
    g = _gen(14)
    xs = torch.randn(P, P * m, K, generator=g)
    ws = torch.randn(P, K, N, generator=g)
    qws = [quantize_fp8_weight(ws[q]) for q in range(P)]
    deq = sum(quantize_fp8_per_token(xs[q]).dequantize() @ qws[q].dequantize() for q in range(P))
    exact = sum(xs[q] @ ws[q] for q in range(P))
    rows = slice(r * m, (r + 1) * m)
    outs = {}
    for backend in OURS:
        outs[backend] = matmul_reduce_scatter_fp8(xs[r], qws[r], tp, out_dtype=torch.float32, backend=backend)
        _close(outs[backend], deq[rows], f"{backend} vs dequantized")
        err = ((outs[backend] - exact[rows]).norm() / exact[rows].norm()).item()
        assert err < FP8_REL_TOL, err
    _close(outs["decomposed"], outs["reference"], "decomposed vs reference (sum order differs)", 1e-5)


FP8_GRAD_TOL = 2e-5
"""fp8 gradient checks: both sides multiply the same dequantized fp8 values (STE backward in
fp32), so they differ only by fp32 summation order (block matmuls, reduce-scatter sums)."""


def _fake_fp8(v: torch.Tensor, dim: int) -> torch.Tensor:
    """deq(q(v)) in fp32 with one scale per slice along `dim` (amax / 448), written independently of fp8.py."""
    scale = v.detach().abs().amax(dim=dim, keepdim=True) / 448.0
    return (v.detach() / scale).to(torch.float8_e4m3fn).float() * scale


def _ste(v: torch.Tensor, dim: int) -> torch.Tensor:
    """Forward value deq(q(v)) exactly; backward the identity (straight-through estimator)."""
    return _fake_fp8(v, dim) + (v - v.detach())


def fp8_all_gather_matmul_gradients_match_dense_ste(tp, r, P):
    m, K, n1, n2 = 3, 32, 16, 8
    g = _gen(15)
    X = torch.randn(P * m, K, generator=g)
    W1 = torch.randn(K, P * n1, generator=g)  # column-parallel: rank r holds columns; per-column scales
    W2 = torch.randn(K, P * n2, generator=g)
    G1 = torch.randn(P * m, P * n1, generator=g)
    G2 = torch.randn(P * m, P * n2, generator=g)
    Xd, W1d, W2d = (t.clone().requires_grad_() for t in (X, W1, W2))
    Xs = _ste(Xd, -1)
    (((Xs @ _ste(W1d, 0)) * G1).sum() + ((Xs @ _ste(W2d, 0)) * G2).sum()).backward()
    X1 = X.clone().requires_grad_()  # only output 1 used
    ((_ste(X1, -1) @ _fake_fp8(W1, 0)) * G1).sum().backward()
    c1, c2, rows = slice(r * n1, (r + 1) * n1), slice(r * n2, (r + 1) * n2), slice(r * m, (r + 1) * m)
    for backend in OURS:
        x = X[rows].clone().requires_grad_()
        w1, w2 = W1[:, c1].clone().requires_grad_(), W2[:, c2].clone().requires_grad_()
        o1, o2 = all_gather_matmul_fp8(x, [w1, w2], tp, out_dtype=torch.float32, backend=backend).outputs
        _close(o1, _fake_fp8(X, -1) @ _fake_fp8(W1, 0)[:, c1], f"{backend} fp8 forward", FP8_GRAD_TOL)
        ((o1 * G1[:, c1]).sum() + (o2 * G2[:, c2]).sum()).backward()
        _close(x.grad, Xd.grad[rows], f"{backend} fp8 grad x", FP8_GRAD_TOL)
        _close(w1.grad, W1d.grad[:, c1], f"{backend} fp8 grad w1 (re-gathered fp8)", FP8_GRAD_TOL)
        _close(w2.grad, W2d.grad[:, c2], f"{backend} fp8 grad w2", FP8_GRAD_TOL)
        # return_gathered (its fp8 reused for the weight gradient), one output unused
        x = X[rows].clone().requires_grad_()
        w1, w2 = W1[:, c1].clone().requires_grad_(), W2[:, c2].clone().requires_grad_()
        res = all_gather_matmul_fp8(x, [w1, w2], tp, return_gathered=True, out_dtype=torch.float32, backend=backend)
        _close(res.gathered.dequantize(), _fake_fp8(X, -1), f"{backend} fp8 gathered", 0)
        (res.outputs[0] * G1[:, c1]).sum().backward()
        assert w2.grad is None, backend
        _close(x.grad, X1.grad[rows], f"{backend} fp8 grad x (one output)", FP8_GRAD_TOL)
        _close(w1.grad, W1d.grad[:, c1], f"{backend} fp8 grad w1 (returned gathered)", FP8_GRAD_TOL)
        # pre-quantized operands get no gradient: fp8 x with float w, float x with fp8 w
        w1 = W1[:, c1].clone().requires_grad_()
        (o1,) = all_gather_matmul_fp8(quantize_fp8_per_token(X[rows]), [w1], tp, out_dtype=torch.float32,
                                      backend=backend).outputs
        (o1 * G1[:, c1]).sum().backward()
        _close(w1.grad, W1d.grad[:, c1], f"{backend} fp8 grad w1 (fp8 x)", FP8_GRAD_TOL)
        x = X[rows].clone().requires_grad_()
        (o1,) = all_gather_matmul_fp8(x, [quantize_fp8_weight(W1[:, c1])], tp, out_dtype=torch.float32,
                                      backend=backend).outputs
        (o1 * G1[:, c1]).sum().backward()
        _close(x.grad, X1.grad[rows], f"{backend} fp8 grad x (fp8 w)", FP8_GRAD_TOL)
    # gather along dim 1 of [B, P*m, K], bf16 outputs: the gradients stay fp32 (the input's dtype)
    X3 = torch.randn(2, P * m, K, generator=g)
    G3 = torch.randn(2, P * m, P * n1, generator=g).bfloat16().float()
    X3d, W1d = X3.clone().requires_grad_(), W1.clone().requires_grad_()
    ((_ste(X3d, -1) @ _ste(W1d, 0)) * G3).sum().backward()
    for backend in OURS:
        x = X3[:, rows].clone().requires_grad_()
        w1 = W1[:, c1].clone().requires_grad_()
        (o1,) = all_gather_matmul_fp8(x, [w1], tp, gather_dim=1, backend=backend).outputs
        assert o1.dtype == torch.bfloat16, o1.dtype
        (o1.float() * G3[..., c1]).sum().backward()
        assert x.grad.dtype == torch.float32 and w1.grad.dtype == torch.float32
        _close(x.grad, X3d.grad[:, rows], f"{backend} fp8 grad x gather_dim=1", FP8_GRAD_TOL)
        _close(w1.grad, W1d.grad[:, c1], f"{backend} fp8 grad w1 gather_dim=1", FP8_GRAD_TOL)


def fp8_matmul_reduce_scatter_gradients_match_dense_ste(tp, r, P):
    m, k, N = 2, 32, 16
    g = _gen(16)
    X = torch.randn(P * m, P * k, generator=g)  # row-parallel: rank r holds K columns of x, K rows of w
    W = torch.randn(P * k, N, generator=g)
    G = torch.randn(P * m, N, generator=g).bfloat16().float()
    Xd, Wd = X.clone().requires_grad_(), W.clone().requires_grad_()
    dense = sum(_ste(Xd[:, q * k:(q + 1) * k], -1) @ _ste(Wd[q * k:(q + 1) * k], 0) for q in range(P))
    (dense * G).sum().backward()
    ks, rows = slice(r * k, (r + 1) * k), slice(r * m, (r + 1) * m)
    for backend in OURS:
        for out_dtype in (torch.float32, torch.bfloat16):
            x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
            out = matmul_reduce_scatter_fp8(x, w, tp, out_dtype=out_dtype, backend=backend)
            if out_dtype == torch.float32:
                _close(out, dense.detach()[rows], f"{backend} fp8 forward", FP8_GRAD_TOL)
            else:  # partial sums travel (and are rounded) in bf16: 8 bits a partial
                err = ((out.float() - dense.detach()[rows]).norm() / dense.detach()[rows].norm()).item()
                assert err < 1e-2, f"{backend} bf16 fp8 forward error {err}"
            (out.float() * G[rows]).sum().backward()
            _close(x.grad, Xd.grad[:, ks], f"{backend} {out_dtype} fp8 grad x", FP8_GRAD_TOL)
            _close(w.grad, Wd.grad[ks], f"{backend} {out_dtype} fp8 grad w", FP8_GRAD_TOL)
        # weight gradient alone (the output gradient is only gathered, no matmul)
        w = W[ks].clone().requires_grad_()
        out = matmul_reduce_scatter_fp8(X[:, ks], w, tp, out_dtype=torch.float32, backend=backend)
        (out * G[rows]).sum().backward()
        _close(w.grad, Wd.grad[ks], f"{backend} fp8 grad w alone", FP8_GRAD_TOL)


def fp8_rms_norm_quantize_all_gather_gradients_match_dense_ste(tp, r, P):
    m, Hd, eps = 3, 16, 1e-6
    g = _gen(17)
    X = torch.randn(P * m, Hd, generator=g) * 2
    NW = torch.rand(Hd, generator=g) + 0.5
    Hs = torch.randn(P, P * m, Hd, generator=g)  # rank q's weighting of the gathered values
    Xd, NWd = X.clone().requires_grad_(), NW.clone().requires_grad_()
    normed = Xd / torch.sqrt((Xd ** 2).mean(-1, keepdim=True) + eps) * NWd
    (_ste(normed, -1) * Hs.sum(0)).sum().backward()
    rows = slice(r * m, (r + 1) * m)
    x, nw = X[rows].clone().requires_grad_(), NW.clone().requires_grad_()
    got = rms_norm_quantize_all_gather(x, nw, tp, eps=eps)
    plain = rms_norm_quantize_all_gather(X[rows], NW, tp, eps=eps)  # no grad: the same fp8 bytes
    assert torch.equal(got.data.view(torch.uint8), plain.data.view(torch.uint8)) and torch.equal(got.scale, plain.scale)
    _close(got.dequantize(), plain.dequantize(), "ste value = dequantized", 0)
    (got.dequantize() * Hs[r]).sum().backward()
    _close(x.grad, Xd.grad[rows], "rms_norm_quantize_all_gather grad x", FP8_GRAD_TOL)
    nw_grad = nw.grad.clone()  # this rank's tokens only: the SP region all-reduces it
    if P > 1:
        torch.distributed.all_reduce(nw_grad, group=tp.group)
    _close(nw_grad, NWd.grad, "rms_norm_quantize_all_gather grad norm weight (all-reduced)", FP8_GRAD_TOL)


def bad_inputs_raise_value_errors_naming_the_values(tp, r, P):
    expect = assert_value_error

    x = torch.randn(P * 2 + (1 if P > 1 else 0), 4)
    w = torch.randn(4, 3)
    if P > 1:
        expect(lambda: matmul_reduce_scatter(x, w, tp), f"= {x.shape[0]}", f"group size {P}")
        expect(lambda: ColumnParallelLinear(4, 4 * P + 1, tp), f"({4 * P + 1})", f"size {P}")
        expect(lambda: RowParallelLinear(4 * P + 1, 4, tp), "in_features", f"multiples of {P}")
        expect(lambda: sp_all_gather(torch.randn(2, 3), tp, num_tokens=2 * P + 1), f"({2 * P + 1})")
    expect(lambda: all_gather_matmul(x, [w], tp, gather_dim=1), "gather_dim (1)", "0..0")
    expect(lambda: all_gather_matmul(x, [torch.randn(5, 3)], tp), "(5, 3)", "K=4")
    expect(lambda: all_gather_matmul(x, [w.double()], tp), "torch.float64", "torch.float32")
    expect(lambda: all_gather_matmul(x, [w], tp, backend="nccl"), "'nccl'", "decomposed")
    col = ColumnParallelLinear(4, [2 * P, 2 * P], tp)
    expect(lambda: col.load_full_weight(torch.randn(4 * P, 5)), f"({4 * P}, 5)", f"[{4 * P}, 4]")
    if P > 1:  # on CPU the symmetric-memory backend is named as unavailable, with the alternatives
        expect(lambda: all_gather_matmul(torch.randn(2, 4), [w], tp, backend="symm_mem"), "not CUDA", "decomposed")
    # fp8 partial sums cannot be reduced: refused up front on every backend and group size (the
    # decomposed engine used to fail in its final sum, after every transfer had run)
    for backend in OURS:
        expect(lambda: matmul_reduce_scatter_fp8(torch.randn(2 * P, 32), torch.randn(32, 16), tp,
                                                 out_dtype=torch.float8_e4m3fn, backend=backend),
               "torch.float8_e4m3fn", "torch.bfloat16")
    # nor can the plain ops take fp8 operands (no scales): the decomposed reduce-scatter used to fail in
    # its final sum after every transfer had run, and the all-gather returned saturated unscaled products
    x8, w8 = torch.randn(2 * P, 4).to(torch.float8_e4m3fn), torch.randn(4, 3).to(torch.float8_e4m3fn)
    for backend in OURS:
        expect(lambda: matmul_reduce_scatter(x8, w8, tp, backend=backend), "torch.float8_e4m3fn",
               "matmul_reduce_scatter_fp8")
        expect(lambda: all_gather_matmul(x8, [w8], tp, backend=backend), "torch.float8_e4m3fn",
               "all_gather_matmul_fp8")
        expect(lambda: all_gather_matmul_fp8(torch.randn(2, 32), [torch.randn(32, 16)], tp, out_dtype=torch.int32,
                                             backend=backend), "out_dtype torch.int32", "torch.bfloat16")
    # a per-token scale of shape [m] (not [m, 1]) was gathered into a scale that dequantize broadcast
    # over K: with m = 2, K = 2 * P the gathered [2P, 2P] values came out silently wrong
    q = quantize_fp8_per_token(torch.randn(2, 2 * P))
    expect(lambda: all_gather_fp8(Fp8Activation(q.data, q.scale[:, 0]), tp), "scales (2,)", "[..., 1]")


def _awkward_ops_against_plain_autograd(grp) -> None:
    """One group's awkward cases against autograd of the plain formulas (float64, tight tolerance)."""
    r, P = grp.rank, grp.size
    f64 = torch.float64

    def weights(K, g):  # both layouts the API takes: [K, N] contiguous and nn.Linear's [N, K] transposed
        return [torch.randn(K, 3, generator=g, dtype=f64), torch.randn(2, K, generator=g, dtype=f64).t()]

    # all_gather_matmul: one token a rank, none at all, a middle gather dim (non-contiguous shard, batch dims)
    for shape, gd in (((1, 4), 0), ((0, 4), 0), ((2, 3, 4), 1), ((2, 1, 3, 4), -3)):
        full = list(shape)
        full[gd] *= P
        g = _gen(30 + len(shape))
        X = torch.randn(full, generator=g, dtype=f64)
        Ws = weights(shape[-1], g)
        m, gdn = shape[gd], gd % len(shape)
        for backend in OURS:
            for ret in (False, True):
                what = f"P={P} ranks={list(grp.ranks)} all_gather_matmul {shape} gather_dim={gd} {backend} ret={ret}"
                x = X.narrow(gdn, r * m, m).clone().requires_grad_()
                ws = [W.clone().requires_grad_() if i == 0 else W.t().clone().t().requires_grad_()
                      for i, W in enumerate(Ws)]
                outs = all_gather_matmul(x, ws, grp, gather_dim=gd, return_gathered=ret, backend=backend)
                Xd = X.clone().requires_grad_()
                Wd = [W.clone().requires_grad_() for W in Ws]
                dense = ([Xd] if ret else []) + [Xd @ W for W in Wd]  # all_gather then matmul, every rank
                Gs = [torch.randn((P,) + tuple(d.shape), generator=_gen(40 + i), dtype=f64) for i, d in enumerate(dense)]
                for o, d in zip(outs, dense):
                    _close(o, d.detach(), f"{what} forward", 1e-12)
                sum((o * G[r]).sum() for o, G in zip(outs, Gs)).backward()
                # x feeds every rank's outputs (rank q's loss weights Gs[.][q]); the weights only this rank's
                (gx,) = torch.autograd.grad(sum((d * G.sum(0)).sum() for d, G in zip(dense, Gs)), [Xd], retain_graph=True)
                gws = torch.autograd.grad(sum((d * G[r]).sum() for d, G in zip(dense, Gs)), Wd)
                _close(x.grad, gx.narrow(gdn, r * m, m), f"{what} grad x", 1e-12)
                for i, (w, gw) in enumerate(zip(ws, gws)):
                    _close(w.grad, gw, f"{what} grad w{i}", 1e-12)
    # matmul_reduce_scatter: one token a rank, none, a middle scatter dim; every rank's own partial input
    for shape, sd in (((1, 4), 0), ((0, 4), 0), ((2, 3, 4), 1)):
        full = list(shape)
        full[sd] *= P
        g = _gen(50 + len(shape))
        Xs = torch.randn((P,) + tuple(full), generator=g, dtype=f64)
        Ws = torch.randn(P, 3, shape[-1], generator=g, dtype=f64).transpose(1, 2)  # rank q's [K, N], transposed
        G = torch.randn(full[:-1] + [3], generator=g, dtype=f64)
        m, sdn = shape[sd], sd % len(shape)
        Xd, Wd = Xs.clone().requires_grad_(), Ws.clone().requires_grad_()
        dense = sum(Xd[q] @ Wd[q] for q in range(P))  # matmul then reduce_scatter (sum)
        (dense * G).sum().backward()
        for backend in OURS:
            what = f"P={P} ranks={list(grp.ranks)} matmul_reduce_scatter {shape} scatter_dim={sd} {backend}"
            x, w = Xs[r].clone().requires_grad_(), Ws[r].clone().requires_grad_()
            out = matmul_reduce_scatter(x, w, grp, scatter_dim=sd, backend=backend)
            _close(out, dense.detach().narrow(sdn, r * m, m), f"{what} forward", 1e-12)
            (out * G.narrow(sdn, r * m, m)).sum().backward()
            _close(x.grad, Xd.grad[r], f"{what} grad x", 1e-12)
            _close(w.grad, Wd.grad[r], f"{what} grad w", 1e-12)
    # bf16 operands: bf16 results within bf16 rounding of the fp32 products
    g = _gen(60)
    X = torch.randn(P * 3, 16, generator=g).bfloat16()
    W = torch.randn(16, 8, generator=g).bfloat16()
    Xs = torch.randn(P, P * 3, 16, generator=g).bfloat16()
    for backend in OURS:
        (o,) = all_gather_matmul(X[r * 3:(r + 1) * 3], [W], grp, backend=backend)
        want = X.float() @ W.float()
        assert o.dtype == torch.bfloat16 and ((o.float() - want).norm() / want.norm()).item() < 1e-2, backend
        o = matmul_reduce_scatter(Xs[r], W, grp, backend=backend)
        want = sum(Xs[q].float() @ W.float() for q in range(P))[r * 3:(r + 1) * 3]
        assert o.dtype == torch.bfloat16 and ((o.float() - want).norm() / want.norm()).item() < 1e-2, backend
    # fp8 matmul-reduce-scatter, x bf16 and w fp32 with an fp32 output: dw keeps dy in fp32 (it was
    # rounded to x's bf16 on the way), dx is bf16
    g = _gen(61)
    X = torch.randn(P, 2 * P, 32, generator=g).bfloat16()
    W = torch.randn(P, 32, 16, generator=g)
    G = torch.randn(2 * P, 16, generator=g)
    rows = slice(r * 2, (r + 1) * 2)
    Wd = W.clone().requires_grad_()
    (sum(_fake_fp8(X[q].float(), -1) @ _ste(Wd[q], 0) for q in range(P)) * G).sum().backward()
    for backend in OURS:
        x, w = X[r].clone().requires_grad_(), W[r].clone().requires_grad_()
        out = matmul_reduce_scatter_fp8(x, w, grp, out_dtype=torch.float32, backend=backend)
        (out * G[rows]).sum().backward()
        assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32, backend
        _close(w.grad, Wd.grad[r], f"P={P} {backend} fp8 grad w (x bf16, w fp32)", FP8_GRAD_TOL)


def awkward_shapes_match_plain_autograd_on_the_group_and_a_three_rank_subgroup(tp, r, P):
    """One token a rank, zero tokens, batch dims, a middle gather / scatter dim, both weight layouts, bf16,
    float64 gradients against autograd of all_gather-then-matmul and matmul-then-reduce_scatter; on the
    4-rank job also on the group of global ranks 1, 2, 3 (TP = 3, group ranks != global ranks)."""
    _awkward_ops_against_plain_autograd(tp)
    if P == 4:
        from parallel.comm import as_group

        pg = torch.distributed.new_group([1, 2, 3])  # every rank takes part in creating it
        if r in (1, 2, 3):
            sub = as_group(pg)
            assert sub.size == 3 and sub.ranks == (1, 2, 3) and sub.rank == r - 1, sub
            _awkward_ops_against_plain_autograd(sub)


def empty_inner_dims_keep_the_plain_results_shapes(tp, r, P):
    """A zero-size dim beside the gathered / scattered one: the plain collective's shapes, not [0, 0, N]."""
    K, N, m = 8, 5, 3
    w = torch.randn(K, N, generator=_gen(18))
    qw = quantize_fp8_weight(w)
    for backend in OURS:
        gathered, out = all_gather_matmul(torch.randn(m, 0, K), [w], tp, return_gathered=True, backend=backend)
        assert gathered.shape == (P * m, 0, K) and out.shape == (P * m, 0, N), (backend, gathered.shape, out.shape)
        (out,) = all_gather_matmul(torch.randn(0, m, K), [w], tp, gather_dim=1, backend=backend)
        assert out.shape == (0, P * m, N), (backend, out.shape)
        out = matmul_reduce_scatter(torch.randn(2 * P, 0, K), w, tp, backend=backend)
        assert out.shape == (2, 0, N), (backend, out.shape)
        out = matmul_reduce_scatter(torch.randn(0, 2 * P, K), w, tp, scatter_dim=1, backend=backend)
        assert out.shape == (0, 2, N), (backend, out.shape)
        res = all_gather_matmul_fp8(torch.randn(m, 0, K), [qw], tp, return_gathered=True, out_dtype=torch.float32,
                                    backend=backend)
        assert res.outputs[0].shape == (P * m, 0, N) and res.gathered.data.shape == (P * m, 0, K), backend
        assert res.gathered.scale.shape == (P * m, 0, 1), (backend, res.gathered.scale.shape)
        out = matmul_reduce_scatter_fp8(torch.randn(2 * P, 0, K), qw, tp, out_dtype=torch.float32, backend=backend)
        assert out.shape == (2, 0, N), (backend, out.shape)
    # K = 0 (no contraction) and N = 0 (no output column), forward and gradients against the plain formulas
    # (a reshape(-1, 0) of the row view and of the weight gradient raised "ambiguous" on every backend)
    rows = slice(r * 2, (r + 1) * 2)
    for k0, n0 in ((0, 3), (4, 0)):
        g = _gen(19)
        X, Xs = torch.randn(P * 2, k0, generator=g), torch.randn(P, P * 2, k0, generator=g)
        W = torch.randn(k0, n0, generator=g)
        Gg, Go = torch.randn(P, P * 2, k0, generator=g), torch.randn(P, P * 2, n0, generator=g)
        Gr = torch.randn(P * 2, n0, generator=g)
        for backend in OURS:
            what = f"K={k0} N={n0} {backend}"
            x, w = X[rows].clone().requires_grad_(), W.clone().requires_grad_()
            gathered, out = all_gather_matmul(x, [w], tp, return_gathered=True, backend=backend)
            assert torch.equal(gathered, X) and out.shape == (P * 2, n0), (what, out.shape)
            _close(out, X @ W, f"{what} all_gather_matmul")
            ((gathered * Gg[r]).sum() + (out * Go[r]).sum()).backward()
            _close(x.grad, (Gg.sum(0) + Go.sum(0) @ W.t())[rows], f"{what} all_gather_matmul grad x")
            _close(w.grad, X.t() @ Go[r], f"{what} all_gather_matmul grad w")
            x, w = Xs[r].clone().requires_grad_(), W.clone().requires_grad_()
            out = matmul_reduce_scatter(x, w, tp, backend=backend)
            assert out.shape == (2, n0), (what, out.shape)
            _close(out, sum(Xs[q] @ W for q in range(P))[rows], f"{what} matmul_reduce_scatter")
            (out * Gr[rows]).sum().backward()
            _close(x.grad, Gr @ W.t(), f"{what} matmul_reduce_scatter grad x")
            _close(w.grad, Xs[r].t() @ Gr, f"{what} matmul_reduce_scatter grad w")


def bench_overlap_rows_time_every_backend_on_gloo(tp, r, P):
    """The overlap code of `megapar bench sp` (not run by `--quick`), on tiny shapes."""
    if P == 1:
        return
    from launch.bench.sp import overlap_rows

    rows = overlap_rows(tp, 4 * P, 8, 2 * P, quick=True)
    assert [row["case"] for row in rows] == [f"{op} tp={P} {b}" for op in ("all_gather_matmul", "matmul_reduce_scatter")
                                             for b in OURS], rows
    for row in rows:
        assert row["time_us"] > 0 and row["comm_us"] > 0 and row["gemm_us"] > 0, row


CASES = [f for name, f in sorted(globals().items()) if callable(f) and getattr(f, "__module__", None) == __name__
         and not name.startswith(("_", "test")) and f.__code__.co_varnames[:3] == ("tp", "r", "P")]


@pytest.mark.parametrize("case", [c.__name__ for c in CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sp(world_size: int, case: str) -> None:
    assert_case_passed(launch_once(run_tp_cases, world_size, __name__, False), case)
