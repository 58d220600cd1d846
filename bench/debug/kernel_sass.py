"""Compile kernels of one or more versions of a module for sm_90a on a CPU machine and print what
the GPU would run: registers (occupancy), spills, instruction count, global loads, fp64 ops.
Compares versions of a kernel without a GPU (bench/results/compare/kernel-sass.md).

    python bench/debug/kernel_sass.py merge parallel/cp/triton_merge.py OLD_TREE/parallel/cp/triton_merge.py
    python bench/debug/kernel_sass.py quant parallel/quant/triton_quant.py OLD_TREE/parallel/quant/triton_quant.py
    python bench/debug/kernel_sass.py quant-variants parallel/quant/triton_quant.py   # defaults vs opt-in VARIANTS
    python bench/debug/kernel_sass.py decode parallel/cp/triton_decode.py     # MLA decode launch settings
    python bench/debug/kernel_sass.py decode-config parallel/cp/triton_decode.py   # as CONFIG launches them
    python bench/debug/kernel_sass.py --loop --only stage16 decode parallel/cp/triton_decode.py   # + the main loop's ops
    python bench/debug/kernel_sass.py mla_prep parallel/cp/triton_mla_prep.py   # the fused MLA prep
    python bench/debug/kernel_sass.py fp8_gemm moe/kernels/triton_w4a8.py       # prefill FP8 GEMM variants
    python bench/debug/kernel_sass.py --only "N=4" merge parallel/cp/triton_merge.py   # some cases only
    KERNEL_SASS_DUMP=DIR python bench/debug/kernel_sass.py ...   # also writes each case's SASS to DIR
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MERGE = {  # label -> (kernel, pointer dtypes, constexprs); unit strides and 16-divisible ints, as a launch specializes
    "_merge_n_kernel N=4": ("_merge_n_kernel", dict(x_ptr="*bf16", y_ptr="*bf16", lx_ptr="*fp32", ly_ptr="*fp32"),
                            dict(N=4, D=128, BLOCK_R=32, BLOCK_D=128, BASE2=False, sx_d=1, sy_d=1)),
    "_merge_n_kernel N=8": ("_merge_n_kernel", dict(x_ptr="*bf16", y_ptr="*bf16", lx_ptr="*fp32", ly_ptr="*fp32"),
                            dict(N=8, D=128, BLOCK_R=32, BLOCK_D=128, BASE2=False, sx_d=1, sy_d=1)),
    "_merge_n_kernel N=4 fp32 pdl": ("_merge_n_kernel", dict(x_ptr="*fp32", y_ptr="*fp32", lx_ptr="*fp32", ly_ptr="*fp32"),
                                     dict(N=4, D=128, BLOCK_R=32, BLOCK_D=128, BASE2=False, sx_d=1, sy_d=1, PDL=True)),
    # a decode step's split merge (MLA: 4 splits of fp32 partials over the 512 latent dims, one row a
    # program, launched with PDL)
    "_merge_n_kernel N=4 D=512 split merge": ("_merge_n_kernel", dict(x_ptr="*fp32", y_ptr="*fp32", lx_ptr="*fp32",
                                                                     ly_ptr="*fp32"),
                                              dict(N=4, D=512, BLOCK_R=1, BLOCK_D=512, BASE2=False, sx_d=1, sy_d=1,
                                                   PDL=True)),
    "_merge_pair_kernel fp32 acc + bf16": ("_merge_pair_kernel",
                                           dict(a_ptr="*fp32", b_ptr="*bf16", y_ptr="*fp32", la_ptr="*fp32",
                                                lb_ptr="*fp32", ly_ptr="*fp32"),
                                           dict(D=128, BLOCK_R=32, BLOCK_D=128, BASE2=False, sa_d=1, sb_d=1, sy_d=1)),
}
_FP4 = dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", gs_ptr="*fp32")
QUANT = {  # the default launch (CONFIG "fp4_quant": 4096 elements per program, 4 warps) on bf16 weights
    "_fp4_quant_kernel nvfp4": ("_fp4_quant_kernel", _FP4,
                                dict(IS_NV=True, GS_PER_MATRIX=False, BS=16, ROWS=256, EVEN=True)),
    "_fp4_quant_kernel nvfp4 per matrix": ("_fp4_quant_kernel", _FP4,
                                           dict(IS_NV=True, GS_PER_MATRIX=True, BS=16, ROWS=256, EVEN=True)),
    "_fp4_quant_kernel nvfp4 8 warps": ("_fp4_quant_kernel", _FP4,
                                        dict(IS_NV=True, GS_PER_MATRIX=False, BS=16, ROWS=256, EVEN=True, num_warps=8)),
    "_fp4_quant_kernel nvfp4 per matrix 8 warps": ("_fp4_quant_kernel", _FP4, dict(IS_NV=True, GS_PER_MATRIX=True, BS=16,
                                                                                ROWS=256, EVEN=True, num_warps=8)),
    "_fp4_quant_kernel mxfp4": ("_fp4_quant_kernel", {**_FP4, "gs_ptr": "*u8"},
                                dict(IS_NV=False, GS_PER_MATRIX=False, BS=32, ROWS=128, EVEN=True)),
}
_LINES = dict(IS_NV=False, GS_PER_MATRIX=False, GS_PAIRED=False, ROWS=128, TILES=1, MASKED=False, REVERSE=False,
              OFF64=False)
_FP8Q = dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*fp32", amax_floor="fp32")
_DQ = dict(data_ptr="*u8", scale_ptr="*u8", gs_ptr="*fp32", out_ptr="*bf16")
QUANT_VARIANTS = {  # the defaults next to the opt-in VARIANTS, as the probe launches them on the bench shapes
    # (labels: elements per thread, to read instructions per element)
    "_fp4_quant_kernel mxfp4 blocks (128, 4) [32/thread]": QUANT["_fp4_quant_kernel mxfp4"],
    "_fp4_quant_kernel mxfp4 blocks DIAG [32/thread]": ("_fp4_quant_kernel", {**_FP4, "gs_ptr": "*u8"},
                                                         dict(IS_NV=False, GS_PER_MATRIX=False, BS=32, ROWS=128, EVEN=True,
                                                              DIAG=1)),
    "_fp4_quant_lines_kernel mxfp4 (128, 4) [32/thread]": ("_fp4_quant_lines_kernel", _FP4, _LINES),
    "_fp4_quant_lines_kernel mxfp4 DIAG [32/thread]": ("_fp4_quant_lines_kernel", _FP4, dict(_LINES, DIAG=1)),
    "_fp4_quant_lines_kernel mxfp4 (128, 4) x 2 tiles [64/thread]": ("_fp4_quant_lines_kernel", _FP4,
                                                                     dict(_LINES, TILES=2)),
    "_fp4_quant_kernel nvfp4 blocks (128, 4) [32/thread]": QUANT["_fp4_quant_kernel nvfp4"],
    "_fp4_quant_lines_kernel nvfp4 (128, 4) [32/thread]": ("_fp4_quant_lines_kernel", _FP4, dict(_LINES, IS_NV=True)),
    "_fp4_quant_lines_kernel nvfp4 per matrix (128, 4) [32/thread]": (
        "_fp4_quant_lines_kernel", _FP4, dict(_LINES, IS_NV=True, GS_PER_MATRIX=True, GS_PAIRED=True)),
    "_fp4_quant_lines_kernel nvfp4 reverse x 2 tiles [64/thread]": (
        "_fp4_quant_lines_kernel", _FP4, dict(_LINES, IS_NV=True, REVERSE=True, TILES=2)),
    "_fp4_dequant_kernel mxfp4 -> bf16 blocks (256, 8) [32/thread]": (
        "_fp4_dequant_kernel", {**_DQ, "gs_ptr": "*u8"},
        dict(IS_NV=False, GS_PER_MATRIX=False, BS=32, ROWS=256, EVEN=True, num_warps=8)),
    "_fp4_dequant_chunks_kernel mxfp4 -> bf16 (1024, 4) [64/thread]": (
        "_fp4_dequant_chunks_kernel", {**_DQ, "gs_ptr": "*u8"},
        dict(IS_NV=False, GS_PER_MATRIX=False, BS=32, ROWS=1024, EVEN=True, OFF64=False)),
    "_fp4_dequant_chunks_kernel nvfp4 -> bf16 (1024, 4) [64/thread]": (
        "_fp4_dequant_chunks_kernel", _DQ, dict(IS_NV=True, GS_PER_MATRIX=False, BS=16, ROWS=1024, EVEN=True, OFF64=False)),
    "_amax_scale_kernel (32768, 16) [64/thread]": ("_amax_scale_kernel", dict(x_ptr="*bf16", acc_ptr="*i32", gs_ptr="*fp32"),
                                                   dict(BLOCK=32768, EVEN=True, num_warps=16)),
    "_fp8_group_quant_kernel fp8_token K 7168 tile (1 x 8192, 8) [32/thread, 28 live]": (
        "_fp8_group_quant_kernel", _FP8Q, dict(UE8M0=False, ROWS=1, GROUP=8192, HW=True, num_warps=8)),
    "_fp8_row_quant_kernel fp8_token K 7168 rows (1024, 4) [56/thread]": (
        "_fp8_row_quant_kernel", _FP8Q, dict(UE8M0=False, CHUNK=1024, NUM_CHUNKS=7, HW=True, EVEN=True, UNROLL=True)),
    "_fp8_group_quant_kernel fp8_group (32, 4) [32/thread]": (
        "_fp8_group_quant_kernel", _FP8Q, dict(UE8M0=False, ROWS=32, GROUP=128, HW=True)),
    "_fp8_block_quant_kernel loop (32, 8) [64/thread, 16 per step]": (
        "_fp8_block_quant_kernel", _FP8Q, dict(UE8M0=False, SUB=32, HW=True, num_warps=8)),
    "_fp8_block_quant_kernel unrolled (32, 8) [64/thread, 16 per step]": (
        "_fp8_block_quant_kernel", _FP8Q, dict(UE8M0=False, SUB=32, HW=True, EVEN=True, UNROLL=True, num_warps=8)),
    "_fp8_dequant_kernel fp8_group -> bf16 tile (128, 8) [64/thread]": (
        "_fp8_dequant_kernel", dict(data_ptr="*fp8e4nv", scale_ptr="*fp32", out_ptr="*bf16"),
        dict(ROW_BLOCK=1, ROWS=128, FIX_NAN=False, num_warps=8)),
    "_fp8_dequant_chunks_kernel fp8_group -> bf16 (64, 8) [32/thread]": (
        "_fp8_dequant_chunks_kernel", dict(data_ptr="*fp8e4nv", scale_ptr="*fp32", out_ptr="*bf16"),
        dict(ROW_BLOCK=1, ROWS=64, FIX_NAN=False, num_warps=8)),
}
_DECODE = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", ks_ptr="*fp32", vs_ptr="*fp32", table_ptr="*i32",
               lens_ptr="*i32", glens_ptr="*i64", o_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32")
_MLA = dict(Tq=1, KV_HEADS=1, dcp_size=1, interleave=1, D_MAIN=512, D_REST=64, BLOCK_REST=64, DV=512, BLOCK_DV=512, PAGE=64, FP8=False, V_FROM_K=True,
            CAUSAL=False, IEEE=False, INTERPRETED=False)
DECODE = {  # the paged decode kernel on MLA's latent cache (512 + 64 key dims, values = the first 512)
    f"_paged_decode_kernel MLA {'fp8' if fp8 else 'bf16'} block_m={m} block_n={n} warps={w} stages={st}":
        ("_paged_decode_kernel", dict(_DECODE, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if fp8 else {})),
         dict(_MLA, FP8=fp8, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st))
    for fp8 in (False, True)
    for m, n, w, st in ((32, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2), (64, 32, 4, 2), (128, 16, 8, 1),
                        (32, 64, 8, 3), (64, 64, 8, 3))
}
DECODE.update({  # GQA (Hq 32, Hkv 4, D 128: 8 query rows per kv head) as CONFIG launches it
    f"_paged_decode_kernel GQA {'fp8' if fp8 else 'bf16'} block_m=16 block_n={n} warps=4 stages={st} {label}":
        ("_paged_decode_kernel", dict(_DECODE, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if fp8 else {})),
         dict(_MLA, D_MAIN=128, D_REST=0, BLOCK_REST=0, DV=128, BLOCK_DV=128, V_FROM_K=False, FP8=fp8, BLOCK_M=16,
              BLOCK_N=n, num_warps=4, num_stages=st, **opts))
    for fp8, n, st in ((False, 64, 2), (True, 128, 3), (True, 64, 3))
    # (TMA tiles lie inside a page: block_n 64 on these 64-token pages)
    for label, opts in (("plain", {}), ("lazy", dict(LAZY=True))) + ((("f16", dict(F16=True)),) if fp8 else ())
    + ((("tma", dict(TMA=True)),) + ((("f16 tma", dict(F16=True, TMA=True)),) if fp8 else ()) if n == 64 else ())
})
DECODE.update({  # the structure options (CONFIG halves_wide / tma_wide / lazy_rescale_wide) at the MLA defaults
    f"_paged_decode_kernel MLA {'fp8' if fp8 else 'bf16'} block_m={m} block_n=64 warps={w} stages={st} {label}":
        ("_paged_decode_kernel", dict(_DECODE, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if fp8 else {})),
         dict(_MLA, FP8=fp8, BLOCK_M=m, BLOCK_N=64, num_warps=w, num_stages=st, **opts))
    for fp8, m in ((False, 64), (True, 32), (True, 64), (False, 16), (True, 16))
    for w, st in ((8, 3), (8, 2), (4, 2))
    for label, opts in (("plain", {}), ("halves", dict(HALVES=True)), ("halves tma", dict(HALVES=True, TMA=True)),
                        ("lazy", dict(LAZY=True)), ("halves tma lazy", dict(HALVES=True, TMA=True, LAZY=True)))
})

DECODE.update({  # MLA with 16 heads (TP 8: a narrow head tile) over fp8, as launched, and with fp16 operands
    f"_paged_decode_kernel MLA narrow fp8 block_m=16 block_n=64 warps={w} stages=2 {label}":
        ("_paged_decode_kernel", dict(_DECODE, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"),
         dict(_MLA, FP8=True, BLOCK_M=16, BLOCK_N=64, num_warps=w, num_stages=2, **opts))
    for w in (8, 4)
    for label, opts in (("plain", {}), ("f16", dict(F16=True)), ("maxnreg 128", dict(maxnreg=128)),
                        ("f16 maxnreg 128", dict(F16=True, maxnreg=128)))
})
DECODE.update({  # stage16 (CONFIG stage16_fp8 / stage16_wide_narrow): fp8 tiles converted where loaded, staged as 16-bit
    f"_paged_decode_kernel {name} block_n={n} warps={w} stages={st} stage16={stage}{' f16' if f16 else ''}":
        ("_paged_decode_kernel", dict(_DECODE, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"),
         dict(cons, BLOCK_N=n, num_warps=w, num_stages=st, F16=f16, STAGE=stage))
    for name, cons, shapes in (
        ("GQA fp8", dict(_MLA, D_MAIN=128, D_REST=0, BLOCK_REST=0, DV=128, BLOCK_DV=128, V_FROM_K=False, FP8=True,
                         BLOCK_M=16), ((128, 4, 3), (128, 4, 2), (64, 4, 2))),
        ("MLA narrow fp8", dict(_MLA, FP8=True, BLOCK_M=16), ((64, 4, 2), (64, 8, 2), (32, 4, 2), (32, 4, 3),
                                                              (16, 4, 2), (16, 4, 3))))
    for n, w, st in shapes
    for stage in (0, 1, 2)
    for f16 in (True, False) if name.startswith("MLA") or f16
})
DECODE.update({  # MLA 128 heads over fp8 in the halves kernel, bf16 operands (as installed) and fp16 (f16_wide_fp8)
    f"_paged_decode_kernel MLA128 fp8 halves tma warps=8 stages={st}{' f16' if f16 else ''}":
        ("_paged_decode_kernel", dict(_DECODE, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"),
         dict(_MLA, FP8=True, BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=st, HALVES=True, TMA=True, F16=f16))
    for st in (2, 3) for f16 in (False, True)
})
DECODE.update({  # GQA with fewer warps per program (1 / 2: less of the 16-row tile split across warps)
    f"_paged_decode_kernel GQA {'fp8 f16' if fp8 else 'bf16'} fewwarps block_n={n} warps={w} stages={st}": (
        "_paged_decode_kernel", dict(_DECODE, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if fp8 else {})),
        dict(_MLA, D_MAIN=128, D_REST=0, BLOCK_REST=0, DV=128, BLOCK_DV=128, V_FROM_K=False, FP8=fp8, BLOCK_M=16,
             BLOCK_N=n, num_warps=w, num_stages=st, **(dict(F16=True) if fp8 else {})))
    for fp8 in (True, False) for n in (128, 64, 32) for w in (1, 2, 4) for st in (2, 3)
})
DECODE.update({  # GQA as CONFIG launches it, inside a DCP group (dcp_size a runtime int) and alone (1: specialized)
    f"_paged_decode_kernel GQA {'fp8' if fp8 else 'bf16'} as installed dcp={dcp}": (
        "_paged_decode_kernel", dict(_DECODE, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if fp8 else {}),
                                     **({"dcp_size": "i32"} if dcp != 1 else {})),
        dict({k: v for k, v in _MLA.items() if dcp == 1 or k != "dcp_size"}, D_MAIN=128, D_REST=0, BLOCK_REST=0,
             DV=128, BLOCK_DV=128, V_FROM_K=False, FP8=fp8, BLOCK_M=16, KV_HEADS=4, PDL=True,
             **(dict(BLOCK_N=128, num_warps=4, num_stages=2, F16=True, maxnreg=168) if fp8 else
                dict(BLOCK_N=64, num_warps=4, num_stages=3))))
    for fp8 in (True, False) for dcp in (1, "n")
})
DECODE.update({  # ... and with the group size built in (CONFIG dcp_constexpr)
    f"_paged_decode_kernel GQA fp8 as installed dcp=4 constexpr": (
        "_paged_decode_kernel", dict(_DECODE, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv", dcp_size="i32"),
        dict({k: v for k, v in _MLA.items() if k != "dcp_size"}, D_MAIN=128, D_REST=0, BLOCK_REST=0, DV=128,
             BLOCK_DV=128, V_FROM_K=False, FP8=True, BLOCK_M=16, KV_HEADS=4, PDL=True, BLOCK_N=128, num_warps=4,
             num_stages=2, F16=True, maxnreg=168, DCP_N=4, DCP_I=1))
})
DECODE.update({  # MLA's narrow tile over fp8 as CONFIG launches it, one query token (16 rows) and a speculative
    # step's two (32 rows, causal; 4 warps 2361 µs, 8 warps 425, the swapped Gluon kernel 104: decode-narrow7)
    f"_paged_decode_kernel MLA narrow fp8 as installed tq={tq} warps={w}": (
        "_paged_decode_kernel", dict(_DECODE, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"),
        dict(_MLA, FP8=True, BLOCK_M=16 * tq, BLOCK_N=32, num_warps=w, num_stages=2, F16=True, STAGE=1,
             Tq=tq, CAUSAL=tq > 1))
    for tq in (1, 2) for w in (4, 8)
})
DECODE.update({  # ... and over bf16
    f"_paged_decode_kernel MLA narrow bf16 as installed tq={tq} warps={w}": (
        "_paged_decode_kernel", dict(_DECODE), dict(_MLA, BLOCK_M=16 * tq, BLOCK_N=64, num_warps=w, num_stages=2,
                                                    Tq=tq, CAUSAL=tq > 1))
    for tq in (1, 2) for w in (4, 8)
})
DECODE.update({  # ... and with whole tiles unmasked (CONFIG even / even_fp8; over fp8 with stage16_fp8, as installed)
    f"_paged_decode_kernel GQA {'fp8' if fp8 else 'bf16'} as installed{' even' if even else ''}"
    f"{' stage16' if even and fp8 else ''}": (
        "_paged_decode_kernel", dict(_DECODE, **({"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} if fp8 else {}),
                                     dcp_size="i32"),
        dict({k: v for k, v in _MLA.items() if k != "dcp_size"}, D_MAIN=128, D_REST=0, BLOCK_REST=0, DV=128,
             BLOCK_DV=128, V_FROM_K=False, FP8=fp8, BLOCK_M=16, KV_HEADS=4, PDL=True, DCP_N=4, DCP_I=1, EVEN=even,
             STAGE=int(even and fp8),
             **(dict(BLOCK_N=128, num_warps=4, num_stages=2, F16=True, maxnreg=168) if fp8 else
                dict(BLOCK_N=64, num_warps=4, num_stages=3))))
    for fp8 in (True, False) for even in (False, True)
})
DECODE["_paged_decode_kernel MLA narrow bf16 block_m=16 block_n=64 warps=8 stages=2 plain"] = (
    "_paged_decode_kernel", _DECODE, dict(_MLA, BLOCK_M=16, BLOCK_N=64, num_warps=8, num_stages=2))


def decode_config(mod) -> dict:
    """MLA decode as the module's `launch_settings` would launch it (1 query x 128 heads), for a
    bf16, an fp8 and an fp32 problem: what has to fit in shared memory."""
    torch = sys.modules.get("torch") or __import__("torch")
    out = {}
    for tag, qd, cd, ptr in (("bf16", torch.bfloat16, torch.bfloat16, "*bf16"),
                             ("fp8", torch.bfloat16, torch.float8_e4m3fn, "*fp8e4nv"),
                             ("fp32", torch.float32, torch.float32, "*fp32")):
        cfg = mod.launch_settings(576, qd, cd, 128)
        ptrs = dict(_DECODE, k_ptr=ptr, v_ptr=ptr, **({"q_ptr": "*fp32"} if tag == "fp32" else {}))
        cons = dict(_MLA, FP8=tag == "fp8", IEEE=tag == "fp32", BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], LAZY=bool(cfg["lazy_rescale"]),
                    HALVES=bool(cfg["halves"]) and cfg["block_n"] <= 64, TMA=bool(cfg["halves"] and cfg["tma"]),
                    F16=bool(cfg["f16"]) and tag == "fp8")
        out[f"_paged_decode_kernel MLA {tag} as launched {cfg}"] = ("_paged_decode_kernel", ptrs, cons)
    return out


_PREP = dict(q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", table_ptr="*i32", cs_ptr="*fp32", qw_ptr="*bf16",
             kw_ptr="*bf16", qo_ptr="*bf16", cache_ptr="*bf16", scale_ptr="*fp32", slot_ptr="*i64", eps="fp32")
MLA_PREP = {  # the fused MLA prep as the bench launches it: H 128, nope 128 + rope 64 query heads, latent 512 + 64
    f"_mla_prep_kernel {'fp8' if fp8 else 'bf16'} cache": (
        "_mla_prep_kernel", dict(_PREP, **({"cache_ptr": "*fp8e4nv"} if fp8 else {})),
        dict(NOPE=128, BLOCK_NOPE=128, R=512, BLOCK_R=512, HALF=32, BLOCK_HALF=32, BLOCK_H=16, PAGE=64,
             Q_NORM=True, FP8=fp8, Q_TILES=8, num_warps=4))
    for fp8 in (False, True)
}
_FP8G = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", out_ptr="*bf16", out_scale_ptr="*bf16",
             counts_ptr="*i32", offsets_ptr="*i64")
_FP8P = dict(_FP8G, a_desc="*fp8e4nv", b_desc="*fp8e4nv")
_FP8G_C = dict(K=2048, E_POW2=32, SLAB=False, HAS_OFFSETS=False, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128,
               num_warps=8, num_stages=3)
FP8_GEMM = {  # the prefill FP8 GEMM at V3 L2 (K 2048, 128 x 256 tiles, 3 stages): one-tile kernel variants, persistent
    "_fp8_gemm_kernel": ("_fp8_gemm_kernel", _FP8G, dict(_FP8G_C, A_GROUP=False, B_GROUP=False, SWIGLU=False,
                                                           HAS_LIMIT=False, QUANT_OUT=False)),
    "_fp8_gemm_kernel tma_store": ("_fp8_gemm_kernel", _FP8G, dict(_FP8G_C, A_GROUP=False, B_GROUP=False, SWIGLU=False,
                                                                     HAS_LIMIT=False, QUANT_OUT=False, TMA_STORE=True)),
    "_fp8_gemm_persistent_kernel flatten": ("_fp8_gemm_persistent_kernel", _FP8P,
                                            dict(_FP8G_C, NUM_PROGRAMS=132, FLATTEN=True, INTERPRETED=False,
                                                 TMA_LOAD=False)),
    "_fp8_gemm_persistent_kernel": ("_fp8_gemm_persistent_kernel", _FP8P,
                                    dict(_FP8G_C, NUM_PROGRAMS=132, FLATTEN=False, INTERPRETED=False, TMA_LOAD=False)),
    "_fp8_gemm_persistent_kernel flatten tma loads": (
        "_fp8_gemm_persistent_kernel", dict(_FP8P, a_desc="tensordesc<fp8e4nv[128, 128]>",
                                            b_desc="tensordesc<fp8e4nv[256, 128]>"),
        dict(_FP8G_C, NUM_PROGRAMS=132, FLATTEN=True, INTERPRETED=False, TMA_LOAD=True)),
}
SETS = {"merge": MERGE, "quant": QUANT, "quant-variants": QUANT_VARIANTS, "decode": DECODE, "decode-config": decode_config,
        "mla_prep": MLA_PREP, "fp8_gemm": FP8_GEMM}
NOT_DIVISIBLE = ("M", "M_TILES")


PACKAGES = {"triton_merge.py": "megapar.parallel.cp", "triton_decode.py": "megapar.parallel.cp",
            "triton_mla_prep.py": "megapar.parallel.cp", "triton_w4a8.py": "megapar.moe.kernels",
            "triton_quant.py": "megapar.parallel.quant"}


def _load(path: str):
    """The module at `path`, as a member of its package (relative imports resolve there)."""
    import linecache

    src = Path(path).read_text()
    mod = type(sys)("kernel_under_test")
    mod.__package__ = PACKAGES[Path(path).name]
    mod.__file__ = path
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)   # triton.jit reads the source
    sys.modules[mod.__name__] = mod                                          # (dataclasses look it up)
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def main_loop(sass: str) -> list[str]:
    """The ops of the kernel's longest loop (the largest backward branch: a decode / GEMM main loop)."""
    ops, spans = [], []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass):
        at = int(m.group(1), 16)
        ops.append((at, m.group(2)))
        target = re.search(r"0x([0-9a-f]+)", m.group(3)) if m.group(2) == "BRA" else None
        if target and int(target.group(1), 16) < at:
            spans.append((at - int(target.group(1), 16), int(target.group(1), 16), at))
    if not spans:
        return []
    _, lo, hi = max(spans)
    return [op for at, op in ops if lo <= at <= hi]


