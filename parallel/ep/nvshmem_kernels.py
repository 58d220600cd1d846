"""Device-initiated transfers over peer pointers: Triton kernels and the channel protocol.

Nothing here knows NVSHMEM: a *peer table* is an int64 tensor [W] holding the base address of
one buffer on every rank (rank r's own buffer included), as NVSHMEM's `get_peer_tensor` gives
them, or, in tests, ordinary tensors of one process standing in for W ranks. Kernels store
into those addresses directly; flags are int64 counters updated with release/acquire atomics
at system scope.

Kernels (all on the caller's stream, no host synchronization):

- `put_rows`: rows of a local uint8 tensor [N, B] (B a multiple of 4: moved as int32 words)
  into row ``dest_row[i]`` of rank ``dest_rank[i]``'s buffer; ``dest_row < 0`` skips the row.
  Only the byte columns [col0, col1) move, so one packed row can be sent in parts.
- `signal`: add 1 to slot ``index`` of a counter array [W] on every rank.
- `wait`: one program per slot s of a local counter array [W] spins until
  ``counter[s] >= epoch - lag``; after `max_iters` polls it gives up and records
  ``(code << 16) | (s + 1)`` in the error word (the first error wins). Once the error word is
  set, waits return at once, so a missing rank costs one bounded wait, not one per call.

`PeerChannel` is one direction of traffic (each rank writes into the others' receive region):

    begin()                    epoch += 1; wait until every rank has consumed the last epoch
    put(...)                   rows into the receivers' regions (one or more launches)
    post()                     arrive[me] += 1 on every rank
    receive(n, B) -> [n, B]    wait for every rank's arrive, copy the region out, free[me] += 1
                               on every rank

Every rank runs the same sequence of transfers on a channel, so epochs agree; a rank that
skips one makes the others' waits time out with its rank in the error word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import triton
import triton.language as tl

# error codes (high bits of the error word)
ERR_ARRIVE = 1  # a rank's data never arrived
ERR_FREE = 2  # a rank never released its receive region
ERR_NAMES = {ERR_ARRIVE: "never delivered its rows", ERR_FREE: "never released its receive buffer"}


@triton.jit
def _put_rows_kernel(src, src_row, dest_rank, dest_row, ptrs, src_stride, dest_stride, col0, ncols,
                     BLOCK: tl.constexpr):
    """src: int32 words [N, src_stride]; program (i, c): words col0 + [c*BLOCK, (c+1)*BLOCK) of row i."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    drow = tl.load(dest_row + i)
    if drow >= 0:
        d = tl.load(dest_rank + i)
        srow = tl.load(src_row + i)
        base = tl.load(ptrs + d).to(tl.pointer_type(tl.int32))
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ncols
        vals = tl.load(src + srow * src_stride + col0 + offs, mask=mask)
        tl.store(base + drow * dest_stride + col0 + offs, vals, mask=mask)


@triton.jit
def _signal_kernel(ptrs, index):
    d = tl.program_id(0)
    base = tl.load(ptrs + d).to(tl.pointer_type(tl.int64))
    tl.atomic_add(base + index, tl.full([], 1, tl.int64), sem="release", scope="sys")


@triton.jit
def _wait_kernel(counter, epoch, lag, err, code, max_iters):
    s = tl.program_id(0)
    zero = tl.full([], 0, tl.int64)  # int64 operands for the int64 words
    target = tl.load(epoch) - lag
    failed = tl.atomic_add(err, zero, sem="relaxed", scope="gpu")
    if failed == 0:
        v = tl.atomic_add(counter + s, zero, sem="acquire", scope="sys")
        i = 0
        while (v < target) & (i < max_iters):
            v = tl.atomic_add(counter + s, zero, sem="acquire", scope="sys")
            i += 1
        if v < target:
            word = (code * 65536 + s + 1).to(tl.int64)
            tl.atomic_cas(err, zero, word, sem="relaxed", scope="gpu")


_BLOCK = 256


