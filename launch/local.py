"""launch_local: run `fn(rank, *args)` in `world_size` real processes with a torchrun environment.

Used by every multi-rank test and by `megapar demo`. Fail fast: when one rank raises or dies,
the others are stopped within seconds and the parent raises `RankError` naming the rank with
its traceback; a global timeout turns a hang into an error; no process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable


class RankError(RuntimeError):
    """A rank raised, died, or hung. `rank` is the first failing rank (None for a timeout)."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int, port: int, *, local_world_size: int | None = None,
                 addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun sets for one rank on a single node."""
    lws = local_world_size or world_size
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % lws),
            "LOCAL_WORLD_SIZE": str(lws), "GROUP_RANK": str(rank // lws), "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}


def _worker(fn: Callable[..., Any], rank: int, args: tuple, env: dict[str, str], results: "mp.Queue") -> None:
    os.environ.update(env)
    import torch

    # Ranks share the cores: intra-op threads beyond a fair share make gloo transfers crawl.
    world = int(env.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        value = fn(rank, *args)
        # Plain pickle: multiprocessing's pickler would pass tensors as shared-memory handles
        # that die with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # report everything, including SystemExit
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            from parallel.groups import destroy_parallel

            destroy_parallel()
        except Exception:
            pass
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
              "ECONNRESET", "Socket Timeout", "Timed out waiting")


def _root_cause(procs: list, results: "mp.Queue", done: dict, rank: int, text: str) -> RankError:
    """The error to report once some rank failed: a rank that died silently, else the first
    error that is not a peer-disconnect consequence, else the first error seen."""
    errors = [(rank, text)]
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            r, status, value = results.get(timeout=0.1)
            if status == "error":
                errors.append((r, value))
            else:
                done[r] = None
        except queue.Empty:
            pass
    reported = {r for r, _ in errors} | set(done)
    for r, p in enumerate(procs):
        if r not in reported and not p.is_alive() and p.exitcode not in (0, None):
            return RankError(f"rank {r} exited with code {p.exitcode} before returning a result", rank=r)
    r, t = pick_primary(errors)
    return RankError(f"rank {r} failed:\n{t}", rank=r, remote_traceback=t)


def pick_primary(errors: list[tuple[int, str]]) -> tuple[int, str]:
    """Of several ranks' errors, the first that is not a peer-disconnect consequence."""
    primary = [(r, t) for r, t in errors if not any(s in t for s in _SECONDARY)]
    return (primary or errors)[0]


def launch_local(fn: Callable[..., Any], world_size: int, *, backend: str = "gloo", args: tuple = (),
                 timeout: float = 120.0, env: dict[str, str] | None = None) -> list[Any]:
    """Spawn `world_size` processes, call `fn(rank, *args)` in each, return results by rank.

    fn: a module-level (picklable) function. backend: exported as MEGAPAR_BACKEND for
    `init_parallel`. env: extra environment for every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = torchrun_env(rank, world_size, port)
        rank_env["MEGAPAR_BACKEND"] = backend
        rank_env.update(env or {})
        p = ctx.Process(target=_worker, args=(fn, rank, args, rank_env, results), daemon=True,
                        name=f"megapar-rank{rank}")
        p.start()
        procs.append(p)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and not p.is_alive():
                        # It may have put its result just before exiting: drain once more.
                        try:
                            rank, status, value = results.get(timeout=0.5)
                            break
                        except queue.Empty:
                            raise RankError(f"rank {r} exited with code {p.exitcode} before returning a result",
                                            rank=r) from None
                else:
                    if time.monotonic() > deadline:
                        missing = [r for r in range(world_size) if r not in out]
                        raise RankError(f"timed out after {timeout:.0f}s waiting for ranks {missing}")
                    continue
            if status == "error":
                raise _root_cause(procs, results, out, rank, value)
            out[rank] = pickle.loads(value)
    finally:
        _stop(procs)
        results.close()
    return [out[r] for r in range(world_size)]
