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

The quantizer is `parallel.quant`'s "fp8_token" format (one amax floor, one E4M3_MAX for every
package): activations are fp8_token of x, weights fp8_token of w^T (one scale per output column).

Tolerance: E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4, ~2^-4/sqrt(3)
rms), so a product of quantized activations and weights differs from the fp32 product by a
relative Frobenius error of about 0.035 on random data; the tests bound it by `FP8_REL_TOL`.
Against a reference computed from the same quantized values the backends agree to fp32
rounding.

Autograd (the recipe of Float8 training, e.g. torchao's Float8Linear, with a high-precision
backward): `all_gather_matmul_fp8`, `matmul_reduce_scatter_fp8` and
`rms_norm_quantize_all_gather` are differentiable when given high-precision tensors that
require grad (x as a float tensor; weights as float [K, N] tensors, quantized here with
`quantize_fp8_weight`). The forward is exactly the fp8 forward above. The backward treats
each quantize -> dequantize as the identity (straight-through estimator, STE) and computes
in the input's high-precision dtype from the *dequantized* fp8 operands saved by the
forward (1 byte a value kept, not the float input):
    y = deq(q(x)) @ deq(q(w))   =>   dx = dy @ deq(q(w))^T,   dw = deq(q(x))^T @ dy.
The input gradient of all-gather-matmul is a (high-precision) matmul-reduce-scatter of the
output gradient, and that of matmul-reduce-scatter an all-gather-matmul, both run by the
engines of `ops.py` (same backend choice; "symm_mem" where available). The weight gradient
of all-gather-matmul re-gathers the fp8 shard (half the bytes) unless it was returned.
Inputs given already quantized (`Fp8Activation`, `Fp8Weight`) receive no gradient; the
quantizers themselves (`quantize_fp8_per_token`, ...) are not differentiable. Calls with no
gradient needed (no_grad, or nothing requires grad) run the plain forward, unchanged.

