"""GQA decode as warp-specialized Gluon kernels for Hopper (sm_90): one program per (sequence,
kv head, split) streams that head's keys and values through a deep shared-memory ring, so that
one CTA per SM keeps enough bytes in flight (cuDNN's decode form) and the grid rarely needs more
than one split, hence no merge.

Over bf16 (`_gqa_decode_ws_kernel`):
- the loader brings each 64-key tile's k and v (two 64-column boxes each, head dim 128) from
  the paged cache [blocks, page, kv heads, 128] by TMA into the ring, the block ids one tile
  ahead; the split's last tile, where it ends inside the tile, comes through masked loads
  instead (zeros past the sequence's end: the cache holds anything there, NaN included, and
  0 x NaN in P V is NaN);
- the consumer warpgroup (the default partition): the G = Hq / Hkv query rows of the kv head
  (padded to 64, wgmma's M) held in registers as the MMA's A operand, S = Q K^T, the online
  softmax, and O += P V with P passed from registers. A speculative step's Tq tokens are more rows
  of the same tile (row = token x G + head, Tq x G <= 64: the MMAs of one token), causal within
  the step over DCP's global positions; the mask is applied only to tiles that reach past the
  step's first token.

Over fp8 (`_gqa_decode_direct_kernel`, CONFIG direct_gluon_gqa_fp8), no converter: a one-warp
loader brings each tile's raw key and value boxes (64 x 128 fp8) into 8-12 stages; a scores
warpgroup computes S^T = K Q^T as fp8 MMAs straight from the raw keys against the queries split
into two e4m3 parts (hi + lo, a power of two per row), runs the online softmax over four tiles a
step (one cross-warp maximum of the scores and one of the weights for all four) and publishes the
weights; a value warpgroup reads the raw value boxes transposed (16-bit ldmatrix, each dim pair
split into its even and odd dims) into its MMA's A operand. Its columns are the kv head's query
heads times a speculative step's tokens (at most 32, causal within the step); wider problems stay
on the Triton kernel. The arithmetic is the Triton kernel's f16 path: scores times the keys'
scales, weights p * v_scale divided by a running per-row unit r (the largest weight so far), the
accumulator kept in units of r.

Outputs are the split's partial (out, lse) in `triton_decode.paged_decode_triton`'s layout.
`gluon_gqa_ok` says where they apply; CONFIG gluon_gqa / gluon_gqa_fp8 choose them there. (Forms
measured and removed, a converter warpgroup to an fp16 ring over fp8 and a consumer with swapped
operands among them: triton_decode.CONFIG's notes.)"""

from __future__ import annotations

import torch
from torch import Tensor

from .gluon_mla import SMEM_LIMIT, grid_rows, planned_launch, shared_box

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .gluon_mla import (HAS_GLUON, IDS_L, _bad_ids, _bad_ids_after, _block_of, _finish, _gdc_wait_and_release,
                            _ids_early, _ids_window, _table_tiles, _softmax_step, _split_range, _window_start,
                            _window_tile)
    from .gluon_mla_narrow import (LBOX, _fold_parts, _publish_factor, _query_pos, _query_split, _scores_box8,
                                   _softmax_start, _store_box, _value_operands, _zero_tail)
    from .triton_common import global_pos as _global_pos
    from .triton_common import work_item as _work_item
except ImportError:  # pragma: no cover - a Triton without Gluon
    HAS_GLUON = False

_BLOCK, _HEAD_DIM = 64, 128       # (the host's ints of the kernel's constants below)
TILE = _BLOCK                     # keys a tile and query rows a program (fewer heads: padded rows)

if HAS_GLUON:
    BLOCK = gl.constexpr(64)      # keys a tile, query rows (padded), columns a box (128 B of 16-bit)
    CHUNKS = gl.constexpr(2)      # boxes of the head dim (2 x 64 = 128)


