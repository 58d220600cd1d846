"""MLA absorbed decode for narrow head tiles (at most 32 query heads: 16 under TP 8, DeepSeek's
usual DCP deployment) as warp-specialized Gluon kernels for Hopper with swapped operands.

`gluon_mla`'s kernels put the heads in wgmma's M dimension, which is 64: with 16 heads three
quarters of every score and output MMA, and of the softmax, work on padding rows. Here the tile's
64 keys are M and the NQ columns (heads, or a speculative step's tokens x heads, at most 32,
rounded up to a power of two >= 8) are N:

- S^T = K Q^T: the key tile (the 576-wide latent + rope row) is the A operand, the queries
  (NQ x 576, shared memory) the B operand;
- the online softmax runs down the keys of each head's column (per-head maxima and sums
  reduce across the warpgroup);
- O^T += V^T P^T: the value dims (the latent's first 512, the same bytes read transposed) are M
  in eight 64-row accumulators of NQ columns each (64 fp32 registers a thread at NQ 16, against
  4 x 64 in each of two warpgroups for a padded tile), the weights P^T (shared memory) are B.

Over bf16 (`_mla_narrow_kernel`) a loader warpgroup brings the queries and each tile by TMA into a
2-stage ring (the masked last tile through loads, zeros past the end, as in `gluon_mla._loader`)
and one consumer warpgroup does all of the above.

Over fp8 (`_mla_narrow_direct_kernel`, CONFIG direct_wide_narrow_fp8) there is no converter and no
fp16 stage: a one-warp loader brings each raw tile as four 64 x 128 latent boxes, the rope box and
the scales into up to five stages, and two warpgroups read the bytes themselves. The scores
warpgroup splits the queries into two e4m3 parts (hi + lo, one operand of 2 NQ columns, so one MMA
reads a box once) and computes S^T as fp8 MMAs straight from shared memory, each box into its own
accumulator summed in fp32, at most 16 columns in tile pairs (the second tile's MMAs run under the
first's softmax); it publishes P^T and the rescale through a double buffer. The value warpgroup
loads each latent box transposed with 16-bit ldmatrix (64 dim pairs x 64 keys) and splits each
pair into its even and odd dims in registers, so each of its eight accumulators holds one parity
of a box's 128 dims. Those splits are e4m3 -> fp16 conversions (and the byte permutes that feed
them) in the installed form; with CONFIG values8_narrow_fp8 (`_values_tile8`, at most 16 columns)
they are byte permutes only, the value MMAs run in fp8 against the weights published as e4m3 hi + lo
parts, and each tile's MMAs start a fresh accumulator that the fp32 outputs take up (the tensor
cores' fp8 sums are not kept in fp32 over long chains).

More than 32 columns (a speculative step's tokens x heads) run in head tiles of 32 (`head_tiles`:
one program a sequence x tile, a sequence's tiles side by side in the grid, so that all but the
first find its keys in L2).

The output is the split's partial (out, lse) in `triton_decode.paged_decode_triton`'s layout.
`narrow_ok` says where they apply; CONFIG swap_wide_narrow / swap_wide_narrow_fp8 choose them.
(Forms measured and removed, a converter warpgroup to fp16 stages over fp8 and fp16 score MMAs
over the raw bytes among them: triton_decode.CONFIG's notes.)"""

from __future__ import annotations

import torch
from torch import Tensor

from .gluon_mla import (_BLOCK, _CHUNKS, HAS_GLUON, SMEM_LIMIT, grid_rows, planned_launch, scales_by_tma,
                        shared_box)

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_mla import (BLOCK, CHUNKS, IDS_L, STAGES, _bad_ids, _bad_ids_after, _barriers, _finish,
                            _gdc_wait_and_release, _ids_early, _loader, _softmax_step, _split_range, _window_start,
                            _window_tile)
    from .triton_common import global_pos as _global_pos
    from .triton_common import work_item as _work_item

MAX_HEADS = 32      # the widest narrow tile: NQ = 32 columns (eight 64 x 32 fp32 accumulators)
VALUES8_MAX_COLUMNS = 16  # the widest tile whose value MMAs go in fp8 (`values8_apply`; at 32 its accumulators
#                           and operands spill 456-468 B)
PAIRS_MAX_COLUMNS = 16  # the direct fp8 form's widest tile whose scores go in tile pairs (at 32 two tiles'
#                         score accumulators spill 0.6-0.8 KB)
_LBOX, _LBOXES = 128, 4     # the direct fp8 kernel's latent boxes: 128 dims (128-byte rows), four of them
_DIRECT_STAGE = _LBOXES * _BLOCK * _LBOX + _BLOCK * _BLOCK + 4 * _BLOCK    # a raw stage: latent, rope, scales


def columns(heads: int) -> int:
    """NQ: the heads rounded up to a power of two, at least 8 (wgmma's N)."""
    return max(8, 1 << (heads - 1).bit_length())


def direct_fits(heads: int, raw: int) -> bool:
    """The direct fp8 kernel's shared memory (no fp16 stages): the queries (NQ x 576 at two bytes a dim:
    fp16, or e4m3 hi and lo parts), `raw` raw stages of 64 keys (four 64 x 128 latent boxes, the 64 x 64 rope box and the
    keys' scales), two buffers of the weights (NQ x 64 fp16) and their rescale, barriers and 1 KB of
    the compiler's scratch (the sm_90a builds take 0.3-0.4 KB)."""
    nq = columns(heads)
    need = (nq * _CHUNKS * _BLOCK * 2 + raw * _DIRECT_STAGE + 2 * (nq * _BLOCK * 2 + nq * 4) + 8 * (2 * raw + 4)
            + 1024)
    return heads <= MAX_HEADS and raw >= 1 and need <= SMEM_LIMIT


def direct_stages(heads: int, raw: int) -> int:
    """The direct kernel's raw stages at this head count: the configured `raw` cut to what shared memory
    holds (0: none fit, or `raw` is 0: off, the kernel does not run)."""
    while raw > 0 and not direct_fits(heads, raw):
        raw -= 1
    return raw


def pairs_apply(rows: int, raw: int) -> bool:
    """The direct fp8 form can take its scores in tile pairs: at least two raw stages (the pair's tiles
    in two of them) and at most PAIRS_MAX_COLUMNS query rows."""
    return raw >= 2 and rows <= PAIRS_MAX_COLUMNS


def values8_apply(rows: int) -> bool:
    """The direct fp8 kernel's value MMAs may go in fp8 (`_values_tile8`): at most VALUES8_MAX_COLUMNS
    columns a tile."""
    return rows <= VALUES8_MAX_COLUMNS


