"""`megapar bench quant`: quantize / dequantize bandwidth against the copy ceiling.

Inputs (full run): a 117M-element bf16 weight [4, 4096, 7168] (four V3 W13 experts) for
mxfp4 / nvfp4 / fp8_block, and a 117M-element bf16 activation [16384, 7168] for fp8_token /
fp8_group. Ours is the Triton backend; the anchor is the torch reference on the same device
(ANCHORS.md: 22.9 ms for MXFP4 on the H200). The floor is the bytes that must move (input
read + data and scales written, or the reverse) at the copy ceiling; target >= 70% of it.
Each case also checks that the Triton bits equal the reference's. NVFP4 with a computed
tensor scale reads the input twice (amax pass); its floor counts one read.

With `--device cuda` (full run) a sweep of tile rows x warps per kernel is recorded too, so
`moe.quant.triton_quant.CONFIG` can be checked against the best setting.
"""

from __future__ import annotations

import torch

from launch.bench.common import BenchContext, copy_ceiling_gbps
from moe.quant import dequantize, quantize

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
            ref = quantize(x, fmt, backend="torch", **opts)
            q = quantize(x, fmt, backend=backend, **opts)
            bits_ok = _same(q, ref)
            in_bytes = x.numel() * x.element_size()
            moved = in_bytes + q.nbytes
            ours_us = ctx.time_fn(lambda: quantize(x, fmt, backend=backend, **opts))
            anchor_us = ctx.time_fn(lambda: quantize(x, fmt, backend="torch", **opts), iters=anchor_iters)
            floor_us = moved / (ceiling * 1e3)
            ctx.record(f"quantize {label} bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=bits_ok)
            deq_ref = dequantize(ref, torch.bfloat16, backend="torch")
            deq_ok = _same(dequantize(q, torch.bfloat16, backend=backend), deq_ref)
            del deq_ref
            ours_us = ctx.time_fn(lambda: dequantize(q, torch.bfloat16, backend=backend))
            anchor_us = ctx.time_fn(lambda: dequantize(q, torch.bfloat16, backend="torch"), iters=anchor_iters)
            ctx.record(f"dequantize {label} -> bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=deq_ok)
            del ref, q
    if ctx.is_cuda and not ctx.quick:
        _sweep(ctx, weight, act)


def _sweep(ctx: BenchContext, weight: torch.Tensor, act: torch.Tensor) -> None:
    """Time each kernel over tile rows x warps; record the best against the default CONFIG."""
    from moe.quant import triton_quant as tq

    default = dict(tq.CONFIG)
    cases = {
        "fp4_quant": lambda: tq.quantize(weight, "mxfp4"),
        "fp4_dequant": lambda: tq.dequantize(q_fp4, torch.bfloat16),
        "fp8_group": lambda: tq.quantize(act, "fp8_group"),
        "fp8_dequant": lambda: tq.dequantize(q_fp8, torch.bfloat16),
    }
    q_fp4 = tq.quantize(weight, "mxfp4")
    q_fp8 = tq.quantize(act, "fp8_group")
    rows_choices = {"fp4_quant": (32, 64, 128, 256), "fp4_dequant": (32, 64, 128, 256),
                    "fp8_group": (8, 16, 32, 64), "fp8_dequant": (8, 16, 32, 64)}
    try:
        for name, fn in cases.items():
            tq.CONFIG[name] = default[name]
            default_us = ctx.time_fn(fn, warmup=2, iters=20)
            best = None
            for rows in rows_choices[name]:
                for warps in (2, 4, 8):
                    tq.CONFIG[name] = (rows, warps)
                    us = ctx.time_fn(fn, warmup=2, iters=20)
                    if best is None or us < best[0]:
                        best = (us, rows, warps)
            tq.CONFIG[name] = default[name]
            ctx.record(f"sweep {name}", best[0], anchor="default CONFIG", anchor_us=default_us,
                       best_rows=best[1], best_warps=best[2], default_rows=default[name][0],
                       default_warps=default[name][1])
    finally:
        tq.CONFIG.update(default)
