"""Exact MXFP4 -> FP8 E4M3 conversion for W4A8 (docs/numerics.md): fold the power-of-two block scales.

An MXFP4 element is v * 2^e_b (v in E2M1, e_b the exponent of its 32-block). Inside one
scale group (1x128 along K, or 128 rows x 128) let e_max be the largest block exponent and
e_ref = max(e_max - 6, -126). The FP8 value is v * 2^shift with shift = e_b - e_ref <= 6, and
the group's fp32 scale is 2^e_ref. 6 * 2^6 = 384 <= 448, and 0.5 * 2^-8 = 2^-9 is the
smallest E4M3 subnormal, so every E2M1 value is exact in E4M3 for shift in [-8, 6]: the fold
is EXACT whenever the block exponents of a group span at most 14 (the "<= 8" rule of
docs/numerics.md is a subset). A block further below is rounded to nearest even in E4M3 (its smallest values
flush to 0); `strict=True` raises instead. A NaN block scale (byte 255) makes its group's
scale NaN.

GEMM kernels expanding FP4 to FP8 in registers use `mxfp4_fold_plan` (the shifts and group
scales) and must produce `mxfp4_to_fp8_block`'s bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapar.parallel.quant.formats import QuantizedTensor, e2m1_to_float, unpack_fp4
from megapar.parallel.quant.reference import _pow2_f32, check_storage

EXACT_SPREAD = 14  # max(e_b) - min(e_b) within a group for which the fold is exact


@dataclass
class Fp8FoldPlan:
    """shift: [..., N, K/32] int32, FP8 value = e2m1 * 2^shift (shift <= 6);
    scale: fp32 group scale 2^e_ref, [..., N, ceil(K/128)] (tile_rows=1) or
    [..., ceil(N/128), ceil(K/128)] (tile_rows=128)."""

    shift: torch.Tensor
    scale: torch.Tensor
    tile_rows: int


def _check_group(group: int, tile_rows: int) -> None:
    if group != 128:
        raise ValueError(f"fp8 fold group must be 128 (the fp8_group/fp8_block scale size), got {group}")
    if tile_rows not in (1, 128):
        raise ValueError(f"tile_rows must be 1 (1x128 scales) or 128 (128x128 scales), got {tile_rows}")


def mxfp4_fold_plan(scale: torch.Tensor, group: int = 128, *, tile_rows: int = 1) -> Fp8FoldPlan:
    """scale: [..., N, K/32] uint8 E8M0 (tile_rows=128 needs >= 2 dims) -> Fp8FoldPlan."""
    _check_group(group, tile_rows)
    if scale.dtype != torch.uint8:
        raise ValueError(f"mxfp4 scale must be uint8 E8M0, got {scale.dtype}")
    if tile_rows == 128 and scale.dim() < 2:
        raise ValueError(f"tile_rows=128 needs a scale with >= 2 dims, got shape {tuple(scale.shape)}")
    blocks_per_group = group // 32
    nan = scale == 255
    e = torch.where(nan, -127, scale.to(torch.int32) - 127)          # [..., N, B]
    nb = e.shape[-1]
    pad = -nb % blocks_per_group
    e_pad = torch.nn.functional.pad(e, (0, pad), value=-127)
    nan_pad = torch.nn.functional.pad(nan, (0, pad), value=False)
    grouped = e_pad.reshape(*e.shape[:-1], e_pad.shape[-1] // blocks_per_group, blocks_per_group)
    e_max = grouped.amax(-1)                                          # [..., N, G]
    nan_g = nan_pad.reshape(grouped.shape).any(-1)
    if tile_rows == 128:
        n = e_max.shape[-2]
        rpad = -n % 128
        e_max = torch.nn.functional.pad(e_max.transpose(-1, -2), (0, rpad), value=-127).transpose(-1, -2)
        nan_g = torch.nn.functional.pad(nan_g.transpose(-1, -2), (0, rpad), value=False).transpose(-1, -2)
        tiles = e_max.shape[-2] // 128
        groups = e_max.shape[-1]
        e_max = e_max.reshape(*e_max.shape[:-2], tiles, 128, groups).amax(-2)   # [..., Nt, G]
        nan_g = nan_g.reshape(*nan_g.shape[:-2], tiles, 128, groups).any(-2)
    e_ref = (e_max - 6).clamp(min=-126)
    group_scale = torch.where(nan_g, float("nan"), _pow2_f32(e_ref))
    # e_ref per block: [..., N, B]
    ref_b = e_ref
    if tile_rows == 128:
        ref_b = ref_b.repeat_interleave(128, dim=-2)[..., : e.shape[-2], :]
    ref_b = ref_b.repeat_interleave(blocks_per_group, dim=-1)[..., :nb]
    return Fp8FoldPlan(shift=e - ref_b, scale=group_scale, tile_rows=tile_rows)


def mxfp4_to_fp8_block(q: QuantizedTensor, group: int = 128, *, tile_rows: int = 1,
                       strict: bool = False) -> QuantizedTensor:
    """mxfp4 [..., N, K] -> FP8 E4M3 with power-of-two scales: "fp8_group" (1x128 scales,
    tile_rows=1) or "fp8_block" (128x128, tile_rows=128). Exact when every group's block
    exponents span <= 14; otherwise the lowest blocks round (strict=True: ValueError)."""
    if q.fmt != "mxfp4":
        raise ValueError(f"mxfp4_to_fp8_block needs an mxfp4 QuantizedTensor, got {q.fmt!r}")
    check_storage(q)
    plan = mxfp4_fold_plan(q.scale, group, tile_rows=tile_rows)
    vals = e2m1_to_float(unpack_fp4(q.data))                          # [..., N, K]
    mult = _pow2_f32(plan.shift.clamp(min=-126)).repeat_interleave(32, dim=-1)
    target = vals * mult                                              # exact in fp32
    fp8 = target.to(torch.float8_e4m3fn)                              # |target| <= 384: no overflow
    if strict:
        lost = fp8.float() != target
        if lost.any():
            spread = int(plan.shift.amax() - plan.shift.amin())
            raise ValueError(f"mxfp4 -> fp8 fold is inexact for {int(lost.sum())} elements: block exponents "
                             f"within a {tile_rows}x{group} group span more than {EXACT_SPREAD} "
                             f"(largest shift spread {spread}); use strict=False to round them")
    fmt = "fp8_group" if tile_rows == 1 else "fp8_block"
    return QuantizedTensor(fp8, plan.scale, fmt, q.shape)
