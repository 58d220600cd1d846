"""Register budgets of two memory-bound kernels on sm_90a, compiled here without a GPU
(`bench/debug/kernel_sass.py`). The before/after run of 2026-12-01 traced two slowdowns to
register growth: the N-way LSE merge went from 71 to 106 registers (7 -> 4 programs per SM),
and the NVFP4 quantize to 207 (2 per SM). These bounds keep the occupancy that the fixes
restored (bench/results/compare/kernel-sass.md). Triton is pinned, so the counts are stable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent


def _compiled(kind: str, path: str) -> dict[str, tuple[int, int, int]]:
    """label -> (registers, spilled bytes, shared bytes) for the cases of `kernel_sass.py kind path`."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "bench/debug/kernel_sass.py"), kind, path], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"  (.+?): (\d+) registers, (\d+) B spilled, (\d+) B shared", proc.stdout)
    assert rows, proc.stdout[-2000:]
    return {label: (int(regs), int(spill), int(shared)) for label, regs, spill, shared in rows}


def _registers(kind: str, path: str) -> dict[str, tuple[int, int]]:
    return {label: (regs, spill) for label, (regs, spill, _) in _compiled(kind, path).items()}


def test_merge_kernels_keep_their_registers():
    got = _registers("merge", "parallel/cp/triton_merge.py")
    # 4 warps (128 threads) per program: <= 72 registers -> 7 programs per SM, <= 80 -> 6
    assert got["_merge_n_kernel N=4"][0] <= 72, got
    assert got["_merge_pair_kernel fp32 acc + bf16"][0] <= 80, got
    assert got["_merge_n_kernel N=8"][0] <= 168, got
    assert got["_merge_n_kernel N=4 D=512 split merge"][0] <= 72, got   # a decode step's split merge
    assert all(spill == 0 for _, spill in got.values()), got


def test_nvfp4_quantize_keeps_four_programs_per_sm():
    got = _registers("quant", "parallel/quant/triton_quant.py")
    # 4 warps: <= 128 registers -> 4 programs per SM (the rare tiles' float64-threshold branch
    # counts too: registers are the maximum over all paths; 102 / 96 at this writing)
    assert got["_fp4_quant_kernel nvfp4"][0] <= 128, got
    assert got["_fp4_quant_kernel nvfp4 per matrix"][0] <= 128, got
    assert got["_fp4_quant_kernel mxfp4"][0] <= 128, got
    assert all(spill == 0 for _, spill in got.values()), got


def test_mla_decode_launch_settings_fit_in_shared_memory():
    """The MLA decode kernel as CONFIG launches it for bf16, fp8 and fp32 problems: a setting
    tuned on bf16 (64 x 64 tiles, 3 stages: 222 KB) must not reach the fp32 path, where it would
    need 312 KB and fail to launch."""
    got = _compiled("decode-config", "parallel/cp/triton_decode.py")
    assert len(got) == 3, got
    assert all(shared <= 232448 for _, _, shared in got.values()), got     # sm_90 dynamic shared memory
