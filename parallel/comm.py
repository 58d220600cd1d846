"""Thin collectives shared by every primitive.

Uneven all-gather / reduce-scatter along any dim (padding handled inside), all-to-all with
per-rank split sizes, async variants returning a handle, and uint8 transport of low-precision
tensors (gloo rejects fp8; packed fp4 is uint8 already). A group argument may be a
`parallel.groups.Group`, a raw `ProcessGroup`, or None (the world, or a single process when
torch.distributed is not initialized); size-1 groups never communicate. Groups are resolved
(`resolve_group`) at these public entry points, never further down.

Also here: the copy-to-region / reduce-from-region autograd pair (identity one way, sum over the
group the other) that tensor- and expert-parallel layers wrap their per-rank work in (on CPU
each first agrees with the group on its tensor's shape and dtype: `region_agreement`), and
`even_split`, the one near-equal split of a count (micro-batches, overlap chunks), and
`input_agreement`, the one small all-gather by which a group's ranks learn that one of them had
bad input (or that they were called differently) before a collective would leave them waiting.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .groups import Group

GroupLike = Group | dist.ProcessGroup | None
"""What every public function takes as a group: a `Group`, a raw `ProcessGroup`, or None (the
world, or one process when torch.distributed is not initialized)."""


def resolve_group(group: GroupLike) -> tuple[dist.ProcessGroup | None, int, int]:
    """(process group or None, rank in group, group size)."""
    if isinstance(group, Group):
        return group.group, group.rank, group.size
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a ProcessGroup was given but torch.distributed is not initialized")
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def as_group(group: GroupLike) -> Group:
    """`group` as a `Group` (resolved once, at a public entry point; internals then read
    `.group`, `.rank`, `.size` instead of asking torch.distributed again)."""
    if isinstance(group, Group):
        return group
    pg, rank, size = resolve_group(group)
    return Group(name="", group=pg, rank=rank, size=size, ranks=tuple(group_ranks(group)))


def group_ranks(group: GroupLike) -> list[int]:
    """Global ranks of the group in group-rank order."""
    if isinstance(group, Group):
        return list(group.ranks)
    pg, _, size = resolve_group(group)
    if pg is None:
        return list(range(size))
    return [dist.get_global_rank(pg, i) for i in range(size)]


_WIRE_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.bool}
for _name in ("float8_e8m0fnu", "float4_e2m1fn_x2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _WIRE_DTYPES.add(getattr(torch, _name))


_WIDE_WIRE_DTYPES = {torch.int16, torch.uint16, torch.uint32, torch.uint64}
"""Multi-byte integer dtypes that gloo (and NCCL, for the 16-bit ones) cannot carry: moved by
the gather / all-to-all as bytes in an extra trailing dim (their rows keep their count)."""


def needs_wire(dtype: torch.dtype) -> bool:
    """True when collectives cannot carry `dtype` directly (fp8/fp4/bool): send it as uint8."""
    return dtype in _WIRE_DTYPES


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of `t` (last dim scaled by the element size; int16/uint16/uint32/uint64 get a
    trailing dim of their bytes instead); a no-op for plain dtypes."""
    if t.dtype in _WIDE_WIRE_DTYPES:
        return t.contiguous().unsqueeze(-1).view(torch.uint8)
    if not needs_wire(t.dtype):
        return t
    return t.contiguous().view(torch.uint8)


