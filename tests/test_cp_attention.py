"""Local attention with LSE, its fused-kernel block decomposition, zigzag layout, and the ring
compute path on one process (size-1 groups and the all-ranks simulation)."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.cp import (attention_with_lse, merge_attn_states, ring_attention, zigzag_positions,
                         zigzag_positions_varlen, zigzag_shard, zigzag_shard_varlen, zigzag_unshard,
                         zigzag_unshard_varlen)
from parallel.cp.local_attn import _FusedBlock, _offset_causal_by_blocks
from parallel.cp.ring import simulate_ring_backward, simulate_ring_forward
from tests.helpers import reference_attention


def _qkv(seed: int, tq: int, tk: int, hq: int, hkv: int, d: int, dv: int, *, batch: int | None = None,
         dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    q = torch.randn(*lead, tq, hq, d, generator=gen)
    k = torch.randn(*lead, tk, hkv, d, generator=gen)
    v = torch.randn(*lead, tk, hkv, dv, generator=gen)
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


def _loss_weights(out: torch.Tensor, lse: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen,
                                                                                 dtype=torch.float64)


def _loss(out, lse, w_out, w_lse):
    finite = torch.isfinite(lse)
    return (out.double() * w_out.to(out.device)).sum() + torch.where(finite, lse.double(), 0.0).mul(
        w_lse.to(lse.device)).sum()


CASES = [  # (tq, tk, hq, hkv, d, dv, causal, q_offset, k_offset)
    (7, 9, 6, 2, 8, 5, False, 0, 0),
    (8, 8, 4, 4, 8, 8, True, 0, 0),
    (7, 9, 3, 1, 8, 8, True, 3, 0),      # every query sees a prefix plus a diagonal
    (7, 9, 6, 3, 8, 4, True, 0, 4),      # first rows see nothing
    (5, 6, 2, 1, 8, 8, True, 20, 0),     # every key visible
    (5, 6, 2, 2, 8, 8, True, 0, 30),     # nothing visible
    (6, 10, 4, 2, 8, 8, True, 5, 7),
]


@pytest.mark.parametrize("case", CASES)
def test_math_attention_with_offsets_and_gqa_matches_reference_with_grads(case):
    tq, tk, hq, hkv, d, dv, causal, qo, ko = case
    q, k, v = _qkv(sum(case[:6]), tq, tk, hq, hkv, d, dv)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = attention_with_lse(qa, ka, va, causal=causal, q_offset=qo, k_offset=ko, backend="math")
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, causal=causal, q_pos=torch.arange(tq) + qo,
                                           k_pos=torch.arange(tk) + ko)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-6)
    w_out, w_lse = _loss_weights(out, lse, 0)
    _loss(out, lse, w_out, w_lse).backward()
    _loss(ref_out, ref_lse, w_out, w_lse).backward()
    for ours, ref in ((qa, qr), (ka, kr), (va, vr)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=0, atol=2e-5)


def test_batched_inputs_match_per_sequence_attention():
    q, k, v = _qkv(3, 6, 6, 4, 2, 8, 8, batch=3)
    out, lse = attention_with_lse(q, k, v, causal=True, q_offset=2, k_offset=1)
    assert out.shape == (3, 6, 4, 8) and lse.shape == (3, 6, 4)
    for b in range(3):
        ref_out, ref_lse = reference_attention(q[b], k[b], v[b], causal=True, q_pos=torch.arange(6) + 2,
                                               k_pos=torch.arange(6) + 1)
        torch.testing.assert_close(out[b].double(), ref_out, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse[b].double(), ref_lse, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", [c for c in CASES if c[6]])
def test_block_decomposition_for_fused_kernels_matches_masked_math(case):
    """The cut of an offset causal mask into square-causal and unmasked blocks (what the fused
    kernels run), and the two-call lse gradient of `_FusedBlock`, both evaluated with math blocks."""
    tq, tk, hq, hkv, d, dv, causal, qo, ko = case
    q, k, v = _qkv(7 + tq, tq, tk, hq, hkv, d, dv, batch=2)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    state = _offset_causal_by_blocks(qa, ka, va, qo - ko, d ** -0.5, "math")
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = attention_with_lse(qr, kr, vr, causal=True, q_offset=qo, k_offset=ko, backend="math")
    torch.testing.assert_close(state.out, ref.out, rtol=0, atol=1e-6)
    torch.testing.assert_close(state.lse, ref.lse, rtol=0, atol=1e-6)
    if not state.out.requires_grad:   # no row sees a key: nothing depends on the inputs
        assert torch.isinf(ref.lse).all()
        return
    w_out, w_lse = _loss_weights(ref.out, ref.lse, 1)
    _loss(*state, w_out, w_lse).backward()
    _loss(*ref, w_out, w_lse).backward()
    for ours, theirs in ((qa, qr), (ka, kr), (va, vr)):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=2e-5)


def test_block_decomposition_of_an_empty_query_set_is_empty():
    """No queries (the all-gather variant's first chunk of a one-token sequence): an empty result
    on the fused-kernel path as on the math path, not an error."""
    q, k, v = _qkv(2, 0, 5, 4, 2, 8, 6, batch=2)
    for delta in (-3, 0, 4):
        out, lse = _offset_causal_by_blocks(q, k, v, delta, 0.5, "math")
        assert out.shape == (2, 0, 4, 6) and lse.shape == (2, 0, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("causal", [False, True])
def test_fused_block_autograd_handles_gradients_through_lse(causal):
    q, k, v = _qkv(11, 6, 6, 4, 2, 8, 8, batch=2)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = _FusedBlock.apply(qa, ka, va, causal, 0.3, "math")
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = attention_with_lse(qr, kr, vr, causal=causal, scale=0.3, backend="math")
    w_out, w_lse = _loss_weights(out, lse, 2)
    for use_out, use_lse in ((True, False), (False, True), (True, True)):
        for t in (qa, ka, va, qr, kr, vr):
            t.grad = None
        out, lse = _FusedBlock.apply(qa, ka, va, causal, 0.3, "math")
        sel = lambda o, l: (o.double() * w_out).sum() * use_out + (l.double() * w_lse).sum() * use_lse
        sel(out, lse).backward()
        sel(*ref).backward(retain_graph=True)
        for ours, theirs in ((qa, qr), (ka, kr), (va, vr)):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=2e-5)


def test_attention_over_key_chunks_merged_equals_full_causal_attention():
    """The ring's building block: per-chunk attention with offsets, merged by LSE."""
    q, k, v = _qkv(5, 12, 12, 4, 2, 8, 8)
    parts = [attention_with_lse(q, k[i:i + 4], v[i:i + 4], causal=True, k_offset=i) for i in (0, 4, 8)]
    out, lse = merge_attn_states(torch.stack([p.out for p in parts]), torch.stack([p.lse for p in parts]))
    ref_out, ref_lse = reference_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-6)


