"""The SP / async-TP ops against the semantics of their references, restated here independently.

References (read for their meaning; nothing is imported from them):
- torch's symmetric-memory fused ops (torch.distributed._symmetric_memory):
  * fused_all_gather_matmul(A_shard, Bs, gather_dim, group, return_A) -> (A, [A @ B for B in Bs]):
    A is the all-gather of the shards along gather_dim in rank order (rank r's shard is block r),
    every B is [K, N] (A @ B, no transpose), the gathered A comes first when asked for. A
    gather_dim equal to the last dim gathers K (each rank holds columns of A, B stays [K, N]).
  * fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group): reduce_op "sum" or "avg" over
    the ranks' products A_q @ B; rank r keeps chunk r along scatter_dim (the last dim = N allowed).
  * fused_all_gather_scaled_matmul / fused_scaled_matmul_reduce_scatter: A fp8 with a scale that is
    tensor-wise (one number) or row-wise ([..., 1], one per row of A, sharded and gathered with A);
    B fp8 [K, N] with a tensor-wise or per-column [1, N] scale (what _scaled_mm's row-wise mode
    takes); out = (A * a_scale) @ (B * b_scale) in out_dtype (scales multiply: they dequantize).
    The gather moves the fp8 bytes and the row scales; the fused op returns the gathered bytes.
- Megatron-LM tensor_parallel mappings / layers with sequence_parallel:
  * gather_from_sequence_parallel_region: forward all-gather along the sequence dim (rank order);
    backward reduce-scatter (sum) of the gradient when the consumers are tensor-parallel
    (tensor_parallel_output_grad), else this rank's slice of it.
  * reduce_scatter_to_sequence_parallel_region: forward reduce-scatter (sum), backward all-gather.
  * scatter_to_sequence_parallel_region: forward this rank's slice, backward all-gather.
  * ColumnParallelLinear(sequence_parallel): y = all_gather(x) @ W_r^T; dX = reduce_scatter(dY @ W_r),
    dW_r = dY^T @ all_gather(x) (the input gathered again in backward); RowParallelLinear: the
    reduce-scatter of x_r @ W_r^T, dX_r = all_gather(dY) @ W_r. Parameters of the SP region (norm
    weights, the row layer's bias) get per-rank partial gradients, all-reduced over TP later.

Project convention (parallel/sp/ops.py, modules.py): the ops take weights as [K, N] like torch's
fused ops (the nn.Linear layers pass W^T); the layer weights are nn.Linear's [out, in] like Megatron.

Deliberate differences, pinned below (the project refuses what it does not implement, with a
ValueError on every rank, instead of computing something else):
- gather_dim / scatter_dim = the last dim (torch: gather K / scatter N) is refused;
- there is no reduce_op: matmul_reduce_scatter is always the sum (Megatron's, torch's "sum");
- the fp8 ops take row-wise (per-token) A scales and per-column B scales only: a tensor-wise scale is
  refused (torch accepts it); a [1, 1] scale of a one-row shard is row-wise, as in torch.

One launch per world size (1, 2, 4) runs every case, as in tests/test_sp_multirank.py.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.helpers import assert_case_passed, assert_value_error, launch_once, run_tp_cases

WORLD_SIZES = (1, 2, 4)
BACKENDS = ("decomposed", "reference", "auto")
FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# the references' semantics, restated (float64, rank by rank)


def ref_all_gather(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Rank r's shard is block r of the result along dim."""
    return torch.cat([s.double() for s in shards], dim)


def ref_reduce_scatter(parts: list[torch.Tensor], dim: int, rank: int, reduce_op: str = "sum") -> torch.Tensor:
    """Chunk `rank` (along dim) of the sum (or mean) of every rank's tensor."""
    total = sum(p.double() for p in parts)
    if reduce_op == "avg":
        total = total / len(parts)
    return total.chunk(len(parts), dim)[rank] if total.shape[dim] else total


def ref_fused_all_gather_matmul(shards, Bs, gather_dim, return_A=True):
    a = ref_all_gather(shards, gather_dim)
    return (a if return_A else None), [a @ b.double() for b in Bs]


def ref_fused_matmul_reduce_scatter(As, B, reduce_op, scatter_dim, rank):
    return ref_reduce_scatter([a.double() @ B.double() for a in As], scatter_dim, rank, reduce_op)


