"""FP8-aware sequence parallelism: quantize the token shard, gather fp8, run scaled matmuls.

When the GEMM after the all-gather runs in FP8 anyway, quantizing *before* the gather moves
1 byte a value instead of 2 (plus 4 bytes of scale a token), and quantizes T / P tokens per
rank instead of T. In the SP region the sequence is RMSNorm -> per-token quantize -> gather
(`rms_norm_quantize_fp8` on the shard, then `all_gather_matmul_fp8` or
`rms_norm_quantize_all_gather`), so quantization does not undo the saving.

Formats: activations FP8 E4M3 with one fp32 scale per token (`x ~= data * scale`, scale =
amax / 448); weights FP8 E4M3 [K, N] stored column-major with one fp32 scale per output
column, which is what `torch._scaled_mm`'s row-wise mode takes. On CUDA the matmul is
`torch._scaled_mm` (bf16 output); elsewhere the reference: dequantize both to fp32 and
multiply (bit-for-bit the same products the decomposed and reference backends see).

This tiny quantizer lives here, not in `moe.quant` (which has an "fp8_token" format too),
because dependencies point `moe -> parallel`: `parallel` may not import `moe`.

Tolerance: E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4, ~2^-4/sqrt(3)
rms), so a product of quantized activations and weights differs from the fp32 product by a
relative Frobenius error of about 0.035 on random data; the tests bound it by `FP8_REL_TOL`.
Against a reference computed from the same quantized values the backends agree to fp32
rounding. No autograd here (inference / forward of FP8 training recipes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..comm import all_gather_uneven, reduce_scatter_uneven, resolve_group, to_wire
from ..groups import Group
from .ops import Backend, check_dim, resolve_backend, rows_view, symm_mem_group_name
from .ring import RingPeers, pairwise_reduce_scatter, ring_all_gather

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_REL_TOL = 0.06
"""Relative Frobenius error bound of an fp8 product against fp32 used by the tests (documented above)."""

GroupLike = Group | dist.ProcessGroup | None


@dataclass
class Fp8Activation:
    """Per-token FP8 activations: x ~= data * scale."""

    data: torch.Tensor
    """[..., K] float8_e4m3fn"""
    scale: torch.Tensor
    """[..., 1] float32, one scale per token"""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale).to(dtype)


@dataclass
class Fp8Weight:
    """FP8 weight with one scale per output column: w ~= data * scale."""

    data: torch.Tensor
    """[K, N] float8_e4m3fn, column-major (data.t() is contiguous)"""
    scale: torch.Tensor
    """[1, N] float32"""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale).to(dtype)


@dataclass
class Fp8GatherMatmulResult:
    """What `all_gather_matmul_fp8` returns."""

    outputs: list[torch.Tensor]
    """[..., P * m, ..., N_i] per weight, out_dtype"""
    gathered: Fp8Activation | None
    """the gathered fp8 input, when asked for"""


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_fp8_per_token(x: torch.Tensor) -> Fp8Activation:
    """x: [..., K] float -> E4M3 data [..., K] and fp32 scales [..., 1] (all-zero tokens get a tiny scale)."""
    if not x.is_floating_point() or x.element_size() < 2:
        raise ValueError(f"quantize_fp8_per_token: x must be fp16/bf16/fp32/fp64, got {x.dtype}")
    xf = x.float()
    scale = _amax_scale(xf.abs().amax(dim=-1, keepdim=True))
    return Fp8Activation((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale)


def quantize_fp8_weight(w: torch.Tensor) -> Fp8Weight:
    """w: [K, N] float -> E4M3 [K, N] column-major with fp32 scales [1, N] (amax of each column / 448)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_weight: w must be a float [K, N] matrix, got {w.dtype} {tuple(w.shape)}")
    wt = w.t().float()  # [N, K]; quantized contiguous, so data = wt_q.t() is column-major
    scale = _amax_scale(wt.abs().amax(dim=1, keepdim=True))  # [N, 1]
    data = (wt / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous().t()
    return Fp8Weight(data, scale.t().contiguous())


def rms_norm_quantize_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> Fp8Activation:
    """RMSNorm (fp32 math) then per-token FP8: x [..., H] float, weight [H] -> Fp8Activation [..., H]."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_quantize_fp8: weight has shape {tuple(weight.shape)}, expected "
                         f"[{x.shape[-1]}] for x of shape {tuple(x.shape)}")
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    return quantize_fp8_per_token(normed)


def scaled_matmul(a: Fp8Activation, w: Fp8Weight, out_dtype: torch.dtype = torch.bfloat16,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(a.data * a.scale) @ (w.data * w.scale): a [M, K], w [K, N] -> [M, N] out_dtype (into `out` if given).

    CUDA with bf16 output: `torch._scaled_mm` with row-wise scales. Otherwise the fp32 reference.
    """
    if a.data.is_cuda and out_dtype == torch.bfloat16:
        args = (a.data, w.data, a.scale, w.scale)
        if out is None:
            return torch._scaled_mm(*args, out_dtype=out_dtype)
        return torch.ops.aten._scaled_mm.out(*args, out_dtype=out_dtype, out=out)
    res = a.dequantize() @ w.dequantize()
    if out is None:
        return res.to(out_dtype)
    return out.copy_(res)


def _check_fp8_operands(op: str, a: Fp8Activation, weights: Sequence[Fp8Weight]) -> None:
    if a.data.dtype != FP8_DTYPE or a.scale.shape != a.data.shape[:-1] + (1,):
        raise ValueError(f"{op}: activations must be {FP8_DTYPE} [..., K] with fp32 scales [..., 1], got "
                         f"{a.data.dtype} {tuple(a.data.shape)} and scales {tuple(a.scale.shape)}")
    if a.data.dim() < 2:
        raise ValueError(f"{op}: x must have at least 2 dims [..., K], got shape {tuple(a.data.shape)}")
    if len(weights) == 0:
        raise ValueError(f"{op}: at least one weight is needed")
    k = a.data.shape[-1]
    for i, w in enumerate(weights):
        if not isinstance(w, Fp8Weight) or w.data.dtype != FP8_DTYPE:
            raise ValueError(f"{op}: weight {i} must be an Fp8Weight (see quantize_fp8_weight)")
        if w.data.dim() != 2 or w.data.shape[0] != k:
            raise ValueError(f"{op}: weight {i} has shape {tuple(w.data.shape)}, expected [K={k}, N]")
        if a.data.is_cuda and (k % 16 or w.data.shape[1] % 16):
            raise ValueError(f"{op}: torch._scaled_mm needs K ({k}) and N ({w.data.shape[1]}) divisible by 16")


def _as_fp8(x: torch.Tensor | Fp8Activation) -> Fp8Activation:
    return x if isinstance(x, Fp8Activation) else quantize_fp8_per_token(x)


def all_gather_fp8(q_shard: Fp8Activation, group: GroupLike, *, gather_dim: int = 0) -> Fp8Activation:
    """Gather fp8 token shards (data as uint8 on the wire, scales as fp32): [.., m, ..] -> [.., P * m, ..]."""
    _, _, size = resolve_group(group)
    m = q_shard.data.shape[gather_dim]
    data = all_gather_uneven(q_shard.data, group, gather_dim, sizes=[m] * size)
    scale = all_gather_uneven(q_shard.scale, group, gather_dim, sizes=[m] * size)
    return Fp8Activation(data, scale)


def rms_norm_quantize_all_gather(x_shard: torch.Tensor, norm_weight: torch.Tensor, group: GroupLike, *,
                                 eps: float = 1e-6, gather_dim: int = 0) -> Fp8Activation:
    """The SP-region sequence: RMSNorm and quantize this rank's tokens, then gather the fp8 bytes.

    x_shard: [..., m, ..., H] float; norm_weight: [H] -> Fp8Activation [..., P * m, ..., H].
    """
    q = rms_norm_quantize_fp8(x_shard, norm_weight, eps)
    return all_gather_fp8(q, group, gather_dim=check_dim(q.data, gather_dim, "gather_dim"))


def all_gather_matmul_fp8(x_shard: torch.Tensor | Fp8Activation, weights: Sequence[Fp8Weight], group: GroupLike,
                          *, gather_dim: int = 0, return_gathered: bool = False,
                          out_dtype: torch.dtype = torch.bfloat16, backend: Backend = "auto") -> Fp8GatherMatmulResult:
    """`[all_gather(q) @ w for w in weights]` with q the per-token FP8 of x_shard, gathered in fp8.

    x_shard: [..., m, ..., K] float (quantized here, before the gather) or an Fp8Activation
    (e.g. from `rms_norm_quantize_fp8`). weights: Fp8Weight [K, N_i] each. Backends as in
    `all_gather_matmul` ("symm_mem" uses `torch.ops.symm_mem.fused_all_gather_scaled_matmul`).
    """
    q = _as_fp8(x_shard)
    weights = list(weights)
    _check_fp8_operands("all_gather_matmul_fp8", q, weights)
    gather_dim = check_dim(q.data, gather_dim, "gather_dim")
    chosen = resolve_backend(backend, q.data, group)
    _, _, size = resolve_group(group)
    if chosen == "local":
        outs = [_scaled_matmul_nd(q, w, out_dtype) for w in weights]
        return Fp8GatherMatmulResult(outs, q if return_gathered else None)
    if chosen == "symm_mem":
        n = len(weights)
        data, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            q.data, [w.data for w in weights], q.scale, [w.scale for w in weights], gather_dim,
            symm_mem_group_name(group), [None] * n, [None] * n, [out_dtype] * n, [False] * n)
        gathered = None
        if return_gathered:  # the fused op returns the data only; the scales are 4 bytes a token
            m = q.scale.shape[gather_dim]
            gathered = Fp8Activation(data, all_gather_uneven(q.scale, group, gather_dim, sizes=[m] * size))
        return Fp8GatherMatmulResult(list(outs), gathered)

    data2d, unflatten = rows_view(q.data, gather_dim)
    scale2d, _ = rows_view(q.scale, gather_dim)
    m = data2d.shape[0]
    if chosen == "reference" or data2d.numel() == 0:
        full = all_gather_fp8(Fp8Activation(data2d, scale2d), group)
        outs2d = [scaled_matmul(full, w, out_dtype) for w in weights]
        full_data, full_scale = full.data, full.scale
    else:
        outs2d = [data2d.new_empty((size * m, w.data.shape[1]), dtype=out_dtype) for w in weights]
        out_blocks = [o.view(size, m, -1) for o in outs2d]

        def consume(src: int, blocks: list[torch.Tensor]) -> None:
            a = Fp8Activation(blocks[0].view(FP8_DTYPE), blocks[1])
            for w, ob in zip(weights, out_blocks):
                scaled_matmul(a, w, out_dtype, out=ob[src])

        wire, full_scale = ring_all_gather([to_wire(data2d), scale2d], RingPeers.of(group), consume,
                                           fill_own=return_gathered)
        full_data = wire.view(FP8_DTYPE)
    gathered = Fp8Activation(unflatten(full_data), unflatten(full_scale)) if return_gathered else None
    return Fp8GatherMatmulResult([unflatten(o) for o in outs2d], gathered)


