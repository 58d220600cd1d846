"""All-gather-matmul and matmul-reduce-scatter (async tensor parallelism), with autograd.

    all_gather_matmul(x_shard, [w1, w2], tp)   == [all_gather(x_shard) @ w1, all_gather(x_shard) @ w2]
    matmul_reduce_scatter(x, w, tp)            == reduce_scatter(x @ w)

They sit on both sides of a sequence-parallel region: the column-parallel linear that
follows it gathers the token shards, the row-parallel linear that precedes it scatters its
partial sums. Decomposing each collective into one block per rank lets the matmul of one
block run while the next block is on the wire.

Backends (`backend=`):
- "decomposed": the P2P engines of `ring.py` (a ring for the gather, pairwise sends and one
  final reduction for the scatter; a comm stream on CUDA); any torch.distributed backend,
  gloo included; this is what the CPU tests run. Every block matmul writes straight into
  its slice of a preallocated output (`torch.mm(..., out=)`), no concatenation, no copy of
  the own shard unless the gathered input is wanted.
- "symm_mem": PyTorch's `torch.ops.symm_mem.fused_all_gather_matmul` /
  `fused_matmul_reduce_scatter` (symmetric memory; CUDA, NCCL group, >= 2 ranks on distinct GPUs).
- "reference": one plain collective and one matmul, nothing overlapped (the specification).
- "auto": "symm_mem" where it is available, else "decomposed" (op "sp.matmul" of `parallel.impl`;
  it warns once when only the torch build stands in the way).
A size-1 group never communicates (one matmul); the gathered input it returns (`return_gathered`)
is x_shard's own storage, not a copy, as Megatron's one-rank gather returns its input.

Shapes: the gathered / scattered dim is any dim but the last (K); every rank holds the same
shard shape, so uneven token counts are padded first (`sp_shard`). On CPU tensors the ranks
agree on it first (`shard.agree_call`): a rank with another shape, dtype, dim, backend or
inputs requiring grad, or with bad arguments, makes every rank raise ValueError before anything
moves (gloo aborted the process, or the gather misread the bytes); CUDA skips that host sync.
Autograd: the backward
of one op is the other (grad of the input of all_gather_matmul is a matmul-reduce-scatter,
and vice versa); the gathered input is not kept for the weight gradient but gathered again
in backward (sequence parallelism exists to save that memory) unless it was returned.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist

from .. import impl
from ..comm import GroupLike, all_gather_uneven, as_group, dtype_code, needs_wire, reduce_scatter_uneven, resolve_group
from ..groups import Group
from .ring import RingPeers, pairwise_reduce_scatter, ring_all_gather
from .shard import UNEVEN_HINT, agree_call, grad_code, shape_fields, shape_names

Backend = Literal["auto", "decomposed", "symm_mem", "reference"]

def symm_mem_unavailable_reason(x: torch.Tensor, pg: dist.ProcessGroup | None, size: int) -> str | None:
    """Why the symmetric-memory backend cannot run these operands (None when it can)."""
    why = _symm_mem_check(impl.Facts(x.device, extra={"pg": pg, "size": size}))
    return None if why is None else why.reason


_SYMM_MEM_NEEDS = ("it needs CUDA tensors, an NCCL group of >= 2 ranks on distinct GPUs and torch built with "
                   "symmetric memory; backend='decomposed' runs on any backend, 'reference' is the plain collective")


def _symm_mem_check(f: impl.Facts) -> impl.Unusable | None:
    """Facts: device, pg (the group), size (its ranks)."""
    def no(reason: str, installable: bool = False) -> impl.Unusable:
        return impl.Unusable(reason, installable=installable, hint=_SYMM_MEM_NEEDS)

    if f.device is None or f.device.type != "cuda":
        return no(f"the tensors are on {getattr(f.device, 'type', None)}, not CUDA")
    if f.size < 2:
        return no("the group has a single rank")
    backend = str(dist.get_backend(f.pg))
    if "nccl" not in backend:
        return no(f"the group's backend is {backend}, not nccl")
    if not impl.importable("torch.distributed._symmetric_memory"):  # registers torch.ops.symm_mem
        return no("torch.distributed._symmetric_memory does not import", installable=True)
    if not hasattr(torch.ops.symm_mem, "fused_all_gather_matmul"):
        return no("this torch has no torch.ops.symm_mem.fused_all_gather_matmul", installable=True)
    return None


MATMUL = impl.Op("sp.matmul", [
    impl.Impl("symm_mem", _symm_mem_check),
    impl.Impl("decomposed"),
    impl.Impl("reference", auto=False),
])
"""All-gather-matmul and matmul-reduce-scatter: symmetric memory (CUDA, NCCL, >= 2 ranks), the
decomposed P2P engines (any backend), the plain collective (named only: the specification)."""
BACKENDS: tuple[str, ...] = MATMUL.names


def resolve_backend(backend: str, x: torch.Tensor, group: GroupLike) -> str:
    """The backend that will run: one of BACKENDS minus "auto", or "local" for a size-1 group."""
    if backend != "auto":
        MATMUL.get(backend)  # ValueError naming the valid choices, whatever the group size
    pg, _, size = resolve_group(group)
    if size == 1:
        return "local"
    return MATMUL.resolve(backend, device=x.device, pg=pg, size=size)


def symm_mem_group_name(group: GroupLike) -> str:
    """The group's name, with symmetric memory enabled for it (needed by older torch)."""
    pg, _, _ = resolve_group(group)
    pg = pg if pg is not None else dist.group.WORLD
    from torch.distributed import _symmetric_memory as symm

    name = pg.group_name
    if hasattr(symm, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated (a no-op need) in newer torch
            symm.enable_symm_mem_for_group(name)
    return name


def check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    """`dim` normalized; it must not be the last (contraction) dim."""
    nd = x.dim()
    if not -nd <= dim < nd or dim % nd == nd - 1:
        raise ValueError(f"{name} ({dim}) out of range for x of shape {tuple(x.shape)}: valid {name} are "
                         f"0..{x.dim() - 2} or {-x.dim()}..-2 (the last dim is K, the contraction dim)")
    return dim % x.dim()


def check_matmul_operands(op: str, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> None:
    """x [..., K] and weights [K, N_i] of one dtype and device."""
    if x.dim() < 2:
        raise ValueError(f"{op}: x must have at least 2 dims [..., K], got shape {tuple(x.shape)}")
    if len(weights) == 0:
        raise ValueError(f"{op}: at least one weight [K, N] is needed")
    if needs_wire(x.dtype):  # the products (and the reduce-scatter sums) are formed in x's dtype, unscaled
        raise ValueError(f"{op}: x is {x.dtype}, which cannot hold unscaled products or partial sums; valid "
                         "dtypes are those of torch.mm, e.g. torch.bfloat16, torch.float16, torch.float32 (fp8 "
                         "operands go through parallel.sp.fp8: all_gather_matmul_fp8 / matmul_reduce_scatter_fp8)")
    k = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[0] != k:
            raise ValueError(f"{op}: weight {i} has shape {tuple(w.shape)}, expected [K={k}, N] "
                             f"to multiply x of shape {tuple(x.shape)}")
        if w.dtype != x.dtype:
            raise ValueError(f"{op}: dtype mismatch, x is {x.dtype} and weight {i} is {w.dtype}; cast one "
                             "of them (fp8 activations go through parallel.sp.fp8)")
        if w.device != x.device:
            raise ValueError(f"{op}: x is on {x.device} and weight {i} on {w.device}")


# ---------------------------------------------------------------------------------------------
# Forward implementations (no autograd): N-D shapes are moved to a 2D [rows, K] view whose
# row blocks are the per-rank shards, so the ring engines only ever see contiguous blocks.


def rows_view(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
    """x [..., K] as contiguous rows [R, K] with `dim` outermost (copies only when dim != 0), and the
    inverse for a result [R', C] whose outermost (moved) dim was gathered or scattered.

    unflatten(t, outer): `outer` is the result's size along `dim` (needed when an inner dim is 0:
    then R' = 0 whatever the size along `dim`); None derives it from R'."""
    moved = x.movedim(dim, 0)
    inner = tuple(moved.shape[1:-1])
    rows = moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]).contiguous()  # not -1: K may be 0

    def unflatten(t: torch.Tensor, outer: int | None = None) -> torch.Tensor:
        if outer is None:
            outer = t.shape[0] // max(math.prod(inner), 1)
        return t.view((outer,) + inner + (t.shape[-1],)).movedim(0, dim)

    return rows, unflatten


COMPUTE_LANES = 1
"""Compute streams the decomposed backend rotates its block matmuls over on CUDA (`ring.ComputeLanes`).
2 lets a block's matmul fill the SMs the previous one's last wave leaves idle; `megapar bench
sp` times both ("... lanes=2" rows) on one GPU."""


def decomposed_all_gather_matmul(x2d: torch.Tensor, weights: Sequence[torch.Tensor], peers: RingPeers,
                                 need_gathered: bool, gathered: torch.Tensor | None = None, *,
                                 lanes: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The "decomposed" backend on 2D rows: x2d [m, K] contiguous -> (gathered [P * m, K], [P * m, N_i] each).

    One matmul per rank block, written by `torch.mm(..., out=)` straight into that block's
    rows of the output (the own block first, from x2d itself, while the first remote block
    travels). The gathered buffer's own block is filled only when `need_gathered`.
    gathered: the receive buffer [P * m, K] (allocated here when None; the loopback
    benchmark passes one holding random data, so its matmuls see realistic operands).
    lanes: compute streams (default COMPUTE_LANES).
    """
    size, m = peers.size, x2d.shape[0]
    outs2d = [x2d.new_empty((size * m, w.shape[1])) for w in weights]
    out_blocks = [o.view(size, m, w.shape[1]) for o, w in zip(outs2d, weights)]

    def consume(src: int, blocks: list[torch.Tensor]) -> None:
        for w, ob in zip(weights, out_blocks):
            torch.mm(blocks[0], w, out=ob[src])

    (gathered2d,) = ring_all_gather([x2d], peers, consume, fill_own=need_gathered,
                                    out=None if gathered is None else [gathered],
                                    lanes=COMPUTE_LANES if lanes is None else lanes)
    return gathered2d, outs2d


def decomposed_matmul_reduce_scatter(x2d: torch.Tensor, w: torch.Tensor, peers: RingPeers, *,
                                     lanes: int | None = None) -> torch.Tensor:
    """The "decomposed" backend on 2D rows: x2d [P * m, K] contiguous, w [K, N] -> [m, N] (block `rank` of the sum).

    Each destination's partial [m, K] @ [K, N] is written by `torch.mm(..., out=)` into the
    buffer it is sent from (or, for the own block, received into); one reduction ends it.
    lanes: compute streams (default COMPUTE_LANES).
    """
    m = x2d.shape[0] // peers.size

    def produce(d: int, out: torch.Tensor) -> None:
        torch.mm(x2d[d * m:(d + 1) * m], w, out=out)

    return pairwise_reduce_scatter(produce, peers, x2d, (m, w.shape[1]),
                                   lanes=COMPUTE_LANES if lanes is None else lanes)


def _all_gather_matmul_impl(x_shard: torch.Tensor, weights: Sequence[torch.Tensor],
                            group: Group, gather_dim: int, backend: str,
                            need_gathered: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    size = group.size
    if backend == "local":
        return x_shard, [x_shard @ w for w in weights]
    if backend == "symm_mem":
        gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(
            x_shard, list(weights), gather_dim, symm_mem_group_name(group), return_A=need_gathered)
        return gathered, list(outs)
    x2d, unflatten = rows_view(x_shard, gather_dim)  # [m, K]
    if backend == "reference" or x2d.numel() == 0:
        gathered2d = all_gather_uneven(x2d, group, 0, sizes=[x2d.shape[0]] * size)
        outs2d = [gathered2d @ w for w in weights]
    elif backend == "decomposed":
        gathered2d, outs2d = decomposed_all_gather_matmul(x2d, weights, RingPeers.of(group), need_gathered)
    else:
        raise AssertionError(backend)
    outer = size * x_shard.shape[gather_dim]
    return (unflatten(gathered2d, outer) if need_gathered else None), [unflatten(o, outer) for o in outs2d]


def _matmul_reduce_scatter_impl(x: torch.Tensor, w: torch.Tensor, group: Group,
                                scatter_dim: int, backend: str) -> torch.Tensor:
    size = group.size
    if backend == "local":
        return x @ w
    if backend == "symm_mem":
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w, "sum", scatter_dim, symm_mem_group_name(group))
    x2d, unflatten = rows_view(x, scatter_dim)  # [P * m, K], block d goes to rank d
    m = x2d.shape[0] // size
    if backend == "reference" or x2d.numel() == 0:
        y2d = reduce_scatter_uneven(x2d @ w, [m] * size, group, 0)
    elif backend == "decomposed":
        y2d = decomposed_matmul_reduce_scatter(x2d, w, RingPeers.of(group))
    else:
        raise AssertionError(backend)
    return unflatten(y2d, x.shape[scatter_dim] // size)


def _gather(x_shard: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return all_gather_uneven(x_shard, group, dim, sizes=[x_shard.shape[dim]] * group.size)


def _weight_grad(inp: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """sum over all rows of inp[..., K]^T grad_out[..., N] -> [K, N]."""
    rows = math.prod(inp.shape[:-1])  # not -1: K or N may be 0
    return inp.reshape(rows, inp.shape[-1]).t() @ grad_out.reshape(rows, grad_out.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard: torch.Tensor, group, gather_dim: int, return_gathered: bool, backend: str,
                *weights: torch.Tensor):
        gathered, outs = _all_gather_matmul_impl(x_shard, weights, group, gather_dim, backend, return_gathered)
        ctx.group, ctx.gather_dim, ctx.backend, ctx.return_gathered = group, gather_dim, backend, return_gathered
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        ctx.save_for_backward(gathered if return_gathered else x_shard, *weights)
        return (gathered, *outs) if return_gathered else tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved, *weights = ctx.saved_tensors
        g_gathered = grads[0] if ctx.return_gathered else None
        g_outs = grads[1:] if ctx.return_gathered else grads
        gd, group = ctx.gather_dim, ctx.group
        grad_ws: list[torch.Tensor | None] = [None] * len(weights)
        if any(ctx.needs_input_grad[5:]):
            gathered = saved if ctx.return_gathered else _gather(saved, group, gd)
            for i, g in enumerate(g_outs):
                if g is not None and ctx.needs_input_grad[5 + i]:
                    grad_ws[i] = _weight_grad(gathered, g)
        grad_x = None
        if ctx.needs_input_grad[0]:
            used = [(g, w) for g, w in zip(g_outs, weights) if g is not None]
            size = group.size
            if used:
                g_cat = torch.cat([g for g, _ in used], dim=-1) if len(used) > 1 else used[0][0]
                w_cat = torch.cat([w for _, w in used], dim=1) if len(used) > 1 else used[0][1]
            if g_gathered is not None:  # both flow into x: sum locally, then one reduce-scatter
                local = g_gathered + (g_cat @ w_cat.t() if used else 0)
                m = local.shape[gd] // size
                grad_x = local if size == 1 else reduce_scatter_uneven(local, [m] * size, group, gd)
            elif used:
                grad_x = _matmul_reduce_scatter_impl(g_cat, w_cat.t(), group, gd, ctx.backend)
        return (grad_x, None, None, None, None, *grad_ws)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, group, scatter_dim: int, backend: str):
        ctx.group, ctx.scatter_dim, ctx.backend = group, scatter_dim, backend
        ctx.save_for_backward(x, w)
        return _matmul_reduce_scatter_impl(x, w, group, scatter_dim, backend)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w = ctx.saved_tensors
        if ctx.needs_input_grad[0]:
            g_full, outs = _all_gather_matmul_impl(grad_out, [w.t()], ctx.group, ctx.scatter_dim, ctx.backend,
                                                   need_gathered=True)
            grad_x = outs[0]
        else:
            g_full, grad_x = _gather(grad_out, ctx.group, ctx.scatter_dim), None
        grad_w = _weight_grad(x, g_full) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


def all_gather_matmul(x_shard: torch.Tensor, weights: Sequence[torch.Tensor],
                      group: GroupLike, *, gather_dim: int = 0,
                      return_gathered: bool = False, backend: Backend = "auto") -> list[torch.Tensor]:
    """`[all_gather(x_shard, gather_dim) @ w for w in weights]`, the gather overlapped with the matmuls.

    x_shard: [..., m, ..., K] this rank's shard (m along `gather_dim`; the same shape and dtype
    on every rank: on CPU a rank whose shard differs makes every rank raise ValueError).
    weights: [K, N_i] each, x_shard's dtype (e.g. the Q, K, V or gate/up shards of this rank;
    several weights share one gather). Returns [..., P * m, ..., N_i] per weight, preceded by
    the gathered input [..., P * m, ..., K] when `return_gathered`. Differentiable.
    """
    weights = list(weights)
    group = as_group(group)  # resolved once here; the internals take the Group

    def check() -> tuple[tuple[int, str], list[int]]:
        check_matmul_operands("all_gather_matmul", x_shard, weights)
        dim = check_dim(x_shard, gather_dim, "gather_dim")
        chosen = resolve_backend(backend, x_shard, group)
        return (dim, chosen), shape_fields(x_shard) + [dim, dtype_code(x_shard.dtype), backend_code(chosen),
                                                       int(return_gathered), grad_code(x_shard, weights)]

    dim, chosen = agree_call("all_gather_matmul", group, _device(x_shard), _GATHER_FIELDS, check, UNEVEN_HINT)
    return list(_AllGatherMatmul.apply(x_shard, group, dim, return_gathered, chosen, *weights))


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group: GroupLike, *,
                          scatter_dim: int = 0, backend: Backend = "auto") -> torch.Tensor:
    """`reduce_scatter(x @ w, scatter_dim)` (sum), each block's partial product sent while the next is computed.

    x: [..., M, ..., K] this rank's partial-sum input (M along `scatter_dim`, divisible by
    the group size P; pad tokens with `sp_shard`/`sp_reduce_scatter` otherwise), the same shape
    and dtype on every rank, with a weight of the same N (on CPU a rank that differs makes every
    rank raise ValueError).
    w: [K, N], x's dtype. Returns [..., M / P, ..., N]: rank r gets block r. Differentiable.
    """
    group = as_group(group)  # resolved once here; the internals take the Group

    def check() -> tuple[tuple[int, str], list[int]]:
        check_matmul_operands("matmul_reduce_scatter", x, [w])
        dim = check_dim(x, scatter_dim, "scatter_dim")
        size = group.size
        if x.shape[dim] % size:
            raise ValueError(f"matmul_reduce_scatter: x.shape[{dim}] = {x.shape[dim]} is not "
                             f"divisible by the group size {size}; pad it to a multiple of {size} first "
                             "(parallel.sp.sp_pad)")
        chosen = resolve_backend(backend, x, group)
        return (dim, chosen), shape_fields(x) + [w.shape[1], dim, dtype_code(x.dtype), backend_code(chosen),
                                                 grad_code(x, [w])]

    dim, chosen = agree_call("matmul_reduce_scatter", group, _device(x), _SCATTER_FIELDS, check,
                             "every rank must pass x of the same shape and dtype (M a multiple of the group size: "
                             "pad with sp_pad), a weight of the same N, and the same options")
    return _MatmulReduceScatter.apply(x, w, group, dim, chosen)


_BACKEND_CODES = ("local",) + tuple(b for b in BACKENDS if b != "auto")
BACKEND_FIELD = f"backend ({', '.join(f'{i}: {b}' for i, b in enumerate(_BACKEND_CODES))})"
"""The agreement field of the resolved backend (`backend_code`): ranks running different engines
would pair a ring's sends with a plain collective."""


def backend_code(chosen: str) -> int:
    """The resolved backend `chosen` as an int of BACKEND_FIELD (len of the table for an unknown one)."""
    return _BACKEND_CODES.index(chosen) if chosen in _BACKEND_CODES else len(_BACKEND_CODES)


_GATHER_FIELDS = shape_names("x_shard") + ("gather_dim", "dtype", BACKEND_FIELD, "return_gathered",
                                          "grad (1: x, 2: a weight)")
_SCATTER_FIELDS = shape_names("x") + ("w.shape[1] (N)", "scatter_dim", "dtype", BACKEND_FIELD,
                                      "grad (1: x, 2: w)")


def _device(x: object) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None