def ref_scaled(a_data, a_scale, b_data, b_scale):
    """(A * a_scale) @ (B * b_scale): a_scale one per row of A (or one number), b_scale one per column of B."""
    a = a_data.double() * a_scale.double()
    return a @ (b_data.double() * b_scale.double())


# ---------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype = torch.float32) -> None:
    assert actual.dtype == dtype, (what, actual.dtype, dtype)
    if dtype == torch.bfloat16:
        err = (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
        assert actual.shape == expected.shape and err < 1e-2, (what, tuple(actual.shape), float(err))
    else:
        torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what}: {m}")


def _fp8(shape, g: torch.Generator) -> torch.Tensor:
    """Random E4M3 values of moderate magnitude (no NaN)."""
    return (torch.randn(shape, generator=g) * 4).to(FP8)


_raises = assert_value_error


# ---------------------------------------------------------------------------------------------
# cases: (tp group, rank, world size)


def all_gather_matmul_is_torchs_fused_all_gather_matmul(tp, r, P):
    """Gathered A first, then A @ B per weight; rank order; gather along dim 0, 1, -2 of 3-D; odd K, N; m = 0."""
    from parallel.sp import all_gather_matmul

    for dtype in (torch.float32, torch.bfloat16):
        for shard_shape, gd in (((3, 7), 0), ((2, 3, 7), 0), ((2, 3, 7), 1), ((2, 3, 7), -2), ((3, 2, 5, 7), 2),
                                ((0, 7), 0), ((2, 0, 7), 1)):
            g = _gen(1)
            shards = [torch.randn(shard_shape, generator=g).to(dtype) for _ in range(P)]
            Bs = [torch.randn(7, 5, generator=g).to(dtype), torch.randn(7, 3, generator=g).to(dtype)]
            want_a, want = ref_fused_all_gather_matmul(shards, Bs, gd % len(shard_shape))
            for backend in BACKENDS:
                what = f"{dtype} {shard_shape} gather_dim={gd} {backend}"
                a, *outs = all_gather_matmul(shards[r], Bs, tp, gather_dim=gd, return_gathered=True, backend=backend)
                assert a.dtype == dtype and torch.equal(a.double(), want_a), what  # a gather is exact
                assert len(outs) == 2, what
                for o, w in zip(outs, want):
                    _close(o, w, what, dtype)
                outs = all_gather_matmul(shards[r], Bs, tp, gather_dim=gd, backend=backend)
                assert len(outs) == 2, what  # return_A=False: the products only
                for o, w in zip(outs, want):
                    _close(o, w, what, dtype)


def matmul_reduce_scatter_is_torchs_fused_sum(tp, r, P):
    """The sum (not the mean) of the ranks' products; rank r keeps chunk r along scatter_dim."""
    from parallel.sp import matmul_reduce_scatter

    assert "reduce_op" not in inspect.signature(matmul_reduce_scatter).parameters  # pinned: always "sum"
    for dtype in (torch.float32, torch.bfloat16):
        for shape, sd in (((3 * P, 7), 0), ((2, 3 * P, 7), 1), ((2 * P, 3, 7), 0), ((2, 3 * P, 7), -2),
                          ((0, 7), 0), ((2, 0, 7), 1)):
            g = _gen(2)
            As = [torch.randn(shape, generator=g).to(dtype) for _ in range(P)]
            B = torch.randn(7, 5, generator=g).to(dtype)
            want = ref_fused_matmul_reduce_scatter(As, B, "sum", sd % len(shape), r)
            for backend in BACKENDS:
                what = f"{dtype} {shape} scatter_dim={sd} {backend}"
                out = matmul_reduce_scatter(As[r], B, tp, scatter_dim=sd, backend=backend)
                _close(out, want, what, dtype)
                if P > 1 and dtype == torch.float32 and want.numel():
                    avg = ref_fused_matmul_reduce_scatter(As, B, "avg", sd % len(shape), r)
                    assert not torch.allclose(out.double(), avg, rtol=1e-3, atol=1e-3), what


