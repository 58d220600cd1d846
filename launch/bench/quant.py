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

Times are CUDA-graph replays (the serving setting), ours and the torch anchor alike (column
`anchor_timing`; until 2026-12-05 the anchor alone was an eager call, its host launches counted
against it). Until 2026-12-03 they were eager calls
between CUDA events from an idle GPU, which count the host's Python wrapper and Triton launch on
top of the kernels (the wrapper alone, with the launches stubbed out, takes 22-58 µs per call on
the 2-core CI machine; 38.9 µs for mxfp4, 57.9 µs for nvfp4 with its amax pass): at these sizes
(70-85 µs floors) that can be a large part of the misses the earlier probes reported.

With `--device cuda` (full run) a short sweep of tile rows x warps per kernel is recorded too,
so `moe.quant.triton_quant.CONFIG` can be checked against the best setting.

`python -m megapar.launch.bench.quant --probe --out DIR` is the tuning probe: for every op (a
quantize or dequantize at the full sizes on CUDA) each kernel that can run it (the default and
the opt-in `triton_quant.VARIANTS`) at a handful of launch settings (tile x warps, tiles per
program, the fp8 quantizers with and without the hardware E4M3 conversion, nvfp4's second read
backwards or matrix by matrix), each checked bit for bit against the CPU reference on a slice,
timed as a CUDA-graph replay and eagerly, printed as a table (GB/s, % of the copy ceiling). The
fastest bit-identical setting per kernel and kernel per op go to DIR/quant-tuning.json, which
`triton_quant.apply_tuning` (or MEGAPAR_QUANT_TUNING=DIR/quant-tuning.json) installs.
Diagnostic rows, never chosen: each FP4 quantize kernel at its default launch with its
arithmetic dropped ("DIAG memory only": the same loads and stores, the bound the access pattern
alone sets), nvfp4's amax pass alone and its quantize alone with the tensor scale given (the
two reads of a computed scale, side by side), nvfp4 dequantize per kernel, and a torch copy of
each input (this run's copy ceiling). All kernels compile first, in parallel. On CPU under
TRITON_INTERPRET=1 it is a dry run on tiny sizes (one setting per kernel and per option).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps, event_median_us, graph_time
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


def _bits_vs_cpu_reference(x: torch.Tensor, q, fmt: str, opts: dict, rows: int,
                           cache: dict | None = None) -> tuple[bool, bool]:
    """(quantize bits, dequantize bits) of q (from x on any device) against the CPU torch
    reference on the first `rows` rows of the first matrix (cache: reuse the reference across calls)."""
    ok, ref, part = _cpu_reference(x, q, fmt, opts, rows, cache)
    ok = ok and _same(part, ref)
    deq = _slice_rows(dequantize(q, torch.bfloat16), rows).cpu()
    return ok, _same(deq, _ref_dequant(ref, cache))


def _cpu_reference(x: torch.Tensor, q, fmt: str, opts: dict, rows: int, cache: dict | None = None):
    """(q's computed nvfp4 global scale is amax / 2688, the CPU reference's quantization of the
    first rows, q's part of it)."""
    from megapar.moe.quant.reference import NVFP4_GLOBAL_DIVISOR

    xs = _slice_rows(x, rows).cpu()
    opts_cpu = dict(opts)
    ok = True
    if fmt == "nvfp4":
        gs = q.global_scale.cpu()
        if not isinstance(opts.get("global_scale"), (float, torch.Tensor)):     # computed: check it
            per_matrix = opts.get("global_scale") == "matrix"
            key = ("amax", x.data_ptr(), per_matrix)
            if cache is None or key not in cache:
                amax = (x.abs().amax(dim=(-2, -1)) if per_matrix else x.abs().amax()).float().cpu()
                if cache is not None:
                    cache[key] = amax
            amax = cache[key] if cache is not None else amax
            ok = _same(gs, amax / NVFP4_GLOBAL_DIVISOR)
        opts_cpu["global_scale"] = gs[(0,) * gs.dim()].reshape(()) if gs.dim() else gs
    key = (x.data_ptr(), fmt, rows, repr({k: (v.cpu().tolist() if isinstance(v, torch.Tensor) else v)
                                        for k, v in opts_cpu.items()}))
    if cache is not None and key in cache:
        ref = cache[key]
    else:
        ref = quantize(xs, fmt, backend="torch", **opts_cpu)
        if cache is not None:
            cache[key] = ref
    part = QuantizedTensor(_slice_rows(q.data, rows).cpu(),
                           _slice_rows(q.scale, -(-rows // 128) if fmt == "fp8_block" else rows).cpu(),
                           fmt, xs.shape, None if fmt != "nvfp4" else opts_cpu["global_scale"])
    return ok, ref, part


def _ref_dequant(ref, cache: dict | None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    key = ("deq", id(ref), dtype)
    if cache is not None and key in cache:
        return cache[key][1]
    deq = dequantize(ref, dtype, backend="torch")
    if cache is not None:
        cache[key] = (ref, deq)          # (ref kept alive: its id stays unique)
    return deq


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
        copy_us, _ = graph_time(ctx, lambda: out.copy_(weight))
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
            ours_us, how = graph_time(ctx, lambda: quantize(x, fmt, backend=backend, **opts))
            # the anchor timed as ours is (a graph replay; eager where its capture fails, anchor_timing says)
            anchor_us, anchor_how = graph_time(ctx, lambda: quantize(x, fmt, backend="torch", **opts),
                                               iters=anchor_iters)
            floor_us = moved / (ceiling * 1e3)
            extra = {}
            if fmt == "nvfp4" and not isinstance(opts.get("global_scale"), (float, torch.Tensor)):
                # a computed global scale needs the amax before any block: two reads of x
                extra["two_read_floor_us"] = (moved + in_bytes) / (ceiling * 1e3)
            ctx.record(f"quantize {label} bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=bits_ok, timing=how,
                       anchor_timing=anchor_how, **extra)
            ours_us, how = graph_time(ctx, lambda: dequantize(q, torch.bfloat16, backend=backend))
            anchor_us, anchor_how = graph_time(ctx, lambda: dequantize(q, torch.bfloat16, backend="torch"),
                                               iters=anchor_iters)
            ctx.record(f"dequantize {label} -> bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=deq_ok, timing=how,
                       anchor_timing=anchor_how)
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
            default_us = graph_time(ctx, fn, iters=20)[0]
            best = None
            for rows, warps in (default[name], *choices[name]):
                tq.CONFIG[name] = (rows, warps)
                us = default_us if (rows, warps) == default[name] else graph_time(ctx, fn, iters=20)[0]
                if best is None or us < best[0]:
                    best = (us, rows, warps)
            tq.CONFIG[name] = default[name]
            ctx.record(f"sweep {name}", best[0], anchor="default CONFIG", anchor_us=default_us,
                       best_rows=best[1], best_warps=best[2], default_rows=default[name][0],
                       default_warps=default[name][1])
    finally:
        tq.CONFIG.update(default)


# ------------------------------------------------------------------ tuning probe

# (tile, warps) per CONFIG kernel: the current defaults are always included. Each setting costs a
# compile (in parallel, before any timing) and ~0.1 s of timing and bit checks.
PROBE_SETTINGS: dict[str, tuple[tuple[int, int], ...]] = {
    "fp4_quant": ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8), (512, 8)),
    "fp4_dequant": ((128, 4), (256, 4), (256, 8), (512, 8), (1024, 8), (512, 16)),
    "fp4_amax": ((4096, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16)),
    "fp8_group": ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)),
    "fp8_token": ((8192, 4), (8192, 8), (8192, 16), (16384, 8), (32768, 16)),
    "fp8_block": ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8)),
    "fp8_dequant": ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8), (128, 8)),
    # the opt-in variants (triton_quant.VARIANTS): lines of 32 per tile, warps (x LOOPS below)
    "mxfp4_lines": ((128, 4), (64, 2), (256, 8), (32, 1)),
    "nvfp4_lines": ((128, 4), (64, 2), (256, 8)),
    "fp4_dequant_chunks": ((1024, 4), (512, 4), (2048, 8), (256, 2), (512, 2)),
    "fp8_token_rows": ((1024, 4), (512, 2), (1024, 8), (2048, 8)),
    "fp8_block_unrolled": ((32, 8), (64, 8), (16, 8), (64, 16)),
    "fp8_dequant_chunks": ((64, 8), (32, 4), (128, 8), (16, 4), (64, 4)),
}
# tiles per program (software prefetch) of the lines kernels, each at its first two settings
PROBE_LOOPS = {"mxfp4_lines": (2, 4), "nvfp4_lines": (2,)}
HW_CAST_KERNELS = ("fp8_group", "fp8_token", "fp8_block")     # also probed with the integer rounding
# op -> (fmt, opts, input, "quantize" | "dequantize", [(kernel, variant)]): what the probe times;
# variant None: the kernel has no alternative (the op's only kernel)
PROBE_OPS: dict[str, tuple[str, dict, str, str, list[tuple[str, str | None]]]] = {
    "mxfp4_quant": ("mxfp4", {}, "weight", "quantize", [("fp4_quant", "blocks"), ("mxfp4_lines", "lines")]),
    "fp4_dequant": ("mxfp4", {}, "weight", "dequantize", [("fp4_dequant", "blocks"), ("fp4_dequant_chunks", "chunks")]),
    "nvfp4_quant": ("nvfp4", {}, "weight", "quantize", [("fp4_amax", "blocks"), ("nvfp4_lines", "lines")]),
    "fp8_group": ("fp8_group", {}, "act", "quantize", [("fp8_group", None)]),
    "fp8_token": ("fp8_token", {}, "act", "quantize", [("fp8_token", "tile"), ("fp8_token_rows", "rows")]),
    "fp8_block": ("fp8_block", {}, "weight", "quantize", [("fp8_block", "loop"), ("fp8_block_unrolled", "unrolled")]),
    "fp8_dequant": ("fp8_group", {}, "act", "dequantize", [("fp8_dequant", "tile"), ("fp8_dequant_chunks", "chunks")]),
}
# the VARIANTS entry an op's variant sets (the ops in PROBE_OPS choose it; the others show it)
VARIANT_OF = {"mxfp4_quant": "mxfp4_quant", "nvfp4_quant": "nvfp4_quant", "fp4_dequant": "fp4_dequant",
              "fp8_token": "fp8_token", "fp8_block": "fp8_block", "fp8_dequant": "fp8_dequant",
              "nvfp4_matrix_quant": "nvfp4_quant",
              "nvfp4_dequant": "fp4_dequant"}


