"""Sequence-parallel pieces that need no second process: FP8 formats and their tolerance,
size-1 groups, argument checking, the decomposed engines' compute schedule on a loopback
peer set (what `megapar bench sp` times on one device); plus the CUDA tests the GPU machine runs.

Multi-rank behaviour (gloo, 1/2/4 ranks) is in test_sp_multirank.py.
"""

from __future__ import annotations

import pytest
import torch

from parallel.sp import (
    FP8_REL_TOL,
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_matmul,
    all_gather_matmul_fp8,
    matmul_reduce_scatter,
    matmul_reduce_scatter_fp8,
    quantize_fp8_per_token,
    quantize_fp8_weight,
    rms_norm_quantize_all_gather,
    rms_norm_quantize_fp8,
    scaled_matmul,
    sp_all_gather,
    sp_pad,
    sp_shard,
)
from parallel.sp.fp8 import Fp8Activation


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative E4M3 value, decoded from its bits (independent of torch's cast)."""
    vals = []
    for e in range(16):
        for mant in range(8):
            if e == 15 and mant == 7:
                continue  # NaN
            vals.append(mant / 8 * 2.0 ** -6 if e == 0 else (1 + mant / 8) * 2.0 ** (e - 7))
    return torch.tensor(sorted(vals), dtype=torch.float64)


def test_per_token_fp8_rounds_each_value_to_the_nearest_e4m3_point_of_its_token_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.5, 2.0])[:, None]
    x[4] = 0.0  # an all-zero token
    q = quantize_fp8_per_token(x)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (6, 1) and q.scale.dtype == torch.float32
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(q.scale[[0, 1, 2, 3, 5]], (amax / 448)[[0, 1, 2, 3, 5]])
    assert torch.equal(q.dequantize()[4], torch.zeros(40))
    grid = _e4m3_grid()
    scaled = (x.double() / q.scale.double()).abs()
    nearest = grid[(scaled[..., None] - grid).abs().argmin(-1)]
    got = q.data.double().abs()
    # ties may round either way only where two grid points are equally near
    tie = ((scaled[..., None] - grid).abs().sort(-1).values[..., :2].diff(dim=-1).squeeze(-1) < 1e-9)
    assert torch.equal(got[~tie], nearest[~tie])
    assert torch.equal(q.data.double().sign(), x.double().sign() * (got > 0))
    assert q.data.double().abs().amax(-1)[[0, 1, 2, 3, 5]].eq(448).all()  # the largest value maps to 448


def test_fp8_weight_is_column_major_with_one_scale_per_output_column():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 10, 48)
    qw = quantize_fp8_weight(w)
    assert qw.data.shape == (64, 48) and qw.data.t().is_contiguous() and qw.scale.shape == (1, 48)
    torch.testing.assert_close(qw.scale, w.abs().amax(0, keepdim=True) / 448)
    rel = (qw.dequantize() - w).abs() / w.abs().amax(0, keepdim=True)
    assert rel.max() <= 2.0 ** -4 + 1e-6


@pytest.mark.parametrize("shape,spread", [((128, 256, 64), 1.0), ((33, 512, 48), 20.0)])
def test_fp8_product_error_against_fp32_is_within_the_documented_tolerance(shape, spread):
    M, K, N = shape
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * spread / 10)
    x[:, :4] *= spread  # outlier channels
    w = torch.randn(K, N, generator=g)
    out = scaled_matmul(quantize_fp8_per_token(x), quantize_fp8_weight(w), torch.float32)
    err = ((out - x @ w).norm() / (x @ w).norm()).item()
    assert 0.005 < err < FP8_REL_TOL, err  # fp8 is lossy, but within the bound


