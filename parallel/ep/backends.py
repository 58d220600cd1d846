"""EP transports: how token rows reach the expert ranks and how partial results come back.

A backend turns one routing (`topk_ids` on every rank) into a `Route` with two operations:

- ``send(pieces)``: per-token rows ``[T, C_i]`` of this rank -> the rows this rank receives,
  ``[n_recv, C_i]``, ordered by source rank, then token index. A token routed to several
  experts of one rank is sent there once.
- ``reduce(pieces)``: rows ``[n_recv, C_i]`` (partial sums per received row) -> ``[T, C_i]``
  fp32, each token summing what every rank sent back for it.

Dispatch is ``send`` followed by the local layout; combine is a local weighted reduction
followed by ``reduce``; the backward passes use the same two operations the other way round.

Before any payload moves, every rank contributes a *census* (an error flag, its token count,
its top-k width K, rows for each rank, pairs for each expert) to one all-gather of a few
integers. Every rank then knows the split sizes, the per-expert totals, and whether any rank had
bad input, an expert overflows a slab or the ranks' K differ (rows are packed and unpacked by
K), so every rank raises the same error before the payload collective and none is left waiting
on a partner. The census is the one host synchronization of a dispatch.

Backends: ``local`` (group of one: no communication), ``all_to_all`` (payload through
``all_to_all_single``; gloo and NCCL), ``allgather`` (all-gather tokens and routing, select
locally, reduce-scatter partial sums in fp32 on combine; simple, for small decode batches and
DP attention). `register_backend` plugs in another implementation of `Backend`: ``nvshmem``
(`parallel.ep.nvshmem`: payload by device writes into symmetric memory) and ``deepep``
(`parallel.ep.deepep`) register themselves when `parallel.ep` is imported, with checks that
say why they cannot run here, and are chosen by name only (a torch symmetric-memory transport
is not written yet).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megapar.parallel import comm, impl
from megapar.parallel.comm import dtype_code, dtype_name
from megapar.parallel.ep.layout import count_values, gather_reduce, gather_rows, scatter_add_rows

log = logging.getLogger(__name__)

_ALIGN_BYTES = 16
# torch >= 2.12 renamed all_gather_into_tensor (the old name warns there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Census:
    """Every rank's routing totals, identical on every rank after one all-gather (host ints)."""

    num_tokens: list[int]  # [W]: tokens T of each rank
    rows: list[list[int]]  # [W][W]: rows[s][d] = deduplicated token rows rank s sends to rank d
    expert_pairs: list[int]  # [E]: (token, k) pairs routed to each expert, summed over ranks
    errors: list[int]  # [W]: nonzero where rank s reported bad input
    top_k: list[int] = field(default_factory=list)  # [W]: K of each rank's topk_ids (0 where it reported an error)

    def expert_totals(self, first: int, count: int) -> list[int]:
        """Pairs arriving at experts first .. first + count - 1."""
        return self.expert_pairs[first:first + count]


@dataclass
class RoutingInfo:
    """Device-side routing of this rank's tokens, shared by the census and the routes."""

    valid: torch.Tensor  # [T, K] bool: id in [0, E)
    dest: torch.Tensor  # [T, K] int64: destination rank, W where invalid
    present: torch.Tensor  # [T, W] bool: token t has an expert on rank d


def routing_info(topk_ids: torch.Tensor, num_experts: int, size: int) -> RoutingInfo:
    """topk_ids: [T, K] int32/int64 -> destinations; ids outside [0, E) count as no expert."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    dest = torch.where(valid, ids // (num_experts // size), torch.full_like(ids, size))
    present = torch.zeros(ids.shape[0], size + 1, dtype=torch.bool, device=ids.device)
    present.scatter_(1, dest, True)
    return RoutingInfo(valid=valid, dest=dest, present=present[:, :size])


PAYLOAD_FIELDS = ("x dtype", "x row width", "x_scale dtype", "x_scale row width")
"""What `payload_format` describes of a dispatch's rows besides K; every rank must send the same."""


