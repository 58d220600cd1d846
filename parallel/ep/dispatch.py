"""Expert-parallel dispatch and combine: the public `Dispatcher`.

``dispatch`` sends each (token, expert) pair to the rank owning the expert
(``rank = expert // experts_per_rank``; ids are generic, so physical-slot ids after EPLB work
the same) and lays the received rows out for grouped GEMMs (`parallel.ep.layout`);
``combine`` brings expert outputs back and sums ``w_k * y_k`` per token in fp32.

The flow of one dispatch: check inputs -> census (one all-gather of a few ints; every rank
learns split sizes, per-expert totals and every rank's errors, so all raise together before
any payload moves) -> payload transfer (one collective: x, its scales, ids and weights packed
as uint8 rows; fp8/fp4 travel as bytes) -> local layout. ``async_op=True`` returns once the
payload is in flight; ``wait()`` finishes the layout. Combine reduces each received row's
pairs locally (weighted or not) in fp32, sends one partial row per (token, rank) back (in
expert_out's dtype, as DeepEP does; fp32 for `allgather`, whose collective does the sum), and
sums the partials in fp32.

Async on CPU (gloo): ``async_op=True`` returns at once. The census, the payload collective and
the layout run on one communication thread per EP group (FIFO: jobs run in submission order),
and ``wait()`` joins the job. Collectives issued from two threads on one process group would
reach the group in an order that differs between ranks, so the thread communicates over a
*private* process group with the same ranks (created once, on first use, by the group's
members only: ``new_group(..., use_local_synchronization=True)``). The constraint this sets:
every collective on that private group goes through the thread, in submission order - the
dispatcher does so for async dispatch/combine, for a synchronous combine of an async dispatch
and for their backward passes (which submit and wait). Synchronous dispatches stay on the
caller's thread and the caller's group, ordered with the caller's own collectives as before.
Jobs are submitted in program order, identical on every rank (the micro-batch runner fixes
it), so the FIFO keeps ranks agreeing. As with any async collective, inputs must not be
modified in place before ``wait()``. On CUDA the payload collectives are already async on
their own stream and the caller's thread is used (``comm_thread=False`` forces that on CPU).

The census is the one device-to-host sync of a dispatch (split sizes must be known on the
host). Combine has none on CUDA. On CPU it first agrees (`comm.input_agreement`, one all-gather
of three ints, on the route's group and in order with its transfer: on the communication thread
when the route lives there) on expert_out's dtype and row width and on whether autograd records
it: a bf16 expert_out beside an fp32 one made the return transfer's sizes differ (gloo aborted the
process), beside an fp16 one it was misread as garbage, and a rank recording no graph never joins
the backward's transfer. A difference raises `CombineInputError` (a ValueError) on every rank
together and poisons nothing; so does an argument that one rank refuses on its own (not this
dispatcher's handle, an expert_out of another layout or dtype): that rank joins the agreement
with its error instead of its values. On CUDA the agreement's read-back would wait for the expert
GEMMs queued before it, delaying the return transfer, so the ranks must agree by contract there.
On one rank with ``layout="slab"``, a ``drop_policy`` and ``check_ids=False`` nothing needs a
host value, the census is skipped, and dispatch + combine can be captured in a CUDA graph. (Multi-rank graph capture needs a symmetric-memory backend.)

Faults: a failure inside a collective sequence leaves this rank's EP collectives out of step
with its peers' (a micro-batch that raised on one rank leaves the others inside a dispatch or
combine; a rank that went on would pair its next census with their old payloads and compute on
garbage). So a failure poisons EP communication on the rank: a collective of a dispatch or
combine that raised, a job of the communication thread that raised, any failed `UBatchRunner`
run (`parallel.ubatch.add_failure_listener`), or a combine that refused its arguments on this
rank where no agreement runs (CUDA; a handle it cannot use before this dispatcher ever
dispatched: the peers went on into the collective). Every later dispatch/combine on that
rank raises `EPPoisonedError`, naming the first failure, until torch.distributed is made again
(`destroy_parallel()`, `init_parallel()`, new dispatchers); a collective of the earlier one that
fails after that (a job of its thread that times out later) poisons nothing. The peers fail in
their pending collective within the group timeout (the private group takes `init_parallel(timeout=...)`,
`parallel.groups.group_timeout()`) and are then poisoned in turn. Bad input found by the census
raises `DispatchInputError` (a ValueError) on every rank together and poisons nothing.

Autograd: dispatch's backward is an unweighted combine (plus the weight gradients of each
pair sent home); combine's backward is a dispatch of the output gradient. All ranks must run
backward for the same dispatches in the same order, with the same inputs requiring grad
(the backward passes are collectives too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from megapar.parallel import comm, ubatch
from megapar.parallel.groups import group_timeout
from megapar.parallel.ep.backends import (Backend, Census, LocalRoute, Route, payload_format, routing_info,
                                          select_backend, take_census)
from megapar.parallel.ep.layout import (LayoutPlan, check_layout_args, gather_reduce, gather_rows, local_expert_ids,
                                plan_layout, scatter_add_rows)

_PLAIN_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class DispatchInputError(ValueError):
    """Bad dispatch input (or a slab overflow) found by the census. Every EP rank raises it at
    the same dispatch, so the group stays in step: it poisons nothing."""


class CombineInputError(DispatchInputError):
    """EP ranks that passed combine different expert_out dtypes or row widths (or inputs requiring
    grad), or a rank that refused its own arguments (a handle or expert_out it cannot combine),
    found by the combine's agreement. Every EP rank raises it at the same combine, before its
    transfer, so it poisons nothing (a DispatchInputError: what exempts agreed input errors from
    poisoning exempts it too)."""


_COMBINE_FIELDS = ("expert_out dtype", "expert_out row width", "autograd records the combine")


class EPPoisonedError(RuntimeError):
    """This rank's EP collectives are out of step with its peers' after an earlier failure;
    `reason` names it. Raised by every dispatch/combine until torch.distributed is made again."""

    def __init__(self, what: str, ranks: tuple[int, ...], reason: str) -> None:
        super().__init__(
            f"EP {what} on ranks {list(ranks)} refused: an earlier failure left this rank's EP collectives out "
            f"of step with its peers' ({reason}); a result would pair with the wrong collectives. Recreate "
            "torch.distributed and the layers that hold dispatchers: destroy_parallel(); init_parallel() (a "
            "torch.distributed you started yourself stays up through destroy_parallel(): destroy_process_group() "
            "and init_process_group() it in between)")
        self.ranks, self.reason = ranks, reason


# rank set (None = every EP rank set of this process) -> (first failure, the WORLD group it happened under)
_poisoned: dict[tuple[int, ...] | None, tuple[str, Any]] = {}
_poison_lock = threading.Lock()


def _world() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


_CURRENT: Any = object()  # `poison`'s default world: the torch.distributed of now


def poison(ranks: tuple[int, ...] | None, reason: str, world: Any = _CURRENT) -> None:
    """Mark EP communication on `ranks` (None: on every rank set) out of step; the first reason stays.

    world: the WORLD group of the torch.distributed the failed collectives belonged to (default:
    the current one). A failure under an earlier one, destroyed and made again since (a job of
    the old communication thread that times out after the re-creation), marks nothing: its groups
    are gone, and the re-created ones are in step."""
    current = _world()
    if world is not _CURRENT and world is not current:
        return
    world = current
    with _poison_lock:
        entry = _poisoned.get(ranks)
        if entry is None or entry[1] is not world:
            _poisoned[ranks] = (reason, world)


def poison_reason(ranks: tuple[int, ...]) -> str | None:
    """Why EP communication on `ranks` is poisoned, or None. Entries made under an earlier
    torch.distributed (destroyed and made again since) are dropped."""
    world = _world()
    with _poison_lock:
        for key in (ranks, None):
            entry = _poisoned.get(key)
            if entry is None:
                continue
            if world is not None and entry[1] is world:
                return entry[0]
            del _poisoned[key]
    return None


def _raise(exc: BaseException) -> None:
    raise exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _poison_on_failure(ranks: tuple[int, ...] | None, what: str, world: Any = _CURRENT):
    """Poison `ranks` when the block (a collective sequence) raises anything but an agreed input
    error; `world`: the torch.distributed its collectives belong to (see `poison`)."""
    try:
        yield
    except (DispatchInputError, EPPoisonedError):
        raise
    except BaseException as exc:
        if ranks is not None:
            poison(ranks, f"{what} failed on this rank: {_describe(exc)}", world)
        raise


def _on_ubatch_failure(error: BaseException) -> None:
    """A micro-batch run failed: its other micro-batches stopped at arbitrary points while the
    peers' did not, so every EP rank set of this process is out of step (unless the failure was
    an input error every rank raised together)."""
    cause = getattr(error, "error", error)
    if isinstance(cause, (DispatchInputError, EPPoisonedError)) or _world() is None:
        return
    poison(None, str(error))


ubatch.add_failure_listener(_on_ubatch_failure)


class _Job:
    """One function run on a `_CommWorker`; `wait()` joins it and re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.threads = torch.get_num_threads()  # OpenMP's count is per OS thread: copy the caller's
        self.inference = torch.is_inference_mode_enabled()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            with torch.no_grad(), torch.inference_mode(self.inference):
                self.result = self.fn()
        except BaseException as exc:  # re-raised by wait() on the caller's thread
            self.error = exc
        finally:
            self.fn = None  # type: ignore[assignment]
            self.done.set()

    def wait(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class _CommWorker:
    """One thread running jobs in submission order over a private process group (see the module
    docstring: every collective on `group` must be a job here)."""

    def __init__(self, group: dist.ProcessGroup, ranks: tuple[int, ...]) -> None:
        self.group, self.ranks = group, ranks
        self.world = _world()  # the torch.distributed `group` belongs to
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"ep-comm-{'-'.join(map(str, ranks))}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            reason = poison_reason(self.ranks)
            if reason is not None:  # queued before the failure: out of step too, never run it
                job.fn = functools.partial(_raise, EPPoisonedError("communication job", self.ranks, reason))
            job.run()
            if job.error is not None and not isinstance(job.error, (DispatchInputError, EPPoisonedError)):
                poison(self.ranks, f"a collective on the EP communication thread failed: {_describe(job.error)}",
                       self.world)

    def submit(self, fn: Callable[[], Any]) -> _Job:
        reason = poison_reason(self.ranks)
        if reason is not None:
            raise EPPoisonedError("communication", self.ranks, reason)
        job = _Job(fn)
        self._jobs.put(job)
        return job

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in order with the queued jobs and return its result."""
        return self.submit(fn).wait()

    def stop(self) -> None:
        self._jobs.put(None)


_workers: dict[tuple[int, ...], _CommWorker] = {}
_workers_lock = threading.Lock()


def _live(group: dist.ProcessGroup) -> bool:
    """False once torch.distributed was torn down (or re-initialized) under the group."""
    try:
        return dist.is_initialized() and group in dist.distributed_c10d._world.pg_names
    except AttributeError:  # private registry moved: assume alive
        return dist.is_initialized()


def _comm_worker(group: dist.ProcessGroup | None) -> _CommWorker:
    """The communication thread of the ranks of `group` (one per rank set, shared by every
    dispatcher on them), creating its private group on first use. Called in program order on
    every member (it is a collective among them the first time)."""
    ranks = tuple(comm.group_ranks(group))
    with _workers_lock:
        worker = _workers.get(ranks)
        if worker is not None and _live(worker.group):
            return worker
        if worker is not None:
            worker.stop()
        # init_parallel's timeout bounds both this creation (it waits for the members) and every
        # collective on it, so a peer that never comes fails this rank instead of hanging it
        private = dist.new_group(list(ranks), timeout=group_timeout(), use_local_synchronization=True,
                                 group_desc="megapar_ep_comm")
        worker = _workers[ranks] = _CommWorker(private, ranks)
        return worker


def _joined(job: _Job) -> comm.CommHandle:
    """A handle whose wait() joins `job` (and returns its result)."""
    return comm.CommHandle(work=None, finish=job.wait)


@dataclass
class CombineHandle:
    """Everything `combine` needs from one dispatch (routing is not recomputed)."""

    route: Route
    plan: LayoutPlan
    row_weights: torch.Tensor  # [R] fp32: DispatchResult.topk_weights, flattened (autograd-connected)
    out_dtype: torch.dtype | None  # dtype combine returns; None = expert_out's dtype (quantized x)
    hidden: int
    owner: int  # id() of the Dispatcher that made it
    worker: _CommWorker | None = None  # route on the worker's private group: its collectives go there
    ranks: tuple[int, ...] | None = None  # the EP group's ranks (None: one rank); poisoned together
    world: Any = None  # the WORLD group of the torch.distributed the route's collectives belong to


@dataclass
class DispatchResult:
    """What this rank's experts receive. R = layout rows (see `parallel.ep.layout`)."""

    x: torch.Tensor  # contiguous: [R, H]; slab: [E_local, capacity, H]; dtype of the dispatched x
    x_scale: torch.Tensor | None  # [R, S] / [E_local, capacity, S], the scales dispatched with x
    counts: torch.Tensor  # [E_local] int32: rows per local expert (without padding)
    offsets: torch.Tensor  # [E_local + 1] int32: first row of each expert's block (contiguous: padded)
    topk_weights: torch.Tensor  # [R] / [E_local, capacity] fp32: router weight of each row's pair, 0 on padding
    expert_ids: torch.Tensor  # [R] / [E_local, capacity] int32: local expert of each row, -1 = padding
    handle: CombineHandle
    num_recv_tokens: int  # distinct token rows received (a token is sent once per rank)
    num_dropped: int | None  # slab with drop_policy="drop": pairs dropped on this rank (None on the graph-safe path)
    # expected rows per local expert under uniform routing, a host value (no sync): the `rows_hint`
    # that `moe.kernels.grouped_gemm` / `expert_ffn` want for a slab sized for the worst case
    # (without it the capacity picks the prefill kernel settings: 5x slower at decode sizes)
    rows_hint: float = 0.0

    @property
    def counts_list(self) -> list[int]:
        """counts on the host (a device sync on CUDA)."""
        return self.counts.tolist()


def expected_rows_per_expert(num_recv: int, top_k: int, experts_here: int, num_experts: int,
                             capacity: int | None = None) -> float:
    """Rows each of this rank's `experts_here` experts gets on average when `num_recv` distinct
    tokens arrive, each with `top_k` distinct experts drawn uniformly from `num_experts`. A token
    arrives when at least one of its experts is here. Given that, it holds on average
    (top_k * experts_here / num_experts) / P(at least one here) of them, with P(none here) =
    C(num_experts - experts_here, top_k) / C(num_experts, top_k). At most `capacity` (a slab's).
    Host arithmetic only."""
    if experts_here <= 0 or num_experts <= 0 or num_recv <= 0:
        return 0.0
    k = max(1, min(top_k, num_experts))
    p_none = math.comb(num_experts - experts_here, k) / math.comb(num_experts, k)
    per_token = (k * experts_here / num_experts) / max(1.0 - p_none, 1e-12)
    rows = num_recv * per_token / experts_here
    return float(min(rows, capacity)) if capacity is not None else float(rows)


def _take(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """values: [N] flat; idx: any shape int, -1 = 0.0 -> values[idx] with zeros where idx < 0."""
    if values.numel() == 0:
        return torch.zeros(idx.shape, dtype=values.dtype, device=values.device)
    picked = values[idx.clamp(min=0)]
    return torch.where(idx >= 0, picked, torch.zeros((), dtype=values.dtype, device=values.device))


def _gather_payload(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """gather_rows for any payload dtype: fp8/fp4 move as bytes."""
    if comm.needs_wire(src.dtype):
        return gather_rows(src.view(torch.uint8), idx).view(src.dtype)
    return gather_rows(src, idx)


class _DispatchOp:
    """One dispatch between its payload transfer and its layout."""

    def __init__(self, owner: "Dispatcher", route: Route, pending: comm.CommHandle, counts_host: list[int] | None,
                 x_dtype: torch.dtype, has_scale: bool, worker: _CommWorker | None = None) -> None:
        self.owner, self.route, self.pending = owner, route, pending
        self.counts_host, self.x_dtype, self.has_scale = counts_host, x_dtype, has_scale
        self.worker = worker
        self.result: DispatchResult | None = None

    def collective(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (a collective on this op's route) in order on its group."""
        self.owner._check_poison("dispatch backward")
        with self.owner._guard("dispatch backward"):
            return self.worker.call(fn) if self.worker is not None else fn()

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the payload and build the layout -> (x layout, row weights)."""
        if self.result is not None:  # built already (on the communication thread)
            return self.result.x, self.result.topk_weights
        d = self.owner
        received = self.pending.wait()
        recv_x, recv_ids, recv_w = received[0], received[-2], received[-1]
        local_ids = local_expert_ids(recv_ids, d.rank, d.experts_per_rank)  # [n_recv, K]
        plan = plan_layout(local_ids, d.experts_per_rank, layout=d.layout, align=d.align, capacity=d.capacity,
                           drop_policy=d.drop_policy, counts_host=self.counts_host)
        k = local_ids.shape[1]
        x_layout = _gather_payload(recv_x, plan.row_src)
        x_scale = _gather_payload(received[1], plan.row_src) if self.has_scale else None
        pair = torch.where(plan.row_src >= 0, plan.row_src * k + plan.row_slot, plan.row_src)
        row_weights = _take(recv_w.reshape(-1).float(), pair)  # [R]
        self.plan = plan
        out_dtype = self.x_dtype if self.x_dtype in _PLAIN_FLOATS else None
        shape = plan.shape
        self.result = DispatchResult(
            x=x_layout.view(shape(x_layout.shape[1])),
            x_scale=x_scale.view(shape(x_scale.shape[1])) if x_scale is not None else None,
            counts=plan.counts, offsets=plan.offsets,
            topk_weights=row_weights.view(shape()),
            expert_ids=plan.expert_ids.view(shape()),
            handle=CombineHandle(self.route, plan, row_weights, out_dtype, d.hidden, id(d), self.worker, d.ranks,
                                 d._world),
            num_recv_tokens=self.route.num_recv,
            num_dropped=plan.num_dropped,
            rows_hint=expected_rows_per_expert(self.route.num_recv, k, d.experts_per_rank, d.num_experts,
                                               d.capacity if d.layout == "slab" else None),
        )
        return self.result.x, self.result.topk_weights


class _DispatchFn(torch.autograd.Function):
    """x, topk_weights -> (x layout, row weights); backward = unweighted combine + weight grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, op: _DispatchOp
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x_layout, row_weights = op.finish()
        ctx.op = op
        ctx.x_dtype, ctx.w_dtype = x.dtype, topk_weights.dtype
        if not ctx.needs_input_grad[0]:
            ctx.mark_non_differentiable(x_layout)
        return x_layout, row_weights

    @staticmethod
    def backward(ctx: Any, grad_x_layout: torch.Tensor, grad_row_weights: torch.Tensor):
        op: _DispatchOp = ctx.op
        plan, route = op.plan, op.route
        pieces = []
        if ctx.needs_input_grad[0]:
            grad_rows = grad_x_layout.reshape(plan.num_rows, grad_x_layout.shape[-1])
            pieces.append(gather_reduce(grad_rows, plan.pair_pos, None,
                                        route.reduce_dtype(grad_rows.dtype, ctx.x_dtype)))
        if ctx.needs_input_grad[1]:
            pieces.append(_take(grad_row_weights.reshape(-1).float(), plan.pair_pos))  # [n_recv, K]
        back = op.collective(lambda: route.reduce(pieces).wait())
        grad_x = back.pop(0).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_w = back.pop(0).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class _CombineOp:
    """One combine between its return transfer and the final sum."""

    def __init__(self, handle: CombineHandle, pending: comm.CommHandle, out_dtype: torch.dtype) -> None:
        self.handle, self.pending, self.out_dtype = handle, pending, out_dtype

    def finish(self) -> torch.Tensor:
        return self.pending.wait()[0].to(self.out_dtype)


class _CombineFn(torch.autograd.Function):
    """expert_out rows, row weights -> [T, H]; backward = dispatch of the output gradient."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, row_weights: torch.Tensor, op: _CombineOp,
                weighted: bool) -> torch.Tensor:
        ctx.op, ctx.weighted = op, weighted
        ctx.save_for_backward(rows, row_weights)
        return op.finish()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        rows, row_weights = ctx.saved_tensors
        handle: CombineHandle = ctx.op.handle
        plan = handle.plan
        grad_out = grad_out.contiguous()
        send = lambda: handle.route.send([grad_out]).wait()[0]  # noqa: E731
        if handle.ranks is not None and (reason := poison_reason(handle.ranks)) is not None:
            raise EPPoisonedError("combine backward", handle.ranks, reason)
        with _poison_on_failure(handle.ranks, "combine backward", handle.world):
            grad_recv = handle.worker.call(send) if handle.worker is not None else send()  # [n_recv, H]
        grad_rows = grad_w = None
        if ctx.needs_input_grad[0]:
            scale = None if ctx.weighted else row_weights.detach().float()
            grad_rows = gather_rows(grad_recv, plan.row_src, scale).to(rows.dtype)
        if ctx.needs_input_grad[1] and not ctx.weighted:
            grad_w = (gather_rows(grad_recv, plan.row_src).float() * rows.float()).sum(1)
        return grad_rows, grad_w, None, None


class Dispatcher:
    """Dispatch/combine for one EP group, expert count, hidden size and layout."""

    def __init__(self, group: Any, num_experts: int, hidden: int, *, backend: str = "auto",
                 layout: str = "contiguous", align: int = 1, capacity: int | None = None,
                 drop_policy: str | None = None, check_ids: bool = True, comm_thread: bool = True,
                 backend_config: Any = None) -> None:
        pg, rank, size = comm.resolve_group(group)
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % size:
            valid = [m * size for m in range(1, 5)]
            raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the EP group size "
                             f"({size}); e.g. {', '.join(map(str, valid))}, ...")
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden ({hidden!r}) must be a positive int")
        check_layout_args(layout, align, capacity, drop_policy)
        check_backend_config(backend, backend_config)
        self.group, self.rank, self.size = pg, rank, size
        self.ranks: tuple[int, ...] | None = tuple(comm.group_ranks(group)) if size > 1 else None
        self._world = _world()  # the torch.distributed its groups belong to: failures poison under it
        self.num_experts, self.hidden = num_experts, hidden
        self.experts_per_rank = num_experts // size
        self.layout, self.align, self.capacity, self.drop_policy = layout, align, capacity, drop_policy
        self.check_ids = check_ids
        self.comm_thread = comm_thread
        self.backend_config = backend_config
        self.backend: Backend = self._new_backend(select_backend(backend, size=size), pg)
        self._worker_backend: Backend | None = None  # self.backend's class on the worker's private group
        # (communication thread or None, device) of the latest dispatch: where a combine whose
        # handle this rank cannot use still meets its peers' combine agreement (`_refusal_route`)
        self._last_route: tuple[_CommWorker | None, torch.device] | None = None
        # one rank, a slab that drops overflow and no id check: nothing needs a host value, so
        # dispatch/combine never synchronize the device (CUDA-graph capturable)
        self._graph_safe = size == 1 and layout == "slab" and drop_policy is not None and not check_ids

    def _new_backend(self, cls: type[Backend], group: Any) -> Backend:
        """An instance of `cls` on `group`, given the backend's typed config when there is one."""
        if self.backend_config is None or getattr(cls, "config_type", None) is None:
            return cls(group, self.rank, self.size)
        return cls(group, self.rank, self.size, config=self.backend_config)  # type: ignore[call-arg]

    def __repr__(self) -> str:
        return (f"Dispatcher(rank {self.rank}/{self.size}, experts={self.num_experts} "
                f"({self.experts_per_rank}/rank), hidden={self.hidden}, backend={self.backend.name}, "
                f"layout={self.layout})")

    # -- checks -----------------------------------------------------------------------------

    def _check_poison(self, what: str) -> None:
        """Raise EPPoisonedError when an earlier failure left this rank's EP collectives out of step."""
        if self.ranks is not None:
            reason = poison_reason(self.ranks)
            if reason is not None:
                raise EPPoisonedError(what, self.ranks, reason)

    def _guard(self, what: str):
        """Context: a failure inside it poisons this dispatcher's rank set (see the module docstring)."""
        return _poison_on_failure(self.ranks, what, self._world)

    def _input_error(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     x_scale: torch.Tensor | None) -> str | None:
        """Why these inputs cannot be dispatched (checked on the host), or None."""
        if x.dim() != 2:
            return f"x must be [T, H], got shape {tuple(x.shape)}"
        t, width = x.shape
        packed = x.dtype == torch.uint8 and width * 2 == self.hidden
        if width != self.hidden and not packed:
            return (f"x hidden size {width} != the dispatcher's hidden ({self.hidden}) "
                    f"(uint8 packed fp4 may have hidden/2 = {self.hidden / 2:g})")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
            return f"topk_ids must be [T={t}, K], got shape {tuple(topk_ids.shape)}"
        if topk_ids.dtype not in (torch.int32, torch.int64):
            return f"topk_ids dtype {topk_ids.dtype} is not int32 or int64"
        if topk_weights.shape != topk_ids.shape:
            return f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}"
        if not topk_weights.dtype.is_floating_point:
            return f"topk_weights dtype {topk_weights.dtype} is not floating point (fp32 expected)"
        if x_scale is not None and (x_scale.dim() != 2 or x_scale.shape[0] != t):
            return f"x_scale must be [T={t}, S] (S = 1 per token or ceil(H/128)), got {tuple(x_scale.shape)}"
        devices = {x.device, topk_ids.device, topk_weights.device}
        if x_scale is not None:
            devices.add(x_scale.device)
        if len(devices) > 1:
            return f"x, topk_ids, topk_weights and x_scale must be on one device, got {sorted(map(str, devices))}"
        return self.backend.payload_error(x, x_scale, topk_ids.shape[1])

    def _check_census(self, census: Census, own_error: str | None) -> None:
        """Raise the same error on every rank when any rank's input is bad or a slab overflows."""
        bad = [r for r, e in enumerate(census.errors) if e]
        if bad:
            if own_error is not None:
                raise DispatchInputError(f"[rank {self.rank}] EP dispatch: {own_error}")
            if census.errors[self.rank]:
                raise DispatchInputError(f"[rank {self.rank}] EP dispatch: topk_ids has {census.errors[self.rank]} "
                                 f"ids outside [-1, {self.num_experts}) (num_experts={self.num_experts}; "
                                 "-1 = no expert; check_ids=False skips this check)")
            raise DispatchInputError(f"[rank {self.rank}] EP dispatch aborted before sending: EP rank(s) {bad} "
                             "reported invalid input (see their error)")
        if self.layout == "slab" and self.drop_policy is None:
            per_expert = census.expert_pairs
            worst = max(range(self.num_experts), key=per_expert.__getitem__)
            if per_expert[worst] > self.capacity:  # type: ignore[operator]
                owner = worst // self.experts_per_rank
                raise DispatchInputError(f"[rank {self.rank}] slab capacity ({self.capacity}) is too small: expert "
                                 f"{worst} (rank {owner}) receives {per_expert[worst]} rows; pass capacity >= "
                                 f"{per_expert[worst]}, or drop_policy='drop' to drop the overflow")

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 x_scale: torch.Tensor | None = None, async_op: bool = False
                 ) -> DispatchResult | comm.CommHandle:
        """Send each (token, expert) pair to its expert's rank.

        x: [T, H] bf16/fp16/fp32, fp8 e4m3 (with x_scale), or uint8 packed fp4 [T, H/2].
        topk_ids: [T, K] int32/int64, -1 = no expert. topk_weights: [T, K] fp32.
        x_scale: [T, S] (fp32: S = 1 per token or ceil(H/128) per 128 channels) or None.
        Returns a DispatchResult, or with async_op a handle whose wait() returns it.
        """
        error = self._input_error(x, topk_ids, topk_weights, x_scale)
        if error is not None and self.size == 1:
            raise ValueError(f"EP dispatch: {error}")
        self._check_poison("dispatch")
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad)
        with self._guard("creating the EP communication thread"):  # a collective among the members
            worker = self._worker(x.device) if async_op else None
        self._last_route = (worker, x.device)
        if worker is not None:
            # census, payload and (without autograd) the layout on the communication thread
            def job() -> _DispatchOp:
                op = self._launch(x, topk_ids, topk_weights, x_scale, error, worker, async_op=False)
                if not needs_grad:
                    op.finish()
                return op

            ready = worker.submit(job)
            return comm.CommHandle(work=None, finish=lambda: self._dispatch_result(ready.wait(), x, topk_weights,
                                                                                  needs_grad))
        with self._guard("dispatch"), torch.no_grad():
            op = self._launch(x, topk_ids, topk_weights, x_scale, error, None, async_op=async_op)
        if async_op:
            return comm.CommHandle(work=None, finish=lambda: self._dispatch_result(op, x, topk_weights, needs_grad))
        return self._dispatch_result(op, x, topk_weights, needs_grad)

    def _worker(self, device: torch.device) -> _CommWorker | None:
        """The communication thread for an async op on `device`, or None (caller's thread)."""
        if not self.comm_thread or self.size == 1 or device.type == "cuda" or self._graph_safe:
            return None
        worker = _comm_worker(self.group)
        if self._worker_backend is None or self._worker_backend.group is not worker.group:
            self._worker_backend = self._new_backend(type(self.backend), worker.group)
        return worker

    def _launch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                x_scale: torch.Tensor | None, error: str | None, worker: _CommWorker | None, *,
                async_op: bool) -> _DispatchOp:
        """Census, route and payload transfer (on the worker's group when given) -> the op."""
        backend = self.backend if worker is None else self._worker_backend
        assert backend is not None
        if self._graph_safe:
            route: Route = LocalRoute(x.shape[0])
            counts_host = None
        else:
            info = routing_info(topk_ids, self.num_experts, self.size) if error is None else None
            census = take_census(topk_ids if error is None else None, info, self.num_experts,
                                 group=backend.group, size=self.size, device=x.device,
                                 local_error=error is not None, check_ids=self.check_ids,
                                 payload=payload_format(x, x_scale) if error is None else None)
            self._check_census(census, error)
            assert info is not None
            route = backend.route(info, census)
            counts_host = census.expert_totals(self.rank * self.experts_per_rank, self.experts_per_rank)
        if self.size == 1:
            ids = topk_ids
        else:
            # ids travel as int32. The census counted every id outside [0, E) as no expert; send
            # those as -1, or narrowing would turn one (2**32 + 1 with check_ids=False) into a
            # valid expert on the receiver that the census never counted
            ids = torch.where(info.valid, topk_ids, -1).to(torch.int32)
        pieces = [x] + ([x_scale] if x_scale is not None else []) + [ids, topk_weights.float()]
        pending = route.send(pieces, async_op=async_op)
        return _DispatchOp(self, route, pending, counts_host, x.dtype, x_scale is not None, worker)

    @staticmethod
    def _dispatch_result(op: _DispatchOp, x: torch.Tensor, topk_weights: torch.Tensor,
                         needs_grad: bool) -> DispatchResult:
        with op.owner._guard("dispatch"):
            return Dispatcher._dispatch_layout(op, x, topk_weights, needs_grad)

    @staticmethod
    def _dispatch_layout(op: _DispatchOp, x: torch.Tensor, topk_weights: torch.Tensor,
                         needs_grad: bool) -> DispatchResult:
        if needs_grad:
            x_layout, row_weights = _DispatchFn.apply(x, topk_weights, op)
            assert op.result is not None
            op.result.x, op.result.topk_weights = x_layout, row_weights
            op.result.handle.row_weights = row_weights.reshape(-1)
        else:
            with torch.no_grad():
                op.finish()
        assert op.result is not None
        return op.result

    # -- combine ----------------------------------------------------------------------------

    def _combine_error(self, expert_out: torch.Tensor, handle: CombineHandle) -> str | None:
        """Why `combine` cannot take these arguments (checked on the host, on this rank alone), or None."""
        if not isinstance(handle, CombineHandle):
            return f"handle must be the CombineHandle of a DispatchResult, got {type(handle).__name__}"
        if handle.owner != id(self):
            return "this handle was made by another Dispatcher; combine with the one that dispatched"
        if not isinstance(expert_out, torch.Tensor):
            return f"expert_out must be a tensor, got {type(expert_out).__name__}"
        plan = handle.plan
        expected = plan.shape(self.hidden)
        if tuple(expert_out.shape) != expected and tuple(expert_out.shape) != (plan.num_rows, self.hidden):
            return (f"expert_out shape {tuple(expert_out.shape)} != the dispatched layout {expected} "
                    f"(hidden={self.hidden})")
        if not expert_out.dtype.is_floating_point or comm.needs_wire(expert_out.dtype):
            return f"expert_out dtype {expert_out.dtype} must be bf16, fp16 or fp32"
        return None

    def _combine_agreement(self, fields: list[int] | None, error: str | None, group: Any,
                           device: torch.device) -> None:
        """The combine's agreement (a collective on `group`): CombineInputError on every rank when
        a rank refused its arguments (`error`, with `fields` None) or the ranks' fields differ."""
        message = comm.input_agreement(
            "EP combine", _COMBINE_FIELDS, fields, error, group, device, {"expert_out dtype": "dtype"},
            "the partial rows travel in expert_out's dtype and width, so every EP rank must pass expert_out "
            "of one dtype (and hidden size), and every rank or none must record autograd (its backward is a "
            "transfer too)")
        if message is not None:
            raise CombineInputError(f"[rank {self.rank}] EP combine: {message}" if error is not None
                                    else f"[rank {self.rank}] {message}")

    def _refusal_route(self, handle: Any) -> tuple[_CommWorker | None, torch.device] | None:
        """(communication thread or None, device) on which this rank's peers run the agreement of
        the combine whose arguments this rank refused, or None where they run none (CUDA) or this
        rank cannot tell. The peers agree on their handle's group: the communication thread's for
        an async dispatch (one per rank set, shared by every dispatcher on it), else this
        dispatcher's group. This rank's own handle names it; an unusable one (not a handle, another
        dispatcher's) does not, and the latest dispatch of this rank stands in for it (the peers
        combine that dispatch's handle when every rank runs the same program)."""
        if self._world is not _world():  # made under an earlier torch.distributed: its groups are gone
            return None
        if isinstance(handle, CombineHandle) and handle.owner == id(self):
            route = (handle.worker, handle.row_weights.device)
        elif self._last_route is not None:
            route = self._last_route
        else:
            return None
        worker, device = route
        if device.type != "cpu" or (worker is not None and worker.world is not self._world):
            return None
        return route

    def _refuse(self, error: str, handle: Any, async_op: bool) -> comm.CommHandle:
        """Raise `error` (this rank's refusal of combine's arguments) at the call, or at wait()
        where the agreement runs on the communication thread, as an accepted combine would raise
        a disagreement: with every rank through the agreement where there is one (CombineInputError,
        nothing poisoned), else on this rank alone (ValueError; poisons this rank when it has peers)."""
        route = self._refusal_route(handle) if self.ranks is not None else None
        if route is None or poison_reason(self.ranks) is not None:  # type: ignore[arg-type]
            if self.ranks is not None:  # the peers may have gone on into the combine's collective
                poison(self.ranks, f"combine refused its arguments on this rank: ValueError: {error}", self._world)
            raise ValueError(error)
        worker, device = route
        if worker is None:
            with self._guard("combine"):
                self._combine_agreement(None, error, self.group, device)
            raise AssertionError("unreachable: the agreement raises for a rank with an error")
        job = _joined(worker.submit(lambda: self._combine_agreement(None, error, worker.group, device)))

        def finish() -> Any:
            with self._guard("combine"):
                return job.wait()

        return comm.CommHandle(work=None, finish=finish) if async_op else finish()

    def combine(self, expert_out: torch.Tensor, handle: CombineHandle, *, weighted: bool = False,
                async_op: bool = False) -> torch.Tensor | comm.CommHandle:
        """Return expert outputs to their tokens and sum them in fp32.

        expert_out: the dispatched layout's shape with last dim H ([R, H] or [E_local, capacity, H]),
        bf16/fp16/fp32, of one dtype on every EP rank: the partial rows travel in it (all_to_all;
        for quantized x the output and its gradient take it too). On CPU the ranks agree on it
        first: a rank with another dtype or row width (or that records autograd where a peer does
        not) makes every rank raise `CombineInputError` (a ValueError naming each rank's value),
        at the call, or at wait() where the combine runs on the communication thread. On CUDA
        nothing compares them (no host sync): a mismatch there makes the transfer sizes differ.
        weighted: True when the rows are already multiplied by their router weight (then they are
        summed as they are); False multiplies by DispatchResult.topk_weights.
        Returns [T, H] in the dispatched x's dtype (expert_out's dtype for quantized x), or with
        async_op a handle whose wait() returns it.

        A handle or expert_out that this rank refuses on its own (not a tensor, not this
        dispatcher's handle, another layout, a dtype that is not bf16/fp16/fp32) raises
        `CombineInputError` on this rank and, through the same agreement, on every EP rank (theirs
        names the group rank that had bad input), where the agreement runs (CPU), so it poisons
        nothing. The refusing rank meets its peers on the group its handle's dispatch used (the
        communication thread's for an async dispatch); a handle it cannot use names none, so it
        takes its own latest dispatch's. Where there is no agreement (CUDA, a handle unusable before
        any dispatch, an already poisoned rank) the rank raises ValueError alone and poisons EP
        communication on itself, as its peers may be inside the combine's collective (see the
        module docstring).
        """
        error = self._combine_error(expert_out, handle)
        if error is not None:
            return self._refuse(error, handle, async_op)
        self._check_poison("combine")
        plan = handle.plan
        rows = expert_out.reshape(plan.num_rows, self.hidden)
        row_weights = handle.row_weights
        out_dtype = handle.out_dtype or expert_out.dtype
        route = handle.route
        worker = handle.worker
        reduce_dtype = route.reduce_dtype(rows.dtype, out_dtype)
        rows_in, weights_in = rows.detach(), None if weighted else row_weights.detach()
        needs_grad = torch.is_grad_enabled() and (rows.requires_grad or (not weighted and row_weights.requires_grad))
        # what sizes the return transfer (and whether its backward transfer runs), agreed on CPU only
        agree = self.size > 1 and rows_in.device.type == "cpu"
        fields = [comm.dtype_code(expert_out.dtype), expert_out.shape[-1], int(needs_grad)]

        def agreement(group: Any) -> None:
            self._combine_agreement(fields, None, group, rows_in.device)

        def launch(async_launch: bool) -> comm.CommHandle:
            """Local weighted reduction per received row, then the return transfer."""
            if rows_in.device.type == "cpu":  # one pass over the layout rows (each has one source row)
                partial = scatter_add_rows(rows_in, plan.row_src, route.num_recv, weights_in, reduce_dtype)
            else:
                pair_w = None if weights_in is None else _take(weights_in, plan.pair_pos)  # [n_recv, K]
                partial = gather_reduce(rows_in, plan.pair_pos, pair_w, reduce_dtype)
            return route.reduce([partial], async_op=async_launch)

        if worker is not None:  # the route lives on the worker's group: the agreement and transfer go there
            def job() -> list[torch.Tensor]:
                if agree:
                    agreement(worker.group)
                return launch(False).wait()

            op = _CombineOp(handle, _joined(worker.submit(job)), out_dtype)
        else:
            with self._guard("combine"), torch.no_grad():
                if agree:
                    agreement(self.group)
                op = _CombineOp(handle, launch(async_op), out_dtype)

        def finish() -> torch.Tensor:
            with self._guard("combine"):
                if needs_grad:
                    return _CombineFn.apply(rows, row_weights, op, weighted)
                return op.finish()

        return comm.CommHandle(work=None, finish=finish) if async_op else finish()


# ---- typed configs ----------------------------------------------------------------------------

_deprecated_seen: set[str] = set()
_deprecated_lock = threading.Lock()


def warn_deprecated_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """A DeprecationWarning for `key` (an old call form), once per process."""
    import warnings

    with _deprecated_lock:
        if key in _deprecated_seen:
            return
        _deprecated_seen.add(key)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def config_from_keywords(who: str, config: Any, options: dict[str, Any], valid: tuple[str, ...], config_type: type,
                         build: Callable[[dict[str, Any]], Any], new_form: str) -> Any:
    """`config`, or, for the deprecated keyword call form of `who` (`options` given), the config
    `build(options)` makes (a DeprecationWarning once). TypeError for unknown keywords or both forms."""
    if not options:
        return config
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"{who} got unknown options {unknown}; pass a {config_type.__name__} (fields: "
                        f"{', '.join(f.name for f in dataclasses.fields(config_type))})")
    if config is not None:
        raise TypeError(f"{who}: pass either a {config_type.__name__} or the (deprecated) keywords "
                        f"{sorted(options)}, not both")
    warn_deprecated_once(who, f"{who}({', '.join(f'{k}=' for k in options)}) is deprecated; pass {new_form}",
                         stacklevel=4)
    return build(options)


