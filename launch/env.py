"""init_from_env: a torchrun (or Slurm-like) environment -> `init_parallel`, device, rank logging.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Under
Slurm without torchrun, SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS are mapped onto them
(MASTER_ADDR/PORT must still be exported by the job script).
"""

from __future__ import annotations

import logging
import os

import torch

from parallel import ParallelConfig, ParallelGroups, init_parallel

_SLURM = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS"}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_rank_logging(rank: int, level: int | str = "INFO") -> None:
    """Prefix every megapar log line with `[rank N]`."""
    logger = logging.getLogger("megapar")
    if any(getattr(h, "_megapar", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler._megapar = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("MEGAPAR_LOG_LEVEL", level))
    logger.propagate = False


def init_from_env(config: ParallelConfig | None = None, *, backend: str | None = None, **sizes: int
                  ) -> ParallelGroups:
    """Initialize from the launcher's environment.

    config: the layout; or pass sizes (tp=2, pcp=2, ...) and the world size comes from the
    environment. Sets the CUDA device from LOCAL_RANK when CUDA is present.
    """
    for var, slurm in _SLURM.items():
        if var not in os.environ and slurm in os.environ:
            os.environ[var] = os.environ[slurm]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if config is None:
        config = ParallelConfig(world_size=world, **sizes)
    elif sizes:
        raise ValueError(f"give either config or sizes, not both (sizes: {sizes})")
    setup_rank_logging(rank)
    if torch.cuda.is_available() and (backend in (None, "nccl")):
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local % torch.cuda.device_count())
    return init_parallel(config, backend=backend)
