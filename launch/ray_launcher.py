"""launch_on_ray: one Ray actor per rank, torchrun variables on each, fail fast.

Reserve a placement group (one bundle per rank), start one actor per bundle, sort the actors
by (node, GPU), have rank 0's actor host the rendezvous store (bound on port 0, so the port is
held from the moment it is chosen; see `_RankWorker.host_store`), export the torchrun variables
on every actor (MASTER_ADDR = rank 0's node, MASTER_PORT = that store's port,
TORCHELASTIC_USE_AGENT_STORE=True so that every rank joins the store as a client), run
`init_parallel` on all at once (when a config is given), then `fn(rank, *args)`. Results come back by rank. The first exception or dead actor
kills every actor, removes the placement group and raises `RankError` with the rank and its
traceback; a startup timeout and a global timeout turn hangs into errors.

Ray itself: a process already connected (the caller ran `ray.init`) keeps its connection and
cluster. Otherwise `launch_on_ray` connects with `ray.init(address=...)` (which starts a local
cluster when there is none to join) and calls `ray.shutdown()` when the job ends, returned or
raised, so it leaves no cluster of its own behind and the process is as unconnected as before.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable, Literal

from megapar.parallel import ParallelConfig

from .local import (AGENT_STORE, RankError, check_timeout, check_world_size, export_rank_env, host_store,
                    pick_primary, torchrun_env)


def _require_ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("launch_on_ray needs Ray: pip install 'megapar[ray]' (or 'ray[default]')") from e
    return ray


def _gpu_key(gpu: str) -> tuple[int, int, str]:
    """Order GPU ids numerically where they are indices ("2" before "10"), else by name."""
    return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)


def _ray_seconds(seconds: float) -> float | None:
    """A timeout for ray.wait / ray.get: they count milliseconds in an int, and float('inf') (which
    check_timeout accepts as "no limit") raised OverflowError there; None is Ray's "no limit"."""
    return None if math.isinf(seconds) else seconds


class _RankWorker:
    """The body of one actor (wrapped by ray.remote at launch time)."""

    def node_info(self) -> tuple[str, str, list[str]]:
        import ray

        ctx = ray.get_runtime_context()
        # As Ray gives them: indices, or the entries of a CUDA_VISIBLE_DEVICES the node started
        # with, which may be GPU-/MIG- UUIDs (int() of those failed every GPU job there).
        gpus = sorted((str(g) for g in ray.get_gpu_ids()), key=_gpu_key) if hasattr(ray, "get_gpu_ids") else []
        return ctx.get_node_id(), ray.util.get_node_ip_address(), gpus

    def host_store(self) -> int:
        """Host the job's rendezvous store in this actor (rank 0's) and return its port. Bound on
        port 0 and kept by the actor until it is killed: a port chosen here and bound later by
        rank 0's init could be taken in between (EADDRINUSE, or the ranks met at a stranger's
        server). Asked again, it returns the same store's port."""
        if getattr(self, "_store", None) is None:
            self._store = host_store()
        return self._store.port

    def setup(self, env: dict[str, str]) -> None:
        export_rank_env(env)

    def run(self, fn: Callable[..., Any], rank: int, args: tuple, config: ParallelConfig | None,
            backend: str | None) -> Any:
        from megapar.parallel import destroy_parallel, init_parallel

        try:
            if config is not None:
                if backend == "nccl":
                    import torch

                    torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
                init_parallel(config, backend=backend)
            return fn(rank, *args)
        finally:
            destroy_parallel()

    def pid(self) -> int:
        return os.getpid()


