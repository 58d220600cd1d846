"""The rendezvous port of launch_local / launch_on_ray cannot be taken by another process between
being chosen and being used: the launcher (or, on Ray, rank 0's actor) binds the rendezvous store
on port 0 itself and holds it for the whole job; the ranks join it as clients.

Before, `free_port()` bound a socket to port 0, closed it and handed the number to the ranks;
rank 0's store bound it seconds later. A process that took the port in between made rank 0 fail
with EADDRINUSE (and the other ranks dialed the stranger). The race is made deterministic here:
every port that `free_port()` picks is taken by a listener at once."""

from __future__ import annotations

import datetime
import os
import socket
import sys

import pytest
import torch

import launch.local as local
from launch.local import launch_local


def _port_job(rank: int) -> tuple[float, int]:
    """A tiny gloo job: init_parallel, one all_reduce; returns the sum and the port the ranks met at."""
    import torch.distributed as dist

    from parallel import ParallelConfig, init_parallel

    init_parallel(ParallelConfig(world_size=int(os.environ["WORLD_SIZE"])))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), int(os.environ["MASTER_PORT"])


@pytest.fixture
def stranger(monkeypatch):
    """Every port `free_port()` returns is listened on, at once, by a socket of this process (a
    stranger to the job): the race, lost every time."""
    taken: dict[int, socket.socket] = {}
    real = local.free_port

    def free_port_then_taken() -> int:
        port = real()
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("", port))
        s.listen()
        taken[port] = s
        return port

    monkeypatch.setattr(local, "free_port", free_port_then_taken)
    yield taken
    for s in taken.values():
        s.close()


def test_launch_local_rendezvous_survives_a_port_taken_after_it_was_chosen(stranger):
    # old code: rank 0 failed with "address already in use" on the port free_port() had chosen
    results = launch_local(_port_job, 2, timeout=60)
    assert [r[0] for r in results] == [3.0, 3.0]
    ports = {r[1] for r in results}
    assert len(ports) == 1 and not ports & set(stranger)     # the ranks met at the job's own port
    for s in stranger.values():                                # and never dialed a stranger
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.accept()


def test_launch_local_a_master_port_given_in_env_is_used_as_before():
    # the caller's own MASTER_PORT: rank 0 hosts the store there (torch's default), as before
    port = local.free_port()
    assert launch_local(_port_job, 2, env={"MASTER_PORT": str(port)}, timeout=60) == [(3.0, port)] * 2


@pytest.mark.xdist_group("ray")
def test_ray_rank0_actor_hosts_the_store_on_a_port_it_holds():
    # launch_on_ray asked rank 0's actor for free_port() and let rank 0 bind it later (the same
    # race, on rank 0's node); the actor now hosts the store itself, bound on port 0, until it dies
    pytest.importorskip("ray")
    from launch.ray_launcher import _RankWorker

    worker = _RankWorker()
    port = worker.host_store()
    assert 1 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(OSError):
            s.bind(("", port))                  # held: nobody else can take it
    client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False,
                                        timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert worker.host_store() == port          # one store per actor, asked twice
    assert client.get("k") == b"v"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
