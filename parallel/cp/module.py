"""The attention a model layer calls: picks ring attention, DCP decode or plain attention.

`ContextParallelAttention(groups)` holds no weights; the layer projects q/k/v (and applies RoPE
with `positions()` when PCP shards the sequence), then calls
- `forward(q, k, v)` for prefill/training: ring attention over the PCP group when pcp > 1
  (inputs are this rank's zigzag shard, see `shard()`), plain local attention otherwise;
  packed variable-length batches pass `cu_seqlens` (the FULL batch's offsets, the same on every
  rank) to `shard`/`unshard`/`positions`/`forward`, and attention stays within each sequence;
- `insert_kv(cache, k, v, positions, block_table)` to store new tokens in the (DCP-sharded)
  paged cache, and `decode(q, cache, block_table, seq_lens)` for one decode step: DCP attention
  over the DCP group when dcp > 1, plain paged attention otherwise. As in vLLM, with pcp > 1
  the cache is sharded over the pcp * dcp ranks of the DCP group and its PCP peers
  (`total_cp_rank = pcp_rank * dcp + dcp_rank`, docs/numerics.md §8) and decode merges the
  partial results over both groups.
Tensors use this package's layout: `[T, H, D]` (packed tokens) or `[B, T, H, D]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..comm import all_gather_uneven
from ..groups import Group, ParallelGroups
from .dcp import DCPComm, PagedKVCache, dcp_decode_attention, dcp_kv_insert, plan_dcp_decode
from .local_attn import AttnBackend, attention_with_lse
from .ring import (RingVariant, _seq_lengths, ring_attention, zigzag_positions, zigzag_positions_varlen,
                   zigzag_shard, zigzag_shard_varlen, zigzag_unshard, zigzag_unshard_varlen)

if TYPE_CHECKING:
    from .triton_decode import LengthPlan

CuSeqlens = Tensor | Sequence[int]   # [N+1] int offsets of the full packed batch (host ints or a tensor)


def _single(name: str) -> Group:
    return Group(name, None, 0, 1, (0,))


def _check_total(cu_seqlens: CuSeqlens, total: int | None, what: str) -> list[int]:
    """Sequence lengths of `cu_seqlens`; ValueError unless they cover `total` tokens (None: any)."""
    lengths = _seq_lengths(cu_seqlens)
    if total is not None and sum(lengths) != total:
        raise ValueError(f"cu_seqlens covers {sum(lengths)} tokens but {what}")
    return lengths


class ContextParallelAttention(torch.nn.Module):
    """Context-parallel attention core (no parameters).

    groups: the job's ParallelGroups (None = one process, plain attention everywhere).
    scale: softmax scale (default 1/sqrt(head_dim)). interleave: DCP interleave size.
    dcp_comm: "ag_rs" or "a2a". ring_variant: "ring" or "allgather". backend: local kernel choice.
    """

    def __init__(self, groups: ParallelGroups | None = None, *, scale: float | None = None, interleave: int = 1,
                 dcp_comm: DCPComm = "ag_rs", ring_variant: RingVariant = "ring",
                 backend: AttnBackend = "auto") -> None:
        super().__init__()
        self.pcp = groups.pcp if groups is not None else _single("pcp")
        self.dcp = groups.dcp if groups is not None else _single("dcp")
        self.scale = scale
        self.interleave = interleave
        self.dcp_comm = dcp_comm
        self.ring_variant = ring_variant
        self.backend = backend

    # prefill -----------------------------------------------------------------------------

    def shard(self, x: Tensor, *, dim: int = 0, cu_seqlens: CuSeqlens | None = None) -> Tensor:
        """This rank's zigzag shard of a full sequence along `dim` (identity when pcp == 1).

        cu_seqlens: [N+1] offsets of a packed batch in x (each length a multiple of 2*pcp when
        pcp > 1): every sequence is sharded on its own (`zigzag_shard_varlen`)."""
        if cu_seqlens is not None:
            if self.pcp.size == 1:
                _check_total(cu_seqlens, x.shape[dim], f"x has {x.shape[dim]} tokens along dim {dim}")
                return x
            return zigzag_shard_varlen(x, cu_seqlens, self.pcp.rank, self.pcp.size, dim=dim)
        return x if self.pcp.size == 1 else zigzag_shard(x, self.pcp.rank, self.pcp.size, dim=dim)

    def unshard(self, x: Tensor, *, dim: int = 0, cu_seqlens: CuSeqlens | None = None) -> Tensor:
        """The full sequence from every PCP rank's shard (all-gather + zigzag reorder).

        cu_seqlens: [N+1] offsets of the FULL packed batch (as given to `shard`)."""
        if self.pcp.size == 1:
            if cu_seqlens is not None:
                _check_total(cu_seqlens, x.shape[dim], f"x has {x.shape[dim]} tokens along dim {dim}")
            return x
        gathered = all_gather_uneven(x.contiguous(), self.pcp, dim=dim, sizes=[x.shape[dim]] * self.pcp.size)
        shards = gathered.chunk(self.pcp.size, dim=dim)
        if cu_seqlens is not None:
            return zigzag_unshard_varlen(shards, cu_seqlens, dim=dim)
        return zigzag_unshard(shards, dim=dim)

    def positions(self, seq_len: int | None = None, *, device: torch.device | str | None = None,
                  cu_seqlens: CuSeqlens | None = None) -> Tensor:
        """Global positions [seq_len / pcp] int64 of this rank's tokens (for RoPE).

        cu_seqlens: [N+1] offsets of the FULL packed batch instead of seq_len (seq_len may be
        omitted or must equal cu_seqlens[-1]): each token's position within its own sequence."""
        if cu_seqlens is not None:
            lengths = _check_total(cu_seqlens, seq_len, f"seq_len is {seq_len}")
            if self.pcp.size == 1:
                return torch.cat([torch.arange(n, device=device) for n in lengths])
            return zigzag_positions_varlen(cu_seqlens, self.pcp.rank, self.pcp.size, device=device)
        if seq_len is None:
            raise ValueError("positions() needs seq_len or cu_seqlens")
        if self.pcp.size == 1:
            return torch.arange(seq_len, device=device)
        return zigzag_positions(seq_len, self.pcp.rank, self.pcp.size, device=device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                cu_seqlens: CuSeqlens | None = None) -> Tensor:
        """Prefill attention. q [.., T, Hq, D], k [.., T, Hkv, D], v [.., T, Hkv, Dv] -> [.., T, Hq, Dv].

        cu_seqlens: [N+1] offsets of the FULL packed batch (packed [T, H, D] inputs, sharded with
        `shard(x, cu_seqlens=...)`); attention stays within each sequence."""
        if self.pcp.size > 1 or cu_seqlens is not None:   # one rank: ring_attention runs no communication
            return ring_attention(q, k, v, self.pcp, causal=causal, scale=self.scale, variant=self.ring_variant,
                                  backend=self.backend, cu_seqlens=cu_seqlens)
        return attention_with_lse(q, k, v, causal=causal, scale=self.scale, backend=self.backend).out

    # decode ------------------------------------------------------------------------------

    def insert_kv(self, cache: PagedKVCache, k: Tensor, v: Tensor, positions: Tensor, block_table: Tensor) -> Tensor:
        """Store new tokens' k/v [T, Hkv, D] at `positions` [T] (this rank keeps the ones it owns)."""
        return dcp_kv_insert(cache, k, v, positions, block_table, self.dcp, interleave=self.interleave,
                             pcp_group=self._kv_pcp())

    def decode(self, q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, *,
               same_heads: bool = False, plan: LengthPlan | None = None) -> Tensor:
        """One decode step. q [S, Hq_local, D] -> [S, Hq_local, Dv].

        same_heads: every DCP rank holds the same query heads (see `dcp_decode_attention`). plan: the
        step's length plan (`plan_decode`)."""
        return dcp_decode_attention(q, cache, block_table, seq_lens, self.dcp, interleave=self.interleave,
                                    comm=self.dcp_comm, scale=self.scale, same_heads=same_heads,
                                    pcp_group=self._kv_pcp(), plan=plan)

    def plan_decode(self, q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor) -> LengthPlan:
        """The length plan of `decode` with these arguments (`plan_dcp_decode`): make it once a decode
        step, after the lengths are written, and give it to every layer's `decode` (a batch of very
        different lengths then keeps the whole GPU busy)."""
        return plan_dcp_decode(q, cache, block_table, seq_lens, self.dcp, interleave=self.interleave,
                               pcp_group=self._kv_pcp())

    @property
    def kv_shards(self) -> int:
        """Ranks one KV cache is sharded over: pcp * dcp (a virtual block holds block_size * this)."""
        return self.pcp.size * self.dcp.size

    def _kv_pcp(self) -> Group | None:
        return self.pcp if self.pcp.size > 1 else None

    def extra_repr(self) -> str:
        return (f"pcp={self.pcp.size}, dcp={self.dcp.size}, ring={self.ring_variant}, dcp_comm={self.dcp_comm}, "
                f"interleave={self.interleave}, backend={self.backend}")