def launch_on_ray(fn: Callable[..., Any], num_workers: int, *, parallel_config: ParallelConfig | None = None,
                  resources_per_worker: dict[str, float] | None = None,
                  placement: Literal["pack", "spread"] = "pack", args: tuple = (), backend: str | None = None,
                  timeout: float = 600.0, startup_timeout: float = 120.0, address: str | None = None,
                  ray_init_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """Run `fn(rank, *args)` on `num_workers` Ray actors; return the results by rank.

    parallel_config: when given, every actor runs `init_parallel(parallel_config)` before fn
    (its world_size must equal num_workers). resources_per_worker: the bundle of one rank,
    default {"CPU": 1} (add "GPU": 1 for one GPU per actor; backend then defaults to nccl;
    fractions such as {"CPU": 0.5} share a core). A job that the cluster's resources cannot hold
    is refused at once (ValueError saying what to pass) instead of waiting for startup_timeout.
    address / ray_init_kwargs: for `ray.init`, called only when this process is not connected to
    Ray yet; that connection (and the local cluster it started, if any) is shut down again when
    the job ends, whether it returned or raised. A connection made before the call is left open.
    """
    check_world_size(num_workers, "num_workers")
    timeout = check_timeout(timeout)
    startup_timeout = check_timeout(startup_timeout, "startup_timeout")
    if placement not in ("pack", "spread"):
        raise ValueError(f"placement must be 'pack' or 'spread', got {placement!r}")
    if parallel_config is not None and parallel_config.world_size != num_workers:
        raise ValueError(f"parallel_config.world_size ({parallel_config.world_size}) != num_workers ({num_workers})")
    ray = _require_ray()
    bundle = dict(resources_per_worker or {"CPU": 1})
    if backend is None:
        backend = "nccl" if bundle.get("GPU", 0) > 0 else "gloo"
    if backend not in ("gloo", "nccl"):   # else every actor started, then failed in init_parallel
        raise ValueError(f"backend must be 'gloo' or 'nccl' (None: nccl when resources_per_worker has a GPU), "
                         f"got {backend!r}")
    if backend == "nccl" and not bundle.get("GPU", 0) >= 1:
        raise ValueError(f"backend='nccl' runs one rank per GPU: resources_per_worker needs 'GPU': 1, got {bundle} "
                         f"(or pass backend='gloo')")
    owns_ray = not ray.is_initialized()   # then this call connects, and must disconnect again
    try:
        if owns_ray:
            ray.init(address=address, **{"include_dashboard": False, "log_to_driver": True, **(ray_init_kwargs or {})})
        check_resources(ray.cluster_resources(), bundle, num_workers)
        results = _run_on_actors(ray, fn, num_workers, bundle=bundle, placement=placement, args=args,
                                 parallel_config=parallel_config, backend=backend, timeout=timeout,
                                 startup_timeout=startup_timeout)
    except BaseException as job_error:
        if owns_ray:
            try:
                ray.shutdown()
            except Exception as e:   # noqa: BLE001 - the job's error is the one to report
                if hasattr(job_error, "add_note"):   # Python >= 3.11
                    job_error.add_note(f"launch_on_ray: ray.shutdown() after this error raised "
                                       f"{type(e).__name__}: {e}")
        raise
    if owns_ray:
        ray.shutdown()
    return results


def _run_on_actors(ray, fn: Callable[..., Any], num_workers: int, *, bundle: dict[str, float],
                   placement: Literal["pack", "spread"], args: tuple, parallel_config: ParallelConfig | None,
                   backend: str, timeout: float, startup_timeout: float) -> list[Any]:
    """The job on a connected Ray: placement group, actors, rendezvous, fn; results by rank.
    Kills its actors and removes its placement group however it ends."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([bundle] * num_workers, strategy=placement.upper())
    actors: list = []
    try:
        ready, _ = ray.wait([pg.ready()], timeout=min(5.0, startup_timeout))
        if not ready and startup_timeout > 5.0:
            print(f"launch_on_ray: waiting up to {startup_timeout:.0f}s for Ray to reserve {num_workers} x {bundle} "
                  f"(available now: {ray.available_resources()})", file=sys.stderr, flush=True)
            ready, _ = ray.wait([pg.ready()], timeout=_ray_seconds(startup_timeout - 5.0))
        if not ready:
            raise RankError(f"Ray could not reserve {num_workers} x {bundle} within {startup_timeout:.0f}s "
                            f"(cluster resources: {ray.cluster_resources()})")
        pythonpath = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        worker_cls = ray.remote(_RankWorker)
        for i in range(num_workers):
            actors.append(worker_cls.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, max_restarts=0,
            ).remote())
        infos = _get_all(ray, [a.node_info.remote() for a in actors], startup_timeout, "starting actors")
        order = sorted(range(num_workers), key=lambda i: (infos[i][0], [_gpu_key(g) for g in infos[i][2]], i))
        actors = [actors[i] for i in order]
        infos = [infos[i] for i in order]
        master_addr = infos[0][1]
        port = _get_all(ray, [actors[0].host_store.remote()], startup_timeout, "starting the rendezvous store")[0]
        node_ranks: dict[str, list[int]] = {}
        for rank, (node, _, _) in enumerate(infos):
            node_ranks.setdefault(node, []).append(rank)
        setups = []
        for rank, actor in enumerate(actors):
            node = infos[rank][0]
            env = torchrun_env(rank, num_workers, port, addr=master_addr, local_world_size=len(node_ranks[node]))
            env["LOCAL_RANK"] = str(node_ranks[node].index(rank))
            env["GROUP_RANK"] = str(list(node_ranks).index(node))
            env["MEGAPAR_BACKEND"] = backend
            env[AGENT_STORE] = "True"   # rank 0's actor hosts the store: no rank binds the port again
            setups.append(actor.setup.remote(env))
        _get_all(ray, setups, startup_timeout, "exporting the torchrun environment")
        refs = [a.run.remote(fn, rank, args, parallel_config, backend) for rank, a in enumerate(actors)]
        return _get_all(ray, refs, timeout, "running fn")
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(pg)
        except Exception:
            pass


def check_resources(cluster: dict[str, float], bundle: dict[str, float], num_workers: int) -> None:
    """Refuse a job larger than the whole cluster, saying what would fit."""
    short = {k: (v * num_workers, cluster.get(k, 0.0)) for k, v in bundle.items() if v * num_workers > cluster.get(k, 0.0)}
    if not short:
        return
    need = ", ".join(f"{k}: {n:g} needed, {h:g} in the cluster" for k, (n, h) in short.items())
    missing = [k for k, (_, h) in short.items() if h == 0]
    if missing:
        hint = f"the cluster has no {', '.join(missing)}: drop it from resources_per_worker or use a cluster that has it"
    elif "GPU" in short:    # one GPU per rank: fewer workers, not fractions
        hint = f"use at most {int(short['GPU'][1] // bundle['GPU'])} workers (one GPU each)"
    else:
        fit = {k: (v if k not in short else int(h / num_workers * 100) / 100)
               for k, v, h in ((k, v, short.get(k, (0, 0))[1]) for k, v in bundle.items())}
        hint = (f"pass resources_per_worker={fit} (fractions share a core), or start Ray with more "
                f"(ray.init(num_cpus=...))")
    raise ValueError(f"launch_on_ray: {num_workers} workers x resources_per_worker={bundle} do not fit in this Ray "
                     f"cluster ({need}; cluster resources: {cluster}): {hint}")


def _get_all(ray, refs: list, timeout: float, what: str) -> list[Any]:
    """Results by position; the first failure (in completion order) raises RankError."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(index[r] for r in pending)
            raise RankError(f"timed out after {timeout:.0f}s {what}; ranks still running: {missing}")
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
        failures: list[tuple[int, str, bool]] = []   # (rank, text, actor died)
        for ref in done:
            _collect(ray, ref, index[ref], results, failures)
        if failures:
            # Peers of a failed rank fail too (broken connections): give them a moment, then
            # report a dead actor first, else the first error that is not such a consequence.
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in more:
                _collect(ray, ref, index[ref], results, failures)
            died = [(r, t) for r, t, dead in failures if dead]
            if died:
                r, t = died[0]
                raise RankError(f"rank {r}: its actor died while {what}: {t}", rank=r)
            r, t = pick_primary([(r, t) for r, t, _ in failures])
            raise RankError(f"rank {r} failed while {what}:\n{t}", rank=r, remote_traceback=t)
    return [results[i] for i in range(len(refs))]


def _collect(ray, ref, rank: int, results: dict[int, Any], failures: list[tuple[int, str, bool]]) -> None:
    try:
        results[rank] = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        failures.append((rank, str(e), True))
    except ray.exceptions.RayTaskError as e:
        failures.append((rank, str(e), False))
    except Exception as e:  # noqa: BLE001 - e.g. RaySystemError: the result does not deserialize here
        # (it escaped launch_on_ray as Ray's own error, naming no rank)
        failures.append((rank, f"its result could not be received by the caller: {type(e).__name__}: {e}", False))
