"""Ring attention for prefill/training context parallelism (PCP), docs/numerics.md.

A sequence of S tokens is cut into 2P chunks; rank r holds chunks r and 2P-1-r (zigzag), so
every rank does the same causal work. Local tensors are `[T, H, D]` or `[B, T, H, D]` with
T = S/P (the two chunks concatenated); see `zigzag_shard`. This is the layout of
ring-flash-attention's zigzag ring, Megatron-LM's / TransformerEngine's load-balanced CP
(get_batch_on_this_cp_rank, THD: thd_get_partitioned_indices per sequence) and torch's
_HeadTailLoadBalancer, with the same ring step masks (tests/test_ring_reference_layout.py).

Ring (`variant="ring"`): P steps; at step s a rank holds the KV of rank `src = r - s`, sends it on
to r+1 while computing against it (asynchronous P2P into the other of two buffers), and merges
the partial result by LSE into fp32 accumulators. With zigzag chunks the mask of a step needs no
mask at all: step 0 is plain causal over the local tokens; when src < r all local queries see
the first chunk of the block (unmasked); when src > r only the second local chunk sees the
block, all of it. Backward (`_RingAttention`) runs the same ring with the final out/lse: each
step's dQ stays home while dK/dV accumulators travel with their KV block and reach the owner
after P hops (FlashAttention's backward is exact given the global out and lse).

All-gather (`variant="allgather"`): gather the whole KV, attend the two local chunks with
position offsets; more memory, one collective, lower error, and autograd does the backward
(all-gather's backward is a reduce-scatter). Good for short sequences and as a cross-check.

Packed variable-length batches (`cu_seqlens`): every sequence is zigzag-sharded on its own
(`zigzag_shard_varlen`: 2P chunks per sequence, rank r keeps chunks r and 2P-1-r of EACH), so all
ranks hold the same local layout (local offsets = cu_seqlens / P) and a KV block from any rank
lines up with the local queries sequence by sequence. A ring step is then the step above done
per sequence (block-diagonal: no attention across sequences); the ring loop, merges and the
backward are the same code, over a list of per-sequence blocks instead of one. On CUDA the fused
kernels run once per sequence and step (no varlen kernel is used).

Agreement: at P > 1 every call first all-gathers a few ints per rank (shapes, dtype, causal,
variant, the softmax scale's float64 bits, a checksum of cu_seqlens, and whether this rank's
arguments are valid), so ranks that disagree on the head layout, the dtype, the scale or the
packing, or a rank with bad input (a backend it cannot run included), raise ValueError on every
rank before any KV moves instead of returning results (or hanging). The scale must agree exactly:
the ranks merge partial results that each computed with its own scale, so a difference would
silently mix softmaxes of different temperatures. It is one host sync of a few bytes per call;
the cu_seqlens are read on the host anyway.
"""

from __future__ import annotations

import operator
import zlib
from typing import Literal, Sequence

import torch
from torch import Tensor

from ..comm import (GroupLike, all_gather_uneven, dtype_code, float_code, input_agreement, reduce_scatter_uneven,
                    resolve_group)
from ..p2p import P2PExchanger, P2PWork, Peers
from .local_attn import (AttnBackend, attention_with_lse, block_attention_backward, block_attention_forward,
                         check_qkv, resolve_backend, resolve_scale)
from .merge import AttnState, merge_two_attn_states

RingVariant = Literal["ring", "allgather"]


# ---------------------------------------------------------------------------------------------
# zigzag layout


