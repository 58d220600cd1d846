"""Triton kernels for the LSE merge of `merge.py` (CUDA, or TRITON_INTERPRET=1 in tests).

`merge.py` chooses them (op "cp.merge" of `parallel.impl`); this module imports nothing of it.

One program merges BLOCK_R rows (a row = one token x head) over the whole head dim, so it reads
every input of its rows before writing: the output may alias an input (in-place ring
accumulation). Two kernels: a pair kernel with two input pointers (no stacking copy, what a
ring step uses) and an N-way kernel over a stacked `[N, M, H, D]` tensor. Both are pure
bandwidth: N*D reads + D writes per row, fp32 math, two passes over the tiny LSE vectors.
Inputs may be strided (PyTorch's fused attention returns `[B, T, H, D]` views of `[B, H, T, D]`
memory); only the head dim is expected to be unit-stride for full speed.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .state import AttnState

try:    # programmatic dependent launch (sm_90+): a kernel launched with it starts before the one it
    # follows has finished and waits in-kernel (griddepcontrol.wait) before touching memory
    from triton.backends.nvidia.compiler import CUDAOptions as _CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = "launch_pdl" in getattr(_CUDAOptions, "__dataclass_fields__", {})
except ImportError:  # pragma: no cover - older triton
    HAS_PDL = False
    gdc_wait = gdc_launch_dependents = None


@triton.jit
def _clean_lse(lse):
    # +inf marks an empty partial (as -inf does): treat it as -inf. NaN stays: the row max is
    # taken with NaN propagation, so a NaN lse makes the row's max, weights, out and lse NaN
    # without a separate per-row flag (which cost registers and load overlap on sm_90).
    return tl.where(lse == float("inf"), float("-inf"), lse)


@triton.jit
def _pow(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _store_merged(y_ptr, ly_ptr, m_idx, h_idx, d, rmask, mask2, acc, mx, total, sy_m, sy_h, sy_d, sly_m, sly_h,
                  BASE2: tl.constexpr):
    """Write the merged rows: out = acc, lse = mx + log(total) (-inf where every partial is empty;
    both NaN on rows where some partial's lse is NaN)."""
    tl.store(y_ptr + m_idx[:, None] * sy_m + h_idx[:, None] * sy_h + d[None, :] * sy_d,
             acc.to(y_ptr.dtype.element_ty), mask=mask2)
    safe = tl.where(total > 0, total, 1.0)
    if BASE2:
        lse = mx + tl.log2(safe)
    else:
        lse = mx + tl.log(safe)
    # total is 0 only where every partial is empty, and NaN on a NaN row (whose lse stays NaN)
    tl.store(ly_ptr + m_idx * sly_m + h_idx * sly_h, tl.where(total == 0, float("-inf"), lse), mask=rmask)


@triton.jit
def _program_rows(M, H, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows (token x head) of the M x H: (in range, token, head), 64-bit."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    return rows < M * H, rows // H, rows % H


@triton.jit
def _max_and_total(lx_ptr, lse_off, slx_n64, rmask, N: tl.constexpr, BLOCK_R: tl.constexpr, BASE2: tl.constexpr):
    """The N-way merge's first pass over the stacked LSE vectors only: the rows' max (0 where every
    partial is empty, NaN where one is NaN) and the sum of the weights relative to it."""
    mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for i in tl.static_range(N):
        li = _clean_lse(tl.load(lx_ptr + i * slx_n64 + lse_off, mask=rmask, other=float("-inf")).to(tl.float32))
        mx = tl.maximum(mx, li, propagate_nan=tl.PropagateNan.ALL)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.full([BLOCK_R], 0.0, tl.float32)
    for i in tl.static_range(N):
        li = _clean_lse(tl.load(lx_ptr + i * slx_n64 + lse_off, mask=rmask, other=float("-inf")).to(tl.float32))
        total += _pow(li - mx, BASE2)
    return mx, total


@triton.jit
def _weighted_outs(x_ptr, x_off, sx_n64, lx_ptr, lse_off, slx_n64, first, mx, total, rmask, mask2, P: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BASE2: tl.constexpr):
    """Pass 2 of a merge: sum_j out_j w_(first + j) / sum_i w_i over P outs (j strides of sx_n64 in)
    whose lses stand at first, first + 1, .. of the stacked lses (`_max_and_total`'s mx and total).
    NaN on a row where any lse is NaN: mx is NaN there, hence the scale, and 0 * NaN."""
    safe = tl.where(total > 0, total, 1.0)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    for j in tl.static_range(P):
        lj = _clean_lse(tl.load(lx_ptr + (first + j) * slx_n64 + lse_off, mask=rmask, other=float("-inf"))
                        .to(tl.float32))
        sj = _pow(lj - mx, BASE2) / safe
        oj = tl.load(x_ptr + j * sx_n64 + x_off, mask=mask2, other=0.0)
        acc += tl.where(sj[:, None] > 0, oj.to(tl.float32), 0.0) * sj[:, None]
    return acc


@triton.jit
def _merge_pair_kernel(
    a_ptr, la_ptr, b_ptr, lb_ptr, y_ptr, ly_ptr,
    M, H,
    sa_m, sa_h, sa_d, sla_m, sla_h,
    sb_m, sb_h, sb_d, slb_m, slb_h,
    sy_m, sy_h, sy_d, sly_m, sly_h,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BASE2: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:   # launched early (programmatic dependent launch): wait for the kernel before, first
        gdc_wait()
    rmask, m_idx, h_idx = _program_rows(M, H, BLOCK_R)
    la = tl.load(la_ptr + m_idx * sla_m + h_idx * sla_h, mask=rmask, other=float("-inf")).to(tl.float32)
    lb = tl.load(lb_ptr + m_idx * slb_m + h_idx * slb_h, mask=rmask, other=float("-inf")).to(tl.float32)
    la = _clean_lse(la)
    lb = _clean_lse(lb)
    mx = tl.maximum(la, lb, propagate_nan=tl.PropagateNan.ALL)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wa = _pow(la - mx, BASE2)
    wb = _pow(lb - mx, BASE2)
    total = wa + wb
    safe = tl.where(total > 0, total, 1.0)
    sa = wa / safe
    sb = wb / safe
    d = tl.arange(0, BLOCK_D)
    mask2 = rmask[:, None] & (d[None, :] < D)
    oa = tl.load(a_ptr + m_idx[:, None] * sa_m + h_idx[:, None] * sa_h + d[None, :] * sa_d, mask=mask2, other=0.0)
    ob = tl.load(b_ptr + m_idx[:, None] * sb_m + h_idx[:, None] * sb_h + d[None, :] * sb_d, mask=mask2, other=0.0)
    acc = tl.where(sa[:, None] > 0, oa.to(tl.float32), 0.0) * sa[:, None]
    acc += tl.where(sb[:, None] > 0, ob.to(tl.float32), 0.0) * sb[:, None]
    _store_merged(y_ptr, ly_ptr, m_idx, h_idx, d, rmask, mask2, acc, mx, total, sy_m, sy_h, sy_d, sly_m, sly_h,
                  BASE2)


@triton.jit
def _merge_n_kernel(
    x_ptr, lx_ptr, y_ptr, ly_ptr,
    M, H,
    sx_n, sx_m, sx_h, sx_d, slx_n, slx_m, slx_h,
    sy_m, sy_h, sy_d, sly_m, sly_h,
    N: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BASE2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:   # launched early (programmatic dependent launch): wait for the kernel before, first
        gdc_wait()
    rmask, m_idx, h_idx = _program_rows(M, H, BLOCK_R)
    lse_off = m_idx * slx_m + h_idx * slx_h
    # input i starts i strides in: 64-bit (a stride that fits in 32 bits arrives as i32, and 4 stacked
    # prefill inputs of 2^29 elements would wrap at i = 4)
    sx_n64 = tl.cast(sx_n, tl.int64)
    slx_n64 = tl.cast(slx_n, tl.int64)
    mx, total = _max_and_total(lx_ptr, lse_off, slx_n64, rmask, N, BLOCK_R, BASE2)
    # pass 2: the weighted sum of the outs
    d = tl.arange(0, BLOCK_D)
    mask2 = rmask[:, None] & (d[None, :] < D)
    x_off = m_idx[:, None] * sx_m + h_idx[:, None] * sx_h + d[None, :] * sx_d
    acc = _weighted_outs(x_ptr, x_off, sx_n64, lx_ptr, lse_off, slx_n64, 0, mx, total, rmask, mask2, N, BLOCK_R,
                         BLOCK_D, BASE2)
    _store_merged(y_ptr, ly_ptr, m_idx, h_idx, d, rmask, mask2, acc, mx, total, sy_m, sy_h, sy_d, sly_m, sly_h,
                  BASE2)


@triton.jit
def _rescale_kernel(
    x_ptr, lx_ptr, y_ptr, ly_ptr,
    M, H, INDEX,
    sx_p, sx_m, sx_h, sx_d, slx_n, slx_m, slx_h,
    sy_m, sy_h, sy_d, sly_m, sly_h,
    N: tl.constexpr, P: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BASE2: tl.constexpr, PDL: tl.constexpr = False,
):
    """The P partials of rank INDEX, their shares of an N-way merge summed (the all-gather +
    reduce-scatter form): sum_p out_p w_(INDEX P + p) / sum_i w_i over the N lses (rank-major: rank
    r's P partials at r P ..), and the merged lse; the same arithmetic as `_merge_n_kernel` with P
    outs read instead of N (P = 1: one partial's share)."""
    if PDL:
        gdc_wait()
    rmask, m_idx, h_idx = _program_rows(M, H, BLOCK_R)
    lse_off = m_idx * slx_m + h_idx * slx_h
    slx_n64 = tl.cast(slx_n, tl.int64)
    sx_p64 = tl.cast(sx_p, tl.int64)
    mx, total = _max_and_total(lx_ptr, lse_off, slx_n64, rmask, N, BLOCK_R, BASE2)
    d = tl.arange(0, BLOCK_D)
    mask2 = rmask[:, None] & (d[None, :] < D)
    x_off = m_idx[:, None] * sx_m + h_idx[:, None] * sx_h + d[None, :] * sx_d
    acc = _weighted_outs(x_ptr, x_off, sx_p64, lx_ptr, lse_off, slx_n64, tl.cast(INDEX, tl.int64) * P, mx, total,
                         rmask, mask2, P, BLOCK_R, BLOCK_D, BASE2)
    _store_merged(y_ptr, ly_ptr, m_idx, h_idx, d, rmask, mask2, acc, mx, total, sy_m, sy_h, sy_d, sly_m, sly_h,
                  BASE2)


@triton.jit
def _merge_segments_kernel(
    x_ptr, lx_ptr, seg_ptr, y_ptr, ly_ptr,
    M, H, T,
    sx_v, sx_t, sx_h, sx_d, slx_v, slx_t, slx_h,
    sy_m, sy_h, sy_d, sly_m, sly_h,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, UNROLL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row m = (r, t) of the M = R x T merges the partials [seg[r], seg[r + 1]) of x [V, T, H, D]
    (a length plan's items, `merge_segments_triton`): a count per row, so the loops run to the
    program's largest count under a mask; the same weights as `_merge_n_kernel` (natural log). A
    long sequence has tens of items: the lse of BLOCK_V of them are loaded at once and the partials
    UNROLL at a time, so that the loads of a round are in flight together (one item a round waited
    out a memory latency per item: ~22 µs for 26 items of 128 heads x 512 on an H100)."""
    if PDL:
        gdc_wait()
    rmask, m_idx, h_idx = _program_rows(M, H, BLOCK_R)
    r = m_idx // T
    lse_off = (m_idx % T) * slx_t + h_idx * slx_h
    lo = tl.load(seg_ptr + r, mask=rmask, other=0).to(tl.int64)
    count = tl.load(seg_ptr + r + 1, mask=rmask, other=0).to(tl.int64) - lo
    most = tl.max(count, 0)
    mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
    nan = tl.full([BLOCK_R], 0, tl.int32)
    j = tl.arange(0, BLOCK_V)
    i = 0
    while i < most:
        valid = rmask[:, None] & ((i + j)[None, :] < count[:, None])
        li = tl.load(lx_ptr + (lo[:, None] + i + j[None, :]) * slx_v + lse_off[:, None], mask=valid,
                     other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, tl.max(_clean_lse(li), 1))
        nan += tl.sum((li != li).to(tl.int32), 1)
        i += BLOCK_V
    mx = tl.where(nan > 0, float("nan"), mx)       # (a NaN partial: the row's max, weights, out and lse NaN)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    d = tl.arange(0, BLOCK_D)
    mask2 = rmask[:, None] & (d[None, :] < D)
    x_off = (m_idx % T)[:, None] * sx_t + h_idx[:, None] * sx_h + d[None, :] * sx_d
    total = tl.full([BLOCK_R], 0.0, tl.float32)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    i = 0
    while i < most:
        for u in tl.static_range(UNROLL):
            valid = rmask & (i + u < count)
            li = _clean_lse(tl.load(lx_ptr + (lo + i + u) * slx_v + lse_off, mask=valid,
                                    other=float("-inf")).to(tl.float32))
            wi = tl.exp(li - mx)
            oi = tl.load(x_ptr + (lo + i + u)[:, None] * sx_v + x_off, mask=mask2 & valid[:, None], other=0.0)
            acc += tl.where(wi[:, None] > 0, oi.to(tl.float32), 0.0) * wi[:, None]
            total += wi
        i += UNROLL
    acc = acc / tl.where(total > 0, total, 1.0)[:, None]
    _store_merged(y_ptr, ly_ptr, m_idx, h_idx, d, rmask, mask2, acc, mx, total, sy_m, sy_h, sy_d, sly_m, sly_h,
                  False)


def rescale_triton(outs: Tensor, lses: Tensor, index: int, *, base: str = "e", pdl: bool = False) -> AttnState:
    """Triton version of `merge.rescale_parts_to_merged` (inputs validated there): outs [P, ..., T, H,
    D], lses [N, P, ..., T, H] stacked (N x P at most merge.MAX_RESCALE_PARTIALS: the kernel's loops
    over them are unrolled). Returns (fp32 out, fp32 merged lse), fresh tensors."""
    pdl = pdl and pdl_ok(outs.device)
    n, p = lses.shape[0], outs.shape[0]
    shape = outs.shape[1:]
    H, D = shape[-2], shape[-1]
    x = outs.reshape(p, -1, H, D)
    lx = lses.reshape(n * p, -1, H)
    M = x.shape[1]
    y = torch.empty((M, H, D), dtype=torch.float32, device=outs.device)
    ly = torch.empty((M, H), dtype=torch.float32, device=outs.device)
    from .. import impl

    block_r, block_d, num_warps = _launch_config(D, M * H, 0 if impl.interpreting() else CONFIG["min_programs"])
    if M * H > 0:
        _rescale_kernel[(triton.cdiv(M * H, block_r),)](
            x, lx, y, ly, M, H, index,
            *x.stride(), *lx.stride(), *y.stride(), *ly.stride(),
            N=n * p, P=p, D=D, BLOCK_R=block_r, BLOCK_D=block_d, BASE2=(base == "2"), PDL=pdl, num_warps=num_warps,
            **({"launch_pdl": True} if pdl else {}))
    return AttnState(y.view(shape), ly.view(shape[:-1]))


def merge_segments_triton(outs: Tensor, lses: Tensor, segments: Tensor, out: Tensor, *,
                          pdl: bool = False) -> AttnState:
    """Merge runs of partials: row r of out [R, T, H, D] (any float dtype, written) and of the fresh
    lse [R, T, H] from outs [V, T, H, D] / lses [V, T, H] (natural log) at [segments[r],
    segments[r + 1]) (int32 [R + 1], on the device: a length plan's, read by the kernel, never on
    the host). A row with no partial gets out 0 and lse -inf, one with a NaN lse NaN."""
    pdl = pdl and pdl_ok(outs.device)
    R, T, H, D = out.shape
    ly = torch.empty((R, T, H), dtype=torch.float32, device=out.device)
    y = out.view(R * T, H, D)
    M = R * T
    from .. import impl

    least = 0 if impl.interpreting() else CONFIG["segment_min_programs"]
    block_r, block_d, num_warps = _launch_config(D, M * H, least)
    if M * H > 0:
        _merge_segments_kernel[(triton.cdiv(M * H, block_r),)](
            outs, lses, segments, y, ly, M, H, T,
            *outs.stride(), *lses.stride(), *y.stride(), *ly.view(M, H).stride(),
            D=D, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_V=CONFIG["segment_lse_block"],
            UNROLL=CONFIG["segment_unroll"], PDL=pdl, num_warps=num_warps, **({"launch_pdl": True} if pdl else {}))
    return AttnState(out, ly)


def _rows(x: Tensor, width: int) -> Tensor:
    """View `x [..., H(, D)]` as `[M, H(, D)]` (a copy only when the leading dims do not merge)."""
    return x.reshape((-1,) + tuple(x.shape[x.dim() - width:]))


CONFIG = {"block_elems": 4096, "num_warps": 4, "min_programs": 528, "segment_lse_block": 32, "segment_unroll": 4,
          "segment_min_programs": 8192}
"""Tile of one program (rows x padded head dim, in elements) and its warps; `megapar bench merge`
sweeps both on the GPU. min_programs: fewer rows a program (down to 1) until the grid has at least
this many programs (0: the tile as given). A decode step's split merge has few rows (B x Hq: 1024
for B 32, Hq 32: 32 programs of 32 rows at the tile alone). Whole decode calls (kernel + merge,
bench/debug/decode_merge.py, H200, B 32, 1/4 of 8K / 32K; bench/results/logs/decode-merge-h200.json),
0 -> 528: GQA bf16 41.7 -> 39.3 / 132.7 -> 130.4 µs, fp8 40.6 -> 38.5 / 120.1 -> 117.1; MLA 16
heads bf16 42.9 -> 34.2 / 101.9 -> 94.0, fp8 46.9 -> 40.4 / 129.4 -> 122.3; MLA 128 heads 86.1
-> 84.8 / 269.4 -> 267.2 (264 and 1056 within 0.3% of it on average). Large merges keep the tile.
Measured and removed: a one-round form of the N-way kernel (every input's loads issued first, one
rescaling pass; one memory round trip a program where the two-pass form's SASS has two). In `megapar
bench cp` of 2026-12-05 (bench/results/logs/cp-dcp-h200-2026-12-05-0410-d16f398.md, column
merge_one_round_us) it lost where the merge weighs most, MLA 16 heads at 1/4 of 8K / 32K: 29.96 /
80.71 µs against 28.60 / 79.20 (over one page 11.26 against 10.09), and tied elsewhere.
segment_lse_block / segment_unroll: a length plan's segment merge (`_merge_segments_kernel`) loads
the lse of that many items at once, and the partials that many at a time; segment_min_programs its
min_programs. Its sweep (bench/debug/mixed_probe.py, H100, 2026-12-06 06:14 UTC, bench/results/logs/
mixed-probe-h100-2026-12-06-0614-1afd972.json; the merge alone without programmatic dependent launch,
its lse 32 at a time, B 32 at 1/4 of the KV, µs, two 128K among thirty 2K / log-uniform 1K-128K):
MLA 128 heads (82 / 85 items) partials unroll 1, 4, 8 at min_programs 528: 18.6 / 12.7,
16.1 / 13.1, 16.0 / 14.5; at 8192 (one (row, head) a program): 13.5 / 12.2, 10.5 / 12.0, 13.7 /
13.7; GQA (Hq 32, D 128: one a program at 528 already) unroll 1 5.9 / 3.8, 4 3.9 / 3.6, 8 3.9 / 4.0.
One item a round and one lse at a time (before 087963e) took ~22 µs of the MLA row (the call's
graph time less its kernel's)."""


def _launch_config(D: int, rows: int = 0, min_programs: int = 0) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(D)
    block_r = max(1, min(128, CONFIG["block_elems"] // block_d))
    while block_r > 1 and -(-rows // block_r) < min_programs:
        block_r //= 2
    return block_r, block_d, CONFIG["num_warps"]


def merge_states_triton(outs: Tensor | Sequence[Tensor], lses: Tensor | Sequence[Tensor], *, base: str = "e",
                        out: Tensor | None = None, out_lse: Tensor | None = None, pdl: bool = False) -> AttnState:
    """Triton version of `merge_attn_states` (inputs already validated there).

    outs: [N, ..., T, H, D] stacked or a sequence of N [..., T, H, D]; lses likewise.
    pdl: launch with programmatic dependent launch (`pdl_ok`): the kernel may start while the
    one before it on the stream finishes, and waits for it before reading anything.
    """
    pdl = pdl and pdl_ok(first_device(outs))
    stacked = isinstance(outs, Tensor)
    first = outs[0]
    shape, lse_shape = first.shape, first.shape[:-1]
    H, D = shape[-2], shape[-1]
    y = out if out is not None else torch.empty(shape, dtype=first.dtype, device=first.device)
    ly = out_lse if out_lse is not None else torch.empty(lse_shape, dtype=torch.float32, device=first.device)
    # Destinations must be written through views; fall back to a temporary when they do not merge.
    try:
        y_rows = y.view(-1, H, D)
    except RuntimeError:
        y_rows = None
    try:
        ly_rows = ly.view(-1, H)
    except RuntimeError:
        ly_rows = None
    y_k = y_rows if y_rows is not None else torch.empty((y.numel() // max(H * D, 1), H, D), dtype=y.dtype,
                                                        device=y.device)
    ly_k = ly_rows if ly_rows is not None else torch.empty((ly.numel() // max(H, 1), H), dtype=torch.float32,
                                                           device=ly.device)
    M = y_k.shape[0]
    from .. import impl

    # (the interpreter runs programs one after another: a finer grid there only costs CPU time)
    block_r, block_d, num_warps = _launch_config(D, M * H, 0 if impl.interpreting() else CONFIG["min_programs"])
    grid = (triton.cdiv(M * H, block_r),)
    n = outs.shape[0] if stacked else len(outs)
    if not stacked and n == 2:
        a, b = _rows(outs[0], 2), _rows(outs[1], 2)
        la, lb = _rows(lses[0], 1), _rows(lses[1], 1)
        _merge_pair_kernel[grid](
            a, la, b, lb, y_k, ly_k, M, H,
            *a.stride(), *la.stride(), *b.stride(), *lb.stride(), *y_k.stride(), *ly_k.stride(),
            D=D, BLOCK_R=block_r, BLOCK_D=block_d, BASE2=(base == "2"), PDL=pdl, num_warps=num_warps,
            **({"launch_pdl": True} if pdl else {}))
    else:
        x = outs if stacked else torch.stack(list(outs))
        lx = lses if isinstance(lses, Tensor) else torch.stack(list(lses))
        x = x.reshape(n, -1, H, D)
        lx = lx.reshape(n, -1, H)
        _merge_n_kernel[grid](
            x, lx, y_k, ly_k, M, H,
            *x.stride(), *lx.stride(), *y_k.stride(), *ly_k.stride(),
            N=n, D=D, BLOCK_R=block_r, BLOCK_D=block_d, BASE2=(base == "2"), PDL=pdl, num_warps=num_warps,
            **({"launch_pdl": True} if pdl else {}))
    if y_rows is None:
        y.copy_(y_k.view(shape))
    if ly_rows is None:
        ly.copy_(ly_k.view(lse_shape))
    return AttnState(y, ly)


def first_device(outs: Tensor | Sequence[Tensor]) -> torch.device:
    return outs.device if isinstance(outs, Tensor) else outs[0].device


def pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch applies: a CUDA device of compute capability >= 9 (Hopper),
    a Triton that launches with it, not the interpreter."""
    from .. import impl

    if not HAS_PDL or device.type != "cuda" or impl.interpreting():
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def merge_bytes(n: int, rows: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes a merge of `n` states moves: n outs + n lses read, one out + one lse written."""
    return n * rows * (head_dim * elem_bytes + 4) + rows * (head_dim * elem_bytes + 4)

