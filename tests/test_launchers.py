"""Launchers: torchrun entry, Ray actors, the CLI's layout and env commands, and launch_local
under injected faults (gloo): the root-cause rank is named, a hang names the ranks outside the
collective, ranks die with their parent, and bad arguments are refused before anything starts."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from launch.cli import main as cli_main
from launch.local import RankError, free_port, launch_local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megapar_groups_prints_layout_and_rejects_bad_sizes(capsys):
    assert cli_main(["groups", "--world-size", "8", "--pp", "2", "--pcp", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "[0, 2]  [1, 3]  [4, 6]  [5, 7]" in out          # pcp groups
    assert "[0, 1, 2, 3]  [4, 5, 6, 7]" in out               # ep groups
    assert cli_main(["groups", "--world-size", "8", "--tp", "4", "--dcp", "3"]) == 2
    assert "valid dcp: 1, 2, 4" in capsys.readouterr().err


def test_megapar_bench_sigterm_stops_the_run_and_the_handler_is_the_callers_again(tmp_path, monkeypatch, capsys):
    # SIGTERM in the second suite of `bench all`: that suite's rows are kept, the rest are not run
    # (they all ran, after a TERM from `timeout` or a scheduler), the exit code is 1; and the
    # handler that did this is removed when main() returns (a later SIGTERM to the caller's
    # process raised an exception in whatever code ran)
    import types

    from launch.cli import SUITES

    ran = []

    def fake(name):
        def run(ctx):
            ran.append(name)
            ctx.rows.append({"case": "first", "time_us": 1.0})
            if len(ran) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)              # the handler interrupts this
        return types.SimpleNamespace(run=run)

    for name in SUITES:
        monkeypatch.setitem(sys.modules, f"megapar.launch.bench.{name}", fake(name))
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert cli_main(["bench", "all", "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert time.monotonic() - t0 < 20
    assert ran == list(SUITES[:2])
    err = capsys.readouterr().err
    assert f"failed suites: {SUITES[1]}, {SUITES[2]} (not run)" in err
    assert "stopped by SIGTERM" in (tmp_path / f"{SUITES[1]}-cpu.json").read_text()
    assert signal.getsignal(signal.SIGTERM) is before


def test_megapar_bench_compare_with_the_file_the_run_replaces_compares_with_the_old_rows(tmp_path, monkeypatch):
    # `megapar bench SUITE --out DIR --compare DIR/SUITE-DEVICE.json` (the last run in the same folder):
    # the old file was read after the run had overwritten it, so every ratio was 1.000 and the
    # verdict "no regression" whatever the code did
    import json
    import types

    times = iter([100.0, 200.0])

    def run(ctx):
        ctx.rows.append({"case": "one", "time_us": next(times)})

    monkeypatch.setitem(sys.modules, "megapar.launch.bench.merge", types.SimpleNamespace(run=run))
    argv = ["bench", "merge", "--device", "cpu", "--out", str(tmp_path)]
    assert cli_main(argv) == 0
    old = tmp_path / "merge-cpu.json"
    assert cli_main(argv + ["--compare", str(old)]) == 0
    assert json.loads(old.read_text())["rows"][0]["time_us"] == 200.0          # the new run's file
    table = (tmp_path / "merge-compare.md").read_text()
    assert "| one | 100.0 | 200.0 | 2.000! | **yes** |" in table, table
    assert "as it was before this run" in table
    # a file that is not a result file is refused before the suite runs
    (tmp_path / "bad.json").write_text("{}")
    assert cli_main(argv + ["--compare", str(tmp_path / "bad.json")]) == 2
    assert json.loads(old.read_text())["rows"][0]["time_us"] == 200.0


def test_megapar_bench_plot_without_matplotlib_is_refused_before_any_suite_runs(tmp_path, monkeypatch, capsys):
    # the ImportError came after the first suite had run and ended `bench all` with a traceback
    import types

    ran = []

    def run(ctx):
        ran.append(ctx.suite)
        ctx.rows.append({"case": "one", "time_us": 1.0})

    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "megapar.launch.bench.merge", types.SimpleNamespace(run=run))
    assert cli_main(["bench", "merge", "--device", "cpu", "--plot", "--out", str(tmp_path)]) == 2
    assert ran == [] and "--plot needs matplotlib" in capsys.readouterr().err


def test_megapar_env_lists_backends(capsys):
    assert cli_main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "gloo", "nccl", "triton", "deep_ep", "deep_gemm", "ray", "nvshmem4py"):
        assert name in out


def test_megapar_env_runs_next_to_stray_modules_of_generic_names(tmp_path):
    # `python -m megapar.launch.cli env` imported the op modules as moe.kernels.ffn, model.mhc,
    # parallel.cp: the user's moe.py in the working directory (sys.path[0]) was imported instead
    for name in ("parallel", "model", "moe"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user file was imported')\n")
    proc = subprocess.run([sys.executable, "-m", "megapar.launch.cli", "env"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "implementations (" in proc.stdout and "cp.merge" in proc.stdout


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES", "MEGAPAR_BACKEND", "MASTER_ADDR", "MASTER_PORT")


def _set_launch_env(monkeypatch, env: dict[str, str]) -> None:
    """Only `env`'s launch variables, over a valid rendezvous address (None in env: unset)."""
    for k in _LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"} | env).items():
        if v is not None:
            monkeypatch.setenv(k, v)


