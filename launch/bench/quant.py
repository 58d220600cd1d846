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

`python -m megapar.launch.bench.quant --probe --out DIR` is the tuning probe: for every kernel a
handful of launch settings (tile x warps; the fp8 quantizers with and without the hardware E4M3
conversion) at the full sizes on CUDA, each checked bit for bit against the CPU reference on a
slice, timed, printed as a table (GB/s, % of the copy ceiling), and the fastest bit-identical
setting per kernel written to DIR/quant-tuning.json, which `triton_quant.apply_tuning` (or
MEGAPAR_QUANT_TUNING=DIR/quant-tuning.json) installs. Two more rows per run, never chosen: the
FP4 quantize kernel (mxfp4, nvfp4) at its default launch with its arithmetic dropped ("DIAG
memory only": the same loads and stores), the bound its access pattern alone sets. On CPU
under TRITON_INTERPRET=1 it is a dry run on tiny sizes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

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
            extra = {}
            if fmt == "nvfp4" and not isinstance(opts.get("global_scale"), (float, torch.Tensor)):
                # a computed global scale needs the amax before any block: two reads of x
                extra["two_read_floor_us"] = (moved + in_bytes) / (ceiling * 1e3)
            ctx.record(f"quantize {label} bf16 {tuple(x.shape)}", ours_us, anchor="torch reference",
                       anchor_us=anchor_us, floor_us=floor_us, gbps=moved / ours_us / 1e3,
                       meets_target=floor_us / ours_us >= TARGET, bit_identical=bits_ok, **extra)
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


# ------------------------------------------------------------------ tuning probe

# (tile, warps) per kernel: the current defaults are always included; ~6 each keeps the whole
# probe (a compile per setting) well under 3 minutes on the H200
PROBE_SETTINGS: dict[str, tuple[tuple[int, int], ...]] = {
    "fp4_quant": ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8), (512, 8)),
    "fp4_dequant": ((128, 4), (256, 4), (256, 8), (512, 8), (1024, 8), (512, 16)),
    "fp4_amax": ((4096, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16)),
    "fp8_group": ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8)),
    "fp8_token": ((8192, 4), (8192, 8), (8192, 16), (16384, 8), (32768, 16)),
    "fp8_block": ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8)),
    "fp8_dequant": ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8), (128, 8)),
}
HW_CAST_KERNELS = ("fp8_group", "fp8_token", "fp8_block")     # also probed with the integer rounding


def _probe_cases(weight: torch.Tensor, act: torch.Tensor) -> dict[str, tuple[str, dict, torch.Tensor, str]]:
    """kernel -> (fmt, opts, input, "quantize" | "dequantize"): what each CONFIG entry launches."""
    return {
        "fp4_quant": ("mxfp4", {}, weight, "quantize"),
        "fp4_dequant": ("mxfp4", {}, weight, "dequantize"),
        "fp4_amax": ("nvfp4", {}, weight, "quantize"),            # the whole nvfp4 quantize, amax pass included
        "fp8_group": ("fp8_group", {}, act, "quantize"),
        "fp8_token": ("fp8_token", {}, act, "quantize"),
        "fp8_block": ("fp8_block", {}, weight, "quantize"),
        "fp8_dequant": ("fp8_group", {}, act, "dequantize"),
    }


