"""W4A16 grouped expert GEMM in Triton for Hopper: FP4 weights expanded to 16 bits in registers.

Hopper has no FP4 tensor cores, so each weight tile is expanded right before the MMA. The
kernel is built for few tokens per expert (decode), where it is bound by weight bytes:

- Swap-AB: a program computes out^T[n tile, token tile] = W[e][n tile, :] @ x[tokens, :]^T,
  so the 64..256 weight rows fill the MMA's wide side and the 1..32 tokens of an expert pad
  only the narrow side (>= 16).
- Paired packing (prepare.py): byte j of each chunk of two scale blocks holds element j and
  element j + block, so a [rows, block] byte tile expands into two [rows, block] operands,
  each with ONE scale per row. The block scale is applied to the [rows, tokens] partial
  product in fp32, not to every weight element.
- Expansion is bit placement, no lookup: an E2M1 code s|e1e0|m dropped into the exponent /
  mantissa fields of an fp16 is v * 2^-14 exactly (the code for 0.5 lands on an fp16
  subnormal, which the tensor cores take as is); the 2^14 goes into the fp32 block scale.
  Activations enter as fp16 scaled by 2^-8 (|x| up to 1.6e7, values below 2^-6 keep
  absolute error <= 2^-17, far under bf16's own rounding); the 2^8 goes into the scale too.
  MODE 1 (bf16 operands) and MODE 2 (fp32, for tests and the interpreter) rebuild v as an
  fp32 (bits * 2^126, exact) instead.
- bf16 activations over MXFP4 (MODE 5, "bf16asm", the decode default for oct weights): the
  code dropped into a bf16 instead (v * 2^-126), one integer multiply per pair of elements
  placing magnitude and sign together, the block scale folded into the operand relative to the
  row's largest (prescale), and the activations fed to the MMA as they are (no fp16 copy of
  each block). MODE 6 ("bf16rot") reads packing "octb" (how the MoE layer prepares MXFP4:
  `prepare.packing_for`), where each 32-bit word holds four bf16 pairs up to a rotation
  (prepare.OCTB_POS): 9 instructions per 8 elements, the same bits as bf16asm, 1.03-1.08x its
  time on the decode shapes (bench/gemm-notes.md, round 7). MODE 7 ("bf16rot_ps", the decode
  default for octb weights) is bf16rot with the prescale multipliers built inside the same PTX
  (a byte permute and a shift per two blocks instead of I2F + MUFU.EX2 + F2F per row and block;
  the HMUL2 reads its half as a broadcast operand): the same bits while every row's largest block
  exponent is <= 253, 1.07-1.15x bf16rot (round 8). The Triton-arithmetic modes (and the
  expansion kernel) read octb too; the other PTX modes read oct only.
- Expert lookup on the device: every program reads the [E] counts, forms the per-expert tile
  prefix sums in registers and finds its expert; no host sync, no extra launch (CUDA graphs).

Epilogues: plain store, SwiGLU over a gate tile and an up tile read at a fixed row offset
(W13 in split order), and optionally FP8 quantization of the SwiGLU output with one scale per
token and 128 columns (the fp8_group format that the W4A8 L2 GEMM reads).

Split-K (opt-in, `W4A16Config.split_k`): for decode with few experts hit, where the grid of
(row tiles x token tiles) under-fills the GPU, K is dealt out to 2 / 4 / 8 programs that write
fp32 partial products; a second kernel sums them in a fixed order and runs the epilogue.

`expand_fp4` (bf16 or exact FP8 copies of a weight, bandwidth-bound) serves the paths for
many tokens per expert, where the weight tile is reused by many token tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megapar.moe.kernels import prepare
from megapar.moe.kernels.prepare import PreparedWeight, WeightStrides  # noqa: F401  (WeightStrides: re-export)
from megapar.moe.kernels.triton_common import (  # noqa: F401  (FP8_MAX, AMAX_FLOOR, expert_tile, ...: re-exports)
    AMAX_FLOOR,
    FP8_MAX,
    block_scale,
    chunks_for,
    e2m1_pair,
    e8m0_value,
    expert_tile,
    fp8_group_quant,
    layout_args,
    nibble_operand,
    octb_operand,
    swiglu_tile,
    to_e4m3,
)
from megapar.moe.kernels.triton_expand import EXPAND_DEFAULTS, expand_fp4  # noqa: F401  (expand_fp4: re-export)
from megapar.parallel import impl

MODES = {"f16": 0, "bf16": 1, "f32": 2, "f16asm": 3, "f16asm_swap": 4, "bf16asm": 5, "bf16rot": 6, "bf16rot_ps": 7}
ASM_PACKING = {"f16asm": "oct", "f16asm_swap": "oct", "bf16asm": "oct", "bf16rot": "octb",
               "bf16rot_ps": "octb"}   # inline PTX (GPU)
ASM_MODES = tuple(ASM_PACKING)
PACKS = {"paired": 0, "oct": 1, "octb": 2}   # (octb: the oct loop with octb's nibble order)
SPLIT_KS = (1, 2, 4, 8)

@triton.jit
def act_operand(x, MODE: tl.constexpr):
    if MODE == 0 or MODE == 3 or MODE == 4:
        return (x.to(tl.float32) * 0.00390625).to(tl.float16)   # x * 2^-8 in fp16
    elif MODE == 1 or MODE >= 5:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def mma(a, b, MODE: tl.constexpr):
    if MODE == 2:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fp4_chunk(acc, w_rows, wk, s_rows, kc, offs_b, n_mask, x_lo, x_hi,
               BLOCK: tl.constexpr, NVFP4: tl.constexpr, MODE: tl.constexpr):
    """acc [BN, BM] += (two blocks of W rows) @ (x_lo; x_hi), block scales applied in fp32.
    wk: byte offset of this chunk in every row."""
    wb = tl.load(w_rows[:, None] + (wk + offs_b)[None, :], mask=n_mask[:, None], other=0)
    sblk = kc // BLOCK
    s_lo = tl.load(s_rows + sblk, mask=n_mask, other=0)
    s_hi = tl.load(s_rows + sblk + 1, mask=n_mask, other=0)
    w_lo, w_hi = e2m1_pair(wb, MODE)
    acc += mma(w_lo, x_lo, MODE) * block_scale(s_lo, NVFP4, MODE)[:, None]
    acc += mma(w_hi, x_hi, MODE) * block_scale(s_hi, NVFP4, MODE)[:, None]
    return acc


# E2M1 nibbles of two 32-bit words -> 8 registers of two fp16 each (v * 2^-14, as MODE 0):
# for byte k, PRMT puts byte k of word a in bits 0-7 and of word b in bits 16-23; the low
# nibble's magnitude goes to bits 9-11 and its sign to bit 15 of each half (shift 9 / 12), the
# high nibble's with shift 5 / 8. About 2.3 integer instructions per element.
_OCT_F16_ASM = "\n".join(
    ["{", ".reg .b32 c, t, u;"]
    + [line for k in range(4) for line in (
        f"prmt.b32 c, $8, $9, 0x{4 + k}{4 + k}{k}{k};",
        "shl.b32 t, c, 9;", "and.b32 t, t, 0x0E000E00;", "shl.b32 u, c, 12;", "and.b32 u, u, 0x80008000;",
        f"or.b32 ${2 * k}, t, u;",
        "shl.b32 t, c, 5;", "and.b32 t, t, 0x0E000E00;", "shl.b32 u, c, 8;", "and.b32 u, u, 0x80008000;",
        f"or.b32 ${2 * k + 1}, t, u;")]
    + ["}"])


_OCT_F16_ASM_SWAP = tl.constexpr(_OCT_F16_ASM.replace("$8, $9", "$9, $8"))   # (probe: the other half order)
_OCT_F16_ASM = tl.constexpr(_OCT_F16_ASM)

# MODE 5 ("bf16asm"): the same 8 registers as bf16 pairs, v * 2^-126 (the code's magnitude in bits
# 6-8, its sign in bit 15 of each half: the 0.5 code is a bf16 subnormal, as MODE 0's is an fp16
# one), by one multiply per pair instead of two shifts and two masks: the pair's nibble (both
# halves, masked out of the PRMT word) times 2^a + 2^b is two copies of it whose bits do not
# overlap (so the sum is their OR), one with the magnitude at bits 6-8 and one with the sign at
# bit 15; a last mask keeps those. Per 4 elements 1 PRMT + 2 x (LOP3, IMAD, LOP3) = 7
# instructions, against 11 for MODE 3. `OCT_BF16_STEPS` holds the constants; the tests replay
# them on the CPU (`oct_bf16_reference`).
OCT_BF16_TARGET = 0x81C081C0
OCT_BF16_STEPS = ((0x000F000F, (1 << 6) + (1 << 12)),    # low nibble of the byte: bits 0-3 (+16)
                  (0x00F000F0, (1 << 2) + (1 << 8)))     # high nibble: bits 4-7 (+16)
_OCT_BF16_ASM = tl.constexpr("\n".join(
    ["{", ".reg .b32 c, t;"]
    + [line for k in range(4) for line in (
        [f"prmt.b32 c, $8, $9, 0x{4 + k}{4 + k}{k}{k};"]
        + [ln for j, (mask, mult) in enumerate(OCT_BF16_STEPS) for ln in (
            f"and.b32 t, c, 0x{mask:08X};", f"mul.lo.u32 t, t, {mult};",
            f"and.b32 ${2 * k + j}, t, 0x{OCT_BF16_TARGET:08X};")])]
    + ["}"]))


# MODE 6 ("bf16rot", packing "octb": prepare.OCTB_POS): each word holds four whole bf16 pairs up
# to a rotation, so a word expands with one funnel-shift rotation and one mask per pair (the
# fourth pair: its m bit a rotation by 8 away, the rest in place). 9 instructions per 8 elements.
OCTB_ROTATIONS = (6, 2, 28)
OCTB_IN_PLACE, OCTB_M_MASK = 0x81808180, 0x00400040      # block 3: (e0, e1, sign) / m after rotating by 8
_OCTB_BF16_ASM = tl.constexpr("\n".join(
    ["{", ".reg .b32 t;"]
    + [line for a in range(2) for line in (
        [ln for j, r in enumerate(OCTB_ROTATIONS) for ln in (
            f"shf.l.wrap.b32 t, ${8 + a}, ${8 + a}, {r};", f"and.b32 ${4 * a + j}, t, 0x{OCT_BF16_TARGET:08X};")]
        + [f"shf.l.wrap.b32 t, ${8 + a}, ${8 + a}, 8;", f"and.b32 t, t, 0x{OCTB_M_MASK:08X};",
           f"and.b32 ${4 * a + 3}, ${8 + a}, 0x{OCTB_IN_PLACE:08X};", f"or.b32 ${4 * a + 3}, ${4 * a + 3}, t;"])]
    + ["}"]))


# MODE 7 ("bf16rot_ps"): bf16rot with the prescale inside the same PTX. The prescale multiplier of
# block i is 2^(126 - d) = 2^(s_i + C - 127) with C = 253 - R, R = min(r_max, 253) (C >= 0, so
# every s_i + C fits a byte: s_i <= r_max). The kernel adds C to all four scale bytes of a word at
# once (one integer add per row and word; no byte carries), and the PTX builds each multiplier in
# two instructions: a byte permute puts byte j in both halves' low byte, a shift by 7 makes it
# the bf16 exponent field (byte 0 -> +0: the block is then 2^-253 or more below its row's largest
# and flushes to 0, as before). MODES 5 / 6 build it per row and block by I2F + MUFU.EX2 + F2F.
# Register 4a + j (block 4a + j) is word a's pair j times the multiplier from byte j of $10 + 2a
# (the scale word of blocks 4a .. 4a + 3 plus C; $11 / $13 are the same row's copies that pack=2
# hands over, unused).
OCTB_PS_SELECT = (0x4140, 0x4342)   # prmt selectors: bytes (0, 1) / (2, 3) of the word to the halves' low bytes
_OCTB_PS_ASM = tl.constexpr("\n".join(
    ["{", ".reg .b32 t, z, m01, m23, h;", ".reg .b16 l, u;", "mov.b32 z, 0;"]
    + [line for a in range(2) for line in (
        [f"prmt.b32 m01, ${10 + 2 * a}, z, 0x{OCTB_PS_SELECT[0]:04X};", "shl.b32 m01, m01, 7;",
         f"prmt.b32 m23, ${10 + 2 * a}, z, 0x{OCTB_PS_SELECT[1]:04X};", "shl.b32 m23, m23, 7;"]
        + [ln for j, r in enumerate(OCTB_ROTATIONS) for ln in (
            f"shf.l.wrap.b32 t, ${8 + a}, ${8 + a}, {r};", f"and.b32 t, t, 0x{OCT_BF16_TARGET:08X};",
            f"mov.b32 {{l, u}}, {'m01' if j < 2 else 'm23'};", f"mov.b32 h, {{{'l, l' if j % 2 == 0 else 'u, u'}}};",
            f"mul.rn.bf16x2 ${4 * a + j}, t, h;")]
        + [f"shf.l.wrap.b32 t, ${8 + a}, ${8 + a}, 8;", f"and.b32 t, t, 0x{OCTB_M_MASK:08X};",
           f"and.b32 h, ${8 + a}, 0x{OCTB_IN_PLACE:08X};", "or.b32 t, t, h;",
           "mov.b32 {l, u}, m23;", "mov.b32 h, {u, u};", f"mul.rn.bf16x2 ${4 * a + 3}, t, h;"])]
    + ["}"]))


def _prmt_zero(a: torch.Tensor, select: int) -> torch.Tensor:
    """PTX `prmt.b32 d, a, 0, select` on int64 words in [0, 2^32) (selector nibbles < 4: byte of a, 4: 0)."""
    out = torch.zeros_like(a)
    for k in range(4):
        src = (select >> (4 * k)) & 7
        if src < 4:
            out |= ((a >> (8 * src)) & 0xFF) << (8 * k)
    return out


def octb_ps_reference(w0: torch.Tensor, w1: torch.Tensor, t_lo: torch.Tensor, t_hi: torch.Tensor) -> list[torch.Tensor]:
    """MODE 7's PTX replayed on the CPU: octb words w0, w1 and the row's scale words plus C (t_lo:
    blocks 0-3, t_hi: 4-7; same shape) -> 8 bf16 tensors [..., 2]: register i's (low, high) halves,
    the bf16rot operand of block i times the half (i % 2) of the multiplier pair that
    OCTB_PS_SELECT[i % 4 // 2] permutes out of its word, shifted by 7 (the bf16 exponent field)."""
    regs = octb_bf16_reference(w0, w1)
    out = []
    for i, reg in enumerate(regs):
        word = (t_lo if i < 4 else t_hi).to(torch.int64) & 0xFFFFFFFF
        pair = (_prmt_zero(word, OCTB_PS_SELECT[i % 4 // 2]) << 7) & 0xFFFFFFFF
        mult = ((pair >> (16 * (i % 2))) & 0xFFFF).to(torch.int16).view(torch.bfloat16)
        halves = torch.stack([reg & 0xFFFF, reg >> 16], dim=-1).to(torch.int16).view(torch.bfloat16)
        out.append(halves * mult[..., None])
    return out


# The probe's "no expansion" diagnostic (DIAG 3 / 4, wrong results): one mask per register in
# place of the expansion, so the loop keeps its loads, prescale and MMAs (a bound, never a result)
_OCT_DIAG_ASM = tl.constexpr("\n".join(
    ["{"] + [f"and.b32 ${i}, ${8 + i // 4}, 0x{OCT_BF16_TARGET:08X};" for i in range(8)] + ["}"]))


def octb_bf16_reference(w0: torch.Tensor, w1: torch.Tensor) -> list[torch.Tensor]:
    """The bf16rot expansion replayed with int64 torch ops (CPU): octb words w0 (word 2p), w1
    (word 2p + 1) -> 8 registers as int64 in [0, 2^32); register i holds block i's elements
    (2p, 2p + 1) as bf16 bits (low half, high half)."""
    def rot(w: torch.Tensor, r: int) -> torch.Tensor:
        return ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF

    out = []
    for w in (w0.to(torch.int64) & 0xFFFFFFFF, w1.to(torch.int64) & 0xFFFFFFFF):
        out += [rot(w, r) & OCT_BF16_TARGET for r in OCTB_ROTATIONS]
        out.append((w & OCTB_IN_PLACE) | (rot(w, 8) & OCTB_M_MASK))
    return out


def oct_bf16_reference(w0: torch.Tensor, w1: torch.Tensor) -> list[torch.Tensor]:
    """The bf16asm expansion replayed with int64 torch ops (CPU): int32 words w0, w1 (same shape)
    -> the 8 registers as int64 in [0, 2^32): register i holds nibble i of w0 in its low half and
    nibble i of w1 in its high half, each as bf16 bits."""
    a, b = w0.to(torch.int64) & 0xFFFFFFFF, w1.to(torch.int64) & 0xFFFFFFFF
    out = []
    for k in range(4):
        byte_a, byte_b = (a >> (8 * k)) & 0xFF, (b >> (8 * k)) & 0xFF
        c = byte_a | byte_a << 8 | byte_b << 16 | byte_b << 24          # prmt 0x{4+k}{4+k}{k}{k}
        out += [(((c & mask) * mult) & 0xFFFFFFFF) & OCT_BF16_TARGET for mask, mult in OCT_BF16_STEPS]
    return out


@triton.jit
def _eight_operands(w, ASM: tl.constexpr, BF16: tl.constexpr):
    """Two oct words per call (pack 2) -> 8 registers of two bf16 / fp16: one operand per scale block."""
    if BF16:
        return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], is_pure=True, pack=2,
                                         dtype=(tl.bfloat16,) * 8)
    else:
        return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], is_pure=True, pack=2,
                                         dtype=(tl.float16,) * 8)


