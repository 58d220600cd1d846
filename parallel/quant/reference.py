"""Plain-torch quantize/dequantize: the specification every fast path must match bit for bit.

All math is fp32 (inputs are upcast first), every step an exactly specified IEEE operation,
so a Triton kernel doing the same steps gives the same bits:

- mxfp4: block amax a (32 along K). The exponent e = ceil(log2(a / 6)) is read off a's bits
  (a = m * 2^E, m in [1, 2): e = E - 2 if m <= 1.5 else E - 1), so no value clips; byte =
  clamp(e + 127, 0, 254); a = 0 gives byte 0 (2^-127). A block holding NaN gets byte 255
  (E8M0 NaN), so it dequantizes to NaN. `scale_rule="floor"` makes the OCP rule
  e = floor(log2(a)) - 2 instead (values in (6, 8) * 2^e saturate to 6), as found in
  checkpoints; dequantization accepts any byte. y = x * 2^-e (exact), then E2M1 round to
  nearest even, saturating at 6, sign kept (so -0.0 and tiny negatives give code 8 = -0).
  Finite inputs never need byte > 253; an inf gives 253 and saturates (dequantizes to inf);
  |x| above ~2^127.5 may round up to 4 or 6 * 2^126, which is inf in fp32.
- nvfp4: g = amax(|x|) / 2688 (= 448 * 6) per tensor (or per matrix, or given); s =
  e4m3(min(a / 6 / g, 448)) per 16 (0 where g is not > 0); the E2M1 code of x / (s * g) is
  rounded from the exact quotient (`nvfp4_codes`: |x| compared with each boundary times s * g
  in float64, where both are exact; an fp32 product or quotient would send midpoints the wrong
  way); y = x * 0 where s * g is not > 0; dequant (e2m1 * s) * g. A given global scale must be
  finite and > 0 (ValueError); a computed one is 0 for an all-zero tensor, which quantizes to zeros. A NaN block gets s = NaN (0x7F) when g is
  finite; a NaN anywhere in a tensor-scaled x makes g NaN, so everything dequantizes to NaN.
- fp8_*: a' = max(a, amax_floor); scale = a' / 448 (or, with ue8m0=True, 2^ceil(log2(a'/448))
  read off the bits); y = clamp(x / scale, -448, 448) -> e4m3 round to nearest even.
Dequantization computes in fp32 and casts to the requested dtype at the end.
"""

from __future__ import annotations

import functools

import torch

from megapar.parallel.quant.formats import (
    E4M3_MAX,
    FP4_FORMATS,
    QuantizedTensor,
    check_quantizable,
    e2m1_to_float,
    get_format,
    pack_fp4,
    unpack_fp4,
)

NVFP4_GLOBAL_DIVISOR = E4M3_MAX * 6.0  # 2688
DEFAULT_AMAX_FLOOR = 1e-12             # fp8: scale of an all-zero block is floor / 448

# E2M1 round-to-nearest-even boundaries on |y|: index = number of boundaries passed.
# Ties (0.25, 1.25, 2.5, 5) go down (to the even code), ties (0.75, 1.75, 3.5) go up.
_E2M1_BOUNDS_GT = (0.25, 1.25, 2.5, 5.0)   # passed when |y| >  bound
_E2M1_BOUNDS_GE = (0.75, 1.75, 3.5)        # passed when |y| >= bound


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """y: float (fp32 in the quantizers; any float dtype, compared as is: the bounds are exact in
    each) -> uint8 E2M1 codes, round to nearest even, |y| > 6 saturates, sign kept."""
    a = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.int32, device=y.device)
    for b in _E2M1_BOUNDS_GT:
        idx += (a > b).int()
    for b in _E2M1_BOUNDS_GE:
        idx += (a >= b).int()
    # (signbit, not a view as int32: that paired the halves of a bf16 / fp16 tensor)
    sign = torch.where(torch.isnan(y), 0, torch.signbit(y).int())  # NaN -> +0: its sign bit is platform noise
    return (idx | (sign << 3)).to(torch.uint8)