def put_rows(src: torch.Tensor, src_row: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
             ptrs: torch.Tensor, dest_row_bytes: int, cols: tuple[int, int] | None = None) -> None:
    """src: [N, B] uint8 (B % 4 == 0, contiguous); src_row/dest_rank/dest_row: [M] int
    (dest_row -1 = skip); ptrs: [W] int64 base addresses of [rows, dest_row_bytes] buffers."""
    if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[1] % 4 or dest_row_bytes % 4:
        raise ValueError(f"put_rows: src must be [N, B] uint8 with B % 4 == 0 and dest rows of whole words, "
                         f"got {src.dtype}{tuple(src.shape)}, dest_row_bytes={dest_row_bytes}")
    m = dest_row.shape[0]
    c0, c1 = cols if cols is not None else (0, src.shape[1])
    if c0 % 4 or c1 % 4 or not 0 <= c0 <= c1 <= min(src.shape[1], dest_row_bytes):
        raise ValueError(f"put_rows: columns [{c0}, {c1}) must be whole words inside rows of {src.shape[1]} "
                         f"(dest {dest_row_bytes}) bytes")
    if m == 0 or c1 == c0 or src.shape[0] == 0:
        return
    words = src.contiguous().view(torch.int32)
    ncols = (c1 - c0) // 4
    grid = (m, triton.cdiv(ncols, _BLOCK))
    _put_rows_kernel[grid](words, src_row.contiguous(), dest_rank.contiguous(), dest_row.contiguous(), ptrs,
                           words.shape[1], dest_row_bytes // 4, c0 // 4, ncols, BLOCK=_BLOCK)


def signal(ptrs: torch.Tensor, index: int) -> None:
    """counter[index] += 1 on every rank (ptrs: [W] int64 addresses of int64 [W] counters)."""
    _signal_kernel[(ptrs.shape[0],)](ptrs, index)


def wait(counter: torch.Tensor, epoch: torch.Tensor, lag: int, err: torch.Tensor, code: int, max_iters: int) -> None:
    """Spin (bounded) until counter[s] >= epoch - lag for every s; see the module docstring."""
    _wait_kernel[(counter.shape[0],)](counter, epoch, lag, err, code, max_iters)


def describe_error(word: int) -> str:
    """The error word -> a sentence naming the rank."""
    code, who = word >> 16, (word & 0xFFFF) - 1
    return f"rank {who} {ERR_NAMES.get(code, f'failed (code {code})')} within the bounded wait"


@dataclass
class PeerChannel:
    """One direction of traffic between W ranks (module docstring). Tensors are this rank's."""

    rank: int
    size: int
    region: torch.Tensor  # [bytes] uint8: this rank's receive region (symmetric)
    region_ptrs: torch.Tensor  # [W] int64: every rank's region base
    arrive: torch.Tensor  # [W] int64 (symmetric): arrive[s] = epochs rank s delivered here
    arrive_ptrs: torch.Tensor  # [W] int64: every rank's `arrive`
    free: torch.Tensor  # [W] int64 (symmetric): free[s] = epochs rank s has copied out of its region
    free_ptrs: torch.Tensor  # [W] int64: every rank's `free`
    epoch: torch.Tensor  # [1] int64, local: transfers begun on this channel
    err: torch.Tensor  # [1] int64, local: the error word (shared by a buffer's channels)
    max_iters: int = 1 << 22

    @property
    def capacity_bytes(self) -> int:
        return self.region.numel()

    def check_rows(self, rows: int, row_bytes: int, what: str) -> None:
        """ValueError (before any write) when `rows` rows of `row_bytes` do not fit the region."""
        if rows * row_bytes > self.capacity_bytes:
            raise ValueError(f"{what}: {rows} rows x {row_bytes} bytes = {rows * row_bytes} bytes exceed the "
                             f"receive buffer ({self.capacity_bytes} bytes); build the buffer with larger "
                             "max_tokens (or hidden / top-k / payload dtype matching the call)")

    def begin(self) -> None:
        self.epoch += 1
        wait(self.free, self.epoch, 1, self.err, ERR_FREE, self.max_iters)

    def put(self, src: torch.Tensor, src_row: torch.Tensor, dest_rank: torch.Tensor, dest_row: torch.Tensor,
            row_bytes: int, cols: tuple[int, int] | None = None) -> None:
        put_rows(src, src_row, dest_rank, dest_row, self.region_ptrs, row_bytes, cols)

    def post(self) -> None:
        signal(self.arrive_ptrs, self.rank)

    def receive(self, rows: int, row_bytes: int) -> torch.Tensor:
        """Wait for every rank's rows, copy them out -> [rows, row_bytes] uint8 (a fresh tensor)."""
        wait(self.arrive, self.epoch, 0, self.err, ERR_ARRIVE, self.max_iters)
        out = self.region[:rows * row_bytes].view(rows, row_bytes).clone()
        signal(self.free_ptrs, self.rank)
        return out
