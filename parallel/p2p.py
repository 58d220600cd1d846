"""Point-to-point exchange: the one place that posts `batch_isend_irecv` (cp ring, sp engines, EPLB).

`Peers` is this rank's place in a group (peer ranks global, as P2P wants them);
`P2PExchanger(peers, device, on_comm_stream=...)` posts a step, a set of sends and receives to
group ranks, and returns a `P2PWork` whose `wait()` makes what arrived usable. `shift(send,
recv)` is the ring step (send to `rank + 1`, receive from `rank - 1`, or any offsets).

CUDA stream rules (the caller picks the one its schedule relies on):
- ``on_comm_stream=False`` (cp ring attention, EPLB migration): the step is posted from the
  current stream, so NCCL orders the transfer after everything already queued on it;
  `wait()` orders the current stream after the arrival.
- ``on_comm_stream=True`` (the sp all-gather / reduce-scatter engines): the step is posted from
  one dedicated communication stream per device, which waits for the current stream only
  when ``after_compute=True`` (the send blocks were just written there), not for every matmul
  queued after them; `wait()` orders the communication stream (which may forward what arrived)
  and then the current stream after the arrival. Buffers must be allocated on the current
  stream and stay referenced until it has waited, so the caching allocator cannot reuse them.
On CPU (gloo) the transfers run on gloo's threads and `wait()` blocks the host.

`Peers.loopback_of(rank, size)` posts nothing at all (receive buffers keep what they held): the
single-device benchmarks run an engine's compute schedule with it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .comm import GroupLike, group_ranks, resolve_group

_COMM_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def comm_stream(device: torch.device) -> "torch.cuda.Stream":
    """The communication stream of a CUDA device (one per device, created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


@dataclass(frozen=True)
class Peers:
    """This rank's place in a group (peer ranks are global, as P2P wants them)."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: tuple[int, ...]
    """global rank of each group rank"""
    loopback: bool = False
    """no transport: a single-device stand-in that runs only the compute schedule"""

    @classmethod
    def of(cls, group: GroupLike) -> "Peers":
        """This process's place in `group`; a group it is not a member of is a ValueError naming its
        global rank and the group's ranks (torch.distributed answers rank -1, size -1 and no ranks
        for the NON_GROUP_MEMBER that new_group returns outside the group: every step then went wrong)."""
        pg, rank, size = resolve_group(group)
        ranks = tuple(group_ranks(group))
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < size or len(ranks) != size or ranks[rank] != me:
            if me in ranks:
                raise ValueError(f"Peers.of: this process (global rank {me}) is group rank {ranks.index(me)} of the "
                                 f"group of global ranks {list(ranks)}, but the group says rank {rank} of {size}")
            where = (f"the group of global ranks {list(ranks)}" if ranks else
                     f"the group given (rank {rank} of {size}, no global ranks: torch.distributed's "
                     f"GroupMember.NON_GROUP_MEMBER, what new_group returns outside the group, whose ranks "
                     f"are not known here)")
            raise ValueError(f"Peers.of: this process (global rank {me}) is not a member of {where}; only the "
                             f"group's members can exchange within it")
        return cls(pg, rank, size, ranks)

    @classmethod
    def loopback_of(cls, rank: int, size: int) -> "Peers":
        """Group rank `rank` of `size` with every send and receive skipped (benchmarks only)."""
        if not 0 <= rank < size:
            raise ValueError(f"loopback rank {rank} is out of range for size {size}: valid ranks are 0..{size - 1}")
        return cls(None, rank, size, tuple(range(size)), loopback=True)

    def peer(self, offset: int) -> int:
        """Global rank of the group rank `rank + offset` (mod size)."""
        return self.ranks[(self.rank + offset) % self.size]


@dataclass
class P2PWork:
    """One posted step; `wait()` (idempotent) makes its received tensors usable (module docstring)."""

    works: list[Any] = field(default_factory=list)
    stream: "torch.cuda.Stream | None" = None
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):  # the comm stream too, before it forwards what arrived
                for w in self.works:
                    w.wait()
        for w in self.works:
            w.wait()
        self.done = True


def _checked(messages: Sequence[tuple[int, torch.Tensor]], what: str, p: Peers) -> list[tuple[int, torch.Tensor]]:
    """`messages` as a list, every peer a group rank in [0, size) (a negative one indexed `ranks` from the
    end: -1 reached the last rank, and -size this rank itself over the transport)."""
    out = list(messages)
    for peer, _ in out:
        if isinstance(peer, bool) or not isinstance(peer, numbers.Integral) or not 0 <= peer < p.size:
            raise ValueError(f"{what}: peer {peer!r} is not a group rank of this group of {p.size} "
                             f"(valid: 0..{p.size - 1}; this rank is {p.rank})")
    return [(int(peer), t) for peer, t in out]


class P2PExchanger:
    """Posts P2P steps among `peers` under one of the two stream rules of the module docstring."""

    def __init__(self, peers: Peers, device: torch.device, *, on_comm_stream: bool = False) -> None:
        self.peers = peers
        use_stream = on_comm_stream and device.type == "cuda" and not peers.loopback
        self.stream = comm_stream(device) if use_stream else None
        self._pending: list[P2PWork] = []

    def post(self, sends: Sequence[tuple[int, torch.Tensor]] = (), recvs: Sequence[tuple[int, torch.Tensor]] = (),
             *, after_compute: bool = True) -> P2PWork:
        """Send each `(group rank, tensor)` of `sends`, receive into each of `recvs`, as one batch.

        Tensors: contiguous, any dtype the backend carries (fp8 as a uint8 view for gloo); the
        receiver's buffer has the sender's shape and dtype. Messages to this rank itself are
        copied here, in order (a size-1 ring is a copy). after_compute: (comm stream only)
        the sends were just written on the current stream.
        """
        p = self.peers
        sends, recvs = _checked(sends, "sends", p), _checked(recvs, "recvs", p)
        if p.loopback:
            return P2PWork(done=True)
        # messages to this rank itself are local copies, matched in order
        own_sends = [t for dst, t in sends if dst == p.rank]
        own_recvs = [r for src, r in recvs if src == p.rank]
        if len(own_sends) != len(own_recvs):   # zip() dropped the extra ones: a buffer kept stale data
            raise ValueError(f"P2P step on group rank {p.rank} of {p.size}: {len(own_sends)} send(s) to itself "
                             f"but {len(own_recvs)} receive(s) from itself; they are copied in pairs, in order")
        for i, (t, r) in enumerate(zip(own_sends, own_recvs)):
            if t.shape != r.shape or t.dtype != r.dtype:   # copy_ would broadcast or cast silently
                raise ValueError(f"P2P step on group rank {p.rank}: message {i} to itself is {tuple(t.shape)} "
                                 f"{t.dtype} but its receive buffer is {tuple(r.shape)} {r.dtype} (must match)")
        for t, r in zip(own_sends, own_recvs):
            r.copy_(t)
        ops = [dist.P2POp(dist.isend, t, p.ranks[dst], group=p.pg) for dst, t in sends if dst != p.rank]
        ops += [dist.P2POp(dist.irecv, t, p.ranks[src], group=p.pg) for src, t in recvs if src != p.rank]
        if not ops:
            return P2PWork(done=True)
        if self.stream is None:
            work = P2PWork(dist.batch_isend_irecv(ops))
        else:
            current = torch.cuda.current_stream(self.stream.device)
            with torch.cuda.stream(self.stream):
                if after_compute:
                    self.stream.wait_stream(current)
                work = P2PWork(dist.batch_isend_irecv(ops), self.stream)
        self._pending.append(work)
        return work

    def shift(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], *, after_compute: bool = True,
              send_offset: int = 1, recv_offset: int = -1) -> P2PWork:
        """One ring step: `send` to group rank `rank + send_offset`, `recv` from `rank + recv_offset`."""
        p = self.peers
        to, frm = (p.rank + send_offset) % p.size, (p.rank + recv_offset) % p.size
        return self.post([(to, t) for t in send], [(frm, t) for t in recv], after_compute=after_compute)

    def finish(self) -> None:
        """Wait for every step posted and not yet waited for."""
        pending, self._pending = self._pending, []
        for work in pending:
            work.wait()
