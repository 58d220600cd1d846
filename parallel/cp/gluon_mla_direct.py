"""MLA absorbed decode over an fp8 latent cache for full 64-head tiles (128 heads: TP 1, DP attention,
or DCP's `-tp 8 -dcp 8` layout) without a converter: a warp-specialized Gluon kernel for Hopper.

`gluon_mla`'s fp8 kernel converts every key tile to fp16 in shared memory before its MMAs; one
converter warpgroup bounds it (~0.43 of the FLOP roofline where bf16 reaches ~0.64). Here, as in
the narrow tiles' direct form (`gluon_mla_narrow`), the raw fp8 tile is read by the MMAs' own
warpgroups and crosses shared memory once:

- the scores warpgroup computes S = Q K^T with the heads as wgmma's M (64) and the tile's 64 keys as
  N: fp8 MMAs straight from the raw key boxes against the queries split into two e4m3 parts
  (hi + lo, ~8 significant bits: a bf16 query's), each box (four latent, the rope) into an
  accumulator of its own, summed in fp32 (`_tile_scores`). The online softmax then runs along each
  head's row (no cross-warp reduction), with the keys' scales, and publishes the weights P (fp16,
  over a running per-head unit as in every fp8 kernel here) and the rescale through a double buffer;
- two value warpgroups, each for two latent boxes (256 of the 512 value dims), compute O^T += V^T
  P^T: the A operand is the raw box read transposed by 16-bit ldmatrix and split into its even and
  odd dims in registers (`gluon_mla_narrow._values_box`), P^T is the B operand from shared memory;
- a one-warp loader brings each tile's four 128-dim latent boxes, its rope box and its scales by
  TMA into a ring of raw stages (`gluon_mla_narrow._direct_loader`).

The output is the split's partial (out, lse) in `triton_decode.paged_decode_triton`'s layout;
CONFIG direct_wide_fp8 chooses it (its raw stages; 0: the converter's kernel). Registers shape it: the
O accumulators alone take half the register file, so one box's scores are in flight at a time and the
value boxes' operands are loaded one box at a time (`REGS_VALUES`); a tighter split makes ptxas
serialize every wgmma of the kernel (its C7511 / C7512, which tests/test_gluon_compile.py fails on)."""

from __future__ import annotations

import torch
from torch import Tensor

from .gluon_mla import _BLOCK, _CHUNKS, HAS_GLUON, SMEM_LIMIT, grid_rows, planned_launch, scales_by_tma
from .gluon_mla_narrow import _DIRECT_STAGE, _LBOX, _LBOXES

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_mla import (BLOCK, CHUNKS, IDS_L, _bad_ids, _bad_ids_after, _finish, _gdc_wait_and_release,
                            _ids_early, _opaque_zero, _softmax_step, _split_range)
    from .gluon_mla_narrow import (LBOX, LBOXES, _direct_loader, _e4m3_scale, _final_factor, _first_column,
                                   _publish, _publish_factor, _published, _query_split, _store_box, _values_box,
                                   _zero_tail)
    from .triton_common import work_item as _work_item

MAX_RAW = 3     # raw stages that fit beside the queries' e4m3 parts and the weights' double buffer


def shared_bytes(raw: int) -> int:
    """The kernel's shared memory: the queries' e4m3 hi and lo parts (64 x 576 each), their factors,
    `raw` raw stages (four 64 x 128 latent boxes, the 64 x 64 rope box, the keys' scales), two buffers
    of the weights (64 x 64 fp16) and their rescale, barriers and 1 KB of the compiler's scratch."""
    return (2 * _BLOCK * _CHUNKS * _BLOCK + 4 * _BLOCK + raw * _DIRECT_STAGE + 2 * (_BLOCK * _BLOCK * 2 + 4 * _BLOCK)
            + 8 * (2 * raw + 4) + 1024)


def direct_fits(raw: int) -> bool:
    """`raw` raw stages (at least one) fit sm_90's shared memory (`shared_bytes`)."""
    return raw >= 1 and shared_bytes(raw) <= SMEM_LIMIT