def _int(value, what: str) -> int:
    """`value` as an int: integers only (a float, even 8.0, or a bool is a ValueError naming it)."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _check_rank(rank: int, size: int) -> tuple[int, int]:
    size, rank = _int(size, "group size"), _int(rank, "rank")
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank ({rank}) must be in [0, {size})")
    return rank, size


def _check_zigzag(length: int, size: int, what: str) -> int:
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    if length % (2 * size) != 0:
        pad = -length % (2 * size)
        raise ValueError(f"{what} ({length}) must split into 2*P = {2 * size} equal chunks; "
                         f"pad it by {pad} to {length + pad}")
    return length // (2 * size)


def zigzag_shard(x: Tensor, rank: int, size: int, *, dim: int = 0) -> Tensor:
    """Rank `rank`'s zigzag shard of a full sequence: chunks `rank` and `2*size-1-rank` of 2*size.

    x: [..., S, ...] with the sequence along `dim`; S % (2*size) == 0 (else ValueError saying how
    much to pad). Returns [..., S/size, ...] (a copy).
    """
    rank, size = _check_rank(rank, size)
    chunk = _check_zigzag(x.shape[dim], size, "sequence length")
    first = x.narrow(dim, rank * chunk, chunk)
    second = x.narrow(dim, (2 * size - 1 - rank) * chunk, chunk)
    return torch.cat([first, second], dim=dim)


def zigzag_unshard(shards: Sequence[Tensor], *, dim: int = 0) -> Tensor:
    """Inverse of `zigzag_shard`: the full sequence from every rank's shard (in rank order)."""
    size = len(shards)
    if size == 0:
        raise ValueError("zigzag_unshard needs at least one shard")
    length = shards[0].shape[dim]
    if length % 2 != 0 or any(s.shape[dim] != length for s in shards):
        raise ValueError(f"every shard must hold two equal chunks along dim {dim}; got lengths "
                         f"{[s.shape[dim] for s in shards]}")
    halves = [s.chunk(2, dim=dim) for s in shards]
    ordered = [halves[r][0] for r in range(size)] + [halves[r][1] for r in reversed(range(size))]
    return torch.cat(ordered, dim=dim)


def zigzag_positions(seq_len: int, rank: int, size: int, *, device: torch.device | str | None = None) -> Tensor:
    """Global positions [seq_len / size] int64 of the tokens rank `rank` holds (for RoPE etc.).

    seq_len: a non-negative integer, a multiple of 2*size (a float such as 8.0 is refused: it made
    float positions)."""
    seq_len = _int(seq_len, "seq_len")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    return zigzag_shard(torch.arange(seq_len, dtype=torch.int64, device=device), rank, size)


def _seq_lengths(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    """Lengths of the packed sequences in `cu_seqlens` [N+1] (host ints or an integer tensor)."""
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                             f"{tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()   # host sync on CUDA: the blocks are planned on the host
    try:   # int() would truncate 7.5 to 7 silently; integers only (no bools), like the tensor path
        if any(isinstance(c, bool) for c in cu_seqlens):
            raise TypeError
        cu = [operator.index(c) for c in cu_seqlens]
    except TypeError:
        raise ValueError(f"cu_seqlens must be integer offsets, got {cu_seqlens!r}") from None
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and hold at least one sequence; "
                         f"got {cu}")
    return [b - a for a, b in zip(cu, cu[1:])]


def _check_chunks(lengths: Sequence[int], size: int) -> None:
    """Every packed sequence must split into 2*size equal chunks (else ValueError saying how to pad)."""
    bad = [i for i, n in enumerate(lengths) if n % (2 * size) != 0]
    if bad:
        padded = [n + (-n % (2 * size)) for n in lengths]
        raise ValueError(f"every packed sequence must split into 2*P = {2 * size} equal chunks; sequence(s) "
                         f"{bad} have lengths {[lengths[i] for i in bad]}; pad each sequence to a multiple of "
                         f"{2 * size} (padded lengths {padded})")


def _zigzag_lengths(cu_seqlens: Tensor | Sequence[int], size: int) -> list[int]:
    lengths = _seq_lengths(cu_seqlens)
    _check_chunks(lengths, size)
    return lengths


