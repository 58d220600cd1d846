"""MLA absorbed decode for narrow head tiles (at most 32 query heads: 16 under TP 8, DeepSeek's
usual DCP deployment) as a warp-specialized Gluon kernel for Hopper with swapped operands.

`gluon_mla`'s kernels put the heads in wgmma's M dimension, which is 64: with 16 heads three
quarters of every score and output MMA, and of the softmax, work on padding rows. Here the tile's
64 keys are M and the NQ columns (heads, or a speculative step's tokens x heads, at most 32,
rounded up to a power of two >= 8) are N:

- S^T = K Q^T: the key tile (nine 64 x 64 boxes of the 576-wide latent + rope row) is the A
  operand, the queries (NQ x 576, shared memory) the B operand;
- the online softmax runs down the keys of each head's column (per-head maxima and sums
  reduce across the warpgroup);
- O^T += V^T P^T: the value dims (the latent's first 512, the same boxes read transposed) are M
  in eight 64-row accumulators of NQ columns each (64 fp32 registers a thread at NQ 16, against
  4 x 64 in each of two warpgroups for a padded tile), the weights P^T (shared memory) are B.

One consumer warpgroup does all of it. Over bf16 a loader warpgroup brings the queries and each
tile by TMA into a 2-stage ring (the masked last tile through loads, zeros past the end, as in
`gluon_mla._loader`); over fp8 a one-warp TMA loader fills a raw ring and a converter warpgroup
writes each tile as fp16 with its per-token scales (`gluon_mla._converter`, the queries times a
power of two per head), and the consumer keeps the weights in a running per-head unit. The
output is the split's partial (out, lse) in `triton_decode.paged_decode_triton`'s layout.
`narrow_ok` says where it applies; CONFIG swap_wide_narrow / swap_wide_narrow_fp8 choose it."""

from __future__ import annotations

import torch
from torch import Tensor

from .gluon_mla import _BLOCK, _CHUNKS, HAS_GLUON, SMEM_LIMIT

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_mla import (BLOCK, CHUNKS, STAGES, _bad_ids, _barriers, _converter, _finish, _loader, _raw_loader,
                            _softmax_step, _split_range)
    from .triton_common import global_pos as _global_pos

MAX_HEADS = 32      # the widest narrow tile: NQ = 32 columns (eight 64 x 32 fp32 accumulators)


def columns(heads: int) -> int:
    """NQ: the heads rounded up to a power of two, at least 8 (wgmma's N)."""
    return max(8, 1 << (heads - 1).bit_length())


def fp8_fits(heads: int, ring: int, raw: int, rope_raw: bool = False) -> bool:
    """The fp8 kernel's shared memory: queries (fp16, NQ x 576), `ring` fp16 stages of 64 x 576 (64 x
    512 with rope_raw) and `raw` fp8 stages of 64 x 576, the weights (NQ x 64 fp16), scales and
    barriers, plus 2 KB of the compiler's scratch."""
    nq, width = columns(heads), _CHUNKS * _BLOCK
    stage = (width - _BLOCK if rope_raw else width) * _BLOCK * 2
    need = (nq * width * 2 + ring * stage + raw * _BLOCK * width + nq * _BLOCK * 2
            + 4 * (nq + (ring + raw) * _BLOCK) + 8 * (3 + 2 * ring + 2 * raw) + 2048)
    return heads <= MAX_HEADS and ring >= 1 and raw >= 1 and need <= SMEM_LIMIT


def narrow_ok(rows: int, k: Tensor, k_scale: Tensor | None) -> bool:
    """The swapped kernel applies (where `gluon_mla.gluon_mla_ok` holds, up to 8 query tokens): at most
    32 query rows (tokens x heads), and over fp8 contiguous scales [nb, page, 1] (its loader brings
    them by TMA)."""
    if not HAS_GLUON or rows > MAX_HEADS:
        return False
    return k.dtype != torch.float8_e4m3fn or (k_scale is not None and k_scale.is_contiguous())


