"""Checks of the independent full-attention reference (`tests.helpers.reference_attention`) that
the context-parallel tests compare against: written differently from `parallel.cp` on purpose
(float64, one head at a time, torch.softmax and torch.logsumexp, masks from explicit position
vectors), and checked here against PyTorch's scaled_dot_product_attention.

Then ring attention (`parallel.cp.ring`) against `_plain_attention`, a float64 attention over the
whole (packed) sequence written here from one explicit mask: the ring's steps and merges in one
process (`simulate_ring_forward` / `simulate_ring_backward`, P = 1..8) and the public entry on
one rank (some of q, k, v requiring grad, a second backward, torch.no_grad, bf16, bad input).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from parallel.cp import ring_attention, zigzag_shard, zigzag_shard_varlen, zigzag_unshard, zigzag_unshard_varlen
from parallel.cp.ring import simulate_ring_backward, simulate_ring_forward
from tests.helpers import reference_attention


def test_reference_matches_torch_sdpa_with_gqa_and_causal_mask():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, 6, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(7, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 2, 5, generator=gen, dtype=torch.float64)
    for causal in (False, True):
        out, lse = reference_attention(q, k, v, causal=causal)
        expect = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1),
                                                v.repeat_interleave(3, 1).transpose(0, 1), is_causal=causal)
        torch.testing.assert_close(out, expect.transpose(0, 1), rtol=1e-12, atol=1e-12)
        scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(3, 1)) * 8 ** -0.5
        if causal:
            scores = scores + torch.full((7, 7), -math.inf, dtype=torch.float64).triu(1)
        torch.testing.assert_close(lse, scores.exp().sum(-1).log().T, rtol=1e-12, atol=1e-12)


def test_reference_rows_without_keys_are_zero_with_minus_inf_lse():
    q, k, v = torch.randn(3, 1, 4), torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    out, lse = reference_attention(q, k, v, causal=True, q_pos=torch.tensor([0, 5, 10]), k_pos=torch.tensor([3, 6]))
    assert torch.equal(out[0], torch.zeros(1, 4, dtype=torch.float64)) and lse[0, 0] == -math.inf
    assert torch.isfinite(lse[1:]).all()


# ---------------------------------------------------------------------------------------------
# ring attention (parallel/cp/ring.py) against plain float64 attention over the whole sequence


def _plain_attention(q, k, v, *, causal, scale, lengths=None):
    """q [B, S, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] -> out [B, S, Hq, Dv], lse [B, S, Hq] (float64).

    One mask over the whole (packed) sequence: token j is visible from token i iff both lie in the
    same packed sequence (`lengths`, default one sequence) and, when causal, j <= i. Query head h
    reads kv head h // (Hq // Hkv). Differentiable (autograd of plain torch ops)."""
    b, s, hq, _ = q.shape
    hkv = k.shape[2]
    lengths = [s] if lengths is None else lengths
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(s)
    visible = seq[:, None] == seq[None, :]
    if causal:
        visible = visible & (pos[None, :] <= pos[:, None])
    heads = torch.arange(hq) // (hq // hkv)
    kk, vv = k.double()[:, :, heads], v.double()[:, :, heads]
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), kk) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.exp(scores - lse[..., None]), vv)
    return out, lse.transpose(1, 2)