def payload_format(x: torch.Tensor, x_scale: torch.Tensor | None) -> list[int]:
    """The ints of PAYLOAD_FIELDS for x [T, ...] and its optional scale [T, ...] (0s: no scale)."""
    row = lambda t: math.prod(t.shape[1:]) if t.dim() else 0
    if x_scale is None:
        return [dtype_code(x.dtype), row(x), 0, 0]
    return [dtype_code(x.dtype), row(x), dtype_code(x_scale.dtype), row(x_scale)]


def take_census(topk_ids: torch.Tensor | None, info: RoutingInfo | None, num_experts: int, *,
                group: dist.ProcessGroup | None, size: int, device: torch.device, local_error: bool,
                check_ids: bool, payload: Sequence[int] | None = None) -> Census:
    """Build this rank's census row on the device, all-gather it, read it on the host once.

    topk_ids/info are None when `local_error` (this rank's input is unusable). payload: this
    rank's `payload_format` (None: not compared). Raises `DispatchInputError` on every rank
    together when no rank reported an error but the ranks' topk_ids have different K, or their
    payloads different dtypes or row widths: each rank packs the rows it sends and unpacks the
    rows it receives by its own K and pieces, so a receiver would drop (or invent) pairs the
    census counted, or misread the bytes (gloo aborts the process on the size mismatch)."""
    fmt = [0] * len(PAYLOAD_FIELDS) if payload is None else list(payload)
    if len(fmt) != len(PAYLOAD_FIELDS):
        raise ValueError(f"payload has {len(fmt)} ints, expected {len(PAYLOAD_FIELDS)}: {PAYLOAD_FIELDS}")
    head = 3 + len(fmt) + size  # per-rank columns: error flag, T, K, the payload format, rows to each rank
    width = head + num_experts
    if local_error or topk_ids is None or info is None:
        row = torch.zeros(width, dtype=torch.int64, device=device)
        row[0] = 1
    else:
        ids = topk_ids.long()
        bad = ((ids < -1) | (ids >= num_experts)).sum().reshape(1) if check_ids \
            else torch.zeros(1, dtype=torch.int64, device=device)
        key = torch.where(info.valid, ids, torch.full_like(ids, num_experts)).reshape(-1)
        pairs = count_values(key, num_experts + 1)[:num_experts]
        # (fills, not torch.tensor(list, device=...): a host-to-device copy would wait for the stream here)
        shape = [torch.full((1,), v, dtype=torch.int64, device=device) for v in (ids.shape[0], ids.shape[1], *fmt)]
        row = torch.cat([bad, *shape, info.present.sum(0), pairs]).to(torch.int64)
    if size == 1:
        table = row[None]
    else:
        table = torch.empty(size * width, dtype=torch.int64, device=device)
        _all_gather_single(table, row, group=group)
        table = table.view(size, width)
    # one device-to-host copy: the per-rank columns and the per-expert totals
    host = torch.cat([table[:, :head].reshape(-1), table[:, head:].sum(0)]).tolist()
    per_rank = [host[r * head:(r + 1) * head] for r in range(size)]
    first = 3 + len(fmt)
    census = Census(num_tokens=[r[1] for r in per_rank], rows=[r[first:] for r in per_rank],
                    expert_pairs=host[size * head:], errors=[r[0] for r in per_rank],
                    top_k=[r[2] for r in per_rank])
    if any(census.errors):
        return census
    rank = dist.get_rank(group) if size > 1 else 0
    if len(set(census.top_k)) > 1:
        from megapar.parallel.ep.dispatch import DispatchInputError

        raise DispatchInputError(
            f"[rank {rank}] EP dispatch: the EP ranks' topk_ids have different top-k widths K (by rank: "
            f"{census.top_k}); rows are packed by K, so every rank must pass topk_ids [T, K] with the same K "
            "(a rank without tokens too: [0, K])")
    if payload is not None:
        formats = [r[3:first] for r in per_rank]
        differ = [i for i, name in enumerate(PAYLOAD_FIELDS) if len({f[i] for f in formats}) > 1]
        if differ:
            from megapar.parallel.ep.dispatch import DispatchInputError

            show = lambda i, v: (dtype_name(v) if v else "none") if "dtype" in PAYLOAD_FIELDS[i] else v
            detail = "; ".join(f"{PAYLOAD_FIELDS[i]}: {[show(i, f[i]) for f in formats]}" for i in differ)
            raise DispatchInputError(
                f"[rank {rank}] EP dispatch: the EP ranks' payloads differ (by rank) in {detail}; rows are packed "
                "by them, so every rank must send x (and x_scale, or none) of the same dtype and row width "
                "(a rank without tokens too: [0, ...])")
    return census