def _f32_bits(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(biased exponent field, mantissa field) of a non-negative fp32 tensor, int32."""
    bits = x.contiguous().view(torch.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int32 e in [-126, 127] (built from bits, exact)."""
    return ((e + 127) << 23).view(torch.float32)


def mxfp4_scale_bytes(amax: torch.Tensor, rule: str = "ceil") -> torch.Tensor:
    """amax: fp32 block amax -> uint8 E8M0 bytes (rule "ceil": no clipping; "floor": OCP)."""
    expo, mant = _f32_bits(amax)
    if rule == "ceil":
        byte = expo - 2 + (mant > 0x400000).int()
    elif rule == "floor":
        byte = expo - 2
    else:
        raise ValueError(f"unknown mxfp4 scale_rule {rule!r}; valid: 'ceil', 'floor'")
    byte = byte.clamp(0, 254)
    byte = torch.where(torch.isnan(amax), 255, byte)
    return byte.to(torch.uint8)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> fp32 2^(byte-127); byte 0 is 2^-127 (subnormal fp32), 255 is NaN.
    torch.float8_e8m0fnu is taken as a view of its bytes; other float dtypes are refused (their
    values would be read as bytes)."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    elif scale.is_floating_point():
        raise ValueError(f"e8m0_to_float needs uint8 (or float8_e8m0fnu) E8M0 bytes, got {scale.dtype}; "
                         f"a float scale holds values, not E8M0 bytes")
    b = scale.to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)
    bits = torch.where(b == 255, 0x7FC00000, bits)
    return bits.view(torch.float32)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[..., K] -> [..., K/size, size] fp32."""
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // size, size)  # (no -1: x may be empty)


def quantize_mxfp4(x: torch.Tensor, *, scale_rule: str = "ceil") -> QuantizedTensor:
    """x: [..., K] float, K % 32 == 0 -> mxfp4 QuantizedTensor."""
    check_quantizable(x, "mxfp4")
    blk = _blocks(x, 32)                                        # [..., K/32, 32]
    has_nan = torch.isnan(blk).any(-1)
    amax = blk.abs().amax(-1)
    amax = torch.where(has_nan, float("nan"), amax)
    byte = mxfp4_scale_bytes(amax, scale_rule)                  # [..., K/32]
    # 2^-e for byte in [0, 253] is a normal fp32 with exponent field 254 - byte.
    inv = ((254 - byte.to(torch.int32)).clamp(min=1) << 23).view(torch.float32)
    y = blk * inv.unsqueeze(-1)
    codes = round_to_e2m1(y).reshape(x.shape)
    return QuantizedTensor(pack_fp4(codes), byte, "mxfp4", x.shape)


def dequantize_mxfp4(q: QuantizedTensor) -> torch.Tensor:
    """-> fp32 of q.shape."""
    vals = _blocks(e2m1_to_float(unpack_fp4(q.data)), 32)
    return (vals * e8m0_to_float(q.scale).unsqueeze(-1)).reshape(q.shape)


def _div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    """a / divisor, correctly rounded on every device: CUDA turns division by a Python float
    into a multiply by its reciprocal, which is off by one ulp for some values."""
    return a / torch.full_like(a, divisor)


def nvfp4_global_scale(x: torch.Tensor, per_matrix: bool = False) -> torch.Tensor:
    """amax(|x|) / (448 * 6) in fp32: 0-d, or per matrix [...] of x [..., N, K]."""
    a = x.float().abs()
    if a.numel() == 0:
        return torch.zeros(x.shape[:-2] if per_matrix else (), dtype=torch.float32, device=x.device)
    return _div(a.amax(dim=(-2, -1)) if per_matrix else a.amax(), NVFP4_GLOBAL_DIVISOR)


def _nvfp4_gs(x: torch.Tensor, global_scale: torch.Tensor | float | str | None) -> torch.Tensor:
    if global_scale is None or isinstance(global_scale, str):
        if global_scale not in (None, "tensor", "matrix"):
            raise ValueError(f"nvfp4 global_scale {global_scale!r}; valid: None/'tensor', 'matrix', or a tensor")
        if global_scale == "matrix" and x.dim() < 2:
            raise ValueError(f"global_scale='matrix' needs x with >= 2 dims, got {tuple(x.shape)}")
        return nvfp4_global_scale(x, per_matrix=global_scale == "matrix")
    gs = torch.as_tensor(global_scale, dtype=torch.float32).to(x.device)
    capturing = gs.is_cuda and torch.cuda.is_current_stream_capturing()  # (no host read inside a graph)
    if not capturing and not bool(((gs > 0) & torch.isfinite(gs)).all()):  # (NaN and inf fail too)
        raise ValueError(f"nvfp4 global_scale must be > 0 (finite); got {gs.flatten()[:8].tolist()}"
                         f"{' ...' if gs.numel() > 8 else ''}; pass None/'tensor' or 'matrix' to compute it")
    if gs.numel() == 1:
        return gs.reshape(())
    if x.dim() >= 2 and tuple(gs.shape) == tuple(x.shape[:-2]):
        return gs
    raise ValueError(f"nvfp4 global_scale has shape {tuple(gs.shape)}; valid: one element or "
                     f"one per matrix {tuple(x.shape[:-2])} for x {tuple(x.shape)}")


def nvfp4_codes(blk: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of blk / (s * g), rounded from the exact quotient.

    blk: [..., B] float (the blocks), s: [...] fp32 block scales (E4M3 values), g: fp32 global
    scale broadcastable to s. The divisor d = s * g is exact in float64 (4 + 24 significant
    bits), and so is each boundary b * d (b in 0.25 .. 5, at most 3 bits), so comparing |x|
    with b * d decides every rounding exactly: a midpoint such as x = 1.75 * d goes to the
    even code however fp32 would have rounded the product or the quotient. Where d is not > 0
    (an all-zero tensor, an underflowed block scale, a NaN), y = x * 0 as before."""
    d = (s.double() * g.double()).unsqueeze(-1)                   # [..., 1], exact
    a = blk.double().abs()
    idx = torch.zeros(blk.shape, dtype=torch.int32, device=blk.device)
    for b in _E2M1_BOUNDS_GT:
        idx += (a > b * d).int()
    for b in _E2M1_BOUNDS_GE:
        idx += (a >= b * d).int()
    xf = blk.float()
    sign = torch.where(torch.isnan(xf), 0, (xf.view(torch.int32) >> 31) & 1)
    codes = (idx | (sign << 3)).to(torch.uint8)
    return torch.where(d > 0, codes, round_to_e2m1(xf * 0.0))