def _time_graph_us(fn: Callable[[], Any], cuda: bool, iters: int) -> tuple[float, str]:
    """Median µs of fn as a CUDA-graph replay (what a serving step runs: no Python or launch
    cost), ("eager" on CPU or when the capture fails)."""
    if not cuda:
        return _time_us(fn, cuda, iters), "eager"
    from megapar.launch.bench.common import capture_graph

    try:
        graph, out = capture_graph(fn)
    except Exception as e:  # noqa: BLE001 - fall back, and say so
        torch.cuda.synchronize()
        return _time_us(fn, cuda, iters), f"eager ({type(e).__name__})"
    us = _time_us(graph.replay, cuda, iters)
    del graph, out
    return us, "graph"


def _time_us(fn: Callable[[], Any], cuda: bool, iters: int) -> float:
    """Median µs of fn() between CUDA events, each call from an idle GPU: on CUDA this counts
    the host's Python and launch time before the first kernel starts (the eager figure)."""
    if not cuda:        # the interpreter's dry run: one call, no warm-up (nothing compiles)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return event_median_us(fn, iters)


def _probe_rows(cfg: dict, cuda: bool) -> list[dict[str, Any]]:
    """Every setting the probe times: dicts of op, kernel, tile, warps, variant, loops, hw_cast,
    reverse, group_bytes, role ("tune": may be chosen; "diag": a diagnostic, never chosen).
    On CPU (the interpreter's dry run) one setting per kernel (and one of each option), so every path runs once."""
    from megapar.parallel.quant import triton_quant as tq

    def row(op, kernel, tile_warps, variant, role="tune", **extra):
        r = {"op": op, "kernel": kernel, "tile": tile_warps[0], "warps": tile_warps[1], "variant": variant,
             "loops": tq.LOOPS.get(kernel, 1), "hw_cast": tq.FP8_HW_CAST, "reverse": False, "group_bytes": 0,
             "role": role}
        r.update(extra)
        return r

    rows = []
    for op, (_, _, _, _, kernels) in PROBE_OPS.items():
        for kernel, variant in kernels:
            settings = list(dict.fromkeys((cfg[kernel], *PROBE_SETTINGS[kernel])))
            if not cuda:
                settings = settings[:1]
            rows += [row(op, kernel, st, variant) for st in settings]
            for loops in PROBE_LOOPS.get(kernel, ()) if cuda else PROBE_LOOPS.get(kernel, ())[:1]:
                rows += [row(op, kernel, st, variant, loops=loops) for st in settings[:2]]
            if kernel in HW_CAST_KERNELS:
                rows.append(row(op, kernel, cfg[kernel], variant, hw_cast=not tq.FP8_HW_CAST))
    # nvfp4 with a computed tensor scale reads x twice: quantize walking backwards (its first
    # reads where the amax pass ended, maybe in L2), and the parts timed alone (diagnostics)
    nv_kernels = (("fp4_amax", "blocks"), ("nvfp4_lines", "lines")) if cuda else (("nvfp4_lines", "lines"),)
    for kernel, variant in nv_kernels:
        rows.append(row("nvfp4_quant", kernel, cfg[kernel], variant, reverse=True))
        rows.append(row("nvfp4_quant", kernel, cfg[kernel], variant, role="diag", what="quantize only, given tensor scale"))
    rows.append(row("nvfp4_quant", "fp4_amax", cfg["fp4_amax"], "blocks", role="diag", what="amax pass only"))
    # per-matrix computed scales: whole quantize, and matrix by matrix (amax, then quantize backwards)
    for kernel, variant in nv_kernels:
        rows.append(row("nvfp4_matrix_quant", kernel, cfg[kernel], variant))
        rows.append(row("nvfp4_matrix_quant", kernel, cfg[kernel], variant, group_bytes=1))
    # nvfp4 dequantize with each variant (the choice is made on mxfp4; shown for both)
    for kernel, variant in (("fp4_dequant", "blocks"), ("fp4_dequant_chunks", "chunks")):
        rows.append(row("nvfp4_dequant", kernel, cfg[kernel], variant, role="diag", what="nvfp4 dequantize"))
    # the arithmetic dropped (same loads and stores): the bound the access pattern alone sets
    for op, kernel, variant in (("mxfp4_quant", "fp4_quant", "blocks"), ("mxfp4_quant", "mxfp4_lines", "lines"),
                                ("nvfp4_quant", "fp4_amax", "blocks"), ("nvfp4_quant", "nvfp4_lines", "lines")):
        rows.append(row(op, kernel, cfg[kernel], variant, role="diag", what="DIAG memory only"))
    return rows