# ---------------------------------------------------------------------------------------------
# Packing several per-row pieces into one uint8 buffer: one collective instead of several.


@dataclass(frozen=True)
class _Piece:
    dtype: torch.dtype
    width: int  # elements per row
    offset: int  # byte offset in the packed row


def _layout_rows(pieces: list[torch.Tensor]) -> tuple[int, list[_Piece]]:
    """Byte layout of one packed row: each piece 16-byte aligned -> (row bytes, pieces)."""
    specs: list[_Piece] = []
    offset = 0
    for p in pieces:
        specs.append(_Piece(p.dtype, p.shape[1], offset))
        offset += -(-p.shape[1] * p.element_size() // _ALIGN_BYTES) * _ALIGN_BYTES
    return offset, specs


def _pack_rows(pieces: list[torch.Tensor], index: torch.Tensor | None = None) -> tuple[torch.Tensor, list[_Piece]]:
    """pieces: [N, C_i] any dtypes -> packed [M, B] uint8 rows and their layout; with `index`
    ([M] int), row m packs row index[m] of every piece (one gather pass, no staging copy).
    Alignment bytes are left unwritten: no reader looks at them."""
    row_bytes, specs = _layout_rows(pieces)
    n = pieces[0].shape[0] if index is None else index.shape[0]
    only = pieces[0]
    if index is None and len(pieces) == 1 and only.is_contiguous() and only.numel() \
            and only.shape[1] * only.element_size() == row_bytes and not comm.needs_wire(only.dtype):
        return only.view(torch.uint8).view(n, row_bytes), specs  # already one packed row each: no copy
    buf = torch.empty(n, row_bytes, dtype=torch.uint8, device=pieces[0].device)
    for p, spec in zip(pieces, specs):
        nbytes = p.shape[1] * p.element_size()
        if p.stride(-1) != 1 or not p.is_contiguous():  # (a [T, 1] or empty tensor may have stride 0)
            p = torch.empty(p.shape, dtype=p.dtype, device=p.device).copy_(p)
        src = p.view(torch.uint8).reshape(p.shape[0], nbytes)
        dst = buf[:, spec.offset:spec.offset + nbytes]
        if index is None:
            dst.copy_(src)
        else:
            gather_rows(src, index, out=dst)
    return buf, specs


def _unpack_rows(buf: torch.Tensor, specs: list[_Piece]) -> list[torch.Tensor]:
    """Inverse of `_pack_rows`: views [N, C_i] into `buf` [N, B] uint8."""
    out = []
    for spec in specs:
        nbytes = spec.width * torch.empty((), dtype=spec.dtype).element_size()
        out.append(buf[:, spec.offset:spec.offset + nbytes].view(spec.dtype))
    return out


def _done(value: object) -> comm.CommHandle:
    return comm.CommHandle(work=None, finish=lambda: value)


def _then(handle: comm.CommHandle, fn: Callable) -> comm.CommHandle:
    """A handle whose wait() waits for `handle` and returns fn(its result)."""
    return comm.CommHandle(work=None, finish=lambda: fn(handle.wait()))


# ---------------------------------------------------------------------------------------------
# Routes.


class Route:
    """One routing's transport. Subclasses implement `send` and `reduce` (see module docstring)."""

    num_tokens: int  # T: rows of this rank's tokens
    num_recv: int  # rows received by `send`

    def reduce_dtype(self, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
        """Dtype partial sums of `dtype` values should have when handed to `reduce` (what travels
        on the wire); `out_dtype` is what the caller finally returns."""
        return dtype

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        """pieces: [T, C_i] -> handle whose wait() gives [n_recv, C_i] each."""
        raise NotImplementedError

    def reduce(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        """pieces: [n_recv, C_i] -> handle whose wait() gives [T, C_i] each (fp32, or the
        pieces' dtype for a local route)."""
        raise NotImplementedError


class LocalRoute(Route):
    """A group of one: received rows are this rank's tokens; nothing moves."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = self.num_recv = num_tokens

    def reduce_dtype(self, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
        return out_dtype  # the partial sums are the result

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        return _done(list(pieces))

    def reduce(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        return _done(list(pieces))


class AllToAllRoute(Route):
    """Deduplicated token rows to each destination rank with one `all_to_all_single`."""

    def __init__(self, info: RoutingInfo, census: Census, *, group: dist.ProcessGroup | None, rank: int,
                 size: int) -> None:
        self.group = group
        t, k = info.dest.shape
        self.num_tokens = t
        self.send_splits = list(census.rows[rank])
        self.recv_splits = [census.rows[s][rank] for s in range(size)]
        self.num_recv = sum(self.recv_splits)
        num_send = sum(self.send_splits)
        device = info.dest.device
        # send rows in (destination, token) order: row index of (d, t) = exclusive running count
        present_dt = info.present.t().reshape(-1)  # [W * T], destination-major
        row_of = torch.cumsum(present_dt, 0) - 1
        tokens = torch.arange(t, device=device).repeat(size)
        send_token = torch.zeros(num_send + 1, dtype=torch.int64, device=device)
        send_token.scatter_(0, torch.where(present_dt, row_of, torch.full_like(row_of, num_send)), tokens)
        self.send_token = send_token[:num_send]  # [n_send] token index of each send row
        # slot[t, k]: send row carrying (t, k) for the first k of each destination, else -1,
        # so that summing the returned rows over slots counts each destination once.
        row_td = torch.cat([row_of.view(size, t).t(), torch.full((t, 1), -1, device=device, dtype=torch.int64)], 1)
        slot = torch.gather(row_td, 1, info.dest)
        earlier = torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)  # [k, j]: j < k
        repeated = ((info.dest[:, :, None] == info.dest[:, None, :]) & earlier).any(2)
        self.slot = torch.where(info.valid & ~repeated, slot, torch.full_like(slot, -1))  # [T, K]

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        rows, specs = _pack_rows(pieces, self.send_token)
        pending = comm.all_to_all_uneven(rows, self.send_splits, self.group, self.recv_splits, async_op=True)
        handle = _then(pending, lambda result: _unpack_rows(result[0], specs))
        return handle if async_op else _done(handle.wait())

    def reduce(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        packed, specs = _pack_rows(pieces)
        pending = comm.all_to_all_uneven(packed, self.recv_splits, self.group, self.send_splits, async_op=True)

        def finish(result: tuple[torch.Tensor, list[int]]) -> list[torch.Tensor]:
            back = _unpack_rows(result[0], specs)  # [n_send, C_i]
            if back and back[0].device.type == "cpu":  # each send row belongs to one token: no atomics
                return [scatter_add_rows(piece, self.send_token, self.num_tokens, None, torch.float32)
                        for piece in back]
            return [gather_reduce(piece, self.slot, None, torch.float32) for piece in back]

        handle = _then(pending, finish)
        return handle if async_op else _done(handle.wait())


class AllGatherRoute(Route):
    """Every rank receives every token (rank-major); partial sums come back by reduce-scatter."""

    def __init__(self, census: Census, *, group: dist.ProcessGroup | None, rank: int) -> None:
        self.group = group
        self.sizes = list(census.num_tokens)
        self.num_tokens = self.sizes[rank]
        self.num_recv = sum(self.sizes)

    def reduce_dtype(self, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # the collective sums: keep fp32 on the wire

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        packed, specs = _pack_rows(pieces)
        pending = comm.all_gather_uneven(packed, self.group, sizes=self.sizes, async_op=True)
        handle = _then(pending, lambda gathered: _unpack_rows(gathered, specs))
        return handle if async_op else _done(handle.wait())

    def reduce(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> comm.CommHandle:
        widths = [p.shape[1] for p in pieces]
        flat = torch.cat([p.float() for p in pieces], 1) if len(pieces) > 1 else pieces[0].float()
        pending = comm.reduce_scatter_uneven(flat, self.sizes, self.group, async_op=True)
        handle = _then(pending, lambda mine: list(torch.split(mine, widths, 1)))
        return handle if async_op else _done(handle.wait())


# ---------------------------------------------------------------------------------------------
# Backend registry.


class Backend:
    """Makes a `Route` for one dispatch. `available()` says whether it can run here."""

    name = "base"

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def available(cls) -> bool:
        return True

    @staticmethod
    def input_error(x: torch.Tensor) -> str | None:
        """Why this transport cannot move x's rows (a host check on shape and dtype), or None.
        The dispatcher agrees on it in its census, so every rank raises together and the
        group stays in step (an error raised inside the transport poisons it)."""
        return None

    def payload_error(self, x: torch.Tensor, x_scale: torch.Tensor | None, top_k: int) -> str | None:
        """Why this transport cannot move x with x_scale and K = top_k slots a token (host checks,
        agreed in the census like `input_error`), or None. Default: `input_error(x)`."""
        return self.input_error(x)

    def route(self, info: RoutingInfo, census: Census) -> Route:
        raise NotImplementedError


class LocalBackend(Backend):
    name = "local"

    def route(self, info: RoutingInfo, census: Census) -> Route:
        return LocalRoute(census.num_tokens[0])


class AllToAllBackend(Backend):
    name = "all_to_all"

    def route(self, info: RoutingInfo, census: Census) -> Route:
        return AllToAllRoute(info, census, group=self.group, rank=self.rank, size=self.size)


class AllGatherBackend(Backend):
    name = "allgather"

    def route(self, info: RoutingInfo, census: Census) -> Route:
        return AllGatherRoute(census, group=self.group, rank=self.rank)


_REGISTRY: dict[str, type[Backend]] = {"all_to_all": AllToAllBackend, "allgather": AllGatherBackend}

# Which transport "auto" means: the host-synced dispatcher's all-to-all (each token goes only to the
# ranks that hold its experts); "allgather" is asked for by name (or chosen by MoELayer's device path).
# Only implemented transports are listed; "nvshmem" and "deepep" join via `register_backend`
# (parallel/ep/__init__.py), with auto=False.
TRANSPORT = impl.Op("ep.transport", [impl.Impl("all_to_all"), impl.Impl("allgather", auto=False)])
BACKENDS: tuple[str, ...] = TRANSPORT.names


def register_backend(name: str, cls: type[Backend], *, check: impl.Check | None = None,
                     before: str | None = None, auto: bool = True) -> None:
    """Plug in a transport implementation (a `Backend` subclass); `check` says when it can run,
    `before` places it in the "auto" order."""
    global BACKENDS
    _REGISTRY[name] = cls
    TRANSPORT.register(impl.Impl(name, check, auto=auto), before=before)
    BACKENDS = TRANSPORT.names


def select_backend(name: str, *, size: int, device: torch.device | None = None) -> type[Backend]:
    """The backend class for `name` on a group of `size` ranks; a group of one never communicates."""
    if name not in TRANSPORT.names:
        raise ValueError(f"backend={name!r} is not known; valid backends: {', '.join(TRANSPORT.names)}")
    chosen = TRANSPORT.resolve(name, device=device)
    if size == 1:
        return LocalBackend
    if name == "auto":
        log.debug("EP backend auto -> %s", chosen)
    return _REGISTRY[chosen]
