"""Column- and row-parallel linear layers with sequence parallelism and comm/compute overlap.

    up   = ColumnParallelLinear(H, [I, I], tp, sequence_parallel=True)   # gate and up shards
    down = RowParallelLinear(I, H, tp, sequence_parallel=True)
    gate, up_ = up(x_shard)          # x_shard [T/P, H] -> [T, I/P] each (one gather, overlapped)
    y_shard = down(act(gate) * up_)  # [T, I/P] -> [T/P, H] (matmul-reduce-scatter, overlapped)

Weights follow `nn.Linear` ([out, in]); a column-parallel layer holds rows
`[r * out/P, (r+1) * out/P)` of every part, a row-parallel one holds columns
`[r * in/P, (r+1) * in/P)`. `from_full` / `load_full_weight` slice a full (unsharded)
checkpoint tensor for this rank.

sequence_parallel=True: the column layer takes a token shard and gathers it
(`all_gather_matmul`), the row layer reduce-scatters its output over tokens
(`matmul_reduce_scatter`); token counts must be padded to a multiple of P (`sp_shard`).
sequence_parallel=False: plain TP, the column layer takes the full (replicated) input and
all-reduces its gradient, the row layer all-reduces its output. On CPU each first agrees with
the group on its input's shape and dtype and its weight's dtype (the column layer also on whether
autograd records its input; `comm.region_agreement`): a rank that differs raises ValueError on
every rank, naming the per-rank values, where the all-reduce of unequal buffers made gloo abort
the process or hang. CUDA skips that host sync.
overlap=False runs the same maths with plain, un-overlapped collectives ("reference").

The row layer adds its bias after the reduction; under sequence parallelism every rank then
holds only its tokens' share of the bias gradient (`param.sequence_parallel = True` marks
it): all-reduce such gradients over the TP group before the optimizer step, as Megatron does.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..comm import GroupLike, copy_to_region, dtype_code, reduce_from_region, region_agreement, resolve_group
from .ops import Backend, all_gather_matmul, matmul_reduce_scatter


def _shard_len(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {size}; "
                         f"valid sizes are multiples of {size}")
    return total // size


class ColumnParallelLinear(nn.Module):
    """y = x @ W^T (+ b) with W's output rows split over the group; outputs stay split.

    out_features: one size, or several (e.g. [q, k, v] or [gate, up]) that are split part by
    part and returned as a list. forward: x [T/P, ..., in] (sequence_parallel, padded T) or
    [T, ..., in] -> [T, ..., out/P] (a list of [T, ..., out_i/P] when several parts).
    """

    def __init__(self, in_features: int, out_features: int | Sequence[int], group: GroupLike, *, bias: bool = False,
                 sequence_parallel: bool = False, overlap: bool = True, backend: Backend = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _, self.tp_rank, self.tp_size = resolve_group(group)
        self.group = group
        self.in_features = in_features
        self.parts = [out_features] if isinstance(out_features, int) else list(out_features)
        self.is_fused = not isinstance(out_features, int)
        self.local_parts = [_shard_len(n, self.tp_size, f"out_features part {i}") for i, n in enumerate(self.parts)]
        self.sequence_parallel = sequence_parallel
        self.backend: Backend = backend if overlap else "reference"
        local_out = sum(self.local_parts)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local_out, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: GroupLike, *,
                  out_features: int | Sequence[int] | None = None, **kwargs) -> "ColumnParallelLinear":
        """A layer holding this rank's shard of a full weight [sum(out), in] (and bias [sum(out)])."""
        layer = cls(weight.shape[1], weight.shape[0] if out_features is None else out_features, group,
                    bias=bias is not None, device=weight.device, dtype=weight.dtype, **kwargs)
        layer.load_full_weight(weight, bias)
        return layer

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of each part of a full weight [sum(out), in] (and bias)."""
        if tuple(weight.shape) != (sum(self.parts), self.in_features):
            raise ValueError(f"full weight has shape {tuple(weight.shape)}, expected "
                             f"[{sum(self.parts)}, {self.in_features}] (parts {self.parts})")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"bias given: {bias is not None}, layer has a bias: {self.bias is not None}")
        if bias is not None and tuple(bias.shape) != (sum(self.parts),):  # checked before anything is copied
            raise ValueError(f"full bias has shape {tuple(bias.shape)}, expected [{sum(self.parts)}]")
        self.weight.copy_(torch.cat([p.narrow(0, self.tp_rank * n, n)
                                     for p, n in zip(weight.split(self.parts), self.local_parts)]))
        if bias is not None:
            self.bias.copy_(torch.cat([p.narrow(0, self.tp_rank * n, n)
                                       for p, n in zip(bias.split(self.parts), self.local_parts)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if self.sequence_parallel:
            (y,) = all_gather_matmul(x, [self.weight.t()], self.group, backend=self.backend)
        else:
            # on CPU the ranks agree before the matmul too (one of mismatched dtypes raises on one rank alone)
            region_agreement("ColumnParallelLinear (sequence_parallel=False) input", x, self.group,
                             records_grad=torch.is_grad_enabled() and x.requires_grad,
                             extra={"weight dtype": dtype_code(self.weight.dtype)})
            y = copy_to_region(x, self.group, agreed=True) @ self.weight.t()
        if self.bias is not None:
            y = y + self.bias
        return list(y.split(self.local_parts, dim=-1)) if self.is_fused else y


class RowParallelLinear(nn.Module):
    """y = x @ W^T (+ b) with W's input columns split over the group; the output is summed.

    forward: x [T, ..., in/P] (the split output of a column-parallel layer) ->
    [T/P, ..., out] (sequence_parallel; T must be a multiple of P) or [T, ..., out].
    """

    def __init__(self, in_features: int, out_features: int, group: GroupLike, *, bias: bool = False,
                 sequence_parallel: bool = False, overlap: bool = True, backend: Backend = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _, self.tp_rank, self.tp_size = resolve_group(group)
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _shard_len(in_features, self.tp_size, "in_features")
        self.sequence_parallel = sequence_parallel
        self.backend: Backend = backend if overlap else "reference"
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # per-rank partial gradient, see the module docstring
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: GroupLike,
                  **kwargs) -> "RowParallelLinear":
        """A layer holding this rank's shard of a full weight [out, in] (the bias is replicated)."""
        layer = cls(weight.shape[1], weight.shape[0], group, bias=bias is not None, device=weight.device,
                    dtype=weight.dtype, **kwargs)
        layer.load_full_weight(weight, bias)
        return layer

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's columns of a full weight [out, in] (and the full bias [out])."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"full weight has shape {tuple(weight.shape)}, expected "
                             f"[{self.out_features}, {self.in_features}]")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"bias given: {bias is not None}, layer has a bias: {self.bias is not None}")
        if bias is not None and tuple(bias.shape) != (self.out_features,):  # checked before anything is copied
            raise ValueError(f"full bias has shape {tuple(bias.shape)}, expected [{self.out_features}]")
        self.weight.copy_(weight.narrow(1, self.tp_rank * self.local_in, self.local_in))
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = matmul_reduce_scatter(x, self.weight.t(), self.group, backend=self.backend)
        else:
            # agreed on the input: a rank whose matmul fails (another dtype) must not leave its peers
            # in the all-reduce; equal x and weight shapes and dtypes then give equal partials
            region_agreement("RowParallelLinear (sequence_parallel=False) input", x, self.group,
                             extra={"weight dtype": dtype_code(self.weight.dtype), "out_features": self.out_features})
            y = reduce_from_region(x @ self.weight.t(), self.group, agreed=True)
        if self.bias is not None:
            y = y + self.bias
        return y