_OPS_FOR = {"nvfp4_matrix_quant": ("nvfp4", {"global_scale": "matrix"}, "weight", "quantize"),
            "nvfp4_dequant": ("nvfp4", {}, "weight", "dequantize")}


def probe(out_dir: str | os.PathLike, *, device: str | None = None, iters: int = 20) -> dict:
    """Run the tuning probe (module docstring); returns what it writes to out_dir/quant-tuning.json."""
    from megapar.launch.bench.common import precompile
    from megapar.parallel import impl
    from megapar.parallel.quant import triton_quant as tq

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    if not cuda and not impl.interpreting():
        raise ValueError("the quant probe needs CUDA, or TRITON_INTERPRET=1 for a CPU dry run")
    weight_shape, act_shape, rows = ((4, 4096, 7168), (16384, 7168), 512) if cuda else ((2, 32, 256), (32, 256), 32)
    deq_dtype = torch.bfloat16 if cuda else torch.float32      # (the interpreter rounds to bf16 its own way)
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {"weight": torch.randn(weight_shape, generator=g).to(dev, torch.bfloat16),
              "act": (torch.randn(act_shape, generator=g) * 3).to(dev, torch.bfloat16)}
    ceiling = copy_ceiling_gbps(dev)
    saved = _tq_state(tq)
    cfg = dict(tq.CONFIG)
    plan = _probe_rows(cfg, cuda)
    ops = {op: spec[:4] for op, spec in PROBE_OPS.items()} | _OPS_FOR
    q_in = {}             # op -> the dequantize input (default settings)
    ref_cache: dict = {}
    t_start = time.time()
    results: list[dict[str, Any]] = []
    try:
        for op, (fmt, opts, name, kind) in ops.items():
            if kind == "dequantize":
                q_in[op] = quantize(inputs[name], fmt, backend="triton", **opts)
        gs_tensor = q_in["nvfp4_dequant"].global_scale          # the weight's computed tensor scale
        calls = [_probe_call(tq, r, ops, inputs, q_in, gs_tensor, saved, deq_dtype) for r in plan]
        if cuda:          # every compile first, in parallel (launches only compile in here)
            with precompile():
                for r, (setup, fn) in zip(plan, calls):
                    setup()
                    fn()
            _tq_restore(tq, saved)
            torch.cuda.synchronize()
        for r, (setup, fn) in zip(plan, calls):
            fmt, opts, name, kind = ops[r["op"]]
            x = inputs[name]
            res = {k: v for k, v in r.items()}
            res["fmt"] = fmt
            res["default"] = r["role"] == "tune" and _is_default(r, cfg, saved)
            try:
                setup()
                out = fn()
                what = r.get("what", "")
                if what.startswith("DIAG") or what == "amax pass only":
                    res["bit_identical"] = False              # not a quantization
                elif kind == "quantize":
                    o = dict(opts, global_scale=gs_tensor) if what.startswith("quantize only") else opts
                    ok, ref, part = _cpu_reference(x, out, fmt, o, rows, ref_cache)
                    res["bit_identical"] = ok and _same(part, ref)
                else:
                    q = q_in[r["op"]]
                    _, ref, _ = _cpu_reference(x, q, fmt, opts, rows, ref_cache)
                    res["bit_identical"] = _same(_slice_rows(out, rows).cpu(), _ref_dequant(ref, ref_cache, deq_dtype))
                del out
                us, how = _time_graph_us(fn, cuda, iters)
                eager = _time_us(fn, cuda, iters) if cuda else us
                in_bytes = x.numel() * x.element_size()
                moved = in_bytes if what == "amax pass only" else in_bytes + _q_nbytes(x, fmt)
                res.update(us=round(us, 2), timing=how, eager_us=round(eager, 2), gbps=round(moved / us / 1e3, 1),
                           pct_copy=round(100 * moved / us / 1e3 / ceiling, 1))
            except Exception as e:  # noqa: BLE001
                res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                _tq_restore(tq, saved)
            results.append(res)
            print("  " + "  ".join(f"{k}={v}" for k, v in res.items()), flush=True)
            if cuda:
                torch.cuda.synchronize()
        for name, x in inputs.items():          # this run's copy ceiling (bytes read + written)
            out = torch.empty_like(x)
            us, how = _time_graph_us(lambda: out.copy_(x), cuda, iters)
            moved = 2 * x.numel() * x.element_size()
            results.append({"op": f"copy {name}", "kernel": "torch copy_", "role": "diag", "fmt": "bf16", "default": False,
                            "us": round(us, 2), "timing": how, "gbps": round(moved / us / 1e3, 1),
                            "pct_copy": round(100 * moved / us / 1e3 / ceiling, 1)})
            del out
    finally:
        _tq_restore(tq, saved)
    tuning = _choose(results, saved)
    tuning.update({"device": torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter dry run)",
                   "sizes": {"weight": list(weight_shape), "act": list(act_shape)},
                   "timing": "CUDA-graph replays (us); eager_us: one call from an idle GPU, host time included",
                   "seconds": round(time.time() - t_start, 1), "results": results})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant-tuning.json").write_text(json.dumps(tuning, indent=1))
    _print_probe_table(results, tuning["best"])
    print(f"wrote {out / 'quant-tuning.json'} ({tuning['seconds']} s): config {tuning['config']}, variants "
          f"{tuning['variants']}, loops {tuning['loops']}, fp8_hw_cast {tuning['fp8_hw_cast']}, nvfp4_reverse "
          f"{tuning['nvfp4_reverse']}, nvfp4_group_bytes {tuning['nvfp4_group_bytes']}", flush=True)
    return tuning