def report(cases, path: str, loop: bool = False) -> None:
    mod = _load(path)
    if callable(cases):      # a set made from the module itself (its launch settings)
        cases = cases(mod)
    for label, (name, ptrs, cons) in cases.items():
        if name not in mod.__dict__:          # a kernel this version does not have
            continue
        kernel = getattr(mod, name)
        params = inspect.signature(kernel.fn).parameters
        names = list(params)
        options = {"num_warps": cons.get("num_warps", 4), "num_stages": cons.get("num_stages", 3),
                   **({"maxnreg": cons["maxnreg"]} if "maxnreg" in cons else {})}
        cons = {k: v for k, v in cons.items() if k not in options and k != "maxnreg"}
        cons.update({n: p.default for n, p in params.items()   # defaulted constexprs, as a launch takes them
                     if n not in cons and n not in ptrs and p.default is not inspect.Parameter.empty})
        sig = {n: "constexpr" if n in cons else ptrs.get(n, "i32") for n in names}
        # pointers 16-byte aligned, ints multiples of 16 (the bench shapes'), as launches specialize them
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*")
                 or sig[n] == "i32" and n not in NOT_DIVISIBLE}
        c = triton.compile(ASTSource(kernel, sig, {(names.index(k),): v for k, v in cons.items()}, attrs),
                           target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
            ptx.write_text(c.asm["ptx"])
            cubin.write_bytes(c.asm["cubin"])
            info = subprocess.run([BIN / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", Path(tmp, "k.o")],
                                  capture_output=True, text=True).stderr
            sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
        ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)]
        regs = re.search(r"Used (\d+) registers", info).group(1)
        spill = re.search(r"(\d+) bytes spill stores", info).group(1)
        hist = collections.Counter(o for o in ops if o.startswith(("LDG", "STG")))
        fp64 = sum(o.startswith(("DADD", "DMUL", "DFMA", "DSETP", "F2F.F64", "F2F.F32.F64")) for o in ops)
        mma = {o: n for o, n in collections.Counter(o.split(".")[0] for o in ops).items() if o.endswith("MMA")}
        print(f"{path}  {label}: {regs} registers, {spill} B spilled, {c.metadata.shared} B shared, "
              f"{len(ops)} instructions ({fp64} fp64), loads {dict(sorted(hist.items()))}, mma {mma}")
        if loop:
            body = main_loop(sass)
            top = collections.Counter(body).most_common(12)
            print(f"    main loop: {len(body)} instructions; most: {', '.join(f'{o} {n}' for o, n in top)}")
        if os.environ.get("KERNEL_SASS_DUMP"):        # the whole SASS of each case, one file per case
            out = Path(os.environ["KERNEL_SASS_DUMP"]) / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", label) + ".sass")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(sass)


if __name__ == "__main__":
    args = sys.argv[1:]
    only, loop = None, False
    while args and args[0] in ("--only", "--loop"):
        if args[0] == "--loop":                      # --loop: also the main loop's length and commonest ops
            loop, args = True, args[1:]
        elif len(args) >= 2:                         # --only SUBSTRING: the cases whose label holds it
            only, args = args[1], args[2:]
        else:
            break
    if len(args) < 2 or args[0] not in SETS:
        sys.exit(__doc__)
    chosen = SETS[args[0]]
    for p in args[1:]:
        report(chosen if callable(chosen) else {k: v for k, v in chosen.items() if only is None or only in k}, p, loop)
