"""DCP layout helpers against a brute-force assignment, the paged cache, and single-rank decode
(the multi-rank decode runs in test_cp_dist.py)."""

from __future__ import annotations

import pytest
import torch

from parallel.cp import ContextParallelAttention, DCPLayout, PagedKVCache, dcp_decode_attention, dcp_kv_insert
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


def _check_single_rank_decode(cache_dtype: torch.dtype, atol: float, device: str) -> None:
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


CACHE_DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 8e-2)]


@pytest.mark.parametrize("cache_dtype,atol", CACHE_DTYPES)
def test_single_rank_paged_decode_matches_full_attention(cache_dtype, atol):
    _check_single_rank_decode(cache_dtype, atol, "cpu")


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


def test_module_without_groups_is_plain_attention_and_plain_paged_decode():
    attn = ContextParallelAttention(None)
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, 4, 8, generator=gen), torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    torch.testing.assert_close(attn(q, k, v).double(), reference_attention(q, k, v, causal=True)[0], rtol=0, atol=1e-6)
    assert torch.equal(attn.shard(q), q) and torch.equal(attn.positions(6), torch.arange(6))
    cache = PagedKVCache.allocate(4, 4, 2, 8, dtype=torch.float32)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    attn.insert_kv(cache, k, v, torch.arange(6), table[0])
    out = attn.decode(q[5:6], cache, table, torch.tensor([6]))
    torch.testing.assert_close(out.double(), reference_attention(q[5:6], k, v, causal=False)[0], rtol=0, atol=1e-6)


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
