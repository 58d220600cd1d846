"""Process-group manager: one torch.distributed group per axis of the rank layout.

`init_parallel(cfg)` initializes torch.distributed from the torchrun environment
(`read_launch_env`, the one reader of it, Slurm included) when it is not yet initialized (and reuses it when it is), then creates every group of every axis with
an explicit timeout and a description, in the same order on every rank, followed by one
small all-reduce per group so that a bad layout fails at start rather than at the first
collective. Axes with identical rank lists share one communicator.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import ParallelConfig
from .layout import AXES, group_of, rank_groups, rank_grid
from .log import get_logger

log = get_logger(__name__)

_SLURM = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS"}


def _env_timeout(default: float = 300.0) -> _dt.timedelta:
    """MEGAPAR_PG_TIMEOUT seconds (> 0; inf for none), else `default`. Anything else raises,
    naming it: 0 or a negative value made every rendezvous and collective time out at once
    ("timed out after 0ms"), a word failed the import with float()'s message."""
    raw = os.environ.get("MEGAPAR_PG_TIMEOUT")
    if raw is None:
        return _dt.timedelta(seconds=default)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"environment variable MEGAPAR_PG_TIMEOUT={raw!r} must be a number of seconds > 0 "
                         f"('inf' for none; unset: {default:g})")
    return _dt.timedelta(seconds=min(seconds, 1e9))  # inf: ~30 years (torch counts ms in int64)


DEFAULT_TIMEOUT = _env_timeout()


@dataclass(frozen=True)
class Group:
    """One axis as seen from this rank."""

    name: str
    group: dist.ProcessGroup | None
    """The communicator; None only when torch.distributed is not initialized (1 rank)."""
    rank: int
    """This rank's index inside the group."""
    size: int
    ranks: tuple[int, ...]
    """Global ranks of the group, in group-rank order."""

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank}/{self.size}, ranks={list(self.ranks)})"


@dataclass
class ParallelGroups:
    """Every axis of the job, seen from this rank. Usable as a context manager."""

    config: ParallelConfig
    rank: int
    world: Group
    tp: Group
    dcp: Group
    pcp: Group
    pp: Group
    dp: Group
    ep: Group
    edp: Group
    backend: str
    timeout: _dt.timedelta = DEFAULT_TIMEOUT
    """The collective timeout every group was created with (also taken by groups made later,
    such as the EP communication thread's: `group_timeout()`). Where torch.distributed is the
    caller's and `init_parallel` got no timeout, the axes over every rank are its WORLD, with the
    caller's timeout."""
    _mesh: object | None = field(default=None, repr=False)
    _created: list = field(default_factory=list, repr=False)
    """The communicators `init_parallel` created that hold this rank (not WORLD): destroyed by
    `destroy_parallel` even when torch.distributed itself was the caller's and stays up."""

    def axis(self, name: str) -> Group:
        if name not in AXES and name != "world":
            raise ValueError(f"unknown axis {name!r}; valid: world, {', '.join(AXES)}")
        return getattr(self, name)

    def device_mesh(self):
        """A DeviceMesh over the same ranks with dims (dp, pp, pcp, tp) (ext_dp folded into dp), its
        groups made with this job's collective timeout (`timeout`), as every megapar group."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            cfg = self.config
            mesh = rank_grid(cfg).reshape(cfg.ext_dp * cfg.dp, cfg.pp, cfg.pcp, cfg.tp)
            device_type = "cuda" if self.backend == "nccl" else "cpu"
            options = dist.ProcessGroupNCCL.Options() if self.backend == "nccl" else dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            self._mesh = DeviceMesh(device_type, mesh, mesh_dim_names=("dp", "pp", "pcp", "tp"),
                                    backend_override=((self.backend, options),) * 4)
        return self._mesh

    def destroy(self) -> None:
        destroy_parallel()

    def __enter__(self) -> "ParallelGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


_GROUPS: ParallelGroups | None = None
_OWNS_DIST = False
_GENERATION = 0
"""How many times `init_parallel` started torch.distributed in this process: the key prefix of
that generation in the rendezvous store (every rank counts the same)."""


def get_groups() -> ParallelGroups:
    """The groups made by `init_parallel`; raises when there are none."""
    if _GROUPS is None:
        raise RuntimeError("megapar parallel groups are not initialized; call parallel.init_parallel() first")
    return _GROUPS


def get_optional_groups() -> ParallelGroups | None:
    return _GROUPS


def group_timeout() -> _dt.timedelta:
    """The timeout for a process group created now: `init_parallel`'s, else the default
    (MEGAPAR_PG_TIMEOUT seconds, 300 unless set)."""
    return _GROUPS.timeout if _GROUPS is not None else DEFAULT_TIMEOUT


def _positive_seconds(value: object) -> float | None:
    """Seconds of a timedelta or of a number > 0 (inf allowed) as a float; None for anything else
    (0, negative, NaN, a string, a bool, None)."""
    seconds = value.total_seconds() if isinstance(value, _dt.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds <= 0:
        return None
    return float(seconds)


def check_timeout(timeout: object, name: str = "timeout") -> _dt.timedelta:
    """None -> DEFAULT_TIMEOUT; a timedelta or a number of seconds > 0 -> a timedelta; anything
    else (0, negative, NaN, a string, a bool) raises ValueError naming the value."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    seconds = _positive_seconds(timeout)
    if seconds is None:
        raise ValueError(f"{name} must be a datetime.timedelta or a number of seconds > 0 (None = the default, "
                         f"{DEFAULT_TIMEOUT.total_seconds():g} s), got {timeout!r}")
    if isinstance(timeout, _dt.timedelta):
        return timeout
    return _dt.timedelta(seconds=min(seconds, 1e9))  # inf: ~30 years (torch counts ms in int64)