def from_wire(u8: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of `to_wire`."""
    if u8.dtype == dtype:
        return u8 if shape is None else u8.reshape(shape)
    out = u8.view(dtype)
    if dtype in _WIDE_WIRE_DTYPES:
        out = out.squeeze(-1)
    return out if shape is None else out.reshape(shape)


@dataclass
class CommHandle:
    """An in-flight collective. `wait()` returns its result tensor (post-processed)."""

    work: Any
    finish: Callable[[], Any]
    _done: bool = False
    _result: Any = None

    def wait(self) -> Any:
        if not self._done:
            if self.work is not None:
                for w in (self.work if isinstance(self.work, (list, tuple)) else [self.work]):
                    w.wait()
            self._result = self.finish()
            self._done = True
        return self._result


def _done_handle(value: Any) -> CommHandle:
    return CommHandle(work=None, finish=lambda: value)


# torch >= 2.13 renamed the flat-tensor collectives; 2.11 (the GPU machine) has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NO_REDUCE_SCATTER: set[str] = set()


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """`out[i * n:(i + 1) * n] = inp` of rank i (equal sizes), under either torch name."""
    return _all_gather_flat(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None,
                        async_op: bool = False):
    """Sum `inp` over the group and keep this rank's equal slice in `out`. Backends without a
    reduce-scatter (gloo before torch 2.13) all-reduce a copy and slice it."""
    backend = str(dist.get_backend(group))
    if backend not in _NO_REDUCE_SCATTER:
        try:
            return _reduce_scatter_flat(out, inp, group=group, async_op=async_op)
        except RuntimeError as e:
            if "not supported" not in str(e) and "unsupported" not in str(e).lower():
                raise
            _NO_REDUCE_SCATTER.add(backend)
    buf = inp.clone()
    work = dist.all_reduce(buf, group=group, async_op=async_op)
    rank, n = dist.get_rank(group), out.shape[0]
    if not async_op:
        out.copy_(buf[rank * n:(rank + 1) * n])
        return None

    class _Sliced:
        def wait(self_inner):
            work.wait()
            out.copy_(buf[rank * n:(rank + 1) * n])
            return True

    return _Sliced()


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim ({dim}) out of range for a tensor of {x.dim()} dims")
    return dim % x.dim()


def gather_sizes(n: int, group: GroupLike, device: torch.device | None = None) -> list[int]:
    """Every rank's `n`, in group-rank order."""
    pg, _, size = resolve_group(group)
    if size == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_flat(out, t, pg)
    return out.tolist()


def all_gather_uneven(x: torch.Tensor, group: GroupLike, dim: int = 0, *,
                      sizes: list[int] | None = None, async_op: bool = False) -> torch.Tensor | CommHandle:
    """Concatenate every rank's `x` along `dim`; ranks may hold different sizes there.

    sizes: every rank's size along `dim` when known (saves one small collective).
    """
    pg, rank, size = resolve_group(group)
    dim = _check_dim(x, dim)
    if sizes is None:
        sizes = [x.shape[dim]] if size == 1 else gather_sizes(x.shape[dim], group, x.device)
    if len(sizes) != size:
        raise ValueError(f"sizes has {len(sizes)} entries for a group of {size}")
    if sizes[rank] != x.shape[dim]:
        raise ValueError(f"sizes[{rank}] ({sizes[rank]}) != this rank's x.shape[{dim}] ({x.shape[dim]}); "
                         f"sizes {sizes}")
    if any(n < 0 for n in sizes):
        raise ValueError(f"sizes {sizes} must not be negative")
    if size == 1:
        return _done_handle(x) if async_op else x
    dtype = x.dtype
    wire = to_wire(x.movedim(dim, 0).contiguous())
    longest = max(sizes)
    if wire.shape[0] < longest:
        pad = wire.new_zeros((longest - wire.shape[0],) + tuple(wire.shape[1:]))
        wire = torch.cat([wire, pad])
    out = wire.new_empty((size * longest,) + tuple(wire.shape[1:]))
    work = all_gather_flat(out, wire, pg, async_op=async_op)

    def finish() -> torch.Tensor:
        chunks = out.view(size, longest, *wire.shape[1:])
        parts = torch.cat([chunks[i, :n] for i, n in enumerate(sizes)])
        return from_wire(parts, dtype).movedim(0, dim)

    if async_op:
        return CommHandle(work, finish)
    return finish()


def reduce_scatter_uneven(x: torch.Tensor, sizes: list[int], group: GroupLike,
                          dim: int = 0, *, async_op: bool = False) -> torch.Tensor | CommHandle:
    """Sum `x` over the group, then give rank i the i-th slice (of `sizes[i]`) along `dim`."""
    pg, rank, size = resolve_group(group)
    dim = _check_dim(x, dim)
    if len(sizes) != size or sum(sizes) != x.shape[dim] or any(n < 0 for n in sizes):
        raise ValueError(f"sizes {sizes} must have {size} entries >= 0 summing to x.shape[{dim}] = {x.shape[dim]}")
    if size == 1:
        return _done_handle(x) if async_op else x
    if needs_wire(x.dtype):
        raise ValueError(f"cannot sum {x.dtype} tensors; reduce in a wider dtype")
    xt = x.movedim(dim, 0)
    longest = max(sizes)
    parts = []
    start = 0
    for n in sizes:
        piece = xt[start:start + n]
        if n < longest:
            piece = torch.cat([piece, piece.new_zeros((longest - n,) + tuple(piece.shape[1:]))])
        parts.append(piece)
        start += n
    inp = torch.cat(parts).contiguous()
    out = inp.new_empty((longest,) + tuple(inp.shape[1:]))
    work = reduce_scatter_flat(out, inp, pg, async_op=async_op)
    finish = lambda: out[:sizes[rank]].movedim(0, dim)
    if async_op:
        return CommHandle(work, finish)
    return finish()


def all_to_all_uneven(x: torch.Tensor, send_splits: list[int], group: GroupLike,
                      recv_splits: list[int] | None = None, *, async_op: bool = False
                      ) -> tuple[torch.Tensor, list[int]] | CommHandle:
    """Send rows `x[sum(send_splits[:j]) : ...+send_splits[j]]` to rank j; receive from every rank.

    x: [N, ...] any dtype (fp8/fp4 travel as uint8). recv_splits: rows coming from each rank,
    exchanged with one small all-to-all when not given. Returns (received [sum(recv), ...],
    recv_splits), or a handle whose wait() returns that pair.
    """
    pg, _, size = resolve_group(group)
    if len(send_splits) != size or sum(send_splits) != x.shape[0] or any(n < 0 for n in send_splits):
        raise ValueError(f"send_splits {send_splits} must have {size} entries >= 0 summing to x.shape[0] = {x.shape[0]}")
    if recv_splits is not None and (len(recv_splits) != size or any(n < 0 for n in recv_splits)):
        raise ValueError(f"recv_splits {recv_splits} must have {size} entries >= 0")
    if size == 1:
        result = (x, list(send_splits))
        return _done_handle(result) if async_op else result
    if recv_splits is None:
        send_t = torch.tensor(send_splits, dtype=torch.int64, device=x.device)
        recv_t = torch.empty_like(send_t)
        dist.all_to_all_single(recv_t, send_t, group=pg)
        recv_splits = recv_t.tolist()
    dtype = x.dtype
    wire = to_wire(x.contiguous())
    out = wire.new_empty((sum(recv_splits),) + tuple(wire.shape[1:]))
    work = dist.all_to_all_single(out, wire, output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=pg, async_op=async_op)
    rs = list(recv_splits)
    finish = lambda: (from_wire(out, dtype), rs)
    if async_op:
        return CommHandle(work, finish)
    return finish()


def all_reduce(x: torch.Tensor, group: GroupLike, op: dist.ReduceOp = dist.ReduceOp.SUM,
               *, async_op: bool = False) -> torch.Tensor | CommHandle:
    """In-place all-reduce that is a no-op on size-1 groups; returns `x` (or a handle)."""
    pg, _, size = resolve_group(group)
    if size == 1:
        return _done_handle(x) if async_op else x
    work = dist.all_reduce(x, op=op, group=pg, async_op=async_op)
    if async_op:
        return CommHandle(work, lambda: x)
    return x


# ---- autograd regions --------------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; the gradient summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: GroupLike) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Sum over the group forward; the gradient passes through backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: GroupLike) -> torch.Tensor:
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


_REGION_DIMS = 8  # dims of a region tensor whose sizes the agreement shows one by one (the rest as one code)


def region_agreement(what: str, x: torch.Tensor, group: GroupLike, *, records_grad: bool | None = None,
                     extra: dict[str, int] | None = None) -> None:
    """ValueError on every rank of `group` when the ranks' `x` differ in shape or dtype (or, with
    `records_grad` given, in whether autograd records the region; or in an `extra` field), decided
    by one `input_agreement` naming `what` and the per-rank values.

    Why: the regions' all-reduce sums equal-sized buffers. A rank with another shape makes gloo
    abort the process ("Received data size doesn't match") or wait forever, one with another dtype
    of the same byte size sums misread values, and a rank whose region autograd does not record
    never joins the backward's all-reduce. A layer calls it itself before a computation that could
    fail on one rank alone (a matmul of mismatched dtypes), with `extra` fields (its weight's dtype)
    that fix the region tensor's shape and dtype, and then passes agreed=True to the region.
    CPU tensors only: on CUDA the read-back is a host sync (a graph-captured step cannot take it),
    so the ranks must agree by contract there. One rank (or no tensor): nothing."""
    _, _, size = resolve_group(group)
    if size == 1 or not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        return
    shape = tuple(x.shape)
    head = list(shape[:_REGION_DIMS]) + [-1] * (_REGION_DIMS - min(len(shape), _REGION_DIMS))
    rest = zlib.crc32(str(shape[_REGION_DIMS:]).encode()) if len(shape) > _REGION_DIMS else 0
    extra = extra or {}
    names = (["dtype", "dims"] + [f"shape[{i}]" for i in range(_REGION_DIMS)] + [f"shape[{_REGION_DIMS}:] code"]
             + list(extra) + (["autograd records it"] if records_grad is not None else []))
    values = ([dtype_code(x.dtype), len(shape)] + head + [rest] + list(extra.values())
              + ([int(records_grad)] if records_grad is not None else []))
    kinds = {n: "dtype" for n in names if n.endswith("dtype")}
    message = input_agreement(
        what, names, values, None, group, x.device, kinds,
        "every rank of the group must pass a tensor of one shape and dtype (shape[i] = -1: no such dim)"
        + (", and every rank or none must record autograd (the backward is an all-reduce)"
           if records_grad is not None else ""))
    if message is not None:
        raise ValueError(message)


def copy_to_region(x: torch.Tensor, group: GroupLike, *, agreed: bool = False) -> torch.Tensor:
    """A tensor replicated over `group` entering per-rank work (a column-parallel layer's input,
    the tokens every EP rank sends to its experts): `x` itself forward; backward, the per-rank
    gradients are summed over the group, so every rank gets the gradient of the replicated x.

    On CPU every rank of the group first agrees (`region_agreement`) on x's shape and dtype and
    on whether autograd records the call (one small all-gather, even under no_grad: a rank that
    records it would be alone in the backward's all-reduce); a difference raises ValueError on
    every rank, naming the per-rank values. agreed=True: the caller ran that agreement already.
    CUDA skips that host sync."""
    if not agreed:
        region_agreement("copy_to_region", x, group, records_grad=_records_grad(x))
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: GroupLike, *, agreed: bool = False) -> torch.Tensor:
    """Per-rank partial results leaving that work (a row-parallel layer's output, EP partial
    outputs): their sum on every rank forward (a new tensor; `x` is untouched); the gradient
    passes through unchanged backward (each partial contributed to the sum with weight 1).

    On CPU every rank of the group first agrees (`region_agreement`) on x's shape and dtype (one
    small all-gather): a difference raises ValueError on every rank, naming the per-rank values,
    instead of an all-reduce of unequal buffers. agreed=True: the caller ran an agreement that
    fixes x's shape and dtype already. CUDA skips that host sync."""
    if not agreed:
        region_agreement("reduce_from_region", x, group)
    return _ReduceFromRegion.apply(x, group)


