"""Grouped expert GEMM: y[rows of expert e] = x[rows of expert e] @ w[e]^T, one entry point.

Two row layouts (docs/numerics.md):
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
- "deep_gemm": DeepGEMM's SM90 FP8 grouped GEMMs (moe/kernels/deep_gemm.py): activations
  quantized to fp8_group, weights in an exact 128x128-block FP8 form made once; contiguous ->
  `m_grouped_fp8_gemm_nt_contiguous`, slab -> `m_grouped_fp8_gemm_nt_masked`. Opt-in: "auto"
  skips it unless MEGAPAR_DEEP_GEMM_AUTO=1.
- "auto": CPU -> torch; CUDA: dense -> torch_grouped_mm; FP4 with <= FUSED_MAX_ROWS rows per
  expert (decode) -> triton_w4a16; MXFP4 with more -> triton_w4a8 when the FP8 fold is exact,
  else triton_w4a16; fp8 -> triton_w4a8. (Rows per expert are known on the host without a
  sync: M / E, or the slab capacity.) H200 numbers behind the thresholds: bench/gemm-notes.md.

GPU paths never synchronize with the host (counts stay on the device); the reference does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from megapar.moe.kernels import deep_gemm as _deep_gemm
from megapar.moe.kernels.prepare import PreparedWeight, as_prepared, dequantize_prepared
from megapar.parallel import impl
from megapar.parallel.quant import QuantizedTensor, dequantize, quantize

Layout = Literal["contiguous", "slab"]
LAYOUTS = ("contiguous", "slab")
# Above this many rows per expert, "auto" leaves the fused W4A16 kernel (weight-bandwidth bound)
# for the compute-bound paths (set from `megapar bench gemm`; bench/gemm-notes.md).
# H200, MoE layer (bench/results/moe-h200.md, 2026-12-01): the fused kernel at 48-64 rows per
# expert took 3.1 ms (V4-Flash T=256) and 7.9 ms (V3 T=256) where W4A8 at 192 rows took 1.2 / 2.1 ms.
FUSED_MAX_ROWS = int(os.environ.get("MEGAPAR_W4A16_FUSED_MAX_ROWS", "32"))
# triton_w4a16 with more rows per expert than this expands the weight once to bf16 and runs
# torch._grouped_mm (the expanded tile is then reused by every token tile).
EXPAND_MIN_ROWS = int(os.environ.get("MEGAPAR_W4A16_EXPAND_MIN_ROWS", "64"))


@dataclass(frozen=True)
class ExpertRows:
    """Which rows of x belong to which expert.

    counts: [E] int (device of x): valid rows per expert.
    offsets: [E+1] int or None (contiguous only): row ranges, offsets[0] = 0, offsets[E] = M.
    capacity: slab rows per expert (0 for contiguous).
    rows_hint: expected rows per expert, known on the host without a sync, which picks kernels
        and launch settings: the caller's `rows_hint`, else M / E (contiguous) or the capacity
        (slab, which may be far above the counts in a decode slab sized for the worst case).
    """

    layout: Layout
    num_experts: int
    counts: torch.Tensor
    offsets: torch.Tensor | None
    capacity: int
    rows_hint: float = 0.0

    def host_ranges(self, num_rows: int) -> list[tuple[int, int]]:
        """[(start, count)] per expert, on the host (syncs); validates the layout."""
        if self.layout == "contiguous" and self.offsets is not None:
            offs = [int(o) for o in self.offsets.tolist()]
            if offs[0] != 0 or offs[-1] > num_rows or any(b < a for a, b in zip(offs, offs[1:])):
                raise ValueError(f"offsets must rise from 0 to at most M={num_rows}, got {offs}")
            return [(offs[e], offs[e + 1] - offs[e]) for e in range(self.num_experts)]
        counts = [int(c) for c in self.counts.tolist()]
        if any(c < 0 for c in counts):
            raise ValueError(f"counts must be >= 0, got {counts}")
        if self.layout == "slab":
            if any(c > self.capacity for c in counts):
                raise ValueError(f"slab counts {counts} exceed the capacity {self.capacity}")
            return [(e * self.capacity, c) for e, c in enumerate(counts)]
        if sum(counts) > num_rows:
            raise ValueError(f"contiguous layout: counts sum to {sum(counts)} but x has only {num_rows} rows")
        starts = [sum(counts[:e]) for e in range(len(counts))]
        return list(zip(starts, counts))


def expert_rows(x: torch.Tensor, num_experts: int, counts: torch.Tensor | None, offsets: torch.Tensor | None,
                layout: str, rows_hint: float | None = None) -> ExpertRows:
    """Validate the layout arguments -> ExpertRows (counts / offsets on x's device).

    Shapes always. Values (counts >= 0 and within M or the slab capacity, offsets rising from 0
    to at most M) when counts / offsets are on the host (a list, or a CPU tensor), where reading
    them syncs nothing: the Triton kernels trust the counts they read, and rows past M would be
    read and written out of bounds. Counts already on the device are not read (no sync): the
    caller vouches for them (the slab kernels clamp them to the capacity)."""
    if rows_hint is not None and (isinstance(rows_hint, bool) or not isinstance(rows_hint, (int, float))
                                  or not rows_hint >= 0):
        raise ValueError(f"rows_hint must be a number of rows per expert >= 0, got {rows_hint!r}")
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
    given = offsets if offsets is not None else counts
    on_host = not isinstance(given, torch.Tensor) or given.device.type == "cpu"
    if offsets is not None:
        offsets = torch.as_tensor(offsets)
        if offsets.shape != (num_experts + 1,) or offsets.is_floating_point():
            raise ValueError(f"offsets must be an int tensor [E+1={num_experts + 1}], got "
                             f"{offsets.dtype}{tuple(offsets.shape)}")
        counts = offsets[1:] - offsets[:-1]
    counts = torch.as_tensor(counts)
    if counts.shape != (num_experts,) or counts.is_floating_point():
        raise ValueError(f"counts must be an int tensor [E={num_experts}], got {counts.dtype}{tuple(counts.shape)}")
    capacity = x.shape[1] if layout == "slab" else 0
    if on_host:   # (host values: checked before any kernel reads them, ValueError naming them)
        ExpertRows(layout, num_experts, counts, offsets, capacity).host_ranges(
            x.shape[0] if layout == "contiguous" else 0)
    counts = counts.to(x.device)
    offsets = offsets.to(x.device) if offsets is not None else None
    if rows_hint is None:
        rows_hint = capacity if layout == "slab" else x.shape[0] / max(num_experts, 1)
    return ExpertRows(layout, num_experts, counts, offsets, capacity, float(rows_hint))


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
    if w.device.type == "cuda" and w.is_fp4 and impl.triton_importable():
        from megapar.moe.kernels.triton_w4a16 import expand_fp4
        return expand_fp4(w, dtype)
    return dequantize_prepared(w, dtype)


def mask_slab_rows(y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Zero rows >= counts[e] of a slab output y [E, C, N] (in place). A fill, not a product
    with 0: padding rows may hold inf/NaN (the slab's unused rows are not read as data)."""
    keep = torch.arange(y.shape[1], device=y.device)[None, :] < counts[:, None]
    return y.masked_fill_(~keep.unsqueeze(-1), 0)


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
# One op in parallel.impl. The checks read the facts `weight` (PreparedWeight), `rows_per_expert`
# and `asked` (named explicitly; absent in impl.report(), where only capabilities count): a named backend needs only what it can run on; "auto" also
# applies the preferences of the module docstring (the order below is the order of preference).

def _w4a8_check(f: impl.Facts) -> impl.Unusable | None:
    w: PreparedWeight | None = f.weight
    if w is None:                        # (impl.report(): no inputs, only capabilities)
        return None
    if w.fmt not in ("mxfp4", "fp8"):
        return impl.Unusable(f"triton_w4a8 needs mxfp4 or fp8_block weights (exact FP8), got {w.fmt!r}")
    if f.asked or w.fmt == "fp8":
        return None
    if not w.fused_fp4_fits:
        return impl.Unusable(f"K ({w.k}) is not a whole number of scale-block pairs")
    if f.rows_per_expert <= FUSED_MAX_ROWS:
        return impl.Unusable(f"{f.rows_per_expert:g} rows per expert <= {FUSED_MAX_ROWS}: the fused W4A16 kernel")
    if not w.fp8_exact:
        return impl.Unusable("this mxfp4 weight has no exact FP8 fold")
    return None


def _w4a16_check(f: impl.Facts) -> impl.Unusable | None:
    w: PreparedWeight | None = f.weight
    if w is None:                        # (impl.report(): no inputs, only capabilities)
        return None
    if not w.is_fp4 and w.fmt != "bf16":
        return impl.Unusable(f"triton_w4a16 needs mxfp4/nvfp4 (or bf16) weights, got {w.fmt!r}")
    if f.asked:
        return None
    if not w.is_fp4:
        return impl.Unusable("dense weights take torch._grouped_mm")
    if not w.fused_fp4_fits:
        return impl.Unusable(f"K ({w.k}) is not a whole number of scale-block pairs")
    return None


def _grouped_mm_check(f: impl.Facts) -> impl.Unusable | None:
    if not hasattr(torch, "_grouped_mm"):
        return impl.Unusable(f"torch {torch.__version__} has no torch._grouped_mm; use backend='torch'")
    w: PreparedWeight | None = f.weight
    if w is None or f.asked or w.fmt in ("bf16", "fp16"):
        return None
    if w.fmt != "fp32" and not impl.triton_importable():   # quantized weights without Triton: dequantize
        return None
    return impl.Unusable(f"{w.fmt} weights take the {'torch reference' if w.fmt == 'fp32' else 'Triton kernels'}")


GEMM = impl.Op("moe.grouped_gemm", [
    # The Triton and DeepGEMM kernels have no backward: under autograd "auto" passes them over and
    # asking for one by name raises (their output would carry no gradient to x).
    impl.Impl("triton_w4a8", impl.all_of(impl.forward_only, _w4a8_check, impl.triton_kernel(impl.cuda_unless_asked))),
    impl.Impl("triton_w4a16", impl.all_of(impl.forward_only, _w4a16_check,
                                          impl.triton_kernel(impl.cuda_unless_asked))),
    impl.Impl("torch_grouped_mm", impl.all_of(_grouped_mm_check, impl.cuda_unless_asked)),
    # DeepGEMM FP8 (moe/kernels/deep_gemm.py): asked for by name; "auto" only with MEGAPAR_DEEP_GEMM_AUTO=1
    impl.Impl("deep_gemm", impl.all_of(impl.forward_only, _deep_gemm.check), auto=_deep_gemm.AUTO),
    impl.Impl("torch"),
])
BACKENDS = GEMM.names


def fused_fp4_fits(w: PreparedWeight) -> bool:
    """Deprecated alias of `PreparedWeight.fused_fp4_fits`."""
    return w.fused_fp4_fits


def resolve_backend(backend: str, x: torch.Tensor | torch.device, w: PreparedWeight, rows_per_expert: float) -> str:
    """The backend that `backend` means for these inputs (x, or just its device; ValueError for
    impossible requests)."""
    if isinstance(x, torch.device):     # (a question about a device: autograd unknown, taken as off)
        return GEMM.resolve(backend, device=x, weight=w, rows_per_expert=rows_per_expert)
    return GEMM.resolve(backend, device=x.device, weight=w, rows_per_expert=rows_per_expert,
                        needs_grad=impl.grad_needed(x, w.data))


def grouped_gemm(x: torch.Tensor, w: torch.Tensor | QuantizedTensor | PreparedWeight, *,
                 counts: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 layout: Layout = "contiguous", backend: str = "auto",
                 out_dtype: torch.dtype | None = None, rows_hint: float | None = None) -> torch.Tensor:
    """y = x @ w[e]^T for the rows of each expert e.

    x: contiguous [M, K] or slab [E, C, K], bf16/fp16/fp32.
    w: [E, N, K]: float tensor, QuantizedTensor (mxfp4 / nvfp4 / fp8_block), or PreparedWeight
        (`prepare_weights`, once at load time: the fast paths want paired FP4 packing).
    counts: [E] int rows per expert; offsets: [E+1] int (contiguous only, instead of counts).
    rows_hint: expected rows per expert, for the choice of kernel and launch settings (default
        M / E, or the slab capacity; a decode slab sized for the worst case wants the expected
        count: the kernels skip empty tiles on the device either way. H200, V3 L1, C = 128, 8 rows
        per expert: 240 µs with rows_hint=8, 1285 without; bench/results/gemm-h200.md). An EP slab
        dispatch gives its estimate as `DispatchResult.rows_hint`.
    Returns [M, N] or [E, C, N] in `out_dtype` (default x.dtype); slab rows >= counts are zero.
    """
    pw = as_prepared(w)
    E, N, K = pw.shape
    rows = expert_rows(x, E, counts, offsets, layout, rows_hint)
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but the weight is [E={E}, N={N}, K={K}]")
    out_dtype = out_dtype or x.dtype
    hint = rows.rows_hint
    chosen = resolve_backend(backend, x, pw, hint)
    if chosen == "torch":
        return _gemm_torch(x, pw, rows, out_dtype)
    if chosen == "torch_grouped_mm":
        return _gemm_grouped_mm(x, pw, rows, out_dtype)
    if chosen == "deep_gemm":
        return _deep_gemm.deep_gemm_grouped_gemm(x, pw, rows, out_dtype=out_dtype)
    if chosen == "triton_w4a16":
        if pw.is_fp4 and hint <= EXPAND_MIN_ROWS:
            from megapar.moe.kernels.triton_w4a16 import w4a16_grouped_gemm
            return w4a16_grouped_gemm(x, pw, rows, out_dtype=out_dtype)
        return _gemm_grouped_mm(x, pw, rows, out_dtype)
    from megapar.moe.kernels.triton_w4a8 import w4a8_grouped_gemm
    return w4a8_grouped_gemm(x, pw, rows, out_dtype=out_dtype)