# MASTER_PORT=0 hung: rank 0 listened on a random port while the others dialed port 0 until the
# group timeout; 'x' and 70000 failed in torch without naming the variable
_BAD_RENDEZVOUS = [
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "0"}, "MASTER_PORT='0' must be a port number in [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "x"}, "MASTER_PORT='x' must be a port number in [1, 65535]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' must be a port"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": None}, "WORLD_SIZE=2 but MASTER_PORT is not set"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": None, "MASTER_PORT": None},
     "WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set"),
    # (torch looked ' node1' up as given: every rank retried the rendezvous until the group timeout)
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " node1"}, "MASTER_ADDR=' node1' has whitespace"),
]


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be in [0, WORLD_SIZE=2)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 must be in [0, WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1, got 0"),
    *_BAD_RENDEZVOUS,
])
def test_init_parallel_called_directly_refuses_a_bad_rank_before_any_rendezvous(monkeypatch, env, needle):
    """init_parallel reads the same environment as init_from_env and refuses the same ranks (it
    reached init_process_group with them, which waits for a rendezvous that never completes)."""
    import torch.distributed as dist

    from parallel import init_parallel
    from parallel import groups as groups_mod

    _set_launch_env(monkeypatch, env)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(k))
    with pytest.raises(ValueError) as err:
        init_parallel(backend="gloo")
    assert needle in str(err.value)
    assert started == [] and groups_mod.get_optional_groups() is None


@pytest.mark.parametrize("backend, env, needle", [
    (None, {"MEGAPAR_BACKEND": "ncl"}, "environment variable MEGAPAR_BACKEND must be 'gloo' or 'nccl', got 'ncl'"),
    ("mpi", {}, "backend must be 'gloo' or 'nccl', got 'mpi'"),
    ("", {"MEGAPAR_BACKEND": "gloo"}, "backend must be 'gloo' or 'nccl', got ''"),
])
def test_init_parallel_refuses_a_backend_it_cannot_run_before_any_rendezvous(monkeypatch, backend, env, needle):
    # a typo reached init_process_group: rank 0 waited for its peers at the store, and only after
    # the rendezvous did torch fail ("Unknown backend type ncl", not naming MEGAPAR_BACKEND)
    import torch.distributed as dist

    from parallel import init_parallel
    from parallel import groups as groups_mod

    _set_launch_env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2"} | env)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(k))
    with pytest.raises(ValueError) as err:
        init_parallel(backend=backend)
    assert str(err.value) == needle
    assert started == [] and groups_mod.get_optional_groups() is None


def _backend_names(rank: int) -> tuple:
    import torch.distributed as dist

    from parallel import ParallelConfig, destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig(world_size=2, tp=2))
    out = (g.backend, dist.get_backend(), dist.get_backend(g.tp.group))
    destroy_parallel()
    return out


def test_init_parallel_names_the_backend_as_torch_does():
    # MEGAPAR_BACKEND=GLOO was kept as given in groups.backend, which every check of the backend
    # compares with "gloo" / "nccl" (NCCL: no GPU per LOCAL_RANK, the start-up probe on a CPU tensor)
    res = launch_local(_backend_names, 2, env={"MEGAPAR_BACKEND": "GLOO"}, timeout=60)
    assert res == [("gloo", "gloo", "gloo")] * 2


