"""Transport engines behind the decomposed all-gather-matmul and matmul-reduce-scatter.

The one idea: a collective over P ranks becomes P - 1 point-to-point steps, and the matmul
that consumes or produces one step's block runs while the next step is on the wire.

- `ring_all_gather`: every rank starts with its own shard; at step s it holds the shard of
  rank `(rank - s) % P`, forwards it to the next rank, and hands it to `consume` while the
  next one arrives. The own shard is consumed straight from the input (no copy); it is
  copied into the gathered buffer only when the caller wants the gathered tensor.
- `pairwise_reduce_scatter`: at step s = 1 .. P - 1 the partial for rank `(rank + s) % P` is
  produced and sent straight to it (each step a shift permutation, so every rank sends and
  receives one block a step), while the next partial is computed; the own partial is
  produced last, into the buffer that also receives the other ranks' partials, and one
  reduction over that [P, m, N] buffer ends it. Compared with a ring that adds the running
  sum at every hop, that is one reduction kernel reading P blocks instead of P - 1 separate
  adds reading two each (and the compute stream never waits for the wire until the end;
  the bf16 sum accumulates in fp32 instead of rounding at every hop).

`ComputeLanes` optionally rotates the block matmuls over several CUDA streams (each waits
only for its own block's arrival), so one matmul's last, partly filled wave can overlap the
next; `parallel.sp.ops.COMPUTE_LANES` picks the count (1: everything on the current stream).

Transport is `parallel.p2p.P2PExchanger` on its communication stream (`on_comm_stream=True`):
any torch.distributed backend works (gloo runs it in its own threads, which is what the CPU
tests use); on CUDA each step waits only for what it really depends on (the input shard, or
the partial just computed), not for every matmul queued after it, and the compute stream then
waits for each step's arrival. Buffers are allocated on the compute stream and stay
referenced until the compute stream has waited for the step that used them, so the caching
allocator cannot hand them out early.

`RingPeers.loopback_of(rank, size)` runs the same schedule with no transport at all (receive
buffers keep whatever they held): the single-device benchmark of what the decomposition
costs in compute (`launch/bench/sp.py`) measures exactly the kernels the op launches.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from ..p2p import P2PExchanger, Peers, comm_stream

RingPeers = Peers
"""This rank's place in the group (`parallel.p2p.Peers`; the old name stays)."""

__all__ = ["RingPeers", "ComputeLanes", "comm_stream", "side_stream", "ring_all_gather", "pairwise_reduce_scatter"]

_SIDE_STREAMS: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def side_stream(device: torch.device, index: int) -> "torch.cuda.Stream":
    """The index-th extra compute stream of a CUDA device (created on first use)."""
    dev = device.index if device.index is not None else torch.cuda.current_device()
    if (dev, index) not in _SIDE_STREAMS:
        _SIDE_STREAMS[(dev, index)] = torch.cuda.Stream(device=dev)
    return _SIDE_STREAMS[(dev, index)]


class ComputeLanes:
    """Round-robin compute streams for independent block matmuls; lane 0 is the current stream.

    With more than one lane (CUDA only) the next block's matmul can start while the last
    wave of the previous one leaves SMs idle. Side lanes wait for the current stream on
    entry (the inputs are ready) and the current stream waits for them in `join()`; every
    buffer they touch is allocated on the current stream before and used after, so the
    caching allocator never reuses one early. One lane (or CPU) is a plain no-op.
    """

    def __init__(self, device: torch.device, count: int) -> None:
        if count < 1:
            raise ValueError(f"compute lanes must be >= 1, got {count}")
        self.streams: list[torch.cuda.Stream] = []
        if device.type == "cuda" and count > 1:
            main = torch.cuda.current_stream(device)
            self.streams = [main] + [side_stream(device, i) for i in range(count - 1)]
            for s in self.streams[1:]:
                s.wait_stream(main)

    def lane(self, i: int):
        """Context manager: work issued inside runs on lane i (mod the lane count)."""
        if not self.streams:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.streams[i % len(self.streams)])

    def join(self) -> None:
        for s in self.streams[1:]:
            self.streams[0].wait_stream(s)


