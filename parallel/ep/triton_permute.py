"""Triton kernels for the EP local permute (`gather_rows`) and weighted unpermute (`gather_reduce`).

Imported only when used on CUDA (or under TRITON_INTERPRET=1 in tests); the torch references
with the same signatures are in `parallel.ep.layout`. Both kernels are pure data movement, so
the one idea is to move rows with wide loads: a plain permute reinterprets each row as int32
(or int16) words, whatever the payload dtype (bf16, fp8, packed fp4), and the unpermute reads
its K source rows once each and accumulates in fp32 registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapar.parallel.ep.words import as_words, word_size

_BLOCK_C = 1024


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, scale_ptr, out_ptr, C, src_stride, out_stride,
                        HAS_SCALE: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    src_row = tl.load(idx_ptr + row).to(tl.int64)
    out_ptrs = out_ptr + row.to(tl.int64) * out_stride + cols
    if src_row >= 0:
        vals = tl.load(src_ptr + src_row * src_stride + cols, mask=mask)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + row)
            vals = (vals.to(tl.float32) * scale).to(out_ptr.dtype.element_ty)
        tl.store(out_ptrs, vals, mask=mask)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_C], 0, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_reduce_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, C, src_stride, out_stride,
                          K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    acc = tl.full([BLOCK_C], 0.0, tl.float32)
    # masked loads rather than branches, so the K row loads can all be in flight at once
    for j in tl.static_range(K):
        src_row = tl.load(idx_ptr + row * K + j).to(tl.int64)
        ok = src_row >= 0
        vals = tl.load(src_ptr + tl.maximum(src_row, 0) * src_stride + cols, mask=mask & ok, other=0.0)
        vals = vals.to(tl.float32)
        if HAS_W:
            vals = vals * tl.load(w_ptr + row * K + j)
        acc += tl.where(ok, vals, 0.0)
    tl.store(out_ptr + row.to(tl.int64) * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, row_scale: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out[m] = src[idx[m]] (zero row where idx == -1), times row_scale[m] (fp32) when given.
    src: [N, C], unit last stride; idx: [M] int32/int64; row_scale: [M] fp32 or None;
    out: [M, C] of src's dtype with unit last stride (e.g. columns of a packed buffer) or None."""
    m, c = idx.shape[0], src.shape[1]
    if out is None:
        out = torch.empty((m, c), dtype=src.dtype, device=src.device)
    if m == 0 or c == 0:
        return out
    idx = idx.contiguous()
    if row_scale is None:
        size = word_size(src, out)
        src_w, out_w = as_words(src, size), as_words(out, size)
    else:
        src_w, out_w, row_scale = src, out, row_scale.float().contiguous()
    cw = src_w.shape[1]
    if src.shape[0] == 0:  # every row is padding
        src_w = out_w
    grid = (m, triton.cdiv(cw, _BLOCK_C))
    _gather_rows_kernel[grid](src_w, idx, row_scale if row_scale is not None else idx, out_w, cw,
                              src_w.stride(0), out_w.stride(0), HAS_SCALE=row_scale is not None,
                              BLOCK_C=_BLOCK_C, num_warps=4)
    return out


def gather_reduce(src: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[m] = sum_k weights[m, k] * src[idx[m, k]] over idx >= 0, fp32 accumulation.
    src: [N, C] float, unit last stride; idx: [M, K] int (-1 = skip); weights: [M, K] fp32 or
    None (= 1) -> [M, C] in out_dtype (default src's dtype)."""
    m, k = idx.shape
    c = src.shape[1]
    out = torch.empty((m, c), dtype=out_dtype or src.dtype, device=src.device)
    if m == 0 or c == 0:
        return out
    if src.shape[0] == 0:
        return out.zero_()
    idx = idx.contiguous()
    w = weights.float().contiguous() if weights is not None else idx
    grid = (m, triton.cdiv(c, _BLOCK_C))
    _gather_reduce_kernel[grid](src, idx, w, out, c, src.stride(0), out.stride(0), K=k,
                                HAS_W=weights is not None, BLOCK_C=_BLOCK_C, num_warps=4)
    return out
