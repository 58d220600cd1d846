"""The DCP KV-cache layout and decode combine against vLLM's, restated here from its code.

What vLLM does (read from vllm/v1/worker/block_table.py, vllm/v1/worker/gpu/block_table.py,
vllm/v1/worker/gpu/cp_utils.py, vllm/v1/attention/backends/utils.py, vllm/v1/attention/ops/common.py
and vllm/distributed/parallel_state.py; restated below in plain per-token Python, not copied):

- KV shards: N ranks, rank r, interleave I (cp_kv_cache_interleave_size), block size B. One row of
  the block table addresses B * N tokens per entry (the "virtual block"). A token at position p
  lies at offset o = p mod (B*N) of entry p div (B*N); it is kept by the rank (o div I) mod N, at
  slot entry_id * B + (o div (N*I)) * I + (o mod I); every other rank gets the pad slot -1.
- Tokens rank r keeps of a length-L sequence: L div (N*I) full rounds of I, plus what is left of
  L mod (N*I) after the r*I tokens of the ranks before it, at most I.
- Which ranks shard: the block table in the release that added PCP (PR #28718) sharded over
  N = pcp * dcp ranks, rank pcp_rank * dcp + dcp_rank ("total_cp_rank"); vLLM's current main
  shards over the DCP group only (N = dcp, r = dcp_rank) and keeps a full replica on every PCP
  rank (K/V all-gathered over PCP before the cache write). The project shards over pcp * dcp
  (the older meaning) and reaches the current one by passing no `pcp_group`; both are checked.
- Groups: all_ranks = arange(world).reshape(ext_dp, dp, pp, pcp, tp); DCP groups are
  all_ranks.reshape(-1, dcp), PCP groups all_ranks.transpose(pcp, tp).reshape(-1, pcp).
- Decode (GQA/MLA backends, "ag_rs" combine): all-gather q over the DCP group on the head dim
  (rank-major: rank 0's heads first), attend every gathered head over the local shard -> (o, lse),
  all-gather the lses, scale o by exp(lse_local - lse_all) where lse_all = logsumexp over ranks
  (NaN or +inf lses taken as -inf; a row empty everywhere keeps max 0, so lse_all = -inf and the
  scale exp(-inf - -inf) = NaN is taken as 0), then reduce-scatter over heads: rank r keeps the
  sum of every rank's rows for heads [r*H, (r+1)*H) -- its own query heads again.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from launch.local import launch_local
from parallel.config import ParallelConfig
from parallel.cp import DCPLayout, PagedKVCache, dcp_decode_attention, dcp_kv_insert
from parallel.cp.dcp import _layout, insert_slots
from parallel.groups import Group
from parallel.layout import coords, rank_groups
from tests.helpers import reference_attention

PAD = -1

# ------------------------------------------------------------------------------------------------
# vLLM's formulas, restated one token at a time


def vllm_slot(p: int, table: list[int], block: int, n: int, inter: int, rank: int) -> int:
    span = block * n
    entry, off = divmod(p, span)
    if (off // inter) % n != rank:
        return PAD
    return table[entry] * block + (off // (n * inter)) * inter + off % inter


def vllm_owner(p: int, block: int, n: int, inter: int) -> int:
    return ((p % (block * n)) // inter) % n


def vllm_local_len(length: int, n: int, inter: int, rank: int) -> int:
    rounds, left = divmod(length, n * inter)
    return rounds * inter + min(max(left - rank * inter, 0), inter)


def vllm_kv_shards(pcp_rank: int, pcp: int, dcp_rank: int, dcp: int, *, replicated_over_pcp: bool):
    """(N, r) of the cache: current main replicates over PCP; PR #28718's release sharded over it."""
    if replicated_over_pcp:
        return dcp, dcp_rank
    return pcp * dcp, pcp_rank * dcp + dcp_rank


def vllm_groups(world: int, dp: int, pp: int, pcp: int, tp: int, dcp: int) -> dict[str, list[list[int]]]:
    grid = torch.arange(world).reshape(-1, dp, pp, pcp, tp)
    return {"tp": grid.reshape(-1, tp).tolist(), "dcp": grid.reshape(-1, dcp).tolist(),
            "pcp": grid.transpose(3, 4).reshape(-1, pcp).tolist()}


# ------------------------------------------------------------------------------------------------
# layout: many (N, I, B, L) and (pcp, dcp) combinations


def _awkward_lengths(block: int, n: int, inter: int) -> list[int]:
    span, rnd = block * n, n * inter
    cand = {0, 1, 2, inter - 1, inter, inter + 1, rnd - 1, rnd, rnd + 1, span - 1, span, span + 1,
            2 * span + inter + 3, 3 * span - 1, 3 * span + 7}
    return sorted(x for x in cand if x >= 0)