@triton.jit
def _octb_scaled_operands(w, s8, r_max):
    """MODE 7: octb words w (int32 [BN, BLOCK]), the row's 8 scale bytes s8 (int64 [BN]) and its
    largest r_max (int32 [BN]) -> 8 prescaled bf16 operands (see _OCTB_PS_ASM)."""
    c4 = (253 - tl.minimum(r_max, 253)) * 0x01010101
    t_lo = (s8.to(tl.int32) + c4)[:, None]
    t_hi = ((s8 >> 32).to(tl.int32) + c4)[:, None]
    _, t_lo = tl.broadcast(w, t_lo)
    _, t_hi = tl.broadcast(w, t_hi)
    return tl.inline_asm_elementwise(_OCTB_PS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r",
                                     [w, t_lo, t_hi],
                                     is_pure=True, pack=2, dtype=(tl.bfloat16,) * 8)


@triton.jit
def _oct_operands_asm(w, SWAP: tl.constexpr, BF16: tl.constexpr = False, ROT: tl.constexpr = False,
                      NO_EXPANSION: tl.constexpr = False):
    if NO_EXPANSION:
        return _eight_operands(w, _OCT_DIAG_ASM, True)
    elif ROT:
        return _eight_operands(w, _OCTB_BF16_ASM, True)
    elif BF16:
        return _eight_operands(w, _OCT_BF16_ASM, True)
    elif SWAP:
        return _eight_operands(w, _OCT_F16_ASM_SWAP, False)
    else:
        return _eight_operands(w, _OCT_F16_ASM, False)