Agreement (CPU tensors, as in `ops.py`, `shard.agree_call`): every public op here first agrees
with the group on the fp8 shard's shape, its scales' dtype, the dim, the backend, the dtypes that
travel (out_dtype for the partial sums, x's high-precision dtype in backward) and which inputs
require grad; a rank that differs, or has bad arguments, makes every rank raise ValueError
before anything moves. CUDA skips that host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm import GroupLike, all_gather_uneven, as_group, dtype_code, reduce_scatter_uneven, to_wire
from ..quant import E4M3_MAX as FP8_MAX  # noqa: F401  (the old name)
from ..quant import quantize
from .ops import (
    BACKEND_FIELD,
    Backend,
    _all_gather_matmul_impl,
    _matmul_reduce_scatter_impl,
    _weight_grad,
    backend_code,
    check_dim,
    resolve_backend,
    rows_view,
    symm_mem_group_name,
)
from .ring import RingPeers, pairwise_reduce_scatter, ring_all_gather
from .shard import UNEVEN_HINT, agree_call, grad_code, shape_fields, shape_names

FP8_DTYPE = torch.float8_e4m3fn
FP8_REL_TOL = 0.06
"""Relative Frobenius error bound of an fp8 product against fp32 used by the tests (documented above)."""



@dataclass
class Fp8Activation:
    """Per-token FP8 activations: x ~= data * scale."""

    data: torch.Tensor
    """[..., K] float8_e4m3fn"""
    scale: torch.Tensor
    """[..., 1] float32, one scale per token"""
    ste: torch.Tensor | None = None
    """[..., K] float32 equal to data * scale and attached to the autograd graph of the
    high-precision input through the straight-through estimator; set only by a differentiable
    producer (`rms_norm_quantize_all_gather` with an input that requires grad), else None"""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale in dtype; differentiable (STE) when `ste` is set."""
        if self.ste is not None:
            return self.ste.to(dtype)
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


def quantize_fp8_per_token(x: torch.Tensor) -> Fp8Activation:
    """x: [..., K] float -> E4M3 data [..., K] and fp32 scales [..., 1] (parallel.quant "fp8_token";
    all-zero tokens get the amax floor's scale)."""
    if not x.is_floating_point() or x.element_size() < 2:
        raise ValueError(f"quantize_fp8_per_token: x must be fp16/bf16/fp32/fp64, got {x.dtype}")
    q = quantize(x, "fp8_token", backend="torch")
    return Fp8Activation(q.data, q.scale)


def quantize_fp8_weight(w: torch.Tensor) -> Fp8Weight:
    """w: [K, N] float -> E4M3 [K, N] column-major with fp32 scales [1, N] (amax of each column / 448)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8_weight: w must be a float [K, N] matrix, got {w.dtype} {tuple(w.shape)}")
    q = quantize(w.t(), "fp8_token", backend="torch")   # [N, K], scale [N, 1]: one per output column
    return Fp8Weight(q.data.contiguous().t(), q.scale.t().contiguous())


def rms_norm_quantize_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> Fp8Activation:
    """RMSNorm (fp32 math) then per-token FP8: x [..., H] float, weight [H] -> Fp8Activation [..., H]."""
    return quantize_fp8_per_token(_rms_norm_fp32("rms_norm_quantize_fp8", x, weight, eps))


def _rms_norm_fp32(op: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] float, weight [H] -> RMSNorm(x) * weight [..., H] float32 (differentiable torch ops)."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{op}: weight has shape {tuple(weight.shape)}, expected "
                         f"[{x.shape[-1]}] for x of shape {tuple(x.shape)}")
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def _scaled_mm_ok(a: Fp8Activation, out_dtype: torch.dtype) -> bool:
    """`scaled_matmul` may use torch._scaled_mm: CUDA, bf16 out, no straight-through gradient asked for."""
    wants_grad = a.ste is not None and a.ste.requires_grad and torch.is_grad_enabled()
    return a.data.is_cuda and out_dtype == torch.bfloat16 and not wants_grad


def scaled_matmul(a: Fp8Activation, w: Fp8Weight, out_dtype: torch.dtype = torch.bfloat16,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """(a.data * a.scale) @ (w.data * w.scale): a [M, K], w [K, N] -> [M, N] out_dtype (into `out` if given).

    CUDA with bf16 output: `torch._scaled_mm` with row-wise scales. Otherwise the fp32 reference,
    which is also taken where `a` carries a straight-through gradient (`ste`, with grad mode on):
    `_scaled_mm` reads the fp8 bytes, so that gradient would be dropped silently.
    """
    if _scaled_mm_ok(a, out_dtype):
        args = (a.data, w.data, a.scale, w.scale)
        if out is None:
            return torch._scaled_mm(*args, out_dtype=out_dtype)
        return torch.ops.aten._scaled_mm.out(*args, out_dtype=out_dtype, out=out)
    res = a.dequantize() @ w.dequantize()
    if out is None:
        return res.to(out_dtype)
    return out.copy_(res)


def _check_fp8_activation(op: str, a: Fp8Activation) -> None:
    if a.data.dtype != FP8_DTYPE or a.scale.shape != a.data.shape[:-1] + (1,):
        raise ValueError(f"{op}: activations must be {FP8_DTYPE} [..., K] with fp32 scales [..., 1], got "
                         f"{a.data.dtype} {tuple(a.data.shape)} and scales {tuple(a.scale.shape)}")


def _check_out_dtype(op: str, out_dtype: torch.dtype, what: str) -> None:
    if not out_dtype.is_floating_point or out_dtype.itemsize < 2:
        raise ValueError(f"{op}: out_dtype {out_dtype} cannot carry {what}; valid: torch.bfloat16, torch.float16, "
                         "torch.float32, torch.float64 (quantize the result afterwards)")


def _check_fp8_operands(op: str, a: Fp8Activation, weights: Sequence[Fp8Weight]) -> None:
    _check_fp8_activation(op, a)
    if a.data.dim() < 2:
        raise ValueError(f"{op}: x must have at least 2 dims [..., K], got shape {tuple(a.data.shape)}")
    if len(weights) == 0:
        raise ValueError(f"{op}: at least one weight is needed")
    k = a.data.shape[-1]
    for i, w in enumerate(weights):
        if not isinstance(w, Fp8Weight) or w.data.dtype != FP8_DTYPE:
            raise ValueError(f"{op}: weight {i} must be an Fp8Weight (see quantize_fp8_weight) or a float "
                             f"[K, N] tensor, got {type(w).__name__} {getattr(w, 'dtype', '')}")
        if w.data.dim() != 2 or w.data.shape[0] != k:
            raise ValueError(f"{op}: weight {i} has shape {tuple(w.data.shape)}, expected [K={k}, N]")
        if tuple(w.scale.shape) != (1, w.data.shape[1]):
            raise ValueError(f"{op}: weight {i} has scales of shape {tuple(w.scale.shape)}, expected one per "
                             f"output column [1, N={w.data.shape[1]}] (see quantize_fp8_weight)")
        if a.data.is_cuda and (k % 16 or w.data.shape[1] % 16):
            raise ValueError(f"{op}: torch._scaled_mm needs K ({k}) and N ({w.data.shape[1]}) divisible by 16")


def _as_fp8(x: torch.Tensor | Fp8Activation) -> Fp8Activation:
    return x if isinstance(x, Fp8Activation) else quantize_fp8_per_token(x.detach())


def _as_fp8_weight(w: torch.Tensor | Fp8Weight) -> Fp8Weight | torch.Tensor:
    """A float [K, N] tensor quantized (per output column); anything else returned for the checks to name."""
    if isinstance(w, torch.Tensor) and w.is_floating_point() and w.element_size() >= 2 and w.dim() == 2:
        return quantize_fp8_weight(w.detach())
    return w


def _wants_grad(*args: object) -> bool:
    """Autograd is recorded: grad mode is on and a high-precision tensor argument requires grad."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _gather_hp(x: torch.Tensor, group: GroupLike, dim: int) -> torch.Tensor:
    size = as_group(group).size
    return all_gather_uneven(x, group, dim, sizes=[x.shape[dim]] * size)


def _q_device(q: object) -> torch.device | None:
    """The device of an fp8 operand's data (a tensor's own), None for anything else."""
    data = q.data if isinstance(q, Fp8Activation) else q
    return data.device if isinstance(data, torch.Tensor) else None


def _scale_dtype(q: Fp8Activation) -> int:
    return dtype_code(q.scale.dtype) if isinstance(q.scale, torch.Tensor) else 0


_GATHER_FP8_FIELDS = shape_names("q_shard.data") + ("q_shard.scale dtype", "gather_dim")


def all_gather_fp8(q_shard: Fp8Activation, group: GroupLike, *, gather_dim: int = 0) -> Fp8Activation:
    """Gather fp8 token shards (data as uint8 on the wire, scales as fp32): [.., m, ..] -> [.., P * m, ..].

    Every rank's shard has the same shape (uneven token counts padded first): on CPU a rank whose
    shard differs makes every rank raise ValueError naming the per-rank sizes."""
    group = as_group(group)  # resolved once here; the internals take the Group

    def check() -> tuple[int, list[int]]:
        _check_fp8_activation("all_gather_fp8", q_shard)  # a mis-shaped scale gathered into a silently wrong one
        dim = check_dim(q_shard.data, gather_dim, "gather_dim")  # not K: the scales are per token
        return dim, shape_fields(q_shard.data) + [_scale_dtype(q_shard), dim]

    dim = agree_call("all_gather_fp8", group, _q_device(q_shard), _GATHER_FP8_FIELDS, check, UNEVEN_HINT)
    return _all_gather_fp8(q_shard, group, dim)


def _all_gather_fp8(q_shard: Fp8Activation, group: GroupLike, gather_dim: int) -> Fp8Activation:
    """`all_gather_fp8` on checked, agreed operands (gather_dim normalized)."""
    size = as_group(group).size
    m = q_shard.data.shape[gather_dim]
    data = all_gather_uneven(q_shard.data, group, gather_dim, sizes=[m] * size)
    scale = all_gather_uneven(q_shard.scale, group, gather_dim, sizes=[m] * size)
    return Fp8Activation(data, scale)


class _QuantizeAllGather(torch.autograd.Function):
    """normed shard [.., m, .., H] float32 -> deq(q(all_gather)) [.., P * m, .., H] float32; STE backward.

    The fp8 bytes and scales of the gather are handed out through `box` (not autograd outputs).
    """

    @staticmethod
    def forward(ctx, normed: torch.Tensor, group, gather_dim: int, box: dict):
        gathered = _all_gather_fp8(quantize_fp8_per_token(normed.detach()), group, gather_dim)
        ctx.group, ctx.gather_dim = group, gather_dim
        box["gathered"] = gathered
        return gathered.dequantize()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # d deq(q(v)) / dv := identity (STE); the gather's adjoint is a reduce-scatter (sum) in fp32
        size = ctx.group.size
        if size > 1:
            m = grad.shape[ctx.gather_dim] // size
            grad = reduce_scatter_uneven(grad.contiguous(), [m] * size, ctx.group, ctx.gather_dim)
        return grad, None, None, None


def rms_norm_quantize_all_gather(x_shard: torch.Tensor, norm_weight: torch.Tensor, group: GroupLike, *,
                                 eps: float = 1e-6, gather_dim: int = 0) -> Fp8Activation:
    """The SP-region sequence: RMSNorm and quantize this rank's tokens, then gather the fp8 bytes.

    x_shard: [..., m, ..., H] float; norm_weight: [H] -> Fp8Activation [..., P * m, ..., H].

    Gradients: when x_shard or norm_weight requires grad (and grad mode is on), the result
    also carries `ste`, the gathered values deq(q(RMSNorm(x))) [..., P * m, ..., H] float32
    on the autograd graph, which `dequantize()` returns. Backward: the gradient reaching
    `ste` is reduce-scattered (sum over ranks, fp32) to this rank's tokens, passed through
    the quantizer unchanged (STE) and through the fp32 RMSNorm to x_shard and norm_weight
    (norm_weight's gradient is this rank's partial sum over its tokens, as for any SP-region
    parameter: all-reduce it over the group). The fp8 bytes are the same as without grad.
    """
    group = as_group(group)  # resolved once here; the internals take the Group
    wants_grad = _wants_grad(x_shard, norm_weight)

    def check() -> tuple[tuple[torch.Tensor, int], list[int]]:
        normed = _rms_norm_fp32("rms_norm_quantize_all_gather", x_shard, norm_weight, eps)
        dim = check_dim(normed, gather_dim, "gather_dim")
        return (normed, dim), shape_fields(x_shard) + [dim, dtype_code(x_shard.dtype),
                                                       grad_code(x_shard, [norm_weight])]

    normed, dim = agree_call("rms_norm_quantize_all_gather", group, _q_device(x_shard), _NORM_GATHER_FIELDS, check,
                             UNEVEN_HINT)
    if not wants_grad:
        return _all_gather_fp8(quantize_fp8_per_token(normed), group, dim)
    box: dict = {}
    ste = _QuantizeAllGather.apply(normed, group, dim, box)
    gathered = box["gathered"]
    return Fp8Activation(gathered.data, gathered.scale, ste)


_NORM_GATHER_FIELDS = shape_names("x_shard") + ("gather_dim", "dtype", "grad (1: x_shard, 2: norm_weight)")


def _all_gather_matmul_fp8_impl(q: Fp8Activation, weights: list[Fp8Weight], group: GroupLike, gather_dim: int,
                                return_gathered: bool, out_dtype: torch.dtype, chosen: str) -> Fp8GatherMatmulResult:
    """The forward of `all_gather_matmul_fp8` on checked, quantized operands, backend `chosen` resolved."""
    size = as_group(group).size
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
        full = _all_gather_fp8(Fp8Activation(data2d, scale2d), group, 0)
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
    outer = size * q.data.shape[gather_dim]
    gathered = Fp8Activation(unflatten(full_data, outer), unflatten(full_scale, outer)) if return_gathered else None
    return Fp8GatherMatmulResult([unflatten(o, outer) for o in outs2d], gathered)


class _AllGatherMatmulFp8(torch.autograd.Function):
    """Forward: the fp8 all-gather-matmul. Backward (STE, high precision): dx = matmul-reduce-scatter of
    dy @ deq(w)^T, dw_i = deq(all_gather(q))^T @ dy_i. x_in / weights are the caller's high-precision
    tensors (graph inputs only); q / qws their fp8 forms; the result's gathered input goes out via `box`."""

    @staticmethod
    def forward(ctx, q: Fp8Activation, qws: list[Fp8Weight], group, gather_dim: int, return_gathered: bool,
                out_dtype: torch.dtype, chosen: str, bw_backend: str, box: dict, x_in, *weights):
        res = _all_gather_matmul_fp8_impl(q, qws, group, gather_dim, return_gathered, out_dtype, chosen)
        box["gathered"] = res.gathered
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        ctx.q, ctx.qws, ctx.gathered = q, qws, res.gathered  # fp8: 1 byte a value kept for backward
        ctx.group, ctx.gather_dim, ctx.bw_backend = group, gather_dim, bw_backend
        ctx.x_dtype = x_in.dtype if isinstance(x_in, torch.Tensor) else None
        ctx.w_dtypes = [w.dtype if isinstance(w, torch.Tensor) else None for w in weights]
        return tuple(res.outputs)

    @staticmethod
    def backward(ctx, *grads):
        first_w = 10  # index of the first weight among forward's inputs
        group, gd = ctx.group, ctx.gather_dim
        grad_x = None
        if ctx.needs_input_grad[first_w - 1]:
            hp = ctx.x_dtype
            used = [(g, qw) for g, qw in zip(grads, ctx.qws) if g is not None]
            if used:
                g_cat = torch.cat([g.to(hp) for g, _ in used], dim=-1).contiguous()          # [.., P*m, .., sum N]
                w_cat = torch.cat([qw.dequantize(hp) for _, qw in used], dim=1)             # [K, sum N]
                grad_x = _matmul_reduce_scatter_impl(g_cat, w_cat.t(), group, gd, ctx.bw_backend)
        grad_ws: list[torch.Tensor | None] = [None] * len(ctx.qws)
        if any(ctx.needs_input_grad[first_w:]):
            full = ctx.gathered if ctx.gathered is not None else _all_gather_fp8(ctx.q, group, gd)
            for i, g in enumerate(grads):
                if g is not None and ctx.needs_input_grad[first_w + i]:
                    dt = ctx.w_dtypes[i]
                    grad_ws[i] = _weight_grad(full.dequantize(dt), g.to(dt))
        return (None,) * (first_w - 1) + (grad_x, *grad_ws)


def all_gather_matmul_fp8(x_shard: torch.Tensor | Fp8Activation, weights: Sequence[Fp8Weight | torch.Tensor],
                          group: GroupLike, *, gather_dim: int = 0, return_gathered: bool = False,
                          out_dtype: torch.dtype = torch.bfloat16, backend: Backend = "auto") -> Fp8GatherMatmulResult:
    """`[all_gather(q) @ w for w in weights]` with q the per-token FP8 of x_shard, gathered in fp8.

    x_shard: [..., m, ..., K] float (quantized here, before the gather) or an Fp8Activation
    (e.g. from `rms_norm_quantize_fp8`). weights: Fp8Weight [K, N_i] each, or float [K, N_i]
    tensors (quantized here per output column). Backends as in `all_gather_matmul`
    ("symm_mem" uses `torch.ops.symm_mem.fused_all_gather_scaled_matmul`).

    Gradients (when a float x_shard or weight requires grad): straight-through estimator,
    computed in the high-precision dtype of each input: grad x_shard = reduce_scatter(
    sum_i dy_i @ deq(q(w_i))^T) (one matmul-reduce-scatter of the concatenated output
    gradients, `ops.py` engines), grad w_i = deq(all_gather(q(x)))^T @ dy_i (the fp8 shard
    is re-gathered in backward unless `return_gathered`). `gathered` carries no gradient.
    """
    group = as_group(group)  # resolved once here; the internals take the Group
    weights = list(weights)

    def check() -> tuple[tuple[Fp8Activation, list, int, str], list[int]]:
        _check_out_dtype("all_gather_matmul_fp8", out_dtype, "the products (no result scale is applied)")
        q = _as_fp8(x_shard)
        qws = [_as_fp8_weight(w) for w in weights]
        _check_fp8_operands("all_gather_matmul_fp8", q, qws)
        dim = check_dim(q.data, gather_dim, "gather_dim")
        chosen = resolve_backend(backend, q.data, group)
        return (q, qws, dim, chosen), shape_fields(q.data) + [
            _scale_dtype(q), dim, _hp_dtype(x_shard), backend_code(chosen), int(return_gathered),
            grad_code(x_shard, weights)]

    q, qws, gather_dim, chosen = agree_call("all_gather_matmul_fp8", group, _q_device(x_shard), _AGM_FP8_FIELDS,
                                            check, UNEVEN_HINT)
    if not _wants_grad(x_shard, *weights):
        return _all_gather_matmul_fp8_impl(q, qws, group, gather_dim, return_gathered, out_dtype, chosen)
    box: dict = {}
    outs = _AllGatherMatmulFp8.apply(q, qws, group, gather_dim, return_gathered, out_dtype, chosen, chosen, box,
                                     x_shard, *weights)
    return Fp8GatherMatmulResult(list(outs), box["gathered"])


def _matmul_reduce_scatter_fp8_impl(q: Fp8Activation, weight: Fp8Weight, group: GroupLike, scatter_dim: int,
                                    out_dtype: torch.dtype, chosen: str) -> torch.Tensor:
    """The forward of `matmul_reduce_scatter_fp8` on checked, quantized operands, backend `chosen` resolved."""
    size = as_group(group).size
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
    return unflatten(y2d, q.data.shape[scatter_dim] // size)


class _MatmulReduceScatterFp8(torch.autograd.Function):
    """Forward: the fp8 matmul-reduce-scatter. Backward (STE, high precision): dx = all-gather-matmul of
    dy with deq(w)^T (which also returns the gathered dy), dw = deq(q(x))^T @ all_gather(dy)."""

    @staticmethod
    def forward(ctx, q: Fp8Activation, qw: Fp8Weight, group, scatter_dim: int, out_dtype: torch.dtype,
                chosen: str, bw_backend: str, x_in, w_in):
        ctx.q, ctx.qw = q, qw
        ctx.group, ctx.scatter_dim, ctx.bw_backend = group, scatter_dim, bw_backend
        ctx.x_dtype = x_in.dtype if isinstance(x_in, torch.Tensor) else None
        ctx.w_dtype = w_in.dtype if isinstance(w_in, torch.Tensor) else None
        return _matmul_reduce_scatter_fp8_impl(q, qw, group, scatter_dim, out_dtype, chosen)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        group, sd = ctx.group, ctx.scatter_dim
        grad_x = grad_w = None
        g_full = None
        if ctx.needs_input_grad[7]:
            # the dy gathered for dx (in x's dtype) serves dw only when that cast lost nothing dw keeps:
            # x bf16 with w fp32 and an fp32 dy rounded dw's dy to bf16 (a relative error ~2^-9)
            reuse = ctx.needs_input_grad[8] and (ctx.w_dtype == ctx.x_dtype
                                                 or torch.promote_types(grad_out.dtype, ctx.x_dtype) == ctx.x_dtype)
            gathered, (grad_x,) = _all_gather_matmul_impl(grad_out.to(ctx.x_dtype).contiguous(),
                                                          [ctx.qw.dequantize(ctx.x_dtype).t()], group, sd,
                                                          ctx.bw_backend, need_gathered=True)
            g_full = gathered if reuse else None
        if ctx.needs_input_grad[8]:
            if g_full is None:
                g_full = _gather_hp(grad_out.contiguous(), group, sd)
            grad_w = _weight_grad(ctx.q.dequantize(ctx.w_dtype), g_full.to(ctx.w_dtype))
        return None, None, None, None, None, None, None, grad_x, grad_w


def matmul_reduce_scatter_fp8(x: torch.Tensor | Fp8Activation, weight: Fp8Weight | torch.Tensor, group: GroupLike,
                              *, scatter_dim: int = 0, out_dtype: torch.dtype = torch.bfloat16,
                              backend: Backend = "auto") -> torch.Tensor:
    """`reduce_scatter(q @ weight)` with q the per-token FP8 of x; partial sums travel in out_dtype.

    x: [..., M, ..., K] float or Fp8Activation, M divisible by P; weight: Fp8Weight [K, N] or a
    float [K, N] tensor (quantized here per output column). Backends "decomposed" and
    "reference" ("auto" and "symm_mem" run "decomposed": the fused symmetric-memory scaled
    variant is not wired here).

    Gradients (when a float x or weight requires grad): straight-through estimator, in the
    high-precision dtype of each input: grad x = all_gather(dy) @ deq(q(w))^T (one
    all-gather-matmul of the output gradient, `ops.py` engines; `backend` as given, so
    "auto" may use the symmetric-memory op there), grad w = deq(q(x))^T @ all_gather(dy).
    """
    group = as_group(group)  # resolved once here; the internals take the Group
    wants_grad = _wants_grad(x, weight)

    def check() -> tuple[tuple[Fp8Activation, Fp8Weight, int, str, str], list[int]]:
        _check_out_dtype("matmul_reduce_scatter_fp8", out_dtype, "the partial sums that are reduced over the group")
        q = _as_fp8(x)
        qw = _as_fp8_weight(weight)
        _check_fp8_operands("matmul_reduce_scatter_fp8", q, [qw])
        dim = check_dim(q.data, scatter_dim, "scatter_dim")
        chosen = resolve_backend("decomposed" if backend in ("auto", "symm_mem") else backend, q.data, group)
        size = group.size
        if q.data.shape[dim] % size:
            raise ValueError(f"matmul_reduce_scatter_fp8: x.shape[{dim}] = {q.data.shape[dim]} is not "
                             f"divisible by the group size {size}; pad it first (parallel.sp.sp_pad)")
        bw_backend = resolve_backend(backend, q.data, group) if wants_grad else "none"  # (only backward uses it)
        return (q, qw, dim, chosen, bw_backend), shape_fields(q.data) + [
            _scale_dtype(q), qw.data.shape[1], dim, dtype_code(out_dtype), _hp_dtype(x), backend_code(chosen),
            backend_code(bw_backend), grad_code(x, [weight])]

    q, qw, scatter_dim, chosen, bw_backend = agree_call(
        "matmul_reduce_scatter_fp8", group, _q_device(x), _MRS_FP8_FIELDS, check,
        "every rank must pass x of the same shape (M a multiple of the group size: pad with sp_pad), a weight of "
        "the same N, and the same out_dtype, x dtype, backend and inputs requiring grad")
    if not wants_grad:
        return _matmul_reduce_scatter_fp8_impl(q, qw, group, scatter_dim, out_dtype, chosen)
    return _MatmulReduceScatterFp8.apply(q, qw, group, scatter_dim, out_dtype, chosen, bw_backend, x, weight)


def _hp_dtype(x: object) -> int:
    """x's own dtype code (its gradient's dtype in backward); 0 for an already quantized input."""
    return dtype_code(x.dtype) if isinstance(x, torch.Tensor) else 0


_AGM_FP8_FIELDS = shape_names("q.data") + ("q.scale dtype", "gather_dim", "x_shard dtype", BACKEND_FIELD,
                                          "return_gathered", "grad (1: x_shard, 2: a weight)")
_MRS_FP8_FIELDS = shape_names("q.data") + ("q.scale dtype", "w.shape[1] (N)", "scatter_dim", "out_dtype", "x dtype",
                                          "forward " + BACKEND_FIELD, "backward " + BACKEND_FIELD,
                                          "grad (1: x, 2: weight)")


def _scaled_matmul_nd(q: Fp8Activation, w: Fp8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    data2d, unflatten = rows_view(q.data, 0)
    scale2d, _ = rows_view(q.scale, 0)
    return unflatten(scaled_matmul(Fp8Activation(data2d, scale2d), w, out_dtype), q.data.shape[0])
