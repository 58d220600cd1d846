"""`megapar bench quant`: quantize / dequantize bandwidth against the copy ceiling.

Inputs (full run): a 117M-element bf16 weight [4, 4096, 7168] (four V3 W13 experts) for
mxfp4 / nvfp4 / fp8_block, and a 117M-element bf16 activation [16384, 7168] for fp8_token /
fp8_group. Ours is the Triton backend; the anchor is the torch reference on the same device
(docs/performance.md: 22.9 ms for MXFP4 on the H200). The floor is the bytes that must move (input
read + data and scales written, or the reverse) at the copy ceiling; target >= 70% of it.
Each case also checks that the Triton bits equal the reference's. NVFP4 with a computed
tensor scale reads the input twice (amax pass); its floor counts one read.

Bit identity is checked against the torch reference ON CPU (the specification: CUDA torch
computes `t / python_float` as t * (1 / float), so the reference run on CUDA can differ in the
last bit of a scale), on a slice of the input (the first rows; nvfp4 with the full tensor's
global scale, itself checked against amax / 2688 computed on CPU).

With `--device cuda` (full run) a short sweep of tile rows x warps per kernel is recorded too,
so `moe.quant.triton_quant.CONFIG` can be checked against the best setting.
"""

from __future__ import annotations

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps
from megapar.moe.quant import QuantizedTensor, dequantize, quantize

TARGET = 0.70
WEIGHT_FORMATS = (("mxfp4", {}), ("nvfp4", {}), ("nvfp4", {"global_scale": "matrix"}), ("fp8_block", {}))
ACT_FORMATS = (("fp8_token", {}), ("fp8_group", {}), ("fp8_group", {"ue8m0": True}))


def _same(a, b) -> bool:
    """Bit equality of two QuantizedTensors or two float tensors (NaN positions must agree)."""
    if isinstance(a, torch.Tensor):
        na, nb = torch.isnan(a), torch.isnan(b)
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return bool(torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb]))
    same = torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    same = same and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    if a.global_scale is not None:
        same = same and torch.equal(a.global_scale, b.global_scale)
    return bool(same)


def _slice_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The first matrix's first `rows` rows of [..., N, K] (all leading dims 0 but the row dim)."""
    lead = (0,) * (x.dim() - 2)
    return x[lead][:rows].unsqueeze(0) if x.dim() > 2 else x[:rows]


