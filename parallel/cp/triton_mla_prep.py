"""Triton kernel of the fused MLA prep (`mla_prep.py` defines the math and validates the inputs).

Grid (T, q_tiles + 1): program (t, i < q_tiles) normalizes and rotates BLOCK_H query heads of
token t; program (t, q_tiles) normalizes c_kv, rotates k_pe, quantizes the latent row to e4m3
(fp8 caches) and stores it at the token's slot when this DCP rank owns the position. Every
value is rounded to the input dtype where the torch sequence rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dcp import DCPLayout
from .mla import MLACache

@triton.jit
def _prep_query_tile(q_ptr, qw_ptr, qo_ptr, t, part, cos, sin, H, eps, sq_t, sq_h, sqo_t, sqo_h,
                     NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, Q_NORM: tl.constexpr):
    """Query heads [part * BLOCK_H, +BLOCK_H) of token t: optional RMSNorm, RoPE on the rope part."""
    h = part * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    row = t * sq_t + h.to(tl.int64) * sq_h
    n = tl.arange(0, BLOCK_NOPE)
    nmask = hmask[:, None] & (n < NOPE)[None, :]
    j = tl.arange(0, 2 * BLOCK_HALF)               # the rope part as one contiguous run of pairs
    pmask = hmask[:, None] & (j < 2 * HALF)[None, :]
    xn = tl.load(q_ptr + row[:, None] + n[None, :], mask=nmask, other=0.0)
    xp = tl.load(q_ptr + row[:, None] + NOPE + j[None, :], mask=pmask, other=0.0)
    fn = xn.to(tl.float32)
    fe, fo = tl.split(tl.reshape(xp.to(tl.float32), (BLOCK_H, BLOCK_HALF, 2)))       # x[2i], x[2i + 1]
    if Q_NORM:
        ms = (tl.sum(fn * fn, 1) + tl.sum(fe * fe, 1) + tl.sum(fo * fo, 1)) / (NOPE + 2 * HALF)
        inv = tl.math.rsqrt(ms + eps)[:, None]
        wn = tl.load(qw_ptr + n, mask=n < NOPE, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(qw_ptr + NOPE + j, mask=j < 2 * HALF, other=0.0).to(tl.float32)
        we, wo = tl.split(tl.reshape(wp, (BLOCK_HALF, 2)))
        we, wo = we[None, :], wo[None, :]
        fn = ((fn * inv) * wn).to(xn.dtype).to(tl.float32)
        fe = ((fe * inv) * we).to(xn.dtype).to(tl.float32)
        fo = ((fo * inv) * wo).to(xn.dtype).to(tl.float32)
    orow = t * sqo_t + h.to(tl.int64) * sqo_h
    tl.store(qo_ptr + orow[:, None] + n[None, :], fn.to(xn.dtype), mask=nmask)
    re = fe * cos[None, :] - fo * sin[None, :]
    ro = fe * sin[None, :] + fo * cos[None, :]
    rp = tl.reshape(tl.join(re, ro), (BLOCK_H, 2 * BLOCK_HALF))
    tl.store(qo_ptr + orow[:, None] + NOPE + j[None, :], rp.to(xn.dtype), mask=pmask)


@triton.jit
def _prep_latent(kv_ptr, kw_ptr, table_ptr, cache_ptr, scale_ptr, slot_ptr, t, pos, cos, sin, eps,
                 dcp_size, dcp_rank, interleave, skv_t, st_t, sc_blk, sc_tok, ss_blk, ss_tok, table_width, num_blocks,
                 max_pos,
                 R: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 PAGE: tl.constexpr, FP8: tl.constexpr):
    """The latent of token t: RMSNorm of c_kv, RoPE of k_pe, fp8 quantization, the sharded insert."""
    c = tl.arange(0, BLOCK_R)
    cmask = c < R
    xc = tl.load(kv_ptr + t * skv_t + c, mask=cmask, other=0.0)
    fc = xc.to(tl.float32)
    kms = tl.sum(fc * fc, 0) / R
    w = tl.load(kw_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    fc = ((fc * tl.math.rsqrt(kms + eps)) * w).to(xc.dtype).to(tl.float32)
    j = tl.arange(0, 2 * BLOCK_HALF)
    jmask = j < 2 * HALF
    kp = tl.load(kv_ptr + t * skv_t + R + j, mask=jmask, other=0.0).to(tl.float32)
    kfe, kfo = tl.split(tl.reshape(kp, (BLOCK_HALF, 2)))
    kre = (kfe * cos - kfo * sin).to(xc.dtype).to(tl.float32)
    kro = (kfe * sin + kfo * cos).to(xc.dtype).to(tl.float32)
    # where the token lives (docs/numerics.md §8.2)
    vb = PAGE * dcp_size
    o = pos % vb
    owner = (o // interleave) % dcp_size
    offset = (o // (dcp_size * interleave)) * interleave + o % interleave
    # a bad entry (position outside the table or the rope table, block id outside the cache) is not
    # read past the table nor written anywhere: slot -1, as dcp.insert_slots does on CUDA (no host
    # check there)
    vblock = pos // vb
    in_table = (pos >= 0) & (vblock < table_width)
    block = tl.load(table_ptr + t * st_t + vblock, mask=in_table, other=-1).to(tl.int64)
    ok = in_table & (block >= 0) & (block < num_blocks) & (owner == dcp_rank) & (pos < max_pos)
    slot = tl.where(ok, block * PAGE + offset, -1)
    tl.store(slot_ptr + t, slot)
    if slot >= 0:
        # (the cache may be a view of a larger buffer: addressed by its block and token strides)
        dst = cache_ptr + block * sc_blk + offset * sc_tok
        if FP8:
            amax = tl.maximum(tl.max(tl.abs(fc), 0), tl.maximum(tl.max(tl.abs(kre), 0), tl.max(tl.abs(kro), 0)))
            sc = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
            qc = tl.minimum(tl.maximum(tl.math.div_rn(fc, sc), -448.0), 448.0)
            qe = tl.minimum(tl.maximum(tl.math.div_rn(kre, sc), -448.0), 448.0)
            qo = tl.minimum(tl.maximum(tl.math.div_rn(kro, sc), -448.0), 448.0)
            tl.store(dst + c, qc.to(cache_ptr.dtype.element_ty), mask=cmask)
            tl.store(dst + R + j, tl.reshape(tl.join(qe, qo), (2 * BLOCK_HALF,)).to(cache_ptr.dtype.element_ty),
                     mask=jmask)
            tl.store(scale_ptr + block * ss_blk + offset * ss_tok, sc)
        else:
            tl.store(dst + c, fc.to(cache_ptr.dtype.element_ty), mask=cmask)
            tl.store(dst + R + j, tl.reshape(tl.join(kre, kro), (2 * BLOCK_HALF,)).to(cache_ptr.dtype.element_ty),
                     mask=jmask)


@triton.jit
def _mla_prep_kernel(
    q_ptr, kv_ptr, pos_ptr, table_ptr, cs_ptr, qw_ptr, kw_ptr, qo_ptr, cache_ptr, scale_ptr, slot_ptr,
    H, eps, dcp_size, dcp_rank, interleave,
    sq_t, sq_h, skv_t, sqo_t, sqo_h, st_t, scs, sc_blk, sc_tok, ss_blk, ss_tok, table_width, num_blocks, max_pos,
    NOPE: tl.constexpr, BLOCK_NOPE: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
    Q_NORM: tl.constexpr, FP8: tl.constexpr, Q_TILES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    # a position outside the rope table reads nothing past it: its angles are NaN, so its query's
    # rope part is NaN (the decode row reports it) and its latent is not written (slot -1), as
    # the torch sequence does on CUDA; CPU tensors raise before the launch
    pos_ok = (pos >= 0) & (pos < max_pos)
    cs_row = tl.where(pos_ok, pos, 0) * scs
    imask = i < HALF
    cos = tl.load(cs_ptr + cs_row + i, mask=imask & pos_ok, other=0.0)
    sin = tl.load(cs_ptr + cs_row + HALF + i, mask=imask & pos_ok, other=0.0)
    cos = tl.where(pos_ok, cos, float("nan"))      # (padding lanes stay 0 on a good row: the fp8 amax)
    sin = tl.where(pos_ok, sin, float("nan"))
    # (each branch is a function, and no local holds a dtype: Triton 3.6 merges the locals of both
    # branches of a run-time `if`, and a dtype value breaks that merge)
    if part < Q_TILES:
        _prep_query_tile(q_ptr, qw_ptr, qo_ptr, t, part, cos, sin, H, eps, sq_t, sq_h, sqo_t, sqo_h,
                         NOPE, BLOCK_NOPE, HALF, BLOCK_HALF, BLOCK_H, Q_NORM)
    else:
        _prep_latent(kv_ptr, kw_ptr, table_ptr, cache_ptr, scale_ptr, slot_ptr, t, pos, cos, sin, eps,
                     dcp_size, dcp_rank, interleave, skv_t, st_t, sc_blk, sc_tok, ss_blk, ss_tok, table_width,
                     num_blocks, max_pos, R, BLOCK_R, HALF,
                     BLOCK_HALF, PAGE, FP8)


CONFIG = {"block_elems": 4096, "num_warps": 4}


def mla_prep_triton(q: Tensor, kv: Tensor, positions: Tensor, cache: MLACache, block_table: Tensor, cos_sin: Tensor,
                    kv_norm_weight: Tensor, layout: DCPLayout, q_norm_weight: Tensor | None, nope: int,
                    eps: float) -> tuple[Tensor, Tensor]:
    """Launch; returns (q_out [T, H, nope + d_r], slots [T] int64)."""
    t, heads, d = q.shape
    r = cache.kv_lora_rank
    half = (d - nope) // 2
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    q_out = torch.empty_like(q)
    slots = torch.empty(t, dtype=torch.int64, device=q.device)
    if cache.kv.stride(-1) != 1:
        raise ValueError(f"the Triton MLA prep writes the latent cache's values with unit stride; got stride "
                         f"{cache.kv.stride()} (backend='torch' takes any)")
    fp8 = cache.scale is not None
    scale = cache.scale if fp8 else slots
    scale_st = (scale.stride(0), scale.stride(1)) if fp8 else (0, 0)
    block_nope = triton.next_power_of_2(max(nope, 1))
    fit = max(1, CONFIG["block_elems"] // (block_nope + 2 * half))
    block_h = min(triton.next_power_of_2(heads), 1 << (fit.bit_length() - 1))   # tl.arange needs a power of two
    q_tiles = triton.cdiv(heads, block_h)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    # the kernel reads these with unit stride (positions[t], cos_sin's columns, the norm weights)
    positions = positions.contiguous()
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    kv_norm_weight = kv_norm_weight.contiguous()
    q_norm_weight = None if q_norm_weight is None else q_norm_weight.contiguous()
    if t > 0:
        _mla_prep_kernel[(t, q_tiles + 1)](
            q, kv, positions, table, cos_sin, q_norm_weight if q_norm_weight is not None else kv_norm_weight,
            kv_norm_weight, q_out, cache.kv, scale, slots,
            heads, eps, layout.size, layout.rank, layout.interleave,
            q.stride(0), q.stride(1), kv.stride(0), q_out.stride(0), q_out.stride(1), table.stride(0),
            cos_sin.stride(0), cache.kv.stride(0), cache.kv.stride(1), *scale_st, table.shape[-1], cache.kv.shape[0],
            cos_sin.shape[0],
            NOPE=nope, BLOCK_NOPE=block_nope, R=r, BLOCK_R=triton.next_power_of_2(r), HALF=half,
            BLOCK_HALF=triton.next_power_of_2(max(half, 1)), BLOCK_H=block_h, PAGE=cache.block_size,
            Q_NORM=q_norm_weight is not None, FP8=fp8, Q_TILES=q_tiles, num_warps=CONFIG["num_warps"])
    return q_out, slots