def last_dim_gather_or_scatter_is_refused_on_every_rank(tp, r, P):
    """torch gathers K (gather_dim = last) and scatters N (scatter_dim = last); the project refuses both."""
    from parallel.sp import all_gather_matmul, all_gather_matmul_fp8, matmul_reduce_scatter, matmul_reduce_scatter_fp8

    x, w = torch.randn(2, 4 * P), torch.randn(4 * P, 2 * P)
    for backend in BACKENDS:
        for d in (-1, 1):
            _raises(lambda: all_gather_matmul(x, [w], tp, gather_dim=d, backend=backend), "gather_dim", "contraction")
            _raises(lambda: matmul_reduce_scatter(x, w, tp, scatter_dim=d, backend=backend), "scatter_dim",
                    "contraction")
            _raises(lambda: all_gather_matmul_fp8(x, [w], tp, gather_dim=d, backend=backend), "gather_dim")
            _raises(lambda: matmul_reduce_scatter_fp8(x, w, tp, scatter_dim=d, backend=backend), "scatter_dim")


def gradients_follow_megatrons_column_and_row_parallel_linears(tp, r, P):
    """Column (all_gather_matmul): dX = reduce_scatter(sum_i dY_i @ W_i^T), dW_i = all_gather(x)^T @ dY_i.
    Row (matmul_reduce_scatter): dX = all_gather(dY) @ W^T, dW = X^T @ all_gather(dY). Rank-specific
    weights (as TP shards are), 3-D with gather_dim 1, bf16 and fp32, a gradient into the gathered input."""
    from parallel.sp import all_gather_matmul, matmul_reduce_scatter

    m, K, N1, N2 = 3, 7, 5, 3
    for dtype in (torch.float32, torch.bfloat16):
        for gd in (0, 1):
            g = _gen(3)
            shape = (m, 2, K) if gd == 0 else (2, m, K)
            full_shape = list(shape)
            full_shape[gd] *= P
            shards = [torch.randn(shape, generator=g).to(dtype) for _ in range(P)]
            W1 = [torch.randn(K, N1, generator=g).to(dtype) for _ in range(P)]
            W2 = [torch.randn(K, N2, generator=g).to(dtype) for _ in range(P)]
            G1 = [torch.randn(full_shape[:-1] + [N1], generator=g).to(dtype) for _ in range(P)]
            G2 = [torch.randn(full_shape[:-1] + [N2], generator=g).to(dtype) for _ in range(P)]
            GA = [torch.randn(full_shape, generator=g).to(dtype) for _ in range(P)]
            A = ref_all_gather(shards, gd)
            for backend in BACKENDS:
                for with_a in (False, True):
                    what = f"column {dtype} gather_dim={gd} {backend} gathered={with_a}"
                    x = shards[r].clone().requires_grad_()
                    w1, w2 = W1[r].clone().requires_grad_(), W2[r].clone().requires_grad_()
                    res = all_gather_matmul(x, [w1, w2], tp, gather_dim=gd, return_gathered=with_a, backend=backend)
                    loss = (res[-2] * G1[r]).sum() + (res[-1] * G2[r]).sum()
                    if with_a:
                        loss = loss + (res[0] * GA[r]).sum()
                    loss.backward()
                    local = [G1[q].double() @ W1[q].double().t() + G2[q].double() @ W2[q].double().t()
                             + (GA[q].double() if with_a else 0) for q in range(P)]
                    _close(x.grad, ref_reduce_scatter(local, gd, r), what + " dX", dtype)
                    _close(w1.grad, A.reshape(-1, K).t() @ G1[r].double().reshape(-1, N1), what + " dW1", dtype)
                    _close(w2.grad, A.reshape(-1, K).t() @ G2[r].double().reshape(-1, N2), what + " dW2", dtype)
                what = f"row {dtype} scatter_dim={gd} {backend}"
                Xs = [torch.randn(full_shape, generator=g).to(dtype) for _ in range(P)]
                W = [torch.randn(K, N1, generator=g).to(dtype) for _ in range(P)]
                Gs = [torch.randn(shape[:-1] + (N1,), generator=g).to(dtype) for _ in range(P)]
                x, w = Xs[r].clone().requires_grad_(), W[r].clone().requires_grad_()
                out = matmul_reduce_scatter(x, w, tp, scatter_dim=gd, backend=backend)
                (out * Gs[r]).sum().backward()
                g_full = ref_all_gather(Gs, gd)
                _close(x.grad, g_full @ W[r].double().t(), what + " dX", dtype)
                _close(w.grad, Xs[r].double().reshape(-1, K).t() @ g_full.reshape(-1, N1), what + " dW", dtype)


