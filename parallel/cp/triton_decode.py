"""Triton split-KV paged decode attention with LSE (CUDA, or TRITON_INTERPRET=1 in tests).

`paged.py` chooses it (op "cp.decode" of `parallel.impl`) and validates the inputs; this module
only launches. Flash-decoding: program (s, kv head, row tile, split) reads the tokens
`[split * split_len, (split + 1) * split_len)` of sequence s held in this rank's paged cache ONCE
for all the query rows of that kv head (rows = Tq query tokens x G = Hq / Hkv heads), keeps an
online softmax in base 2 and writes a normalized partial (o, lse). Splits past a sequence's
length write lse = -inf; the partials are merged by the LSE merge kernel (`triton_merge.py`)
when there is more than one split. The grid depends on shapes only (CUDA-graph capturable).

Head dims: the key dim is cut into a power-of-two main part and a rest (MLA: 512 + 64), so no
lane is wasted on padding. When v is a prefix view of k (the MLA latent cache, v = c_kv =
k[..., :Dv] with Dv the main part), the key tile already loaded is reused as the value tile and
the cache is read once. fp8 (e4m3) caches carry one fp32 scale per (token, kv head): the
scores are scaled by the k scale per column and the probabilities by the v scale before P @ V.
With Tq > 1 (speculative decoding) query t of a sequence of global length L sits at position
`L - Tq + t` and sees local token j iff its global position (docs/numerics.md §8.2) is <= that.

Structure options (CONFIG, 0/1, off until the GPU probe measures them; `launch_settings`):
- `halves_wide` (MLA: one latent head whose value is the key's first 512 dims, pages a multiple of
  the key tile): the latent tile read as two 256-wide halves with two accumulators, FlashMLA's
  split of the value dim; the rope part is a third, 64-wide operand.
- `tma_wide` (with halves): each whole key tile comes by three TMA boxes from device-side
  descriptors over [blocks, page, 576] (no address registers, no masks); the partial last tile of
  a split goes through the masked pointer loads, since a cache holds anything (NaN included)
  past a sequence's end and 0 * NaN in P @ V is NaN.
- `lazy_rescale`, `lazy_rescale_wide`: the running max moves only when a row's max grew by more
  than 8 (base 2), so most tiles skip the rescale of the accumulator (exact: p <= 2^8).
- `f16_fp8` (GQA over an fp8 cache, bf16 or fp16 queries; on): fp16 MMA operands. bf16 queries are
  scaled into fp16's range by one power of two per tile (exact for every element within 2^-31 of
  the largest), the weights p * v_scale are divided by a running per-row maximum so they fit fp16
  whatever the scales (acc is kept in that unit), and each fp8 pair converts in one instruction.
  `maxnreg_fp8` caps its registers. MLA has the same option: `f16_wide_narrow` (16-head tiles)
  and `f16_wide_fp8` (128 heads, in the halves kernel; on, with pointer loads: `tma_wide_fp8` 0).
- `stage16_fp8`, `stage16_wide_narrow` (fp8 caches, GQA and MLA's narrow head tiles; 0/1/2): the
  value tile (2: and the key tile) converted where it was loaded and staged for the MMA as 16-bit
  in shared memory (`_staged`), not read back as MMA operand one byte per load.
- `gluon_wide`, `gluon_wide_fp8` (on): MLA's full 64-head tiles over one latent head (the halves
  layout, one query token, bf16 queries, an sm_90 GPU) go to the warp-specialized Gluon kernel of
  `gluon_mla.py` instead (a loader warpgroup, one warpgroup for the scores, softmax and output
  dims [0, 256), one for [256, 512) from the same published weights); this module still plans
  the splits and merges them.
- `gluon_gqa` (on), `gluon_gqa_fp8` (on): GQA with head dim 128 and bf16 queries
  (`gluon_gqa.gluon_gqa_ok`) goes to the warp-specialized Gluon kernel of `gluon_gqa.py` (a TMA
  loader ring and one consumer warpgroup over bf16, a speculative step's tokens too where tokens x
  heads fill at most 64 rows, `gluon_gqa_tokens`; one CTA per SM, so splits planned to at most
  `target_programs_gluon_gqa` programs); over fp8 to its direct form (`direct_gluon_gqa_fp8` raw
  stages, no converter; a speculative step's tokens too, up to 32 columns of tokens x heads),
  where that does not apply to the Triton kernel; the bf16 ring's depth is `stages_gluon_gqa`.
- `dcp_constexpr` (on): the DCP group size and interleave built into the kernel (one build per
  group), whose loop then compiles as the group-of-one build's.
- `pdl` (on where the device and Triton allow it: `triton_merge.pdl_ok`): programmatic dependent
  launch of the kernel and of the split merge after it; each may launch while the kernel before it
  finishes and waits for it (griddepcontrol.wait) before touching memory (0.5-1.3 µs per call).
The *_wide_fp8 entries are MLA's over an fp8 cache. `diag_wide` (1 no softmax, 2 no P @ V, 3
scores only) is the tuning probe's subtraction diagnostic, never attention.

Roofline: MLA's 128 query heads over one latent head do 2 x 128 x (576 + 512) FLOP per 1152-byte
token, 242 FLOP/B, above the H200's 799 TFLOP/s (measured bf16 dense) / ~4.3 TB/s = 186: MLA
decode at 128 heads is compute-bound, and `megapar bench cp` takes the larger of the byte and the
FLOP floor. GQA (8 query heads per kv head: 8 FLOP/B) is bound by the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch import Tensor

from .. import impl
from . import gluon_gqa, gluon_mla, gluon_mla_direct, gluon_mla_narrow, gluon_mla_runs
from .state import AttnState
from .triton_common import global_pos as _global_pos
from .triton_common import local_len as _local_len
from .triton_common import local_of as _local_of
from .triton_common import work_item as _work_item
from .triton_merge import gdc_launch_dependents, gdc_wait, merge_segments_triton, merge_states_triton, pdl_ok

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, with exact fp32 products when IEEE (fp32 inputs under test)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _checked_range(glens_ptr, table_ptr, s, s64, st_s, start, end, local_len, num_blocks, table_w, split_len,
                   PAGE: tl.constexpr, SCAN: tl.constexpr):
    """A split's tokens [start, end) of sequence s, which holds local_len here -> (end, bad).
    bad = 1 where the sequence's length is negative, past the table's capacity (the range is
    cut to it: no read past the table's row) or past what the grid's splits reach (splits x
    split_len: a length past the max_seq_len the grid was sized by, whose tail no split would
    read), or (SCAN) a block id the split would read lies
    outside [0, num_blocks): the range is then emptied. A program with bad = 1 reports NaN, a
    CUDA call's device-side answer to bad input (its values are not read on the host there).
    SCAN is one pass over the split's ids before the loop (MLA's latent tiles, and every tile over
    an fp8 cache); GQA's tiles over bf16 check their own ids instead (`_checked_block`; the sm_90a
    compile of that loop came out shorter with it, 1216 -> 1144 instructions)."""
    bad = tl.where((tl.load(glens_ptr + s) < 0) | (local_len > table_w * PAGE)
                   | (local_len > tl.num_programs(1) * split_len), 1, 0)
    end = tl.minimum(end, table_w * PAGE)
    if SCAN:
        p = start // PAGE
        p_end = (end + PAGE - 1) // PAGE
        while p < p_end:
            pages = p + tl.arange(0, 64)
            ids = tl.load(table_ptr + s64 * st_s + pages, mask=pages < p_end, other=0)
            out = (pages < p_end) & ((ids < 0) | (ids >= num_blocks))
            bad = tl.maximum(bad, tl.max(tl.where(out, 1, 0), 0))
            p += 64
        end = tl.where(bad > 0, start, end)
    return end, bad


@triton.jit
def _checked_block(block, num_blocks, bad, mask, VEC: tl.constexpr):
    """Block ids of a key tile (a scalar, or VEC: [BLOCK_N] under `mask`) -> (ids with those
    outside [0, num_blocks) set to 0, so no load leaves the cache; bad = 1 once a used id was
    outside)."""
    ok = (block >= 0) & (block < num_blocks)
    if VEC:
        bad = tl.maximum(bad, tl.max(tl.where(mask & (ok == 0), 1, 0), 0))
    else:
        bad = tl.maximum(bad, tl.where(ok, 0, 1))
    return tl.where(ok, block, 0), bad


@triton.jit
def _mask_scores(qk, j, jmask, rmask, q_pos, dcp_size, dcp_rank, interleave, CAUSAL: tl.constexpr):
    """Scores [M, N] of local tokens j -> -inf where the token is past the split or the row is
    padding, or (CAUSAL) its global position (docs/numerics.md §8.2) is after the row's query;
    returns (masked scores, allowed)."""
    allowed = jmask[None, :] & rmask[:, None]
    if CAUSAL:
        allowed = allowed & (_global_pos(j, dcp_size, dcp_rank, interleave)[None, :] <= q_pos[:, None])
    return tl.where(allowed, qk, float("-inf")), allowed


@triton.jit
def _softmax_step(qk, m_i, LAZY: tl.constexpr):
    """Online-softmax step over masked base-2 scores qk [M, N] with running max m_i [M]:
    (new max, p = 2^(qk - max), alpha = 2^(m_i - max) to rescale l and acc by, grow). LAZY keeps
    the running max (alpha = 1, grow false: the caller skips the rescale of acc) unless some row's
    max grew by more than 8: p <= 2^8 is then exact to the same relative precision in fp32 and
    bf16, and out = acc / l and lse = max + log2(l) are unchanged in exact arithmetic."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if LAZY:
        grow = tl.max((m_new > m_i + 8.0).to(tl.int32), 0) > 0
        m_new = tl.where(grow, m_new, m_i)
    else:
        grow = True
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, p, alpha, grow


@triton.jit
def _staged(x, STAGE: tl.constexpr):
    """x unchanged. STAGE (GPU only): through an impure no-op, so the compiler keeps the ops that
    made x (an fp8 tile's conversion) in the layout they ran in and hands x to the MMA through
    shared memory as 16-bit (ldmatrix; .trans for a value tile), instead of moving the conversion
    behind byte-wise operand loads (`stage16`: an 8-bit value tile has no ldmatrix .trans on
    sm_90, so a [keys, dims] fp8 value tile read as MMA operand took one LDS.U8 per element)."""
    if STAGE:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)
    else:
        return x


@triton.jit
def _f16_queries(q_main, q_rest, qk_scale, D_REST: tl.constexpr):
    """bf16 query tiles -> fp16 ones times one power of two 2^e that puts their largest magnitude in
    [2^14, 2^15) (e <= 100: tiles below 2^-85 stay smaller), and qk_scale * 2^-e. Every element
    at least 2^-31 of the largest converts exactly (fp16 holds bf16's 8 significant bits from
    2^-17 up); smaller ones round in fp16's subnormals, a change to the score below 2^-31 of the
    largest term's bound. Any finite bf16 tile fits (e >= -113)."""
    if q_main.dtype == tl.bfloat16:   # (fp16 queries stay as they are)
        amax = _amax(q_main)
        if D_REST > 0:
            amax = tl.maximum(amax, _amax(q_rest))
        up, qk_scale = _f16_exponent(amax, qk_scale)
        q_main = (q_main.to(tl.float32) * up).to(tl.float16)
        if D_REST > 0:
            q_rest = (q_rest.to(tl.float32) * up).to(tl.float16)
    return q_main, q_rest, qk_scale


@triton.jit
def _amax(x):
    return tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0)


