"""Fused expert FFN: y = (SwiGLU(x @ W1^T, x @ W3^T)) @ W2^T per expert (docs/numerics.md).

W13 is one [E, 2I, H] weight; its gate and up rows are either split halves (rows [0, I) gate,
[I, 2I) up) or interleaved (row 2i gate, 2i + 1 up); `prepare_weights(w13,
gate_up="interleaved")` reorders to split once at load time so every kernel reads the up tile
at a fixed row offset I from the gate tile. SwiGLU with clamp: g = min(g, L),
u = clamp(u, -L, L), h = g * sigmoid(alpha g) * (u + beta).

Paths (`backend=` as grouped_gemm):
- "torch": the reference: fp32 GEMMs, SwiGLU in fp32, h rounded to x's dtype, fp32 L2.
- "triton_w4a16": L1 with SwiGLU in the kernel's epilogue (h written once, in x's dtype),
  then L2; for many rows per expert both GEMMs run on bf16-expanded weights through
  torch._grouped_mm and SwiGLU runs in between.
- "triton_w4a8": x quantized per token to FP8; L1 (exact FP8 weights) with SwiGLU in its
  epilogue; h quantized per token; L2 (both scales applied once, in the epilogue). The kernels
  can also quantize h to fp8_group inside L1's epilogue (`quant_out=True`), but then L2 must
  rescale every 128-deep partial product, which measured slower than the extra pass.
- "torch_grouped_mm": dense weights, torch._grouped_mm, SwiGLU in torch.
- "deep_gemm": both GEMMs through DeepGEMM (fp8_group activations, h in bf16 between), SwiGLU in torch.
"""

from __future__ import annotations

import torch

from megapar.moe.kernels.grouped_gemm import (
    EXPAND_MIN_ROWS,
    ExpertRows,
    _gemm_grouped_mm,
    expert_rows,
    grouped_gemm_reference,
    quantize_dequantize_act,
    resolve_backend,
)
from megapar.moe.kernels.prepare import PreparedWeight, as_prepared, dequantize_prepared, prepare_weights
from megapar.parallel.quant import QuantizedTensor, dequantize
from megapar.parallel.quant.reference import check_storage


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, limit: float | None = None, alpha: float = 1.0,
           beta: float = 0.0) -> torch.Tensor:
    """g * sigmoid(alpha g) * (u + beta) after the clamp (docs/numerics.md), computed in fp32."""
    g, u = gate.float(), up.float()
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


def _as_w13(w13, gate_up: str) -> PreparedWeight:
    if gate_up not in ("split", "interleaved"):
        raise ValueError(f"gate_up must be 'split' or 'interleaved', got {gate_up!r}")
    if isinstance(w13, PreparedWeight):
        if gate_up == "interleaved" and w13.gate_up != "split":
            raise ValueError("W13 was prepared without gate_up='interleaved'; prepare_weights(w13, "
                             "gate_up='interleaved') reorders it at load time")
        return w13
    if gate_up == "interleaved":
        return prepare_weights(w13, packing="natural", gate_up="interleaved",
                               dtype=w13.dtype if isinstance(w13, torch.Tensor) else torch.bfloat16)
    return as_prepared(w13)


def expert_ffn_reference(x: torch.Tensor, w13: PreparedWeight, w2: PreparedWeight, rows: ExpertRows, *,
                         swiglu_limit: float | None = None, alpha: float = 1.0, beta: float = 0.0,
                         act_quant: str | None = None, h_quant: str | None = None) -> torch.Tensor:
    """fp32 reference (w13 in split order). h is rounded to x's dtype (what the kernels store);
    act_quant / h_quant emulate the W4A8 path: x (resp. h) quantized to that fp8 format and back."""
    xq = quantize_dequantize_act(x, act_quant)
    y1 = grouped_gemm_reference(xq, dequantize_prepared(w13), rows)
    inter = y1.shape[-1] // 2
    h = swiglu(y1[..., :inter], y1[..., inter:], limit=swiglu_limit, alpha=alpha, beta=beta).to(x.dtype)
    h = quantize_dequantize_act(h, h_quant)
    return grouped_gemm_reference(h, dequantize_prepared(w2), rows)


def ffn_backend(backend: str, x: torch.Tensor | torch.device, w13: PreparedWeight, w2: PreparedWeight,
                rows_per_expert: float) -> str:
    """The path `expert_ffn` takes for x (or its device) and rows per expert (the `backend` rules of
    grouped_gemm, then: "auto" leaves triton_w4a8 for triton_w4a16 when w2's FP8 fold is not
    exact, and takes the torch path when the fused FP4 kernels do not fit the weights)."""
    chosen = resolve_backend(backend, x, w13, rows_per_expert)
    if chosen == "triton_w4a8" and backend == "auto" and not w2.fp8_exact:
        chosen = "triton_w4a16"
    if chosen.startswith("triton") and backend == "auto" and not w2.fused_fp4_fits:
        chosen = "torch"
    return chosen