def expanded_output_gradients_of_a_plain_sum(tp, r, P):
    """loss = out.sum() hands backward a stride-0 gradient; with only the weight (or only x) requiring grad."""
    from parallel.sp import all_gather_matmul, matmul_reduce_scatter

    g = _gen(4)
    shards = [torch.randn(2, 3, 6, generator=g) for _ in range(P)]
    W = torch.randn(6, 4, generator=g)
    Xs = [torch.randn(2, 3 * P, 6, generator=g) for _ in range(P)]
    A = ref_all_gather(shards, 1)
    for backend in BACKENDS:
        for x_grad in (False, True):
            x, w = shards[r].clone().requires_grad_(x_grad), W.clone().requires_grad_(not x_grad)
            all_gather_matmul(x, [w], tp, gather_dim=1, backend=backend)[0].sum().backward()
            if x_grad:
                want = ref_reduce_scatter([torch.ones(2, 3 * P, 4, dtype=torch.float64) @ W.double().t()] * P, 1, r)
                _close(x.grad, want, f"column dX {backend}")
            else:
                _close(w.grad, A.reshape(-1, 6).t() @ torch.ones(2 * 3 * P, 4, dtype=torch.float64),
                       f"column dW {backend}")
            x, w = Xs[r].clone().requires_grad_(x_grad), W.clone().requires_grad_(not x_grad)
            matmul_reduce_scatter(x, w, tp, scatter_dim=1, backend=backend).sum().backward()
            ones = torch.ones(2, 3 * P, 4, dtype=torch.float64)
            if x_grad:
                _close(x.grad, ones @ W.double().t(), f"row dX {backend}")
            else:
                _close(w.grad, Xs[r].double().reshape(-1, 6).t() @ ones.reshape(-1, 4), f"row dW {backend}")


def megatron_sp_mappings(tp, r, P):
    """sp_all_gather / sp_reduce_scatter / sp_shard: Megatron's gather (backward reduce-scatter, or the own
    slice for replicated consumers), reduce-scatter (backward all-gather) and scatter (backward all-gather)."""
    from parallel.sp import sp_all_gather, sp_reduce_scatter, sp_shard

    g = _gen(5)
    shards = [torch.randn(3, 2, 4, generator=g) for _ in range(P)]
    grads = [torch.randn(3 * P, 2, 4, generator=g) for _ in range(P)]
    for reduce_grad in (True, False):
        x = shards[r].clone().requires_grad_()
        y = sp_all_gather(x, tp, reduce_grad=reduce_grad)
        _close(y, ref_all_gather(shards, 0), "gather forward")
        (y * grads[r]).sum().backward()
        want = ref_reduce_scatter(grads, 0, r) if reduce_grad else grads[r].chunk(P, 0)[r]
        _close(x.grad, want, f"gather backward reduce_grad={reduce_grad}")
    x = grads[r].clone().requires_grad_()
    y = sp_reduce_scatter(x, tp)
    _close(y, ref_reduce_scatter(grads, 0, r), "reduce_scatter forward")
    (y * shards[r]).sum().backward()
    _close(x.grad, ref_all_gather(shards, 0), "reduce_scatter backward")
    full = grads[0].clone().requires_grad_()  # replicated
    y = sp_shard(full, tp)
    _close(y, grads[0].chunk(P, 0)[r], "scatter forward")
    (y * shards[r]).sum().backward()
    _close(full.grad, ref_all_gather(shards, 0), "scatter backward")