def direct_ok(q: Tensor, k: Tensor, k_scale: Tensor | None) -> bool:
    """Applies (where `gluon_mla.gluon_mla_ok` holds): one query token, heads a multiple of 64, an fp8
    cache whose scales [nb, page, 1] the loader can bring by TMA (`gluon_mla.scales_by_tma`)."""
    return (HAS_GLUON and k.dtype == torch.float8_e4m3fn and q.shape[1] == 1 and q.shape[2] % _BLOCK == 0
            and scales_by_tma(k_scale))


if HAS_GLUON:
    HALF = gl.constexpr(32)         # query rows read at a time (a 32 x 128 fp32 box: 32 registers a thread)
    # registers a thread of each value warpgroup (the scores warpgroup keeps 104: 512 - 2 x 192 - 24 for the
    # loader's warpgroup; at 184 / 200 ptxas serializes the wgmma pipeline of one side or the other)
    REGS_VALUES = gl.constexpr(192)

    @gluon.jit
    def _query_rows(base, r0: gl.constexpr, first, WIDTH: gl.constexpr, layout: gl.constexpr):
        """Query rows r0 .. r0 + HALF (heads of the tile), dims first .. first + WIDTH, fp32."""
        rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
        dims = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        return gl.load(base + rows.to(gl.int64)[:, None] * (CHUNKS * BLOCK) + first + dims[None, :]).to(gl.float32)

    @gluon.jit
    def _query_half(base, r0: gl.constexpr, ql_smem, qr_smem, qf_smem):
        """Query rows r0 .. r0 + HALF times a power of two per row (its largest magnitude into [2^7, 2^8):
        no part saturates) as e4m3 hi and lo parts: box b's at ql_smem[2b], [2b + 1], the rope's at
        qr_smem[0], [1], rows r0..; the rows' 2^-e into qf_smem. Two passes over the rows (L2), so that
        no more than one 32 x 128 box is held at a time."""
        lat: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        amax = gl.max(gl.abs(_query_rows(base, r0, LBOXES * LBOX, BLOCK, lat)), 1)
        for b in gl.static_range(LBOXES):
            amax = gl.maximum(amax, gl.max(gl.abs(_query_rows(base, r0, b * LBOX, LBOX, lat)), 1))
        up, down = _e4m3_scale(amax)
        for b in gl.static_range(LBOXES):
            _query_split(_query_rows(base, r0, b * LBOX, LBOX, lat), up, ql_smem.index(2 * b).slice(r0, HALF),
                         ql_smem.index(2 * b + 1).slice(r0, HALF))
        _query_split(_query_rows(base, r0, LBOXES * LBOX, BLOCK, lat), up, qr_smem.index(0).slice(r0, HALF),
                     qr_smem.index(1).slice(r0, HALF))
        qf_smem.slice(r0, HALF).store(down)

    @gluon.jit
    def _box_scores(acc, q8, first, box):
        """acc + the queries' e4m3 hi part (q8[first]) and lo part (q8[first + 1]) against a raw box's keys
        [64, W]: two fp8 MMAs, the box read as the B operand (K-major) from shared memory."""
        kt = box.permute((1, 0))
        acc = warpgroup_mma(q8.index(first), kt, acc, is_async=True)
        return warpgroup_mma(q8.index(first + 1), kt, acc, is_async=True)

    @gluon.jit
    def _box_done(acc):
        """A box's score accumulator once its MMAs are complete."""
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    @gluon.jit
    def _tile_scores(kl_smem, kr_smem, ql_smem, qr_smem, rs, z, mma8: gl.constexpr):
        """Raw stage rs's scores S [64 heads, 64 keys]: each box (four latent, the rope) hi + lo into an
        accumulator of its own, added to the fp32 sum once complete. A chain of fp8 MMAs on one
        accumulator rounds its running sum to ~14 bits at every step (one chain over the 576 dims put
        the output 1.3e-2 off the converter's fp16 MMAs on the GPU test's data); the next box issued
        before the sum (two accumulators in flight) leaves ptxas too few registers for the wgmma
        pipeline beside the value warpgroups: it serializes every wgmma of the kernel (C7511 / C7512). z:
        an opaque 0 (`gluon_mla._opaque_zero`) offsetting the queries' boxes, so that their ten descriptors
        are made where used instead of held across the loop (they spilled)."""
        zero = gl.zeros([BLOCK, BLOCK], gl.float32, mma8)
        first = rs * LBOXES
        sc = _box_done(_box_scores(zero, ql_smem, z, kl_smem.index(first)))
        sc = sc + _box_done(_box_scores(zero, ql_smem, z + 2, kl_smem.index(first + 1)))
        sc = sc + _box_done(_box_scores(zero, ql_smem, z + 4, kl_smem.index(first + 2)))
        sc = sc + _box_done(_box_scores(zero, ql_smem, z + 6, kl_smem.index(first + 3)))
        return sc + _box_done(_box_scores(zero, qr_smem, z, kr_smem.index(rs)))

    @gluon.jit
    def _scores(q_ptr, ql_smem, qr_smem, qf_smem, kl_smem, kr_smem, ks_smem, p_smem, a_smem, raw_ready, raw_free,
                p_ready, p_free, table_ptr, glens_ptr, lse_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                table_w, num_blocks, st_s, qk_scale, sl_p, sl_s, HQ, PAGE: gl.constexpr, RAW: gl.constexpr,
                TILES: gl.constexpr, AHEAD: gl.constexpr):
        """The scores warpgroup: the queries as e4m3 hi and lo parts, then per raw tile the scores
        (`_tile_scores`), the online softmax along each head's row (the keys' scales, a running per-head
        unit), the weights P and the rescale published in buffer t % 2 for the value warpgroups; at the end
        the lse, and the output's factor to them."""
        mma8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma8)
        key_l: gl.constexpr = gl.SliceLayout(0, mma8)
        if AHEAD:   # (the split's block ids for the check at the end, loaded beside the length)
            early = _ids_early(table_ptr, s, st_s, split * split_len, table_w, PAGE, IDS_L)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        c0 = _first_column(TILES, BLOCK)
        base = q_ptr + (s * HQ + c0).to(gl.int64) * (CHUNKS * BLOCK)
        _query_half(base, 0, ql_smem, qr_smem, qf_smem)
        _query_half(base, HALF, ql_smem, qr_smem, qf_smem)
        if not AHEAD:
            bad = bad | _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE, IDS_L)
        fence_async_shared()
        gl.thread_barrier()
        qk_q = qf_smem.load(row_l) * qk_scale
        m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK], gl.float32, row_l)
        r_i = gl.zeros([BLOCK], gl.float32, row_l)
        keys = gl.arange(0, BLOCK, layout=key_l)
        for t in range(tiles):
            rs = t % RAW
            j0 = start + t * BLOCK
            mbarrier.wait(raw_ready.index(rs), (t // RAW) & 1)
            if end - j0 < BLOCK:    # (zeros past the split's end before the value warpgroups read the stage:
                # they wait for this tile's P; the score MMAs may still see the old bytes, masked below)
                _zero_tail(kl_smem, rs * LBOXES, end - j0)
            sc = _tile_scores(kl_smem, kr_smem, ql_smem, qr_smem, rs, _opaque_zero(t), mma8)
            key_live = j0 + keys < end
            ks = gl.where(key_live, ks_smem.index(rs).reshape([BLOCK]).load(key_l), 0.0)
            mbarrier.arrive(raw_free.index(rs))
            sc = gl.where(key_live[None, :], sc * ks[None, :] * qk_q[:, None], float("-inf"))
            p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, ks, 1, True)
            _publish(p_smem, a_smem, p_free, p_ready, t, p.to(gl.float16), alpha)
        if AHEAD:
            bad = bad | _bad_ids_after(early, table_ptr, s, st_s, start, end, num_blocks, PAGE, IDS_L)
        factor, lse = _finish(m_i, l_i, r_i, bad, True)
        heads = (c0 + gl.arange(0, BLOCK, layout=row_l)).to(gl.int64)
        gl.store(lse_ptr + split.to(gl.int64) * sl_p + s.to(gl.int64) * sl_s + heads, lse)
        _publish_factor(a_smem, p_free, p_ready, tiles, factor)

    @gluon.jit
    def _values(kl_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, split, split_len,
                dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, PAGE: gl.constexpr, RAW: gl.constexpr,
                PART: gl.constexpr, TILES: gl.constexpr, PAIRED: gl.constexpr):
        """A value warpgroup (PART 0 or 1: latent boxes 2 PART and 2 PART + 1, value dims 256 PART ..): per
        tile, once its weights are published, O^T += V^T P^T with the A operands converted in registers from
        the raw bytes (each accumulator one parity of a box's dims, 64 x 64 heads; the second box's operands
        loaded once the first's MMAs are complete: with both boxes' operands live ptxas serializes the
        wgmma pipeline, C7511), its hold on the raw stage and the weights then released; at the end the
        output times the scores warpgroup's factor."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK, 16])
        dim_l: gl.constexpr = gl.SliceLayout(1, mma)
        head_l: gl.constexpr = gl.SliceLayout(0, mma)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        i16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        e0 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        d0 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        e1 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        d1 = gl.zeros([BLOCK, BLOCK], gl.float32, mma)
        for t in range(tiles):
            rs = t % RAW
            alpha, pt = _published(p_smem, a_smem, p_ready, t, head_l)
            first = rs * LBOXES + 2 * PART
            e0, d0 = _values_box(kl_smem.index(first), pt, e0, d0, alpha, a_l, i16)
            e0, d0 = warpgroup_mma_wait(num_outstanding=0, deps=(e0, d0))
            e1, d1 = _values_box(kl_smem.index(first + 1), pt, e1, d1, alpha, a_l, i16)
            e0, d0, e1, d1 = warpgroup_mma_wait(num_outstanding=0, deps=(e0, d0, e1, d1))
            mbarrier.arrive(p_free.index(t % 2))
            mbarrier.arrive(raw_free.index(rs))
        factor = _final_factor(a_smem, p_ready, tiles, head_l)
        heads = _first_column(TILES, BLOCK) + gl.arange(0, BLOCK, layout=head_l)
        rows = gl.arange(0, BLOCK, layout=dim_l)
        o_q = split.to(gl.int64) * so_p + s.to(gl.int64) * so_s + heads.to(gl.int64) * so_h
        live = heads >= 0
        _store_box(o_ptr, e0, d0, 2 * PART * LBOX, factor, o_q, live, rows, PAIRED)
        _store_box(o_ptr, e1, d1, (2 * PART + 1) * LBOX, factor, o_q, live, rows, PAIRED)

    @gluon.jit
    def _mla_wide_direct_kernel(q_ptr, kl_desc, kr_desc, ks_desc, table_ptr, glens_ptr, o_ptr, lse_ptr, qk_scale,
                                split_len, HQ, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, so_p, so_s,
                                so_h, sl_p, sl_s, PAGE: gl.constexpr, RAW: gl.constexpr, TILES: gl.constexpr,
                                PDL: gl.constexpr = False, PAIRED: gl.constexpr = False,
                                AHEAD: gl.constexpr = False, plan_ptr=None, PLANNED: gl.constexpr = False):
        """fp8 latent cache, 64 heads a program (program_id(0) = sequence x TILES + head tile), without a
        converter: a one-warp TMA loader fills RAW raw stages; the scores warpgroup (`_scores`) and two value
        warpgroups (`_values`) read each tile's bytes themselves. PAIRED: the output's dim pairs stored
        together; AHEAD: the loader's first block ids, and the scores warpgroup's id check, loaded beside the
        sequence's length."""
        s = gl.program_id(0) // TILES
        split = gl.program_id(1)
        lbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        rbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        pbox: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        sc_box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        ql_smem = gl.allocate_shared_memory(gl.float8e4nv, [2 * LBOXES, BLOCK, LBOX], lbox)
        qr_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK, BLOCK], rbox)
        qf_smem = gl.allocate_shared_memory(gl.float32, [BLOCK], vec)
        p_smem = gl.allocate_shared_memory(gl.float16, [2, BLOCK, BLOCK], pbox)
        a_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK], vec)
        kl_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW * LBOXES, BLOCK, LBOX], lbox)
        kr_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW, BLOCK, BLOCK], rbox)
        ks_smem = gl.allocate_shared_memory(gl.float32, [RAW, 1, BLOCK], sc_box)
        raw_ready = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        raw_free = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(RAW):
            mbarrier.init(raw_ready.index(i), count=1)
            mbarrier.init(raw_free.index(i), count=3)      # (the scores and both value warpgroups)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=2)        # (both value warpgroups)
        fence_async_shared()
        if PDL:     # (launched early: the barriers above are set up while the kernel before finishes)
            _gdc_wait_and_release()
        if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
            s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
        LOW: gl.constexpr = 0
        HIGH: gl.constexpr = 1
        gl.warp_specialize([
            (_scores, (q_ptr, ql_smem, qr_smem, qf_smem, kl_smem, kr_smem, ks_smem, p_smem, a_smem, raw_ready,
                       raw_free, p_ready, p_free, table_ptr, glens_ptr, lse_ptr, s, split, split_len, dcp_size,
                       dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale, sl_p, sl_s, HQ, PAGE, RAW, TILES,
                       AHEAD)),
            (_values, (kl_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, split, split_len,
                       dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, PAGE, RAW, LOW, TILES, PAIRED)),
            (_values, (kl_smem, p_smem, a_smem, raw_free, p_ready, p_free, glens_ptr, o_ptr, s, split, split_len,
                       dcp_size, dcp_rank, interleave, table_w, so_p, so_s, so_h, PAGE, RAW, HIGH, TILES, PAIRED)),
            (_direct_loader, (kl_desc, kr_desc, ks_desc, table_ptr, glens_ptr, kl_smem, kr_smem, ks_smem,
                              raw_ready, raw_free, s, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                              num_blocks, st_s, PAGE, RAW, AHEAD)),
        ], [4, 4, 1], [REGS_VALUES, REGS_VALUES, 24])


