"""Grouped expert GEMM: y[rows of expert e] = x[rows of expert e] @ w[e]^T, one entry point.

Two row layouts (SPEC §5):
- "contiguous": x [M, K], rows grouped by expert; `counts` [E] (rows per expert, in order)
  or `offsets` [E+1] (offsets[0] = 0, offsets[E] <= M). Rows after the last expert's block
  are not computed (a static upper bound M with counts on the device, as the device-driven MoE
  path uses): their output is unspecified (zero in the reference). Output [M, N].
- "slab": x [E, C, K] with `counts` [E]; rows >= counts[e] are ignored and their outputs are
  zero (fixed shapes, CUDA-graph friendly). Output [E, C, N].

Backends (`backend=`):
- "torch": the reference, any device: dequantize the weight, one float64-accumulated matmul
  per expert (batch-invariant), one rounding to the output dtype. CI runs every MoE test
  through it.
- "torch_grouped_mm": dense bf16 weights (quantized ones dequantized first) through
  `torch._grouped_mm` (contiguous) or a batched matmul (slab).
- "triton_w4a16": FP4 weights expanded to 16-bit in registers (moe/kernels/triton_w4a16.py)
  up to EXPAND_MIN_ROWS rows per expert; above, the weight is expanded once to bf16 and
  torch._grouped_mm runs (the expanded tile is then reused by every token tile).
- "triton_w4a8": activations quantized to FP8 (per token), MXFP4 weights expanded exactly to
  FP8 (or fp8_block weights), FP8 tensor-core products (moe/kernels/triton_w4a8.py).
- "deep_gemm": not wired (ANCHORS.md: the probe crashed); asking for it raises.
- "auto": CPU -> torch; CUDA: dense -> torch_grouped_mm; FP4 with <= FUSED_MAX_ROWS rows per
  expert (decode) -> triton_w4a16; MXFP4 with more -> triton_w4a8 when the FP8 fold is exact,
  else triton_w4a16; fp8 -> triton_w4a8. (Rows per expert are known on the host without a
  sync: M / E, or the slab capacity.) H200 numbers behind the thresholds: bench/gemm-notes.md.

GPU paths never synchronize with the host (counts stay on the device); the reference does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch

from moe.kernels.prepare import PreparedWeight, as_prepared, dequantize_prepared, fold_plan
from moe.quant import QuantizedTensor, dequantize, quantize
from moe.quant import _interpreting, _triton_importable as _triton_ok

_log = logging.getLogger(__name__)
_warned: set[str] = set()

Layout = Literal["contiguous", "slab"]
LAYOUTS = ("contiguous", "slab")
BACKENDS = ("auto", "torch", "torch_grouped_mm", "triton_w4a16", "triton_w4a8", "deep_gemm")
# Above this many rows per expert, "auto" leaves the fused W4A16 kernel (weight-bandwidth bound)
# for the compute-bound paths (set from `megapar bench gemm`; bench/gemm-notes.md).
FUSED_MAX_ROWS = int(os.environ.get("MEGAPAR_W4A16_FUSED_MAX_ROWS", "64"))
# triton_w4a16 with more rows per expert than this expands the weight once to bf16 and runs
# torch._grouped_mm (the expanded tile is then reused by every token tile).
EXPAND_MIN_ROWS = int(os.environ.get("MEGAPAR_W4A16_EXPAND_MIN_ROWS", "64"))


def warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(msg)


@dataclass(frozen=True)
class ExpertRows:
    """Which rows of x belong to which expert.

    counts: [E] int (device of x): valid rows per expert.
    offsets: [E+1] int or None (contiguous only): row ranges, offsets[0] = 0, offsets[E] = M.
    capacity: slab rows per expert (0 for contiguous).
    """

    layout: Layout
    num_experts: int
    counts: torch.Tensor
    offsets: torch.Tensor | None
    capacity: int

    def host_ranges(self, num_rows: int) -> list[tuple[int, int]]:
        """[(start, count)] per expert, on the host (syncs); validates the layout."""
        counts = [int(c) for c in self.counts.tolist()]
        if any(c < 0 for c in counts):
            raise ValueError(f"counts must be >= 0, got {counts}")
        if self.layout == "slab":
            if any(c > self.capacity for c in counts):
                raise ValueError(f"slab counts {counts} exceed the capacity {self.capacity}")
            return [(e * self.capacity, c) for e, c in enumerate(counts)]
        if self.offsets is not None:
            offs = [int(o) for o in self.offsets.tolist()]
            if offs[0] != 0 or offs[-1] > num_rows or any(b < a for a, b in zip(offs, offs[1:])):
                raise ValueError(f"offsets must rise from 0 to at most M={num_rows}, got {offs}")
            return [(offs[e], offs[e + 1] - offs[e]) for e in range(self.num_experts)]
        if sum(counts) > num_rows:
            raise ValueError(f"contiguous layout: counts sum to {sum(counts)} but x has only {num_rows} rows")
        starts = [sum(counts[:e]) for e in range(len(counts))]
        return list(zip(starts, counts))


def expert_rows(x: torch.Tensor, num_experts: int, counts: torch.Tensor | None, offsets: torch.Tensor | None,
                layout: str) -> ExpertRows:
    """Validate the layout arguments (shapes only, no sync) -> ExpertRows."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "slab":
        if x.dim() != 3 or x.shape[0] != num_experts:
            raise ValueError(f"slab layout needs x [E={num_experts}, capacity, K], got {tuple(x.shape)}")
        if counts is None or offsets is not None:
            raise ValueError("slab layout needs counts [E] (and no offsets)")
    else:
        if x.dim() != 2:
            raise ValueError(f"contiguous layout needs x [M, K], got {tuple(x.shape)}")
        if (counts is None) == (offsets is None):
            raise ValueError("contiguous layout needs exactly one of counts [E] or offsets [E+1]")
    if offsets is not None:
        offsets = torch.as_tensor(offsets, device=x.device)
        if offsets.shape != (num_experts + 1,) or offsets.is_floating_point():
            raise ValueError(f"offsets must be an int tensor [E+1={num_experts + 1}], got "
                             f"{offsets.dtype}{tuple(offsets.shape)}")
        counts = offsets[1:] - offsets[:-1]
    counts = torch.as_tensor(counts, device=x.device)
    if counts.shape != (num_experts,) or counts.is_floating_point():
        raise ValueError(f"counts must be an int tensor [E={num_experts}], got {counts.dtype}{tuple(counts.shape)}")
    capacity = x.shape[1] if layout == "slab" else 0
    return ExpertRows(layout, num_experts, counts, offsets, capacity)