if HAS_GLUON:
    @gluon.jit
    def _tma_kv_tile(k_desc, v_desc, row, kvh, bar, k_dst, v_dst, first):
        """A 64-key tile of kv head kvh at cache row `row` (its k and v, two 64-column boxes each) by TMA
        into k_dst / v_dst boxes first, first + 1, completing on mbarrier bar."""
        mbarrier.expect(bar, 2 * CHUNKS * k_desc.block_type.nbytes)
        for c in gl.static_range(CHUNKS):
            col = kvh * (CHUNKS * BLOCK) + c * BLOCK
            tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_dst.index(first + c))
            tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_dst.index(first + c))

    @gluon.jit
    def _bf16_loader(k_desc, v_desc, k_ptr, v_ptr, table_ptr, glens_ptr, k_smem, v_smem, ready, free,
                     s, kvh, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                     sk_b, sk_t, sv_b, sv_t, PAGE: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr = False):
        """The block ids one tile ahead (four ahead measured no faster: docs/gpu.md section 18); AHEAD:
        the first one loaded beside the sequence's length (`_table_tiles`)."""
        if AHEAD:
            first = split * split_len
            blk_next = _block_of(table_ptr, s, st_s, first, _table_tiles(first, table_w, PAGE) > 0, num_blocks, PAGE)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        if not AHEAD:
            blk_next = _block_of(table_ptr, s, st_s, start, tiles > 0, num_blocks, PAGE)
        for t in range(tiles):
            stage = t % STAGES
            j0 = start + t * BLOCK
            blk = blk_next          # (the next tile's id loads while this one waits for its stage)
            blk_next = _block_of(table_ptr, s, st_s, j0 + BLOCK, t + 1 < tiles, num_blocks, PAGE)
            if t >= STAGES:
                mbarrier.wait(free.index(stage), ((t // STAGES) - 1) & 1)
            valid = end - j0
            if valid >= BLOCK:
                _tma_kv_tile(k_desc, v_desc, blk * PAGE + j0 % PAGE, kvh, ready.index(stage), k_smem, v_smem,
                             stage * CHUNKS)
            else:   # the split's last tile ends inside it: rows past the end as zeros
                rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, blocked))
                cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, blocked))
                token = ((j0 % PAGE) + rows).to(gl.int64)[:, None]
                live = (rows < valid)[:, None]
                kb = k_ptr + blk.to(gl.int64) * sk_b + token * sk_t + kvh * (CHUNKS * BLOCK)
                vb = v_ptr + blk.to(gl.int64) * sv_b + token * sv_t + kvh * (CHUNKS * BLOCK)
                for c in gl.static_range(CHUNKS):
                    k_smem.index(stage * CHUNKS + c).store(gl.load(kb + (c * BLOCK + cols)[None, :], mask=live,
                                                                   other=0.0))
                    v_smem.index(stage * CHUNKS + c).store(gl.load(vb + (c * BLOCK + cols)[None, :], mask=live,
                                                                   other=0.0))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ready.index(stage))

    @gluon.jit
    def _queries(q_ptr, s, kvh, G, TQ, sq_s, sq_t, sq_h, ROWS: gl.constexpr, TOKENS: gl.constexpr):
        """The kv head's query rows, row r = (token r // G, head r % G) of the step's TQ tokens (ROWS of
        them, zeros past TQ x G; not TOKENS: one token, row r = head r), as two fp32 halves [ROWS, 64]
        of the head dim."""
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
        qc = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, blocked))
        if TOKENS:
            row_off = (qr // G).to(gl.int64) * sq_t + (kvh * G + qr % G).to(gl.int64) * sq_h
        else:
            row_off = (kvh * G + qr).to(gl.int64) * sq_h
        q_base = q_ptr + s.to(gl.int64) * sq_s + row_off[:, None] + qc[None, :]
        qmask = (qr < TQ * G)[:, None]
        q0 = gl.load(q_base, mask=qmask, other=0.0).to(gl.float32)
        q1 = gl.load(q_base + BLOCK, mask=qmask, other=0.0).to(gl.float32)
        return q0, q1

    @gluon.jit
    def _store_out(o_ptr, lse_ptr, o0, o1, factor, lse, s, kvh, split, G, TQ, so_p, so_s, so_t, so_h, sl_p, sl_s,
                   sl_t, dims, qn, TOKENS: gl.constexpr):
        """The split's partial out (the two accumulators [rows, dims] times factor) and lse of the kv
        head's TQ x G query rows (row r: token r // G, head r % G; not TOKENS: one token, row r = head
        r); qn: row indices, dims: head dims 0-63, both in the accumulators' slice layouts."""
        if TOKENS:
            token = qn // G
            head = kvh * G + qn % G
        else:
            token = qn * 0
            head = kvh * G + qn
        o_q = (split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + token.to(gl.int64) * so_t
               + head.to(gl.int64) * so_h)
        mine = qn < TQ * G
        gl.store(o_ptr + o_q[:, None] + dims[None, :], o0 * factor[:, None], mask=mine[:, None])
        gl.store(o_ptr + o_q[:, None] + (BLOCK + dims)[None, :], o1 * factor[:, None], mask=mine[:, None])
        gl.store(lse_ptr + split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + token * sl_t + head, lse, mask=mine)

    @gluon.jit
    def _consumer(q_ptr, k_smem, v_smem, ready, free, table_ptr, glens_ptr, o_ptr, lse_ptr, s, kvh, split,
                  split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sq_s, sq_t, sq_h, G, TQ,
                  qk_scale, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, PAGE: gl.constexpr, STAGES: gl.constexpr,
                  AHEAD: gl.constexpr = False, CAUSAL: gl.constexpr = False):
        """The query rows (a speculative step's TQ tokens x the kv head's G query heads) padded to 64
        (wgmma's M) as the A operand of S = Q K^T from registers, the online softmax over [64 rows, 64
        keys], O += P V with P from registers too. AHEAD: the split's block ids for the final check
        loaded beside the length (`_ids_early`), not after the loop. CAUSAL: a key counts for a row
        where its global position is at most the row's token's (the step's last TQ positions)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        dtype: gl.constexpr = k_smem.dtype
        if AHEAD:
            early = _ids_early(table_ptr, s, st_s, split * split_len, table_w, PAGE, IDS_L)
        q0, q1 = _queries(q_ptr, s, kvh, G, TQ, sq_s, sq_t, sq_h, BLOCK, CAUSAL)
        qa0 = gl.convert_layout(q0.to(dtype), a_l)
        qa1 = gl.convert_layout(q1.to(dtype), a_l)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK], gl.float32, row_l)
        r_i = gl.zeros([BLOCK], gl.float32, row_l)
        o0 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        o1 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        cols = gl.arange(0, BLOCK, layout=col_l)
        rows = gl.arange(0, BLOCK, layout=row_l)
        q_pos = _query_pos(glens_ptr, s, TQ, rows, G, CAUSAL)
        if CAUSAL:  # (the step's first token's position: tiles wholly at or before it need no causal mask)
            q_first = gl.load(glens_ptr + s).to(gl.int32) - TQ
        for t in range(tiles):
            stage = t % STAGES
            j0 = start + t * BLOCK
            mbarrier.wait(ready.index(stage), (t // STAGES) & 1)
            sc = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
            sc = warpgroup_mma(qa0, k_smem.index(stage * CHUNKS).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma(qa1, k_smem.index(stage * CHUNKS + 1).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
            live = (j0 + cols < end)[None, :]
            sc = gl.where(live, sc * qk_scale, float("-inf"))
            if CAUSAL:  # (global positions rise with the local index: the tile's last key is its latest)
                if _global_pos(j0 + BLOCK - 1, dcp_size, dcp_rank, interleave) > q_first:
                    seen = _global_pos(j0 + cols, dcp_size, dcp_rank, interleave)[None, :] <= q_pos[:, None]
                    sc = gl.where(seen, sc, float("-inf"))
            p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, m_i, 1, False)
            pa = gl.convert_layout(p.to(dtype), a_l)
            o0 = warpgroup_mma(pa, v_smem.index(stage * CHUNKS), o0 * alpha[:, None], is_async=True)
            o1 = warpgroup_mma(pa, v_smem.index(stage * CHUNKS + 1), o1 * alpha[:, None], is_async=True)
            o0, o1 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1))
            mbarrier.arrive(free.index(stage))
        if AHEAD:
            bad = bad | _bad_ids_after(early, table_ptr, s, st_s, start, end, num_blocks, PAGE, IDS_L)
        else:
            bad = bad | _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE, col_l)
        factor, lse = _finish(m_i, l_i, r_i, bad, False)
        _store_out(o_ptr, lse_ptr, o0, o1, factor, lse, s, kvh, split, G, TQ, so_p, so_s, so_t, so_h, sl_p, sl_s,
                   sl_t, cols, rows, CAUSAL)

    @gluon.jit
    def _ring(n: gl.constexpr, count: gl.constexpr):
        bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n):
            mbarrier.init(bars.index(i), count=count)
        return bars

    @gluon.jit
    def _gqa_decode_ws_kernel(q_ptr, k_desc, v_desc, k_ptr, v_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr,
                              qk_scale, split_len, G, KV_HEADS, TQ, dcp_size, dcp_rank, interleave, table_w,
                              num_blocks, st_s, sq_s, sq_t, sq_h, sk_b, sk_t, sv_b, sv_t, so_p, so_s, so_t, so_h, sl_p,
                              sl_s, sl_t, PAGE: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr = False,
                              AHEAD: gl.constexpr = False, CAUSAL: gl.constexpr = False,
                              plan_ptr=None, PLANNED: gl.constexpr = False):
        pid = gl.program_id(0)
        split = gl.program_id(1)
        s = pid // KV_HEADS
        kvh = pid % KV_HEADS
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        ready = _ring(STAGES, 1)
        free = _ring(STAGES, 1)
        fence_async_shared()
        if PDL:     # (launched early: the set-up above overlaps the kernel before)
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
        gl.warp_specialize([
            (_consumer, (q_ptr, k_smem, v_smem, ready, free, table_ptr, glens_ptr, o_ptr, lse_ptr, s, kvh, split,
                         split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sq_s, sq_t, sq_h, G, TQ,
                         qk_scale, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, PAGE, STAGES, AHEAD, CAUSAL)),
            (_bf16_loader, (k_desc, v_desc, k_ptr, v_ptr, table_ptr, glens_ptr, k_smem, v_smem, ready, free, s, kvh,
                            split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                            sv_b, sv_t, PAGE, STAGES, AHEAD)),
        ], [4], [64])



if HAS_GLUON:
    DIRECT_REGS = gl.constexpr(128)     # registers a thread of the direct kernel's value warpgroup

    @gluon.jit
    def _direct_queries(q_ptr, s, kvh, G, TQ, sq_s, sq_t, sq_h, ql_smem, table_ptr, st_s, start, end, num_blocks,
                        PAGE: gl.constexpr, NQ: gl.constexpr, key_l: gl.constexpr, IDS: gl.constexpr = True):
        """The kv head's query rows, column c = (token c // G, head c % G) of the step's TQ tokens (NQ of
        them, zeros past TQ x G), times a power of two each (the largest magnitude into [2^7, 2^8): no
        part saturates) as e4m3 hi and lo parts in ql_smem[0], [1]; the split's block ids checked while
        the loads fly. Returns (2^-e per row, whether an id is bad)."""
        lat: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, NQ, layout=gl.SliceLayout(1, lat))
        dims = gl.arange(0, LBOX, layout=gl.SliceLayout(0, lat))
        row_off = (rows // G).to(gl.int64) * sq_t + (kvh * G + rows % G).to(gl.int64) * sq_h
        ptrs = q_ptr + s.to(gl.int64) * sq_s + row_off[:, None] + dims[None, :]
        x = gl.load(ptrs, mask=(rows < TQ * G)[:, None], other=0.0).to(gl.float32)
        if IDS:     # (not IDS: the caller checks them)
            bad = _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE, key_l)
        else:
            bad = False
        biased = (gl.max(gl.abs(x), 1).to(gl.int32, bitcast=True) >> 23) & 0xFF
        e = gl.minimum(gl.maximum(134 - biased, -120), 107)
        _query_split(x, ((e + 127) << 23).to(gl.float32, bitcast=True), ql_smem.index(0), ql_smem.index(1))
        fence_async_shared()
        gl.thread_barrier()
        return ((127 - e) << 23).to(gl.float32, bitcast=True), bad

    @gluon.jit
    def _softmax_quad(sc0, sc1, sc2, sc3, m_i, l_i, r_i, vs0, vs1, vs2, vs3):
        """`gluon_mla._softmax_step` (fp8, deferred sums, keys along axis 0) over four tiles at once: one
        cross-warp maximum of the scores and one of the weights for all four (those reductions bound
        the step: a tile at a time took 0.9 us, two 0.65 us a tile). Returns (p0, p1, p2, p3, alpha,
        m, l, r)."""
        m_new = gl.maximum(m_i, gl.max(gl.maximum(gl.maximum(sc0, sc1), gl.maximum(sc2, sc3)), 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p0 = gl.exp2(sc0 - m_safe[None, :])
        p1 = gl.exp2(sc1 - m_safe[None, :])
        p2 = gl.exp2(sc2 - m_safe[None, :])
        p3 = gl.exp2(sc3 - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha[None, :] + ((p0 + p1) + (p2 + p3))
        p0 = p0 * vs0[:, None]
        p1 = p1 * vs1[:, None]
        p2 = p2 * vs2[:, None]
        p3 = p3 * vs3[:, None]
        r_new = gl.maximum(r_i * alpha, gl.max(gl.maximum(gl.maximum(p0, p1), gl.maximum(p2, p3)), 0))
        inv = 1.0 / gl.where(r_new > 0, r_new, 1.0)
        return (p0 * inv[None, :], p1 * inv[None, :], p2 * inv[None, :], p3 * inv[None, :], r_i * alpha * inv, m_new,
                l_i, r_new)

    @gluon.jit
    def _step_scales(ks_ptr, vs_ptr, b0, b1, b2, b3, j0, end, kvh, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, keys,
                     PAGE: gl.constexpr):
        """The key and value scales of a step's four tiles from j0 on, in blocks b0 .. b3."""
        k0, v0 = _scales_at(ks_ptr, vs_ptr, b0, j0, end, kvh, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, keys, PAGE)
        k1, v1 = _scales_at(ks_ptr, vs_ptr, b1, j0 + BLOCK, end, kvh, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, keys, PAGE)
        k2, v2 = _scales_at(ks_ptr, vs_ptr, b2, j0 + 2 * BLOCK, end, kvh, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, keys,
                            PAGE)
        k3, v3 = _scales_at(ks_ptr, vs_ptr, b3, j0 + 3 * BLOCK, end, kvh, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, keys,
                            PAGE)
        return k0, v0, k1, v1, k2, v2, k3, v3

    @gluon.jit
    def _masked_scores(sc, ks, qk_q, j0, end, keys, q_pos, dcp_size, dcp_rank, interleave, mma: gl.constexpr,
                       CAUSAL: gl.constexpr):
        """A tile's raw scores times its keys' scales and the queries' factors, -inf past the end (and,
        CAUSAL, where a key's global position lies past the column's token, q_pos)."""
        x = gl.convert_layout(_fold_parts(sc, qk_q.shape[0]), mma) * ks[:, None] * qk_q[None, :]  # (same registers)
        live = (j0 + keys < end)[:, None]
        if CAUSAL:
            live = live & (_global_pos(j0 + keys, dcp_size, dcp_rank, interleave)[:, None] <= q_pos[None, :])
        return gl.where(live, x, float("-inf"))

    @gluon.jit
    def _direct_scores(q_ptr, ks_ptr, vs_ptr, ql_smem, k_smem, v_smem, p_smem, a_smem, raw_ready, raw_free, p_ready,
                       p_free, table_ptr, glens_ptr, lse_ptr, s, kvh, split, split_len, dcp_size, dcp_rank,
                       interleave, table_w, num_blocks, st_s, sq_s, sq_t, sq_h, G, TQ, qk_scale, ss_b, ss_t, ss_h,
                       svs_b, svs_t, svs_h, sl_p, sl_s, sl_t, PAGE: gl.constexpr, RAW: gl.constexpr, NQ: gl.constexpr,
                       CAUSAL: gl.constexpr, AHEAD: gl.constexpr = False):
        """The direct fp8 kernel's first warpgroup: the queries, then per step of four raw tiles S^T = K Q^T
        as fp8 MMAs from shared memory (each tile's 128 key dims against the queries' hi and lo parts, one
        operand of 2 NQ columns),
        one online-softmax step over the four with their key and value scales (loaded a step ahead, from
        block ids loaded two steps ahead) and a running per-column unit, the tiles' weights P^T and the
        rescale alpha published in a double buffer for the value warpgroup; at the end the lse, and the
        output's factor to it. A split's last step may hold fewer than four tiles: the absent ones'
        scores are masked and their value stages zeroed (the value warpgroup reads them), which with
        RAW >= 8 nothing else uses then."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
        mma8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 2 * NQ, 32])    # (hi and lo parts)
        key_l: gl.constexpr = gl.SliceLayout(1, mma)
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        keys = gl.arange(0, BLOCK, layout=key_l)
        if AHEAD:   # the first two steps' block ids, and the split's for the check at the end, loaded beside
            first = split * split_len       # the length (bounded by the table: `_table_tiles`)
            ahead = _table_tiles(first, table_w, PAGE)
            b0, b1, b2, b3 = _ids_window(table_ptr, s, st_s, first, ahead, num_blocks, PAGE)
            n0, n1, n2, n3 = _ids_window(table_ptr, s, st_s, first + 4 * BLOCK, ahead - 4, num_blocks, PAGE)
            early = _ids_early(table_ptr, s, st_s, first, table_w, PAGE, IDS_L)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        if not AHEAD:
            b0, b1, b2, b3 = _ids_window(table_ptr, s, st_s, start, tiles, num_blocks, PAGE)
            n0, n1, n2, n3 = _ids_window(table_ptr, s, st_s, start + 4 * BLOCK, tiles - 4, num_blocks, PAGE)
        k0, v0, k1, v1, k2, v2, k3, v3 = _step_scales(ks_ptr, vs_ptr, b0, b1, b2, b3, start, end, kvh, ss_b, ss_t,
                                                      ss_h, svs_b, svs_t, svs_h, keys, PAGE)
        qf, bad_id = _direct_queries(q_ptr, s, kvh, G, TQ, sq_s, sq_t, sq_h, ql_smem, table_ptr, st_s, start, end,
                                     num_blocks, PAGE, NQ, key_l, not AHEAD)
        if not AHEAD:
            bad = bad | bad_id
        qk_q = gl.convert_layout(qf, q_l) * qk_scale
        m_i, l_i, r_i = _softmax_start(NQ, mma)
        cols = gl.arange(0, NQ, layout=q_l)
        q_pos = _query_pos(glens_ptr, s, TQ, cols, G, CAUSAL)
        steps = (tiles + 3) // 4
        for i in range(steps):
            t = 4 * i
            pb = i % 2
            j0 = start + t * BLOCK
            # (this step's scales; the next step's from the ids loaded a step ago; the ids two steps ahead)
            ks0, vs0, ks1, vs1, ks2, vs2, ks3, vs3 = k0, v0, k1, v1, k2, v2, k3, v3
            k0, v0, k1, v1, k2, v2, k3, v3 = _step_scales(ks_ptr, vs_ptr, n0, n1, n2, n3, j0 + 4 * BLOCK, end, kvh,
                                                          ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, keys, PAGE)
            n0, n1, n2, n3 = _ids_window(table_ptr, s, st_s, j0 + 8 * BLOCK, tiles - t - 8, num_blocks, PAGE)
            for k in gl.static_range(4):
                mbarrier.wait(raw_ready.index((t + k) % RAW), ((t + k) // RAW) & 1, pred=t + k < tiles)
            # (absent tiles: their stages' stale bytes, masked below)
            sc0 = _scores_box8(k_smem.index(t % RAW), ql_smem, 0, mma8, NQ)
            sc1 = _scores_box8(k_smem.index((t + 1) % RAW), ql_smem, 0, mma8, NQ)
            sc2 = _scores_box8(k_smem.index((t + 2) % RAW), ql_smem, 0, mma8, NQ)
            sc3 = _scores_box8(k_smem.index((t + 3) % RAW), ql_smem, 0, mma8, NQ)
            sc0, sc1, sc2, sc3 = warpgroup_mma_wait(num_outstanding=0, deps=(sc0, sc1, sc2, sc3))
            for k in gl.static_range(4):
                mbarrier.arrive(raw_free.index((t + k) % RAW), pred=t + k < tiles)
            tail = end - j0     # (the step's last present tile ends inside it: its value rows past the end to
            if tail < 4 * BLOCK:    # zeros before the value warpgroup may read them)
                if tail % BLOCK > 0:
                    _zero_tail(v_smem, (t + tail // BLOCK) % RAW, tail % BLOCK, 1)
            p0, p1, p2, p3, alpha, m_i, l_i, r_i = _softmax_quad(
                _masked_scores(sc0, ks0, qk_q, j0, end, keys, q_pos, dcp_size, dcp_rank, interleave, mma, CAUSAL),
                _masked_scores(sc1, ks1, qk_q, j0 + BLOCK, end, keys, q_pos, dcp_size, dcp_rank, interleave, mma,
                               CAUSAL),
                _masked_scores(sc2, ks2, qk_q, j0 + 2 * BLOCK, end, keys, q_pos, dcp_size, dcp_rank, interleave, mma,
                               CAUSAL),
                _masked_scores(sc3, ks3, qk_q, j0 + 3 * BLOCK, end, keys, q_pos, dcp_size, dcp_rank, interleave, mma,
                               CAUSAL), m_i, l_i, r_i, vs0, vs1, vs2, vs3)
            if i >= 2:
                mbarrier.wait(p_free.index(pb), ((i // 2) - 1) & 1)
            for k in gl.static_range(1, 4):     # (absent tiles: the value warpgroup is done with their stages now)
                if t + k >= tiles:
                    _zero_tail(v_smem, (t + k) % RAW, 0, 1)
            p_smem.index(4 * pb).store(gl.permute(p0.to(gl.float16), [1, 0]))
            p_smem.index(4 * pb + 1).store(gl.permute(p1.to(gl.float16), [1, 0]))
            p_smem.index(4 * pb + 2).store(gl.permute(p2.to(gl.float16), [1, 0]))
            p_smem.index(4 * pb + 3).store(gl.permute(p3.to(gl.float16), [1, 0]))
            a_smem.index(pb).store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready.index(pb))
        if AHEAD:
            bad = bad | _bad_ids_after(early, table_ptr, s, st_s, start, end, num_blocks, PAGE, IDS_L)
        factor, lse = _finish(m_i, gl.sum(l_i, 0), r_i, bad, True)
        lse_at = (split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + (cols // G).to(gl.int64) * sl_t + kvh * G
                  + cols % G)
        gl.store(lse_ptr + lse_at, lse, mask=cols < TQ * G)
        _publish_factor(a_smem, p_free, p_ready, steps, factor)

    @gluon.jit
    def _scales_at(ks_ptr, vs_ptr, blk, j0, end, kvh, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, srows,
                   PAGE: gl.constexpr):
        """The key and value scales of the tile at local token j0 in cache block blk (an id already
        loaded and clamped; 0 past the split's end)."""
        token = ((j0 % PAGE) + srows).to(gl.int64)
        slive = srows < end - j0
        ks = gl.load(ks_ptr + blk.to(gl.int64) * ss_b + token * ss_t + kvh * ss_h, mask=slive, other=0.0)
        vs = gl.load(vs_ptr + blk.to(gl.int64) * svs_b + token * svs_t + kvh * svs_h, mask=slive, other=0.0)
        return ks, vs

    @gluon.jit
    def _direct_values(v_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, kvh, split,
                       split_len, dcp_size, dcp_rank, interleave, table_w, G, TQ, so_p, so_s, so_t, so_h,
                       PAGE: gl.constexpr, RAW: gl.constexpr, NQ: gl.constexpr, PAIRED: gl.constexpr = False):
        """The direct fp8 kernel's value warpgroup: per step of four tiles, once their weights are
        published, O^T = alpha O^T + sum_k Vk^T Pk^T with each value box read from the raw bytes
        (`_value_operands`: one accumulator of the even dims, one of the odd), then its hold on the
        stages released; at the end the output times the scores warpgroup's factor."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
        key_l: gl.constexpr = gl.SliceLayout(1, mma)
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        i16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        even = gl.zeros([BLOCK, NQ], gl.float32, mma)
        odd = gl.zeros([BLOCK, NQ], gl.float32, mma)
        steps = (tiles + 3) // 4
        for i in range(steps):
            t = 4 * i
            pb = i % 2
            mbarrier.wait(p_ready.index(pb), (i // 2) & 1)
            alpha = a_smem.index(pb).load(q_l)
            e0, o0 = _value_operands(v_smem.index(t % RAW), a_l, i16)
            pt = p_smem.index(4 * pb).permute((1, 0))
            even = warpgroup_mma(e0, pt, even * alpha[None, :], is_async=True)
            odd = warpgroup_mma(o0, pt, odd * alpha[None, :], is_async=True)
            e1, o1 = _value_operands(v_smem.index((t + 1) % RAW), a_l, i16)
            pt = p_smem.index(4 * pb + 1).permute((1, 0))
            even = warpgroup_mma(e1, pt, even, is_async=True)
            odd = warpgroup_mma(o1, pt, odd, is_async=True)
            even, odd = warpgroup_mma_wait(num_outstanding=2, deps=(even, odd))
            e2, o2 = _value_operands(v_smem.index((t + 2) % RAW), a_l, i16)
            pt = p_smem.index(4 * pb + 2).permute((1, 0))
            even = warpgroup_mma(e2, pt, even, is_async=True)
            odd = warpgroup_mma(o2, pt, odd, is_async=True)
            even, odd = warpgroup_mma_wait(num_outstanding=2, deps=(even, odd))
            e3, o3 = _value_operands(v_smem.index((t + 3) % RAW), a_l, i16)
            pt = p_smem.index(4 * pb + 3).permute((1, 0))
            even = warpgroup_mma(e3, pt, even, is_async=True)
            odd = warpgroup_mma(o3, pt, odd, is_async=True)
            even, odd = warpgroup_mma_wait(num_outstanding=0, deps=(even, odd))
            mbarrier.arrive(p_free.index(pb))
            for k in gl.static_range(4):
                mbarrier.arrive(raw_free.index((t + k) % RAW), pred=t + k < tiles)
        mbarrier.wait(p_ready.index(steps % 2), (steps // 2) & 1)
        factor = a_smem.index(steps % 2).load(q_l)
        cols = gl.arange(0, NQ, layout=q_l)
        rows = gl.arange(0, BLOCK, layout=key_l)
        o_q = (split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + (cols // G).to(gl.int64) * so_t
               + (kvh * G + cols % G).to(gl.int64) * so_h)
        _store_box(o_ptr, even, odd, 0, factor, o_q, cols < TQ * G, rows, PAIRED)

    @gluon.jit
    def _direct_loader(k_desc, v_desc, table_ptr, glens_ptr, k_smem, v_smem, raw_ready, raw_free, s, kvh, split,
                       split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, PAGE: gl.constexpr,
                       RAW: gl.constexpr, AHEAD: gl.constexpr = False):
        """(one warp) Each 64-key tile's key and value boxes (64 x 128 fp8 each: a tile lies in its page)
        by TMA into the raw ring, the block ids four tiles ahead (AHEAD: the first four loaded beside the
        sequence's length, `_table_tiles`)."""
        start, tiles, b1, b2, b3, b4 = _window_start(table_ptr, glens_ptr, s, st_s, split, split_len, dcp_size,
                                                     dcp_rank, interleave, table_w, num_blocks, PAGE, AHEAD)
        for t in range(tiles):
            rs, j0, blk, b1, b2, b3, b4 = _window_tile(b1, b2, b3, b4, table_ptr, s, st_s, start, t, tiles, num_blocks,
                                                       raw_free, PAGE, RAW)
            mbarrier.expect(raw_ready.index(rs), 2 * k_desc.block_type.nbytes)
            row = blk * PAGE + j0 % PAGE
            tma.async_copy_global_to_shared(k_desc, [row, kvh * LBOX], raw_ready.index(rs), k_smem.index(rs))
            tma.async_copy_global_to_shared(v_desc, [row, kvh * LBOX], raw_ready.index(rs), v_smem.index(rs))

    @gluon.jit
    def _gqa_decode_direct_kernel(q_ptr, k_desc, v_desc, ks_ptr, vs_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr,
                                  qk_scale, split_len, G, KV_HEADS, TQ, dcp_size, dcp_rank, interleave, table_w,
                                  num_blocks, st_s, sq_s, sq_t, sq_h, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h,
                                  so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, PAGE: gl.constexpr, RAW: gl.constexpr,
                                  NQ: gl.constexpr, CAUSAL: gl.constexpr = False, PDL: gl.constexpr = False,
                                  PAIRED: gl.constexpr = False, AHEAD: gl.constexpr = False,
                                  plan_ptr=None, PLANNED: gl.constexpr = False):
        """fp8 cache without a converter: a one-warp TMA loader fills RAW raw stages (a tile's key and
        value boxes); one warpgroup computes the scores as fp8 MMAs straight from the raw keys
        (`_direct_scores`), the other reads the raw values into its MMA's A operand (`_direct_values`),
        one tile behind, through a double buffer of the weights. PAIRED: the output's dim pairs stored
        together; AHEAD: the block ids the loader and the scores warpgroup need first (and the latter's
        id check) loaded beside the sequence's length."""
        pid = gl.program_id(0)
        split = gl.program_id(1)
        s = pid // KV_HEADS
        kvh = pid % KV_HEADS
        lbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        pbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, BLOCK], gl.float16)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        ql_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, NQ, LBOX], lbox)
        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW, BLOCK, LBOX], lbox)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW, BLOCK, LBOX], lbox)
        p_smem = gl.allocate_shared_memory(gl.float16, [8, NQ, BLOCK], pbox)      # (two steps of four tiles)
        a_smem = gl.allocate_shared_memory(gl.float32, [2, NQ], vec)
        raw_ready = _ring(RAW, 1)
        raw_free = _ring(RAW, 2)
        p_ready = _ring(2, 1)
        p_free = _ring(2, 1)
        fence_async_shared()
        if PDL:     # (launched early: the barriers above are set up while the kernel before finishes)
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
        gl.warp_specialize([
            (_direct_scores, (q_ptr, ks_ptr, vs_ptr, ql_smem, k_smem, v_smem, p_smem, a_smem, raw_ready, raw_free,
                              p_ready, p_free, table_ptr, glens_ptr, lse_ptr, s, kvh, split, split_len, dcp_size,
                              dcp_rank, interleave, table_w, num_blocks, st_s, sq_s, sq_t, sq_h, G, TQ, qk_scale,
                              ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, sl_p, sl_s, sl_t, PAGE, RAW, NQ, CAUSAL,
                              AHEAD)),
            (_direct_values, (v_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, kvh, split,
                              split_len, dcp_size, dcp_rank, interleave, table_w, G, TQ, so_p, so_s, so_t, so_h,
                              PAGE, RAW, NQ, PAIRED)),
            (_direct_loader, (k_desc, v_desc, table_ptr, glens_ptr, k_smem, v_smem, raw_ready, raw_free, s, kvh,
                              split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, PAGE,
                              RAW, AHEAD)),
        ], [4, 1], [DIRECT_REGS, 24])


