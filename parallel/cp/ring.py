"""Ring attention for prefill/training context parallelism (PCP), SPEC §8.

A sequence of S tokens is cut into 2P chunks; rank r holds chunks r and 2P-1-r (zigzag), so
every rank does the same causal work. Local tensors are `[T, H, D]` or `[B, T, H, D]` with
T = S/P (the two chunks concatenated); see `zigzag_shard`.

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
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import all_gather_uneven, group_ranks, reduce_scatter_uneven, resolve_group
from ..groups import Group
from .local_attn import (AttnBackend, attention_with_lse, block_attention_backward, block_attention_forward,
                         check_qkv, resolve_backend)
from .merge import AttnState, merge_two_attn_states

RingVariant = Literal["ring", "allgather"]
GroupLike = Group | dist.ProcessGroup | None


# ---------------------------------------------------------------------------------------------
# zigzag layout


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
    if not 0 <= rank < size:
        raise ValueError(f"rank ({rank}) must be in [0, {size})")
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
    """Global positions [seq_len / size] int64 of the tokens rank `rank` holds (for RoPE etc.)."""
    return zigzag_shard(torch.arange(seq_len, device=device), rank, size)


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


# ---------------------------------------------------------------------------------------------
# ring communication


class _Ring:
    """Asynchronous send-to-next / receive-from-previous of one flat buffer."""

    def __init__(self, group: GroupLike) -> None:
        self.pg, self.rank, self.size = resolve_group(group)
        ranks = group_ranks(group)
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]

    def start(self, send: Tensor, recv: Tensor) -> list:
        ops = [dist.P2POp(dist.isend, send, self.next, self.pg), dist.P2POp(dist.irecv, recv, self.prev, self.pg)]
        return dist.batch_isend_irecv(ops)


def _wait(works: list | None) -> None:
    for w in works or ():
        w.wait()


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
                  causal: bool, scale: float, backend: str) -> AttnState:
    """Attend local q to the KV block of `src` held at `step`; merge into `state` (fp32, in place)."""
    rows, keys, blk_causal = _zigzag_step(rank, src, step, causal, q.shape[1])
    o, l = block_attention_forward(q.transpose(1, 2)[:, :, rows], kb.transpose(1, 2)[:, :, keys],
                                   vb.transpose(1, 2)[:, :, keys], causal=blk_causal, scale=scale, backend=backend)
    o, l = o.transpose(1, 2), l.transpose(1, 2)
    if state is None:   # step 0 covers every row
        return AttnState(o.to(torch.float32, memory_format=torch.contiguous_format), l.contiguous())
    merge_two_attn_states(state.out[:, rows], state.lse[:, rows], o, l, out=state.out[:, rows],
                          out_lse=state.lse[:, rows])
    return state


def _backward_step(grads: tuple[Tensor, Tensor, Tensor], dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor,
                   out: Tensor, lse_bht: Tensor, rank: int, src: int, step: int, *, causal: bool, scale: float,
                   backend: str) -> None:
    """Add this step's block gradients into grads = (dq [B, T, Hq, D], dk, dv of the block), fp32."""
    rows, keys, blk_causal = _zigzag_step(rank, src, step, causal, q.shape[1])
    dq_b, dk_b, dv_b = block_attention_backward(
        dout.transpose(1, 2)[:, :, rows], q.transpose(1, 2)[:, :, rows], kb.transpose(1, 2)[:, :, keys],
        vb.transpose(1, 2)[:, :, keys], out.transpose(1, 2)[:, :, rows], lse_bht[:, :, rows],
        causal=blk_causal, scale=scale, backend=backend)
    dq, dk, dv = grads
    dq[:, rows] += dq_b.transpose(1, 2)
    dk[:, keys] += dk_b.transpose(1, 2)
    dv[:, keys] += dv_b.transpose(1, 2)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: _Ring | None, rank: int, size: int, *, causal: bool,
                 scale: float, backend: str) -> AttnState:
    """Ring attention forward. q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, Dv] (zigzag shards).
    Returns AttnState(out [B, T, Hq, Dv] fp32, lse [B, T, Hq] fp32). `ring` None means size 1."""
    bufs = [_pack(k, v)]
    if size > 1:
        bufs.append(torch.empty_like(bufs[0]))
    state = None
    for step in range(size):
        cur = bufs[step % 2]
        works = ring.start(cur, bufs[(step + 1) % 2]) if step + 1 < size else None
        kb, vb = _unpack(cur, (k, v))
        state = _forward_step(state, q, kb, vb, rank, (rank - step) % size, step, causal=causal, scale=scale,
                              backend=backend)
        _wait(works)
    return state


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: _Ring | None,
                  rank: int, size: int, *, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Ring attention backward from the final out [B, T, Hq, Dv] and lse [B, T, Hq].

    dQ accumulates locally; the fp32 dK/dV of a KV block travel with it and arrive at the owner
    after the last step. Returns dq, dk, dv in the inputs' dtypes."""
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
        kv_works = ring.start(cur, kv_bufs[(step + 1) % 2]) if step + 1 < size else None
        kb, vb = _unpack(cur, (k, v))
        _wait(dkv_works)                       # the accumulator of this block (zeros at step 0)
        acc = dkv_bufs[step % 2]
        _backward_step((dq, *_unpack(acc, (k, v))), dout, q, kb, vb, out, lse_bht, rank, (rank - step) % size, step,
                       causal=causal, scale=scale, backend=backend)
        dkv_works = ring.start(acc, dkv_bufs[(step + 1) % 2]) if size > 1 else None
        _wait(kv_works)
    _wait(dkv_works)                           # our own block's gradient, back after P hops
    dk, dv = _unpack(dkv_bufs[size % len(dkv_bufs)], (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def simulate_ring_forward(q_shards: Sequence[Tensor], k_shards: Sequence[Tensor], v_shards: Sequence[Tensor], *,
                          causal: bool = True, scale: float | None = None, backend: str = "auto") -> list[AttnState]:
    """Every rank's ring compute (the same steps and merges) on one device, no communication.

    *_shards: per rank [B, T, H, D] zigzag shards. Returns each rank's AttnState (fp32). Used by
    the one-GPU benchmark of the ring compute path and by tests.
    """
    size = len(q_shards)
    scale = q_shards[0].shape[-1] ** -0.5 if scale is None else scale
    backend = resolve_backend(backend, q_shards[0], k_shards[0], v_shards[0])
    states = []
    for rank in range(size):
        state = None
        for step in range(size):
            src = (rank - step) % size
            state = _forward_step(state, q_shards[rank], k_shards[src], v_shards[src], rank, src, step,
                                  causal=causal, scale=scale, backend=backend)
        states.append(state)
    return states


def simulate_ring_backward(dout_shards: Sequence[Tensor], q_shards: Sequence[Tensor], k_shards: Sequence[Tensor],
                           v_shards: Sequence[Tensor], states: Sequence[AttnState], *, causal: bool = True,
                           scale: float | None = None, backend: str = "auto") -> list[tuple[Tensor, Tensor, Tensor]]:
    """Every rank's ring backward on one device: per rank (dq, dk, dv) fp32 of its own shards."""
    size = len(q_shards)
    scale = q_shards[0].shape[-1] ** -0.5 if scale is None else scale
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
                           backend=backend)
    return grads


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: GroupLike, causal: bool, scale: float, backend: str):
        _, rank, size = resolve_group(group)
        ring = _Ring(group) if size > 1 else None
        out, lse = ring_forward(q, k, v, ring, rank, size, causal=causal, scale=scale, backend=backend)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, rank, size, causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, size, causal, scale, backend = ctx.args
        ring = _Ring(group) if size > 1 else None
        dq, dk, dv = ring_backward(dout.to(q.dtype), q, k, v, out, lse, ring, rank, size, causal=causal,
                                   scale=scale, backend=backend)
        return dq, dk, dv, None, None, None, None


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