def check_int(owner: str, name: str, value: Any, low: int, *, optional: bool = False) -> None:
    """ValueError unless `value` is an int >= low (None too when optional), naming owner.name."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}: {name} ({value!r}) must be an int >= {low}" + (" or None" if optional else ""))


def check_backend_config(backend: str, config: Any) -> None:
    """ValueError unless `config` is None or the typed config of the named `backend`
    (its Backend class's `config_type`: `NvshmemConfig` for "nvshmem", `DeepEPConfig` for "deepep")."""
    if config is None:
        return
    from megapar.parallel.ep import backends

    if backend not in backends.TRANSPORT.names:
        return  # the unknown name is what gets reported (select_backend / DispatcherConfig)
    cls = backends._REGISTRY.get(backend)
    config_type = getattr(cls, "config_type", None)
    if config_type is None:
        takes = sorted(n for n, c in backends._REGISTRY.items() if getattr(c, "config_type", None) is not None)
        raise ValueError(f"backend={backend!r} takes no backend_config (got {type(config).__name__}); backends "
                         f"with one: {', '.join(takes)} (name the backend, not 'auto')")
    if not isinstance(config, config_type):
        raise ValueError(f"backend={backend!r} takes a {config_type.__name__} as backend_config, got "
                         f"{type(config).__name__}")
    check = getattr(cls, "check_config", None)
    if check is not None:
        check(config)


@dataclass(kw_only=True, frozen=True)
class DispatcherConfig:
    """How a `Dispatcher` moves and lays out tokens (validated at construction)."""

    backend: str = "auto"
    """EP transport: "auto" | "all_to_all" | "allgather" | a registered one (`backends.BACKENDS`)"""
    layout: Literal["contiguous", "slab"] = "contiguous"
    """received rows grouped by expert (blocks padded to `align`), or a fixed [E_local, capacity, H] slab"""
    align: int = 1
    """contiguous blocks padded to a multiple of this many rows (e.g. 128 for DeepGEMM)"""
    capacity: int | None = None
    """slab rows per local expert"""
    drop_policy: Literal["drop"] | None = None
    """slab overflow: None raises, "drop" drops the last arrivals"""
    check_ids: bool = True
    """count ids outside [-1, num_experts) and raise (rides on the census)"""
    comm_thread: bool = True
    """with async_op on CPU, census, transfer and layout run on the group's communication thread"""
    backend_config: Any = None
    """the transport's own options: `NvshmemConfig(mode="normal")` for "nvshmem", `DeepEPConfig`
    for "deepep" (None: their defaults)"""

    def __post_init__(self) -> None:
        check_layout_args(self.layout, self.align, self.capacity, self.drop_policy)
        if self.backend not in _transport_names():
            raise ValueError(f"backend={self.backend!r} is not known; valid backends: {', '.join(_transport_names())}")
        check_backend_config(self.backend, self.backend_config)


def _transport_names() -> tuple[str, ...]:  # (read when asked: the registry can grow)
    from megapar.parallel.ep import backends

    return backends.TRANSPORT.names


def make_dispatcher(group: Any, num_experts: int, hidden: int, config: DispatcherConfig | None = None,
                    **options: Any) -> Dispatcher:
    """A `Dispatcher` for `group` (a parallel.groups.Group, a ProcessGroup, or None = world).

    num_experts: expert slots over the whole group (physical slots when EPLB replicates);
    rank r owns ids [r * E_local, (r + 1) * E_local), E_local = num_experts // group size.
    config: a `DispatcherConfig`; `options` are its fields given as keywords (they override
    `config`'s): backend, layout, align, capacity, drop_policy, check_ids, comm_thread,
    backend_config. A group of one never communicates.
    """
    unknown = sorted(set(options) - set(DispatcherConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"make_dispatcher got unknown options {unknown}; valid: "
                        f"{', '.join(DispatcherConfig.__dataclass_fields__)}")
    cfg = replace(config, **options) if config is not None else DispatcherConfig(**options)
    return Dispatcher(group, num_experts, hidden, backend=cfg.backend, layout=cfg.layout, align=cfg.align,
                      capacity=cfg.capacity, drop_policy=cfg.drop_policy, check_ids=cfg.check_ids,
                      comm_thread=cfg.comm_thread, backend_config=cfg.backend_config)