def _tq_state(tq) -> dict:
    return {"config": dict(tq.CONFIG), "variants": dict(tq.VARIANTS), "loops": dict(tq.LOOPS),
            "hw": tq.FP8_HW_CAST, "reverse": tq.NVFP4_REVERSE, "group_bytes": tq.NVFP4_GROUP_BYTES}


def _tq_restore(tq, st: dict) -> None:
    tq.CONFIG.clear()
    tq.CONFIG.update(st["config"])
    tq.VARIANTS.clear()
    tq.VARIANTS.update(st["variants"])
    tq.LOOPS.clear()
    tq.LOOPS.update(st["loops"])
    tq.FP8_HW_CAST, tq.NVFP4_REVERSE, tq.NVFP4_GROUP_BYTES = st["hw"], st["reverse"], st["group_bytes"]
    tq.FP4_QUANT_DIAG = 0


def _is_default(r: dict, cfg: dict, st: dict) -> bool:
    """The row is what the module launches for its op as it stands."""
    key = VARIANT_OF.get(r["op"])
    if key is not None and st["variants"][key] != r["variant"]:
        return False
    return ((r["tile"], r["warps"]) == cfg[r["kernel"]] and r["loops"] == st["loops"].get(r["kernel"], 1)
            and r["hw_cast"] == st["hw"] and r["reverse"] == st["reverse"] and r["group_bytes"] == st["group_bytes"])


