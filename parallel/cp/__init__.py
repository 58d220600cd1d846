"""Context parallelism: LSE merging, local attention with LSE, ring attention (PCP), DCP decode.

Tensor layout everywhere: `[T, H, D]` (packed tokens) or `[B, T, H, D]`; LSEs `[.., T, H]` fp32.
- `merge_attn_states` / `merge_two_attn_states`: combine partial attention results (docs/numerics.md §7);
  `rescale_to_merged`: one partial's share of a merge (DCP's all-gather + reduce-scatter combine);
  `rescale_parts_to_merged`: the same for a rank's several partials (the decode kernel's splits).
- `attention_with_lse`: local attention returning (out, lse), with offset causal masks and GQA.
- `ring_attention`, `zigzag_shard` / `zigzag_unshard`: PCP prefill over a zigzag-sharded sequence;
  `zigzag_*_varlen` shard packed batches (cu_seqlens) sequence by sequence for `ring_attention(cu_seqlens=)`.
- `DCPLayout`, `PagedKVCache`, `dcp_kv_insert`, `dcp_decode_attention`: DCP decode (docs/numerics.md §8).
- `paged_decode_attention`: the DCP local part, a split-KV Triton kernel (op "cp.decode") or torch;
  `plan_paged_decode` / `plan_dcp_decode` / `plan_mla_decode`: its splits cut from the lengths on the device (batches of
  very different lengths), made once a decode step and given to every layer's call (plan=).
- `MLACache`, `mla_kv_insert`, `mla_decode_attention`, `mla_prefill_attention`, `mla_prep`: DeepSeek's
  multi-head latent attention over a latent paged cache (absorbed DCP decode, ring prefill, fused prep).
- `ContextParallelAttention`: the module a model layer uses (ring / DCP / plain).
"""

from .dcp import DCPLayout, PagedKVCache, dcp_decode_attention, dcp_kv_insert, plan_dcp_decode
from .local_attn import attention_with_lse
from .merge import AttnState, merge_attn_states, merge_two_attn_states, rescale_parts_to_merged, rescale_to_merged
from .mla import MLACache, MLADims, mla_decode_attention, mla_kv_insert, mla_prefill_attention, plan_mla_decode
from .mla_prep import mla_prep, rope_table
from .module import ContextParallelAttention
from .paged import paged_decode_attention, plan_paged_decode
from .ring import (ring_attention, zigzag_positions, zigzag_positions_varlen, zigzag_shard, zigzag_shard_varlen,
                   zigzag_unshard, zigzag_unshard_varlen)

__all__ = [
    "AttnState", "merge_attn_states", "merge_two_attn_states", "rescale_to_merged", "rescale_parts_to_merged",
    "attention_with_lse", "ring_attention",
    "zigzag_shard", "zigzag_unshard", "zigzag_positions", "zigzag_shard_varlen", "zigzag_unshard_varlen",
    "zigzag_positions_varlen", "DCPLayout", "PagedKVCache", "dcp_kv_insert",
    "dcp_decode_attention", "ContextParallelAttention", "paged_decode_attention", "MLACache", "MLADims",
    "mla_kv_insert", "mla_decode_attention", "mla_prefill_attention", "mla_prep", "rope_table", "plan_paged_decode",
    "plan_dcp_decode", "plan_mla_decode",
]