# ---- reference --------------------------------------------------------------------------------

def quantize_dequantize_act(x: torch.Tensor, act_quant: str | None) -> torch.Tensor:
    """x as the W4A8 kernels see it: fp8_token / fp8_group quantize + dequantize (fp32)."""
    if act_quant is None:
        return x.float()
    if act_quant not in ("fp8_token", "fp8_group"):
        raise ValueError(f"act_quant must be None, 'fp8_token' or 'fp8_group', got {act_quant!r}")
    return dequantize(quantize(x, act_quant, backend="torch"), torch.float32, backend="torch")


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """Reference: x [M, K] or [E, C, K] (any float), w [E, N, K] -> fp32 output, zeros where no
    expert row is. Products accumulate in float64, so a row's result does not depend on how
    many rows its expert has (BLAS blocking in fp32 does): micro-batched and whole runs agree."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros(flat.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for e, (start, count) in enumerate(rows.host_ranges(x.shape[0] if rows.layout == "contiguous" else 0)):
        if count:
            out[start:start + count] = (flat[start:start + count].double() @ w[e].double().t()).float()
    return out.reshape(*x.shape[:-1], w.shape[1])


def _gemm_torch(x: torch.Tensor, w: PreparedWeight, rows: ExpertRows, out_dtype: torch.dtype,
                act_quant: str | None = None) -> torch.Tensor:
    xq = quantize_dequantize_act(x, act_quant)
    return grouped_gemm_reference(xq, dequantize_prepared(w, torch.float32), rows).to(out_dtype)


# ---- torch._grouped_mm --------------------------------------------------------------------------

def dense_weight(w: PreparedWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[E, N, K] in `dtype`: the weight itself when dense, else expanded (Triton on CUDA)."""
    if w.fmt in ("bf16", "fp16", "fp32"):
        return w.data if w.data.dtype == dtype else w.data.to(dtype)
    if w.device.type == "cuda" and w.is_fp4 and _triton_ok():
        from moe.kernels.triton_w4a16 import expand_fp4
        return expand_fp4(w, dtype)
    return dequantize_prepared(w, dtype)


