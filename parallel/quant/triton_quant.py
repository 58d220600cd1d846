"""Triton quantize/dequantize kernels, bit-identical to `parallel.quant.reference`.

Imported only on CUDA (or under TRITON_INTERPRET=1 in tests). Each kernel repeats the
reference's fp32 steps exactly: divisions are correctly rounded (`tl.div_rn`, or per element
`_div_abs_fast`: a per-block reciprocal and two fma remainder steps, same bits; plain `/` is
approximate on NVIDIA), power-of-two scales are built from bits, and E4M3 / E2M1 rounding is
done on the integer bits (no E2M1 cast on sm_90; the interpreter rounds E4M3 subnormals wrongly).
Layout: a row-major [..., K] input is viewed as [rows, K] (fp4: [blocks, 32|16], since K is a
multiple of the block); one program handles a tile of rows x one block/group, with 16-byte
loads and stores per thread. The helpers below are written for few ops per element, the NaN/inf
handling runs only in tiles that hold one (a branch per program), and the fp8 dequantize uses
the hardware E4M3 conversion (exact).

Opt-in alternatives (VARIANTS, not yet measured on a GPU) change the memory structure rather
than the arithmetic, with the same bits: the FP4 quantize "lines" kernel gives each thread 32
contiguous elements (no shuffles, no shared-memory layout conversion, one 16-byte store per
thread, 48 / 70 registers on sm_90a for mxfp4 / nvfp4 where the blocks kernel takes 96 / 102),
the FP4 and FP8 dequantize "chunks" kernels store 16 bytes per thread without going through
shared memory, fp8_token "rows" reads a row in K / chunk unmasked chunks, fp8_block "unrolled"
has a whole 128 x 128 tile's loads in flight; nvfp4's computed global scale can be followed by
a backwards quantize or applied matrix by matrix (NVFP4_REVERSE, NVFP4_GROUP_BYTES) so that
the second read of x finds it in L2. `python bench/debug/kernel_sass.py quant-variants
parallel/quant/triton_quant.py` compiles each next to its default for sm_90a.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megapar.parallel import impl
from megapar.parallel.quant.formats import FP4_FORMATS, QuantizedTensor, check_quantizable, get_format
from megapar.parallel.quant.reference import DEFAULT_AMAX_FLOOR, _check_floor, check_storage

# The interpreter's fma rounds twice, so there `_div_abs_fast` is plain tl.div_rn; the tests swap
# in an exact fma and set this to run the fma path (the only one on GPU). Read once, at import:
# triton itself decides at import whether it interprets.
FMA_DIVISION = tl.constexpr(not impl.interpreting())

# Launch settings per kernel, (tile, warps); `python -m megapar.launch.bench.quant --probe` sweeps
# them on the GPU and writes a file for `apply_tuning` (or MEGAPAR_QUANT_TUNING=path at import).
CONFIG: dict[str, tuple[int, int]] = {
    "fp4_quant": (128, 4),     # 128 blocks of 32 (or 256 of 16): 4096 elements per program
    # (probe 2: (64, 4) 147 -> 139 µs on mxfp4; not taken: the probe did not time nvfp4 with it)
    "fp4_dequant": (256, 8),   # H200 sweep (bench/results/quant-h200.md): 10% over (128, 4)
    "fp4_amax": (32768, 16),   # nvfp4 computed global scale: elements per program (probe: 647 -> 597 µs)
    "fp8_group": (32, 4),      # 32 rows x 128
    "fp8_token": (4096, 8),    # fp8_token rows of <= 8192: elements per program (whole rows)
    "fp8_block": (32, 8),      # fp8_block: rows per pass of a 128 x 128 tile (probe: 235 -> 202 µs)
    "fp8_dequant": (128, 8),   # 128 rows x 128 columns (probe: 166 -> 142 µs)
    # the variants of VARIANTS below (measured: the comment there):
    "mxfp4_lines": (128, 4),   # the lines kernel: lines of 32 elements per tile (one per thread), warps
    "nvfp4_lines": (128, 4),
    "fp8_token_rows": (1024, 4),   # fp8_token one row per program, two unrolled passes: chunk, warps
    "fp4_dequant_chunks": (1024, 4),   # the chunks dequantize: chunks of 8 outputs per program, warps
    "fp8_block_unrolled": (32, 8),     # fp8_block with both passes unrolled: rows per step, warps
    "fp8_dequant_chunks": (64, 8),     # fp8 dequantize over [rows, 16, 8] tiles: rows, warps
}
# Which kernel an op launches. The alternatives are opt-in until the probe has timed them side by
# side with the default on the GPU; switching is one entry here or in a tuning file ("variants").
#   mxfp4_quant / nvfp4_quant: "blocks" (`_fp4_quant_kernel`) | "lines" (`_fp4_quant_lines_kernel`)
#   fp8_token (rows of K <= 8192): "tile" (whole rows in one [ROWS, next_pow2(K)] tile) | "rows"
#     (`_fp8_row_quant_kernel` unrolled over K / chunk chunks: no masked columns, a second read
#     of the row that L1 serves)
#   fp4_dequant (both formats): "blocks" (`_fp4_dequant_kernel`) | "chunks" (`_fp4_dequant_chunks_kernel`)
#   fp8_block: "loop" | "unrolled" (both passes unrolled; no masks where N, K are multiples of 128)
#   fp8_dequant: "tile" (`_fp8_dequant_kernel`) | "chunks" (`_fp8_dequant_chunks_kernel`)
# Defaults from the H200 probe of 2026-12-03 (`python -m megapar.launch.bench.quant --probe`,
# CUDA-graph replays, every row bit-identical; bench/results/quant-probe3-h200.log, its tuning file
# quant-tuning-h200.json), % of the copy ceiling against the previous default in the same run:
# mxfp4 quantize lines x2 91.2% (blocks 66.6%), nvfp4 quantize (computed scale) lines x2 33.5%
# (28.7%), fp8_token rows 87.5% (tile 74.9%); the dequantize / fp8_group / fp8_block / fp8
# dequantize defaults stayed best or within 2% (86.4 / 79.0 / 80.3 / 76.6%).
VARIANTS: dict[str, str] = {"mxfp4_quant": "lines", "nvfp4_quant": "lines", "fp8_token": "rows", "fp4_dequant": "blocks",
                            "fp8_block": "loop", "fp8_dequant": "tile"}
VARIANT_CHOICES = {"mxfp4_quant": ("blocks", "lines"), "nvfp4_quant": ("blocks", "lines"), "fp8_token": ("tile", "rows"),
                   "fp4_dequant": ("blocks", "chunks"), "fp8_block": ("loop", "unrolled"), "fp8_dequant": ("tile", "chunks")}
# Tiles per program of the lines kernels (> 1: a loop with the next tile's loads issued first).
LOOPS: dict[str, int] = {"mxfp4_lines": 2, "nvfp4_lines": 2}   # (probe 3: 79.8 -> 76.4 and 219.3 -> 210.5 µs)
# nvfp4 with a computed global scale reads x twice (the amax pass, then the quantize). Options
# for the second read to find x in L2 (opt-in until measured):
#   NVFP4_REVERSE: the quantize programs walk x from its end, where the amax pass ended;
#   NVFP4_GROUP_BYTES > 0 (global_scale="matrix" only): amax pass and quantize per group of
#     whole matrices of about this many bytes of x (one matrix at least), each quantize reversed,
#     so a group that fits in L2 is read from DRAM once.
NVFP4_REVERSE = False
NVFP4_GROUP_BYTES = 0
# The "probe" figures: `python -m megapar.launch.bench.quant --probe` on the H200, 2026-12-01
# (bench/results/quant-probe-h200.json; a [4, 4096, 7168] weight, [16384, 7168] activations,
# every setting bit-identical to the default's output). Those probes timed eager calls from an
# idle GPU, so each figure includes the host's wrapper and launch time (tens of µs); the probe
# now times CUDA-graph replays and reports the eager figure next to it.
# E4M3 rounding of the fp8 quantize fast path by the hardware conversion (inline PTX
# `cvt.rn.satfinite.e4m3x2.f32`; GPU only, the interpreter always runs the integer rounding).
# On by default since 2026-12-01: the H200 probe found it bit-identical to the integer rounding on
# its data and faster (second probe, same run as the integer rounding: fp8_group 194 -> 140 µs,
# fp8_token 204 -> 182, fp8_block 204 -> 135; bench/results/quant-probe2-h200.json), and the GPU
# tests of tests/test_quant_triton.py and tests/test_gemm_gpu.py (odd K, partial tiles, saturation,
# bit checks against the CPU reference) pass with it on (59 tests). apply_tuning({"fp8_hw_cast":
# false}) (or MEGAPAR_QUANT_TUNING=path) turns it off.
FP8_HW_CAST = True
FP4_QUANT_DIAG = 0   # 1: the FP4 quantize kernel without its arithmetic (launch/bench/quant.py's probe only)


def apply_tuning(tuning: dict) -> None:
    """Install measured launch settings {"config": {kernel: [tile, warps]}, "fp8_hw_cast": bool,
    "variants": {op: kernel}, "loops": {kernel: tiles per program}, "nvfp4_reverse": bool,
    "nvfp4_group_bytes": int}
    (as written by `python -m megapar.launch.bench.quant --probe --out DIR` to DIR/quant-tuning.json).
    ValueError for an unknown kernel or a malformed entry (nothing is installed then)."""
    global FP8_HW_CAST, NVFP4_REVERSE, NVFP4_GROUP_BYTES
    if not isinstance(tuning.get("nvfp4_group_bytes", 0), int) or tuning.get("nvfp4_group_bytes", 0) < 0:
        raise ValueError(f"nvfp4_group_bytes must be an int >= 0, got {tuning['nvfp4_group_bytes']!r}")
    for name, value in tuning.get("config", {}).items():
        if name not in CONFIG:
            raise ValueError(f"unknown quant kernel {name!r} in tuning; valid: {', '.join(CONFIG)}")
        if len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
            raise ValueError(f"tuning for {name!r} must be [tile, warps] (positive ints), got {value!r}")
    for op, name in tuning.get("variants", {}).items():
        if op not in VARIANT_CHOICES or name not in VARIANT_CHOICES[op]:
            raise ValueError(f"unknown quant variant {op!r}: {name!r}; valid: {VARIANT_CHOICES}")
    for name, value in tuning.get("loops", {}).items():
        if name not in LOOPS or not isinstance(value, int) or value <= 0:
            raise ValueError(f"loops for {name!r} must be a positive int (kernels: {', '.join(LOOPS)}), got {value!r}")
    for name, value in tuning.get("config", {}).items():
        CONFIG[name] = (int(value[0]), int(value[1]))
    VARIANTS.update(tuning.get("variants", {}))
    LOOPS.update(tuning.get("loops", {}))
    if "fp8_hw_cast" in tuning:
        FP8_HW_CAST = bool(tuning["fp8_hw_cast"])
    if "nvfp4_reverse" in tuning:
        NVFP4_REVERSE = bool(tuning["nvfp4_reverse"])
    if "nvfp4_group_bytes" in tuning:
        NVFP4_GROUP_BYTES = int(tuning["nvfp4_group_bytes"])


def _load_env_tuning() -> None:
    import json
    import os

    path = os.environ.get("MEGAPAR_QUANT_TUNING")
    if path:
        with open(path) as f:
            apply_tuning(json.load(f))


def _hw_cast() -> bool:
    return FP8_HW_CAST and not impl.interpreting()


# ------------------------------------------------------------------ bit helpers (device)
# Public for other kernels (e.g. the expert GEMMs) that must produce parallel.quant's exact bits in registers.
# The kernels are ALU-bound, not memory-bound (the old versions ran ~38 SASS instructions per
# element for mxfp4): every helper is written for few integer ops per element.


@triton.jit
def _minifloat_bits(a, MAN: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr, SUB_SCALE: tl.constexpr):
    """non-NaN fp32 a >= 0 -> int32 bits (exponent | MAN-bit mantissa, no sign) of a minifloat
    with exponent bias BIAS, round to nearest even, subnormals included, saturating at bits MAX.
    SUB_SCALE = 2^(BIAS - 1 + MAN): subnormals are integer multiples of 1 / SUB_SCALE."""
    a_bits = a.to(tl.int32, bitcast=True)
    # normal range: round the mantissa to MAN bits and rebias 127 -> BIAS in one add
    drop: tl.constexpr = 23 - MAN
    normal = tl.minimum((a_bits + (((a_bits >> drop) & 1) + ((1 << (drop - 1)) - 1 - ((127 - BIAS) << 23)))) >> drop, MAX)
    # subnormal range: adding 2^23 to a * SUB_SCALE rounds it to an integer (nearest even)
    sub = (a * SUB_SCALE + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(a_bits >= ((128 - BIAS) << 23), normal, sub)


@triton.jit
def _e4m3_magnitude(a):
    """non-NaN fp32 a >= 0 -> int32 E4M3 bits of a, round to nearest even, saturating at 448 (0x7E)."""
    return _minifloat_bits(a, 3, 7, 0x7E, 512.0)


@triton.jit
def _e4m3_bytes_hw(q, x):
    """q = |x| / scale (fp32, non-NaN, >= 0), x -> uint8 E4M3 bits of q with x's sign: the sm_89+
    `cvt.rn.satfinite.e4m3x2.f32` (one RNE rounding, saturating at 448; Triton's own cast goes
    through fp16 and can round twice), 1.5 instructions per element instead of ~10 integer ops.
    GPU only (the interpreter runs no PTX): callers pick it with a constexpr."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 s, t;
        cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
        cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
        mov.b32 $0, {lo, hi};
        prmt.b32 s, $5, $6, 0x73;
        prmt.b32 t, $7, $8, 0x73;
        prmt.b32 s, s, t, 0x5410;
        and.b32 s, s, 0x80808080;
        or.b32 $0, $0, s;
        }""",
        "=r,r,r,r,r,r,r,r,r", [q, x], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _sign_at(x, BIT: tl.constexpr):
    """The sign of fp32 x moved to bit BIT (E4M3: 7, E2M1: 3), as int32."""
    return (x.to(tl.int32, bitcast=True) >> (31 - BIT)) & (1 << BIT)


@triton.jit
def _e4m3_byte_finite(y):
    """non-NaN fp32 y -> int32 E4M3 bits, round to nearest even, saturating at +-448."""
    return _e4m3_magnitude(tl.abs(y)) | _sign_at(y, 7)


@triton.jit
def e4m3_byte(y):
    """fp32 y -> uint8 E4M3 bits, round to nearest even, saturating at +-448; NaN -> 0x7F."""
    return tl.where(y != y, 0x7F, _e4m3_byte_finite(y)).to(tl.uint8)


@triton.jit
def e4m3_value(byte):
    """uint8 E4M3 bits -> fp32 (exact; 0x7F/0xFF are NaN)."""
    b = byte.to(tl.int32)
    mag = b & 0x7F
    exp = mag >> 3
    man = mag & 7
    normal = ((exp + 120) << 23) | (man << 20)
    val = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    val = tl.where(mag == 0x7F, float("nan"), val)
    return (val.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)  # keeps -0.0


@triton.jit
def _e2m1_index(a):
    """non-NaN fp32 a >= 0 -> int32 E2M1 magnitude index of a, round to nearest even, saturating at 6.

    The index is min(RN(2a), RN(a) + 2, RN(a / 2) + 4) (saturated at 7): each term is exact on
    its binade ([0, 2): step 0.5; [2, 4): 1; [4, 8): 2) and, RN being monotonic, no larger than
    the others there. Each RN(.) + c is one fp32 add or fma against 2^23 + c (ulp 1, c even, so
    ties go to the even integer as E2M1's do), read off the bits: 3 fma-pipe ops and two integer
    mins per element, where the bit-level rounding took ~9 integer ops (the H200 quantize was
    bound by the integer pipe)."""
    t2 = tl.fma(a, 2.0, 8388608.0).to(tl.int32, bitcast=True)           # 2^23 + RN(2a)
    t1 = (a + 8388610.0).to(tl.int32, bitcast=True)                      # 2^23 + 2 + RN(a)
    th = tl.fma(a, 0.5, 8388612.0).to(tl.int32, bitcast=True)           # 2^23 + 4 + RN(a / 2)
    return tl.minimum(tl.minimum(tl.minimum(t2, t1), th), 0x4B000007) - 0x4B000000


@triton.jit
def _e2m1_index_le6_signed(a, x):
    """a = |x| * 2^k in [0, 6] (no saturation needed) -> int32 whose LOW BYTE is the E2M1 code of
    a with x's sign (bits 24.. hold 0x4B: callers pack and truncate to uint8): `_e2m1_index`
    without its saturating min and without removing the 2^23 offset, the sign added by one
    multiply-high and a multiply-add (fma-pipe integer ops, where mask, shift and or took 3 ALU ops)."""
    t2 = tl.fma(a, 2.0, 8388608.0).to(tl.int32, bitcast=True)
    t1 = (a + 8388610.0).to(tl.int32, bitcast=True)
    th = tl.fma(a, 0.5, 8388612.0).to(tl.int32, bitcast=True)
    m = tl.minimum(tl.minimum(t2, t1), th)                          # 0x4B000000 + index, index <= 7
    sign = tl.umulhi(x.to(tl.uint32, bitcast=True), 2).to(tl.int32)  # x >> 31 on the fma pipe (IMAD.HI)
    return m + sign * 8


@triton.jit
def _e2m1_code_finite(y):
    """non-NaN fp32 y -> int32 E2M1 code (sign<<3 | index), round to nearest even, saturating."""
    return _e2m1_index(tl.abs(y)) | _sign_at(y, 3)


@triton.jit
def e2m1_code(y):
    """fp32 -> E2M1 code (sign<<3 | index), round to nearest even, saturating; NaN -> 0."""
    return tl.where(y != y, 0, _e2m1_code_finite(y))


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32 in [0, 16)) -> fp32 (exact; code 8 is -0.0).

    The code's bits placed at fp32 bit 22 are the value times 2^-126 (1.0 -> exponent field 1,
    0.5 -> the subnormal 2^-127), so one exact multiply finishes it (fp32 subnormals are kept)."""
    bits = ((code & 7) << 22) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37     # 2^126


@triton.jit
def e8m0_value(byte):
    """uint8 E8M0 -> fp32 2^(byte - 127); 0 -> 2^-127 (subnormal), 255 -> NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax, amax_floor, UE8M0: tl.constexpr):
    """Block amax -> fp32 scale (amax/448 or the next power of two), as reference.fp8_scale."""
    a = tl.where(amax < amax_floor, amax_floor, amax)
    if UE8M0:
        bits = a.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -126), 127)
        s = ((e + 127) << 23).to(tl.float32, bitcast=True)
        return tl.where(a != a, a, s)
    else:
        return tl.div_rn(a, 448.0)


@triton.jit
def fp8_quant(x, scale):
    """fp32 x / scale -> uint8 E4M3 bits (clamped to +-448; NaN -> 0x7F), as the reference."""
    return e4m3_byte(tl.div_rn(x, scale))


@triton.jit
def _abs_max_bits(x, axis: tl.constexpr):
    """max of |x| along `axis` as fp32 bits (int32): a NaN anywhere gives a NaN pattern
    (> 0x7F800000), since non-negative floats order like their bits."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=axis)


@triton.jit
def _div_abs_fast(x, d, r):
    """|x| / d rounded to nearest even (= |tl.div_rn(x, d)|) for d in [2^-64, 2^64], r = RN(1 / d)
    and |x| / d <= 2^64. q = |x| r is within 2 ulp; two remainder steps, each remainder exact
    by fma, make it correctly rounded (Markstein). 5 ops per element instead of div.rn's
    reciprocal, range check and branch. Callers take the sign from x (so -0.0 keeps it)."""
    a = tl.abs(x)
    if FMA_DIVISION:
        nd = -d                      # per block (negating q per element would cost an op each)
        q = a * r
        q = tl.fma(tl.fma(q, nd, a), r, q)
        q = tl.fma(tl.fma(q, nd, a), r, q)
    else:
        q = tl.div_rn(a, d)
    return q


@triton.jit
def _fast_div_ok(d):
    """Per-block divisors for which `_div_abs_fast` is exact (with quotients bounded by 2^64)."""
    return (d >= 5.421010862427522e-20) & (d <= 1.8446744073709552e19)      # 2^-64, 2^64


@triton.jit
def _fp8_tile(x, scale, slow, UE8M0: tl.constexpr, HW: tl.constexpr):
    """x: fp32 tile, scale: fp32 per block broadcastable to it -> uint8 E4M3 bits of x / scale.
    `slow` (a scalar): some block of the tile has an inf/NaN (x / scale may be NaN -> 0x7F) or
    a scale outside [2^-64, 2^64]; the tile then takes the reference's plain steps.
    HW: the hardware E4M3 conversion of the quotients (GPU), else the integer rounding."""
    r = tl.div_rn(1.0, scale)
    if UE8M0:          # a power of two: |x| * (1 / scale) is |x| / scale exactly (one rounding)
        a = tl.abs(x) * r
    else:              # scale >= amax / 448: quotients <= 448, only the range of scale matters
        a = _div_abs_fast(x, scale, r)
    if HW:
        byte = _e4m3_bytes_hw(a, x)
    else:
        byte = (_e4m3_magnitude(a) | _sign_at(x, 7)).to(tl.uint8)
    if slow:
        byte = e4m3_byte(tl.div_rn(x, scale))
    return byte


# ------------------------------------------------------------------ FP4 kernels


@triton.jit
def _boundary_bits(c, g, GE: tl.constexpr):
    """fp32 c, g > 0 with c * g in [2^-98, 2^99] -> int32 bits of the least fp32 T with, for
    every fp32 a >= 0: a >= T  <=>  a >= c * g (GE) or a > c * g (not GE), c * g exact (real).

    p = RN(c g) and e = c g - p, exact by fma (the error of a product is an fp32 when the
    exponents sum to >= -103): GE: T = RU(c g) = p, or p's successor where e > 0; not GE: T is
    the least fp32 above c g = p's successor where e >= 0, else p (RN puts no fp32 between c g
    and p). Successor of a positive finite fp32 = its bits + 1."""
    p = c * g
    if FMA_DIVISION:
        e = tl.fma(c, g, -p)
    else:          # the interpreter (its fma rounds twice): c * g is exact in float64, so is the difference
        e = c.to(tl.float64) * g.to(tl.float64) - p.to(tl.float64)
    if GE:
        up = e > 0
    else:
        up = e >= 0
    return p.to(tl.int32, bitcast=True) + up.to(tl.int32)


@triton.jit
def _nvfp4_thresholds(sval, g, abits):
    """sval: E4M3 block scales (fp32 [ROWS]), g: global scale (scalar or [ROWS]), abits: block
    amax bits -> (fast: [ROWS] bool, b0..b6: fp32 [ROWS] thresholds): for fast rows, the E2M1
    code of x / (s * g) rounded from the exact quotient (as reference.nvfp4_codes) is
    `_e2m1_count(x, b0, .., b6)`.

    Per element, no division: the index is the number of boundaries |x| has passed, and each
    test `|x| > b s g` (b = 0.25, 1.25, 2.5, 5; ties to the even code below) or `|x| >= b s g`
    (b = 0.75, 1.75, 3.5) is one fp32 compare `|x| >= T_b` with a per-block threshold T_b
    (`_boundary_bits`, exact). b s is exact (3 and 4 significant bits), the thresholds of
    b = 0.25, 2.5, 5 and 3.5 are those of 1, 1.25 and 1.75 times a power of two (bits -+ k << 23,
    exact while normal), so four fma pairs per block. Fast rows: s g in [2^-96, 2^96] (every
    threshold normal, every error exact), or s = 0 with a finite amax (the reference's x * 0:
    the sign alone; thresholds +inf give index 0). NaN blocks (s = NaN), an inf with s = 0 and
    extreme s * g are not fast: the caller takes `_boundary_f64` thresholds for those tiles."""
    d = sval * g                                            # approximate: the range test only
    zero = sval == 0.0
    fast = ((d >= 1.262177448353619e-29) & (d <= 7.922816251426434e28)) | (zero & (abits < 0x7F800000))
    t1 = _boundary_bits(sval, g, False)                    # |x| > 1 s g (-> 0.25)
    t15 = _boundary_bits(sval * 1.5, g, True)              # |x| >= 1.5 s g (-> 0.75)
    t125 = _boundary_bits(sval * 1.25, g, False)           # |x| > 1.25 s g (-> 2.5, 5)
    t175 = _boundary_bits(sval * 1.75, g, True)            # |x| >= 1.75 s g (-> 3.5)
    inf = 0x7F800000
    b0 = tl.where(zero, inf, t1 - (2 << 23)).to(tl.float32, bitcast=True)       # 0.25
    b1 = tl.where(zero, inf, t15 - (1 << 23)).to(tl.float32, bitcast=True)      # 0.75
    b2 = tl.where(zero, inf, t125).to(tl.float32, bitcast=True)                 # 1.25
    b3 = tl.where(zero, inf, t175).to(tl.float32, bitcast=True)                 # 1.75
    b4 = tl.where(zero, inf, t125 + (1 << 23)).to(tl.float32, bitcast=True)     # 2.5
    b5 = tl.where(zero, inf, t175 + (1 << 23)).to(tl.float32, bitcast=True)     # 3.5
    b6 = tl.where(zero, inf, t125 + (2 << 23)).to(tl.float32, bitcast=True)     # 5
    return fast, b0, b1, b2, b3, b4, b5, b6


@triton.jit
def _e2m1_count(x, b0, b1, b2, b3, b4, b5, b6):
    """x: fp32 [ROWS, BS], b0..b6: fp32 [ROWS] thresholds -> int32 sign << 3 | (number of b
    with |x| >= b). Each test as 1.0 / 0.0 summed in fp32 onto 2^23 (FSET + FADD on sm_90;
    integer 0/1 sums compile to compares, selects and predicated moves): bits 0x4B000000 + n."""
    a = tl.abs(x)
    n = tl.where(a >= b0[:, None], 1.0, 0.0) + tl.where(a >= b1[:, None], 1.0, 0.0)
    n += tl.where(a >= b2[:, None], 1.0, 0.0) + tl.where(a >= b3[:, None], 1.0, 0.0)
    n += tl.where(a >= b4[:, None], 1.0, 0.0) + tl.where(a >= b5[:, None], 1.0, 0.0)
    n += tl.where(a >= b6[:, None], 1.0, 0.0) + 8388608.0
    return (n.to(tl.int32, bitcast=True) - 0x4B000000) | _sign_at(x, 3)


@triton.jit
def _e2m1_search(x, b0, b1, b2, b3, b4, b5, b6):
    """`_e2m1_count` by a 3-step search of the ordered thresholds (b0 <= .. <= b6, per row): the
    same count of thresholds |x| has passed, in 3 compares and 4 selects per element where the
    sum takes 7 compares and 7 adds (the lines kernel; NaN passes none, as there)."""
    a = tl.abs(x)
    hi = a >= b3[:, None]
    mid = a >= tl.where(hi, b5[:, None], b1[:, None])
    lo = a >= tl.where(hi, tl.where(mid, b6[:, None], b4[:, None]), tl.where(mid, b2[:, None], b0[:, None]))
    n = tl.where(hi, 4, 0) + tl.where(mid, 2, 0) + tl.where(lo, 1, 0)
    return n | _sign_at(x, 3)


@triton.jit
def _boundary_f64(b: tl.constexpr, sval, g, GE: tl.constexpr):
    """`_boundary_bits` for any s * g, as fp32: D = b * s * g is exact in float64 (3 + 4 + 24
    significant bits), f = RN32(D) and its float64 value decide the direction (f's successor
    where f < D (GE) or f <= D); an overflowing D gives +inf, a tiny one the least subnormal."""
    dd = (sval * b).to(tl.float64) * g.to(tl.float64)
    f = dd.to(tl.float32)
    if GE:
        up = f.to(tl.float64) < dd
    else:
        up = f.to(tl.float64) <= dd
    return (f.to(tl.int32, bitcast=True) + up.to(tl.int32)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_quant_kernel(x_ptr, data_ptr, scale_ptr, gs_ptr, n_blocks, blocks_per_gs,
                      IS_NV: tl.constexpr, GS_PER_MATRIX: tl.constexpr, BS: tl.constexpr,
                      ROWS: tl.constexpr, EVEN: tl.constexpr, DIAG: tl.constexpr = 0, REVERSE: tl.constexpr = False):
    """One program: ROWS whole blocks of BS (a [ROWS * BS] contiguous slice of x). Each thread
    loads 16 bytes, stores its packed bytes in one store; EVEN (n_blocks % ROWS == 0) drops masks.
    DIAG 1 (a diagnostic of the tuning probe, never a result): the same loads and stores with
    the arithmetic dropped, codes from x's bits and one max per block as the scale.
    REVERSE: program p takes the tile of program (programs - 1 - p) (see NVFP4_REVERSE)."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)    # block index
    cols = tl.arange(0, BS)
    if EVEN:
        x = tl.load(x_ptr + rows[:, None] * BS + cols[None, :])
    else:
        x = tl.load(x_ptr + rows[:, None] * BS + cols[None, :], mask=(rows < n_blocks)[:, None], other=0.0)
    x = x.to(tl.float32)
    if DIAG == 1:
        codes = (x.to(tl.int32, bitcast=True) >> 16) & 0xF
        sbyte = tl.max(codes, 1).to(tl.uint8)
        _fp4_store(data_ptr, scale_ptr, rows, n_blocks, codes, sbyte, ROWS, BS, EVEN)
    else:
        abits = _abs_max_bits(x, 1)                                      # [ROWS] block amax bits
        if IS_NV:
            if GS_PER_MATRIX:
                g = tl.load(gs_ptr + rows.to(tl.int32) // blocks_per_gs, mask=rows < n_blocks, other=1.0)
            else:
                g = tl.load(gs_ptr)
            amax = abits.to(tl.float32, bitcast=True)                        # NaN when the block has one
            s = tl.where(g > 0, tl.div_rn(tl.div_rn(amax, 6.0), g), 0.0)
            s = tl.where(s > 448.0, 448.0, s)
            sbyte = e4m3_byte(s)
            sval = e4m3_value(sbyte)
            fast, b0, b1, b2, b3, b4, b5, b6 = _nvfp4_thresholds(sval, g, abits)
            # rare tiles: a NaN in a block, an inf where s is 0, or s * g outside [2^-96, 2^96]:
            # the same compares against thresholds from float64 (exact for every s * g:
            # subnormal, overflowing), then the reference's rule for NaN (code 0) and s * g not
            # > 0 (the code of x * 0). Each branch packs and stores its own codes, so no
            # per-element value lives across the branch (registers set the occupancy).
            if tl.min(fast.to(tl.int32)) == 0:
                codes = _nv_line_codes_slow(x, sval, g)
                _fp4_store(data_ptr, scale_ptr, rows, n_blocks, codes, sbyte, ROWS, BS, EVEN)
            else:
                codes = _e2m1_count(x, b0, b1, b2, b3, b4, b5, b6)
                _fp4_store(data_ptr, scale_ptr, rows, n_blocks, codes, sbyte, ROWS, BS, EVEN)
        else:
            byte = (abits >> 23) - 2 + ((abits & 0x7FFFFF) > 0x400000).to(tl.int32)
            byte = tl.minimum(tl.maximum(byte, 0), 254)
            byte = tl.where(abits > 0x7F800000, 255, byte)
            inv = (tl.maximum(254 - byte, 1) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact multiply
            y = tl.abs(x) * inv[:, None]
            if tl.max(abits) >= 0x7F800000:      # an inf (saturates) or a NaN (its code is +0) in the tile
                codes = tl.where(x != x, 0, _e2m1_index(y) | _sign_at(x, 3))
            else:                                # finite: y <= 6, no saturation; sign | index in one op
                codes = _e2m1_index_le6_signed(y, x)
            sbyte = byte.to(tl.uint8)
        if not IS_NV:
            _fp4_store(data_ptr, scale_ptr, rows, n_blocks, codes, sbyte, ROWS, BS, EVEN)


@triton.jit
def _fp4_store(data_ptr, scale_ptr, rows, n_blocks, codes, sbyte, ROWS: tl.constexpr, BS: tl.constexpr,
               EVEN: tl.constexpr):
    """codes: int32 [ROWS, BS] E2M1 codes -> packed bytes (even | odd << 4) at data[rows], sbyte at scale[rows]."""
    pcols = tl.arange(0, BS // 2)
    even, odd = tl.split(tl.reshape(codes, (ROWS, BS // 2, 2)))
    packed = (even | (odd << 4)).to(tl.uint8)
    if EVEN:
        tl.store(data_ptr + rows[:, None] * (BS // 2) + pcols[None, :], packed)
        tl.store(scale_ptr + rows, sbyte)
    else:
        tl.store(data_ptr + rows[:, None] * (BS // 2) + pcols[None, :], packed, mask=(rows < n_blocks)[:, None])
        tl.store(scale_ptr + rows, sbyte, mask=rows < n_blocks)


# ---- the "lines" FP4 quantize (opt-in: VARIANTS["mxfp4_quant"] / ["nvfp4_quant"] = "lines")
# One thread owns one line of 32 contiguous elements (one mxfp4 block, two nvfp4 blocks), loaded
# as four [ROWS, 8] chunks (Triton gives a [ROWS, 8] load one row per thread): the block amax is a
# per-thread max (no shuffles), the 16 packed bytes of a line are joined in registers and stored
# by one 16-byte store per thread, the scale bytes by one 1-byte (2-byte) store; no shared memory
# and no layout conversion (the blocks kernel goes through shared memory and barriers to give
# each thread 16 contiguous output bytes). TILES > 1: a program quantizes TILES consecutive tiles
# of ROWS lines, loading tile t + 1 before it computes tile t (software prefetch); REVERSE: the
# programs walk the tensor from its end (after the nvfp4 amax pass, whose last reads may still
# sit in L2).


@triton.jit
def _line_chunks(x_ptr, lines, n_chunks, MASKED: tl.constexpr):
    """x[lines * 32 + j * 8 + (0..7)] for j = 0..3 as four [ROWS, 8] tensors (x's dtype); MASKED:
    chunks at or past n_chunks (8-element units) read 0."""
    c = tl.arange(0, 8)
    p = x_ptr + lines[:, None] * 32 + c[None, :]
    if MASKED:
        q = lines[:, None] * 4
        x0 = tl.load(p, mask=q < n_chunks, other=0.0)
        x1 = tl.load(p + 8, mask=q + 1 < n_chunks, other=0.0)
        x2 = tl.load(p + 16, mask=q + 2 < n_chunks, other=0.0)
        x3 = tl.load(p + 24, mask=q + 3 < n_chunks, other=0.0)
    else:
        x0 = tl.load(p)
        x1 = tl.load(p + 8)
        x2 = tl.load(p + 16)
        x3 = tl.load(p + 24)
    return x0, x1, x2, x3


@triton.jit
def _pack8(codes):
    """int32 [ROWS, 8] E2M1 codes (low nibble; bits 8..23 zero) -> uint8 [ROWS, 4] (even | odd << 4)."""
    even, odd = tl.split(tl.reshape(codes, (codes.shape[0], 4, 2)))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def _cat_cols(a, b):
    """[ROWS, n] and [ROWS, n] -> [ROWS, 2n] (a's columns, then b's), in registers."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _line_bytes(c0, c1, c2, c3):
    """The four chunks' codes -> the line's 16 packed bytes [ROWS, 16]."""
    return _cat_cols(_cat_cols(_pack8(c0), _pack8(c1)), _cat_cols(_pack8(c2), _pack8(c3)))


@triton.jit
def _abs_max2(a, b):
    return tl.maximum(_abs_max_bits(a, 1), _abs_max_bits(b, 1))


@triton.jit
def _mx_line_codes(x, inv, SLOW: tl.constexpr):
    """mxfp4 codes of a chunk x (fp32 [ROWS, 8]) with per-row 2^-e (inv); SLOW: the tile holds an
    inf or NaN (saturation, NaN -> +0), else |x| * inv <= 6 (as `_fp4_quant_kernel`)."""
    y = tl.abs(x) * inv[:, None]
    if SLOW:
        return tl.where(x != x, 0, _e2m1_index(y) | _sign_at(x, 3))
    else:
        return _e2m1_index_le6_signed(y, x)


@triton.jit
def _nv_scale(abits, g):
    """nvfp4 block amax bits -> (E4M3 scale byte, its fp32 value), as `_fp4_quant_kernel`."""
    amax = abits.to(tl.float32, bitcast=True)
    s = tl.where(g > 0, tl.div_rn(tl.div_rn(amax, 6.0), g), 0.0)
    s = tl.where(s > 448.0, 448.0, s)
    sbyte = e4m3_byte(s)
    return sbyte, e4m3_value(sbyte)


@triton.jit
def _nv_line_codes_slow(x, sval, g):
    """nvfp4 codes of x ([R, C], its rows' block scales sval [R]) in a tile with a rare block: the
    compares against thresholds from float64 (exact for every s * g: subnormal, overflowing),
    then the reference's rule where s * g is not > 0: a finite x keeps its sign (index 0:
    thresholds +inf), an inf gives code 0 (inf * 0 is NaN); a NaN is code 0 anywhere. Both FP4
    quantize kernels' slow branch."""
    d_pos = (sval.to(tl.float64) * g.to(tl.float64)) > 0                     # exact s * g > 0
    inf = float("inf")
    b0 = tl.where(d_pos, _boundary_f64(0.25, sval, g, False), inf)
    b1 = tl.where(d_pos, _boundary_f64(0.75, sval, g, True), inf)
    b2 = tl.where(d_pos, _boundary_f64(1.25, sval, g, False), inf)
    b3 = tl.where(d_pos, _boundary_f64(1.75, sval, g, True), inf)
    b4 = tl.where(d_pos, _boundary_f64(2.5, sval, g, False), inf)
    b5 = tl.where(d_pos, _boundary_f64(3.5, sval, g, True), inf)
    b6 = tl.where(d_pos, _boundary_f64(5.0, sval, g, False), inf)
    codes = _e2m1_count(x, b0, b1, b2, b3, b4, b5, b6)
    return tl.where((x != x) | ((tl.abs(x) == inf) & (d_pos == 0)[:, None]), 0, codes)


@triton.jit
def _line_store(data_ptr, lines, packed, n_blocks, IS_NV: tl.constexpr, MASKED: tl.constexpr):
    """packed: uint8 [ROWS, 16], the lines' codes -> data[lines * 16 + (0..15)] (one 16-byte store
    per thread; MASKED: bytes of blocks at or past n_blocks are not written)."""
    b = tl.arange(0, 16)
    p = data_ptr + lines[:, None] * 16 + b[None, :]
    if MASKED:
        if IS_NV:
            tl.store(p, packed, mask=lines[:, None] * 2 + b[None, :] // 8 < n_blocks)
        else:
            tl.store(p, packed, mask=(lines < n_blocks)[:, None])
    else:
        tl.store(p, packed)


@triton.jit
def _fp4_lines_tile(x0, x1, x2, x3, lines, x_ptr, data_ptr, scale_ptr, gs_ptr, n_chunks, n_blocks, blocks_per_gs,
                    IS_NV: tl.constexpr, GS_PER_MATRIX: tl.constexpr, GS_PAIRED: tl.constexpr, MASKED: tl.constexpr,
                    DIAG: tl.constexpr):
    """Quantize and store one tile: x0..x3 the chunks of ROWS lines (x's dtype). The fast path's
    codes are stored first; a tile with a rare block (mxfp4: an inf or NaN; nvfp4: see the blocks
    kernel) then reloads its lines and overwrites them with the exact path's codes, so no element
    stays live across the tile-wide test (registers set the occupancy)."""
    x0 = x0.to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x3 = x3.to(tl.float32)
    if DIAG == 1:            # memory only: codes from the bits, the max code as the scale byte
        c0 = (x0.to(tl.int32, bitcast=True) >> 16) & 0xF
        c1 = (x1.to(tl.int32, bitcast=True) >> 16) & 0xF
        c2 = (x2.to(tl.int32, bitcast=True) >> 16) & 0xF
        c3 = (x3.to(tl.int32, bitcast=True) >> 16) & 0xF
        _line_store(data_ptr, lines, _line_bytes(c0, c1, c2, c3), n_blocks, IS_NV, MASKED)
        _line_scales(scale_ptr, lines, tl.max(tl.maximum(c0, c1), 1).to(tl.uint8),
                     tl.max(tl.maximum(c2, c3), 1).to(tl.uint8), n_blocks, IS_NV, MASKED)
    elif IS_NV:              # two blocks per line: a = chunks 0, 1; b = chunks 2, 3
        if GS_PER_MATRIX:
            blk = lines * 2
            ga = tl.load(gs_ptr + (blk // blocks_per_gs).to(tl.int32), mask=blk < n_blocks, other=1.0)
            if GS_PAIRED:    # blocks_per_gs even: a line's two blocks share their matrix
                gb = ga
            else:
                gb = tl.load(gs_ptr + ((blk + 1) // blocks_per_gs).to(tl.int32), mask=blk + 1 < n_blocks, other=1.0)
        else:
            ga = tl.load(gs_ptr)
            gb = ga
        abits_a = _abs_max2(x0, x1)
        abits_b = _abs_max2(x2, x3)
        sa, sval_a = _nv_scale(abits_a, ga)
        sb, sval_b = _nv_scale(abits_b, gb)
        _line_scales(scale_ptr, lines, sa, sb, n_blocks, IS_NV, MASKED)
        fast_a, a0, a1, a2, a3, a4, a5, a6 = _nvfp4_thresholds(sval_a, ga, abits_a)
        fast_b, b0, b1, b2, b3, b4, b5, b6 = _nvfp4_thresholds(sval_b, gb, abits_b)
        packed = _line_bytes(_e2m1_search(x0, a0, a1, a2, a3, a4, a5, a6), _e2m1_search(x1, a0, a1, a2, a3, a4, a5, a6),
                             _e2m1_search(x2, b0, b1, b2, b3, b4, b5, b6), _e2m1_search(x3, b0, b1, b2, b3, b4, b5, b6))
        _line_store(data_ptr, lines, packed, n_blocks, IS_NV, MASKED)
        if tl.min((fast_a & fast_b).to(tl.int32)) == 0:      # rare tiles: float64 thresholds (see the blocks kernel)
            y0, y1, y2, y3 = _line_chunks(x_ptr, lines, n_chunks, MASKED)
            packed = _line_bytes(_nv_line_codes_slow(y0.to(tl.float32), sval_a, ga),
                                 _nv_line_codes_slow(y1.to(tl.float32), sval_a, ga),
                                 _nv_line_codes_slow(y2.to(tl.float32), sval_b, gb),
                                 _nv_line_codes_slow(y3.to(tl.float32), sval_b, gb))
            _line_store(data_ptr, lines, packed, n_blocks, IS_NV, MASKED)
    else:                    # mxfp4: one block per line
        abits = tl.maximum(_abs_max2(x0, x1), _abs_max2(x2, x3))
        byte = (abits >> 23) - 2 + ((abits & 0x7FFFFF) > 0x400000).to(tl.int32)
        byte = tl.minimum(tl.maximum(byte, 0), 254)
        byte = tl.where(abits > 0x7F800000, 255, byte)
        inv = (tl.maximum(254 - byte, 1) << 23).to(tl.float32, bitcast=True)
        _line_scales(scale_ptr, lines, byte.to(tl.uint8), byte.to(tl.uint8), n_blocks, IS_NV, MASKED)
        packed = _line_bytes(_mx_line_codes(x0, inv, False), _mx_line_codes(x1, inv, False),
                             _mx_line_codes(x2, inv, False), _mx_line_codes(x3, inv, False))
        _line_store(data_ptr, lines, packed, n_blocks, IS_NV, MASKED)
        if tl.max(abits) >= 0x7F800000:     # an inf (saturates) or a NaN (code +0) in the tile
            y0, y1, y2, y3 = _line_chunks(x_ptr, lines, n_chunks, MASKED)
            packed = _line_bytes(_mx_line_codes(y0.to(tl.float32), inv, True), _mx_line_codes(y1.to(tl.float32), inv, True),
                                 _mx_line_codes(y2.to(tl.float32), inv, True), _mx_line_codes(y3.to(tl.float32), inv, True))
            _line_store(data_ptr, lines, packed, n_blocks, IS_NV, MASKED)


@triton.jit
def _line_scales(scale_ptr, lines, sa, sb, n_blocks, IS_NV: tl.constexpr, MASKED: tl.constexpr):
    """The lines' scale bytes: nvfp4 sa, sb (the line's two blocks) in one 2-byte store; mxfp4 sa."""
    if IS_NV:
        k = tl.arange(0, 2)
        sp = scale_ptr + lines[:, None] * 2 + k[None, :]
        if MASKED:
            tl.store(sp, tl.join(sa, sb), mask=lines[:, None] * 2 + k[None, :] < n_blocks)
        else:
            tl.store(sp, tl.join(sa, sb))
    else:
        if MASKED:
            tl.store(scale_ptr + lines, sa, mask=lines < n_blocks)
        else:
            tl.store(scale_ptr + lines, sa)


@triton.jit
def _fp4_quant_lines_kernel(x_ptr, data_ptr, scale_ptr, gs_ptr, line0, n_chunks, n_blocks, blocks_per_gs,
                            IS_NV: tl.constexpr, GS_PER_MATRIX: tl.constexpr, GS_PAIRED: tl.constexpr,
                            ROWS: tl.constexpr, TILES: tl.constexpr, MASKED: tl.constexpr, REVERSE: tl.constexpr,
                            OFF64: tl.constexpr, DIAG: tl.constexpr = 0):
    """FP4 quantize, one line of 32 elements per thread (see above). Program p quantizes lines
    line0 + (p * TILES + t) * ROWS + (0..ROWS-1), t < TILES; n_chunks: x's elements / 8, n_blocks:
    its fp4 blocks. MASKED: the launch's last lines are partial (else every line is whole);
    OFF64: element offsets need int64. GS_PAIRED (per-matrix global scales): blocks_per_gs is even.
    DIAG 1 (the tuning probe's diagnostic, never a result): the same loads and stores without the
    arithmetic."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    if OFF64:
        start = line0 + pid.to(tl.int64) * (ROWS * TILES)
    else:
        start = line0 + pid * (ROWS * TILES)
    lines = start + tl.arange(0, ROWS)
    x0, x1, x2, x3 = _line_chunks(x_ptr, lines, n_chunks, MASKED)
    for t in range(TILES):
        if TILES > 1:        # the next tile's loads go out before this tile's arithmetic
            nxt = lines + ROWS
            y0, y1, y2, y3 = _line_chunks(x_ptr, nxt, tl.where(t + 1 < TILES, n_chunks, 0), True)
        _fp4_lines_tile(x0, x1, x2, x3, lines, x_ptr, data_ptr, scale_ptr, gs_ptr, n_chunks, n_blocks, blocks_per_gs,
                        IS_NV, GS_PER_MATRIX, GS_PAIRED, MASKED, DIAG)
        if TILES > 1:
            x0, x1, x2, x3 = y0, y1, y2, y3
            lines = nxt


@triton.jit
def _fp4_values(packed, sbyte, gs_ptr, gs_idx, ok, IS_NV: tl.constexpr, GS_PER_MATRIX: tl.constexpr):
    """Packed E2M1 bytes [R, C] and their blocks' scale bytes [R] -> fp32 (low nibbles, high
    nibbles), each [R, C]: E2M1 x E8M0 scale, or (NVFP4) x E4M3 scale x the global scale (one, or
    per matrix at gs_idx [R] where ok)."""
    packed = packed.to(tl.int32)
    lo = e2m1_value(packed & 0xF)
    hi = e2m1_value(packed >> 4)
    if IS_NV:
        s = e4m3_value(sbyte)[:, None]
        if GS_PER_MATRIX:
            g = tl.load(gs_ptr + gs_idx, mask=ok, other=1.0)[:, None]
        else:
            g = tl.load(gs_ptr)
        return (lo * s) * g, (hi * s) * g
    else:
        s = e8m0_value(sbyte)[:, None]
        return lo * s, hi * s


@triton.jit
def _fp4_dequant_kernel(data_ptr, scale_ptr, gs_ptr, out_ptr, n_blocks, blocks_per_gs,
                        IS_NV: tl.constexpr, GS_PER_MATRIX: tl.constexpr, BS: tl.constexpr,
                        ROWS: tl.constexpr, EVEN: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    pcols = tl.arange(0, BS // 2)
    cols = tl.arange(0, BS)
    if EVEN:
        packed = tl.load(data_ptr + rows[:, None] * (BS // 2) + pcols[None, :])
        sbyte = tl.load(scale_ptr + rows)
    else:
        packed = tl.load(data_ptr + rows[:, None] * (BS // 2) + pcols[None, :], mask=(rows < n_blocks)[:, None], other=0)
        sbyte = tl.load(scale_ptr + rows, mask=rows < n_blocks, other=0)
    lo, hi = _fp4_values(packed, sbyte, gs_ptr, rows.to(tl.int32) // blocks_per_gs, rows < n_blocks, IS_NV,
                         GS_PER_MATRIX)
    vals = tl.reshape(tl.join(lo, hi), (ROWS, BS)).to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + rows[:, None] * BS + cols[None, :], vals)
    else:
        tl.store(out_ptr + rows[:, None] * BS + cols[None, :], vals, mask=(rows < n_blocks)[:, None])


@triton.jit
def _fp4_dequant_chunks_kernel(data_ptr, scale_ptr, gs_ptr, out_ptr, n_chunks, blocks_per_gs,
                               IS_NV: tl.constexpr, GS_PER_MATRIX: tl.constexpr, BS: tl.constexpr,
                               ROWS: tl.constexpr, EVEN: tl.constexpr, OFF64: tl.constexpr):
    """FP4 dequantize, opt-in (VARIANTS["fp4_dequant"] = "chunks"): a thread owns chunks of 8
    consecutive outputs: it loads their 4 packed bytes (lanes contiguous: one dense 128-byte
    load per warp) and their block's scale byte, and stores the 8 outputs with one 16-byte store
    (dense 512 bytes per warp). The blocks kernel gives a thread a whole block (one 16-byte load)
    and moves the outputs through shared memory (4 rounds, 7 barriers) for the same stores.
    Program p: chunks p * ROWS + (0..ROWS-1); n_chunks = elements / 8; EVEN: n_chunks % ROWS == 0."""
    pid = tl.program_id(0)
    if OFF64:
        ch = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    else:
        ch = pid * ROWS + tl.arange(0, ROWS)
    b = tl.arange(0, 4)
    blk = ch // (BS // 8)
    if EVEN:
        packed = tl.load(data_ptr + ch[:, None] * 4 + b[None, :])
        sbyte = tl.load(scale_ptr + blk)
    else:
        packed = tl.load(data_ptr + ch[:, None] * 4 + b[None, :], mask=(ch < n_chunks)[:, None], other=0)
        sbyte = tl.load(scale_ptr + blk, mask=ch < n_chunks, other=0)
    lo, hi = _fp4_values(packed, sbyte, gs_ptr, (blk // blocks_per_gs).to(tl.int32), ch < n_chunks, IS_NV,
                         GS_PER_MATRIX)
    vals = tl.reshape(tl.join(lo, hi), (ROWS, 8)).to(out_ptr.dtype.element_ty)
    c = tl.arange(0, 8)
    if EVEN:
        tl.store(out_ptr + ch[:, None] * 8 + c[None, :], vals)
    else:
        tl.store(out_ptr + ch[:, None] * 8 + c[None, :], vals, mask=(ch < n_chunks)[:, None])


@triton.jit
def _amax_scale_kernel(x_ptr, acc_ptr, gs_ptr, per_mat, chunks, mats, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """The nvfp4 computed global scale in one launch: program (c, mat) folds max |x| (fp32 bits;
    non-negative floats order like their bits, a NaN beats everything) over chunk c of BLOCK
    elements of matrix mat into acc[mat] (atomic max), then counts itself in acc[mats + mat];
    the matrix's last program reads the max back and writes gs[mat] = amax / 2688 (IEEE
    division, as the reference). acc: int32 [2 * mats], zeroed. One read of x; the partial
    tensor, the torch max over it and the division kernel of the two-stage version are gone."""
    mat = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        x = tl.load(x_ptr + mat * per_mat + offs)
    else:
        x = tl.load(x_ptr + mat * per_mat + offs, mask=offs < per_mat, other=0.0)
    tl.atomic_max(acc_ptr + mat, _abs_max_bits(x.to(tl.float32), 0))          # acq_rel, gpu scope
    done = tl.atomic_add(acc_ptr + mats + mat, 1)
    if done == chunks - 1:
        amax = tl.atomic_max(acc_ptr + mat, 0)                                   # an ordered read
        tl.store(gs_ptr + mat, tl.div_rn(amax.to(tl.float32, bitcast=True), 2688.0))


# ------------------------------------------------------------------ FP8 kernels


@triton.jit
def _fp8_group_quant_kernel(x_ptr, data_ptr, scale_ptr, n_rows, k, n_groups, amax_floor,
                            UE8M0: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr, HW: tl.constexpr):
    """One program: ROWS rows x one group of GROUP columns (fp8_group; fp8_token with GROUP >= K)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    cols = grp * GROUP + tl.arange(0, GROUP)
    mask = (rows < n_rows)[:, None] & (cols < k)[None, :]
    offs = rows[:, None] * k + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    abits = _abs_max_bits(x, 1)
    scale = fp8_scale(abits.to(tl.float32, bitcast=True), amax_floor, UE8M0)
    slow = (tl.max(abits) >= 0x7F800000) | (tl.min(_fast_div_ok(scale).to(tl.int32)) == 0)
    byte = _fp8_tile(x, scale[:, None], slow, UE8M0, HW)
    tl.store(data_ptr + offs, byte, mask=mask)
    tl.store(scale_ptr + rows * n_groups + grp, scale, mask=rows < n_rows)


@triton.jit
def _fp8_row_chunk(x_ptr, base, c, k, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    cols = c * CHUNK + tl.arange(0, CHUNK)
    if EVEN:
        return tl.load(x_ptr + base + cols).to(tl.float32)
    return tl.load(x_ptr + base + cols, mask=cols < k, other=0.0).to(tl.float32)


@triton.jit
def _fp8_row_store(data_ptr, base, c, k, byte, CHUNK: tl.constexpr, EVEN: tl.constexpr):
    cols = c * CHUNK + tl.arange(0, CHUNK)
    if EVEN:
        tl.store(data_ptr + base + cols, byte)
    else:
        tl.store(data_ptr + base + cols, byte, mask=cols < k)


@triton.jit
def _fp8_row_quant_kernel(x_ptr, data_ptr, scale_ptr, n_rows, k, amax_floor,
                          UE8M0: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                          HW: tl.constexpr, EVEN: tl.constexpr = False, UNROLL: tl.constexpr = False):
    """fp8_token for long rows: one program per row, two passes over CHUNK columns.
    (NUM_CHUNKS is constexpr: the interpreter cannot loop to a runtime bound.)
    EVEN: K % CHUNK == 0 (no masks). UNROLL: both passes unrolled, so the first pass has all of
    the row's loads in flight at once and the second pass (a reread that L1 / L2 serves) issues its
    loads ahead of the arithmetic (the VARIANTS["fp8_token"] = "rows" launch for K <= 8192)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * k
    abits = tl.zeros((CHUNK,), dtype=tl.int32)
    if UNROLL:
        for c in tl.static_range(NUM_CHUNKS):
            x = _fp8_row_chunk(x_ptr, base, c, k, CHUNK, EVEN)
            abits = tl.maximum(abits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    else:
        for c in range(NUM_CHUNKS):
            x = _fp8_row_chunk(x_ptr, base, c, k, CHUNK, EVEN)
            abits = tl.maximum(abits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    a = tl.max(abits, axis=0)
    scale = fp8_scale(a.to(tl.float32, bitcast=True), amax_floor, UE8M0)
    slow = (a >= 0x7F800000) | (_fast_div_ok(scale) == 0)
    if UNROLL:
        for c in tl.static_range(NUM_CHUNKS):
            x = _fp8_row_chunk(x_ptr, base, c, k, CHUNK, EVEN)
            _fp8_row_store(data_ptr, base, c, k, _fp8_tile(x, scale, slow, UE8M0, HW), CHUNK, EVEN)
    else:
        for c in range(NUM_CHUNKS):
            x = _fp8_row_chunk(x_ptr, base, c, k, CHUNK, EVEN)
            _fp8_row_store(data_ptr, base, c, k, _fp8_tile(x, scale, slow, UE8M0, HW), CHUNK, EVEN)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _fp8_block_mask(tr, r0, cmask, n, SUB: tl.constexpr):
    rows = tr * 128 + r0 + tl.arange(0, SUB)
    return (rows < n)[:, None] & cmask[None, :]


@triton.jit
def _fp8_block_rows(x_ptr, base, tr, r0, cols, cmask, n, k, SUB: tl.constexpr, EVEN: tl.constexpr):
    """(offsets, fp32 values) of rows tr * 128 + r0 + (0..SUB-1) of a 128-column tile."""
    rows = tr * 128 + r0 + tl.arange(0, SUB)
    offs = base + rows[:, None] * k + cols[None, :]
    if EVEN:
        return offs, tl.load(x_ptr + offs).to(tl.float32)
    return offs, tl.load(x_ptr + offs, mask=_fp8_block_mask(tr, r0, cmask, n, SUB), other=0.0).to(tl.float32)


@triton.jit
def _fp8_block_quant_kernel(x_ptr, data_ptr, scale_ptr, n, k, nb, kb, amax_floor,
                            UE8M0: tl.constexpr, SUB: tl.constexpr, HW: tl.constexpr,
                            EVEN: tl.constexpr = False, UNROLL: tl.constexpr = False):
    """fp8_block: one program per 128x128 tile of one matrix, two passes of SUB rows.
    Opt-in (VARIANTS["fp8_block"] = "unrolled"): UNROLL unrolls both passes (the first pass's
    loads all in flight at once, the second pass's reread ahead of its arithmetic), EVEN (N and K
    multiples of 128) drops the masks."""
    mat = tl.program_id(0).to(tl.int64)
    tr = tl.program_id(1)
    tc = tl.program_id(2)
    cols = tc * 128 + tl.arange(0, 128)
    cmask = cols < k
    base = mat * n * k
    abits = tl.zeros((SUB, 128), dtype=tl.int32)
    if UNROLL:
        for r0 in tl.static_range(0, 128, SUB):
            _, x = _fp8_block_rows(x_ptr, base, tr, r0, cols, cmask, n, k, SUB, EVEN)
            abits = tl.maximum(abits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    else:
        for r0 in range(0, 128, SUB):
            rows = tr * 128 + r0 + tl.arange(0, SUB)
            mask = (rows < n)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + base + rows[:, None] * k + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            abits = tl.maximum(abits, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    a = tl.max(tl.max(abits, axis=1), axis=0)
    scale = fp8_scale(a.to(tl.float32, bitcast=True), amax_floor, UE8M0)
    slow = (a >= 0x7F800000) | (_fast_div_ok(scale) == 0)
    if UNROLL:
        for r0 in tl.static_range(0, 128, SUB):
            offs, x = _fp8_block_rows(x_ptr, base, tr, r0, cols, cmask, n, k, SUB, EVEN)
            if EVEN:
                tl.store(data_ptr + offs, _fp8_tile(x, scale, slow, UE8M0, HW))
            else:
                tl.store(data_ptr + offs, _fp8_tile(x, scale, slow, UE8M0, HW),
                         mask=_fp8_block_mask(tr, r0, cmask, n, SUB))
    else:
        for r0 in range(0, 128, SUB):
            rows = tr * 128 + r0 + tl.arange(0, SUB)
            mask = (rows < n)[:, None] & cmask[None, :]
            offs = base + rows[:, None] * k + cols[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(data_ptr + offs, _fp8_tile(x, scale, slow, UE8M0, HW), mask=mask)
    tl.store(scale_ptr + mat * nb * kb + tr * kb + tc, scale)


@triton.jit
def _fp8_dequant_kernel(data_ptr, scale_ptr, out_ptr, n_rows, k, rows_per_mat, s_mat, s_row, s_col,
                        ROW_BLOCK: tl.constexpr, ROWS: tl.constexpr, FIX_NAN: tl.constexpr):
    """out[r, c] = e4m3(data[r, c]) * scale[(r // N) * s_mat + (r % N // RB) * s_row + (c // 128) * s_col].
    One program: ROWS rows x the 128 columns of one scale group, so the scale is one load per row.
    data is read as float8e4nv (the hardware conversion is exact); FIX_NAN (interpreter only,
    whose conversion misses E4M3 NaN) re-marks 0x7F/0xFF as NaN."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    cols = grp * 128 + tl.arange(0, 128)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < k)[None, :]
    offs = rows[:, None] * k + cols[None, :]
    d = tl.load(data_ptr + offs, mask=mask, other=0.0)
    v = d.to(tl.float32)
    if FIX_NAN:
        v = tl.where((d.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
    if ROW_BLOCK == 1:                                                   # fp8_token / fp8_group
        sidx = rows * s_row + grp * s_col
    else:                                                                # fp8_block: [mats, N, K]
        r32 = rows.to(tl.int32)
        mat = r32 // rows_per_mat
        sidx = mat.to(tl.int64) * s_mat + ((r32 - mat * rows_per_mat) // ROW_BLOCK) * s_row + grp * s_col
    s = tl.load(scale_ptr + sidx, mask=rmask, other=1.0)
    tl.store(out_ptr + offs, (v * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_dequant_chunks_kernel(data_ptr, scale_ptr, out_ptr, n_rows, k, rows_per_mat, s_mat, s_row, s_col,
                               ROW_BLOCK: tl.constexpr, ROWS: tl.constexpr, FIX_NAN: tl.constexpr):
    """`_fp8_dequant_kernel` over a [ROWS, 16, 8] view of its tile (opt-in: VARIANTS["fp8_dequant"]
    = "chunks"): a thread holds 8 consecutive bytes (one 8-byte load, lanes contiguous) and
    stores their 8 outputs with one 16-byte store, where the [ROWS, 128] tile loads 16 bytes per
    thread and moves the outputs through shared memory to store 16 bytes per thread."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    cols = grp * 128 + tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :]          # [16, 8]
    rmask = rows < n_rows
    mask = rmask[:, None, None] & (cols < k)[None, :, :]
    offs = rows[:, None, None] * k + cols[None, :, :]
    d = tl.load(data_ptr + offs, mask=mask, other=0.0)
    v = d.to(tl.float32)
    if FIX_NAN:
        v = tl.where((d.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
    if ROW_BLOCK == 1:
        sidx = rows * s_row + grp * s_col
    else:
        r32 = rows.to(tl.int32)
        mat = r32 // rows_per_mat
        sidx = mat.to(tl.int64) * s_mat + ((r32 - mat * rows_per_mat) // ROW_BLOCK) * s_row + grp * s_col
    s = tl.load(scale_ptr + sidx, mask=rmask, other=1.0)
    tl.store(out_ptr + offs, (v * s[:, None, None]).to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------ host wrappers

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _computed_global_scale(x: torch.Tensor, per_matrix: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """amax(|x|) / 2688 (0-d, or per matrix of contiguous [..., N, K]) in fp32, NaN if x has one.
    out: a contiguous fp32 tensor of one element per matrix to write it to."""
    shape = x.shape[:-2] if per_matrix else ()
    if x.numel() == 0:
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    per_mat = x.shape[-2] * x.shape[-1] if per_matrix else x.numel()
    mats = x.numel() // per_mat
    block, warps = CONFIG["fp4_amax"]
    chunks = triton.cdiv(per_mat, block)
    acc = torch.zeros(2 * mats, dtype=torch.int32, device=x.device)       # [max bits | programs done]
    gs = torch.empty(mats, dtype=torch.float32, device=x.device) if out is None else out
    _amax_scale_kernel[(chunks, mats)](x, acc, gs, per_mat, chunks, mats, BLOCK=block, EVEN=per_mat % block == 0,
                                       num_warps=warps)
    return gs.reshape(shape)


def _nvfp4_global(x: torch.Tensor, global_scale) -> torch.Tensor:
    from megapar.parallel.quant.reference import _nvfp4_gs

    if global_scale is None or (isinstance(global_scale, str) and global_scale in ("tensor", "matrix")):
        per_matrix = global_scale == "matrix"
        if per_matrix and x.dim() < 2:
            raise ValueError(f"global_scale='matrix' needs x with >= 2 dims, got {tuple(x.shape)}")
        return _computed_global_scale(x, per_matrix)
    return _nvfp4_gs(x, global_scale)


def quantize(x: torch.Tensor, fmt: str, **opts) -> QuantizedTensor:
    """Same contract as `parallel.quant.quantize` (opts per format)."""
    check_quantizable(x, fmt)
    x = x.contiguous()
    if fmt == "mxfp4":
        return _quantize_mxfp4(x, **opts)
    if fmt == "nvfp4":
        return _quantize_nvfp4(x, **opts)
    return _quantize_fp8(x, fmt, **opts)


# Each FP4 format takes its own option only, as the reference's quantize_mxfp4 / quantize_nvfp4 do
# (the other one is a TypeError there; a shared signature ignored it here).
def _quantize_mxfp4(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    return _quantize_fp4(x, "mxfp4", 32, scale_rule=scale_rule)


def _quantize_nvfp4(x: torch.Tensor, *, global_scale=None) -> QuantizedTensor:
    return _quantize_fp4(x, "nvfp4", 16, global_scale=global_scale)


def _fp4_launch_args(n_blocks: int, bs: int, gs: torch.Tensor | None, shape: torch.Size, cfg: str) -> tuple:
    """(grid, blocks_per_gs, meta) for the fp4 kernels: ROWS blocks of bs per program."""
    rows, warps = CONFIG[cfg]
    rows = rows * 32 // bs
    per_matrix = gs is not None and gs.dim() > 0
    blocks_per_gs = shape[-2] * (shape[-1] // bs) if per_matrix else max(n_blocks, 1)
    meta = dict(IS_NV=gs is not None, GS_PER_MATRIX=per_matrix, BS=bs, ROWS=rows,
                EVEN=n_blocks % rows == 0, num_warps=warps)
    return (triton.cdiv(n_blocks, rows),), blocks_per_gs, meta


def _fp4_lines_launch(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                      n_blocks: int, bs: int, fmt: str, reverse: bool = False) -> None:
    """`_fp4_quant_lines_kernel` over x: the programs of whole lines unmasked, the rest (a partial
    last tile, an odd nvfp4 block) in one masked program."""
    rows, warps = CONFIG[f"{fmt}_lines"]
    tiles = LOOPS[f"{fmt}_lines"]
    numel = n_blocks * bs
    per = rows * tiles
    bulk = numel // 32 // per                     # programs with whole lines only
    per_matrix = gs is not None and gs.dim() > 0
    blocks_per_gs = x.shape[-2] * (x.shape[-1] // bs) if per_matrix else max(n_blocks, 1)
    meta = dict(IS_NV=gs is not None, GS_PER_MATRIX=per_matrix, GS_PAIRED=per_matrix and blocks_per_gs % 2 == 0,
                ROWS=rows, TILES=tiles, REVERSE=reverse,
                OFF64=numel + 64 >= 2**31, num_warps=warps)
    if FP4_QUANT_DIAG:          # the probe's memory-only variant (its output is not a quantization)
        meta["DIAG"] = FP4_QUANT_DIAG
    args = (x, data, scale, scale if gs is None else gs)
    if bulk:
        _fp4_quant_lines_kernel[(bulk,)](*args, 0, numel // 8, n_blocks, blocks_per_gs, MASKED=False, **meta)
    if triton.cdiv(numel, 32) > bulk * per:
        _fp4_quant_lines_kernel[(1,)](*args, bulk * per, numel // 8, n_blocks, blocks_per_gs, MASKED=True, **meta)


def _quantize_fp4(x: torch.Tensor, fmt: str, bs: int, *, scale_rule: str = "ceil",
                  global_scale=None) -> QuantizedTensor:
    if fmt == "mxfp4" and scale_rule != "ceil":
        if scale_rule == "floor":                                   # checkpoint emulation: torch path
            from megapar.parallel.quant.reference import quantize_mxfp4
            return quantize_mxfp4(x, scale_rule="floor")
        raise ValueError(f"unknown mxfp4 scale_rule {scale_rule!r}; valid: 'ceil', 'floor'")
    *lead, k = x.shape
    n_blocks = x.numel() // bs
    data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*lead, k // bs), dtype=torch.uint8, device=x.device)
    if (fmt == "nvfp4" and NVFP4_GROUP_BYTES and isinstance(global_scale, str) and global_scale == "matrix"
            and x.dim() >= 3 and n_blocks):
        gs = _quantize_nvfp4_grouped(x, data, scale)
        return QuantizedTensor(data, scale, fmt, x.shape, gs)
    gs = _nvfp4_global(x, global_scale).to(torch.float32).contiguous() if fmt == "nvfp4" else None
    if n_blocks:
        computed = global_scale is None or isinstance(global_scale, str)
        _fp4_quant_launch(x, data, scale, gs, n_blocks, bs, fmt, reverse=fmt == "nvfp4" and computed and NVFP4_REVERSE)
    return QuantizedTensor(data, scale, fmt, x.shape, gs)


def _fp4_quant_launch(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None,
                      n_blocks: int, bs: int, fmt: str, reverse: bool) -> None:
    """The FP4 quantize kernel VARIANTS picks, over all of x (n_blocks > 0)."""
    if VARIANTS[f"{fmt}_quant"] == "lines":
        _fp4_lines_launch(x, data, scale, gs, n_blocks, bs, fmt, reverse=reverse)
        return
    grid, blocks_per_gs, meta = _fp4_launch_args(n_blocks, bs, gs, x.shape, "fp4_quant")
    if FP4_QUANT_DIAG:      # the probe's memory-only variant (its output is not a quantization)
        meta = dict(meta, DIAG=FP4_QUANT_DIAG)
    if reverse:
        meta = dict(meta, REVERSE=True)
    _fp4_quant_kernel[grid](x, data, scale, scale if gs is None else gs, n_blocks, blocks_per_gs, **meta)


def _quantize_nvfp4_grouped(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """nvfp4 with per-matrix computed global scales, NVFP4_GROUP_BYTES at a time: for each group
    of whole matrices the amax pass, then its quantize walking backwards (x's second read from
    L2 where the group fits). Returns the global scales [...] (x.shape[:-2])."""
    n, k = x.shape[-2:]
    mats = x.numel() // (n * k)
    per = max(1, NVFP4_GROUP_BYTES // (n * k * x.element_size()))
    xm, dm, sm = x.reshape(mats, n, k), data.view(mats, n, k // 2), scale.view(mats, n, k // 16)
    gs = torch.empty(mats, dtype=torch.float32, device=x.device)
    for m0 in range(0, mats, per):
        m1 = min(mats, m0 + per)
        _computed_global_scale(xm[m0:m1], True, out=gs[m0:m1])
        _fp4_quant_launch(xm[m0:m1], dm[m0:m1], sm[m0:m1], gs[m0:m1], (m1 - m0) * n * k // 16, 16, "nvfp4", reverse=True)
    return gs.reshape(x.shape[:-2])


def _quantize_fp8(x: torch.Tensor, fmt: str, *, ue8m0: bool = False,
                  amax_floor: float = DEFAULT_AMAX_FLOOR) -> QuantizedTensor:
    _check_floor(amax_floor)
    k = x.shape[-1]
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    d8 = data.view(torch.uint8)
    if fmt == "fp8_block":
        *lead, n, _ = x.shape
        mats = x.numel() // max(n * k, 1)
        nb, kb = triton.cdiv(n, 128), triton.cdiv(k, 128)
        scale = torch.empty((*lead, nb, kb), dtype=torch.float32, device=x.device)
        if x.numel():
            sub, warps = CONFIG["fp8_block"]
            extra = {}
            if VARIANTS["fp8_block"] == "unrolled":
                sub, warps = CONFIG["fp8_block_unrolled"]
                extra = dict(UNROLL=True, EVEN=n % 128 == 0 and k % 128 == 0)
            _fp8_block_quant_kernel[(mats, nb, kb)](x, d8, scale, n, k, nb, kb, amax_floor,
                                                    UE8M0=ue8m0, SUB=sub, HW=_hw_cast(), num_warps=warps, **extra)
        return QuantizedTensor(data, scale, fmt, x.shape)
    n_rows = x.numel() // k if k else 0
    rows, warps = CONFIG["fp8_group"]
    if fmt == "fp8_group":
        n_groups = triton.cdiv(k, 128)
        scale = torch.empty((*x.shape[:-1], n_groups), dtype=torch.float32, device=x.device)
        if x.numel():
            _fp8_group_quant_kernel[(triton.cdiv(n_rows, rows), n_groups)](
                x, d8, scale, n_rows, k, n_groups, amax_floor, UE8M0=ue8m0, ROWS=rows, GROUP=128, HW=_hw_cast(),
                num_warps=warps)
        return QuantizedTensor(data, scale, fmt, x.shape)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if x.numel():
        width = triton.next_power_of_2(k)
        elems, warps = CONFIG["fp8_token"]
        if width <= 8192 and VARIANTS["fp8_token"] == "rows":     # opt-in: two unrolled passes over chunks
            chunk, warps = CONFIG["fp8_token_rows"]
            _fp8_row_quant_kernel[(n_rows,)](x, d8, scale, n_rows, k, amax_floor, UE8M0=ue8m0, CHUNK=chunk,
                                             NUM_CHUNKS=triton.cdiv(k, chunk), HW=_hw_cast(), EVEN=k % chunk == 0,
                                             UNROLL=True, num_warps=warps)
        elif width <= 8192:                                          # whole rows in one tile
            r = max(1, min(16, elems // width))
            _fp8_group_quant_kernel[(triton.cdiv(n_rows, r), 1)](
                x, d8, scale, n_rows, k, 1, amax_floor, UE8M0=ue8m0, ROWS=r, GROUP=width, HW=_hw_cast(),
                num_warps=warps if width >= 4096 else 4)
        else:
            _fp8_row_quant_kernel[(n_rows,)](x, d8, scale, n_rows, k, amax_floor, UE8M0=ue8m0,
                                             CHUNK=4096, NUM_CHUNKS=triton.cdiv(k, 4096), HW=_hw_cast(), num_warps=8)
    return QuantizedTensor(data, scale, fmt, x.shape)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as `parallel.quant.dequantize`."""
    check_storage(q)
    info = get_format(q.fmt)
    out_dtype = dtype if dtype in _OUT_DTYPES else torch.float32
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    data = q.data.contiguous()
    scale = q.scale.contiguous()
    if q.fmt in FP4_FORMATS:
        bs = info.block[1]
        n_blocks = out.numel() // bs
        gs = None
        if q.fmt == "nvfp4":
            gs = q.global_scale.to(device=q.device, dtype=torch.float32).contiguous()
        if n_blocks and VARIANTS["fp4_dequant"] == "chunks":
            rows, warps = CONFIG["fp4_dequant_chunks"]
            n_chunks = out.numel() // 8
            per_matrix = gs is not None and gs.dim() > 0
            blocks_per_gs = q.shape[-2] * (q.shape[-1] // bs) if per_matrix else max(n_blocks, 1)
            _fp4_dequant_chunks_kernel[(triton.cdiv(n_chunks, rows),)](
                data, scale, scale if gs is None else gs, out, n_chunks, blocks_per_gs, IS_NV=gs is not None,
                GS_PER_MATRIX=per_matrix, BS=bs, ROWS=rows, EVEN=n_chunks % rows == 0,
                OFF64=out.numel() + 64 >= 2**31, num_warps=warps)
        elif n_blocks:
            grid, blocks_per_gs, meta = _fp4_launch_args(n_blocks, bs, gs, q.shape, "fp4_dequant")
            _fp4_dequant_kernel[grid](data, scale, scale if gs is None else gs, out, n_blocks, blocks_per_gs, **meta)
    else:
        k = q.shape[-1]
        n_rows = out.numel() // k if k else 0
        if q.fmt == "fp8_token":
            args = (n_rows, 0, 1, 0, 1)                     # rows_per_mat, s_mat, s_row, s_col, ROW_BLOCK
        elif q.fmt == "fp8_group":
            args = (n_rows, 0, scale.shape[-1], 1, 1)
        else:
            n = q.shape[-2]
            nb, kb = scale.shape[-2:]
            args = (n, nb * kb, kb, 1, 128)
        rows, warps = CONFIG["fp8_dequant"]
        kernel = _fp8_dequant_kernel
        if VARIANTS["fp8_dequant"] == "chunks":
            rows, warps = CONFIG["fp8_dequant_chunks"]
            kernel = _fp8_dequant_chunks_kernel
        if out.numel():
            kernel[(triton.cdiv(n_rows, rows), triton.cdiv(k, 128))](
                data, scale, out, n_rows, k, *args[:4], ROW_BLOCK=args[4], ROWS=rows,
                FIX_NAN=impl.interpreting(), num_warps=warps)
    return out if out_dtype == dtype else out.to(dtype)


_load_env_tuning()
