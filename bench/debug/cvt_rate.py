"""e4m3 -> fp16 unpack throughput on the GPU: F2FP conversions (`cvt.rn.f16x2.e4m3x2`) against shifts
and masks, in the layout the direct decode kernels' value operands take (pairs of int16: even and odd
dims apart, `gluon_mla_narrow._fp8_pairs`) and in plain byte order (a converter's), each thread
unpacking 16 independent words in a loop at full occupancy; values per ns per SM, and each form's
results checked against torch's conversion first.

The shifts-and-masks form: an e4m3 byte s.eeee.mmm placed as the fp16 halfword s.0eeee.mmm0000000 is
its value times 2^-8 exactly, subnormals included (e4m3's NaN byte comes out +-1.875). Measured on the
H200 (2026-12-04, bench/results/logs/cvt-rate-h200.json): F2FP pairs 98.5 values / ns / SM, shifts and
masks 82.5; plain order 161 against 55. Hopper's e4m3 F2FP is not the slow path here; in the direct
kernels the shifts and masks ran 3-5% slower (decode-narrow15-bits, decode-gluon-gqa-bits), not kept.

    python bench/debug/cvt_rate.py OUT.json        # on the GPU
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

BITS_FACTOR = 256.0     # what the shifts-and-masks forms' values are divided by
FP8_BITS_UNPACK = ("{ .reg .b32 t0, t1, t2, t3; shl.b32 t0, $2, 8; shl.b32 t1, $2, 7; shr.b32 t2, $2, 1; "
                   "and.b32 t0, t0, 0x80008000; and.b32 t1, t1, 0x3F803F80; or.b32 $0, t0, t1; "
                   "and.b32 t3, $2, 0x80008000; and.b32 t2, t2, 0x3F803F80; or.b32 $1, t3, t2; }")

# (name, asm, whether its values are times 2^-8, the byte order: "pairs" (out0: bytes 0, 2; out1: 1, 3)
# or "plain" (out0: bytes 0, 1; out1: 2, 3))
FORMS = {
    "f2fp pairs": ("{ .reg .b16 a0, a1; .reg .b32 t0, t1; mov.b32 {a0, a1}, $2; cvt.rn.f16x2.e4m3x2 t0, a0; "
                   "cvt.rn.f16x2.e4m3x2 t1, a1; prmt.b32 $0, t0, t1, 0x5410; prmt.b32 $1, t0, t1, 0x7632; }",
                   False, "pairs"),
    "bits pairs": (FP8_BITS_UNPACK, True, "pairs"),
    "f2fp plain": ("{ .reg .b16 a0, a1; mov.b32 {a0, a1}, $2; cvt.rn.f16x2.e4m3x2 $0, a0; "
                   "cvt.rn.f16x2.e4m3x2 $1, a1; }", False, "plain"),
    "bits plain": ("{ .reg .b32 y0, y1, s0, s1, z; mov.b32 z, 0; "
                   "prmt.b32 y0, $2, z, 0x1404; prmt.b32 y1, $2, z, 0x3424; "
                   "shr.b32 s0, y0, 1; shr.b32 s1, y1, 1; and.b32 y0, y0, 0x80008000; and.b32 y1, y1, 0x80008000; "
                   "and.b32 s0, s0, 0x3F803F80; and.b32 s1, s1, 0x3F803F80; or.b32 $0, y0, s0; or.b32 $1, y1, s1; }",
                   True, "plain"),
}


@triton.jit
def _once(x_ptr, o0_ptr, o1_ptr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a, b = tl.inline_asm_elementwise(ASM, "=r,=r,r", [tl.load(x_ptr + offs)], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)
    tl.store(o0_ptr + offs, a)
    tl.store(o1_ptr + offs, b)


@triton.jit
def _loop(x_ptr, out_ptr, iters, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in range(iters):
        a, b = tl.inline_asm_elementwise(ASM, "=r,=r,r", [x], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        x = a ^ b
    tl.store(out_ptr + offs, x)


def _expected(words: torch.Tensor, order: str, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    b = [((words >> (8 * i)) & 0xFF).to(torch.uint8) for i in range(4)]

    def f16(byte):
        v = byte.view(torch.float8_e4m3fn).float() / (BITS_FACTOR if scaled else 1.0)
        return v.half().view(torch.int16).to(torch.int64) & 0xFFFF
    lo, hi = ((0, 2), (1, 3)) if order == "pairs" else ((0, 1), (2, 3))
    return tuple(f16(b[i]) | (f16(b[j]) << 16) for i, j in (lo, hi))


def main(path: str) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    block, warps = 16 * 32 * 8, 8          # 16 words a thread, 8 warps a program
    n = block * sms * 4                    # four programs an SM
    rows = []
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int64, device=dev)
    words = words[(((words >> 0) & 0x7F) != 0x7F) & (((words >> 8) & 0x7F) != 0x7F)
                  & (((words >> 16) & 0x7F) != 0x7F) & (((words >> 24) & 0x7F) != 0x7F)][: n // 2]
    words = torch.cat([words, words])[:n].to(torch.int32)      # (no NaN byte: the forms differ there)
    out = torch.empty_like(words)
    for name, (asm, scaled, order) in FORMS.items():
        o0, o1 = torch.empty_like(words), torch.empty_like(words)
        _once[(n // block,)](words, o0, o1, ASM=asm, BLOCK=block, num_warps=warps)
        e0, e1 = _expected(words.long() & 0xFFFFFFFF, order, scaled)
        ok = bool(torch.equal(o0.long() & 0xFFFFFFFF, e0) and torch.equal(o1.long() & 0xFFFFFFFF, e1))
        iters = 4096
        _loop[(n // block,)](words, out, iters, ASM=asm, BLOCK=block, num_warps=warps)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(5):
            start.record()
            _loop[(n // block,)](words, out, iters, ASM=asm, BLOCK=block, num_warps=warps)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e6)     # ns
        values = 4.0 * n * iters
        row = {"form": name, "exact": ok, "ns": round(best), "values_per_ns_per_sm": round(values / best / sms, 2)}
        rows.append(row)
        print(row, flush=True)
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cvt-rate.json")