def mask_slab_rows(y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Zero rows >= counts[e] of a slab output y [E, C, N] (in place)."""
    keep = torch.arange(y.shape[1], device=y.device)[None, :] < counts[:, None]
    return y.mul_(keep.unsqueeze(-1).to(y.dtype))


def _gemm_grouped_mm(x: torch.Tensor, w: PreparedWeight, rows: ExpertRows, out_dtype: torch.dtype) -> torch.Tensor:
    wd = dense_weight(w, torch.bfloat16)
    xb = x.to(torch.bfloat16)
    if rows.layout == "slab":
        y = torch.bmm(xb, wd.transpose(1, 2))
        return mask_slab_rows(y, rows.counts).to(out_dtype)
    ends = rows.offsets[1:] if rows.offsets is not None else torch.cumsum(rows.counts, 0)
    y = torch._grouped_mm(xb, wd.transpose(1, 2), offs=ends.to(torch.int32))
    return y.to(out_dtype)


# ---- dispatch ---------------------------------------------------------------------------------

def resolve_backend(backend: str, x: torch.Tensor, w: PreparedWeight, rows_per_expert: float) -> str:
    """The backend that `backend` means for these inputs (ValueError for impossible requests)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "deep_gemm":
        try:
            import deep_gemm  # noqa: F401
        except ImportError:
            raise ValueError("backend='deep_gemm' needs DeepGEMM (pip install deepinfer-gemm; on the H200 "
                             "`source .device-pkgs/install.sh deep_gemm`)") from None
        raise ValueError("backend='deep_gemm' is not wired in this build (its first grouped call crashed "
                         "on the H200 probe, ANCHORS.md); use 'triton_w4a8'")
    if backend in ("triton_w4a16", "triton_w4a8"):
        if backend == "triton_w4a16" and not w.is_fp4 and w.fmt != "bf16":
            raise ValueError(f"triton_w4a16 needs mxfp4/nvfp4 (or bf16) weights, got {w.fmt!r}")
        if backend == "triton_w4a8" and w.fmt not in ("mxfp4", "fp8"):
            raise ValueError(f"triton_w4a8 needs mxfp4 or fp8_block weights (exact FP8), got {w.fmt!r}")
        if not _triton_ok():
            raise ValueError(f"backend={backend!r} needs the triton package (pip install triton)")
        if x.device.type != "cuda" and not _interpreting():
            raise ValueError(f"backend={backend!r} needs CUDA tensors (or TRITON_INTERPRET=1), got {x.device}")
        return backend
    if backend == "torch_grouped_mm" and not hasattr(torch, "_grouped_mm"):
        raise ValueError(f"torch {torch.__version__} has no torch._grouped_mm; use backend='torch'")
    if backend != "auto":
        return backend
    if x.device.type != "cuda":
        return "torch"
    if w.fmt in ("bf16", "fp16"):
        return "torch_grouped_mm" if hasattr(torch, "_grouped_mm") else "torch"
    if w.fmt == "fp32" or not _triton_ok():
        if w.fmt != "fp32":
            warn_once("no-triton", "moe.kernels: triton not importable; quantized expert GEMMs dequantize + "
                                   "torch._grouped_mm")
            return "torch_grouped_mm"
        return "torch"
    if w.fmt == "fp8":
        return "triton_w4a8"
    if not fused_fp4_fits(w):
        return "torch"
    if rows_per_expert <= FUSED_MAX_ROWS:
        return "triton_w4a16"
    if w.fmt == "mxfp4":
        plan = fold_plan(w)
        if plan.rowwise_exact or plan.group_exact:
            return "triton_w4a8"
    return "triton_w4a16"


def fused_fp4_fits(w: PreparedWeight) -> bool:
    """The Triton FP4 kernels expand two scale blocks per step: K must hold a whole number of them
    (tiny test shapes may not; "auto" then takes the dequantizing torch path)."""
    return not w.is_fp4 or w.k % (2 * w.block) == 0


def grouped_gemm(x: torch.Tensor, w: torch.Tensor | QuantizedTensor | PreparedWeight, *,
                 counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 layout: Layout = "contiguous", backend: str = "auto",
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ w[e]^T for the rows of each expert e.

    x: contiguous [M, K] or slab [E, C, K], bf16/fp16/fp32.
    w: [E, N, K]: float tensor, QuantizedTensor (mxfp4 / nvfp4 / fp8_block), or PreparedWeight
        (`prepare_weights`, once at load time: the fast paths want paired FP4 packing).
    counts: [E] int rows per expert; offsets: [E+1] int (contiguous only, instead of counts).
    Returns [M, N] or [E, C, N] in `out_dtype` (default x.dtype); slab rows >= counts are zero.
    """
    pw = as_prepared(w)
    E, N, K = pw.shape
    rows = expert_rows(x, E, counts, offsets, layout)
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but the weight is [E={E}, N={N}, K={K}]")
    out_dtype = out_dtype or x.dtype
    hint = rows.capacity if layout == "slab" else x.shape[0] / max(E, 1)
    chosen = resolve_backend(backend, x, pw, hint)
    if chosen == "torch":
        return _gemm_torch(x, pw, rows, out_dtype)
    if chosen == "torch_grouped_mm":
        return _gemm_grouped_mm(x, pw, rows, out_dtype)
    if chosen == "triton_w4a16":
        if pw.is_fp4 and hint <= EXPAND_MIN_ROWS:
            from moe.kernels.triton_w4a16 import w4a16_grouped_gemm
            return w4a16_grouped_gemm(x, pw, rows, out_dtype=out_dtype)
        return _gemm_grouped_mm(x, pw, rows, out_dtype)
    from moe.kernels.triton_w4a8 import w4a8_grouped_gemm
    return w4a8_grouped_gemm(x, pw, rows, out_dtype=out_dtype)