def _records_grad(x: Any) -> bool:
    """Whether autograd records a region entered with `x` (its backward then all-reduces)."""
    return torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad


# ---- sizes ---------------------------------------------------------------------------------------


def even_split(total: int, parts: int) -> list[int]:
    """`total` items in `parts` near-equal sizes, earlier ones larger: even_split(7, 3) == [3, 2, 2]."""
    if total < 0 or parts < 1:
        raise ValueError(f"need total >= 0 and parts >= 1, got total={total} and parts={parts}")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# ---- agreement on input ----------------------------------------------------------------------------


def dtype_code(dtype: torch.dtype) -> int:
    """The same int on every rank for the same dtype (an `input_agreement` field)."""
    return zlib.crc32(str(dtype).encode())


def float_code(x: float) -> int:
    """A float's exact bits as an int (an `input_agreement` field: equal floats, equal ints)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def dtype_name(code: int) -> str:
    """The dtype a `dtype_code` stands for, as str(dtype) (the code itself if none)."""
    names = {dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return names.get(code, str(code))


def _show_code(kind: str, code: int) -> str | float | int:
    if kind == "dtype":
        return dtype_name(code)
    if kind == "float":
        return struct.unpack("<d", struct.pack("<q", code))[0]
    return code


def input_agreement(what: str, names: Sequence[str], values: Sequence[int] | None, error: str | None,
                    group: GroupLike, device: torch.device | None = None,
                    kinds: dict[str, str] | None = None, hint: str = "") -> str | None:
    """What this rank must raise, decided with the whole group in one all-gather of a few ints.

    Call it on every rank of `group` before the collectives of `what`, with this rank's own
    input error (None if its input was good) and the ints every rank must agree on (`names`:
    the same on every rank; `values`: this rank's, or None where its input was too bad to have
    them). Returns this rank's own error; else, if any rank had one, a message naming those
    ranks; else, if the ranks' values differ, a message showing them per rank; else None. So
    either every rank gets a message (and raises it) or none does: a bad input on one rank no
    longer leaves its peers waiting in a collective it will never join. `kinds` marks fields to
    print as a dtype ("dtype", from `dtype_code`) or a float ("float", from `float_code`); `hint`
    ends a disagreement's message (what every rank must pass alike).
    The all-gather and its read-back are a host sync: CPU paths and eager prefill take it, a
    CUDA-graph-captured decode step cannot."""
    pg, _, size = resolve_group(group)
    if size == 1:
        return error
    n = len(names) + 1
    if values is not None and len(values) != len(names):
        raise ValueError(f"{len(values)} values for {len(names)} names: {list(names)}")
    row = torch.tensor([int(error is not None)] + list(values if values is not None else [0] * len(names)),
                       dtype=torch.int64, device=device)
    table = torch.empty(size * n, dtype=torch.int64, device=device)
    all_gather_flat(table, row, pg)
    rows = table.view(size, n).tolist()
    if error is not None:
        return error
    bad = [r for r, got in enumerate(rows) if got[0]]
    if bad:
        return f"{what} aborted: group rank(s) {bad} had invalid input (see the error raised there)"
    differ = [i for i in range(len(names)) if len({got[i + 1] for got in rows}) > 1]
    if not differ:
        return None
    kinds = kinds or {}
    detail = "; ".join(f"{names[i]}: {[_show_code(kinds.get(names[i], ''), got[i + 1]) for got in rows]}"
                       for i in differ)
    return f"{what}: the ranks of the group disagree (values per group rank) on {detail}" + (f"; {hint}" if hint else "")
