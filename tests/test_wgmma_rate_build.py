"""bench/debug/wgmma_rate.py, the GPU probe of wgmma's rate at narrow N, builds for sm_90a on a CPU machine
and its loop holds the instructions it claims to time: UNROLL calls of one wgmma shape each, m64nNk16 over
bf16 (four a call) and m64nNk32 over e4m3 (two), A from shared memory or from registers as asked, and
ptxas keeps the wgmma pipeline (no serialization)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wgmma_rate_cases_build_with_their_shapes(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "debug" / "wgmma_rate.py"), "--build", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 12
    for row in rows:
        m = re.match(r"(bf16|fp8) N=(\d+)( A in registers)?$", row["case"])
        assert m, row
        fp8, n, reg_a = m.group(1) == "fp8", int(m.group(2)), bool(m.group(3))
        shape = f"{'QGMMA' if fp8 else 'HGMMA'}.64x{n}x{32 if fp8 else 16}.F32"
        assert row["mmas"] and all(s.startswith(shape) for s in row["mmas"]), row
        # A's operand: a register (R) where asked, else a shared-memory descriptor (gdesc)
        assert all((" R" in s.split(",")[1]) == reg_a and ("gdesc" in s) != reg_a for s in row["mmas"]), row
        assert row["count"] == 8 * (2 if fp8 else 4), row        # UNROLL calls of K = 64
        assert not row["serialized"], row
        assert (tmp_path / f"wgmma-{m.group(1)}-{n}{'-rega' if reg_a else ''}.cubin").stat().st_size > 0