def test_attention_rejects_bad_input():
    q, k, v = _qkv(0, 4, 4, 6, 4, 8, 8)
    with pytest.raises(ValueError, match=r"query heads \(6\) must be a multiple of kv heads \(4\)"):
        attention_with_lse(q, k, v)
    q, k, v = _qkv(0, 4, 4, 4, 2, 8, 8)
    with pytest.raises(ValueError, match="dtypes differ"):
        attention_with_lse(q, k.double(), v)
    with pytest.raises(ValueError, match="head dim"):
        attention_with_lse(q[..., :4], k, v)
    with pytest.raises(ValueError, match="unknown implementation 'cudnn'; valid: auto, flash, efficient, math"):
        attention_with_lse(q, k, v, backend="cudnn")
    with pytest.raises(ValueError, match="CUDA"):
        attention_with_lse(q, k, v, backend="flash")
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        attention_with_lse(q[0], k, v)
    for scale in (math.nan, math.inf, "0.5x"):   # a NaN or infinite scale made every output NaN
        with pytest.raises(ValueError, match=f"scale must be a finite number or None, got {scale!r}"):
            attention_with_lse(q, k, v, scale=scale)
        with pytest.raises(ValueError, match=f"scale must be a finite number or None, got {scale!r}"):
            ring_attention(q, k, v, scale=scale)
    for dtype in (torch.float8_e4m3fn, torch.int32):   # fp8 is floating point, but nothing computes with it
        with pytest.raises(ValueError, match=f"got {dtype}"):
            attention_with_lse(q.to(dtype), k.to(dtype), v.to(dtype))
        with pytest.raises(ValueError, match=f"got {dtype}"):
            ring_attention(q.to(dtype), k.to(dtype), v.to(dtype))


