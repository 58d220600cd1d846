"""DeepEP's `Buffer` behind the EP contract (``pip install 'megapar[deepep]'``, import name `deep_ep`).

- backend ``"deepep"`` of `parallel.ep.make_dispatcher` (normal mode): the first ``send`` of a
  route is DeepEP's dispatch (``get_dispatch_layout`` then ``dispatch`` with x, or (x, scales)
  for FP8, topk ids and weights); DeepEP's handle is kept on the route, so later sends (the
  backward of combine) are cached dispatches (``dispatch(t, handle=...)``) and ``reduce`` is
  ``combine(t, handle)``. DeepEP returns received rows ordered by source rank then token and
  local expert ids (-1 off this rank), which are turned back into global ids, so the layout,
  combine and backward passes are those of ``all_to_all``. DeepEP combines bf16 only: partial
  sums travel as bf16; the router weights' gradients (dispatch's backward) travel in fp32 as
  combine's ``topk_weights``, which DeepEP sums across ranks like the rows. Payloads DeepEP
  asserts against (x_scale beside x wider than one byte, scales not fp32/int32, K > 32) are
  refused by the dispatcher's census on every rank (`DeepEPBackend.payload_error`).
- `DeepEPLowLatency`: ``low_latency_dispatch`` -> ``[E_local, W * max_tokens, H]`` (DeepEP's
  layout) with per-expert counts, and ``low_latency_combine``.

Options are one `DeepEPConfig` (the arguments of DeepEP's ``Buffer``, plus the low-latency
sizes): ``make_dispatcher(..., backend="deepep", backend_config=DeepEPConfig(num_nvl_bytes=...))``
and ``DeepEPLowLatency(group, DeepEPConfig(low_latency_mode=True, max_dispatch_tokens_per_rank=,
hidden=, num_experts=))``. The keyword form ``DeepEPLowLatency(group, max_tokens=, hidden=,
num_experts=, use_fp8=)`` still works and warns once (DeprecationWarning).

Every ``Buffer`` is made with ``explicitly_destroy=True``, so that ``destroy()`` (of the backend,
or of `DeepEPLowLatency`) frees it at a point every rank reaches together; DeepEP's ``destroy``
refuses buffers made without that flag, and its destructor-time release runs a barrier across
ranks that can hang at interpreter exit.

Status: the PyPI build `deepinfer-ep` (DeepEP V2) needs CUDA >= 13.1 and NCCL >= 2.32.3, and
V2's buffer runs over an NCCL communicator, which refuses two ranks on one GPU; the GPU machine
(one H200, CUDA 13.0, NCCL 2.28.9) has neither. This module is tested with a fake `deep_ep` that
checks the calls and shapes it receives. DeepEP's last pre-V2 source (commit 567632d: the same
``Buffer`` API, NVSHMEM optional) can be built there and run with two ranks on the one GPU under
MPS (its intranode kernels share buffers through CUDA IPC): bench/fetch_deepep.sh and
bench/run_deepep_mpg.sh (docs/gpu.md). Built that way, it passes this project's DeepEP GPU tests,
normal and low-latency mode (the latter captured in a CUDA graph), two ranks on one GPU: on the H200
and, on 2026-12-05, on an H100 (docs/gpu.md §37). NVLink runs across GPUs have not been made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megapar.parallel import impl
from megapar.parallel.ep import backends
from megapar.parallel.ep.backends import Backend, Census, Route, RoutingInfo
from megapar.parallel.ep.dispatch import check_int, config_from_keywords

HINT = ("pip install 'megapar[deepep]' (deepinfer-ep: needs CUDA >= 13.1, NCCL >= 2.32.3), or build DeepEP's "
        "pre-V2 source (commit 567632d) with `python setup.py build_ext --inplace` (bench/run_deepep_mpg.sh)")
NVL_BYTES = int(os.environ.get("MEGAPAR_DEEPEP_NVL_BYTES", str(1 << 30)))
"""normal mode's default NVLink buffer bytes (read once at import)"""

