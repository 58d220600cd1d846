"""`megapar bench gemm`: FP4 grouped expert GEMMs of one EP=8 shard against torch's grouped GEMMs.

Shapes (docs/performance.md): V3 (32 local experts, H=7168, I=2048) and V4-Flash (32, H=4096,
I=2048); L1 = x[M, H] @ W13[E, 2I, H]^T, L2 = h[M, I] @ W2[E, H, I]^T; 1..2048 tokens per
expert, M = 32 x tokens. Weights are random MXFP4 (random E2M1 codes, block exponents
spread over 7 values); the anchors use the same values in bf16 and as rowwise FP8.

Per case, in the same run: torch bf16 `_grouped_mm` and torch fp8 rowwise
`_scaled_grouped_mm` (pre-quantized activations), and ours: `triton_w4a16` and `triton_w4a8`
through the public `grouped_gemm` (activation quantization and FP4 expansion included).
Every timing is a CUDA-graph replay (the serving setting: no Python launch overhead),
median of many. The fp4 floor is the MXFP4 weight + bf16 activation bytes at the measured
copy bandwidth; rel_err is ||ours - ref|| / ||ref|| against an fp32 reference (W4A8: the
reference with the same fp8 activations). Targets: decode (<= 32 tok/expert) >= 75% of the
floor's speed and >= 4x torch bf16; prefill (2048) W4A8 >= 1.0x torch fp8, W4A16 >= 0.9x bf16.

DeepGEMM rows (V3 only; `deep_gemm` backend, moe/kernels/deep_gemm.py), beside ours and torch:
prefill contiguous at 512 / 1024 / 2048 tok/expert - "deep_gemm" (public grouped_gemm: fp8_group
activation quantization + the padding copy + the GEMM), "deep_gemm aligned" (the rows already on
DeepGEMM's 128-row layout: no copy), "deep_gemm gemm only" (fp8 inputs, MN-major scales and
m_indices made beforehand) - anchored on torch fp8 rowwise `_scaled_grouped_mm`; decode masked
(slab, capacity 128) at 8 / 32 / 128 tok/expert, anchored on torch bf16 bmm, beside our
triton_w4a16 / triton_w4a8 slab calls. The roofline of DeepGEMM's rows is the FP8 one: max(flops
at the FP8 rate, fp8 weight + activation bytes at the copy bandwidth); our slab rows read the FP4
weight, and their roofline is max(flops at the rate of their MMAs (bf16 for W4A16, FP8 for W4A8),
the fp4 floor's bytes) (`w4_floor_us`). When deep_gemm cannot run
(no CUDA, not installed, not SM90, a libstdc++ mix-up) a note gives the reason and the rows are
skipped. "routed" rows: decode batches of 1 / 8 / 64 tokens routed top-8 (V3) or top-6 (V4-Flash)
over the 32 experts, counts on the device, the floor counting only the experts hit; both sides
timed ten calls a graph over copies of their weights taken in turn (`step_time`: the experts hit
would otherwise stay in L2 from one replay to the next).
MEGAPAR_BENCH_GEMM_SECTIONS picks the sections (default main,routed,deep_gemm).

`python -m launch.bench.gemm --probe --out DIR` runs the kernel-tuning probe instead (variants
and launch configs side by side, correctness of each) and writes DIR/gemm-probe.json; `--sections`
picks the rounds (decode, decode2, decode3, decode4 = TMA weight loads vs the default, decode5 = how
fast plain kernels stream the same weight bytes (launch/bench/stream_probe.py), decode6 = split-K,
decode7 = bf16 operands by the multiply expansion (mode bf16asm), decode8 = bf16asm under a
register cap (maxnreg) and the octb packing with mode bf16rot, decode9 = bf16rot with the prescale
multiplier built inside the expansion PTX (mode bf16rot_ps), prefill, prefill2 = the FP8 GEMM alone
at V3 L2 over tile shapes and stages, rowwise and per-128 promoted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
import zlib
from typing import Any, Callable

import torch

from megapar.launch.bench.common import (BenchContext, ceilings, copy_ceiling_gbps,
                                         graph_time, l2_sets, precompile, step_time)

SHAPES = {"v3": (32, 7168, 2048), "v4flash": (32, 4096, 2048)}
TOKENS = (1, 8, 32, 128, 512, 2048)
DG_SHAPES = ("v3",)
DG_PREFILL_TOKENS = (512, 1024, 2048)
DG_DECODE_TOKENS = (8, 32, 128)
DG_SLAB_CAPACITY = 128
ROUTED_TOKENS = (1, 8, 64)            # decode batches routed top-k over the shard's experts
ROUTED_TOPK = {"v3": 8, "v4flash": 6, "tiny": 2}


# ---- data ---------------------------------------------------------------------------------------

def random_mxfp4(E: int, N: int, K: int, device: torch.device, seed: int):
    """A random MXFP4 weight [E, N, K] (QuantizedTensor) with block exponents in [-9, -3]."""
    from megapar.moe.quant import QuantizedTensor

    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8, device=device)
    scale = torch.randint(118, 125, (E, N, K // 32), generator=g, dtype=torch.uint8, device=device)
    return QuantizedTensor(data, scale, "mxfp4", torch.Size((E, N, K)))


def fp4_floor_us(E: int, N: int, K: int, M: int, device: torch.device) -> float:
    nbytes = E * N * K // 2 + E * N * K // 32 + M * K * 2 + M * N * 2
    return nbytes / (copy_ceiling_gbps(device) * 1e3)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---- the suite ----------------------------------------------------------------------------------

class Case:
    """One (shape, gemm, tokens) problem with its data on the device."""

    def __init__(self, ctx: BenchContext, shape: str, gemm: str, tok: int, w: dict[str, Any]):
        self.shape, self.gemm, self.tok = shape, gemm, tok
        self.E, self.N, self.K = w["shape"]
        self.M = self.E * tok
        g = torch.Generator(device=ctx.device).manual_seed(tok * 7 + self.K)
        self.x = torch.randn(self.M, self.K, generator=g, device=ctx.device).to(torch.bfloat16)
        self.counts = torch.full((self.E,), tok, dtype=torch.int32, device=ctx.device)
        self.offs = torch.cumsum(self.counts, 0).to(torch.int32)
        self.w = w

    def reference(self, x: torch.Tensor | None = None) -> torch.Tensor:
        x = (self.x if x is None else x).float().view(self.E, self.tok, self.K)
        return torch.bmm(x, self.w["f32"].transpose(1, 2)).reshape(self.M, self.N)


def _weights(ctx: BenchContext, E: int, N: int, K: int, seed: int) -> dict[str, Any]:
    from megapar.moe.kernels import packing_for, prepare_weights
    from megapar.parallel.impl import interpreting, triton_importable

    q = random_mxfp4(E, N, K, ctx.device, seed)
    pw = prepare_weights(q)
    if (ctx.is_cuda or interpreting()) and triton_importable():
        from megapar.moe.kernels.triton_w4a16 import expand_fp4
        bf16 = expand_fp4(pw, torch.bfloat16)
        fp8, fp8_scale = expand_fp4(pw, fold="row")
    else:
        from megapar.moe.kernels.prepare import dequantize_prepared
        bf16 = dequantize_prepared(pw, torch.bfloat16)
        fp8, fp8_scale = None, None
    # the rows a user runs take the weight as the MoE layer prepares it (moe.kernels.packing_for:
    # octb under bf16 activations on CUDA); the probe sections take pw (oct) and repack themselves
    layer = prepare_weights(pw, packing=packing_for("mxfp4", torch.bfloat16, ctx.is_cuda) or "oct") if ctx.is_cuda else pw
    return {"shape": (E, N, K), "pw": pw, "layer": layer, "bf16": bf16, "f32": bf16.float(), "fp8": fp8, "fp8_scale": fp8_scale}


def _gemms(E: int, H: int, inter: int) -> dict[str, tuple[int, int, int]]:
    return {"L1": (E, 2 * inter, H), "L2": (E, H, inter)}


def run(ctx: BenchContext) -> None:
    from megapar.moe.kernels import grouped_gemm

    tuning_path = os.environ.get("MEGAPAR_GEMM_TUNING")
    if tuning_path:
        from megapar.moe.kernels.triton_w4a16 import apply_tuning
        with open(tuning_path) as f:
            tuning = json.load(f)
        apply_tuning(tuning)
        ctx.options["tuning"] = tuning
        ctx.note(f"launch settings from the probe of the same run: {json.dumps(tuning)}")
    if ctx.quick or not ctx.is_cuda:
        shapes = {"tiny": (4, 256, 128)}
        tokens = (1, 8) if ctx.quick else (1, 8, 64)
        ctx.note("CPU / quick: tiny shapes through the torch reference and torch._grouped_mm (kernels need CUDA)")
        ctx.label_quick("not the GPU sizes")
    else:
        shapes, tokens = SHAPES, TOKENS
    ctx.note("times: CUDA-graph replays, median; ours include activation quantization and FP4 expansion")
    sections = os.environ.get("MEGAPAR_BENCH_GEMM_SECTIONS", "main,routed,deep_gemm").split(",")
    dg_skipped = False
    for shape, (E, H, inter) in shapes.items():
        for gemm, (e, n, k) in _gemms(E, H, inter).items():
            w = _weights(ctx, e, n, k, seed=zlib.crc32(f"{shape}{gemm}".encode()) % 1000)
            cases = [Case(ctx, shape, gemm, tok, w) for tok in tokens] if "main" in sections else []
            if ctx.is_cuda:
                with precompile():
                    for c in cases:
                        for backend in ("triton_w4a16", "triton_w4a8"):
                            with contextlib.suppress(Exception):
                                grouped_gemm(c.x, w["layer"], counts=c.counts, backend=backend)
            for c in cases:
                _run_case(ctx, c, grouped_gemm)
            if "routed" in sections:
                _routed_rows(ctx, shape, gemm, w, grouped_gemm)
            if "deep_gemm" in sections and (shape in DG_SHAPES or shape == "tiny") and not dg_skipped:
                dg_skipped = not _deep_gemm_rows(ctx, shape, gemm, w, grouped_gemm)
            del w, cases
            if ctx.is_cuda:
                torch.cuda.empty_cache()
    if ctx.is_cuda and not ctx.quick:
        _targets(ctx)


def _run_case(ctx: BenchContext, c: Case, grouped_gemm) -> None:
    w = c.w
    flops = 2.0 * c.M * c.N * c.K
    floor = fp4_floor_us(c.E, c.N, c.K, c.M, ctx.device)
    fp8_floor = max(flops / (ceilings(ctx.device).fp8_tflops * 1e6), floor)
    ref = c.reference()
    anchors: dict[str, float] = {}
    try:
        anchors["bf16"], _ = graph_time(ctx, lambda: torch._grouped_mm(c.x, w["bf16"].transpose(1, 2), offs=c.offs))
    except Exception as e:  # noqa: BLE001
        ctx.note(f"{c.shape} {c.gemm} tok={c.tok}: torch bf16 _grouped_mm failed: {type(e).__name__}: {e}")
    interp = os.environ.get("MEGAPAR_BENCH_INTERP") == "1"   # dry run of the GPU code under TRITON_INTERPRET=1
    if ctx.is_cuda or interp:
        from megapar.moe.kernels.triton_w4a8 import quantize_act, torch_scaled_grouped_mm
        xq, xs = quantize_act(c.x)
        try:
            anchors["fp8"], _ = graph_time(ctx, lambda: torch_scaled_grouped_mm(xq, xs, w["fp8"], w["fp8_scale"], c.counts))
        except Exception as e:  # noqa: BLE001
            ctx.note(f"{c.shape} {c.gemm} tok={c.tok}: torch fp8 _scaled_grouped_mm failed: {type(e).__name__}: {e}")
        ref8 = c.reference(xq.float() * xs)
    impls = ("triton_w4a16", "triton_w4a8") if ctx.is_cuda or interp else ("torch", "torch_grouped_mm")
    for impl in impls:
        fn = (lambda impl=impl: grouped_gemm(c.x, w["layer"], counts=c.counts, backend=impl))
        try:
            out = fn()
            err = rel_err(out, ref8 if impl == "triton_w4a8" else ref)
            us, how = graph_time(ctx, fn)
        except Exception as e:  # noqa: BLE001
            ctx.note(f"{c.shape} {c.gemm} tok={c.tok} {impl}: failed: {type(e).__name__}: {e}")
            continue
        ctx.record(f"{c.shape} {c.gemm} tok={c.tok} {impl}", us, anchor="torch bf16 _grouped_mm",
                   anchor_us=anchors.get("bf16"), floor_us=floor, shape=c.shape, gemm=c.gemm, tok_per_expert=c.tok,
                   impl=impl, M=c.M, N=c.N, K=c.K, tflops=flops / us / 1e6,
                   fp8_anchor_us=anchors.get("fp8"),
                   speedup_vs_fp8=(anchors["fp8"] / us) if "fp8" in anchors else None,
                   w4a8_floor_us=round(fp8_floor, 2), rel_err=err, timing=how)
    if (ctx.is_cuda or interp) and c.tok >= (128 if ctx.is_cuda else 8):
        # W4A8 with its weight's FP8 form resident (end to end); under the anchor's conditions:
        # activations already fp8 (as when the previous op quantizes them); and the GEMM alone
        # (weights expanded once beforehand).
        from megapar.moe.kernels.triton_w4a16 import expand_fp4
        from megapar.moe.kernels.triton_w4a8 import fp8_grouped_gemm, fp8_weight
        rows = expert_rows_of(c)
        import dataclasses

        # the weight's exact FP8 form kept resident (`PreparedWeight.keep_fp8`, 2x the FP4 bytes
        # more): end to end, activation quantization included, without the per-call expansion
        if "resident" not in w and w["pw"].fp8_exact:
            w["resident"] = dataclasses.replace(w["pw"], cache=dict(w["pw"].cache)).keep_fp8()
        parts = {"triton_w4a8 resident fp8": lambda: grouped_gemm(c.x, w["resident"], counts=c.counts,
                                                                  backend="triton_w4a8"),
                 "triton_w4a8 x pre-quantized": lambda: fp8_grouped_gemm(xq, xs, *fp8_weight(w["pw"]), rows,
                                                                         out_dtype=torch.bfloat16),
                 "triton_w4a8 gemm only": lambda: fp8_grouped_gemm(xq, xs, w["fp8"], w["fp8_scale"], rows,
                                                                   out_dtype=torch.bfloat16)}
        for impl, fn in parts.items():
            try:
                err = rel_err(fn(), ref8)
                us, how = graph_time(ctx, fn)
            except Exception as e:  # noqa: BLE001
                ctx.note(f"{c.shape} {c.gemm} tok={c.tok} {impl}: failed: {type(e).__name__}: {e}")
                continue
            ctx.record(f"{c.shape} {c.gemm} tok={c.tok} {impl}", us, anchor="torch fp8 rowwise _scaled_grouped_mm",
                       anchor_us=anchors.get("fp8"), floor_us=floor, shape=c.shape, gemm=c.gemm,
                       tok_per_expert=c.tok, impl=impl, M=c.M, N=c.N, K=c.K, tflops=flops / us / 1e6,
                       fp8_anchor_us=anchors.get("fp8"),
                       speedup_vs_fp8=(anchors["fp8"] / us) if "fp8" in anchors else None,
                       w4a8_floor_us=round(fp8_floor, 2), rel_err=err, timing=how)


def _routed_rows(ctx: BenchContext, shape: str, gemm: str, w: dict[str, Any], grouped_gemm) -> None:
    """Decode as the MoE layer sees it: T tokens each routed to top-k of the E experts (uniform
    random picks, fixed seed), counts on the device, experts with no rows skipped. The floor
    counts only the weights of the experts hit."""
    E, N, K = w["shape"]
    k = min(ROUTED_TOPK.get(shape, 8), E)
    for T in ROUTED_TOKENS:
        g = torch.Generator(device="cpu").manual_seed(T * 131 + N)
        picks = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])     # [T, k]
        counts_h = torch.bincount(picks.flatten(), minlength=E)
        hit, M = int((counts_h > 0).sum()), int(counts_h.sum())
        counts = counts_h.to(device=ctx.device, dtype=torch.int32)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randn(M, K, generator=torch.Generator(device=ctx.device).manual_seed(T + K),
                        device=ctx.device).to(torch.bfloat16)
        bounds = [0] + torch.cumsum(counts_h, 0).tolist()
        ref = torch.cat([x[bounds[e]:bounds[e + 1]].float() @ w["f32"][e].T for e in range(E)])
        floor = fp4_floor_us(hit, N, K, M, ctx.device)
        name = f"{shape} {gemm} routed T={T} top{k}"
        # The experts hit hold a few tens of MB (V4-Flash L1 at T = 1: ~27 MB of FP4), which the L2
        # keeps from one replay to the next where a decode step's other layers would evict it: both
        # sides take copies of their weights in turn (`step_time`), as many as keep >= 3x the L2
        # between two uses of one copy, counted over the weights each reads
        fp4_hit = hit * (N * K // 2 + N * K // 32)
        bf16_sets = [w["bf16"]] + [w["bf16"].clone() for _ in range(l2_sets(ctx, 2 * hit * N * K) - 1)]
        try:
            anchor_us, anchor_cols = step_time(ctx, [lambda b=b: torch._grouped_mm(x, b.transpose(1, 2), offs=offs)
                                                     for b in bf16_sets])
        except Exception as e:  # noqa: BLE001
            ctx.note(f"{name}: torch bf16 _grouped_mm failed: {type(e).__name__}: {e}")
            anchor_us, anchor_cols = None, {}
        del bf16_sets
        impls = ("triton_w4a16",) if ctx.is_cuda or os.environ.get("MEGAPAR_BENCH_INTERP") == "1" else ("torch",)
        layer_sets = [w["layer"]] + [w["layer"].clone() for _ in range(l2_sets(ctx, fp4_hit) - 1)]
        for impl in impls:
            fns = [lambda impl=impl, pw=pw: grouped_gemm(x, pw, counts=counts, backend=impl) for pw in layer_sets]
            try:
                err = rel_err(fns[-1](), ref)
                us, cols = step_time(ctx, fns)
            except Exception as e:  # noqa: BLE001
                ctx.note(f"{name} {impl}: failed: {type(e).__name__}: {e}")
                continue
            ctx.record(f"{name} {impl}", us, anchor="torch bf16 _grouped_mm", anchor_us=anchor_us, floor_us=floor,
                       shape=shape, gemm=gemm, tok_per_expert=round(M / hit, 2), impl=impl, M=M, N=N, K=K,
                       experts_hit=hit, tflops=2.0 * M * N * K / us / 1e6, rel_err=err, **cols,
                       anchor_input_sets=anchor_cols.get("input_sets"), anchor_timing=anchor_cols.get("timing"))


def fp8_floor_us(E: int, N: int, K: int, M: int, device: torch.device) -> float:
    """FP8 roofline: max(flops at the FP8 rate, fp8 weight + fp8 activation + bf16 output bytes at
    the copy bandwidth)."""
    nbytes = E * N * K + E * N * K // 128 // 128 * 4 + M * K + M * K // 128 * 4 + M * N * 2
    return max(2.0 * M * N * K / (ceilings(device).fp8_tflops * 1e6), nbytes / (copy_ceiling_gbps(device) * 1e3))


def w4_floor_us(E: int, N: int, K: int, M: int, device: torch.device, backend: str) -> float:
    """Roofline of our FP4-weight kernels: max(flops at the rate of their MMAs (bf16 for triton_w4a16,
    FP8 for triton_w4a8), the MXFP4 weight + bf16 activation and output bytes at the copy bandwidth)."""
    c = ceilings(device)
    rate = c.fp8_tflops if backend == "triton_w4a8" else c.bf16_tflops
    return max(2.0 * M * N * K / (rate * 1e6), fp4_floor_us(E, N, K, M, device))


def _deep_gemm_rows(ctx: BenchContext, shape: str, gemm: str, w: dict[str, Any], grouped_gemm) -> bool:
    """DeepGEMM rows of one (shape, gemm); False (and a note with the reason) when it cannot run."""
    from megapar.moe.kernels import deep_gemm as dgm
    from megapar.moe.kernels import expert_rows
    from megapar.moe.kernels.grouped_gemm import GEMM, quantize_dequantize_act

    why = GEMM.usable(device=ctx.device, weight=w["pw"] if ctx.is_cuda else None,
                      rows_per_expert=float(DG_PREFILL_TOKENS[-1]))["deep_gemm"]
    if why is not None:
        ctx.note(f"deep_gemm rows skipped: {why}")
        return False
    dw = dgm.deep_gemm_weight(w["pw"])
    dg = dgm._module()
    E, N, K = w["shape"]
    ctx.note(f"deep_gemm {shape} {gemm}: weight {dw.source}, +{dw.extra_bytes / 2**20:.0f} MiB resident")
    tag = f"{shape} {gemm}"

    def row(name: str, fn, ref, tok: int, M: int, anchor: str, anchor_us: float | None,
            floor_us: float | None = None, **extra) -> None:
        """One row; its floor the FP8 roofline unless `floor_us` is given (ours: `w4_floor_us`)."""
        try:
            err = rel_err(fn(), ref)
            us, how = graph_time(ctx, fn)
        except Exception as e:  # noqa: BLE001
            ctx.note(f"{tag} tok={tok} {name}: failed: {type(e).__name__}: {e}")
            return
        flops = 2.0 * M * N * K
        ctx.record(f"{tag} tok={tok} {name}", us, anchor=anchor, anchor_us=anchor_us,
                   floor_us=fp8_floor_us(E, N, K, M, ctx.device) if floor_us is None else floor_us,
                   shape=shape, gemm=gemm, tok_per_expert=tok,
                   impl=name, M=M, N=N, K=K, tflops=flops / us / 1e6, rel_err=err, timing=how, **extra)

    def anchor_time(what: str, fn) -> float | None:
        try:
            return graph_time(ctx, fn)[0]
        except Exception as e:  # noqa: BLE001
            ctx.note(f"{tag}: {what} failed: {type(e).__name__}: {e}")
            return None

    # -- prefill: contiguous --
    for tok in DG_PREFILL_TOKENS:
        c = Case(ctx, shape, gemm, tok, w)
        ref8 = c.reference(quantize_dequantize_act(c.x, "fp8_group"))
        fp8_us = None
        if w["fp8"] is not None:
            from megapar.moe.kernels.triton_w4a8 import quantize_act, torch_scaled_grouped_mm
            xq, xs = quantize_act(c.x)
            fp8_us = anchor_time("torch fp8 _scaled_grouped_mm",
                                 lambda: torch_scaled_grouped_mm(xq, xs, w["fp8"], w["fp8_scale"], c.counts))
        anchor = "torch fp8 rowwise _scaled_grouped_mm (fp8 inputs)"
        row("deep_gemm", lambda: grouped_gemm(c.x, w["pw"], counts=c.counts, backend="deep_gemm"), ref8, tok, c.M,
            anchor, fp8_us)
        offs = torch.cat([c.offs.new_zeros(1), c.offs])
        rows = expert_rows(c.x, E, None, offs, "contiguous")
        if tok % dgm.alignment(dg) == 0:
            row("deep_gemm aligned", lambda: dgm.deep_gemm_grouped_gemm(c.x, w["pw"], rows, out_dtype=torch.bfloat16,
                                                                       rows_aligned=True), ref8, tok, c.M, anchor,
                fp8_us)
            gemm_only = _deep_gemm_only(w["pw"], c.x, E, tok)
            if gemm_only is not None:
                row("deep_gemm gemm only", gemm_only, ref8, tok, c.M, anchor, fp8_us)
        del c
    # -- decode: masked slab --
    C = DG_SLAB_CAPACITY
    g = torch.Generator(device=ctx.device).manual_seed(K + N)
    xs_ = torch.randn(E, C, K, generator=g, device=ctx.device).to(torch.bfloat16)
    for tok in DG_DECODE_TOKENS:
        counts = torch.full((E,), min(tok, C), dtype=torch.int32, device=ctx.device)
        keep = (torch.arange(C, device=ctx.device) < min(tok, C))[None, :, None]
        ref8 = torch.bmm(quantize_dequantize_act(xs_.reshape(E * C, K), "fp8_group").view(E, C, K),
                         w["f32"].transpose(1, 2)) * keep
        bf16_us = anchor_time("torch bf16 bmm", lambda: torch.bmm(xs_, w["bf16"].transpose(1, 2)))
        anchor = "torch bf16 bmm (whole slab)"
        M = E * min(tok, C)
        row(f"deep_gemm masked C={C}", lambda: grouped_gemm(xs_, w["pw"], counts=counts, layout="slab",
                                                            backend="deep_gemm"), ref8, tok, M, anchor, bf16_us,
            fp4_floor_us=round(fp4_floor_us(E, N, K, M, ctx.device), 2))
        slab_rows = expert_rows(xs_, E, counts, None, "slab")
        row(f"deep_gemm masked C={C} expected_m={tok}",
            lambda: dgm.deep_gemm_grouped_gemm(xs_, w["pw"], slab_rows, out_dtype=torch.bfloat16, expected_m=tok),
            ref8, tok, M, anchor, bf16_us)
        # ours take the weight as the MoE layer prepares it (w["layer"]: octb under bf16 activations on
        # CUDA), as the main and routed rows do; w["pw"] (oct) is the probe's, a slower decode kernel
        for ours, act in (("triton_w4a16", None), ("triton_w4a8", "fp8_token")):   # each against its own inputs
            xr = quantize_dequantize_act(xs_.reshape(E * C, K), act).view(E, C, K)
            # without a hint the slab's capacity picks the kernel settings; with rows_hint = the
            # expected rows (as DeepGEMM's expected_m; an EP slab dispatch gives DispatchResult.rows_hint),
            # the decode ones
            for hint in (None, tok):
                row(f"{ours} slab C={C}" + (f" rows_hint={hint}" if hint else ""),
                    lambda ours=ours, hint=hint: grouped_gemm(xs_, w["layer"], counts=counts, layout="slab",
                                                              backend=ours, rows_hint=hint),
                    torch.bmm(xr, w["f32"].transpose(1, 2)) * keep, tok, M, anchor, bf16_us,
                    floor_us=w4_floor_us(E, N, K, M, ctx.device, ours),
                    fp4_floor_us=round(fp4_floor_us(E, N, K, M, ctx.device), 2))
    return True


def expert_rows_of(c: Case):
    from megapar.moe.kernels import expert_rows
    return expert_rows(c.x, c.E, c.counts, None, "contiguous")


PUBLIC_IMPLS = ("triton_w4a16", "triton_w4a8")
"""impl of the rows that time the public grouped_gemm call with that backend (the targets' rows)"""


def _targets(ctx: BenchContext) -> None:
    """Notes: which docs/performance.md targets are met, with the numbers. Only the rows of the
    public call (`grouped_gemm(x, weight, backend=impl)`: impl exactly triton_w4a16 / triton_w4a8)
    count: the W4A8 part rows ("... x pre-quantized", "... gemm only", "... resident fp8") and the
    DeepGEMM section's slab rows time less than a user's call (until 2026-12-05 any impl starting
    with triton_w4a8 could give the prefill W4A8 note)."""
    rows = [r for r in ctx.rows if r.get("impl") in PUBLIC_IMPLS]
    for r in rows:
        tok, impl = r["tok_per_expert"], r["impl"]
        name = r["case"]
        if tok <= 32 and impl == "triton_w4a16":
            frac, speed = r.get("roofline_fraction"), r.get("speedup_vs_anchor")
            ok = frac is not None and speed is not None and frac >= 0.75 and speed >= 4
            ctx.note(f"decode target {'MET' if ok else 'missed'}: {name}: {frac:.2f} of the fp4 floor (>= 0.75), "
                     f"{speed:.2f}x torch bf16 (>= 4)")
        if tok == 2048 and impl == "triton_w4a8" and r.get("speedup_vs_fp8") is not None:
            ok = r["speedup_vs_fp8"] >= 1.0
            ctx.note(f"prefill W4A8 target {'MET' if ok else 'missed'}: {name}: {r['speedup_vs_fp8']:.2f}x torch fp8 "
                     f"(>= 1.0)")
        if tok == 2048 and impl == "triton_w4a16" and r.get("speedup_vs_anchor") is not None:
            ok = r["speedup_vs_anchor"] >= 0.9
            ctx.note(f"prefill W4A16 target {'MET' if ok else 'missed'}: {name}: {r['speedup_vs_anchor']:.2f}x torch "
                     f"bf16 (>= 0.9)")


# ---- probe: variants and launch configs side by side ----------------------------------------------


def _print_verdicts(section: str, rows: list[dict[str, Any]], families) -> None:
    """Per problem of a probe section: its "... default" row against the fastest row of each family
    (label, verdict when faster, row predicate); rows with rel_err >= 1e-2 never count."""
    for prob in dict.fromkeys(r["problem"] for r in rows if "us" in r):
        mine = [r for r in rows if r["problem"] == prob and "us" in r and r.get("rel_err", 1) < 1e-2]
        default = next((r for r in mine if r["name"].endswith("default")), None)
        if default is None:
            continue
        line = f"{section} {prob}: default {default['us']:.1f} us ({default['floor_frac']:.3f} of floor)"
        found = False
        for label, verdict, pick in families:
            got = [r for r in mine if pick(r)]
            if got:
                found = True
                best = min(got, key=lambda r: r["us"])
                line += (f", best {label} {best['us']:.1f} us ({best['floor_frac']:.3f}) = {best['name']}: "
                         f"{verdict if best['us'] < default['us'] else 'default wins'}")
        if found:
            print(line, flush=True)


def probe(out_dir: str, sections: list[str]) -> None:
    from megapar.moe.kernels import expert_rows, prepare_weights
    from megapar.moe.kernels.prepare import repack
    from megapar.moe.kernels.triton_w4a16 import W4A16Config, expand_fp4, launch_w4a16
    from megapar.moe.kernels.triton_w4a8 import FP8Config, fp8_grouped_gemm, quantize_act, torch_scaled_grouped_mm

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = BenchContext(suite="gemm-probe", device=dev, quick=not ctx_is_cuda(dev))
    tiny = dev.type != "cuda"   # dry run of the probe's own code under TRITON_INTERPRET=1
    shape_l1 = (32, 4096, 7168) if not tiny else (2, 64, 512)
    shape_l2 = (32, 7168, 2048) if not tiny else (2, 64, 256)
    results: list[dict[str, Any]] = []
    os.makedirs(out_dir, exist_ok=True)
    path = f"{out_dir}/gemm-probe.json"

    def save() -> None:
        with open(path, "w") as f:
            json.dump({"versions": _versions(), "results": results}, f, indent=1)

    variants: list[tuple[str, str, Callable[[], Any], Callable[[Any], float] | None, dict]] = []

    def add(section: str, name: str, fn, check=None, **info) -> None:
        variants.append((section, name, fn, check, info))

    t0 = time.time()
    cache: dict[tuple, Any] = {}
    if ctx.is_cuda:   # compile the expansion kernels the data setup uses, in parallel
        with precompile():
            _weights(ctx, 2, 64, 512, seed=0)

    def weights(E, N, K):
        key = (E, N, K)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache()
            cache[key] = _weights(ctx, E, N, K, seed=N + K)
        return cache[key]

    def problem(E, N, K, tok):
        w = weights(E, N, K)
        M = E * tok
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        counts = torch.full((E,), tok, dtype=torch.int32, device=dev)
        rows = expert_rows(x, E, counts, None, "contiguous")
        ref = torch.bmm(x.float().view(E, tok, K), w["f32"].transpose(1, 2)).reshape(M, N)
        return w, x, counts, rows, ref

    def err_of(ref):
        return lambda out: rel_err(out, ref)

    def add_w4a16(section, name, x, wt, rows, cfg, ref, floor, problem, swiglu=False, diag=0):
        """One launch_w4a16 variant (bf16 out; with swiglu the fused SwiGLU and ref its output;
        diag > 0: a subtraction diagnostic, not checked)."""
        sw = (None, 1.0, 0.0) if swiglu else None
        add(section, name,
            (lambda: launch_w4a16(x, wt, rows, out_dtype=torch.bfloat16, config=cfg, swiglu=sw, diag=diag)),
            None if diag else err_of(ref), floor_us=floor, cfg=dict(cfg.__dict__), diag=diag, tile_n=wt.tile_n,
            problem=problem)

    def run_section_rows(acc: list) -> None:
        """Time the variants added so far, append their results to acc, start a new set."""
        n0 = len(results)
        _run_variants(ctx, variants, results, save)
        acc += results[n0:]
        variants.clear()

    # -- decode: W4A16 variants (V3 L1 at 1 and 32 tok/expert, V3 L2 at 8) --
    if "decode" in sections:
        for (E, N, K, tok) in ((*shape_l1, 1), (*shape_l1, 32), (*shape_l2, 8)):
            w, x, counts, rows, ref = problem(E, N, K, tok)
            pw = w["pw"]
            natural = repack(pw, "natural")
            floor = fp4_floor_us(E, N, K, E * tok, dev)
            bm = 16 if tok <= 16 else 32
            oct_w = repack(pw, "oct")
            cfgs = [("f16asm", "oct", 128, bm, 1, 4, 4), ("f16asm_swap", "oct", 128, bm, 1, 4, 4),
                    ("f16asm", "oct", 256, bm, 1, 8, 3), ("f16asm", "oct", 64, bm, 1, 4, 4),
                    ("f16asm", "oct", 128, bm, 1, 4, 3), ("f16asm", "oct", 128, bm, 2, 4, 3),
                    ("f16", "oct", 128, bm, 1, 4, 4), ("f16", "paired", 128, bm, 2, 4, 4),
                    ("bf16", "paired", 128, bm, 2, 4, 4)]
            if K == shape_l2[2] or tok > 16:
                cfgs = [c for i, c in enumerate(cfgs) if i in (0, 1, 2, 7)]
            if tiny:   # the interpreter has no inline asm; small tiles
                cfgs = [("f16", "oct", 32, 16, 1, 4, 1), ("f16", "paired", 32, 16, 2, 4, 1)]
            for mode, packing, bn, bm_, ch, nw, ns in cfgs:
                cfg = W4A16Config(block_n=bn, block_m=bm_, chunks=ch, num_warps=nw, num_stages=ns, mode=mode,
                                  packing=packing)
                wt = oct_w if packing == "oct" else pw
                add("decode", f"N{N} K{K} tok{tok} w4a16 {mode} {packing} bn{bn} bm{bm_} ch{ch} w{nw} s{ns}",
                    (lambda x=x, wt=wt, rows=rows, cfg=cfg: launch_w4a16(x, wt, rows, out_dtype=torch.bfloat16,
                                                                         config=cfg)),
                    err_of(ref), floor_us=floor, anchor="floor")
            offs = torch.cumsum(counts, 0).to(torch.int32)
            add("decode", f"N{N} K{K} tok{tok} torch bf16 _grouped_mm",
                (lambda x=x, wb=w["bf16"], offs=offs: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs)),
                err_of(ref), floor_us=floor)
            _run_variants(ctx, variants, results, save)
            variants.clear()

    # the decode3 / decode4 problems: V3 / V4-Flash L1 and L2, (shape, tok/expert, experts hit (0: all))
    v4f_l1 = (32, 4096, 4096) if not tiny else (2, 64, 512)
    v4f_l2 = (32, 4096, 2048) if not tiny else (2, 64, 256)
    decode_probs = [(shape_l1, 1, 0), (shape_l1, 8, 0), (shape_l1, 32, 0), (shape_l2, 1, 0), (shape_l2, 8, 0),
                    (v4f_l1, 1, 0), (v4f_l2, 1, 0), (shape_l1, 1, 8), (v4f_l1, 1, 8), (v4f_l1, 8, 8)]
    if tiny:
        decode_probs = decode_probs[:1] + decode_probs[-1:]

    def hit_problem(E, N, K, tok, hit):
        """problem(), with only `hit` experts given tok rows each when hit > 0 (decode of one token
        routed top-8); returns w, x, rows, ref, experts hit, FP4 floor."""
        w, x, counts, rows, ref = problem(E, N, K, tok)
        if hit:
            hit = min(hit, E)
            counts = torch.zeros(E, dtype=torch.int32, device=dev)
            counts[torch.randperm(E, device=dev)[:hit]] = tok
            x = x[: hit * tok].contiguous()
            rows = expert_rows(x, E, counts, None, "contiguous")
            offs = torch.cumsum(counts, 0) - counts
            ref = torch.cat([x[offs[e]: offs[e] + counts[e]].float() @ w["f32"][e].t()
                             for e in range(E) if int(counts[e])]) if x.shape[0] else ref[:0]
        experts = hit or E
        return w, x, rows, ref, experts, fp4_floor_us(experts, N, K, x.shape[0], dev)

    # -- decode, round 3: prescaled operands (one chained accumulator, no per-block rescale) --
    if "decode3" in sections:
        import dataclasses

        from megapar.moe.kernels.triton_w4a16 import pick_config
        for (E, N, K), tok, hit in decode_probs:
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, tok, hit)
            # the default before round 3 (64 rows, 4 warps, 4 stages, per-block rescale), then today's
            base = dataclasses.replace(pick_config(max(tok, 1), torch.bfloat16, "oct", fmt="nvfp4"), block_n=64,
                                       num_warps=4, num_stages=4, prescale=False)
            cfgs = [("previous default", base), ("default", pick_config(max(tok, 1), torch.bfloat16, "oct"))] + [
                (f"prescale bn{bn} w{nw} s{ns}", dataclasses.replace(base, block_n=bn, num_warps=nw, num_stages=ns,
                                                                      prescale=True))
                for bn, nw, ns in ((base.block_n, base.num_warps, base.num_stages), (64, 4, 6), (128, 4, 4),
                                   (128, 8, 4), (64, 4, 3))]
            if tiny:
                cfgs = [("default", W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1,
                                                mode="f16", packing="oct")),
                        ("prescale", W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1,
                                                 mode="f16", packing="oct", prescale=True))]
            if not tiny and tok == 1:   # subtraction diagnostics on the default: loads only; no block scales
                cfgs += [("DIAG loads-only", base), ("DIAG no-scale", base)]
                cfgs += [("bn128 w4 s4 (no prescale)", dataclasses.replace(base, block_n=128, num_stages=4))]
            for label, cfg in cfgs:
                diag = 1 if "loads-only" in label else 2 if "no-scale" in label else 0
                add("decode3", f"N{N} K{K} tok{tok} hit{experts} {label}",
                    (lambda x=x, wt=w["pw"], rows=rows, cfg=cfg, diag=diag: launch_w4a16(
                        x, wt, rows, out_dtype=torch.bfloat16, config=cfg, diag=diag)),
                    err_of(ref) if diag == 0 else None, floor_us=floor, cfg=dict(cfg.__dict__),
                    problem=f"{N}x{K} tok{tok} hit{experts}")
                if hit and tok == 1 and N == 4096 and diag == 0 and label in ("previous default", "default"):
                    # the MoE layer's fused L1 + SwiGLU (N = 2I gate/up rows -> I outputs)
                    add("decode3", f"N{N} K{K} tok{tok} hit{experts} swiglu {label}",
                        (lambda x=x, wt=w["pw"], rows=rows, cfg=cfg: launch_w4a16(
                            x, wt, rows, out_dtype=torch.bfloat16, config=cfg, swiglu=(None, 1.0, 0.0))),
                        None, floor_us=floor, cfg=dict(cfg.__dict__), problem=f"{N}x{K} tok{tok} hit{experts} swiglu")
            _run_variants(ctx, variants, results, save)
            variants.clear()

    # -- decode, round 4: TMA weight loads (device-side tensor descriptors) against today's default --
    if "decode4" in sections:
        import dataclasses

        from megapar.moe.kernels.triton_w4a16 import pick_config
        for (E, N, K), tok, hit in decode_probs:
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, tok, hit)
            pw = w["pw"]
            base = pick_config(max(tok, 1), torch.bfloat16, "oct")
            if tiny:   # the interpreter: arithmetic expansion, small tiles (64-row weight tiles: 32-row boxes)
                base = W4A16Config(block_n=32, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16",
                                   packing="oct")
            tma = dataclasses.replace(base, tma=True)
            grid = ((64, 128), (3, 4, 6), (4, 8)) if not tiny else ((16,), (1,), (4,))
            # (label, config, weight, diag)
            cfgs = [("default", base, pw, 0), ("default tma", tma, pw, 0)] + [
                (f"tma bn{bn} s{ns} w{nw}", dataclasses.replace(tma, block_n=bn, num_stages=ns, num_warps=nw), pw, 0)
                for bn in grid[0] for ns in grid[1] for nw in grid[2]]
            if tok == 1 and not hit:   # rows in order (2-D boxes); loads-only diagnostics of both paths
                untiled = repack(pw, "oct", tile_n=0)
                cfgs += [("default untiled", base, untiled, 0), ("tma untiled", tma, untiled, 0),
                         ("DIAG loads-only", base, pw, 1), ("DIAG loads-only tma", tma, pw, 1)]
            for label, cfg, wt, diag in cfgs:
                add("decode4", f"N{N} K{K} tok{tok} hit{experts} {label}",
                    (lambda x=x, wt=wt, rows=rows, cfg=cfg, diag=diag: launch_w4a16(
                        x, wt, rows, out_dtype=torch.bfloat16, config=cfg, diag=diag)),
                    err_of(ref) if diag == 0 else None, floor_us=floor, cfg=dict(cfg.__dict__), diag=diag,
                    tile_n=wt.tile_n, problem=f"{N}x{K} tok{tok} hit{experts}")
            if tok == 1 and (hit or tiny):   # the MoE layer's fused L1 + SwiGLU, both load paths
                for label, cfg in (("swiglu default", base), ("swiglu tma", tma)):
                    add("decode4", f"N{N} K{K} tok{tok} hit{experts} {label}",
                        (lambda x=x, wt=pw, rows=rows, cfg=cfg: launch_w4a16(
                            x, wt, rows, out_dtype=torch.bfloat16, config=cfg, swiglu=(None, 1.0, 0.0))),
                        None, floor_us=floor, cfg=dict(cfg.__dict__), diag=0, tile_n=pw.tile_n,
                        problem=f"{N}x{K} tok{tok} hit{experts} swiglu")
            _run_variants(ctx, variants, results, save)
            variants.clear()
        for line in tma_verdict(results):
            print(line, flush=True)

    # -- decode, round 5: how fast plain Triton kernels stream the same packed weight bytes (launch/bench/
    # stream_probe.py: flat, the kernel's tiles, split-K, persistent) beside the W4A16 kernel itself --
    if "decode5" in sections:
        from megapar.launch.bench import stream_probe
        from megapar.moe.kernels.triton_w4a16 import pick_config
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if ctx.is_cuda else 2
        for (E, N, K) in ((shape_l1, shape_l2, v4f_l1, v4f_l2) if not tiny else (shape_l1, shape_l2)):
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, 1, 0)
            cfg = pick_config(1, torch.bfloat16, "oct")
            prob = f"{N}x{K} tok1 hit{experts}"
            for label, fn, check, info in stream_probe.variants(w["pw"], (cfg.block_n, cfg.num_stages, cfg.num_warps),
                                                                sms, copy_ceiling_gbps(dev), tiny):
                add("decode5", f"N{N} K{K} tok1 hit{experts} {label}", fn, check, problem=prob,
                    kernel_floor_us=floor, **info)
            for label, diag in (("w4a16 default", 0), ("w4a16 DIAG loads-only", 1))[: 1 if tiny else 2]:
                add("decode5", f"N{N} K{K} tok1 hit{experts} {label}",
                    (lambda x=x, wt=w["pw"], rows=rows, cfg=cfg, diag=diag: launch_w4a16(
                        x, wt, rows, out_dtype=torch.bfloat16, config=cfg, diag=diag)),
                    err_of(ref) if diag == 0 else None, floor_us=floor, cfg=dict(cfg.__dict__), diag=diag,
                    problem=prob, reads="the kernel: data, scales, x, out")
            _run_variants(ctx, variants, results, save)
            variants.clear()
        for line in stream_probe.verdict(results):
            print(line, flush=True)

    # -- decode, round 2: row-tiled weights, warps/stages, and subtraction diagnostics --
    if "decode2" in sections:
        probs = [((*shape_l1, 1), "all"), ((*shape_l1, 32), "some"), ((*shape_l2, 8), "some"),
                 (((32, 4096, 4096) if not tiny else (2, 64, 512)) + (1,), "few")]
        for (E, N, K, tok), which in probs:
            w, x, counts, rows, ref = problem(E, N, K, tok)
            pw = w["pw"]
            floor = fp4_floor_us(E, N, K, E * tok, dev)
            bm = 16 if tok <= 16 else 32
            asm = "f16asm" if not tiny else "f16"
            # (label, tile_n, mode, bn, warps, stages, diag)
            cfgs = [("untiled", 0, asm, 128, 4, 3, 0), ("tiled", 128, asm, 128, 4, 3, 0),
                    ("tiled", 128, asm, 128, 4, 4, 0), ("tiled", 128, asm, 128, 8, 3, 0),
                    ("tiled", 128, asm, 128, 4, 6, 0), ("tiled", 64, asm, 64, 4, 4, 0),
                    ("tiled", 256, asm, 256, 8, 3, 0), ("DIAG loads-only untiled", 0, asm, 128, 4, 3, 1),
                    ("DIAG loads-only tiled", 128, asm, 128, 4, 3, 1), ("DIAG no-scale tiled", 128, asm, 128, 4, 3, 2),
                    ("tiled arith", 128, "f16", 128, 4, 3, 0)]
            keep = {"all": (0, 1, 2, 3, 5, 8), "some": (1, 3, 5), "few": (1, 5)}[which]
            if tiny:
                cfgs = [("tiled", 32, "f16", 32, 4, 1, 0), ("DIAG loads-only tiled", 32, "f16", 32, 4, 1, 1)]
                keep = (0, 1)
            wts: dict[int, Any] = {}
            for i in keep:
                label, tile_n, mode, bn, nw, ns, diag = cfgs[i]
                if tile_n not in wts:
                    wts[tile_n] = repack(pw, "oct", tile_n=tile_n)
                cfg = W4A16Config(block_n=bn, block_m=bm, chunks=1, num_warps=nw, num_stages=ns, mode=mode,
                                  packing="oct")
                add("decode2", f"N{N} K{K} tok{tok} {label} T{tile_n} {mode} bn{bn} bm{bm} w{nw} s{ns}",
                    (lambda x=x, wt=wts[tile_n], rows=rows, cfg=cfg, diag=diag: launch_w4a16(
                        x, wt, rows, out_dtype=torch.bfloat16, config=cfg, diag=diag)),
                    err_of(ref) if diag == 0 else None, floor_us=floor, cfg=dict(cfg.__dict__), tile_n=tile_n,
                    diag=diag, problem=f"{N}x{K} tok{tok}")
            if which == "all" and os.environ.get("MEGAPAR_PROBE_AUX") == "1":   # expansion / act-quant sweeps
                for tile_n in (0, 128 if not tiny else 32):
                    if tile_n not in wts:
                        wts[tile_n] = repack(pw, "oct", tile_n=tile_n)
                    for rp, nw in ((16, 4), (32, 4), (64, 8)):
                        add("decode2", f"N{N} K{K} expand bf16 T{tile_n} rows{rp} w{nw}",
                            (lambda wt=wts[tile_n], rp=rp, nw=nw: expand_fp4(wt, torch.bfloat16, rows_per_program=rp,
                                                                            num_warps=nw)),
                            None, bytes=E * N * K * 2.5, expand=dict(rows_per_program=rp, num_warps=nw), tile_n=tile_n)
                        add("decode2", f"N{N} K{K} expand fp8-row T{tile_n} rows{rp} w{nw}",
                            (lambda wt=wts[tile_n], rp=rp, nw=nw: expand_fp4(wt, fold="row", rows_per_program=rp,
                                                                            num_warps=nw)),
                            None, bytes=E * N * K * 1.5)
                xa = torch.randn(E * (64 if tiny else 2048), K, device=dev, dtype=torch.bfloat16)
                for nw in (4, 8, 16):
                    add("decode2", f"act quant K{K} M{xa.shape[0]} w{nw}",
                        (lambda nw=nw, xa=xa: quantize_act(xa, num_warps=nw)), None, bytes=xa.numel() * 3,
                        act_quant_warps=nw)
            _run_variants(ctx, variants, results, save)
            variants.clear()
            del wts
        tuning = _tuning_from(results, shape_l1)
        with open(f"{out_dir}/gemm-tuning.json", "w") as f:
            json.dump(tuning, f, indent=1)
        print("tuning:", json.dumps(tuning), flush=True)

    # -- decode, round 6: split-K (W4A16Config.split_k: K over 2 / 4 / 8 programs, fp32 partials, then an
    # ordered sum + epilogue kernel) against today's default, on decode4's 1-token and few-experts-hit problems --
    if "decode6" in sections:
        import dataclasses

        from megapar.moe.kernels.triton_w4a16 import pick_config
        shapes6 = [p[0] for p in decode_probs]
        probs6 = sorted((p for p in decode_probs if p[1] == 1 or p[2]), key=lambda p: shapes6.index(p[0]))
        splits = (2, 4, 8) if not tiny else (2,)
        if tiny:   # the interpreter's dry run: the few-experts-hit problem (SwiGLU included) only
            probs6 = probs6[-1:]
        rows6: list[dict[str, Any]] = []
        for (E, N, K), tok, hit in probs6:   # (grouped by shape: one weight set each)
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, tok, hit)
            pw = w["pw"]
            base = pick_config(rows.rows_hint, torch.bfloat16, "oct")   # what launch_w4a16 takes with no config
            if tiny:   # the interpreter: arithmetic expansion, one row tile
                base = W4A16Config(block_n=64, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16",
                                   packing="oct")
            other = "pointer" if base.tma else "tma"
            cfgs = [("default", base)] + [(f"split{s}", dataclasses.replace(base, split_k=s)) for s in splits]
            if hit:   # few experts hit: the other load path too (split-K changes the CTA count it was chosen for)
                cfgs += [(f"split{s} {other}", dataclasses.replace(base, split_k=s, tma=not base.tma)) for s in splits]
            tag = f"{N}x{K} tok{tok} hit{experts}"
            for label, cfg in cfgs:
                add_w4a16("decode6", f"N{N} K{K} tok{tok} hit{experts} {label}", x, pw, rows, cfg, ref, floor, tag)
            if hit and (tok == 1 or tiny) and N == shape_l1[1]:   # the MoE layer's fused L1 + SwiGLU
                I = N // 2
                sw_ref = ref[:, :I] * torch.sigmoid(ref[:, :I]) * ref[:, I:]
                sw = pick_config(rows.rows_hint, torch.bfloat16, "oct", swiglu=True) if not tiny else base
                for s in (1, *splits):
                    cfg = dataclasses.replace(sw, split_k=s)
                    name = f"N{N} K{K} tok{tok} hit{experts} swiglu {'default' if s == 1 else f'split{s}'}"
                    add_w4a16("decode6", name, x, pw, rows, cfg, sw_ref, floor,
                              f"{tag} swiglu", swiglu=True)
            run_section_rows(rows6)
        _print_verdicts("decode6", rows6, [("split", "split-K wins", lambda r: r["cfg"]["split_k"] > 1)])

    # -- decode, round 6: bf16 operands by the multiply expansion (mode bf16asm) against the default --
    if "decode7" in sections:
        import dataclasses

        from megapar.moe.kernels.triton_w4a16 import pick_config
        shapes7 = [p[0] for p in decode_probs]
        probs7 = sorted(decode_probs, key=lambda p: shapes7.index(p[0]))
        rows7: list[dict[str, Any]] = []
        for (E, N, K), tok, hit in probs7:   # (grouped by shape: one weight set each)
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, tok, hit)
            pw = w["pw"]
            # the f16asm default (what fp16 activations get; bf16 ones got it before bf16asm) and
            # the bf16asm default (what launch_w4a16 takes with no config)
            base = pick_config(rows.rows_hint, torch.float16, "oct")
            bf = pick_config(rows.rows_hint, torch.bfloat16, "oct")
            if tiny:   # the interpreter: no inline PTX, and its tl.dot of bf16 operands is wrong (Triton
                # 3.6): Triton-arithmetic f16 against f32 operands, to run the section's code
                base = W4A16Config(block_n=64, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16",
                                   packing="oct")
                bf = dataclasses.replace(base, mode="f32")
            cfgs = [("f16asm default", base), ("bf16asm", bf),
                    ("bf16asm other loads", dataclasses.replace(bf, tma=not bf.tma))]
            if not tiny:
                cfgs += [("bf16asm 4 stages", dataclasses.replace(bf, num_stages=4)),
                         ("bf16asm 2 stages", dataclasses.replace(bf, num_stages=2)),
                         ("bf16asm 64 rows", dataclasses.replace(bf, block_n=64))]
            tag = f"{N}x{K} tok{tok} hit{experts}"
            for label, cfg in cfgs:
                add_w4a16("decode7", f"N{N} K{K} tok{tok} hit{experts} {label}", x, pw, rows, cfg, ref, floor, tag)
            if N == shape_l1[1] and not tiny:   # the MoE layer's fused L1 + SwiGLU (W13 in split order)
                I = N // 2
                sw_ref = ref[:, :I] * torch.sigmoid(ref[:, :I]) * ref[:, I:]
                old = W4A16Config(block_n=64, block_m=base.block_m, chunks=1, num_warps=4, num_stages=4,
                                  mode="f16asm", packing="oct")     # the f16asm default before bf16asm
                sw = pick_config(rows.rows_hint, torch.bfloat16, "oct", swiglu=True)
                for label, cfg in (("f16asm default", old), ("bf16asm", sw),
                                   ("bf16asm 128 rows", dataclasses.replace(sw, block_n=128)),
                                   ("bf16asm 128 rows tma 3 stages", dataclasses.replace(sw, block_n=128, tma=True,
                                                                                         num_stages=3))):
                    add_w4a16("decode7", f"N{N} K{K} tok{tok} hit{experts} swiglu {label}", x, pw, rows, cfg, sw_ref,
                              floor,
                              f"{tag} swiglu", swiglu=True)
            run_section_rows(rows7)
        # (f32: the interpreter's stand-in for bf16asm)
        _print_verdicts("decode7", rows7, [("bf16", "bf16 wins", lambda r: r["cfg"]["mode"] in ("bf16asm", "f32"))])

    # -- decode, round 7: bf16asm under a register cap, and packing octb with mode bf16rot --
    if "decode8" in sections:
        import dataclasses

        from megapar.moe.kernels.triton_w4a16 import pick_config
        shapes8 = [p[0] for p in decode_probs]
        rows8: list[dict[str, Any]] = []
        for (E, N, K), tok, hit in sorted(decode_probs, key=lambda p: shapes8.index(p[0])):
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, tok, hit)
            pw = w["pw"]
            base = pick_config(rows.rows_hint, torch.bfloat16, "oct")   # what launch_w4a16 takes with no config
            if tiny:   # the interpreter (no inline PTX; maxnreg is ignored there): the section's code only
                base = W4A16Config(block_n=64, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16",
                                   packing="oct")
            cfgs = [("default", pw, base), ("maxnreg128", pw, dataclasses.replace(base, maxnreg=128))]
            if not tiny:
                pb = pw.in_layout("octb")    # (made once, before the timing)
                rot = dataclasses.replace(base, mode="bf16rot", packing="octb")
                cfgs += [(f"maxnreg128 {st} stages", pw, dataclasses.replace(base, maxnreg=128, num_stages=st))
                         for st in (2, 4) if st != base.num_stages]
                cfgs += [("bf16rot", pb, rot), ("bf16rot other loads", pb, dataclasses.replace(rot, tma=not rot.tma))]
                cfgs += [(f"bf16rot {st} stages", pb, dataclasses.replace(rot, num_stages=st))
                         for st in (2, 4) if st != rot.num_stages]
            tag = f"{N}x{K} tok{tok} hit{experts}"
            for label, wt, cfg in cfgs:
                add_w4a16("decode8", f"N{N} K{K} tok{tok} hit{experts} {label}", x, wt, rows, cfg, ref, floor, tag)
            if tok == 1 and not tiny:   # what each part costs: the default without it (wrong results)
                for label, diag in (("no block scales", 2), ("no expansion", 3), ("neither", 4)):
                    add_w4a16("decode8", f"N{N} K{K} tok{tok} hit{experts} DIAG {label}", x, pw, rows, base, ref,
                              floor, tag, diag=diag)
            if N == shape_l1[1] and not tiny:   # the MoE layer's fused L1 + SwiGLU
                I = N // 2
                sw_ref = ref[:, :I] * torch.sigmoid(ref[:, :I]) * ref[:, I:]
                sw = pick_config(rows.rows_hint, torch.bfloat16, "oct", swiglu=True)
                for label, wt, cfg in (("default", pw, sw), ("bf16rot", pb, dataclasses.replace(sw, mode="bf16rot",
                                                                                                packing="octb")),
                                       ("maxnreg128", pw, dataclasses.replace(sw, maxnreg=128))):
                    add_w4a16("decode8", f"N{N} K{K} tok{tok} hit{experts} swiglu {label}", x, wt, rows, cfg, sw_ref,
                              floor,
                              f"{tag} swiglu", swiglu=True)
            run_section_rows(rows8)
        _print_verdicts("decode8", rows8, [
            ("maxnreg", "maxnreg wins", lambda r: r["cfg"]["maxnreg"] and r["cfg"]["mode"] != "bf16rot"),
            ("bf16rot", "bf16rot wins", lambda r: r["cfg"]["mode"] == "bf16rot")])

    # -- decode, round 8: the prescale multiplier built in the expansion PTX (mode bf16rot_ps) --
    if "decode9" in sections:
        import dataclasses

        from megapar.moe.kernels.triton_w4a16 import pick_config
        shapes9 = [p[0] for p in decode_probs]
        rows9: list[dict[str, Any]] = []
        for (E, N, K), tok, hit in sorted(decode_probs, key=lambda p: shapes9.index(p[0])):
            w, x, rows, ref, experts, floor = hit_problem(E, N, K, tok, hit)
            pb = w["pw"].in_layout("octb") if not tiny else w["pw"]
            base = pick_config(rows.rows_hint, torch.bfloat16, "octb")   # the layer's decode default
            tag = f"{N}x{K} tok{tok} hit{experts}"
            if tiny:   # the interpreter (no inline PTX): the section's code only
                base = W4A16Config(block_n=64, block_m=16, chunks=1, num_warps=4, num_stages=1, mode="f16",
                                   packing=pb.kernel_packing)
                cfgs = [("default", base)]
            else:
                ps = dataclasses.replace(base, mode="bf16rot_ps", prescale=True)
                cfgs = [("default", dataclasses.replace(base, mode="bf16rot", prescale=True)), ("bf16rot_ps", ps),
                        ("bf16rot_ps other loads", dataclasses.replace(ps, tma=not ps.tma, num_stages=4 if ps.tma else 2))]
                cfgs += [(f"bf16rot_ps {st} stages", dataclasses.replace(ps, num_stages=st))
                         for st in (2, 3, 4) if st != ps.num_stages]
                if ps.block_n == 128:   # 2 rows per thread instead of 4: fewer live multipliers
                    cfgs.append(("bf16rot_ps 64 rows", dataclasses.replace(ps, block_n=64)))
            for label, cfg in cfgs:
                add_w4a16("decode9", f"N{N} K{K} tok{tok} hit{experts} {label}", x, pb, rows, cfg, ref, floor, tag)
            if tok == 1 and not tiny:   # the bound left: the default without its block scales (wrong results)
                add_w4a16("decode9", f"N{N} K{K} tok{tok} hit{experts} DIAG no block scales", x, pb, rows, base, ref,
                          floor, tag, diag=2)
            if N == shape_l1[1] and not tiny:   # the MoE layer's fused L1 + SwiGLU
                I = N // 2
                sw_ref = ref[:, :I] * torch.sigmoid(ref[:, :I]) * ref[:, I:]
                sw = pick_config(rows.rows_hint, torch.bfloat16, "octb", swiglu=True)
                for label, cfg in (("default", dataclasses.replace(sw, mode="bf16rot")),
                                   ("bf16rot_ps", dataclasses.replace(sw, mode="bf16rot_ps"))):
                    add_w4a16("decode9", f"N{N} K{K} tok{tok} hit{experts} swiglu {label}", x, pb, rows, cfg, sw_ref,
                              floor, f"{tag} swiglu", swiglu=True)
            run_section_rows(rows9)
        _print_verdicts("decode9", rows9, [("bf16rot_ps", "bf16rot_ps wins", lambda r: r["cfg"]["mode"] == "bf16rot_ps")])

    # -- prefill: V3 L1 at 2048 tok/expert --
    if "prefill" in sections:
        for (E, N, K, tok) in ((*shape_l1, 2048 if not tiny else 64), (*shape_l1, 128 if not tiny else 16)):
            w, x, counts, rows, ref = problem(E, N, K, tok)
            pw = w["pw"]
            offs = torch.cumsum(counts, 0).to(torch.int32)
            xq, xs = quantize_act(x)
            ref8 = torch.bmm((xq.float() * xs).view(E, tok, K), w["f32"].transpose(1, 2)).reshape(E * tok, N)
            b_row, s_row = w["fp8"], w["fp8_scale"]
            b_grp, s_grp = expand_fp4(pw, fold="group")
            tag = f"N{N} K{K} tok{tok}"
            add("prefill", f"{tag} torch bf16 _grouped_mm",
                lambda: torch._grouped_mm(x, w["bf16"].transpose(1, 2), offs=offs), err_of(ref))
            add("prefill", f"{tag} torch fp8 rowwise _scaled_grouped_mm (gemm only)",
                lambda: torch_scaled_grouped_mm(xq, xs, b_row, s_row, counts), err_of(ref8))
            add("prefill", f"{tag} expand fp4->bf16", lambda: expand_fp4(pw, torch.bfloat16), None,
                bytes=E * N * K * 2.5)
            add("prefill", f"{tag} expand fp4->fp8 row", lambda: expand_fp4(pw, fold="row"), None, bytes=E * N * K * 1.5)
            add("prefill", f"{tag} expand fp4->fp8 group", lambda: expand_fp4(pw, fold="group"), None,
                bytes=E * N * K * 1.5)
            add("prefill", f"{tag} act quant fp8 token", lambda: quantize_act(x), None, bytes=E * tok * K * 3)
            add("prefill", f"{tag} w4a16 expand+_grouped_mm",
                lambda: torch._grouped_mm(x, expand_fp4(pw, torch.bfloat16).transpose(1, 2), offs=offs), err_of(ref))
            add("prefill", f"{tag} w4a8 quant+expand+torch scaled_grouped_mm",
                lambda: torch_scaled_grouped_mm(*quantize_act(x), *expand_fp4(pw, fold="row"), counts), err_of(ref8))
            fp8_cfgs = [(128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 4), (256, 128, 8, 3)]
            if tok <= 128:
                fp8_cfgs = [(64, 128, 4, 4), (128, 128, 8, 4)]
            if tiny:
                fp8_cfgs = [(16, 32, 4, 1)]
            for bm, bn, nw, ns in fp8_cfgs:
                cfg = FP8Config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                add("prefill", f"{tag} triton fp8 gemm only row bm{bm} bn{bn} w{nw} s{ns}",
                    (lambda cfg=cfg: fp8_grouped_gemm(xq, xs, b_row, s_row, rows, out_dtype=torch.bfloat16,
                                                      config=cfg)), err_of(ref8))
            cfg = FP8Config(*fp8_cfgs[0][:2], num_warps=fp8_cfgs[0][2], num_stages=3)
            add("prefill", f"{tag} triton fp8 gemm only group-promote bm{cfg.block_m} bn{cfg.block_n} s3",
                lambda: fp8_grouped_gemm(xq, xs, b_grp, s_grp, rows, out_dtype=torch.bfloat16, config=cfg),
                err_of(ref8))
            if tok <= 128 and not tiny:
                oct_w = repack(pw, "oct")
                for bm, nw in ((64, 4), (128, 8)):
                    cfg16 = W4A16Config(block_n=128, block_m=bm, chunks=1, num_warps=nw, num_stages=3, mode="f16asm",
                                        packing="oct")
                    add("prefill", f"{tag} w4a16 fused f16asm oct bm{bm} w{nw}",
                        (lambda cfg16=cfg16: launch_w4a16(x, oct_w, rows, out_dtype=torch.bfloat16, config=cfg16)),
                        err_of(ref))
            _run_variants(ctx, variants, results, save)
            variants.clear()
            del b_grp, s_grp
    # -- prefill2: the FP8 GEMM alone at V3 L2 (K 2048), where it trailed DeepGEMM (0.84x at 512 and
    # 2048 tok/expert, bench/results/gemm-deepgemm-h200.md): tile shapes and stages, rowwise scales
    # and the per-128 promotion, beside torch fp8 rowwise --
    if "prefill2" in sections:
        for tok in ((512, 2048) if not tiny else (32,)):
            E, N, K = shape_l2
            w, x, counts, rows, ref = problem(E, N, K, tok)
            xq, xs = quantize_act(x)
            gq, gs = quantize_act(x, group=True)
            ref8 = torch.bmm((xq.float() * xs).view(E, tok, K), w["f32"].transpose(1, 2)).reshape(E * tok, N)
            xg = (gq.float().view(E * tok, K // 128, 128) * gs.view(E * tok, K // 128, 1)).view(E, tok, K)
            ref8g = torch.bmm(xg, w["f32"].transpose(1, 2)).reshape(E * tok, N)
            b_grp, s_grp = expand_fp4(w["pw"], fold="group")
            tag = f"N{N} K{K} tok{tok}"
            add("prefill2", f"{tag} torch fp8 rowwise _scaled_grouped_mm (gemm only)",
                lambda: torch_scaled_grouped_mm(xq, xs, w["fp8"], w["fp8_scale"], counts), err_of(ref8),
                flops=2.0 * E * tok * N * K)
            cfgs = [(128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 4), (64, 256, 4, 4),
                    (128, 128, 4, 4), (128, 256, 4, 3), (256, 128, 8, 4)] if not tiny else [(16, 32, 4, 1)]
            for bm, bn, nw, ns in cfgs:
                cfg = FP8Config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                add("prefill2", f"{tag} triton fp8 gemm only row bm{bm} bn{bn} w{nw} s{ns}",
                    (lambda cfg=cfg: fp8_grouped_gemm(xq, xs, w["fp8"], w["fp8_scale"], rows, out_dtype=torch.bfloat16,
                                                      config=cfg)), err_of(ref8), flops=2.0 * E * tok * N * K)
            for bm, bn, nw, ns in (((128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 4, 3), (128, 256, 8, 3))
                                   if not tiny else ((16, 32, 4, 1),)):
                cfg = FP8Config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                add("prefill2", f"{tag} triton fp8 gemm only group-promote bm{bm} bn{bn} w{nw} s{ns}",
                    (lambda cfg=cfg: fp8_grouped_gemm(gq, gs, b_grp, s_grp, rows, out_dtype=torch.bfloat16,
                                                      config=cfg)), err_of(ref8g), flops=2.0 * E * tok * N * K)
            # the bound of the DeepGEMM gap: the same tiles without their epilogue store (DIAG 1:
            # each tile's 128 x 256 bf16 store is not overlapped with the next tile's loads here,
            # DeepGEMM's persistent kernel overlaps it), and DeepGEMM itself on these operands
            for bm, bn, nw, ns in (((128, 256, 8, 3), (256, 128, 8, 3)) if not tiny else ((16, 32, 4, 1),)):
                cfg = FP8Config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
                add("prefill2", f"{tag} triton fp8 gemm only row bm{bm} bn{bn} w{nw} s{ns} DIAG 1 (no store)",
                    (lambda cfg=cfg: fp8_grouped_gemm(xq, xs, w["fp8"], w["fp8_scale"], rows, out_dtype=torch.bfloat16,
                                                      config=cfg, diag=1)), None, flops=2.0 * E * tok * N * K, diag=1)
            # and the epilogue as one TMA store per tile (FP8Config.tma_store)
            for bm, bn, nw, ns in (((128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4)) if not tiny
                                   else ((16, 32, 4, 1),)):
                cfg = FP8Config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, tma_store=True)
                add("prefill2", f"{tag} triton fp8 gemm only row bm{bm} bn{bn} w{nw} s{ns} tma_store",
                    (lambda cfg=cfg: fp8_grouped_gemm(xq, xs, w["fp8"], w["fp8_scale"], rows, out_dtype=torch.bfloat16,
                                                      config=cfg)), err_of(ref8), flops=2.0 * E * tok * N * K)
            # and as a persistent kernel: one program per SM walking the tiles, the tile and K loops
            # flattened (the next tile's loads overlap this tile's epilogue) or not, operands by TMA
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if ctx.is_cuda else 2
            for bm, bn, nw, ns, flat, tma in (((128, 256, 8, 3, True, False), (128, 256, 8, 3, False, False),
                                               (128, 256, 8, 3, True, True), (128, 256, 8, 4, True, True),
                                               (128, 128, 8, 4, True, True), (256, 128, 8, 3, True, True))
                                              if not tiny else ((16, 32, 4, 1, True, False),)):
                cfg = FP8Config(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, persistent=sms, flatten=flat,
                                tma_load=tma)
                add("prefill2", f"{tag} triton fp8 gemm only row bm{bm} bn{bn} w{nw} s{ns} persistent {sms}"
                    + (" flatten" if flat else "") + (" tma loads" if tma else ""),
                    (lambda cfg=cfg: fp8_grouped_gemm(xq, xs, w["fp8"], w["fp8_scale"], rows, out_dtype=torch.bfloat16,
                                                      config=cfg)), err_of(ref8), flops=2.0 * E * tok * N * K)
            dg_fn = _deep_gemm_only(w["pw"], x, E, tok) if ctx.is_cuda else None
            if dg_fn is not None:
                add("prefill2", f"{tag} deep_gemm gemm only (fp8_group acts, 128x128 block weights)", dg_fn,
                    err_of(ref8g), flops=2.0 * E * tok * N * K)
            _run_variants(ctx, variants, results, save)
            variants.clear()
            del b_grp, s_grp
    print(f"probe done in {time.time() - t0:.0f} s")
    save()
    _print_table(results)


def _deep_gemm_only(pw, x: torch.Tensor, E: int, tok: int):
    """DeepGEMM's contiguous grouped GEMM alone on x (fp8_group, MN-major TMA-aligned scales) and
    pw folded to fp8 128x128 blocks, as a callable for the probe; None (printed why) when
    deep_gemm cannot run here."""
    from megapar.moe.kernels import deep_gemm as dgm
    from megapar.moe.kernels.grouped_gemm import GEMM
    from megapar.parallel.quant import quantize

    why = GEMM.usable(device=x.device, weight=pw, rows_per_expert=float(tok))["deep_gemm"]
    if why is not None or tok % 128:
        print(f"  deep_gemm row skipped: {why or f'{tok} rows per expert is not 128-aligned'}", flush=True)
        return None
    dg, dw = dgm._module(), dgm.deep_gemm_weight(pw)
    q = quantize(x, "fp8_group")
    sfa = dg.get_mn_major_tma_aligned_tensor(q.scale) if hasattr(dg, "get_mn_major_tma_aligned_tensor") else q.scale
    m_idx = torch.arange(E, dtype=torch.int32, device=x.device).repeat_interleave(tok)
    d = torch.empty(x.shape[0], dw.data.shape[1], dtype=torch.bfloat16, device=x.device)

    def run():
        dg.m_grouped_fp8_gemm_nt_contiguous((q.data, sfa), (dw.data, dw.scale), d, m_idx)
        return d
    return run


def tma_verdict(results: list[dict[str, Any]]) -> list[str]:
    """decode4, per problem: the default (pointer loads) against the fastest correct TMA row,
    with floor fractions: one line each, 'tma wins' when the TMA row is faster."""
    lines = []
    rows = [r for r in results if r.get("section") == "decode4" and "us" in r and r.get("diag") == 0]
    for prob in dict.fromkeys(r["problem"] for r in rows):
        mine = [r for r in rows if r["problem"] == prob]
        default = next((r for r in mine if not r["cfg"]["tma"] and r["name"].endswith("default")), None)
        tma = [r for r in mine if r["cfg"]["tma"] and (r.get("rel_err") is None or r["rel_err"] < 1e-2)]
        if default is None or not tma:
            continue
        best = min(tma, key=lambda r: r["us"])
        verdict = "tma wins" if best["us"] < default["us"] else "pointer loads win"
        lines.append(f"decode4 {prob}: default {default['us']:.1f} us ({default['floor_frac']:.3f} of floor), "
                     f"best tma {best['us']:.1f} us ({best['floor_frac']:.3f}) = {best['name']}: {verdict}")
    return lines


def _tuning_from(results: list[dict[str, Any]], shape_l1: tuple[int, int, int]) -> dict[str, Any]:
    """Best measured settings: the decode tiling and config (V3 L1 at 1 tok/expert decides the
    tiling), configs per block_m bucket with that tiling, expansion and act-quant launch sizes."""
    ok = [r for r in results if "us" in r and r.get("diag") == 0 and "cfg" in r and (r.get("rel_err") or 1) < 1e-2]
    main = f"{shape_l1[1]}x{shape_l1[2]} tok1"
    tuning: dict[str, Any] = {"w4a16": {}}
    first = [r for r in ok if r["problem"] == main]
    if first:
        best = min(first, key=lambda r: r["us"])
        tuning["tile_n"] = best["tile_n"]
        for bucket in (16, 32):
            cands = [r for r in ok if r["cfg"]["block_m"] == bucket and r["tile_n"] == best["tile_n"]]
            if cands:
                by_cfg: dict[str, list[float]] = {}
                for r in cands:   # rank configs by their mean time relative to each problem's fastest
                    fastest = min(c["us"] for c in cands if c["problem"] == r["problem"])
                    by_cfg.setdefault(json.dumps(r["cfg"], sort_keys=True), []).append(r["us"] / fastest)
                tuning["w4a16"][bucket] = json.loads(min(by_cfg, key=lambda k: sum(by_cfg[k]) / len(by_cfg[k])))
    exp = [r for r in results if "expand" in r and "us" in r and r["tile_n"] == tuning.get("tile_n", 0)]
    if exp:
        tuning["expand"] = min(exp, key=lambda r: r["us"])["expand"]
    aq = [r for r in results if "act_quant_warps" in r and "us" in r]
    if aq:
        tuning["act_quant_warps"] = min(aq, key=lambda r: r["us"])["act_quant_warps"]
    return tuning


def ctx_is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda"


def _run_variants(ctx, variants, results, save) -> None:
    if ctx.is_cuda:    # compile every variant in parallel first (on CPU a dry run: nothing to gain)
        t = time.time()
        with precompile():
            for _, _, fn, _, _ in variants:
                with contextlib.suppress(Exception):
                    fn()
        print(f"  precompiled {len(variants)} variants in {time.time() - t:.1f} s", flush=True)
    for section, name, fn, check, info in variants:
        row: dict[str, Any] = {"section": section, "name": name, **info}
        try:
            out = fn()
            if ctx.is_cuda:
                torch.cuda.synchronize()
            if check is not None:
                row["rel_err"] = check(out[0] if isinstance(out, tuple) else out)
            if ctx.is_cuda:
                row["us"], row["timing"] = graph_time(ctx, fn, iters=30)
            else:          # the interpreter's dry run: the call above was the warm-up
                row["us"], row["timing"] = ctx.time_fn(fn, warmup=0, iters=1), "eager"
            if "floor_us" in info:
                row["floor_frac"] = round(info["floor_us"] / row["us"], 3)
            if "bytes" in info:
                row["gbps"] = round(info["bytes"] / row["us"] / 1e3, 1)
            if "flops" in info:
                row["tflops"] = round(info["flops"] / row["us"] / 1e6, 1)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc(limit=2)
            if ctx.is_cuda:
                torch.cuda.synchronize()
        results.append(row)
        print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        save()


def _print_table(results) -> None:
    print("\n| variant | µs | rel_err | floor frac / GB/s |")
    for r in results:
        extra = r.get("floor_frac", r.get("gbps", ""))
        print(f"| {r['name']} | {r.get('us', r.get('error', '')[:60])} | {r.get('rel_err', '')} | {extra} |")


def _versions() -> dict[str, str]:
    from megapar.launch.bench.common import versions
    return versions()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", action="store_true")
    p.add_argument("--sections", default="decode2")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.probe:
        probe(args.out, args.sections.split(","))
        return 0
    from megapar.launch.cli import main as cli_main
    return cli_main(["bench", "gemm", "--out", args.out])


if __name__ == "__main__":
    sys.exit(main())