def test_resolve_scale_accepts_real_scalars_and_refuses_the_rest():
    """The accepted set of `scale`: None, real numbers (numpy scalars and Fractions included), 0-dim
    real tensors and arrays; bools, strings, complex values, tensors/arrays with dims (even one
    element) and huge ints are ValueErrors naming the value (a complex tensor raised RuntimeError,
    which a ring rank did not turn into an agreed error)."""
    from fractions import Fraction

    import numpy as np

    from parallel.cp.local_attn import resolve_scale

    assert resolve_scale(None, 64) == 0.125
    for given in (0.5, 2, np.float32(0.5), np.float64(0.5), np.int64(2), Fraction(1, 2), np.array(0.5),
                  torch.tensor(0.5), torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(2)):
        got = resolve_scale(given, 64)
        assert type(got) is float and got == float(given), (given, got)
    for given in (True, False, np.bool_(True), torch.tensor(True), np.array(True), "0.5", 1 + 0j,
                  torch.tensor(1 + 1j), torch.tensor([0.5]), torch.tensor([[0.5]]), np.array([0.5]), 10 ** 400,
                  torch.tensor(math.inf), np.float32(math.nan)):
        with pytest.raises(ValueError, match=r"scale must be a finite number or None, got "):
            resolve_scale(given, 64)


def test_scale_that_requires_grad_is_refused_not_silently_detached():
    """No attention path differentiates the softmax scale, so a trainable tensor scale would stop
    training without a word (its gradient was dropped): a ValueError while grad mode is on; under
    no_grad nothing is dropped and the value is used. A detached tensor scale works."""
    from parallel.cp.local_attn import resolve_scale

    q, k, v = _qkv(4, 6, 6, 4, 2, 8, 8)
    trainable = torch.nn.Parameter(torch.tensor(0.3))
    for call in (lambda s: attention_with_lse(q, k, v, causal=True, scale=s),
                 lambda s: ring_attention(q, k, v, None, causal=True, scale=s),
                 lambda s: ring_attention(q, k, v, None, causal=True, scale=s, variant="allgather"),
                 lambda s: resolve_scale(s, 8)):
        with pytest.raises(ValueError, match=r"requires grad.*does not differentiate the softmax scale.*float"):
            call(trainable)
    ref, _ = reference_attention(q, k, v, causal=True, scale=0.3)
    with torch.no_grad():
        torch.testing.assert_close(ring_attention(q, k, v, None, scale=trainable).double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(ring_attention(q, k, v, None, scale=trainable.detach()).double(), ref, rtol=0,
                               atol=1e-6)
    torch.testing.assert_close(attention_with_lse(q, k, v, causal=True, scale=torch.tensor(0.3)).out.double(), ref,
                               rtol=0, atol=1e-6)


def test_zigzag_shard_unshard_and_positions():
    x = torch.arange(16).view(16, 1)
    shards = [zigzag_shard(x, r, 4) for r in range(4)]
    assert shards[1].view(-1).tolist() == [2, 3, 12, 13]
    assert zigzag_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert torch.equal(zigzag_unshard(shards), x)
    y = torch.randn(2, 12, 3)
    assert torch.equal(zigzag_unshard([zigzag_shard(y, r, 3, dim=1) for r in range(3)], dim=1), y)
    with pytest.raises(ValueError, match=r"2\*P = 6 .*pad it by 2 to 12"):
        zigzag_shard(torch.zeros(10), 0, 3)


def test_zigzag_varlen_shards_every_sequence_and_round_trips():
    cu = [0, 4, 16, 24]   # P = 2: chunks of 1, 3 and 2 tokens
    x = torch.arange(24)
    expect = {0: [0, 3, 4, 5, 6, 13, 14, 15, 16, 17, 22, 23], 1: [1, 2, 7, 8, 9, 10, 11, 12, 18, 19, 20, 21]}
    for rank in (0, 1):
        assert zigzag_shard_varlen(x, cu, rank, 2).tolist() == expect[rank]
        assert zigzag_shard_varlen(x, torch.tensor(cu), rank, 2).tolist() == expect[rank]
    assert zigzag_positions_varlen(cu, 1, 2).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5]
    y = torch.randn(3, 48, 2)
    cu = torch.tensor([0, 6, 6, 30, 48])   # P = 3, incl. an empty sequence
    shards = [zigzag_shard_varlen(y, cu, r, 3, dim=1) for r in range(3)]
    assert all(s.shape == (3, 16, 2) for s in shards)
    assert torch.equal(zigzag_unshard_varlen(shards, cu, dim=1), y)
    one = torch.randn(16, 2)   # a single sequence is plain zigzag
    assert torch.equal(zigzag_shard_varlen(one, [0, 16], 1, 4), zigzag_shard(one, 1, 4))


