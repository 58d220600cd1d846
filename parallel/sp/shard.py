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

Agreement: the collectives here and in `ops.py` / `fp8.py` move equal shards, and a rank whose
shard differs (one token more, another hidden size or dtype) made gloo abort the process or
the gather return misread bytes. So on CPU tensors every public op first agrees with the group
(`agree_call`: one all-gather of a few ints, `comm.input_agreement`) on the shapes, dtypes and
options that size its collectives (and on which inputs require grad: the backward passes are
collectives too); a rank with other values, or with bad arguments, makes every rank raise
ValueError naming the per-rank values before anything moves. Uneven shards are not supported
(pad first: `sp_shard` / `sp_pad`). On CUDA the agreement would be a host sync on every TP
linear (and decode steps are captured in CUDA graphs), so it is skipped there: the ranks must
pass equal shards, and a rank's bad arguments raise on that rank alone.
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence, TypeVar

import torch
import torch.nn.functional as F

from ..comm import GroupLike, all_gather_uneven, dtype_code, input_agreement, reduce_scatter_uneven, resolve_group

T = TypeVar("T")

SHAPE_DIMS = 6
"""Dims of a tensor's shape that `shape_fields` shows one by one (the rest go into one checksum)."""


def shape_names(name: str) -> tuple[str, ...]:
    """The `input_agreement` field names for the shape of tensor `name` (see `shape_fields`)."""
    return ((f"{name} dims",) + tuple(f"{name}.shape[{i}]" for i in range(SHAPE_DIMS))
            + (f"{name}.shape[{SHAPE_DIMS}:] (crc32)",))


def shape_fields(t: torch.Tensor) -> list[int]:
    """The ints of `shape_names` for `t`: its dim count, its first SHAPE_DIMS sizes (-1 past its
    last dim), and a crc32 of any later sizes (0 if none), so that any two shapes differ somewhere."""
    shape = list(t.shape)
    head = shape[:SHAPE_DIMS] + [-1] * (SHAPE_DIMS - min(len(shape), SHAPE_DIMS))
    tail = shape[SHAPE_DIMS:]
    return [len(shape)] + head + [zlib.crc32(repr(tail).encode()) if tail else 0]


def agree_call(what: str, group: GroupLike, device: torch.device | None, names: Sequence[str],
               check: Callable[[], tuple[T, Sequence[int]]], hint: str) -> T:
    """`check()`'s result, after the group agreed that every rank may go on into `what`'s collectives.

    check: this rank's argument checks; returns (result, the ints of `names`) or raises ValueError.
    On a group of more than one rank with CPU tensors (`device`), every rank joins one
    `input_agreement`: a ValueError on any rank, or values that differ between the ranks, raise
    ValueError on every rank (the per-rank values in the message, `hint` at its end), so none is
    left in a collective its peers never join, or pairs equal transfers of different bytes.
    Elsewhere (one rank; CUDA, where it would be a host sync) `check()` runs alone. Fields whose
    name ends in "dtype" are `dtype_code`s and are shown as dtypes."""
    _, _, size = resolve_group(group)
    if size == 1 or device is None or device.type != "cpu":
        return check()[0]
    result: T | None = None
    values: Sequence[int] | None = None
    error = None
    try:
        result, values = check()
    except ValueError as exc:
        error = str(exc)
    kinds = {n: "dtype" for n in names if n.endswith("dtype")}
    message = input_agreement(what, names, values, error, group, device, kinds, hint)
    if message is not None:
        raise ValueError(message)
    return result  # type: ignore[return-value]


def grad_code(x: object, weights: Sequence[object] = ()) -> int:
    """Which inputs autograd will differentiate (0 under no_grad): 1 for x, 2 for any weight; an
    agreement field, as the backward passes are collectives too."""
    if not torch.is_grad_enabled():
        return 0
    req = lambda t: isinstance(t, torch.Tensor) and t.requires_grad  # noqa: E731
    return int(req(x)) + 2 * int(any(req(w) for w in weights))


UNEVEN_HINT = ("every rank must pass a shard of the same shape and dtype (and the same options): uneven token "
               "counts are not supported, pad them to a multiple of the group size first (sp_shard / sp_pad)")



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
        # the forward moved nothing: the shards' shapes meet here first (a rank given an x of
        # another length has a shard of another size, or another num_tokens to cut the gather to)
        fields = lambda: (None, shape_fields(grad) + [ctx.dim, dtype_code(grad.dtype), ctx.num_tokens])  # noqa: E731
        agree_call("sp_shard backward", ctx.group, grad.device, _SHARD_BACKWARD_FIELDS, fields,
                   "every rank must shard the same replicated x (the same length T along the same dim)")
        return _gather_tokens(grad, ctx.group, ctx.dim, ctx.num_tokens), None, None


_SHARD_BACKWARD_FIELDS = shape_names("grad") + ("dim", "dtype", "num_tokens T")
_GATHER_FIELDS = shape_names("x_shard") + ("dim", "dtype", "num_tokens", "reduce_grad", "grad")
_REDUCE_SCATTER_FIELDS = shape_names("x") + ("dim", "dtype", "grad")


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

    x_shard: [..., m, ...], the same shape (and dtype) on every rank -> [..., num_tokens, ...]
    (default P * m). Shards of different sizes are refused (ValueError on every rank, see the
    module docstring): pad with `sp_shard` first.
    reduce_grad: backward reduce-scatters (consumers are tensor-parallel) when True, keeps
    this rank's slice of the gradient (consumers are replicated) when False.
    """
    def check() -> tuple[tuple[int, int], list[int]]:
        d = _check_dim(x_shard, dim)
        _, _, size = resolve_group(group)
        padded_len = size * x_shard.shape[d]
        n = padded_len if num_tokens is None else num_tokens
        lowest = max(padded_len - size + 1, 0)  # sp_shard gives ceil(T / P) tokens a rank
        if not lowest <= n <= padded_len:
            raise ValueError(f"num_tokens ({n}) does not match shards of {x_shard.shape[d]} tokens on "
                             f"{size} ranks: valid num_tokens are {lowest}..{padded_len}")
        return (d, n), shape_fields(x_shard) + [d, dtype_code(x_shard.dtype), n, int(reduce_grad),
                                                grad_code(x_shard)]

    d, n = agree_call("sp_all_gather", group, _device(x_shard), _GATHER_FIELDS, check, UNEVEN_HINT)
    return _AllGather.apply(x_shard, group, d, n, reduce_grad)


def sp_reduce_scatter(x: torch.Tensor, group: GroupLike, dim: int = 0) -> torch.Tensor:
    """Sum over the group of partial sums `x`, this rank keeping its token shard.

    x: [..., T, ...] partial sums (e.g. a row-parallel linear's output), the same shape (and
    dtype) on every rank (they are summed) -> [..., ceil(T / P), ...], rows past T zero;
    ValueError on every rank otherwise (see the module docstring). Backward: all-gather.
    """
    def check() -> tuple[int, list[int]]:
        d = _check_dim(x, dim)
        return d, shape_fields(x) + [d, dtype_code(x.dtype), grad_code(x)]

    d = agree_call("sp_reduce_scatter", group, _device(x), _REDUCE_SCATTER_FIELDS, check,
                   "every rank must pass partial sums of the same shape and dtype along the same dim")
    return _ReduceScatter.apply(x, group, d)


def _device(x: object) -> torch.device | None:
    """x's device, or None for a non-tensor (whose checks then raise on this rank alone)."""
    return x.device if isinstance(x, torch.Tensor) else None