@triton.jit
def _f16_exponent(amax, qk_scale):
    """`_f16_queries`' power of two for a largest query magnitude amax: (2^e, qk_scale * 2^-e)."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF            # amax in [2^(b-127), 2^(b-126))
    e = tl.minimum(tl.maximum(141 - biased, -113), 100)                # 2^e * amax in [2^14, 2^15)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    return up, qk_scale * down


@triton.jit
def _tile(j0, end, s64, kvh, q_main, q_rest, q_pos, rmask, dm, dr, rest_mask, dv, dv_mask, m_i, l_i, acc, r_i, bad,
          k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, num_blocks, qk_scale, dcp_size, dcp_rank, interleave,
          sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h, st_s,
          D_REST: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
          V_FROM_K: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, LAZY: tl.constexpr,
          F16: tl.constexpr, CHECK: tl.constexpr = True, desc_k=None, desc_v=None, TMA: tl.constexpr = False,
          STAGE: tl.constexpr = 0, EVEN: tl.constexpr = False):
    """One key tile [j0, j0 + BLOCK_N) of the online softmax: returns the new (m, l, acc, r, bad).
    CHECK: the tile checks its own block ids (`_checked_block`); off when `_checked_range` scanned
    the split's ids before the loop (every id the loop reads is then inside the cache).
    F16 (fp8 cache, fp16 queries from `_f16_queries`): fp16 MMA operands, one conversion per fp8
    pair; the weights w = p * v_scale go to fp16 over the running per-row scale r = the largest
    weight so far (w / r <= 1), acc is kept in units of r (out = acc * r / l).
    TMA (GQA, a whole tile inside its page): k and v come as one box each from the descriptors over
    [blocks, PAGE, kv heads, D] (`_paged_decode_kernel`), no per-element addresses or masks.
    STAGE (fp8 cache, `_staged`): 1 the value tile (MLA's latent, which is also the key) converted
    where it was loaded and staged as 16-bit, 2 the key tile too.
    EVEN (one query token, a whole tile inside the split): no masks on the loads or the scores (the
    padding rows of the tile are never stored)."""
    j = j0 + tl.arange(0, BLOCK_N)
    if EVEN:    # (a constant mask: the compiler drops it from the loads)
        tl.static_assert(not CAUSAL, "whole tiles skip the masks of one query token only")
        jmask = tl.full([BLOCK_N], 1, tl.int1)
    else:
        jmask = j < end
    if PAGE % BLOCK_N == 0:     # the tile lies in one page (tiles start at multiples of BLOCK_N): one id
        block = tl.load(table_ptr + s64 * st_s + j0 // PAGE).to(tl.int64)
        if CHECK:
            block, bad = _checked_block(block, num_blocks, bad, True, False)
    else:
        block = tl.load(table_ptr + s64 * st_s + j // PAGE, mask=jmask, other=0).to(tl.int64)
        if CHECK:
            block, bad = _checked_block(block, num_blocks, bad, jmask, True)
    in_page = (j % PAGE).to(tl.int64)
    if TMA:
        tl.static_assert(PAGE % BLOCK_N == 0, "TMA tiles lie inside a page")
        k_main = tl.reshape(desc_k.load([block.to(tl.int32), j0 % PAGE, kvh, 0]), (BLOCK_N, dm.shape[0]))
    else:
        k_row = block * sk_b + in_page * sk_t + kvh * sk_h                       # [BLOCK_N]
        k_main = tl.load(k_ptr + k_row[:, None] + dm[None, :], mask=jmask[:, None], other=0.0)
    if FP8:
        k_main = _staged(k_main.to(q_main.dtype), STAGE >= 2 or (STAGE == 1 and V_FROM_K))
    if IEEE:
        qk = tl.dot(q_main, tl.trans(k_main), input_precision="ieee")
    else:
        qk = tl.dot(q_main, tl.trans(k_main))
    if D_REST > 0:
        k_rest = tl.load(k_ptr + k_row[:, None] + dr[None, :], mask=jmask[:, None] & rest_mask[None, :],
                         other=0.0)
        if FP8:
            k_rest = k_rest.to(q_main.dtype)
        if IEEE:
            qk += tl.dot(q_rest, tl.trans(k_rest), input_precision="ieee")
        else:
            qk += tl.dot(q_rest, tl.trans(k_rest))
    if FP8:
        ks = tl.load(ks_ptr + block * ss_b + in_page * ss_t + kvh * ss_h, mask=jmask, other=0.0)
        qk = qk * (ks * qk_scale)[None, :]
    else:
        qk = qk * qk_scale
    if not EVEN:
        qk, allowed = _mask_scores(qk, j, jmask, rmask, q_pos, dcp_size, dcp_rank, interleave, CAUSAL)
    m_new, p, alpha, grow = _softmax_step(qk, m_i, LAZY and not F16)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FROM_K:
        v_tile = k_main
    elif TMA:
        v_tile = tl.reshape(desc_v.load([block.to(tl.int32), j0 % PAGE, kvh, 0]), (BLOCK_N, dv.shape[0]))
        if FP8:
            v_tile = _staged(v_tile.to(q_main.dtype), STAGE >= 1)
    else:
        v_row = block * sv_b + in_page * sv_t + kvh * sv_h
        v_tile = tl.load(v_ptr + v_row[:, None] + dv[None, :], mask=jmask[:, None] & dv_mask[None, :], other=0.0)
        if FP8:
            v_tile = _staged(v_tile.to(q_main.dtype), STAGE >= 1)
    if FP8:
        vs = tl.load(vs_ptr + block * svs_b + in_page * svs_t + kvh * svs_h, mask=jmask, other=0.0)
        pv = p * vs[None, :]
    else:
        pv = p
    if F16:   # acc in units of r: r' = max(r * alpha, largest weight of the tile) >= every weight
        r_new = tl.maximum(r_i * alpha, tl.max(pv, 1))
        inv = 1.0 / tl.where(r_new > 0, r_new, 1.0)
        acc = acc * (r_i * alpha * inv)[:, None]
        pv = pv * inv[:, None]
        r_i = r_new
    elif LAZY:
        if grow:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    if IEEE:
        acc += tl.dot(pv.to(v_tile.dtype), v_tile, input_precision="ieee")
    else:
        acc += tl.dot(pv.to(v_tile.dtype), v_tile)
    return m_new, l_i, acc, r_i, bad


@triton.jit
def _tile_halves(j0, end, s64, q0, q1, q_rest, q_pos, rmask, m_i, l_i, acc0, acc1, r_i, desc_main, desc_rest,
                 k_ptr, ks_ptr, table_ptr, qk_scale, dcp_size, dcp_rank, interleave, sk_b, sk_t, ss_b, ss_t, st_s,
                 HALF: tl.constexpr, D_REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr, FP8: tl.constexpr, CAUSAL: tl.constexpr, LAZY: tl.constexpr,
                 TMA: tl.constexpr, DIAG: tl.constexpr, IEEE: tl.constexpr, F16: tl.constexpr = False):
    """`_tile` for one latent head whose value is the key's first 2 * HALF dims (MLA: 512 of 576),
    kept as two halves [BLOCK_N, HALF] (a TMA box is at most 256 wide) and two accumulators; the
    tile lies in one page (PAGE % BLOCK_N == 0, tiles start at multiples of BLOCK_N). TMA: the
    three boxes of the tile from device-side descriptors over [blocks, PAGE, D]; rows past `end`
    are zeroed before they serve as values (the cache holds anything there). DIAG (the tuning
    probe's subtraction diagnostics, never a result): 1 no softmax (p = the scores), 2 no P @ V,
    3 scores only (neither). F16 (fp8 cache, DIAG 0): fp16 operands, weights over the running
    per-row scale r_i, as `_tile` keeps them."""
    j = j0 + tl.arange(0, BLOCK_N)
    jmask = j < end
    block = tl.load(table_ptr + s64 * st_s + j0 // PAGE).to(tl.int64)
    p0 = j0 % PAGE
    if TMA:
        blk = block.to(tl.int32)
        k0 = tl.reshape(desc_main.load([blk, p0, 0]), (BLOCK_N, HALF))
        k1 = tl.reshape(desc_main.load([blk, p0, HALF]), (BLOCK_N, HALF))
        kr = tl.reshape(desc_rest.load([blk, p0, 2 * HALF]), (BLOCK_N, BLOCK_REST))
    else:
        dh = tl.arange(0, HALF)
        dr = 2 * HALF + tl.arange(0, BLOCK_REST)
        k_row = block * sk_b + (p0 + tl.arange(0, BLOCK_N)).to(tl.int64) * sk_t                     # [BLOCK_N]
        k0 = tl.load(k_ptr + k_row[:, None] + dh[None, :], mask=jmask[:, None], other=0.0)
        k1 = tl.load(k_ptr + k_row[:, None] + HALF + dh[None, :], mask=jmask[:, None], other=0.0)
        kr = tl.load(k_ptr + k_row[:, None] + dr[None, :], mask=jmask[:, None] & (dr < 2 * HALF + D_REST)[None, :],
                     other=0.0)
    if FP8:
        k0 = k0.to(q0.dtype)
        k1 = k1.to(q0.dtype)
        kr = kr.to(q0.dtype)
    qk = _dot(q0, tl.trans(k0), tl.zeros([q0.shape[0], BLOCK_N], tl.float32), IEEE)
    qk = _dot(q1, tl.trans(k1), qk, IEEE)
    qk = _dot(q_rest, tl.trans(kr), qk, IEEE)
    if FP8:
        s_row = block * ss_b + (p0 + tl.arange(0, BLOCK_N)).to(tl.int64) * ss_t
        ks = tl.load(ks_ptr + s_row, mask=jmask, other=0.0)
        qk = qk * (ks * qk_scale)[None, :]
    else:
        qk = qk * qk_scale
    qk, allowed = _mask_scores(qk, j, jmask, rmask, q_pos, dcp_size, dcp_rank, interleave, CAUSAL)
    if DIAG == 1 or DIAG == 3:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.where(allowed, qk, 0.0)
        l_i += tl.sum(p, 1)
    else:
        m_new, p, alpha, grow = _softmax_step(qk, m_i, LAZY and not F16)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not F16:                      # (F16: acc is rescaled with the weights' unit below)
            if LAZY:
                if grow:
                    acc0 = acc0 * alpha[:, None]
                    acc1 = acc1 * alpha[:, None]
            else:
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
    if DIAG != 2 and DIAG != 3:
        if FP8:
            p = p * ks[None, :]          # the value scale is the key scale (one latent vector per token)
        if F16:   # acc in units of r: r' = max(r * alpha, largest weight of the tile) >= every weight
            r_new = tl.maximum(r_i * alpha, tl.max(p, 1))
            inv = 1.0 / tl.where(r_new > 0, r_new, 1.0)
            unit = r_i * alpha * inv
            acc0 = acc0 * unit[:, None]
            acc1 = acc1 * unit[:, None]
            p = p * inv[:, None]
            r_i = r_new
        pv = p.to(k0.dtype)
        acc0 = _dot(pv, k0, acc0, IEEE)
        acc1 = _dot(pv, k1, acc1, IEEE)
    return m_new, l_i, acc0, acc1, r_i


@triton.jit
def _finish(l_i, m_i):
    """(l where a row saw a key else 1: the divisor of acc, lse in natural log: -inf for rows that
    saw none)."""
    nonempty = l_i > 0
    safe = tl.where(nonempty, l_i, 1.0)
    return safe, tl.where(nonempty, (m_i + tl.log2(safe)) * 0.6931471805599453, float("-inf"))


@triton.jit
def _halves_body(q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr, split, s, s64, q_row,
                 t_idx, h_idx, rmask, qk_scale, split_len, Tq, dcp_size, dcp_rank, interleave, sk_b, sk_t,
                 ss_b, ss_t, st_s, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, NUM_BLOCKS, TABLE_W,
                 HALF: tl.constexpr, D_REST: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, CAUSAL: tl.constexpr,
                 INTERPRETED: tl.constexpr, LAZY: tl.constexpr, TMA: tl.constexpr, DIAG: tl.constexpr,
                 IEEE: tl.constexpr, F16: tl.constexpr = False):
    """The kernel's program for one latent head read in halves (`_tile_halves`)."""
    dh = tl.arange(0, HALF)
    dr = 2 * HALF + tl.arange(0, BLOCK_REST)
    q0 = tl.load(q_ptr + q_row[:, None] + dh[None, :], mask=rmask[:, None], other=0.0)
    q1 = tl.load(q_ptr + q_row[:, None] + HALF + dh[None, :], mask=rmask[:, None], other=0.0)
    q_rest = tl.load(q_ptr + q_row[:, None] + dr[None, :], mask=rmask[:, None] & (dr < 2 * HALF + D_REST)[None, :],
                     other=0.0)
    if F16:
        if q0.dtype == tl.bfloat16:      # (`_f16_queries` over the three tiles)
            up, qk_scale = _f16_exponent(tl.maximum(tl.maximum(_amax(q0), _amax(q1)), _amax(q_rest)), qk_scale)
            q0 = (q0.to(tl.float32) * up).to(tl.float16)
            q1 = (q1.to(tl.float32) * up).to(tl.float16)
            q_rest = (q_rest.to(tl.float32) * up).to(tl.float16)
    if TMA:
        desc_main = tl.make_tensor_descriptor(k_ptr, [NUM_BLOCKS, PAGE, 2 * HALF + D_REST], [sk_b, sk_t, 1],
                                              [1, BLOCK_N, HALF])
        desc_rest = tl.make_tensor_descriptor(k_ptr, [NUM_BLOCKS, PAGE, 2 * HALF + D_REST], [sk_b, sk_t, 1],
                                              [1, BLOCK_N, BLOCK_REST])
    else:
        desc_main, desc_rest = k_ptr, k_ptr
    local_len = _local_len(glens_ptr, s, dcp_size, dcp_rank, interleave)
    start = split * split_len
    end, bad = _checked_range(glens_ptr, table_ptr, s, s64, st_s, start, tl.minimum(start + split_len, local_len),
                              local_len, NUM_BLOCKS, TABLE_W, split_len, PAGE, True)
    if CAUSAL:
        q_pos = tl.load(glens_ptr + s) - Tq + t_idx
    else:
        q_pos = t_idx
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)
    r_i = tl.zeros([BLOCK_M], tl.float32)      # (F16: acc's unit)
    if TMA:     # whole tiles by TMA, then the partial one (if any) through masked pointer loads
        full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N
    else:
        full_end = end
    if INTERPRETED:
        j0 = start
        while j0 < full_end:
            m_i, l_i, acc0, acc1, r_i = _tile_halves(
                j0, end, s64, q0, q1, q_rest, q_pos, rmask, m_i, l_i, acc0, acc1, r_i, desc_main, desc_rest, k_ptr,
                ks_ptr, table_ptr, qk_scale, dcp_size, dcp_rank, interleave, sk_b, sk_t, ss_b, ss_t, st_s, HALF,
                D_REST, BLOCK_REST, BLOCK_N, PAGE, FP8, CAUSAL, LAZY, TMA, DIAG, IEEE, F16)
            j0 += BLOCK_N
    else:
        for j0 in range(start, full_end, BLOCK_N):
            m_i, l_i, acc0, acc1, r_i = _tile_halves(
                j0, end, s64, q0, q1, q_rest, q_pos, rmask, m_i, l_i, acc0, acc1, r_i, desc_main, desc_rest, k_ptr,
                ks_ptr, table_ptr, qk_scale, dcp_size, dcp_rank, interleave, sk_b, sk_t, ss_b, ss_t, st_s, HALF,
                D_REST, BLOCK_REST, BLOCK_N, PAGE, FP8, CAUSAL, LAZY, TMA, DIAG, IEEE, F16)
    if TMA:
        if full_end < end:
            m_i, l_i, acc0, acc1, r_i = _tile_halves(
                full_end, end, s64, q0, q1, q_rest, q_pos, rmask, m_i, l_i, acc0, acc1, r_i, desc_main, desc_rest,
                k_ptr, ks_ptr, table_ptr, qk_scale, dcp_size, dcp_rank, interleave, sk_b, sk_t, ss_b, ss_t, st_s,
                HALF, D_REST, BLOCK_REST, BLOCK_N, PAGE, FP8, CAUSAL, LAZY, False, DIAG, IEEE, F16)
    safe, lse = _finish(l_i, m_i)
    safe = tl.where(bad > 0, float("nan"), safe)      # a bad table or length: NaN out and lse
    lse = tl.where(bad > 0, float("nan"), lse)
    o_row = split.to(tl.int64) * so_p + s64 * so_s + t_idx.to(tl.int64) * so_t + h_idx.to(tl.int64) * so_h
    if F16:
        factor = r_i / safe
    else:
        factor = 1.0 / safe
    tl.store(o_ptr + o_row[:, None] + dh[None, :], acc0 * factor[:, None], mask=rmask[:, None])
    tl.store(o_ptr + o_row[:, None] + HALF + dh[None, :], acc1 * factor[:, None], mask=rmask[:, None])
    l_row = split.to(tl.int64) * sl_p + s64 * sl_s + t_idx.to(tl.int64) * sl_t + h_idx
    tl.store(lse_ptr + l_row, lse, mask=rmask)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr,
    qk_scale, split_len, Tq, G, M_TILES, KV_HEADS, HQ,
    dcp_size, dcp_rank, interleave,
    sq_s, sq_t, sq_h,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h,
    st_s,
    so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t,
    D_MAIN: tl.constexpr, D_REST: tl.constexpr, BLOCK_REST: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr, V_FROM_K: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
    INTERPRETED: tl.constexpr, LAZY: tl.constexpr = False, HALVES: tl.constexpr = False,
    TMA: tl.constexpr = False, DIAG: tl.constexpr = 0, F16: tl.constexpr = False, PDL: tl.constexpr = False,
    STAGE: tl.constexpr = 0, NUM_BLOCKS=1, TABLE_W=1, DCP_N: tl.constexpr = 0, DCP_I: tl.constexpr = 0,
    EVEN: tl.constexpr = False, plan_ptr=None, PLANNED: tl.constexpr = False,
):
    if DCP_N > 0:   # (CONFIG dcp_constexpr: the DCP group size and interleave built into the kernel)
        dcp_size = DCP_N
        interleave = DCP_I
    if PDL:   # launched early (programmatic dependent launch): wait for the kernel before, then let
        gdc_wait()                  # the merge that follows launch (it waits for this one in turn)
        gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tile = pid % M_TILES
    kvh = (pid // M_TILES) % KV_HEADS
    s = pid // (M_TILES * KV_HEADS)
    if PLANNED:     # (the grid's splits are a length plan's items: each names its sequence and split)
        s, split, split_len, o_ptr, lse_ptr = _work_item(plan_ptr, split, o_ptr, lse_ptr, so_p, sl_p)
    s64 = s.to(tl.int64)
    # rows of this tile: r = t * G + g  (query token t, head kvh * G + g)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < Tq * G
    t_idx = r // G
    h_idx = kvh * G + r % G
    q_row = s64 * sq_s + t_idx.to(tl.int64) * sq_t + h_idx.to(tl.int64) * sq_h
    if HALVES:
        _halves_body(q_ptr, k_ptr, ks_ptr, table_ptr, glens_ptr, o_ptr, lse_ptr, split, s, s64, q_row,
                     t_idx, h_idx, rmask, qk_scale, split_len, Tq, dcp_size, dcp_rank, interleave, sk_b, sk_t,
                     ss_b, ss_t, st_s, so_p, so_s, so_t, so_h, sl_p, sl_s, sl_t, NUM_BLOCKS, TABLE_W, D_MAIN // 2,
                     D_REST, BLOCK_REST, BLOCK_M, BLOCK_N, PAGE, FP8, CAUSAL, INTERPRETED, LAZY, TMA, DIAG, IEEE, F16)
    else:
        dm = tl.arange(0, D_MAIN)
        q_main = tl.load(q_ptr + q_row[:, None] + dm[None, :], mask=rmask[:, None], other=0.0)
        if D_REST > 0:
            dr = D_MAIN + tl.arange(0, BLOCK_REST)
            rest_mask = dr < D_MAIN + D_REST
            q_rest = tl.load(q_ptr + q_row[:, None] + dr[None, :], mask=rmask[:, None] & rest_mask[None, :], other=0.0)
        else:   # unused placeholders
            dr, rest_mask, q_rest = dm, dm < 0, q_main
        dv = tl.arange(0, BLOCK_DV)
        dv_mask = dv < DV
        local_len = _local_len(glens_ptr, s, dcp_size, dcp_rank, interleave)
        start = split * split_len
        # fp8 caches scan the split's ids first: the per-tile check spilled GQA over fp8 under its
        # register cap (sm_90a, 168 registers: 152 B of spill stores, 2768 -> 3424 instructions;
        # bench cp on the H200, 1/4 of the KV, B 32, 8K / 32K / 128K: 55.7 / 159.4 / 569.4 µs);
        # the scan leaves it at 0 spills (2848 instructions) and 44.0 / 124.1 / 440.1 µs in the
        # next run (bench/results/cp-dcp-h200.md of commit ba3cff7). bf16 keeps the per-tile check (no spill there).
        end, bad = _checked_range(glens_ptr, table_ptr, s, s64, st_s, start, tl.minimum(start + split_len, local_len),
                                  local_len, NUM_BLOCKS, TABLE_W, split_len, PAGE, FP8)
        if CAUSAL:
            q_pos = tl.load(glens_ptr + s) - Tq + t_idx                                  # [BLOCK_M]
        else:
            q_pos = t_idx
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        r_i = tl.zeros([BLOCK_M], tl.float32)      # (F16: acc's unit)
        if F16:
            q_main, q_rest, qk_scale = _f16_queries(q_main, q_rest, qk_scale, D_REST)
        if TMA:     # (GQA: whole tiles by TMA, then the partial one, if any, through masked pointer loads)
            desc_k = tl.make_tensor_descriptor(k_ptr, [NUM_BLOCKS, PAGE, KV_HEADS, D_MAIN], [sk_b, sk_t, sk_h, 1],
                                               [1, BLOCK_N, 1, D_MAIN])
            desc_v = tl.make_tensor_descriptor(v_ptr, [NUM_BLOCKS, PAGE, KV_HEADS, DV], [sv_b, sv_t, sv_h, 1],
                                               [1, BLOCK_N, 1, BLOCK_DV])
        else:
            desc_k, desc_v = k_ptr, v_ptr
        if TMA or EVEN:     # (EVEN: whole tiles without masks; the partial one, if any, after them with them)
            full_end = start + (tl.maximum(end - start, 0) // BLOCK_N) * BLOCK_N
        else:
            full_end = end
        # a `for` loop pipelines on the GPU; the interpreter only takes constant bounds there
        if INTERPRETED:
            j0 = start
            while j0 < full_end:
                m_i, l_i, acc, r_i, bad = _tile(
                    j0, end, s64, kvh, q_main, q_rest, q_pos, rmask, dm, dr, rest_mask, dv, dv_mask, m_i, l_i, acc,
                    r_i, bad, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, NUM_BLOCKS, qk_scale, dcp_size, dcp_rank,
                    interleave, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h,
                    st_s, D_REST, BLOCK_N, PAGE, FP8, V_FROM_K, CAUSAL, IEEE, LAZY, F16, not FP8, desc_k, desc_v, TMA,
                    STAGE, EVEN)
                j0 += BLOCK_N
        else:
            for j0 in range(start, full_end, BLOCK_N):
                m_i, l_i, acc, r_i, bad = _tile(
                    j0, end, s64, kvh, q_main, q_rest, q_pos, rmask, dm, dr, rest_mask, dv, dv_mask, m_i, l_i, acc,
                    r_i, bad, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, NUM_BLOCKS, qk_scale, dcp_size, dcp_rank,
                    interleave, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h,
                    st_s, D_REST, BLOCK_N, PAGE, FP8, V_FROM_K, CAUSAL, IEEE, LAZY, F16, not FP8, desc_k, desc_v, TMA,
                    STAGE, EVEN)
        if TMA or EVEN:
            if full_end < end:
                m_i, l_i, acc, r_i, bad = _tile(
                    full_end, end, s64, kvh, q_main, q_rest, q_pos, rmask, dm, dr, rest_mask, dv, dv_mask, m_i, l_i,
                    acc, r_i, bad, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, NUM_BLOCKS, qk_scale, dcp_size, dcp_rank,
                    interleave, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, ss_b, ss_t, ss_h, svs_b, svs_t, svs_h,
                    st_s, D_REST, BLOCK_N, PAGE, FP8, V_FROM_K, CAUSAL, IEEE, LAZY, F16, not FP8, STAGE=STAGE)
        safe, lse = _finish(l_i, m_i)
        safe = tl.where(bad > 0, float("nan"), safe)      # a bad table or length: NaN out and lse
        lse = tl.where(bad > 0, float("nan"), lse)
        if F16:
            out = acc * (r_i / safe)[:, None]
        else:
            out = acc / safe[:, None]
        o_row = split.to(tl.int64) * so_p + s64 * so_s + t_idx.to(tl.int64) * so_t + h_idx.to(tl.int64) * so_h
        tl.store(o_ptr + o_row[:, None] + dv[None, :], out, mask=rmask[:, None] & dv_mask[None, :])
        l_row = split.to(tl.int64) * sl_p + s64 * sl_s + t_idx.to(tl.int64) * sl_t + h_idx
        tl.store(lse_ptr + l_row, lse, mask=rmask)


CONFIG = impl.Settings({
    # ~2 waves of 132 SMs (H200). One split wherever B x Hkv programs fill the SMs once (no merge
    # kernel, as cuDNN's SDPA runs this problem: 128 CTAs) lost in the probe of 2026-12-03 (bench/
    # results/cp-probe7-h200.json, GQA B 32, 1/4 of 8K / 32K: bf16 49.7 -> 66.4 / 135.5 -> 232.5 µs,
    # fp8 44.1 -> 62.5 / 124.1 -> 210.1): one CTA per SM does not stream the KV fast enough here
    "target_programs": 264,
    # programmatic dependent launch (sm_90+, 0/1): the kernel and the split merge after it launch
    # while the kernel before each finishes, and wait for it in-kernel before touching memory
    "pdl": 1,
    # length plans (`plan_by_lengths`): items_target = the capacity plan's splits' target x plan_waves;
    # plan_fit 0: chunk = the batch's local tokens over it, 1: the shortest chunk whose items fit it
    # (plan_fit_wide: MLA's kernels). bench cp's mixed rows, all four settings in one run (H100, 04:52
    # UTC, B 32, 1/4 of the KV, two 128K among thirty 2K / log-uniform 1K-128K, µs; docs/gpu.md §49):
    # GQA bf16 fit 0 68.8 / 177.8, fit 1 373.8 / 332.7 (32 rows for 33 items: no row split), waves 2
    # 81.8 / 166.9; GQA fp8 49.6 / 106.9 against 249.1 / 214.8 and 62.5 / 102.1; MLA 128 heads bf16
    # fit 0 82.7 / 183.1, fit 1 83.0 / 160.5; fp8 108.1 / 261.5 against 113.7 / 240.1; MLA 16 bf16 67.4
    # / 119.9 against 62.5 / 103.1, fp8 58.4 / 84.4 against 51.4 / 66.7 (waves 2 slower on every MLA row)
    # plan_order 1: the items launch longest first (every full chunk, then the partial ones by length)
    # instead of in row order (`_plan_kernel`); plan_fit_wide_narrow: plan_fit of MLA's narrow head
    # tiles (16 heads, `gluon_mla_narrow`), plan_fit_wide of its full ones. The run with all the
    # settings side by side (H100, 2026-12-06 06:00 UTC, commit 97c4367, the same batches, µs, row
    # order -> longest first): GQA bf16 tokens' share 68.5 / 178.6 -> 68.9 / 156.3, fp8 49.3 / 107.4 ->
    # 49.4 / 94.1; MLA 128 heads bf16 fit 83.4 / 163.6, share 81.2 / 183.6 -> 82.1 / 159.6, fp8 fit
    # 113.0 / 239.3, share 109.7 / 260.7 -> 108.8 / 214.0; MLA 16 heads bf16 fit 63.0 / 103.0 -> 61.3 /
    # 103.2 (the share longest first 63.8 / 108.0), fp8 fit 51.2 / 66.2 -> 51.3 / 66.4 (52.0 / 71.7).
    # With the segment merge's rounds (06:18, a4f6e13;
    # bench/results/logs/cp-mixed-h100-2026-12-06-0618-a4f6e13.md) the installed plans ran GQA 67.3 / 159.7
    # and 46.7 / 95.6, MLA 128 heads 74.0 / 154.5 and 93.8 / 211.7, MLA 16
    # heads 49.5 / 101.3 and 38.0 / 63.4 (bf16 / fp8), the other settings as columns beside them
    "plan_waves": 1, "plan_fit": 0, "plan_fit_wide": 0, "plan_fit_wide_narrow": 1, "plan_order": 1,
    # ... except for MLA's narrow head tiles' swapped kernels (`gluon_mla_narrow`, bf16 and fp8) and
    # their split merge: off. Launched without it they were faster on 52 of 56 MLA 16-head rows in
    # the four runs of 2026-12-05 that timed both (bench cp's no_pdl_us: H200 11:01 and 19:31, H100
    # 19:10 and 19:28; slower: the speculative step's fp8 row by 0.6-1.4% in three, fp8 at 128K
    # once, a row that moves by 5-8% between runs); on the H200 at 19:31, 1/4 of 8K / 32K / 128K,
    # bf16 27.26 / 78.16 / 277.31 µs against 27.72 / 79.68 / 278.71 and fp8 22.76 / 54.22 / 190.45
    # against 23.59 / 55.95 / 192.70, over one page 8.48 against 9.83 (bf16) and 10.19 against 11.09
    # (fp8), at DCP N = 8 44.76 against 46.35 (bf16) and 33.13 against 34.37 (fp8). The other
    # kernels keep it (without it GQA fp8 at 8K 5.4% slower, MLA 128 heads bf16 at 128K 9%)
    "pdl_wide_narrow": 0,
    # MLA with full 64-head tiles over a bf16 cache through the warp-specialized Gluon kernel
    # (`gluon_mla`: a TMA loader warpgroup, one warpgroup for the scores, softmax and output dims
    # [0, 256), one for dims [256, 512) from the same weights), where it applies (`gluon_mla_ok`).
    # bench/debug/decode_gluon.py (2026-12-04, bench/results/logs/decode-gluon-h200.json; 128 heads,
    # B 32, 1/4 of 8K / 32K / 128K, step_time): Triton 86.0 / 273.2 / 1039.6 µs -> Gluon 49.7 /
    # 151.0 / 640.3, bit-identical outputs (the same wgmma steps in the same order)
    "gluon_wide": 1,
    # ... in the seesaw form (0/1; `gluon_mla._mla_decode_seesaw_kernel`, bf16): the two warpgroups take
    # the scores and softmax of alternate tiles, each rescaling its half of the output by the other's
    # statistics (FlashMLA's dense decode schedule), so that one warpgroup's softmax runs beside the
    # other's MMAs. Passes its GPU tests; measured slower (bench cp's seesaw_us column, 1/4 of 8K / 32K /
    # 128K): 58.9 / 161.9 / 612.1 µs against 53.0 / 153.9 / 597.7 on an H100, 53.8 / 160.1 / 616.9
    # against 49.2 / 151.1 / 607.7 on an H200 (2.5x slower before its ring indices stopped the
    # compiler hoisting and spilling every box's wgmma descriptor; docs/gpu.md §41)
    "seesaw_wide": 0,
    # ... in the split form (0/1; `gluon_mla._mla_decode_ws_kernel` SPLIT, bf16): warpgroup 0 the scores and
    # softmax only, two value warpgroups the output's halves (168 registers each), so that no warpgroup's
    # P V waits behind the next tile's scores. Passes its GPU tests (the Triton kernel's results exactly);
    # measured no faster: bench/debug/decode_gluon.py (H100, 2026-12-06 10:16, logs/decode-gluon-split-h100-
    # 2026-12-06-1016-d2b21f4.json; 1/4 of 8K / 32K / 128K, two rounds) 53.0-53.2 / 156.3-158.0 / 613.3-619.1 µs
    # against 52.6-53.0 / 153.3-157.7 / 601.1-602.8: what bounds the bf16 kernel is not warpgroup 0's serial P V
    "split_wide": 0,
    # ... under a length plan, over equal runs of key tiles that cross sequence boundaries (0/1;
    # `gluon_mla_runs`, FlashMLA's schedule: one program per SM pair of head tiles, one wave, a query
    # load per segment instead of a prologue per item): the plan (`plan_by_lengths`) is then made for
    # it; bf16, one query token (a speculative step's expanded rows included), full head tiles, not the
    # seesaw or split forms. runs_overhead_wide: what a segment costs beyond its tiles, in 64-key tiles
    # (FlashMLA's scheduler charges 5). H100, 2026-12-06 23:40 (overhead charged: none): uniform 8K / 32K
    # 58.1 / 159.6 µs against the length plan's 59.4 / 160.3; two 128K among thirty 2K 81.0 against
    # 74.3, log-uniform 1K-128K 158.8 against 158.0: the programs of many short sequences paid a query
    # load and a partial row per segment uncounted. H100, 2026-12-07 02:40 (bench/results/logs/
    # decode-runs-h100-2026-12-07-0240-3b4dcf0.json, B 32, 1/4 of the KV, graph µs; the length plan's
    # items in brackets), a charge of 0 / 2 / 5 / 8 tiles a sequence: uniform 8K 59.4 / 59.9 / 62.1 /
    # 64.9 (60.2), 32K 161.1 / 163.9 / 162.2 / 161.6 (161.7), 128K 621 / 619 / 607 / 618 (617); two 128K
    # among thirty 2K 83.0 / 76.5 / 76.3 / 78.1 (75.0), log-uniform 1K-128K 158.6 / 150.0 / 144.1 / 142.4
    # (157.7); bench cp's mixed rows in the next call (bench/results/cp-mixed-h100.md) 74.3 / 142.6 at a
    # charge of 5 against the items' 73.4 / 157.0, FlashMLA 57.3 / 123.4. No one charge wins everywhere:
    # the plan chooses it (runs_choose_wide below), and with the choice the token runs tie the items on
    # the uniform batches and on two 128K among thirty 2K (within 2%) and are 9% faster on the log-uniform
    # one: on
    "runs_wide": 1, "runs_overhead_wide": 5,
    # ... runs_choose_wide: the plan's charge a sequence not runs_overhead_wide itself but, of
    # `gluon_mla_runs.RUNS_CHARGES` (0 / 2 / 5 / 8), the one whose plan's busiest program costs least with a
    # segment costing runs_overhead_wide tiles (`runs_charge`, in the planner kernel `_runs_span`): the H100
    # run of 2026-12-07 02:40 (bench/results/logs/decode-runs-h100-2026-12-07-0240-3b4dcf0.json): on each of its
    # five batches the charge this model picks ran within 1.2% of the fastest charge (uniform 8K: none, 59.4
    # against 62.1 µs at 5; 32K and 128K: 5; two 128K among thirty 2K: 5; log-uniform 1K-128K: 5, 144.1
    # against 142.4 at 8 and 158.6 at none)
    "runs_choose_wide": 1,
    # ... and over an fp8 latent cache (its loader converts each tile to fp16 into shared memory, the
    # scores and weights take the per-token scales as `f16_wide_fp8` does): Triton 106.6 / 359.0 /
    # 1356.7 µs -> Gluon 94.6 / 289.3 / 1062.4 at 1/4 of 8K / 32K / 128K (decode-gluon2-h200.json).
    # Bound by the loader's conversion (bf16 runs in 151 µs at 32K): its 96 registers hold no second
    # tile's bytes (loading them before the stage's wait spilled 2.6 KB, sm_90a), and shared memory
    # holds no fp8 staging ring beside the two fp16 stages and the queries
    "gluon_wide_fp8": 1,
    # ... for MLA's narrow head tiles too (fewer than 64 heads, e.g. 16 under TP 8: the tile padded
    # to 64 rows; with them the problem is bound by the bytes), per cache dtype. 16 heads, B 32, 1/4
    # of 8K / 32K / 128K (decode-gluon4-h200.json): bf16 34.2 / 94.4 / 322.2 µs (Triton) -> 29.8 /
    # 84.2 / 335.1 (on: the loss at 128K is 4%), fp8 39.6 / 123.1 at 8K / 32K -> 47.4 / 155.0 (off:
    # the Gluon loader's conversion bounds it, and 16 heads leave it 4x the tiles per FLOP). With
    # the 32-key tiles below (decode-gluon9-h200.json, 2026-12-04): fp8 Triton 39.5 / 120.7 / 439.8
    # -> Gluon 34.3 / 106.5 / 390.8: on
    "gluon_wide_narrow": 1, "gluon_wide_narrow_fp8": 1,
    # ... and there (at most 32 heads) the kernel with swapped operands (`gluon_mla_narrow`: the tile's
    # 64 keys as wgmma's M, the heads as N, so no padded rows), per cache dtype; over fp8 its direct
    # form below (the converter's forms measured here, a converter warpgroup writing fp16 stages from a
    # raw ring, the rope box's scores from the raw stage: removed after 78e902e, as CONFIG
    # ring_wide_narrow_fp8 / raw_ring_wide_narrow_fp8 / rope_raw_wide_narrow_fp8).
    # bench/debug/decode_narrow.py (2026-12-04, bench/results/logs/decode-narrow-h200.json; B 32, 1/4
    # of 8K / 32K / 128K, 16 heads): fp8 padded 35.4 / 107.2 / 389.8 µs -> swapped (2 fp16 stages, 1
    # raw) 26.5 / 83.9 / 303.8 (1 and 3: 30.7 / 90.4 / 317.5); bf16 29.7 / 83.0 / 317 -> 28.7 / 79.0 /
    # 273.7. At 32K: 32 heads fp8 109.4 -> 100.4, 8 heads 107.9 -> 76.8. Both on. The rope box from
    # the raw stage with two raw stages (decode-narrow2-h200.log): 16 heads fp8 26.8 / 84.1 / 304.4
    # -> 25.1 / 75.3 / 266.2 µs: on (32 heads kept one raw stage). Two
    # consumer warpgroups on alternate tiles (each its own partial for the split merge; commit
    # b8c79fa) ran 42.9 / 118 / 403 µs: their registers spilled (decode-narrow3-h200.json); removed.
    # Summing each key position's weights and reducing them once at the end (cab3240): 25.0 / 75.1 /
    # 266 -> 24.1 / 70.9 / 251.8 µs (decode-narrow4-h200.json). The rope box in a TMA ring of its own,
    # 2-3 stages, so that the converter frees a raw stage without waiting for the consumer (commit
    # f56e553, reverted): 24.2 / 71.4 / 251.5 (decode-narrow5-h200.json), no gain. A speculative
    # step's 2 query tokens (32 columns) at 32K, 16 heads (decode-narrow6-h200.json): the Triton kernel
    # 2318 µs over fp8 (its 32-row narrow tile over fp8 with the causal mask: pathological) and 114.3
    # over bf16 -> swapped 105.0 / 84.0
    "swap_wide_narrow": 1, "swap_wide_narrow_fp8": 1,
    # over fp8 the swapped kernel's direct form (`gluon_mla_narrow._mla_narrow_direct_kernel`; 0 off, the
    # padded-tile kernel then, else its raw stages, cut to what fits: `direct_stages`): no converter and
    # no fp16 stages. A TMA
    # loader fills the raw ring; one warpgroup computes the scores and the softmax, one the values,
    # each reading the raw tile's bytes itself (a tile crosses shared memory once by TMA and is read
    # twice: ~124 KB of traffic against ~270 through the converter). The values' A operand is the raw
    # box read transposed by 16-bit ldmatrix, split into even and odd dims in registers; the scores as
    # fp8 MMAs straight from shared memory against the queries as e4m3 hi + lo parts (~8 significant
    # bits, a bf16 query's; each 128-dim box its own accumulator, summed in fp32): against fp16 scores
    # (the A operand by plain ldmatrix in a permuted dim order, CONFIG fp8_scores_wide_narrow_fp8 0,
    # removed after 78e902e) lse within 2.2e-3 and out within 1.5e-3 on the GPU test's data.
    # bench/debug/decode_narrow.py (2026-12-04, DECODE_NARROW_FP8=1, bench/results/logs/
    # decode-narrow8/11-h200.json; B 32, 16 heads, 1/4 of 8K / 32K / 128K): the converter's form
    # 24.4 / 71.7 / 250.6 µs -> direct with fp16 scores 23.7 / 65.5 / 222.0 -> fp8 scores 22.6 / 60.3
    # / 208.0 (at 32K: 32 heads 96 -> 83, 8 heads 64 -> 51.5). 3 or 5 raw stages alike. One
    # warpgroup for everything ran 27.8 / 77.1 / 266.5 (its ~1100-instruction chain a tile, decode-
    # narrow-direct1wg-h200.json); measured and not kept: the next tile's scores issued before the
    # softmax (decode-narrow9-pipe, slower: 70.0 / 232 µs, and its GPU test hung), two value
    # warpgroups of two boxes each (decode-narrow10/12-values2, 3-7% slower), the block ids four
    # tiles ahead in the loader (kept: no change either way)
    # With the queries' hi and lo parts as one MMA operand of 2 NQ columns (one fp8 MMA a box instead of two,
    # the box read from shared memory once; decode-narrow16-wide-h200.json, 2026-12-04 19:32): raw 5 22.1 /
    # 57.2 / 192.0-196.2 µs, raw 3 21.9 / 56.1 / 191.8-194.4 (32 heads at 32K 78.9 / 77.9, 8 heads 47.4 /
    # 46.8). With the scores in tile pairs (pipe_wide_narrow_fp8 below; decode-narrow18-pairs-h200.json): raw 5
    # 22.1-22.2 / 55.6-55.9 / 182.0-192.6, raw 3 22.7 / 59.7-60.0 / 204.1-204.9 (raw 3 unpaired 22.3-22.4 /
    # 56.3-56.5 / 196.5-199.4); 32 columns (no pairs there) raw 5 79.3-83.3 against raw 3 78.0-79.2: 5
    "direct_wide_narrow_fp8": 5,
    # ... its raw stages over more than 16 columns (32 heads, or 16 x a speculative step's 2 tokens), where the
    # tile pairs do not apply: 3 (32 heads at 1/4 of 32K: 78.0-79.2 µs against 79.2-83.3 with 5,
    # decode-narrow18/19)
    "direct_wide_narrow_fp8_32": 3,
    # ... at most 16 columns, the scores in tile pairs: the second tile's MMAs issued
    # before the first's softmax, run under it (1), or each tile's after the last's softmax (0). Issuing
    # the next tile's MMAs every tile (one in flight across iterations) made ptxas serialize every wgmma
    # of the kernel (C7514: the loop-carried accumulators' register moves read in-flight registers):
    # 26-27 / 67-74 / 228-259 µs (decode-narrow17-pipe-h200.json), removed, as was the same for GQA's
    # steps (34.5-35.8 / 116-127 / 443-489 µs against 23.6 / 71.0 / 260.6). Nor kept: the value warpgroup
    # leaving a tile's last two boxes' MMAs in flight into the next tile (its raw stage released once read):
    # 25.8-26.0 / 67.3 / 226.7-227.0 against 22.7-23.1 / 56.0-56.2 / 182.8-185.7 (decode-narrow19-defer-h200.json)
    # Nor the split merge in the kernel (the last of a sequence's splits to finish, by a per-device counter,
    # merging them in its value warpgroup; commits d9e27d2 / 2afb292): one page per rank, 4 splits, ten calls a
    # graph, 16.2 µs a call against 11.4 with the merge kernel (7.4 with one split and no merge): its chain
    # (fence, atomic, the lse and partials read back from L2 by one CTA) is longer than the merge kernel's
    # launch (logs/decode-fixed2-h200.json)
    "pipe_wide_narrow_fp8": 1,
    # the direct fp8 kernels (MLA's narrow tiles, GQA): the output stored as dim pairs, one 8-byte store a
    # pair (a thread holds dim 2r in its even accumulator and 2r + 1 in its odd one at the same place):
    # 2 x NQ vector stores a thread instead of 4 x NQ scalar ones of one parity (half-filled sectors;
    # Nsight Compute put the narrow kernel's epilogue among a one-page call's stalls, docs/gpu.md
    # section 24). ids_ahead (the loaders of the GQA kernels over bf16 and the direct fp8 one, and of
    # MLA's narrow tiles over bf16 and the direct fp8 one): the first block ids loaded beside the
    # sequence's length, not after it (their sm_90a SASS: the table loads issued before the branch that
    # waits on the length), one memory round trip fewer before the first TMA; and in the same kernels'
    # consumer / scores warpgroups the split's block-id check loaded beside the length and evaluated
    # after the loop (`gluon_mla._ids_early`), not in the prologue (the direct fp8 kernels: a round trip
    # before the queries' split) or after the loop (the bf16 ones: one before the output's stores), and
    # in GQA's direct scores warpgroup its first two steps' ids beside the length too (their scales'
    # loads then wait for one round trip, not two). Both built and checked on the CPU only (docs/gpu.md
    # sections 26, 28): off until `megapar bench cp` has timed them (columns paired_store_us, ids_ahead_us)
    # Timed by `megapar bench cp` of 2026-12-05 (bench/results/logs/cp-dcp-h200-2026-12-05-0410-d16f398.md,
    # columns paired_store_us, ids_ahead_us): the paired stores won over fp8 where the epilogue weighs
    # (MLA 16 heads at 1/4 of 8K / 32K / 128K: 22.56 / 55.06 / 180.9 µs against 25.36 / 56.69 / 184.1,
    # over one page 11.78 against 12.17; a speculative step of 2 tokens 78.45 against 82.49) and tied
    # on GQA (23.43 / 69.14 against 23.55 / 69.25): on. ids_ahead won a little on every bf16 row
    # (GQA 34.43 / 122.8 / 469.9 against 35.25 / 124.1 / 474.4, over one page 3.88 against 4.10; MLA
    # 16 heads 27.84 / 78.89 / 273.2 against 28.60 / 79.20 / 273.8) and lost on GQA's direct fp8
    # kernel (69.25 / 252.0 -> 72.31 / 270.3 at 32K / 128K, the DCP rows likewise) while MLA's narrow
    # fp8 kernel was mixed (25.36 / 56.69 / 184.1 -> 24.28 / 56.06 / 185.7): on for the bf16 kernels,
    # off for the direct fp8 ones (ids_ahead_direct_fp8, column ids_ahead_fp8_us; `ids_ahead_key`);
    # since 2026-12-05 evening its own key for MLA's narrow direct fp8 kernel, ids_ahead_narrow_fp8
    # (column ids_after_narrow_fp8_us): on. On the H200 at 9f2a766 (logs/cp-dcp-h200-2026-12-05-1931-9f2a766.md, the
    # ids_ahead_fp8_us column) it was faster on every MLA 16-head fp8 row, 22.74 / 54.81 / 185.98 µs
    # against 23.59 / 55.95 / 192.70 at 1/4 of 8K / 32K / 128K, over one page 10.48 against 11.09, at
    # DCP N = 8 33.58 against 34.37, while GQA's direct kernel lost again (73.04 / 275.73 against 70.50 /
    # 262.58 at 32K / 128K); on the H100 a tie for MLA (within 0.2%) and a 1.5-3% win for GQA
    "paired_store_direct_fp8": 1,
    # MLA's narrow direct fp8 kernel at most 16 columns (`gluon_mla_narrow.values8_apply`): the value MMAs in
    # fp8 (`_values_tile8`): each box's even / odd dims made into fp8 A operands by byte permutes (no
    # e4m3 -> fp16 conversion: its sm_90a loop 242 instructions a tile against 452, of which 128 F2FP and
    # 128 PRMT), against the weights published as e4m3 hi + lo parts (~8 significant bits, a bf16
    # weight's), into a fresh accumulator a tile that the fp32 outputs take up; its scores warpgroup ~33
    # instructions a tile more for the parts. Its GPU test passes (H100, 2026-12-07); measured off: on the
    # H100 16 heads at 1/4 of 8K / 32K / 128K 25.9 / 65.6 / 217.6 µs against 26.2 / 65.2 / 217.1 (bench cp,
    # column values8_us), and with the tiles in L2 (bench/debug/decode_l2pace.py, the kernel's own pace,
    # which bounds this row on an H200) 3795 against 3849 GB/s of tiles: the unpacking is not the pacer
    "values8_narrow_fp8": 0,
    # MLA's narrow direct fp8 kernel: one softmax maximum a tile instead of two (`_softmax_step_one`: the
    # running maximum over the scores plus log2 of the keys' scales, so that the published weights are at
    # most 1 without the running unit's second maximum). Over 16 columns a tile's keys span the scores
    # warpgroup's four warps, so each maximum is a cross-warp reduction (12 SHFL, shared memory and bar.sync
    # a tile); Nsight Compute's stall samples with the tiles in L2 (H100, 2026-12-07) put that chain
    # (FMNMX, SHFL, LDS, BAR, FSEL) at ~40% of the scores warpgroup, the pacer (the value warpgroup waits
    # on its weights for a third of its samples). Measured on (H100, 2026-12-07, commit c8438d7): bench cp
    # (column one_max_us) 16 heads at 1/4 of 8K / 32K / 128K 25.72 / 63.54 / 208.73 µs against 25.96 / 64.72
    # / 211.71 off (read-bound there), speculative steps of 2 / 3 tokens 72.3 / 123.1 against 77.1 / 138.5;
    # with the tiles in L2 (bench/debug/decode_l2pace.py, the kernel's own pace, which bounds the row on an
    # H200) 935 / 1256 / 1152 ns a tile an SM against 1106 / 1262 / 1337. Installed since; bench cp's column
    # two_max_us times the form before it beside each row
    "one_max_narrow_fp8": 1,
    "ids_ahead": 1,
    "ids_ahead_direct_fp8": 0,
    "ids_ahead_narrow_fp8": 1,
    # over fp8: a TMA ring of this many raw fp8 tiles in front of the Gluon kernel's converter (0:
    # the converter loads 64-key tiles itself into two fp16 stages; Nsight Compute had put the
    # kernel's bound in those loads, docs/gpu.md section 18). With 64-key tiles and one fp16 stage:
    # bench/debug/decode_gluon.py (2026-12-04, decode-gluon6-h200.json; 128 heads, 1/4 of 8K / 32K
    # / 128K): 96.1 / 293.3 / 1073.1 µs (0) -> 91.0 / 288.5 / 1069.7 (1), 92.8 / 300.7 / 1130.5 (2)
    # ... its key tile (64 or 32 keys) and the fp16 stages after the converter (`ring`). With 64-key
    # tiles only one fp16 stage fits beside the queries and the raw ring, so the converter waits for
    # both warpgroups to finish a tile before it writes the next (Nsight Compute, 128 heads, 1/4 of
    # 8K: the converter and warpgroup 1 spend most of their samples waiting, docs/gpu.md section 19);
    # 32-key tiles fit two or three fp16 stages and the conversion runs a tile ahead.
    # decode-gluon7-h200.json (2026-12-04, 128 heads, 1/4 of 8K / 32K / 128K): 64 keys, 1 fp16 and
    # 1 raw stage 92.6 / 288.6 / 1070 µs -> 32 keys, 2 and 2: 81.0 / 258.1 / 969.5 (2 and 4: 81.9 /
    # 260.3 / 976.6; 3 and 2: 81.7 / 260.5 / 980.5). Then the converter's masking of a split's last
    # tile went into a branch of its own (it had run as selects on every tile: 500 -> 125
    # instructions a tile, sm_90a), decode-gluon8-h200.json: 64 keys 89.4 / 279.1 / 1042.1, 32 keys
    # 2 and 2 69.2 / 210.8 / 778.5 (2 and 4: 69.9 / 212.4 / 794.2; 3 and 2: 70.9 / 218.0 / 810.4);
    # 16 heads at 32K 106.8 against Triton 121.3. Built, measured and not kept (decode-gluon10-ping-
    # h200.json): warpgroup 0 issuing the next tile's scores behind its own P V before it hands the
    # weights to warpgroup 1 (FA3's ordering): fp8 69.1 / 212.0 / 777.0 -> 70.0 / 210.8 / 777.2 µs,
    # bf16 49.9 / 152.4 / 632.6 -> 60.2 / 185.8 / 705.3 (warpgroup 1's later release of a stage
    # delays the loader's next tile in a 2-stage ring). Nor 32-key tiles over bf16 (3 or 4 TMA
    # stages; decode-gluon11-bf16-k32-h200.json): 50.5 / 146.3 / 610.1 µs -> 57.8 / 181.6 / 715.6 with
    # 4 stages: the scores' wgmma at N = 32 reads the queries from shared memory for half the keys.
    # Nor the scales folded into the fp16 rows by the converter (each row times scale / u, u the
    # tile's largest scale; warpgroup 0 then without per-key scales or a running unit;
    # decode-gluon12-fold-h200.json): 69.3 / 210.8 / 795.3 µs -> 70.7 / 214.4 / 837.8, max error
    # against the torch path 2.8e-4 -> 3.2e-3 (one more fp16 rounding of the keys)
    "raw_ring_wide_fp8": 2, "keys_wide_fp8": 32, "ring_wide_fp8": 2,
    # over fp8, full 64-head tiles of one query token through the direct kernel instead
    # (`gluon_mla_direct`: no converter; the scores as fp8 MMAs from the raw key boxes against the
    # queries' e4m3 hi + lo parts, two value warpgroups reading the raw boxes transposed into their
    # MMAs' A operands), its raw stages (0: off, the converter's kernel above; at most 3 fit), and its
    # first block ids loaded beside the length (ids_ahead_wide_fp8). bench/debug/decode_gluon.py (2026-12-06,
    # B 32, 1/4 of 8K / 32K / 128K, two rounds, bench/results/logs/decode-gluon-direct1..4-*.json), with 2
    # raw stages (3 ran slower or alike): every wgmma serialized by ptxas (C7511, too few registers), H100
    # 68.0 / 204.0 / 732-749 µs against the converter's 70 / 215 / 776-811, H200 68.0 / 207.5 / 770-773
    # against 68 / 211 / 784-791; unserialized with 196 B of spilled descriptors (H100) 64.6 / 186.4 / 701;
    # the descriptors made where used (H100) 58.7 / 166.7 / 624-638 against 70 / 215 / 773-776. bench cp
    # (H100, logs/cp-dcp-h100-2026-12-06-1000-fe2eb55.md) 58.97 / 171.4 / 629.7 against the converter's
    # 70.4 / 214.2 / 775.8 in the same run (column converter_fp8_us): 1.19 / 1.25 / 1.23x. Two latent boxes a
    # score accumulator (three waits on the MMAs a tile instead of five; commit e67b929, since removed): 57.4-57.9 /
    # 166.1-168.8 / 629-646 µs against 58.2-58.5 / 165.9-168.6 / 655-661, within the spread, with the output
    # 3.7e-3 off the Triton kernel at 32K against 1.4e-3 (logs/decode-gluon-chain2-h100-2026-12-06-1040-e67b929.json)
    "direct_wide_fp8": 2, "ids_ahead_wide_fp8": 1,
    # The split merge inside the full-tile kernels (bf16 and direct fp8), where the merge kernel after them
    # reads back 16.8 MB of fp32 partials at 128 heads and B = 32, measured slower and removed after commit
    # 3c98e6e (2026-12-06; docs/gpu.md §57): every split stored its partial and counted itself in (an acq_rel
    # atomic a value warpgroup), the last of each program read them back from L2 in the merge kernel's
    # order (bit-identical to it; 10 GPU tests passed). H100, B = 32, 128 heads, µs, merge kernel -> in
    # the kernel: fp8 1/4 of 8K 58.4 -> 105, of 32K 166 -> 213, of 128K 640 -> 688-710, 1/8 of 32K 94 ->
    # 140, one page 20.6 -> 52; bf16 1/4 of 8K 53.0 -> 62.6, 1/8 of 32K 85 -> 96, one page 18.5 -> 28.1
    # (logs/decode-kmerge-h100-2026-12-06-1359-3c98e6e.json). Likely why (not profiled): the merging
    # warpgroups' reads back are a chain of L2 round trips beside a full register file (its epilogue
    # spilled 0.4-1.6 KB a thread), where the merge kernel spreads the same bytes over every SM. A form
    # that kept the last split's own partial in registers was as slow (43.6 µs at one page) and summed in
    # arrival order (not deterministic). The narrow fp8 kernel's in-kernel merge (2026-12-04, §24) lost
    # the same way.
    # GQA (head dim 128, one query token, bf16 queries) through the warp-specialized Gluon kernels
    # (`gluon_gqa`: over bf16 a TMA loader with a ring of 64-key tiles and one consumer warpgroup, over
    # fp8 the direct kernel below), per cache dtype, where `gluon_gqa_ok` holds; one CTA per SM (bf16:
    # 255 registers a thread over 8 warps, 106 KB of shared memory with 3 stages), so splits are
    # planned to at most target_programs_gluon_gqa programs (B 32 x 4 kv heads: one split, no merge).
    # Their history: a converter warpgroup to an fp16 ring over fp8 first, then the direct form
    # bench/debug/decode_gluon_gqa.py (2026-12-04, the runs of bench/results/logs/
    # decode-gluon-gqa{,2,3}-h200.json; Hq 32 / Hkv 4, B 32, 1/4 of 8K / 32K / 128K, step_time): bf16
    # Triton 38.2-39.3 / 126.9-129.7 / 476-492 µs -> Gluon 35.4-35.8 / 121.2-123.9 / 475.3-476.2 with
    # a 3-stage ring (4 stages: 35.6-36.7 / 123.4-126.4 / 473.4-473.9; 2: 36.5 / 130; 6: 37.1 /
    # 127.1 / 487.0), B 4 at 32K 25.6 -> 23.0. Over fp8 it loses: 33.4-34.0 / 101.5-103.0 / 380-386
    # -> 42.0-43.1 / 143.8-151.0 / 552-581 (the forms below change it by <= 8%); with the
    # converter's select on the last tile only (2026-12-04 afternoon) 38.5-39.5 / 135.9-137.0 /
    # 518-527 against Triton 33.4-34.3 / 102.3-103.5 / 380-394. Over fp8 it now runs the direct form
    # (direct_gluon_gqa_fp8 below), which beats the Triton kernel everywhere measured
    "gluon_gqa": 1, "gluon_gqa_fp8": 1, "target_programs_gluon_gqa": 132,
    # a speculative step's query tokens over bf16 in the Gluon kernel too: rows = tokens x the kv head's
    # query heads, at most one 64-row tile (`gluon_gqa.bf16_max_tq`), causal within the step; the MMAs
    # are those of one token, the rows padded to 64 either way. 0: those steps run the Triton kernel,
    # which timed them at 0.95x SDPA over 4 tokens (bench cp's speculative rows, H200 828a783 and H100
    # fa94e68; column triton_tokens_us times it beside)
    "gluon_gqa_tokens": 1,
    # its ring over bf16: 16-bit stages of 32 KB each
    "stages_gluon_gqa": 3,
    # over fp8, the direct kernel (`gluon_gqa._gqa_decode_direct_kernel`: no converter, the raw tile's
    # key bytes into fp8 score MMAs against the queries' e4m3 hi + lo parts, its value bytes read
    # transposed into the value MMA's A operand, tiles in steps of four) with this many raw stages of
    # 16 KB (at least 8; 0: the Triton kernel); more than 32 columns (query heads a kv head times a
    # speculative step's tokens) run the Triton kernel. bench/debug/decode_gluon_gqa.py (2026-12-04 evening,
    # DGQA_SET=fp8; B 32, 1/4 of 8K /
    # 32K / 128K, step_time; bench/results/logs/decode-gluon-gqa-direct*-h200.json): Triton 33.4 / 98.9 /
    # 360.3 µs, the converter's Gluon form 39.0 / 136.9, direct 8 / 10 / 12 stages 25.6 / 73.1 / 263.0,
    # 25.3 / 71.3, 25.9 / 73.1 / 259.4 (one tile a step: 34.8 / 119.6 / 461; two: 27.2 / 89.1 / 336.6,
    # the scores warpgroup's two cross-warp reductions a step bound them); B 4 at 32K 19.9 -> 15.0.
    # With the queries' hi and lo parts as one MMA operand of 2 NQ columns (decode-gluon-gqa-wide-h200.json,
    # 2026-12-04 19:32): direct 8 / 10 / 12 stages 22.9 / 69.4 / 252.2-253.9, 23.9 / 70.0, 24.4 / 70.8 /
    # 255.2-257.5 µs (Triton 33.1 / 98.6 / 361.4): 8
    "direct_gluon_gqa_fp8": 8,
    # Removed after their runs (code in the history): the converter's form over fp8 (a converter
    # warpgroup from a raw ring of 6 to an fp16 ring of 2 or 4 stages: 39.0-43.7 / 136.9-150.9 µs at 1/4
    # of 8K / 32K against the Triton kernel's 33.4 / 101.8, decode-gluon-gqa4-h200.json; removed after
    # 78e902e, as CONFIG raw_stages_gluon_gqa / stages_gluon_gqa_fp8), the consumer with swapped operands
    # (S^T = K Q^T; swap_gluon_gqa / _fp8, decode-gluon-gqa5-h200.json: bf16 35.6 / 125.5 / 485.3 µs
    # against 35.9 / 125.8 / 477.1 unswapped, fp8 147-150 at 32K; removed after 78e902e), block ids four tiles ahead in the bf16 GQA
    # loader and in the MLA loader and converter (CONFIG ids_ahead_gluon_gqa / ids_ahead_wide, removed
    # after 918617a; 2026-12-04 afternoon: GQA 35.1 / 121.4 µs against 35.0 / 121.9 with one ahead, MLA
    # 16 heads 29.8 / 81.3 / 319.2 against 29.4 / 83.1 / 307.0, 128 heads at 32K 146.8 against
    # 142.3), two converter warpgroups on alternate tiles over fp8 (converters_gluon_gqa_fp8, removed
    # after 918617a; 43.4 / 149.1 / 581.7 µs against 43.7 / 150.9, 142.3 against 143.7 at 32K after the
    # deeper prefetch), two consumer warpgroups on alternate tiles,
    # merged in the CTA (commit 8bea930; bf16 37.3-37.5 / 125.6-126.1 / 480.2-480.8 µs with 4 stages,
    # 40.3 / 140.2 with 2; fp8 42.0-42.8 / 143.8-145.1 / 552-555), and each raw fp8 tile as one 64 x
    # 128 TMA box (1703bb6; decode-gluon-gqa6-h200.json: 141.7-146.0 µs at 32K against 140.8-141.6
    # with two 64 x 64 boxes): neither count of TMA requests nor consumers bounded the fp8 kernel.
    # Every fp8 form ran at ~1.1 µs per 64-key tile. Measured on 2026-12-04 afternoon and removed
    # again (none faster; docs/gpu.md section 18 has the numbers and the profiles): the loader's ids
    # four ahead and the scales three ahead (the form kept), two (converter, consumer) pairs on
    # alternate tiles (commit 24c2e19), the fp8 tiles by cp.async instead of TMA (07bd670), the ids
    # as a stream of 16-page chunks and the scales by TMA beside the tiles (b7464cb). Nsight
    # Compute's stall samples put the one-pair kernel's bound in its consumer: 587 instructions a
    # tile at ~3 cycles each (the converter and loader wait for it); with two pairs each consumer
    # ran at half that rate.
    #
    # the DCP group size and interleave as compile-time constants (a build per group; 0/1). GQA
    # over fp8 read the same 32768 slots per sequence in 385-387 µs launched as a group of 1
    # (dcp_size specialized to 1 by Triton) and in 431-435 µs as rank 0 of 4 with them as runtime
    # ints; with them built in, rank 0 of 4 took 386 µs; bf16 488-493 µs in all four
    # (bench/debug/decode_clock.py, 2026-12-04, bench/results/logs/decode-clock3-h200.json)
    "dcp_constexpr": 1,
    # tokens of a sequence's local KV: never split finer. Per family (`launch_settings`): GQA,
    # GQA over an fp8 cache, MLA (key dim > 256: *_wide), MLA over fp8 (numbers below the dict)
    "min_split": 512, "min_split_fp8": 512, "min_split_wide": 1024, "min_split_wide_fp8": 1024,
    "block_n": 64, "block_n_wide": 64,            # key tile; "wide" when the key dim > 256 (MLA)
    "block_m": 64, "block_m_wide": 64, "block_m_wide_fp8": 64,
    "num_warps": 4, "num_warps_wide": 8, "num_stages": 3, "num_stages_wide": 2,
    "block_n_fp8": 128, "num_stages_fp8": 2,      # GQA over an fp8 cache (key dim <= 256)
    # its warps and split target (GQA's 4 and 264 served until 2026-12-03 late). Swept then (bench/
    # results/cp-probe14..17-h200.json, B 32, 1/4 of 8K / 32K, installed 39.8 / 118.6 µs): 8 warps
    # 55.7-80.1 / 165.7-266.9; 3-4 CTAs per SM (396 / 528 programs) 48.0 / 139.1; 256-key tiles
    # 61.9 / 199.9; 2 warps 42.6 / 117.4 (528 programs); one warp a program over 12 splits (no
    # cross-warp reduction: the 4-warp loop syncs its CTA 15 times a tile) 43.4 / 110.1, the only
    # gain, at 32K only. Nsight Compute (bench/results/logs/decode-ncu*-h200.log): 12 warps per SM
    # (168 registers), issue slots 49% busy, per issued instruction 1.4 cycles of fixed-latency
    # waits and 0.9 of memory waits against 4.0 of memory waits over bf16 (DRAM 87% busy there,
    # 50% here): the fp8 loop is bound by its instructions' latencies, not by the KV's bytes
    "num_warps_fp8": 4, "target_programs_fp8": 264,
    # GQA's whole key / value tiles by TMA from device-side descriptors over [blocks, page, kv
    # heads, D] (power-of-two head dims, tiles inside pages; `_gqa_tma_ok`), 0/1 per cache dtype.
    # Off: timed with step_time (cp-probe10 / cp-probe9, B 32, 1/4 of 8K / 32K) bf16 41.96 / 131.3 µs
    # -> 43.2 / 132.7 with TMA, fp8 39.9 / 119.2 -> 39.7 / 118.9 (within run-to-run noise)
    "tma": 0, "tma_fp8": 0,
    # f16_fp8: fp16 MMA operands over an fp8 cache (bf16 queries scaled into fp16 by a power of two,
    # weights p * v_scale over a running per-row maximum: `_tile`), one conversion per fp8 pair
    # instead of fp8 -> fp16 -> bf16 (sm_90a loop per 128-key tile: 1818 -> 1509 instructions, the
    # 256 F2F.BF16.F16 gone), under a register cap (234 -> 168 registers, no spill: 3 CTAs per SM)
    "f16_fp8": 1, "maxnreg_fp8": 168,
    # stage16 (fp8 caches; 0 off, 1 the value tile, 2 key and value tiles): each fp8 tile converted
    # in the layout it was loaded in (vectorized shared loads, one conversion per element) and
    # handed to the MMA as 16-bit through shared memory (ldmatrix), where the compiler would
    # otherwise read the value tile as MMA operand one byte per load (no 8-bit ldmatrix .trans on
    # sm_90) and, for MLA's latent (key and value at once), convert every element twice. sm_90a
    # loop per tile (bench/debug/kernel_sass.py decode --only stage16): GQA 128 keys 1521 -> 1013
    # (1) / 952 (2) instructions, no LDS.U8; MLA 16 heads, 64 keys, 4 warps 2796 -> 1302 (with
    # f16), 8 warps 1520 -> 750. GQA over fp8 gains nothing from it (cp-probe9, B 32, 1/4 of 8K /
    # 32K: 39.9 / 119.2 µs as installed, stage16 1 40.7 / 119.3, 2 49.5 / 154.1; without the register
    # cap 46.8 / 157.5 and 44.3 / 133.9): off there then. With whole tiles unmasked (even_fp8, below)
    # it gains (bench/debug/decode_gluon_gqa.py DGQA_SET=fp8-even, 2026-12-04, decode-gluon-gqa13-h200.json;
    # B 32, 1/4 of 8K / 32K / 128K): 33.7 / 100.2 / 375.2 µs -> 33.7 / 98.6 / 362.6 with stage16 1
    # (3 stages 33.7 / 100.8 / 374.6; 64-key tiles over 396-528 programs 51-52 / 154-172 / 579-631): on
    # (sm_90a, bench/debug/kernel_sass.py --only "even stage16": 923 instructions a tile, 164 registers,
    # no spill, 73 KB of shared memory: 3 CTAs per SM).
    # MLA's narrow tiles take it too (below)
    "stage16_fp8": 1,
    # even (GQA, one query token; 0/1 per cache dtype): a split's whole key tiles in a loop without
    # masks on the loads and the scores, its partial last tile, if any, after it with them (sm_90a
    # loop per tile: fp8 1522 -> 1353 instructions, bf16 448 -> 378 with 93 -> 128 registers).
    # bench/debug/decode_gluon_gqa.py (2026-12-04, decode-gluon-gqa12-h200.json; B 32, 1/4 of 8K /
    # 32K / 128K): fp8 33.5 / 102.3 / 387.6 µs -> 33.8 / 99.7 / 378 (B 4 at 32K: 19.8 -> 20.2): on;
    # bf16 39.0 / 129.1 -> 40.1 / 130.0 (the Gluon kernel serves bf16: 35.7 / 124.5): off
    "even": 0, "even_fp8": 1,
    # MLA with fp32 queries (exact products): 64 x 64 tiles in 3 stages would need 312 KB of shared
    # memory (sm_90a compile, bench/debug/kernel_sass.py); 32 x 32 in 2 stages needs 152 KB
    "block_n_wide_f32": 32, "block_m_wide_f32": 32, "num_stages_wide_f32": 2,
    "halves_wide_f32": 0, "tma_wide_f32": 0,     # (with them: 7.7 KB of spills)
    # kernel structure, 0/1 (the probe measures them): lazy_rescale keeps the running max unless it
    # grew by > 2^8 (acc is then not rescaled); halves_wide reads MLA's latent as two 256-wide halves
    # with two accumulators, tma_wide (with halves) loads each tile by TMA from device-side
    # descriptors. diag_wide: the probe's subtraction diagnostics (1 no softmax, 2 no P @ V, 3
    # scores only: not attention, never set otherwise)
    "lazy_rescale": 0, "lazy_rescale_wide": 0, "halves_wide": 1, "tma_wide": 1, "diag_wide": 0,
    # MLA over an fp8 cache
    "block_n_wide_fp8": 64, "num_warps_wide_fp8": 8, "num_stages_wide_fp8": 2, "lazy_rescale_wide_fp8": 0,
    "halves_wide_fp8": 1, "tma_wide_fp8": 0,
    # fp16 operands (as GQA's f16_fp8; in the halves kernel too): one conversion per fp8 pair
    # instead of fp8 -> fp16 -> bf16, with pointer loads (TMA off). Probe of 2026-12-03 night
    # (bench/results/cp-probe11-h200.json, step_time, B 32, 1/4 of 8K / 32K): 119.0 / 510.4 µs ->
    # 108.4 / 456.2, max error 7.5e-4 -> 7.6e-5; with TMA left on 172.9 / 728.2 (the fp16 weight
    # bookkeeping spills 1.6 KB there, sm_90a)
    "f16_wide_fp8": 1,
    # MLA with a query-head tile that is not full (fewer than block_m rows per kv head: 16 heads
    # under TP 8): the halves / TMA structure loses there (probe below), so it is off. The probe
    # does not sweep these two (its halves / tma rows of such problems then run this setting);
    # apply_tuning({"config": {...}}) sets them
    "halves_wide_narrow": 0, "tma_wide_narrow": 0,
    # its own launch settings and register cap (0: the compiler's) and fp16 operands over fp8
    # (probe family "mla_narrow"). 4 warps, from the family's probe (2026-12-03, bench/results/
    # cp-probe6-h200.json, CUDA-graph replays, 8 -> 4 warps): over fp8 64.0 -> 56.3 µs (8K) and
    # 199.5 -> 168.9 (32K), over bf16 47.0 -> 47.2 and 112.1 -> 109.2. A cap of 128 registers at 8
    # warps gave fp8 57.0 / 169.8 (bf16 46.8 / 109.7); fp16 operands alone 61.5 / 187.0
    "block_n_wide_narrow": 64, "num_warps_wide_narrow": 4, "num_stages_wide_narrow": 2, "maxnreg_wide_narrow": 0,
    # ... over fp8, at least this many warps where the narrow tile has more than 16 rows (a speculative
    # step's tokens x heads: 32 rows at 16 heads x 2 tokens). sm_90a builds (bench/debug/kernel_sass.py
    # --only "narrow fp8 as installed"): 4 warps spill 9320 B (32 registers: the allocation gave up), 8
    # warps 484 B with 255 registers. decode-narrow7-h200.json (16 heads x 2 tokens, 1/4 of 32K):
    # 2361 -> 425 µs. Over bf16 (4 warps: 255 registers + 12 B, 8: 175 and none) 8 warps ran slower,
    # 115 -> 169 µs: bf16 keeps num_warps_wide_narrow. The swapped Gluon kernel serves both on sm_90
    # (104 / 85 µs)
    "num_warps_wide_narrow_fp8_32": 8,
    # over an fp8 cache: fp16 operands, the latent tile staged as 16-bit (stage16) and 32-key tiles
    # (its own key tile: mla_narrow's block_n_fp8; f16 / stage16 leave bf16 caches as they are).
    # Probes of 2026-12-03 night (bench/results/cp-probe9-h200.json, cp-probe10-h200.json; step_time,
    # B 32, 1/4 of 8K / 32K): 54.4 / 165.0 and 55.0 / 163.1 µs -> 46.7 / 128.1 and 46.5 / 127.6;
    # f16 alone 52.5 / 150.3, f16 + 32 keys 51.6 / 150.7, stage16 + f16 at 64 keys 60.2 / 177.4
    # (123 KB of shared memory: one CTA per SM), at 16 keys 61.9 / 189.7; a register cap of 168 /
    # 128 on the winner 62.6 / 185.6 and 83.4 / 256.4
    "f16_wide_narrow": 1, "stage16_wide_narrow": 1, "block_n_wide_narrow_fp8": 32,
    # and splits 4x finer: its grid is B x 1 head tile per split (B = 32 at 1/4 of 8K, 2048 local
    # tokens: 2 splits = 64 programs under min_split 1024, half the SMs idle; 8 = 256 under 256),
    # where a full 128-head problem has 2 head tiles and is compute-bound per tile
    "min_split_wide_narrow": 256,
    # and never more programs than target_programs (splits rounded down, not up): 16 heads at 1/4
    # of 32K (B = 32, 8192 local tokens) took 126.0 µs in 9 splits (288 programs: a third partial
    # wave at its occupancy) against 110.5 in 8 (bench cp, 2026-12-03, two runs). Both together
    # (bench/results/cp-decode-h200.md at commit 55800dc, against the run before, 16 heads bf16 at 8K / 32K / 128K):
    # 74.4 / 110.5 / 501.5 -> 47.2 / 110.0 / 349.4 µs; over fp8 86.8 / 207.1 / 889.9 -> 64.8 /
    # 203.1 / 680.5
    "at_most_wide_narrow": 1,
    # splits rounded down to target_programs for full MLA head tiles too (bf16 / fp8 caches): 1/4
    # of 32K over fp8 took 510.4 µs in 5 splits (320 programs of one CTA per SM: a partial third
    # wave) against 421.2 with min_split 2048 (4 splits; cp-probe11). Probe 12 (bench/results/
    # cp-probe12-h200.json, B 32, 1/4 of 8K / 32K): bf16 86.3 / 347.7 -> 86.0 / 286.4 µs, fp8 (fp16
    # operands) 108.2 / 460.5 -> 109.4 / 378.5 (8K keeps its 2 splits); with MLA's own
    # target_programs (below) 86.4 / 267.1
    "at_most_wide": 1, "at_most_wide_fp8": 1,
    # target_programs of full MLA head tiles (it was one value for every problem): 132 with
    # at_most, one wave of one CTA per SM (cp-probe12, bf16, 1/4 of 8K / 32K: 86.0 / 286.4 µs at
    # 264 -> 86.4 / 267.1; cp-probe13 with it installed: 264 86.0 / 286.9 against 86.7 / 268.8),
    # fp8 (cp-probe13) 108.5 / 382.2 -> 108.5 / 362.6. MLA's narrow tiles keep theirs
    "target_programs_wide": 132, "target_programs_wide_fp8": 132, "target_programs_wide_narrow": 264,
    # MLA with more than 32 query columns (tokens x heads) through the swapped narrow kernels in head
    # tiles of 32 columns (`gluon_mla_narrow.head_tiles`: a sequence's tiles side by side in the grid,
    # its keys read from L2 by all but the first), per cache dtype (bf16 / fp8): 0 never, 1 where the
    # full-head-tile Gluon kernels do not apply (a speculative step's tokens: 128 heads x 2, 16 x 3;
    # the Triton kernel otherwise), 2 wherever there are more than 32 columns. bench/debug/
    # decode_tiles.py (H100, 2026-12-05 21:23, bench/results/logs/decode-tiles-h100.json; fp8, B 32,
    # 1/4 of L): 16 heads x 3 tokens at 32K, Triton 454.4 / 453.7 µs -> tiles 140.4 / 136.4; 128
    # heads x 2 tokens 664.8 / 667.2 -> 510.9 / 512.3; one token (2) slower than the converter's
    # kernel: 128 heads at 8K / 32K / 128K 70.1 / 212.3 / 776.3 -> 69.5 / 251.2 / 994.4, 64 heads at
    # 32K 115.5 -> 134.9. Splits planned to at most target_programs_tiles programs (132: one wave of
    # one CTA per SM; 264 lost everywhere but a tie at 128 x 2), over fp8 direct_tiles_fp8 raw
    # stages of 64 keys (3 and 5 within 1-2%; at most 5 fit beside 32 columns' queries). bench cp
    # (H100, 21:31, bench/results/cp-h100.md, untiled_us the Triton kernel), 1/4 of 32K: bf16 16 x 3
    # 364.1 -> 125.5 µs, 128 x 2 524.2 -> 422.5; fp8 16 x 3 454.1 -> 139.6, 128 x 2 661.8 -> 503.9
    "tiles_wide": 1, "tiles_wide_fp8": 1, "target_programs_tiles": 132, "direct_tiles_fp8": 3,
    # the tiles' columns (16 or 32; over fp8 at 16 the scores go in tile pairs, pipe_wide_narrow_fp8).
    # bench/debug/decode_tiles.py (H100, 2026-12-05 21:40, logs/decode-tiles2-h100.json, B 32, 1/4 of
    # 32K): 16 columns slower everywhere, bf16 16 x 3 122.8-123.6 µs at 32 against 172.5-175.0, fp8
    # 138.9-139.4 against 163.7-179.4; 128 x 2 bf16 422.5-436.6 / 647.3-651.5, fp8 506.9-507.4 /
    # 654.3-687.9
    "tile_columns": 32, "tile_columns_fp8": 32,
    # a speculative step over full 64-head tiles (128 heads: TP 1 / DP attention) as one-token decodes
    # through the full-head-tile kernels (`_expanded`; per cache dtype), before the head tiles: at one
    # token those kernels beat the tiles (bf16 128 heads at 32K 150.4-151.5 µs against 212.9-218.4).
    # bench/debug/decode_tiles.py (H100, 2026-12-06 00:32, logs/decode-tiles3-h100.json, B 32, 1/4 of L,
    # two runs each), expanded against the installed 32-column tiles: bf16 128 x 2 at 8K 74.8-75.0 µs
    # against 118.1-118.7, at 32K 291.5-306.8 / 429.5-434.2, 128 x 4 at 32K 557.9-580.3 / 841.1-871.8,
    # 64 x 3 at 32K 257.2-257.4 / 426.3-429.0; fp8 128 x 2 at 8K 110.9-114.3 / 138.0-142.4, at 32K
    # 397.4-400.3 / 509.9-510.4, 64 x 3 at 32K 387.0-390.3 / 537.9-542.4; bench cp (00:30,
    # bench/results/cp-h100.md) 128 x 2 at 32K bf16 423.0 -> 291.0, fp8 507.8 -> 393.4
    "expand_wide": 1, "expand_wide_fp8": 1,
    # the split partials (a call of several splits) in the query's 16-bit dtype instead of fp32: half
    # the bytes written by the kernel and read back by the merge (MLA 128 heads at 1/4 of 8K: 2 x 32 x
    # 128 x 512 partials, 16.8 MB in fp32), at the cost of one more rounding of each split's normalized
    # output (relative 2^-9 in bf16) before the fp32 merge. FlashMLA and FlashAttention keep fp32.
    # Measured off (bench cp, H100, 2026-12-06 00:30, bench/results/cp-h100.md, column
    # half_partials_us, since removed): slower on the 128-head rows, whose fixed part grew by ~2 µs
    # (the full-tile kernels' epilogue issues as many stores, b32 pairs of bf16 for v2.b32 pairs of
    # fp32: bf16 1/4 of 8K / 32K 53.1 -> 55.5 / 153.7 -> 159.5 µs, fp8 70.1 -> 71.8 / 212.7 -> 215.6),
    # 0.5-2.3 µs faster on every 16-head row (8K bf16 35.7 -> 34.9, fp8 25.8 -> 24.9; DCP at N = 8 fp8
    # 40.2 -> 39.2): not worth a second rounding
    "half_partials": 0,
})
# H200, B = 32, 1/4 of L = 8K and 32K (`python -m megapar.launch.bench.cp --probe`, CUDA-graph
# replays, two runs: bench/results/cp-probe-h200.json, cp-probe2-h200.json): MLA with 64-token
# tiles and 3 stages 272 -> 192 µs and 937 -> 604 µs (was 32 / 2), then 64 query heads per tile
# (wgmma; min_split 512) 191 -> 139 and 604 -> 436 µs; GQA over fp8 with 128 / 3 stages 73 -> 63
# and 203 -> 160 µs, where GQA bf16 keeps 64 / 2 (157 µs against 187 with 128 / 3).
# Third probe (2026-12-01, bench/results/cp-probe3-h200.json; the µs of each setting and of the
# previous CONFIG come from the same run): MLA 128 heads bf16, 2 stages + latent halves + TMA
# tiles 138.8 -> 124.1 µs (8K) and 433.4 -> 372.1 µs (32K); at 16 heads (TP 8) the same options
# cost 144.7 -> 178.9 µs, so they stay off for heads tiles that are not full ("narrow"), where
# min_split 1024 gives 128.9. min_split 1024 also: MLA 8K 138.8 -> 120.0 (2 splits instead of
# 4), GQA 65.5 -> 62.8 / 151.6 -> 150.3. MLA over fp8 with 64 heads per tile (2 stages; the
# 3-stage build spilled) and halves + TMA: 238.9 -> 160.9 µs (8K) and 810.0 -> 531.2 µs (32K);
# at 16 heads 244.2 (previous) against 246.6 (64 / 2 stages, narrow: no halves). Lazy rescale
# gained <= 3% and raised the max error 4-5x (6e-4 -> 2.7e-3): off.
# Fourth probe (2026-12-02, bench/results/cp-probe4-h200.json, same command): GQA over fp8 with
# fp16 operands, 168 registers and 2 stages 62.4 -> 55.8 µs (8K) and 159.7 -> 124.6 µs (32K),
# max error 4.0e-4 -> 3.1e-5 and 1.6e-4 -> 1.5e-5 (fp16 weights hold 3 more bits than bf16);
# without the cap 54.1 and 176.2 (2 CTAs per SM at 32K), 160 registers 56.8 and 123.7.
# GQA bf16 with 3 stages instead of 2: 65.4 -> 60.2 / 149.0 -> 149.6 µs (probe 4) and, after the
# local lengths moved into the kernel, 50.2 -> 48.1 / 136.2 -> 135.4 (bench/results/
# cp-probe5-h200.json); both probes pick it.
# min_split per family (it was one key for all four). GQA takes 512 from probe 5 (bf16, 8K, 1/4:
# 2048 local tokens, 3 splits instead of 2): at 2 stages 1024 -> 512 gave 50.2 (repeats 52.1,
# 53.1) -> 46.4 µs (128: 46.35), against 48.1 for the installed 3 stages at 1024; 3 stages with
# 512 was not timed at target_programs 264 (at 528, 4 splits: 47.6). At 32K: 3 splits either
# way (135.4 µs). MLA keeps 1024 (probe 3: 138.8 -> 120.0 µs at 8K against 512). GQA over fp8
# takes 512 too without a measurement of its own (same grid: B x Hkv = 128 programs per split;
# probes 3 / 4 ran it at 512 / 1024 but with other kernels), MLA over fp8 keeps 1024. These
# 512s came from probe 5; `megapar bench cp` on 2026-12-03 (cp-dcp-h200.md of commit ba3cff7) has GQA
# bf16 at 8K, 1/4 of the KV, at 45.3 µs against 49.6 on 2026-12-02 (cross-run). Its dcp section
# runs L = 32K, where 1/8 of the KV (4096 tokens) gets 3 splits under 512 and 1024 alike: the
# change moves GQA only where a sequence holds < 3 x 1024 tokens here (1/4 of 8K: 2 -> 3 splits;
# 1/8 of 8K: 1 -> 2). The probe sweeps every family's min_split.
"""Launch parameters. `python -m megapar.launch.bench.cp --probe --out DIR` sweeps them on the GPU
(CUDA-graph replays) and writes DIR/decode-tuning.json for `apply_tuning` (or
MEGAPAR_DECODE_TUNING=path at import)."""

# the tuning file's per-problem keys: GQA's go to CONFIG as they are, MLA's (key dim > 256) to the
# *_wide keys where CONFIG has one; the others are shared by both problems
_WIDE = {"block_n": "block_n_wide", "block_m": "block_m_wide", "num_warps": "num_warps_wide",
         "num_stages": "num_stages_wide", "lazy_rescale": "lazy_rescale_wide", "halves": "halves_wide",
         "tma": "tma_wide", "diag": "diag_wide", "min_split": "min_split_wide", "at_most": "at_most_wide",
         "target_programs": "target_programs_wide"}
# kernel options (0/1; diag 0-3; maxnreg 0 = the compiler's choice, else a register cap), launch_settings
_STRUCTURE = ("lazy_rescale", "halves", "tma", "diag", "f16", "maxnreg", "stage16", "even")
_FP8 = {"block_n": "block_n_fp8", "num_stages": "num_stages_fp8", "f16": "f16_fp8",
        "maxnreg": "maxnreg_fp8", "min_split": "min_split_fp8", "tma": "tma_fp8",
        "stage16": "stage16_fp8", "num_warps": "num_warps_fp8", "even": "even_fp8",
        "target_programs": "target_programs_fp8"}                                 # GQA over an fp8 cache
_WIDE_FP8 = {k: f"{k}_wide_fp8" for k in ("block_m", "block_n", "num_warps", "num_stages", "lazy_rescale", "halves",
                                          "tma", "min_split", "f16", "at_most", "target_programs")}   # MLA, fp8 cache
_WIDE_FP8["gluon_wide"] = "gluon_wide_fp8"
# MLA with a query-head tile that is not full (16 heads under TP 8), bf16 and fp8 caches
_WIDE_NARROW = {k: f"{k}_wide_narrow" for k in ("block_n", "num_warps", "num_stages", "min_split", "at_most", "halves",
                                              "tma", "f16", "maxnreg", "stage16")}
_WIDE_NARROW["block_n_fp8"] = "block_n_wide_narrow_fp8"    # (its key tile over an fp8 cache)
_WIDE_NARROW["gluon_wide"] = "gluon_wide_narrow"            # (bf16: the Gluon kernel for these tiles)
# tuning-file family -> (its keys' CONFIG names, whether only those keys are allowed)
_FAMILIES = {"gqa": ({}, False), "gqa_fp8": (_FP8, True), "mla": (_WIDE, False), "mla_fp8": (_WIDE_FP8, True),
             "mla_narrow": (_WIDE_NARROW, True)}
# min_split was one key for every problem before it became per family: a file's gqa / mla value
# also serves gqa_fp8 / mla_fp8 unless the file gives those their own (older files keep their meaning)
_FP8_OF = {"gqa": "gqa_fp8", "mla": "mla_fp8"}
_VALID = {
    "target_programs": range(1, 1 << 16), "min_split": range(1, 1 << 24),
    "block_n": (16, 32, 64, 128, 256), "block_m": (16, 32, 64, 128, 256), "block_n_fp8": (16, 32, 64, 128, 256),
    "num_warps": (1, 2, 4, 8, 16), "num_stages": (1, 2, 3, 4, 5, 6),
    "lazy_rescale": (0, 1), "pdl": (0, 1), "dcp_constexpr": (0, 1), "halves": (0, 1), "tma": (0, 1),
    "diag": (0, 1, 2, 3), "f16": (0, 1),
    "gluon_wide": (0, 1), "gluon_wide_fp8": (0, 1), "gluon_wide_narrow": (0, 1), "gluon_wide_narrow_fp8": (0, 1),
    "seesaw_wide": (0, 1), "split_wide": (0, 1), "runs_wide": (0, 1), "runs_overhead_wide": range(0, 65),
    "runs_choose_wide": (0, 1),
    "gluon_gqa": (0, 1), "gluon_gqa_fp8": (0, 1), "stages": range(2, 7),
    "swap": (0, 1), "raw_ring": (0, 1, 2, 3, 4), "keys": (32, 64), "ring": (1, 2, 3),
    "maxnreg": (0, *range(64, 256, 8)), "at_most": (0, 1), "stage16": (0, 1, 2), "even": (0, 1),
    "direct": range(0, 13), "pipe": (0, 1), "paired_store": (0, 1), "values8": (0, 1), "ids_ahead": (0, 1),
    "one_max": (0, 1),
    "tiles": (0, 1, 2),
    "tile_columns": (16, 32), "expand": (0, 1), "half_partials": (0, 1), "plan_waves": range(1, 9),
    "plan_fit": (0, 1), "plan_fit_wide": (0, 1), "plan_fit_wide_narrow": (0, 1), "plan_order": (0, 1),
}
_META = ("device", "sizes", "seconds", "results", "notes", "problems")


def _valid_value(key: str, value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in _VALID[key]


def apply_tuning(tuning: dict) -> None:
    """Install measured launch settings {"gqa": {key: value}, "mla": {key: value}, ...} (as written
    by `python -m megapar.launch.bench.cp --probe --out DIR` to DIR/decode-tuning.json).
    - "gqa": block_n, block_m, num_warps, num_stages, target_programs, min_split, lazy_rescale, tma.
    - "gqa_fp8" (GQA over an fp8 cache, CONFIG's *_fp8 entries): block_n, num_warps, num_stages,
      target_programs, f16, maxnreg, stage16, min_split, tma, even.
    - "mla": the gqa keys plus halves / tma / diag / at_most, to CONFIG's *_wide entries
      (target_programs too since 2026-12-03 night: it reaches full MLA head tiles only).
    - "mla_fp8": MLA over an fp8 cache, CONFIG's *_wide_fp8 entries.
    - "mla_narrow": MLA with fewer query heads than a head tile (16 under TP 8), bf16 and fp8
      caches: block_n, num_warps, num_stages, min_split, at_most (splits rounded down), halves,
      tma, f16, maxnreg, stage16, block_n_fp8, CONFIG's *_wide_narrow entries (since 2026-12-03 a
      file's mla entry no longer reaches those tiles).
    min_split is per family; a gqa / mla min_split also sets gqa_fp8's / mla_fp8's unless the file
    gives those (files from before it was per family, with one shared value, keep their meaning).
    {"config": {CONFIG key: value}} sets entries directly.
    Nothing is installed unless all of it is valid: ValueError naming the bad keys or values."""
    if not isinstance(tuning, dict):
        raise ValueError(f"decode tuning must be a dict, got {type(tuning).__name__}")
    bad = [k for k in tuning if k not in (*_FAMILIES, "config") + _META]
    if bad:
        raise ValueError(f"unknown decode tuning entries {bad}; valid: {', '.join(_FAMILIES)}, config")
    new: dict[str, int] = {}
    for kind, (names, only) in _FAMILIES.items():
        part = tuning.get(kind, {})
        if not isinstance(part, dict):
            raise ValueError(f"decode tuning {kind!r} must be a dict of settings, got {part!r}")
        for key, value in part.items():
            keys = names if only else _VALID
            if kind == "gqa" and key in ("halves", "diag", "gluon_wide"):
                raise ValueError(f"decode tuning gqa.{key}: an MLA-only option (the latent head's layout); "
                                 f"give it under 'mla'")
            if kind in ("gqa", "mla") and key == "block_n_fp8":
                raise ValueError(f"decode tuning {kind}.block_n_fp8: the key tile of MLA's narrow tiles over fp8; "
                                 f"give it under 'mla_narrow'")
            if kind in ("gqa", "mla") and key in ("f16", "maxnreg", "stage16"):
                raise ValueError(f"decode tuning {kind}.{key}: an fp8-cache option; give it under 'gqa_fp8' "
                                 f"(or 'mla_narrow')")
            if key not in keys:
                raise ValueError(f"unknown decode tuning key {kind}.{key}; valid: {', '.join(keys)}")
            if not _valid_value(key, value):
                raise ValueError(f"decode tuning {kind}.{key} = {value!r} is invalid; valid: {_describe(key)}")
            name = names.get(key, key)
            if name not in CONFIG:      # (a setting of another family, or a {"config": ...} entry only)
                raise ValueError(f"decode tuning {kind}.{key}: no such setting for {kind} (CONFIG has no {name!r}); "
                                 f"set CONFIG entries directly under 'config'")
            if name in new and new[name] != value:
                raise ValueError(f"decode tuning: the shared key {key} differs between gqa ({new[name]}) and "
                                 f"mla ({value}); one value serves both (only {', '.join(_WIDE)} have *_wide "
                                 f"entries)")
            new[name] = value
    for kind, fp8_kind in _FP8_OF.items():
        if "min_split" in tuning.get(kind, {}) and "min_split" not in tuning.get(fp8_kind, {}):
            new[_FAMILIES[fp8_kind][0]["min_split"]] = tuning[kind]["min_split"]
    config = tuning.get("config", {})
    if not isinstance(config, dict):
        raise ValueError(f"decode tuning 'config' must be a dict of CONFIG entries, got {config!r}")
    for name, value in config.items():
        base = next((k for k in _VALID if name == k or name.startswith(k + "_")), name)
        if name not in CONFIG:
            raise ValueError(f"unknown decode CONFIG key {name!r}; valid: {', '.join(CONFIG)}")
        if not _valid_value(base, value):
            raise ValueError(f"decode CONFIG {name} = {value!r} is invalid; valid: {_describe(base)}")
        new[name] = value
    CONFIG.update(new)


def _describe(key: str) -> str:
    valid = _VALID[key]
    return f"an int in [{valid.start}, {valid.stop - 1}]" if isinstance(valid, range) else ", ".join(map(str, valid))


def _load_env_tuning() -> None:
    import json
    import os

    path = os.environ.get("MEGAPAR_DECODE_TUNING")
    if path:
        with open(path) as f:
            apply_tuning(json.load(f))


_load_env_tuning()


def _split_dims(d: int) -> tuple[int, int, int]:
    """Key dim -> (power-of-two main part, rest, padded rest): 128 -> (128, 0, 0), 576 -> (512, 64, 64)."""
    main = 1 << (d.bit_length() - 1)
    rest = d - main
    return main, rest, (max(16, triton.next_power_of_2(rest)) if rest else 0)


def plan_splits(capacity: int, programs: int, block_n: int, min_split: int, at_most: bool = False,
                target: int | None = None) -> tuple[int, int]:
    """(num_splits, split_len) for `capacity` tokens per sequence, `programs` programs per split
    and splits of at least `min_split` tokens (the family's, `launch_settings`): enough splits to
    reach target_programs programs, or with `at_most` as many as stay within it."""
    capacity = max(capacity, 1)
    target, programs = target or CONFIG["target_programs"], max(programs, 1)
    want = max(1, target // programs if at_most else -(-target // programs))
    most = max(1, -(-capacity // max(min_split, 1)))
    splits = min(want, most)
    split_len = -(-(-(-capacity // splits)) // block_n) * block_n
    return -(-capacity // split_len), split_len


PLAN_CLASSES = 8
"""The length classes a plan with CONFIG plan_order 1 sorts its partial items into (`_plan_kernel`)."""


@dataclass(frozen=True)
class LengthPlan:
    """A split-KV plan made on the device from the sequences' lengths (`plan_by_lengths`; the public
    maker is `paged.plan_paged_decode`): each sequence's local tokens are cut into splits of one
    length `chunk` (a device value made from the lengths and `items_target`: `_plan_kernel`), so a
    batch of very different lengths keeps every program busy, where the capacity's plan
    (`plan_splits`) gives every sequence the same number of splits and a few long sequences among
    short ones run on a few programs. Capturable: one launch, nothing read on the host.

    items_table: int32 [2 + 3 x items]: chunk, 0, then per launch slot (the grid's split axis)
    (sequence, split, out row): the item's split of that sequence, stored at that row of the
    partials; items past the batch's own name an empty split (of sequence 0, past the table).
    segments: int32 [rows + 1]: row r's out rows are [segments[r], segments[r + 1]) (the launch
    order is another: CONFIG plan_order, `_plan_kernel`). items: the grid's splits, items_target + rows
    (a bound on the count: a row takes at most one split more than its share of the tokens). rows:
    the sequences (x Tq where a speculative step runs as one-token rows, `_expanded`). key: what it
    was planned for (the kernel's settings, the table's width, the cache's page, the DCP layout),
    checked by every call it is given to.
    """

    items_table: Tensor
    segments: Tensor
    items: int
    rows: int
    key: tuple

    def check(self, rows: int, key: tuple) -> None:
        if rows != self.rows or key != self.key:
            raise ValueError(f"this length plan was made for {self.rows} rows and {dict(self.key)}; the call has "
                             f"{rows} rows and {dict(key)}: make the plan for the call's shapes and layout "
                             f"(plan_paged_decode)")


def _plan_key(c: SimpleNamespace, table: Tensor, page: int, dcp_size: int, dcp_rank: int, interleave: int,
              expand: int) -> tuple:
    """A length plan's settings for the kernel `_choose` picked: its target of splits over the batch
    (the capacity plan's programs over a sequence's programs, rounded as there, times CONFIG
    plan_waves), the split unit (the kernel's key tile), the shortest split (its min_split) and the
    chunk's rule (CONFIG plan_fit; for MLA's latent head plan_fit_wide, over its narrow head tiles
    plan_fit_wide_narrow) and the launch order (CONFIG plan_order; `_plan_kernel`); runs: the programs of a
    token-run plan (`gluon_mla_runs.runs_plan`, CONFIG runs_wide) where the kernel takes one, else 0, and
    its overhead (CONFIG runs_overhead_wide) and whether it chooses its charge (runs_choose_wide)."""
    target, programs = c.cfg["target_programs"], max(c.row_programs, 1)
    items = max(1, target // programs if c.cfg["at_most"] else -(-target // programs)) * CONFIG["plan_waves"]
    unit = c.block_n
    min_chunk = -(-max(c.cfg["min_split"], 1) // unit) * unit
    fit = CONFIG["plan_fit" if c.d_main + c.d_rest <= 256 else "plan_fit_wide_narrow" if c.swapped else
                 "plan_fit_wide"]
    return (("items_target", items), ("unit", unit), ("min_chunk", min_chunk), ("fit", fit),
            ("table_blocks", table.shape[1]), ("page", page), ("dcp", (dcp_size, dcp_rank, interleave)),
            ("expand", expand), ("order", CONFIG["plan_order"]), ("runs", c.runs),
            ("runs_overhead", CONFIG["runs_overhead_wide"] if c.runs else 0),
            ("runs_choose", CONFIG["runs_choose_wide"] if c.runs else 0))


@triton.jit
def _plan_lengths(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, TQ: tl.constexpr):
    """Rows r's local lengths for the plan: row r is token r % TQ of sequence r // TQ (TQ > 1: a
    speculative step run as one-token rows, `_expanded`'s lengths); 0 where the row is masked, its
    length negative or its local share past the table (the kernel reports those: NaN)."""
    return _plan_bad_lengths(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, TQ)[0]


@triton.jit
def _plan_bad_lengths(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, TQ: tl.constexpr):
    """(`_plan_lengths`, the rows whose length is negative or past the table)."""
    g = tl.load(glens_ptr + r // TQ, mask=rmask, other=0).to(tl.int64)
    if TQ > 1:
        g = tl.where(g < 0, g, tl.maximum(g - (TQ - 1) + r % TQ, 0))
    n = _local_of(g, dcp_size, dcp_rank, interleave)
    bad = rmask & ((g < 0) | (n > cap))
    return tl.where(rmask & ~bad, n, 0), bad


@triton.jit
def _runs_share(glens_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, charge, TQ: tl.constexpr,
                BLOCK: tl.constexpr):
    """The units of the token-run stream a program takes (`gluon_mla_runs._share`): the stream's units at
    `charge` a row with a tile, over P, rounded up, at least 1."""
    total = tl.zeros([], tl.int64)
    r0 = 0
    while r0 < R:
        r = r0 + tl.arange(0, BLOCK)
        n = _plan_lengths(glens_ptr, r, r < R, cap, dcp_size, dcp_rank, interleave, TQ).to(tl.int64)
        tiles = (n + UNIT - 1) // UNIT
        total += tl.sum(tl.where(tiles > 0, tiles + charge, 0), 0)
        r0 += BLOCK
    return tl.maximum((total + P - 1) // P, 1)


@triton.jit
def _runs_rows(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, UNIT, charge, base, TQ: tl.constexpr):
    """Rows r of the token-run stream (`gluon_mla_runs._stream`), the stream's units before them `base`:
    (local length, bad, tiles, units, first tile's place in the stream, its end)."""
    n, bad = _plan_bad_lengths(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, TQ)
    n = n.to(tl.int64)
    tiles = (n + UNIT - 1) // UNIT
    units = tl.where(tiles > 0, tiles + charge, 0)
    starts = base + tl.cumsum(units, 0) - units + tl.where(tiles > 0, charge, 0)
    return n, bad, tiles, units, starts, starts + tiles


@triton.jit
def _runs_span(glens_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, charge, cost, TQ: tl.constexpr,
               BLOCK: tl.constexpr, BLOCK_P: tl.constexpr):
    """`gluon_mla_runs.runs_makespan` in one program: a program's share of the stream at `charge` a row,
    then per block of rows their tiles' overlap with each program's share, summed per program as tiles
    and segments; the largest tiles + cost x segments."""
    per = _runs_share(glens_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, charge, TQ, BLOCK)
    lo = tl.arange(0, BLOCK_P).to(tl.int64) * per
    got = tl.zeros([BLOCK_P], tl.int64)
    base = tl.zeros([], tl.int64)
    r0 = 0
    while r0 < R:
        r = r0 + tl.arange(0, BLOCK)
        _, _, _, units, starts, ends = _runs_rows(glens_ptr, r, r < R, cap, dcp_size, dcp_rank, interleave, UNIT,
                                                  charge, base, TQ)
        over = tl.minimum(ends[:, None], lo[None, :] + per) - tl.maximum(starts[:, None], lo[None, :])
        over = tl.maximum(over, 0)
        got += tl.sum(over, 0) + cost * tl.sum((over > 0).to(tl.int64), 0)
        base += tl.sum(units, 0)
        r0 += BLOCK
    return tl.max(tl.where(tl.arange(0, BLOCK_P) < P, got, 0), 0)


@triton.jit
def _runs_plan_kernel(glens_ptr, table_ptr, seg_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, OVERHEAD,
                      TQ: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, CHOOSE: tl.constexpr = False,
                      C0: tl.constexpr = 0, C1: tl.constexpr = 2, C2: tl.constexpr = 5, C3: tl.constexpr = 8):
    """(one program) `gluon_mla_runs.runs_plan`'s tables from the global lengths: pass 1 the stream's
    units (a row with a tile: OVERHEAD + its tiles), pass 2 per block of rows their first tile in the
    stream, their programs' range, segment counts and segments, and the programs' starts as
    lo[q] = sum over rows of clamp(q - first_r, 0, count_r) (the segments before program q). CHOOSE: the
    charge a row is instead the one of C0..C3 (`gluon_mla_runs.RUNS_CHARGES`) whose plan costs least with
    a segment costing OVERHEAD tiles (`_runs_span`; the first of equal ones)."""
    if CHOOSE:
        charge = tl.full([], C0, tl.int64)
        best = _runs_span(glens_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, charge, OVERHEAD, TQ, BLOCK,
                          BLOCK_P)
        for j in tl.static_range(3):
            f = tl.full([], C1 if j == 0 else C2 if j == 1 else C3, tl.int64)
            span = _runs_span(glens_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, f, OVERHEAD, TQ, BLOCK,
                              BLOCK_P)
            charge = tl.where(span < best, f, charge)
            best = tl.minimum(span, best)
        OVERHEAD = charge
    per = _runs_share(glens_ptr, R, P, cap, dcp_size, dcp_rank, interleave, UNIT, OVERHEAD, TQ, BLOCK)
    q = tl.arange(0, BLOCK_P)
    lo = tl.zeros([BLOCK_P], tl.int32)
    base_u = tl.zeros([], tl.int64)
    base_s = tl.zeros([], tl.int64)
    r0 = 0
    while r0 < R:
        r = r0 + tl.arange(0, BLOCK)
        rmask = r < R
        n, bad, tiles, units, starts, ends = _runs_rows(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, UNIT,
                                                        OVERHEAD, base_u, TQ)
        first = tl.minimum(starts // per, P - 1)
        last = tl.where(tiles > 0, (ends - 1) // per, first)
        count = tl.where(tiles > 0, last - first + 1, bad.to(tl.int64))
        seg_first = base_s + tl.cumsum(count, 0) - count
        tl.store(seg_ptr + r, seg_first.to(tl.int32), mask=rmask)
        lo += tl.sum(tl.minimum(tl.maximum(q[None, :] - first.to(tl.int32)[:, None], 0),
                                count.to(tl.int32)[:, None]), 0)
        most = tl.max(count, 0)
        i = 0
        while i < most:
            m = rmask & (i < count)
            prog = first + i
            t0 = tl.maximum(starts, prog * per) - starts
            t1 = tl.minimum(ends, (prog + 1) * per) - starts
            start = tl.where(tiles > 0, t0 * UNIT, 0)
            end = tl.where(tiles > 0, tl.minimum(t1 * UNIT, n), 0)
            slot = table_ptr + P + 1 + 3 * (seg_first + i)
            tl.store(slot, r, mask=m)
            tl.store(slot + 1, start.to(tl.int32), mask=m)
            tl.store(slot + 2, end.to(tl.int32), mask=m)
            i += 1
        base_u += tl.sum(units, 0)
        base_s += tl.sum(count, 0)
        r0 += BLOCK
    tl.store(table_ptr + q, lo, mask=q <= P)
    tl.store(seg_ptr + R, base_s.to(tl.int32))
    k0 = base_s
    while k0 < P + R:       # (the slots past the segments: sequence 0's empty range, never read)
        k = k0 + tl.arange(0, BLOCK)
        for c in tl.static_range(3):
            tl.store(table_ptr + P + 1 + 3 * k + c, tl.zeros_like(k).to(tl.int32), mask=k < P + R)
        k0 += BLOCK


@triton.jit
def _plan_count(glens_ptr, R, chunk, cap, dcp_size, dcp_rank, interleave, TQ: tl.constexpr, BLOCK: tl.constexpr):
    """The items the rows take with splits of `chunk` tokens: sum of max(ceil(n_r / chunk), 1)."""
    count = tl.zeros([], tl.int32)
    r0 = 0
    while r0 < R:
        r, rmask, n, items = _plan_rows(glens_ptr, r0, R, chunk, cap, dcp_size, dcp_rank, interleave, TQ, BLOCK)
        count += tl.sum(items, 0)
        r0 += BLOCK
    return count


@triton.jit
def _plan_kernel(glens_ptr, items_ptr, seg_ptr, R, V, ITEMS, UNIT, MIN_CHUNK, cap, dcp_size, dcp_rank, interleave,
                 TQ: tl.constexpr, BLOCK: tl.constexpr, FIT: tl.constexpr, ORDER: tl.constexpr, NB: tl.constexpr):
    """(one program) `LengthPlan`'s tables. The chunk: FIT, the shortest multiple of UNIT, at least
    MIN_CHUNK, with which the rows take at most ITEMS items (a binary search: the count only falls as
    the chunk grows), or one item a row where even the longest row's length does not get there; else
    the rows' local tokens over ITEMS, up to a multiple of UNIT, at least MIN_CHUNK. Row r takes
    max(ceil(n_r / chunk), 1) items (one for an empty or bad row: its partial carries the row's lse
    -inf or NaN), whose out rows are row r's segment [first_r, first_r + count_r) in row order; the
    items past them name split ceil(cap / chunk) of row 0, which starts past the table (empty). The
    launch order (the table's slots; a grid runs its CTAs about in that order): ORDER 0 the out
    rows'; ORDER 1 every row's full chunks first, then the rows' last, partial items longest first
    (in NB classes of chunk / NB), so that the short items fill in behind the long ones (a greedy
    longest-first schedule, where in row order a long row's items may start last)."""
    longest = tl.zeros([], tl.int32)
    total = tl.zeros([], tl.int64)
    r0 = 0
    while r0 < R:
        r = r0 + tl.arange(0, BLOCK)
        n = _plan_lengths(glens_ptr, r, r < R, cap, dcp_size, dcp_rank, interleave, TQ)
        longest = tl.maximum(longest, tl.max(n, 0))
        total += tl.sum(n.to(tl.int64), 0)
        r0 += BLOCK
    if FIT:
        lo = tl.zeros([], tl.int32) + MIN_CHUNK // UNIT
        hi = tl.maximum((longest + UNIT - 1) // UNIT, lo)
        while lo < hi:
            mid = (lo + hi) // 2
            fits = _plan_count(glens_ptr, R, mid * UNIT, cap, dcp_size, dcp_rank, interleave, TQ, BLOCK) <= ITEMS
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid + 1)
        chunk = lo * UNIT
    else:
        chunk = (((total + ITEMS - 1) // ITEMS + UNIT - 1) // UNIT) * UNIT
        chunk = tl.maximum(chunk, MIN_CHUNK).to(tl.int32)
    tl.store(items_ptr, chunk)
    tl.store(items_ptr + 1, 0)
    # pass 1: the segments (row r's out rows [first, first + count)) and the items that launch first:
    # all of a row's (ORDER 0), or its full chunks (ORDER 1), in row order
    base = tl.zeros([], tl.int32)
    lead = tl.zeros([], tl.int32)
    r0 = 0
    while r0 < R:
        r, rmask, n, count = _plan_rows(glens_ptr, r0, R, chunk, cap, dcp_size, dcp_rank, interleave, TQ, BLOCK)
        first = base + tl.cumsum(count, 0) - count
        tl.store(seg_ptr + r, first, mask=rmask)
        if ORDER:
            early = tl.where(rmask, n // chunk, 0)
        else:
            early = count
        slot = lead + tl.cumsum(early, 0) - early
        most = tl.max(early, 0)
        k = 0
        while k < most:
            _plan_store(items_ptr, slot + k, r, tl.zeros_like(r) + k, first + k, rmask & (k < early))
            k += 1
        base += tl.sum(count, 0)
        lead += tl.sum(early, 0)
        r0 += BLOCK
    tl.store(seg_ptr + R, base)
    if ORDER:   # pass 2: the rows' last, partial items (an empty row's one), longest first in NB classes
        b = NB - 1
        while b >= 0:
            r0 = 0
            while r0 < R:
                r, rmask, n, count = _plan_rows(glens_ptr, r0, R, chunk, cap, dcp_size, dcp_rank, interleave, TQ,
                                                BLOCK)
                first = tl.load(seg_ptr + r, mask=rmask, other=0)
                full = n // chunk
                part = rmask & (count > full) & ((n - full * chunk) * NB // chunk == b)
                take = part.to(tl.int32)
                slot = lead + tl.cumsum(take, 0) - take
                _plan_store(items_ptr, slot, r, full, first + full, part)
                lead += tl.sum(take, 0)
                r0 += BLOCK
            b -= 1
    empty = (cap + chunk - 1) // chunk
    v0 = base
    while v0 < V:
        v = v0 + tl.arange(0, BLOCK)
        _plan_store(items_ptr, v, tl.zeros_like(v), tl.zeros_like(v) + empty, v, v < V)
        v0 += BLOCK


@triton.jit
def _plan_rows(glens_ptr, r0, R, chunk, cap, dcp_size, dcp_rank, interleave, TQ: tl.constexpr,
               BLOCK: tl.constexpr):
    """The planner's rows [r0, r0 + BLOCK): (r, r < R, their local lengths, their item counts with
    splits of `chunk` tokens: max(ceil(n / chunk), 1), 0 past R)."""
    r = r0 + tl.arange(0, BLOCK)
    rmask = r < R
    n = _plan_lengths(glens_ptr, r, rmask, cap, dcp_size, dcp_rank, interleave, TQ)
    return r, rmask, n, tl.where(rmask, tl.maximum((n + chunk - 1) // chunk, 1), 0)


@triton.jit
def _plan_store(items_ptr, slot, row, split, out, mask):
    """Launch slot `slot` of a plan's table runs split `split` of row `row` into out row `out`."""
    tl.store(items_ptr + 2 + 3 * slot, row, mask=mask)
    tl.store(items_ptr + 3 + 3 * slot, split, mask=mask)
    tl.store(items_ptr + 4 + 3 * slot, out, mask=mask)


def plan_settings(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | None, v_scale: Tensor | None,
                  block_table: Tensor, *, dcp_size: int, dcp_rank: int, interleave: int) -> tuple[int, tuple]:
    """(rows, key) of the length plan for a call with these shapes (`_choose`; a speculative step that
    `_expanded` runs as one-token rows is planned over those rows)."""
    s, tq, hq, d = q.shape
    c, expand = _choose(q, k, v, k_scale, v_scale), 1
    if c.expand:
        expand = tq
        c = _choose(q.view(s * tq, 1, hq, d), k, v, k_scale, v_scale)
    return s * expand, _plan_key(c, block_table, k.shape[1], dcp_size, dcp_rank, interleave, expand)


def plan_by_lengths(seq_lens: Tensor, rows: int, key: tuple) -> LengthPlan:
    """The length plan of `plan_settings`' (rows, key) over the global lengths seq_lens [S] (one
    launch of `_plan_kernel`, or of `_runs_plan_kernel` for a token-run key, on seq_lens' device:
    CUDA, or the interpreter)."""
    kv = dict(key)
    size, rank, interleave = kv["dcp"]
    block = max(16, min(1024, triton.next_power_of_2(max(rows, 1))))
    if kv["runs"]:      # (a token-run plan: `gluon_mla_runs.runs_plan`'s tables, `_runs_plan_kernel`)
        programs = kv["runs"]
        table = torch.empty(programs + 1 + 3 * (programs + rows), dtype=torch.int32, device=seq_lens.device)
        segments = torch.empty(rows + 1, dtype=torch.int32, device=seq_lens.device)
        c0, c1, c2, c3 = gluon_mla_runs.RUNS_CHARGES
        _runs_plan_kernel[(1,)](seq_lens, table, segments, rows, programs, kv["table_blocks"] * kv["page"], size,
                                rank, interleave, kv["unit"], kv["runs_overhead"], TQ=kv["expand"],
                                BLOCK=min(block, 64), BLOCK_P=triton.next_power_of_2(programs + 1),
                                CHOOSE=bool(kv.get("runs_choose", 0)), C0=c0, C1=c1, C2=c2, C3=c3, num_warps=8)
        return LengthPlan(table, segments, programs + rows, rows, key)
    items = kv["items_target"] + rows
    table = torch.empty(2 + 3 * items, dtype=torch.int32, device=seq_lens.device)
    segments = torch.empty(rows + 1, dtype=torch.int32, device=seq_lens.device)
    _plan_kernel[(1,)](seq_lens, table, segments, rows, items, kv["items_target"], kv["unit"], kv["min_chunk"],
                       kv["table_blocks"] * kv["page"], size, rank, interleave, TQ=kv["expand"],
                       BLOCK=block, FIT=bool(kv["fit"]),
                       ORDER=bool(kv["order"]), NB=PLAN_CLASSES)
    return LengthPlan(table, segments, items, rows, key)


def ids_ahead_key(fp8: bool, narrow: bool = False) -> str:
    """The CONFIG entry that sets ids_ahead for the Gluon kernels over this cache dtype (over fp8 they
    are the direct kernels, GQA's or, `narrow`, MLA's narrow head tiles': each timed apart, and they
    differ)."""
    if not fp8:
        return "ids_ahead"
    return "ids_ahead_narrow_fp8" if narrow else "ids_ahead_direct_fp8"


def _narrow(rows: int) -> bool:
    """MLA's query-head tile is not full (e.g. 16 heads: TP 8): `rows` query rows per kv head."""
    return rows < CONFIG["block_m_wide"]


def launch_settings(d: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, rows: int) -> dict[str, int]:
    """CONFIG's block_m / block_n / num_warps / num_stages / min_split, the split planning's
    at_most / target_programs, and the structure options lazy_rescale / halves / tma / diag / f16
    / stage16 and maxnreg (0 where CONFIG has none) for a key dim d, these dtypes and `rows` query
    rows per kv head (q_len x heads per kv head): "wide" (d > 256, MLA) entries first, with their
    fp32-query, narrow-tile over fp8, narrow-tile or fp8-cache variants (in that order) where
    CONFIG has one; else GQA's, fp8 ones for an fp8 cache."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    narrow = _narrow(rows)

    def key(name: str) -> str:
        if d > 256:   # (fp32 queries first: their tiles are sized for shared memory)
            for variant, on in (("f32", q_dtype == torch.float32), ("narrow_fp8", narrow and fp8), ("narrow", narrow),
                                ("fp8", fp8)):
                if on and f"{name}_wide_{variant}" in CONFIG:
                    return f"{name}_wide_{variant}"
            return _WIDE.get(name, f"{name}_wide")
        return _FP8[name] if fp8 and name in _FP8 else name

    out = {name: CONFIG[key(name)] for name in ("block_m", "block_n", "num_warps", "num_stages", "min_split")}
    out["at_most"] = CONFIG.get(key("at_most"), 0)    # plan_splits' rounding
    out["target_programs"] = CONFIG.get(key("target_programs"), CONFIG["target_programs"])
    out["block_m"] = max(16, min(triton.next_power_of_2(max(rows, 1)), out["block_m"]))
    if d > 256 and narrow and fp8 and out["block_m"] > 16:
        out["num_warps"] = max(out["num_warps"], CONFIG["num_warps_wide_narrow_fp8_32"])
    out.update({name: CONFIG.get(key(name), 0) for name in _STRUCTURE})   # GQA has no halves / tma / diag
    return out


@triton.jit
def _expand_rows_kernel(lens_ptr, table_ptr, out_lens_ptr, out_table_ptr, st_s, TABLE_W: tl.constexpr,
                        TQ: tl.constexpr, TQ_P2: tl.constexpr, BLOCK: tl.constexpr):
    """(one program a sequence s) Its TQ rows of the expanded step: lengths L - TQ + 1 + t (0 where that
    is negative; a negative L stays L) and TQ copies of its block-table row."""
    s = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + s).to(tl.int64)
    t = tl.arange(0, TQ_P2)
    each = tl.where(n < 0, n, tl.maximum(n - (TQ - 1) + t, 0))
    tl.store(out_lens_ptr + s * TQ + t, each, mask=t < TQ)
    for c0 in tl.static_range(0, TABLE_W, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ids = tl.load(table_ptr + s * st_s + cols, mask=cols < TABLE_W)
        for r in tl.static_range(TQ):
            tl.store(out_table_ptr + (s * TQ + r) * TABLE_W + cols, ids, mask=cols < TABLE_W)


def _expanded(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | None, v_scale: Tensor | None, block_table: Tensor,
              seq_lens: Tensor, scale: float, merge: bool = True, out_dtype: torch.dtype = torch.float32,
              plan: LengthPlan | None = None, **layout) -> AttnState:
    """A speculative step's Tq query tokens as Tq one-token decodes (CONFIG expand_wide / expand_wide_fp8):
    token t of a sequence of global length L sees the positions < L - Tq + 1 + t, which is a decode of
    that length (DCP's local share taken from it as from any length), so q [S, Tq, Hq, D] runs as
    [S x Tq, 1, Hq, D] over lengths L - Tq + 1 + t (0 where that is negative: no key, lse -inf, as the
    causal kernels give; a negative L stays itself: the kernels' bad length) and each sequence's block
    table row repeated Tq times, both by one launch (`_expand_rows_kernel`; capturable), the same
    sequence's tokens side by side in the grid (its keys read from L2 by all but the first)."""
    s, tq, hq, d = q.shape
    width = block_table.shape[1]
    if block_table.stride(-1) != 1:     # (the copy reads rows of unit stride)
        block_table = block_table.contiguous()
    each = torch.empty(s * tq, dtype=torch.int64, device=q.device)
    table = torch.empty(s * tq, width, dtype=block_table.dtype, device=q.device)
    if s > 0:
        _expand_rows_kernel[(s,)](seq_lens, block_table, each, table, block_table.stride(0), TABLE_W=width, TQ=tq,
                                  TQ_P2=triton.next_power_of_2(tq), BLOCK=min(1024, triton.next_power_of_2(width)))
    got = paged_decode_triton(q.view(s * tq, 1, hq, d), k, v, k_scale, v_scale, table, each, scale, merge=merge,
                              out_dtype=out_dtype, plan=plan, **layout)
    lead = got.lse.shape[:-3]        # (merge=False: the splits)
    return AttnState(got.out.view(*lead, s, tq, hq, -1), got.lse.view(*lead, s, tq, hq))


_CHOICES = impl.Memo()


def _facts(t: Tensor | None) -> tuple | None:
    """What a kernel choice reads of a tensor (`_choose`'s helpers): shape, dtype, strides, 16-byte
    alignment of its base, contiguity."""
    return None if t is None else (t.shape, t.dtype, t.stride(), t.data_ptr() % 16, t.is_contiguous())


def _choose(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> SimpleNamespace:
    """Which kernel a call runs and its launch settings (shapes and CONFIG only: what the split plan
    and a length plan, `plan_by_lengths`, are made from). expand: a speculative step of MLA's full head
    tiles that runs as one-token decodes (`_expanded`), whose own choice is the one-token call's.
    Kept per call shape (`_CHOICES`: the facts `_choose_now` reads of the tensors, the interpreter
    switch, CONFIG's version): an eager call pays ~5 µs for it instead of ~15-30 (the caller must not
    change what it returns)."""
    same_v = v.data_ptr() == k.data_ptr()      # (a layer's own cache tensors: one key for every layer)
    same_scale = k_scale is not None and v_scale is not None and v_scale.data_ptr() == k_scale.data_ptr()
    key = (q.shape, q.dtype, q.device, q.is_contiguous(), q.data_ptr() % 16, _facts(k), _facts(v), same_v,
           _facts(k_scale), _facts(v_scale), same_scale, impl.interpreting(), CONFIG.version)
    return _CHOICES.get(key, lambda: _choose_now(q, k, v, k_scale, v_scale))


def _choose_now(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | None, v_scale: Tensor | None) -> SimpleNamespace:
    """`_choose` worked out."""
    s, tq, hq, d = q.shape
    page, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    d_main, d_rest, block_rest = _split_dims(d)
    v_from_k = (v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and dv == d_main)
    fp8 = k.dtype == torch.float8_e4m3fn
    cfg = launch_settings(d, q.dtype, k.dtype, tq * g)
    block_n, block_m = cfg["block_n"], cfg["block_m"]
    halves = bool(cfg["halves"]) and _halves_ok(k, v, k_scale, v_scale, d_main, block_n)
    # MLA's Gluon kernels (the latent layout, compiled): the swapped one for narrow tiles (up to 8 query
    # tokens within its 32 columns), else the padded-tile one (one query token)
    narrow = _narrow(tq * g)
    narrow_on = CONFIG["gluon_wide_narrow_fp8" if fp8 else "gluon_wide_narrow"]
    latent = not impl.interpreting() and _halves_ok(k, v, k_scale, v_scale, d_main, gluon_mla.TILE)
    expand = bool(latent and tq > 1 and hq % gluon_mla.TILE == 0 and CONFIG["expand_wide_fp8" if fp8 else "expand_wide"]
                  and gluon_mla.gluon_mla_ok(q, k, v, 1, page, k_scale, v_scale))
    # (over fp8 its direct form, with the raw stages that fit at these columns: none, or
    # direct_wide_narrow_fp8 0, leaves the padded-tile kernel)
    narrow_raw = CONFIG["direct_wide_narrow_fp8_32" if tq * hq > gluon_mla_narrow.PAIRS_MAX_COLUMNS
                        else "direct_wide_narrow_fp8"]
    narrow_raw = (gluon_mla_narrow.direct_stages(tq * hq, narrow_raw) if narrow and fp8 and CONFIG["direct_wide_narrow_fp8"]
                  else 0)
    swapped = (latent and narrow and narrow_on and CONFIG["swap_wide_narrow_fp8" if fp8 else "swap_wide_narrow"]
               and (narrow_raw > 0 or not fp8)
               and gluon_mla.gluon_mla_ok(q, k, v, tq, page, k_scale, v_scale, max_tq=8)
               and gluon_mla_narrow.narrow_ok(tq * hq, k, k_scale))
    # (wider problems: the same kernels in head tiles of 32 columns, CONFIG tiles_wide / tiles_wide_fp8)
    tiles_mode = CONFIG["tiles_wide_fp8" if fp8 else "tiles_wide"]
    width = CONFIG["tile_columns_fp8" if fp8 else "tile_columns"]
    tiled = (latent and tq * hq > gluon_mla_narrow.MAX_HEADS and (tiles_mode == 2 or tiles_mode == 1 and tq > 1)
             and gluon_mla.gluon_mla_ok(q, k, v, tq, page, k_scale, v_scale, max_tq=8)
             and gluon_mla_narrow.tiles_ok(tq * hq, k, k_scale))
    if tiled and fp8:
        narrow_raw = gluon_mla_narrow.direct_stages(width, CONFIG["direct_tiles_fp8"])
        tiled = narrow_raw > 0
    head_tiles = gluon_mla_narrow.head_tiles(tq * hq, width)[1] if tiled else 1
    swapped = swapped or tiled
    gluon = swapped or (latent and CONFIG["gluon_wide_fp8" if fp8 else "gluon_wide"] and (not narrow or narrow_on)
                        and gluon_mla.gluon_mla_ok(q, k, v, tq, page, k_scale, v_scale))
    # (over fp8 full head tiles of one token: the direct kernel, with the raw stages that fit, where on)
    wide_raw = min(CONFIG["direct_wide_fp8"], gluon_mla_direct.MAX_RAW)
    wide_raw = wide_raw if gluon and not swapped and fp8 and gluon_mla_direct.direct_ok(q, k, k_scale) else 0
    if gluon:       # (its tiles: 64 keys, 64 heads, the head tile padded where there are fewer; one CTA
        block_n, block_m = gluon_mla.TILE, gluon_mla.TILE      # per SM, so full tiles' split targets)
        cfg = dict(cfg, at_most=1, target_programs=CONFIG["target_programs_wide_fp8" if fp8 else "target_programs_wide"])
    if tiled:       # (one program a head tile of 32 columns; one CTA per SM)
        cfg = dict(cfg, at_most=1, target_programs=CONFIG["target_programs_tiles"])
    # (over fp8 the Gluon kernel where its direct form applies, a speculative step's tokens too, up to 32
    # columns of tokens x heads; more than that, or direct_gluon_gqa_fp8 0, run the Triton kernel)
    direct_raw = CONFIG["direct_gluon_gqa_fp8"]
    direct_cols = fp8 and gluon_gqa.direct_stages(tq * g, direct_raw) > 0
    bf16_tokens = gluon_gqa.bf16_max_tq(g) if CONFIG["gluon_gqa_tokens"] and not fp8 else 1
    gqa_ws = (not gluon and CONFIG["gluon_gqa_fp8" if fp8 else "gluon_gqa"] and not impl.interpreting()
              and (direct_cols or not fp8)
              and gluon_gqa.gluon_gqa_ok(q, k, v, tq, k_scale, v_scale,
                                         max_tq=8 if direct_cols else bf16_tokens))
    if gqa_ws:      # (64-key tiles, a kv head's query rows padded to 64; one CTA per SM)
        block_n, block_m = gluon_gqa.TILE, gluon_gqa.TILE
        cfg = dict(cfg, at_most=1, target_programs=CONFIG["target_programs_gluon_gqa"])
    f16 = (bool(cfg["f16"]) and fp8 and q.dtype in (torch.bfloat16, torch.float16)
           and not (halves and cfg["diag"]))          # (the probe's diagnostics run without it)
    # (inline PTX: not under the interpreter, where it would change nothing anyway)
    stage16 = cfg["stage16"] if fp8 and not halves and not impl.interpreting() else 0
    tma = bool(cfg["tma"]) and (_tma_ok(k) if halves else _gqa_tma_ok(k, v, d_rest, dv, block_n, v_from_k))
    even = bool(cfg["even"]) and tq == 1 and not halves and not tma
    pdl = bool(CONFIG["pdl_wide_narrow" if swapped and not tiled else "pdl"]) and pdl_ok(q.device)
    m_tiles = -(-(tq * g) // block_m)
    # (under a length plan, equal runs of key tiles across sequences: the programs of one wave, or 0)
    runs = (gluon_mla_runs.programs_for(q.device, m_tiles)
            if gluon and not swapped and not fp8 and tq == 1 and hq % gluon_mla.TILE == 0 and CONFIG["runs_wide"]
            and not CONFIG["seesaw_wide"] and not CONFIG["split_wide"] else 0)
    return SimpleNamespace(
        expand=expand, cfg=cfg, block_n=block_n, block_m=block_m, halves=halves, narrow=narrow, narrow_raw=narrow_raw,
        wide_raw=wide_raw,
        swapped=swapped, tiled=tiled, width=width, gluon=gluon, gqa_ws=gqa_ws, direct_raw=direct_raw, f16=f16,
        stage16=stage16, tma=tma, even=even, pdl=pdl, m_tiles=m_tiles, fp8=fp8, v_from_k=v_from_k, d_main=d_main,
        d_rest=d_rest, block_rest=block_rest, g=g, runs=runs,
        row_programs=head_tiles if tiled else hkv * m_tiles)      # programs a sequence (a split of it)


def paged_decode_triton(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | None, v_scale: Tensor | None,
                        block_table: Tensor, seq_lens: Tensor, scale: float, *,
                        dcp_size: int, dcp_rank: int, interleave: int, capacity: int,
                        merge: bool = True, out_dtype: torch.dtype = torch.float32,
                        plan: LengthPlan | None = None) -> AttnState:
    """Launch (inputs validated by `paged.paged_decode_attention`).

    q: [S, Tq, Hq, D]; k: [nb, B, Hkv, D]; v: [nb, B, Hkv, Dv] (may be the view k[..., :Dv]);
    scales [nb, B, Hkv] fp32 for fp8; block_table [S, max_blocks]; seq_lens [S] int32 / int64
    global lengths (the kernel takes this rank's share of each); capacity: tokens per sequence the
    grid covers.
    Returns AttnState(out [S, Tq, Hq, Dv] fp32, lse [S, Tq, Hq] fp32); merge=False: the P splits'
    partials unmerged, out [P, S, Tq, Hq, Dv] (fp32, or q's dtype under CONFIG half_partials), lse
    [P, S, Tq, Hq] (P = 1 where one split covers the grid). out_dtype: the merged out's dtype (fp32,
    or the 16-bit dtype the caller casts to: the split merge, or one split's kernel, writes it).
    plan: a length plan (`plan_by_lengths`, for these shapes) in place of the capacity's split plan:
    its work items are the grid's splits, merged per sequence (`merge_segments_triton`); merge=False
    then returns that merge as one partial (P = 1).
    """
    s, tq, hq, d = q.shape
    dv = v.shape[-1]
    c = _choose(q, k, v, k_scale, v_scale)
    if c.expand:
        return _expanded(q, k, v, k_scale, v_scale, block_table, seq_lens, scale, merge, out_dtype, dcp_size=dcp_size,
                         dcp_rank=dcp_rank, interleave=interleave, capacity=capacity, plan=plan)
    cfg, block_n, block_m, m_tiles, pdl = c.cfg, c.block_n, c.block_m, c.m_tiles, c.pdl
    if c.tma:
        impl.ensure_triton_scratch()
    if plan is not None:      # (made for this call: `paged.check_plan`)
        splits, split_len, rows = plan.items, 0, 1      # (the grid: a sequence's programs x the plan's items)
    else:
        splits, split_len = plan_splits(capacity, s * c.row_programs, block_n, cfg["min_split"], bool(cfg["at_most"]),
                                        cfg["target_programs"])
        rows = s
    programs = rows * c.row_programs
    # (the kernels store through o's dtype: one split's partial is the call's output, in out_dtype)
    half = (splits > 1 or plan is not None) and bool(CONFIG["half_partials"]) and q.dtype in (torch.bfloat16,
                                                                                               torch.float16)
    o_dtype = q.dtype if half else out_dtype if splits == 1 and merge and plan is None else torch.float32
    if plan is None:
        o = torch.empty(splits, s, tq, hq, dv, dtype=o_dtype, device=q.device)
        lse = torch.empty(splits, s, tq, hq, dtype=torch.float32, device=q.device)
    else:       # (item v's partial at row v: the sequence's stride 0, the kernels offset o by the item)
        o_items = torch.empty(splits, tq, hq, dv, dtype=o_dtype, device=q.device)
        lse_items = torch.empty(splits, tq, hq, dtype=torch.float32, device=q.device)
        o = o_items.unsqueeze(1).expand(splits, s, tq, hq, dv)
        lse = lse_items.unsqueeze(1).expand(splits, s, tq, hq)
    fp8 = c.fp8
    ks = k_scale if fp8 else _no_scale(q)
    vs = v_scale if fp8 else ks
    ks_st = ks.stride() if fp8 else (0, 0, 0)
    vs_st = vs.stride() if fp8 else (0, 0, 0)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    direct_opts = {"paired": bool(CONFIG["paired_store_direct_fp8"]),
                   "ahead": bool(CONFIG[ids_ahead_key(fp8, narrow=c.swapped)])}
    planned = {} if plan is None else {"plan": plan.items_table}
    if s > 0 and plan is not None and c.runs:
        gluon_mla_runs.launch(q, k, table, seq_lens, o_items, lse_items, scale * _LOG2E, dcp_size, dcp_rank,
                              interleave, plan.items_table, c.runs, pdl=pdl)
    elif s > 0 and splits > 0 and c.swapped:
        gluon_mla_narrow.launch(q, k, table, seq_lens, o, lse, scale * _LOG2E, splits, split_len, dcp_size, dcp_rank,
                                interleave, k_scale if fp8 else None, raw=c.narrow_raw, pdl=pdl,
                                pipe=bool(CONFIG["pipe_wide_narrow_fp8"]), values8=bool(CONFIG["values8_narrow_fp8"]),
                                one_max=bool(CONFIG["one_max_narrow_fp8"]),
                                width=c.width if c.tiled else gluon_mla_narrow.MAX_HEADS, **direct_opts, **planned)
    elif s > 0 and splits > 0 and c.wide_raw:
        gluon_mla_direct.launch(q, k, table, seq_lens, o, lse, scale * _LOG2E, splits, split_len, dcp_size, dcp_rank,
                                interleave, k_scale, raw=c.wide_raw, pdl=pdl, paired=direct_opts["paired"],
                                ahead=bool(CONFIG["ids_ahead_wide_fp8"]), **planned)
    elif s > 0 and splits > 0 and c.gluon:
        gluon_mla.launch_gluon_mla(q, k, table, seq_lens, o, lse, scale * _LOG2E, splits, split_len, dcp_size,
                                   dcp_rank, interleave, k_scale if fp8 else None, raw_ring=CONFIG["raw_ring_wide_fp8"],
                                   keys=CONFIG["keys_wide_fp8"], ring=CONFIG["ring_wide_fp8"], pdl=pdl,
                                   seesaw=bool(CONFIG["seesaw_wide"]), split=bool(CONFIG["split_wide"]), **planned)
    elif s > 0 and splits > 0 and c.gqa_ws:
        gluon_gqa.launch_gluon_gqa(q, k, v, table, seq_lens, o, lse, scale * _LOG2E, splits, split_len, dcp_size,
                                   dcp_rank, interleave, k_scale if fp8 else None, v_scale if fp8 else None,
                                   stages=CONFIG["stages_gluon_gqa"], direct=c.direct_raw, pdl=pdl, **direct_opts,
                                   **planned)
    elif s > 0 and splits > 0:
        _paged_decode_kernel[(programs, splits)](
            q, k, v, ks, vs, table, seq_lens, o, lse,
            scale * _LOG2E, split_len, tq, c.g, m_tiles, k.shape[2], hq,
            dcp_size, dcp_rank, interleave,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), *ks_st, *vs_st,
            table.stride(0),
            o.stride(0), o.stride(1), o.stride(2), o.stride(3), lse.stride(0), lse.stride(1), lse.stride(2),
            D_MAIN=c.d_main, D_REST=c.d_rest, BLOCK_REST=c.block_rest, DV=dv, BLOCK_DV=triton.next_power_of_2(dv),
            BLOCK_M=block_m, BLOCK_N=block_n, PAGE=k.shape[1], FP8=fp8, V_FROM_K=c.v_from_k, CAUSAL=tq > 1,
            IEEE=q.dtype == torch.float32, INTERPRETED=impl.interpreting(), LAZY=bool(cfg["lazy_rescale"]),
            HALVES=c.halves, TMA=c.tma, DIAG=cfg["diag"] if c.halves else 0, F16=c.f16, PDL=pdl, STAGE=c.stage16,
            NUM_BLOCKS=k.shape[0], EVEN=c.even,
            TABLE_W=table.shape[1], **({"DCP_N": dcp_size, "DCP_I": interleave} if CONFIG["dcp_constexpr"] else {}),
            plan_ptr=plan.items_table if plan is not None else None, PLANNED=plan is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}), **({"launch_pdl": True} if pdl else {}))
    if plan is not None:
        out = torch.empty(s, tq, hq, dv, dtype=out_dtype if merge else torch.float32, device=q.device)
        merged = merge_segments_triton(o_items, lse_items, plan.segments, out, pdl=pdl)
        return merged if merge else AttnState(merged.out.unsqueeze(0), merged.lse.unsqueeze(0))
    if not merge:
        return AttnState(o, lse)
    if splits == 1:
        return AttnState(o[0], lse[0])
    out = torch.empty(s * tq, hq, dv, dtype=out_dtype, device=q.device)
    merged = merge_states_triton(o.view(splits, s * tq, hq, dv), lse.view(splits, s * tq, hq), pdl=pdl, out=out)
    return AttnState(merged.out.view(s, tq, hq, dv), merged.lse.view(s, tq, hq))


def _halves_ok(k: Tensor, v: Tensor, k_scale: Tensor | None, v_scale: Tensor | None, d_main: int,
               block_n: int) -> bool:
    """The halves layout applies: one latent head whose value is the key's first 512 dims (and,
    fp8, one scale per token for both), tiles inside pages."""
    same_scale = k_scale is None or (v_scale is not None and v_scale.data_ptr() == k_scale.data_ptr()
                                     and v_scale.stride() == k_scale.stride())
    return (k.shape[2] == 1 and d_main == 512 and v.shape[-1] == d_main and v.data_ptr() == k.data_ptr()
            and v.stride() == k.stride() and k.shape[1] % block_n == 0 and same_scale and k.stride(-1) == 1
            )


def _gqa_tma_ok(k: Tensor, v: Tensor, d_rest: int, dv: int, block_n: int, v_from_k: bool) -> bool:
    """GQA's TMA tiles apply: power-of-two key and value dims of at most 256 (no rest part; a TMA
    box dim holds <= 256), tiles inside pages, a separate value tensor of the key's dtype, and
    both tensors' bases and page / token / head strides 16-byte aligned."""
    return (d_rest == 0 and dv == triton.next_power_of_2(dv) and max(k.shape[-1], dv) <= 256    # (a box's dims)
            and k.shape[1] % block_n == 0 and not v_from_k
            and k.dtype == v.dtype and k.stride(-1) == 1 and v.stride(-1) == 1
            and all(t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:3])
                    for t in (k, v)))


def _tma_ok(k: Tensor) -> bool:
    """TMA descriptors over k [blocks, page, 1, D]: a 16-byte aligned base and byte strides."""
    e = k.element_size()
    return k.data_ptr() % 16 == 0 and all((st * e) % 16 == 0 for st in (k.stride(0), k.stride(1)))


_NO_SCALE: dict[torch.device, Tensor] = {}


def _no_scale(q: Tensor) -> Tensor:
    """A 1-element fp32 tensor standing in for absent scale pointers (never read), one per device:
    no fill kernel per call."""
    t = _NO_SCALE.get(q.device)
    if t is None:
        t = _NO_SCALE[q.device] = torch.zeros(1, dtype=torch.float32, device=q.device)
    return t


def kv_read_bytes(local_lens_total: int, kv_heads: int, head_dim: int, head_dim_v: int, elem_bytes: int,
                  v_from_k: bool = False, fp8: bool = False) -> int:
    """Bytes a decode step must read from the cache: every held token's k (and v unless it is
    k's prefix), plus the fp32 scales of an fp8 cache."""
    per_token = kv_heads * (head_dim + (0 if v_from_k else head_dim_v)) * elem_bytes
    if fp8:
        per_token += kv_heads * 4 * (1 if v_from_k else 2)
    return local_lens_total * per_token