def _local_bounds(lengths: Sequence[int], size: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of each sequence in a rank's local zigzag shard (every rank has the same)."""
    bounds, start = [], 0
    for n in lengths:
        bounds.append((start, start + n // size))
        start += n // size
    return tuple(bounds)


def zigzag_shard_varlen(x: Tensor, cu_seqlens: Tensor | Sequence[int], rank: int, size: int, *,
                        dim: int = 0) -> Tensor:
    """Rank `rank`'s zigzag shard of a packed batch: chunks `rank` and `2*size-1-rank` of EACH sequence.

    x: [..., S_total, ...] packed tokens along `dim`; cu_seqlens: [N+1] int offsets of the N
    sequences (cu_seqlens[-1] == S_total), each length a multiple of 2*size (else ValueError saying
    how to pad). Returns [..., S_total/size, ...]: per sequence its two chunks, sequences in order;
    the local offsets are cu_seqlens / size.
    """
    rank, size = _check_rank(rank, size)
    lengths = _zigzag_lengths(cu_seqlens, size)
    if sum(lengths) != x.shape[dim]:
        raise ValueError(f"cu_seqlens covers {sum(lengths)} tokens but x has {x.shape[dim]} along dim {dim}")
    return torch.cat([zigzag_shard(seq, rank, size, dim=dim) for seq in x.split(lengths, dim=dim)], dim=dim)


def zigzag_unshard_varlen(shards: Sequence[Tensor], cu_seqlens: Tensor | Sequence[int], *, dim: int = 0) -> Tensor:
    """Inverse of `zigzag_shard_varlen`: the packed batch [..., S_total, ...] from every rank's shard
    (in rank order); cu_seqlens: [N+1] offsets of the FULL packed batch."""
    size = len(shards)
    if size == 0:
        raise ValueError("zigzag_unshard_varlen needs at least one shard")
    local = [n // size for n in _zigzag_lengths(cu_seqlens, size)]
    if any(s.shape[dim] != sum(local) for s in shards):
        raise ValueError(f"every shard must hold {sum(local)} tokens along dim {dim} (cu_seqlens / {size}); got "
                         f"{[s.shape[dim] for s in shards]}")
    pieces = [s.split(local, dim=dim) for s in shards]
    return torch.cat([zigzag_unshard([p[i] for p in pieces], dim=dim) for i in range(len(local))], dim=dim)


def zigzag_positions_varlen(cu_seqlens: Tensor | Sequence[int], rank: int, size: int, *,
                            device: torch.device | str | None = None) -> Tensor:
    """Positions within its own sequence [S_total / size] int64 of each token rank `rank` holds."""
    rank, size = _check_rank(rank, size)
    return torch.cat([zigzag_positions(n, rank, size, device=device) for n in _zigzag_lengths(cu_seqlens, size)])


def _zigzag_step(rank: int, src: int, step: int, causal: bool, t_local: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, square-causal?) of the block computed at ring `step` (KV of `src`)."""
    every = slice(0, t_local)
    half = t_local // 2
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    if src < rank:
        return every, slice(0, half), False
    return slice(half, t_local), every, False


Bounds = tuple[tuple[int, int], ...]   # local (start, end) of each packed sequence; ((0, T),) unpacked


def _step_blocks(rank: int, src: int, step: int, causal: bool, bounds: Bounds) -> list[tuple[slice, slice, bool]]:
    """The zigzag step of every packed sequence, shifted to its local rows (empty sequences skipped)."""
    blocks = []
    for start, end in bounds:
        if end > start:
            rows, keys, square = _zigzag_step(rank, src, step, causal, end - start)
            blocks.append((slice(start + rows.start, start + rows.stop), slice(start + keys.start, start + keys.stop),
                           square))
    return blocks


def _bounds(t_local: int, size: int, cu_seqlens: Tensor | Sequence[int] | None) -> Bounds:
    """Local sequence bounds of a rank's shard of T = t_local tokens (one sequence without cu_seqlens)."""
    if cu_seqlens is None:
        return ((0, t_local),)
    lengths = _seq_lengths(cu_seqlens)
    if sum(lengths) != t_local * size:
        raise ValueError(f"cu_seqlens must be the offsets of the full packed batch: it covers {sum(lengths)} "
                         f"tokens, but P * T_local = {size} * {t_local} = {t_local * size}")
    if size > 1:   # one rank: any lengths
        _check_chunks(lengths, size)
    return _local_bounds(lengths, size)


# ---------------------------------------------------------------------------------------------
# ring communication


def _pack(*tensors: Tensor) -> Tensor:
    """One flat buffer holding `tensors` (one message per ring hop instead of one per tensor)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    views, start = [], 0
    for t in like:
        views.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    return views


# ---------------------------------------------------------------------------------------------
# ring forward / backward on [B, T, H, D]


def _forward_step(state: AttnState | None, q: Tensor, kb: Tensor, vb: Tensor, rank: int, src: int, step: int, *,
                  causal: bool, scale: float, backend: str, bounds: Bounds) -> AttnState:
    """Attend local q to the KV block of `src` held at `step` (one block per packed sequence);
    merge into `state` (fp32, in place)."""
    first = []
    for rows, keys, blk_causal in _step_blocks(rank, src, step, causal, bounds):
        o, l = block_attention_forward(q.transpose(1, 2)[:, :, rows], kb.transpose(1, 2)[:, :, keys],
                                       vb.transpose(1, 2)[:, :, keys], causal=blk_causal, scale=scale,
                                       backend=backend)
        o, l = o.transpose(1, 2), l.transpose(1, 2)
        if state is None:   # step 0: the blocks tile every row, in order
            first.append((o, l))
        else:
            merge_two_attn_states(state.out[:, rows], state.lse[:, rows], o, l, out=state.out[:, rows],
                                  out_lse=state.lse[:, rows])
    if state is None:
        if len(first) == 1:
            o, l = first[0]
            return AttnState(o.to(torch.float32, memory_format=torch.contiguous_format), l.contiguous())
        return AttnState(torch.cat([o for o, _ in first], dim=1).float(), torch.cat([l for _, l in first], dim=1))
    return state


def _backward_step(grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor,
                   out: Tensor, lse_bht: Tensor, rank: int, src: int, step: int, *, causal: bool, scale: float,
                   backend: str, bounds: Bounds) -> None:
    """Add this step's block gradients into grads = (dq [B, T, Hq, D], dk, dv of the block), fp32."""
    dq, dk, dv = grads
    for rows, keys, blk_causal in _step_blocks(rank, src, step, causal, bounds):
        dq_b, dk_b, dv_b = block_attention_backward(
            dout.transpose(1, 2)[:, :, rows], q.transpose(1, 2)[:, :, rows], kb.transpose(1, 2)[:, :, keys],
            vb.transpose(1, 2)[:, :, keys], out.transpose(1, 2)[:, :, rows], lse_bht[:, :, rows],
            causal=blk_causal, scale=scale, backend=backend)
        dq[:, rows] += dq_b.transpose(1, 2)
        dk[:, keys] += dk_b.transpose(1, 2)
        dv[:, keys] += dv_b.transpose(1, 2)


def _ring(group: GroupLike, device: torch.device) -> P2PExchanger:
    """The KV ring: posted from the current stream, so a send is ordered after the compute that
    wrote it (`parallel.p2p`, on_comm_stream=False)."""
    return P2PExchanger(Peers.of(group), device)


def _wait(work: P2PWork | None) -> None:
    if work is not None:
        work.wait()


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: P2PExchanger | None, rank: int, size: int, *, causal: bool,
                 scale: float, backend: str, bounds: Bounds | None = None) -> AttnState:
    """Ring attention forward. q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv] (zigzag shards).
    bounds: local (start, end) of each packed sequence (None: one sequence, all T rows).
    Returns AttnState(out [B, T, Hq, Dv] fp32, lse [B, T, Hq] fp32). `ring` None means size 1."""
    bounds = ((0, q.shape[1]),) if bounds is None else bounds
    bufs = [_pack(k, v)]
    if size > 1:
        bufs.append(torch.empty_like(bufs[0]))
    state = None
    for step in range(size):
        cur = bufs[step % 2]
        works = ring.shift([cur], [bufs[(step + 1) % 2]]) if step + 1 < size else None
        kb, vb = _unpack(cur, (k, v))
        state = _forward_step(state, q, kb, vb, rank, (rank - step) % size, step, causal=causal, scale=scale,
                              backend=backend, bounds=bounds)
        _wait(works)
    return state


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  ring: P2PExchanger | None,
                  rank: int, size: int, *, causal: bool, scale: float, backend: str,
                  bounds: Bounds | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Ring attention backward from the final out [B, T, Hq, Dv] and lse [B, T, Hq] (bounds as in
    `ring_forward`).

    dQ accumulates locally; the fp32 dK/dV of a KV block travel with it and arrive at the owner
    after the last step. Returns dq, dk, dv in the inputs' dtypes."""
    bounds = ((0, q.shape[1]),) if bounds is None else bounds
    lse_bht = lse.transpose(1, 2).contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv_bufs = [_pack(k, v)]
    dkv_bufs = [torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=k.device)]
    if size > 1:
        kv_bufs.append(torch.empty_like(kv_bufs[0]))
        dkv_bufs.append(torch.empty_like(dkv_bufs[0]))
    dkv_works = None
    for step in range(size):
        cur = kv_bufs[step % 2]
        kv_works = ring.shift([cur], [kv_bufs[(step + 1) % 2]]) if step + 1 < size else None
        kb, vb = _unpack(cur, (k, v))
        _wait(dkv_works)                       # the accumulator of this block (zeros at step 0)
        acc = dkv_bufs[step % 2]
        _backward_step((dq, *_unpack(acc, (k, v))), dout, q, kb, vb, out, lse_bht, rank, (rank - step) % size, step,
                       causal=causal, scale=scale, backend=backend, bounds=bounds)
        dkv_works = ring.shift([acc], [dkv_bufs[(step + 1) % 2]]) if size > 1 else None
        _wait(kv_works)
    _wait(dkv_works)                           # our own block's gradient, back after P hops
    dk, dv = _unpack(dkv_bufs[size % len(dkv_bufs)], (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def simulate_ring_forward(q_shards: Sequence[Tensor], k_shards: Sequence[Tensor], v_shards: Sequence[Tensor], *,
                          causal: bool = True, scale: float | None = None, backend: str = "auto",
                          cu_seqlens: Tensor | Sequence[int] | None = None) -> list[AttnState]:
    """Every rank's ring compute (the same steps and merges) on one device, no communication.

    *_shards: per rank [B, T, H, D] zigzag shards (`zigzag_shard_varlen` shards of a packed batch
    with its global cu_seqlens). Returns each rank's AttnState (fp32). Used by the one-GPU
    benchmark of the ring compute path and by tests.
    """
    size = len(q_shards)
    bounds = _bounds(q_shards[0].shape[1], size, cu_seqlens)
    scale = resolve_scale(scale, q_shards[0].shape[-1])
    backend = resolve_backend(backend, q_shards[0], k_shards[0], v_shards[0])
    states = []
    for rank in range(size):
        state = None
        for step in range(size):
            src = (rank - step) % size
            state = _forward_step(state, q_shards[rank], k_shards[src], v_shards[src], rank, src, step,
                                  causal=causal, scale=scale, backend=backend, bounds=bounds)
        states.append(state)
    return states


def simulate_ring_backward(dout_shards: Sequence[Tensor], q_shards: Sequence[Tensor], k_shards: Sequence[Tensor],
                           v_shards: Sequence[Tensor], states: Sequence[AttnState], *, causal: bool = True,
                           scale: float | None = None, backend: str = "auto",
                           cu_seqlens: Tensor | Sequence[int] | None = None) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Every rank's ring backward on one device: per rank (dq, dk, dv) fp32 of its own shards."""
    size = len(q_shards)
    bounds = _bounds(q_shards[0].shape[1], size, cu_seqlens)
    scale = resolve_scale(scale, q_shards[0].shape[-1])
    backend = resolve_backend(backend, q_shards[0], k_shards[0], v_shards[0])
    grads = [tuple(torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
             for q, k, v in zip(q_shards, k_shards, v_shards)]
    for rank in range(size):
        out = states[rank].out.to(q_shards[rank].dtype)
        lse_bht = states[rank].lse.transpose(1, 2).contiguous()
        for step in range(size):
            src = (rank - step) % size
            _backward_step((grads[rank][0], grads[src][1], grads[src][2]), dout_shards[rank], q_shards[rank],
                           k_shards[src], v_shards[src], out, lse_bht, rank, src, step, causal=causal, scale=scale,
                           backend=backend, bounds=bounds)
    return grads


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: GroupLike, causal: bool, scale: float, backend: str,
                bounds: Bounds):
        _, rank, size = resolve_group(group)
        ring = _ring(group, q.device) if size > 1 else None
        out, lse = ring_forward(q, k, v, ring, rank, size, causal=causal, scale=scale, backend=backend,
                                bounds=bounds)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, rank, size, causal, scale, backend, bounds)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, size, causal, scale, backend, bounds = ctx.args
        ring = _ring(group, q.device) if size > 1 else None
        dq, dk, dv = ring_backward(dout.to(q.dtype), q, k, v, out, lse, ring, rank, size, causal=causal,
                                   scale=scale, backend=backend, bounds=bounds)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------
# all-gather variant


class _GatherSequence(torch.autograd.Function):
    """All-gather along the token dim (1) of [B, T, H, D]; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: Tensor, group: GroupLike, size: int):
        ctx.group, ctx.size, ctx.t = group, size, x.shape[1]
        return all_gather_uneven(x.contiguous(), group, dim=1, sizes=[x.shape[1]] * size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_uneven(grad.contiguous(), [ctx.t] * ctx.size, ctx.group, dim=1), None, None


def _sequence_kv(x_all: Tensor, start: int, end: int, t_local: int, size: int, causal: bool) -> Tensor:
    """One packed sequence's tokens [B, P * (end - start), H, D] out of the gathered shards
    [B, P * t_local, H, D]: in sequence order when causal (positions matter), else any order."""
    if not causal and (start, end) == (0, t_local):
        return x_all
    if size == 1:
        return x_all[:, start:end]
    pieces = [shard[:, start:end] for shard in x_all.split(t_local, dim=1)]
    return zigzag_unshard(pieces, dim=1) if causal else torch.cat(pieces, dim=1)


def _allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: GroupLike, rank: int, size: int, *,
                         causal: bool, scale: float, backend: str, bounds: Bounds) -> AttnState:
    k_all = _GatherSequence.apply(k, group, size)
    v_all = _GatherSequence.apply(v, group, size)
    t_local = q.shape[1]
    parts = []
    for start, end in bounds:
        if end == start:
            continue
        k_seq = _sequence_kv(k_all, start, end, t_local, size, causal)
        v_seq = _sequence_kv(v_all, start, end, t_local, size, causal)
        if not causal:
            parts.append(attention_with_lse(q[:, start:end], k_seq, v_seq, scale=scale, backend=backend))
            continue
        chunk = (end - start) // 2   # the local rows of a sequence are its chunks r and 2P-1-r
        for rows, index in ((slice(start, start + chunk), rank), (slice(start + chunk, end), 2 * size - 1 - rank)):
            parts.append(attention_with_lse(q[:, rows], k_seq, v_seq, causal=True, q_offset=index * chunk,
                                            scale=scale, backend=backend))
    if len(parts) == 1:
        return parts[0]
    return AttnState(torch.cat([p.out for p in parts], dim=1), torch.cat([p.lse for p in parts], dim=1))


# ---------------------------------------------------------------------------------------------
# agreement among the ranks

_SIGNATURE = ("batch", "local tokens T", "q heads", "kv heads", "head dim", "v head dim", "dtype", "causal",
              "variant", "scale", "sequences", "cu_seqlens checksum", "grad (1: q, 2: k or v)")


def _signature(q: Tensor, k: Tensor, v: Tensor, causal: bool, variant: str, scale: float,
               cu_seqlens: Tensor | Sequence[int] | None) -> list[int]:
    """The ints every rank of the ring must agree on ([B, T, H, D] inputs, the resolved float scale).

    The last is which inputs autograd will differentiate: the backward is collective too (the ring
    passes dK / dV around, the all-gather's backward reduce-scatters them), so a rank that records
    no graph, or none for k and v, would leave the others waiting in it."""
    if cu_seqlens is None:
        seqs, checksum = 1, 0
    else:
        offsets = [int(o) for o in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        seqs, checksum = len(offsets) - 1, zlib.crc32(repr(offsets).encode())
    return [q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], dtype_code(q.dtype),
            int(causal), int(variant == "allgather"), float_code(scale), seqs, checksum, _grad_code(q, k, v)]


def _grad_code(q: Tensor, k: Tensor, v: Tensor) -> int:
    if not torch.is_grad_enabled():
        return 0
    return int(q.requires_grad) + 2 * int(k.requires_grad or v.requires_grad)


# ---------------------------------------------------------------------------------------------
# public entry


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: GroupLike = None, *, causal: bool = True,
                   scale: float | None = None, variant: RingVariant = "ring", backend: AttnBackend = "auto",
                   return_lse: bool = False, cu_seqlens: Tensor | Sequence[int] | None = None) -> Tensor | AttnState:
    """Context-parallel attention over a sequence sharded zigzag-wise over `group`.

    q: [T, Hq, D] or [B, T, Hq, D], this rank's zigzag shard (`zigzag_shard`), T = S / P;
    k: [.., T, Hkv, D]; v: [.., T, Hkv, Dv]; Hq % Hkv == 0. With causal=True at P > 1, T must be even.
    group: parallel.groups.Group, ProcessGroup, or None (the world).
    scale: softmax scale, default 1/sqrt(D); the forms `resolve_scale` accepts (a float; not a tensor that
    requires grad: the ring's backward treats the scale as a constant). It must be the same float on
    every rank (ValueError on every rank otherwise, naming each rank's value).
    variant: "ring" (P2P ring, double-buffered) or "allgather" (gather all KV first).
    cu_seqlens: [N+1] int offsets of the FULL packed batch (the same on every rank, host ints or a
    tensor, read on the host), for packed [T, H, D] inputs sharded with `zigzag_shard_varlen`;
    every sequence length a multiple of 2P; attention stays within each sequence (causal or not).
    Returns out [.., T, Hq, Dv] in q's dtype (same rows as q), or AttnState(out, lse fp32) with
    return_lse=True (the lse is not differentiable through the ring variant).
    """
    _, rank, size = resolve_group(group)
    squeeze = q.dim() == 3
    error = signature = None
    try:  # a bad argument on one rank must not leave the others waiting in the ring
        check_qkv(q, k, v)
        if variant not in ("ring", "allgather"):
            raise ValueError(f"variant must be 'ring' or 'allgather', got {variant!r}")
        if squeeze:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"q and k must hold the same local tokens; got T = {q.shape[1]} and {k.shape[1]}")
        if q.shape[1] == 0:
            raise ValueError(f"q has no tokens (T = 0, shape {tuple(q.shape)}); ring attention needs T >= 1 "
                             f"(T >= 2 and even when causal at P > 1)")
        if cu_seqlens is not None and not squeeze:
            raise ValueError(f"cu_seqlens needs packed [T, H, D] inputs, got q {tuple(q.shape)}")
        bounds = _bounds(q.shape[1], size, cu_seqlens)
        if causal and size > 1 and q.shape[1] % 2 != 0:
            raise ValueError(f"local length ({q.shape[1]}) must be even: each rank holds two zigzag chunks; pad "
                             f"the sequence to a multiple of 2*P = {2 * size} and shard it with zigzag_shard")
        backend = resolve_backend(backend, q, k, v)   # a bad backend on one rank must not hang the others
        scale = resolve_scale(scale, q.shape[-1])      # likewise a bad scale (and, agreed below, a different one)
        signature = _signature(q, k, v, causal, variant, scale, cu_seqlens)
    except ValueError as exc:
        if size == 1:
            raise
        error = str(exc)
    if size > 1:
        message = input_agreement("ring attention", _SIGNATURE, signature, error, group, q.device,
                                  {"dtype": "dtype", "scale": "float"},
                                  "every rank must call with the same layout, dtype, causal, variant, softmax "
                                  "scale, cu_seqlens and inputs requiring grad")
        if message is not None:
            raise ValueError(message)
    if variant == "allgather":
        state = _allgather_attention(q, k, v, group, rank, size, causal=causal, scale=scale, backend=backend,
                                     bounds=bounds)
        state = AttnState(state.out.to(q.dtype), state.lse)
    else:
        out, lse = _RingAttention.apply(q, k, v, group, causal, scale, backend, bounds)
        state = AttnState(out, lse)
    if squeeze:
        state = AttnState(state.out.squeeze(0), state.lse.squeeze(0))
    return state if return_lse else state.out
