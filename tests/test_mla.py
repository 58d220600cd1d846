"""MLA: absorbed decode over the latent paged cache (torch and the Triton kernel under the
interpreter) and non-absorbed prefill, against the DeepSeek-V3 equations in fp64
(`mla_reference`, checked itself against a per-head loop), DCP and ring prefill on gloo ranks,
and HF transformers' DeepSeek-V3 attention with random weights when transformers is installed."""

from __future__ import annotations

import math

import pytest
import torch

from launch.local import launch_local
from parallel.cp import DCPLayout, zigzag_shard
from parallel.cp.mla import (MLACache, MLADims, absorb_query, mla_decode_attention, mla_kv_insert, mla_output,
                             mla_prefill_attention, mla_reference, plan_mla_decode, split_kv_b)
from parallel.cp.paged import paged_decode_attention

DIMS = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)


def _weights(heads: int, dims: MLADims, seed: int):
    gen = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, generator=gen) * 0.2
    return split_kv_b(kv_b, heads, dims)


def _tokens(b: int, t: int, heads: int, dims: MLADims, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, heads, dims.qk_nope_head_dim, generator=gen),
            torch.randn(b, t, heads, dims.qk_rope_head_dim, generator=gen),
            torch.randn(b, t, dims.kv_lora_rank, generator=gen),
            torch.randn(b, t, dims.qk_rope_head_dim, generator=gen))