def fp8_form(heads: int, ring: int, raw: int, rope_raw: bool) -> tuple[int, int, bool]:
    """The configured fp8 ring form cut to what shared memory holds at this head count: the rope box
    from the raw stage only where that fits, then raw stages down to one (`launch` refuses what
    still does not fit)."""
    rope_raw = bool(rope_raw) and fp8_fits(heads, ring, raw, True)
    while raw > 1 and not fp8_fits(heads, ring, raw, rope_raw):
        raw -= 1
    return ring, raw, rope_raw


if HAS_GLUON:
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
    def _consumer(q_smem, k_smem, p_smem, qf_smem, ks_smem, q_bar, ready, free, table_ptr, glens_ptr, o_ptr,
                  lse_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale,
                  so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, HQ, TQ, PAGE: gl.constexpr, RING: gl.constexpr,
                  NQ: gl.constexpr, CAUSAL: gl.constexpr,
                  FP8: gl.constexpr, kr_smem=None, raw_ready=None, raw_free=None, RAW: gl.constexpr = 0,
                  ROPE_RAW: gl.constexpr = False):
        """S^T = K Q^T over the nine boxes, the online softmax down each column, O^T += V^T P^T. Column c
        is query token c // HQ's head c % HQ (TQ x HQ <= NQ columns); CAUSAL (TQ > 1): token t sees the
        keys at global positions <= its own, length - TQ + t.
        FP8: the scores take the keys' scales and the heads' powers of two (qf_smem), the weights p *
        scale go to fp16 over a running per-head unit r (`_softmax_step`). ROPE_RAW: the fp16 stages
        hold the latent's eight boxes only; the rope box's scores come from the raw fp8 box, converted
        in registers as the A operand (the raw stage is free once both this and the converter are done).
        (Two consumers on alternate tiles, each writing its own partial for the split merge, ran 1.5-2.2x
        slower: their registers spilled 880 B; decode-narrow3-h200.json.)"""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
        key_l: gl.constexpr = gl.SliceLayout(1, mma)
        q_l: gl.constexpr = gl.SliceLayout(0, mma)
        start, end, tiles, bad = _split_range(glens_ptr, s, split, split_len, dcp_size, dcp_rank, interleave,
                                              table_w, PAGE)
        m_i = gl.full([NQ], float("-inf"), gl.float32, q_l)
        l_i = gl.zeros([BLOCK, NQ], gl.float32, mma)     # (per key position: summed over the keys at the end)
        r_i = gl.zeros([NQ], gl.float32, q_l)
        o0 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o1 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o2 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o3 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o4 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o5 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o6 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        o7 = gl.zeros([BLOCK, NQ], gl.float32, mma)
        keys = gl.arange(0, BLOCK, layout=key_l)
        cols = gl.arange(0, NQ, layout=q_l)
        if CAUSAL:
            q_pos = gl.load(glens_ptr + s).to(gl.int32) - TQ + cols // HQ
        BOXES: gl.constexpr = CHUNKS - 1 if ROPE_RAW else CHUNKS      # (boxes of a fp16 stage)
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        mbarrier.wait(q_bar, 0)
        if FP8:
            qk_q = qf_smem.load(q_l) * qk_scale
        for t in range(tiles):
            stage = t % RING
            j0 = start + t * BLOCK
            if ROPE_RAW:
                rs = t % RAW
                mbarrier.wait(raw_ready.index(rs), (t // RAW) & 1)
                rope = kr_smem.index(rs * CHUNKS + CHUNKS - 1).load(a_l).to(gl.float16)
            mbarrier.wait(ready.index(stage), (t // RING) & 1)
            sc = gl.zeros([BLOCK, NQ], gl.float32, mma)
            for c in gl.static_range(BOXES):
                sc = warpgroup_mma(k_smem.index(stage * BOXES + c), q_smem.index(c).permute((1, 0)), sc,
                                   is_async=True)
            if ROPE_RAW:
                sc = warpgroup_mma(rope, q_smem.index(CHUNKS - 1).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
            if ROPE_RAW:
                mbarrier.arrive(raw_free.index(rs))
            live = (j0 + keys < end)[:, None]
            if CAUSAL:
                live = live & (_global_pos(j0 + keys, dcp_size, dcp_rank, interleave)[:, None] <= q_pos[None, :])
            if FP8:
                ks = ks_smem.index(stage).load(key_l)
                sc = gl.where(live, sc * ks[:, None] * qk_q[None, :], float("-inf"))
            else:
                sc = gl.where(live, sc * qk_scale, float("-inf"))
            p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, ks if FP8 else m_i, 0, FP8, True)
            if t > 0:       # (the previous tile's V^T P^T read p_smem: done, its wait returned)
                gl.thread_barrier()
            p_smem.store(gl.permute(p.to(p_smem.dtype), [1, 0]))
            fence_async_shared()
            gl.thread_barrier()
            o0, o1, o2, o3, o4, o5, o6, o7 = _pv_t(o0, o1, o2, o3, o4, o5, o6, o7, alpha, p_smem, k_smem,
                                                   stage * BOXES)
            mbarrier.arrive(free.index(stage))
        bad = bad | _bad_ids(table_ptr, s, st_s, start, end, num_blocks, PAGE, key_l)
        factor, lse = _finish(m_i, gl.sum(l_i, 0), r_i, bad, FP8)
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
                           CAUSAL: gl.constexpr = False):
        """bf16 latent cache: the loader's TMA boxes of NQ query rows (rows past the sequence's TQ x HQ
        are other rows or zeros: their columns are never stored) and of each 64-key tile."""
        s = gl.program_id(0)
        split = gl.program_id(1)
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
        qbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, BLOCK], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, NQ, BLOCK], qbox)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, BLOCK], qbox)
        q_bar, ready, free, p_ready, p_free = _barriers(STAGES, 1)
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, p_smem, None, None, q_bar, ready, free, table_ptr, glens_ptr, o_ptr, lse_ptr,
                         s, split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale,
                         so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, HQ, TQ, PAGE, STAGES, NQ, CAUSAL, False)),
            (_loader, (q_desc, k_desc, k_ptr, table_ptr, glens_ptr, q_smem, k_smem, q_bar, ready, free, s,
                       s * (TQ * HQ),
                       split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t,
                       PAGE)),
        ], [4], [64])

    @gluon.jit
    def _mla_narrow_fp8_kernel(q_ptr, k_desc, ks_desc, k_ptr, ks_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr, qk_scale,
                               split_len, HQ, TQ, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b,
                               sk_t, ss_b, ss_t, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, PAGE: gl.constexpr,
                               NQ: gl.constexpr, RAW: gl.constexpr, RING: gl.constexpr, ROPE_RAW: gl.constexpr = False,
                               CAUSAL: gl.constexpr = False):
        """fp8 latent cache: a raw TMA ring of RAW 64-key tiles, the converter into RING fp16 stages (of
        the latent's eight boxes only with ROPE_RAW: the consumer takes the rope box from the raw ring)."""
        BOXES: gl.constexpr = CHUNKS - 1 if ROPE_RAW else CHUNKS
        s = gl.program_id(0)
        split = gl.program_id(1)
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float16)
        qbox: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NQ, BLOCK], gl.float16)
        raw_box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.float8e4nv)
        sc_box: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.float16, [CHUNKS, NQ, BLOCK], qbox)
        k_smem = gl.allocate_shared_memory(gl.float16, [RING * BOXES, BLOCK, BLOCK], box)
        p_smem = gl.allocate_shared_memory(gl.float16, [NQ, BLOCK], qbox)
        qf_smem = gl.allocate_shared_memory(gl.float32, [NQ], vec)
        ks_smem = gl.allocate_shared_memory(gl.float32, [RING, BLOCK], vec)
        kr_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW * CHUNKS, BLOCK, BLOCK], raw_box)
        ksr_smem = gl.allocate_shared_memory(gl.float32, [RAW, 1, BLOCK], sc_box)
        q_bar, ready, free, p_ready, p_free = _barriers(RING, 1)
        raw_ready = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        raw_free = gl.allocate_shared_memory(gl.int64, [RAW, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(RAW):
            mbarrier.init(raw_ready.index(i), count=1)
            mbarrier.init(raw_free.index(i), count=2 if ROPE_RAW else 1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, p_smem, qf_smem, ks_smem, q_bar, ready, free, table_ptr, glens_ptr,
                         o_ptr, lse_ptr, s, split, split_len, dcp_size, dcp_rank, interleave, table_w,
                         num_blocks, st_s, qk_scale, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, HQ, TQ, PAGE, RING, NQ,
                         CAUSAL, True, kr_smem, raw_ready, raw_free, RAW, ROPE_RAW)),
            (_converter, (q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, q_smem, qf_smem, k_smem, ks_smem, q_bar,
                          ready, free, s, s * (TQ * HQ), split, split_len, dcp_size, dcp_rank, interleave, table_w,
                          num_blocks, st_s, sk_b, sk_t, ss_b, ss_t, TQ * HQ, PAGE, kr_smem, ksr_smem, raw_ready,
                          raw_free, RAW, RING, BLOCK, NQ, BOXES)),
            (_raw_loader, (k_desc, ks_desc, table_ptr, glens_ptr, kr_smem, ksr_smem, raw_ready, raw_free, s,
                           split, split_len, dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, PAGE,
                           RAW, BLOCK)),
        ], [4, 1], [96, 24])


