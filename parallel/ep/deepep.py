"""DeepEP's `Buffer` behind the EP contract (``pip install 'megapar[deepep]'``, import name `deep_ep`).

- backend ``"deepep"`` of `parallel.ep.make_dispatcher` (normal mode): the first ``send`` of a
  route is DeepEP's dispatch (``get_dispatch_layout`` then ``dispatch`` with x, or (x, scales)
  for FP8, topk ids and weights); DeepEP's handle is kept on the route, so later sends (the
  backward of combine) are cached dispatches (``dispatch(t, handle=...)``) and ``reduce`` is
  ``combine(t, handle)``. DeepEP returns received rows ordered by source rank then token and
  local expert ids (-1 off this rank), which are turned back into global ids, so the layout,
  combine and backward passes are those of ``all_to_all``. DeepEP combines bf16 only: partial
  sums travel as bf16.
- `DeepEPLowLatency`: ``low_latency_dispatch`` -> ``[E_local, W * max_tokens, H]`` (DeepEP's
  layout) with per-expert counts, and ``low_latency_combine``.

Known blocker: the PyPI build `deepinfer-ep` needs
CUDA >= 13.1 and NCCL >= 2.32.3; the GPU machine has CUDA 13.0 and NCCL 2.28.9, so this
module is tested with a fake `deep_ep` that checks the calls and shapes it receives.
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

HINT = "pip install 'megapar[deepep]' (deepinfer-ep: needs CUDA >= 13.1, NCCL >= 2.32.3)"
NVL_BYTES = int(os.environ.get("MEGAPAR_DEEPEP_NVL_BYTES", str(1 << 30)))


def _deep_ep() -> Any:
    return impl.require("deep_ep", "the deepep EP backend", HINT)


class DeepEPRoute(Route):
    """One routing through a DeepEP buffer (module docstring)."""

    def __init__(self, info: RoutingInfo, census: Census, backend: "DeepEPBackend") -> None:
        self.backend = backend
        self.num_tokens = info.dest.shape[0]
        self.num_recv = sum(census.rows[s][backend.rank] for s in range(backend.size))
        self.num_experts = len(census.expert_pairs)
        self.handle: Any = None

    def reduce_dtype(self, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16  # DeepEP's combine takes bf16

    def send(self, pieces: list[torch.Tensor], *, async_op: bool = False) -> Any:
        buf = self.backend.buffer
        if self.handle is not None:  # cached dispatch along the first one's routing
            return backends._done([buf.dispatch(p, handle=self.handle)[0] for p in pieces])
        x, ids, weights = pieces[0], pieces[-2].long(), pieces[-1].float()
        scale = pieces[1] if len(pieces) == 4 else None
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
        buf = self.backend.buffer
        return backends._done([buf.combine(p.to(torch.bfloat16).contiguous(), self.handle)[0].float()
                               for p in pieces])


class DeepEPBackend(Backend):
    """Dispatcher backend "deepep": one `deep_ep.Buffer` per backend, made at first use."""

    name = "deepep"

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        super().__init__(group, rank, size)
        self._buffer: Any = None

    @property
    def buffer(self) -> Any:
        if self._buffer is None:
            self._buffer = _deep_ep().Buffer(self.group, NVL_BYTES, 0)
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

    def __init__(self, group: Any, *, max_tokens: int, hidden: int, num_experts: int, use_fp8: bool = False) -> None:
        from megapar.parallel import comm

        pg, self.rank, self.size = comm.resolve_group(group)
        if num_experts % self.size:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the EP size ({self.size})")
        ep = _deep_ep()
        self.max_tokens, self.hidden, self.num_experts, self.use_fp8 = max_tokens, hidden, num_experts, use_fp8
        rdma = ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, self.size, num_experts)
        self.buffer = ep.Buffer(pg, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // self.size)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> LowLatencyResult:
        if x.dim() != 2 or x.shape[1] != self.hidden or x.shape[0] > self.max_tokens:
            raise ValueError(f"x must be [T <= max_tokens={self.max_tokens}, H={self.hidden}], got {tuple(x.shape)}")
        ids = topk_ids.long()
        recv, counts, handle, _, _ = self.buffer.low_latency_dispatch(x, ids, self.max_tokens, self.num_experts,
                                                                      use_fp8=self.use_fp8)
        return LowLatencyResult(recv, counts, handle, ids, topk_weights.float())

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
