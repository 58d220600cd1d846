"""Decode context parallelism (DCP): the KV cache of every sequence is sharded over the DCP ranks.

Layout (docs/numerics.md §8, vLLM's): with N ranks, interleave I and block size B, tokens go round-robin in
runs of I (position p lives on rank `(p // I) % N`), and each rank packs its tokens densely into
its own paged cache. The block table is shared: virtual block `p // (B*N)` (B*N tokens, B per
rank) maps to the same physical block id on every rank. `DCPLayout` holds these formulas.
With PCP > 1 (`pcp_group` given) the cache is sharded over the N = pcp * dcp ranks of the DCP
group and its PCP peers, this rank being shard `total_cp_rank = pcp_rank * dcp + dcp_rank`
(`total_cp_world_size` / `total_cp_rank` of vLLM's block table as PCP first landed, PR #28718);
the per-rank cache format is unchanged. vLLM's current main no longer shards over PCP: every PCP
rank keeps a full replica (K/V all-gathered over PCP before the write) sharded over the DCP group
alone; here that is `pcp_group=None` on every PCP rank (tests/test_dcp_vllm_layout.py checks both).

Decode step (`dcp_decode_attention`): each rank holds the query heads of its TP slice, but all
ranks of a DCP group share the same KV heads; so (1) all-gather q over the group (heads), (2)
attend every gathered head over the local KV shard -> (o, lse), (3) combine, either
  "ag_rs": all-gather the LSEs, rescale the local o by exp(lse_local - lse_global), and
           reduce-scatter over heads (each rank keeps its own heads), or
  "a2a":   one all-to-all of (o, lse) per destination head slice, then a local N-way merge.
With `pcp_group`, the DCP-combined (o, lse) of each rank is then merged over the PCP group
(all-gather of (o, lse) + a local merge; PCP peers hold the same query heads).
Shards without tokens give lse = -inf and drop out. The combine runs in fp32.

Bad tables never read another sequence's data: positions past a sequence's local length are
masked AND their gathered k/v zeroed (a NaN in the block that a masked slot points at cannot
leak in through 0 x NaN). Value checks (negative `seq_lens`, a length past the table's
capacity, a block id outside [0, num_blocks) in the used part of a table, positions past the
table) raise ValueError for CPU tensors. On CUDA they would be host syncs, so the decode path
(CUDA-graph capturable: static shapes from the table's width, no `.item()`) checks on the
device instead: such a sequence's output and lse are NaN on every rank, and `dcp_kv_insert`
skips writes to invalid blocks. With the Triton kernel (backend "triton", the "auto" choice on
CUDA) the kernel is that check: it gives NaN out and lse for the sequence on each rank that
reads a bad id or holds tokens past the table, and rank 0 (total_cp_rank 0) always does, since
it holds the first token of every virtual block; the combine (ag_rs: a NaN lse makes every
rank's scale NaN, and the reduce-scatter sums the NaN; a2a and PCP: the merge propagates a NaN
lse) makes the row NaN on every rank, the other rows unchanged. Only the torch path runs the
separate check (`_invalid_sequences`: ~10 small kernels per step). On CPU tensors the checks
are agreed over the group before any collective (`comm.input_agreement`, one all-gather of a
few ints): a bad input on one rank raises ValueError on every rank instead of leaving its peers
waiting, and so do ranks given different shapes, scale, block tables or lengths.

Cache: `PagedKVCache` with k/v `[num_blocks, B, Hkv, D]`, optionally fp8 (e4m3) with one fp32
scale per (token, kv head). The local attention here is exact torch math over gathered pages
(one query token per sequence); a paged-attention kernel can replace it behind the same call.
"""

from __future__ import annotations

import math
import numbers
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from ..comm import (GroupLike, all_gather_uneven, all_to_all_uneven, dtype_code, float_code, input_agreement,
                    reduce_scatter_uneven, resolve_group)
from ..quant import quantize
from .local_attn import masked_attention_math, resolve_scale
from .merge import MAX_RESCALE_PARTIALS, AttnState, merge_attn_states, rescale_parts_to_merged

if TYPE_CHECKING:
    from .triton_decode import LengthPlan

DCPComm = Literal["ag_rs", "a2a"]


# ---------------------------------------------------------------------------------------------
# layout


