"""Triton kernels compile for Hopper (sm_90) without a GPU: `triton.compile` with a CUDA target
runs the whole front end and back end here, so a kernel that only ran under the interpreter
cannot reach the GPU machine with a code-generation error (as the fused MLA prep once did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent


_COMPILER = """
import inspect, json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(module, name, types, constexprs):
    kernel = getattr(__import__(module, fromlist=[name]), name)
    params = inspect.signature(kernel.fn).parameters
    names = list(params)
    for n, prm in params.items():   # constexpr parameters with a default take it, as a launch does
        if n not in types and n not in constexprs and prm.default is not inspect.Parameter.empty:
            constexprs[n] = prm.default
    missing = [n for n in names if n not in types and n not in constexprs]
    assert not missing, f"no type given for {missing}"
    sig = {n: types.get(n, "constexpr") for n in names}
    num_warps = constexprs.pop("num_warps", 4)
    # pointers 16-byte aligned, as launches specialize them (the vectorized code is what runs)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if types.get(n, "").startswith("*")}
    triton.compile(ASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

for key in json.loads(sys.stdin.read()):
    try:
        build(*json.loads(key))
        error = None
    except Exception:
        error = traceback.format_exc()[-3000:]
    print(json.dumps([key, error]), flush=True)
"""
_DONE: dict[str, str | None] = {}


def _key(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, object]) -> str:
    return json.dumps([module, kernel, types, constexprs], sort_keys=True)


def _compile(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compile in fresh processes (the test session runs Triton's interpreter, TRITON_INTERPRET=1): at the
    first call every build of `_builds()`, over two processes (a process a build paid ~1.5 s of imports)."""
    key = _key(module, kernel, types, constexprs)
    if key not in _DONE:
        keys = sorted({_key(*b) for b in _builds()} | {key})
        env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
        jobs = [(subprocess.Popen([sys.executable, "-c", _COMPILER], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), keys[i::2])
                for i in range(2)]
        for proc, part in jobs:
            out, err = proc.communicate(json.dumps(part), timeout=600)
            assert proc.returncode == 0, err[-3000:]
            _DONE.update(json.loads(line) for line in out.splitlines())
    assert _DONE[key] is None, f"{kernel} {constexprs}: {_DONE[key]}"


def _builds() -> list[tuple]:
    """(module, kernel, types, constexprs) of every test below."""
    return ([_mla_prep(fp8, q_norm) for fp8 in (False, True) for q_norm in (False, True)] + _PLAN_SWIGLU
            + [(_QUANT, *q) for q in _QUANT_BUILDS] + [_FP8_GEMM])


def _mla_prep(fp8: bool, q_norm: bool) -> tuple:
    ptrs = dict(q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", table_ptr="*i32", cs_ptr="*fp32", qw_ptr="*fp32",
                kw_ptr="*fp32", qo_ptr="*bf16", cache_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32",
                slot_ptr="*i64", eps="fp32")
    ints = {n: "i32" for n in ("H", "dcp_size", "dcp_rank", "interleave", "sq_t", "sq_h", "skv_t", "sqo_t", "sqo_h",
                               "st_t", "scs", "sc_blk", "sc_tok", "ss_blk", "ss_tok", "table_width", "num_blocks",
                               "max_pos")}
    return ("megapar.parallel.cp.triton_mla_prep", "_mla_prep_kernel", {**ptrs, **ints},
            dict(NOPE=128, BLOCK_NOPE=128, R=512, BLOCK_R=512, HALF=32, BLOCK_HALF=32, BLOCK_H=2, PAGE=16,
                 Q_NORM=q_norm, FP8=fp8, Q_TILES=8))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_norm", [False, True])
def test_fused_mla_prep_compiles_for_sm90(fp8, q_norm):
    _compile(*_mla_prep(fp8, q_norm))


_PLAN_SWIGLU = [
    ("megapar.parallel.ep.triton_plan", "_plan_kernel",
     dict(ids_ptr="*i64", pair_pos_ptr="*i64", row_token_ptr="*i64", counts_ptr="*i32", offsets_ptr="*i32",
          bad_ptr="*i32", num_pairs="i32", K="i32", first_slot="i32", num_slots="i32", num_slots_total="i32"),
     dict(S_POW2=32, BLOCK=128, NUM_BLOCKS=2, COUNT_BAD=True)),
    ("megapar.moe.kernels.triton_swiglu", "_swiglu_kernel",
     dict(g_ptr="*bf16", u_ptr="*bf16", out_ptr="*bf16", n="i32", limit="fp32", alpha="fp32", beta="fp32"),
     dict(HAS_LIMIT=True, BLOCK=1024))]


def test_static_plan_and_swiglu_compile_for_sm90():
    for build in _PLAN_SWIGLU:
        _compile(*build)


_QUANT = "megapar.parallel.quant.triton_quant"
_FP4_ARGS = dict(data_ptr="*u8", scale_ptr="*u8", n_blocks="i32", blocks_per_gs="i32")
_FP8_QUANT_ARGS = dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*fp32", n_rows="i32", k="i32", amax_floor="fp32")


_QUANT_BUILDS = [
    ("_fp4_quant_kernel", dict(x_ptr="*bf16", gs_ptr="*u8", **_FP4_ARGS),
     dict(IS_NV=False, GS_PER_MATRIX=False, BS=32, ROWS=128, EVEN=True)),
    ("_fp4_quant_kernel", dict(x_ptr="*bf16", gs_ptr="*fp32", **_FP4_ARGS),     # the probe's memory-only variant
     dict(IS_NV=True, GS_PER_MATRIX=False, BS=16, ROWS=256, EVEN=True, DIAG=1)),
    ("_fp4_quant_kernel", dict(x_ptr="*fp32", gs_ptr="*fp32", **_FP4_ARGS),
     dict(IS_NV=True, GS_PER_MATRIX=True, BS=16, ROWS=256, EVEN=False, num_warps=8)),
    ("_fp4_dequant_kernel", dict(gs_ptr="*fp32", out_ptr="*bf16", **_FP4_ARGS),
     dict(IS_NV=True, GS_PER_MATRIX=False, BS=16, ROWS=512, EVEN=True, num_warps=8)),
    ("_amax_scale_kernel", dict(x_ptr="*bf16", acc_ptr="*i32", gs_ptr="*fp32", per_mat="i32", chunks="i32", mats="i32"),
     dict(BLOCK=8192, EVEN=False, num_warps=8)),
    ("_fp8_group_quant_kernel", dict(n_groups="i32", **_FP8_QUANT_ARGS), dict(UE8M0=False, ROWS=32, GROUP=128, HW=True)),
    ("_fp8_group_quant_kernel", dict(n_groups="i32", **_FP8_QUANT_ARGS),
     dict(UE8M0=True, ROWS=1, GROUP=8192, HW=False, num_warps=8)),
    ("_fp8_group_quant_kernel", dict(n_groups="i32", **_FP8_QUANT_ARGS),      # W4A8 act quant, K=7168, 16 warps
     dict(UE8M0=False, ROWS=1, GROUP=8192, HW=False, num_warps=16)),
    ("_fp8_row_quant_kernel", _FP8_QUANT_ARGS, dict(UE8M0=False, CHUNK=4096, NUM_CHUNKS=3, HW=True, num_warps=8)),
    ("_fp8_block_quant_kernel", dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*fp32", n="i32", k="i32", nb="i32",
                                     kb="i32", amax_floor="fp32"), dict(UE8M0=True, SUB=16, HW=True)),
    ("_fp8_dequant_kernel", dict(data_ptr="*fp8e4nv", scale_ptr="*fp32", out_ptr="*bf16", n_rows="i32", k="i32",
                                 rows_per_mat="i32", s_mat="i32", s_row="i32", s_col="i32"),
     dict(ROW_BLOCK=128, ROWS=16, FIX_NAN=False))]