_LOW_LATENCY_FIELDS = ("max_dispatch_tokens_per_rank", "hidden", "num_experts")


@dataclass(frozen=True, kw_only=True)
class DeepEPConfig:
    """How a DeepEP ``Buffer`` is made; identical on every EP rank.

    low_latency_mode False: backend "deepep" of `make_dispatcher` (its ``backend_config``); the
    dispatcher knows the experts and hidden size, so only the Buffer's sizes apply. True:
    `DeepEPLowLatency` (decode), which needs max_dispatch_tokens_per_rank, hidden and num_experts.
    """

    low_latency_mode: bool = False
    num_nvl_bytes: int | None = None
    """NVLink buffer bytes; None: `NVL_BYTES` (1 GiB, MEGAPAR_DEEPEP_NVL_BYTES) normal, 0 low-latency"""
    num_rdma_bytes: int | None = None
    """RDMA buffer bytes; None: 0 normal, DeepEP's ``get_low_latency_rdma_size_hint`` low-latency"""
    num_qps_per_rank: int | None = None
    """None: experts per rank in low-latency mode (as DeepEP's tests), DeepEP's default in normal mode"""
    max_dispatch_tokens_per_rank: int | None = None
    """low-latency: most tokens one rank dispatches per call (static shapes)"""
    hidden: int | None = None
    num_experts: int | None = None
    """low-latency: expert slots over the whole EP group"""
    use_fp8: bool = False
    """low-latency: dispatch FP8 (DeepEP quantizes; the slab is (fp8, scales))"""

    def __post_init__(self) -> None:
        own = "DeepEPConfig"
        for name in ("low_latency_mode", "use_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{own}: {name} must be True or False, got {getattr(self, name)!r}")
        check_int(own, "num_nvl_bytes", self.num_nvl_bytes, 0, optional=True)
        check_int(own, "num_rdma_bytes", self.num_rdma_bytes, 0, optional=True)
        check_int(own, "num_qps_per_rank", self.num_qps_per_rank, 1, optional=True)
        if self.low_latency_mode:
            for name in _LOW_LATENCY_FIELDS:
                check_int(own, name, getattr(self, name), 1)
            return
        given = [f"{n}={getattr(self, n)!r}" for n in _LOW_LATENCY_FIELDS if getattr(self, n) is not None]
        given += ["use_fp8=True"] if self.use_fp8 else []
        if given:
            raise ValueError(f"{own}(low_latency_mode=False): {', '.join(given)} apply to low_latency_mode=True "
                             "only (the dispatcher has its own experts and hidden size)")

    def buffer_args(self, group: Any, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) of ``deep_ep.Buffer`` for an EP group of `size` ranks."""
        kwargs: dict[str, Any] = {"explicitly_destroy": True}  # freed by destroy() (module docstring)
        if self.low_latency_mode:
            assert self.num_experts is not None
            nvl = 0 if self.num_nvl_bytes is None else self.num_nvl_bytes
            rdma = self.num_rdma_bytes
            if rdma is None:
                rdma = _deep_ep().Buffer.get_low_latency_rdma_size_hint(self.max_dispatch_tokens_per_rank,
                                                                        self.hidden, size, self.num_experts)
            kwargs["low_latency_mode"] = True
            kwargs["num_qps_per_rank"] = (self.num_experts // size if self.num_qps_per_rank is None
                                          else self.num_qps_per_rank)
        else:
            nvl = NVL_BYTES if self.num_nvl_bytes is None else self.num_nvl_bytes
            rdma = 0 if self.num_rdma_bytes is None else self.num_rdma_bytes
            if self.num_qps_per_rank is not None:
                kwargs["num_qps_per_rank"] = self.num_qps_per_rank
        return (group, nvl, rdma), kwargs


def _deep_ep() -> Any:
    return impl.require("deep_ep", "the deepep EP backend", HINT)


# DeepEP's SM90 intranode dispatch copies each row as two halves of int4s through a TMA buffer
# of 8 KiB per warp (EP_DEVICE_ASSERT in its intranode.cu): a row that is not a multiple of 32
# bytes, or whose half (+ an 8-byte mbarrier) exceeds 8 KiB, traps the kernel ("unspecified
# launch failure", seen on the H200 with 8 bf16 values a row).
ROW_ALIGN, MAX_ROW_BYTES = 32, 2 * (8192 - 8)
MAX_TOP_K = 32  # EP_DEVICE_ASSERT(num_topk <= 32) in its dispatch and combine kernels


def row_bytes_error(x: torch.Tensor) -> str | None:
    """Why DeepEP's dispatch cannot take x's rows, or None."""
    nbytes = x.shape[-1] * x.element_size()
    if nbytes % ROW_ALIGN or nbytes > MAX_ROW_BYTES:
        return (f"DeepEP's intranode dispatch needs rows of a multiple of {ROW_ALIGN} bytes and at most "
                f"{MAX_ROW_BYTES}; got hidden {x.shape[-1]} x {x.element_size()} B ({x.dtype}) = {nbytes} B")
    return None


def check_row_bytes(x: torch.Tensor) -> None:
    error = row_bytes_error(x)
    if error is not None:
        raise ValueError(error)


class DeepEPRoute(Route):
    """One routing through a DeepEP buffer (module docstring)."""

    def __init__(self, info: RoutingInfo, census: Census, backend: "DeepEPBackend") -> None:
        self.backend = backend
        self.num_tokens = info.dest.shape[0]
        self.num_recv = sum(census.rows[s][backend.rank] for s in range(backend.size))
        self.num_experts = len(census.expert_pairs)
        self.handle: Any = None
        self.top_k: int | None = None  # K and the bytes of one x row, set by the first send
        self.row_bytes = 0

    def reduce_dtype(self, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16  # DeepEP's combine takes bf16

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> Any:
        buf = self.backend.buffer
        if self.handle is not None:  # cached dispatch along the first one's routing
            return backends._done([buf.dispatch(p, handle=self.handle)[0] for p in pieces])
        # DeepEP asserts contiguous x, scales, ids and weights (buffer.hpp); the dispatcher takes any strides
        x, ids, weights = pieces[0].contiguous(), pieces[-2].long().contiguous(), pieces[-1].float().contiguous()
        scale = pieces[1].contiguous() if len(pieces) == 4 else None
        check_row_bytes(x)  # the dispatcher checked it before its census (DeepEPBackend.input_error)
        self.top_k, self.row_bytes = ids.shape[1], x.shape[1] * x.element_size()
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, self.num_experts)
        recv_x, recv_ids, recv_w, _, self.handle, _ = buf.dispatch(
            (x, scale) if scale is not None else x, topk_idx=ids, topk_weights=weights,
            num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        recv_scale = None
        if isinstance(recv_x, tuple):
            recv_x, recv_scale = recv_x
        if recv_x.shape[0] != self.num_recv:
            raise RuntimeError(f"DeepEP dispatch returned {recv_x.shape[0]} rows; the census expects {self.num_recv}")
        first = self.backend.rank * (self.num_experts // self.backend.size)
        global_ids = torch.where(recv_ids >= 0, recv_ids + first, torch.full_like(recv_ids, -1)).to(torch.int32)
        return backends._done([recv_x] + ([recv_scale] if recv_scale is not None else []) + [global_ids, recv_w])

    def reduce(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> Any:
        """DeepEP's combine sums the rows sent back, without weights: the hidden-wide partial sums
        travel as bf16 (`reduce_dtype`). The fp32 [n_recv, K] piece of dispatch's backward (the
        router weights' gradients, always last) travels as combine's ``topk_weights``, which
        DeepEP sums the same way in fp32: as bf16 rows it lost precision, and DeepEP refuses rows
        of K bf16 values unless 2K bytes are whole int4s (K = 2: 4 bytes)."""
        buf = self.backend.buffer
        pieces = list(pieces)
        weights = None
        if pieces and pieces[-1].dtype == torch.float32 and pieces[-1].dim() == 2 \
                and pieces[-1].shape[1] == self.top_k:
            weights = pieces.pop().contiguous()
        rows = [p.to(torch.bfloat16).contiguous() for p in pieces]
        if weights is None:
            return backends._done([buf.combine(r, self.handle)[0].float() for r in rows])
        # the weights ride on the last rows' combine; alone, on rows of zeros (the dispatched x's bytes)
        carrier = rows.pop() if rows else torch.zeros(weights.shape[0], self.row_bytes // 2, dtype=torch.bfloat16,
                                                      device=weights.device)
        out = [buf.combine(r, self.handle)[0].float() for r in rows]
        summed, summed_weights = buf.combine(carrier, self.handle, topk_weights=weights)[:2]
        return backends._done(out + ([summed.float()] if pieces else []) + [summed_weights.float()])


class DeepEPBackend(Backend):
    """Dispatcher backend "deepep": one `deep_ep.Buffer` per backend, made at first use."""

    name = "deepep"
    config_type = DeepEPConfig

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 config: DeepEPConfig | None = None) -> None:
        super().__init__(group, rank, size)
        self.config = DeepEPConfig() if config is None else config
        self.check_config(self.config)
        self._buffer: Any = None

    @staticmethod
    def input_error(x: torch.Tensor) -> str | None:
        return row_bytes_error(x)

    def payload_error(self, x: torch.Tensor, x_scale: torch.Tensor | None, top_k: int) -> str | None:
        """DeepEP's host asserts (buffer.hpp, intranode_dispatch) and device assert (num_topk <= 32)
        beyond the row bytes: x_scale only with 1-byte x (fp8, packed fp4) and of fp32 or int32."""
        if top_k > MAX_TOP_K:
            return f"DeepEP's dispatch takes at most {MAX_TOP_K} experts a token (num_topk); got K = {top_k}"
        if x_scale is not None and x.element_size() != 1:
            return (f"DeepEP's dispatch takes x_scale only with 1-byte x (fp8 / packed fp4); got x {x.dtype} "
                    "with x_scale")
        if x_scale is not None and x_scale.dtype not in (torch.float32, torch.int32):
            return f"DeepEP's dispatch takes x_scale of float32 or int32; got {x_scale.dtype}"
        return row_bytes_error(x)

    @staticmethod
    def check_config(config: DeepEPConfig) -> None:
        if config.low_latency_mode:
            raise ValueError("backend 'deepep' of make_dispatcher runs DeepEP's normal mode; got DeepEPConfig("
                             "low_latency_mode=True): pass DeepEPConfig(num_nvl_bytes=..., num_rdma_bytes=...) "
                             "(the low-latency mode is DeepEPLowLatency)")

    @property
    def buffer(self) -> Any:
        if self._buffer is None:
            args, kwargs = self.config.buffer_args(self.group, self.size)
            self._buffer = _deep_ep().Buffer(*args, **kwargs)
        return self._buffer

    def route(self, info: RoutingInfo, census: Census) -> Route:
        return DeepEPRoute(info, census, self)

    def destroy(self) -> None:
        if self._buffer is not None and hasattr(self._buffer, "destroy"):
            self._buffer.destroy()
        self._buffer = None


@dataclass
class LowLatencyResult:
    x: Any  # [E_local, W * max_tokens, H] (bf16, or (fp8, scales) with use_fp8)
    counts: torch.Tensor  # [E_local] int32: rows per local expert
    handle: Any
    topk_ids: torch.Tensor  # [T, K] int64 (kept for combine)
    topk_weights: torch.Tensor  # [T, K] fp32


class DeepEPLowLatency:
    """DeepEP low-latency dispatch/combine (decode; CUDA-graph capturable in DeepEP)."""

    _KEYWORDS = {"max_tokens": "max_dispatch_tokens_per_rank", "hidden": "hidden", "num_experts": "num_experts",
                 "use_fp8": "use_fp8"}

    def __init__(self, group: Any, config: DeepEPConfig | None = None, **options: Any) -> None:
        """config: a `DeepEPConfig(low_latency_mode=True, ...)`. The keywords max_tokens, hidden,
        num_experts, use_fp8 instead of a config are the deprecated form."""
        from megapar.parallel import comm

        config = config_from_keywords(
            "DeepEPLowLatency", config, options, tuple(self._KEYWORDS), DeepEPConfig,
            lambda kw: DeepEPConfig(low_latency_mode=True, **{self._KEYWORDS[k]: v for k, v in kw.items()}),
            "DeepEPConfig(low_latency_mode=True, max_dispatch_tokens_per_rank=, hidden=, num_experts=, use_fp8=)")
        if not isinstance(config, DeepEPConfig) or not config.low_latency_mode:
            raise ValueError(f"DeepEPLowLatency needs a DeepEPConfig(low_latency_mode=True, ...), got {config!r}")
        pg, self.rank, self.size = comm.resolve_group(group)
        num_experts = config.num_experts
        assert num_experts is not None and config.max_dispatch_tokens_per_rank is not None
        if num_experts % self.size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the EP size ({self.size})")
        self.config = config
        self.max_tokens, self.hidden = config.max_dispatch_tokens_per_rank, config.hidden
        self.num_experts, self.use_fp8 = num_experts, config.use_fp8
        args, kwargs = config.buffer_args(pg, self.size)
        self.buffer = _deep_ep().Buffer(*args, **kwargs)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> LowLatencyResult:
        """x [T, H], topk_ids / topk_weights [T, K]; ids outside [0, num_experts) go nowhere."""
        if x.dim() != 2 or x.shape[1] != self.hidden or x.shape[0] > self.max_tokens:
            raise ValueError(f"x must be [T <= max_tokens={self.max_tokens}, H={self.hidden}], got {tuple(x.shape)}")
        # DeepEP reads an id as an expert when >= 0 and sends to rank id // E_local: an id >= E addressed
        # a peer that does not exist. As on every other backend it counts as no expert (-1, as do ids < -1),
        # here without a host check (this path is captured in decode graphs). The result is contiguous,
        # as DeepEP asserts for x, topk_idx (and the weights in combine).
        ids = topk_ids.long().masked_fill(topk_ids >= self.num_experts, -1).clamp_min(-1).contiguous()
        recv, counts, handle, _, _ = self.buffer.low_latency_dispatch(x.contiguous(), ids, self.max_tokens,
                                                                      self.num_experts, use_fp8=self.use_fp8)
        return LowLatencyResult(recv, counts, handle, ids, topk_weights.float().contiguous())

    def combine(self, expert_out: torch.Tensor, result: LowLatencyResult) -> torch.Tensor:
        """expert_out: [E_local, W * max_tokens, H] bf16 -> [T, H] (sum_k w_k y_k)."""
        out, _, _ = self.buffer.low_latency_combine(expert_out, result.topk_ids, result.topk_weights, result.handle)
        return out

    def destroy(self) -> None:
        if hasattr(self.buffer, "destroy"):
            self.buffer.destroy()


def _cuda(f: impl.Facts) -> impl.Unusable | None:
    return None if impl.cuda_available() or f.asked else impl.Unusable("needs CUDA")


CHECK = impl.all_of(impl.needs_package("deep_ep", HINT), _cuda)


def register() -> None:
    """Make "deepep" a `make_dispatcher` backend (asked for by name; "auto" never picks it)."""
    backends.register_backend("deepep", DeepEPBackend, check=CHECK, auto=False)