@dataclass(frozen=True)
class DCPLayout:
    """Where each token of a sequence lives in a KV cache sharded over `size` DCP ranks."""

    size: int
    """DCP group size N."""
    rank: int
    """This rank's index in the DCP group."""
    block_size: int
    """Tokens per physical cache block B (per rank)."""
    interleave: int = 1
    """Consecutive tokens per rank before moving to the next I; B % I == 0."""

    def __post_init__(self) -> None:
        for name in ("size", "rank", "block_size", "interleave"):
            value = getattr(self, name)   # (a float interleave gave float positions: zeros, no error)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank ({self.rank}) must be in [0, size) with size ({self.size}) >= 1")
        if self.block_size < 1 or self.interleave < 1:
            raise ValueError(f"block_size ({self.block_size}) and interleave ({self.interleave}) must be >= 1")
        if self.block_size % self.interleave != 0:
            valid = [i for i in range(1, self.block_size + 1) if self.block_size % i == 0]
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of interleave "
                             f"({self.interleave}); valid interleave: {valid}")

    @property
    def virtual_block(self) -> int:
        """Tokens per virtual block (B*N): one physical block on every rank."""
        return self.block_size * self.size

    def owner(self, positions: Tensor | int) -> Tensor | int:
        """DCP rank holding each position."""
        return ((positions % self.virtual_block) // self.interleave) % self.size

    def local_offset(self, positions: Tensor | int) -> Tensor | int:
        """Offset inside the owner's physical block."""
        o = positions % self.virtual_block
        return (o // (self.size * self.interleave)) * self.interleave + o % self.interleave

    def slot_mapping(self, positions: Tensor, block_table: Tensor) -> Tensor:
        """Cache slots [T] int64 of `positions` on THIS rank; -1 where another rank owns it.

        positions: [T] int; block_table: [T, max_blocks] (each token's sequence row) or
        [max_blocks] (one sequence), int32/int64 physical block ids.
        """
        positions = positions.long()
        table = block_table.long()
        vblock = positions // self.virtual_block
        if table.dim() == 1:
            blocks = table[vblock]
        else:
            blocks = table.gather(1, vblock.unsqueeze(1)).squeeze(1)
        slots = blocks * self.block_size + self.local_offset(positions)
        return torch.where(self.owner(positions) == self.rank, slots, -1)

    def global_positions(self, local_index: Tensor | int) -> Tensor | int:
        """Global positions of this rank's tokens of a sequence, by their index in the rank's cache
        order (its blocks in table order): the inverse of `slot_mapping` over one sequence."""
        i = self.interleave
        return (local_index // i) * (i * self.size) + self.rank * i + local_index % i

    def local_lengths(self, seq_lens: Tensor | int) -> Tensor | int:
        """Tokens of each sequence held by this rank (`seq_lens` = global lengths)."""
        per_round = self.interleave * self.size
        base = (seq_lens // per_round) * self.interleave
        rem = seq_lens - base * self.size - self.rank * self.interleave
        if isinstance(rem, Tensor):
            return base + rem.clamp(0, self.interleave)
        return base + min(max(rem, 0), self.interleave)


def _layout(group: GroupLike, block_size: int, interleave: int, pcp_group: GroupLike | None = None) -> DCPLayout:
    """This rank's shard of the cache: the DCP group's, or (pcp_group) the pcp * dcp shards'."""
    _, rank, size = resolve_group(group)
    if pcp_group is not None:
        _, pcp_rank, pcp_size = resolve_group(pcp_group)
        rank, size = pcp_rank * size + rank, pcp_size * size       # total_cp_rank, total_cp_world_size
    return DCPLayout(size=size, rank=rank, block_size=block_size, interleave=interleave)


def _bad_block_ids(ids: Tensor, num_blocks: int) -> Tensor:
    return (ids < 0) | (ids >= num_blocks)


def _invalid_sequences(block_table: Tensor, seq_lens: Tensor, layout: DCPLayout, num_blocks: int) -> Tensor:
    """[S] bool: sequences whose length or used block ids are invalid. On CPU tensors, raises
    ValueError naming the first one instead (on CUDA that would be a host sync).

    block_table: [S, W] int; seq_lens: [S] int global lengths. Used blocks of a sequence: the
    virtual blocks 0 .. ceil(len / (B*N)) - 1 (the same on every rank of the group)."""
    lens, table = seq_lens.long(), block_table.long()
    width, vb = table.shape[1], layout.virtual_block
    capacity = width * vb
    used = torch.arange(width, device=table.device) < ((lens.clamp(0, capacity) + vb - 1) // vb).unsqueeze(1)
    bad_ids = used & _bad_block_ids(table, num_blocks)                            # [S, W]
    bad = (lens < 0) | (lens > capacity) | bad_ids.any(dim=1)
    if table.device.type == "cpu" and bool(bad.any()):
        s = int(bad.nonzero()[0, 0])
        n = int(lens[s])
        if n < 0:
            raise ValueError(f"seq_lens must be >= 0; seq_lens[{s}] = {n}")
        if n > capacity:
            raise ValueError(f"seq_lens[{s}] = {n} exceeds the block table's capacity: {width} blocks x "
                             f"{vb} tokens (block_size {layout.block_size} x {layout.size} ranks) = {capacity}")
        j = int(bad_ids[s].nonzero()[0, 0])
        raise ValueError(f"block_table[{s}, {j}] = {int(table[s, j])} is outside the cache's blocks [0, {num_blocks}) "
                         f"(virtual block {j} is used by a sequence of length {n})")
    return bad


def _kernel_reports_bad_tables(backend: str, device: torch.device) -> bool:
    """The local attention reports bad tables itself, so `_invalid_sequences` is not run: the Triton
    kernel off the CPU (NaN out and lse for a used block id outside the cache, a length past the
    table or a negative length, on the ranks that read the id or hold the tokens; nothing outside
    the table or cache read). CPU tensors keep the check for its ValueError; the torch path (which
    only masks) keeps it to make the rows NaN."""
    return backend == "triton" and device.type != "cpu"


# ---------------------------------------------------------------------------------------------
# cache


@dataclass
class PagedKVCache:
    """One rank's paged KV cache. fp8 caches carry per-(token, kv head) fp32 scales."""

    k: Tensor
    """[num_blocks, block_size, kv_heads, head_dim]; fp32/bf16/fp16 or float8_e4m3fn."""
    v: Tensor
    """[num_blocks, block_size, kv_heads, head_dim_v]; same dtype as k."""
    k_scale: Tensor | None = None
    """[num_blocks, block_size, kv_heads] fp32 when fp8, else None."""
    v_scale: Tensor | None = None

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 head_dim_v: int | None = None) -> "PagedKVCache":
        """Zeroed cache; `dtype=torch.float8_e4m3fn` adds the scale tensors."""
        dv = head_dim if head_dim_v is None else head_dim_v
        k = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        v = torch.zeros(num_blocks, block_size, kv_heads, dv, dtype=dtype, device=device)
        if dtype == torch.float8_e4m3fn:
            ones = torch.ones(num_blocks, block_size, kv_heads, dtype=torch.float32, device=device)
            return cls(k, v, ones, ones.clone())
        return cls(k, v)

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.v.dim() != 4 or self.k.shape[:3] != self.v.shape[:3]:
            raise ValueError(f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must be "
                             f"[num_blocks, block_size, kv_heads, head_dim] with equal leading dims")
        if self.is_fp8 != (self.k_scale is not None and self.v_scale is not None):
            given = [n for n, t in (("k_scale", self.k_scale), ("v_scale", self.v_scale)) if t is not None]
            raise ValueError(f"an fp8 cache needs k_scale and v_scale; other dtypes take none (dtype {self.k.dtype}, "
                             f"given: {given or 'none'})")
        if self.v.dtype != self.k.dtype:   # (an fp8 v beside a bf16 k would be read without its scales)
            raise ValueError(f"k and v must have the same dtype, got k {self.k.dtype} and v {self.v.dtype}")
        if self.v.device != self.k.device:
            raise ValueError(f"k on {self.k.device} but v on {self.v.device}")
        for name, sc in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if sc is not None and (tuple(sc.shape) != tuple(self.k.shape[:3]) or sc.dtype != torch.float32
                                   or sc.device != self.k.device):
                raise ValueError(f"{name} must be float32 {tuple(self.k.shape[:3])} (k's [num_blocks, block_size, "
                                 f"kv_heads]) on {self.k.device}, got {tuple(sc.shape)} {sc.dtype} on {sc.device}")

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype == torch.float8_e4m3fn

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]


def _quantize_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-(token, head) scale (parallel.quant "fp8_token" over D): x [T, H, D] -> (fp8 [T, H, D],
    scale [T, H] fp32)."""
    q = quantize(x, "fp8_token", backend="torch")
    return q.data, q.scale.squeeze(-1)


def dcp_kv_insert(cache: PagedKVCache, k: Tensor, v: Tensor, positions: Tensor, block_table: Tensor,
                  group: GroupLike = None, *, interleave: int = 1, pcp_group: GroupLike | None = None) -> Tensor:
    """Write the K/V of new tokens into this rank's shard of the cache (tokens it owns only).

    k: [T, Hkv, D], v: [T, Hkv, Dv] (every DCP rank passes the same new tokens); positions: [T]
    int global positions; block_table: [T, max_blocks] or [max_blocks]. fp8 caches quantize with
    a per-(token, head) scale. pcp_group: the PCP group when the cache is sharded over
    pcp * dcp ranks (None: over `group` alone). Returns the slots used [T] int64 (-1 = owned
    elsewhere, or not written: invalid on CUDA). ValueError (CPU tensors) for a position outside
    the table or a block id outside [0, num_blocks).
    """
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, kv_heads, head_dim]")
    if k.shape[1:] != cache.k.shape[2:] or v.shape[1:] != cache.v.shape[2:]:
        raise ValueError(f"new k/v heads and dims {tuple(k.shape[1:])}/{tuple(v.shape[1:])} do not match the "
                         f"cache's {tuple(cache.k.shape[2:])}/{tuple(cache.v.shape[2:])}")
    if positions.shape != k.shape[:1]:
        raise ValueError(f"positions {tuple(positions.shape)} must be [T] with T = {k.shape[0]}")
    if k.device != cache.k.device or v.device != cache.k.device:
        raise ValueError(f"new k on {k.device}, v on {v.device}, but the cache is on {cache.k.device}")
    layout = _layout(group, cache.block_size, interleave, pcp_group)
    slots = insert_slots(layout, positions.to(k.device), block_table.to(k.device), cache.k.shape[0])
    write_kv_slots(cache, k, v, slots)
    return slots


def insert_slots(layout: DCPLayout, positions: Tensor, block_table: Tensor, num_blocks: int) -> Tensor:
    """Cache slots [T] int64 of new tokens on this rank (`layout`), -1 where another rank owns the
    position or (CUDA) where it is invalid, so nothing is written there.

    positions: [T] int global; block_table: [max_blocks] or [T, max_blocks] int. ValueError (CPU
    tensors) for a position outside the table or a block id outside [0, num_blocks), and (any
    device) for positions or a table that are not integers."""
    for name, t in (("positions", positions), ("block_table", block_table)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:   # (.long() truncated)
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    positions, table = positions.long(), block_table.long()
    if table.dim() not in (1, 2) or (table.dim() == 2 and table.shape[0] != positions.shape[0]):
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [max_blocks] or [T, max_blocks] with "
                         f"T = {positions.shape[0]}")
    width = table.shape[-1]
    vblock = positions // layout.virtual_block
    in_table = (positions >= 0) & (vblock < width)
    rows = table.expand(positions.shape[0], width) if table.dim() == 1 else table
    if width == 0:   # no block: every position is outside the table (a gather would index past it)
        rows = torch.full((positions.shape[0], 1), -1, dtype=torch.long, device=positions.device)
    ids = rows.gather(1, torch.where(in_table, vblock, 0).unsqueeze(1)).squeeze(1)          # [T]
    bad = ~in_table | _bad_block_ids(ids, num_blocks)
    if positions.device.type == "cpu" and bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        p = int(positions[t])
        if not in_table[t]:
            raise ValueError(f"positions[{t}] = {p} is outside the block table: positions must lie in "
                             f"[0, {width} blocks x {layout.virtual_block} tokens = {width * layout.virtual_block})")
        raise ValueError(f"block id {int(ids[t])} of positions[{t}] = {p} (virtual block {p // layout.virtual_block}) "
                         f"is outside the cache's blocks [0, {num_blocks})")
    # CUDA: an invalid token is not written (no host sync); the decode reports its sequence as NaN.
    slots = layout.slot_mapping(torch.where(in_table, positions, 0), rows)
    return torch.where(bad, -1, slots)


def skip_free_slots(slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Slots [T] int64 with -1 = skip, as a write with no skipped row and no host sync (a boolean
    mask's data-dependent shape would sync, and a decode step's graph could not capture it):
    (targets [T] >= 0, source token [T] of each row, whether any token is written). A skipped
    token writes the first written token's row again with that token's values (the duplicate
    writes carry the same bytes); where none is written, every row targets slot 0, and the caller
    writes slot 0's own contents back (`keep`)."""
    valid = slots >= 0
    first = torch.argmax(valid.to(torch.int32))          # the first written token (0 if none)
    src = torch.where(valid, torch.arange(slots.shape[0], device=slots.device), first)
    return slots[src].clamp_min(0), src, valid.any()


def keep(any_written: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """`new`, or where no token is written (`skip_free_slots`) the slot's `old` contents."""
    return torch.where(any_written, new, old)


def write_kv_slots(cache: PagedKVCache, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """Store k [T, Hkv, D] / v [T, Hkv, Dv] at cache slots [T] int64 (-1 = skip); fp8 quantizes.
    No host sync (`skip_free_slots`): a decode step's insert is captured with the step."""
    if slots.numel() == 0:
        return
    idx, src, written = skip_free_slots(slots)
    # (block, offset) indexing, not a flat view: a strided cache (k = kv[:, 0] of a joint buffer) has none
    blk, off = idx // cache.block_size, idx % cache.block_size
    if cache.is_fp8:   # fp8 indexing kernels are patchy across devices: move the bytes as uint8
        kq, ks = _quantize_fp8(k[src])
        vq, vs = _quantize_fp8(v[src])
        k8, v8 = cache.k.view(torch.uint8), cache.v.view(torch.uint8)
        k8[blk, off] = keep(written, kq.view(torch.uint8), k8[blk, off])
        v8[blk, off] = keep(written, vq.view(torch.uint8), v8[blk, off])
        cache.k_scale[blk, off] = keep(written, ks, cache.k_scale[blk, off])
        cache.v_scale[blk, off] = keep(written, vs, cache.v_scale[blk, off])
    else:
        cache.k[blk, off] = keep(written, k[src].to(cache.k.dtype), cache.k[blk, off])
        cache.v[blk, off] = keep(written, v[src].to(cache.v.dtype), cache.v[blk, off])


# ---------------------------------------------------------------------------------------------
# decode


def gather_local_kv(cache: PagedKVCache, block_table: Tensor, local_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's KV of each sequence, densely: k [S, L, Hkv, D], v [S, L, Hkv, Dv] (dequantized
    to fp32 for fp8 caches), valid [S, L] bool. L = the table's capacity `max_blocks * B` on CUDA
    (static: no host sync, capturable), the longest local length on the CPU. Positions that are
    not valid (past a length, or in a block id outside the cache) read zeros, never cache data."""
    s, width = block_table.shape
    bs = cache.block_size
    dev = cache.k.device
    if dev.type == "cpu":
        longest = min(int(local_lens.max()) if s > 0 else 0, width * bs)
    else:
        longest = width * bs
    idx = torch.arange(longest, device=dev)
    table = block_table.long()
    ids = table.gather(1, (idx // bs).unsqueeze(0).expand(s, -1))                        # [S, L]
    valid = (idx.unsqueeze(0) < local_lens.unsqueeze(1)) & ~_bad_block_ids(ids, cache.k.shape[0])
    # (block, offset) indexing, not a flat view: a strided cache (k = kv[:, 0] of a joint buffer) has none
    blk, off = torch.where(valid, ids, 0), idx % bs                                    # [S, L], [L]
    if cache.is_fp8:
        k = cache.k.view(torch.uint8)[blk, off].view(cache.k.dtype).float()
        v = cache.v.view(torch.uint8)[blk, off].view(cache.v.dtype).float()
        k = k * cache.k_scale[blk, off].unsqueeze(-1)
        v = v * cache.v_scale[blk, off].unsqueeze(-1)
    else:
        k, v = cache.k[blk, off], cache.v[blk, off]
    keep = valid[:, :, None, None]                       # masked slots read slot 0: zero what they read
    return torch.where(keep, k, 0), torch.where(keep, v, 0), valid


def local_decode_attention(q: Tensor, cache: PagedKVCache, block_table: Tensor, local_lens: Tensor,
                           scale: float) -> AttnState:
    """Attention of one query token per sequence over this rank's cached tokens.

    q: [S, Hq, D]; block_table: [S, max_blocks]; local_lens: [S] tokens held here. Returns
    AttnState(out [S, Hq, Dv] fp32, lse [S, Hq] fp32), lse -inf where a sequence has no token here.
    """
    k, v, valid = gather_local_kv(cache, block_table, local_lens)
    out, lse = masked_attention_math(q.float().unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), scale,
                                     valid[:, None, None, None, :])
    return AttnState(out.squeeze(2), lse.squeeze(2))


_DECODE_FIELDS = ("sequences", "local query heads", "head_dim", "v head_dim", "kv heads", "block_size",
                  "block_table width", "interleave", "comm", "same_heads", "scale", "q dtype", "cache dtype",
                  "seq_lens checksum", "block_table checksum")
_KINDS = {"scale": "float", "q dtype": "dtype", "cache dtype": "dtype"}


def _checksum(t: Tensor) -> int:
    return zlib.crc32(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())


def _decode_fields(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, interleave: int,
                   comm: str, same_heads: bool, scale: float) -> list[int]:
    """The ints every rank of a DCP decode step must agree on (CPU: the table's and lengths'
    contents too, since every rank must be given the same ones)."""
    return [q.shape[0], q.shape[1], q.shape[2], cache.v.shape[-1], cache.kv_heads, cache.block_size,
            block_table.shape[1], interleave, int(comm == "a2a"), int(bool(same_heads)), float_code(scale),
            dtype_code(q.dtype), dtype_code(cache.k.dtype), _checksum(seq_lens), _checksum(block_table)]


def _check_decode_call(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, group: GroupLike,
                       interleave: int, comm: str, scale: float | None, same_heads: bool, backend: str,
                       pcp_group: GroupLike | None, plan: LengthPlan | None = None
                       ) -> tuple[DCPLayout, int, str, Tensor | None, float]:
    """`dcp_decode_attention`'s checks, all before any collective: (layout, local heads, backend,
    the invalid-sequence mask or None, scale); ValueError for bad input (a plan made for another
    call's shapes or layout among it)."""
    if comm not in ("ag_rs", "a2a"):
        raise ValueError(f"comm must be 'ag_rs' or 'a2a', got {comm!r}")
    if q.dim() != 3 or q.shape[-1] != cache.k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} must be [S, heads, head_dim] with head_dim {cache.k.shape[-1]}")
    if q.device != cache.k.device:
        raise ValueError(f"q on {q.device} but the cache is on {cache.k.device}")
    if block_table.shape[0] != q.shape[0] or seq_lens.shape != q.shape[:1]:
        raise ValueError(f"block_table {tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)} must "
                         f"have one row per sequence ({q.shape[0]})")
    if block_table.dim() != 2:
        raise ValueError(f"block_table {tuple(block_table.shape)} must be [S, max_blocks]")
    layout = _layout(group, cache.block_size, interleave, pcp_group)
    _, _, size = resolve_group(group)
    from .paged import check_paged_inputs, check_plan, resolve_backend

    heads = q.shape[1]
    if same_heads and heads % cache.kv_heads != 0:
        raise ValueError(f"with same_heads, local query heads ({heads}) must be a multiple of the cache's "
                         f"kv heads ({cache.kv_heads})")
    if (heads * size) % cache.kv_heads != 0:
        raise ValueError(f"gathered query heads ({heads} x dcp {size} = {heads * size}) must be a multiple of the "
                         f"cache's kv heads ({cache.kv_heads})")
    # the local attention's shape / dtype / cache checks before any collective (its values: just below)
    check_paged_inputs(q[:, None, :1].expand(-1, -1, heads * size, -1), cache, block_table, seq_lens, layout,
                       validate=False)
    chosen = resolve_backend(q, cache, backend)
    if plan is not None:        # (the gathered queries' shape: no value is read)
        check_plan(plan, q.new_empty(q.shape[0], 1, heads * size, q.shape[-1]), cache, block_table.to(q.device),
                   layout)
    if _kernel_reports_bad_tables(chosen, q.device):
        invalid = None            # the kernel's NaN rows, carried to every rank by the combine below
    else:
        invalid = _invalid_sequences(block_table.to(q.device), seq_lens.to(q.device), layout, cache.k.shape[0])
    scale = resolve_scale(scale, q.shape[-1])           # ValueError unless finite (NaN: every row NaN)
    return layout, heads, chosen, invalid, scale


_OUT_DTYPES = (torch.float16, torch.bfloat16)


def dcp_decode_attention(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor,
                         group: GroupLike = None, *, interleave: int = 1, comm: DCPComm = "ag_rs",
                         scale: float | None = None, return_lse: bool = False, same_heads: bool = False,
                         backend: str = "auto", pcp_group: GroupLike | None = None,
                         plan: "LengthPlan | None" = None) -> Tensor | AttnState:
    """One decode step over a DCP-sharded KV cache.

    q: [S, Hq_local, D], this rank's query heads (one token per sequence); the group's gathered
    heads (N * Hq_local) must be a multiple of the cache's kv heads. block_table: [S, max_blocks]
    int; seq_lens: [S] int global lengths (including the token being decoded, already inserted).
    comm: "ag_rs" (all-gather LSE + reduce-scatter) or "a2a" (all-to-all + local merge).
    same_heads: every rank of `group` holds the SAME query heads (e.g. PCP peers passed as the
    group, so the ranks differ only in which tokens their cache holds); each rank's Hq_local
    heads then map onto the cache's kv heads by themselves. False (vLLM's TP-carved DCP): the
    group's gathered heads are consecutive global heads sharing the cache's kv heads.
    backend: the local attention, "auto" | "torch" | "triton" (op "cp.decode", `paged.py`).
    pcp_group: with PCP > 1, the PCP group; the cache is then sharded over pcp * dcp ranks
    (vLLM's total_cp_rank) and the partial results are merged over both groups. None: the
    cache is sharded over `group` alone.
    plan: the length plan of this rank's local call (`plan_dcp_decode`, made once a decode step and
    given to every layer's call): its splits cut from the lengths (`paged.plan_paged_decode`).
    Returns out [S, Hq_local, Dv] in q's dtype (or AttnState with lse [S, Hq_local] fp32).
    ValueError (CPU tensors; NaN rows on CUDA on every rank, see the module docstring) for
    negative seq_lens, a length past the table's capacity, or a used block id outside the cache.
    """
    _, rank, size = resolve_group(group)
    pcp_size = 1 if pcp_group is None else resolve_group(pcp_group)[2]
    agree = q.device.type == "cpu" and size * pcp_size > 1      # (on CUDA the agreement would be a host sync)
    error = fields = None
    try:   # a bad input on one rank must not leave the others waiting in the collectives below
        layout, heads, chosen, invalid, scale = _check_decode_call(
            q, cache, block_table, seq_lens, group, interleave, comm, scale, same_heads, backend, pcp_group, plan)
        fields = _decode_fields(q, cache, block_table, seq_lens, interleave, comm, same_heads, scale) if agree else None
    except ValueError as exc:
        if not agree:
            raise
        error = str(exc)
    if agree:
        message = input_agreement("dcp_decode_attention", _DECODE_FIELDS, fields, error, group, q.device, _KINDS)
        if pcp_size > 1:   # every PCP group holds a rank of each DCP group: a failed one reaches them all
            message = input_agreement("dcp_decode_attention (PCP)", _DECODE_FIELDS, fields, message, pcp_group,
                                      q.device, _KINDS)
        if message is not None:
            raise ValueError(message)
    from .paged import paged_decode_attention

    q_all = all_gather_uneven(q.contiguous(), group, dim=1, sizes=[heads] * size)       # [S, N*Hq, D]
    s_len, hkv = q.shape[0], cache.kv_heads
    if same_heads and hkv > 1 and size > 1:
        # [S, N, Hkv, G, D] -> kv-head-major so the plain GQA mapping (head // (N*G)) picks kv head j.
        q_all = q_all.view(s_len, size, hkv, heads // hkv, -1).transpose(1, 2).reshape(s_len, size * heads, -1)
    # (values: checked above, a ValueError on CPU, or reported by the kernel). The ag_rs combine takes
    # the split-KV kernel's splits unmerged: their merge and its rescale are one kernel
    # (`rescale_parts_to_merged`); the other combines exchange one state a rank.
    fused = comm == "ag_rs" and size > 1
    # (one rank and no PCP merge after it: the local out is the result, written in q's dtype at once)
    last = size == 1 and layout.size == size
    parts = paged_decode_attention(q_all, cache, block_table.to(q.device), seq_lens.to(q.device), layout=layout,
                                   scale=scale, backend=chosen, validate=False, merge=not fused,
                                   out_dtype=q.dtype if last and q.dtype in _OUT_DTYPES else torch.float32, plan=plan)
    if not fused:
        parts = AttnState(parts.out.unsqueeze(0), parts.lse.unsqueeze(0))
    elif parts.lse.shape[0] * size > MAX_RESCALE_PARTIALS:     # (more splits than one kernel merges)
        parts = merge_attn_states(parts.out, parts.lse)
        parts = AttnState(parts.out.unsqueeze(0), parts.lse.unsqueeze(0))
    # [S, N * Hq, ...] of the kernel's head order back to the group's, once a rank holds one state (the
    # rescale is per row, and every rank's rows are in the same order)
    back = None
    if same_heads and hkv > 1 and size > 1:
        back = lambda t: t.view(s_len, hkv, size, heads // hkv, *t.shape[2:]).transpose(1, 2).reshape(
            s_len, size * heads, *t.shape[2:])
    if size == 1:
        state = AttnState(parts.out[0], parts.lse[0])
    elif comm == "ag_rs":
        lses = all_gather_uneven(parts.lse.unsqueeze(0).contiguous(), group, dim=0, sizes=[1] * size)
        scaled = rescale_parts_to_merged(parts.out, lses, rank)      # (one kernel on CUDA)
        if back is not None:
            scaled = AttnState(back(scaled.out), back(scaled.lse))
        out = reduce_scatter_uneven(scaled.out, [heads] * size, group, dim=1)
        state = AttnState(out, scaled.lse[:, rank * heads:(rank + 1) * heads])
    else:
        local = AttnState(parts.out[0], parts.lse[0])
        if back is not None:
            local = AttnState(back(local.out), back(local.lse))
        s, dv = q.shape[0], local.out.shape[-1]
        packed = torch.cat([local.out, local.lse.unsqueeze(-1)], dim=-1)                  # [S, N*Hq, Dv+1]
        send = packed.view(s, size, heads, dv + 1).transpose(0, 1).reshape(size * s, heads, dv + 1)
        recv, _ = all_to_all_uneven(send, [s] * size, group, recv_splits=[s] * size)
        recv = recv.view(size, s, heads, dv + 1)
        state = merge_attn_states(recv[..., :dv], recv[..., dv])
    if pcp_group is not None and layout.size > size:      # PCP peers: same heads, other token shards
        dv = state.out.shape[-1]
        packed = torch.cat([state.out.float(), state.lse.unsqueeze(-1)], dim=-1).unsqueeze(0)   # [1, S, Hq, Dv+1]
        parts = all_gather_uneven(packed.contiguous(), pcp_group, dim=0, sizes=[1] * (layout.size // size))
        state = merge_attn_states(parts[..., :dv], parts[..., dv])
    out, lse = state.out, state.lse
    if invalid is not None:                                # device-side report of invalid inputs (CUDA, torch path)
        bad = invalid[:, None]
        out = torch.where(bad[..., None], math.nan, out)
        lse = torch.where(bad, math.nan, lse)
    out = out.to(q.dtype)
    return AttnState(out, lse) if return_lse else out


def plan_dcp_decode(q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, group: GroupLike = None,
                    *, interleave: int = 1, backend: str = "auto", pcp_group: GroupLike | None = None) -> "LengthPlan":
    """The length plan of `dcp_decode_attention`'s local call on this rank (`paged.plan_paged_decode`
    for the group's gathered query heads over this rank's shard; q: this rank's [S, Hq_local, D], the
    other arguments as that call's). One kernel launch, nothing read on the host and no collective:
    make it once a decode step, after the lengths are written, and give it to every layer's call
    (plan=)."""
    from .paged import plan_paged_decode

    if q.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)} must be [S, Hq_local, D], as dcp_decode_attention's")
    size = resolve_group(group)[2]
    layout = _layout(group, cache.block_size, interleave, pcp_group)
    # (the gathered heads' shape and dtype, as the call's all-gather makes them: no value is read)
    gathered = q.new_empty(q.shape[0], size * q.shape[1], q.shape[2])
    return plan_paged_decode(gathered, cache, block_table.to(q.device), seq_lens.to(q.device), layout=layout,
                             backend=backend, validate=False)
