"""The README's Python snippets run as written (at small sizes where the README's are large).

Each ```python block of README.md is one program. The torchrun MoE job runs under
`torch.distributed.run` on 2 gloo ranks with its sizes shrunk through the same API (the
substituted text must be present, so a README edit that breaks the mapping fails here); the
launch_local and Ray programs run unchanged as scripts. Their printed results are checked.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

# the MoE job at test size: 2 ranks (ep 2), a V4-Flash layer with small dimensions
SHRINK = {
    "ParallelConfig(world_size=8, tp=2, pcp=2, dcp=2)": "ParallelConfig(world_size=2)",
    'MoEConfig.deepseek_v4_flash(expert_format="mxfp4")':
        'MoEConfig.deepseek_v4_flash(expert_format="mxfp4", hidden=64, inter=32, num_experts=8, top_k=2)',
}


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _find(needle: str) -> str:
    found = [s for s in snippets() if needle in s]
    assert len(found) == 1, f"expected one README python snippet with {needle!r}, found {len(found)}"
    return found[0]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), MEGAPAR_BACKEND="gloo", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_every_readme_snippet_is_valid_python_and_covered():
    blocks = snippets()
    # 4 run here; the CUDA-graph one continues the MoE job on a GPU (tests/test_moe_device.py runs
    # the same calls there)
    assert len(blocks) == 5, f"README has {len(blocks)} python snippets; this file knows 5: update it"
    for block in blocks:
        ast.parse(block)
    assert "GraphedMoE(layer" in _find("from moe.graphs import GraphedMoE")


def test_readme_moe_snippet_under_torchrun(tmp_path):
    code = _find("MoELayer(")
    for old, new in SHRINK.items():
        assert old in code, f"the README MoE snippet no longer contains {old!r}: update SHRINK"
        code = code.replace(old, new)
    (tmp_path / "moe_job.py").write_text(code)
    # (--standalone: torchrun's own store binds port 0 and keeps it; a port chosen before the launch
    # could be taken by another process in between)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                 "moe_job.py"], tmp_path, timeout=120)
    lines = sorted(re.findall(r"rank \d: y \(\d+, \d+\) torch\.(?:bfloat16|float16|float32)", proc.stdout))
    assert lines == ["rank 0: y (16, 64) torch.bfloat16", "rank 1: y (16, 64) torch.bfloat16"], proc.stdout


def test_readme_decode_plan_snippet_as_a_script(tmp_path):
    (tmp_path / "decode_job.py").write_text(_find("plan_paged_decode(q"))
    proc = _run([sys.executable, "decode_job.py"], tmp_path, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "(4, 32, 128) (4, 32)", proc.stdout


def test_readme_launch_local_snippet_as_a_script(tmp_path):
    (tmp_path / "local_job.py").write_text(_find("launch_local(fn"))
    proc = _run([sys.executable, "local_job.py"], tmp_path, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[3.0, 3.0]", proc.stdout


@pytest.mark.xdist_group("ray")
def test_readme_ray_snippet_as_a_script(tmp_path):
    pytest.importorskip("ray")
    (tmp_path / "ray_job.py").write_text(_find("launch_on_ray(fn"))
    proc = _run([sys.executable, "ray_job.py"], tmp_path, timeout=240)
    assert proc.stdout.strip().splitlines()[-1] == "[6.0, 6.0, 6.0, 6.0]", proc.stdout[-2000:]


def _readme_commands() -> list[str]:
    """The README's `megapar ...` and `... -m launch.demo ...` commands (```bash blocks, `$ ` lines,
    inline code), placeholders such as SUITE or [--quick] left out."""
    text = README.read_text()
    lines = [ln for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for ln in b.splitlines()]
    lines += re.findall(r"^\$ (.*)$", text, flags=re.M) + re.findall(r"`([^`\n]+)`", text)
    parts = [p.split("#")[0].strip() for ln in lines for p in ln.split("&&")]
    return [p for p in parts if (p.startswith("megapar ") or "-m launch.demo" in p)
            and "[" not in p and "SUITE" not in p]


def test_readme_commands_match_the_cli():
    # every command the README shows parses with the real CLI (a renamed flag fails here)
    import shlex

    from launch.cli import build_parser
    from launch.demo import build_parser as demo_parser, spec_from_args

    commands = _readme_commands()
    assert len(commands) >= 6, commands
    for command in commands:
        words = shlex.split(command)
        if "-m" in words:      # torchrun --nproc-per-node N -m launch.demo ARGS: the demo's layout at N ranks
            world = int(words[words.index("--nproc-per-node") + 1])
            args = demo_parser().parse_args(words[words.index("-m") + 2:])
            spec_from_args(args, world)
        elif words[1] == "demo":
            args = demo_parser().parse_args(words[2:])
            spec_from_args(args, args.world_size or 4)
        elif words[1] == "groups":   # the layout too, not only the flags
            from launch.cli import main as cli_main

            assert cli_main(words[1:]) == 0, command
        else:
            build_parser().parse_args(words[1:])


def test_numpy_is_a_base_dependency():
    # without numpy, torch prints "Failed to initialize NumPy" at every import (the first README command)
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps), deps