def launch(q: Tensor, k: Tensor, table: Tensor, seq_lens: Tensor, o: Tensor, lse: Tensor, scale_log2: float,
           splits: int, split_len: int, dcp_size: int, dcp_rank: int, interleave: int, k_scale: Tensor,
           raw: int = MAX_RAW, pdl: bool = False, paired: bool = False, ahead: bool = False,
           plan: Tensor | None = None) -> None:
    """Fill the split partials o [splits, S, 1, Hq, 512] / lse [splits, S, 1, Hq] of queries q [S, 1, Hq,
    576] over an fp8 latent cache (`gluon_mla.gluon_mla_ok` and `direct_ok` hold) with `raw` raw stages
    (`direct_fits`); paired: the output's dim pairs stored together; ahead: the loader's first block ids
    loaded beside the length; pdl: launched with programmatic dependent launch (`triton_merge.pdl_ok`);
    plan: a length plan's item table (`triton_decode.LengthPlan`): the grid's `splits` are its items, o's
    sequence stride 0."""
    s, tq, hq, d = q.shape
    if not direct_fits(raw):
        raise ValueError(f"the direct fp8 MLA kernel with {raw} raw stages of {_BLOCK} keys does not fit in shared "
                         f"memory ({SMEM_LIMIT} bytes; at most {MAX_RAW})")
    nb, page = k.shape[0], k.shape[1]
    launch = {"PDL": True, "launch_pdl": True} if pdl else {}
    launch.update(planned_launch(plan))
    lbox = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    rbox = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    sc_box = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    k2, ks2 = k.view(nb * page, d), k_scale.view(nb, page)
    kl_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _LBOX], lbox)
    kr_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], rbox)
    ks_desc = TensorDescriptor(ks2, list(ks2.shape), list(ks2.stride()), [1, _BLOCK], sc_box)
    tiles = hq // _BLOCK
    _mla_wide_direct_kernel[(grid_rows(s, plan) * tiles, splits)](
        q, kl_desc, kr_desc, ks_desc, table, seq_lens, o, lse, scale_log2, split_len, hq, dcp_size, dcp_rank,
        interleave, table.shape[1], nb, table.stride(0), o.stride(0), o.stride(1), o.stride(3), lse.stride(0),
        lse.stride(1), PAGE=page, RAW=raw, TILES=tiles, PAIRED=bool(paired), AHEAD=bool(ahead), num_warps=4,
        **launch)