def gs_per_row(gs: torch.Tensor, ndim: int) -> torch.Tensor:
    """nvfp4 global scale () or [...] -> broadcastable against [..., N, X] (ndim dims)."""
    return gs if gs.dim() == 0 else gs.reshape(*gs.shape, *([1] * (ndim - gs.dim())))


def quantize_nvfp4(x: torch.Tensor, *, global_scale: torch.Tensor | float | str | None = None) -> QuantizedTensor:
    """x: [..., K] float, K % 16 == 0 -> nvfp4 QuantizedTensor.

    global_scale: None/"tensor" (amax/2688 of all of x, 0-d), "matrix" (one per [N, K] matrix,
    shape x.shape[:-2]), or given (one element or x.shape[:-2]).
    """
    check_quantizable(x, "nvfp4")
    gs = _nvfp4_gs(x, global_scale).float()
    blk = _blocks(x, 16)                                        # [..., K/16, 16]
    amax = blk.abs().amax(-1)                                   # [..., K/16]
    amax = torch.where(torch.isnan(blk).any(-1), float("nan"), amax)
    g = gs_per_row(gs, amax.dim())
    s = torch.where(g > 0, _div(amax, 6.0) / g, torch.zeros_like(amax))
    s8 = _to_e4m3(s)                                            # [..., K/16]
    codes = nvfp4_codes(blk, s8.float(), g).reshape(x.shape)
    return QuantizedTensor(pack_fp4(codes), s8.view(torch.uint8), "nvfp4", x.shape, gs)


def dequantize_nvfp4(q: QuantizedTensor) -> torch.Tensor:
    """-> fp32 of q.shape: (e2m1 * block scale) * global scale."""
    vals = _blocks(e2m1_to_float(unpack_fp4(q.data)), 16)      # [..., K/16, 16]
    s = q.scale.view(torch.float8_e4m3fn).float().unsqueeze(-1)
    g = gs_per_row(q.global_scale.float(), vals.dim())
    return ((vals * s) * g).reshape(q.shape)


def fp8_scale(amax: torch.Tensor, *, ue8m0: bool = False, amax_floor: float = DEFAULT_AMAX_FLOOR) -> torch.Tensor:
    """amax: fp32 -> fp32 scale with amax / scale <= 448: amax/448, or the next power of two."""
    a = amax.clamp(min=amax_floor)
    if not ue8m0:
        return _div(a, E4M3_MAX)
    expo, mant = _f32_bits(a)
    # 448 = 1.75 * 2^8: a = m 2^E <= 448 * 2^e  <=>  e >= E - 8 (+1 when m > 1.75).
    e = (expo - 127 - 8 + (mant > 0x600000).int()).clamp(-126, 127)
    return torch.where(torch.isnan(a), a, _pow2_f32(e))