def fp8_all_gather_matmul_is_torchs_row_wise_scaled_op(tp, r, P):
    """Row-wise A scales sharded with A and gathered with it; per-column B scales; scales multiply; out_dtype;
    the gathered fp8 bytes and scales returned; gather_dim 0 and 1 of 3-D; zero-size shards."""
    from parallel.sp import Fp8Activation, Fp8Weight, all_gather_matmul_fp8

    for shape, gd in (((3, 16), 0), ((2, 3, 16), 1), ((3, 2, 16), 0), ((0, 16), 0)):
        g = _gen(6)
        datas = [_fp8(shape, g) for _ in range(P)]
        scales = [torch.rand(shape[:-1] + (1,), generator=g) + 0.25 for _ in range(P)]
        ws = [Fp8Weight(_fp8((16, n), g).t().contiguous().t(), torch.rand(1, n, generator=g) + 0.25) for n in (5, 3)]
        a_data, a_scale = ref_all_gather([d.float() for d in datas], gd), ref_all_gather(scales, gd)
        want = [ref_scaled(a_data, a_scale, w.data, w.scale) for w in ws]
        for backend in BACKENDS:
            for out_dtype in (torch.float32, torch.bfloat16):
                what = f"fp8 {shape} gather_dim={gd} {backend} {out_dtype}"
                res = all_gather_matmul_fp8(Fp8Activation(datas[r], scales[r]), ws, tp, gather_dim=gd,
                                            return_gathered=True, out_dtype=out_dtype, backend=backend)
                assert res.gathered.data.dtype == FP8 and torch.equal(res.gathered.data.float().double(), a_data), what
                assert torch.equal(res.gathered.scale.double(), a_scale), what
                for o, w in zip(res.outputs, want):
                    _close(o, w, what, out_dtype)


def fp8_matmul_reduce_scatter_is_torchs_scaled_sum(tp, r, P):
    """Every rank's scaled product in out_dtype, summed; rank r keeps chunk r; row scales scattered with A."""
    from parallel.sp import Fp8Activation, Fp8Weight, matmul_reduce_scatter_fp8

    for shape, sd in (((3 * P, 16), 0), ((2, 3 * P, 16), 1), ((0, 16), 0)):
        g = _gen(7)
        datas = [_fp8(shape, g) for _ in range(P)]
        scales = [torch.rand(shape[:-1] + (1,), generator=g) + 0.25 for _ in range(P)]
        ws = [Fp8Weight(_fp8((16, 5), g).t().contiguous().t(), torch.rand(1, 5, generator=g) + 0.25)
              for _ in range(P)]
        want = ref_reduce_scatter([ref_scaled(d.float(), s, w.data, w.scale) for d, s, w in zip(datas, scales, ws)],
                                  sd, r)
        for backend in BACKENDS:
            for out_dtype in (torch.float32, torch.bfloat16):
                out = matmul_reduce_scatter_fp8(Fp8Activation(datas[r], scales[r]), ws[r], tp, scatter_dim=sd,
                                                out_dtype=out_dtype, backend=backend)
                _close(out, want, f"fp8 rs {shape} scatter_dim={sd} {backend} {out_dtype}", out_dtype)


def fp8_tensor_wise_scales_are_refused_row_wise_one_row_is_not(tp, r, P):
    """torch also takes a tensor-wise A scale; the project's fp8 ops take per-token scales only."""
    from parallel.sp import Fp8Activation, Fp8Weight, all_gather_fp8, all_gather_matmul_fp8, matmul_reduce_scatter_fp8

    g = _gen(8)
    w = Fp8Weight(_fp8((16, 4), g).t().contiguous().t(), torch.rand(1, 4, generator=g) + 0.5)
    data = _fp8((2 * P, 16), g)
    for scale in (torch.tensor(0.5), torch.tensor([0.5])):
        a = Fp8Activation(data, scale)
        _raises(lambda: all_gather_matmul_fp8(a, [w], tp, out_dtype=torch.float32), "scales")
        _raises(lambda: matmul_reduce_scatter_fp8(a, w, tp, out_dtype=torch.float32), "scales")
        _raises(lambda: all_gather_fp8(a, tp), "scales")
    per_row = Fp8Activation(data, torch.ones(2 * P, 1))
    _raises(lambda: all_gather_matmul_fp8(per_row, [Fp8Weight(w.data, torch.ones(4))], tp, out_dtype=torch.float32),
            "one per output column")
    # a one-row shard's [1, 1] scale is that row's (torch's rule for the ambiguous case)
    rows = [_fp8((1, 16), g) for _ in range(P)]
    sc = [torch.full((1, 1), 0.5 * (q + 1)) for q in range(P)]
    res = all_gather_matmul_fp8(Fp8Activation(rows[r], sc[r]), [w], tp, out_dtype=torch.float32)
    want = ref_scaled(ref_all_gather([x.float() for x in rows], 0), ref_all_gather(sc, 0), w.data, w.scale)
    _close(res.outputs[0], want, "one-row shards")