def test_rms_norm_quantize_matches_separate_norm_then_quantize():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 32, generator=g, dtype=torch.float64).to(torch.bfloat16)
    w = torch.rand(32, generator=g) + 0.5
    xd = x.double()
    normed = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    q = rms_norm_quantize_fp8(x, w, eps=1e-5)
    err = ((q.dequantize().double() - normed).norm() / normed.norm()).item()
    assert err < FP8_REL_TOL / 2, err
    torch.testing.assert_close(q.scale.double(), normed.abs().amax(-1, keepdim=True) / 448, rtol=1e-5, atol=0)


def test_single_rank_ops_and_gradients_equal_plain_matmuls():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    gathered, o1, o2 = all_gather_matmul(x, [w1, w2], None, return_gathered=True)
    y = matmul_reduce_scatter(o1, torch.ones(3, 4, dtype=torch.float64), None)
    assert torch.equal(gathered, x) and torch.equal(o1, x @ w1) and torch.equal(o2, x @ w2)
    (y.sum() + (o2 ** 2).sum() + gathered.sum()).backward()
    xd, w1d, w2d = (t.detach().clone().requires_grad_() for t in (x, w1, w2))
    ((xd @ w1d).sum(-1, keepdim=True) * 4).sum().add(((xd @ w2d) ** 2).sum()).add(xd.sum()).backward()
    for a, b in ((x, xd), (w1, w1d), (w2, w2d)):
        torch.testing.assert_close(a.grad, b.grad)
    q = all_gather_matmul_fp8(x.detach().float(), [quantize_fp8_weight(w1.detach().float())], None,
                              out_dtype=torch.float32, return_gathered=True)
    assert q.gathered is not None and q.outputs[0].shape == (5, 3)


def _deq_e4m3(v: torch.Tensor, dim: int) -> torch.Tensor:
    """deq(q(v)): nearest E4M3 grid point at one scale (amax / 448) per slice along dim (seeded data: no ties)."""
    v = v.detach().double()
    scale = v.abs().amax(dim=dim, keepdim=True) / 448.0
    grid = _e4m3_grid()
    a = (v / scale).abs()
    idx = torch.searchsorted(grid, a.clamp(max=448.0)).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    return torch.where(a - lo <= hi - a, lo, hi) * v.sign() * scale


