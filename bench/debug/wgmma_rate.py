"""How fast Hopper's wgmma runs at the narrow N of the 16-head MLA decode kernels: one warpgroup a CTA
issuing chains of `warpgroup_mma` on one accumulator from shared memory (A [64, 64], B [N, 64]), UNROLL
calls between waits, over bf16 (m64nNk16: four instructions a call) and e4m3 (m64nNk32: two), N = 16,
32, 64, 128, with one and two CTAs an SM (two: two warpgroups sharing an SM's tensor cores, as the
narrow fp8 kernel's scores and value warpgroups do). Columns: ns an instruction an SM, and the
fraction of the dense peak of that dtype (2 x 64 x N x K FLOPs an instruction against this card's
measured matmul ceiling, `launch.bench.common.measure_ceilings`).

Why: the narrow kernels take 1.27-1.40 µs a 64-key tile an SM over either dtype even with their
tiles in L2 (bench/debug/decode_l2pace.py), with only 0.2-0.4 instructions a cycle issued a sub-
partition; halving the reductions (two tiles a softmax step) or the value warpgroup's instructions
(values8_narrow_fp8) did not move it. A tile is 68 m64n16k16 wgmma over bf16 and 18 m64n32k32 + 32
m64n16k16 over fp8: if an N = 16 instruction costs ~32-40 cycles (a quarter of the dense rate), the
MMAs alone are most of a tile's ~2500-2760 cycles (docs/performance.md §5.3). Found on an H100
(2026-12-07, docs/gpu.md §73): N = 16 costs 2.7x a FLOP's share at N = 128, about half of the fp8
tile's time and two thirds of the bf16 tile's, not all of it. (fraction_of_dense_peak can exceed 1:
the peak is torch's measured matmul ceiling, which this loop of back-to-back wgmma beats.)

    python bench/debug/wgmma_rate.py OUT.json        # on the GPU
    python bench/debug/wgmma_rate.py --build DIR     # anywhere: compile every case for sm_90a into DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

K = 64              # the shared tiles' K: four bf16 instructions a call, two e4m3
UNROLL = 8          # calls between two waits
# (dtype, N, A from registers: the narrow kernels' value MMAs take it so, their score MMAs from shared memory)
CASES = [(dtype, n, False) for dtype in ("bf16", "fp8") for n in (16, 32, 64, 128)] + [
    (dtype, n, True) for dtype in ("bf16", "fp8") for n in (16, 32)]


@gluon.jit
def _wgmma_loop(out_ptr, iters, DT: gl.constexpr, N: gl.constexpr, KI: gl.constexpr, KB: gl.constexpr,
                UNROLL: gl.constexpr, REG_A: gl.constexpr):
    """iters x UNROLL `warpgroup_mma` calls A [64, KB] x B^T [KB, N] into one fp32 accumulator (a wait
    after every UNROLL), then the accumulator's row sums stored (so that nothing is dead). REG_A: A
    loaded into registers once (wgmma's register operand) instead of read from shared memory."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, KI])
    a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, KB], DT)
    b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([N, KB], DT)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    a_smem = gl.allocate_shared_memory(DT, [64, KB], a_l, gl.full([64, KB], 0.5, gl.float32, blk).to(DT))
    b_smem = gl.allocate_shared_memory(DT, [N, KB], b_l, gl.full([N, KB], 0.25, gl.float32, blk).to(DT))
    fence_async_shared()
    acc = gl.zeros([64, N], gl.float32, mma)
    if REG_A:
        a_reg = a_smem.load(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KI // 8))
        for _ in range(iters):
            for _j in gl.static_range(UNROLL):
                acc = warpgroup_mma(a_reg, b_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        for _ in range(iters):
            for _j in gl.static_range(UNROLL):
                acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    gl.store(out_ptr + gl.program_id(0) * 64 + rows, gl.sum(acc, 1))


def case_args(dtype: str, n: int, reg_a: bool) -> dict:
    """The constexprs of one case: the element type, N, one instruction's K, A from registers."""
    return {"DT": gl.float8e4nv if dtype == "fp8" else gl.bfloat16, "N": n, "KI": 32 if dtype == "fp8" else 16,
            "KB": K, "UNROLL": UNROLL, "REG_A": reg_a}


def instructions_per_call(dtype: str) -> int:
    return K // (32 if dtype == "fp8" else 16)


def build(out_dir: str) -> list[dict]:
    """Compile every case for sm_90a (no GPU needed); write NAME.cubin into out_dir; one row a case:
    the SASS's wgmma instructions of the loop, registers, whether ptxas serialized the pipeline."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    names = _wgmma_loop.arg_names
    rows = []
    for dtype, n, reg_a in CASES:
        consts = case_args(dtype, n, reg_a)
        sig = {a: ("*fp32" if a == "out_ptr" else "constexpr" if a in consts else "i32") for a in names}
        compiled = triton.compile(GluonASTSource(_wgmma_loop, sig, {(names.index(a),): v for a, v in consts.items()},
                                                 {(0,): [["tt.divisibility", 16]]}),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        cubin = Path(out_dir) / f"wgmma-{dtype}-{n}{'-rega' if reg_a else ''}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp, "k.ptx")
            ptx.write_text(compiled.asm["ptx"])
            info = subprocess.run([str(bins / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp, "k.o"))],
                                  capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(bins / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        rows.append({"case": f"{dtype} N={n}{' A in registers' if reg_a else ''}",
                     "mmas": sorted(set(re.findall(r"[HQ]GMMA\.\S+ R\d+, \S+", sass))),
                     "count": len(re.findall(r"[HQ]GMMA\.", sass)),
                     "serialized": any(c in info for c in ("C7511", "C7512", "C7514")),
                     "regs": re.findall(r"Used (\d+) registers", info)})
    return rows


def main(path: str) -> None:
    from megapar.launch.bench.common import measure_ceilings

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceil = measure_ceilings(dev)
    rows = []
    for dtype, n, reg_a in CASES:
        consts = case_args(dtype, n, reg_a)
        peak = (ceil.fp8_tflops if dtype == "fp8" else ceil.bf16_tflops) * 1e12
        for per_sm in (1, 2):
            grid = sms * per_sm
            out = torch.empty(grid * 64, device=dev)
            iters = 2048
            _wgmma_loop[(grid,)](out, iters, **consts, num_warps=4)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            best = float("inf")
            for _ in range(5):
                start.record()
                _wgmma_loop[(grid,)](out, iters, **consts, num_warps=4)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) * 1e6)     # ns
            instr = iters * UNROLL * instructions_per_call(dtype) * per_sm     # an SM's
            flops = 2.0 * 64 * n * consts["KI"] * instr * sms
            row = {"dtype": dtype, "N": n, "a_in_registers": reg_a, "ctas_per_sm": per_sm, "ns": round(best),
                   "ns_per_instruction_per_sm": round(best / instr, 2),
                   "fraction_of_dense_peak": round(flops / (best * 1e-9) / peak, 3),
                   "finite": bool(torch.isfinite(out).all())}
            rows.append(row)
            print(row, flush=True)
    with open(path, "w") as f:
        json.dump({"command": "python bench/debug/wgmma_rate.py", "device": torch.cuda.get_device_name(dev),
                   "ceilings": {"bf16_tflops": ceil.bf16_tflops, "fp8_tflops": ceil.fp8_tflops}, "rows": rows},
                  f, indent=1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        for row in build(sys.argv[2]):
            print(json.dumps(row))
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "wgmma-rate.json")