@pytest.mark.parametrize("env, gpus, needle", [
    # an out-of-range or missing RANK waited for a rendezvous that never completes (a hang)
    ({"RANK": "2", "WORLD_SIZE": "2"}, 0, "RANK=2 must be in [0, WORLD_SIZE=2)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, 0, "RANK=-1 must be in [0, WORLD_SIZE=2)"),
    ({"WORLD_SIZE": "2"}, 0, "WORLD_SIZE=2 but RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, 0, "WORLD_SIZE must be >= 1, got 0"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, 0,
     "LOCAL_RANK=2 must be in [0, LOCAL_WORLD_SIZE=2)"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, 0, "LOCAL_RANK=-1 must be >= 0"),
    # a LOCAL_WORLD_SIZE that is not a count of this job's processes was ignored (and with it the
    # bound on LOCAL_RANK)
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "two"}, 0,
     "LOCAL_WORLD_SIZE='two' must be an int in [1, WORLD_SIZE=2]"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}, 0,
     "LOCAL_WORLD_SIZE='8' must be an int in [1, WORLD_SIZE=2]"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, 0,
     "LOCAL_WORLD_SIZE='0' must be an int in [1, WORLD_SIZE=2]"),
    # 4 ranks on a 2-GPU node: LOCAL_RANK 2 went silently to GPU 0 (modulo), rank 0's GPU
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 2,
     "LOCAL_RANK=2 but this node has 2 GPU(s)"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, None),   # valid
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}, 1, None),  # one GPU each
    *[(env, 0, needle) for env, needle in _BAD_RENDEZVOUS],
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": None, "MASTER_PORT": None}, 0, None),   # one process: no rendezvous
    # torch looked up "node1\n" as given: every rank retried the rendezvous until the group timeout
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node1\n"}, 0, "MASTER_ADDR='node1\\n' has whitespace"),
])
def test_init_from_env_refuses_an_inconsistent_environment(monkeypatch, env, gpus, needle):
    import launch.env as launch_env

    _set_launch_env(monkeypatch, env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    reached = []     # nothing is started here: the checks come first
    monkeypatch.setattr(launch_env, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(launch_env, "set_local_device", lambda e: reached.append(("device", e.local_rank)))
    monkeypatch.setattr(launch_env, "init_parallel",
                        lambda cfg, backend=None, timeout=None: reached.append(("init", backend)))
    backend = "nccl" if gpus else "gloo"
    if needle is None:
        launch_env.init_from_env(backend=backend)
        assert reached[-1] == ("init", backend)
        return
    with pytest.raises(ValueError) as err:
        launch_env.init_from_env(backend=backend)
    assert needle in str(err.value)
    assert reached == []


@pytest.mark.parametrize("started_backend", ["undefined", "cpu:gloo,cuda:nccl", "nccl"])
def test_launch_env_reads_a_callers_backend_as_what_it_runs_on(monkeypatch, started_backend):
    # a torch.distributed the caller started without a backend reports "undefined" (or a device map):
    # the check compared it with "nccl" and let LOCAL_RANK 2 of a 2-GPU node through (to GPU 0)
    import torch.distributed as dist

    import launch.env as launch_env

    _set_launch_env(monkeypatch, {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: started_backend)
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but this node has 2 GPU"):
        launch_env.check_launch_env(launch_env.read_launch_env())


def test_init_from_env_takes_the_rank_of_a_callers_torch_distributed(monkeypatch):
    # init_process_group(rank=1, world_size=2, init_method="tcp://...") sets no RANK / WORLD_SIZE:
    # init_from_env took rank 0 (every rank logged as "[rank 0]" and, with CUDA, went to GPU 0)
    # and world size 1 (sizes laid out for one process)
    import torch.distributed as dist

    import launch.env as launch_env

    _set_launch_env(monkeypatch, {"MASTER_ADDR": None, "MASTER_PORT": None})
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    got = []
    monkeypatch.setattr(launch_env, "setup_logging", lambda rank, *a, **k: got.append(("log", rank)))
    monkeypatch.setattr(launch_env, "set_local_device", lambda e: got.append(("device", e.rank, e.local_rank)))
    monkeypatch.setattr(launch_env, "init_parallel", lambda cfg, backend=None, timeout=None:
                        got.append(("init", cfg.world_size, cfg.tp)))
    launch_env.init_from_env(backend="nccl", tp=2)
    assert got == [("log", 1), ("device", 1, None), ("init", 2, 2)]


def test_init_from_env_passes_its_timeout_to_init_parallel(monkeypatch):
    # the demo's --timeout was ignored under torchrun: init_from_env had no way to pass it on
    import launch.env as launch_env

    _set_launch_env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": None, "MASTER_PORT": None})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch_env, "setup_logging", lambda *a, **k: None)
    got = []
    monkeypatch.setattr(launch_env, "init_parallel", lambda cfg, backend=None, timeout=None: got.append(timeout))
    launch_env.init_from_env(backend="gloo", timeout=42.0)
    launch_env.init_from_env(backend="gloo")
    assert got == [42.0, None]


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
                           "--standalone", str(script)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two ranks share stdout: their lines may interleave without a newline between them
    lines = sorted(re.findall(r"RESULT rank=\d tp_rank=\d sum=[\d.]+", proc.stdout))
    assert lines == ["RESULT rank=0 tp_rank=0 sum=3.0", "RESULT rank=1 tp_rank=1 sum=3.0"]
    assert "terminate called" not in proc.stderr


# ---------------------------------------------------------------- launch_local under faults
def _fault(rank: int, mode: str, faulty: int):
    """All ranks meet in one all_reduce; then `faulty` misbehaves while the others enter a second."""
    import torch.distributed as dist

    from parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(world_size=int(os.environ["WORLD_SIZE"])))
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == faulty:
        if mode == "exit0":
            os._exit(0)        # leaves in the middle of the job with a "success" code
        if mode == "hang":
            time.sleep(1000)   # never reaches the collective below
    dist.all_reduce(t)
    return t.item()


def _no_stray_ranks() -> list:
    time.sleep(0.2)
    return [p for p in mp.active_children() if p.name.startswith("megapar-rank")]


@pytest.mark.parametrize("world, faulty", [(3, 1), (2, 0)])
def test_launch_local_blames_the_rank_that_exited_with_code_0(world, faulty):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        launch_local(_fault, world, args=("exit0", faulty), timeout=60)
    assert err.value.rank == faulty, str(err.value)[:2000]
    assert f"rank {faulty} exited with code 0 before returning a result" in str(err.value)
    assert time.monotonic() - t0 < 45                 # well before the 60 s timeout, on a loaded box too
    assert _no_stray_ranks() == []


def test_launch_local_timeout_names_the_rank_that_never_reached_the_collective():
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        # start-up takes seconds, and over 12 s on a loaded 2-core box (CI saw the timeout hit
        # while all three ranks were still creating their store): leave it room
        launch_local(_fault, 3, args=("hang", 1), timeout=30)
    msg = str(err.value)
    assert time.monotonic() - t0 < 60
    assert "timed out after 30s" in msg
    assert err.value.rank == 1, msg[:3000]
    assert "ranks [1] never reached the collective that ranks [0, 2] wait in (all_reduce" in msg, msg[:3000]
    assert "--- rank 1 stack" in msg and "in _fault" in msg          # where it hangs, from its own stack
    assert sorted(err.value.stacks) == [0, 1, 2] and "all_reduce" in err.value.stacks[0]
    assert _no_stray_ranks() == []


def test_launch_local_inside_a_torchrun_job_starts_its_own_rendezvous(monkeypatch):
    # torchrun exports TORCHELASTIC_USE_AGENT_STORE=True to its workers; a worker that calls
    # launch_local passed it on, every new rank then connected to the store as a client, none
    # hosted it, and the job hung until the timeout
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer-job")
    t0 = time.monotonic()
    assert launch_local(_fault, 2, args=("none", -1), timeout=30) == [4.0, 4.0]
    assert time.monotonic() - t0 < 25
    # a variable given through env is the caller's choice and reaches the ranks; the agent-store
    # flag they see is this job's own (launch_local hosts its store), not the outer job's
    assert launch_local(_torchelastic_env, 1, env={"TORCHELASTIC_RUN_ID": "mine"}, timeout=30) == [("True", "mine")]
    assert _no_stray_ranks() == []


def _torchelastic_env(rank: int) -> tuple:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), os.environ.get("TORCHELASTIC_RUN_ID")


class _PopenProc:
    """The part of a multiprocessing.Process that the timeout report uses, over a subprocess."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen, self.pid = popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None


_STUCK = """
import faulthandler, signal, sys, time
stacks = open(sys.argv[1], "w")
faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
def {name}():
    print("ready", flush=True)
    time.sleep(1000)
{name}()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="stacks are asked for with SIGUSR1")
def test_timeout_report_after_some_ranks_returned_shows_each_stuck_ranks_own_stack(tmp_path):
    # rank 0 returned; ranks 1 and 2 are stuck: the report asks only those two for their stacks,
    # and must file each under its own rank (it indexed the shorter list by rank: IndexError)
    from launch.local import _Rank, _timeout_error

    ranks = [_Rank(0, _PopenProc(subprocess.Popen([sys.executable, "-c", "pass"])), None,
                   str(tmp_path / "0.stack"), status="ok", value=0)]
    ranks[0].proc.popen.wait(30)
    try:
        for rank, name in ((1, "rank_one_is_here"), (2, "rank_two_is_here")):
            path = tmp_path / f"{rank}.stack"
            p = subprocess.Popen([sys.executable, "-c", _STUCK.format(name=name), str(path)],
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready"
            ranks.append(_Rank(rank, _PopenProc(p), None, str(path)))
        err = _timeout_error(ranks, 5.0)
        assert isinstance(err, RankError)
        msg = str(err)
        assert msg.startswith("timed out after 5s waiting for ranks [1, 2]: none is in a collective"), msg
        assert sorted(err.stacks) == [1, 2]
        assert "rank_one_is_here" in err.stacks[1] and "rank_two_is_here" not in err.stacks[1]
        assert "rank_two_is_here" in err.stacks[2] and "rank_one_is_here" not in err.stacks[2]
    finally:
        for r in ranks[1:]:
            r.proc.popen.kill()
            r.proc.popen.wait(10)
            r.proc.popen.stdout.close()


def _ok(rank: int) -> int:
    return rank * 10


def _nested_fn():
    def inner(rank):
        return rank
    return inner


@pytest.mark.parametrize("kwargs, needle", [
    (dict(timeout=0), "timeout must be a number of seconds > 0"),
    (dict(timeout=-1), "got -1"),
    (dict(timeout="5"), "got '5'"),
    (dict(timeout=math.nan), "got nan"),
    (dict(world_size="2"), "world_size must be an int >= 1, got '2'"),
    (dict(fn=lambda rank: rank), "fn is a lambda"),
    (dict(fn=_nested_fn()), "is defined inside a function"),
    (dict(fn=_ok, args=(lambda: 0,)), "args must be picklable"),
    # every rank died in os.environ.update and rank 1 was blamed
    (dict(env={"MEGAPAR_X": 1}), "env must be a dict of str to str, got {'MEGAPAR_X': 1}"),
    # every rank became rank 0 ("address already in use", blamed on rank 0) / waited for a third rank
    (dict(env={"RANK": "0", "MASTER_PORT": "29500"}), "env sets {'RANK': '0'}, which launch_local sets itself"),
    (dict(env={"WORLD_SIZE": "3"}), "env sets {'WORLD_SIZE': '3'}"),
])
def test_launch_local_refuses_bad_arguments_before_starting(kwargs, needle):
    call = dict(fn=_ok, world_size=2, timeout=30) | kwargs
    with pytest.raises(ValueError, match="module-level function|timeout|world_size|picklable|env") as err:
        launch_local(call.pop("fn"), call.pop("world_size"), **call)
    assert needle in str(err.value)
    assert _no_stray_ranks() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="binds 127.0.0.2 (all of 127/8 is loopback on Linux)")
