"""The PCP (ring attention) layouts of parallel/cp/ring.py against the references' layouts.

What each reference means, restated here in this file's own words as index maps (nothing below
is imported from the references except torch's own load balancers, which ship with torch):

- ring-flash-attention (zhuzilin), zigzag_ring_flash_attn[_varlen] and its tests' extract_local:
  a sequence of n tokens (n a multiple of 2P) is cut with `chunk` into 2P equal pieces; rank r
  keeps piece r followed by piece 2P-1-r. Packed batches: the same per sequence, sequences in
  order, every length (every cu_seqlens entry) a multiple of 2P; local offsets are cu_seqlens / P
  and the two halves of each local sequence start at cu_seqlens / P and cu_seqlens / P + n / 2P.
  Ring step s of rank r holds the KV of rank r - s (sends to r + 1): step 0 is causal over the
  local tokens, a step with s <= r attends all local queries to the first half of the block
  (no mask), any other step attends only the second half of the queries to the whole block.
- TransformerEngine: thd_get_partitioned_indices (the CUDA kernel): local token t of rank r lies
  in sequence i, the last one whose local start cu_i / P is <= t (empty sequences are skipped by
  the binary search), at offset j = t - cu_i / P; with h = n_i / 2P it reads global token
  cu_i + j + h * r when j < h, else cu_i + j + h * (2P - 2 - r), i.e. chunk 2P-1-r. The Python
  get_batch_on_this_cp_rank (THD) takes, per sequence, the ranges [r h, (r+1) h) and
  [(2P-1-r) h, (2P-r) h) of it, position ids included. Its KV-P2P ring uses the same step rule
  as ring-flash-attention (i == 0 causal; i <= rank: KV's first half; else the queries' second half).
- Megatron-LM get_batch_on_this_cp_rank, per sequence: the sequence dim (1 for [B, S, ...]) is
  viewed as [2P, S / 2P] and the two rows r and 2P-1-r are selected, in that order, for every
  tensor including position_ids (so RoPE sees the global positions of the local tokens). Per
  document (packed, cu_seqlens): TE's thd_get_partitioned_indices above.
- torch.distributed.tensor.experimental context_parallel, _HeadTailLoadBalancer: the sequence is
  permuted to [chunk 0, chunk 2P-1, chunk 1, chunk 2P-2, ...] and then cut into P contiguous
  shards, so rank r gets chunk r then chunk 2P-1-r. _PerDocumentHeadTailLoadBalancer: the code
  (torch 2.13) lists the pairs document by document ([doc 0: rank 0's pair, rank 1's pair, ...],
  [doc 1: ...]) before the same contiguous cut, while its docstring's example shows each rank
  holding its pair of EVERY document. The pairs are the project's; the concatenation differs:
  see `test_torch_per_document_balancer_pairs_match_but_its_concatenation_is_not_per_rank`.

The project (docs/numerics.md §8.1) agrees with all of them on the chunk assignment, the order of
the two chunks within a rank, the per-sequence varlen rule, the divisibility requirement and the
step masks; the tests below compare exhaustively (P 1..8, lengths up to a few hundred) and run
the ring on 2 and 4 gloo ranks against one float64 masked attention over the whole packed batch.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random

import pytest
import torch

from launch.local import launch_local
from parallel.cp import (ring_attention, zigzag_positions, zigzag_positions_varlen, zigzag_shard,
                         zigzag_shard_varlen, zigzag_unshard, zigzag_unshard_varlen)
from parallel.cp.ring import _local_bounds, _zigzag_step

SIZES = range(1, 9)

# ------------------------------------------------------------------ the references, restated


def rfa_local(n: int, rank: int, size: int) -> list[int]:
    """ring-flash-attention extract_local: torch.chunk into 2P pieces, keep pieces r and 2P-1-r."""
    pieces = torch.arange(n).chunk(2 * size)
    return pieces[rank].tolist() + pieces[2 * size - 1 - rank].tolist()


def rfa_local_varlen(cu: list[int], rank: int, size: int) -> list[int]:
    out = []
    for a, b in zip(cu, cu[1:]):
        if b > a:   # (the reference's chunk() of an empty sequence has one piece: nothing to keep)
            out += [a + i for i in rfa_local(b - a, rank, size)]
    return out


def megatron_local(n: int, rank: int, size: int) -> list[int]:
    """Megatron per-sequence: view [2P, n / 2P], index_select rows (r, 2P-1-r), flatten."""
    rows = torch.arange(n).view(2 * size, n // (2 * size))
    return rows.index_select(0, torch.tensor([rank, 2 * size - 1 - rank])).reshape(-1).tolist()


def te_thd_partitioned_indices(cu: list[int], rank: int, size: int) -> list[int]:
    """TE's thd kernel, token by token: locate the sequence in cu / P, then offset by chunk."""
    local_cu = [c // size for c in cu]
    out = []
    for t in range(cu[-1] // size):
        seq = max(i for i in range(len(cu) - 1) if local_cu[i] <= t and local_cu[i + 1] > t)
        half = (local_cu[seq + 1] - local_cu[seq]) // 2
        j = t - local_cu[seq]
        chunk_shift = rank if j < half else 2 * size - 2 - rank
        out.append(j + local_cu[seq] * size + half * chunk_shift)
    return out


def te_thd_batch_ranges(cu: list[int], rank: int, size: int) -> list[int]:
    """TE's Python get_batch_on_this_cp_rank (THD): two ranges per sequence."""
    out = []
    for a, b in zip(cu, cu[1:]):
        h = (b - a) // (2 * size)
        out += list(range(a + rank * h, a + (rank + 1) * h))
        out += list(range(a + (2 * size - 1 - rank) * h, a + (2 * size - rank) * h))
    return out


def torch_head_tail_local(n: int, rank: int, size: int) -> list[int]:
    """torch's _HeadTailLoadBalancer (the installed class), then the contiguous cut into P shards."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    perm = _HeadTailLoadBalancer(n, size, "cpu")._generate_indices()[0].long()
    return perm.chunk(size)[rank].tolist()


def rfa_step(rank: int, step: int, t_local: int) -> tuple[range, range, bool]:
    """ring-flash-attention's (and TE's) zigzag step: (query rows, key rows, causal)."""
    half = t_local // 2
    if step == 0:
        return range(t_local), range(t_local), True
    if step <= rank:
        return range(t_local), range(half), False
    return range(half, t_local), range(t_local), False


def random_cu(rng: random.Random, size: int, max_total: int, empty: bool) -> list[int]:
    cu = [0]
    while True:
        units = rng.choice([0, 1, 1, 2, 3, 5, 8]) if empty else rng.choice([1, 1, 2, 3, 5, 8])
        if cu[-1] + units * 2 * size > max_total and len(cu) > 1:
            return cu
        cu.append(cu[-1] + units * 2 * size)


def lengths_for(size: int) -> list[int]:
    return list(range(2 * size, 321, 2 * size))


# ------------------------------------------------------------------ one sequence


def test_single_sequence_layout_matches_every_reference_exhaustively():
    checked = 0
    for size in SIZES:
        for n in lengths_for(size):
            x = torch.arange(n)
            shards = []
            for rank in range(size):
                ours = zigzag_shard(x, rank, size).tolist()
                assert ours == rfa_local(n, rank, size) == megatron_local(n, rank, size) \
                    == te_thd_partitioned_indices([0, n], rank, size) == te_thd_batch_ranges([0, n], rank, size) \
                    == torch_head_tail_local(n, rank, size), (n, rank, size)
                assert zigzag_positions(n, rank, size).tolist() == ours   # RoPE positions: the global ones
                shards.append(torch.tensor(ours))
                checked += 1
            assert torch.equal(zigzag_unshard(shards), x)
    assert checked == sum(len(lengths_for(s)) * s for s in SIZES)


def test_torch_restore_indices_are_the_projects_unshard():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    for size in SIZES:
        for n in lengths_for(size)[:6]:
            lb = _HeadTailLoadBalancer(n, size, "cpu")
            rearranged = torch.arange(n)[lb._generate_indices()[0].long()]
            restored = rearranged[lb._generate_indices(restore=True)[0].long()]
            ours = zigzag_unshard(list(rearranged.chunk(size)))
            assert torch.equal(ours, restored) and torch.equal(ours, torch.arange(n))


def test_megatron_sequence_dim_one_of_batched_tensors():
    """Megatron shards [B, S, ...] along dim 1 (attention masks along their query dim 2)."""
    for size in (1, 2, 3, 4, 8):
        n = 4 * size
        x = torch.randn(3, n, 5)
        mask = torch.randn(3, 1, n, n)
        for rank in range(size):
            view = x.view(3, 2 * size, n // (2 * size), 5)
            theirs = view.index_select(1, torch.tensor([rank, 2 * size - 1 - rank])).reshape(3, -1, 5)
            assert torch.equal(zigzag_shard(x, rank, size, dim=1), theirs)
            mview = mask.view(3, 1, 2 * size, n // (2 * size), n)
            mtheirs = mview.index_select(2, torch.tensor([rank, 2 * size - 1 - rank])).reshape(3, 1, -1, n)
            assert torch.equal(zigzag_shard(mask, rank, size, dim=2), mtheirs)
            assert torch.equal(zigzag_shard(x, rank, size, dim=-2), theirs)


# ------------------------------------------------------------------ packed (varlen)


def test_varlen_layout_matches_every_reference_exhaustively():
    rng = random.Random(0)
    checked = 0
    for size in SIZES:
        cases = [[0, 2 * size], [0, 2 * size, 4 * size, 6 * size]]   # the minimum: one token per chunk
        cases += [random_cu(rng, size, 320, empty=False) for _ in range(12)]
        cases += [random_cu(rng, size, 320, empty=True) for _ in range(6)]
        for cu in cases:
            total = cu[-1]
            x = torch.arange(total)
            shards = []
            for rank in range(size):
                ours = zigzag_shard_varlen(x, cu, rank, size).tolist()
                te = te_thd_partitioned_indices(cu, rank, size) if total else []
                assert ours == rfa_local_varlen(cu, rank, size) == te == te_thd_batch_ranges(cu, rank, size), \
                    (cu, rank, size)
                # positions within each sequence (RoPE of packed batches): the global index minus its start
                starts = [cu[bisect.bisect_right(cu, g) - 1] for g in ours]
                pos = zigzag_positions_varlen(cu, rank, size).tolist()
                assert pos == [g - s for g, s in zip(ours, starts)], (cu, rank, size)
                assert zigzag_shard_varlen(x, torch.tensor(cu, dtype=torch.int32), rank, size).tolist() == ours
                shards.append(torch.tensor(ours, dtype=torch.int64))
                checked += 1
            assert torch.equal(zigzag_unshard_varlen(shards, cu), x)
            # local offsets: cu / P (ring-flash-attention's local_cu_seqlens; TE's cu_seqlens / cp_size)
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            assert [a for a, _ in _local_bounds(lengths, size)] + [total // size] == [c // size for c in cu]
    assert checked == 20 * sum(SIZES)


def test_torch_per_document_balancer_pairs_match_but_its_concatenation_is_not_per_rank():
    """torch 2.13's _PerDocumentHeadTailLoadBalancer: each (document, rank) pair it lists is the
    project's (chunks r, 2P-1-r of that document, in that order), but the code lists the pairs
    document-major, so the contiguous cut into P shards does not give rank r its pair of every
    document (what the class's docstring shows, and what TE / Megatron / ring-flash-attention /
    the project do). Shown wrong for its purpose: with documents [4, 12] on 2 ranks the causal work
    of the shards is 26 vs 62 score rows, not balanced; the project's layout gives 44 and 44."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _PerDocumentHeadTailLoadBalancer)

    rng = random.Random(1)
    for size in SIZES:
        for _ in range(6):
            cu = random_cu(rng, size, 200, empty=False)
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            perm = _PerDocumentHeadTailLoadBalancer([lengths], size, "cpu")._generate_indices()[0].tolist()
            pos = 0
            for a, n in zip(cu, lengths):
                for rank in range(size):   # the pairs, document-major
                    pair = perm[pos:pos + n // size]
                    pos += n // size
                    assert pair == zigzag_shard_varlen(torch.arange(a, a + n), [0, n], rank, size).tolist()
    # the docstring's example (documents 4, 8, 4 on 2 ranks) is the project's layout ...
    docstring_rank0 = [0, 3, 4, 5, 10, 11, 12, 15]
    assert zigzag_shard_varlen(torch.arange(16), [0, 4, 12, 16], 0, 2).tolist() == docstring_rank0
    # ... the code's cut is not, and its work is unbalanced on [4, 12]
    lb = _PerDocumentHeadTailLoadBalancer([[4, 12]], 2, "cpu")._generate_indices()[0]
    torch_shards = lb.chunk(2)
    work = lambda toks: sum(int(t) + 1 - (0 if t < 4 else 4) for t in toks)   # keys seen, per document
    assert [work(s) for s in torch_shards] == [26, 62]
    assert [work(zigzag_shard_varlen(torch.arange(16), [0, 4, 16], r, 2)) for r in range(2)] == [44, 44]


# ------------------------------------------------------------------ the ring's step masks


def test_step_masks_match_ring_flash_attention_and_cover_the_causal_mask_exactly_once():
    """For every P, rank and step: the project's block equals ring-flash-attention's / TE's, and
    over the P steps the blocks hold every (query, key) pair the global causal mask allows, once."""
    for size in SIZES:
        for chunk in (1, 2, 3):
            n, t_local = 2 * size * chunk, 2 * chunk
            pos = [zigzag_positions(n, r, size).tolist() for r in range(size)]
            for rank in range(size):
                seen = set()
                for step in range(size):
                    src = (rank - step) % size
                    rows, keys, square = _zigzag_step(rank, src, step, True, t_local)
                    ref_rows, ref_keys, ref_causal = rfa_step(rank, step, t_local)
                    assert (range(t_local)[rows], range(t_local)[keys], square) == (ref_rows, ref_keys, ref_causal)
                    for i, j in itertools.product(range(t_local)[rows], range(t_local)[keys]):
                        if square and j > i:
                            continue
                        pair = (pos[rank][i], pos[src][j])
                        assert pair not in seen
                        seen.add(pair)
                want = {(qp, kp) for qp in pos[rank] for kp in range(n) if kp <= qp}
                assert seen == want, (size, chunk, rank)
            # non-causal: every step is the whole block
            for rank, step in itertools.product(range(size), range(size)):
                rows, keys, square = _zigzag_step(rank, (rank - step) % size, step, False, t_local)
                assert (range(t_local)[rows], range(t_local)[keys], square) == (range(t_local), range(t_local), False)


# ------------------------------------------------------------------ bad input


def test_bad_input_is_a_value_error_naming_the_values():
    x = torch.arange(12)
    cases = [
        (lambda: zigzag_shard(x, 0, 4), r"sequence length \(12\).*2\*P = 8.*pad it by 4 to 16"),
        (lambda: zigzag_shard(x, 3, 3), r"rank \(3\) must be in \[0, 3\)"),
        (lambda: zigzag_shard(x, -1, 3), r"rank \(-1\)"),
        (lambda: zigzag_shard(x, 0, 0), r"group size must be >= 1, got 0"),
        (lambda: zigzag_shard(x, 1.0, 2), r"rank must be an integer, got 1.0"),
        (lambda: zigzag_shard(x, True, 2), r"rank must be an integer, got True"),
        (lambda: zigzag_positions(12.0, 0, 2), r"seq_len must be an integer, got 12.0"),
        (lambda: zigzag_positions(-4, 0, 2), r"seq_len must be >= 0, got -4"),
        (lambda: zigzag_positions(10, 0, 2), r"sequence length \(10\).*pad it by 2 to 12"),
        (lambda: zigzag_unshard([x[:6], x[:4]]), r"lengths \[6, 4\]"),
        (lambda: zigzag_unshard([x[:3], x[:3]]), r"lengths \[3, 3\]"),
        (lambda: zigzag_shard_varlen(x, [0, 4, 10, 12], 0, 2), r"sequence\(s\) \[1, 2\] have lengths \[6, 2\]"),
        (lambda: zigzag_shard_varlen(x, [0, 6, 12], 0, 2), r"sequence\(s\) \[0, 1\] have lengths \[6, 6\].*"
                                                           r"padded lengths \[8, 8\]"),
        (lambda: zigzag_shard_varlen(x, [0, 8, 4, 12], 0, 1), r"non-decreasing.*\[0, 8, 4, 12\]"),
        (lambda: zigzag_shard_varlen(x, [4, 12], 0, 1), r"start at 0.*\[4, 12\]"),
        (lambda: zigzag_shard_varlen(x, [0], 0, 1), r"at least one sequence.*\[0\]"),
        (lambda: zigzag_shard_varlen(x, [0, 8], 0, 2), r"covers 8 tokens but x has 12"),
        (lambda: zigzag_shard_varlen(x, [0, 6.0, 12], 0, 1), r"integer offsets.*6.0"),
        (lambda: zigzag_shard_varlen(x, [0, True, 12], 0, 1), r"integer offsets.*True"),
        (lambda: zigzag_shard_varlen(x, torch.tensor([0, 12.0]), 0, 1), r"1-D integer tensor, got torch.float32"),
        (lambda: zigzag_shard_varlen(x, torch.tensor([[0, 12]]), 0, 1), r"1-D integer tensor.*\(1, 2\)"),
        (lambda: zigzag_shard_varlen(x, [0, 12], 2, 2), r"rank \(2\) must be in \[0, 2\)"),
        (lambda: zigzag_positions_varlen([0, 4, 10], 0, 2), r"\[1\] have lengths \[6\]"),
        (lambda: zigzag_positions_varlen([0, 4], 0, 0), r"group size must be >= 1, got 0"),
        (lambda: zigzag_unshard_varlen([x[:6], x[:4]], [0, 12]), r"hold 6 tokens.*\[6, 4\]"),
        (lambda: ring_attention(torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4),
                                cu_seqlens=[0, 4, 2, 6]), r"non-decreasing.*\[0, 4, 2, 6\]"),
        (lambda: ring_attention(torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4),
                                cu_seqlens=[0, 4]), r"covers 4 tokens.*1 \* 6 = 6"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


def test_old_code_gave_float_positions_for_a_float_length():
    """Regression: zigzag_positions(8.0, ...) returned float32 positions (torch.arange(8.0));
    now a float length is refused and positions are always int64."""
    for size in (1, 2, 4):
        assert zigzag_positions(8, 0, size).dtype == torch.int64
        assert zigzag_positions(torch.tensor(8), 0, size).dtype == torch.int64
        assert zigzag_positions(0, 0, size).tolist() == []
        with pytest.raises(ValueError, match="8.0"):
            zigzag_positions(8.0, 0, size)


# ------------------------------------------------------------------ the ring on gloo ranks


def _masked_reference(q, k, v, seq_ids, pos, *, causal: bool, scale: float):
    """One float64 attention over the whole packed batch: key j visible from query i iff both lie
    in the same sequence (and, causal, pos[j] <= pos[i]); GQA by repeating each KV head."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    allowed = seq_ids[:, None] == seq_ids[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv)
    return out, lse.T


# (sequence lengths in units of 2P, hq, hkv, d, dv, causal, variant): 2P-token sequences
# (one token per chunk), empty ones, GQA / MQA, dv != d
DIST_CASES = [
    ((1,), 4, 2, 8, 8, True, "ring"),
    ((1, 1, 1), 6, 2, 8, 4, True, "ring"),
    ((1, 0, 3, 0, 2), 4, 1, 8, 8, True, "ring"),
    ((0, 5, 1), 6, 3, 4, 6, False, "ring"),
    ((2, 1, 0, 1), 4, 2, 8, 8, True, "allgather"),
]


def _ring_rank(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    from parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig(world_size=world, pcp=world))
    for i, (units, hq, hkv, d, dv, causal, variant) in enumerate(DIST_CASES):
        lengths = [u * 2 * world for u in units]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        seq_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
        pos = torch.cat([torch.arange(n) for n in lengths])
        gen = torch.Generator().manual_seed(100 + i)
        q, k, v, dout = (torch.randn(cu[-1], h, e, generator=gen, dtype=torch.float64)
                         for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv)))
        scale = 0.37
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = _masked_reference(*ref, seq_ids, pos, causal=causal, scale=scale)
        (ref_out * dout).sum().backward()
        shard = lambda t: zigzag_shard_varlen(t, cu, rank, world)
        local = [shard(t).float().requires_grad_() for t in (q, k, v)]
        out, lse = ring_attention(*local, groups.pcp, causal=causal, scale=scale, variant=variant,
                                  cu_seqlens=cu, return_lse=True)
        out.backward(shard(dout).float())
        msg = f"rank {rank}/{world} case {i}"
        checks = [(out, ref_out, 2e-6, "out"), (lse, ref_lse, 2e-6, "lse")]
        checks += [(x.grad, r.grad, 2e-5, f"d{n}") for n, x, r in zip("qkv", local, ref)]
        for got, want, atol, name in checks:
            err = (got.double() - shard(want)).abs().max().item()
            assert err <= atol, f"{msg} {name}: {err:.3g}"
        assert torch.equal(zigzag_positions_varlen(cu, rank, world), shard(pos)), msg
    # one unpacked batched sequence of the minimum length 2P: [B, 2, H, D] per rank
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, 2 * world, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    outs = [_masked_reference(*(t[b] for t in ref), torch.zeros(2 * world), torch.arange(2 * world),
                              causal=True, scale=8 ** -0.5)[0] for b in range(2)]
    ref_out = torch.stack(outs)
    (ref_out * dout).sum().backward()
    shard = lambda t: zigzag_shard(t, rank, world, dim=1)
    local = [shard(t).float().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, groups.pcp)
    out.backward(shard(dout).float())
    for got, want, atol in [(out, ref_out, 2e-6)] + [(x.grad, r.grad, 2e-5) for x, r in zip(local, ref)]:
        err = (got.double() - shard(want)).abs().max().item()
        assert err <= atol, f"rank {rank}/{world} batched 2P: {err:.3g}"
    return "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_one_masked_attention_on_gloo_ranks(world):
    assert launch_local(_ring_rank, world, args=(world,), timeout=120) == ["ok"] * world
