"""MLA absorbed decode as a warp-specialized Gluon kernel for Hopper (sm_90): one program per
(sequence, 64-head tile, split) of a bf16 latent cache, three partitions sharing one CTA:

- the loader (4 warps) brings the 64 heads' queries once and each 64-key tile of the latent
  (576 wide: nine 64-column boxes) into a ring of `STAGES` shared-memory stages by TMA; the
  last tile of a split that ends inside it is loaded through masked loads instead, so that
  the cache's rows past the sequence (anything may be there) enter as zeros;
- warpgroup 0 computes the scores S = Q K^T (wgmma over the nine boxes), the online softmax,
  publishes the weights P (bf16) and the rescale factors of the tile in shared memory, and
  accumulates output dims [0, 256) as P V;
- warpgroup 1 accumulates output dims [256, 512) from the same P, so that one warpgroup's
  P V runs on the tensor cores while the other computes the next tile's scores and softmax.

Outputs are the split's partial (out, lse) in the layout `triton_decode.paged_decode_triton`
writes (the split merge follows). `triton_decode` takes it where `gluon_mla_ok` holds (bf16
queries, a bf16 or fp8 latent cache in the layout of `_halves_ok`, one query token, heads a
multiple of 64 or fewer than 64 (one head tile whose padding rows are never stored), pages a
multiple of 64, an sm_90 GPU with Gluon) and CONFIG gluon_wide / gluon_wide_fp8 /
gluon_wide_narrow(_fp8) say so. Over fp8 a converter warpgroup replaces the TMA loader: it writes
each tile as fp16 (exact for e4m3) with its per-token scales beside it, and the queries as fp16
times a power of two per row; warpgroup 0 keeps the weights in a running per-row unit. The
converter reads 64-key tiles' bytes itself into two fp16 stages, or (CONFIG raw_ring_wide_fp8) from a
ring of raw fp8 tiles that a one-warp TMA loader fills, in front of CONFIG ring_wide_fp8 fp16 stages
of CONFIG keys_wide_fp8 keys (32-key tiles: two fp16 stages fit beside the queries, so the converter
writes the next tile while the warpgroups read this one; one 64-key stage made it wait for them)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .triton_common import local_len as _dcp_local_len
    from .triton_common import work_item as _work_item
    HAS_GLUON = True
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

_BLOCK, _CHUNKS, _VCHUNKS = 64, 9, 4     # (the host's ints of the kernel's constants below)
TILE = _BLOCK                             # keys a tile and heads a program (fewer heads: padded rows)

if HAS_GLUON:
    BLOCK = gl.constexpr(64)       # heads a program, keys a tile, columns a box
    CHUNKS = gl.constexpr(9)       # 576 / 64: boxes of the latent + rope key
    VCHUNKS = gl.constexpr(4)      # boxes of output dims per warpgroup (2 x 4 x 64 = 512)
    STAGES = gl.constexpr(2)
    IDS_L = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))   # a warpgroup's BLOCK early block ids
else:  # pragma: no cover
    BLOCK, CHUNKS, VCHUNKS, STAGES = 64, 9, 4, 2

if HAS_GLUON:
    @gluon.jit
    def _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, PAGE: gl.constexpr,
                     KEYS: gl.constexpr = 64):
        """(start, end, tiles of KEYS keys, bad) of this split: bad where the length is negative, past the
        table or past what the grid's splits reach (program_id(1) is the split: a length past the
        max_seq_len the grid was sized by, whose tail no split would read)."""
        local = _dcp_local_len(glens_ptr, s, dcp_size, dcp_rank, interleave)
        start = split * split_len
        end = gl.minimum(gl.minimum(start + split_len, local), table_w * PAGE)
        bad = (gl.load(glens_ptr + s) < 0) | (local > table_w * PAGE) | (local > gl.num_programs(1) * split_len)
        tiles = (gl.maximum(end - start, 0) + KEYS - 1) // KEYS
        return start, end, tiles, bad

    @gluon.jit
    def _gdc_wait_and_release():
        """Programmatic dependent launch: wait for the kernel before this one on the stream (its writes
        visible), then let the next one launch (it waits for this one in turn)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _block_of(table_ptr, s, st_s, j0, has, num_blocks, PAGE: gl.constexpr):
        """The cache block of the tile at local token j0 (0 where `has` is false or the id lies outside
        [0, num_blocks): no load leaves the cache; the consumer reports a bad id)."""
        blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE, mask=has, other=0)
        return gl.where((blk >= 0) & (blk < num_blocks), blk, 0)

    @gluon.jit
    def _ids_window(table_ptr, s, st_s, start, tiles, num_blocks, PAGE: gl.constexpr):
        """The block ids of a split's first four tiles (a loader's window of ids loaded ahead)."""
        return (_block_of(table_ptr, s, st_s, start, tiles > 0, num_blocks, PAGE),
                _block_of(table_ptr, s, st_s, start + BLOCK, tiles > 1, num_blocks, PAGE),
                _block_of(table_ptr, s, st_s, start + 2 * BLOCK, tiles > 2, num_blocks, PAGE),
                _block_of(table_ptr, s, st_s, start + 3 * BLOCK, tiles > 3, num_blocks, PAGE))

    @gluon.jit
    def _table_tiles(start, table_w, PAGE: gl.constexpr):
        """Tiles from local token `start` to the block table's end: a bound on a split's tiles that
        needs no length, so a loader's `_ids_window` under it goes out beside the length's load (one
        memory round trip fewer before its first TMA; ids past the split's end are never used)."""
        return (table_w * PAGE - start + BLOCK - 1) // BLOCK

    @gluon.jit
    def _ids_next(b1, b2, b3, b4, table_ptr, s, st_s, j0, t, tiles, num_blocks, PAGE: gl.constexpr):
        """(tile t's id, the window moved on: tile t + 4's id starts loading)."""
        return b1, b2, b3, b4, _block_of(table_ptr, s, st_s, j0 + 4 * BLOCK, t + 4 < tiles, num_blocks, PAGE)

    @gluon.jit
    def _window_start(table_ptr, glens_ptr, s, st_s, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                      num_blocks, PAGE: gl.constexpr, AHEAD: gl.constexpr):
        """A direct loader's (start, tiles) of its split and its first `_ids_window` (AHEAD: loaded beside
        the sequence's length, bounded by `_table_tiles`; else after it, bounded by the split's tiles)."""
        if AHEAD:
            first = split * split_len
            b1, b2, b3, b4 = _ids_window(table_ptr, s, st_s, first, _table_tiles(first, table_w, PAGE), num_blocks,
                                         PAGE)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        if not AHEAD:
            b1, b2, b3, b4 = _ids_window(table_ptr, s, st_s, start, tiles, num_blocks, PAGE)
        return start, tiles, b1, b2, b3, b4

    @gluon.jit
    def _window_tile(b1, b2, b3, b4, table_ptr, s, st_s, start, t, tiles, num_blocks, raw_free, PAGE: gl.constexpr,
                     RAW: gl.constexpr):
        """A direct loader's tile t: (its raw stage, its first local token, its block id, the window moved
        on: `_ids_next`), once its raw stage's last tile is consumed (raw_free)."""
        rs = t % RAW
        j0 = start + t * BLOCK
        blk, b1, b2, b3, b4 = _ids_next(b1, b2, b3, b4, table_ptr, s, st_s, j0, t, tiles, num_blocks, PAGE)
        if t >= RAW:
            mbarrier.wait(raw_free.index(rs), ((t // RAW) - 1) & 1)
        return rs, j0, blk, b1, b2, b3, b4

    @gluon.jit
    def _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE: gl.constexpr, layout: gl.constexpr):
        """Whether any block id of the split's pages [start, end) lies outside [0, num_blocks): read once
        after the loop (the loaders clamp the ids they load), not a load a tile in the consumer's loop."""
        idx = gl.arange(0, BLOCK, layout=layout)
        last = (end + PAGE - 1) // PAGE
        bad = gl.zeros([BLOCK], gl.int32, layout)
        for p0 in range(start // PAGE, last, BLOCK):
            page = p0 + idx
            blk = gl.load(table_ptr + s.to(gl.int64) * st_s + page, mask=page < last, other=0)
            bad = bad | ((blk < 0) | (blk >= num_blocks)).to(gl.int32)
        return gl.max(bad, 0) > 0

    @gluon.jit
    def _ids_early(table_ptr, s, st_s, first, table_w, PAGE: gl.constexpr, layout: gl.constexpr):
        """The block ids of the first BLOCK pages from local token `first` (a split's start, known before
        the sequence's length), bounded by the table's width: loaded beside the length's load, checked
        after the loop by `_bad_ids_after` (CONFIG ids_ahead), so the check's memory round trip leaves
        the chain before the first tile."""
        page = first // PAGE + gl.arange(0, BLOCK, layout=layout)
        return gl.load(table_ptr + s.to(gl.int64) * st_s + page, mask=page < table_w, other=0)

    @gluon.jit
    def _bad_ids_after(early, table_ptr, s, st_s, start, end, num_blocks, PAGE: gl.constexpr,
                       layout: gl.constexpr):
        """`_bad_ids` with the split's first BLOCK pages' ids already loaded (`_ids_early` from `start`):
        the pages past those (splits of more than BLOCK pages) are loaded here."""
        idx = gl.arange(0, BLOCK, layout=layout)
        last = (end + PAGE - 1) // PAGE
        p0 = start // PAGE
        bad = ((p0 + idx < last) & ((early < 0) | (early >= num_blocks))).to(gl.int32)
        for p1 in range(p0 + BLOCK, last, BLOCK):
            page = p1 + idx
            blk = gl.load(table_ptr + s.to(gl.int64) * st_s + page, mask=page < last, other=0)
            bad = bad | ((blk < 0) | (blk >= num_blocks)).to(gl.int32)
        return gl.max(bad, 0) > 0

    @gluon.jit
    def _softmax_step(sc, m_i, l_i, r_i, w, AXIS: gl.constexpr, FP8: gl.constexpr, DEFER: gl.constexpr = False):
        """One online-softmax step over masked base-2 scores sc, the queries along 1 - AXIS and the keys
        along AXIS: (weights p, the accumulator's rescale alpha, new m, l, r). FP8: the weights times
        the keys' value scales w, over a running per-query unit r (the largest weight so far: fp16
        holds them), alpha then carries the unit's change too. DEFER: l_i is sc's shape, the sums of
        each key position's weights, reduced over the keys once at the end (no cross-warp sum a
        step where the keys span the warpgroup's warps)."""
        m_new = gl.maximum(m_i, gl.max(sc, AXIS))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - gl.expand_dims(m_safe, AXIS))
        alpha = gl.exp2(m_i - m_safe)
        if DEFER:
            l_i = l_i * gl.expand_dims(alpha, AXIS) + p
        else:
            l_i = l_i * alpha + gl.sum(p, AXIS)
        if FP8:
            p = p * gl.expand_dims(w, 1 - AXIS)
            r_new = gl.maximum(r_i * alpha, gl.max(p, AXIS))
            inv = 1.0 / gl.where(r_new > 0, r_new, 1.0)
            alpha = r_i * alpha * inv
            p = p * gl.expand_dims(inv, AXIS)
            r_i = r_new
        return p, alpha, m_new, l_i, r_i

    @gluon.jit
    def _finish(m_i, l_i, r_i, bad, FP8: gl.constexpr):
        """(the output's factor: 1 / l, r / l over fp8, NaN for a bad table; the lse in natural log:
        -inf for queries that saw no key, NaN for a bad table)."""
        nonempty = l_i > 0
        safe = gl.where(nonempty, l_i, 1.0)
        if FP8:
            factor = gl.where(bad, float("nan"), r_i / safe)
        else:
            factor = gl.where(bad, float("nan"), 1.0 / safe)
        lse = gl.where(nonempty, (m_i + gl.log2(safe)) * 0.6931471805599453, float("-inf"))
        return factor, gl.where(bad, float("nan"), lse)

    @gluon.jit
    def _pv(o0, o1, o2, o3, alpha, p_smem, k_smem, first):
        """A warpgroup's four 64-wide output accumulators rescaled by alpha, plus P V over the ring's
        boxes first .. first + 3 (the value dims they hold)."""
        o0 = o0 * alpha[:, None]
        o1 = o1 * alpha[:, None]
        o2 = o2 * alpha[:, None]
        o3 = o3 * alpha[:, None]
        o0 = warpgroup_mma(p_smem, k_smem.index(first), o0, is_async=True)
        o1 = warpgroup_mma(p_smem, k_smem.index(first + 1), o1, is_async=True)
        o2 = warpgroup_mma(p_smem, k_smem.index(first + 2), o2, is_async=True)
        o3 = warpgroup_mma(p_smem, k_smem.index(first + 3), o3, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))

    @gluon.jit
    def _store_quarter_rows(ptr, o0, o1, o2, o3, factor, live):
        """A warpgroup's 256 output dims, times the rows' final factor, at ptr (its first 64) on;
        rows past the sequence's heads (a padded head tile) are not written."""
        gl.store(ptr, o0 * factor[:, None], mask=live[:, None])
        gl.store(ptr + BLOCK, o1 * factor[:, None], mask=live[:, None])
        gl.store(ptr + 2 * BLOCK, o2 * factor[:, None], mask=live[:, None])
        gl.store(ptr + 3 * BLOCK, o3 * factor[:, None], mask=live[:, None])

    @gluon.jit
    def _load_queries(q_desc, q_smem, q_bar, head0):
        """The program's 64 query rows (nine boxes) by TMA, arriving on q_bar."""
        mbarrier.expect(q_bar, CHUNKS * q_desc.block_type.nbytes)
        for c in gl.static_range(CHUNKS):
            tma.async_copy_global_to_shared(q_desc, [head0, c * BLOCK], q_bar, q_smem.index(c))

    @gluon.jit
    def _range_and_queries(q_desc, q_smem, q_bar, head0, glens_ptr, s, split, split_len, dcp_size, dcp_rank,
                           interleave, table_w, PAGE: gl.constexpr):
        """A bf16 loader's start: its split's (start, end, tiles), then its queries' TMA (`_load_queries`)."""
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        _load_queries(q_desc, q_smem, q_bar, head0)
        return start, end, tiles

    @gluon.jit
    def _store_masked_tile(k_ptr, k_smem, stage, blk, j0, valid, sk_b, sk_t, PAGE: gl.constexpr):
        """A split's last tile that ends inside it (`valid` keys from local token j0, cache block blk)
        into the ring stage through masked loads, rows past the end as zeros, then fenced for the
        MMAs and every warp past its stores (the caller arrives on the stage's ready barriers)."""
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, blocked))
        base = k_ptr + blk.to(gl.int64) * sk_b + ((j0 % PAGE) + rows).to(gl.int64)[:, None] * sk_t
        for c in gl.static_range(CHUNKS):
            x = gl.load(base + (c * BLOCK + cols)[None, :], mask=(rows < valid)[:, None], other=0.0)
            k_smem.index(stage * CHUNKS + c).store(x)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _loader(q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready, free,
                s, head0, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                PAGE: gl.constexpr, AHEAD: gl.constexpr = False):
        """Each tile's block id after its stage's wait (ids four tiles ahead measured no faster:
        docs/gpu.md section 18); AHEAD: the first tile's loaded beside the sequence's length (the narrow
        kernel's: in the full head tiles' kernel its loader then spilled 24 bytes more)."""
        if AHEAD:
            j_first = split * split_len
            first = _block_of(table_ptr, s, st_s, j_first, _table_tiles(j_first, table_w, PAGE) > 0, num_blocks, PAGE)
        start, end, tiles = _range_and_queries(q_desc, q_smem, q_bar, head0, glens_ptr, s, split, split_len, dcp_size,
                                               dcp_rank, interleave, table_w, PAGE)
        for t in range(tiles):
            stage = t % STAGES
            j0 = start + t * BLOCK
            if t >= STAGES:
                mbarrier.wait(free.index(stage), ((t // STAGES) - 1) & 1)
            if AHEAD:
                blk = gl.where(t == 0, first, _block_of(table_ptr, s, st_s, j0, t > 0, num_blocks, PAGE))
            else:
                blk = _checked_id(table_ptr, s, st_s, j0, num_blocks, PAGE)
            _load_tile(k_desc, k_ptr, k_smem, ready, stage, blk, j0, end, sk_b, sk_t, PAGE)

    @gluon.jit
    def _checked_id(table_ptr, s, st_s, j0, num_blocks, PAGE: gl.constexpr):
        """The cache block of sequence s's local token j0, 0 where the table's id is outside the cache
        (warpgroup 0 reports it: NaN)."""
        blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE)
        return gl.where((blk >= 0) & (blk < num_blocks), blk, 0)

    @gluon.jit
    def _load_tile(k_desc, k_ptr, k_smem, ready, stage, blk, j0, end, sk_b, sk_t, PAGE: gl.constexpr):
        """The 64-key tile from local token j0 (cache block blk) into ring stage `stage`, arriving on its
        ready barrier: by TMA, or, where the range ends inside it at `end`, through masked loads with
        the rows past the end as zeros."""
        valid = end - j0
        if valid >= BLOCK:
            mbarrier.expect(ready.index(stage), CHUNKS * k_desc.block_type.nbytes)
            row = blk * PAGE + j0 % PAGE
            for c in gl.static_range(CHUNKS):
                tma.async_copy_global_to_shared(k_desc, [row, c * BLOCK], ready.index(stage),
                                                k_smem.index(stage * CHUNKS + c))
        else:
            _store_masked_tile(k_ptr, k_smem, stage, blk, j0, valid, sk_b, sk_t, PAGE)
            mbarrier.arrive(ready.index(stage))

    @gluon.jit
    def _scores_and_low_half(q_smem, k_smem, p_smem, a_smem, q_bar, ready, free, p_ready, p_free,
                             table_ptr, glens_ptr, o_ptr, lse_ptr, s, head0_in_seq, split, split_len, dcp_size,
                             dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale, so_p, so_s, so_h, sl_p, sl_s, HQ,
                             PAGE: gl.constexpr, ks_smem=None, qf_smem=None, FP8: gl.constexpr = False,
                             RING: gl.constexpr = STAGES, KEYS: gl.constexpr = 64, PV: gl.constexpr = True):
        """FP8 (fp16 operands over an fp8 cache): the scores take the query rows' powers of two
        (qf_smem) and the keys' scales (ks_smem); the weights p * scale go to fp16 over a running
        per-row unit r (the largest weight so far: no fp16 overflow), the accumulators are kept in
        units of r and rescaled by the unit's change with alpha. KEYS: keys a tile (64, or 32 over
        fp8, where the smaller stages let the ring hold two converted tiles). Not PV (the split form):
        scores and softmax only, the stage released once the score MMAs are done; two `_value_half`
        warpgroups take the output's halves."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, KEYS, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_s)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE, KEYS)
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK], gl.float32, row_l)
        if PV:
            o0 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
            o1 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
            o2 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
            o3 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        cols = gl.arange(0, KEYS, layout=col_l)
        r_i = gl.zeros([BLOCK], gl.float32, row_l)
        mbarrier.wait(q_bar, 0)
        if FP8:
            qk_rows = qf_smem.load(row_l) * qk_scale
        for t in range(tiles):
            stage = t % RING
            j0 = start + t * KEYS
            blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE)
            bad = bad | (blk < 0) | (blk >= num_blocks)
            sc = _score_tile(q_smem, k_smem, ready, stage, (t // RING) & 1,
                             gl.zeros([BLOCK, KEYS], gl.float32, mma_s))
            if not PV:
                mbarrier.arrive(free.index(stage))
            if FP8:
                ks = ks_smem.index(stage).load(col_l)
                sc = gl.where((j0 + cols < end)[None, :], sc * qk_rows[:, None] * ks[None, :], float("-inf"))
            else:
                sc = gl.where((j0 + cols < end)[None, :], sc * qk_scale, float("-inf"))
            p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, ks if FP8 else m_i, 1, FP8)
            if t > 0:       # warpgroup 1 is done with the previous tile's weights
                mbarrier.wait(p_free, (t - 1) & 1)
            p_smem.store(p.to(p_smem.dtype))
            a_smem.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready)
            if PV:
                o0, o1, o2, o3 = _pv(o0, o1, o2, o3, gl.convert_layout(alpha, gl.SliceLayout(1, mma)), p_smem,
                                     k_smem, stage * CHUNKS + 0)
                mbarrier.arrive(free.index(stage))
        # the final factor 1 / l (NaN for a bad table) to warpgroup 1, then this half and the lse
        factor, lse = _finish(m_i, l_i, r_i, bad, FP8)
        if tiles > 0:
            mbarrier.wait(p_free, (tiles - 1) & 1)
        a_smem.store(factor)
        gl.thread_barrier()
        mbarrier.arrive(p_ready)
        rows = gl.arange(0, BLOCK, layout=row_l)
        live = head0_in_seq + rows < HQ
        gl.store(lse_ptr + split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + head0_in_seq + rows, lse, mask=live)
        if PV:
            rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma))
            ocols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma))
            o_row = split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + (head0_in_seq + rows).to(gl.int64) * so_h
            _store_quarter_rows(o_ptr + o_row[:, None] + ocols[None, :], o0, o1, o2, o3,
                                gl.convert_layout(factor, gl.SliceLayout(1, mma)), head0_in_seq + rows < HQ)

    @gluon.jit
    def _score_tile(q_smem, k_smem, ready, stage, phase, sc):
        """S = Q K^T of ring stage `stage` (once its ready barrier passes `phase`) over the nine boxes,
        into the zeroed accumulator sc, waited for."""
        mbarrier.wait(ready.index(stage), phase)
        for c in gl.static_range(CHUNKS):
            sc = warpgroup_mma(q_smem.index(c), k_smem.index(stage * CHUNKS + c).permute((1, 0)), sc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))

    @gluon.jit
    def _high_half(k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s, head0_in_seq, split,
                   split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, HQ, PAGE: gl.constexpr,
                   RING: gl.constexpr = STAGES, KEYS: gl.constexpr = 64):
        """Warpgroup 1: the output's high half (value boxes 4 .. 7) from the published weights."""
        _value_half(k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s, head0_in_seq, split,
                    split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, HQ, PAGE, RING, KEYS, 4)

    @gluon.jit
    def _value_half(k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s, head0_in_seq, split,
                    split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, HQ, PAGE: gl.constexpr,
                    RING: gl.constexpr, KEYS: gl.constexpr, FIRST: gl.constexpr):
        """A value warpgroup: the output's dims FIRST * 64 .. + 255 (value boxes FIRST .. FIRST + 3), P V per
        tile once its weights are published, its hold on the stage and the weights then released."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE, KEYS)
        o0 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        o1 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        o2 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        o3 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        for t in range(tiles):
            stage = t % RING
            mbarrier.wait(ready.index(stage), (t // RING) & 1)
            mbarrier.wait(p_ready, t & 1)
            alpha = a_smem.load(row_l)
            o0, o1, o2, o3 = _pv(o0, o1, o2, o3, alpha, p_smem, k_smem, stage * CHUNKS + FIRST)
            gl.thread_barrier()
            mbarrier.arrive(p_free)
            mbarrier.arrive(free.index(stage))
        mbarrier.wait(p_ready, tiles & 1)
        factor = a_smem.load(row_l)
        rows = gl.arange(0, BLOCK, layout=row_l)
        cols = gl.arange(0, BLOCK, layout=col_l)
        o_row = split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + (head0_in_seq + rows).to(gl.int64) * so_h
        _store_quarter_rows(o_ptr + o_row[:, None] + (FIRST * BLOCK + cols)[None, :], o0, o1, o2, o3, factor,
                            head0_in_seq + rows < HQ)

    @gluon.jit
    def _barriers(RING: gl.constexpr = STAGES, CONSUMERS: gl.constexpr = 2, P_CONSUMERS: gl.constexpr = 1):
        """The kernels' mbarriers, initialized: q_bar (the queries are in), ready / free per ring stage
        (a tile is in / its CONSUMERS warpgroups are done with it), p_ready / p_free (a tile's weights
        and factors are published / the P_CONSUMERS warpgroups that read them are done with them)."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=P_CONSUMERS)
        for i in gl.static_range(RING):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=CONSUMERS)
        fence_async_shared()
        return q_bar, ready, free, p_ready, p_free

    @gluon.jit
    def _mla_decode_ws_kernel(q_desc, k_desc, k_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr,
                              qk_scale, split_len, M_TILES, HQ, dcp_size, dcp_rank, interleave, table_w, num_blocks,
                              st_s, sk_b, sk_t, so_p, so_s, so_h, sl_p, sl_s, PAGE: gl.constexpr,
                              PDL: gl.constexpr = False,
                              plan_ptr=None, PLANNED: gl.constexpr = False, SPLIT: gl.constexpr = False):
        """bf16 latent cache: a loader warpgroup fills the ring; warpgroup 0 computes the scores, the
        softmax and the output's low half, warpgroup 1 its high half. SPLIT (CONFIG split_wide): warpgroup
        0 the scores and softmax only, two value warpgroups the two halves (its P V no longer waits behind
        the next tile's scores in one warpgroup)."""
        pid = gl.program_id(0)
        split = gl.program_id(1)
        s = pid // M_TILES
        head0_in_seq = (pid % M_TILES) * BLOCK
        head0 = s * HQ + head0_in_seq                     # row of q viewed as [S * Hq, 576]
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, BLOCK, BLOCK], box)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, BLOCK], box)
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        if SPLIT:
            q_bar, ready, free, p_ready, p_free = _barriers(STAGES, 3, 2)
        else:
            q_bar, ready, free, p_ready, p_free = _barriers()
        if PDL:     # (launched early: the set-up above overlaps the kernel before)
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
            head0 = s * HQ + head0_in_seq
        if SPLIT:
            LOW: gl.constexpr = 0
            HIGH: gl.constexpr = 4
            gl.warp_specialize([
                (_scores_and_low_half, (q_smem, k_smem, p_smem, a_smem, q_bar, ready, free, p_ready, p_free,
                                        table_ptr, glens_ptr, o_ptr, lse_ptr, s, head0_in_seq, split, split_len,
                                        dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale, so_p,
                                        so_s, so_h, sl_p, sl_s, HQ, PAGE, None, None, False, STAGES, BLOCK, False)),
                (_value_half, (k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s,
                               head0_in_seq, split, split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s,
                               so_h, HQ, PAGE, STAGES, BLOCK, LOW)),
                (_value_half, (k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s,
                               head0_in_seq, split, split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s,
                               so_h, HQ, PAGE, STAGES, BLOCK, HIGH)),
                (_loader, (q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready, free, s, head0,
                           split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                           PAGE)),
            ], [4, 4, 4], [REGS_SPLIT, REGS_SPLIT, 48])
        else:
            gl.warp_specialize([
                (_scores_and_low_half, (q_smem, k_smem, p_smem, a_smem, q_bar, ready, free, p_ready, p_free, table_ptr,
                                        glens_ptr, o_ptr, lse_ptr, s, head0_in_seq, split, split_len, dcp_size, dcp_rank,
                                        interleave, table_w, num_blocks, st_s, qk_scale, so_p, so_s, so_h, sl_p, sl_s,
                                        HQ, PAGE)),
                (_high_half, (k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s, head0_in_seq,
                              split, split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, HQ, PAGE)),
                (_loader, (q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready, free, s, head0,
                           split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                           PAGE)),
            ], [4, 4], [200, 48])

    # ---- the "seesaw" form (CONFIG seesaw_wide): both warpgroups take scores and softmax in turn ----
    # Tiles go in pairs (A, B): warpgroup 0 scores tile A while warpgroup 1 scores tile B, so one
    # warpgroup's softmax runs beside the other's MMAs (in the form above warpgroup 0 does every
    # tile's scores and softmax and warpgroup 1 waits for it). Each keeps its half of the output
    # dims; with m the running row maximum (base 2) before the pair:
    #   warpgroup 0: mA = max(m, max S_A), sA = 2^(m - mA), P_A = 2^(S_A - mA); publishes P_A, mA, sA;
    #                O_L = O_L sA + P_A V_A,L (P_A from its registers); then, given sB:
    #                O_L = O_L sB + P_B V_B,L (P_B from shared memory)
    #   warpgroup 1: O_R = O_R sA + P_A V_A,R (P_A from shared memory), while it takes
    #                mB = max(mA, max S_B), sB = 2^(mA - mB), P_B = 2^(S_B - mB); publishes P_B, sB, mB;
    #                O_R = O_R sB + P_B V_B,R (P_B from its registers)
    # which is FlashAttention's online softmax over A then B (the order of the rescales aside). One
    # weights buffer serves both: warpgroup 1 overwrites P_A with P_B only after its own P_A V_A,R
    # has finished, warpgroup 0 writes the next P_A only after its own P_B V_B,L (neither reads the
    # buffer otherwise). The sums: warpgroup 0 keeps (l0 sA + sum P_A) sB, warpgroup 1 l1 sA sB +
    # sum P_B; l = l0 + l1 at the end. (FlashMLA's dense decode schedules its two warpgroups this
    # way; its deep-dive note calls it "seesaw" scheduling.)

    REGS_SPLIT = gl.constexpr(168)      # registers a thread of each value warpgroup in the split form
    REGS_SEESAW = gl.constexpr(224)     # registers a thread of warpgroup 1 in the seesaw form (it scores too)

    @gluon.jit
    def _pv_issue(o0, o1, o2, o3, scale, p, k_smem, first):
        """The four 64-wide accumulators times the per-row `scale`, plus P V over the ring's boxes first ..
        first + 3, with P ([64, 64] bf16) as wgmma's A operand: from shared memory (the other warpgroup's
        weights) or from registers in the dot-operand layout of the scores' (this warpgroup's own);
        issued, not waited for."""
        o0 = warpgroup_mma(p, k_smem.index(first), o0 * scale[:, None], is_async=True)
        o1 = warpgroup_mma(p, k_smem.index(first + 1), o1 * scale[:, None], is_async=True)
        o2 = warpgroup_mma(p, k_smem.index(first + 2), o2 * scale[:, None], is_async=True)
        o3 = warpgroup_mma(p, k_smem.index(first + 3), o3 * scale[:, None], is_async=True)
        return o0, o1, o2, o3

    # The seesaw ring's boxes go in three groups a stage, each with its own ready and free barrier
    # (index stage * GROUPS + group; a group's boxes are group * 4 .. group * 4 + 3 of the nine): the
    # left value boxes (0-3), free after warpgroup 0's P V of the tile; the right ones (4-7), after
    # warpgroup 1's; the rope box (8), free once the tile's scores are in (loaded first). So the
    # loader refills a stage by groups as they free (a pair's tile A's value boxes while tile B's P V
    # runs) instead of waiting for the whole stage, and a tile's scores start on the boxes that are
    # in. (The loader goes in tile order: tile B's rope box waits behind the next tile A's groups.)
    GROUPS = gl.constexpr(3)
    LEFT, RIGHT, ROPE = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)

    @gluon.jit
    def _score_group(q_smem, k_smem, stage, ready_g, phase, sc, group: gl.constexpr):
        """sc plus the scores' products over a group's boxes, issued once the group is in."""
        mbarrier.wait(ready_g.index(stage * GROUPS + group), phase)
        for c in gl.static_range(group * VCHUNKS, group * VCHUNKS + VCHUNKS):
            if c < CHUNKS:
                sc = warpgroup_mma(q_smem.index(c), k_smem.index(stage * CHUNKS + c).permute((1, 0)), sc,
                                   is_async=True)
        return sc

    @gluon.jit
    def _load_group(k_desc, k_smem, ready_g, free_g, stage, phase, reuse, row, group: gl.constexpr):
        """A tile's group of boxes (first row `row` of the cache) into the stage, once that group of
        the stage's last tile is free (`reuse`: the stage had one)."""
        boxes: gl.constexpr = 1 if group == ROPE else VCHUNKS
        if reuse:
            mbarrier.wait(free_g.index(stage * GROUPS + group), phase)
        bar = ready_g.index(stage * GROUPS + group)
        mbarrier.expect(bar, boxes * k_desc.block_type.nbytes)
        for c in gl.static_range(group * VCHUNKS, group * VCHUNKS + boxes):
            tma.async_copy_global_to_shared(k_desc, [row, c * BLOCK], bar, k_smem.index(stage * CHUNKS + c))

    @gluon.jit
    def _scores(q_smem, k_smem, stage, ready_g, free_g, phase, qk_scale, j0, end, mma: gl.constexpr):
        """S = Q K^T of the ring stage's tile, base 2 (times qk_scale), keys past `end` -inf: each group's
        boxes issued once that group is in (ready_g, `phase`); the stage's rope box released after."""
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        sc = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        sc = _score_group(q_smem, k_smem, stage, ready_g, phase, sc, ROPE)    # (the loader's order)
        sc = _score_group(q_smem, k_smem, stage, ready_g, phase, sc, LEFT)
        sc = _score_group(q_smem, k_smem, stage, ready_g, phase, sc, RIGHT)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        gl.thread_barrier()     # (every warp past its ready waits and its MMAs before the one arrival)
        mbarrier.arrive(free_g.index(stage * GROUPS + ROPE))
        cols = gl.arange(0, BLOCK, layout=col_l)
        return gl.where((j0 + cols < end)[None, :], sc * qk_scale, float("-inf"))

    @gluon.jit
    def _seesaw_barriers():
        """q_bar, ready_g / free_g (a group of a stage is in / its last reader is done with it), a_ready,
        b_ready (a pair's tile A's / tile B's weights and statistics are published), initialized."""
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready_g = gl.allocate_shared_memory(gl.int64, [STAGES * GROUPS, 1], mbarrier.MBarrierLayout())
        free_g = gl.allocate_shared_memory(gl.int64, [STAGES * GROUPS, 1], mbarrier.MBarrierLayout())
        a_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        b_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(a_ready, count=1)
        mbarrier.init(b_ready, count=1)
        for i in gl.static_range(STAGES * GROUPS):
            mbarrier.init(ready_g.index(i), count=1)
            mbarrier.init(free_g.index(i), count=1)
        fence_async_shared()
        return q_bar, ready_g, free_g, a_ready, b_ready

    @gluon.jit
    def _seesaw_loader(q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready_g, free_g,
                       s, head0, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b,
                       sk_t, PAGE: gl.constexpr):
        """`_loader` for the seesaw ring: each tile's groups (rope, left, right), each once the group's
        boxes of the stage's last tile are free; the split's last tile, when it ends inside it, through
        masked loads once all three are free."""
        start, end, tiles = _range_and_queries(q_desc, q_smem, q_bar, head0, glens_ptr, s, split, split_len, dcp_size,
                                               dcp_rank, interleave, table_w, PAGE)
        for t in range(tiles):
            stage = t % STAGES
            j0 = start + t * BLOCK
            reuse = t >= STAGES
            phase = ((t // STAGES) - 1) & 1
            blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE)
            blk = gl.where((blk >= 0) & (blk < num_blocks), blk, 0)    # (warpgroup 0 reports it)
            valid = end - j0
            if valid >= BLOCK:
                row = blk * PAGE + j0 % PAGE
                # (the rope box frees first: once the stage's last tile is scored)
                _load_group(k_desc, k_smem, ready_g, free_g, stage, phase, reuse, row, ROPE)
                _load_group(k_desc, k_smem, ready_g, free_g, stage, phase, reuse, row, LEFT)
                _load_group(k_desc, k_smem, ready_g, free_g, stage, phase, reuse, row, RIGHT)
            else:   # the split's last tile ends inside it: rows past the end as zeros
                if reuse:
                    for group in gl.static_range(GROUPS):
                        mbarrier.wait(free_g.index(stage * GROUPS + group), phase)
                _store_masked_tile(k_ptr, k_smem, stage, blk, j0, valid, sk_b, sk_t, PAGE)
                for group in gl.static_range(GROUPS):
                    mbarrier.arrive(ready_g.index(stage * GROUPS + group))

    @gluon.jit
    def _zero_quarter(mma: gl.constexpr):
        """A warpgroup's four 64-wide output accumulators (its 256 of the 512 value dims), zero."""
        return (gl.zeros([BLOCK, BLOCK], gl.float32, mma), gl.zeros([BLOCK, BLOCK], gl.float32, mma),
                gl.zeros([BLOCK, BLOCK], gl.float32, mma), gl.zeros([BLOCK, BLOCK], gl.float32, mma))

    @gluon.jit
    def _opaque_zero(i):
        """0, from a value the compiler cannot see through that changes with the loop counter i: ring
        indices offset by it are computed where they are used instead of hoisted out of the loop (a
        shared-memory descriptor for each fixed box the warpgroup reads, held in registers across the
        loop, spilled 1.4 KB a thread)."""
        return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [i], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _seesaw_step(sc, m_old):
        """(P = 2^(S - m_new), 2^(m_old - m_new), m_new, the rows' sums of P) with m_new = max(m_old, max S)
        (0 in place of an m_new of -inf: rows that saw no key keep P = 0 and a factor 0)."""
        m_new = gl.maximum(m_old, gl.max(sc, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - m_safe[:, None])
        return p, gl.exp2(m_old - m_safe), m_new, gl.sum(p, 1)

    @gluon.jit
    def _seesaw_start(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, q_bar,
                      PAGE: gl.constexpr, mma: gl.constexpr):
        """A seesaw warpgroup's start: (start, end, tiles, bad) of its split, its running sum and four
        output accumulators at zero, and its pairs of tiles, once the queries are in."""
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        l_i = gl.zeros([BLOCK], gl.float32, gl.SliceLayout(1, mma))
        o0, o1, o2, o3 = _zero_quarter(mma)
        mbarrier.wait(q_bar, 0)
        return start, end, tiles, bad, l_i, o0, o1, o2, o3, (tiles + 1) // 2

    @gluon.jit
    def _seesaw_lead(q_smem, k_smem, p_smem, st_smem, q_bar, ready_g, free_g, a_ready, b_ready, table_ptr, glens_ptr,
                     o_ptr, lse_ptr, s, head0_in_seq, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                     num_blocks, st_s, qk_scale, so_p, so_s, so_h, sl_p, sl_s, HQ, PAGE: gl.constexpr):
        """Warpgroup 0 of the seesaw form: tile A of each pair, output dims [0, 256), the block-id check,
        the final factor and the lse. st_smem rows: 0 mA, 1 sA, 2 sB, 3 mB, 4 warpgroup 1's running sum, 5
        the factor."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        start, end, tiles, bad, l_i, o0, o1, o2, o3, pairs = _seesaw_start(
            glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, q_bar, PAGE, mma)
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_l)
        for i in range(pairs):
            j0 = start + 2 * i * BLOCK
            has_b = 2 * i + 1 < tiles
            blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE)
            bad = bad | (blk < 0) | (blk >= num_blocks)
            if has_b:
                blk = gl.load(table_ptr + s.to(gl.int64) * st_s + (j0 + BLOCK) // PAGE)
                bad = bad | (blk < 0) | (blk >= num_blocks)
            st0 = _opaque_zero(i)
            sc = _scores(q_smem, k_smem, st0, ready_g, free_g, i & 1, qk_scale, j0, end, mma)
            p, s_a, m_i, rows_sum = _seesaw_step(sc, m_i)
            l_i = l_i * s_a + rows_sum
            p = p.to(gl.bfloat16)
            # (the buffer is this warpgroup's again: warpgroup 1 published P_B of the last pair, whose
            # P_B V_B,L below has finished)
            p_smem.store(p)
            st_smem.index(0).store(m_i)
            st_smem.index(1).store(s_a)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(a_ready)
            o0, o1, o2, o3 = _pv_issue(o0, o1, o2, o3, s_a, gl.convert_layout(p, a_l), k_smem, st0)
            mbarrier.wait(b_ready, i & 1)
            s_b = st_smem.index(2).load(row_l)
            m_i = st_smem.index(3).load(row_l)
            o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
            mbarrier.arrive(free_g.index(LEFT))
            l_i = l_i * s_b
            if has_b:       # (tile B is in: warpgroup 1 scored it before b_ready; waited here too)
                mbarrier.wait(ready_g.index(GROUPS + LEFT), i & 1)
                o0, o1, o2, o3 = _pv_issue(o0, o1, o2, o3, s_b, p_smem, k_smem, st0 + CHUNKS)
                o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
                mbarrier.arrive(free_g.index(GROUPS + LEFT))
        # warpgroup 1's sum (published with its last pair's statistics), then the factor 1 / l (NaN for a
        # bad table) back to it. (An arrival of its own for the sum could complete b_ready's next phase
        # before a lagging warp here had waited for the last pair's: that warp would then wait forever.)
        if pairs > 0:
            l_i = l_i + st_smem.index(4).load(row_l)
        factor, lse = _finish(m_i, l_i, l_i, bad, False)
        st_smem.index(5).store(factor)
        gl.thread_barrier()
        mbarrier.arrive(a_ready)
        rows = gl.arange(0, BLOCK, layout=row_l)
        live = head0_in_seq + rows < HQ
        gl.store(lse_ptr + split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + head0_in_seq + rows, lse, mask=live)
        ocols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma))
        o_row = split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + (head0_in_seq + rows).to(gl.int64) * so_h
        _store_quarter_rows(o_ptr + o_row[:, None] + ocols[None, :], o0, o1, o2, o3, factor, live)

    @gluon.jit
    def _seesaw_follow(q_smem, k_smem, p_smem, st_smem, q_bar, ready_g, free_g, a_ready, b_ready, glens_ptr, o_ptr, s,
                       head0_in_seq, split, split_len, dcp_size, dcp_rank, interleave, table_w, qk_scale, so_p, so_s,
                       so_h, HQ, PAGE: gl.constexpr):
        """Warpgroup 1 of the seesaw form: tile B of each pair, output dims [256, 512)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        start, end, tiles, bad, l_i, o0, o1, o2, o3, pairs = _seesaw_start(
            glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, q_bar, PAGE, mma)
        for i in range(pairs):
            j0 = start + 2 * i * BLOCK
            has_b = 2 * i + 1 < tiles
            st0 = _opaque_zero(i)
            # (no tile B, the pair's last: scores all -inf, so P_B = 0, sB = 1 and mB = mA)
            sc = gl.full([BLOCK, BLOCK], float("-inf"), gl.float32, mma)
            if has_b:       # (tile B's scores run beside warpgroup 0's softmax of tile A)
                sc = _scores(q_smem, k_smem, st0 + 1, ready_g, free_g, i & 1, qk_scale, j0 + BLOCK, end, mma)
            mbarrier.wait(a_ready, i & 1)
            m_a = st_smem.index(0).load(row_l)
            s_a = st_smem.index(1).load(row_l)
            mbarrier.wait(ready_g.index(RIGHT), i & 1)     # (in: warpgroup 0 scored it before a_ready)
            o0, o1, o2, o3 = _pv_issue(o0, o1, o2, o3, s_a, p_smem, k_smem, st0 + 4)
            p, s_b, m_b, rows_sum = _seesaw_step(sc, m_a)
            l_i = l_i * s_a * s_b + rows_sum
            p = p.to(gl.bfloat16)
            o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
            mbarrier.arrive(free_g.index(RIGHT))
            if has_b:       # (P_A V_A,R has finished: the buffer takes P_B)
                p_smem.store(p)
            st_smem.index(2).store(s_b)
            st_smem.index(3).store(m_b)
            st_smem.index(4).store(l_i)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(b_ready)
            if has_b:
                o0, o1, o2, o3 = _pv_issue(o0, o1, o2, o3, s_b, gl.convert_layout(p, a_l), k_smem,
                                          st0 + CHUNKS + 4)
                o0, o1, o2, o3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
                mbarrier.arrive(free_g.index(GROUPS + RIGHT))
        mbarrier.wait(a_ready, pairs & 1)
        factor = st_smem.index(5).load(row_l)
        rows = gl.arange(0, BLOCK, layout=row_l)
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma))
        o_row = split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + (head0_in_seq + rows).to(gl.int64) * so_h
        _store_quarter_rows(o_ptr + o_row[:, None] + (4 * BLOCK + cols)[None, :], o0, o1, o2, o3, factor,
                            head0_in_seq + rows < HQ)

    @gluon.jit
    def _mla_decode_seesaw_kernel(q_desc, k_desc, k_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr,
                                  qk_scale, split_len, M_TILES, HQ, dcp_size, dcp_rank, interleave, table_w,
                                  num_blocks, st_s, sk_b, sk_t, so_p, so_s, so_h, sl_p, sl_s, PAGE: gl.constexpr,
                                  PDL: gl.constexpr = False,
                                  plan_ptr=None, PLANNED: gl.constexpr = False):
        """`_mla_decode_ws_kernel`'s problem (bf16 latent cache, 64-head tiles) in the seesaw form: the
        two-stage ring (a pair's tiles A and B in stages 0 and 1) filled by groups of boxes as they free
        (`_seesaw_loader`), one weights buffer, the rows' statistics in st_smem."""
        pid = gl.program_id(0)
        split = gl.program_id(1)
        s = pid // M_TILES
        head0_in_seq = (pid % M_TILES) * BLOCK
        head0 = s * HQ + head0_in_seq
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, BLOCK, BLOCK], box)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, BLOCK], box)
        st_smem = gl.allocate_shared_memory(gl.float32, [6, BLOCK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        q_bar, ready_g, free_g, a_ready, b_ready = _seesaw_barriers()
        if PDL:
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
            head0 = s * HQ + head0_in_seq
        gl.warp_specialize([
            (_seesaw_lead, (q_smem, k_smem, p_smem, st_smem, q_bar, ready_g, free_g, a_ready, b_ready, table_ptr,
                            glens_ptr, o_ptr, lse_ptr, s, head0_in_seq, split, split_len, dcp_size, dcp_rank,
                            interleave, table_w, num_blocks, st_s, qk_scale, so_p, so_s, so_h, sl_p, sl_s, HQ,
                            PAGE)),
            (_seesaw_follow, (q_smem, k_smem, p_smem, st_smem, q_bar, ready_g, free_g, a_ready, b_ready, glens_ptr,
                              o_ptr, s, head0_in_seq, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                              qk_scale, so_p, so_s, so_h, HQ, PAGE)),
            (_seesaw_loader, (q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready_g, free_g,
                              s, head0, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                              sk_b, sk_t, PAGE)),
        ], [4, 4], [REGS_SEESAW, 48])


if HAS_GLUON:
    @gluon.jit
    def _converter(q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, q_smem, qf_smem, k_smem, ks_smem, q_bar, ready, free,
                   s, head0, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                   ss_b, ss_t, q_rows, PAGE: gl.constexpr, kr_smem=None, ksr_smem=None,
                   raw_ready=None, raw_free=None, RAW: gl.constexpr = 0, RING: gl.constexpr = STAGES,
                   KEYS: gl.constexpr = 64, QROWS: gl.constexpr = 64, BOXES: gl.constexpr = CHUNKS):
        """The fp8 kernel's loader: the QROWS query rows (64, or a swapped narrow tile's) to fp16, each
        times a power of two 2^e that puts its largest magnitude in [2^14, 2^15) (qf_smem holds
        2^-e), then each key tile's fp8 rows (zeros past the split's end) converted to fp16 and its
        scales into the ring's stage: loaded here (RAW 0), or from the raw ring of RAW stages
        `_raw_loader` fills by TMA (its first BOXES boxes: `_convert_raw`)."""
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qr = gl.arange(0, QROWS, layout=gl.SliceLayout(1, blocked))
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, blocked))
        q_base = q_ptr + (head0 + qr).to(gl.int64)[:, None] * (CHUNKS * BLOCK) + cols[None, :]
        amax = gl.zeros([QROWS], gl.float32, gl.SliceLayout(1, blocked))
        qmask = (qr < q_rows)[:, None]       # (a padded head tile: rows past the sequence's heads are 0)
        for c in gl.static_range(CHUNKS):
            amax = gl.maximum(amax, gl.max(gl.abs(gl.load(q_base + c * BLOCK, mask=qmask, other=0.0).to(gl.float32)), 1))
        biased = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        e = gl.minimum(gl.maximum(141 - biased, -113), 100)
        up = ((e + 127) << 23).to(gl.float32, bitcast=True)
        qf_smem.store(((127 - e) << 23).to(gl.float32, bitcast=True))
        for c in gl.static_range(CHUNKS):
            qc = gl.load(q_base + c * BLOCK, mask=qmask, other=0.0).to(gl.float32) * up[:, None]
            q_smem.index(c).store(qc.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(q_bar)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE, KEYS)
        if RAW > 0:
            _convert_raw(kr_smem, ksr_smem, k_smem, ks_smem, raw_ready, raw_free, ready, free, start, end, tiles,
                         RAW, RING, KEYS, BOXES)
        else:
            rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, blocked))
            for t in range(tiles):
                stage = t % STAGES
                j0 = start + t * BLOCK
                blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE)
                blk = gl.where((blk >= 0) & (blk < num_blocks), blk, 0)    # (warpgroup 0 reports it)
                live = rows < end - j0
                token = ((j0 % PAGE) + rows).to(gl.int64)
                base = k_ptr + blk.to(gl.int64) * sk_b + token[:, None] * sk_t + cols[None, :]
                ks = gl.load(ks_ptr + blk.to(gl.int64) * ss_b + token * ss_t, mask=live, other=0.0)
                if t >= STAGES:
                    mbarrier.wait(free.index(stage), ((t // STAGES) - 1) & 1)
                for c in gl.static_range(CHUNKS):
                    kc = gl.load(base + c * BLOCK, mask=live[:, None], other=0.0)
                    k_smem.index(stage * CHUNKS + c).store(kc.to(gl.float16))
                ks_smem.index(stage).store(ks)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ready.index(stage))

    @gluon.jit
    def _convert_raw(kr_smem, ksr_smem, k_smem, ks_smem, raw_ready, raw_free, ready, free, start, end, tiles,
                     RAW: gl.constexpr, RING: gl.constexpr, KEYS: gl.constexpr, BOXES: gl.constexpr = CHUNKS):
        """Each raw fp8 tile (nine KEYS x 64 boxes and its KEYS scales, by TMA) to fp16 in the ring's
        stage: its first BOXES boxes (all nine, or the eight of the latent where the consumer reads
        the rope box from the raw ring itself); rows past the split's end as zeros (the last tile
        only) and their scales 0."""
        blocked: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, KEYS, layout=gl.SliceLayout(1, blocked))
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        srows = gl.arange(0, KEYS, layout=vec)
        GROUP: gl.constexpr = 3 if BOXES % 3 == 0 else 2
        for t in range(tiles):
            rs = t % RAW
            stage = t % RING
            valid = end - (start + t * KEYS)
            mbarrier.wait(raw_ready.index(rs), (t // RAW) & 1)
            if t >= RING:
                mbarrier.wait(free.index(stage), ((t // RING) - 1) & 1)
            if valid < KEYS:    # the split's last tile ends inside it
                for c in gl.static_range(BOXES):
                    kx = kr_smem.index(rs * CHUNKS + c).load(blocked).to(gl.float16)
                    k_smem.index(stage * BOXES + c).store(gl.where((rows < valid)[:, None], kx, 0.0))
            else:               # (a branch of its own: no selects; GROUP boxes' loads issued together)
                for g in gl.static_range(BOXES // GROUP):
                    k0 = kr_smem.index(rs * CHUNKS + GROUP * g).load(blocked)
                    k1 = kr_smem.index(rs * CHUNKS + GROUP * g + 1).load(blocked)
                    if GROUP == 3:
                        k2 = kr_smem.index(rs * CHUNKS + GROUP * g + 2).load(blocked)
                    k_smem.index(stage * BOXES + GROUP * g).store(k0.to(gl.float16))
                    k_smem.index(stage * BOXES + GROUP * g + 1).store(k1.to(gl.float16))
                    if GROUP == 3:
                        k_smem.index(stage * BOXES + GROUP * g + 2).store(k2.to(gl.float16))
            ks_smem.index(stage).store(gl.where(srows < valid, ksr_smem.index(rs).reshape([KEYS]).load(vec), 0.0))
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(raw_free.index(rs))
            mbarrier.arrive(ready.index(stage))

    @gluon.jit
    def _raw_loader(k_desc, ks_desc, table_ptr, glens_ptr, kr_smem, ksr_smem, raw_ready, raw_free, s, split,
                    split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, PAGE: gl.constexpr,
                    RAW: gl.constexpr, KEYS: gl.constexpr = 64):
        """(one warp) Each key tile's nine fp8 boxes of KEYS keys x 64 dims and its KEYS scales by TMA
        into the raw ring (whole boxes: a tile lies in its page; the converter zeroes what lies past
        the end), the block ids one tile ahead."""
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE, KEYS)
        blk_next = _block_of(table_ptr, s, st_s, start, tiles > 0, num_blocks, PAGE)
        for t in range(tiles):
            rs = t % RAW
            j0 = start + t * KEYS
            blk = blk_next
            blk_next = _block_of(table_ptr, s, st_s, j0 + KEYS, t + 1 < tiles, num_blocks, PAGE)
            if t >= RAW:
                mbarrier.wait(raw_free.index(rs), ((t // RAW) - 1) & 1)
            mbarrier.expect(raw_ready.index(rs), CHUNKS * k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
            row = blk * PAGE + j0 % PAGE
            for c in gl.static_range(CHUNKS):
                tma.async_copy_global_to_shared(k_desc, [row, c * BLOCK], raw_ready.index(rs),
                                                kr_smem.index(rs * CHUNKS + c))
            tma.async_copy_global_to_shared(ks_desc, [blk, j0 % PAGE], raw_ready.index(rs), ksr_smem.index(rs))

    @gluon.jit
    def _mla_decode_ws_fp8_kernel(q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr,
                                  qk_scale, split_len, M_TILES, HQ, dcp_size, dcp_rank, interleave, table_w, num_blocks,
                                  st_s, sk_b, sk_t, ss_b, ss_t, so_p, so_s, so_h, sl_p, sl_s, PAGE: gl.constexpr,
                                  k_desc=None, ks_desc=None, RAW: gl.constexpr = 0, RING: gl.constexpr = 1,
                                  KEYS: gl.constexpr = 64, PDL: gl.constexpr = False,
                                  plan_ptr=None, PLANNED: gl.constexpr = False):
        """RAW 0: the converter loads each 64-key tile's fp8 rows itself (two fp16 stages); RAW > 0: a
        TMA loader fills a raw ring of RAW fp8 tiles of KEYS keys in front of it, and the fp16 ring
        after it has RING stages (shared memory: queries 72 KB + 18 KB a fp16 stage and 9 KB a raw
        stage per 16 keys + weights 2 KB per 16 keys: 64-key tiles fit RING 1 with RAW 1-2, 32-key
        tiles RING 2 with RAW 2-4 or RING 3 with RAW 2)."""
        pid = gl.program_id(0)
        split = gl.program_id(1)
        s = pid // M_TILES
        head0_in_seq = (pid % M_TILES) * BLOCK
        head0 = s * HQ + head0_in_seq
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float16)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.float16, [CHUNKS, BLOCK, BLOCK], box)
        FP16_RING: gl.constexpr = RING if RAW > 0 else STAGES
        kbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK], gl.float16)
        pbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, KEYS], gl.float16)
        k_smem = gl.allocate_shared_memory(gl.float16, [FP16_RING * CHUNKS, KEYS, BLOCK], kbox)
        p_smem = gl.allocate_shared_memory(gl.float16, [BLOCK, KEYS], pbox)
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK], vec)
        qf_smem = gl.allocate_shared_memory(gl.float32, [BLOCK], vec)
        ks_smem = gl.allocate_shared_memory(gl.float32, [FP16_RING, KEYS], vec)
        q_bar, ready, free, p_ready, p_free = _barriers(FP16_RING)
        if RAW > 0:
            raw_box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK], gl.float8e4nv)
            sc_box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            kr_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW * CHUNKS, KEYS, BLOCK], raw_box)
            ksr_smem = gl.allocate_shared_memory(gl.float32, [RAW, 1, KEYS], sc_box)
            raw_ready = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
            raw_free = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(RAW):
                mbarrier.init(raw_ready.index(i), count=1)
                mbarrier.init(raw_free.index(i), count=1)
            fence_async_shared()
            if PDL:     # (launched early: the set-up above overlaps the kernel before)
                _gdc_wait_and_release()
            if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
                s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
                head0 = s * HQ + head0_in_seq
            gl.warp_specialize([
                (_scores_and_low_half, (q_smem, k_smem, p_smem, a_smem, q_bar, ready, free, p_ready, p_free,
                                        table_ptr, glens_ptr, o_ptr, lse_ptr, s, head0_in_seq, split, split_len,
                                        dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale, so_p,
                                        so_s, so_h, sl_p, sl_s, HQ, PAGE, ks_smem, qf_smem, True, RING, KEYS)),
                (_high_half, (k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s,
                              head0_in_seq, split, split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s,
                              so_h, HQ, PAGE, RING, KEYS)),
                (_converter, (q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, q_smem, qf_smem, k_smem, ks_smem, q_bar,
                              ready, free, s, head0, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                              num_blocks, st_s, sk_b, sk_t, ss_b, ss_t, HQ - head0_in_seq, PAGE, kr_smem,
                              ksr_smem, raw_ready, raw_free, RAW, RING, KEYS)),
                (_raw_loader, (k_desc, ks_desc, table_ptr, glens_ptr, kr_smem, ksr_smem, raw_ready, raw_free, s,
                               split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, PAGE,
                               RAW, KEYS)),
            ], [4, 4, 1], [168, 64, 24])
        else:
            if PDL:     # (launched early: the set-up above overlaps the kernel before)
                _gdc_wait_and_release()
            if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
                s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
                head0 = s * HQ + head0_in_seq
            gl.warp_specialize([
                (_scores_and_low_half, (q_smem, k_smem, p_smem, a_smem, q_bar, ready, free, p_ready, p_free, table_ptr,
                                        glens_ptr, o_ptr, lse_ptr, s, head0_in_seq, split, split_len, dcp_size, dcp_rank,
                                        interleave, table_w, num_blocks, st_s, qk_scale, so_p, so_s, so_h, sl_p, sl_s,
                                        HQ, PAGE, ks_smem, qf_smem, True)),
                (_high_half, (k_smem, p_smem, a_smem, ready, free, p_ready, p_free, glens_ptr, o_ptr, s, head0_in_seq,
                              split, split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, HQ, PAGE)),
                (_converter, (q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, q_smem, qf_smem, k_smem, ks_smem, q_bar, ready,
                              free, s, head0, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                              sk_b, sk_t, ss_b, ss_t, HQ - head0_in_seq, PAGE)),
            ], [4, 4], [152, 96])