def test_zigzag_varlen_rejects_bad_lengths_and_offsets():
    pad_message = r"2\*P = 4 .*sequence\(s\) \[1\] have lengths \[6\].*padded lengths \[4, 8, 8\]"
    with pytest.raises(ValueError, match=pad_message):
        zigzag_shard_varlen(torch.zeros(18), [0, 4, 10, 18], 0, 2)
    with pytest.raises(ValueError, match="covers 16 tokens but x has 18"):
        zigzag_shard_varlen(torch.zeros(18), [0, 8, 16], 0, 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        zigzag_shard_varlen(torch.zeros(8), [0, 8, 4], 0, 1)
    with pytest.raises(ValueError, match="1-D integer"):
        zigzag_shard_varlen(torch.zeros(8), torch.tensor([0.0, 8.0]), 0, 1)
    with pytest.raises(ValueError, match=r"integer offsets, got \[0, 8.5, 16\]"):  # not truncated to 8
        zigzag_shard_varlen(torch.zeros(16), [0, 8.5, 16], 0, 2)
    with pytest.raises(ValueError, match=r"rank \(2\)"):
        zigzag_shard_varlen(torch.zeros(8), [0, 8], 2, 2)
    with pytest.raises(ValueError, match="must hold 8 tokens"):
        zigzag_unshard_varlen([torch.zeros(8), torch.zeros(6)], [0, 8, 16])
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="full packed batch"):
        ring_attention(q, q, q, None, cu_seqlens=[0, 4, 8])
    with pytest.raises(ValueError, match=r"packed \[T, H, D\]"):
        ring_attention(q[None], q[None], q[None], None, cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match="integer offsets"):
        ring_attention(q, q, q, None, cu_seqlens=[0, 3.5, 10])


def _per_sequence_reference(q, k, v, dout, cu, causal):
    """Full attention of each packed sequence on its own (float64), with gradients."""
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    parts = [reference_attention(*(x[a:b] for x in ref), causal=causal) for a, b in zip(cu[:-1], cu[1:])]
    out, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    (out * dout.double()).sum().backward()
    return out, lse, [x.grad for x in ref]


@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_packed_ring_attention_on_a_single_rank_attends_within_each_sequence(variant):
    cu = [0, 3, 10, 10, 16]   # one rank: any lengths (odd ones, an empty one)
    q, k, v = _qkv(4, 16, 16, 6, 2, 8, 4)
    dout = torch.randn(16, 6, 4)
    for causal in (True, False):
        local = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = ring_attention(*local, None, causal=causal, variant=variant, return_lse=True, cu_seqlens=cu)
        out.backward(dout)
        ref_out, ref_lse, ref_grads = _per_sequence_reference(q, k, v, dout, cu, causal)
        torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-6)
        for ours, ref in zip(local, ref_grads):
            torch.testing.assert_close(ours.grad.double(), ref, rtol=0, atol=2e-5)


