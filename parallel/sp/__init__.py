"""Sequence parallelism and async tensor parallelism (docs/numerics.md §9).

- `sp_shard` / `sp_all_gather` / `sp_reduce_scatter` / `sp_pad`: token shards of the TP
  group, padded so uneven token counts still give every rank the same shard (`shard.py`).
- `all_gather_matmul` / `matmul_reduce_scatter`: the collectives around TP linears,
  decomposed so each rank's block is multiplied while the next one travels; backends
  "decomposed" (P2P ring / pairwise sends, any torch.distributed backend), "symm_mem" (PyTorch's fused
  symmetric-memory ops, CUDA), "reference" (plain collectives); with autograd (`ops.py`).
- FP8: quantize the token shard before the gather and run scaled matmuls; differentiable
  with a straight-through, high-precision backward (`fp8.py`).
- `ColumnParallelLinear` / `RowParallelLinear` with `sequence_parallel` and `overlap`
  options, loadable from full weights (`modules.py`).
"""

from .fp8 import (
    FP8_REL_TOL,
    Fp8Activation,
    Fp8GatherMatmulResult,
    Fp8Weight,
    all_gather_fp8,
    all_gather_matmul_fp8,
    matmul_reduce_scatter_fp8,
    quantize_fp8_per_token,
    quantize_fp8_weight,
    rms_norm_quantize_all_gather,
    rms_norm_quantize_fp8,
    scaled_matmul,
)
from .modules import ColumnParallelLinear, RowParallelLinear
from .ops import BACKENDS, all_gather_matmul, matmul_reduce_scatter
from .shard import sp_all_gather, sp_local_tokens, sp_pad, sp_reduce_scatter, sp_shard

__all__ = [
    "BACKENDS", "all_gather_matmul", "matmul_reduce_scatter",
    "sp_shard", "sp_all_gather", "sp_reduce_scatter", "sp_pad", "sp_local_tokens",
    "ColumnParallelLinear", "RowParallelLinear",
    "FP8_REL_TOL", "Fp8Activation", "Fp8Weight", "Fp8GatherMatmulResult", "quantize_fp8_per_token",
    "quantize_fp8_weight", "rms_norm_quantize_fp8", "scaled_matmul", "all_gather_fp8",
    "rms_norm_quantize_all_gather", "all_gather_matmul_fp8", "matmul_reduce_scatter_fp8",
]