def timeout_seconds(value: object, name: str = "timeout") -> float:
    """A launcher's timeout: seconds as a float from a number > 0 or a timedelta (float('inf') =
    none; None is refused), else ValueError naming the value."""
    seconds = _positive_seconds(value)
    if seconds is None:
        shown = value.total_seconds() if isinstance(value, _dt.timedelta) else value
        raise ValueError(f"{name} must be a number of seconds > 0 (float('inf') for none), got {shown!r}")
    return seconds


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher's environment says."""

    rank: int
    world_size: int
    local_rank: int | None
    """rank on this node (LOCAL_RANK); None when the launcher did not say"""


def read_launch_env() -> LaunchEnv:
    """RANK / WORLD_SIZE / LOCAL_RANK as torchrun sets them (default: one process). Under Slurm
    without torchrun, SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID are copied onto those names
    first (into os.environ: torch.distributed's env:// reads them; MASTER_ADDR/PORT must still be
    exported by the job script)."""
    for var, slurm in _SLURM.items():
        if var not in os.environ and slurm in os.environ:
            os.environ[var] = os.environ[slurm]
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = os.environ.get(name)
        try:
            values[name] = None if raw is None else int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    return LaunchEnv(rank=values["RANK"] or 0, world_size=1 if values["WORLD_SIZE"] is None else values["WORLD_SIZE"],
                     local_rank=values["LOCAL_RANK"])


def check_rank_env(env: LaunchEnv) -> None:
    """Refuse a launcher environment that cannot name one rank of a job (WORLD_SIZE < 1, RANK unset
    in a job of several, RANK outside [0, WORLD_SIZE)) or its rendezvous (MASTER_ADDR unset or with
    whitespace around the host, MASTER_PORT unset or not a port in [1, 65535]), naming the values: such a rank would wait for a
    rendezvous that never completes (MASTER_PORT=0: rank 0 listened on a random port, the others
    dialed port 0 until the timeout) or fail with a message that does not say which variable."""
    if env.world_size < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {env.world_size}")
    if env.world_size > 1 and "RANK" not in os.environ:
        raise ValueError(f"WORLD_SIZE={env.world_size} but RANK is not set: every process would be rank 0 "
                         f"(set RANK, or SLURM_PROCID under Slurm)")
    if not 0 <= env.rank < env.world_size:
        raise ValueError(f"environment variable RANK={env.rank} must be in [0, WORLD_SIZE={env.world_size})")
    if env.world_size == 1:
        return   # one process: no rendezvous
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(f"WORLD_SIZE={env.world_size} but {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set: the ranks meet at MASTER_ADDR:MASTER_PORT "
                         f"(rank 0's host and a free port there; torchrun sets both, a Slurm job script exports them)")
    addr = os.environ["MASTER_ADDR"]
    if addr != addr.strip():    # (torch looked the host up as given: every rank retried it until the group timeout)
        raise ValueError(f"environment variable MASTER_ADDR={addr!r} has whitespace around the host name; "
                         f"no rank could reach the rendezvous at it (strip it in the job script)")
    raw = os.environ["MASTER_PORT"]
    try:
        port = int(raw)
    except ValueError:
        port = None
    if port is None or not 1 <= port <= 65535:
        raise ValueError(f"environment variable MASTER_PORT={raw!r} must be a port number in [1, 65535]")