def expert_ffn(x: torch.Tensor | QuantizedTensor, w13: torch.Tensor | QuantizedTensor | PreparedWeight,
               w2: torch.Tensor | QuantizedTensor | PreparedWeight, *, counts: torch.Tensor | None = None,
               offsets: torch.Tensor | None = None, layout: str = "contiguous", swiglu_limit: float | None = None,
               alpha: float = 1.0, beta: float = 0.0, gate_up: str = "split", backend: str = "auto",
               out_dtype: torch.dtype | None = None, rows_hint: float | None = None) -> torch.Tensor:
    """Routed expert FFN over grouped rows.

    x: [M, H] (contiguous) or [E, C, H] (slab); w13: [E, 2I, H]; w2: [E, H, I]; counts [E] /
    offsets [E+1] and rows_hint as in grouped_gemm. Returns [M, H] or [E, C, H] (slab rows >= counts zero)
    in out_dtype (default x's dtype).
    x may also arrive quantized: an fp8_token QuantizedTensor [M, H] (contiguous layout), what
    the W4A8 path would make of bf16 rows. Quantizing per token commutes with gathering rows, so
    a caller can quantize each token once before replicating it to its top-k experts. The W4A8
    path reads it as is. Any other path computes on its dequantized values in bf16, and the
    default out_dtype is bf16.
    """
    p13, p2 = _as_w13(w13, gate_up), as_prepared(w2)
    E, two_i, H = p13.shape
    if p2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"w13 {p13.shape} and w2 {p2.shape} disagree: need w13 [E, 2I, H] and w2 [E, H, I]")
    xq = None
    if isinstance(x, QuantizedTensor):
        if x.fmt != "fp8_token" or len(x.shape) != 2 or layout != "contiguous":
            raise ValueError(f"a quantized x must be an fp8_token QuantizedTensor [M, H] in the contiguous layout; "
                             f"got fmt={x.fmt!r}, shape {tuple(x.shape)}, layout {layout!r}")
        check_storage(x)   # (the W4A8 kernels read data and one fp32 scale per row as they are)
        xq, x = x, x.data
    if x.shape[-1] != H:
        raise ValueError(f"x has H={x.shape[-1]} but w13 is [E={E}, 2I={two_i}, H={H}]")
    rows = expert_rows(x, E, counts, offsets, layout, rows_hint)
    out_dtype = out_dtype or (torch.bfloat16 if xq is not None else x.dtype)
    hint = rows.rows_hint
    chosen = ffn_backend(backend, x, p13, p2, hint)
    act = dict(limit=swiglu_limit, alpha=alpha, beta=beta)
    if chosen == "triton_w4a8":
        return _ffn_w4a8(x if xq is None else xq, p13, p2, rows, act, out_dtype)
    if xq is not None:
        x = dequantize(xq, torch.bfloat16)
    if chosen == "torch":
        y = expert_ffn_reference(x, p13, p2, rows, swiglu_limit=swiglu_limit, alpha=alpha, beta=beta)
        return y.to(out_dtype)
    if chosen == "deep_gemm":   # both GEMMs through DeepGEMM (moe/kernels/deep_gemm.py), SwiGLU between
        from megapar.moe.kernels.deep_gemm import deep_gemm_grouped_gemm

        y1 = deep_gemm_grouped_gemm(x, p13, rows, out_dtype=torch.bfloat16)
        h = swiglu(y1[..., :two_i // 2], y1[..., two_i // 2:], **act).to(torch.bfloat16)
        return deep_gemm_grouped_gemm(h, p2, rows, out_dtype=out_dtype)
    if chosen == "triton_w4a16" and p13.is_fp4 and p2.is_fp4 and hint <= EXPAND_MIN_ROWS:
        from megapar.moe.kernels.triton_w4a16 import launch_w4a16

        h = launch_w4a16(x, p13, rows, out_dtype=x.dtype, swiglu=(swiglu_limit, alpha, beta))
        return launch_w4a16(h, p2, rows, out_dtype=out_dtype)
    y1 = _gemm_grouped_mm(x, p13, rows, torch.bfloat16)
    inter = two_i // 2
    h = swiglu(y1[..., :inter], y1[..., inter:], **act).to(torch.bfloat16)
    return _gemm_grouped_mm(h, p2, rows, out_dtype)


def _ffn_w4a8(x: torch.Tensor | QuantizedTensor, p13: PreparedWeight, p2: PreparedWeight, rows: ExpertRows,
              act: dict, out_dtype: torch.dtype) -> torch.Tensor:
    from megapar.moe.kernels.triton_w4a8 import fp8_grouped_gemm, fp8_weight, quantize_act

    if not (p13.fp8_exact and p2.fp8_exact):
        raise ValueError("triton_w4a8 needs both weights in mxfp4 with an exact FP8 fold, or fp8_block")
    H = p13.k
    if isinstance(x, QuantizedTensor):          # fp8_token rows quantized by the caller
        a, a_scale, x = x.data.contiguous(), x.scale.reshape(-1, 1).contiguous(), x.data
    else:
        a, a_scale = quantize_act(x.reshape(-1, H).contiguous(), group=False)
    b13, s13 = fp8_weight(p13)
    # h leaves L1's epilogue in bf16 and is quantized per token: a per-token scale lets L2 apply
    # both scales once in its epilogue, while fp8_group scales (quant_out=True, fused) force a
    # rescale of every 128-deep partial product, ~2.6x slower on the H200 (bench/gemm-notes.md).
    h = fp8_grouped_gemm(a, a_scale, b13, s13, rows, out_dtype=torch.bfloat16,
                         swiglu=(act["limit"], act["alpha"], act["beta"]))
    hq, h_scale = quantize_act(h, group=False)
    b2, s2 = fp8_weight(p2)
    y = fp8_grouped_gemm(hq, h_scale, b2, s2, rows, out_dtype=out_dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])