@pytest.mark.parametrize("kernel,types,constexprs", _QUANT_BUILDS, ids=lambda v: v if isinstance(v, str) else None)
def test_quant_kernels_compile_for_sm90(kernel, types, constexprs):
    """Every quantize / dequantize kernel variant the launches pick, incl. the inline-PTX E4M3 cast
    (HW=True: never run by the interpreter tests)."""
    _compile(_QUANT, kernel, types, constexprs)


_FP8_GEMM_PTRS = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", out_ptr="*fp8e4nv",
                      out_scale_ptr="*fp32", counts_ptr="*i64", offsets_ptr="*i32")
_FP8_GEMM_INTS = {n: "i32" for n in ("N", "num_experts", "tiles_per_expert", "capacity", "up_rows", "num_pid_n",
                                     "stride_am", "stride_asm", "stride_be", "stride_bn", "stride_bse", "stride_bsn",
                                     "stride_om", "stride_osm")}
_FP8_GEMM = ("megapar.moe.kernels.triton_w4a8", "_fp8_gemm_kernel",
             dict(**_FP8_GEMM_PTRS, **_FP8_GEMM_INTS, limit="fp32", alpha="fp32", beta="fp32"),
             dict(K=7168, E_POW2=8, SLAB=False, HAS_OFFSETS=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                  A_GROUP=False, B_GROUP=False, SWIGLU=True, HAS_LIMIT=True, QUANT_OUT=True, num_warps=8))


def test_fp8_gemm_with_fp8_group_epilogue_compiles_for_sm90():
    """The W4A8 GEMM's SwiGLU + fp8_group output epilogue (parallel.quant's device helpers inlined)."""
    _compile(*_FP8_GEMM)