def _combos():
    for n in (1, 2, 3, 4, 5, 8):
        for block in (1, 2, 4, 6, 16):
            for inter in [i for i in (1, 2, 3, 4, 8, 16) if block % i == 0]:   # incl. I = 1 and I = B
                yield n, inter, block


@pytest.mark.parametrize("n,inter,block", list(_combos()))
def test_slot_mapping_owner_and_local_lengths_match_vllm(n, inter, block):
    span = block * n
    lengths = _awkward_lengths(block, n, inter)
    longest = max(lengths)
    width = -(-longest // span) + 1
    gen = torch.Generator().manual_seed(n * 1000 + inter * 37 + block)
    table = torch.randperm(4 * width + 3, generator=gen)[:width]
    tl = table.tolist()
    positions = torch.arange(longest + 1)
    owners = [vllm_owner(p, block, n, inter) for p in range(longest + 1)]
    for rank in range(n):
        lay = DCPLayout(size=n, rank=rank, block_size=block, interleave=inter)
        assert lay.virtual_block == span
        assert lay.owner(positions).tolist() == owners
        want = [vllm_slot(p, tl, block, n, inter, rank) for p in range(longest + 1)]
        assert lay.slot_mapping(positions, table).tolist() == want
        assert lay.slot_mapping(positions, table.int().expand(longest + 1, -1)).tolist() == want
        # the insert path (what dcp_kv_insert writes) gives the same slots, pad where not local
        assert insert_slots(lay, positions, table, 4 * width + 3).tolist() == want
        lens = [vllm_local_len(length, n, inter, rank) for length in lengths]
        assert lay.local_lengths(torch.tensor(lengths)).tolist() == lens
        assert [lay.local_lengths(length) for length in lengths] == lens
        # vLLM's two formulas agree with each other and with dense paging of the local tokens: the
        # rank's j-th token (ascending p) sits at entry j // B, offset j % B of its pages
        mine = [p for p in range(longest + 1) if owners[p] == rank]
        for length, local in zip(lengths, lens):
            assert local == sum(1 for p in mine if p < length)
        for j, p in enumerate(mine):
            assert want[p] == tl[j // block] * block + j % block
        if mine:
            assert lay.global_positions(torch.arange(len(mine))).tolist() == mine


@pytest.mark.parametrize("pcp,dcp", [(1, 1), (1, 2), (1, 4), (2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (4, 2), (3, 2)])
def test_pcp_dcp_composition_matches_both_vllm_meanings(pcp, dcp):
    """`_layout(dcp group, pcp_group=pcp group)` is PR #28718's sharding over pcp * dcp ranks
    (total_cp_rank = pcp_rank * dcp + dcp_rank); `_layout(dcp group)` with no pcp_group is current
    vLLM's (sharded over DCP, replicated over PCP). Same slots as the restated formulas."""
    block, inter = 4, 2
    for pr, dr in itertools.product(range(pcp), range(dcp)):
        dgroup = Group("dcp", None, dr, dcp, tuple(range(dcp)))
        pgroup = Group("pcp", None, pr, pcp, tuple(range(pcp)))
        for replicated in (False, True):
            n, r = vllm_kv_shards(pr, pcp, dr, dcp, replicated_over_pcp=replicated)
            lay = _layout(dgroup, block, inter, None if replicated else pgroup)
            assert (lay.size, lay.rank) == (n, r), (pr, dr, replicated)
            length = 3 * block * n + 5
            table = list(range(10, 10 + length // (block * n) + 1))
            want = [vllm_slot(p, table, block, n, inter, r) for p in range(length)]
            assert lay.slot_mapping(torch.arange(length), torch.tensor(table)).tolist() == want
            assert lay.local_lengths(length) == vllm_local_len(length, n, inter, r)


@pytest.mark.parametrize("world,dp,pp,pcp,tp,dcp", [(8, 1, 1, 1, 8, 2), (8, 1, 1, 2, 4, 2), (8, 1, 1, 2, 4, 4),
                                                    (16, 2, 1, 2, 4, 2), (16, 1, 2, 2, 4, 1), (12, 1, 1, 3, 4, 2),
                                                    (8, 1, 1, 4, 2, 1), (16, 1, 1, 2, 8, 8)])
def test_groups_and_total_cp_rank_match_vllm(world, dp, pp, pcp, tp, dcp):
    cfg = ParallelConfig(world_size=world, dp=dp, pp=pp, pcp=pcp, tp=tp, dcp=dcp)
    ours, theirs = rank_groups(cfg, derived=True), vllm_groups(world, dp, pp, pcp, tp, dcp)
    for axis in ("tp", "dcp", "pcp"):
        assert ours[axis] == theirs[axis], axis
    for rank in range(world):
        dcp_g = next(g for g in theirs["dcp"] if rank in g)
        pcp_g = next(g for g in theirs["pcp"] if rank in g)
        c = coords(cfg, rank)
        assert (c["dcp"], c["pcp"]) == (dcp_g.index(rank), pcp_g.index(rank))
        total = pcp_g.index(rank) * dcp + dcp_g.index(rank)                     # PR #28718's total_cp_rank
        assert c["cp"] == total
        # the pcp * dcp ranks sharing one cache: this rank's DCP group and its PCP peers' DCP groups,
        # listed by total_cp_rank
        def total_of(x):
            return next(g for g in theirs["pcp"] if x in g).index(x) * dcp + next(g for g in theirs["dcp"] if x in g).index(x)

        sharing = {total_of(x): x for peer in pcp_g for x in next(g for g in theirs["dcp"] if peer in g)}
        assert next(g for g in ours["cp"] if rank in g) == [sharing[i] for i in range(pcp * dcp)]


# ------------------------------------------------------------------------------------------------
# decode combine on gloo ranks against vLLM's combine restated and a single-process reference


def _vllm_local(q_all: torch.Tensor, ks, vs, lens, n: int, inter: int, block: int, rank: int, hkv: int):
    """One rank's (o, lse) in float64 over the tokens vLLM's layout gives it (o 0, lse -inf if none)."""
    s_count, heads, _ = q_all.shape
    dv = vs[0].shape[-1]
    out = torch.zeros(s_count, heads, dv, dtype=torch.float64)
    lse = torch.full((s_count, heads), -math.inf, dtype=torch.float64)
    for s, length in enumerate(lens):
        mine = [p for p in range(length) if vllm_owner(p, block, n, inter) == rank]
        if not mine:
            continue
        for h in range(heads):
            g = h // (heads // hkv)                    # gathered head -> kv head (the kernel's GQA grouping)
            k, v = ks[s][mine, g].double(), vs[s][mine, g].double()
            sc = (k @ q_all[s, h].double()) * q_all.shape[-1] ** -0.5
            lse[s, h] = torch.logsumexp(sc, 0)
            out[s, h] = torch.softmax(sc, 0) @ v
    return out, lse


def _vllm_combine(o: torch.Tensor, lse: torch.Tensor, group, rank: int, n: int):
    """vLLM's ag_rs: all-gather lse, correct o, reduce-scatter over heads (as all-gather + sum)."""
    import torch.distributed as dist

    lses = [torch.empty_like(lse) for _ in range(n)]
    dist.all_gather(lses, lse.contiguous(), group=group)
    stack = torch.stack(lses)                                           # [N, S, H]
    stack = torch.where(torch.isnan(stack) | (stack == math.inf), -math.inf, stack)
    top = stack.max(0).values
    top = torch.where(top == -math.inf, 0.0, top)
    total = torch.log(torch.exp(stack - top).sum(0)) + top               # -inf where every shard is empty
    expo = lse - total
    expo = torch.where(torch.isnan(expo) | (expo == math.inf), -math.inf, expo)
    corrected = o * torch.exp(expo).unsqueeze(-1)
    parts = [torch.empty_like(corrected) for _ in range(n)]
    dist.all_gather(parts, corrected.contiguous(), group=group)
    h = o.shape[1] // n
    return sum(parts)[:, rank * h:(rank + 1) * h], total[:, rank * h:(rank + 1) * h]


def _decode_case(group, pcp_group, n_kv: int, kv_rank: int, group_rank: int, group_size: int, seed: int,
                 inter: int, hkv: int, lens: list[int], label: str) -> None:
    """Insert every sequence through dcp_kv_insert, decode with both combines, compare with vLLM's
    restated combine (same ranks) and the single-process reference, head by head."""
    import torch.distributed as dist

    block, d, dv, hq = 4, 8, 6, 2 * hkv                    # hq query heads per rank
    gen = torch.Generator().manual_seed(seed)
    q_full = torch.randn(len(lens), hq * group_size, d, generator=gen) * 2
    ks = [torch.randn(max(x, 1), hkv, d, generator=gen) for x in lens]
    vs = [torch.randn(max(x, 1), hkv, dv, generator=gen) for x in lens]
    width = max(1, max(-(-x // (block * n_kv)) for x in lens))
    table = torch.randperm(len(lens) * width + 2, generator=gen)[: len(lens) * width].view(len(lens), width)
    cache = PagedKVCache.allocate(len(lens) * width + 2, block, hkv, d, head_dim_v=dv, dtype=torch.float32)
    for s, x in enumerate(lens):
        if x:
            dcp_kv_insert(cache, ks[s][:x], vs[s][:x], torch.arange(x), table[s], group, interleave=inter,
                          pcp_group=pcp_group)
    mine = slice(group_rank * hq, (group_rank + 1) * hq)
    q = q_full[:, mine].contiguous()
    # vLLM: all-gather q over the DCP group on the head dim, rank-major
    pg = group.group if isinstance(group, Group) else group
    gathered = [torch.empty_like(q) for _ in range(group_size)]
    dist.all_gather(gathered, q, group=pg)
    q_all = torch.cat(gathered, dim=1)
    assert torch.equal(q_all, q_full), label                        # rank-major order = global head order
    o_loc, lse_loc = _vllm_local(q_all, ks, vs, lens, n_kv, inter, block, kv_rank, hkv)
    v_out, v_lse = _vllm_combine(o_loc, lse_loc, pg, group_rank, group_size)
    if pcp_group is not None:                                      # PR #28718: then merge over the PCP peers
        pp = pcp_group.group
        outs = [torch.empty_like(v_out) for _ in range(pcp_group.size)]
        lses = [torch.empty_like(v_lse) for _ in range(pcp_group.size)]
        dist.all_gather(outs, v_out.contiguous(), group=pp)
        dist.all_gather(lses, v_lse.contiguous(), group=pp)
        ls = torch.stack(lses)
        tot = torch.logsumexp(ls, 0)
        w = torch.where(torch.isinf(tot), 0.0, torch.exp(ls - tot.nan_to_num(neginf=0.0)))
        v_out = (w.unsqueeze(-1) * torch.stack(outs)).sum(0)
        v_lse = tot
    for comm in ("ag_rs", "a2a"):
        out, lse = dcp_decode_attention(q, cache, table, torch.tensor(lens), group, interleave=inter, comm=comm,
                                        return_lse=True, pcp_group=pcp_group)
        what = (label, comm, group_rank)
        assert torch.allclose(out.double(), v_out, atol=2e-6, rtol=0), (*what, (out.double() - v_out).abs().max())
        assert torch.equal(torch.isinf(lse), torch.isinf(v_lse)), what
        fin = ~torch.isinf(v_lse)
        assert torch.allclose(lse.double()[fin], v_lse[fin], atol=2e-6, rtol=0), what
        for s, x in enumerate(lens):
            if x == 0:
                assert torch.equal(out[s], torch.zeros_like(out[s])) and bool((lse[s] == -math.inf).all()), what
                continue
            ref_o, ref_l = reference_attention(q_full[s:s + 1], ks[s][:x], vs[s][:x], causal=False)
            err = max((out[s].double() - ref_o[0, mine]).abs().max().item(),
                      (lse[s].double() - ref_l[0, mine]).abs().max().item())
            assert err < 2e-6, (*what, s, err)


def _combine_rank(rank: int) -> str:
    from parallel import init_parallel

    groups = init_parallel(ParallelConfig(world_size=4, tp=2, pcp=2, dcp=2))
    import torch.distributed as dist

    world = Group("world", dist.group.WORLD, rank, 4, (0, 1, 2, 3))
    # lengths: empty sequence, shorter than one round (ranks without tokens), a round exactly,
    # ragged ones past several virtual blocks
    for i, (inter, hkv, lens) in enumerate([(1, 1, [0, 1, 3, 4, 23]), (2, 1, [5, 2, 8, 41]), (4, 2, [3, 16, 17, 0, 50]),
                                            (4, 1, [1, 4, 33])]):
        # 4 DCP ranks (one group over the world): vLLM's ag_rs with N = 4
        _decode_case(world, None, 4, rank, rank, 4, 100 + i, inter, hkv, lens, f"dcp4 I={inter} hkv={hkv}")
        # tp 2, pcp 2, dcp 2, current vLLM: sharded over DCP only, a full replica per PCP rank
        d = groups.dcp
        _decode_case(d, None, 2, d.rank, d.rank, 2, 200 + i, inter, hkv, lens, f"dcp2 replicated I={inter}")
        # the same ranks, PR #28718's sharding over pcp * dcp (total_cp_rank), merged over PCP
        _decode_case(d, groups.pcp, 4, groups.pcp.rank * 2 + d.rank, d.rank, 2, 300 + i, inter, hkv, lens,
                     f"pcp2 x dcp2 I={inter}")
    return "ok"


def test_decode_combine_head_order_and_empty_shards_match_vllm_on_gloo():
    """4 gloo ranks: DCP over 4 ranks, DCP 2 replicated over PCP 2 (current vLLM), DCP 2 x PCP 2
    sharded (PR #28718); both combines give every rank its own heads, equal to vLLM's ag_rs
    restated and to full attention, with empty shards (L < N*I) and an empty sequence."""
    assert launch_local(_combine_rank, 4, timeout=180) == ["ok"] * 4
