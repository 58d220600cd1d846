"""Triton quantize/dequantize kernels, bit-identical to `moe.quant.reference`.

Imported only on CUDA (or under TRITON_INTERPRET=1 in tests). Each kernel repeats the
reference's fp32 steps exactly: divisions are `tl.div_rn` (IEEE; plain `/` is approximate on
NVIDIA), power-of-two scales are built from bits, and E4M3 / E2M1 rounding is done on the
integer bits rather than by the hardware cast (the interpreter rounds E4M3 subnormals wrongly).
Layout: a row-major [..., K] input is viewed as [rows, K] (fp4: [blocks, 32|16], since K is a
multiple of the block); one program handles a tile of rows x one block/group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe.quant.formats import FP4_FORMATS, QuantizedTensor, check_quantizable, get_format
from moe.quant.reference import DEFAULT_AMAX_FLOOR, _check_floor, check_storage

# Tile sizes (rows of blocks per program, warps); bench `megapar bench quant` sweeps them.
CONFIG: dict[str, tuple[int, int]] = {
    "fp4_quant": (128, 4),     # 128 blocks of 32 (or 256 of 16): 4096 elements per program
    "fp4_dequant": (128, 4),
    "fp8_group": (32, 4),      # 32 rows x 128
    "fp8_dequant": (32, 4),    # 32 rows x 128 columns
}


# ------------------------------------------------------------------ bit helpers (device)
# Public for other kernels (moe.kernels) that must produce moe.quant's exact bits in registers.


@triton.jit
def e4m3_byte(y):
    """fp32 y with |y| <= 448 (or NaN) -> uint8 E4M3 bits, round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    # normal E4M3 (|y| >= 2^-6): round the 23-bit mantissa to 3 bits, rebias 127 -> 7
    rnd = a_bits + 0x7FFFF + ((a_bits >> 20) & 1)
    normal = (rnd >> 20) - (120 << 3)
    # subnormal E4M3: m * 2^-9 with m = rne(|y| * 2^9) in [0, 8] (8 is the smallest normal)
    t = tl.abs(y) * 512.0
    m = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    byte = sign | tl.where(a_bits >= (121 << 23), normal, m)
    return tl.where(a_bits > 0x7F800000, 0x7F, byte).to(tl.uint8)   # NaN -> 0x7F


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
def e2m1_code(y):
    """fp32 -> E2M1 code (sign<<3 | index), round to nearest even, saturating; NaN -> 0."""
    a = tl.abs(y)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    sign = (y.to(tl.int32, bitcast=True) >> 28) & 8
    sign = tl.where(y != y, 0, sign)
    return idx | sign


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32 in [0, 16)) -> fp32 (exact; code 8 is -0.0)."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


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
    y = tl.div_rn(x, scale)
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    return e4m3_byte(y)


# ------------------------------------------------------------------ FP4 kernels


