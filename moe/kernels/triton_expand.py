"""FP4 weight expansion in Triton: dense bf16/fp16/fp32 copies, or exact FP8 (W4A8 fold).

Bandwidth-bound, run once per call on the paths with many tokens per expert, where each
expanded weight tile is reused by many token tiles (torch._grouped_mm on bf16, or the W4A8
fp8 GEMM). Reads the prepared weight's own layout (`PreparedWeight.strides()`): paired bytes
or oct / octb int32 words, rows in order or tiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapar.moe.kernels.prepare import PreparedWeight
from megapar.moe.kernels.triton_common import block_scale, chunks_for, e2m1_pair, nibble_operand, octb_operand

EXPAND_DEFAULTS: dict[str, int] = {"rows_per_program": 16, "num_warps": 4}   # H200: 3.08 TB/s (bf16 out)


@triton.jit
def _fold_ref(s_ptr, row_base, blk, nblk, r_mask):
    """e_ref of the 1x128 group holding block `blk` (mxfp4): max block exponent - 6, >= -126;
    and whether the group has a NaN scale. A row's last group may hold fewer than 4 of its nblk
    blocks (K not a multiple of 128): only the row's own blocks count (as parallel.quant's fold)."""
    b0 = (blk // 4) * 4
    e_max = tl.full(r_mask.shape, -127, tl.int32)
    has_nan = r_mask & False
    for t in tl.static_range(4):
        st = tl.load(s_ptr + row_base + b0 + t, mask=r_mask & (b0 + t < nblk), other=0)
        e_max = tl.maximum(e_max, tl.where(st == 255, -127, st.to(tl.int32) - 127))
        has_nan = has_nan | (st == 255)
    return tl.maximum(e_max - 6, -126), has_nan


@triton.jit
def _expand_block(vals, s_ptr, gs_ptr, ref_ptr, out_ptr, out_scale_ptr, r64, r_mask, N, K, blk, offs_b,
                  BLOCK: tl.constexpr, NVFP4: tl.constexpr, OUT: tl.constexpr):
    """One scale block of rows: vals fp32 [ROWS, BLOCK] E2M1 values -> out[r, blk*BLOCK + j]."""
    nblk = K // BLOCK
    s = tl.load(s_ptr + r64 * nblk + blk, mask=r_mask, other=0)
    if OUT == 0:
        vals = vals * block_scale(s, NVFP4, 2)[:, None]
        if NVFP4:
            vals = vals * tl.load(gs_ptr + r64 // N, mask=r_mask, other=1.0)[:, None]
    else:
        if OUT == 1:
            e_ref = tl.load(ref_ptr + r64, mask=r_mask, other=0)
        else:
            e_ref, has_nan = _fold_ref(s_ptr, r64 * nblk, blk, nblk, r_mask)
            gscale = tl.where(has_nan, float("nan"), ((e_ref + 127) << 23).to(tl.float32, bitcast=True))
            first = (blk % 4) == 0
            tl.store(out_scale_ptr + r64 * ((K + 127) // 128) + blk // 4, gscale, mask=r_mask & first)
        e_b = tl.where(s == 255, -127, s.to(tl.int32) - 127)
        shift = tl.maximum(e_b - e_ref, -126)
        vals = vals * ((shift + 127) << 23).to(tl.float32, bitcast=True)[:, None]
    tl.store(out_ptr + r64[:, None] * K + (blk * BLOCK + offs_b)[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=r_mask[:, None])


@triton.jit
def _expand_kernel(w_ptr, s_ptr, gs_ptr, ref_ptr, out_ptr, out_scale_ptr, total_rows, N, K,
                   stride_we, stride_wtile, stride_wn, stride_wchunk,
                   ROWS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, NVFP4: tl.constexpr,
                   OUT: tl.constexpr, PACK: tl.constexpr, TILE: tl.constexpr):
    """FP4 rows (paired bytes, or oct / octb int32 words) -> natural-order rows. OUT 0: dense
    (e2m1 * scale [* global]) in out's dtype; OUT 1: E4M3 v * 2^(e_block - e_ref[row])
    (rowwise fold); OUT 2: the same with e_ref per 1x128 group, group scales 2^e_ref written."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = pid_r * ROWS + tl.arange(0, ROWS)
    r_mask = r < total_rows
    r64 = r.to(tl.int64)
    n64 = r64 % N
    w_rows = w_ptr + (r64 // N) * stride_we + (n64 // TILE) * stride_wtile + (n64 % TILE) * stride_wn
    offs_b = tl.arange(0, BLOCK)
    for c in tl.static_range(CHUNKS):
        unit = pid_k * CHUNKS + c
        if PACK >= 1:   # oct (1) / octb (2) int32 words
            kc = unit * 8 * BLOCK
            w = tl.load(w_rows[:, None] + (unit * stride_wchunk + offs_b)[None, :], mask=r_mask[:, None], other=0)
            for i in tl.static_range(8):
                if PACK == 2:
                    vals = octb_operand(w, i, 2)
                else:
                    vals = nibble_operand(w, i, 2)
                _expand_block(vals, s_ptr, gs_ptr, ref_ptr, out_ptr, out_scale_ptr, r64, r_mask,
                              N, K, kc // BLOCK + i, offs_b, BLOCK, NVFP4, OUT)
        else:
            kc = unit * 2 * BLOCK
            wb = tl.load(w_rows[:, None] + (unit * stride_wchunk + offs_b)[None, :], mask=r_mask[:, None], other=0)
            lo, hi = e2m1_pair(wb, 2)
            _expand_block(lo, s_ptr, gs_ptr, ref_ptr, out_ptr, out_scale_ptr, r64, r_mask, N, K, kc // BLOCK,
                          offs_b, BLOCK, NVFP4, OUT)
            _expand_block(hi, s_ptr, gs_ptr, ref_ptr, out_ptr, out_scale_ptr, r64, r_mask, N, K, kc // BLOCK + 1,
                          offs_b, BLOCK, NVFP4, OUT)


def expand_fp4(w: PreparedWeight, dtype: torch.dtype = torch.bfloat16, *, fold: str | None = None,
               out: torch.Tensor | None = None, rows_per_program: int | None = None, units: int | None = None,
               num_warps: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FP4 weight [E, N, K] -> dense natural-order copy.

    fold=None: `dtype` values equal to moe.quant.dequantize(w, dtype).
    fold="row" / "group" (mxfp4): exact E4M3 data plus fp32 scales [E, N] (2^e_ref per row) /
    [E, N, ceil(K/128)] (per 1x128 group, the last one partial when K is not a multiple of 128;
    bit-identical to moe.quant.mxfp4_to_fp8_block(tile_rows=1)).
    """
    if not w.is_fp4:
        raise ValueError(f"expand_fp4 needs an mxfp4/nvfp4 weight, got {w.fmt!r}")
    if w.packing == "natural":
        w = w.in_layout("paired")          # (prepared weights are never natural on the GPU)
    E, N, K = w.shape
    rows_total = E * N
    kind = {None: 0, "row": 1, "group": 2}
    if fold not in kind:
        raise ValueError(f"fold must be None, 'row' or 'group', got {fold!r}")
    if fold is not None and w.fmt != "mxfp4":
        raise ValueError(f"an exact FP8 fold needs mxfp4 (power-of-two scales), got {w.fmt!r}")
    out_dtype = torch.float8_e4m3fn if fold else dtype
    if out is None:
        out = torch.empty(E, N, K, dtype=out_dtype, device=w.device)
    elif (tuple(out.shape) != (E, N, K) or out.dtype != out_dtype or out.device != w.device
          or not out.is_contiguous()):   # (the kernel writes rows of K at r * K: nothing else fits)
        raise ValueError(f"out must be a contiguous {out_dtype} tensor [E={E}, N={N}, K={K}] on {w.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}, contiguous={out.is_contiguous()}")
    scale_out = out
    ref = w.scale
    if fold == "row":
        ref = w.fold.e_ref
        scale_out = w.row_fold_scale()
    elif fold == "group":
        scale_out = torch.empty(E, N, -(-K // 128), dtype=torch.float32, device=w.device)
    oct = w.packing in ("oct", "octb")
    unit = (8 if oct else 2) * w.block
    chunks = chunks_for(K, unit, units or (1 if oct else 4))
    rows_per = rows_per_program or EXPAND_DEFAULTS["rows_per_program"]
    num_warps = num_warps or EXPAND_DEFAULTS["num_warps"]
    grid = (triton.cdiv(rows_total, rows_per), K // (unit * chunks))
    gs = w.global_scale if w.global_scale is not None else w.scale
    st = w.strides()
    _expand_kernel[grid](st.data, w.scale, gs, ref, out, scale_out, rows_total, N, K,
                         st.expert, st.tile, st.row, st.chunk,
                         ROWS=rows_per, CHUNKS=chunks, BLOCK=w.block, NVFP4=w.fmt == "nvfp4", OUT=kind[fold],
                         PACK={"oct": 1, "octb": 2}.get(w.packing, 0), TILE=st.tile_n, num_warps=num_warps)
    return (out, scale_out) if fold else out