def _simulated_packed_ring_check(size: int, lengths: list[int], backend: str, device: str, dtype, atol: float,
                                 grad_atol: float, d: int = 8) -> None:
    cu = torch.tensor([0] + lengths).cumsum(0).tolist()
    q, k, v = _qkv(size, cu[-1], cu[-1], 4, 2, d, d, batch=1, dtype=dtype, device=device)
    dout = torch.randn(q.shape, dtype=dtype, device=device)
    shard = lambda x: [zigzag_shard_varlen(x, cu, r, size, dim=1) for r in range(size)]
    for causal in (True, False):
        states = simulate_ring_forward(shard(q), shard(k), shard(v), causal=causal, backend=backend, cu_seqlens=cu)
        grads = simulate_ring_backward(shard(dout), shard(q), shard(k), shard(v), states, causal=causal,
                                       backend=backend, cu_seqlens=cu)
        ref_out, ref_lse, ref_grads = _per_sequence_reference(*(x[0].cpu() for x in (q, k, v, dout)), cu, causal)
        unshard = lambda xs: zigzag_unshard_varlen(xs, cu, dim=1)[0].double().cpu()
        torch.testing.assert_close(unshard([s.out for s in states]), ref_out, rtol=0, atol=atol)
        torch.testing.assert_close(unshard([s.lse for s in states]), ref_lse, rtol=0, atol=atol)
        for i, ref in enumerate(ref_grads):
            torch.testing.assert_close(unshard([g[i] for g in grads]), ref, rtol=0, atol=grad_atol)


def test_simulated_packed_ring_of_three_ranks_matches_per_sequence_attention():
    _simulated_packed_ring_check(3, [6, 18, 12], "math", "cpu", torch.float32, 1e-6, 2e-5)  # first: exactly 2P


@pytest.mark.parametrize("variant", ["ring", "allgather"])
@pytest.mark.parametrize("causal,scale", [(True, None), (True, 0.6), (False, 0.6)])
def test_ring_attention_on_a_single_rank_is_plain_attention(variant, causal, scale):
    """Default and explicit softmax scales (0.6, not the default 8^-0.5 = 0.354): the scale must
    reach the forward blocks and the ring's backward, causal or not."""
    q, k, v = _qkv(9, 10, 10, 6, 3, 8, 4)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(qa, ka, va, None, causal=causal, scale=scale, variant=variant, return_lse=True)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, causal=causal, scale=scale)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-6)
    w = torch.randn(out.shape, dtype=torch.float64)
    (out.double() * w).sum().backward()
    (ref_out * w).sum().backward()
    for ours, ref in ((qa, qr), (ka, kr), (va, vr)):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=0, atol=2e-5)