DIRECT_MAX_G = 32       # the direct fp8 kernel's widest column tile (query heads per kv head)
DIRECT_MIN_STAGES = 8   # its fewest raw stages: tiles go in steps of four, and an absent tile's stage is zeroed


def direct_stages(g: int, raw: int) -> int:
    """The direct fp8 kernel's raw stages for g query heads per kv head: the configured `raw`, at least
    DIRECT_MIN_STAGES, cut to what shared memory holds beside the queries' two e4m3 parts, the weights'
    two steps of four buffers and 1 KB of the compiler's scratch (0: the kernel does not apply, or `raw`
    is 0: off)."""
    if g > DIRECT_MAX_G or raw <= 0:
        return 0
    nq = max(8, 1 << (g - 1).bit_length())
    fixed = 2 * nq * _HEAD_DIM + 8 * nq * _BLOCK * 2 + 2 * nq * 4 + 8 * 4 + 1024
    raw = max(raw, DIRECT_MIN_STAGES)
    while raw > DIRECT_MIN_STAGES and fixed + raw * (2 * _BLOCK * _HEAD_DIM + 16) > SMEM_LIMIT:
        raw -= 1
    return raw


def bf16_max_tq(g: int) -> int:
    """The most query tokens a step the bf16 kernel takes at g query heads per kv head: its rows, tokens
    x heads, fill at most one 64-row MMA tile (so a speculative step costs the MMAs of one token)."""
    return _BLOCK // g if 0 < g <= _BLOCK else 0


