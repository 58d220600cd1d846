"""launch_local: run `fn(rank, *args)` in `world_size` real processes with a torchrun environment.

Used by every multi-rank test and by `megapar demo`. Fail fast and name the root cause:

- a rank that raises: the parent raises `RankError` naming it, with its traceback (peers that
  fail only because it left, with "connection closed" errors, are not blamed);
- a rank that exits without returning a result (any exit code, 0 included, or a signal): the
  rank that exited first is named;
- a hang: at the global timeout every rank dumps its Python stack (`faulthandler`), and the
  ranks that never reached the collective the others wait in are named, with their stacks.

Ranks die with their parent (Linux `PR_SET_PDEATHSIG`, else a watchdog thread): killing the
process that called `launch_local`, even with SIGKILL, leaves no rank behind.

The rendezvous store is hosted by the launching process, not by rank 0: it binds a TCPStore on
port 0 (the OS picks a free port and the store holds it from that moment), exports that port as
MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True (as torchrun does for its workers), and every
rank, rank 0 included, joins the store as a client. A port chosen first and bound later by rank 0
could be taken in between by another process: rank 0 then failed with EADDRINUSE, or the ranks
met at a stranger's server.
"""

from __future__ import annotations

import ast
import faulthandler
import functools
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable


class RankError(RuntimeError):
    """A rank raised, died, or hung. `rank` is the root-cause rank (None when it is unknown);
    `stacks` holds each rank's Python stack when a timeout dumped them."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None,
                 stacks: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.stacks = stacks or {}


def free_port() -> int:
    """A port that no IPv4 socket of this host is bound to, at any address, when this returns: a
    store listens on 0.0.0.0. (Asking on 127.0.0.1 alone could give a port that a server holds on
    another address, e.g. the host's own IP, and rank 0 failed with EADDRINUSE.)

    Nothing holds the port afterwards: another process may take it before it is used. For a
    `torchrun --master-port` of a script where the port must be named; on one node `torchrun
    --standalone` has no such race (its store binds port 0 and keeps it), and the launchers here
    do not use it either: they bind their store on port 0 and keep it (`host_store`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def host_store(addr: str = "127.0.0.1") -> Any:
    """A TCPStore server of this process on a port the OS picks (port 0), listening on every
    address of the host; `.port` is the port, held until the store is garbage collected. Ranks
    that get MASTER_PORT=<.port> and TORCHELASTIC_USE_AGENT_STORE=True join it as clients
    (torch.distributed's env:// and tcp:// rendezvous then host no store of their own), so no
    other process can take the port between choosing and using it. `addr` is where this
    process's own client of the store connects."""
    import torch.distributed as dist

    return dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False)


def torchrun_env(rank: int, world_size: int, port: int, *, local_world_size: int | None = None,
                 addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun sets for one rank on a single node."""
    lws = local_world_size or world_size
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % lws),
            "LOCAL_WORLD_SIZE": str(lws), "GROUP_RANK": str(rank // lws), "MASTER_ADDR": addr,
            "MASTER_PORT": str(port)}


def export_rank_env(env: dict[str, str]) -> None:
    """Make `env` (torchrun_env's variables) this process's launch environment. TORCHELASTIC_*
    variables inherited from a torchrun job that started the launching process describe that
    job, not this one, and are dropped: with an inherited TORCHELASTIC_USE_AGENT_STORE=True
    every rank of the new job connected as a client to a store that nobody hosted for it, and
    init_process_group waited out its timeout. Variables in `env` itself are kept (the launchers
    put the flag there when they host the job's store themselves)."""
    for name in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[name]
    os.environ.update(env)


# ---------------------------------------------------------------------------------------------
# argument checks (shared with the Ray launcher)


def check_timeout(value: Any, name: str = "timeout") -> float:
    """Seconds as a float; a positive number (or timedelta), else ValueError naming the value
    (`parallel.groups.timeout_seconds`, imported here so that importing launch needs no torch)."""
    from megapar.parallel.groups import timeout_seconds

    return timeout_seconds(value, name)


def check_world_size(value: Any, name: str = "world_size") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


_HOW = ("fn must be a module-level function of an importable module: every rank is a new Python "
        "process that imports fn by name. Define it with `def` at the top level of a .py file and pass it by name")


def check_entry(fn: Any, who: str = "launch_local") -> None:
    """Refuse, before any process starts, an fn that the spawned ranks could not import."""
    if not callable(fn):
        raise ValueError(f"{who}: fn must be a function, got {fn!r}")
    target = fn.func if isinstance(fn, functools.partial) else fn
    qual = getattr(target, "__qualname__", None) or repr(target)
    if "<lambda>" in qual:
        raise ValueError(f"{who}: fn is a lambda ({qual}). {_HOW}.")
    if "<locals>" in qual:
        raise ValueError(f"{who}: fn ({qual}) is defined inside a function. {_HOW}.")
    main = sys.modules.get("__main__")
    if getattr(target, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"{who}: fn ({qual}) is defined in the __main__ of `python -c` or an interactive "
                         f"session, which the ranks cannot import. {_HOW}, then import it here.")
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing here
        raise ValueError(f"{who}: fn ({qual}) cannot be sent to the ranks ({type(e).__name__}: {e}). {_HOW}.") from None
    _check_main_guard(who)


def _guarded_lines(path: str) -> list[tuple[int, int]] | None:
    """Line ranges of the top-level `if __name__ == "__main__":` blocks of a script (None when
    its source cannot be read, e.g. a .pyc)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    out = []
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            out.append((node.lineno, node.end_lineno or node.lineno))
    return out


def _check_main_guard(who: str) -> None:
    """A call from the top level of the main script outside `if __name__ == "__main__":` would be
    repeated by every rank (spawned processes re-import the main script) and fail there."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            line, guarded = frame.f_lineno, _guarded_lines(path)
            if guarded is not None and not any(lo <= line <= hi for lo, hi in guarded):
                raise ValueError(
                    f"{who} is called at the top level of {path} (line {line}) without an "
                    f"`if __name__ == \"__main__\":` guard: every rank re-imports this script and would call it "
                    f"again. Put the call (and what starts the job) under `if __name__ == \"__main__\":`.")
            return
        frame = frame.f_back


def check_backend(backend: Any, world_size: int) -> None:
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA, which is not available here "
                             "(torch.cuda.is_available() is False); use backend='gloo' on CPU")
        n = torch.cuda.device_count()
        if world_size > n:
            raise ValueError(f"backend='nccl' runs one rank per GPU: world_size {world_size} > {n} GPU(s) here "
                             f"(NCCL refuses two ranks on one GPU); use world_size <= {n} or backend='gloo'")


# ---------------------------------------------------------------------------------------------
# one rank


def _die_with_parent(parent_pid: int) -> None:
    """Make this process die when the launching process dies, however it dies."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0   # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001
            armed = False
    if os.getppid() != parent_pid:   # the parent died before the line above
        os._exit(1)
    if not armed:
        def watch() -> None:
            while True:
                time.sleep(0.5)
                if os.getppid() != parent_pid:
                    os._exit(1)

        threading.Thread(target=watch, name="megapar-parent-watch", daemon=True).start()


def _worker(fn: Callable[..., Any], rank: int, args: tuple, env: dict[str, str], conn: Any,
            parent_pid: int, stack_path: str) -> None:
    _die_with_parent(parent_pid)
    export_rank_env(env)
    stacks = open(stack_path, "w")   # kept open: faulthandler writes to its descriptor
    faulthandler.enable(stacks)     # fatal signals (segfault, abort)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)   # the parent asks at a timeout
    import torch

    # Ranks share the cores: intra-op threads beyond a fair share make gloo transfers crawl.
    world = int(env.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        value = fn(rank, *args)
        try:
            # Plain pickle: multiprocessing's pickler would pass tensors as shared-memory handles
            # that die with this process.
            message = ("ok", pickle.dumps(value))
        except Exception as exc:  # noqa: BLE001
            message = ("error", f"fn returned a value that cannot be pickled: {type(exc).__name__}: {exc}")
    except BaseException as exc:  # report everything, including SystemExit
        message = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send_bytes(pickle.dumps(message))
        conn.close()
    finally:
        try:
            from megapar.parallel.groups import destroy_parallel

            destroy_parallel()
        except Exception:
            pass
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# ---------------------------------------------------------------------------------------------
# the parent


_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe",
              "ECONNRESET", "Socket Timeout", "Timed out waiting")


def pick_primary(errors: list[tuple[int, str]]) -> tuple[int, str]:
    """Of several ranks' errors, the first that is not a peer-disconnect consequence."""
    primary = [(r, t) for r, t in errors if not any(s in t for s in _SECONDARY)]
    return (primary or errors)[0]


@dataclass
class _Rank:
    rank: int
    proc: Any
    conn: Any
    stack_path: str
    status: str | None = None        # "ok" | "error" | "died"
    value: Any = None                # the result, the error text, or the exit code
    when: float = 0.0                # when the parent saw it
    exited: bool = False


@dataclass
class _Events:
    ranks: list[_Rank]
    order: list[_Rank] = field(default_factory=list)   # failures in the order seen

    def settle(self, r: _Rank, status: str, value: Any) -> None:
        if r.status is None:
            r.status, r.value, r.when = status, value, time.monotonic()
            if status != "ok":
                self.order.append(r)

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` s for results and exits; record them."""
        by_obj: dict[Any, _Rank] = {}
        for r in self.ranks:
            if r.conn is not None:
                by_obj[r.conn] = r
            if not r.exited:
                by_obj[r.proc.sentinel] = r
        if not by_obj:
            time.sleep(timeout)
            return
        ready = mpc.wait(list(by_obj), timeout=timeout)
        # exits first: a rank that died is more often the cause than a peer's error seen with it
        for obj in sorted(ready, key=lambda o: o is by_obj[o].conn):
            r = by_obj[obj]
            if obj is r.conn:
                self._read(r)
            else:
                r.exited = True
                r.proc.join(0.1)
                if r.conn is not None and r.conn.poll(0):
                    self._read(r)   # its message was already in the pipe
                if r.status is None:
                    self.settle(r, "died", r.proc.exitcode)

    def _read(self, r: _Rank) -> None:
        try:
            status, value = pickle.loads(r.conn.recv_bytes())
        except (EOFError, OSError):
            r.conn.close()
            r.conn = None
            return
        if status == "ok":
            try:
                value = pickle.loads(value)
            except Exception as exc:  # noqa: BLE001 - it escaped launch_local raw, naming no rank
                status, value = "error", (f"fn returned a value that the launching process cannot unpickle: "
                                          f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        self.settle(r, status, value)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _fatal_dump(r: _Rank) -> str:
    try:
        with open(r.stack_path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\nits last Python stack:\n{text}" if "Fatal Python error" in text else ""


def _failure(events: _Events) -> RankError:
    """The root cause among the failures seen: the first rank that exited without a result,
    else the first error that is not a peer-disconnect consequence, else the first error."""
    died = [r for r in events.order if r.status == "died"]
    errors = [r for r in events.order if r.status == "error"]
    first_error = None
    if errors:
        rank, text = pick_primary([(r.rank, r.value) for r in errors])
        first_error = next(r for r in errors if r.rank == rank)
        if not any(s in text for s in _SECONDARY) and (not died or first_error.when < died[0].when):
            return RankError(f"rank {rank} failed:\n{text}", rank=rank, remote_traceback=text)
    if died:
        r = died[0]
        later = [d.rank for d in died[1:]]
        also = f" (then ranks {later})" if later else ""
        return RankError(f"rank {r.rank} exited with code {_exit_text(r.value)} before returning a result{also}; "
                         f"it was the first to exit" + _fatal_dump(r), rank=r.rank)
    assert first_error is not None
    return RankError(f"rank {first_error.rank} failed:\n{first_error.value}", rank=first_error.rank,
                     remote_traceback=first_error.value)


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _dump_stacks(ranks: list[_Rank], wait: float = 2.0) -> dict[int, str]:
    """Ask every live rank for its Python stack (SIGUSR1 -> faulthandler) and read them back."""
    live = [r for r in ranks if r.proc.is_alive()]
    sizes = {}
    for r in live:
        try:
            sizes[r.rank] = os.path.getsize(r.stack_path)
            os.kill(r.proc.pid, signal.SIGUSR1)
        except (OSError, AttributeError):
            pass
    deadline = time.monotonic() + wait
    stacks: dict[int, str] = {}
    while time.monotonic() < deadline and len(stacks) < len(sizes):
        time.sleep(0.1)
        for r in live:
            if r.rank in sizes and r.rank not in stacks:
                try:
                    with open(r.stack_path) as f:
                        f.seek(sizes[r.rank])
                        text = f.read()
                except OSError:
                    continue
                if text.strip() and text.endswith("\n"):
                    stacks[r.rank] = text.strip()
    time.sleep(0.1)   # let a dump that was still being written finish
    by_rank = {r.rank: r for r in live}   # `ranks` may be a subset (the ranks still running)
    for rank in list(stacks):
        r = by_rank[rank]
        with open(r.stack_path) as f:
            f.seek(sizes[rank])
            stacks[rank] = f.read().strip()
    return stacks


def _collective_of(stack: str) -> str | None:
    """'all_reduce (called from job.py:12 in step)' when the stack waits in torch.distributed."""
    frames = _FRAME.findall(stack)          # most recent call first
    inside = [i for i, (path, _, _) in enumerate(frames) if "torch/distributed/" in path.replace(os.sep, "/")]
    if not inside:
        return None
    names = [frames[i][2] for i in inside if frames[i][2] not in ("wrapper", "inner", "_fn")]
    name = names[0] if names else frames[inside[0]][2]
    caller = next((f for f in frames[inside[-1] + 1:] if "torch/" not in f[0].replace(os.sep, "/")), None)
    where = f" (called from {os.path.basename(caller[0])}:{caller[1]} in {caller[2]})" if caller else ""
    return name + where


def _where(stack: str) -> str:
    frames = _FRAME.findall(stack)
    return f"{os.path.basename(frames[0][0])}:{frames[0][1]} in {frames[0][2]}" if frames else "?"


def _timeout_error(ranks: list[_Rank], timeout: float) -> RankError:
    missing = [r.rank for r in ranks if r.status is None]
    stacks = _dump_stacks([r for r in ranks if r.status is None])
    waiting = {rank: _collective_of(s) for rank, s in stacks.items()}
    in_coll = [rank for rank in missing if waiting.get(rank)]
    outside = [rank for rank in missing if rank in stacks and not waiting.get(rank)]
    head = f"timed out after {timeout:g}s waiting for ranks {missing}"
    culprit = None
    if in_coll and outside:
        culprit = outside[0]
        coll = waiting[in_coll[0]]
        where = "; ".join(f"rank {rank} is at {_where(stacks[rank])}" for rank in outside)
        head += (f": ranks {outside} never reached the collective that ranks {in_coll} wait in ({coll}); {where}")
    elif in_coll:
        head += f": all of them wait in collectives ({waiting[in_coll[0]]} on rank {in_coll[0]})"
    elif outside:
        head += f": none is in a collective (slow, or stuck in its own code: rank {outside[0]} is at " \
                f"{_where(stacks[outside[0]])})"
    elif not stacks:
        head += " (none answered with its Python stack: still starting up?)"
    shown = outside or in_coll
    body = "".join(f"\n--- rank {rank} stack (most recent call first):\n{_trim(stacks[rank])}" for rank in shown)
    return RankError(head + body, rank=culprit, stacks=stacks)


def _trim(stack: str, lines: int = 30) -> str:
    parts = stack.splitlines()
    return "\n".join(parts[:lines] + ([f"  ... {len(parts) - lines} more lines"] if len(parts) > lines else []))


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


def launch_local(fn: Callable[..., Any], world_size: int, *, backend: str = "gloo", args: tuple = (),
                 timeout: float = 120.0, env: dict[str, str] | None = None) -> list[Any]:
    """Spawn `world_size` processes, call `fn(rank, *args)` in each, return results by rank.

    fn: a module-level function of an importable module (the ranks import it by name).
    backend: exported as MEGAPAR_BACKEND for `init_parallel` ("nccl" needs one GPU per rank).
    timeout: seconds (> 0) for the whole job. env: extra environment for every rank.

    The rendezvous store is this process's (`host_store`), alive until the ranks are stopped;
    the ranks get MASTER_PORT=its port and TORCHELASTIC_USE_AGENT_STORE=True, so a
    torch.distributed rendezvous in a rank (env://, or tcp:// at MASTER_ADDR:MASTER_PORT) joins
    it instead of hosting one. An `env` that sets MASTER_PORT chooses the port itself: then no
    store is hosted here, the flag is not set, and rank 0 hosts the store at that port.
    """
    check_world_size(world_size)
    check_backend(backend, world_size)
    timeout = check_timeout(timeout)
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in env.items())):
        # else every rank died in os.environ.update, and the first to exit was blamed
        raise ValueError(f"launch_local: env must be a dict of str to str, got {env!r}")
    _check_env_keys(env or {}, world_size)
    check_entry(fn, "launch_local")
    ctx = mp.get_context("spawn")
    # Bound now and held until the ranks are stopped (below): no other process can take the port.
    store = None if "MASTER_PORT" in (env or {}) else host_store()
    with tempfile.TemporaryDirectory(prefix="megapar-ranks-") as tmp:
        ranks: list[_Rank] = []
        try:
            for rank in range(world_size):
                rank_env = torchrun_env(rank, world_size, store.port if store is not None else 0)
                if store is not None:
                    rank_env[AGENT_STORE] = "True"
                rank_env["MEGAPAR_BACKEND"] = backend
                rank_env.update(env or {})   # (MASTER_PORT from env replaces the 0 above)
                recv, send = ctx.Pipe(duplex=False)
                stack_path = os.path.join(tmp, f"rank{rank}.stack")
                p = ctx.Process(target=_worker, args=(fn, rank, args, rank_env, send, os.getpid(), stack_path),
                                daemon=True, name=f"megapar-rank{rank}")
                try:
                    p.start()
                except (pickle.PicklingError, TypeError, AttributeError) as e:
                    raise ValueError(f"launch_local: args cannot be sent to the ranks ({type(e).__name__}: {e}); "
                                     f"args must be picklable") from None
                finally:
                    send.close()   # the rank holds the write end now: EOF here when it dies
                ranks.append(_Rank(rank, p, recv, stack_path))
            return _supervise(ranks, timeout)
        finally:
            _stop([r.proc for r in ranks])
            for r in ranks:
                if r.conn is not None:
                    r.conn.close()
            del store   # the ranks are gone: close the rendezvous store and free its port


def _check_env_keys(env: dict[str, str], world_size: int) -> None:
    """Refuse an `env` that overrides a variable launch_local sets per rank with a value some rank
    must not have: RANK="0" made every rank rank 0 (the second failed with "address already in
    use", blamed on rank 0), WORLD_SIZE="3" for 2 processes waited for a third until the timeout.
    Passing the caller's own torchrun environment (env=dict(os.environ)) did both."""
    per_rank = [torchrun_env(rank, world_size, 0) for rank in range(world_size)]
    bad = {k: v for k, v in env.items() if k in per_rank[0] and k not in ("MASTER_ADDR", "MASTER_PORT")
           and any(v != mine[k] for mine in per_rank)}
    if bad:
        raise ValueError(f"launch_local: env sets {bad}, which launch_local sets itself for each of the "
                         f"{world_size} rank(s) (RANK, LOCAL_RANK, GROUP_RANK differ per rank; WORLD_SIZE and "
                         f"LOCAL_WORLD_SIZE are {world_size}); leave them out of env")


def _supervise(ranks: list[_Rank], timeout: float, grace: float = 1.0) -> list[Any]:
    events = _Events(ranks)
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        if all(r.status == "ok" for r in ranks):
            return [r.value for r in ranks]
        if events.order:
            # peers of a failed rank fail too, a moment later: collect them, then judge
            if all(r.status is not None for r in ranks) or now > events.order[0].when + grace:
                raise _failure(events)
            events.poll(min(0.1, events.order[0].when + grace - now + 0.01))
            continue
        if now > deadline:
            raise _timeout_error(ranks, timeout)
        events.poll(min(0.5, deadline - now + 0.01))