def _to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 round to nearest even, saturating at +-448; NaN -> 0x7F whatever its sign."""
    y = torch.where(torch.isnan(y), float("nan"), y.clamp(-E4M3_MAX, E4M3_MAX))
    return y.to(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=64)
def _check_floor(amax_floor: float) -> None:
    """amax_floor must give a finite scale > 0 in fp32: a floor whose floor / 448 is 0 in fp32
    (below ~3e-43) made an all-zero row 0 / 0 = NaN, an infinite one every value x / inf = 0.
    (Cached: every quantize call checks its floor, nearly always the default; ~15 µs of host
    tensor work a call otherwise. A failed check is not cached and raises each time.)"""
    ok = amax_floor > 0 and bool(torch.isfinite(torch.tensor(float(amax_floor))))
    if not ok or not bool(_div(torch.tensor(float(amax_floor)), E4M3_MAX) > 0):
        raise ValueError(f"amax_floor must be > 0 and finite with amax_floor / 448 > 0 in fp32 "
                         f"(>= ~3e-43), got {amax_floor}")


def quantize_fp8_token(x: torch.Tensor, *, ue8m0: bool = False,
                       amax_floor: float = DEFAULT_AMAX_FLOOR) -> QuantizedTensor:
    """x: [..., K] -> fp8_token: data e4m3 [..., K], scale fp32 [..., 1]."""
    check_quantizable(x, "fp8_token")
    _check_floor(amax_floor)
    xf = x.float()
    scale = fp8_scale(xf.abs().amax(-1, keepdim=True), ue8m0=ue8m0, amax_floor=amax_floor)
    return QuantizedTensor(_to_e4m3(xf / scale), scale, "fp8_token", x.shape)


def _pad_last(x: torch.Tensor, mult: int) -> torch.Tensor:
    pad = -x.shape[-1] % mult
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_fp8_group(x: torch.Tensor, *, ue8m0: bool = False,
                       amax_floor: float = DEFAULT_AMAX_FLOOR) -> QuantizedTensor:
    """x: [..., K] -> fp8_group: data e4m3 [..., K], scale fp32 [..., ceil(K/128)]."""
    check_quantizable(x, "fp8_group")
    _check_floor(amax_floor)
    k = x.shape[-1]
    grp = _blocks(_pad_last(x.float(), 128), 128)               # [..., G, 128]
    scale = fp8_scale(grp.abs().amax(-1), ue8m0=ue8m0, amax_floor=amax_floor)
    y = (grp / scale.unsqueeze(-1)).reshape(*x.shape[:-1], grp.shape[-2] * 128)[..., :k]
    return QuantizedTensor(_to_e4m3(y), scale, "fp8_group", x.shape)


def quantize_fp8_block(x: torch.Tensor, *, ue8m0: bool = False,
                       amax_floor: float = DEFAULT_AMAX_FLOOR) -> QuantizedTensor:
    """x: [..., N, K] -> fp8_block: data e4m3 [..., N, K], scale fp32 [..., ceil(N/128), ceil(K/128)]."""
    check_quantizable(x, "fp8_block")
    _check_floor(amax_floor)
    n, k = x.shape[-2:]
    xp = _pad_last(_pad_last(x.float(), 128).transpose(-1, -2), 128).transpose(-1, -2)
    lead = xp.shape[:-2]
    tiles = xp.reshape(*lead, xp.shape[-2] // 128, 128, xp.shape[-1] // 128, 128)
    scale = fp8_scale(tiles.abs().amax(dim=(-3, -1)), ue8m0=ue8m0, amax_floor=amax_floor)
    y = (tiles / scale[..., :, None, :, None]).reshape(xp.shape)[..., :n, :k]
    return QuantizedTensor(_to_e4m3(y), scale, "fp8_block", x.shape)


def fp8_scale_expanded(q: QuantizedTensor) -> torch.Tensor:
    """The fp32 scale of an fp8 QuantizedTensor broadcast to every element: [*q.shape]."""
    k = q.shape[-1]
    if q.fmt == "fp8_token":
        return q.scale.expand(q.shape)
    if q.fmt == "fp8_group":
        return q.scale.repeat_interleave(128, dim=-1)[..., :k]
    if q.fmt == "fp8_block":
        n = q.shape[-2]
        return q.scale.repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)[..., :n, :k]
    raise ValueError(f"fp8_scale_expanded needs an fp8 format, got {q.fmt!r}")


def dequantize_fp8(q: QuantizedTensor) -> torch.Tensor:
    """-> fp32 of q.shape: e4m3 * scale."""
    return q.data.float() * fp8_scale_expanded(q)


_QUANTIZERS = {
    "mxfp4": quantize_mxfp4,
    "nvfp4": quantize_nvfp4,
    "fp8_token": quantize_fp8_token,
    "fp8_group": quantize_fp8_group,
    "fp8_block": quantize_fp8_block,
}


def quantize_reference(x: torch.Tensor, fmt: str, **opts) -> QuantizedTensor:
    """Torch reference quantizer; `opts` per format (see the quantize_* functions)."""
    get_format(fmt)
    return _QUANTIZERS[fmt](x, **opts)


def dequantize_reference(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch reference dequantizer: fp32 math, cast to `dtype` at the end."""
    check_storage(q)
    if q.fmt == "mxfp4":
        out = dequantize_mxfp4(q)
    elif q.fmt == "nvfp4":
        out = dequantize_nvfp4(q)
    else:
        out = dequantize_fp8(q)
    return out.to(dtype)


