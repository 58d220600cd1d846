"""Load-time weight preparation: FP4 checkpoint tensors -> QuantizedTensor, and format conversion.

Checkpoint conventions accepted by `load_fp4_checkpoint` (shapes checked, ValueError otherwise):
- MXFP4 (OCP, e.g. gpt-oss): `weight` packed uint8 [..., N, K/2] (or blocks [..., N, K/32, 16],
  or int8 / float4_e2m1fn_x2 storage), `weight_scale` E8M0 [..., N, K/32] as uint8 or
  float8_e8m0fnu; any E8M0 byte is accepted (the OCP floor rule included).
- NVFP4 (ModelOpt): `weight` packed [..., N, K/2], `weight_scale` E4M3 [..., N, K/16] as
  float8_e4m3fn or uint8, `weight_scale_2` fp32 tensor scale amax/2688 (finite, >= 0): one element,
  or one per matrix ([E] for stacked experts [E, N, K/2]). compressed-tensors stores the reciprocal
  (`weight_global_scale` = 2688/amax): pass `global_scale_is_reciprocal=True`.
Element 2i of a row is the low nibble of byte i in all of them.

`prepare_weight` turns bf16 weights or a loaded QuantizedTensor into the format a GEMM backend
wants, once: quantize, keep, fold MXFP4 exactly into FP8 (W4A8), or dequantize (W16).
"""

from __future__ import annotations

import torch

from megapar.parallel.quant.formats import FORMATS, QuantizedTensor, get_format

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)


def _as_bytes(t: torch.Tensor, what: str, allowed: tuple) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype in tuple(d for d in allowed if d is not None):
        return t.view(torch.uint8)
    names = ", ".join(str(d) for d in (torch.uint8, *allowed) if d is not None)
    raise ValueError(f"{what} has dtype {t.dtype}; valid: {names}")


