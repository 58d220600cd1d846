"""Ring engines behind the decomposed all-gather-matmul and matmul-reduce-scatter.

The one idea: a collective over P ranks becomes P - 1 ring steps (send to the next rank,
receive from the previous one), and the matmul that consumes or produces one step's block
runs while the next step is on the wire.

- `ring_all_gather`: every rank starts with its own shard; at step s it holds the shard of
  rank `(rank - s) % P`, forwards it to the next rank, and hands it to `consume` while the
  next one arrives.
- `ring_reduce_scatter`: the partial sum destined to rank d starts at rank d + 1 and travels
  d + 1 -> d + 2 -> ... -> d, each rank adding its own `produce(d)` before forwarding it, so
  rank d ends with the full sum. `produce` for the next step runs while the running sum of
  this step travels.

Transport is `torch.distributed.batch_isend_irecv`, so any backend works (gloo runs it in
its own threads, which is what the CPU tests use). On CUDA the P2P work is issued from a
dedicated communication stream that waits only for what the step really depends on (the
shard copied in, or the running sum just computed), not for every matmul queued before it;
the compute stream then waits for each step's arrival. Buffers are allocated on the compute
stream and stay referenced until the compute stream has waited for the step that used
them, so the caching allocator cannot hand them out early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm import group_ranks, resolve_group
from ..groups import Group

_COMM_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def comm_stream(device: torch.device) -> "torch.cuda.Stream":
    """The communication stream of a CUDA device (one per device, created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


@dataclass(frozen=True)
class RingPeers:
    """This rank's place on the ring of a group (peer ranks are global, as P2P wants them)."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    next_rank: int
    prev_rank: int

    @classmethod
    def of(cls, group: Group | dist.ProcessGroup | None) -> "RingPeers":
        pg, rank, size = resolve_group(group)
        ranks = group_ranks(group)
        return cls(pg, rank, size, ranks[(rank + 1) % size], ranks[(rank - 1) % size])


class RingExchanger:
    """One ring step in flight at a time: send blocks to the next rank, receive from the previous."""

    def __init__(self, peers: RingPeers, device: torch.device) -> None:
        self.peers = peers
        self.stream = comm_stream(device) if device.type == "cuda" else None
        self._works: list[Any] = []

    def start(self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], *, after_compute: bool) -> None:
        """Post one step. after_compute: the send blocks were just written on the compute stream."""
        assert not self._works, "finish() the step in flight before starting the next one"
        p = self.peers
        ops = [dist.P2POp(dist.isend, t, p.next_rank, group=p.pg) for t in send]
        ops += [dist.P2POp(dist.irecv, t, p.prev_rank, group=p.pg) for t in recv]
        if self.stream is None:
            self._works = dist.batch_isend_irecv(ops)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        with torch.cuda.stream(self.stream):
            if after_compute:
                self.stream.wait_stream(compute)
            self._works = dist.batch_isend_irecv(ops)

    def finish(self) -> None:
        """The step's received blocks are ready for the compute stream (or the host on CPU)."""
        works, self._works = self._works, []
        if self.stream is not None:
            # The comm stream must also be past this step before it forwards what arrived.
            with torch.cuda.stream(self.stream):
                for w in works:
                    w.wait()
        for w in works:
            w.wait()


def ring_all_gather(shards: Sequence[torch.Tensor], group: Group | dist.ProcessGroup | None,
                    consume: Callable[[int, list[torch.Tensor]], None]) -> list[torch.Tensor]:
    """All-gather several same-row-count tensors along dim 0, consuming each rank's block on arrival.

    shards: [m, ...] each (any dtype the backend carries; pass fp8 as a uint8 view), the same
    shapes on every rank. consume(src, blocks): called once per source rank, in arrival order
    (own block first), with that rank's blocks (contiguous views of the outputs).
    Returns the gathered tensors, [P * m, ...] each, in rank order.
    """
    peers = RingPeers.of(group)
    size, rank = peers.size, peers.rank
    gathered = [s.new_empty((size * s.shape[0],) + tuple(s.shape[1:])) for s in shards]
    blocks = [g.view((size,) + tuple(s.shape)) for g, s in zip(gathered, shards)]
    for b, s in zip(blocks, shards):
        b[rank].copy_(s)
    exchanger = RingExchanger(peers, shards[0].device)
    for step in range(size):
        src = (rank - step) % size
        if step > 0:
            exchanger.finish()
        if step < size - 1:
            exchanger.start([b[src] for b in blocks], [b[(src - 1) % size] for b in blocks],
                            after_compute=step == 0)
        consume(src, [b[src] for b in blocks])
    return gathered


def ring_reduce_scatter(produce: Callable[[int], torch.Tensor], group: Group | dist.ProcessGroup | None,
                        device: torch.device) -> torch.Tensor:
    """Sum over ranks of `produce(d)` for this rank's d, produced one destination at a time.

    produce(d): this rank's partial for destination rank d, a fresh tensor of the same shape
    and dtype for every d and on every rank (it is accumulated in place).
    """
    peers = RingPeers.of(group)
    size, rank = peers.size, peers.rank
    exchanger = RingExchanger(peers, device)
    incoming: torch.Tensor | None = None
    running: torch.Tensor | None = None
    for step in range(size):
        partial = produce((rank - 1 - step) % size)  # overlaps the step in flight
        if step > 0:
            exchanger.finish()
            partial.add_(incoming)
        running = partial
        if step < size - 1:
            incoming = torch.empty_like(running)
            exchanger.start([running], [incoming], after_compute=True)
    assert running is not None
    return running