def test_free_port_is_free_on_every_address_the_store_listens_on():
    # it asked for a port on 127.0.0.1 only: one that a server held on another address of the host
    # came back, and rank 0's store (which listens on 0.0.0.0) failed with EADDRINUSE
    import resource
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(4000, (high - low) // 2, (hard if hard != resource.RLIM_INFINITY else 8192) - 200)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, count + 200), hard))
    held = {}
    try:
        for port in range(low, high + 1, max(1, (high - low) // count)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.2", port))
                s.listen()
                held[port] = s
            except OSError:
                s.close()
        assert len(held) > count // 2
        assert [p for p in (free_port() for _ in range(100)) if p in held] == []
    finally:
        for s in held.values():
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _refuse_rebuild():
    raise RuntimeError("not rebuilt in the parent")


class _NoRebuild:
    def __reduce__(self):   # pickles in the rank; unpickling (in the parent only) raises
        return (_refuse_rebuild, ())


def _returns_unrebuildable(rank: int):
    return _NoRebuild() if rank == 1 else rank


@pytest.mark.timeout(120)
def test_launch_local_a_result_the_parent_cannot_unpickle_names_its_rank():
    # the unpickling error escaped launch_local bare (RuntimeError), naming no rank
    with pytest.raises(RankError) as err:
        launch_local(_returns_unrebuildable, 2, timeout=60)
    assert err.value.rank == 1
    assert "rank 1 failed:\nfn returned a value that the launching process cannot unpickle: " \
           "RuntimeError: not rebuilt in the parent" in str(err.value)
    assert _no_stray_ranks() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_launch_local_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='nccl' needs CUDA"):
        launch_local(_ok, 2, backend="nccl")


def _script_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


@pytest.mark.parametrize("how", ["python -c", "no main guard"])
def test_launch_local_from_a_script_the_ranks_cannot_import_is_one_message(how, tmp_path):
    code = textwrap.dedent("""
        from launch import launch_local
        def fn(rank):
            return rank
        print(launch_local(fn, 2, timeout=30))
    """)
    args = [sys.executable, "-c", code] if how == "python -c" else [sys.executable, str(tmp_path / "job.py")]
    (tmp_path / "job.py").write_text(code)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, env=_script_env(), cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: launch_")
    needle = "__main__ of `python -c`" if how == "python -c" else 'without an `if __name__ == "__main__":` guard'
    assert needle in last, proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) < 15, proc.stderr      # one traceback, not one per rank
    assert "bootstrapping phase" not in proc.stderr


_PARENT_SCRIPT = """
import os, sys, time
from launch import launch_local

def fn(rank, folder):
    open(os.path.join(folder, f"{rank}.pid"), "w").write(str(os.getpid()))
    time.sleep(1000)

if __name__ == "__main__":
    launch_local(fn, 2, args=(sys.argv[1],), timeout=300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_ranks_die_with_their_parent(sig, tmp_path):
    (tmp_path / "job.py").write_text(_PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(tmp_path)], env=_script_env(),
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # both ranks have written their pid (a file can exist before its text: a loaded machine)
        while len([p for p in tmp_path.glob("*.pid") if p.read_text().strip()]) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, "the ranks did not start"
            time.sleep(0.2)
        time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert all(_alive(pid) for pid in pids)
        parent.send_signal(sig)
        parent.wait(30)
        deadline = time.monotonic() + 20     # generous: the ranks notice on a shared 2-core machine too
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in tmp_path.glob("*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


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
            "pid": os.getpid(), "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # as under a driver that torchrun started: its agent-store flag reaches every actor (a rank
    # of the Ray job that kept it waited as a store client for a store nobody hosts)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO, "TORCHELASTIC_USE_AGENT_STORE": "True"}})
    yield ray
    ray.shutdown()


@pytest.mark.xdist_group("ray")
def test_launch_on_ray_runs_and_fails_fast(ray_cluster):
    from launch import launch_on_ray
    from parallel import ParallelConfig

    cfg = ParallelConfig(world_size=2)
    res = launch_on_ray(_ray_job, 2, parallel_config=cfg, args=("ok",), timeout=120)
    assert [r["rank"] for r in res] == [0, 1] and [r["env_rank"] for r in res] == [0, 1]
    # the flag is this job's own: rank 0's actor hosts the store and every rank joins it (the
    # fixture's flag, passed on while nobody hosted a store for the job, hung it)
    assert [r["agent_store"] for r in res] == ["True", "True"]
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


def _ray_unrebuildable(rank: int):
    return _NoRebuild() if rank == 1 else rank


@pytest.mark.timeout(300)
@pytest.mark.xdist_group("ray")
def test_launch_on_ray_no_time_limit_and_a_result_the_caller_cannot_unpickle(ray_cluster):
    # float('inf') (accepted: "no limit") raised OverflowError in ray.get / ray.wait, which count
    # milliseconds in an int; a result that does not deserialize on the driver escaped as Ray's
    # RaySystemError, naming no rank
    from launch import launch_on_ray

    with pytest.raises(RankError) as err:
        launch_on_ray(_ray_unrebuildable, 2, timeout=math.inf, startup_timeout=math.inf)
    assert err.value.rank == 1, str(err.value)[:1000]
    assert "rank 1 failed while running fn:\nits result could not be received by the caller" in str(err.value)
    assert "not rebuilt in the parent" in str(err.value)


def test_ray_rank_order_takes_gpu_ids_that_are_uuids(monkeypatch):
    # a node started with CUDA_VISIBLE_DEVICES=MIG-... (or GPU-...) UUIDs: Ray returns those as the
    # actor's GPU ids, and int() of them failed every GPU job there while starting the actors
    ray = pytest.importorskip("ray")
    from launch.ray_launcher import _RankWorker

    class Context:
        def get_node_id(self):
            return "node"

    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["MIG-b", "MIG-a"])
    assert _RankWorker().node_info() == ("node", "10.0.0.1", ["MIG-a", "MIG-b"])
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [10, "2"])
    assert _RankWorker().node_info()[2] == ["2", "10"]      # indices in numeric order


@pytest.mark.xdist_group("ray")
def test_launch_on_ray_refuses_at_once_what_the_cluster_cannot_hold(ray_cluster):
    from launch import launch_on_ray
    from parallel import ParallelConfig

    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:      # 4 x 1 CPU on a 2-CPU cluster
        launch_on_ray(_ray_job, 4, parallel_config=ParallelConfig(world_size=4), args=("ok",))
    assert time.monotonic() - t0 < 5
    assert "CPU: 4 needed, 2 in the cluster" in str(err.value)
    assert "pass resources_per_worker={'CPU': 0.5}" in str(err.value)
    with pytest.raises(ValueError, match="the cluster has no GPU"):
        launch_on_ray(_ray_job, 2, resources_per_worker={"CPU": 1, "GPU": 1})
    # a backend that cannot work is refused before any actor starts (they started, then failed)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'.*got 'ncl'"):
        launch_on_ray(_ray_job, 2, backend="ncl", args=("ok",))
    with pytest.raises(ValueError, match="backend='nccl' runs one rank per GPU.*got {'CPU': 0.5}"):
        launch_on_ray(_ray_job, 2, backend="nccl", resources_per_worker={"CPU": 0.5}, args=("ok",))
    assert time.monotonic() - t0 < 5
    for kwargs in (dict(timeout=0), dict(startup_timeout=-1), dict(timeout="5")):
        with pytest.raises(ValueError, match="must be a number of seconds > 0"):
            launch_on_ray(_ray_job, 2, **kwargs)


class _FakeRay:
    """Stands in for the `ray` module where launch_on_ray decides whether to connect and
    disconnect: records init/shutdown, answers is_initialized and cluster_resources."""

    def __init__(self, initialized: bool, cpus: float = 2.0, shutdown_error: Exception | None = None) -> None:
        self.initialized = initialized
        self.cpus = cpus
        self.shutdown_error = shutdown_error
        self.calls: list[str] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs) -> None:
        self.calls.append("init")
        self.init_kwargs = kwargs
        self.initialized = True

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.initialized = False
        if self.shutdown_error is not None:
            raise self.shutdown_error

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": self.cpus}


@pytest.mark.parametrize("outcome", ["returns", "raises", "refused", "interrupted"])
@pytest.mark.parametrize("connected_before", [False, True])
def test_launch_on_ray_shuts_down_only_the_ray_it_started(monkeypatch, outcome, connected_before):
    # launch_on_ray called ray.init when no Ray was running and left it running after the job
    # (a local cluster of raylet, GCS and workers kept going in the caller's process tree).
    from launch import ray_launcher

    fake = _FakeRay(initialized=connected_before, cpus=0.5 if outcome == "refused" else 2.0)
    monkeypatch.setattr(ray_launcher, "_require_ray", lambda: fake)

    def run_on_actors(ray, fn, num_workers, **kwargs):
        assert ray is fake and ray.initialized  # the job runs connected
        if outcome == "raises":
            raise RankError("rank 1 failed while running fn", rank=1)
        if outcome == "interrupted":
            raise KeyboardInterrupt
        return [fn(rank) for rank in range(num_workers)]

    monkeypatch.setattr(ray_launcher, "_run_on_actors", run_on_actors)
    expected = {"returns": None, "raises": RankError, "refused": ValueError, "interrupted": KeyboardInterrupt}[outcome]
    if expected is None:
        assert ray_launcher.launch_on_ray(lambda rank: rank * 10, 2) == [0, 10]
    else:
        with pytest.raises(expected):
            ray_launcher.launch_on_ray(lambda rank: rank * 10, 2)
    if connected_before:  # the caller's connection (or cluster) is the caller's to end
        assert fake.calls == [] and fake.initialized
    else:
        assert fake.calls == ["init", "shutdown"] and not fake.initialized


def test_launch_on_ray_a_failing_shutdown_does_not_mask_the_jobs_error(monkeypatch):
    from launch import ray_launcher

    fake = _FakeRay(initialized=False, shutdown_error=RuntimeError("shutdown broke"))
    monkeypatch.setattr(ray_launcher, "_require_ray", lambda: fake)

    def failing_job(ray, fn, num_workers, **kwargs):
        raise RankError("rank 0 failed while running fn", rank=0)

    monkeypatch.setattr(ray_launcher, "_run_on_actors", failing_job)
    with pytest.raises(RankError, match="rank 0 failed") as err:
        ray_launcher.launch_on_ray(lambda rank: rank, 2)
    assert fake.calls == ["init", "shutdown"]
    assert any("shutdown broke" in note for note in getattr(err.value, "__notes__", [])) or sys.version_info < (3, 11)
    # after a job that succeeded, the shutdown's own error is the caller's to see
    monkeypatch.setattr(ray_launcher, "_run_on_actors", lambda ray, fn, n, **kwargs: [0, 1])
    fake.calls.clear()
    with pytest.raises(RuntimeError, match="shutdown broke"):
        ray_launcher.launch_on_ray(lambda rank: rank, 2)


_RAY_OWNER_SCRIPT = """
import json, sys
import ray
from launch import RankError, launch_on_ray

def job(rank, fail):
    if fail and rank == 0:
        raise ValueError("rank zero refuses")
    return rank + 1

sessions = []
real_init = ray.init
def init(*args, **kwargs):
    context = real_init(*args, **kwargs)
    sessions.append(context.address_info["session_dir"])
    return context
ray.init = init
kw = dict(resources_per_worker={"CPU": 0.5}, timeout=120, ray_init_kwargs={"num_cpus": 1})
out = {"result": launch_on_ray(job, 1, args=(False,), **kw), "after_ok": ray.is_initialized()}
try:
    launch_on_ray(job, 1, args=(True,), **kw)
except RankError as e:
    out["error"] = "rank zero refuses" in str(e)
out["after_error"] = ray.is_initialized()
out["sessions"] = sessions
print("RESULT " + json.dumps(out))
"""


@pytest.mark.xdist_group("ray")
def test_launch_on_ray_stops_the_cluster_it_started_after_success_and_failure(tmp_path):
    # The one real-cluster check of the ownership rule (Ray starts slowly on 2 cores): in a fresh
    # process, so that no cluster of this test process (the module fixture) is in the way.
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-c", _RAY_OWNER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    import json

    out = json.loads(line[len("RESULT "):])
    assert out["result"] == [1] and out["error"] is True
    assert out["after_ok"] is False and out["after_error"] is False  # each call shut its cluster down
    assert len(out["sessions"]) == 2
    # and no process of those clusters (raylet, GCS, workers) outlives them
    deadline = time.monotonic() + 20
    left = []
    while time.monotonic() < deadline:
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        left = [x for x in ps.splitlines() if any(os.path.basename(s) in x for s in out["sessions"])]
        if not left:
            break
        time.sleep(0.5)
    assert left == []


def test_launch_on_ray_init_kwargs_may_override_its_defaults(monkeypatch):
    # ray_init_kwargs={"include_dashboard": True} raised TypeError (the keyword given twice)
    from launch import ray_launcher

    fake = _FakeRay(initialized=False)
    monkeypatch.setattr(ray_launcher, "_require_ray", lambda: fake)
    monkeypatch.setattr(ray_launcher, "_run_on_actors", lambda ray, fn, n, **kwargs: [fn(r) for r in range(n)])
    assert ray_launcher.launch_on_ray(lambda rank: rank, 2, address="auto",
                                      ray_init_kwargs={"include_dashboard": True, "num_cpus": 2}) == [0, 1]
    assert fake.init_kwargs == {"address": "auto", "include_dashboard": True, "log_to_driver": True, "num_cpus": 2}
    ray_launcher.launch_on_ray(lambda rank: rank, 2)
    assert fake.init_kwargs == {"address": None, "include_dashboard": False, "log_to_driver": True}