def _allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: GroupLike, rank: int, size: int, *,
                         causal: bool, scale: float, backend: str) -> AttnState:
    k_all = _GatherSequence.apply(k, group, size)
    v_all = _GatherSequence.apply(v, group, size)
    if not causal:
        return attention_with_lse(q, k_all, v_all, scale=scale, backend=backend)
    k_all = zigzag_unshard(k_all.chunk(size, dim=1), dim=1)
    v_all = zigzag_unshard(v_all.chunk(size, dim=1), dim=1)
    chunk = q.shape[1] // 2
    parts = [attention_with_lse(q[:, :chunk], k_all, v_all, causal=True, q_offset=rank * chunk, scale=scale,
                                backend=backend),
             attention_with_lse(q[:, chunk:], k_all, v_all, causal=True, q_offset=(2 * size - 1 - rank) * chunk,
                                scale=scale, backend=backend)]
    return AttnState(torch.cat([p.out for p in parts], dim=1), torch.cat([p.lse for p in parts], dim=1))


# ---------------------------------------------------------------------------------------------
# public entry


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: GroupLike = None, *, causal: bool = True,
                   scale: float | None = None, variant: RingVariant = "ring", backend: AttnBackend = "auto",
                   return_lse: bool = False) -> Tensor | AttnState:
    """Context-parallel attention over a sequence sharded zigzag-wise over `group`.

    q: [T, Hq, D] or [B, T, Hq, D], this rank's zigzag shard (`zigzag_shard`), T = S / P;
    k: [.., T, Hkv, D]; v: [.., T, Hkv, Dv]; Hq % Hkv == 0. With causal=True, T must be even.
    group: parallel.groups.Group, ProcessGroup, or None (the world).
    variant: "ring" (P2P ring, double-buffered) or "allgather" (gather all KV first).
    Returns out [.., T, Hq, Dv] in q's dtype (same rows as q), or AttnState(out, lse fp32) with
    return_lse=True (the lse is not differentiable through the ring variant).
    """
    check_qkv(q, k, v)
    if variant not in ("ring", "allgather"):
        raise ValueError(f"variant must be 'ring' or 'allgather', got {variant!r}")
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold the same local tokens; got T = {q.shape[1]} and {k.shape[1]}")
    _, rank, size = resolve_group(group)
    if causal and size > 1 and q.shape[1] % 2 != 0:
        raise ValueError(f"local length ({q.shape[1]}) must be even: each rank holds two zigzag chunks; pad the "
                         f"sequence to a multiple of 2*P = {2 * size} and shard it with zigzag_shard")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = resolve_backend(backend, q, k, v)
    if variant == "allgather":
        state = _allgather_attention(q, k, v, group, rank, size, causal=causal, scale=scale, backend=backend)
        state = AttnState(state.out.to(q.dtype), state.lse)
    else:
        out, lse = _RingAttention.apply(q, k, v, group, causal, scale, backend)
        state = AttnState(out, lse)
    if squeeze:
        state = AttnState(state.out.squeeze(0), state.lse.squeeze(0))
    return state if return_lse else state.out