def test_single_rank_fp8_ops_backward_is_straight_through_in_the_input_dtype():
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, 5, 32, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(32, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(32, 8, generator=g, dtype=torch.float64, requires_grad=True)
    g1, g2 = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 8, generator=g)
    res = all_gather_matmul_fp8(x, [w1, w2], None, gather_dim=1, out_dtype=torch.float32)
    ((res.outputs[0] * g1).sum() + (res.outputs[1] * g2).sum()).backward()
    xq, w1q, w2q = _deq_e4m3(x, -1), _deq_e4m3(w1, 0), _deq_e4m3(w2, 0)
    torch.testing.assert_close(res.outputs[0], (xq @ w1q).float(), rtol=1e-5, atol=1e-5)
    # STE: d out / d x uses the dequantized weights, d out / d w the dequantized activations, in float64
    assert x.grad.dtype == w1.grad.dtype == torch.float64
    torch.testing.assert_close(x.grad, g1.double() @ w1q.t() + g2.double() @ w2q.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, xq.reshape(-1, 32).t() @ g1.double().reshape(-1, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, xq.reshape(-1, 32).t() @ g2.double().reshape(-1, 8), rtol=1e-5, atol=1e-5)
    # no gradient needed: the plain forward, same values, nothing recorded
    with torch.no_grad():
        plain = all_gather_matmul_fp8(x, [w1], None, gather_dim=1, out_dtype=torch.float32).outputs[0]
    assert not plain.requires_grad and torch.equal(plain, res.outputs[0])

    xr = torch.randn(6, 32, generator=g, requires_grad=True)
    w = torch.randn(32, 16, generator=g, requires_grad=True)
    out = matmul_reduce_scatter_fp8(xr, w, None, out_dtype=torch.bfloat16)
    gy = torch.randn(6, 16, generator=g)
    (out.float() * gy).sum().backward()
    gb = gy.bfloat16().double()  # the output gradient arrives in bf16, then is computed in fp32
    assert xr.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(xr.grad.double(), gb @ _deq_e4m3(w, 0).t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), _deq_e4m3(xr, -1).t() @ gb, rtol=1e-5, atol=1e-5)

    xn = torch.randn(4, 16, generator=g, requires_grad=True)
    nw = (torch.rand(16, generator=g) + 0.5).requires_grad_()
    q = rms_norm_quantize_all_gather(xn, nw, None)
    assert q.ste is not None and torch.equal(q.dequantize(), q.data.float() * q.scale)
    gq = torch.randn(4, 16, generator=g)
    (q.dequantize() * gq).sum().backward()
    xd, nwd = xn.detach().double().requires_grad_(), nw.detach().double().requires_grad_()
    (xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * nwd * gq).sum().backward()  # quantizer = identity
    torch.testing.assert_close(xn.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nw.grad.double(), nwd.grad, rtol=1e-5, atol=1e-5)
    assert rms_norm_quantize_all_gather(xn.detach(), nw.detach(), None).ste is None


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float64),
                                              (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
def test_fp8_matmul_reduce_scatter_weight_gradient_keeps_the_output_gradient_in_the_weight_dtype(x_dtype, w_dtype):
    """dw = deq(q(x))^T @ dy in w's dtype: dy was first cast to x's dtype (gathered once for dx and dw), so
    with x bf16, w fp32 and an fp32 output the fp32 weight gradient carried bf16 rounding (~3e-3 relative)."""
    g = torch.Generator().manual_seed(24)
    x = torch.randn(6, 32, generator=g, dtype=torch.float64).to(x_dtype).requires_grad_()
    w = torch.randn(32, 16, generator=g, dtype=torch.float64).to(w_dtype).requires_grad_()
    gy = torch.randn(6, 16, generator=g)
    out = matmul_reduce_scatter_fp8(x, w, None, out_dtype=torch.float32)
    (out * gy).sum().backward()
    assert x.grad.dtype == x_dtype and w.grad.dtype == w_dtype
    want_w = _deq_e4m3(x, -1).t() @ gy.double()  # dy stays fp32: exact in w's dtype when w is fp32 / fp64
    tol = 1e-2 if w_dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(w.grad.double(), want_w, rtol=tol, atol=tol * want_w.abs().max().item())
    want_x = gy.double() @ _deq_e4m3(w, 0).t()  # dx in x's dtype: its own rounding only
    err = ((x.grad.double() - want_x).norm() / want_x.norm()).item()
    assert err < (1e-2 if x_dtype.itemsize == 2 else 1e-6), err


def test_single_rank_parallel_linears_equal_nn_linear():
    torch.manual_seed(4)
    lin1, lin2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)
    x = torch.randn(5, 6)
    for sp in (True, False):
        col = ColumnParallelLinear.from_full(lin1.weight.detach(), lin1.bias.detach(), None, sequence_parallel=sp)
        row = RowParallelLinear.from_full(lin2.weight.detach(), lin2.bias.detach(), None, sequence_parallel=sp)
        torch.testing.assert_close(row(torch.relu(col(x))), lin2(torch.relu(lin1(x))))