def load_fp4_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor | float | None = None, *, fmt: str | None = None,
                        global_scale_is_reciprocal: bool = False,
                        device: torch.device | str | None = None) -> QuantizedTensor:
    """FP4 checkpoint tensors -> QuantizedTensor ("mxfp4" or "nvfp4", inferred unless `fmt`).

    weight: [..., N, K/2] packed (or [..., N, K/32, 16] MXFP4 blocks); weight_scale: [..., N, K/32]
    E8M0 or [..., N, K/16] E4M3; weight_scale_2: NVFP4 fp32 tensor scale (scalar or [...]).
    """
    if fmt is not None and fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"fp4 checkpoint format must be 'mxfp4' or 'nvfp4', got {fmt!r}")
    data = _as_bytes(weight, "weight", (torch.int8, _FP4X2))
    if (data.dim() == weight_scale.dim() + 1 and data.shape[-1] == 16
            and tuple(data.shape[:-1]) == tuple(weight_scale.shape)):
        data = data.reshape(*data.shape[:-2], data.shape[-2] * 16)     # gpt-oss [.., N, K/32, 16]
    if fmt is None:
        if weight_scale.dtype == _E8M0 and _E8M0 is not None:
            fmt = "mxfp4"
        elif weight_scale.dtype == torch.float8_e4m3fn:
            fmt = "nvfp4"
        elif weight_scale.dim() >= 1 and weight_scale.shape[-1] > 0 and data.dim() >= 1:
            ratio = 2 * data.shape[-1] // weight_scale.shape[-1]
            fmt = {32: "mxfp4", 16: "nvfp4"}.get(ratio, "nvfp4" if weight_scale_2 is not None else "mxfp4")
        else:
            fmt = "mxfp4"
    allowed = (_E8M0,) if fmt == "mxfp4" else (torch.float8_e4m3fn,)
    scale = _as_bytes(weight_scale, f"{fmt} weight_scale", allowed)
    block = FORMATS[fmt].block[1]
    k = 2 * data.shape[-1] if data.dim() else 0
    if (data.dim() < 1 or scale.dim() != data.dim() or tuple(scale.shape[:-1]) != tuple(data.shape[:-1])
            or scale.shape[-1] * block != k):
        raise ValueError(f"{fmt} checkpoint: weight {tuple(weight.shape)} and weight_scale "
                         f"{tuple(weight_scale.shape)} disagree; need weight [..., N, K/2] and "
                         f"weight_scale [..., N, K/{block}] (one scale per {block} elements)")
    shape = torch.Size((*data.shape[:-1], k))
    gs = None
    if fmt == "mxfp4":
        if weight_scale_2 is not None:
            raise ValueError("mxfp4 has no tensor scale; weight_scale_2 must be None")
    else:
        if weight_scale_2 is None:
            raise ValueError("nvfp4 checkpoint needs weight_scale_2 (fp32 tensor scale)")
        gs = torch.as_tensor(weight_scale_2).to(torch.float32)
        per_matrix = tuple(shape[:-2])
        if gs.numel() == 1:
            gs = gs.reshape(())
        elif tuple(gs.shape) != per_matrix and gs.numel() == max(1, _prod(per_matrix)) and per_matrix:
            gs = gs.reshape(per_matrix)
        elif tuple(gs.shape) != per_matrix or not per_matrix:
            raise ValueError(f"nvfp4 weight_scale_2 has shape {tuple(gs.shape)}; valid: one element, or "
                             f"one per matrix {per_matrix} for weight {tuple(shape)}")
        if global_scale_is_reciprocal:
            gs = 1.0 / gs
        if not gs.is_meta and not bool(((gs >= 0) & torch.isfinite(gs)).all()):   # (0: an all-zero weight)
            given = "1 / weight_scale_2" if global_scale_is_reciprocal else "weight_scale_2"
            raise ValueError(f"nvfp4 checkpoint: {given} must be finite and >= 0; got "
                             f"{gs.flatten()[:8].tolist()}{' ...' if gs.numel() > 8 else ''}")
    q = QuantizedTensor(data.contiguous(), scale.contiguous(), fmt, shape, gs)
    return q.to(device) if device is not None else q


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


PREPARE_TARGETS = (*FORMATS, "bf16", "fp16", "fp32")


def prepare_weight(w: torch.Tensor | QuantizedTensor, fmt: str, *, device: torch.device | str | None = None,
                   **opts) -> QuantizedTensor | torch.Tensor:
    """Weight -> the storage a GEMM backend wants; run once at load time.

    w: [..., N, K] float weight, or a QuantizedTensor (e.g. from `load_fp4_checkpoint`).
    fmt: a format name, or "bf16"/"fp16"/"fp32" for a dequantized dense weight.
    Conversions: float -> quantize(w, fmt, **opts); same format -> unchanged; mxfp4 ->
    fp8_group / fp8_block -> exact fold (`mxfp4_to_fp8_block`, opts: strict); any other pair
    re-quantizes the dequantized values (lossy).
    """
    from megapar.parallel.quant import dequantize, quantize
    from megapar.parallel.quant.fold import mxfp4_to_fp8_block

    if fmt not in PREPARE_TARGETS:
        raise ValueError(f"unknown weight target {fmt!r}; valid: {', '.join(PREPARE_TARGETS)}")
    if device is not None:
        w = w.to(device)
    dense = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if isinstance(w, torch.Tensor):
        return w.to(dense[fmt]).contiguous() if fmt in dense else quantize(w.contiguous(), fmt, **opts)
    get_format(w.fmt)
    if fmt in dense:
        return dequantize(w, dense[fmt])
    if fmt == w.fmt:
        return w
    if w.fmt == "mxfp4" and fmt in ("fp8_group", "fp8_block"):
        return mxfp4_to_fp8_block(w, tile_rows=1 if fmt == "fp8_group" else 128, **opts)
    return quantize(dequantize(w, torch.float32), fmt, **opts)