def _probe_call(tq, r: dict, ops: dict, inputs: dict, q_in: dict, gs_tensor, st: dict, deq_dtype: torch.dtype):
    """(setup, fn) for one probe row: setup installs the row's settings in triton_quant, fn runs
    the op (what is timed)."""
    fmt, opts, name, kind = ops[r["op"]]
    x = inputs[name]
    op_key = VARIANT_OF.get(r["op"])

    def setup():
        _tq_restore(tq, st)
        tq.CONFIG[r["kernel"]] = (r["tile"], r["warps"])
        if r["kernel"] in tq.LOOPS:
            tq.LOOPS[r["kernel"]] = r["loops"]
        if r["variant"] is not None and op_key is not None:
            tq.VARIANTS[op_key] = r["variant"]
        tq.FP8_HW_CAST = r["hw_cast"]
        tq.NVFP4_REVERSE = r["reverse"]
        tq.NVFP4_GROUP_BYTES = r["group_bytes"]
        if r.get("what") == "DIAG memory only":
            tq.FP4_QUANT_DIAG = 1

    what = r.get("what", "")
    if what == "amax pass only":
        return setup, lambda: tq._computed_global_scale(x, False)
    if what.startswith("quantize only"):
        return setup, lambda: tq.quantize(x, fmt, **dict(opts, global_scale=gs_tensor))
    if kind == "dequantize":
        q = q_in[r["op"]]
        return setup, lambda: tq.dequantize(q, deq_dtype)
    return setup, lambda: tq.quantize(x, fmt, **opts)