def test_plain_attention_of_these_tests_matches_the_shared_reference():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, h, d, generator=gen, dtype=torch.float64) for h, d in ((4, 8), (2, 8), (2, 5)))
    for causal in (False, True):
        out, lse = _plain_attention(q[None], k[None], v[None], causal=causal, scale=0.3, lengths=[5, 0, 7])
        parts = [reference_attention(q[a:b], k[a:b], v[a:b], causal=causal, scale=0.3) for a, b in ((0, 5), (5, 12))]
        torch.testing.assert_close(out[0], torch.cat([p[0] for p in parts]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[0], torch.cat([p[1] for p in parts]), rtol=1e-12, atol=1e-12)


def _inputs(seed, b, s, hq, hkv, d, dv, dtype):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((hq, d), (hkv, d), (hkv, dv), (hq, dv))
    return [torch.randn(b, s, h, e, generator=gen, dtype=torch.float64).to(dtype) for h, e in shapes]


def _expected(q, k, v, dout, causal, scale, lengths):
    """Out, lse and the gradients of q, k, v of the plain float64 attention (inputs read as float64)."""
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = _plain_attention(*leaves, causal=causal, scale=scale, lengths=lengths)
    (out * dout.double()).sum().backward()
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def _check_simulated(size, b, s, hq, hkv, d, dv, causal, scale, lengths, seed, dtype, atol, grad_atol):
    q, k, v, dout = _inputs(seed, b, s, hq, hkv, d, dv, dtype)
    if lengths is None:
        cu = None
        shard = lambda x: [zigzag_shard(x, r, size, dim=1) for r in range(size)]
        unshard = lambda xs: zigzag_unshard(xs, dim=1)
    else:
        cu = [0] + list(itertools.accumulate(lengths))
        shard = lambda x: [zigzag_shard_varlen(x, cu, r, size, dim=1) for r in range(size)]
        unshard = lambda xs: zigzag_unshard_varlen(xs, cu, dim=1)
    qs, ks, vs, dos = shard(q), shard(k), shard(v), shard(dout)
    states = simulate_ring_forward(qs, ks, vs, causal=causal, scale=scale, backend="math", cu_seqlens=cu)
    grads = simulate_ring_backward(dos, qs, ks, vs, states, causal=causal, scale=scale, backend="math", cu_seqlens=cu)
    out, lse, ref_grads = _expected(q, k, v, dout, causal, d ** -0.5 if scale is None else scale, lengths)
    msg = f"P={size} B={b} S={s} Hq={hq} Hkv={hkv} D={d} Dv={dv} causal={causal} scale={scale} lengths={lengths}"
    tol = dict(rtol=atol, atol=atol, msg=lambda m: f"{msg}: {m}")
    torch.testing.assert_close(unshard([st.out for st in states]).double(), out, **tol)
    torch.testing.assert_close(unshard([st.lse for st in states]).double(), lse, **tol)
    for i, name in enumerate("qkv"):
        torch.testing.assert_close(unshard([g[i] for g in grads]).double(), ref_grads[i], rtol=grad_atol,
                                   atol=grad_atol, msg=lambda m, name=name: f"{msg} d{name}: {m}")


@pytest.mark.parametrize("size", range(1, 9))
def test_simulated_ring_matches_plain_float64_attention(size):
    """The ring's steps and merges, P = 1..8: causal and not, GQA (Hkv 1 and 2 of Hq 4), Dv != D,
    B = 2, the default and a custom scale, fresh inputs per seed."""
    for causal, hkv, seed in itertools.product((True, False), (1, 2), (0, 1)):
        scale = 0.3 if seed else None
        _check_simulated(size, 2, 4 * size, 4, hkv, 8, 6, causal, scale, None, 10 * size + seed, torch.float32,
                         5e-6, 2e-5)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_simulated_packed_ring_with_an_empty_sequence_matches_plain_float64_attention(size):
    """Packed batches: several sequences of different lengths (multiples of 2P, one of length 0,
    first and in the middle), no attention across sequences."""
    for causal, lengths in itertools.product((True, False), ([0, 6, 2, 0, 4], [2, 4, 0])):
        lengths = [n * size for n in lengths]
        _check_simulated(size, 1, sum(lengths), 4, 2, 8, 6, causal, 0.4, lengths, size + len(lengths), torch.float32,
                         5e-6, 2e-5)


@pytest.mark.parametrize("size", [2, 3])
def test_simulated_ring_in_bf16_is_close_to_float64_attention_of_the_rounded_inputs(size):
    for causal in (True, False):
        _check_simulated(size, 2, 8 * size, 4, 1, 16, 8, causal, None, None, size, torch.bfloat16, 3e-2, 5e-2)


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_one_rank_ring_attention_backward_with_some_inputs_requiring_grad_twice_and_under_no_grad(variant):
    """The public entry at P = 1 (GQA, Dv != D, B = 2, custom scale, return_lse): each subset of
    q, k, v that requires grad gets the plain attention's gradients and the others none; a
    second backward with retain_graph adds the same gradients again; under torch.no_grad the
    result is the same and carries no graph."""
    q, k, v, dout = _inputs(7, 2, 10, 4, 2, 8, 6, torch.float32)
    out_ref, lse_ref, grads_ref = _expected(q, k, v, dout, True, 0.45, None)
    for needs in ((True, False, False), (False, True, False), (False, False, True), (False, True, True),
                  (True, True, True)):
        xs = [x.clone().requires_grad_(n) for x, n in zip((q, k, v), needs)]
        out, lse = ring_attention(*xs, scale=0.45, variant=variant, return_lse=True)
        torch.testing.assert_close(out.double(), out_ref, rtol=5e-6, atol=5e-6)
        torch.testing.assert_close(lse.double(), lse_ref, rtol=5e-6, atol=5e-6)
        out.backward(dout, retain_graph=True)
        first = [None if x.grad is None else x.grad.clone() for x in xs]
        out.backward(dout)
        for x, n, g, ref, name in zip(xs, needs, first, grads_ref, "qkv"):
            assert (x.grad is not None) == n, f"{variant} {needs}: d{name} {'missing' if n else 'unexpected'}"
            if n:
                torch.testing.assert_close(g.double(), ref, rtol=2e-5, atol=2e-5)
                torch.testing.assert_close(x.grad, 2 * g, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            again = ring_attention(*xs, scale=0.45, variant=variant, return_lse=True)
        assert again.out.grad_fn is None and not again.out.requires_grad
        torch.testing.assert_close(again.out, out.detach(), rtol=0, atol=0)
        torch.testing.assert_close(again.lse, lse.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_one_rank_ring_attention_in_bf16_packed_batch(variant):
    lengths = [6, 0, 3, 7]   # one rank: any lengths, an empty one included
    q, k, v, dout = _inputs(3, 1, sum(lengths), 4, 1, 16, 8, torch.bfloat16)
    out_ref, lse_ref, grads_ref = _expected(q, k, v, dout, True, 16 ** -0.5, lengths)
    xs = [x[0].clone().requires_grad_() for x in (q, k, v)]
    out, lse = ring_attention(*xs, variant=variant, return_lse=True, cu_seqlens=[0, 6, 6, 9, 16])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out.backward(dout[0])
    torch.testing.assert_close(out.double(), out_ref[0], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(lse.double(), lse_ref[0], rtol=3e-2, atol=3e-2)
    for x, ref in zip(xs, grads_ref):
        assert x.grad.dtype == torch.bfloat16
        torch.testing.assert_close(x.grad.double(), ref[0], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_ring_attention_with_head_dim_zero_and_the_default_scale_is_a_value_error(variant):
    """1/sqrt(D) is undefined for D = 0: a ValueError (ring_attention reports ValueErrors to every
    rank), not the ZeroDivisionError that left the other ranks waiting in the agreement."""
    x = torch.randn(4, 2, 0)
    with pytest.raises(ValueError, match=r"head dim D = 0"):
        ring_attention(x, x, x, variant=variant)
    out = ring_attention(x, x, torch.randn(4, 2, 3), scale=0.5, variant=variant)   # an explicit scale still works
    assert out.shape == (4, 2, 3)