@triton.jit
def _prescaled(op, s_i, r_max, MODE: tl.constexpr):
    """fp16 weight operand [BN, Q] (v * 2^-14) times 2^(15 - d), d = r_max - s_i >= 0 (E8M0
    exponents): exact while d <= 24, flushed towards 0 beyond (a block 2^-24 below its row's
    largest); the product is then v * 2^(s_i - r_max + 1). MODES 5 and 6 (bf16, v * 2^-126): times
    2^(126 - d), so v * 2^(s_i - r_max), exact while d <= 125."""
    d = r_max - s_i.to(tl.int32)
    if MODE >= 5:
        mult = tl.exp2((126 - d).to(tl.float32)).to(tl.bfloat16)
    else:
        mult = tl.exp2((15 - d).to(tl.float32)).to(tl.float16)
    return op * mult[:, None]


@triton.jit
def _prescale_factor(r_max, MODE: tl.constexpr):
    """fp32 [BN] that takes a prescaled accumulator back: 2^(r_max - 127) * 2^14 (fp16 weight
    bits) * 2^8 (activation pre-scale) / 2^15 (the operand's 2^15); MODES 5, 6: 2^(r_max - 127)
    (bf16 operands, activations as they are); r_max 255 (NaN scale) -> NaN. Built from the bits as
    the E8M0 decode (r_max 0 -> 2^-127, a subnormal), not by exp2: that is an approximation (the
    interpreter's exp2(127) is an ulp off; the GPU's ex2 may flush a subnormal result to 0)."""
    if MODE == 7:   # operands relative to R = min(r_max, 253) (_OCTB_PS_ASM)
        f = e8m0_value(tl.minimum(r_max, 253))
    else:
        f = e8m0_value(r_max)
    if MODE < 5:
        f = f * 128.0
    return tl.where(r_max == 255, float("nan"), f)


_UNTILED = tl.constexpr(prepare.UNTILED)


