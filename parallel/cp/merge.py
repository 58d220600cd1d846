"""Merging partial attention results by their log-sum-exp (docs/numerics.md).

Attention over disjoint key sets gives partial states `(o_i, lse_i)`; the attention over the
union is `o = sum_i w_i o_i / sum_i w_i` with `w_i = exp(lse_i - max lse)` and
`lse = max + log(sum w_i)`. A partial row that saw no key has `lse = -inf` (or `+inf`, as
FlashAttention marks it) and counts as empty; a row empty in every partial gives `o = 0,
lse = -inf`. A NaN lse is not empty: it propagates (the merged row's out and lse are NaN), so a
NaN in one shard's keys or values cannot vanish in the merge.
Math is fp32 whatever the storage dtype; the scale `w_i / S` is formed first, so `o * exp(lse)`
(which overflows) never appears. `base="2"` treats every LSE as a base-2 log (FlashInfer).

Layout: outs `[..., T, H, D]`, lses `[..., T, H]` (token-major, like the attention functions of
this package). The torch reference below is the specification and is differentiable; on CUDA
(without autograd) the Triton kernel of `triton_merge.py` runs instead (op "cp.merge" of
`parallel.impl`; the interpreter runs it for CPU tensors when asked for by name).
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from torch import Tensor

from .. import impl
from .state import AttnState

Base = Literal["e", "2"]
MergeBackend = Literal["auto", "torch", "triton"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_RESCALE_PARTIALS = 64
"""The most partials (N ranks x P) `rescale_parts_to_merged` merges in one Triton kernel (its loops
are unrolled); past it the torch reference runs ("auto"), or ValueError ("triton")."""


def _kernel_dtypes(f: impl.Facts) -> impl.Unusable | None:
    if f.float_outs:
        return None
    return impl.Unusable("the kernel reads fp32/fp16/bf16 outs only")


MERGE = impl.Op("cp.merge", [
    impl.Impl("triton", impl.all_of(impl.needs_triton, impl.needs_gpu_tensor, impl.forward_only,
                                    _kernel_dtypes)),
    impl.Impl("torch"),
])


def _check_base(base: str) -> None:
    if base not in ("e", "2"):
        raise ValueError(f"base must be 'e' or '2', got {base!r}")


def _check_state(out: Tensor, lse: Tensor, what: str) -> None:
    if out.dim() < 2 or tuple(out.shape[:-1]) != tuple(lse.shape):
        raise ValueError(f"{what}: out {tuple(out.shape)} must be lse {tuple(lse.shape)} plus a head-dim axis")
    if not out.dtype.is_floating_point:
        # the merged out takes input 0's dtype: an integer one truncated the merged values silently
        raise ValueError(f"{what}: out must have a float dtype, got {out.dtype}")
    if out.device != lse.device:
        raise ValueError(f"{what}: out on {out.device} but lse on {lse.device}")


def _backend(backend: str, outs: Sequence[Tensor], lses: Sequence[Tensor]) -> str:
    return MERGE.resolve(backend, device=outs[0].device, needs_grad=impl.grad_needed(*outs, *lses),
                         float_outs=all(t.dtype in _KERNEL_DTYPES for t in outs))


def combine_lse(lses: Sequence[Tensor], base: Base = "e") -> tuple[Tensor, Tensor, list[Tensor]]:
    """The LSE part of a merge: (lse [...], nonempty [...] bool, scales w_i / S per input).

    lses: each [...] (any float dtype; -inf and +inf mean empty). Returns fp32 tensors; the
    merged lse is -inf and every scale 0 on rows empty in all inputs. A row with a NaN lse in
    any input gets lse NaN and every scale NaN (nonempty True): the NaN reaches the merged out.
    """
    exp = torch.exp2 if base == "2" else torch.exp
    log = torch.log2 if base == "2" else torch.log
    nan_row = torch.isnan(lses[0])
    for x in lses[1:]:
        nan_row = nan_row | torch.isnan(x)
    clean = [torch.where(torch.isnan(x) | (x == math.inf), -math.inf, x.float()) for x in lses]
    m = clean[0]
    for x in clean[1:]:
        m = torch.maximum(m, x)
    m = torch.where(m == -math.inf, 0.0, m).detach()   # any finite shift works; 0 for all-empty rows
    weights = [exp(x - m) for x in clean]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    nonempty = total > 0
    safe_total = torch.where(nonempty, total, 1.0)
    lse = torch.where(nonempty, m + log(safe_total), -math.inf)
    return (torch.where(nan_row, math.nan, lse), nonempty | nan_row,
            [torch.where(nan_row, math.nan, w / safe_total) for w in weights])


def _merge_torch(outs: Sequence[Tensor], lses: Sequence[Tensor], base: Base) -> AttnState:
    """Reference merge: fp32 out [..., D] and lse [...]."""
    lse, _, scales = combine_lse(lses, base)
    return AttnState(_weighted_sum(outs, scales), lse)


def _weighted_sum(outs: Sequence[Tensor], scales: Sequence[Tensor]) -> Tensor:
    """sum_i scales_i outs_i in fp32 ([..., D] outs, [...] scales)."""
    acc = None
    for o, s in zip(outs, scales):
        s = s.unsqueeze(-1)
        # where() keeps NaN/inf of an empty partial out of the sum (and out of the gradient); a
        # NaN scale (a NaN lse in the row) makes the term NaN: 0 * NaN.
        term = torch.where(s > 0, o.float(), 0.0) * s
        acc = term if acc is None else acc + term
    return acc


def _finish(result: AttnState, dtype: torch.dtype, out: Tensor | None, out_lse: Tensor | None) -> AttnState:
    if out is None:
        o = result.out.to(dtype)
    else:
        o = out.copy_(result.out)
    if out_lse is None:
        lse = result.lse
    else:
        lse = out_lse.copy_(result.lse)
    return AttnState(o, lse)


def _check_out(out: Tensor | None, out_lse: Tensor | None, shape: torch.Size, lse_shape: torch.Size,
               device: torch.device) -> None:
    if out is not None:
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
        if not out.dtype.is_floating_point:
            raise ValueError(f"out must have a float dtype, got {out.dtype}")
        if out.device != device:
            raise ValueError(f"out is on {out.device}, the inputs on {device}")
    if out_lse is not None:
        if tuple(out_lse.shape) != tuple(lse_shape):
            raise ValueError(f"out_lse has shape {tuple(out_lse.shape)}, expected {tuple(lse_shape)}")
        if out_lse.dtype != torch.float32:
            raise ValueError(f"out_lse must be float32, got {out_lse.dtype}")
        if out_lse.device != device:
            raise ValueError(f"out_lse is on {out_lse.device}, the inputs on {device}")


def merge_attn_states(outs: Tensor | Sequence[Tensor], lses: Tensor | Sequence[Tensor], *, base: Base = "e",
                      out: Tensor | None = None, out_lse: Tensor | None = None,
                      backend: MergeBackend = "auto") -> AttnState:
    """N-way merge of partial attention states over disjoint key sets.

    outs: [N, ..., T, H, D] (or a sequence of N [..., T, H, D]) fp32/bf16/fp16; the inputs of a
        sequence may differ in dtype (an fp32 accumulator merged with a bf16 block).
    lses: [N, ..., T, H] (or a sequence), any float dtype; -inf/+inf = empty partial; a NaN
        lse makes that row's out and lse NaN.
    base: "e" (PyTorch/FlashAttention) or "2" (FlashInfer); the result lse has the same base.
    out / out_lse: optional destinations ([..., T, H, D] any float dtype, [..., T, H] fp32);
        `out` may alias one of the inputs (in-place accumulation).
    Returns AttnState(out [..., T, H, D] in the first input's dtype (or out's), lse [..., T, H] fp32).
    """
    _check_base(base)
    out_list = list(outs.unbind(0)) if isinstance(outs, Tensor) else list(outs)
    lse_list = list(lses.unbind(0)) if isinstance(lses, Tensor) else list(lses)
    if not out_list or len(out_list) != len(lse_list):
        raise ValueError(f"need N >= 1 outs and as many lses, got {len(out_list)} and {len(lse_list)}")
    for i, (o, l) in enumerate(zip(out_list, lse_list)):
        _check_state(o, l, f"input {i}")
        if o.shape != out_list[0].shape or o.device != out_list[0].device:
            raise ValueError(f"input {i} is {tuple(o.shape)} on {o.device}, input 0 is "
                             f"{tuple(out_list[0].shape)} on {out_list[0].device}; shapes and devices must match")
    _check_out(out, out_lse, out_list[0].shape, lse_list[0].shape, out_list[0].device)
    if _backend(backend, out_list, lse_list) == "triton":
        from .triton_merge import merge_states_triton

        return merge_states_triton(outs if isinstance(outs, Tensor) else out_list,
                                   lses if isinstance(lses, Tensor) else lse_list, base=base, out=out, out_lse=out_lse)
    return _finish(_merge_torch(out_list, lse_list, base), out_list[0].dtype, out, out_lse)


def rescale_to_merged(out: Tensor, lses: Tensor | Sequence[Tensor], index: int, *, base: Base = "e",
                      backend: MergeBackend = "auto") -> AttnState:
    """One partial's share of an N-way merge, the all-gather + reduce-scatter form (DCP's "ag_rs"
    combine): `out` times its weight w_index / sum_i w_i among the N partials whose lses are given
    (its own at `index`), and the merged lse. The sum of the N partials' results is
    `merge_attn_states`' out, so a reduce-scatter of them finishes the merge.

    out: [..., T, H, D] any float dtype; lses: [N, ..., T, H] (or a sequence of N [..., T, H]).
    Rows empty in `out`'s partial (scale 0) give 0 even where `out` holds NaN / inf; a NaN lse in
    any partial makes the row NaN, as in the merge. Returns AttnState(fp32 [..., T, H, D], fp32
    [..., T, H]). On CUDA without autograd one Triton kernel (op "cp.merge"); the torch version
    is several elementwise kernels per partial (55-178 µs a decode step at N = 2-8 on an H100)."""
    _check_base(base)
    lse_list = list(lses.unbind(0)) if isinstance(lses, Tensor) else list(lses)
    if not lse_list:
        raise ValueError("need N >= 1 lses")
    _check_index(index, len(lse_list))
    _check_state(out, lse_list[0], "out")
    for i, l in enumerate(lse_list):
        if l.shape != lse_list[0].shape or l.device != out.device or not l.dtype.is_floating_point:
            raise ValueError(f"lse {i} is {tuple(l.shape)} {l.dtype} on {l.device}; every lse must be a float "
                             f"{tuple(out.shape[:-1])} on {out.device} (out {tuple(out.shape)})")
    stacked = lses if isinstance(lses, Tensor) else torch.stack(lse_list)
    return _rescale_parts(out.unsqueeze(0), stacked.unsqueeze(1), index, base, backend)


def rescale_parts_to_merged(outs: Tensor, lses: Tensor, index: int, *, base: Base = "e",
                            backend: MergeBackend = "auto") -> AttnState:
    """`rescale_to_merged` for a rank that holds P partial states of its own, unmerged: the sum of
    their shares of the N x P-way merge of every rank's P partials. The split-KV decode kernel
    leaves its splits so (`paged_decode_attention(merge=False)`): DCP's ag_rs combine then merges
    the splits and rescales in one pass, where the split merge and the rescale were two (each a
    read and a write of the rank's [S, Hq, Dv] fp32 out, and a launch).

    outs: [P, ..., T, H, D] any float dtype; lses: [N, P, ..., T, H] float, every rank's P lses
    (this rank's at `index`). The sum over the N ranks' results is `merge_attn_states` over all
    N x P partials; empty and NaN rows as in `rescale_to_merged`. Returns AttnState(fp32
    [..., T, H, D], fp32 merged lse [..., T, H])."""
    _check_base(base)
    if outs.dim() < 3 or lses.dim() != outs.dim() or tuple(lses.shape[1:]) != tuple(outs.shape[:-1]):
        raise ValueError(f"outs {tuple(outs.shape)} must be [P, ..., T, H, D] and lses {tuple(lses.shape)} "
                         f"[N, P, ..., T, H] of the same P, ..., T, H")
    if not outs.dtype.is_floating_point or not lses.dtype.is_floating_point:
        raise ValueError(f"outs ({outs.dtype}) and lses ({lses.dtype}) must have float dtypes")
    if outs.device != lses.device:
        raise ValueError(f"outs on {outs.device} but lses on {lses.device}")
    if lses.shape[0] < 1 or outs.shape[0] < 1:
        raise ValueError(f"need N >= 1 ranks and P >= 1 partials, got lses {tuple(lses.shape)}")
    _check_index(index, lses.shape[0])
    return _rescale_parts(outs, lses, index, base, backend)


def _check_index(index: int, n: int) -> None:
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
        raise ValueError(f"index {index!r} must be an int in [0, {n}) (one of the {n} lses)")


def _rescale_parts(outs: Tensor, lses: Tensor, index: int, base: Base, backend: MergeBackend) -> AttnState:
    """(validated) outs [P, ..., D], lses [N, P, ...]: the Triton kernel or the torch reference."""
    p = outs.shape[0]
    if _backend(backend, [outs], [lses]) == "triton":
        from .triton_merge import rescale_triton

        if lses.shape[0] * p <= MAX_RESCALE_PARTIALS:
            return rescale_triton(outs, lses, index, base=base)
        if backend == "triton":
            raise ValueError(f"{lses.shape[0]} ranks x {p} partials = {lses.shape[0] * p} is more than the kernel "
                             f"merges ({MAX_RESCALE_PARTIALS}): merge each rank's partials first, or use the torch "
                             f"backend")
    flat = lses.reshape((-1,) + tuple(lses.shape[2:]))                      # [N * P, ...]: rank-major
    lse, _, scales = combine_lse(list(flat.unbind(0)), base)
    return AttnState(_weighted_sum(outs.unbind(0), scales[index * p:(index + 1) * p]), lse)


def merge_two_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *, base: Base = "e",
                          out: Tensor | None = None, out_lse: Tensor | None = None,
                          backend: MergeBackend = "auto") -> AttnState:
    """Two-way merge; `out=out_a, out_lse=lse_a` accumulates in place (what a ring step does).

    out_a, out_b: [..., T, H, D]; lse_a, lse_b: [..., T, H]. Same rules as `merge_attn_states`.
    """
    return merge_attn_states([out_a, out_b], [lse_a, lse_b], base=base, out=out, out_lse=out_lse,
                             backend=backend)