def _simulated_ring_check(size: int, causal: bool, backend: str, device: str, dtype, atol: float, d: int = 16):
    q, k, v = _qkv(size, 8 * size, 8 * size, 4, 2, d, d, batch=1, dtype=dtype, device=device)
    dout = torch.randn(q.shape[:-1] + (d,), device=device, dtype=dtype)
    shard = lambda x: [zigzag_shard(x, r, size, dim=1) for r in range(size)]
    qs, ks, vs, dos = shard(q), shard(k), shard(v), shard(dout)
    states = simulate_ring_forward(qs, ks, vs, causal=causal, backend=backend)
    grads = simulate_ring_backward(dos, qs, ks, vs, states, causal=causal, backend=backend)
    out = zigzag_unshard([s.out for s in states], dim=1)
    qr, kr, vr = (x[0].double().cpu().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference_attention(qr, kr, vr, causal=causal)
    (ref_out * dout[0].double().cpu()).sum().backward()
    torch.testing.assert_close(out[0].double().cpu(), ref_out, rtol=0, atol=atol)
    torch.testing.assert_close(zigzag_unshard([s.lse for s in states], dim=1)[0].double().cpu(), ref_lse,
                               rtol=0, atol=atol)
    for i, ref in enumerate((qr, kr, vr)):
        got = zigzag_unshard([g[i] for g in grads], dim=1)[0].double().cpu()
        torch.testing.assert_close(got, ref.grad, rtol=0, atol=atol * 5)


def test_simulated_ring_of_four_ranks_matches_full_attention():
    _simulated_ring_check(4, True, "math", "cpu", torch.float32, 1e-5)
    _simulated_ring_check(3, False, "math", "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,dtype,atol", [("flash", torch.bfloat16, 3e-2), ("efficient", torch.float32, 2e-4),
                                                ("efficient", torch.bfloat16, 3e-2)])
def test_fused_attention_matches_math_on_cuda(backend, dtype, atol):
    for tq, tk, hq, hkv, d, dv, causal, qo, ko in CASES + [(300, 520, 8, 2, 128, 128, True, 220, 0)]:
        if backend == "flash" and d != dv:
            continue
        d, dv = max(d, 64), max(dv, 64)
        q, k, v = _qkv(1, tq, tk, hq, hkv, d, dv, batch=2, dtype=dtype, device="cuda")
        qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
        got = attention_with_lse(qa, ka, va, causal=causal, q_offset=qo, k_offset=ko, backend=backend)
        qr, kr, vr = (x.float().clone().requires_grad_() for x in (q, k, v))
        ref = attention_with_lse(qr, kr, vr, causal=causal, q_offset=qo, k_offset=ko, backend="math")
        torch.testing.assert_close(got.out.float(), ref.out, rtol=0, atol=atol)
        torch.testing.assert_close(got.lse, ref.lse, rtol=0, atol=atol)
        if not got.out.requires_grad:   # no row sees a key
            continue
        w_out, w_lse = _loss_weights(ref.out, ref.lse, 3)
        _loss(*got, w_out, w_lse).backward()
        _loss(*ref, w_out, w_lse).backward()
        for ours, theirs in ((qa, qr), (ka, kr), (va, vr)):
            torch.testing.assert_close(ours.grad.float(), theirs.grad, rtol=0, atol=atol * 10)


@pytest.mark.gpu
def test_simulated_ring_with_flash_matches_full_attention_on_cuda():
    _simulated_ring_check(4, True, "flash", "cuda", torch.bfloat16, 3e-2, d=64)
    _simulated_ring_check(2, False, "auto", "cuda", torch.bfloat16, 3e-2, d=128)


@pytest.mark.gpu
def test_simulated_packed_ring_with_fused_kernels_matches_per_sequence_attention_on_cuda():
    """Packed batches on CUDA run the fused kernels once per sequence and ring step."""
    _simulated_packed_ring_check(4, [8, 24, 72], "flash", "cuda", torch.bfloat16, 3e-2, 1.5e-1, d=64)
    _simulated_packed_ring_check(2, [4, 12, 100], "efficient", "cuda", torch.float32, 2e-4, 1e-3, d=64)


@pytest.mark.parametrize("causal", [True, False])
def test_nan_or_inf_in_q_or_a_visible_key_makes_exactly_its_rows_nan_never_empty(causal):
    """A row with a NaN score (NaN in q or in a key it sees) or a +inf one (inf in q) came out
    of the math path with out NaN but lse -inf (`total > 0` is False for a NaN total) or +inf (a
    +inf max was reset to 0): both mark a row empty, so the LSE merges of a ring (or of DCP shards)
    dropped it, giving finite values on every row that saw the NaN, and out 0 with lse -inf on a
    NaN query row. Now out and lse are NaN on exactly those rows (directly and through a 2-rank
    ring), every other row as in the float64 reference."""
    q, k, v = _qkv(31, 8, 8, 4, 2, 8, 8, batch=1)
    k[0, 1, 1, 3] = math.nan          # key 1 of kv head 1: q heads 2, 3 of every row that sees key 1
    q[0, 5, 0, 0] = math.inf          # query row 5, head 0: scores of +-inf
    rows = torch.arange(8)[:, None]
    bad = ((rows >= 1) if causal else torch.ones(8, 1, dtype=torch.bool)) & (torch.arange(4) >= 2)
    bad[5, 0] = True
    ref_out, ref_lse = reference_attention(q[0], k[0], v[0], causal=causal)

    def check(out, lse, what):
        assert torch.equal(torch.isnan(lse), bad), (what, lse)
        assert torch.equal(torch.isnan(out).all(-1), bad) and not torch.isnan(out[~bad]).any(), what
        torch.testing.assert_close(out[~bad].double(), ref_out[~bad], rtol=0, atol=1e-6)
        torch.testing.assert_close(lse[~bad].double(), ref_lse[~bad], rtol=0, atol=1e-6)

    got = attention_with_lse(q, k, v, causal=causal, backend="math")
    check(got.out[0], got.lse[0], "local")
    shard = lambda x: [zigzag_shard(x, r, 2, dim=1) for r in range(2)]
    states = simulate_ring_forward(shard(q), shard(k), shard(v), causal=causal, backend="math")
    check(zigzag_unshard([s.out for s in states], dim=1)[0], zigzag_unshard([s.lse for s in states], dim=1)[0],
          "ring of 2")
