"""One logger root, "megapar", and its rank prefix.

Every module logs through `get_logger(__name__)`, a child of "megapar", so one handler on the
root sees everything. `setup_logging(rank)` (called once per process by the launchers'
`init_from_env`; idempotent) gives that root a handler whose `RankFilter` prefixes every line
with `[rank N]`; without it the records propagate to whatever the application configured.
"""

from __future__ import annotations

import logging
import os

ROOT = "megapar"


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` under the "megapar" root ("megapar.parallel.groups", ...)."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def current_rank() -> int:
    """This process's global rank: torch.distributed's when initialized, else $RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankFilter(logging.Filter):
    """Sets `record.rank` (the given rank, or the current one at each record)."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank if self.rank is not None else current_rank()
        return True


def setup_logging(rank: int | None = None, level: int | str = "INFO") -> logging.Logger:
    """Give the "megapar" root one stream handler printing `[rank N] LEVEL name: message` (once
    per process; MEGAPAR_LOG_LEVEL overrides `level`). Returns the root logger."""
    logger = logging.getLogger(ROOT)
    if not any(getattr(h, "_megapar", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._megapar = True  # type: ignore[attr-defined]
        handler.addFilter(RankFilter(rank))
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("MEGAPAR_LOG_LEVEL", level))
    return logger