def launch(q: Tensor, k: Tensor, table: Tensor, seq_lens: Tensor, o: Tensor, lse: Tensor, scale_log2: float,
           splits: int, split_len: int, dcp_size: int, dcp_rank: int, interleave: int,
           k_scale: Tensor | None = None, ring: int = 2, raw: int = 1, rope_raw: bool = False) -> None:
    """Fill the split partials o [splits, S, Tq, Hq, 512] / lse [splits, S, Tq, Hq] of queries q [S, Tq,
    Hq, 576] (`gluon_mla.gluon_mla_ok` and `narrow_ok` of Tq x Hq columns hold; Tq > 1: causal within
    the step's tokens); over fp8 `ring` fp16 and `raw` raw stages of 64 keys (`fp8_fits`), the rope
    box's scores from the raw stage with `rope_raw` (the fp16 stages then hold 512 dims)."""
    s, tq, hq, d = q.shape
    nb, page = k.shape[0], k.shape[1]
    nq = columns(tq * hq)
    fp8 = k.dtype == torch.float8_e4m3fn
    if fp8 and not fp8_fits(tq * hq, ring, raw, rope_raw):
        raise ValueError(f"the narrow fp8 MLA kernel with {tq} x {hq} query rows, {ring} fp16 and {raw} raw "
                         f"stages of {_BLOCK} keys (rope from the raw stage: {bool(rope_raw)}) does not fit in "
                         f"shared memory ({SMEM_LIMIT} bytes)")
    tail = (o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2))
    if fp8:
        raw_box = gl.NVMMASharedLayout.get_default_for([_BLOCK, _BLOCK], gl.float8e4nv)
        sc_box = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        k2, ks2 = k.view(nb * page, d), k_scale.view(nb, page)
        k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], raw_box)
        ks_desc = TensorDescriptor(ks2, list(ks2.shape), list(ks2.stride()), [1, _BLOCK], sc_box)
        _mla_narrow_fp8_kernel[(s, splits)](
            q, k_desc, ks_desc, k, k_scale, table, seq_lens, o, lse, scale_log2, split_len, hq, tq, dcp_size,
            dcp_rank, interleave, table.shape[1], nb, table.stride(0), k.stride(0), k.stride(1), k_scale.stride(0),
            k_scale.stride(1), *tail, PAGE=page, NQ=nq, RAW=raw, RING=ring, ROPE_RAW=bool(rope_raw), CAUSAL=tq > 1,
            num_warps=4)
        return
    box = gl.NVMMASharedLayout.get_default_for([_BLOCK, _BLOCK], gl.bfloat16)
    qbox = gl.NVMMASharedLayout.get_default_for([nq, _BLOCK], gl.bfloat16)
    q2, k2 = q.reshape(s * tq * hq, d), k.view(nb * page, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [nq, _BLOCK], qbox)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], box)
    _mla_narrow_kernel[(s, splits)](
        q_desc, k_desc, k, table, seq_lens, o, lse, scale_log2, split_len, hq, tq, dcp_size, dcp_rank, interleave,
        table.shape[1], nb, table.stride(0), k.stride(0), k.stride(1), *tail, PAGE=page, NQ=nq, CAUSAL=tq > 1,
        num_warps=4)
