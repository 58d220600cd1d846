"""init_from_env: a torchrun (or Slurm-like) environment -> `init_parallel`, device, rank logging.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Under
Slurm without torchrun, SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS are mapped onto them
(MASTER_ADDR/PORT must still be exported by the job script). The environment is read by
`parallel.groups.read_launch_env`, the same reader `init_parallel` uses.
"""

from __future__ import annotations

import torch

from megapar.parallel import ParallelConfig, ParallelGroups, init_parallel
from megapar.parallel.groups import read_launch_env, set_local_device
from megapar.parallel.log import setup_logging


def setup_rank_logging(rank: int, level: int | str = "INFO") -> None:
    """Prefix every megapar log line with `[rank N]` (`parallel.log.setup_logging`)."""
    setup_logging(rank, level)


def init_from_env(config: ParallelConfig | None = None, *, backend: str | None = None, **sizes: int
                  ) -> ParallelGroups:
    """Initialize from the launcher's environment.

    config: the layout; or pass sizes (tp=2, pcp=2, ...) and the world size comes from the
    environment. Sets the CUDA device from LOCAL_RANK when CUDA is present.
    """
    env = read_launch_env()
    if config is None:
        config = ParallelConfig(world_size=env.world_size, **sizes)
    elif sizes:
        raise ValueError(f"give either config or sizes, not both (sizes: {sizes})")
    setup_logging(env.rank)
    if torch.cuda.is_available() and (backend in (None, "nccl")):
        set_local_device(env)
    return init_parallel(config, backend=backend)