def fp8_gradients_are_the_straight_through_megatron_pair(tp, r, P):
    """float inputs: forward on the fp8 values, backward as the column / row linears on the dequantized ones."""
    from parallel.sp import all_gather_matmul_fp8, matmul_reduce_scatter_fp8, quantize_fp8_per_token
    from parallel.sp import quantize_fp8_weight

    def deq_x(x):
        q = quantize_fp8_per_token(x)
        return q.data.double() * q.scale.double()

    def deq_w(w):
        q = quantize_fp8_weight(w)
        return q.data.double() * q.scale.double()

    g = _gen(9)
    m, K, N = 2, 16, 5
    shards = [torch.randn(m, 3, K, generator=g) for _ in range(P)]
    W = [torch.randn(K, N, generator=g) for _ in range(P)]
    G = [torch.randn(P * m, 3, N, generator=g) for _ in range(P)]
    A = ref_all_gather([deq_x(s) for s in shards], 0)
    for backend in BACKENDS:
        x, w = shards[r].clone().requires_grad_(), W[r].clone().requires_grad_()
        res = all_gather_matmul_fp8(x, [w], tp, out_dtype=torch.float32, backend=backend)
        _close(res.outputs[0], A @ deq_w(W[r]), f"fp8 column forward {backend}")
        (res.outputs[0] * G[r]).sum().backward()
        _close(x.grad, ref_reduce_scatter([G[q].double() @ deq_w(W[q]).t() for q in range(P)], 0, r),
               f"fp8 column dX {backend}")
        _close(w.grad, A.reshape(-1, K).t() @ G[r].double().reshape(-1, N), f"fp8 column dW {backend}")
        Xs = [torch.randn(P * m, 3, K, generator=_gen(10 + q)) for q in range(P)]
        Gs = [torch.randn(m, 3, N, generator=_gen(20 + q)) for q in range(P)]
        x, w = Xs[r].clone().requires_grad_(), W[r].clone().requires_grad_()
        out = matmul_reduce_scatter_fp8(x, w, tp, out_dtype=torch.float32, backend=backend)
        _close(out, ref_reduce_scatter([deq_x(Xs[q]) @ deq_w(W[q]) for q in range(P)], 0, r), f"fp8 row fwd {backend}")
        (out * Gs[r]).sum().backward()
        g_full = ref_all_gather(Gs, 0)
        _close(x.grad, g_full @ deq_w(W[r]).t(), f"fp8 row dX {backend}")
        _close(w.grad, deq_x(Xs[r]).reshape(-1, K).t() @ g_full.reshape(-1, N), f"fp8 row dW {backend}")


