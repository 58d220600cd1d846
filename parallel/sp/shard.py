"""Sequence-parallel token shards of a TP group, padded so that every rank holds the same count.

Between the row-parallel linear that ends one TP region and the column-parallel linear that
starts the next, activations are sharded over tokens: norms, residual adds and dropout run
on T / P tokens per rank instead of T, and the all-reduce of plain TP becomes a
reduce-scatter (into the region) plus an all-gather (out of it), the same bytes.

Uneven token counts: T is padded with zero rows to a multiple of P, every rank holds
`ceil(T / P)` tokens (the last ranks hold the padding), and `sp_all_gather(...,
num_tokens=T)` drops the padding again. Equal shards keep every collective even, which the
overlapped ops, NCCL's fast paths and symmetric memory all want. Padding rows start at zero;
token-wise ops keep them finite and they never mix into real tokens.

All three helpers are differentiable with the Megatron conventions: the backward of
`sp_shard` (slice a replicated tensor) is an all-gather, of `sp_reduce_scatter` an
all-gather, and of `sp_all_gather` a reduce-scatter when the consumers of the gathered
tensor are tensor-parallel (each rank holds a partial gradient, `reduce_grad=True`), or just
this rank's slice when they are replicated (`reduce_grad=False`, e.g. the model output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import GroupLike, all_gather_uneven, reduce_scatter_uneven, resolve_group



def sp_local_tokens(num_tokens: int, group: GroupLike | int) -> int:
    """Tokens each rank holds for a sequence of `num_tokens`: ceil(num_tokens / P)."""
    size = group if isinstance(group, int) else resolve_group(group)[2]
    return -(-num_tokens // size)


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim ({dim}) out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _pad_to(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero rows appended along `dim` up to `length`."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
    return F.pad(x, pad)


def sp_pad(x: torch.Tensor, group: GroupLike, dim: int = 0) -> torch.Tensor:
    """x zero-padded along `dim` to a multiple of the group size (x itself when it already is).

    x: [..., T, ...] -> [..., P * ceil(T / P), ...], same dtype.
    """
    dim = _check_dim(x, dim)
    _, _, size = resolve_group(group)
    return _pad_to(x, size * sp_local_tokens(x.shape[dim], size), dim)


def _gather_tokens(x_shard: torch.Tensor, group, dim: int, num_tokens: int) -> torch.Tensor:
    """Equal shards [.., m, ..] concatenated in rank order, cut to num_tokens along dim."""
    _, _, size = resolve_group(group)
    full = all_gather_uneven(x_shard.contiguous(), group, dim, sizes=[x_shard.shape[dim]] * size)
    return full.narrow(dim, 0, num_tokens)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int):
        _, rank, size = resolve_group(group)
        m = sp_local_tokens(x.shape[dim], size)
        ctx.group, ctx.dim, ctx.num_tokens = group, dim, x.shape[dim]
        return _pad_to(x, size * m, dim).narrow(dim, rank * m, m).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_tokens(grad, ctx.group, ctx.dim, ctx.num_tokens), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard: torch.Tensor, group, dim: int, num_tokens: int, reduce_grad: bool):
        ctx.group, ctx.dim, ctx.m, ctx.reduce_grad = group, dim, x_shard.shape[dim], reduce_grad
        return _gather_tokens(x_shard, group, dim, num_tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _, rank, size = resolve_group(ctx.group)
        padded = _pad_to(grad, size * ctx.m, ctx.dim)
        if ctx.reduce_grad:
            g = reduce_scatter_uneven(padded.contiguous(), [ctx.m] * size, ctx.group, ctx.dim)
        else:
            g = padded.narrow(ctx.dim, rank * ctx.m, ctx.m)
        return g, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int):
        _, _, size = resolve_group(group)
        m = sp_local_tokens(x.shape[dim], size)
        ctx.group, ctx.dim, ctx.num_tokens = group, dim, x.shape[dim]
        return reduce_scatter_uneven(_pad_to(x, size * m, dim).contiguous(), [m] * size, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_tokens(grad, ctx.group, ctx.dim, ctx.num_tokens), None, None


def sp_shard(x: torch.Tensor, group: GroupLike, dim: int = 0) -> torch.Tensor:
    """This rank's token shard of a tensor replicated over the group.

    x: [..., T, ...] (the same on every rank) -> [..., ceil(T / P), ...]: rank r holds tokens
    [r * m, (r + 1) * m) of x zero-padded to P * m. Backward: all-gather.
    """
    return _Shard.apply(x, group, _check_dim(x, dim))


def sp_all_gather(x_shard: torch.Tensor, group: GroupLike, *, num_tokens: int | None = None, dim: int = 0,
                  reduce_grad: bool = True) -> torch.Tensor:
    """All token shards concatenated in rank order, the padding dropped.

    x_shard: [..., m, ...], the same m on every rank -> [..., num_tokens, ...] (default P * m).
    reduce_grad: backward reduce-scatters (consumers are tensor-parallel) when True, keeps
    this rank's slice of the gradient (consumers are replicated) when False.
    """
    dim = _check_dim(x_shard, dim)
    _, _, size = resolve_group(group)
    padded_len = size * x_shard.shape[dim]
    num_tokens = padded_len if num_tokens is None else num_tokens
    lowest = max(padded_len - size + 1, 0)  # sp_shard gives ceil(T / P) tokens a rank
    if not lowest <= num_tokens <= padded_len:
        raise ValueError(f"num_tokens ({num_tokens}) does not match shards of {x_shard.shape[dim]} tokens on "
                         f"{size} ranks: valid num_tokens are {lowest}..{padded_len}")
    return _AllGather.apply(x_shard, group, dim, num_tokens, reduce_grad)


def sp_reduce_scatter(x: torch.Tensor, group: GroupLike, dim: int = 0) -> torch.Tensor:
    """Sum over the group of partial sums `x`, this rank keeping its token shard.

    x: [..., T, ...] partial sums (e.g. a row-parallel linear's output) -> [..., ceil(T / P), ...],
    rows past T zero. Backward: all-gather.
    """
    return _ReduceScatter.apply(x, group, _check_dim(x, dim))
