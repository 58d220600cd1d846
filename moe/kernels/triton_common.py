"""Device helpers shared by the Triton expert-GEMM kernels (W4A16, W4A8, weight expansion).

The one place for the pieces every kernel module needs: the expert lookup of a token tile
(`expert_tile`, counts read on the device), FP4 operand expansion (`e2m1_pair`,
`nibble_operand`, `block_scale`), the SwiGLU epilogue, E4M3 rounding done in fp32 and the
fp8_group quantization of an epilogue, plus the host-side tile layout of grouped rows. The
kernel modules import from here and never from each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapar.parallel.quant import DEFAULT_AMAX_FLOOR, E4M3_MAX
from megapar.parallel.quant.triton_quant import _abs_max_bits, _fast_div_ok, _fp8_tile, e8m0_value, fp8_scale

FP8_MAX = tl.constexpr(E4M3_MAX)
AMAX_FLOOR = tl.constexpr(DEFAULT_AMAX_FLOOR)   # parallel.quant's fp8 amax floor


@triton.jit
def expert_tile(pid_t, counts_ptr, offsets_ptr, num_experts, tiles_per_expert, capacity,
                E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr):
    """Tile slot -> (expert, first row, rows to compute (<= 0: none), rows to store)."""
    if SLAB:
        e = pid_t // tiles_per_expert
        j = pid_t - e * tiles_per_expert
        count = tl.minimum(tl.load(counts_ptr + e).to(tl.int32), capacity)
        row0 = e * capacity + j * BLOCK_M
        rows = count - j * BLOCK_M
        store_rows = capacity - j * BLOCK_M
    else:
        idx = tl.arange(0, E_POW2)
        cnt = tl.load(counts_ptr + idx, mask=idx < num_experts, other=0).to(tl.int32)
        tiles = (cnt + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, 0)
        e = tl.sum((tile_end <= pid_t).to(tl.int32), 0)
        sel = idx == e
        tile_begin = tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        count = tl.sum(tl.where(sel, cnt, 0), 0)
        if HAS_OFFSETS:
            start = tl.load(offsets_ptr + e, mask=e < num_experts, other=0).to(tl.int32)
        else:
            start = tl.sum(tl.where(sel, tl.cumsum(cnt, 0) - cnt, 0), 0)
        j = pid_t - tile_begin
        row0 = start + j * BLOCK_M
        rows = count - j * BLOCK_M
        store_rows = rows
    return e, row0, rows, store_rows


@triton.jit
def e2m1_pair(wb, MODE: tl.constexpr):
    """Paired bytes uint8 [R, B] -> (low-nibble operand, high-nibble operand) [R, B].

    MODE 0: fp16 v * 2^-14; MODE 1: bf16 v; MODE 2: fp32 v (v the E2M1 value, exact)."""
    b = wb.to(tl.int32)
    if MODE == 0:
        lo = ((b << 12) & 0x8000) | ((b << 9) & 0x0E00)
        hi = ((b << 8) & 0x8000) | ((b << 5) & 0x0E00)
        return lo.to(tl.int16).to(tl.float16, bitcast=True), hi.to(tl.int16).to(tl.float16, bitcast=True)
    else:
        sign = -2147483648  # 0x80000000 as int32
        lo = ((b << 28) & sign) | ((b << 22) & 0x01C00000)
        hi = ((b << 24) & sign) | ((b << 18) & 0x01C00000)
        lo = lo.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126: the bits hold v * 2^-126
        hi = hi.to(tl.float32, bitcast=True) * 8.507059173023462e37
        if MODE == 1:
            return lo.to(tl.bfloat16), hi.to(tl.bfloat16)
        else:
            return lo, hi


@triton.jit
def block_scale(s, NVFP4: tl.constexpr, MODE: tl.constexpr):
    """Scale bytes (uint8 [R]) -> fp32 multipliers for the partial products of their blocks."""
    if NVFP4:
        f = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        f = e8m0_value(s)   # 2^(s-127): byte 0 -> 2^-127 (an fp32 subnormal, not 0), 255 -> NaN
    if MODE == 0 or MODE >= 3:
        f = f * 4194304.0   # 2^22 = 2^14 (fp16 weight bits) * 2^8 (activation pre-scale)
    return f


@triton.jit
def swiglu_tile(g, u, limit, alpha, beta, HAS_LIMIT: tl.constexpr):
    """docs/numerics.md: g = min(g, L), u = clamp(u, -L, L), g * sigmoid(alpha g) * (u + beta); NaN propagates."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    return g * tl.sigmoid(alpha * g) * (u + beta)