def linear_layers_hold_megatrons_shards(tp, r, P):
    """ColumnParallelLinear(sequence_parallel) = all_gather(x) @ W[rows of rank r]^T; RowParallelLinear =
    reduce_scatter(x_r @ W[:, cols of rank r]^T); the layers' weights are nn.Linear's [out, in]."""
    from parallel.sp import ColumnParallelLinear, RowParallelLinear

    g = _gen(11)
    H, I = 6, 4 * P
    Wc, Wr = torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)
    shards = [torch.randn(3, H, generator=g) for _ in range(P)]
    col = ColumnParallelLinear.from_full(Wc, None, tp, sequence_parallel=True)
    row = RowParallelLinear.from_full(Wr, None, tp, sequence_parallel=True)
    assert col.weight.shape == (I // P, H) and row.weight.shape == (H, I // P)
    X = ref_all_gather(shards, 0)
    h = col(shards[r])
    _close(h, X @ Wc.double().chunk(P, 0)[r].t(), "column layer")
    y = row(h)
    _close(y, (X @ Wc.double().t() @ Wr.double().t()).chunk(P, 0)[r], "row layer")
    # biases: the column layer's is added to all P * m gathered tokens (a full gradient on every rank); the
    # row layer's after the reduce-scatter (this rank's tokens only: Megatron's sequence_parallel attribute)
    bc, br = torch.randn(I, generator=g), torch.randn(H, generator=g)
    col = ColumnParallelLinear.from_full(Wc, bc, tp, sequence_parallel=True)
    row = RowParallelLinear.from_full(Wr, br, tp, sequence_parallel=True)
    G = torch.randn(3, H, generator=g)
    (row(col(shards[r])) * G).sum().backward()
    assert getattr(row.bias, "sequence_parallel", False) and not getattr(col.bias, "sequence_parallel", False)
    _close(row.bias.grad, G.double().sum(0), "row bias grad (partial)")
    g_full = ref_all_gather([G] * P, 0) if P > 1 else G.double()  # every rank's dY reaches rank r's columns
    want_h = g_full @ Wr.double()[:, r * (I // P):(r + 1) * (I // P)]
    _close(col.bias.grad, want_h.sum(0), "column bias grad (full)")


def one_rank_gather_returns_the_shard_itself(tp, r, P):
    """Pinned (documented in ops.py): a one-rank group gathers nothing, so the gathered input returned is
    x_shard's own storage, as Megatron's one-rank gather returns its input; more ranks give a new buffer."""
    from parallel.sp import all_gather_matmul

    x = torch.randn(3, 4)
    with torch.no_grad():
        a, _ = all_gather_matmul(x, [torch.randn(4, 2)], tp, return_gathered=True)
    assert (a.data_ptr() == x.data_ptr()) == (P == 1), (P, a.data_ptr(), x.data_ptr())


def non_contiguous_operands_and_fp8_grads_along_dim_1(tp, r, P):
    """Transposed views as x and w (nn.Linear passes W^T); fp8 float inputs in bf16 gathered along dim 1."""
    from parallel.sp import all_gather_matmul, all_gather_matmul_fp8, matmul_reduce_scatter, quantize_fp8_per_token
    from parallel.sp import quantize_fp8_weight

    g = _gen(12)
    shards = [torch.randn(7, 3, generator=g) for _ in range(P)]  # used as [3, 7] views: K = 7
    Wt = torch.randn(5, 7, generator=g)  # used as its [7, 5] transpose
    Xs = [torch.randn(7, 2 * P, generator=g) for _ in range(P)]
    for backend in BACKENDS:
        (out,) = all_gather_matmul(shards[r].t(), [Wt.t()], tp, backend=backend)
        _close(out, ref_all_gather([s.t() for s in shards], 0) @ Wt.double().t(), f"views agm {backend}")
        out = matmul_reduce_scatter(Xs[r].t(), Wt.t(), tp, backend=backend)
        _close(out, ref_reduce_scatter([x.t().double() @ Wt.double().t() for x in Xs], 0, r), f"views mrs {backend}")

    def deq(q):
        return q.data.double() * q.scale.double()

    xs = [torch.randn(2, 3, 16, generator=g).bfloat16() for _ in range(P)]
    W = torch.randn(16, 4, generator=g).bfloat16()
    G = [torch.randn(2, 3 * P, 4, generator=g) for _ in range(P)]
    A = ref_all_gather([deq(quantize_fp8_per_token(x)) for x in xs], 1)
    Wq = deq(quantize_fp8_weight(W))
    for backend in BACKENDS:
        x, w = xs[r].clone().requires_grad_(), W.clone().requires_grad_()
        res = all_gather_matmul_fp8(x, [w], tp, gather_dim=1, out_dtype=torch.float32, backend=backend)
        _close(res.outputs[0], A @ Wq, f"fp8 dim 1 {backend}")
        (res.outputs[0] * G[r]).sum().backward()
        _close(x.grad, ref_reduce_scatter([q.double() @ Wq.t() for q in G], 1, r), f"fp8 dim 1 dX {backend}",
               torch.bfloat16)
        _close(w.grad, A.reshape(-1, 16).t() @ G[r].double().reshape(-1, 4), f"fp8 dim 1 dW {backend}", torch.bfloat16)


CASES = [f for name, f in sorted(globals().items()) if callable(f) and getattr(f, "__module__", None) == __name__
         and not name.startswith(("_", "test", "ref")) and f.__code__.co_varnames[:3] == ("tp", "r", "P")]


@pytest.mark.parametrize("case", [c.__name__ for c in CASES])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reference_semantics(world_size: int, case: str) -> None:
    assert_case_passed(launch_once(run_tp_cases, world_size, __name__, True), case)

