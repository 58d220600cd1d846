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
import inspect, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name, types, constexprs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
kernel = getattr(__import__(module, fromlist=[name]), name)
names = list(inspect.signature(kernel.fn).parameters)
missing = [n for n in names if n not in types and n not in constexprs]
assert not missing, f"no type given for {missing}"
sig = {n: types.get(n, "constexpr") for n in names}
triton.compile(ASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}),
               target=GPUTarget("cuda", 90, 32))
"""


def _compile(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, object]) -> None:
    """Compile in a fresh process: the test session runs Triton's interpreter (TRITON_INTERPRET=1)."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _COMPILER, module, kernel, json.dumps(types), json.dumps(constexprs)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_norm", [False, True])
def test_fused_mla_prep_compiles_for_sm90(fp8, q_norm):
    ptrs = dict(q_ptr="*bf16", kv_ptr="*bf16", pos_ptr="*i64", table_ptr="*i32", cs_ptr="*fp32", qw_ptr="*fp32",
                kw_ptr="*fp32", qo_ptr="*bf16", cache_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32",
                slot_ptr="*i64", eps="fp32")
    ints = {n: "i32" for n in ("H", "dcp_size", "dcp_rank", "interleave", "sq_t", "sq_h", "skv_t", "sqo_t", "sqo_h",
                               "st_t", "scs", "sc_row", "table_width", "num_blocks", "max_pos")}
    _compile("megapar.parallel.cp.triton_mla_prep", "_mla_prep_kernel", {**ptrs, **ints},
             dict(NOPE=128, BLOCK_NOPE=128, R=512, BLOCK_R=512, HALF=32, BLOCK_HALF=32, BLOCK_H=2, PAGE=16,
                  Q_NORM=q_norm, FP8=fp8, Q_TILES=8))


def test_static_plan_and_swiglu_compile_for_sm90():
    _compile("megapar.parallel.ep.triton_plan", "_plan_kernel", dict(ids_ptr="*i64", pair_pos_ptr="*i64", row_token_ptr="*i64", counts_ptr="*i32",
                                offsets_ptr="*i32", bad_ptr="*i32", num_pairs="i32", K="i32", first_slot="i32",
                                num_slots="i32", num_slots_total="i32"),
             dict(S_POW2=32, BLOCK=128, NUM_BLOCKS=2, COUNT_BAD=True))
    _compile("megapar.moe.kernels.triton_swiglu", "_swiglu_kernel", dict(g_ptr="*bf16", u_ptr="*bf16", out_ptr="*bf16", n="i32", limit="fp32", alpha="fp32",
                                  beta="fp32"), dict(HAS_LIMIT=True, BLOCK=1024))