def gluon_gqa_ok(q: Tensor, k: Tensor, v: Tensor, tq: int, k_scale: Tensor | None = None,
                 v_scale: Tensor | None = None, max_tq: int = 1) -> bool:
    """The Gluon GQA kernels apply: bf16 queries [S, Tq, Hq, 128] (contiguous; Tq <= max_tq: one query
    token, or a speculative step's few: over bf16 `bf16_max_tq`, in the direct fp8 form `direct_stages`
    of Tq x Hq / Hkv columns);
    a bf16 cache, or an fp8 one with fp32 scales [nb, page, Hkv] for keys and values; separate k
    and v tensors [nb, page, Hkv, 128], each contiguous; at most 64 query heads per kv head; pages
    a multiple of 64 tokens; an sm_90 GPU."""
    if not (HAS_GLUON and q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    if k.dtype == torch.float8_e4m3fn:
        if not all(t is not None and t.dtype == torch.float32 and t.dim() == 3 for t in (k_scale, v_scale)):
            return False
    elif k.dtype != torch.bfloat16:
        return False
    hq, hkv = q.shape[-2], k.shape[2]
    return (q.dtype == torch.bfloat16 and 1 <= tq <= max_tq and q.is_contiguous() and q.shape[-1] == _HEAD_DIM
            and k.dim() == 4 and k.shape[-1] == _HEAD_DIM and v.shape == k.shape and v.dtype == k.dtype
            and k.is_contiguous() and v.is_contiguous() and v.data_ptr() != k.data_ptr()
            and hq % hkv == 0 and hq // hkv <= _BLOCK and k.shape[1] % _BLOCK == 0
            and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0)


def launch_gluon_gqa(q: Tensor, k: Tensor, v: Tensor, table: Tensor, seq_lens: Tensor, o: Tensor, lse: Tensor,
                     scale_log2: float, splits: int, split_len: int, dcp_size: int, dcp_rank: int, interleave: int,
                     k_scale: Tensor | None = None, v_scale: Tensor | None = None, stages: int = 3, direct: int = 8,
                     pdl: bool = False, paired: bool = False, ahead: bool = False,
                     plan: Tensor | None = None) -> None:
    """Fill the split partials o [splits, S, Tq, Hq, 128] / lse [splits, S, Tq, Hq] (`gluon_gqa_ok`).
    stages: the bf16 ring's (32 KB each, at most 6); direct: over fp8, the direct kernel's raw stages,
    cut to `direct_stages` (ValueError where none apply: more than DIRECT_MAX_G columns of tokens x
    query heads a kv head); paired: its output's dim pairs stored together; ahead: the first
    block ids loaded beside the length. pdl: launched with programmatic dependent launch
    (`triton_merge.pdl_ok`). plan: a length plan's item table (`triton_decode.LengthPlan`): the
    grid's `splits` are its items, o's sequence stride 0."""
    s, tq, hq, d = q.shape
    nb, page, hkv = k.shape[0], k.shape[1], k.shape[2]
    fp8 = k.dtype == torch.float8_e4m3fn
    raw = direct_stages(tq * (hq // hkv), direct) if fp8 else 0
    if fp8 and not raw:
        raise ValueError(f"the Gluon GQA kernel over fp8 takes at most {DIRECT_MAX_G} columns (tokens x query heads "
                         f"a kv head) and >= {DIRECT_MIN_STAGES} raw stages; got {tq} x {hq // hkv} columns, "
                         f"direct={direct}")
    if tq * (hq // hkv) > _BLOCK and not fp8:
        raise ValueError(f"the Gluon GQA kernel over bf16 takes at most {_BLOCK} rows (tokens x query heads a kv "
                         f"head); got {tq} x {hq // hkv}")
    launch = {"PDL": True, "launch_pdl": True} if pdl else {}
    launch.update(planned_launch(plan))
    k2, v2 = k.view(nb * page, hkv * d), v.view(nb * page, hkv * d)
    if fp8:
        nq = max(8, 1 << (tq * (hq // hkv) - 1).bit_length())   # (columns to a power of two)
        lbox = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _HEAD_DIM], lbox)
        v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [_BLOCK, _HEAD_DIM], lbox)
        _gqa_decode_direct_kernel[(grid_rows(s, plan) * hkv, splits)](
            q, k_desc, v_desc, k_scale, v_scale, table, seq_lens, o, lse, scale_log2, split_len, hq // hkv, hkv, tq,
            dcp_size, dcp_rank, interleave, table.shape[1], nb, table.stride(0), q.stride(0), q.stride(1),
            q.stride(2), *k_scale.stride(), *v_scale.stride(), o.stride(0), o.stride(1), o.stride(2), o.stride(3),
            lse.stride(0), lse.stride(1), lse.stride(2), PAGE=page, RAW=raw, NQ=nq, CAUSAL=tq > 1,
            PAIRED=bool(paired), AHEAD=bool(ahead), num_warps=4, **launch)
        return
    # [blocks * page, kv heads * 128]: a tile of kv head h is the boxes at columns h * 128 + 0 / 64
    box = shared_box(_BLOCK, _BLOCK, gl.bfloat16)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], box)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [_BLOCK, _BLOCK], box)
    _gqa_decode_ws_kernel[(grid_rows(s, plan) * hkv, splits)](
        q, k_desc, v_desc, k, v, table, seq_lens, o, lse, scale_log2, split_len, hq // hkv, hkv, tq, dcp_size,
        dcp_rank, interleave, table.shape[1], nb, table.stride(0), q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0),
        lse.stride(1), lse.stride(2), PAGE=page, STAGES=min(stages, 6), AHEAD=bool(ahead), CAUSAL=tq > 1,
        num_warps=4, **launch)