def ring_all_gather(shards: Sequence[torch.Tensor], peers: RingPeers,
                    consume: Callable[[int, list[torch.Tensor]], None], *, fill_own: bool = True,
                    out: Sequence[torch.Tensor] | None = None, lanes: int = 1) -> list[torch.Tensor]:
    """All-gather several same-row-count tensors along dim 0, consuming each rank's block on arrival.

    shards: [m, ...] each, contiguous (any dtype the backend carries; pass fp8 as a uint8
    view), the same shapes on every rank. consume(src, blocks): called once per source rank,
    in arrival order, with that rank's blocks: the input shards themselves for the own rank
    (first), contiguous views of the outputs for the others.
    Returns the gathered tensors, [P * m, ...] each, in rank order; the own rank's block is
    copied in only when `fill_own` (otherwise it holds garbage). out: the gathered buffers
    to receive into ([P * m, ...] each, contiguous), allocated here when None (a loopback
    benchmark passes buffers that already hold realistic data, as after a real gather).
    lanes: compute streams the consume calls rotate over (`ComputeLanes`; CUDA only).
    """
    size, rank = peers.size, peers.rank
    if out is None:
        gathered = [s.new_empty((size * s.shape[0],) + tuple(s.shape[1:])) for s in shards]
    else:
        gathered = list(out)
        for g, s in zip(gathered, shards):
            if g.shape != (size * s.shape[0],) + tuple(s.shape[1:]) or g.dtype != s.dtype or not g.is_contiguous():
                raise ValueError(f"ring_all_gather: out buffer {tuple(g.shape)} {g.dtype} does not fit {size} shards "
                                 f"{tuple(s.shape)} {s.dtype} (contiguous [P * m, ...] of the shard dtype)")
    blocks = [g.view((size,) + tuple(s.shape)) for g, s in zip(gathered, shards)]
    exchanger = P2PExchanger(peers, shards[0].device, on_comm_stream=True)
    compute = ComputeLanes(shards[0].device, lanes)
    for step in range(size):
        src = (rank - step) % size
        with compute.lane(step):
            if step > 0:
                exchanger.finish()  # this lane waits for the arrival, the others run on
            held = list(shards) if step == 0 else [b[src] for b in blocks]
            if step < size - 1:
                exchanger.shift(held, [b[(src - 1) % size] for b in blocks], after_compute=step == 0)
            consume(src, held)
    compute.join()
    if fill_own:
        for b, s in zip(blocks, shards):
            b[rank].copy_(s)
    return gathered


def pairwise_reduce_scatter(produce: Callable[[int, torch.Tensor], None], peers: RingPeers,
                            like: torch.Tensor, shape: Sequence[int], *, lanes: int = 1) -> torch.Tensor:
    """Sum over ranks of every rank's partial for this rank, each partial produced and sent in turn.

    produce(d, out): writes this rank's partial for group rank d into `out` (a contiguous
    tensor of `shape`, dtype and device of `like`); called for d = rank + 1, ..., rank + P - 1
    (mod P) and then for d = rank. Returns the sum, a new tensor of `shape`.
    lanes: compute streams the produce calls rotate over (`ComputeLanes`; CUDA only).
    """
    size, rank = peers.size, peers.rank
    shape = tuple(shape)
    received = like.new_empty((size,) + shape)  # [0]: own partial, [s]: from rank - s
    outgoing = like.new_empty((size - 1,) + shape)  # [s - 1]: to rank + s, kept alive until finish()
    exchanger = P2PExchanger(peers, like.device, on_comm_stream=True)
    compute = ComputeLanes(like.device, lanes)
    for step in range(1, size):
        with compute.lane(step - 1):  # the send waits for this lane only
            produce((rank + step) % size, outgoing[step - 1])
            exchanger.shift([outgoing[step - 1]], [received[step]], after_compute=True,
                            send_offset=step, recv_offset=-step)
    with compute.lane(size - 1):
        produce(rank, received[0])  # overlaps the last step in flight
    compute.join()
    exchanger.finish()
    return received.sum(dim=0)
