"""Device-initiated expert parallelism over NVSHMEM (nvshmem4py, ``pip install 'megapar[nvshmem]'``).

Three pieces on one `NvshmemBuffer` (symmetric memory, peer pointers, two `PeerChannel`s of
`parallel.ep.nvshmem_kernels`: one for dispatch traffic, one for combine traffic):

- `NvshmemConfig`: every option, typed and validated (mode "low_latency": the buffer sizes and
  the slab layout; mode "normal": the dispatcher backend's wait timeout and first region size).
- `NvshmemBuffer(group, NvshmemConfig(max_tokens=, hidden=, top_k=, num_experts=, dtype=))`: bootstraps
  NVSHMEM from the EP group that already exists (rank 0 makes the unique id, the group
  broadcasts it over gloo or NCCL, every rank calls ``nvshmem.core.init``), checks that every
  rank asked for the same sizes (ValueError on every rank otherwise, before NVSHMEM starts),
  and allocates one symmetric allocation per buffer, sized from those numbers, once. Free it
  with `destroy()` or use it as a context manager; nothing relies on ``__del__``.
- `NvshmemTransport(buffer)` (or `NvshmemTransport.create(group, config)`): low-latency mode (decode). Static shapes, no host sync, CUDA-graph
  capturable. Each token row goes once to every rank holding one of its experts, written by a
  kernel straight into that rank's receive region at row ``source_rank * max_tokens + token``
  (routing rows go to every rank, -1 where absent, so stale rows are never mistaken for new
  ones); arrival is a counter raised by an atomic and waited on by the device. It implements
  `parallel.ep.static.DeviceTransport` (``dispatch`` -> a `DeviceBatch` of W * max_tokens
  rows; ``combine`` of fp32 partial sums per row -> [T, H] fp32, summed on the token's rank)
  and, on top, DeepEP's low-latency layout: `dispatch_slab` -> ``[E_local, capacity, H]`` with
  per-expert counts on the device (rows ordered by source rank, token, k: the order of the
  host-synced slab), `combine_slab` -> the weighted fp32 sum per token. `check()` reads the
  device error word (a sync: call it where the caller synchronizes anyway) and raises naming
  the rank that never arrived, or the capacity an overflowing expert needed. Without a host
  sync, inputs are checked on the calling rank only: a call that raises there (more than
  max_tokens tokens, shapes, dtypes) raises before anything is written, on that rank alone; it
  never joined the transfer, so its peers' waits time out and their `check()` names it, and
  the ranks' buffers are out of step: build new ones on every rank. The rows' byte layout
  follows x's dtype and x_scale's width, so every rank must pass the same ones (x_scale given
  on all ranks or none); nothing can compare them without a sync.
- backend ``"nvshmem"`` of `parallel.ep.make_dispatcher` (normal mode, prefill): the census
  gives every split on the host, as for ``all_to_all``; the payload moves by device writes into
  the receivers' symmetric regions instead of NCCL, in the same order, so `DispatchResult`,
  `combine`, async handles and the backward passes are those of ``all_to_all``. Its buffer
  is allocated at first use and grown (collectively: the sizes come from the census, the
  same on every rank) when a call needs more. Options:
  ``make_dispatcher(..., backend="nvshmem", backend_config=NvshmemConfig(mode="normal", ...))``.

The keyword forms ``NvshmemBuffer(group, max_tokens=..., ...)`` and ``NvshmemTransport(buffer,
capacity=..., drop_policy=...)`` still work and warn once (DeprecationWarning).

After any error a buffer refuses further use; build a new one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from megapar.parallel import comm, impl
from megapar.parallel.ep import backends
from megapar.parallel.ep.backends import (AllToAllRoute, Backend, Census, Route, RoutingInfo, _layout_rows, _pack_rows,
                                  _unpack_rows, routing_info)
from megapar.parallel.ep.dispatch import check_int, config_from_keywords
from megapar.parallel.ep.static import DeviceBatch, int32_ids

HINT = "pip install 'megapar[nvshmem]' (nvshmem4py)"
_ALIGN = 16
DEFAULT_MAX_ITERS = int(os.environ.get("MEGAPAR_NVSHMEM_MAX_ITERS", str(1 << 22)))


def _nvs() -> Any:
    return impl.require("nvshmem.core", "the nvshmem EP backend", HINT)


def _torch_interop() -> Any:
    from nvshmem.core.interop import torch as nt

    return nt


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# ---- one NVSHMEM runtime per process -----------------------------------------------------------


class _Runtime:
    """NVSHMEM is initialized once per process, over one set of ranks; buffers count references."""

    lock = threading.Lock()
    ranks: tuple[int, ...] | None = None
    refs = 0

    @classmethod
    def acquire(cls, pg: dist.ProcessGroup | None, rank: int, size: int, device: torch.device) -> None:
        ranks = tuple(comm.group_ranks(pg)) if dist.is_initialized() else (0,)
        with cls.lock:
            if cls.ranks is not None:
                if cls.ranks != ranks:
                    raise ValueError(f"NVSHMEM is already initialized in this process over ranks {list(cls.ranks)}; "
                                     f"a buffer over ranks {list(ranks)} needs it destroyed first")
                cls.refs += 1
                return
            nvs = _nvs()
            import numpy as np

            uid_bytes = None
            if rank == 0:
                uid = nvs.get_unique_id()
                uid_bytes = bytes(uid._data.view(np.int8))
            if size > 1:
                box = [uid_bytes]
                dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0) if pg is not None else 0, group=pg)
                uid_bytes = box[0]
            if rank != 0:
                uid = nvs.get_unique_id(empty=True)
                uid._data.view(np.int8)[:] = np.frombuffer(uid_bytes, dtype=np.int8)
            kwargs: dict[str, Any] = dict(uid=uid, rank=rank, nranks=size, initializer_method="uid")
            if device.type == "cuda":
                try:
                    from cuda.core import Device
                except ImportError:
                    from cuda.core.experimental import Device
                dev = Device(device.index if device.index is not None else torch.cuda.current_device())
                dev.set_current()
                kwargs["device"] = dev
            nvs.init(**kwargs)
            cls.ranks, cls.refs = ranks, 1

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.refs -= 1
            if cls.refs == 0 and cls.ranks is not None:
                _nvs().finalize()
                cls.ranks = None


# ---- the config -----------------------------------------------------------------------------------

MODES = ("low_latency", "normal")
_SIZE_FIELDS = ("max_tokens", "hidden", "top_k", "num_experts")


@dataclass(frozen=True, kw_only=True)
class NvshmemConfig:
    """What an NVSHMEM transport is built for; identical on every EP rank (the buffer checks).

    mode "low_latency" (decode: `NvshmemBuffer` + `NvshmemTransport`): static shapes from
    max_tokens, hidden, top_k, num_experts, dtype and scale_width (all required but the last
    two); capacity and drop_policy shape the slab layout. mode "normal" (prefill: backend
    "nvshmem" of `make_dispatcher`, as its ``backend_config``): buffers are sized from each
    call's census and grown on demand, so only max_iters and min_region_bytes apply.
    """

    mode: Literal["low_latency", "normal"] = "low_latency"
    max_tokens: int | None = None
    """most tokens one rank brings to one call (low-latency rows per source rank)"""
    hidden: int | None = None
    top_k: int | None = None
    num_experts: int | None = None
    """expert slots over the whole EP group (a multiple of its size)"""
    dtype: torch.dtype | None = None
    """payload dtype (x may be as wide or narrower); None = bfloat16 in low-latency mode"""
    scale_width: int = 0
    """fp32 scales per token row dispatched with x (0: none)"""
    max_iters: int = DEFAULT_MAX_ITERS
    """wait timeout: polls of an arrival counter before the device error word names the missing rank"""
    capacity: int | None = None
    """low-latency slab rows per local expert (None: W * max_tokens, never overflows)"""
    drop_policy: Literal["drop"] | None = None
    """slab overflow: None records it for `check()` to raise, "drop" drops the last arrivals"""
    min_region_bytes: int = 1 << 20
    """normal mode: smallest receive region per channel (grown to twice a call's need)"""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"NvshmemConfig: mode={self.mode!r} is not known; valid: {', '.join(MODES)}")
        own = "NvshmemConfig"
        check_int(own, "scale_width", self.scale_width, 0)
        check_int(own, "max_iters", self.max_iters, 1)
        check_int(own, "min_region_bytes", self.min_region_bytes, 1)
        check_int(own, "capacity", self.capacity, 1, optional=True)
        if self.drop_policy not in (None, "drop"):
            raise ValueError(f"NvshmemConfig: drop_policy={self.drop_policy!r} is not known; valid: None, 'drop'")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"NvshmemConfig: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.mode == "low_latency":
            for name in _SIZE_FIELDS:
                check_int(own, name, getattr(self, name), 1)
            if self.dtype is None:
                object.__setattr__(self, "dtype", torch.bfloat16)
            return
        given = [f"{n}={getattr(self, n)!r}" for n in _SIZE_FIELDS + ("dtype", "capacity", "drop_policy")
                 if getattr(self, n) is not None] + ([f"scale_width={self.scale_width}"] if self.scale_width else [])
        if given:
            raise ValueError(f"NvshmemConfig(mode='normal'): {', '.join(given)} apply to mode='low_latency' only "
                             "(normal mode sizes its buffers from each call's census; the dispatcher has its own "
                             "layout options); set only max_iters and min_region_bytes")


_BUFFER_KEYWORDS = ("max_tokens", "hidden", "top_k", "num_experts", "dtype", "scale_width", "max_iters")
_TRANSPORT_KEYWORDS = ("capacity", "drop_policy")


# ---- the buffer -----------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class BufferSizes:
    """What one buffer is sized for (identical on every rank)."""

    max_tokens: int  # most tokens one rank brings to one call
    hidden: int
    top_k: int
    num_experts: int
    dtype: str  # payload dtype name (e.g. "bfloat16", "float8_e4m3fn")
    scale_width: int  # fp32 scales per token row (0: none)
    dispatch_bytes: int  # receive region of the dispatch channel
    combine_bytes: int  # receive region of the combine channel

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def dispatch_row_bytes(self) -> int:
        """One token row: x | scales | ids int32 | weights fp32, each 16-byte aligned."""
        return (_align(self.hidden * self.element_size) + (_align(4 * self.scale_width) if self.scale_width else 0)
                + 2 * _align(4 * self.top_k))

    @property
    def combine_row_bytes(self) -> int:
        """One partial-sum row: fp32 [H] (+ fp32 [K] weight gradients in backward)."""
        return _align(4 * self.hidden) + _align(4 * self.top_k)


class NvshmemBuffer:
    """Symmetric buffers and channels for one EP group (module docstring)."""

    def __init__(self, group: Any, config: NvshmemConfig | None = None, *, device: torch.device | str | None = None,
                 _region_bytes: tuple[int, int] | None = None, **options: Any) -> None:
        """config: a low-latency `NvshmemConfig` (its sizes; the slab options are read by
        `NvshmemTransport`). The keywords max_tokens, hidden, top_k, num_experts, dtype,
        scale_width, max_iters instead of a config are the deprecated form."""
        config = config_from_keywords("NvshmemBuffer", config, options, _BUFFER_KEYWORDS, NvshmemConfig,
                                      lambda kw: NvshmemConfig(**kw), "an NvshmemConfig(max_tokens=, hidden=, ...)")
        if not isinstance(config, NvshmemConfig):
            raise ValueError(f"NvshmemBuffer needs an NvshmemConfig, got {config!r}")
        if config.mode != "low_latency":
            raise ValueError("NvshmemBuffer: config.mode='normal' is the dispatcher backend's "
                             "(make_dispatcher(..., backend='nvshmem', backend_config=config)); a buffer needs "
                             "mode='low_latency' with its sizes")
        pg, rank, size = comm.resolve_group(group)
        max_tokens, hidden, top_k, num_experts = (getattr(config, n) for n in _SIZE_FIELDS)
        scale_width, max_iters, dtype = config.scale_width, config.max_iters, config.dtype
        assert dtype is not None
        if num_experts % size:
            raise ValueError(f"NvshmemBuffer: num_experts ({num_experts}) must be a multiple of the EP group size "
                             f"({size})")
        self.config = config
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
        self.device = torch.device(device)
        self.group, self.rank, self.size = pg, rank, size
        probe = BufferSizes(max_tokens, hidden, top_k, num_experts, _dtype_name(dtype), scale_width, 0, 0)
        rows = size * max_tokens
        d_bytes, c_bytes = _region_bytes or (rows * probe.dispatch_row_bytes, rows * probe.combine_row_bytes)
        self.sizes = BufferSizes(max_tokens, hidden, top_k, num_experts, _dtype_name(dtype), scale_width,
                                 _align(d_bytes), _align(c_bytes))
        self.max_iters = max_iters
        self._error: str | None = None
        self._heap: torch.Tensor | None = None
        self._peers: list[torch.Tensor] = []
        if size > 1:  # every rank the same sizes, or every rank raises (before NVSHMEM starts)
            everyone: list[Any] = [None] * size
            dist.all_gather_object(everyone, self.sizes, group=pg)
            differ = [r for r, s in enumerate(everyone) if s != everyone[0]]
            if differ:
                table = "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
                raise ValueError(f"[rank {rank}] NvshmemBuffer: ranks {differ} asked for different buffer sizes than "
                                 f"rank 0; every EP rank must pass the same sizes ({table})")
        _Runtime.acquire(pg, rank, size, self.device)
        try:
            self._allocate()
        except BaseException:
            _Runtime.release()
            raise

    def _allocate(self) -> None:
        w, s = self.size, self.sizes
        counters = 4 * w * 8  # per channel: arrive [W], free [W] int64
        total = s.dispatch_bytes + s.combine_bytes + counters
        nt = _torch_interop()
        words = nt.tensor((total // 8,), dtype=torch.int64)  # total is 16-byte aligned
        heap = words.view(torch.uint8)
        words.zero_()
        if heap.is_cuda:
            torch.cuda.synchronize(heap.device)
        if w > 1:
            dist.barrier(group=self.group)  # every rank's counters are zero before anyone signals
        self._heap, self._words = heap, words
        self._peers = [words if r == self.rank else nt.get_peer_tensor(words, r) for r in range(w)]
        bases = torch.tensor([p.data_ptr() for p in self._peers], dtype=torch.int64, device=heap.device)
        self.err = torch.zeros(1, dtype=torch.int64, device=heap.device)
        self.dropped = torch.zeros(1, dtype=torch.int64, device=heap.device)  # slab rows over capacity
        from megapar.parallel.ep.nvshmem_kernels import PeerChannel

        def counter(at: int) -> tuple[torch.Tensor, torch.Tensor]:
            return heap[at:at + 8 * w].view(torch.int64), bases + at

        off = s.dispatch_bytes + s.combine_bytes
        self.channels: list[PeerChannel] = []
        for c, (start, nbytes) in enumerate(((0, s.dispatch_bytes), (s.dispatch_bytes, s.combine_bytes))):
            arrive, arrive_ptrs = counter(off + 16 * w * c)
            free, free_ptrs = counter(off + 16 * w * c + 8 * w)
            self.channels.append(PeerChannel(
                rank=self.rank, size=w, region=heap[start:start + nbytes], region_ptrs=bases + start,
                arrive=arrive, arrive_ptrs=arrive_ptrs, free=free, free_ptrs=free_ptrs,
                epoch=torch.zeros(1, dtype=torch.int64, device=heap.device), err=self.err,
                max_iters=self.max_iters))

    # -- lifetime -------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._heap is not None

    def destroy(self) -> None:
        """Free the symmetric memory (every rank must call it; collective in NVSHMEM)."""
        if self._heap is None:
            return
        words, self._heap, self._words, self._peers, self.channels = self._words, None, None, [], []
        if words.is_cuda:
            torch.cuda.synchronize(words.device)
        _torch_interop().free_tensor(words)
        _Runtime.release()

    def __enter__(self) -> "NvshmemBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._heap is None else (f"failed: {self._error}" if self._error else "ready")
        return f"NvshmemBuffer(rank {self.rank}/{self.size}, {self.sizes}, {state})"

    # -- errors ---------------------------------------------------------------------------------

    def usable(self) -> None:
        """Raise if the buffer was destroyed or saw an error (it then refuses further use)."""
        if self._heap is None:
            raise ValueError("this NvshmemBuffer was destroyed; build a new one")
        if self._error is not None:
            raise RuntimeError(f"[rank {self.rank}] this NvshmemBuffer failed earlier ({self._error}); "
                               "destroy it and build a new one")

    def check(self) -> None:
        """Read the device error word and the slab overflow count (one sync) and raise on either."""
        self.usable()
        word, dropped = torch.cat([self.err, self.dropped]).tolist()
        if word:
            from megapar.parallel.ep.nvshmem_kernels import describe_error

            self._error = describe_error(int(word))
            raise RuntimeError(f"[rank {self.rank}] NVSHMEM EP transfer failed: {self._error}; this buffer "
                               "refuses further use (build a new one)")
        if dropped:
            self.dropped.zero_()
            raise ValueError(f"[rank {self.rank}] slab capacity was too small: {int(dropped)} (token, expert) rows "
                             "over capacity were dropped; build the transport with a larger capacity, or "
                             "drop_policy='drop'")

    def fail(self, why: str) -> None:
        self._error = why


# ---- low-latency mode ------------------------------------------------------------------------------


@dataclass
class NvshmemBatch(DeviceBatch):
    """A `DeviceBatch` of W * max_tokens rows (row s * max_tokens + t: token t of rank s)."""

    x_scale: torch.Tensor | None = None  # [N, S] fp32 scales dispatched with x
    present: torch.Tensor | None = None  # [T, W] bool: this rank's token t was sent to rank d


@dataclass
class SlabHandle:
    batch: NvshmemBatch
    slab_pos: torch.Tensor  # [N, K] int64: slab row of each received pair, -1 = none / dropped
    out_dtype: torch.dtype | None


@dataclass
class SlabDispatch:
    """DeepEP low-latency layout: local expert e's rows are x[e, :counts[e]]."""

    x: torch.Tensor  # [E_local, capacity, H]
    x_scale: torch.Tensor | None  # [E_local, capacity, S]
    counts: torch.Tensor  # [E_local] int32 (device)
    topk_weights: torch.Tensor  # [E_local, capacity] fp32, 0 on padding
    expert_ids: torch.Tensor  # [E_local, capacity] int32, -1 = padding
    handle: SlabHandle


class NvshmemTransport:
    """Low-latency dispatch/combine on a buffer (module docstring). The slab options come from
    `config` (default: the buffer's): capacity = slab rows per local expert (None: W * max_tokens,
    never overflows with distinct experts per token), drop_policy = None (an overflow is recorded
    and raised by `check()`) or "drop". A config given here must describe the buffer (only its
    slab options may differ): one buffer serves transports of several capacities."""

    def __init__(self, buffer: NvshmemBuffer, config: NvshmemConfig | None = None, **options: Any) -> None:
        config = config_from_keywords("NvshmemTransport", config, options, _TRANSPORT_KEYWORDS, NvshmemConfig,
                                      lambda kw: replace(buffer.config, **kw),
                                      "replace(buffer.config, capacity=, drop_policy=) as its config")
        if config is None:
            config = buffer.config
        elif not isinstance(config, NvshmemConfig):
            raise ValueError(f"NvshmemTransport needs an NvshmemConfig, got {config!r}")
        slab = {f: None for f in _TRANSPORT_KEYWORDS}
        if replace(config, **slab) != replace(buffer.config, **slab):
            differ = [f.name for f in fields(NvshmemConfig) if f.name not in _TRANSPORT_KEYWORDS
                      and getattr(config, f.name) != getattr(buffer.config, f.name)]
            raise ValueError(f"NvshmemTransport: the config differs from its buffer's in {differ} (only "
                             f"{', '.join(_TRANSPORT_KEYWORDS)} may differ); build a buffer for it")
        s = buffer.sizes
        self.buffer, self.config = buffer, config
        self.experts_per_rank = s.num_experts // buffer.size
        self.capacity = buffer.size * s.max_tokens if config.capacity is None else config.capacity
        self.drop_policy = config.drop_policy
        self._index: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}

    @classmethod
    def create(cls, group: Any, config: NvshmemConfig, *, device: torch.device | str | None = None
               ) -> "NvshmemTransport":
        """A transport on a new buffer for `config` (free it with ``transport.buffer.destroy()``)."""
        return cls(NvshmemBuffer(group, config, device=device))

    def _static_index(self, t: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Index tensors that depend only on T (cached: CUDA-graph replays reuse them)."""
        key = (t, str(device))
        if key not in self._index:
            w, tm, me = self.buffer.size, self.buffer.sizes.max_tokens, self.buffer.rank
            ranks = torch.arange(w, device=device)
            tok = torch.arange(tm, device=device)
            meta_src = tok.repeat(w)  # [W * Tm], destination-major
            meta_rank = ranks.repeat_interleave(tm)
            meta_row = me * tm + meta_src
            x_src = torch.arange(t, device=device).repeat_interleave(w)  # [T * W], token-major
            x_rank = ranks.repeat(t)
            n = torch.arange(w * tm, device=device)
            self._index[key] = (meta_src, meta_rank, meta_row, x_src, x_rank, me * tm + x_src, n, n // tm,
                                me * tm + n % tm)
        return self._index[key]

    def _check(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               x_scale: torch.Tensor | None) -> None:
        s = self.buffer.sizes
        if x.dim() != 2 or x.shape[1] != s.hidden:
            raise ValueError(f"x must be [T, H={s.hidden}], got {tuple(x.shape)}")
        t = x.shape[0]
        if t > s.max_tokens:
            raise ValueError(f"{t} tokens exceed the buffer's max_tokens ({s.max_tokens}); build the NvshmemBuffer "
                             f"with max_tokens >= {t}")
        if topk_ids.shape != (t, s.top_k) or topk_weights.shape != (t, s.top_k):
            raise ValueError(f"topk_ids/topk_weights must be [T={t}, K={s.top_k}], got {tuple(topk_ids.shape)} / "
                             f"{tuple(topk_weights.shape)}")
        if x.element_size() > s.element_size:
            raise ValueError(f"x dtype {x.dtype} ({x.element_size()} bytes) is wider than the buffer's payload dtype "
                             f"{s.dtype} ({s.element_size} bytes)")
        width = 0 if x_scale is None else x_scale.shape[-1]
        if width > s.scale_width or (x_scale is not None and x_scale.shape != (t, width)):
            raise ValueError(f"x_scale {None if x_scale is None else tuple(x_scale.shape)} does not fit the buffer "
                             f"(scale_width={s.scale_width}, T={t})")

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scale: torch.Tensor | None = None) -> NvshmemBatch:
        """x: [T, H]; topk_ids [T, K] global ids (-1 = none); topk_weights [T, K] -> a batch of
        N = W * max_tokens rows (row s * max_tokens + t: token t of rank s; rows of tokens with
        no expert here hold stale x and are never read: their ids here are all off this rank).
        Every rank calls it (T = 0 included) with the same x dtype and x_scale width; a ValueError
        (T > max_tokens, shapes) is raised on this rank alone, before any write (module docstring)."""
        buf = self.buffer
        buf.usable()
        self._check(x, topk_ids, topk_weights, x_scale)
        w, tm, e_total = buf.size, buf.sizes.max_tokens, buf.sizes.num_experts
        t = x.shape[0]
        ids = torch.full((tm, topk_ids.shape[1]), -1, dtype=torch.int32, device=x.device)
        topk_ids = int32_ids(topk_ids)     # (out of range stays out of range: `present` below counts it)
        ids[:t] = topk_ids
        weights = torch.zeros(tm, topk_ids.shape[1], dtype=torch.float32, device=x.device)
        weights[:t] = topk_weights
        xs = [x] + ([x_scale.float()] if x_scale is not None else [])
        pad = [torch.zeros((tm - t, p.shape[1]), dtype=p.dtype, device=x.device) for p in xs] if tm > t else []
        pieces = [torch.cat([p, q]) if pad else p for p, q in zip(xs, pad or xs)] + [ids, weights]
        packed, specs = _pack_rows(pieces)  # [Tm, B]
        row_bytes = packed.shape[1]
        meta_col = specs[-2].offset
        ch = buf.channels[0]
        ch.check_rows(w * tm, row_bytes, "nvshmem dispatch")
        present = routing_info(topk_ids, e_total, w).present  # [T, W]
        meta_src, meta_rank, meta_row, x_src, x_rank, x_row, *_ = self._static_index(t, x.device)
        ch.begin()
        ch.put(packed, meta_src, meta_rank, meta_row, row_bytes, (meta_col, row_bytes))
        ch.put(packed, x_src, x_rank, torch.where(present.reshape(-1), x_row, -1), row_bytes, (0, meta_col))
        ch.post()
        recv = _unpack_rows(ch.receive(w * tm, row_bytes), specs)
        return NvshmemBatch(x=recv[0].contiguous(), topk_ids=recv[-2].contiguous(),
                            topk_weights=recv[-1].contiguous(), num_tokens=t,
                            x_scale=recv[1].contiguous() if x_scale is not None else None, present=present)

    def combine(self, partial: torch.Tensor, batch: DeviceBatch) -> torch.Tensor:
        """partial: [N, H] fp32 partial sums of the batch's rows -> [T, H] fp32 on the tokens' rank."""
        assert isinstance(batch, NvshmemBatch) and batch.present is not None
        buf = self.buffer
        buf.usable()
        w, tm, h = buf.size, buf.sizes.max_tokens, buf.sizes.hidden
        if partial.shape != (w * tm, h):
            raise ValueError(f"partial must be [N={w * tm}, H={h}], got {tuple(partial.shape)}")
        row_bytes = 4 * h
        ch = buf.channels[1]
        ch.check_rows(w * tm, row_bytes, "nvshmem combine")
        first = buf.rank * self.experts_per_rank
        ids = batch.topk_ids
        mine = ((ids >= first) & (ids < first + self.experts_per_rank)).any(1)  # [N]: row has an expert here
        *_, n, n_rank, n_row = self._static_index(batch.num_tokens, partial.device)
        rows = partial.float().contiguous().view(torch.uint8).view(w * tm, row_bytes)
        ch.begin()
        ch.put(rows, n, n_rank, torch.where(mine, n_row, -1), row_bytes)
        ch.post()
        back = ch.receive(w * tm, row_bytes).view(torch.float32).view(w, tm, h)[:, :batch.num_tokens]
        present = batch.present.t()[:, :, None]  # [W, T, 1]
        return torch.where(present, back, torch.zeros((), device=back.device)).sum(0)

    def dispatch_slab(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      x_scale: torch.Tensor | None = None) -> SlabDispatch:
        """DeepEP low-latency dispatch: [E_local, capacity, H] slabs and device counts."""
        from megapar.parallel.ep.layout import gather_rows
        from megapar.parallel.ep.static import plan_static

        batch = self.dispatch(x, topk_ids, topk_weights, x_scale)
        buf, el, cap = self.buffer, self.experts_per_rank, self.capacity
        first = buf.rank * el
        plan = plan_static(batch.topk_ids, el, first_slot=first, num_slots_total=buf.sizes.num_experts)
        n, k = batch.topk_ids.shape
        e = (batch.topk_ids.long() - first).clamp(0, el - 1)
        j = plan.pair_pos - plan.offsets.long()[e]  # rank of the pair within its expert
        keep = (plan.pair_pos >= 0) & (j < cap)
        slab_pos = torch.where(keep, e * cap + j, -1)  # [N, K]
        target = torch.where(keep, slab_pos, el * cap).reshape(-1)
        rows = el * cap
        row_src = torch.full((rows + 1,), -1, dtype=torch.int64, device=x.device).scatter_(
            0, target, torch.arange(n, device=x.device).repeat_interleave(k))[:rows]
        w_slab = torch.zeros(rows + 1, dtype=torch.float32, device=x.device).scatter_(
            0, target, batch.topk_weights.reshape(-1).float())[:rows]
        e_slab = torch.full((rows + 1,), -1, dtype=torch.int64, device=x.device).scatter_(0, target, e.reshape(-1))
        over = (plan.counts.long() - cap).clamp(min=0).sum()
        if self.drop_policy is None:
            buf.dropped += over
        payload = batch.x.view(torch.uint8) if comm.needs_wire(batch.x.dtype) else batch.x
        x_slab = gather_rows(payload, row_src).view(batch.x.dtype).view(el, cap, -1)
        s_slab = gather_rows(batch.x_scale, row_src).view(el, cap, -1) if batch.x_scale is not None else None
        out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
        return SlabDispatch(x=x_slab, x_scale=s_slab, counts=plan.counts.clamp(max=cap),
                            topk_weights=w_slab.view(el, cap), expert_ids=e_slab[:rows].to(torch.int32).view(el, cap),
                            handle=SlabHandle(batch, slab_pos, out_dtype))

    def combine_slab(self, expert_out: torch.Tensor, handle: SlabHandle, *, weighted: bool = False) -> torch.Tensor:
        """expert_out: [E_local, capacity, H] -> [T, H] (sum_k w_k y_k in fp32, then the x dtype;
        expert_out's dtype for quantized x). weighted: the rows are already multiplied by w."""
        from megapar.parallel.ep.layout import gather_reduce

        el, cap, h = self.experts_per_rank, self.capacity, self.buffer.sizes.hidden
        if tuple(expert_out.shape) != (el, cap, h):
            raise ValueError(f"expert_out must be [E_local={el}, capacity={cap}, H={h}], got {tuple(expert_out.shape)}")
        batch = handle.batch
        weights = None if weighted else batch.topk_weights
        partial = gather_reduce(expert_out.reshape(el * cap, h), handle.slab_pos, weights, torch.float32)
        return self.combine(partial, batch).to(handle.out_dtype or expert_out.dtype)

    def check(self) -> None:
        self.buffer.check()


# ---- normal mode: a Dispatcher backend --------------------------------------------------------------


class NvshmemRoute(AllToAllRoute):
    """The all-to-all route with the payload written into the receivers' symmetric regions."""

    def __init__(self, info: RoutingInfo, census: Census, backend: "NvshmemBackend") -> None:
        super().__init__(info, census, group=backend.group, rank=backend.rank, size=backend.size)
        self.backend = backend
        w, me, rows = backend.size, backend.rank, census.rows
        device = info.dest.device
        # send row j to d lands at d's row sum_{s < me} rows[s][d] + (j - first send row to d)
        dest_rank, dest_row, recv_rank, recv_row = [], [], [], []
        for d in range(w):
            base = sum(rows[s][d] for s in range(me))
            dest_rank += [d] * rows[me][d]
            dest_row += range(base, base + rows[me][d])
        for s in range(w):  # received row i from s goes back to s's send row sum_{d < me} rows[s][d] + i
            base = sum(rows[s][d] for d in range(me))
            recv_rank += [s] * rows[s][me]
            recv_row += range(base, base + rows[s][me])
        as_t = lambda v: torch.tensor(v, dtype=torch.int64).to(device)  # noqa: E731
        self.dest_rank, self.dest_row = as_t(dest_rank), as_t(dest_row)
        self.recv_rank, self.recv_row = as_t(recv_rank), as_t(recv_row)
        self.most_recv = max(sum(rows[s][d] for s in range(w)) for d in range(w))  # rows any rank receives
        self.most_send = max(sum(r) for r in rows)

    def _transfer(self, channel: int, rows: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
                  num_in: int, most: int) -> torch.Tensor:
        buf = self.backend.buffer_for(channel, most * rows.shape[1])
        ch = buf.channels[channel]
        ch.begin()
        ch.put(rows, torch.arange(rows.shape[0], device=rows.device), dest_rank, dest_row, rows.shape[1])
        ch.post()
        out = ch.receive(num_in, rows.shape[1])
        buf.check()  # normal mode may sync: a rank that never arrived raises here
        return out

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> Any:
        rows, specs = _pack_rows(pieces, self.send_token)
        out = self._transfer(0, rows.contiguous(), self.dest_rank, self.dest_row, self.num_recv, self.most_recv)
        return backends._done(_unpack_rows(out, specs))

    def reduce(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> Any:
        from megapar.parallel.ep.layout import gather_reduce, scatter_add_rows

        packed, specs = _pack_rows(pieces)
        out = self._transfer(1, packed.contiguous(), self.recv_rank, self.recv_row, len(self.send_token),
                             self.most_send)
        back = _unpack_rows(out, specs)  # [n_send, C_i]
        if back and back[0].device.type == "cpu":
            return backends._done([scatter_add_rows(p, self.send_token, self.num_tokens, None, torch.float32)
                                   for p in back])
        return backends._done([gather_reduce(p, self.slot, None, torch.float32) for p in back])


class NvshmemBackend(Backend):
    """Dispatcher backend "nvshmem" (normal mode): its buffer is allocated at first use and grown
    collectively when a call needs more (the sizes come from the census: equal on every rank).
    config: an `NvshmemConfig(mode="normal")` (make_dispatcher's ``backend_config``)."""

    name = "nvshmem"
    config_type = NvshmemConfig

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 config: NvshmemConfig | None = None) -> None:
        super().__init__(group, rank, size)
        self.config = NvshmemConfig(mode="normal") if config is None else config
        self.check_config(self.config)
        self.buffer: NvshmemBuffer | None = None

    @staticmethod
    def check_config(config: NvshmemConfig) -> None:
        if config.mode != "normal":
            raise ValueError(f"backend 'nvshmem' of make_dispatcher runs in normal mode; got NvshmemConfig(mode="
                             f"{config.mode!r}): pass NvshmemConfig(mode='normal', max_iters=...) (the low-latency "
                             "mode is NvshmemTransport, or MoELayer(transport='nvshmem'))")

    def route(self, info: RoutingInfo, census: Census) -> Route:
        return NvshmemRoute(info, census, self)

    def buffer_for(self, channel: int, nbytes: int) -> NvshmemBuffer:
        buf = self.buffer
        if buf is not None:
            buf.usable()
            have = (buf.sizes.dispatch_bytes, buf.sizes.combine_bytes)
            if have[channel] >= nbytes:
                return buf
            need = tuple(max(h, 2 * nbytes if c == channel else h) for c, h in enumerate(have))
        else:
            need = tuple(max(self.config.min_region_bytes, 2 * nbytes) for _ in range(2))
        # the new buffer first: NVSHMEM stays initialized (its reference count never drops to 0)
        sizes = NvshmemConfig(max_tokens=1, hidden=1, top_k=1, num_experts=self.size, dtype=torch.uint8,
                              max_iters=self.config.max_iters)
        self.buffer = NvshmemBuffer(self.group, sizes, _region_bytes=need)  # type: ignore[arg-type]
        if buf is not None:
            buf.destroy()
        return self.buffer

    def destroy(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None


def _usable_here(f: impl.Facts) -> impl.Unusable | None:
    if impl.cuda_available() or (f.asked and impl.interpreting()):
        return None
    return impl.Unusable("needs CUDA (device-initiated transfers; tests: TRITON_INTERPRET=1 and asked by name)")


CHECK = impl.all_of(impl.needs_package("nvshmem.core", HINT), impl.needs_triton, _usable_here)


def register() -> None:
    """Make "nvshmem" a `make_dispatcher` backend (not chosen by "auto": it is asked for by name)."""
    backends.register_backend("nvshmem", NvshmemBackend, check=CHECK, auto=False)
