"""init_from_env: a torchrun (or Slurm-like) environment -> `init_parallel`, device, rank logging.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Under
Slurm without torchrun, SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS are mapped onto them
(MASTER_ADDR/PORT must still be exported by the job script). The environment is read by
`parallel.groups.read_launch_env`, the same reader `init_parallel` uses.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megapar.parallel import ParallelConfig, ParallelGroups, init_parallel
from megapar.parallel.groups import (LaunchEnv, check_rank_env, read_launch_env, resolve_backend, set_local_device,
                                     world_backend)
from megapar.parallel.log import setup_logging


def setup_rank_logging(rank: int, level: int | str = "INFO") -> None:
    """Prefix every megapar log line with `[rank N]` (`parallel.log.setup_logging`)."""
    setup_logging(rank, level)


def check_launch_env(env: LaunchEnv, backend: str | None = None) -> None:
    """Refuse a launcher environment that cannot describe one rank of a job, naming the values
    (an out-of-range RANK made the rank wait for a rendezvous that never completes)."""
    started = dist.is_available() and dist.is_initialized()   # the caller's: init_parallel takes its rank
    if not started:
        check_rank_env(env)
    if env.local_rank is None:
        return
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        local_world = None if raw is None else int(raw)
    except ValueError:
        local_world = 0   # refused below, naming it (it was ignored, and LOCAL_RANK went unchecked)
    if local_world is not None and not 1 <= local_world <= env.world_size:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE={raw!r} must be an int in "
                         f"[1, WORLD_SIZE={env.world_size}] (the processes on this node)")
    if env.local_rank < 0 or (local_world is not None and env.local_rank >= local_world):
        bound = f"in [0, LOCAL_WORLD_SIZE={local_world})" if local_world is not None else ">= 0"
        raise ValueError(f"environment variable LOCAL_RANK={env.local_rank} must be {bound}")
    backend = world_backend() if started else resolve_backend(backend)   # ("undefined" -> what it runs on)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Every process sees every GPU (no CUDA_VISIBLE_DEVICES per process): LOCAL_RANK >= the count
    # would put this rank on another rank's GPU (LOCAL_RANK modulo the count), which NCCL refuses.
    if backend == "nccl" and count and env.local_rank >= count and "CUDA_VISIBLE_DEVICES" not in os.environ:
        raise ValueError(f"environment variable LOCAL_RANK={env.local_rank} but this node has {count} GPU(s): "
                         f"NCCL runs one rank per GPU; start at most {count} processes per node "
                         f"(torchrun --nproc-per-node {count}) or use backend='gloo'")


def init_from_env(config: ParallelConfig | None = None, *, backend: str | None = None,
                  timeout: float | None = None, **sizes: int) -> ParallelGroups:
    """Initialize from the launcher's environment.

    config: the layout; or pass sizes (tp=2, pcp=2, ...) and the world size comes from the
    environment. timeout: seconds, every collective's timeout (`init_parallel`'s). Sets the CUDA
    device from LOCAL_RANK when CUDA is present.
    """
    env = read_launch_env()
    if dist.is_available() and dist.is_initialized():
        # The caller's torch.distributed says where this process is (init_parallel uses it): the
        # environment may not (init_process_group(rank=..., init_method="tcp://...")), and its
        # RANK default of 0 put every rank's log under "[rank 0]" and, without LOCAL_RANK, every
        # rank on GPU 0; WORLD_SIZE's default of 1 made the layout of `sizes` a 1-process one.
        env = LaunchEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=env.local_rank)
    check_launch_env(env, backend)
    if config is None:
        config = ParallelConfig(world_size=env.world_size, **sizes)
    elif sizes:
        raise ValueError(f"give either config or sizes, not both (sizes: {sizes})")
    setup_logging(env.rank)
    if torch.cuda.is_available() and (backend in (None, "nccl")):
        set_local_device(env)
    return init_parallel(config, backend=backend, timeout=timeout)
