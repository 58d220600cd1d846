"""The installed names do not collide: a `parallel.py` or `model.py` in the working directory
cannot break the library, and the short names are aliases of the `megapar.*` modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_stray_generic_modules_in_the_working_directory_do_not_shadow_the_library(tmp_path):
    for name in ("parallel", "model"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user file was imported')\n")
    proc = _run("from moe import MoELayer, MoEConfig\n"
                "import megapar.model.mhc, megapar.launch.demo\n"
                "import megapar.parallel.comm as c\n"
                "print('ok', MoELayer.__module__, c.__name__)", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok megapar.moe.layer megapar.parallel.comm" in proc.stdout


def test_short_names_are_the_same_module_objects():
    import megapar.moe.layer
    import megapar.parallel.comm
    import moe
    import moe.layer
    import parallel.comm

    assert moe is sys.modules["megapar.moe"]
    assert moe.layer is megapar.moe.layer and parallel.comm is megapar.parallel.comm
    assert moe.MoELayer is megapar.moe.layer.MoELayer


def test_an_alias_import_keeps_the_modules_spec_so_relative_imports_do_not_warn(tmp_path):
    # `import parallel.cp.paged` after `megapar.parallel.cp.paged` gave the module the alias's __spec__:
    # __spec__.parent ("parallel.cp") then differed from __package__ ("megapar.parallel.cp"), and every
    # relative import run inside a function warned (ImportWarning; a DeprecationWarning since 3.12)
    proc = _run("import warnings\n"
                "warnings.simplefilter('error', ImportWarning)\n"
                "warnings.simplefilter('error', DeprecationWarning)\n"
                "import megapar.parallel.cp.paged\n"
                "import parallel.cp.paged as p, parallel.cp as pkg\n"
                "assert p is megapar.parallel.cp.paged and pkg is megapar.parallel.cp\n"
                "exec('from . import merge', dict(p.__dict__))\n"
                "exec('from .. import impl', dict(p.__dict__))\n"
                "print(p.__spec__.name, p.__spec__.parent == p.__package__, pkg.__spec__.name)", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["megapar.parallel.cp.paged", "True", "megapar.parallel.cp"]


def test_a_users_own_package_of_a_generic_name_is_left_alone(tmp_path):
    pkg = tmp_path / "model"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("MINE = True\n")
    (pkg / "sub.py").write_text("VALUE = 7\n")
    proc = _run("import megapar.moe\nimport model, model.sub\nprint(model.MINE, model.sub.VALUE)", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True 7"


def test_python_dash_m_entry_points_run_next_to_stray_modules(tmp_path):
    for name in ("parallel", "model", "moe"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user file was imported')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "megapar.launch.cli", "groups", "--world-size", "4", "--tp", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tp" in proc.stdout


def test_short_name_import_of_a_submodule_keeps_the_package_name_it_shares():
    """`moe.kernels.grouped_gemm` is both a module and the function the package exports: importing
    the module by its short name must not replace the function (fresh interpreter)."""
    code = ("import types, moe.kernels.grouped_gemm, parallel.cp.mla_prep\n"
            "from moe.kernels import grouped_gemm\n"
            "from parallel.cp import mla_prep\n"
            "import megapar.moe.kernels as k\n"
            "assert not isinstance(grouped_gemm, types.ModuleType), grouped_gemm\n"
            "assert not isinstance(mla_prep, types.ModuleType), mla_prep\n"
            "assert k.grouped_gemm is grouped_gemm\n"
            "import sys\n"
            "m = sys.modules['moe.kernels.grouped_gemm']\n"
            "assert isinstance(m, types.ModuleType) and m.grouped_gemm is grouped_gemm\n"
            "print('ok')\n")
    import subprocess
    import sys

    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_python_dash_m_short_name_of_the_demo_starts_its_ranks(tmp_path):
    """`python -m launch.demo` (the demo's own docstring; the torchrun form in the README) with local
    ranks: the alias module spec had no origin, so runpy left __main__.__file__ None and
    launch_local took the script for `python -c` and refused to start any rank."""
    import importlib.util

    import megapar.launch.demo

    assert importlib.util.find_spec("launch.demo").origin == megapar.launch.demo.__file__
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "launch.demo", "--world-size", "2", "--tp", "2", "--layers", "1",
                           "--new-tokens", "1", "--prompt-len", "4", "--vocab", "64"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "2 rank(s), launcher local" in proc.stdout and "PASS: max error" in proc.stdout