def test_reference_matches_per_head_loop():
    heads = 3
    w_uk, w_uv = _weights(heads, DIMS, 0)
    qn, qp, c, kp = _tokens(1, 5, heads, DIMS, 1)
    got = mla_reference(qn, qp, c, kp, w_uk, w_uv)
    for h in range(heads):
        k = torch.cat([c[0].double() @ w_uk[h].double().T, kp[0].double()], -1)       # [T, d_n + d_r]
        v = c[0].double() @ w_uv[h].double().T
        q = torch.cat([qn[0, :, h], qp[0, :, h]], -1).double()
        s = q @ k.T / math.sqrt(DIMS.qk_head_dim)
        s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
        torch.testing.assert_close(got[0, :, h], s.softmax(-1) @ v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_absorbed_decode_matches_equations(backend, cache_dtype, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    heads, lens, block = 4, [9, 30, 1], 8
    w_uk, w_uv = _weights(heads, DIMS, 2)
    qn, qp, c, kp = _tokens(len(lens), max(lens), heads, DIMS, 3)
    cache = MLACache.allocate(16, block, DIMS, dtype=cache_dtype)
    table = torch.arange(12).view(3, 4).flip(1).int()
    for i, n in enumerate(lens):
        mla_kv_insert(cache, c[i, :n], kp[i, :n], torch.arange(n), table[i])
    q_nope = torch.stack([qn[i, n - 1] for i, n in enumerate(lens)])        # the newest token
    q_pe = torch.stack([qp[i, n - 1] for i, n in enumerate(lens)])
    got = mla_decode_attention(q_nope, q_pe, cache, w_uk, w_uv, table, torch.tensor(lens), backend=backend)
    tol = 1e-4 if cache_dtype == torch.float32 else 0.1
    for i, n in enumerate(lens):
        cc, kk = c[i:i + 1, :n], kp[i:i + 1, :n]
        if cache_dtype == torch.float8_e4m3fn:       # what the cache holds: the fp8-rounded latent
            # by hand (not the decode's own gather): block table[p // B], offset p % B, e4m3 value x scale;
            # it must be the inserted latent to one e4m3 step (relative 2^-4, or a subnormal step)
            p = torch.arange(n)
            blk, off = table[i].long()[p // block], p % block
            held = cache.kv[blk, off, 0].float() * cache.scale[blk, off]                  # [n, r + d_r]
            orig = torch.cat([c[i, :n], kp[i, :n]], -1)
            tiny = 2.0 ** -9 * orig.abs().amax(-1, keepdim=True) / 448
            assert ((held - orig).abs() <= 2.0 ** -4 * orig.abs() + tiny + 1e-30).all()
            cc, kk = held[None, :, :DIMS.kv_lora_rank], held[None, :, DIMS.kv_lora_rank:]
            tol = 1e-4
        ref = mla_reference(q_nope[i:i + 1, None], q_pe[i:i + 1, None], cc, kk, w_uk, w_uv, causal=False)
        torch.testing.assert_close(got[i].double(), ref[0, 0], atol=tol, rtol=0)
    # under a length plan (short splits: the 30-token sequence in several items on the kernel's path)
    if backend == "triton":
        from parallel.cp import triton_decode

        for key in [k for k in triton_decode.CONFIG if k.startswith(("min_split", "block_n"))]:
            monkeypatch.setitem(triton_decode.CONFIG, key, 16)
        for key in [k for k in triton_decode.CONFIG if k.startswith("target_programs")]:
            monkeypatch.setitem(triton_decode.CONFIG, key, 64)
    plan = plan_mla_decode(q_nope, cache, table, torch.tensor(lens), backend=backend)
    assert int(plan.segments[-1]) > len(lens) or backend == "torch"
    planned = mla_decode_attention(q_nope, q_pe, cache, w_uk, w_uv, table, torch.tensor(lens), backend=backend,
                                   plan=plan)
    torch.testing.assert_close(planned, got, atol=1e-5, rtol=0)


def test_absorbed_speculative_tokens_via_paged_kernel_op():
    """q_len = 3 through paged_decode_attention on the latent view: causal within the new tokens."""
    heads, n, tq = 2, 20, 3
    w_uk, w_uv = _weights(heads, DIMS, 4)
    qn, qp, c, kp = _tokens(1, n, heads, DIMS, 5)
    cache = MLACache.allocate(4, 8, DIMS, dtype=torch.float32)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    mla_kv_insert(cache, c[0], kp[0], torch.arange(n), table[0])
    q = absorb_query(qn[:, n - tq:], qp[:, n - tq:], w_uk)                  # [1, Tq, H, r + d_r]
    state = paged_decode_attention(q, cache.paged, table, torch.tensor([n]), scale=DIMS.scale, backend="torch")
    got = mla_output(state.out, w_uv)
    ref = mla_reference(qn[:, n - tq:], qp[:, n - tq:], c, kp, w_uk, w_uv, q_offset=n - tq)
    torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)


def test_latent_cache_rejects_bad_input():
    with pytest.raises(ValueError, match="fp8 latent cache needs a scale"):
        MLACache(torch.zeros(2, 4, 1, 48, dtype=torch.float8_e4m3fn), 32)
    cache = MLACache.allocate(2, 4, DIMS, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"must be \[T, 32\], \[T, 16\], \[T\]"):
        mla_kv_insert(cache, torch.zeros(3, 31), torch.zeros(3, 16), torch.arange(3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="kv_b weight"):
        split_kv_b(torch.zeros(10, 32), 2, DIMS)


def _mla_rank(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=world, pcp=world))
    heads = 4
    w_uk, w_uv = _weights(heads, DIMS, 10)
    # prefill: zigzag shards through the ring and the all-gather variant
    qn, qp, c, kp = _tokens(2, 8 * world, heads, DIMS, 11)
    ref = mla_reference(qn, qp, c, kp, w_uk, w_uv)
    shard = lambda x: zigzag_shard(x, rank, world, dim=1)
    for variant in ("ring", "allgather"):
        o = mla_prefill_attention(shard(qn), shard(qp), shard(c), shard(kp), w_uk, w_uv, groups.pcp, variant=variant)
        torch.testing.assert_close(o.double(), shard(ref), atol=1e-4, rtol=0)
    # decode: every rank holds the same heads here (the PCP peers as the cache's shard group); the
    # latent cache is sharded over them
    lens = [3 * world + 1, 1, 8 * world]
    cache = MLACache.allocate(12, 4, DIMS, dtype=torch.float32)
    table = torch.arange(9).view(3, 3).int()
    for i, n in enumerate(lens):
        mla_kv_insert(cache, c[i % 2, :n], kp[i % 2, :n], torch.arange(n), table[i], groups.pcp)
    q_nope = torch.stack([qn[i % 2, n - 1] for i, n in enumerate(lens)])
    q_pe = torch.stack([qp[i % 2, n - 1] for i, n in enumerate(lens)])
    for comm in ("ag_rs", "a2a"):
        got = mla_decode_attention(q_nope, q_pe, cache, w_uk, w_uv, table,
                                   torch.tensor(lens), groups.pcp, comm=comm)
        for i, n in enumerate(lens):
            r = mla_reference(q_nope[i:i + 1, None], q_pe[i:i + 1, None], c[i % 2:i % 2 + 1, :n],
                              kp[i % 2:i % 2 + 1, :n], w_uk, w_uv, causal=False)
            torch.testing.assert_close(got[i].double(), r[0, 0], atol=1e-4, rtol=0)
    # interleave 2, and the cache sharded over pcp x dcp (dcp 1 here: the PCP merge alone, the world
    # rank is the total cp rank): each rank writes the slots of docs/numerics.md §8.2, by hand, and
    # decode (which must use the same interleave and shards) gives the full attention. Lengths 2 mod 4:
    # a rank's share under interleave 2 is not its share under 1 (6 tokens: 4 + 2 against 3 + 3)
    lens = [6, 1, 14]
    q_nope = torch.stack([qn[i % 2, n - 1] for i, n in enumerate(lens)])
    q_pe = torch.stack([qp[i % 2, n - 1] for i, n in enumerate(lens)])
    for interleave, group, pcp in ((2, groups.pcp, None), (1, groups.dcp, groups.pcp), (2, groups.dcp, groups.pcp)):
        cache = MLACache.allocate(12, 4, DIMS, dtype=torch.float32)
        for i, n in enumerate(lens):
            slots = mla_kv_insert(cache, c[i % 2, :n], kp[i % 2, :n], torch.arange(n), table[i], group,
                                  interleave=interleave, pcp_group=pcp)
            p = torch.arange(n)
            o = p % (4 * world)
            want = torch.where((o // interleave) % world == rank, table[i].long()[p // (4 * world)] * 4
                               + (o // (world * interleave)) * interleave + o % interleave, -1)
            assert torch.equal(slots, want), (interleave, i, slots, want)
        got = mla_decode_attention(q_nope, q_pe, cache, w_uk, w_uv, table, torch.tensor(lens), group,
                                   interleave=interleave, comm="a2a" if pcp is None else "ag_rs", pcp_group=pcp)
        for i, n in enumerate(lens):
            r = mla_reference(q_nope[i:i + 1, None], q_pe[i:i + 1, None], c[i % 2:i % 2 + 1, :n],
                              kp[i % 2:i % 2 + 1, :n], w_uk, w_uv, causal=False)
            torch.testing.assert_close(got[i].double(), r[0, 0], atol=1e-4, rtol=0)
    assert DCPLayout(size=world, rank=rank, block_size=4).local_lengths(1) == (1 if rank == 0 else 0)
    return "ok"


def test_mla_dcp_decode_and_ring_prefill_on_gloo_ranks():
    assert launch_local(_mla_rank, 2, args=(2,), timeout=120) == ["ok"] * 2


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("q_norm", [False, True])
def test_fused_prep_matches_unfused_sequence(cache_dtype, q_norm, monkeypatch):
    """The Triton prep (interpreter) against the unfused torch sequence, on 2 DCP ranks (interleave 2)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_prep(cache_dtype, q_norm, "cpu", exact_bf16=False)   # the interpreter truncates fp32 -> bf16


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("q_norm", [False, True])
def test_fused_prep_matches_unfused_sequence_on_gpu(cache_dtype, q_norm, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check_prep(cache_dtype, q_norm, "cuda", exact_bf16=True)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fused_prep_writes_a_cache_view_of_a_joint_buffer(cache_dtype, monkeypatch):
    """The kernel's cache (and fp8 scales) as one layer's view of a larger buffer: the Triton prep
    flattened it with `.view` and raised; it writes by block and token strides, as the torch prep."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_prep(cache_dtype, False, "cpu", exact_bf16=False, joint=True)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fused_prep_writes_a_cache_view_of_a_joint_buffer_on_gpu(cache_dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check_prep(cache_dtype, True, "cuda", exact_bf16=True, joint=True)


def _joint_view(cache: MLACache) -> MLACache:
    """The same cache as layer 1 of a two-layer buffer [num_blocks, 2, block_size, 1, D] (and scales)."""
    kv = torch.zeros((cache.kv.shape[0], 2) + tuple(cache.kv.shape[1:]), dtype=cache.kv.dtype,
                     device=cache.kv.device)[:, 1]
    scale = None
    if cache.scale is not None:
        scale = torch.ones((cache.scale.shape[0], 2) + tuple(cache.scale.shape[1:]), device=cache.scale.device)[:, 1]
    assert not kv.is_contiguous()
    return MLACache(kv, cache.kv_lora_rank, scale)


def _check_prep(cache_dtype, q_norm, device, exact_bf16, joint=False):
    from parallel.cp.mla_prep import mla_prep, rope_table

    gen = torch.Generator().manual_seed(21)
    t, heads, nope = 10, 3, DIMS.qk_nope_head_dim
    # inputs: bf16 for a bf16 cache; for fp8 bf16 on the GPU, fp32 under the interpreter (which truncates to bf16)
    dt = torch.bfloat16 if cache_dtype == torch.bfloat16 or (exact_bf16 and cache_dtype != torch.float32) \
        else torch.float32
    q = torch.randn(t, heads, nope + DIMS.qk_rope_head_dim, generator=gen).to(dt)
    kv = (torch.randn(t, DIMS.latent_dim, generator=gen) * 3).to(dt)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 30, 17])
    table = torch.tensor([[3, 0, 5, 1]]).expand(t, -1).int()
    cos_sin = rope_table(64, DIMS.qk_rope_head_dim)
    w_kv = torch.rand(DIMS.kv_lora_rank, generator=gen) + 0.5
    w_q = torch.rand(nope + DIMS.qk_rope_head_dim, generator=gen) + 0.5 if q_norm else None
    for rank in range(2):
        layout = DCPLayout(size=2, rank=rank, block_size=4, interleave=2)
        caches = [MLACache.allocate(8, 4, DIMS, dtype=cache_dtype, device=d) for d in ("cpu", device)]  # ref, kernel
        if joint:
            caches[1] = _joint_view(caches[1])
        ref = mla_prep(q, kv, positions, caches[0], table, cos_sin, w_kv, layout=layout, q_norm_weight=w_q,
                       nope=nope, backend="torch")
        args = [x.to(device) for x in (q, kv, positions, table, cos_sin, w_kv)]
        got = mla_prep(*args[:3], caches[1], *args[3:], layout=layout, nope=nope, backend="triton",
                       q_norm_weight=None if w_q is None else w_q.to(device))
        caches[1] = MLACache(caches[1].kv.cpu(), caches[1].kv_lora_rank,
                             None if caches[1].scale is None else caches[1].scale.cpu())
        got.q, got.slots = got.q.cpu(), got.slots.cpu()
        exact = dt == torch.float32 or exact_bf16
        assert torch.equal(got.slots, ref.slots) and (ref.slots >= 0).sum() == 5
        step = 2.0 ** -22 if dt == torch.float32 else 2.0 ** -7
        # one step of the dtype, relative to the row's size (RoPE cancels, so small outputs carry big relative errors)
        torch.testing.assert_close(got.q.float(), ref.q.float(), atol=2 * step * ref.q.float().abs().amax().item(),
                                   rtol=step * 1.01)
        if not q_norm and exact:     # no reduction in the query path: bit-identical
            assert torch.equal(got.q, ref.q)
        a, b = caches[1].kv.float(), caches[0].kv.float()
        step = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7, torch.float8_e4m3fn: 2.0 ** -2}[cache_dtype]
        if cache_dtype == torch.float8_e4m3fn and not exact_bf16:
            # the interpreter's fp32 -> e4m3 loses the carry when rounding up to a power of two (31.9 -> 16,
            # not 32): accept exactly those, the GPU test compares them
            carry = (a != b) & (a * 2 == b) & (torch.frexp(b).mantissa.abs() == 0.5)
            a = torch.where(carry, b, a)
        subnormal = 2.0 ** -9 if cache_dtype == torch.float8_e4m3fn else 2 * step * b.abs().amax().item()
        torch.testing.assert_close(a, b, atol=subnormal * 1.01, rtol=step * 1.01)   # at most one step of the dtype
        if exact:
            assert (a != b).float().mean().item() < 0.05                     # ... and rarely even that
        if cache_dtype != torch.float8_e4m3fn and exact:                      # RoPE alone: bit-identical
            assert torch.equal(a[..., DIMS.kv_lora_rank:], b[..., DIMS.kv_lora_rank:])
        if cache_dtype == torch.float8_e4m3fn:
            torch.testing.assert_close(caches[1].scale, caches[0].scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_tables_lengths_dtypes_and_heads_raise_before_any_launch(backend, monkeypatch):
    """Block ids outside the cache, positions / lengths past the table, cache dtypes without scales, head
    counts that do not match: ValueError naming the values, and the cache is left untouched."""
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from parallel.cp.mla_prep import mla_prep, rope_table

    heads = 2
    w_uk, w_uv = _weights(heads, DIMS, 30)
    cache = MLACache.allocate(3, 4, DIMS, dtype=torch.float32)
    q = torch.randn(2, heads, DIMS.qk_head_dim)
    kv = torch.randn(2, DIMS.latent_dim)
    cos_sin, w_kv = rope_table(64, DIMS.qk_rope_head_dim), torch.ones(DIMS.kv_lora_rank)
    prep = lambda table, pos: mla_prep(q, kv, pos, cache, table, cos_sin, w_kv, nope=DIMS.qk_nope_head_dim,
                                       backend=backend)
    with pytest.raises(ValueError, match=r"block id 7 of positions\[1\] = 5 .*outside the cache's blocks \[0, 3\)"):
        prep(torch.tensor([[0, 7], [0, 7]]), torch.tensor([1, 5]))
    with pytest.raises(ValueError, match=r"positions\[0\] = 8 is outside the block table.* = 8\)"):
        prep(torch.tensor([[0, 1], [0, 1]]), torch.tensor([8, 1]))
    with pytest.raises(ValueError, match=r"block id -1 of positions\[0\] = 2"):
        mla_kv_insert(cache, kv[:1, :DIMS.kv_lora_rank], kv[:1, DIMS.kv_lora_rank:], torch.tensor([2]),
                      torch.tensor([-1, 0]))
    assert not cache.kv.any()                                               # nothing written
    # decode: lengths past the table's capacity, used block ids outside the cache, heads
    qn, qp = q[..., :DIMS.qk_nope_head_dim], q[..., DIMS.qk_nope_head_dim:]
    table = torch.tensor([[0, 1], [2, 0]])
    decode = lambda tbl, lens, **kw: mla_decode_attention(qn, qp, cache, w_uk, w_uv, tbl, torch.tensor(lens),
                                                          backend=backend, **kw)
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 9 exceeds the block table's capacity: 2 blocks x 4"):
        decode(table, [3, 9])
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 3 is outside the cache's blocks \[0, 3\)"):
        decode(torch.tensor([[0, 1], [2, 3]]), [3, 8])
    decode(torch.tensor([[0, 1], [2, 3]]), [3, 4])                         # an unused id past the cache is fine
    with pytest.raises(ValueError, match=r"W_UK \(2, 16, 32\) / W_UV .* the same H"):
        mla_decode_attention(qn[:, :1], qp[:, :1], cache, w_uk, w_uv, table, torch.tensor([3, 4]), backend=backend)
    with pytest.raises(ValueError, match=r"W_UK rank 32 / q_pe dim 8 do not match the cache"):
        mla_decode_attention(qn, qp[..., :8], cache, w_uk, w_uv, table, torch.tensor([3, 4]), backend=backend)
    # caches: a dtype the kernel has no path for, fp8 without (or with wrong) scales
    with pytest.raises(ValueError, match=r"latent cache dtype torch.float64 not supported; valid: float32, float16"):
        MLACache(torch.zeros(2, 4, 1, DIMS.latent_dim, dtype=torch.float64), DIMS.kv_lora_rank)
    fp8 = torch.zeros(2, 4, 1, DIMS.latent_dim, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"fp8 latent cache needs a scale .*scale None"):
        MLACache(fp8, DIMS.kv_lora_rank)
    with pytest.raises(ValueError, match=r"float32 scale \(2, 4, 1\), got \(2, 4\) torch.float32"):
        MLACache(fp8, DIMS.kv_lora_rank, torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"scale None|given: none"):
        from parallel.cp import PagedKVCache

        PagedKVCache(fp8, fp8)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_fused_prep_kernel_skips_bad_table_entries(cache_dtype, monkeypatch):
    """The Triton prep itself (no host validation: as on CUDA) with block ids < 0 and past the
    cache, and a position past the table: those tokens get slot -1 and nothing outside the valid
    slots of the cache changes (no write, no read past the table)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from parallel.cp.mla_prep import mla_prep, rope_table
    from parallel.cp.triton_mla_prep import mla_prep_triton

    gen = torch.Generator().manual_seed(40)
    t, heads, nope = 4, 2, DIMS.qk_nope_head_dim
    q = torch.randn(t, heads, nope + DIMS.qk_rope_head_dim, generator=gen)
    kv = torch.randn(t, DIMS.latent_dim, generator=gen)
    positions = torch.tensor([1, 5, 2, 40])             # token 3: virtual block 10 of a 2-wide table
    table = torch.tensor([[0, 1], [0, 9], [-1, 1], [2, 3]]).int()   # token 1: id 9 of 4, token 2: id -1
    cos_sin, w_kv = rope_table(64, DIMS.qk_rope_head_dim), torch.rand(DIMS.kv_lora_rank, generator=gen) + 0.5
    cache = MLACache.allocate(4, 4, DIMS, dtype=cache_dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(cache_dtype))       # sentinel contents
    if cache.scale is not None:
        cache.scale.copy_(torch.rand(cache.scale.shape, generator=gen) + 1)
    before_kv, before_scale = cache.kv.clone(), None if cache.scale is None else cache.scale.clone()
    layout = DCPLayout(size=1, rank=0, block_size=4)
    q_out, slots = mla_prep_triton(q, kv, positions, cache, table, cos_sin, w_kv, layout, None, nope, 1e-6)
    assert slots.tolist() == [1, -1, -1, -1]
    flat, old = cache.kv.view(-1, DIMS.latent_dim), before_kv.view(-1, DIMS.latent_dim)
    keep = torch.ones(flat.shape[0], dtype=torch.bool)
    keep[1] = False
    assert torch.equal(flat[keep].view(torch.uint8), old[keep].view(torch.uint8))       # untouched, bit for bit
    if cache.scale is not None:
        assert torch.equal(cache.scale.view(-1)[keep], before_scale.view(-1)[keep])
    # the valid token's row equals the torch sequence's (token 0 alone, a fresh cache)
    ref_cache = MLACache.allocate(4, 4, DIMS, dtype=cache_dtype)
    ref = mla_prep(q[:1], kv[:1], positions[:1], ref_cache, table[:1], cos_sin, w_kv, nope=nope, backend="torch")
    assert ref.slots.tolist() == [1]
    got_row, ref_row = flat[1].float(), ref_cache.kv.view(-1, DIMS.latent_dim)[1].float()
    torch.testing.assert_close(got_row, ref_row, atol=2.0 ** -9 * 1.01, rtol=2.0 ** -2 if cache.scale is not None else 1e-5)
    torch.testing.assert_close(q_out[:1], ref.q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prep_without_host_checks_skips_positions_past_the_rope_table(backend, monkeypatch):
    """As on CUDA (no host check): a position inside the block table but past the rope table (or
    negative) indexed the table out of bounds (torch: a device-side assert) or rotated by zero
    angles and wrote k_pe = 0 into the cache (Triton). Now the token is not written (slot -1) and
    its query's rope part is NaN (its decode row reports it); the other tokens are exact."""
    from parallel.cp.mla_prep import mla_prep, mla_prep_reference, rope_table

    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        from parallel.cp.triton_mla_prep import mla_prep_triton
    gen = torch.Generator().manual_seed(41)
    t, heads, nope, dr = 4, 2, DIMS.qk_nope_head_dim, DIMS.qk_rope_head_dim
    q = torch.randn(t, heads, nope + dr, generator=gen)
    kv = torch.randn(t, DIMS.latent_dim, generator=gen)
    positions = torch.tensor([3, 17, 9, 20])             # a 16-row rope table; an 8 x 4 = 32-token table
    table = torch.arange(8, dtype=torch.int32).expand(t, 8).contiguous()
    cos_sin, w_kv, w_q = rope_table(16, dr), torch.rand(DIMS.kv_lora_rank, generator=gen) + 0.5, \
        torch.rand(nope + dr, generator=gen) + 0.5
    for cache_dtype in (torch.float32, torch.float8_e4m3fn):
        cache = MLACache.allocate(8, 4, DIMS, dtype=cache_dtype)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(cache_dtype))       # sentinel contents
        before = cache.kv.clone()
        layout = DCPLayout(size=1, rank=0, block_size=4)
        if backend == "torch":
            got = mla_prep_reference(q, kv, positions, cache, table, cos_sin, w_kv, layout=layout, q_norm_weight=w_q,
                                     nope=nope, eps=1e-6)
            q_out, slots = got.q, got.slots
        else:
            q_out, slots = mla_prep_triton(q, kv, positions, cache, table, cos_sin, w_kv, layout, w_q, nope, 1e-6)
        assert slots.tolist() == [3, -1, 9, -1], (cache_dtype, slots)
        changed = (cache.kv.view(torch.uint8) != before.view(torch.uint8)).any(-1).flatten().nonzero().flatten()
        assert set(changed.tolist()) <= {3, 9}, changed                  # slots 17 and -2 are never written
        assert torch.isnan(q_out[[1, 3], :, nope:]).all() and not torch.isnan(q_out[[0, 2]]).any()
        ref_cache = MLACache.allocate(8, 4, DIMS, dtype=cache_dtype)
        ref = mla_prep(q[[0, 2]], kv[[0, 2]], positions[[0, 2]], ref_cache, table[:2], cos_sin, w_kv, q_norm_weight=w_q,
                       nope=nope, backend="torch")
        torch.testing.assert_close(q_out[[0, 2]], ref.q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q_out[[1, 3], :, :nope], _rms_ref(q[[1, 3]], w_q)[..., :nope], atol=1e-5, rtol=1e-5)
        if cache.scale is None:   # (the interpreter's fp32 -> e4m3 rounds some values wrongly: -124.5 -> -64)
            for slot in (3, 9):
                torch.testing.assert_close(cache.kv.view(-1, DIMS.latent_dim)[slot],
                                           ref_cache.kv.view(-1, DIMS.latent_dim)[slot], atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(cache.scale.view(-1)[[3, 9]], ref_cache.scale.view(-1)[[3, 9]], atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match=r"positions in \[3, 20\] outside the rope table's \[0, 16\)"):
        mla_prep(q, kv, positions, MLACache.allocate(8, 4, DIMS), table, cos_sin, w_kv, nope=nope, backend="torch")


def _rms_ref(x, w, eps=1e-6):
    x = x.double()
    return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()).float()


def _prep_by_hand(q, kv, positions, w_q, w_kv, nope, r, theta, eps):
    """DeepSeek-style prep in fp64: RMSNorm, then RoPE on pairs (2i, 2i+1) as complex products
    (DeepSeek's `apply_rotary_emb`), angles pos * theta^(-2i/d_r)."""
    dr = q.shape[-1] - nope
    freqs = torch.polar(torch.ones(dr // 2, dtype=torch.float64),
                        positions.double()[:, None] * theta ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr))

    def rope(x, f):
        return torch.view_as_real(torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous()) * f
                                  ).flatten(-2)

    def rms(x, w):
        x = x.double()
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()

    qd = q.double() if w_q is None else rms(q, w_q)
    q_out = torch.cat([qd[..., :nope], rope(qd[..., nope:], freqs[:, None])], -1)
    return q_out, rms(kv[:, :r], w_kv), rope(kv[:, r:], freqs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_prep_reads_strided_positions_table_and_weights(backend, monkeypatch):
    """Non-contiguous positions (a column of [T, 2] ids), a RoPE table and norm weights with a
    non-unit last stride: the prep reads their values, not the memory next to them (the Triton
    wrapper passed them to a kernel that assumes unit stride)."""
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from parallel.cp.mla_prep import mla_prep, rope_table

    gen = torch.Generator().manual_seed(50)
    t, heads, nope, r, dr = 7, 3, DIMS.qk_nope_head_dim, DIMS.kv_lora_rank, DIMS.qk_rope_head_dim
    n, blk, inter = 2, 4, 2
    q = torch.randn(t, heads, nope + dr, generator=gen)
    kv = torch.randn(t, r + dr, generator=gen)
    ids = torch.stack([torch.randint(0, 64, (t,), generator=gen), torch.tensor([0, 3, 5, 2, 12, 7, 14])], 1)
    positions = ids[:, 1]                                                   # stride 2
    table = torch.tensor([[1, 3]]).expand(t, -1).int()
    cos_sin = torch.stack([rope_table(64, dr), torch.full((64, dr), 7.0)], -1)[..., 0]    # last stride 2
    w_kv = torch.stack([torch.rand(r, generator=gen) + 0.5, torch.zeros(r)], -1)[:, 0]
    w_q = torch.stack([torch.rand(nope + dr, generator=gen) + 0.5, torch.zeros(nope + dr)], -1)[:, 0]
    assert positions.stride(0) != 1 and cos_sin.stride(-1) != 1 and w_kv.stride(0) != 1 and w_q.stride(0) != 1
    q_ref, c_ref, pe_ref = _prep_by_hand(q, kv, positions, w_q, w_kv, nope, r, 10000.0, 1e-6)
    for rank in range(n):
        cache = MLACache.allocate(4, blk, DIMS, dtype=torch.float32)
        out = mla_prep(q, kv, positions, cache, table, cos_sin, w_kv, layout=DCPLayout(n, rank, blk, inter),
                       q_norm_weight=w_q, nope=nope, backend=backend)
        torch.testing.assert_close(out.q.double(), q_ref, atol=1e-5, rtol=1e-5)
        # docs/numerics.md §8.2, by hand: owner (p % (B N)) // I % N, offset, block from the table
        p = positions.tolist()
        o = [x % (blk * n) for x in p]
        want = [int(table[i, x // (blk * n)]) * blk + (oi // (n * inter)) * inter + oi % inter
                if (oi // inter) % n == rank else -1 for i, (x, oi) in enumerate(zip(p, o))]
        assert out.slots.tolist() == want
        flat = cache.kv.view(-1, r + dr)
        written = torch.zeros(flat.shape[0], dtype=torch.bool)
        for i, s in enumerate(want):
            if s >= 0:
                written[s] = True
                torch.testing.assert_close(flat[s].double(), torch.cat([c_ref[i], pe_ref[i]]), atol=1e-5, rtol=1e-5)
        assert not flat[~written].any()                                     # nothing else written


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prep_rejects_a_layout_of_another_block_size(backend, monkeypatch):
    """A DCP layout whose block size is not the cache's: ValueError naming both, nothing written
    (before: the torch path wrote at slots of the layout's block size or raised IndexError, the
    kernel used the cache's block size after a host check made with the layout's)."""
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from parallel.cp.mla_prep import mla_prep, rope_table

    gen = torch.Generator().manual_seed(51)
    q = torch.randn(3, 2, DIMS.qk_head_dim, generator=gen)
    kv = torch.randn(3, DIMS.latent_dim, generator=gen)
    for layout_block in (2, 8):
        cache = MLACache.allocate(4, 4, DIMS, dtype=torch.float32)
        with pytest.raises(ValueError, match=rf"layout.block_size \({layout_block}\) must equal the cache's block "
                                             r"size \(4\)"):
            mla_prep(q, kv, torch.tensor([0, 5, 6]), cache, torch.tensor([[1, 2]] * 3),
                     rope_table(64, DIMS.qk_rope_head_dim), torch.ones(DIMS.kv_lora_rank),
                     layout=DCPLayout(1, 0, layout_block), nope=DIMS.qk_nope_head_dim, backend=backend)
        assert not cache.kv.any()


def test_decode_rejects_absorb_weights_of_other_dims():
    """W_UK whose d_n is not q_nope's, W_UV whose rank is not the cache's: ValueError naming them
    (before: a RuntimeError from einsum, W_UV's only after the whole DCP attention)."""
    heads = 2
    w_uk, w_uv = _weights(heads, DIMS, 52)
    cache = MLACache.allocate(2, 4, DIMS, dtype=torch.float32)
    qn, qp = torch.randn(1, heads, DIMS.qk_nope_head_dim), torch.randn(1, heads, DIMS.qk_rope_head_dim)
    table, lens = torch.tensor([[0, 1]]), torch.tensor([3])
    with pytest.raises(ValueError, match=r"W_UK \(2, 15, 32\) must be \[H, d_n = 16, r\]"):
        mla_decode_attention(qn, qp, cache, w_uk[:, :15], w_uv, table, lens, backend="torch")
    with pytest.raises(ValueError, match=r"W_UV \(2, 24, 31\) \[H, d_v, r = 32\]"):
        mla_decode_attention(qn, qp, cache, w_uk, w_uv[..., :31], table, lens, backend="torch")
    mla_decode_attention(qn, qp, cache, w_uk, w_uv, table, lens, backend="torch")       # the right ones pass


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_latent_cache_view_of_a_joint_buffer_inserts_and_decodes(cache_dtype):
    """An MLACache whose kv (and fp8 scale) is a strided view, one layer of a [nb, layers, B, 1, r + d_r]
    buffer: accepted and decoded, but the insert (and so the torch prep) raised a RuntimeError from
    `.view(-1, ...)`. The tokens land at table[p // B], offset p % B of that layer only; decode matches
    the equations."""
    from parallel.cp.mla_prep import mla_prep, rope_table

    heads, n, block, nb = 2, 7, 4, 3
    w_uk, w_uv = _weights(heads, DIMS, 60)
    qn, qp, c, kp = _tokens(1, n, heads, DIMS, 61)
    buf = torch.zeros(nb, 2, block, 1, DIMS.latent_dim, dtype=cache_dtype)
    scales = torch.ones(nb, 2, block, 1) if cache_dtype == torch.float8_e4m3fn else None
    cache = MLACache(buf[:, 1], DIMS.kv_lora_rank, None if scales is None else scales[:, 1])
    table = torch.tensor([2, 0], dtype=torch.int32)
    mla_kv_insert(cache, c[0, :n - 1], kp[0, :n - 1], torch.arange(n - 1), table)
    # the newest token through the prep's torch path (identity norm weight: c as given; rope at angle 0)
    cos_sin = torch.cat([torch.ones(n, DIMS.qk_rope_head_dim // 2), torch.zeros(n, DIMS.qk_rope_head_dim // 2)], -1)
    kv_new = torch.cat([c[0, n - 1:], kp[0, n - 1:]], -1)
    rms = kv_new[:, :DIMS.kv_lora_rank].square().mean(-1, keepdim=True).add(1e-6).rsqrt()
    mla_prep(torch.zeros(1, heads, DIMS.qk_head_dim), kv_new, torch.tensor([n - 1]), cache, table[None], cos_sin,
             1 / rms[0].expand(DIMS.kv_lora_rank), nope=DIMS.qk_nope_head_dim, backend="torch")
    assert not buf[:, 0].float().any()                                       # the other layer untouched
    p = torch.arange(n)
    held = buf[table.long()[p // block], 1, p % block, 0].float()
    if scales is not None:
        held = held * scales[table.long()[p // block], 1, p % block]
    orig = torch.cat([c[0], kp[0]], -1)
    tol = 2.0 ** -4 if scales is not None else 1e-5
    assert ((held - orig).abs() <= tol * orig.abs() + 1e-5).all()
    got = mla_decode_attention(qn[:, n - 1], qp[:, n - 1], cache, w_uk, w_uv, table[None], torch.tensor([n]),
                               backend="torch")
    ref = mla_reference(qn[:, n - 1:], qp[:, n - 1:], held[None, :, :DIMS.kv_lora_rank],
                        held[None, :, DIMS.kv_lora_rank:], w_uk, w_uv, causal=False)
    torch.testing.assert_close(got.double(), ref[:, 0], atol=1e-4, rtol=0)


def test_rope_table_rejects_an_odd_rope_dim():
    """rope_table(P, 15) returned a [P, 16] table (8 frequencies, cos and sin): ValueError naming it."""
    from parallel.cp.mla_prep import rope_table

    for dim in (15, 1, 0):
        with pytest.raises(ValueError, match=rf"rope_dim \({dim}\) must be even and >= 2"):
            rope_table(8, dim)
    table = rope_table(5, 4, theta=100.0)
    angles = torch.arange(5, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.1], dtype=torch.float64)
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], -1), rtol=0, atol=1e-6)


def test_absorb_and_output_helpers_refuse_weights_of_other_heads():
    """absorb_query / mla_output with a one-head W_UK / W_UV beside H = 3 heads: ValueError naming the
    shapes (einsum broadcast the one head's weights over every head, a silently wrong result), and
    heads or dims that disagree otherwise: ValueError, not a RuntimeError from einsum / cat. The right
    shapes give the per-head products."""
    heads = 3
    w_uk, w_uv = _weights(heads, DIMS, 60)
    qn, qp = torch.randn(2, heads, DIMS.qk_nope_head_dim), torch.randn(2, heads, DIMS.qk_rope_head_dim)
    o_lat = torch.randn(2, heads, DIMS.kv_lora_rank)
    with pytest.raises(ValueError, match=r"W_UK \(1, 16, 32\) \[H, d_n, r\] with H and d_n of q_nope"):
        absorb_query(qn, qp, w_uk[:1])
    with pytest.raises(ValueError, match=r"q_pe \(2, 2, 16\) must be \[\.\.\., H, d\] with the same leading dims"):
        absorb_query(qn, qp[:, :2], w_uk)
    with pytest.raises(ValueError, match=r"W_UK \(3, 15, 32\)"):
        absorb_query(qn, qp, w_uk[:, :15])
    with pytest.raises(ValueError, match=r"o_lat \(2, 3, 32\) must be \[\.\.\., H, r\] and W_UV \(1, 24, 32\)"):
        mla_output(o_lat, w_uv[:1])
    with pytest.raises(ValueError, match=r"W_UV \(3, 24, 31\)"):
        mla_output(o_lat, w_uv[..., :31])
    got = absorb_query(qn, qp, w_uk)
    for h in range(heads):
        torch.testing.assert_close(got[:, h, :DIMS.kv_lora_rank], qn[:, h] @ w_uk[h])
        torch.testing.assert_close(got[:, h, DIMS.kv_lora_rank:], qp[:, h])
        torch.testing.assert_close(mla_output(o_lat, w_uv)[:, h], o_lat[:, h] @ w_uv[h].T)
