"""The attention a model layer calls: picks ring attention, DCP decode or plain attention.

`ContextParallelAttention(groups)` holds no weights; the layer projects q/k/v (and applies RoPE
with `positions()` when PCP shards the sequence), then calls
- `forward(q, k, v)` for prefill/training: ring attention over the PCP group when pcp > 1
  (inputs are this rank's zigzag shard, see `shard()`), plain local attention otherwise;
- `insert_kv(cache, k, v, positions, block_table)` to store new tokens in the (DCP-sharded)
  paged cache, and `decode(q, cache, block_table, seq_lens)` for one decode step: DCP attention
  over the DCP group when dcp > 1, plain paged attention otherwise.
Tensors use this package's layout: `[T, H, D]` (packed tokens) or `[B, T, H, D]`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import all_gather_uneven
from ..groups import Group, ParallelGroups
from .dcp import DCPComm, PagedKVCache, dcp_decode_attention, dcp_kv_insert
from .local_attn import AttnBackend, attention_with_lse
from .ring import RingVariant, ring_attention, zigzag_positions, zigzag_shard, zigzag_unshard


def _single(name: str) -> Group:
    return Group(name, None, 0, 1, (0,))


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

    def shard(self, x: Tensor, *, dim: int = 0) -> Tensor:
        """This rank's zigzag shard of a full sequence along `dim` (identity when pcp == 1)."""
        return x if self.pcp.size == 1 else zigzag_shard(x, self.pcp.rank, self.pcp.size, dim=dim)

    def unshard(self, x: Tensor, *, dim: int = 0) -> Tensor:
        """The full sequence from every PCP rank's shard (all-gather + zigzag reorder)."""
        if self.pcp.size == 1:
            return x
        gathered = all_gather_uneven(x.contiguous(), self.pcp, dim=dim, sizes=[x.shape[dim]] * self.pcp.size)
        return zigzag_unshard(gathered.chunk(self.pcp.size, dim=dim), dim=dim)

    def positions(self, seq_len: int, *, device: torch.device | str | None = None) -> Tensor:
        """Global positions [seq_len / pcp] of this rank's tokens (for RoPE)."""
        if self.pcp.size == 1:
            return torch.arange(seq_len, device=device)
        return zigzag_positions(seq_len, self.pcp.rank, self.pcp.size, device=device)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True) -> Tensor:
        """Prefill attention. q [.., T, Hq, D], k [.., T, Hkv, D], v [.., T, Hkv, Dv] -> [.., T, Hq, Dv]."""
        if self.pcp.size > 1:
            return ring_attention(q, k, v, self.pcp, causal=causal, scale=self.scale, variant=self.ring_variant,
                                  backend=self.backend)
        return attention_with_lse(q, k, v, causal=causal, scale=self.scale, backend=self.backend).out

    # decode ------------------------------------------------------------------------------

    def insert_kv(self, cache: PagedKVCache, k: Tensor, v: Tensor, positions: Tensor, block_table: Tensor) -> Tensor:
        """Store new tokens' k/v [T, Hkv, D] at `positions` [T] (this rank keeps the ones it owns)."""
        return dcp_kv_insert(cache, k, v, positions, block_table, self.dcp, interleave=self.interleave)

    def decode(self, q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, *,
               same_heads: bool = False) -> Tensor:
        """One decode step. q [S, Hq_local, D] -> [S, Hq_local, Dv].

        same_heads: every DCP rank holds the same query heads (see `dcp_decode_attention`)."""
        return dcp_decode_attention(q, cache, block_table, seq_lens, self.dcp, interleave=self.interleave,
                                    comm=self.dcp_comm, scale=self.scale, same_heads=same_heads)

    def extra_repr(self) -> str:
        return (f"pcp={self.pcp.size}, dcp={self.dcp.size}, ring={self.ring_variant}, dcp_comm={self.dcp_comm}, "
                f"interleave={self.interleave}, backend={self.backend}")