@triton.jit
def to_e4m3(y):
    """fp32 y, |y| <= 448 -> e4m3 with ONE round-to-nearest-even, done in fp32 (Triton's own cast
    can round twice, through fp16, and then differs from torch by an ulp). Signed zeros kept."""
    bits = y.to(tl.int32, bitcast=True)
    q = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3          # exponent of the E4M3 quantum
    m = y * ((127 - q) << 23).to(tl.float32, bitcast=True)         # exact: |m| < 16
    m = (m + 12582912.0) - 12582912.0                             # 1.5 * 2^23: RNE to an integer
    r = m * ((127 + q) << 23).to(tl.float32, bitcast=True)
    r = tl.where(r == 0.0, y * 0.0, r)
    return r.to(tl.float8e4nv)                                    # exact: r is an E4M3 value


@triton.jit
def fp8_group_quant(v, AXIS: tl.constexpr):
    """v fp32 (one 128-group along AXIS) -> (e4m3 values, fp32 scale per group), parallel.quant's
    fp8_group in registers (its own device helpers: same bits, NaN/inf included)."""
    abits = _abs_max_bits(v, AXIS)
    scale = fp8_scale(abits.to(tl.float32, bitcast=True), AMAX_FLOOR, False)
    slow = (tl.max(abits) >= 0x7F800000) | (tl.min(_fast_div_ok(scale).to(tl.int32)) == 0)
    byte = _fp8_tile(v, tl.expand_dims(scale, AXIS), slow, False, False)
    return byte.to(tl.float8e4nv, bitcast=True), scale


@triton.jit
def nibble_operand(w, i: tl.constexpr, MODE: tl.constexpr):
    """int32 words [R, Q] -> operand [R, Q] of nibble i of each word (MODE 0 / 1 / 2 encodings)."""
    b = (w >> (4 * i)) & 0xF
    if MODE == 0:
        v = ((b << 12) & 0x8000) | ((b << 9) & 0x0E00)
        return v.to(tl.int16).to(tl.float16, bitcast=True)
    else:
        sign = -2147483648
        v = ((b << 28) & sign) | ((b << 22) & 0x01C00000)
        v = v.to(tl.float32, bitcast=True) * 8.507059173023462e37
        if MODE == 1:
            return v.to(tl.bfloat16)
        else:
            return v


@triton.jit
def _octb_code(src, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr):
    """The E2M1 codes whose bits (m, e0, e1, sign) sit at bits P0..P3 of int32 words `src`."""
    return ((src >> P0) & 1) | (((src >> P1) & 1) << 1) | (((src >> P2) & 1) << 2) | (((src >> P3) & 1) << 3)


@triton.jit
def octb_operand(w, i: tl.constexpr, MODE: tl.constexpr):
    """int32 words [R, Q] of one packing unit in "octb" order -> operand [R, Q] of scale block i
    (element k of the block is in word 2 (k // 2) + i // 4; bits: prepare.OCTB_POS), in the
    MODE 0 / 1 / 2 encodings of `nibble_operand`."""
    R: tl.constexpr = w.shape[0]
    Q: tl.constexpr = w.shape[1]
    even, odd = tl.split(tl.reshape(w, (R, Q // 2, 2)))
    if i < 4:
        src = even
    else:
        src = odd
    if i % 4 == 0:
        lo = _octb_code(src, 0, 1, 2, 9)
        hi = _octb_code(src, 16, 17, 18, 25)
    elif i % 4 == 1:
        lo = _octb_code(src, 4, 5, 6, 13)
        hi = _octb_code(src, 20, 21, 22, 29)
    elif i % 4 == 2:
        lo = _octb_code(src, 10, 11, 12, 19)
        hi = _octb_code(src, 26, 27, 28, 3)
    else:
        lo = _octb_code(src, 30, 7, 8, 15)
        hi = _octb_code(src, 14, 23, 24, 31)
    return nibble_operand(tl.reshape(tl.join(lo, hi), (R, Q)), 0, MODE)


# ---- host side ----------------------------------------------------------------------------------

def layout_args(rows, x: torch.Tensor, block_m: int) -> tuple[int, int, int, torch.Tensor, torch.Tensor, bool]:
    """(tile slots, tiles per expert, capacity, counts, offsets-or-counts, has offsets)."""
    E = rows.num_experts
    if rows.layout == "slab":
        tpe = triton.cdiv(rows.capacity, block_m)
        return E * tpe, tpe, rows.capacity, rows.counts, rows.counts, False
    M = x.shape[0]
    slots = triton.cdiv(M, block_m) + E
    offs = rows.offsets if rows.offsets is not None else rows.counts
    return slots, 1, 0, rows.counts, offs, rows.offsets is not None


def chunks_for(K: int, unit: int, want: int) -> int:
    """Largest power-of-two c <= want with K divisible by unit * c (unit: elements per packing unit)."""
    c = max(1, want)
    while c > 1 and K % (unit * c):
        c //= 2
    return c