def _q_nbytes(x: torch.Tensor, fmt: str) -> int:
    """Bytes a quantize of x writes (data and scales)."""
    from megapar.parallel.quant.formats import get_format

    n = x.numel()
    if fmt in ("mxfp4", "nvfp4"):
        return n // 2 + n // get_format(fmt).block[1]
    k = x.shape[-1]
    if fmt == "fp8_token":
        return n + 4 * (n // k)
    if fmt == "fp8_group":
        return n + 4 * (n // k) * -(-k // 128)
    nrows = x.shape[-2]
    return n + 4 * (n // (nrows * k)) * -(-nrows // 128) * -(-k // 128)


def _choose(results: list[dict], st: dict) -> dict:
    """The tuning file's settings: per CONFIG kernel its fastest bit-identical setting, per op its
    fastest variant, the fp8 hardware cast where every fp8 quantizer was bit-identical with it
    and it won in most, nvfp4 reverse / grouping where they won."""
    best_kernel: dict[str, dict] = {}
    best_op: dict[str, dict] = {}
    for r in results:
        if r.get("role") != "tune" or not r.get("bit_identical") or "us" not in r:
            continue
        plain = r["hw_cast"] == st["hw"] and not r["reverse"] and not r["group_bytes"] and r["op"] in PROBE_OPS
        if plain and (r["kernel"] not in best_kernel or r["us"] < best_kernel[r["kernel"]]["us"]):
            best_kernel[r["kernel"]] = r
        if r["op"] not in best_op or r["us"] < best_op[r["op"]]["us"]:
            best_op[r["op"]] = r
    config = {k: [r["tile"], r["warps"]] for k, r in best_kernel.items()}
    loops = {k: r["loops"] for k, r in best_kernel.items() if k in st["loops"]}
    variants = {VARIANT_OF[op]: r["variant"] for op, r in best_op.items() if op in VARIANT_OF and op in PROBE_OPS}
    hw_rows = [r for r in results if r.get("role") == "tune" and r.get("kernel") in HW_CAST_KERNELS]
    hw_ok = all(r.get("bit_identical") for r in hw_rows if r["hw_cast"])
    hw_best = [best_op[op]["hw_cast"] for op in HW_CAST_KERNELS if op in best_op]
    nv = best_op.get("nvfp4_quant")
    nv_variant = nv["variant"] if nv else st["variants"]["nvfp4_quant"]
    nvm = min((r for r in results if r.get("op") == "nvfp4_matrix_quant" and r.get("variant") == nv_variant
               and r.get("bit_identical") and "us" in r), key=lambda r: r["us"], default=None)
    return {"config": config, "variants": variants, "loops": loops,
            "fp8_hw_cast": bool(hw_ok and hw_best and sum(hw_best) * 2 >= len(hw_best)),
            "nvfp4_reverse": bool(nv and nv["reverse"]),
            "nvfp4_group_bytes": int(nvm["group_bytes"]) if nvm else 0,
            "best": {op: {k: r[k] for k in ("kernel", "variant", "tile", "warps", "loops", "hw_cast", "reverse",
                                           "group_bytes", "us", "pct_copy")} for op, r in best_op.items()}}


def _print_probe_table(results: list[dict], best: dict) -> None:
    print("\n| op | kernel | variant | tile | warps | loops | extra | us (graph) | eager us | GB/s | % copy | bits | |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b = best.get(r["op"], {})
        is_best = r.get("role") == "tune" and "us" in r and all(r.get(k) == v for k, v in b.items() if k != "pct_copy")
        extra = ", ".join(x for x in (r.get("what", ""), "" if r.get("hw_cast", True) else "integer e4m3",
                                      "reverse" if r.get("reverse") else "",
                                      "by matrix" if r.get("group_bytes") else "") if x)
        mark = ("best" if is_best and b else "") + (" default" if r.get("default") else "")
        print(f"| {r['op']} | {r['kernel']} | {r.get('variant') or ''} | {r.get('tile', '')} | {r.get('warps', '')} | "
              f"{r.get('loops', '')} | {extra} | {r.get('us', r.get('error', '')[:50])} | {r.get('eager_us', '')} | "
              f"{r.get('gbps', '')} | {r.get('pct_copy', '')} | {r.get('bit_identical', '')} | {mark.strip()} |")


def main(argv: list[str] | None = None) -> int:
    from megapar.launch.bench.common import probe_main

    return probe_main("quant", __doc__, probe, "quant-tuning.json", argv)


if __name__ == "__main__":
    sys.exit(main())
