"""Launchers: torchrun entry, Ray actors, the CLI's layout and env commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from launch.cli import main as cli_main
from launch.local import RankError, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megapar_groups_prints_layout_and_rejects_bad_sizes(capsys):
    assert cli_main(["groups", "--world-size", "8", "--pp", "2", "--pcp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "[0, 2]  [1, 3]  [4, 6]  [5, 7]" in out          # pcp groups
    assert "[0, 1, 2, 3]  [4, 5, 6, 7]" in out               # ep groups
    assert cli_main(["groups", "--world-size", "8", "--tp", "4", "--dcp", "3"]) == 2
    assert "valid dcp: 1, 2, 4" in capsys.readouterr().err


def test_megapar_env_lists_backends(capsys):
    assert cli_main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "gloo", "nccl", "triton", "deep_ep", "deep_gemm", "ray", "nvshmem4py"):
        assert name in out


_TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
from launch import init_from_env
g = init_from_env(tp=2)
t = torch.tensor([float(g.rank + 1)])
dist.all_reduce(t, group=g.tp.group)
print(f"RESULT rank={g.rank} tp_rank={g.tp.rank} sum={t.item()}", flush=True)
"""


def test_torchrun_two_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO, MEGAPAR_BACKEND="gloo")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two ranks share stdout: their lines may interleave without a newline between them
    lines = sorted(re.findall(r"RESULT rank=\d tp_rank=\d sum=[\d.]+", proc.stdout))
    assert lines == ["RESULT rank=0 tp_rank=0 sum=3.0", "RESULT rank=1 tp_rank=1 sum=3.0"]
    assert "terminate called" not in proc.stderr


# ---------------------------------------------------------------- Ray
def _ray_job(rank: int, mode: str):
    import torch.distributed as dist

    from parallel import get_groups

    g = get_groups()
    if mode == "raise" and rank == 1:
        raise ValueError("rank one refuses")
    if mode == "die" and rank == 1:
        os._exit(3)
    if mode == "hang" and rank == 0:
        time.sleep(1000)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g.ep.group)
    return {"rank": rank, "env_rank": int(os.environ["RANK"]), "sum": t.item(), "ep": list(g.ep.ranks),
            "pid": os.getpid()}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    yield ray
    ray.shutdown()


def test_launch_on_ray_runs_and_fails_fast(ray_cluster):
    from launch import launch_on_ray
    from parallel import ParallelConfig

    cfg = ParallelConfig(world_size=2)
    res = launch_on_ray(_ray_job, 2, parallel_config=cfg, args=("ok",), timeout=120)
    assert [r["rank"] for r in res] == [0, 1] and [r["env_rank"] for r in res] == [0, 1]
    assert all(r["sum"] == 3.0 and r["ep"] == [0, 1] for r in res)

    for mode, needle in (("raise", "rank one refuses"), ("die", "actor died"), ("hang", "timed out")):
        t0 = time.monotonic()
        with pytest.raises(RankError) as err:
            launch_on_ray(_ray_job, 2, parallel_config=cfg, args=(mode,), timeout=8 if mode == "hang" else 120)
        assert needle in str(err.value), str(err.value)[:500]
        if mode != "hang":
            assert err.value.rank == 1
        assert time.monotonic() - t0 < 60
    # nothing left behind: no live actors, no placement groups holding resources
    # (a live actor or a placement group would hold CPUs)
    from ray._private import state as ray_state

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and ray_cluster.available_resources().get("CPU", 0) < 2:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == 2
    alive = [a for a in ray_state.actors().values() if a.get("State") == "ALIVE"]
    assert alive == []