def gluon_mla_ok(q: Tensor, k: Tensor, v: Tensor, tq: int, page: int, k_scale: Tensor | None = None,
                 v_scale: Tensor | None = None, max_tq: int = 1) -> bool:
    """The Gluon kernels apply: bf16 queries; a bf16 latent cache [nb, page, 1, 576] (rows
    contiguous, v its first 512 dims), or an fp8 one with one fp32 scale per token [nb, page, 1]
    serving keys and values (v_scale is k_scale); one query token (up to max_tq: the swapped narrow
    kernel takes a speculative step's few), heads a multiple of 64, pages a multiple of 64 (or fewer
    than 64: one padded head tile), an sm_90 GPU; 16-byte aligned bases (the TMA descriptors over q and
    the cache refuse others: an unaligned q runs the Triton kernel)."""
    if not (HAS_GLUON and q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    if k.dtype == torch.float8_e4m3fn:
        if (k_scale is None or v_scale is None or v_scale.data_ptr() != k_scale.data_ptr()
                or v_scale.stride() != k_scale.stride() or k_scale.dtype != torch.float32 or k_scale.dim() != 3):
            return False
    elif k.dtype != torch.bfloat16:
        return False
    return (q.dtype == torch.bfloat16 and 1 <= tq <= max_tq
            and (q.shape[-2] % _BLOCK == 0 or q.shape[-2] < _BLOCK) and q.shape[-1] == _CHUNKS * _BLOCK
            and k.shape[2] == 1
            and k.shape[-1] == _CHUNKS * _BLOCK and page % _BLOCK == 0 and k.stride(-1) == 1
            and k.stride(1) == _CHUNKS * _BLOCK and k.stride(0) == page * _CHUNKS * _BLOCK
            and v.data_ptr() == k.data_ptr() and v.shape[-1] == 2 * _VCHUNKS * _BLOCK
            and q.is_contiguous() and q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0)


def scales_by_tma(k_scale: Tensor | None) -> bool:
    """An fp8 cache's per-token scales [nb, page, 1] can back a TMA descriptor ([nb, page]): contiguous,
    on a 16-byte aligned base (Triton's TensorDescriptor refuses any other base)."""
    return k_scale is not None and k_scale.is_contiguous() and k_scale.data_ptr() % 16 == 0


SMEM_LIMIT = 232448      # bytes of dynamic shared memory a CTA may take on sm_90


def grid_rows(s: int, plan: Tensor | None) -> int:
    """The sequences a launch's grid spans: all of them, or one under a length plan (whose items,
    the grid's second axis, name their sequences)."""
    return s if plan is None else 1


@functools.lru_cache(maxsize=None)
def shared_box(rows: int, cols: int, dtype) -> "gl.NVMMASharedLayout":
    """The default NVMMA shared layout of a [rows, cols] TMA box of a Gluon dtype, made once (a launch's
    host work: `get_default_for` is ~5 µs of Python a call)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


def planned_launch(plan: Tensor | None) -> dict:
    """A launch's arguments for a length plan's item table (none without one)."""
    return {} if plan is None else {"plan_ptr": plan, "PLANNED": True}


def fp8_ring_fits(keys: int, ring: int, raw: int) -> bool:
    """The fp8 kernel's shared memory with a raw ring: queries (fp16, 64 x 576), `ring` fp16 and `raw`
    fp8 stages of `keys` x 576, the weights (64 x keys fp16), the scales and barriers."""
    width = _CHUNKS * _BLOCK
    need = (_BLOCK * width * 2 + ring * keys * width * 2 + raw * keys * width + _BLOCK * keys * 2
            + 4 * (2 * _BLOCK + (ring + raw) * keys) + 8 * (3 + 2 * ring + 2 * raw) + 1024)
    return keys in (32, 64) and ring >= 1 and raw >= 1 and need <= SMEM_LIMIT


def launch_gluon_mla(q: Tensor, k: Tensor, table: Tensor, seq_lens: Tensor, o: Tensor, lse: Tensor, scale_log2: float,
                     splits: int, split_len: int, dcp_size: int, dcp_rank: int, interleave: int,
                     k_scale: Tensor | None = None, raw_ring: int = 0, keys: int = 64, ring: int = 1,
                     pdl: bool = False, seesaw: bool = False, split: bool = False,
                     plan: Tensor | None = None) -> None:
    """Fill the split partials o [splits, S, 1, Hq, 512] / lse [splits, S, 1, Hq] (`gluon_mla_ok`;
    k_scale: the fp8 cache's per-token scales;
    raw_ring: over fp8, a TMA ring of that many raw fp8 tiles in front of the converter, where the
    scales are contiguous [nb, page, 1] (0: the converter loads 64-key tiles itself into two fp16
    stages); then `keys` keys a tile (64 or 32) and `ring` fp16 stages after the converter, within
    shared memory (`fp8_ring_fits`)); pdl: launched with programmatic dependent launch
    (`triton_merge.pdl_ok`)); seesaw: over bf16, the seesaw form (`_mla_decode_seesaw_kernel`: both
    warpgroups take scores and softmax on alternate tiles); split: over bf16 (not seesaw), the split form
    (scores and softmax in one warpgroup, the output's halves in two others); plan: a length plan's item table
    (`triton_decode.LengthPlan`): the grid's `splits` are its items, o's sequence stride 0."""
    fp8 = k.dtype == torch.float8_e4m3fn
    launch = {"PDL": True, "launch_pdl": True} if pdl else {}
    launch.update(planned_launch(plan))
    raw = max(int(raw_ring), 0) if fp8 and scales_by_tma(k_scale) else 0
    if raw and not fp8_ring_fits(keys, ring, raw):
        raise ValueError(f"an fp8 ring of {ring} fp16 and {raw} raw stages of {keys} keys does not fit in "
                         f"shared memory ({SMEM_LIMIT} bytes; key tiles of 32 or 64)")
    s, _, hq, d = q.shape
    nb, page = k.shape[0], k.shape[1]
    m_tiles = -(-hq // _BLOCK)
    tail = (o.stride(0), o.stride(1), o.stride(3), lse.stride(0), lse.stride(1))
    if fp8:
        descs, consts = {}, {}
        if raw:
            raw_box = shared_box(keys, _BLOCK, gl.float8e4nv)
            sc_box = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
            k2, ks2 = k.view(nb * page, d), k_scale.view(nb, page)
            descs = {"k_desc": TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [keys, _BLOCK], raw_box),
                     "ks_desc": TensorDescriptor(ks2, list(ks2.shape), list(ks2.stride()), [1, keys], sc_box)}
            consts = {"RING": ring, "KEYS": keys}
        _mla_decode_ws_fp8_kernel[(grid_rows(s, plan) * m_tiles, splits)](
            q, k, k_scale, table, seq_lens, o, lse, scale_log2, split_len, m_tiles, hq, dcp_size, dcp_rank,
            interleave, table.shape[1], nb, table.stride(0), k.stride(0), k.stride(1), k_scale.stride(0),
            k_scale.stride(1), *tail, PAGE=page, RAW=raw, num_warps=4, **descs, **consts, **launch)
        return
    box = shared_box(_BLOCK, _BLOCK, gl.bfloat16)
    q2 = q.view(s * hq, d)
    k2 = k.view(nb * page, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [_BLOCK, _BLOCK], box)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], box)
    kernel = _mla_decode_seesaw_kernel if seesaw else _mla_decode_ws_kernel
    if split and not seesaw:
        launch["SPLIT"] = True
    kernel[(grid_rows(s, plan) * m_tiles, splits)](
        q_desc, k_desc, k, table, seq_lens, o, lse, scale_log2, split_len, m_tiles, hq, dcp_size, dcp_rank,
        interleave, table.shape[1], nb, table.stride(0), k.stride(0), k.stride(1), *tail, PAGE=page,
        num_warps=4, **launch)