@triton.jit
def _fp4_quant_kernel(x_ptr, data_ptr, scale_ptr, gs_ptr, n_blocks, blocks_per_gs,
                      IS_NV: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)                             # block index
    rmask = rows < n_blocks
    cols = tl.arange(0, BS)
    x = tl.load(x_ptr + rows[:, None] * BS + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    if IS_NV:
        g = tl.load(gs_ptr + rows // blocks_per_gs, mask=rmask, other=1.0)
        amax = tl.where(has_nan, float("nan"), amax)
        s = tl.where(g > 0, tl.div_rn(tl.div_rn(amax, 6.0), g), 0.0)
        s = tl.where(s > 448.0, 448.0, s)
        sbyte = e4m3_byte(s)
        denom = e4m3_value(sbyte) * g
        y = tl.where(denom[:, None] > 0, tl.div_rn(x, denom[:, None]), x * 0.0)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        byte = ((bits >> 23) & 0xFF) - 2 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
        byte = tl.minimum(tl.maximum(byte, 0), 254)
        byte = tl.where(has_nan, 255, byte)
        inv = (tl.maximum(254 - byte, 1) << 23).to(tl.float32, bitcast=True)  # 2^-e
        y = x * inv[:, None]
        sbyte = byte.to(tl.uint8)
    codes = e2m1_code(y)
    even, odd = tl.split(tl.reshape(codes, (ROWS, BS // 2, 2)))
    packed = (even | (odd << 4)).to(tl.uint8)
    pcols = tl.arange(0, BS // 2)
    tl.store(data_ptr + rows[:, None] * (BS // 2) + pcols[None, :], packed, mask=rmask[:, None])
    tl.store(scale_ptr + rows, sbyte, mask=rmask)


@triton.jit
def _fp4_dequant_kernel(data_ptr, scale_ptr, gs_ptr, out_ptr, n_blocks, blocks_per_gs,
                        IS_NV: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_blocks
    pcols = tl.arange(0, BS // 2)
    packed = tl.load(data_ptr + rows[:, None] * (BS // 2) + pcols[None, :], mask=rmask[:, None], other=0)
    packed = packed.to(tl.int32)
    sbyte = tl.load(scale_ptr + rows, mask=rmask, other=0)
    lo = e2m1_value(packed & 0xF)
    hi = e2m1_value(packed >> 4)
    if IS_NV:
        s = e4m3_value(sbyte)[:, None]
        g = tl.load(gs_ptr + rows // blocks_per_gs, mask=rmask, other=1.0)[:, None]
        lo = (lo * s) * g
        hi = (hi * s) * g
    else:
        s = e8m0_value(sbyte)[:, None]
        lo = lo * s
        hi = hi * s
    vals = tl.reshape(tl.join(lo, hi), (ROWS, BS))
    cols = tl.arange(0, BS)
    tl.store(out_ptr + rows[:, None] * BS + cols[None, :], vals.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


# ------------------------------------------------------------------ FP8 kernels


@triton.jit
def _fp8_group_quant_kernel(x_ptr, data_ptr, scale_ptr, n_rows, k, n_groups, amax_floor,
                            UE8M0: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """One program: ROWS rows x one group of GROUP columns (fp8_group; fp8_token with GROUP >= K)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    cols = grp * GROUP + tl.arange(0, GROUP)
    mask = (rows < n_rows)[:, None] & (cols < k)[None, :]
    offs = rows[:, None] * k + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), amax)
    scale = fp8_scale(amax, amax_floor, UE8M0)
    tl.store(data_ptr + offs, fp8_quant(x, scale[:, None]), mask=mask)
    tl.store(scale_ptr + rows * n_groups + grp, scale, mask=rows < n_rows)


@triton.jit
def _fp8_row_quant_kernel(x_ptr, data_ptr, scale_ptr, n_rows, k, amax_floor,
                          UE8M0: tl.constexpr, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """fp8_token for long rows: one program per row, two passes over CHUNK columns.
    (NUM_CHUNKS is constexpr: the interpreter cannot loop to a runtime bound.)"""
    row = tl.program_id(0).to(tl.int64)
    base = row * k
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    nan = tl.zeros((CHUNK,), dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        start = c * CHUNK
        cols = start + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + base + cols, mask=cols < k, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
        nan = nan | (x != x).to(tl.int32)
    a = tl.max(amax, axis=0)
    a = tl.where(tl.max(nan, axis=0) > 0, float("nan"), a)
    scale = fp8_scale(a, amax_floor, UE8M0)
    for c in range(NUM_CHUNKS):
        start = c * CHUNK
        cols = start + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + base + cols, mask=cols < k, other=0.0).to(tl.float32)
        tl.store(data_ptr + base + cols, fp8_quant(x, scale), mask=cols < k)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _fp8_block_quant_kernel(x_ptr, data_ptr, scale_ptr, n, k, nb, kb, amax_floor,
                            UE8M0: tl.constexpr, SUB: tl.constexpr):
    """fp8_block: one program per 128x128 tile of one matrix, two passes of SUB rows."""
    mat = tl.program_id(0).to(tl.int64)
    tr = tl.program_id(1)
    tc = tl.program_id(2)
    cols = tc * 128 + tl.arange(0, 128)
    cmask = cols < k
    base = mat * n * k
    amax = tl.zeros((SUB, 128), dtype=tl.float32)
    nan = tl.zeros((SUB, 128), dtype=tl.int32)
    for r0 in range(0, 128, SUB):
        rows = tr * 128 + r0 + tl.arange(0, SUB)
        mask = (rows < n)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + base + rows[:, None] * k + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
        nan = nan | (x != x).to(tl.int32)
    a = tl.max(tl.max(amax, axis=1), axis=0)
    a = tl.where(tl.max(tl.max(nan, axis=1), axis=0) > 0, float("nan"), a)
    scale = fp8_scale(a, amax_floor, UE8M0)
    for r0 in range(0, 128, SUB):
        rows = tr * 128 + r0 + tl.arange(0, SUB)
        mask = (rows < n)[:, None] & cmask[None, :]
        offs = base + rows[:, None] * k + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(data_ptr + offs, fp8_quant(x, scale), mask=mask)
    tl.store(scale_ptr + mat * nb * kb + tr * kb + tc, scale)


@triton.jit
def _fp8_dequant_kernel(data_ptr, scale_ptr, out_ptr, n_rows, k, rows_per_mat, s_mat, s_row, s_col,
                        ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[r, c] = e4m3(data[r, c]) * scale[(r // N) * s_mat + (r % N // RB) * s_row + (c // CB) * s_col]."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = (rows < n_rows)[:, None] & (cols < k)[None, :]
    offs = rows[:, None] * k + cols[None, :]
    v = e4m3_value(tl.load(data_ptr + offs, mask=mask, other=0))
    mat = rows // rows_per_mat
    sidx = (mat * s_mat + ((rows - mat * rows_per_mat) // ROW_BLOCK) * s_row)[:, None] + (cols // COL_BLOCK * s_col)[None, :]
    s = tl.load(scale_ptr + sidx, mask=mask, other=1.0)
    tl.store(out_ptr + offs, (v * s).to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------ host wrappers

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _tensor_amax(x: torch.Tensor, per_matrix: bool) -> torch.Tensor:
    """max |x| (0-d, or per matrix of [..., N, K]) in fp32 without materializing |x|."""
    if x.numel() == 0:
        return torch.zeros(x.shape[:-2] if per_matrix else (), dtype=torch.float32, device=x.device)
    flat = x.reshape(-1, x.shape[-2] * x.shape[-1]) if per_matrix else x.reshape(1, -1)
    lo, hi = torch.aminmax(flat, dim=-1)
    amax = torch.maximum(lo.abs(), hi.abs()).float()
    amax = amax.reshape(x.shape[:-2]) if per_matrix else amax.reshape(())
    return amax


def _nvfp4_global(x: torch.Tensor, global_scale) -> torch.Tensor:
    from moe.quant.reference import NVFP4_GLOBAL_DIVISOR, _nvfp4_gs

    if global_scale is None or (isinstance(global_scale, str) and global_scale in ("tensor", "matrix")):
        per_matrix = global_scale == "matrix"
        if per_matrix and x.dim() < 2:
            raise ValueError(f"global_scale='matrix' needs x with >= 2 dims, got {tuple(x.shape)}")
        return _tensor_amax(x, per_matrix) / NVFP4_GLOBAL_DIVISOR
    return _nvfp4_gs(x, global_scale)


def quantize(x: torch.Tensor, fmt: str, **opts) -> QuantizedTensor:
    """Same contract as `moe.quant.quantize` (opts per format)."""
    info = check_quantizable(x, fmt)
    x = x.contiguous()
    if fmt in FP4_FORMATS:
        return _quantize_fp4(x, fmt, info.block[1], **opts)
    return _quantize_fp8(x, fmt, **opts)


def _quantize_fp4(x: torch.Tensor, fmt: str, bs: int, *, scale_rule: str = "ceil",
                  global_scale=None) -> QuantizedTensor:
    is_nv = fmt == "nvfp4"
    if fmt == "mxfp4" and scale_rule != "ceil":
        if scale_rule == "floor":                                   # checkpoint emulation: torch path
            from moe.quant.reference import quantize_mxfp4
            return quantize_mxfp4(x, scale_rule="floor")
        raise ValueError(f"unknown mxfp4 scale_rule {scale_rule!r}; valid: 'ceil', 'floor'")
    *lead, k = x.shape
    n_blocks = x.numel() // bs
    data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*lead, k // bs), dtype=torch.uint8, device=x.device)
    gs = None
    gs_arg, blocks_per_gs = scale, max(n_blocks, 1)
    if is_nv:
        gs = _nvfp4_global(x, global_scale).to(torch.float32).contiguous()
        gs_arg = gs
        if gs.dim():
            blocks_per_gs = x.shape[-2] * (k // bs)
    rows, warps = CONFIG["fp4_quant"]
    rows = rows * 32 // bs
    if n_blocks:
        _fp4_quant_kernel[(triton.cdiv(n_blocks, rows),)](
            x, data, scale, gs_arg, n_blocks, blocks_per_gs, IS_NV=is_nv, BS=bs, ROWS=rows, num_warps=warps)
    return QuantizedTensor(data, scale, fmt, x.shape, gs)


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
            _fp8_block_quant_kernel[(mats, nb, kb)](x, d8, scale, n, k, nb, kb, amax_floor,
                                                    UE8M0=ue8m0, SUB=16, num_warps=4)
        return QuantizedTensor(data, scale, fmt, x.shape)
    n_rows = x.numel() // k if k else 0
    rows, warps = CONFIG["fp8_group"]
    if fmt == "fp8_group":
        n_groups = triton.cdiv(k, 128)
        scale = torch.empty((*x.shape[:-1], n_groups), dtype=torch.float32, device=x.device)
        if x.numel():
            _fp8_group_quant_kernel[(triton.cdiv(n_rows, rows), n_groups)](
                x, d8, scale, n_rows, k, n_groups, amax_floor, UE8M0=ue8m0, ROWS=rows, GROUP=128, num_warps=warps)
        return QuantizedTensor(data, scale, fmt, x.shape)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if x.numel():
        width = triton.next_power_of_2(k)
        if width <= 8192:                                            # whole row in one tile
            r = max(1, min(16, 4096 // width))
            _fp8_group_quant_kernel[(triton.cdiv(n_rows, r), 1)](
                x, d8, scale, n_rows, k, 1, amax_floor, UE8M0=ue8m0, ROWS=r, GROUP=width, num_warps=4)
        else:
            _fp8_row_quant_kernel[(n_rows,)](x, d8, scale, n_rows, k, amax_floor, UE8M0=ue8m0,
                                             CHUNK=4096, NUM_CHUNKS=triton.cdiv(k, 4096), num_warps=8)
    return QuantizedTensor(data, scale, fmt, x.shape)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as `moe.quant.dequantize`."""
    check_storage(q)
    info = get_format(q.fmt)
    out_dtype = dtype if dtype in _OUT_DTYPES else torch.float32
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    data = q.data.contiguous()
    scale = q.scale.contiguous()
    if q.fmt in FP4_FORMATS:
        bs = info.block[1]
        n_blocks = out.numel() // bs
        is_nv = q.fmt == "nvfp4"
        gs_arg, blocks_per_gs = scale, max(n_blocks, 1)
        if is_nv:
            gs_arg = q.global_scale.to(device=q.device, dtype=torch.float32).contiguous()
            if gs_arg.dim():
                blocks_per_gs = q.shape[-2] * (q.shape[-1] // bs)
        rows, warps = CONFIG["fp4_dequant"]
        rows = rows * 32 // bs
        if n_blocks:
            _fp4_dequant_kernel[(triton.cdiv(n_blocks, rows),)](
                data, scale, gs_arg, out, n_blocks, blocks_per_gs, IS_NV=is_nv, BS=bs, ROWS=rows, num_warps=warps)
    else:
        k = q.shape[-1]
        n_rows = out.numel() // k if k else 0
        if q.fmt == "fp8_token":
            args = (n_rows, 0, 1, 0, 1, 128)                # rows_per_mat, s_mat, s_row, s_col, RB, CB
        elif q.fmt == "fp8_group":
            args = (n_rows, 0, scale.shape[-1], 1, 1, 128)
        else:
            n = q.shape[-2]
            nb, kb = scale.shape[-2:]
            args = (n, nb * kb, kb, 1, 128, 128)
        rows, warps = CONFIG["fp8_dequant"]
        if out.numel():
            _fp8_dequant_kernel[(triton.cdiv(n_rows, rows), triton.cdiv(k, 128))](
                data.view(torch.uint8), scale, out, n_rows, k, *args[:4],
                ROW_BLOCK=args[4], COL_BLOCK=args[5], ROWS=rows, COLS=128, num_warps=warps)
    return out if out_dtype == dtype else out.to(dtype)
