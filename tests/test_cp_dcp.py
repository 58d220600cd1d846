"""DCP layout helpers against a brute-force assignment, the paged cache, single-rank decode, bad
tables (errors, never another sequence's data), and DCP x PCP decode on 4 gloo ranks in vLLM's
layout, with bad tables reported by the Triton kernel alone (NaN on every rank after the merges)
(the other multi-rank decode cases run in test_cp_dist.py)."""

from __future__ import annotations

import pytest
import torch

from launch.local import launch_local
from parallel.cp import (ContextParallelAttention, DCPLayout, PagedKVCache, dcp_decode_attention, dcp_kv_insert,
                         plan_dcp_decode)
from tests.helpers import reference_attention


def _brute_force(num_tokens: int, size: int, interleave: int, block_size: int, table: list[int]):
    """Deal tokens to ranks in runs of `interleave`; each rank fills its pages in order."""
    owner, slot, held = [], [], [0] * size
    for p in range(num_tokens):
        r = (p // interleave) % size
        idx = held[r]
        held[r] += 1
        owner.append(r)
        slot.append(table[idx // block_size] * block_size + idx % block_size)
    return owner, slot


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave,block_size", [(1, 1), (1, 4), (2, 4), (4, 4), (2, 8), (3, 6)])
def test_layout_agrees_with_brute_force_assignment(size, interleave, block_size):
    n = 3 * block_size * size + 5
    gen = torch.Generator().manual_seed(size * 100 + block_size)
    table = torch.randperm(64, generator=gen)[: n // (block_size * size) + 1]
    owner, slot = _brute_force(n, size, interleave, block_size, table.tolist())
    positions = torch.arange(n)
    for rank in range(size):
        layout = DCPLayout(size=size, rank=rank, block_size=block_size, interleave=interleave)
        assert layout.owner(positions).tolist() == owner
        expect = [s if o == rank else -1 for s, o in zip(slot, owner)]
        assert layout.slot_mapping(positions, table).tolist() == expect
        assert layout.slot_mapping(positions, table.expand(n, -1)).tolist() == expect   # per-token rows
        lens = torch.arange(n + 1)
        counts = [sum(1 for o in owner[:length] if o == rank) for length in range(n + 1)]
        assert layout.local_lengths(lens).tolist() == counts
        assert [layout.local_lengths(length) for length in range(n + 1)] == counts


def test_layout_rejects_block_size_not_multiple_of_interleave():
    with pytest.raises(ValueError, match=r"block_size \(6\) must be a multiple of interleave \(4\); valid interleave"):
        DCPLayout(size=2, rank=0, block_size=6, interleave=4)
    with pytest.raises(ValueError, match="rank"):
        DCPLayout(size=2, rank=2, block_size=4)


def test_layout_rejects_non_integer_fields():
    """A float interleave (2.0, as a config file may give it) made float positions: the decode gave
    zeros for every sequence, no error, and the insert an IndexError. ValueError naming it; integer
    types other than int (numpy) are taken as ints."""
    import numpy as np

    with pytest.raises(ValueError, match=r"interleave must be an int, got 2.0 \(float\)"):
        DCPLayout(size=2, rank=0, block_size=4, interleave=2.0)
    with pytest.raises(ValueError, match=r"rank must be an int, got True \(bool\)"):
        DCPLayout(size=2, rank=True, block_size=4)
    assert DCPLayout(size=np.int64(2), rank=1, block_size=4) == DCPLayout(size=2, rank=1, block_size=4)
    cache = PagedKVCache.allocate(4, 4, 1, 8, dtype=torch.float32)
    k, q, table = torch.randn(6, 1, 8), torch.randn(1, 2, 8), torch.tensor([[0, 1]], dtype=torch.int32)
    dcp_kv_insert(cache, k, k, torch.arange(6), table[0])
    for call in (lambda: dcp_kv_insert(cache, k, k, torch.arange(6), table[0], interleave=2.0),
                 lambda: dcp_decode_attention(q, cache, table, torch.tensor([6]), interleave=2.0)):
        with pytest.raises(ValueError, match=r"interleave must be an int, got 2.0"):
            call()
    out = dcp_decode_attention(q, cache, table, torch.tensor([6]), interleave=np.int64(2))
    torch.testing.assert_close(out.double(), reference_attention(q, k, k, causal=False)[0][0:1], rtol=0, atol=1e-6)


def _sequences(seed: int, lens: list[int], hq: int, hkv: int, d: int, dv: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens), hq, d, generator=gen)
    ks = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    vs = [torch.randn(n, hkv, dv, generator=gen) for n in lens]
    return q, ks, vs


def _block_tables(lens: list[int], tokens_per_block: int, num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(-(-n // tokens_per_block) for n in lens)
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    start = 0
    for s, n in enumerate(lens):
        m = -(-n // tokens_per_block)
        table[s, :m] = ids[start:start + m]
        start += m
    return table


def _cache_held(cache: PagedKVCache, table_row: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What one rank's cache holds for positions 0..n-1 of a sequence (block table[p // B], offset
    p % B), as fp32: fp8 bytes converted by torch times the per-(token, head) scale."""
    p = torch.arange(n)
    blk, off = table_row.long().cpu()[p // cache.block_size], p % cache.block_size
    k, v = cache.k.cpu()[blk, off].float(), cache.v.cpu()[blk, off].float()
    if cache.is_fp8:
        k, v = k * cache.k_scale.cpu()[blk, off][..., None], v * cache.v_scale.cpu()[blk, off][..., None]
    return k, v


def _check_single_rank_decode(cache_dtype: torch.dtype, atol: float, device: str,
                              held_atol: float | None = None) -> None:
    """atol: against the inserted fp32 values (covers the cache's rounding). held_atol: against
    what the cache holds (its rounding taken out), which must itself be the inserted values to
    one step of the cache dtype."""
    lens = [1, 9, 4, 16]
    q, ks, vs = _sequences(0, lens, 4, 2, 16, 8)
    cache = PagedKVCache.allocate(32, 4, 2, 16, head_dim_v=8, dtype=cache_dtype, device=device)
    table = _block_tables(lens, 4, 32, 1).to(device)
    for s, n in enumerate(lens):   # prefill all but the last token, then append it
        split = max(n - 1, 0)
        for lo, hi in ((0, split), (split, n)):
            rows = table[s].expand(hi - lo, -1)
            dcp_kv_insert(cache, ks[s][lo:hi].to(device), vs[s][lo:hi].to(device),
                          torch.arange(lo, hi, device=device), rows)
    out, lse = dcp_decode_attention(q.to(device), cache, table, torch.tensor(lens, device=device), None,
                                    return_lse=True)
    for s in range(len(lens)):
        ref_out, ref_lse = reference_attention(q[s:s + 1], ks[s], vs[s], causal=False)
        torch.testing.assert_close(out[s].double().cpu(), ref_out[0], rtol=0, atol=atol)
        torch.testing.assert_close(lse[s].double().cpu(), ref_lse[0], rtol=0, atol=atol)
        if held_atol is None:
            continue
        k, v = _cache_held(cache, table[s], lens[s])
        step = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float8_e4m3fn: 2.0 ** -4}[cache_dtype]
        for held, orig in ((k, ks[s]), (v, vs[s])):   # fp8: +- one subnormal step of the token's scale
            tiny = 2.0 ** -9 * orig.abs().amax(-1, keepdim=True) / 448 if cache_dtype == torch.float8_e4m3fn else 0
            assert ((held - orig).abs() <= step * orig.abs() + tiny + 1e-30).all(), (cache_dtype, s)
        ref_out, ref_lse = reference_attention(q[s:s + 1], k, v, causal=False)
        torch.testing.assert_close(out[s].double().cpu(), ref_out[0], rtol=0, atol=held_atol)
        torch.testing.assert_close(lse[s].double().cpu(), ref_lse[0], rtol=0, atol=held_atol)


CACHE_DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 8e-2)]


@pytest.mark.parametrize("cache_dtype,atol", CACHE_DTYPES)
def test_single_rank_paged_decode_matches_full_attention(cache_dtype, atol):
    """fp32 math on the dequantized cache: 1e-6 against attention over what the cache holds (a wrong
    scale on one token, within the 8e-2 allowed for fp8 rounding, does not pass)."""
    _check_single_rank_decode(cache_dtype, atol, "cpu", held_atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,atol", CACHE_DTYPES)
def test_single_rank_paged_decode_matches_full_attention_on_cuda(cache_dtype, atol):
    _check_single_rank_decode(cache_dtype, max(atol, 1e-5), "cuda")


def test_decode_and_insert_reject_bad_input():
    cache = PagedKVCache.allocate(4, 4, 2, 8, dtype=torch.float32)
    q = torch.randn(2, 3, 8)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"gathered query heads .* multiple of the cache's kv heads \(2\)"):
        dcp_decode_attention(q, cache, table, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="comm"):
        dcp_decode_attention(q[:, :2], cache, table, torch.tensor([1, 1]), comm="allreduce")
    with pytest.raises(ValueError, match="head_dim"):
        dcp_decode_attention(torch.randn(2, 2, 4), cache, table, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="do not match the cache"):
        dcp_kv_insert(cache, torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([0]), table[0])
    with pytest.raises(ValueError, match="fp8 cache needs"):
        PagedKVCache(torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn), torch.zeros(1, 4, 1, 8, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("scale", [None, 0.6])
def test_module_without_groups_is_plain_attention_and_plain_paged_decode(scale):
    """The module's softmax scale (0.6, not the default 8^-0.5) reaches prefill and decode."""
    attn = ContextParallelAttention(None, scale=scale)
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, 4, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    torch.testing.assert_close(attn(q, k, v).double(), reference_attention(q, k, v, causal=True, scale=scale)[0],
                               rtol=0, atol=1e-6)
    assert torch.equal(attn.shard(q), q) and torch.equal(attn.positions(6), torch.arange(6))
    cache = PagedKVCache.allocate(4, 4, 2, 8, dtype=torch.float32)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    attn.insert_kv(cache, k, v, torch.arange(6), table[0])
    out = attn.decode(q[5:6], cache, table, torch.tensor([6]))
    torch.testing.assert_close(out.double(), reference_attention(q[5:6], k, v, causal=False, scale=scale)[0], rtol=0,
                               atol=1e-6)
    # the step's length plan (one sequence, the torch path: its tables, and the same out)
    plan = attn.plan_decode(q[5:6], cache, table, torch.tensor([6]))
    assert plan.rows == 1 and plan.segments.tolist() == [0, 1]
    assert torch.equal(attn.decode(q[5:6], cache, table, torch.tensor([6]), plan=plan), out)


@pytest.mark.parametrize("ring_variant", ["ring", "allgather"])
def test_module_without_groups_attends_within_each_packed_sequence(ring_variant):
    attn = ContextParallelAttention(None, ring_variant=ring_variant)
    cu = [0, 5, 5, 12, 15]   # one rank: any lengths (odd ones, an empty one)
    gen = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(15, 6, 8, generator=gen), torch.randn(15, 2, 8, generator=gen), \
        torch.randn(15, 2, 4, generator=gen)
    dout = torch.randn(15, 6, 4, generator=gen)
    for causal, cu_arg in ((True, cu), (False, torch.tensor(cu))):
        local = [attn.shard(x, cu_seqlens=cu_arg).clone().requires_grad_() for x in (q, k, v)]
        out = attn(*local, causal=causal, cu_seqlens=cu_arg)
        out.backward(dout)
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        ref_out = torch.cat([reference_attention(*(x[a:b] for x in ref), causal=causal)[0]
                             for a, b in zip(cu[:-1], cu[1:])])
        (ref_out * dout.double()).sum().backward()
        torch.testing.assert_close(attn.unshard(out, cu_seqlens=cu_arg).double(), ref_out, rtol=0, atol=1e-6)
        for ours, theirs in zip(local, ref):
            torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=0, atol=2e-5)
    assert attn.positions(cu_seqlens=cu).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert torch.equal(attn.positions(15, cu_seqlens=torch.tensor(cu)), attn.positions(cu_seqlens=cu))
    with pytest.raises(ValueError, match="covers 15 tokens"):
        attn.shard(q[:14], cu_seqlens=cu)
    with pytest.raises(ValueError, match="covers 15 tokens"):
        attn.positions(16, cu_seqlens=cu)
    with pytest.raises(ValueError, match="must start at 0"):
        attn(q, k, v, cu_seqlens=[1, 15])


# ---------------------------------------------------------------------------------------------
# bad tables: errors on CPU, and masked positions never read another sequence's data


@pytest.mark.parametrize("cache_dtype,poison", [(torch.float32, "kv"), (torch.float8_e4m3fn, "scale")])
def test_masked_positions_never_read_another_sequences_data(cache_dtype, poison):
    # sequence 0 owns block 0 and holds NaN / inf there; sequence 1 is shorter than the table's width,
    # so its masked positions point at slot 0 (the old code read them with weight 0: 0 x NaN = NaN)
    lens = [8, 3]
    q, ks, vs = _sequences(5, lens, 2, 1, 8, 8)
    cache = PagedKVCache.allocate(4, 4, 1, 8, dtype=cache_dtype)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for s, n in enumerate(lens):
        dcp_kv_insert(cache, ks[s], vs[s], torch.arange(n), table[s])
    if poison == "kv":
        cache.v[0, 0] = float("nan")
        cache.k[0, 1] = float("inf")
    else:
        cache.v_scale[0, 0] = float("nan")
        cache.k_scale[0, 1] = float("inf")
    out, lse = dcp_decode_attention(q, cache, table, torch.tensor(lens), return_lse=True)
    ref_out, ref_lse = reference_attention(q[1:2], ks[1], vs[1], causal=False)
    atol = 1e-6 if cache_dtype == torch.float32 else 8e-2
    torch.testing.assert_close(out[1].double(), ref_out[0], rtol=0, atol=atol)
    torch.testing.assert_close(lse[1].double(), ref_lse[0], rtol=0, atol=atol)
    assert not torch.isfinite(out[0]).all()            # the poisoned sequence itself does see its NaN


def test_bad_block_tables_and_lengths_raise_naming_the_values():
    cache = PagedKVCache.allocate(4, 4, 1, 8, dtype=torch.float32)
    q = torch.randn(2, 2, 8)
    k = torch.randn(5, 1, 8)
    good = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)   # -1 past a sequence's used blocks is fine
    dcp_kv_insert(cache, k, k, torch.arange(5), good[0])
    dcp_kv_insert(cache, k[:3], k[:3], torch.arange(3), good[1])
    dcp_decode_attention(q, cache, good, torch.tensor([5, 3]))
    with pytest.raises(ValueError, match=r"block id -1 of positions\[0\] = 4 .*outside the cache's blocks \[0, 4\)"):
        dcp_kv_insert(cache, k[:1], k[:1], torch.tensor([4]), good[1])      # -1 in the used part: was skipped
    with pytest.raises(ValueError, match=r"block id 7 of positions\[1\] = 5 .*\[0, 4\)"):
        dcp_kv_insert(cache, k[:2], k[:2], torch.tensor([0, 5]), torch.tensor([[0, 1], [0, 7]]))
    with pytest.raises(ValueError, match=r"positions\[0\] = 8 is outside the block table.*= 8\)"):
        dcp_kv_insert(cache, k[:1], k[:1], torch.tensor([8]), good[0])
    with pytest.raises(ValueError, match=r"positions\[0\] = -1 is outside the block table"):
        dcp_kv_insert(cache, k[:1], k[:1], torch.tensor([-1]), good[0])
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = -1 is outside the cache's blocks \[0, 4\)"):
        dcp_decode_attention(q, cache, good, torch.tensor([5, 5]))         # was: read the last block
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 4 is outside"):
        dcp_decode_attention(q, cache, torch.tensor([[4, 1], [2, 3]]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"seq_lens must be >= 0; seq_lens\[1\] = -2"):
        dcp_decode_attention(q, cache, good, torch.tensor([5, -2]))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9 exceeds the block table's capacity: 2 blocks x 4 tokens"):
        dcp_decode_attention(q, cache, good, torch.tensor([9, 3]))


def test_insert_rejects_non_integer_positions_and_empty_tables():
    """Float positions or tables were truncated by `.long()` (1.5 wrote position 1); a table with no
    block raised an IndexError from the gather (on CUDA: an out-of-bounds device gather, where an
    invalid token must be skipped). ValueError naming them, nothing written; the MLA insert and prep
    likewise."""
    from parallel.cp.mla import MLACache, MLADims, mla_kv_insert
    from parallel.cp.mla_prep import mla_prep, rope_table

    cache = PagedKVCache.allocate(4, 4, 1, 8, dtype=torch.float32)
    k, table = torch.randn(2, 1, 8), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"positions must be an integer tensor, got torch.float32"):
        dcp_kv_insert(cache, k[:1], k[:1], torch.tensor([1.5]), table)
    with pytest.raises(ValueError, match=r"block_table must be an integer tensor, got torch.float32"):
        dcp_kv_insert(cache, k[:1], k[:1], torch.tensor([1]), table.float())
    with pytest.raises(ValueError, match=r"positions\[0\] = 0 is outside the block table: positions must lie in "
                                         r"\[0, 0 blocks x 4 tokens = 0\)"):
        dcp_kv_insert(cache, k, k, torch.arange(2), table[:0])
    with pytest.raises(ValueError, match=r"positions\[0\] = 3 is outside the block table.* = 0\)"):
        dcp_kv_insert(cache, k, k, torch.tensor([3, 1]), table[:0].expand(2, 0), None, interleave=2)   # [T, 0]
    assert not cache.k.any()
    assert dcp_kv_insert(cache, k[:0], k[:0], torch.arange(0), table[:0]).shape == (0,)   # no token: fine
    dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)
    latent = MLACache.allocate(2, 4, dims, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"positions must be an integer tensor, got torch.float64"):
        mla_kv_insert(latent, torch.zeros(1, 32), torch.zeros(1, 16), torch.tensor([1.0], dtype=torch.float64), table)
    with pytest.raises(ValueError, match=r"positions\[0\] = 1 is outside the block table"):
        mla_kv_insert(latent, torch.zeros(1, 32), torch.zeros(1, 16), torch.tensor([1]), table[:0])
    prep = lambda pos, tbl: mla_prep(torch.zeros(1, 2, 32), torch.ones(1, 48), pos, latent, tbl, rope_table(8, 16),
                                     torch.ones(32), nope=16, backend="torch")
    with pytest.raises(ValueError, match=r"positions must be an integer tensor, got torch.float32"):
        prep(torch.tensor([1.5]), table[None])
    with pytest.raises(ValueError, match=r"block_table must be an integer tensor, got torch.bool"):
        prep(torch.tensor([1]), table[None].bool())
    with pytest.raises(ValueError, match=r"positions\[0\] = 1 is outside the block table"):
        prep(torch.tensor([1]), table[None, :0])
    assert not latent.kv.any()


def test_decode_rejects_a_non_finite_scale_before_any_collective(monkeypatch):
    """A NaN or infinite softmax scale made every output row NaN, silently (attention_with_lse and
    ring_attention refuse it): ValueError naming it from the paged, DCP and MLA decode, before the
    all-gather of q."""
    from parallel.cp import dcp as dcp_mod
    from parallel.cp.mla import MLACache, MLADims, mla_decode_attention
    from parallel.cp.paged import paged_decode_attention

    cache = PagedKVCache.allocate(4, 4, 1, 8, dtype=torch.float32)
    k, q, table = torch.randn(5, 1, 8), torch.randn(1, 2, 8), torch.tensor([[0, 1]], dtype=torch.int32)
    dcp_kv_insert(cache, k, k, torch.arange(5), table[0])
    dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24)
    latent = MLACache.allocate(2, 4, dims, dtype=torch.float32)
    qn, qp, w_uk, w_uv = torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.randn(2, 16, 32), torch.randn(2, 24, 32)
    monkeypatch.setattr(dcp_mod, "all_gather_uneven", lambda *a, **kw: pytest.fail("a collective ran"))
    for scale in (float("nan"), float("inf"), "0.5x"):
        for call in (lambda: paged_decode_attention(q, cache, table, torch.tensor([5]), scale=scale),
                     lambda: dcp_decode_attention(q, cache, table, torch.tensor([5]), scale=scale),
                     lambda: mla_decode_attention(qn, qp, latent, w_uk, w_uv, table, torch.tensor([3]), scale=scale)):
            with pytest.raises(ValueError, match=f"scale must be a finite number or None, got {scale!r}"):
                call()
    got = paged_decode_attention(q, cache, table, torch.tensor([5]), scale=0.3)
    torch.testing.assert_close(got.out.double(), reference_attention(q, k, k, causal=False, scale=0.3)[0],
                               rtol=0, atol=1e-6)


def _rank_cache(layout: DCPLayout, kv: list[tuple[torch.Tensor, torch.Tensor]], table: torch.Tensor, nb: int,
                cache: PagedKVCache | None = None) -> PagedKVCache:
    """This rank's shard of the sequences kv[s] = (k [L, Hkv, D], v [L, Hkv, Dv]) under `layout`."""
    from parallel.cp.dcp import insert_slots, write_kv_slots

    k0, v0 = kv[0]
    if cache is None:
        cache = PagedKVCache.allocate(nb, layout.block_size, k0.shape[1], k0.shape[2], head_dim_v=v0.shape[2],
                                      dtype=torch.float32)
    for s, (k, v) in enumerate(kv):
        write_kv_slots(cache, k, v, insert_slots(layout, torch.arange(k.shape[0]), table[s], nb))
    return cache


def _held(layout: DCPLayout, n: int) -> torch.Tensor:
    """[n] bool: positions of a sequence of n tokens that `layout`'s rank holds (docs/numerics.md §8.2)."""
    p = torch.arange(n)
    return ((p % (layout.block_size * layout.size)) // layout.interleave) % layout.size == layout.rank


def test_paged_decode_checks_global_lengths_on_every_rank():
    """seq_lens are global: a length of -1 leaves rank 0 of 2 a share of 0 tokens and a length one past
    the table's capacity leaves rank 1 a share within its pages; both must raise on every rank (they
    ran as an empty / a full shard there), and valid lengths up to the full capacity must not."""
    from parallel.cp.paged import paged_decode_attention

    n, block, d = 2, 4, 8
    gen = torch.Generator().manual_seed(31)
    lens = [16, 5]                                            # 16: the full capacity (2 blocks x 4 x 2 ranks)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    kv = [(torch.randn(m, 1, d, generator=gen), torch.randn(m, 1, d, generator=gen)) for m in lens]
    q = torch.randn(2, 2, d, generator=gen)
    for rank in range(n):
        layout = DCPLayout(size=n, rank=rank, block_size=block)
        cache = _rank_cache(layout, kv, table, 4)
        got = paged_decode_attention(q, cache, table, torch.tensor(lens), layout=layout)
        for s, m in enumerate(lens):
            mine = _held(layout, m)
            ref_out, ref_lse = reference_attention(q[s:s + 1], kv[s][0][mine], kv[s][1][mine], causal=False)
            torch.testing.assert_close(got.out[s].double(), ref_out[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(got.lse[s].double(), ref_lse[0], rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match=r"seq_lens must be >= 0; seq_lens\[1\] = -1"):
            paged_decode_attention(q, cache, table, torch.tensor([16, -1]), layout=layout)
        with pytest.raises(ValueError, match=r"seq_lens\[0\] = 17"):
            paged_decode_attention(q, cache, table, torch.tensor([17, 5]), layout=layout)


def test_paged_decode_rejects_lengths_past_max_seq_len():
    """max_seq_len sizes the Triton kernel's split grid (tokens past it were silently dropped): a
    validated call whose lengths exceed it raises, one within it matches the reference."""
    from parallel.cp.paged import paged_decode_attention

    gen = torch.Generator().manual_seed(32)
    lens, d = [9, 3], 8
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    kv = [(torch.randn(m, 2, d, generator=gen), torch.randn(m, 2, d, generator=gen)) for m in lens]
    cache = _rank_cache(DCPLayout(size=1, rank=0, block_size=4), kv, table, 6)
    q = torch.randn(2, 4, d, generator=gen)
    got = paged_decode_attention(q, cache, table, torch.tensor(lens), max_seq_len=9)
    for s in range(2):
        ref_out, ref_lse = reference_attention(q[s:s + 1], *kv[s], causal=False)
        torch.testing.assert_close(got.out[s].double(), ref_out[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got.lse[s].double(), ref_lse[0], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 9 exceeds max_seq_len \(4\)"):
        paged_decode_attention(q, cache, table, torch.tensor(lens), max_seq_len=4)
    with pytest.raises(ValueError, match=r"max_seq_len \(-1\) must be >= 0"):
        paged_decode_attention(q, cache, table, torch.tensor(lens), max_seq_len=-1)


def test_cache_rejects_mixed_dtypes_and_misshapen_scales():
    """v of another dtype than k (an fp8 v beside a bf16 k has no scales to be read with), and scales
    that are not fp32 [num_blocks, block_size, kv_heads] (inserts wrote them at the wrong places, or
    failed after the k/v bytes were written): ValueError naming them, at construction."""
    k8 = torch.zeros(3, 4, 2, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"same dtype, got k torch.bfloat16 and v torch.float8_e4m3fn"):
        PagedKVCache(torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16), k8.clone())
    with pytest.raises(ValueError, match=r"k_scale must be float32 \(3, 4, 2\) .*got \(3, 2, 4\) torch.float32"):
        PagedKVCache(k8, k8.clone(), torch.ones(3, 2, 4), torch.ones(3, 2, 4))
    with pytest.raises(ValueError, match=r"v_scale must be float32 \(3, 4, 2\) .*got \(3, 4, 2\) torch.bfloat16"):
        PagedKVCache(k8, k8.clone(), torch.ones(3, 4, 2), torch.ones(3, 4, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"new k on cpu, v on meta"):
        dcp_kv_insert(PagedKVCache.allocate(3, 4, 2, 8, dtype=torch.float32), torch.randn(2, 2, 8),
                      torch.randn(2, 2, 8, device="meta"), torch.arange(2), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize("cache_dtype,atol", [(torch.float32, 1e-6), (torch.float8_e4m3fn, 8e-2)])
def test_cache_views_of_a_joint_kv_buffer_insert_and_decode(cache_dtype, atol):
    """k = kv[:, 0], v = kv[:, 1] of one [num_blocks, 2, B, Hkv, D] buffer (strided, no flat view):
    the torch path and the insert used `.view(-1, ...)` and raised; the tokens must land in the
    buffer and decode like any cache, over 2 DCP ranks with uneven lengths and an empty sequence."""
    n, block, hkv, d, nb = 2, 4, 2, 8, 6
    gen = torch.Generator().manual_seed(33)
    lens = [11, 0, 3]
    table = torch.tensor([[0, 1], [2, -1], [3, -1]], dtype=torch.int32)
    kv = [(torch.randn(m, hkv, d, generator=gen), torch.randn(m, hkv, d, generator=gen)) for m in lens]
    q = torch.randn(3, 4, d, generator=gen)
    outs, lses = [], []
    for rank in range(n):
        layout = DCPLayout(size=n, rank=rank, block_size=block)
        buf = torch.zeros(nb, 2, block, hkv, d, dtype=cache_dtype)
        scales = torch.ones(nb, 2, block, hkv) if cache_dtype == torch.float8_e4m3fn else None
        cache = PagedKVCache(buf[:, 0], buf[:, 1], *((scales[:, 0], scales[:, 1]) if scales is not None else ()))
        _rank_cache(layout, kv, table, nb, cache)
        flat = buf.float()
        for s, (k, v) in enumerate(kv):                        # in the buffer, where the layout puts them
            for p in _held(layout, k.shape[0]).nonzero()[:, 0].tolist():
                slot = int(layout.slot_mapping(torch.tensor([p]), table[s])[0])
                sk = 1.0 if scales is None else scales[slot // block, 0, slot % block][:, None]
                sv = 1.0 if scales is None else scales[slot // block, 1, slot % block][:, None]
                for got_row, scale, want in ((flat[slot // block, 0, slot % block], sk, k[p]),
                                             (flat[slot // block, 1, slot % block], sv, v[p])):
                    if scales is None:
                        torch.testing.assert_close(got_row * scale, want, rtol=0, atol=atol)
                    else:  # e4m3 rounding of x / scale: at most half a step of the top binade (16 of 448)
                        bound = want.abs().amax(-1, keepdim=True) * (16 / 448) * (1 + 1e-5)
                        assert ((got_row * scale - want).abs() <= bound).all(), (s, p)
        from parallel.cp.paged import paged_decode_attention

        got = paged_decode_attention(q, cache, table, torch.tensor(lens), layout=layout)
        outs.append(got.out)
        lses.append(got.lse)
    from parallel.cp import merge_attn_states

    merged = merge_attn_states(torch.stack(outs), torch.stack(lses))
    for s, (k, v) in enumerate(kv):
        ref_out, ref_lse = reference_attention(q[s:s + 1], k, v, causal=False)
        torch.testing.assert_close(merged.out[s].double(), ref_out[0], rtol=0, atol=atol)
        torch.testing.assert_close(merged.lse[s].double(), ref_lse[0], rtol=0, atol=atol)
    assert torch.equal(merged.out[1], torch.zeros(4, d)) and (merged.lse[1] == -float("inf")).all()


def test_triton_decode_refuses_a_cache_with_a_strided_head_dim(monkeypatch):
    """The kernel addresses k/v elements as base + dim (no head-dim stride): a cache whose head dim is
    not unit-stride gave silently wrong results by name ("triton"); it is refused there, and runs the
    torch path, which matches the reference."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")       # (CPU tensors may then ask for the kernel by name)
    from parallel.cp.paged import paged_decode_attention, resolve_backend

    gen = torch.Generator().manual_seed(34)
    nb, block, hkv, d = 4, 4, 2, 16
    k = torch.randn(nb, block, d, hkv, generator=gen).transpose(2, 3)     # [nb, B, Hkv, D], head-dim stride 2
    v = torch.randn(nb, block, hkv, d, generator=gen)
    cache = PagedKVCache(k, v)
    table, lens = torch.tensor([[1, 3], [0, 2]], dtype=torch.int32), [7, 2]
    q = torch.randn(2, 4, d, generator=gen)
    assert resolve_backend(q, PagedKVCache(k.contiguous(), v), "triton") == "triton"
    with pytest.raises(ValueError, match=r"'triton' cannot run here: the kernel reads k/v with a unit-stride head dim"):
        paged_decode_attention(q, cache, table, torch.tensor(lens), backend="triton")
    got = paged_decode_attention(q, cache, table, torch.tensor(lens))
    for s, m in enumerate(lens):
        blocks = table[s, : -(-m // block)].long()
        ref_out, ref_lse = reference_attention(q[s:s + 1], k[blocks].reshape(-1, hkv, d)[:m],
                                               v[blocks].reshape(-1, hkv, d)[:m], causal=False)
        torch.testing.assert_close(got.out[s].double(), ref_out[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got.lse[s].double(), ref_lse[0], rtol=0, atol=1e-6)


def test_decode_checks_shapes_and_dtypes_before_any_collective(monkeypatch):
    """docs/design.md: bad input raises before any collective runs. The local attention's dtype and
    cache checks ran only after the all-gather of q (a float table went through `.long()` first)."""
    from parallel.cp import dcp as dcp_mod

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran before the input was checked")

    monkeypatch.setattr(dcp_mod, "all_gather_uneven", no_collective)
    cache = PagedKVCache.allocate(4, 4, 2, 8, dtype=torch.float32)
    q, table, lens = torch.randn(2, 2, 8), torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([3, 4])
    with pytest.raises(ValueError, match=r"block_table \(2, 1\) torch.float32 must be int32/int64"):
        dcp_decode_attention(q, cache, table.float(), lens)
    with pytest.raises(ValueError, match=r"seq_lens \(2,\) torch.float32 must be int32/int64"):
        dcp_decode_attention(q, cache, table, lens.float())
    wide = PagedKVCache(cache.k.double(), cache.v.double())
    with pytest.raises(ValueError, match=r"cache dtype torch.float64 not supported"):
        dcp_decode_attention(q, wide, table, lens)


def _count_device_checks(monkeypatch, d: int, q: torch.Tensor, cache: PagedKVCache) -> list[int]:
    """Head dim 8: the torch path ("auto": the kernel needs >= 16), which runs `_invalid_sequences`;
    16: the Triton kernel, whose own report replaces it. Returns the list its calls append to."""
    from parallel.cp import dcp as dcp_mod
    from parallel.cp.paged import resolve_backend

    assert resolve_backend(q, cache) == ("torch" if d < 16 else "triton")
    calls: list[int] = []
    check = dcp_mod._invalid_sequences
    monkeypatch.setattr(dcp_mod, "_invalid_sequences", lambda *a: calls.append(1) or check(*a))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 16], ids=["torch-path", "kernel-path"])
def test_bad_tables_on_cuda_give_nan_rows_without_host_sync(d, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = PagedKVCache.allocate(4, 4, 1, d, dtype=torch.float32, device="cuda")
    q, ks, vs = _sequences(9, [5, 3, 2], 2, 1, d, d)
    table = torch.tensor([[0, 1], [2, -1], [3, -1]], dtype=torch.int32, device="cuda")
    for s, n in enumerate([5, 3, 2]):
        dcp_kv_insert(cache, ks[s].cuda(), vs[s].cuda(), torch.arange(n, device="cuda"), table[s])
    lens = torch.tensor([5, 7, -1], device="cuda")     # seq 1 uses the -1 block, seq 2 is negative
    calls = _count_device_checks(monkeypatch, d, q.cuda(), cache)
    out, lse = dcp_decode_attention(q.cuda(), cache, table, lens, return_lse=True)
    assert len(calls) == (1 if d < 16 else 0)
    assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()
    ref = reference_attention(q[0:1], ks[0], vs[0], causal=False)[0]
    torch.testing.assert_close(out[0].double().cpu(), ref[0], rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 16], ids=["torch-path", "kernel-path"])
def test_decode_with_its_checks_is_cuda_graph_capturable(d, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    lens0 = [5, 3]
    cache = PagedKVCache.allocate(4, 4, 1, d, dtype=torch.float32, device="cuda")
    q, ks, vs = _sequences(10, lens0, 2, 1, d, d)
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device="cuda")
    for s, n in enumerate(lens0):
        dcp_kv_insert(cache, ks[s].cuda(), vs[s].cuda(), torch.arange(n, device="cuda"), table[s])
    q, lens = q.cuda(), torch.tensor(lens0, device="cuda")
    calls = _count_device_checks(monkeypatch, d, q, cache)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dcp_decode_attention(q, cache, table, lens)                 # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dcp_decode_attention(q, cache, table, lens)
    for new in ([4, 2], [5, 7]):                                    # 7 uses the -1 block: a NaN row
        lens.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_attention(q[0:1].cpu(), ks[0][:new[0]], vs[0][:new[0]], causal=False)[0]
        torch.testing.assert_close(out[0].double().cpu(), ref[0], rtol=0, atol=1e-5)
        if new[1] <= 3:
            ref = reference_attention(q[1:2].cpu(), ks[1][:new[1]], vs[1][:new[1]], causal=False)[0]
            torch.testing.assert_close(out[1].double().cpu(), ref[0], rtol=0, atol=1e-5)
        else:
            assert torch.isnan(out[1]).all()
    assert len(calls) == (2 if d < 16 else 0)                       # (warm-up and capture)


# ---------------------------------------------------------------------------------------------
# DCP x PCP on 4 gloo ranks (tp 2, pcp 2, dcp 2): the cache is sharded 4-way as in vLLM; bad tables
# through the kernel's own report


def _cp_layout_rank(rank: int) -> str:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel
    from parallel.layout import coords

    cfg = ParallelConfig(world_size=4, tp=2, pcp=2, dcp=2)
    groups = init_parallel(cfg)
    assert groups.dcp.ranks == ((0, 1) if rank < 2 else (2, 3)) and groups.pcp.ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
    total = groups.pcp.rank * 2 + groups.dcp.rank                  # vLLM's total_cp_rank
    assert coords(cfg, rank)["cp"] == total
    d, dv, block = 8, 6, 4
    for i, (interleave, comm, hkv, lens) in enumerate([(1, "ag_rs", 1, [1, 6, 17]), (2, "a2a", 2, [3, 32, 9]),
                                                      (4, "ag_rs", 1, [16, 5])]):
        gen = torch.Generator().manual_seed(40 + i)
        hq = 4                                                       # 2 per DCP rank; PCP peers hold the same
        q = torch.randn(len(lens), hq, d, generator=gen)
        ks = [torch.randn(n, hkv, d, generator=gen) for n in lens]
        vs = [torch.randn(n, hkv, dv, generator=gen) for n in lens]
        width = max(-(-n // (block * 4)) for n in lens)
        table = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)
        cache = PagedKVCache.allocate(len(lens) * width, block, hkv, d, head_dim_v=dv, dtype=torch.float32)
        attn = ContextParallelAttention(groups, interleave=interleave, dcp_comm=comm)
        assert attn.kv_shards == 4
        for s, n in enumerate(lens):
            attn.insert_kv(cache, ks[s], vs[s], torch.arange(n), table[s])
        # this rank holds exactly vLLM's tokens: p with (p % (B*N)) // I % N == total_cp_rank
        flat = cache.k.view(-1, hkv, d)
        for s, n in enumerate(lens):
            for p in range(n):
                o = p % (block * 4)
                if (o // interleave) % 4 == total:
                    slot = int(table[s, p // (block * 4)]) * block + (o // (4 * interleave)) * interleave + o % interleave
                    assert torch.equal(flat[slot], ks[s][p]), (rank, s, p)
        held = sum(sum(1 for p in range(n) if ((p % (block * 4)) // interleave) % 4 == total) for n in lens)
        assert int((cache.k.abs().sum((-1, -2)) > 0).sum()) == held, (rank, held)
        mine = slice(groups.dcp.rank * 2, groups.dcp.rank * 2 + 2)
        out, lse = dcp_decode_attention(q[:, mine].contiguous(), cache, table, torch.tensor(lens), groups.dcp,
                                        interleave=interleave, comm=comm, return_lse=True, pcp_group=groups.pcp)
        via_module = attn.decode(q[:, mine].contiguous(), cache, table, torch.tensor(lens))
        assert torch.equal(via_module, out)
        for s in range(len(lens)):
            ref_out, ref_lse = reference_attention(q[s:s + 1], ks[s], vs[s], causal=False)
            err = max((out[s].double() - ref_out[0, mine]).abs().max().item(),
                      (lse[s].double() - ref_lse[0, mine]).abs().max().item())
            assert err < 2e-6, (rank, i, s, err)
    _check_kernel_reported_bad_tables(groups, rank)
    return "ok"


def _check_kernel_reported_bad_tables(groups, rank: int, device: torch.device | None = None) -> None:
    """Bad tables through the Triton kernel's own report, as the CUDA path runs it (no
    `_invalid_sequences`): the ranks that read a bad id or hold tokens past the table give NaN, the
    combine must carry it to every rank and leave the other sequences exact (CPU: the interpreter,
    tiny, with the CUDA decision patched in; CUDA: as it is)."""
    from parallel.cp import dcp as dcp_mod
    from parallel.cp.paged import paged_decode_attention

    assert groups.pcp.rank * 2 + groups.dcp.rank == rank          # total_cp_rank: the world rank (4-rank DCP too)
    n, block, interleave, hkv, d = 4, 4, 2, 1, 16                 # 16 tokens per virtual block, 4 per rank
    # 0 valid (ends inside virtual block 2), 1 a bad id in virtual block 2 whose one token (32) only
    # rank 0 holds, 2 one token past the capacity (48: rank 0's), 3 negative, 4 valid with a -1 past
    # its used blocks, 5 valid at full capacity, 6 a bad id in virtual block 0, read by ranks 0-2 only
    lens, good, width = [37, 33, 49, -1, 20, 48, 5], [0, 4, 5], 3
    detected_by = {1: {0}, 2: {0}, 3: {0, 1, 2, 3}, 6: {0, 1, 2}}
    gen = torch.Generator().manual_seed(21)
    nb = len(lens) * width + 2
    table = torch.randperm(nb, generator=gen)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    table[1, 2], table[4, 2], table[6, 0] = nb + 7, -1, nb
    q = torch.randn(len(lens), 4, d, generator=gen)              # 4 heads: 1 per rank, or 2 per DCP rank (PCP)
    kv = {s: (torch.randn(lens[s], hkv, d, generator=gen), torch.randn(lens[s], hkv, d, generator=gen)) for s in good}
    device = device or torch.device("cpu")
    cache = PagedKVCache.allocate(nb, block, hkv, d, dtype=torch.float32, device=device)
    for s in good:
        dcp_kv_insert(cache, *(x.to(device) for x in kv[s]), torch.arange(lens[s], device=device),
                      table[s].to(device), groups.dcp, interleave=interleave, pcp_group=groups.pcp)
    q, table, seq = q.to(device), table.to(device), torch.tensor(lens, device=device)
    # what this rank's kernel reports by itself: only what it reads (the merges must do the rest)
    local = paged_decode_attention(q, cache, table, seq, layout=DCPLayout(n, rank, block, interleave),
                                   backend="triton", validate=False)
    assert [s for s in range(len(lens)) if torch.isnan(local.lse[s]).any()] == \
        [s for s, ranks in detected_by.items() if rank in ranks], rank
    saved = dcp_mod._kernel_reports_bad_tables
    assert saved("triton", device) == (device.type == "cuda")
    dcp_mod._kernel_reports_bad_tables = lambda backend, device: backend == "triton"   # as on CUDA
    try:   # ag_rs over 4 DCP ranks; a2a over 2, then the PCP merge (world rank 0 = total_cp_rank 0)
        for group, pcp, heads, comm in ((None, None, slice(rank, rank + 1), "ag_rs"),
                                        (groups.dcp, groups.pcp, slice(groups.dcp.rank * 2, groups.dcp.rank * 2 + 2),
                                         "a2a")):
            out, lse = dcp_decode_attention(q[:, heads].contiguous(), cache, table, seq, group, comm=comm,
                                            interleave=interleave, return_lse=True, backend="triton", pcp_group=pcp)
            what = (rank, comm, "pcp" if pcp else "dcp 4")
            for s in detected_by:
                assert torch.isnan(out[s]).all() and torch.isnan(lse[s]).all(), (*what, s, out[s], lse[s])
            for s in good:
                ref_out, ref_lse = reference_attention(q[s:s + 1].cpu(), *kv[s], causal=False)
                err = max((out[s].double().cpu() - ref_out[0, heads]).abs().max().item(),
                          (lse[s].double().cpu() - ref_lse[0, heads]).abs().max().item())
                assert err < (1e-5 if device.type == "cpu" else 1e-4), (*what, s, err)
    finally:
        dcp_mod._kernel_reports_bad_tables = saved


def test_dcp_with_pcp_shards_the_cache_over_pcp_times_dcp_ranks_on_gloo(monkeypatch):
    """vLLM's layout over pcp x dcp ranks; then (`_check_kernel_reported_bad_tables`) a bad block id
    only rank 0 reads, a length past the table only rank 0 holds a token of, a negative length and
    a bad id 3 of 4 ranks read: out and lse NaN on all 4 ranks after ag_rs (4 DCP ranks), a2a
    (2) and the PCP merge."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")     # ("auto" keeps CPU tensors on torch; backend="triton" only)
    assert launch_local(_cp_layout_rank, 4, timeout=240, env={"TRITON_INTERPRET": "1"}) == ["ok"] * 4


def _kernel_bad_tables_nccl_rank(rank: int) -> str:
    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=4, tp=2, pcp=2, dcp=2))
    _check_kernel_reported_bad_tables(groups, rank, torch.device("cuda", torch.cuda.current_device()))
    return "ok"


@pytest.mark.gpu
@pytest.mark.multigpu
def test_kernel_reported_bad_tables_are_nan_on_every_nccl_rank():
    """The CPU test's bad tables on 4 GPUs (NCCL, the Triton kernel and merge, no device-side check)."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (tp 2, pcp 2, dcp 2)")
    assert launch_local(_kernel_bad_tables_nccl_rank, 4, backend="nccl", timeout=300,
                        env={"TRITON_INTERPRET": "0"}) == ["ok"] * 4


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_slot_writes_skip_tokens_without_a_boolean_mask(cache_dtype):
    """The KV writes of DCP's insert (GQA `write_kv_slots`, MLA `mla_write_slots`) with skipped
    tokens (-1: another rank's, or invalid) among written ones, every token skipped, and none: each
    written slot holds its token's values (fp8: its per-token quantization, against a per-token
    loop), every other slot its old bytes. The writes take no boolean mask (a data-dependent shape
    is a host sync on CUDA, which a decode step's graph cannot capture): skipped tokens rewrite a
    written token's slot with its values, or slot 0 with its own."""
    from parallel.cp.dcp import _quantize_fp8, write_kv_slots
    from parallel.cp.mla import MLACache, MLADims, mla_write_slots

    gen = torch.Generator().manual_seed(5)
    nb, block = 3, 4
    for slots in ([5, -1, 0, -1, 11], [-1, -1], [-1, 7], [], [2]):
        slots = torch.tensor(slots, dtype=torch.int64)
        t = slots.shape[0]
        # GQA
        k = torch.randn(t, 2, 8, generator=gen)
        v = torch.randn(t, 2, 6, generator=gen)
        cache = PagedKVCache.allocate(nb, block, 2, 8, dtype=cache_dtype, head_dim_v=6)
        cache.k.view(torch.uint8).copy_(torch.randint(0, 120, cache.k.view(torch.uint8).shape, generator=gen))
        cache.v.view(torch.uint8).copy_(torch.randint(0, 120, cache.v.view(torch.uint8).shape, generator=gen))
        before = [x.clone() for x in (cache.k, cache.v) + ((cache.k_scale, cache.v_scale) if cache.is_fp8 else ())]
        write_kv_slots(cache, k, v, slots)
        expect = [x.clone() for x in before]
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            b, o = divmod(s, block)
            if cache.is_fp8:
                for j, x in enumerate((k, v)):
                    q, sc = _quantize_fp8(x[i:i + 1])
                    expect[j][b, o] = q[0]
                    expect[2 + j][b, o] = sc[0]
            else:
                expect[0][b, o], expect[1][b, o] = k[i].to(cache_dtype), v[i].to(cache_dtype)
        got = (cache.k, cache.v) + ((cache.k_scale, cache.v_scale) if cache.is_fp8 else ())
        for g, e in zip(got, expect):
            assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                               e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e), slots
        # MLA
        dims = MLADims(kv_lora_rank=8, qk_rope_head_dim=4)
        mcache = MLACache.allocate(nb, block, dims, dtype=cache_dtype)
        mcache.kv.view(torch.uint8).copy_(torch.randint(0, 120, mcache.kv.view(torch.uint8).shape, generator=gen))
        old = mcache.kv.view(torch.uint8).clone()
        old_scale = None if mcache.scale is None else mcache.scale.clone()
        c_kv, k_pe = torch.randn(t, 8, generator=gen), torch.randn(t, 4, generator=gen)
        mla_write_slots(mcache, c_kv, k_pe, slots)
        flat = mcache.kv.view(torch.uint8).view(nb * block, -1)
        want = old.view(nb * block, -1).clone()
        want_scale = None if old_scale is None else old_scale.view(-1).clone()
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            row = torch.cat([c_kv[i], k_pe[i]])[None, None]
            if mcache.scale is not None:
                q, sc = _quantize_fp8(row)
                want[s], want_scale[s] = q.view(torch.uint8).flatten(), sc.flatten()[0]
            else:
                want[s] = row.to(cache_dtype).view(torch.uint8).flatten()
        assert torch.equal(flat, want), slots
        if want_scale is not None:
            assert torch.equal(mcache.scale.view(-1), want_scale), slots


@pytest.mark.gpu
def test_kv_inserts_are_captured_by_a_cuda_graph():
    """DCP's GQA insert and MLA's latent write, with tokens of another rank skipped, inside a CUDA
    graph: no host sync (the capture would fail), and the replay writes what the eager call did."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from parallel.cp.dcp import write_kv_slots
    from parallel.cp.mla import MLACache, MLADims, mla_write_slots

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = PagedKVCache.allocate(4, 16, 2, 128, dtype=dtype, device="cuda")
        mcache = MLACache.allocate(4, 16, MLADims(), dtype=dtype, device="cuda")
        slots = torch.tensor([3, -1, 17, -1], device="cuda")
        k, v = torch.randn(4, 2, 128, device="cuda"), torch.randn(4, 2, 128, device="cuda")
        c_kv, k_pe = torch.randn(4, 512, device="cuda"), torch.randn(4, 64, device="cuda")
        write_kv_slots(cache, k, v, slots)
        mla_write_slots(mcache, c_kv, k_pe, slots)
        eager = [x.clone() for x in (cache.k, cache.v, mcache.kv)]
        for x in (cache.k, cache.v, mcache.kv):
            x.view(torch.uint8).zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            write_kv_slots(cache, k, v, slots)
            mla_write_slots(mcache, c_kv, k_pe, slots)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip((cache.k, cache.v, mcache.kv), eager):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# one rank's bad input, or ranks called differently, raise on every rank (CPU: the agreement)


def _agreement_rank(rank: int) -> list[str]:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=4, tp=2, pcp=2, dcp=2))
    gen = torch.Generator().manual_seed(3)
    d, block, lens = 8, 2, [5, 9]
    q = torch.randn(2, 4, d, generator=gen)
    ks = [torch.randn(n, 1, d, generator=gen) for n in lens]
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)             # 8 tokens a virtual block over 4 ranks
    cache = PagedKVCache.allocate(4, block, 1, d, dtype=torch.float32)
    for s, n in enumerate(lens):
        dcp_kv_insert(cache, ks[s], ks[s], torch.arange(n), table[s], groups.dcp, pcp_group=groups.pcp)
    mine = slice(groups.dcp.rank * 2, groups.dcp.rank * 2 + 2)

    def call(**over) -> str:
        args = dict(q=q[:, mine].contiguous(), cache=cache, block_table=table, seq_lens=torch.tensor(lens),
                    scale=None, plan=None)
        args.update(over)
        try:
            dcp_decode_attention(args["q"], args["cache"], args["block_table"], args["seq_lens"], groups.dcp,
                                 scale=args["scale"], pcp_group=groups.pcp, plan=args["plan"])
        except ValueError as exc:
            return str(exc)
        return "ok"

    said = []
    # rank 3 alone: a block id outside its cache (its own error; the others learn it had one)
    said.append(call(block_table=torch.tensor([[9, 1], [2, 3]], dtype=torch.int32)) if rank == 3 else call())
    # rank 1 alone: a scale the others were not given
    said.append(call(scale=0.25) if rank == 1 else call())
    # rank 0 alone: other lengths (the table's contents and the lengths must be every rank's)
    said.append(call(seq_lens=torch.tensor([5, 8])) if rank == 0 else call())
    # rank 2 alone: one query head fewer (the all-gather of q would have failed or waited)
    said.append(call(q=q[:, :1].contiguous()) if rank == 2 else call())
    # rank 1 alone: a length plan made for another table width (its own error, before any collective)
    wide = torch.cat([table, table[:, :1]], 1)
    other = plan_dcp_decode(q[:, mine].contiguous(), cache, wide, torch.tensor(lens), groups.dcp, pcp_group=groups.pcp)
    said.append(call(plan=other) if rank == 1 else call())
    # and afterwards the group still works: the good call is exact
    out = dcp_decode_attention(q[:, mine].contiguous(), cache, table, torch.tensor(lens), groups.dcp,
                               pcp_group=groups.pcp)
    for s in range(2):
        ref = reference_attention(q[s:s + 1], ks[s], ks[s], causal=False)[0]
        torch.testing.assert_close(out[s].double(), ref[0, mine], rtol=0, atol=1e-6)
    return said


def test_one_ranks_bad_input_raises_on_every_rank_instead_of_hanging():
    """dcp_decode_attention on 4 gloo ranks (tp 2, pcp 2, dcp 2): a bad block id on one rank raised
    there and left the other three waiting in the all-gather of q (the job timed out). Now the
    checks are agreed over the DCP group, then the PCP group, before any collective; so are the
    shapes, scale, table and lengths, which ranks called differently silently mixed."""
    said = launch_local(_agreement_rank, 4, timeout=180)
    bad_id, scale, lengths, heads, plan = zip(*said)
    assert "this length plan was made for 2 rows and" in plan[1] and "'table_blocks': 3" in plan[1], plan[1]
    for r in (0, 2, 3):   # rank 1's DCP peer (rank 0) and, through PCP, the others
        assert "had invalid input" in plan[r], (r, plan[r])
    assert "block_table holds block ids [9] outside the cache's [0, 4)" in bad_id[3] or \
        "block_table[0, 0] = 9 is outside the cache's blocks [0, 4)" in bad_id[3], bad_id[3]
    for r in (0, 1, 2):   # rank 2 learns it from its DCP peer's report (rank 3's DCP group is {2, 3})
        assert "dcp_decode_attention" in bad_id[r] and "had invalid input" in bad_id[r], (r, bad_id[r])
    for r in range(4):
        assert ("scale: [" in scale[r] and "0.25" in scale[r]) or "had invalid input" in scale[r], (r, scale[r])
        assert "seq_lens checksum" in lengths[r] or "had invalid input" in lengths[r], (r, lengths[r])
        assert "local query heads: [" in heads[r] or "had invalid input" in heads[r], (r, heads[r])
    assert "disagree" in scale[0] and "disagree" in scale[1]            # the DCP group {0, 1} saw both values