def test_sp_helpers_on_one_rank_are_identity_and_pad_with_zeros():
    x = torch.randn(5, 3)
    assert torch.equal(sp_shard(x, None), x) and torch.equal(sp_all_gather(x, None, num_tokens=5), x)
    assert torch.equal(sp_pad(x, None), x)
    # sp_pad only reads the group size: a Group object of size P > 1 pads without communication
    # (on one rank nothing is ever padded, so the zero padding needs P > 1 to be seen)
    from parallel.groups import Group

    g = torch.Generator().manual_seed(7)
    for P in (2, 3, 4):
        group = Group("tp", None, P - 1, P, tuple(range(P)))
        for T in (0, 1, P - 1, P, P + 1, 2 * P + 1, 13):
            for dim, shape in ((0, (T, 3)), (1, (2, T, 3)), (-2, (2, T, 3))):
                x = (torch.randn(shape, generator=g) + 10).to(torch.bfloat16)  # no value is 0
                padded_len = P * -(-T // P)
                want_shape = list(shape)
                want_shape[dim] = padded_len
                want = torch.zeros(want_shape, dtype=torch.bfloat16)
                for i in range(T):  # token by token: token i stays at index i, the rest is zero
                    want.select(dim, i).copy_(x.select(dim, i))
                got = sp_pad(x, group, dim=dim)
                assert got.dtype == torch.bfloat16 and torch.equal(got, want), (P, T, dim)
                if padded_len == T:
                    assert got is x, (P, T, dim)


def test_bad_arguments_name_the_values_and_the_choices():
    x, w = torch.randn(4, 6), torch.randn(6, 2)
    with pytest.raises(ValueError, match="unknown implementation 'ring'; valid: auto, symm_mem, decomposed, reference"):
        all_gather_matmul(x, [w], None, backend="ring")
    with pytest.raises(ValueError, match=r"scatter_dim \(-1\) out of range.*0\.\.0 or -2\.\.-2"):
        matmul_reduce_scatter(x, w, None, scatter_dim=-1)
    with pytest.raises(ValueError, match=r"gather_dim \(2\) out of range"):
        all_gather_matmul(x, [w], None, gather_dim=2)
    with pytest.raises(ValueError, match="at least 2 dims"):
        all_gather_matmul(torch.randn(6), [w], None)
    with pytest.raises(ValueError, match="at least one weight"):
        all_gather_matmul(x, [], None)
    with pytest.raises(ValueError, match=r"torch.bfloat16 and weight 0 is torch.float32"):
        matmul_reduce_scatter(x.bfloat16(), w, None)
    with pytest.raises(ValueError, match="must be an Fp8Weight .* or a float"):
        all_gather_matmul_fp8(x, [w.to(torch.int32)], None)
    with pytest.raises(ValueError, match=r"expected \[K=6, N\]"):
        all_gather_matmul_fp8(x, [quantize_fp8_weight(torch.randn(5, 2))], None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        all_gather_matmul_fp8(Fp8Activation(x, torch.ones(4, 1)), [quantize_fp8_weight(w)], None)
    with pytest.raises(ValueError, match=r"weight has shape \(5,\), expected \[6\]"):
        rms_norm_quantize_fp8(x, torch.ones(5))
    with pytest.raises(ValueError, match=r"full weight has shape \(8, 5\), expected \[8, 6\]"):
        RowParallelLinear(6, 8, None).load_full_weight(torch.randn(8, 5))
    with pytest.raises(ValueError, match="bias given: True, layer has a bias: False"):
        ColumnParallelLinear(6, 8, None).load_full_weight(torch.randn(8, 6), torch.randn(8))
    with pytest.raises(ValueError, match=r"num_tokens \(7\).*valid num_tokens are 5\.\.5"):
        sp_all_gather(torch.randn(5, 2), None, num_tokens=7)


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_load_full_weight_with_a_bad_bias_changes_nothing(cls):
    """A mis-shaped bias is refused before the weight is copied (the layer kept the new weight and the old bias)."""
    g = torch.Generator().manual_seed(23)
    layer = cls(6, 8, None, bias=True)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(ValueError, match=r"full bias has shape \(7,\), expected \[8\]"):
        layer.load_full_weight(torch.randn(8, 6, generator=g), torch.randn(7, generator=g))
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    w, b = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    layer.load_full_weight(w, b)
    assert torch.equal(layer.weight, w) and torch.equal(layer.bias, b)


def test_fp8_bad_scales_output_dtype_and_gather_dim_raise_value_errors():
    from parallel.sp import all_gather_fp8
    from parallel.sp.fp8 import Fp8Weight

    g = torch.Generator().manual_seed(22)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, 16, generator=g)
    qw = quantize_fp8_weight(w)
    # one scale per K row instead of per output column: it broadcast silently into a wrong product
    rows = Fp8Weight(qw.data, torch.rand(32, 1, generator=g) + 0.5)
    with pytest.raises(ValueError, match=r"weight 0 has scales of shape \(32, 1\).*\[1, N=16\]"):
        all_gather_matmul_fp8(x, [rows], None, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight 0 has scales of shape \(32, 1\)"):
        matmul_reduce_scatter_fp8(x, rows, None, out_dtype=torch.float32)
    # the partial sums of a reduce-scatter cannot travel (or be summed) in fp8, even on one rank
    with pytest.raises(ValueError, match=r"out_dtype torch.float8_e4m3fn .*valid: torch.bfloat16"):
        matmul_reduce_scatter_fp8(x, qw, None, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"out_dtype torch.int32"):
        matmul_reduce_scatter_fp8(x, qw, None, out_dtype=torch.int32)
    # nor can the products of the all-gather variant be truncated to integers (they were, silently)
    with pytest.raises(ValueError, match=r"all_gather_matmul_fp8: out_dtype torch.int32 .*valid: torch.bfloat16"):
        all_gather_matmul_fp8(x, [qw], None, out_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"all_gather_matmul_fp8: out_dtype torch.float8_e4m3fn"):
        all_gather_matmul_fp8(x, [qw], None, out_dtype=torch.float8_e4m3fn)
    # per-token scales cannot be gathered along K
    with pytest.raises(ValueError, match=r"gather_dim \(-1\) out of range"):
        all_gather_fp8(quantize_fp8_per_token(x), None, gather_dim=-1)
    # all_gather_fp8 checks its activations like the matmuls do: a scale per token [m] instead of [m, 1]
    # was gathered as given (and broadcast over K by dequantize), float data was gathered as float
    q = quantize_fp8_per_token(x)
    with pytest.raises(ValueError, match=r"all_gather_fp8: .*got torch.float8_e4m3fn \(4, 32\) and scales \(4,\)"):
        all_gather_fp8(Fp8Activation(q.data, q.scale[:, 0]), None)
    with pytest.raises(ValueError, match=r"all_gather_fp8: activations must be torch.float8_e4m3fn .*got torch.float32"):
        all_gather_fp8(Fp8Activation(x, q.scale), None)
    # the documented forms still run and equal the dequantized product
    torch.testing.assert_close(matmul_reduce_scatter_fp8(x, qw, None, out_dtype=torch.float32),
                               quantize_fp8_per_token(x).dequantize() @ qw.dequantize(), rtol=1e-5, atol=1e-5)


def test_scaled_matmul_keeps_the_straight_through_gradient_off_scaled_mm():
    """On CUDA with bf16 out, scaled_matmul ran torch._scaled_mm on the fp8 bytes even for an
    activation carrying a straight-through gradient (rms_norm_quantize_all_gather's, in training):
    the gradient was dropped silently. Then it takes the dequantized product (CUDA emulated: the
    decision's inputs stood in)."""
    from types import SimpleNamespace

    from parallel.sp.fp8 import _scaled_mm_ok

    cuda_data = SimpleNamespace(is_cuda=True)
    plain = SimpleNamespace(data=cuda_data, ste=None)
    ste = SimpleNamespace(data=cuda_data, ste=torch.zeros(2, 2, requires_grad=True))
    assert _scaled_mm_ok(plain, torch.bfloat16) and not _scaled_mm_ok(plain, torch.float32)
    assert not _scaled_mm_ok(ste, torch.bfloat16)
    with torch.no_grad():
        assert _scaled_mm_ok(ste, torch.bfloat16)
    assert not _scaled_mm_ok(SimpleNamespace(data=SimpleNamespace(is_cuda=False), ste=None), torch.bfloat16)


@pytest.mark.gpu
def test_cuda_scaled_matmul_passes_the_straight_through_gradient():
    from parallel.sp.fp8 import Fp8Activation

    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    q = quantize_fp8_per_token(x.detach())
    a = Fp8Activation(q.data, q.scale, ste=x + (q.dequantize() - x).detach())
    qw = quantize_fp8_weight(torch.randn(64, 32, device="cuda"))
    scaled_matmul(a, qw, torch.bfloat16).float().sum().backward()
    torch.testing.assert_close(x.grad, qw.dequantize().sum(1).expand(32, -1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# GPU machine


@pytest.mark.gpu
def test_cuda_scaled_matmul_matches_the_dequantized_reference():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(96, 256, generator=g), torch.randn(256, 128, generator=g)
    q, qw = quantize_fp8_per_token(x.cuda()), quantize_fp8_weight(w.cuda())
    out = scaled_matmul(q, qw, torch.bfloat16)
    ref = q.dequantize() @ qw.dequantize()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    into = torch.empty(96, 128, device="cuda", dtype=torch.bfloat16)
    assert scaled_matmul(q, qw, torch.bfloat16, out=into) is into
    torch.testing.assert_close(into, out)


@pytest.mark.gpu
def test_cuda_single_rank_ops_equal_plain_matmuls():
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16)
    (out,) = all_gather_matmul(x, [w], None)
    assert torch.equal(out, x @ w) and torch.equal(matmul_reduce_scatter(x, w, None), x @ w)


@pytest.mark.gpu
def test_cuda_fp8_ops_backward_is_straight_through_in_bf16():
    """torch._scaled_mm forward (bf16 out), bf16 backward from the dequantized fp8 operands."""
    g = torch.Generator(device="cuda").manual_seed(22)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    gy = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16, generator=g)
    xq = quantize_fp8_per_token(x.detach()).dequantize()
    wq = quantize_fp8_weight(w.detach()).dequantize()
    for op in ("all_gather_matmul_fp8", "matmul_reduce_scatter_fp8"):
        x.grad = w.grad = None
        if op == "all_gather_matmul_fp8":
            (out,) = all_gather_matmul_fp8(x, [w], None).outputs
        else:
            out = matmul_reduce_scatter_fp8(x, w, None)
        assert out.dtype == torch.bfloat16
        (out * gy).sum().backward()
        assert x.grad.dtype == w.grad.dtype == torch.bfloat16
        for got, want in ((out, xq @ wq), (x.grad, gy.float() @ wq.t()), (w.grad, xq.t() @ gy.float())):
            err = ((got.float() - want).norm() / want.norm()).item()
            assert err < 1e-2, (op, err)  # bf16 rounding of operands and result


def _multigpu_rank(rank: int) -> dict[str, float]:
    """2 ranks, NCCL: every backend against the dense product (max relative error per check)."""
    from parallel import ParallelConfig, destroy_parallel, init_parallel

    tp = init_parallel(ParallelConfig(world_size=2, tp=2)).tp
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(6)
    P, m, K, N = 2, 256, 512, 384
    x_full = torch.randn(P * m, K, generator=g).to(dev, torch.bfloat16)
    ws = [torch.randn(K, N, generator=g).to(dev, torch.bfloat16) for _ in range(2)]
    xs = torch.randn(P, P * m, K, generator=g).to(dev, torch.bfloat16)
    rs_w = torch.randn(P, K, N, generator=g).to(dev, torch.bfloat16)
    n = 192
    W1 = torch.randn(K, P * n, generator=g).to(dev) / K ** 0.5
    W2 = torch.randn(P * n, 256, generator=g).to(dev) / n ** 0.5
    x = x_full[rank * m:(rank + 1) * m]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    out: dict[str, float] = {}
    rs_expect = sum(xs[q].float() @ rs_w[q].float() for q in range(P))[rank * m:(rank + 1) * m]
    for backend in ("decomposed", "symm_mem", "reference"):
        gathered, o1, o2 = all_gather_matmul(x, ws, tp, return_gathered=True, backend=backend)
        out[f"{backend} ag gathered"] = rel(gathered, x_full)
        out[f"{backend} ag out"] = max(rel(o1, x_full.float() @ ws[0].float()), rel(o2, x_full.float() @ ws[1].float()))
        out[f"{backend} rs"] = rel(matmul_reduce_scatter(xs[rank], rs_w[rank], tp, backend=backend), rs_expect)
        # a TP MLP in fp32 (column shard of W1, row shard of W2): gradients against the dense one
        xg = x.float().clone().requires_grad_()
        w1 = W1[:, rank * n:(rank + 1) * n].clone().requires_grad_()
        (h,) = all_gather_matmul(xg, [w1], tp, backend=backend)
        y = matmul_reduce_scatter(h, W2[rank * n:(rank + 1) * n], tp, backend=backend)
        y.square().sum().backward()
        xd, w1d = x_full.float().clone().requires_grad_(), W1.clone().requires_grad_()
        (xd @ w1d @ W2).square().sum().backward()
        out[f"{backend} mlp out"] = rel(y, (x_full.float() @ W1 @ W2)[rank * m:(rank + 1) * m])
        out[f"{backend} grad x"] = rel(xg.grad, xd.grad[rank * m:(rank + 1) * m])
        out[f"{backend} grad w"] = rel(w1.grad, w1d.grad[:, rank * n:(rank + 1) * n])
        qres = all_gather_matmul_fp8(x, [quantize_fp8_weight(ws[0])], tp, return_gathered=True, backend=backend)
        q_full = quantize_fp8_per_token(x_full)
        out[f"{backend} fp8 ag"] = rel(qres.outputs[0], q_full.dequantize() @ quantize_fp8_weight(ws[0]).dequantize())
        out[f"{backend} fp8 gathered scale"] = rel(qres.gathered.scale, q_full.scale)
    torch.cuda.synchronize()
    destroy_parallel()
    return out


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_gpu_backends_match_dense_products_and_gradients():
    from launch.local import launch_local

    for rank, res in enumerate(launch_local(_multigpu_rank, 2, backend="nccl", timeout=300)):
        bad = {k: v for k, v in res.items() if v > (0.03 if "fp8" in k else 1e-2)}
        assert not bad, f"rank {rank}: {bad}"


# ---------------------------------------------------------------------------------------------
# The decomposed engines' compute schedule (what `megapar bench sp` times on one device)


class _KernelLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op that does arithmetic or moves data (not views / allocations)."""

    SKIP = ("empty", "new_empty", "view", "slice", "select", "alias", "_unsafe_view", "detach", "t", "transpose",
            "expand")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in self.SKIP:
            self.ops.append((name, tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
        return out


@pytest.mark.parametrize("P,rank", [(2, 1), (4, 0), (4, 3), (8, 5)])
def test_loopback_all_gather_matmul_runs_one_matmul_per_block_into_the_output_and_no_copy(P, rank):
    from parallel.sp.ops import decomposed_all_gather_matmul
    from parallel.sp.ring import RingPeers

    m, K, N = 3, 5, 4
    x, w = torch.randn(m, K), torch.randn(K, N)
    peers = RingPeers.loopback_of(rank, P)
    with _KernelLog() as log:
        _, (out,) = decomposed_all_gather_matmul(x, [w], peers, need_gathered=False)
    assert log.ops == [("mm", (m, N))] * P, log.ops
    torch.testing.assert_close(out[rank * m:(rank + 1) * m], x @ w)  # the own block, from the input itself
    with _KernelLog() as log:
        gathered, _ = decomposed_all_gather_matmul(x, [w], peers, need_gathered=True)
    assert log.ops == [("mm", (m, N))] * P + [("copy_", (m, K))], log.ops
    assert torch.equal(gathered[rank * m:(rank + 1) * m], x)
    # with a receive buffer that already holds the other blocks, every block lands in its rows
    received = torch.randn(P * m, K)
    expect = received.clone()
    expect[rank * m:(rank + 1) * m] = x
    gathered, (out,) = decomposed_all_gather_matmul(x, [w], peers, need_gathered=True, gathered=received)
    assert gathered is received and torch.equal(gathered, expect)
    torch.testing.assert_close(out, torch.stack([expect[i * m:(i + 1) * m] @ w for i in range(P)]).flatten(0, 1))
    with pytest.raises(ValueError, match=r"out buffer \(5, 5\) torch.float32 does not fit"):
        decomposed_all_gather_matmul(x, [w], peers, need_gathered=False, gathered=torch.randn(5, K))


@pytest.mark.parametrize("P,rank", [(2, 0), (4, 2), (8, 7)])
def test_loopback_matmul_reduce_scatter_produces_each_destination_once_own_last_then_one_reduction(P, rank):
    from parallel.sp.ops import decomposed_matmul_reduce_scatter
    from parallel.sp.ring import RingPeers, pairwise_reduce_scatter

    m, K, N = 2, 3, 5
    x, w = torch.randn(P * m, K), torch.randn(K, N)
    peers = RingPeers.loopback_of(rank, P)
    with _KernelLog() as log:
        y = decomposed_matmul_reduce_scatter(x, w, peers)
    assert log.ops == [("mm", (m, N))] * P + [("sum", (m, N))], log.ops
    assert y.shape == (m, N)
    order, buffers = [], []

    def produce(d: int, out: torch.Tensor) -> None:
        order.append(d)
        buffers.append(out.data_ptr())
        out.fill_(d)

    pairwise_reduce_scatter(produce, peers, x, (m, N))
    assert order == [(rank + s) % P for s in range(1, P)] + [rank]
    assert len(set(buffers)) == P  # every partial has its own buffer until the sends are done


def test_loopback_peers_reject_a_rank_outside_the_group():
    from parallel.sp.ring import RingPeers

    with pytest.raises(ValueError, match="loopback rank 4 is out of range for size 4: valid ranks are 0..3"):
        RingPeers.loopback_of(4, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("lanes", [1, 2])
def test_cuda_loopback_engines_on_compute_lanes_are_ordered_before_the_results_are_read(lanes):
    """Read on the current stream without synchronizing: a missing join would show up as a race."""
    from parallel.sp.ops import decomposed_all_gather_matmul, decomposed_matmul_reduce_scatter
    from parallel.sp.ring import RingPeers, pairwise_reduce_scatter

    P, m, K, N = 4, 1024, 2048, 1536
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    peers = RingPeers.loopback_of(1, P)
    x, w = torch.randn(m, K, device=dev, dtype=bf16), torch.randn(K, N, device=dev, dtype=bf16) / K ** 0.5
    received = torch.randn(P * m, K, device=dev, dtype=bf16)
    expect_in = received.clone()
    expect_in[m:2 * m] = x
    gathered, (out,) = decomposed_all_gather_matmul(x, [w], peers, need_gathered=True, gathered=received,
                                                    lanes=lanes)
    assert torch.equal(gathered, expect_in)
    ref = torch.cat([expect_in[i * m:(i + 1) * m].float() @ w.float() for i in range(P)])
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    xs = torch.randn(P * m, K, device=dev, dtype=bf16)
    seen: dict[int, torch.Tensor] = {}

    def produce(d: int, o: torch.Tensor) -> None:
        torch.mm(xs[d * m:(d + 1) * m], w, out=o)
        seen[d] = o

    pairwise_reduce_scatter(produce, peers, xs, (m, N), lanes=lanes)
    assert sorted(seen) == list(range(P))
    for d, o in seen.items():
        torch.testing.assert_close(o.float(), xs[d * m:(d + 1) * m].float() @ w.float(), rtol=2e-2, atol=2e-2)
    assert decomposed_matmul_reduce_scatter(xs, w, peers, lanes=lanes).shape == (m, N)
