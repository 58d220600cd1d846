"""The Gluon MLA decode kernels compile for sm_90a on a machine without a GPU (Triton's own
compiler and ptxas): what runs on the H200 still builds, fits its shared memory and does not
spill more than the committed builds do (ptxas -v). The GPU tests in test_cp_decode_kernel.py
run them. The build runs in a child process: this one has Triton in interpreter mode (no GPU),
where Triton device functions cannot be called from Gluon."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SMEM_LIMIT = 232448          # bytes of dynamic shared memory a CTA may take on sm_90
ROOT = Path(__file__).resolve().parents[1]


def _build(fp8: bool) -> dict:
    """(child process) Compile one kernel for sm_90a: shared bytes, ptxas spill bytes, PTX markers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from parallel.cp import gluon_mla

    common = {"table_ptr": "*i32", "glens_ptr": "*i64", "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    if fp8:
        kernel = gluon_mla._mla_decode_ws_fp8_kernel
        ptrs = dict(common, q_ptr="*bf16", k_ptr="*fp8e4nv", ks_ptr="*fp32")
    else:
        box = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        kernel = gluon_mla._mla_decode_ws_kernel
        ptrs = dict(common, q_desc=f"tensordesc<bf16[64, 64],{box}>", k_desc=f"tensordesc<bf16[64, 64],{box}>",
                    k_ptr="*bf16")
    names = kernel.arg_names
    sig = {n: ptrs.get(n, "constexpr" if n == "PAGE" else "i32") for n in names}
    compiled = triton.compile(GluonASTSource(kernel, sig, {(names.index("PAGE"),): 64}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp, "k.o"))],
                              capture_output=True, text=True, check=True).stderr
    return {"shared": compiled.metadata.shared,
            "spill": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
            "setmaxnreg": "setmaxnreg" in compiled.asm["ptx"], "wgmma": "wgmma.mma_async" in compiled.asm["ptx"]}


@pytest.mark.parametrize("fp8,spill_cap", [(False, 512), (True, 1024)], ids=["bf16", "fp8"])
def test_gluon_mla_kernel_builds_for_sm90(fp8, spill_cap):
    """spill_cap: the committed builds spill 172 B (bf16: the loader's masked tail tile) and
    560-600 B (fp8: the converter's loads)."""
    pytest.importorskip("triton.experimental.gluon")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, __file__, "fp8" if fp8 else "bf16"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["shared"] <= SMEM_LIMIT, f"{got['shared']} B of shared memory > {SMEM_LIMIT}"
    assert got["spill"] <= spill_cap, f"{got['spill']} B spilled (cap {spill_cap})"
    # three partitions (the CTA's registers move between them: setmaxnreg) and async wgmma
    assert got["setmaxnreg"] and got["wgmma"]


if __name__ == "__main__":
    print(json.dumps(_build(sys.argv[1] == "fp8")))