def head_tiles(rows: int, width: int = MAX_HEADS) -> tuple[int, int]:
    """(NQ, tiles) of the swapped kernels over `rows` query columns (tokens x heads): one tile of
    `columns(rows)` up to `width` (16 or 32), else tiles of `width` (the last one's columns past
    `rows` padding, never stored)."""
    if width not in (16, MAX_HEADS):
        raise ValueError(f"head tiles are 16 or {MAX_HEADS} columns wide, not {width}")
    if rows <= width:
        return columns(rows), 1
    return width, -(-rows // width)


def tiles_ok(rows: int, k: Tensor, k_scale: Tensor | None) -> bool:
    """The swapped kernels apply to `rows` query columns in head tiles (`head_tiles`; where
    `gluon_mla.gluon_mla_ok` holds, up to 8 query tokens): over fp8 scales [nb, page, 1] its loader can
    bring by TMA (`gluon_mla.scales_by_tma`)."""
    return HAS_GLUON and rows >= 1 and (k.dtype != torch.float8_e4m3fn or scales_by_tma(k_scale))


def narrow_ok(rows: int, k: Tensor, k_scale: Tensor | None) -> bool:
    """The swapped kernel applies (where `gluon_mla.gluon_mla_ok` holds, up to 8 query tokens): at most
    32 query rows (tokens x heads), and over fp8 scales [nb, page, 1] its loader can bring by TMA
    (`gluon_mla.scales_by_tma`)."""
    if not HAS_GLUON or rows > MAX_HEADS:
        return False
    return k.dtype != torch.float8_e4m3fn or scales_by_tma(k_scale)


if HAS_GLUON:
    @gluon.jit
    def _first_column(TILES: gl.constexpr, NQ: gl.constexpr):
        """The first of this program's NQ columns (tokens x heads) of its sequence: program_id(0) is
        sequence x TILES + head tile (0 where TILES is 1: the build of one tile a sequence folds it)."""
        return (gl.program_id(0) % TILES) * NQ

    @gluon.jit
    def _query_pos(glens_ptr, s, TQ, cols, H, CAUSAL: gl.constexpr):
        """CAUSAL: each column's token position (a speculative step's tokens: the last TQ of the
        sequence, column c's is c // H); else cols (unused)."""
        if CAUSAL:
            q_pos = gl.load(glens_ptr + s).to(gl.int32) - TQ + cols // H
        else:
            q_pos = cols
        return q_pos

    @gluon.jit
    def _softmax_start(NQ: gl.constexpr, mma: gl.constexpr):
        """The online softmax's (m, l, r) before the first tile, keys along axis 0 of mma (l per key
        position: summed over the keys at the end)."""
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        return (gl.full([NQ], float("-inf"), gl.float32, q_l), gl.zeros([BLOCK, NQ], gl.float32, mma),
                gl.zeros([NQ], gl.float32, q_l))

    @gluon.jit
    def _pv_t(o0, o1, o2, o3, o4, o5, o6, o7, alpha, p_smem, k_smem, first):
        """The eight value-dim accumulators O^T [64, NQ] rescaled per head by alpha, plus V^T P^T over
        the stage's boxes first .. first + 7 (the latent's 512 dims) read transposed."""
        pt = p_smem.permute((1, 0))
        o0 = warpgroup_mma(k_smem.index(first).permute((1, 0)), pt, o0 * alpha[None, :], is_async=True)
        o1 = warpgroup_mma(k_smem.index(first + 1).permute((1, 0)), pt, o1 * alpha[None, :], is_async=True)
        o2 = warpgroup_mma(k_smem.index(first + 2).permute((1, 0)), pt, o2 * alpha[None, :], is_async=True)
        o3 = warpgroup_mma(k_smem.index(first + 3).permute((1, 0)), pt, o3 * alpha[None, :], is_async=True)
        o4 = warpgroup_mma(k_smem.index(first + 4).permute((1, 0)), pt, o4 * alpha[None, :], is_async=True)
        o5 = warpgroup_mma(k_smem.index(first + 5).permute((1, 0)), pt, o5 * alpha[None, :], is_async=True)
        o6 = warpgroup_mma(k_smem.index(first + 6).permute((1, 0)), pt, o6 * alpha[None, :], is_async=True)
        o7 = warpgroup_mma(k_smem.index(first + 7).permute((1, 0)), pt, o7 * alpha[None, :], is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3, o4, o5, o6, o7))

    @gluon.jit
    def _store_t(o_ptr, o, c, factor, o_q, live, dims):
        """Output dims c * 64 .. c * 64 + 63 of the heads (columns) `live`, times their factor."""
        gl.store(o_ptr + o_q[None, :] + (c * BLOCK + dims)[:, None], o * factor[None, :], mask=live[None, :])

    @gluon.jit
    def _consumer(q_smem, k_smem, p_smem, q_bar, ready, free, table_ptr, glens_ptr, o_ptr,
                  lse_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                  qk_scale, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, HQ, TQ, PAGE: gl.constexpr, RING: gl.constexpr,
                  NQ: gl.constexpr, CAUSAL: gl.constexpr, AHEAD: gl.constexpr = False,
                  TILES: gl.constexpr = 1):
        """S^T = K Q^T over the nine boxes, the online softmax down each column, O^T += V^T P^T. Column c
        is query token (c0 + c) // HQ's head (c0 + c) % HQ (c0: the head tile's first column,
        `_first_column`); CAUSAL (TQ > 1): token t sees the keys at global positions <= its own, length -
        TQ + t. AHEAD: the split's block ids for the final check loaded beside the length (`_ids_early`),
        not after the loop.
        (Two consumers on alternate tiles, each writing its own partial for the split merge, ran 1.5-2.2x
        slower: their registers spilled 880 B; decode-narrow3-h200.json.)"""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
        key_l: gl.constexpr = gl.SliceLayout(1, mma)
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        if AHEAD:
            early = _ids_early(table_ptr, s, st_s, split * split_len, table_w, PAGE, IDS_L)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        m_i, l_i, r_i = _softmax_start(NQ, mma)
        o0 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o1 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o2 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o3 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o4 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o5 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o6 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o7 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        keys = gl.arange(0, BLOCK, layout=key_l)
        cols = _first_column(TILES, NQ) + gl.arange(0, NQ, layout=q_l)
        q_pos = _query_pos(glens_ptr, s, TQ, cols, HQ, CAUSAL)
        mbarrier.wait(q_bar, 0)
        for t in range(tiles):
            stage = t % RING
            j0 = start + t * BLOCK
            mbarrier.wait(ready.index(stage), (t // RING) & 1)
            sc = gl.zeros([BLOCK, NQ], gl.float32, mma)
            for c in gl.static_range(CHUNKS):
                sc = warpgroup_mma(k_smem.index(stage * CHUNKS + c), q_smem.index(c).permute((1, 0)), sc,
                                   is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
            live = (j0 + keys < end)[:, None]
            if CAUSAL:
                live = live & (_global_pos(j0 + keys, dcp_size, dcp_rank, interleave)[:, None] <= q_pos[None, :])
            sc = gl.where(live, sc * qk_scale, float("-inf"))
            p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, m_i, 0, False, True)
            if t > 0:       # (the previous tile's V^T P^T read p_smem: done, its wait returned)
                gl.thread_barrier()
            p_smem.store(gl.permute(p.to(p_smem.dtype), [1, 0]))
            fence_async_shared()
            gl.thread_barrier()
            o0, o1, o2, o3, o4, o5, o6, o7 = _pv_t(o0, o1, o2, o3, o4, o5, o6, o7, alpha, p_smem, k_smem,
                                                   stage * CHUNKS)
            mbarrier.arrive(free.index(stage))
        if AHEAD:
            bad = bad | _bad_ids_after(early, table_ptr, s, st_s, start, end, num_blocks, PAGE, IDS_L)
        else:
            bad = bad | _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE, key_l)
        factor, lse = _finish(m_i, gl.sum(l_i, 0), r_i, bad, False)
        mine = cols < TQ * HQ
        tok = (cols // HQ).to(gl.int64)
        head = (cols % HQ).to(gl.int64)
        gl.store(lse_ptr + split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + tok * sl_t + head, lse, mask=mine)
        o_q = split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + tok * so_t + head * so_h
        _store_t(o_ptr, o0, 0, factor, o_q, mine, keys)
        _store_t(o_ptr, o1, 1, factor, o_q, mine, keys)
        _store_t(o_ptr, o2, 2, factor, o_q, mine, keys)
        _store_t(o_ptr, o3, 3, factor, o_q, mine, keys)
        _store_t(o_ptr, o4, 4, factor, o_q, mine, keys)
        _store_t(o_ptr, o5, 5, factor, o_q, mine, keys)
        _store_t(o_ptr, o6, 6, factor, o_q, mine, keys)
        _store_t(o_ptr, o7, 7, factor, o_q, mine, keys)

    @gluon.jit
    def _mla_narrow_kernel(q_desc, k_desc, k_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr, qk_scale, split_len, HQ, TQ,
                           dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                           so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, PAGE: gl.constexpr, NQ: gl.constexpr,
                           CAUSAL: gl.constexpr = False, PDL: gl.constexpr = False, AHEAD: gl.constexpr = False,
                           TILES: gl.constexpr = 1,
                           plan_ptr=None, PLANNED: gl.constexpr = False):
        """bf16 latent cache: the loader's TMA boxes of NQ query rows (rows past the sequence's TQ x HQ
        are other rows or zeros: their columns are never stored) and of each 64-key tile. TILES: as in
        `_mla_narrow_direct_kernel`."""
        s = gl.program_id(0) // TILES
        split = gl.program_id(1)
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
        qbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, BLOCK], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, NQ, BLOCK], qbox)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, BLOCK], qbox)
        q_bar, ready, free, p_ready, p_free = _barriers(STAGES, 1)
        if PDL:     # (launched early: the set-up above overlaps the kernel before)
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, p_smem, q_bar, ready, free, table_ptr, glens_ptr, o_ptr, lse_ptr,
                         s, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                         qk_scale, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, HQ, TQ, PAGE, STAGES, NQ, CAUSAL, AHEAD,
                         TILES)),
            (_loader, (q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready, free, s,
                       s * (TQ * HQ) + _first_column(TILES, NQ),
                       split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                       PAGE, AHEAD)),
        ], [4], [64])

    LBOX = gl.constexpr(128)       # the direct kernel: fp8 dims of a latent box (128-byte rows)
    LBOXES = gl.constexpr(4)       # latent boxes of a key tile (4 x 128 = 512)
    REGS_VALUES = gl.constexpr(232)     # registers a thread of the direct kernel's value warpgroup

    @gluon.jit
    def _fp8_pairs(x):
        """int16 elements holding two e4m3 values each (the low byte: the even dim) -> (the even values,
        the odd values) as fp16 (exact), in x's layout: two conversions and two byte permutes a pair
        of elements (the values' A operand, whose register pairs are two keys of one dim)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b16 a0, a1; .reg .b32 t0, t1; mov.b32 {a0, a1}, $2; cvt.rn.f16x2.e4m3x2 t0, a0; "
            "cvt.rn.f16x2.e4m3x2 t1, a1; prmt.b32 $0, t0, t1, 0x5410; prmt.b32 $1, t0, t1, 0x7632; }",
            "=r,=r,r", [x], dtype=(gl.float16, gl.float16), is_pure=True, pack=2)

    @gluon.jit
    def _scores_box8(box, q8, first, mma: gl.constexpr, NQ: gl.constexpr):
        """A raw fp8 box's keys [64, W] against the queries' W dims as e4m3 hi and lo parts (q8[first],
        q8[first + 1], [NQ, W] each, adjacent: read as one [2 NQ, W] operand): one fp8 MMA of 2 NQ columns
        with both operands in shared memory (the box read once), into an accumulator of the box's own (mma:
        2 NQ columns; summed with the other boxes' in fp32, no fp8 accumulation longer than 128 dims; its
        hi and lo halves added by `_fold_parts`)."""
        W: gl.constexpr = box.shape[1]
        q2 = q8._reinterpret(gl.float8e4nv, [q8.shape[0] // 2, 2 * NQ, W], q8.layout).index(first // 2)
        return warpgroup_mma(box, q2.permute((1, 0)), gl.zeros([BLOCK, 2 * NQ], gl.float32, mma), is_async=True)

    @gluon.jit
    def _scores_tile8(kl_smem, kr_smem, ql_smem, qr_smem, rs, mma8: gl.constexpr, NQ: gl.constexpr):
        """Raw stage rs's score MMAs against the queries' e4m3 parts (`_scores_box8`): four latent boxes and
        the rope box, five accumulators of 2 NQ columns, issued asynchronously."""
        s0 = _scores_box8(kl_smem.index(rs * LBOXES), ql_smem, 0, mma8, NQ)
        s1 = _scores_box8(kl_smem.index(rs * LBOXES + 1), ql_smem, 2, mma8, NQ)
        s2 = _scores_box8(kl_smem.index(rs * LBOXES + 2), ql_smem, 4, mma8, NQ)
        s3 = _scores_box8(kl_smem.index(rs * LBOXES + 3), ql_smem, 6, mma8, NQ)
        s4 = _scores_box8(kr_smem.index(rs), qr_smem, 0, mma8, NQ)
        return s0, s1, s2, s3, s4

    @gluon.jit
    def _fold_parts(acc, NQ: gl.constexpr):
        """[64, 2 NQ] scores against the queries' hi parts (columns < NQ) and lo parts -> their sum [64, NQ]
        (each thread holds column c and c + NQ: no data moves)."""
        hi, lo = gl.split(acc.reshape([acc.shape[0], 2, NQ]).permute((0, 2, 1)))
        return hi + lo

    @gluon.jit
    def _value_operands(box, a_l: gl.constexpr, i16: gl.constexpr):
        """A raw box [64 keys, 128 dims] read transposed (16-bit ldmatrix .trans: 64 dim pairs x 64 keys),
        each pair split into its even and its odd dim: the two A operands, fp16 (exact)."""
        return _fp8_pairs(box._reinterpret(gl.int16, [BLOCK, LBOX // 2], i16).permute((1, 0)).load(a_l))

    @gluon.jit
    def _values_box(box, pt, o_even, o_odd, alpha, a_l: gl.constexpr, i16: gl.constexpr):
        """The two accumulators of a latent box's 128 value dims (its 64 even dims, its 64 odd dims),
        rescaled per column by alpha, plus V^T P^T: the box's A operands from its raw bytes
        (`_value_operands`)."""
        even, odd = _value_operands(box, a_l, i16)
        o_even = warpgroup_mma(even, pt, o_even * alpha[None, :], is_async=True)
        o_odd = warpgroup_mma(odd, pt, o_odd * alpha[None, :], is_async=True)
        return o_even, o_odd

    # The value MMAs in fp8 (CONFIG values8_narrow_fp8): a thread's 16-bit ldmatrix registers, taken in
    # the order (key + 1, key + 8) of `_V16`, hold keys k, k + 1, k + 8, k + 9 of one dim pair; two byte
    # permutes make of them the even and the odd dim's four keys, which is one register of an fp8 A
    # operand once the keys are relabelled k -> b0 + 2 b3 + 4 b1 + 8 b2 + 16 b4 + 32 b5 (`_relabel_keys`, a
    # layout change only). The weights are stored under the same relabelling (`_publish8`), so the MMA's sum
    # over the keys is unchanged.
    _V16 = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [8, 0], [0, 16], [0, 32]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
    P8_UNIT = gl.constexpr(256.0)    # the weights (at most 1) times this as e4m3 hi + lo parts: no part saturates

    @gluon.jit
    def _split_bytes(x):
        """int16 elements (two e4m3 values each, the low byte the even dim) -> (the even bytes, the odd
        bytes) as int8, in x's layout: two byte permutes a four elements."""
        return gl.inline_asm_elementwise(
            "{ prmt.b32 $0, $2, $3, 0x6420; prmt.b32 $1, $2, $3, 0x7531; }",
            "=r,=r,r,r", [x], dtype=(gl.int8, gl.int8), is_pure=True, pack=4)

    @gluon.jit
    def _relabel_keys(x, AXIS: gl.constexpr):
        """x [64, N] (AXIS 0) or [M, 64] (AXIS 1) with its 64 keys relabelled k -> b0 + 2 b3 + 4 b1 + 8 b2 +
        16 b4 + 32 b5 (bi: bit i of k)."""
        if AXIS == 0:
            y = x.reshape([2, 2, 2, 2, 2, 2, x.shape[1]]).permute((0, 1, 3, 4, 2, 5, 6)).reshape([64, x.shape[1]])
        else:
            y = x.reshape([x.shape[0], 2, 2, 2, 2, 2, 2]).permute((0, 1, 2, 4, 5, 3, 6)).reshape([x.shape[0], 64])
        return y

    @gluon.jit
    def _value_operands8(box, a8: gl.constexpr, i16: gl.constexpr):
        """A raw box [64 keys, 128 dims] as the two fp8 A operands of its even and odd dims [64, 64 keys
        relabelled] (`_relabel_keys`): ldmatrix .trans and byte permutes, no conversion."""
        even, odd = _split_bytes(box._reinterpret(gl.int16, [BLOCK, LBOX // 2], i16).permute((1, 0)).load(_V16))
        even = gl.convert_layout(_relabel_keys(even.to(gl.float8e4nv, bitcast=True), 1), a8)
        odd = gl.convert_layout(_relabel_keys(odd.to(gl.float8e4nv, bitcast=True), 1), a8)
        return even, odd

    @gluon.jit
    def _values_box8(box, ph, pl, acc: gl.constexpr, a8: gl.constexpr, i16: gl.constexpr, NQ: gl.constexpr):
        """V^T P^T of a latent box's even and odd dims against the weights' e4m3 hi and lo parts (ph, pl:
        [64 keys relabelled, NQ]), each parity into a fresh accumulator (four fp8 MMAs of 32 keys a chain:
        summed into the fp32 outputs by the caller, as DeepGEMM promotes its fp8 sums)."""
        even, odd = _value_operands8(box, a8, i16)
        zero = gl.zeros([BLOCK, NQ], gl.float32, acc)
        te = warpgroup_mma(even, ph, zero, use_acc=False, is_async=True)
        te = warpgroup_mma(even, pl, te, is_async=True)
        to = warpgroup_mma(odd, ph, zero, use_acc=False, is_async=True)
        to = warpgroup_mma(odd, pl, to, is_async=True)
        return te, to

    @gluon.jit
    def _zero_tail(kl_smem, first, valid, BOXES: gl.constexpr = 4):
        """Rows valid.. of a raw stage's BOXES 64 x 128 fp8 boxes (MLA: its four latent boxes) to zero
        (the split's last tile ends inside it: the value MMAs would read whatever lies in the cache's
        slots past the end, NaN included)."""
        blocked: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        i8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, blocked))
        for b in gl.static_range(BOXES):
            box = kl_smem.index(first + b)._reinterpret(gl.int8, [BLOCK, LBOX], i8)
            x = box.load(blocked)
            box.store(gl.where((rows < valid)[:, None], x, 0))
        gl.thread_barrier()

    @gluon.jit
    def _query_box(base, q_rows, first, WIDTH: gl.constexpr, NQ: gl.constexpr, layout: gl.constexpr):
        """The NQ query rows' dims first .. first + WIDTH (rows past q_rows 0), fp32."""
        rows = gl.arange(0, NQ, layout=gl.SliceLayout(1, layout))
        dims = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        ptrs = base + rows.to(gl.int64)[:, None] * (CHUNKS * BLOCK) + first + dims[None, :]
        return gl.load(ptrs, mask=(rows < q_rows)[:, None], other=0.0).to(gl.float32)

    @gluon.jit
    def _e4m3_scale(amax):
        """(2^e, 2^-e) per query row of largest magnitude amax: 2^e puts it into [2^7, 2^8), so that no e4m3
        part saturates (e4m3's top binade is [2^8, 448]); e clamped to what fp32 exponents hold."""
        biased = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        e = gl.minimum(gl.maximum(134 - biased, -120), 107)
        return ((e + 127) << 23).to(gl.float32, bitcast=True), ((127 - e) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _query_split(x, up, dst_hi, dst_lo):
        """A box of query dims times its rows' powers of two as two e4m3 parts, hi + lo: their sum
        carries ~8 significant bits, a bf16 query's."""
        xs = x * gl.convert_layout(up, gl.SliceLayout(1, x.type.layout))[:, None]
        hi = xs.to(gl.float8e4nv)
        dst_hi.store(hi)
        dst_lo.store((xs - hi.to(gl.float32)).to(gl.float8e4nv))

    @gluon.jit
    def _direct_queries(q_ptr, head0, q_rows, ql_smem, qr_smem, table_ptr, s, st_s, start, end, num_blocks,
                        PAGE: gl.constexpr, NQ: gl.constexpr, key_l: gl.constexpr, IDS: gl.constexpr = True):
        """The NQ query rows times a power of two per row (the largest magnitude into [2^7, 2^8): no
        part saturates), each row read once, as e4m3 hi and lo parts in the natural order: box b's at
        ql_smem[2b], [2b + 1], the rope's at qr_smem[0], [1]. The split's block ids are checked while
        those loads are in flight (`_bad_ids`; not IDS: the caller checks them, False here). Returns
        (2^-e per row, whether a block id lies outside the cache)."""
        lat: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        base = q_ptr + head0.to(gl.int64) * (CHUNKS * BLOCK)
        x0 = _query_box(base, q_rows, 0, LBOX, NQ, lat)
        x1 = _query_box(base, q_rows, LBOX, LBOX, NQ, lat)
        x2 = _query_box(base, q_rows, 2 * LBOX, LBOX, NQ, lat)
        x3 = _query_box(base, q_rows, 3 * LBOX, LBOX, NQ, lat)
        xr = _query_box(base, q_rows, LBOXES * LBOX, BLOCK, NQ, lat)
        if IDS:
            bad = _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE, key_l)
        else:
            bad = False
        amax = gl.max(gl.maximum(gl.maximum(gl.abs(x0), gl.abs(x1)), gl.maximum(gl.abs(x2), gl.abs(x3))), 1)
        amax = gl.maximum(amax, gl.max(gl.abs(xr), 1))
        up, down = _e4m3_scale(amax)
        _query_split(x0, up, ql_smem.index(0), ql_smem.index(1))
        _query_split(x1, up, ql_smem.index(2), ql_smem.index(3))
        _query_split(x2, up, ql_smem.index(4), ql_smem.index(5))
        _query_split(x3, up, ql_smem.index(6), ql_smem.index(7))
        _query_split(xr, up, qr_smem.index(0), qr_smem.index(1))
        fence_async_shared()
        gl.thread_barrier()
        return down, bad

    @gluon.jit
    def _store_half(o_ptr, o, first, factor, o_q, live, rows):
        """Output dims first, first + 2, .. (one parity of a latent box's 128) of the columns `live`."""
        gl.store(o_ptr + o_q[None, :] + (first + 2 * rows)[:, None], o * factor[None, :], mask=live[None, :])

    @gluon.jit
    def _store_pair(o_ptr, even, odd, first, factor, o_q, live, rows):
        """Output dims first + 2r and first + 2r + 1 of the columns `live` (a latent box's dim pair r,
        from its even and odd accumulators: a thread holds element (r, c) of both), one 8-byte store a
        pair: full sectors and half the store instructions of two `_store_half`."""
        vals = gl.join(even * factor[None, :], odd * factor[None, :])            # [BLOCK, NQ, 2]
        l3: gl.constexpr = vals.type.layout
        pair = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, l3)))
        off = gl.convert_layout(o_q[None, :] + (first + 2 * rows)[:, None], gl.SliceLayout(2, l3))
        live3 = gl.convert_layout((rows >= 0)[:, None] & live[None, :], gl.SliceLayout(2, l3))
        off3 = gl.expand_dims(off, 2) + gl.expand_dims(gl.expand_dims(pair, 0), 0)
        mask3 = gl.expand_dims(live3, 2) & gl.expand_dims(gl.expand_dims(pair >= 0, 0), 0)
        gl.store(o_ptr + off3, vals, mask=mask3)

    @gluon.jit
    def _store_box(o_ptr, even, odd, first, factor, o_q, live, rows, PAIRED: gl.constexpr):
        """Output dims first .. first + 127 (a raw box's, from its even and odd accumulators) of the
        columns `live`: PAIRED, one `_store_pair`; else two `_store_half`."""
        if PAIRED:
            _store_pair(o_ptr, even, odd, first, factor, o_q, live, rows)
        else:
            _store_half(o_ptr, even, first, factor, o_q, live, rows)
            _store_half(o_ptr, odd, first + 1, factor, o_q, live, rows)

    @gluon.jit
    def _publish(p_smem, a_smem, p_free, p_ready, t, pw, alpha):
        """Tile t's weights pw (the stored orientation) and rescale alpha into double buffer t % 2 for the
        value warpgroup(s), once they are done with tile t - 2's."""
        pb = t % 2
        if t >= 2:
            mbarrier.wait(p_free.index(pb), ((t // 2) - 1) & 1)
        p_smem.index(pb).store(pw)
        a_smem.index(pb).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(pb))

    @gluon.jit
    def _publish_factor(a_smem, p_free, p_ready, tiles, factor):
        """The output's final factor after the split's `tiles` tiles, in the buffer the next tile's weights
        would have taken."""
        if tiles >= 2:
            mbarrier.wait(p_free.index(tiles % 2), ((tiles // 2) - 1) & 1)
        a_smem.index(tiles % 2).store(factor)
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(tiles % 2))

    @gluon.jit
    def _published(p_smem, a_smem, p_ready, t, col_l: gl.constexpr):
        """(the rescale per column, the weights P^T as the B operand) of tile t, once published (`_publish`)."""
        pb = t % 2
        mbarrier.wait(p_ready.index(pb), (t // 2) & 1)
        return a_smem.index(pb).load(col_l), p_smem.index(pb).permute((1, 0))

    @gluon.jit
    def _publish8(p8_smem, a_smem, p_free, p_ready, t, p, alpha):
        """`_publish` of the weights p [64 keys, NQ] (at most 1) times P8_UNIT as e4m3 hi and lo parts (~8
        significant bits, a bf16 weight's), keys relabelled as the value operands' (`_relabel_keys`), into
        buffer t % 2 of p8_smem [2 buffer + part, NQ, 64]."""
        x = p * P8_UNIT
        hi = x.to(gl.float8e4nv)
        lo = (x - hi.to(gl.float32)).to(gl.float8e4nv)
        pb = t % 2
        if t >= 2:
            mbarrier.wait(p_free.index(pb), ((t // 2) - 1) & 1)
        p8_smem.index(2 * pb).store(gl.permute(_relabel_keys(hi, 0), [1, 0]))
        p8_smem.index(2 * pb + 1).store(gl.permute(_relabel_keys(lo, 0), [1, 0]))
        a_smem.index(pb).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(pb))

    @gluon.jit
    def _published8(p8_smem, a_smem, p_ready, t, col_l: gl.constexpr):
        """(the rescale per column, the weights' hi and lo parts [64 keys relabelled, NQ] as B operands) of
        tile t, once published (`_publish8`)."""
        pb = t % 2
        mbarrier.wait(p_ready.index(pb), (t // 2) & 1)
        return (a_smem.index(pb).load(col_l), p8_smem.index(2 * pb).permute((1, 0)),
                p8_smem.index(2 * pb + 1).permute((1, 0)))

    @gluon.jit
    def _final_factor(a_smem, p_ready, tiles, col_l: gl.constexpr):
        """The output's final factor per column (`_publish_factor`)."""
        mbarrier.wait(p_ready.index(tiles % 2), (tiles // 2) & 1)
        return a_smem.index(tiles % 2).load(col_l)

    @gluon.jit
    def _softmax_step_one(sc, ks, live, m_i, l_i):
        """`gluon_mla._softmax_step` over fp8 (keys along axis 0, l deferred) with one maximum a tile
        instead of two: the running maximum m is taken over the scaled scores sc [64 keys, NQ] plus
        log2 of the keys' value scales ks, so that the weights w exp2(s - m) are at most 1 (fp16
        holds them) without a second maximum over them (the other form's running unit r). l sums
        exp2(s - m) = the weight / w (a key of scale 0, whose score is 0: exp2(-m)); the output's
        factor is 1 / l. (weights, alpha, new m, new l)."""
        lw = gl.log2(ks)     # (-inf at a scale of 0 and past the end)
        sw = gl.where(live, sc + lw[:, None], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sw, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sw - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        inv = gl.where(ks > 0, 1.0 / gl.where(ks > 0, ks, 1.0), 0.0)
        zero_scale = gl.where(live & (ks == 0)[:, None], gl.exp2(-m_safe)[None, :], 0.0)
        l_i = l_i * alpha[None, :] + (p * inv[:, None] + zero_scale)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _tile_softmax(sc, t, m_i, l_i, r_i, start, end, keys, qk_q, q_pos, ks_smem, p_smem, a_smem, raw_free,
                      p_free, p_ready, dcp_size, dcp_rank, interleave, RAW: gl.constexpr, CAUSAL: gl.constexpr,
                      V8: gl.constexpr = False, ONE: gl.constexpr = False):
        """Tile t's raw scores sc (its MMAs complete) through the online softmax: times its keys' scales
        (the raw stage then released) and the queries' factors, masked past the end (CAUSAL: and past
        each column's token), the weights P^T and the rescale published in buffer t % 2 for the value
        warpgroup. ONE: one maximum a tile (`_softmax_step_one`; r stays as it came). Returns the new
        (m, l, r)."""
        rs = t % RAW
        j0 = start + t * BLOCK
        key_live = j0 + keys < end
        live = key_live[:, None]
        if CAUSAL:
            live = live & (_global_pos(j0 + keys, dcp_size, dcp_rank, interleave)[:, None] <= q_pos[None, :])
        ks = gl.where(key_live, ks_smem.index(rs).reshape([BLOCK]).load(keys.type.layout), 0.0)
        mbarrier.arrive(raw_free.index(rs))
        if ONE:
            p, alpha, m_i, l_i = _softmax_step_one(sc * ks[:, None] * qk_q[None, :], ks, live, m_i, l_i)
        else:
            sc = gl.where(live, sc * ks[:, None] * qk_q[None, :], float("-inf"))
            p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, ks, 0, True, True)
        if V8:
            _publish8(p_smem, a_smem, p_free, p_ready, t, p, alpha)
        else:
            _publish(p_smem, a_smem, p_free, p_ready, t, gl.permute(p.to(gl.float16), [1, 0]), alpha)
        return m_i, l_i, r_i

    @gluon.jit
    def _direct_scores(q_ptr, ql_smem, qr_smem, kl_smem, kr_smem, ks_smem, p_smem, a_smem, raw_ready, raw_free,
                       p_ready, p_free, table_ptr, glens_ptr, lse_ptr, s, split, split_len, dcp_size, dcp_rank,
                       interleave, table_w, num_blocks, st_s, qk_scale, sl_p, sl_s, sl_t, HQ, TQ,
                       PAGE: gl.constexpr, RAW: gl.constexpr, NQ: gl.constexpr, CAUSAL: gl.constexpr,
                       PIPE: gl.constexpr = False, AHEAD: gl.constexpr = False, TILES: gl.constexpr = 1,
                       V8: gl.constexpr = False, ONE: gl.constexpr = False):
        """The direct fp8 kernel's first warpgroup: the queries as e4m3 hi and lo parts, then per raw tile
        S^T = K Q^T as fp8 MMAs straight from shared memory (`_scores_tile8`), the online softmax (over
        fp8: scales, a running per-column unit), the weights P^T and
        the rescale alpha published in a double buffer for the second warpgroup; at the end the lse, and
        the output's factor to it. PIPE (RAW >= 2): tiles in pairs, the second's score MMAs issued
        before the first's softmax and run under it (over a stale stage where the split ends first:
        discarded; `launch` asks for it at most at PAIRS_MAX_COLUMNS columns). Across pairs no
        MMAs stay in flight: a loop-carried in-flight accumulator costs register moves, for which ptxas
        serializes every wgmma of the kernel (its warning C7514). V8: the weights published as e4m3 parts for
        fp8 value MMAs (`_publish8`). ONE: one maximum a tile (`_softmax_step_one`)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
        mma8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 2 * NQ, 32])    # (hi and lo parts)
        key_l: gl.constexpr = gl.SliceLayout(1, mma)
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        if AHEAD:   # (the split's block ids for the check at the end, loaded beside the length)
            early = _ids_early(table_ptr, s, st_s, split * split_len, table_w, PAGE, IDS_L)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        c0 = _first_column(TILES, NQ)
        qf, bad_id = _direct_queries(q_ptr, s * (TQ * HQ) + c0, TQ * HQ - c0, ql_smem, qr_smem, table_ptr, s, st_s,
                                     start, end, num_blocks, PAGE, NQ, key_l, not AHEAD)
        if not AHEAD:
            bad = bad | bad_id
        qk_q = gl.convert_layout(qf, q_l) * qk_scale
        m_i, l_i, r_i = _softmax_start(NQ, mma)
        keys = gl.arange(0, BLOCK, layout=key_l)
        cols = c0 + gl.arange(0, NQ, layout=q_l)     # (this head tile's columns of the TQ x HQ)
        q_pos = _query_pos(glens_ptr, s, TQ, cols, HQ, CAUSAL)
        gl.static_assert(not PIPE or RAW >= 2, "tile pairs need two raw stages")
        if PIPE:    # tiles in pairs: the second's MMAs issued before the first's softmax, run under it
            for t in range(0, tiles, 2):
                rs = t % RAW
                two = t + 1 < tiles
                j0 = start + t * BLOCK
                mbarrier.wait(raw_ready.index(rs), (t // RAW) & 1)
                if end - j0 < BLOCK:
                    _zero_tail(kl_smem, rs * LBOXES, end - j0)
                a0, a1, a2, a3, a4 = _scores_tile8(kl_smem, kr_smem, ql_smem, qr_smem, rs, mma8, NQ)
                # (the pair's second tile: over whatever its stage holds where the split ends first, discarded)
                mbarrier.wait(raw_ready.index((t + 1) % RAW), ((t + 1) // RAW) & 1, pred=two)
                if two & (end - j0 - BLOCK < BLOCK):
                    _zero_tail(kl_smem, ((t + 1) % RAW) * LBOXES, end - j0 - BLOCK)
                b0, b1, b2, b3, b4 = _scores_tile8(kl_smem, kr_smem, ql_smem, qr_smem, (t + 1) % RAW, mma8, NQ)
                a0, a1, a2, a3, a4 = warpgroup_mma_wait(num_outstanding=5, deps=(a0, a1, a2, a3, a4))
                sc = gl.convert_layout(_fold_parts((a0 + a1) + (a2 + a3) + a4, NQ), mma)
                m_i, l_i, r_i = _tile_softmax(sc, t, m_i, l_i, r_i, start, end, keys, qk_q, q_pos, ks_smem, p_smem,
                                              a_smem, raw_free, p_free, p_ready, dcp_size, dcp_rank, interleave,
                                              RAW, CAUSAL, V8, ONE)
                b0, b1, b2, b3, b4 = warpgroup_mma_wait(num_outstanding=0, deps=(b0, b1, b2, b3, b4))
                if two:
                    sc = gl.convert_layout(_fold_parts((b0 + b1) + (b2 + b3) + b4, NQ), mma)
                    m_i, l_i, r_i = _tile_softmax(sc, t + 1, m_i, l_i, r_i, start, end, keys, qk_q, q_pos, ks_smem,
                                                  p_smem, a_smem, raw_free, p_free, p_ready, dcp_size, dcp_rank,
                                                  interleave, RAW, CAUSAL, V8, ONE)
        else:
            for t in range(tiles):
                rs = t % RAW
                j0 = start + t * BLOCK
                mbarrier.wait(raw_ready.index(rs), (t // RAW) & 1)
                if end - j0 < BLOCK:    # (before the second warpgroup may read the tile: it waits for this P;
                    # fp8 score MMAs, through the async proxy, may still see those rows' old bytes: masked below)
                    _zero_tail(kl_smem, rs * LBOXES, end - j0)
                s0, s1, s2, s3, s4 = _scores_tile8(kl_smem, kr_smem, ql_smem, qr_smem, rs, mma8, NQ)
                s0, s1, s2, s3, s4 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1, s2, s3, s4))
                sc = gl.convert_layout(_fold_parts((s0 + s1) + (s2 + s3) + s4, NQ), mma)   # (same registers)
                m_i, l_i, r_i = _tile_softmax(sc, t, m_i, l_i, r_i, start, end, keys, qk_q, q_pos, ks_smem, p_smem,
                                              a_smem, raw_free, p_free, p_ready, dcp_size, dcp_rank, interleave,
                                              RAW, CAUSAL, V8, ONE)
        if AHEAD:
            bad = bad | _bad_ids_after(early, table_ptr, s, st_s, start, end, num_blocks, PAGE, IDS_L)
        factor, lse = _finish(m_i, gl.sum(l_i, 0), r_i, bad, not ONE)
        mine = cols < TQ * HQ
        tok = (cols // HQ).to(gl.int64)
        head = (cols % HQ).to(gl.int64)
        gl.store(lse_ptr + split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + tok * sl_t + head, lse, mask=mine)
        _publish_factor(a_smem, p_free, p_ready, tiles, factor)

    @gluon.jit
    def _zero_outputs(NQ: gl.constexpr, mma: gl.constexpr):
        """The value warpgroup's eight fp32 accumulators [64, NQ] (even, odd dims of four latent boxes), zero."""
        return (gl.zeros([BLOCK, NQ], gl.float32, mma), gl.zeros([BLOCK, NQ], gl.float32, mma),
                gl.zeros([BLOCK, NQ], gl.float32, mma), gl.zeros([BLOCK, NQ], gl.float32, mma),
                gl.zeros([BLOCK, NQ], gl.float32, mma), gl.zeros([BLOCK, NQ], gl.float32, mma),
                gl.zeros([BLOCK, NQ], gl.float32, mma), gl.zeros([BLOCK, NQ], gl.float32, mma))

    @gluon.jit
    def _store_outputs(o_ptr, e0, d0, e1, d1, e2, d2, e3, d3, factor, s, split, so_p, so_s, so_t, so_h, HQ, TQ,
                       NQ: gl.constexpr, TILES: gl.constexpr, PAIRED: gl.constexpr, mma: gl.constexpr):
        """The split's partial output: the eight accumulators times the factor per column, the tile's columns
        that are this sequence's TQ x HQ (`_store_box`)."""
        cols = _first_column(TILES, NQ) + gl.arange(0, NQ, layout=gl.SliceLayout(0, mma))
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma))
        mine = cols < TQ * HQ
        o_q = (split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + (cols // HQ).to(gl.int64) * so_t
               + (cols % HQ).to(gl.int64) * so_h)
        _store_box(o_ptr, e0, d0, 0, factor, o_q, mine, rows, PAIRED)
        _store_box(o_ptr, e1, d1, LBOX, factor, o_q, mine, rows, PAIRED)
        _store_box(o_ptr, e2, d2, 2 * LBOX, factor, o_q, mine, rows, PAIRED)
        _store_box(o_ptr, e3, d3, 3 * LBOX, factor, o_q, mine, rows, PAIRED)

    @gluon.jit
    def _direct_values(kl_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, split, split_len,
                       dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_t, so_h, HQ, TQ, PAGE: gl.constexpr,
                       RAW: gl.constexpr, NQ: gl.constexpr, PAIRED: gl.constexpr = False, TILES: gl.constexpr = 1,
                       V8: gl.constexpr = False):
        """The direct fp8 kernel's value warpgroup: per tile, once its weights are published, O^T += V^T
        P^T with the A operand converted in registers from the raw bytes (each accumulator one parity
        of a latent box's dims), its hold on the raw stage and the weights then released; at the end the
        output times the scores warpgroup's factor. (Two value warpgroups of two boxes each ran 3-7%
        slower: decode-narrow10/12-values2-h200.json.) V8 (CONFIG values8_narrow_fp8): the value MMAs in
        fp8 (`_values_tile8`)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        i16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        e0, d0, e1, d1, e2, d2, e3, d3 = _zero_outputs(NQ, mma)
        for t in range(tiles):
            rs = t % RAW
            first = rs * LBOXES
            if V8:
                e0, d0, e1, d1, e2, d2, e3, d3 = _values_tile8(kl_smem, p_smem, a_smem, p_ready, t, first, e0, d0, e1,
                                                               d1, e2, d2, e3, d3, NQ, mma)
            else:
                alpha, pt = _published(p_smem, a_smem, p_ready, t, q_l)
                e0, d0 = _values_box(kl_smem.index(first), pt, e0, d0, alpha, a_l, i16)
                e1, d1 = _values_box(kl_smem.index(first + 1), pt, e1, d1, alpha, a_l, i16)
                e0, d0 = warpgroup_mma_wait(num_outstanding=2, deps=(e0, d0))
                e2, d2 = _values_box(kl_smem.index(first + 2), pt, e2, d2, alpha, a_l, i16)
                e1, d1 = warpgroup_mma_wait(num_outstanding=2, deps=(e1, d1))
                e3, d3 = _values_box(kl_smem.index(first + 3), pt, e3, d3, alpha, a_l, i16)
                e2, d2, e3, d3 = warpgroup_mma_wait(num_outstanding=0, deps=(e2, d2, e3, d3))
            mbarrier.arrive(p_free.index(t % 2))
            mbarrier.arrive(raw_free.index(rs))
        factor = _final_factor(a_smem, p_ready, tiles, q_l)
        if V8:
            factor = factor * (1.0 / P8_UNIT)
        _store_outputs(o_ptr, e0, d0, e1, d1, e2, d2, e3, d3, factor, s, split, so_p, so_s, so_t, so_h, HQ, TQ, NQ,
                       TILES, PAIRED, mma)

    @gluon.jit
    def _values_tile8(kl_smem, p8_smem, a_smem, p_ready, t, first, e0, d0, e1, d1, e2, d2, e3, d3, NQ: gl.constexpr,
                      mma: gl.constexpr):
        """Tile t's value MMAs in fp8 (CONFIG values8_narrow_fp8), once its weights are published: each box's
        even and odd dims as fp8 A operands made by byte permutes (`_value_operands8`, no conversion),
        against the weights' e4m3 hi and lo parts, into fresh accumulators that the fp32 outputs take up
        rescaled (o = o alpha + tile; the output's factor then carries the parts' unit, 1 / P8_UNIT).
        Returns the eight outputs, every MMA complete."""
        acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 32])
        a8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=4)
        i16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        alpha, ph, pl = _published8(p8_smem, a_smem, p_ready, t, gl.SliceLayout(0, mma))
        a2 = alpha[None, :]
        te0, to0 = _values_box8(kl_smem.index(first), ph, pl, acc, a8, i16, NQ)
        te1, to1 = _values_box8(kl_smem.index(first + 1), ph, pl, acc, a8, i16, NQ)
        te0, to0 = warpgroup_mma_wait(num_outstanding=4, deps=(te0, to0))
        e0 = e0 * a2 + gl.convert_layout(te0, mma)
        d0 = d0 * a2 + gl.convert_layout(to0, mma)
        te2, to2 = _values_box8(kl_smem.index(first + 2), ph, pl, acc, a8, i16, NQ)
        te1, to1 = warpgroup_mma_wait(num_outstanding=4, deps=(te1, to1))
        e1 = e1 * a2 + gl.convert_layout(te1, mma)
        d1 = d1 * a2 + gl.convert_layout(to1, mma)
        te3, to3 = _values_box8(kl_smem.index(first + 3), ph, pl, acc, a8, i16, NQ)
        te2, to2, te3, to3 = warpgroup_mma_wait(num_outstanding=0, deps=(te2, to2, te3, to3))
        e2 = e2 * a2 + gl.convert_layout(te2, mma)
        d2 = d2 * a2 + gl.convert_layout(to2, mma)
        e3 = e3 * a2 + gl.convert_layout(te3, mma)
        d3 = d3 * a2 + gl.convert_layout(to3, mma)
        return e0, d0, e1, d1, e2, d2, e3, d3

    @gluon.jit
    def _direct_loader(kl_desc, kr_desc, ks_desc, table_ptr, glens_ptr, kl_smem, kr_smem, ks_smem, raw_ready,
                       raw_free, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                       PAGE: gl.constexpr, RAW: gl.constexpr, AHEAD: gl.constexpr = False):
        """(one warp) Each 64-key tile's four 64 x 128 latent boxes, its 64 x 64 rope box and its scales by
        TMA into the raw ring (whole boxes: a tile lies in its page), the block ids four tiles ahead."""
        start, tiles, b1, b2, b3, b4 = _window_start(table_ptr, glens_ptr, s, st_s, split, split_len, dcp_size,
                                                     dcp_rank, interleave, table_w, num_blocks, PAGE, AHEAD)
        for t in range(tiles):
            rs, j0, blk, b1, b2, b3, b4 = _window_tile(b1, b2, b3, b4, table_ptr, s, st_s, start, t, tiles, num_blocks,
                                                       raw_free, PAGE, RAW)
            mbarrier.expect(raw_ready.index(rs), LBOXES * kl_desc.block_type.nbytes + kr_desc.block_type.nbytes
                            + ks_desc.block_type.nbytes)
            row = blk * PAGE + j0 % PAGE
            for b in gl.static_range(LBOXES):
                tma.async_copy_global_to_shared(kl_desc, [row, b * LBOX], raw_ready.index(rs),
                                                kl_smem.index(rs * LBOXES + b))
            tma.async_copy_global_to_shared(kr_desc, [row, LBOXES * LBOX], raw_ready.index(rs), kr_smem.index(rs))
            tma.async_copy_global_to_shared(ks_desc, [blk, j0 % PAGE], raw_ready.index(rs), ks_smem.index(rs))

    @gluon.jit
    def _mla_narrow_direct_kernel(q_ptr, kl_desc, kr_desc, ks_desc, table_ptr, glens_ptr, o_ptr, lse_ptr, qk_scale,
                                  split_len, HQ, TQ, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s,
                                  so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, PAGE: gl.constexpr, NQ: gl.constexpr,
                                  RAW: gl.constexpr, CAUSAL: gl.constexpr = False, PDL: gl.constexpr = False,
                                  PIPE: gl.constexpr = False, PAIRED: gl.constexpr = False,
                                  AHEAD: gl.constexpr = False, TILES: gl.constexpr = 1,
                                  plan_ptr=None, PLANNED: gl.constexpr = False, V8: gl.constexpr = False,
                                  ONE: gl.constexpr = False):
        """fp8 latent cache without a converter: a one-warp TMA loader fills RAW raw stages; one warpgroup
        reads each tile's bytes straight into the scores' A operands (`_direct_scores`), the other into
        the values' (`_direct_values`) one tile behind, through a double buffer of the weights. PAIRED:
        the output's dim pairs stored together (`_store_pair`); AHEAD: the loader's first block ids, and the
        scores warpgroup's id check, loaded beside the sequence's length (`_table_tiles`). TILES: the
        sequence's TQ x HQ columns in this many tiles of NQ, program_id(0) = sequence x TILES + tile (a
        sequence's tiles launched side by side read its keys at about the same time: from L2 but once)."""
        s = gl.program_id(0) // TILES
        split = gl.program_id(1)
        lbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        rbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        qrbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, BLOCK], gl.float16)
        sc_box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        # (the queries' e4m3 hi and lo parts, box b's at [2b] and [2b + 1])
        ql_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * LBOXES, NQ, LBOX], lbox)
        qr_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, NQ, BLOCK], rbox)
        if V8:      # (the weights' e4m3 hi and lo parts, [2 buffer + part, NQ, 64 keys]: as many bytes as fp16)
            p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, NQ, BLOCK], rbox)
        else:
            p_smem = gl.allocate_shared_memory(gl.float16, [2, NQ, BLOCK], qrbox)
        a_smem = gl.allocate_shared_memory(gl.float32, [2, NQ], vec)
        kl_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW * LBOXES, BLOCK, LBOX], lbox)
        kr_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW, BLOCK, BLOCK], rbox)
        ks_smem = gl.allocate_shared_memory(gl.float32, [RAW, 1, BLOCK], sc_box)
        raw_ready = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        raw_free = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(RAW):
            mbarrier.init(raw_ready.index(i), count=1)
            mbarrier.init(raw_free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        fence_async_shared()
        if PDL:     # (launched early: the barriers above are set up while the kernel before finishes)
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
        gl.warp_specialize([
            (_direct_scores, (q_ptr, ql_smem, qr_smem, kl_smem, kr_smem, ks_smem, p_smem, a_smem, raw_ready,
                              raw_free, p_ready, p_free, table_ptr, glens_ptr, lse_ptr, s, split, split_len,
                              dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale, sl_p, sl_s, sl_t,
                              HQ, TQ, PAGE, RAW, NQ, CAUSAL, PIPE, AHEAD, TILES, V8, ONE)),
            (_direct_values, (kl_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, split,
                              split_len, dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_t, so_h, HQ, TQ,
                              PAGE, RAW, NQ, PAIRED, TILES, V8)),
            (_direct_loader, (kl_desc, kr_desc, ks_desc, table_ptr, glens_ptr, kl_smem, kr_smem, ks_smem,
                              raw_ready, raw_free, s, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                              num_blocks, st_s, PAGE, RAW, AHEAD)),
        ], [4, 1], [REGS_VALUES, 24])

def launch(q: Tensor, k: Tensor, table: Tensor, seq_lens: Tensor, o: Tensor, lse: Tensor, scale_log2: float,
           splits: int, split_len: int, dcp_size: int, dcp_rank: int, interleave: int,
           k_scale: Tensor | None = None, raw: int = 5, pdl: bool = False, pipe: bool = False,
           paired: bool = False, ahead: bool = False, width: int = MAX_HEADS, plan: Tensor | None = None,
           values8: bool = False, one_max: bool = False) -> None:
    """Fill the split partials o [splits, S, Tq, Hq, 512] / lse [splits, S, Tq, Hq] of queries q [S, Tq,
    Hq, 576] (`gluon_mla.gluon_mla_ok` and `narrow_ok` of Tq x Hq columns hold, or `tiles_ok`: more
    columns, in `head_tiles` of `width`; Tq > 1: causal within the step's tokens); over fp8 the
    direct kernel with `raw` raw stages of 64 keys (`direct_fits` of a tile's columns;
    `pipe`: the scores in tile pairs where `pairs_apply`: at least two raw stages and at most
    PAIRS_MAX_COLUMNS columns; `paired`: the output's dim pairs stored together), over both the
    loader's first block ids loaded beside the length with `ahead`; over fp8 `values8`: the value MMAs in
    fp8 against the weights' e4m3 hi and lo parts (`_values_tile8`) where `values8_apply`, `one_max`: one
    softmax maximum a tile (`_softmax_step_one`); pdl: launched
    with programmatic dependent launch, `triton_merge.pdl_ok`. plan: a length plan's item table
    (`triton_decode.LengthPlan`):
    the grid's `splits` are its items, o's sequence stride 0."""
    s, tq, hq, d = q.shape
    nb, page = k.shape[0], k.shape[1]
    nq, tiles = head_tiles(tq * hq, width)
    launch = {"PDL": True, "launch_pdl": True} if pdl else {}
    launch.update(planned_launch(plan))
    fp8 = k.dtype == torch.float8_e4m3fn
    if fp8 and not direct_fits(nq, raw):
        raise ValueError(f"the direct fp8 MLA kernel with {tq} x {hq} query rows in {tiles} tile(s) of {nq} columns and "
                         f"{raw} raw stages of {_BLOCK} keys does not fit in shared memory ({SMEM_LIMIT} bytes)")
    tail = (o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2))
    if fp8:
        lbox = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        rbox = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        sc_box = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        k2, ks2 = k.view(nb * page, d), k_scale.view(nb, page)
        kl_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _LBOX], lbox)
        kr_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], rbox)
        ks_desc = TensorDescriptor(ks2, list(ks2.shape), list(ks2.stride()), [1, _BLOCK], sc_box)
        _mla_narrow_direct_kernel[(grid_rows(s, plan) * tiles, splits)](
            q, kl_desc, kr_desc, ks_desc, table, seq_lens, o, lse, scale_log2, split_len, hq, tq, dcp_size, dcp_rank,
            interleave, table.shape[1], nb, table.stride(0), *tail, PAGE=page, NQ=nq, RAW=raw, CAUSAL=tq > 1,
            PIPE=bool(pipe) and pairs_apply(nq, raw), PAIRED=bool(paired), AHEAD=bool(ahead), TILES=tiles,
            V8=bool(values8) and values8_apply(nq), ONE=bool(one_max), num_warps=4, **launch)
        return
    box = shared_box(_BLOCK, _BLOCK, gl.bfloat16)
    qbox = shared_box(nq, _BLOCK, gl.bfloat16)
    q2, k2 = q.reshape(s * tq * hq, d), k.view(nb * page, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [nq, _BLOCK], qbox)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], box)
    _mla_narrow_kernel[(grid_rows(s, plan) * tiles, splits)](
        q_desc, k_desc, k, table, seq_lens, o, lse, scale_log2, split_len, hq, tq, dcp_size, dcp_rank, interleave,
        table.shape[1], nb, table.stride(0), k.stride(0), k.stride(1), *tail, PAGE=page, NQ=nq, CAUSAL=tq > 1,
        AHEAD=bool(ahead), TILES=tiles, num_warps=4, **launch)