def set_local_device(env: LaunchEnv) -> None:
    """Make this process's GPU (LOCAL_RANK, else the global rank, modulo the GPUs) the current one."""
    count = torch.cuda.device_count()
    if count:
        torch.cuda.set_device((env.rank if env.local_rank is None else env.local_rank) % count)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def resolve_backend(backend: str | None = None) -> str:
    """`backend`, else MEGAPAR_BACKEND, else `default_backend()`, as torch names it ("gloo" /
    "nccl", lower case); anything else raises ValueError naming where it came from. ("NCCL" was
    kept as given: the GPU of LOCAL_RANK was not selected and the start-up probe ran on a CPU
    tensor, both keyed on "nccl"; a typo failed only after the rendezvous.)"""
    if backend is not None:
        where, value = "backend", backend
    elif os.environ.get("MEGAPAR_BACKEND"):
        where, value = "environment variable MEGAPAR_BACKEND", os.environ["MEGAPAR_BACKEND"]
    else:
        return default_backend()
    name = value.lower() if isinstance(value, str) else value
    if name not in ("gloo", "nccl"):
        raise ValueError(f"{where} must be 'gloo' or 'nccl', got {value!r}")
    return name


def world_backend() -> str:
    """The backend of a torch.distributed the caller started, as "gloo" / "nccl" where that is what
    its collectives run on. `init_process_group()` without a backend reports "undefined" (torch
    picks one per tensor device at the first collective: nccl for CUDA tensors where it can, gloo
    for CPU ones) and a device map such as "cpu:gloo,cuda:nccl" names both; either was kept as
    given, so `backend == "nccl"` was false on a GPU job: the start-up probe, `device_mesh()` and
    the benchmarks chose the CPU. Any other name (mpi, ucc, ...) is kept."""
    name = str(dist.get_backend())
    if name in ("gloo", "nccl"):
        return name
    if name == "undefined":
        return default_backend()
    devices = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    if "cuda" in devices and torch.cuda.is_available():
        return devices["cuda"]
    return devices.get("cpu", name)