@triton.jit
def _oct_desc(base, rows, stride_wtile, stride_wn, K: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK: tl.constexpr):
    """Device-side TMA descriptor of one expert's oct words (int32), `rows` rows from `base`.
    Rows in order: 2-D [rows, K/8] (row stride stride_wn), box [BLOCK_N, BLOCK]. Tiled by TILE:
    3-D [rows/TILE tiles, units * TILE, BLOCK] (one (tile, unit) block is TILE x BLOCK contiguous
    words), box [BLOCK_N / BR, BR, BLOCK] with BR = min(TILE, BLOCK_N). Rows past `rows` (the
    last, partial tile of rows) read as zeros."""
    if TILE >= _UNTILED:
        return tl.make_tensor_descriptor(base, [rows, K // 8], [stride_wn, 1], [BLOCK_N, BLOCK])
    else:
        BR: tl.constexpr = TILE if TILE < BLOCK_N else BLOCK_N
        return tl.make_tensor_descriptor(base, [rows // TILE, (K // (8 * BLOCK)) * TILE, BLOCK],
                                         [stride_wtile, stride_wn, 1], [BLOCK_N // BR, BR, BLOCK])


@triton.jit
def _oct_words(w_rows, wk, offs_q, n_mask, desc, n0, unit, TMA: tl.constexpr, TILE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    """int32 [BLOCK_N, BLOCK]: the oct words of rows n0.. and packing unit `unit` (word offset wk
    in a row): pointer-tensor load (masked rows 0), or one TMA box of `desc` (see _oct_desc)."""
    if TMA:
        if TILE >= _UNTILED:
            return desc.load([n0, unit * BLOCK])
        else:
            BR: tl.constexpr = TILE if TILE < BLOCK_N else BLOCK_N
            box = desc.load([n0 // TILE, unit * TILE + n0 % TILE, 0])      # [BLOCK_N / BR, BR, BLOCK]
            return tl.reshape(box, (BLOCK_N, BLOCK))
    else:
        return tl.load(w_rows[:, None] + (wk + offs_q)[None, :], mask=n_mask[:, None], other=0)


@triton.jit
def _fp4_oct(acc, w, s_rows, kc, offs_q, n_mask, x_rows, m_mask, r_max,
             BLOCK: tl.constexpr, NVFP4: tl.constexpr, MODE: tl.constexpr, DIAG: tl.constexpr,
             PRESCALE: tl.constexpr, OCTB: tl.constexpr = False):
    """acc [BN, BM] += 8 scale blocks of W rows (w: their oct words, int32 [BN, BLOCK], from
    `_oct_words`) @ x[kc : kc + 8 BLOCK]. DIAG (probe only, wrong results): 1 = loads only, 2 = no
    block scales, 3 = no expansion (bf16 modes: one mask per register instead), 4 = neither.
    PRESCALE (MXFP4, 16-bit operands): the block scale goes into the operand relative
    to the row's largest (r_max [BN]), so the MMAs chain into one accumulator with no per-block
    fp32 rescale; the caller applies `_prescale_factor(r_max)` once at the end."""
    # the unit's 8 scale bytes of a row are one aligned int64 (s_rows points at int64 scales):
    # one 8-byte load per row instead of eight scattered byte loads
    s8 = tl.load(s_rows + kc // (8 * BLOCK), mask=n_mask, other=0)
    if DIAG == 1:
        acc += tl.sum(w, axis=1).to(tl.float32)[:, None]
    elif MODE == 7 and PRESCALE and DIAG == 0:
        ops = _octb_scaled_operands(w, s8, r_max)
    elif MODE >= 3:
        ops = _oct_operands_asm(w, MODE == 4, MODE >= 5, MODE >= 6, MODE >= 5 and DIAG >= 3)
    for i in tl.static_range(8):
        x_i = tl.load(x_rows[None, :] + (kc + i * BLOCK + offs_q)[:, None], mask=m_mask[None, :], other=0.0)
        s_i = ((s8 >> (8 * i)) & 0xFF).to(tl.uint8)
        if DIAG == 1:
            acc += tl.sum(x_i.to(tl.float32), axis=0)[None, :] + s_i.to(tl.float32)[:, None]
        else:
            if MODE >= 3:
                op = ops[i]
            elif OCTB:   # octb words, Triton arithmetic (mode bf16rot is the fast reader)
                op = octb_operand(w, i, MODE)
            else:
                op = nibble_operand(w, i, MODE)
            if DIAG == 2 or DIAG == 4 or (MODE == 7 and DIAG == 0):   # (MODE 7: prescaled in the PTX)
                acc = tl.dot(op, act_operand(x_i, MODE), acc)
            elif PRESCALE:
                acc = tl.dot(_prescaled(op, s_i, r_max, MODE), act_operand(x_i, MODE), acc)
            else:
                acc += mma(op, act_operand(x_i, MODE), MODE) * block_scale(s_i, NVFP4, MODE)[:, None]
    return acc


@triton.jit
def _oct_step(acc, acc_u, k0, w_rows, s_rows, x_rows, offs_b, n_mask, m_mask, desc, desc_u, n0, r_max, r_max_u,
              up_rows, up_w_offset, stride_wchunk, stride_sn, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
              NVFP4: tl.constexpr, MODE: tl.constexpr, DIAG: tl.constexpr, PRESCALE: tl.constexpr,
              SWIGLU: tl.constexpr, TMA: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
              OCTB: tl.constexpr = False):
    """One oct loop step: CHUNKS packing units (8 scale blocks each) from element k0, gate (acc)
    and with SWIGLU up (acc_u) rows; OCTB: the words are in "octb" order."""
    for c in tl.static_range(CHUNKS):
        kc = k0 + c * 8 * BLOCK
        unit = kc // (8 * BLOCK)
        wk = unit * stride_wchunk
        w = _oct_words(w_rows, wk, offs_b, n_mask, desc, n0, unit, TMA, TILE, BLOCK_N, BLOCK)
        acc = _fp4_oct(acc, w, s_rows, kc, offs_b, n_mask, x_rows, m_mask, r_max, BLOCK, NVFP4,
                       MODE, DIAG, PRESCALE, OCTB)
        if SWIGLU:
            w_u = _oct_words(w_rows + up_w_offset, wk, offs_b, n_mask, desc_u, n0, unit, TMA, TILE,
                             BLOCK_N, BLOCK)
            acc_u = _fp4_oct(acc_u, w_u, s_rows + up_rows * stride_sn, kc,
                             offs_b, n_mask, x_rows, m_mask, r_max_u, BLOCK, NVFP4, MODE, DIAG, PRESCALE, OCTB)
    return acc, acc_u


@triton.jit
def _paired_step(acc, acc_u, k0, w_rows, s_rows, x_rows, offs_b, n_mask, m_mask, up_rows, up_w_offset,
                 stride_wchunk, stride_sn, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, NVFP4: tl.constexpr,
                 MODE: tl.constexpr, SWIGLU: tl.constexpr):
    """One paired loop step: CHUNKS packing units (2 scale blocks each) from element k0."""
    for c in tl.static_range(CHUNKS):
        kc = k0 + c * 2 * BLOCK
        wk = (kc // (2 * BLOCK)) * stride_wchunk
        x_lo = tl.load(x_rows[None, :] + (kc + offs_b)[:, None], mask=m_mask[None, :], other=0.0)
        x_hi = tl.load(x_rows[None, :] + (kc + BLOCK + offs_b)[:, None], mask=m_mask[None, :], other=0.0)
        x_lo = act_operand(x_lo, MODE)
        x_hi = act_operand(x_hi, MODE)
        acc = _fp4_chunk(acc, w_rows, wk, s_rows, kc, offs_b, n_mask, x_lo, x_hi, BLOCK, NVFP4, MODE)
        if SWIGLU:
            acc_u = _fp4_chunk(acc_u, w_rows + up_w_offset, wk, s_rows + up_rows * stride_sn, kc,
                               offs_b, n_mask, x_lo, x_hi, BLOCK, NVFP4, MODE)
    return acc, acc_u


@triton.jit
def _epilogue(acc, acc_u, out_ptr, out_scale_ptr, row0, offs_m, store_rows, offs_n, n_mask, pid_n,
              stride_om, stride_osm, limit, alpha, beta,
              SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, QUANT_OUT: tl.constexpr):
    """acc [BN, BM] fp32 (scales applied) -> SwiGLU (with acc_u) -> out rows row0 + offs_m below
    store_rows: out_dtype, or e4m3 + one fp32 scale per row and 128 columns (QUANT_OUT)."""
    if SWIGLU:
        acc = swiglu_tile(acc, acc_u, limit, alpha, beta, HAS_LIMIT)
    out_rows = (row0 + offs_m).to(tl.int64)
    row_ok = offs_m < store_rows
    mask = row_ok[None, :] & n_mask[:, None]
    ptrs = out_ptr + out_rows[None, :] * stride_om + offs_n[:, None]
    if QUANT_OUT:
        q, scale = fp8_group_quant(acc, 0)
        tl.store(ptrs, q, mask=mask)
        tl.store(out_scale_ptr + out_rows * stride_osm + pid_n, scale, mask=row_ok)
    else:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4a16_program(
    pid_n, pid_t, pid_k, stride_ps,
    x_ptr, w_ptr, s_ptr, gs_ptr, rmax_ptr, out_ptr, out_scale_ptr, counts_ptr, offsets_ptr,
    N, num_experts, tiles_per_expert, capacity, up_rows, up_w_offset,
    stride_xm, stride_we, stride_wtile, stride_wn, stride_wchunk, stride_se, stride_sn, stride_om, stride_osm,
    limit, alpha, beta,
    K: tl.constexpr, E_POW2: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    NVFP4: tl.constexpr, MODE: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    QUANT_OUT: tl.constexpr, PACK: tl.constexpr, TILE: tl.constexpr, DIAG: tl.constexpr,
    PRESCALE: tl.constexpr, stride_re: tl.constexpr, TMA: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """One program of `_w4a16_kernel` (SPLIT_K 1) or `_w4a16_splitk_kernel`: weight rows of tile
    pid_n, token tile slot pid_t, K part pid_k of SPLIT_K. The K loop runs over STEP = CHUNKS
    packing units; part k covers steps [k Q + min(k, R), (k + 1) Q + min(k + 1, R)) of the K / STEP
    steps (Q, R = divmod(K / STEP, SPLIT_K): the first R parts take one step more). SPLIT_K > 1:
    out_ptr is the fp32 partial buffer [SPLIT_K, rows, N (+ N up rows with SWIGLU)] (part stride
    stride_ps, row stride stride_om), written after the prescale factor and the NVFP4 global scale;
    `_w4a16_splitk_reduce` sums it and runs the epilogue."""
    e, row0, rows, store_rows = expert_tile(pid_t, counts_ptr, offsets_ptr, num_experts, tiles_per_expert,
                                            capacity, E_POW2, BLOCK_M, SLAB, HAS_OFFSETS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    offs_b = tl.arange(0, BLOCK)
    e64 = e.to(tl.int64)
    x_rows = x_ptr + (row0 + offs_m).to(tl.int64) * stride_xm
    n64 = offs_n.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + (n64 // TILE) * stride_wtile + (n64 % TILE) * stride_wn
    s_rows = s_ptr + e64 * stride_se + n64 * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    r_max = tl.zeros((BLOCK_N,), tl.int32)
    r_max_u = tl.zeros((BLOCK_N,), tl.int32)
    if PRESCALE:   # [E, N (+ up rows)] uint8: each row's largest block exponent
        # (slots past the last expert's tiles get e up to E_POW2: no load there)
        r_rows = rmax_ptr + e64 * stride_re + n64
        r_mask = n_mask & (e < num_experts)
        r_max = tl.load(r_rows, mask=r_mask, other=0).to(tl.int32)
        if SWIGLU:
            r_max_u = tl.load(r_rows + up_rows, mask=r_mask, other=0).to(tl.int32)
    # K steps of STEP elements; this program's: Q (+ 1 for the first R parts) from k_begin
    STEP: tl.constexpr = (8 if PACK >= 1 else 2) * BLOCK * CHUNKS
    Q: tl.constexpr = K // STEP // SPLIT_K
    R: tl.constexpr = K // STEP % SPLIT_K
    if SPLIT_K == 1:
        k_begin = 0
    else:
        k_begin = tl.multiple_of((pid_k * Q + tl.minimum(pid_k, R)) * STEP, STEP)
    if rows > 0:   # (not a dynamic loop bound: the interpreter cannot range over a reduction)
        if PACK >= 1:   # oct / octb: w_ptr is int32 words, 8 blocks per word row
            n0 = pid_n * BLOCK_N
            desc = w_rows   # (placeholders: read only with TMA)
            desc_u = w_rows
            if TMA:
                w_e = w_ptr + e64 * stride_we
                desc = _oct_desc(w_e, N, stride_wtile, stride_wn, K, TILE, BLOCK_N, BLOCK)
                if SWIGLU:
                    desc_u = _oct_desc(w_e + up_w_offset, N, stride_wtile, stride_wn, K, TILE, BLOCK_N, BLOCK)
            for k0 in range(0, Q * STEP, STEP):
                acc, acc_u = _oct_step(acc, acc_u, k_begin + k0, w_rows, s_rows, x_rows, offs_b, n_mask, m_mask,
                                       desc, desc_u, n0, r_max, r_max_u, up_rows, up_w_offset, stride_wchunk,
                                       stride_sn, CHUNKS, BLOCK, NVFP4, MODE, DIAG, PRESCALE, SWIGLU, TMA, TILE,
                                       BLOCK_N, PACK == 2)
            if R > 0:
                if pid_k < R:
                    acc, acc_u = _oct_step(acc, acc_u, k_begin + Q * STEP, w_rows, s_rows, x_rows, offs_b, n_mask,
                                           m_mask, desc, desc_u, n0, r_max, r_max_u, up_rows, up_w_offset,
                                           stride_wchunk, stride_sn, CHUNKS, BLOCK, NVFP4, MODE, DIAG, PRESCALE,
                                           SWIGLU, TMA, TILE, BLOCK_N, PACK == 2)
        else:
            for k0 in range(0, Q * STEP, STEP):
                acc, acc_u = _paired_step(acc, acc_u, k_begin + k0, w_rows, s_rows, x_rows, offs_b, n_mask, m_mask,
                                          up_rows, up_w_offset, stride_wchunk, stride_sn, CHUNKS, BLOCK, NVFP4,
                                          MODE, SWIGLU)
            if R > 0:
                if pid_k < R:
                    acc, acc_u = _paired_step(acc, acc_u, k_begin + Q * STEP, w_rows, s_rows, x_rows, offs_b,
                                              n_mask, m_mask, up_rows, up_w_offset, stride_wchunk, stride_sn,
                                              CHUNKS, BLOCK, NVFP4, MODE, SWIGLU)
    if PRESCALE:
        acc = acc * _prescale_factor(r_max, MODE)[:, None]
        acc_u = acc_u * _prescale_factor(r_max_u, MODE)[:, None]
    if NVFP4:
        g = tl.load(gs_ptr + e, mask=e < num_experts, other=1.0)
        acc = acc * g
        acc_u = acc_u * g
    if SLAB:   # (contiguous tiles store only the expert's rows)
        # token columns past the count hold 0 times the row scales: 0 * NaN (a NaN block or global
        # scale) would put NaN into the slab rows past the count, which are zero by contract
        acc = tl.where(m_mask[None, :], acc, 0.0)
        acc_u = tl.where(m_mask[None, :], acc_u, 0.0)
    if SPLIT_K == 1:
        _epilogue(acc, acc_u, out_ptr, out_scale_ptr, row0, offs_m, store_rows, offs_n, n_mask, pid_n,
                  stride_om, stride_osm, limit, alpha, beta, SWIGLU, HAS_LIMIT, QUANT_OUT)
    else:   # this part's fp32 partial products: gate rows at columns [0, N), up rows at [N, 2N)
        out_rows = (row0 + offs_m).to(tl.int64)
        mask = (offs_m < store_rows)[None, :] & n_mask[:, None]
        ptrs = out_ptr + pid_k.to(tl.int64) * stride_ps + out_rows[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, acc, mask=mask)
        if SWIGLU:
            tl.store(ptrs + N, acc_u, mask=mask)


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, rmax_ptr, out_ptr, out_scale_ptr, counts_ptr, offsets_ptr,
    N, num_experts, tiles_per_expert, capacity, up_rows, up_w_offset,
    stride_xm, stride_we, stride_wtile, stride_wn, stride_wchunk, stride_se, stride_sn, stride_om, stride_osm,
    limit, alpha, beta,
    K: tl.constexpr, E_POW2: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    NVFP4: tl.constexpr, MODE: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    QUANT_OUT: tl.constexpr, PACK: tl.constexpr, TILE: tl.constexpr, DIAG: tl.constexpr,
    PRESCALE: tl.constexpr = False, stride_re: tl.constexpr = 0, TMA: tl.constexpr = False,
):
    """Weight row n, packing unit c (2 or 8 scale blocks) sits at e * stride_we +
    (n // TILE) * stride_wtile + (n % TILE) * stride_wn + c * stride_wchunk (bytes, or int32
    words for oct): row-major, or tiled so that one program's tile of one unit is contiguous.
    TMA (oct only): the weight words come through a device-side tensor descriptor per program
    (`_oct_desc`: N rows of expert e, and N more from up_w_offset with SWIGLU) instead of pointer
    tensors; needs a global scratch allocator at launch (`launch_w4a16` installs one).
    Grid (weight row tiles, token tile slots); the whole K per program (`_w4a16_program`)."""
    _w4a16_program(
        tl.program_id(0), tl.program_id(1), 0, 0,
        x_ptr, w_ptr, s_ptr, gs_ptr, rmax_ptr, out_ptr, out_scale_ptr, counts_ptr, offsets_ptr,
        N, num_experts, tiles_per_expert, capacity, up_rows, up_w_offset,
        stride_xm, stride_we, stride_wtile, stride_wn, stride_wchunk, stride_se, stride_sn, stride_om, stride_osm,
        limit, alpha, beta, K, E_POW2, SLAB, HAS_OFFSETS, BLOCK_N, BLOCK_M, CHUNKS, BLOCK, NVFP4, MODE, SWIGLU,
        HAS_LIMIT, QUANT_OUT, PACK, TILE, DIAG, PRESCALE, stride_re, TMA, 1)


@triton.jit
def _w4a16_splitk_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, rmax_ptr, part_ptr, counts_ptr, offsets_ptr,
    N, num_experts, tiles_per_expert, capacity, up_rows, up_w_offset,
    stride_xm, stride_we, stride_wtile, stride_wn, stride_wchunk, stride_se, stride_sn, stride_ps, stride_pm,
    K: tl.constexpr, E_POW2: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    NVFP4: tl.constexpr, MODE: tl.constexpr, SWIGLU: tl.constexpr, PACK: tl.constexpr, TILE: tl.constexpr,
    DIAG: tl.constexpr, PRESCALE: tl.constexpr, stride_re: tl.constexpr, TMA: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Split-K first pass: grid (weight row tiles, token tile slots, SPLIT_K); part k of K writes its
    fp32 partial products (scales applied) to part_ptr [SPLIT_K, rows, N (+ N)] (`_w4a16_program`)."""
    _w4a16_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), stride_ps,
        x_ptr, w_ptr, s_ptr, gs_ptr, rmax_ptr, part_ptr, part_ptr, counts_ptr, offsets_ptr,
        N, num_experts, tiles_per_expert, capacity, up_rows, up_w_offset,
        stride_xm, stride_we, stride_wtile, stride_wn, stride_wchunk, stride_se, stride_sn, stride_pm, 0,
        0.0, 1.0, 0.0, K, E_POW2, SLAB, HAS_OFFSETS, BLOCK_N, BLOCK_M, CHUNKS, BLOCK, NVFP4, MODE, SWIGLU,
        False, False, PACK, TILE, DIAG, PRESCALE, stride_re, TMA, SPLIT_K)


@triton.jit
def _w4a16_splitk_reduce(
    part_ptr, out_ptr, out_scale_ptr, counts_ptr, offsets_ptr,
    N, num_experts, tiles_per_expert, capacity, stride_ps, stride_pm, stride_om, stride_osm,
    limit, alpha, beta,
    E_POW2: tl.constexpr, SLAB: tl.constexpr, HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    QUANT_OUT: tl.constexpr,
):
    """Split-K second pass, on the first pass's (row tile, token tile) grid: out = epilogue(part[0] +
    part[1] + ... + part[SPLIT_K - 1]), summed in that order (deterministic), for exactly the rows
    the one-pass kernel stores (same `expert_tile`)."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    e, row0, rows, store_rows = expert_tile(pid_t, counts_ptr, offsets_ptr, num_experts, tiles_per_expert,
                                            capacity, E_POW2, BLOCK_M, SLAB, HAS_OFFSETS)
    if store_rows > 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_m = tl.arange(0, BLOCK_M)
        mask = (offs_m < store_rows)[None, :] & n_mask[:, None]
        p = part_ptr + (row0 + offs_m).to(tl.int64)[None, :] * stride_pm + offs_n[:, None]   # [BN, BM]
        acc = tl.load(p, mask=mask, other=0.0)
        acc_u = acc
        if SWIGLU:
            acc_u = tl.load(p + N, mask=mask, other=0.0)
        for _ in tl.static_range(1, SPLIT_K):
            p += stride_ps
            acc += tl.load(p, mask=mask, other=0.0)
            if SWIGLU:
                acc_u += tl.load(p + N, mask=mask, other=0.0)
        _epilogue(acc, acc_u, out_ptr, out_scale_ptr, row0, offs_m, store_rows, offs_n, n_mask, pid_n,
                  stride_om, stride_osm, limit, alpha, beta, SWIGLU, HAS_LIMIT, QUANT_OUT)


# ---- host side ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class W4A16Config:
    """Launch shape of the fused kernel. block_n: weight rows per program; block_m: tokens per
    tile; chunks: packing units (2 or 8 scale blocks) per loop iteration; mode: operand
    encoding 'f16' | 'bf16' | 'f32' (Triton arithmetic) | 'f16asm' (inline PTX, oct packing) |
    'bf16asm' (inline PTX to bf16 operands, activations used as they are; MXFP4 with prescale only) |
    'bf16rot' (the same from packing 'octb') | 'bf16rot_ps' (bf16rot, prescale multipliers built in
    the PTX; the octb decode default); packing: 'paired' | 'oct' | 'octb' (the PTX modes read
    their own, `ASM_PACKING`; the Triton-arithmetic ones read any); tma (oct / octb only): weight
    words through a device-side TMA descriptor instead of pointer-tensor loads (`pick_config`
    takes it for MXFP4 decode without SwiGLU: bench/gemm-notes.md, rounds 4 and 6).

    split_k (1, 2, 4 or 8; `pick_config` keeps 1): S > 1 splits K over S programs per (row tile,
    token tile), for decode where few experts have rows and the grid under-fills the GPU. The K
    loop's steps (`chunks` packing units each) are dealt out contiguously, the first programs
    taking one step more when S does not divide them; S above the number of steps is lowered to
    the largest of 1, 2, 4, 8 not above it. Each program writes fp32 partial products (block,
    prescale and NVFP4 global scales applied) to a buffer [S, rows, N_out] ([S, rows, 2 N_out]
    with SwiGLU: gate and up), 4 S rows N_out (x2) bytes per call; a second kernel sums the parts
    in order 0..S-1 and runs the epilogue (SwiGLU, fp8 group output, cast): deterministic, no
    atomics, no host sync. The sum's order differs from one pass's, so results differ from
    split_k=1 by fp32 rounding (relative ~1e-7 of the products), not bit for bit.

    maxnreg (0 = the compiler's choice): a register cap per thread for the main kernel (e.g. 128
    lets 4 CTAs of 4 warps share an SM; bench/gemm-notes.md, round 6). The interpreter ignores it."""

    block_n: int = 128
    block_m: int = 16
    chunks: int = 2
    num_warps: int = 4
    num_stages: int = 4
    mode: str = "f16"
    packing: str = "paired"
    prescale: bool = False
    tma: bool = False
    split_k: int = 1
    maxnreg: int = 0

    def __post_init__(self) -> None:
        if type(self.maxnreg) is not int or not (self.maxnreg == 0 or 64 <= self.maxnreg <= 255):
            raise ValueError(f"W4A16Config.maxnreg must be 0 (the compiler's choice) or a register cap in "
                             f"[64, 255], got {self.maxnreg!r}")
        if type(self.split_k) is not int or self.split_k not in SPLIT_KS:
            raise ValueError(f"W4A16Config.split_k must be one of {SPLIT_KS}, got {self.split_k!r}")
        if not isinstance(self.tma, bool):
            raise ValueError(f"W4A16Config.tma must be True or False, got {self.tma!r}")
        if self.tma and self.packing not in ("oct", "octb"):
            raise ValueError(f"W4A16Config.tma needs packing 'oct' or 'octb', got {self.packing!r} (valid: {sorted(PACKS)})")


# Inline PTX expansion (oct packing) on real GPUs; the interpreter runs the arithmetic version.
USE_ASM = True
# Launch configs measured best on the H200, by tokens-per-expert bucket (block_m); they override
# the heuristic below when their packing matches (`apply_tuning`, `megapar bench gemm`).
TUNED: dict[int, W4A16Config] = {}


def apply_tuning(tuning: dict) -> None:
    """Install measured launch settings: {"w4a16": {bucket: config fields}, "expand": {...},
    "tile_n": int, "act_quant_warps": int} (as written by `python -m launch.bench.gemm --probe`)."""
    for bucket, fields in tuning.get("w4a16", {}).items():
        TUNED[int(bucket)] = W4A16Config(**fields)
    EXPAND_DEFAULTS.update(tuning.get("expand", {}))
    if "tile_n" in tuning:
        prepare.DEFAULT_TILE_N = int(tuning["tile_n"])
    if tuning.get("act_quant_warps"):   # the activation quantizer is parallel.quant's: tune its CONFIG
        from megapar.parallel.quant import triton_quant

        for kernel in ("fp8_token", "fp8_group"):
            triton_quant.CONFIG[kernel] = (triton_quant.CONFIG[kernel][0], int(tuning["act_quant_warps"]))


def pick_config(rows_per_expert: float, dtype: torch.dtype, packing: str = "oct", swiglu: bool = False,
                fmt: str = "mxfp4") -> W4A16Config:
    """Heuristic launch config by tokens per expert (tuned with `megapar bench gemm`, notes in
    bench/gemm-notes.md), for a `fmt` weight in `packing`."""
    if dtype == torch.float32:   # fp32 operands: exact products, small tiles (registers)
        return W4A16Config(block_n=64, block_m=16 if rows_per_expert <= 16 else 32, chunks=1, num_warps=4,
                           num_stages=2, mode="f32", packing=packing)
    if packing == "octb":   # the oct settings; bf16asm becomes bf16rot_ps, the other PTX modes Triton arithmetic
        # bf16rot (bench/results/gemm-probe-decode8-h200.json, `--sections decode8`, H200 2026-12-02,
        # beside the bf16asm default in the same run): 1.03-1.08x at the default's settings; with
        # TMA loads 2 stages beat 3 (V3 L1 1 / 8 / 32 tokens per expert 203.4 -> 187.6, 208.3 ->
        # 192.3, 233.0 -> 224.5 µs; V3 L2 1 / 8: 107.1 -> 100.9, 109.5 -> 102.7; V4-Flash L1
        # 124.3 -> 115.3), a tie at V4-Flash L2 (61.1 vs 61.3); pointer loads with 4 stages stay
        # best where few experts have rows (1 token over 8 of 32: 61.5 -> 59.8) and the fused SwiGLU
        # keeps its settings (235.3 -> 219.1 at V3 L1).
        # bf16rot_ps (the prescale multiplier built in the expansion PTX; `--sections decode9`, H200
        # 2026-12-03, bench/results/gemm-probe-decode9-h200.json, beside the bf16rot default in the
        # same run): 3 stages win with TMA and with pointer loads (157 registers: 3 CTAs per SM
        # either way). V3 L1 1 / 8 / 32 tokens per expert 190.9 -> 170.0, 193.3 -> 184.0, 224.0 ->
        # 209.6 µs; V3 L2 1 / 8: 100.7 -> 87.8, 99.4 -> 91.2; V4-Flash L1 / L2 112.4 -> 104.1, 63.1
        # -> 54.5; 1 token over 8 of 32 experts (pointer loads) V3 L1 61.7 -> 54.1, V4-Flash 38.2 ->
        # 33.2; the fused SwiGLU at its settings V3 L1 217.5 -> 199.3, 1 token over 8: 60.2 -> 55.7.
        # (V4-Flash L1 at 8 tokens over 8 experts, a rows hint of 2, took 4 stages: 48.9 -> 34.4,
        # 44.2 at 3; the hint does not tell it apart from 2 tokens per expert.)
        base = pick_config(rows_per_expert, dtype, "oct", swiglu, fmt)
        mode = "bf16rot_ps" if base.mode == "bf16asm" else "f16" if base.mode in ASM_MODES else base.mode
        stages = 3 if mode == "bf16rot_ps" and not swiglu else base.num_stages
        return W4A16Config(**{**base.__dict__, "mode": mode, "packing": "octb", "num_stages": stages})
    asm = USE_ASM and packing == "oct" and not impl.interpreting()
    mode = "f16asm" if asm else "f16"
    bucket = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 64 else 128
    tuned = TUNED.get(bucket)
    if tuned is not None and tuned.packing == packing and (asm or tuned.mode not in ASM_MODES):
        return tuned if not swiglu or bucket < 128 else W4A16Config(**{**tuned.__dict__, "num_stages": 2})
    chunks = 1 if packing == "oct" else 2
    # H200, MXFP4 with inline-PTX expansion (bench/results/gemm-probe-decode3-h200.json, `python -m
    # launch.bench.gemm --probe --sections decode3`, two runs): prescaled operands with 128 rows,
    # 4 warps, 4 stages beat the per-block rescale at 1 token per expert (3-8%, V3 / V4-Flash L1
    # and L2, all or 8 experts hit) and at 32 (324 vs 421 µs, V3 L1), and lost at 8 (6-10%) and
    # in the fused SwiGLU L1 (102 vs 90 µs): those keep the settings below.
    # TMA weight loads (bench/results/gemm-probe-decode4-h200.json, `--sections decode4`): with
    # 128 rows, 4 warps and 3 stages (3 CTAs per SM) they beat the pointer loads by 4-15% wherever
    # most experts have rows (1 token per expert, all 32 hit: V3 L1 259 vs 285 µs, V3 L2 129 vs 151,
    # V4-Flash L1 155 vs 173, L2 78 vs 91; 8 tokens: 287 vs 303; 32: 316 vs 328), and lose where few
    # experts have rows (1 token over 8 of 32 experts: 105 vs 80 µs; there 4 stages and pointer
    # loads stay best). rows_per_expert < 0.5 is that case (M / E with most experts empty).
    # bf16 operands (mode bf16asm; bench/results/gemm-probe-decode7a-h200.json, `--sections decode7`,
    # H200 2026-12-01, each against the f16asm default in the same run; the second run,
    # gemm-probe-decode7-h200.json, agrees within 3%): at these settings 1.16-1.66x
    # on every decode problem, V3 L1 1 / 8 / 32 tokens per expert 253.5 -> 199.3, 287.4 -> 204.7,
    # 311.1 -> 234.6 µs (0.46 -> 0.59 of the FP4 floor at 1 token), V3 L2 1 / 8: 127.9 -> 107.3,
    # 158.6 -> 106.8; V4-Flash L1 157.1 -> 121.0, L2 76.4 -> 66.1; 1 token over 8 of 32 experts
    # (pointer loads, 4 stages) V3 L1 77.1 -> 61.1, V4-Flash L1 50.1 -> 41.4. The expansion is 7
    # instructions per 4 elements instead of 11 and the per-block fp16 copy of the activations
    # through shared memory (and its barriers) is gone: 1249 -> 1028 SASS instructions per loop
    # step (sm_90a compile). fp16 activations keep f16asm (bf16 would round them).
    if asm and fmt == "mxfp4" and dtype == torch.bfloat16 and rows_per_expert <= 32:
        bm = 16 if rows_per_expert <= 16 else 32
        if swiglu:   # the fused L1 + SwiGLU: the settings below, with bf16 operands
            return W4A16Config(block_n=64, block_m=bm, chunks=1, num_warps=4, num_stages=4, mode="bf16asm",
                               packing=packing, prescale=True)
        few = rows_per_expert < 0.5    # most experts empty: pointer loads, 4 stages (see TMA below)
        return W4A16Config(block_n=128, block_m=bm, chunks=1, num_warps=4, num_stages=4 if few else 3,
                           mode="bf16asm", packing=packing, prescale=True, tma=not few)
    tma_ok = asm and fmt == "mxfp4" and packing == "oct" and not swiglu
    if tma_ok and 0.5 <= rows_per_expert <= 32:
        return W4A16Config(block_n=128, block_m=16 if rows_per_expert <= 16 else 32, chunks=1, num_warps=4,
                           num_stages=3, mode=mode, packing=packing, prescale=not 2 < rows_per_expert <= 16,
                           tma=True)
    if (asm and fmt == "mxfp4" and packing == "oct" and not swiglu
            and (rows_per_expert <= 2 or 16 < rows_per_expert <= 32)):
        return W4A16Config(block_n=128, block_m=16 if rows_per_expert <= 16 else 32, chunks=1, num_warps=4,
                           num_stages=4, mode=mode, packing=packing, prescale=True)
    # H200, V3 L1 (bench/results/gemm-probe-h200.json): 64 weight rows x 16 (32) tokens, 4 warps,
    # 4 stages beat 128 / 256 rows and 8 warps at 1 and 32 tokens per expert.
    if rows_per_expert <= 16:
        return W4A16Config(block_n=64, block_m=16, chunks=chunks, num_warps=4, num_stages=4, mode=mode,
                           packing=packing)
    if rows_per_expert <= 32:
        return W4A16Config(block_n=64, block_m=32, chunks=chunks, num_warps=4, num_stages=4, mode=mode,
                           packing=packing)
    if rows_per_expert <= 64:
        return W4A16Config(block_n=128, block_m=64, chunks=chunks, num_warps=4, num_stages=3, mode=mode,
                           packing=packing)
    return W4A16Config(block_n=128, block_m=128, chunks=chunks, num_warps=8, num_stages=2 if swiglu else 3,
                       mode=mode, packing=packing)   # (two weight tiles with swiglu: smem)


def launch_w4a16(x: torch.Tensor, w: PreparedWeight, rows, *, out_dtype: torch.dtype,
                 swiglu: tuple[float | None, float, float] | None = None, quant_out: bool = False,
                 config: W4A16Config | None = None, diag: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused W4A16 grouped GEMM (optionally + SwiGLU (+ fp8 group quant)).

    x: [M, K] or [E, C, K] float; w: mxfp4/nvfp4 PreparedWeight [E, N, K] (N = 2I with swiglu);
    swiglu: (limit or None, alpha, beta) -> output has I columns.
    Returns y [..., N or I] (out_dtype), or with quant_out (y e4m3, scale fp32 [..., I/128]).
    """
    if not w.is_fp4:
        raise ValueError(f"launch_w4a16 needs an mxfp4/nvfp4 weight, got {w.fmt!r}")
    E, N, K = w.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    hint = rows.rows_hint
    packing = w.kernel_packing
    cfg = config or pick_config(hint, x.dtype, packing if K % (8 * w.block) == 0 else "paired", swiglu is not None,
                                w.fmt)
    need = ASM_PACKING.get(cfg.mode)
    if need is not None and cfg.packing != need:
        raise ValueError(f"mode {cfg.mode!r} reads packing {need!r}, got {cfg.packing!r} (the Triton-arithmetic "
                         f"modes f16 / bf16 / f32 read any)")
    if cfg.packing == "octb" and K % (8 * w.block):
        raise ValueError(f"packing 'octb' needs K ({K}) a multiple of 8 scale blocks ({8 * w.block})")
    if cfg.packing == "oct" and K % (8 * w.block):
        if cfg.tma:
            raise ValueError(f"tma=True needs oct packing, i.e. K ({K}) a multiple of 8 scale blocks "
                             f"({8 * w.block}); use tma=False")
        plain = {"f16asm": "f16", "f16asm_swap": "f16", "bf16asm": "bf16"}.get(cfg.mode, cfg.mode)
        cfg = W4A16Config(**{**cfg.__dict__, "packing": "paired", "mode": plain})
    # the weight as this launch reads it: itself when prepared so (the usual case), else a copy
    # made once and cached on it; with swiglu the up half must start on a tile boundary
    tile_n = 0 if swiglu is not None and w.tile_n and (N // 2) % w.tile_n else None
    w = w.in_layout(cfg.packing, tile_n)
    st = w.strides()
    n_out = N // 2 if swiglu is not None else N
    if swiglu is not None and N % 2:
        raise ValueError(f"swiglu needs an even number of W13 rows, got {N}")
    if quant_out:
        if swiglu is None or n_out % 128:
            raise ValueError(f"fp8 group output needs swiglu and I % 128 == 0, got I={n_out}")
        cfg = W4A16Config(**{**cfg.__dict__, "block_n": 128})
    slots, tpe, cap, counts, offs, has_offs = layout_args(rows, x2, cfg.block_m)
    lead = x.shape[:-1]
    if quant_out:
        out = torch.empty(*lead, n_out, dtype=torch.float8_e4m3fn, device=x.device)
        out_scale = torch.empty(*lead, n_out // 128, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(*lead, n_out, dtype=out_dtype, device=x.device)
        out_scale = out
    if slots == 0 or n_out == 0:
        return (out, out_scale) if quant_out else out
    limit, alpha, beta = swiglu if swiglu is not None else (None, 1.0, 0.0)
    gs = w.global_scale if w.global_scale is not None else w.scale
    # oct: 8 scale bytes per row and unit, read as one int64 (K is a multiple of 8 blocks here)
    oct = cfg.packing in ("oct", "octb")
    sdata = w.scale.view(torch.int64) if oct else w.scale
    # prescaled operands: MXFP4 in the oct loop with fp16 operands (the only place it is wired)
    prescale = cfg.prescale and w.fmt == "mxfp4" and oct and MODES[cfg.mode] in (0, 3, 4, 5, 6, 7)
    if cfg.mode in ("bf16asm", "bf16rot", "bf16rot_ps") and not prescale:   # operands v * 2^-126: only prescaled in range
        raise ValueError(f"mode {cfg.mode!r} needs an MXFP4 weight in {need} packing with prescale=True; got fmt "
                         f"{w.fmt!r}, packing {cfg.packing!r}, prescale={cfg.prescale}")
    rmax = w.row_max_scale() if prescale else sdata
    if cfg.tma:
        _check_tma(st, cfg.block_n, st.row_offset(n_out))
        impl.ensure_triton_scratch()
    grid = (triton.cdiv(n_out, cfg.block_n), slots)
    unit = w.block * (8 if oct else 2)   # elements per packing unit
    chunks = chunks_for(K, unit, cfg.chunks)
    split = split_parts(cfg.split_k, K // (unit * chunks))
    meta = dict(
        K=K, E_POW2=triton.next_power_of_2(max(E, 2)), SLAB=rows.layout == "slab", HAS_OFFSETS=has_offs,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK=w.block, CHUNKS=chunks,
        NVFP4=w.fmt == "nvfp4", MODE=MODES[cfg.mode], SWIGLU=swiglu is not None,
    )
    tail = dict(PACK=PACKS[cfg.packing], TILE=st.tile_n, DIAG=diag,
                PRESCALE=prescale, stride_re=rmax.stride(0) if prescale else 0, TMA=cfg.tma,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.maxnreg:
        tail["maxnreg"] = cfg.maxnreg
    head = (x2, st.data, sdata, gs, rmax)
    shape = (counts, offs, n_out, E, tpe, cap, n_out, st.row_offset(n_out),
             x2.stride(0), st.expert, st.tile, st.row, st.chunk, sdata.stride(0), sdata.stride(1))
    has_limit = limit is not None
    limit = float(limit) if has_limit else 0.0
    if split == 1:
        _w4a16_kernel[grid](*head, out, out_scale, *shape, out.stride(-2), out_scale.stride(-2),
                            limit, float(alpha), float(beta), **meta, HAS_LIMIT=has_limit, QUANT_OUT=quant_out,
                            **tail)
        return (out, out_scale) if quant_out else out
    # split-K: fp32 partials [S, rows, N_out (+ N_out up)], then the ordered sum + epilogue
    part = torch.empty(split, x2.shape[0], n_out * (2 if swiglu is not None else 1), dtype=torch.float32,
                       device=x.device)
    _w4a16_splitk_kernel[(*grid, split)](*head, part, *shape, part.stride(0), part.stride(1), **meta, **tail,
                                         SPLIT_K=split)
    _w4a16_splitk_reduce[grid](
        part, out, out_scale, counts, offs, n_out, E, tpe, cap, part.stride(0), part.stride(1),
        out.stride(-2), out_scale.stride(-2), limit, float(alpha), float(beta),
        E_POW2=meta["E_POW2"], SLAB=meta["SLAB"], HAS_OFFSETS=has_offs, BLOCK_N=cfg.block_n,
        BLOCK_M=cfg.block_m, SPLIT_K=split, SWIGLU=swiglu is not None,
        HAS_LIMIT=has_limit, QUANT_OUT=quant_out, num_warps=4)
    return (out, out_scale) if quant_out else out


def split_parts(split_k: int, steps: int) -> int:
    """The split-K parts a launch runs: split_k, lowered to the largest of 1, 2, 4, 8 that is not
    above `steps` (the K loop's steps), so that no part is left without K."""
    return max(s for s in SPLIT_KS if s <= max(1, min(split_k, steps)))


def _check_tma(st: WeightStrides, block_n: int, up_offset: int) -> None:
    """The TMA path's layout needs: contiguous int32 words, every descriptor base (expert and up
    half) and leading stride 16-byte aligned, and row tiles that nest with the program's rows."""
    data = st.data
    nbytes = {"data pointer": data.data_ptr(), "expert stride": 4 * st.expert, "up-half offset": 4 * up_offset,
              "row stride": 4 * st.row, **({"tile stride": 4 * st.tile} if st.tile_n < prepare.UNTILED else {})}
    bad = {k: v for k, v in nbytes.items() if v % 16}
    if data.dtype != torch.int32 or not data.is_contiguous() or bad:
        raise ValueError(f"tma=True needs contiguous oct words with 16-byte aligned bases and strides; got dtype "
                         f"{data.dtype}, contiguous={data.is_contiguous()}, misaligned (bytes): {bad}; use tma=False")
    T = st.tile_n
    if T < prepare.UNTILED and T % block_n and block_n % T:
        raise ValueError(f"tma=True needs block_n ({block_n}) and the weight's tile_n ({T}) to divide one another; "
                         f"prepare the weight with tile_n=0 or a power of two, or use tma=False")


def w4a16_grouped_gemm(x: torch.Tensor, w: PreparedWeight, rows, *, out_dtype: torch.dtype,
                       config: W4A16Config | None = None) -> torch.Tensor:
    """grouped_gemm's triton_w4a16 fused path (see launch_w4a16)."""
    return launch_w4a16(x, w, rows, out_dtype=out_dtype, config=config)


def weight_strides(w: PreparedWeight) -> WeightStrides:
    """Deprecated alias of `PreparedWeight.strides()`."""
    return w.strides()