def expected_storage(fmt: str, shape: torch.Size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(data shape, scale shape) that `fmt` stores for a logical `shape`; ValueError for a shape
    the format cannot hold (fp4: K not a multiple of the block; fp8_block: fewer than 2 dims)."""
    info = get_format(fmt)
    min_dims = 2 if fmt == "fp8_block" else 1
    if len(shape) < min_dims:
        raise ValueError(f"{fmt} needs a shape with >= {min_dims} dims, got {tuple(shape)}")
    *lead, k = shape
    if fmt in FP4_FORMATS:
        if k % info.block[1]:
            raise ValueError(f"{fmt} of shape {tuple(shape)}: the last dim K ({k}) must be divisible by "
                             f"its block size {info.block[1]}")
        return (*lead, k // 2), (*lead, k // info.block[1])
    if fmt == "fp8_token":
        return tuple(shape), (*lead, 1)
    if fmt == "fp8_group":
        return tuple(shape), (*lead, -(-k // 128))
    *lead2, n = lead
    return tuple(shape), (*lead2, -(-n // 128), -(-k // 128))


def check_storage(q: QuantizedTensor) -> None:
    """ValueError when q's data/scale shapes or dtypes do not match its format and shape."""
    data_shape, scale_shape = expected_storage(q.fmt, q.shape)
    data_dtype = torch.uint8 if q.fmt in FP4_FORMATS else torch.float8_e4m3fn
    scale_dtype = torch.uint8 if q.fmt in FP4_FORMATS else torch.float32
    if tuple(q.data.shape) != data_shape or q.data.dtype != data_dtype:
        raise ValueError(f"{q.fmt} of shape {tuple(q.shape)} needs data {data_dtype}{data_shape}, "
                         f"got {q.data.dtype}{tuple(q.data.shape)}")
    if tuple(q.scale.shape) != scale_shape or q.scale.dtype != scale_dtype:
        raise ValueError(f"{q.fmt} of shape {tuple(q.shape)} needs scale {scale_dtype}{scale_shape}, "
                         f"got {q.scale.dtype}{tuple(q.scale.shape)}")
    if q.fmt != "nvfp4" and q.global_scale is not None:   # (dequantization would drop it silently)
        gs = q.global_scale
        got = f"{gs.dtype} {tuple(gs.shape)}" if isinstance(gs, torch.Tensor) else type(gs).__name__
        raise ValueError(f"{q.fmt} has no global_scale (nvfp4 only), got {got}")
    if q.fmt == "nvfp4":
        gs = q.global_scale
        if gs is None or gs.dtype != torch.float32 or (gs.dim() and tuple(gs.shape) != tuple(q.shape[:-2])):
            raise ValueError(f"nvfp4 needs global_scale, an fp32 0-d tensor or one per matrix "
                             f"{tuple(q.shape[:-2])}, got {None if gs is None else (gs.dtype, tuple(gs.shape))}")