def _bits_vs_cpu_reference(x: torch.Tensor, q, fmt: str, opts: dict, rows: int) -> tuple[bool, bool]:
    """(quantize bits, dequantize bits) of q (from x on any device) against the CPU torch
    reference on the first `rows` rows of the first matrix."""
    from megapar.moe.quant.reference import NVFP4_GLOBAL_DIVISOR

    xs = _slice_rows(x, rows).cpu()
    opts_cpu = dict(opts)
    ok = True
    if fmt == "nvfp4":
        gs = q.global_scale.cpu()
        if not isinstance(opts.get("global_scale"), (float, torch.Tensor)):     # computed: check it
            per_matrix = opts.get("global_scale") == "matrix"
            amax = (x.abs().amax(dim=(-2, -1)) if per_matrix else x.abs().amax()).float().cpu()
            ok = _same(gs, amax / NVFP4_GLOBAL_DIVISOR)
        opts_cpu["global_scale"] = gs[(0,) * gs.dim()].reshape(()) if gs.dim() else gs
    ref = quantize(xs, fmt, backend="torch", **opts_cpu)
    part = QuantizedTensor(_slice_rows(q.data, rows).cpu(), _slice_rows(q.scale, -(-rows // 128) if fmt == "fp8_block" else rows).cpu(),
                       fmt, xs.shape, None if fmt != "nvfp4" else opts_cpu["global_scale"])
    ok = ok and _same(part, ref)
    deq = _slice_rows(dequantize(q, torch.bfloat16), rows).cpu()
    return ok, _same(deq, dequantize(ref, torch.bfloat16, backend="torch"))


def _label(fmt: str, opts: dict) -> str:
    return fmt + "".join(f" {k}={v}" for k, v in opts.items())


def run(ctx: BenchContext) -> None:
    if ctx.quick:
        weight_shape, act_shape = (2, 64, 256), (64, 512)
    elif ctx.is_cuda:
        weight_shape, act_shape = (4, 4096, 7168), (16384, 7168)
    else:
        weight_shape, act_shape = (2, 1024, 2048), (1024, 2048)
    backend = "triton" if ctx.is_cuda else "torch"
    if not ctx.is_cuda:
        ctx.note("CPU: the Triton kernels need CUDA; 'ours' is the torch reference here (speedup 1 by construction)")
    ceiling = copy_ceiling_gbps(ctx.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(weight_shape, generator=g).to(ctx.device, torch.bfloat16)
    act = (torch.randn(act_shape, generator=g) * 3).to(ctx.device, torch.bfloat16)

    if ctx.is_cuda:
        out = torch.empty_like(weight)
        copy_us = ctx.time_fn(lambda: out.copy_(weight))
        nbytes = 2 * weight.numel() * 2
        ctx.record(f"copy bf16 {tuple(weight.shape)}", copy_us, floor_us=nbytes / (ceiling * 1e3),
                   gbps=nbytes / copy_us / 1e3)
        del out

    anchor_iters = 3 if ctx.quick else 5
    for x, formats in ((weight, WEIGHT_FORMATS), (act, ACT_FORMATS)):
        for fmt, opts in formats:
            label = _label(fmt, opts)
            q = quantize(x, fmt, backend=backend, **opts)
            bits_ok, deq_ok = _bits_vs_cpu_reference(x, q, fmt, opts, rows=256 if ctx.quick else 512)
            in_bytes = x.numel() * x.element_size()
            moved = in_bytes + q.nbytes
            ours_us = ctx.time_fn(lambda: quantize(x, fmt, backend=backend, **opts))
            anchor_us = ctx.time_fn(lambda: quantize(x, fmt, backend="torch", **opts), iters=anchor_iters)
            floor_us = moved / (ceiling * 1e3)
            ctx.record(f"quantize {label} bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=bits_ok)
            ours_us = ctx.time_fn(lambda: dequantize(q, torch.bfloat16, backend=backend))
            anchor_us = ctx.time_fn(lambda: dequantize(q, torch.bfloat16, backend="torch"), iters=anchor_iters)
            ctx.record(f"dequantize {label} -> bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=deq_ok)
            del q
    if ctx.is_cuda and not ctx.quick:
        _sweep(ctx, weight, act)


def _sweep(ctx: BenchContext, weight: torch.Tensor, act: torch.Tensor) -> None:
    """Time each kernel over tile rows x warps; record the best against the default CONFIG."""
    from megapar.moe.quant import triton_quant as tq

    default = dict(tq.CONFIG)
    cases = {
        "fp4_quant": lambda: tq.quantize(weight, "mxfp4"),
        "fp4_dequant": lambda: tq.dequantize(q_fp4, torch.bfloat16),
        "fp8_group": lambda: tq.quantize(act, "fp8_group"),
        "fp8_dequant": lambda: tq.dequantize(q_fp8, torch.bfloat16),
    }
    q_fp4 = tq.quantize(weight, "mxfp4")
    q_fp8 = tq.quantize(act, "fp8_group")
    # a few (rows, warps) around the default: each setting costs a compile (~1 s)
    choices = {"fp4_quant": ((64, 4), (256, 8)), "fp4_dequant": ((64, 4), (256, 8)),
               "fp8_group": ((64, 8),), "fp8_dequant": ((16, 4),)}
    try:
        for name, fn in cases.items():
            tq.CONFIG[name] = default[name]
            default_us = ctx.time_fn(fn, warmup=2, iters=20)
            best = None
            for rows, warps in (default[name], *choices[name]):
                tq.CONFIG[name] = (rows, warps)
                us = default_us if (rows, warps) == default[name] else ctx.time_fn(fn, warmup=2, iters=20)
                if best is None or us < best[0]:
                    best = (us, rows, warps)
            tq.CONFIG[name] = default[name]
            ctx.record(f"sweep {name}", best[0], anchor="default CONFIG", anchor_us=default_us,
                       best_rows=best[1], best_warps=best[2], default_rows=default[name][0],
                       default_warps=default[name][1])
    finally:
        tq.CONFIG.update(default)