def _time_us(fn: Callable[[], Any], cuda: bool, iters: int) -> float:
    if not cuda:        # the interpreter's dry run: one call, no warm-up (nothing compiles)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def probe(out_dir: str | os.PathLike, *, device: str | None = None, iters: int = 20) -> dict:
    """Run the tuning probe (module docstring); returns what it writes to out_dir/quant-tuning.json."""
    from megapar.parallel import impl
    from megapar.parallel.quant import triton_quant as tq

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    if not cuda and not impl.interpreting():
        raise ValueError("the quant probe needs CUDA, or TRITON_INTERPRET=1 for a CPU dry run")
    weight_shape, act_shape, rows = ((4, 4096, 7168), (16384, 7168), 512) if cuda else ((2, 64, 256), (64, 256), 64)
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(weight_shape, generator=g).to(dev, torch.bfloat16)
    act = (torch.randn(act_shape, generator=g) * 3).to(dev, torch.bfloat16)
    ceiling = copy_ceiling_gbps(dev)
    default_cfg, default_hw = dict(tq.CONFIG), tq.FP8_HW_CAST
    results: list[dict[str, Any]] = []
    t_start = time.time()
    try:
        for kernel, (fmt, opts, x, op) in _probe_cases(weight, act).items():
            settings = list(dict.fromkeys((default_cfg[kernel], *PROBE_SETTINGS[kernel])))
            variants = [(st, default_hw) for st in settings]
            if kernel in HW_CAST_KERNELS:
                variants += [(default_cfg[kernel], not default_hw)]
            q_ref = quantize(x, fmt, backend="triton", **opts)   # (defaults) the dequant input
            in_bytes = x.numel() * x.element_size()
            moved = in_bytes + q_ref.nbytes
            for (tile, warps), hw in variants:
                tq.CONFIG.update(default_cfg)
                tq.CONFIG[kernel] = (tile, warps)
                tq.FP8_HW_CAST = hw
                row: dict[str, Any] = {"kernel": kernel, "fmt": fmt, "op": op, "tile": tile, "warps": warps,
                                       "hw_cast": hw, "default": (tile, warps) == default_cfg[kernel] and hw == default_hw}
                try:
                    if op == "quantize":
                        fn = lambda: tq.quantize(x, fmt, **opts)    # noqa: E731
                        q = fn()
                        row["bit_identical"] = _bits_vs_cpu_reference(x, q, fmt, opts, rows)[0]
                    else:
                        fn = lambda: tq.dequantize(q_ref, torch.bfloat16)    # noqa: E731
                        row["bit_identical"] = _bits_vs_cpu_reference(x, q_ref, fmt, opts, rows)[1]
                    us = _time_us(fn, cuda, iters)
                    row.update(us=round(us, 2), gbps=round(moved / us / 1e3, 1),
                               pct_copy=round(100 * moved / us / 1e3 / ceiling, 1))
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results.append(row)
                print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                if cuda:
                    torch.cuda.synchronize()
        # the FP4 quantize kernel at its default launch without its arithmetic (same loads and
        # stores): what of the miss against the copy ceiling the access pattern alone explains
        tq.CONFIG.update(default_cfg)
        tq.FP8_HW_CAST = default_hw
        for kernel, fmt, x in (("fp4_quant", "mxfp4", weight), ("fp4_amax", "nvfp4", weight)):
            tile, warps = default_cfg["fp4_quant"]
            row = {"kernel": kernel, "fmt": fmt, "op": "DIAG memory only", "tile": tile, "warps": warps,
                   "hw_cast": default_hw, "default": False, "bit_identical": False}
            moved = x.numel() * x.element_size() + quantize(x, fmt, backend="triton").nbytes
            tq.FP4_QUANT_DIAG = 1
            try:
                us = _time_us(lambda: tq.quantize(x, fmt), cuda, iters)
                row.update(us=round(us, 2), gbps=round(moved / us / 1e3, 1),
                           pct_copy=round(100 * moved / us / 1e3 / ceiling, 1))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                tq.FP4_QUANT_DIAG = 0
            results.append(row)
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    finally:
        tq.CONFIG.clear()
        tq.CONFIG.update(default_cfg)
        tq.FP8_HW_CAST = default_hw
        tq.FP4_QUANT_DIAG = 0
    config, best_rows = {}, {}
    for r in results:
        if r.get("bit_identical") and "us" in r and (r["kernel"] not in best_rows or r["us"] < best_rows[r["kernel"]]["us"]):
            best_rows[r["kernel"]] = r
    for kernel, r in best_rows.items():
        config[kernel] = [r["tile"], r["warps"]]
    # the hardware cast only where every fp8 quantizer was bit-identical with it
    hw_ok = all(r.get("bit_identical") for r in results if r["hw_cast"] and r["kernel"] in HW_CAST_KERNELS)
    hw_best = [best_rows[k]["hw_cast"] for k in HW_CAST_KERNELS if k in best_rows]
    tuning = {"config": config, "fp8_hw_cast": bool(hw_ok and hw_best and sum(hw_best) * 2 >= len(hw_best)),
              "device": torch.cuda.get_device_name(dev) if cuda else "cpu (interpreter dry run)",
              "sizes": {"weight": list(weight_shape), "act": list(act_shape)},
              "seconds": round(time.time() - t_start, 1), "results": results}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant-tuning.json").write_text(json.dumps(tuning, indent=1))
    _print_probe_table(results, best_rows)
    print(f"wrote {out / 'quant-tuning.json'} ({tuning['seconds']} s): config {config}, fp8_hw_cast "
          f"{tuning['fp8_hw_cast']}", flush=True)
    return tuning


def _print_probe_table(results: list[dict], best_rows: dict) -> None:
    print("\n| kernel | fmt | tile | warps | hw_cast | us | GB/s | % copy | bits | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        mark = ("best" if best_rows.get(r["kernel"]) is r else "") + (" default" if r["default"] else "") + (
            " DIAG memory only" if r["op"].startswith("DIAG") else "")
        print(f"| {r['kernel']} | {r['fmt']} | {r['tile']} | {r['warps']} | {r['hw_cast']} | "
              f"{r.get('us', r.get('error', '')[:50])} | {r.get('gbps', '')} | {r.get('pct_copy', '')} | "
              f"{r.get('bit_identical', '')} | {mark.strip()} |")


def main(argv: list[str] | None = None) -> int:
    from megapar.launch.bench.common import probe_main

    return probe_main("quant", __doc__, probe, "quant-tuning.json", argv)


if __name__ == "__main__":
    sys.exit(main())