def _start_dist(backend: str, rank: int, world_size: int, timeout: _dt.timedelta) -> None:
    """`init_process_group` over the env:// rendezvous (MASTER_ADDR / MASTER_PORT, or torchrun's
    agent store), its keys under a prefix of this generation. Without one, starting again after
    `destroy_parallel()` hung: the rendezvous store is shared by every TCPStore of the process on
    that port (torch's multi-tenant store), and outlives `destroy_process_group` while anything
    holds a group of the old generation (the old ParallelGroups, a layer, a dispatcher) or is
    torchrun's agent store; the new generation then read the old one's keys."""
    global _GENERATION
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    _GENERATION += 1
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"megapar_{_GENERATION}/default_pg", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def _probe_device(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_parallel(cfg: ParallelConfig | None = None, *, backend: str | None = None,
                  timeout: _dt.timedelta | float | None = None) -> ParallelGroups:
    """Create (or reuse) torch.distributed and build every axis group.

    cfg: sizes; None reads WORLD_SIZE from the environment and uses dp only.
    backend: "nccl" / "gloo"; default nccl when CUDA is present, else gloo. When torch.distributed
    is the caller's, its backend is used; a different one given here is a ValueError.
    timeout: every collective's timeout, for every group made here and later (`group_timeout()`):
    a timedelta or seconds > 0; None = DEFAULT_TIMEOUT. When torch.distributed is the caller's,
    axes over every rank (and `world`) use its WORLD group, with the caller's timeout, unless a
    timeout is given here: then they get a group of all ranks made with it.
    """
    global _GROUPS, _OWNS_DIST
    if _GROUPS is not None:
        raise RuntimeError("init_parallel() was already called; call destroy_parallel() first")
    if cfg is not None and not isinstance(cfg, ParallelConfig):
        hint = " (pass ParallelConfig(**cfg))" if isinstance(cfg, dict) else ""
        raise ValueError(f"cfg must be a ParallelConfig or None, got {type(cfg).__name__} {cfg!r}{hint}")
    timeout_given = timeout is not None
    timeout = check_timeout(timeout)
    callers = dist.is_available() and dist.is_initialized()
    if callers:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        running = world_backend()
        if backend is not None and resolve_backend(backend) != running:  # it was ignored: gloo groups on nccl
            raise ValueError(f"backend={backend!r}, but the caller's torch.distributed already runs on "
                             f"{running!r} (dist.get_backend() = {str(dist.get_backend())!r}); leave backend "
                             f"unset to use it, or start torch.distributed with the backend wanted")
        backend = running
    else:
        env = read_launch_env()
        check_rank_env(env)
        world_size, rank = env.world_size, env.rank
        backend = resolve_backend(backend)
    if cfg is None:
        cfg = ParallelConfig(world_size=world_size)
    if cfg.world_size != world_size:
        raise ValueError(f"ParallelConfig.world_size ({cfg.world_size}) != the job's world size ({world_size})")
    layout = rank_groups(cfg)  # validated before anything is created

    if world_size > 1 and not dist.is_initialized():
        if backend == "nccl":
            set_local_device(env)
        _start_dist(backend, rank, world_size, timeout)
        _OWNS_DIST = True
        # A process that exits with live communicator threads can abort ("terminate called
        # without an active exception"): tear down at exit if the user did not.
        atexit.register(destroy_parallel, sync=True)

    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    everyone = tuple(range(world_size))
    if world_size > 1 and callers and timeout_given:
        # The caller's WORLD keeps the caller's timeout (torch's default: 30 min on gloo): an axis
        # over every rank (EP with tp = pp = pcp = 1) waited that long instead of `timeout`.
        made[everyone] = dist.new_group(list(everyone), timeout=timeout, group_desc="megapar_world")

    def make(axis: str) -> Group:
        mine = group_of(layout[axis], rank)
        for ranks in layout[axis]:  # every rank creates every group, in the same order
            key = tuple(ranks)
            if key in made:
                continue
            if world_size == 1:
                made[key] = None
            elif len(ranks) == world_size:
                made[key] = dist.group.WORLD
            else:
                # Rank lists are ascending (layout.py), so torch's sorted group order is ours.
                made[key] = dist.new_group(list(ranks), timeout=timeout, group_desc=f"megapar_{axis}")
        return Group(axis, made[tuple(mine)], mine.index(rank), len(mine), tuple(mine))

    groups = {axis: make(axis) for axis in AXES}
    world = Group("world", made.get(everyone, dist.group.WORLD) if world_size > 1 else None, rank, world_size,
                  everyone)
    if world_size > 1:
        probe = torch.ones(1, device=_probe_device(backend))
        for g in {id(x.group): x for x in groups.values() if x.size > 1}.values():
            dist.all_reduce(probe, group=g.group)
    created = list({id(x.group): x.group for x in (*groups.values(), world)
                    if x.group is not None and x.group is not dist.group.WORLD}.values())
    _GROUPS = ParallelGroups(config=cfg, rank=rank, world=world, backend=backend, timeout=timeout,
                             _created=created, **groups)
    log.debug("parallel groups ready: %s", cfg.sizes())
    return _GROUPS


def destroy_parallel(*, sync: bool = False) -> None:
    """Drop the groups; tear down torch.distributed if `init_parallel` created it.

    sync: first wait (at most 10 s, gloo) until every rank gets here; used at interpreter exit.
    Not after an error, where a peer stuck in a collective would make everyone wait.
    """
    global _GROUPS, _OWNS_DIST
    groups, _GROUPS = _GROUPS, None
    if not _OWNS_DIST and groups is not None and dist.is_initialized():
        # torch.distributed is the caller's and stays up: drop only what init_parallel (and
        # device_mesh) made, else every init/destroy cycle leaks its communicators.
        made = list(groups._created)
        if groups._mesh is not None:
            made += [groups._mesh.get_group(i) for i in range(groups._mesh.ndim)]
        seen: set[int] = set()
        for pg in made:
            if pg is None or pg is dist.group.WORLD or pg == dist.GroupMember.NON_GROUP_MEMBER or id(pg) in seen:
                continue
            seen.add(id(pg))
            try:
                dist.destroy_process_group(pg)
            except Exception:  # already destroyed by the caller
                pass
    if _OWNS_DIST and dist.is_initialized():
        # Leave together: a rank that tears down while a peer still talks to the store it hosts
        # (rank 0) can abort the peer. Bounded, so a dead peer cannot hang the exit.
        try:
            if sync and dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=_dt.timedelta(seconds=10))
        except Exception:
            pass
        dist.destroy_process_group()
    _OWNS_DIST = False