def matmul_reduce_scatter_fp8(x: torch.Tensor | Fp8Activation, weight: Fp8Weight, group: GroupLike, *,
                              scatter_dim: int = 0, out_dtype: torch.dtype = torch.bfloat16,
                              backend: Backend = "auto") -> torch.Tensor:
    """`reduce_scatter(q @ weight)` with q the per-token FP8 of x; partial sums travel in out_dtype.

    x: [..., M, ..., K] float or Fp8Activation, M divisible by P; weight: Fp8Weight [K, N].
    Backends "decomposed" and "reference" ("auto" and "symm_mem" run "decomposed": the fused
    symmetric-memory scaled variant is not wired here).
    """
    q = _as_fp8(x)
    _check_fp8_operands("matmul_reduce_scatter_fp8", q, [weight])
    scatter_dim = check_dim(q.data, scatter_dim, "scatter_dim")
    chosen = resolve_backend("decomposed" if backend in ("auto", "symm_mem") else backend, q.data, group)
    _, _, size = resolve_group(group)
    if q.data.shape[scatter_dim] % size:
        raise ValueError(f"matmul_reduce_scatter_fp8: x.shape[{scatter_dim}] = {q.data.shape[scatter_dim]} is not "
                         f"divisible by the group size {size}; pad it first (parallel.sp.sp_pad)")
    if chosen == "local":
        return _scaled_matmul_nd(q, weight, out_dtype)
    data2d, unflatten = rows_view(q.data, scatter_dim)
    scale2d, _ = rows_view(q.scale, scatter_dim)
    m = data2d.shape[0] // size
    if chosen == "reference" or data2d.numel() == 0:
        y2d = scaled_matmul(Fp8Activation(data2d, scale2d), weight, out_dtype)
        y2d = reduce_scatter_uneven(y2d, [m] * size, group, 0)
    else:
        def produce(d: int, out: torch.Tensor) -> None:
            scaled_matmul(Fp8Activation(data2d[d * m:(d + 1) * m], scale2d[d * m:(d + 1) * m]), weight, out_dtype,
                          out=out)

        y2d = pairwise_reduce_scatter(produce, RingPeers.of(group), data2d.new_empty((), dtype=out_dtype),
                                      (m, weight.data.shape[1]))
    return unflatten(y2d)


def _scaled_matmul_nd(q: Fp8Activation, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    data2d, unflatten = rows_view(q.data, 0)
    scale2d, _ = rows_view(q.scale, 0)
    return unflatten(scaled_matmul(Fp8Activation(data2d, scale2d), w, out_dtype))
