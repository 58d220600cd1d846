"""MLA absorbed decode over equal runs of tokens (FlashMLA's schedule) for full 64-head tiles of a
bf16 latent cache: `gluon_mla._mla_decode_ws_kernel`'s three partitions, but each program walks a
run of the batch's key tiles that crosses sequence boundaries, instead of one (sequence, split).

The plan (made once a decode step by `paged.plan_paged_decode` under CONFIG runs_wide: on a GPU one
launch of `triton_decode._runs_plan_kernel`, capturable; `runs_plan` here is its torch specification)
lays the batch's local tokens end to end as one stream of 64-key tiles (a sequence's last tile may
be partial), each sequence's tiles after a charge of a few units that stand for its segment's fixed
cost (CONFIG runs_choose_wide: the charge of RUNS_CHARGES whose plan's busiest program costs least,
`runs_charge`), and gives each of P programs (one per SM pair of head tiles: the grid is head tiles x
P) an equal run of the stream. Where a run crosses a sequence boundary it is cut into segments; a
segment is one (sequence, start, end) range and one partial row, merged per sequence by
`triton_merge.merge_segments_triton` as a length plan's items are. Against a length plan's items
(one prologue, pipeline fill and query load each, a second wave where they outnumber the
programs), a program pays one prologue and one query load per segment; at a boundary the loader
issues the next sequence's first key tile, then waits until the scores warpgroup has issued its
last score MMAs over the old queries (barrier q_free) before loading the new ones (shared memory
holds no second query buffer: queries 72 KB and two 72 KB key stages of 227 KB). The key ring's
counter runs on across segments; every publication of weights or of the final factors is acked
by warpgroup 1 (p_free), the final factors included, so that the next segment's first weights
never overwrite factors warpgroup 1 has not read.

Tables (`items_table` of the `triton_decode.LengthPlan` that carries them): int32, P + 1 program
starts (program p's segments are slots [starts[p], starts[p + 1])), then per segment slot
(sequence, start, end) in local tokens. Sequences with no local token get no segment (the merge
writes out 0, lse -inf) unless their length is bad (negative, past the table): one empty segment
then, whose kernel reports NaN as the other kernels do."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .gluon_mla import _BLOCK, HAS_GLUON

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_mla import (BLOCK, CHUNKS, STAGES, _barriers, _checked_id, _finish, _gdc_wait_and_release,
                            _load_queries, _load_tile, _pv, _score_tile, _softmax_step, _store_quarter_rows,
                            shared_box)
    from .triton_common import local_len as _dcp_local_len

    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))


RUNS_CHARGES = (0, 2, 5, 8)     # the charges a sequence a chosen plan tries (`runs_plan`'s choose)


def _stream(local: Tensor, unit: int, charge) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(n, tiles, stream start, stream end, cumulative units) per row: the rows' local lengths laid end
    to end as tiles, each row with a tile after `charge` units (an int, or a 0-d device tensor)."""
    n = local.long().clamp(min=0)
    tiles = (n + unit - 1) // unit
    units = torch.where(tiles > 0, tiles + charge, tiles)       # (the stream: the charge, then the tiles)
    ends_u = units.cumsum(0)
    starts = ends_u - units + torch.where(tiles > 0, charge, 0)
    return n, tiles, starts, starts + tiles, ends_u


def _share(ends_u: Tensor, programs: int) -> Tensor:
    """The units of the stream (its rows' cumulative units ends_u) a program takes: ceil(stream /
    programs), at least 1 ([1], on the device)."""
    total = ends_u[-1:] if ends_u.shape[0] else torch.zeros(1, dtype=torch.long, device=ends_u.device)
    return ((total + programs - 1) // programs).clamp(min=1)


def runs_makespan(local: Tensor, programs: int, unit: int, charge, cost: int) -> Tensor:
    """The most a program of the plan at `charge` (`runs_plan`'s overhead) costs, a segment counted as
    `cost` tiles beyond its tiles (its query load, pipeline fill and partial row): max over programs of
    tiles + cost x segments, a 0-d tensor on local's device (no host read)."""
    _, _, starts, ends, ends_u = _stream(local, unit, charge)
    per = _share(ends_u, programs)
    lo = torch.arange(programs, device=local.device) * per
    overlap = (torch.minimum(ends[:, None], lo[None, :] + per) - torch.maximum(starts[:, None], lo[None, :]))
    overlap = overlap.clamp(min=0)
    return (overlap.sum(0) + cost * (overlap > 0).sum(0)).max()


def runs_charge(local: Tensor, programs: int, unit: int, cost: int) -> Tensor:
    """Of RUNS_CHARGES, the charge whose plan has the least `runs_makespan` at `cost` (the first of equal
    ones), a 0-d long tensor on local's device: where equal sequences halve into the programs no charge
    (a charge would cut them in three), where many short sequences share a program one that keeps their
    segments' costs in its share."""
    best = torch.stack([runs_makespan(local, programs, unit, f, cost) for f in RUNS_CHARGES]).argmin()
    charge = torch.zeros((), dtype=torch.long, device=local.device)
    for i, f in enumerate(RUNS_CHARGES):        # (no host tensor copied in: capturable)
        charge = torch.where(best == i, f, charge)
    return charge


def runs_plan(local: Tensor, bad: Tensor, programs: int, unit: int = _BLOCK,
              overhead: int = 0, choose: bool = False) -> tuple[Tensor, Tensor]:
    """(items_table int32 [programs + 1 + 3 x (programs + R)], segments int32 [R + 1]) of rows with
    local lengths `local` [R] (0 where `bad`) for `programs` programs (module docstring). overhead:
    what a sequence's segment costs beyond its tiles, in tiles (its query load, pipeline fill and
    partial row): each sequence with a tile takes that many units of the stream before its tiles,
    so that a program of many short sequences gets fewer tiles (FlashMLA's scheduler charges 5 blocks
    a sequence the same way); a program whose share ends inside those units leaves the sequence to
    the next. choose: the charge is instead the one of RUNS_CHARGES whose plan costs least with a
    segment costing `overhead` tiles (`runs_charge`). Torch ops on local's device with fixed shapes and
    no host read: capturable."""
    if programs < 1:
        raise ValueError(f"a token-run plan needs at least one program, got {programs}")
    if overhead < 0:
        raise ValueError(f"a token-run plan's overhead is a count of tiles >= 0, got {overhead}")
    dev, rows = local.device, local.shape[0]
    if choose:
        overhead = runs_charge(local, programs, unit, overhead) if rows else 0
    n, tiles, starts, ends, ends_u = _stream(local, unit, overhead)    # (a row's first tile in the stream ..)
    per = _share(ends_u, programs)                                 # units a program: [1], a device value
    first = torch.minimum(starts // per, torch.full_like(starts, programs - 1))
    last = torch.where(tiles > 0, (ends - 1) // per, first)
    count = torch.where(tiles > 0, last - first + 1, bad.long())
    seg_ends = count.cumsum(0)
    seg_first = seg_ends - count
    slots = programs + rows
    k = torch.arange(slots, device=dev)
    row = torch.searchsorted(seg_ends, k, right=True).clamp(max=max(rows - 1, 0))
    used = k < (seg_ends[-1] if rows else 0)
    if rows:
        prog = first[row] + (k - seg_first[row])
        t0 = torch.maximum(starts[row], prog * per) - starts[row]
        t1 = torch.minimum(ends[row], (prog + 1) * per) - starts[row]
        start = torch.where(tiles[row] > 0, t0 * unit, 0)         # (a bad row's segment: empty)
        end = torch.where(tiles[row] > 0, torch.minimum(t1 * unit, n[row]), 0)
    else:
        prog = start = end = torch.zeros(slots, dtype=torch.long, device=dev)
    prog = torch.where(used, prog, torch.full_like(prog, programs))
    zero = torch.zeros_like(k)
    seg = torch.stack([torch.where(used, row, zero), torch.where(used, start, zero), torch.where(used, end, zero)], 1)
    lo = torch.searchsorted(prog.contiguous(), torch.arange(programs + 1, device=dev))
    table = torch.cat([lo, seg.flatten()]).to(torch.int32)
    segments = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), seg_ends]).to(torch.int32)
    return table, segments


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The streaming multiprocessors of CUDA device `index` (read once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_for(device: torch.device, m_tiles: int) -> int:
    """The token-run programs of a launch over m_tiles head tiles: one CTA per SM (the kernel's shared
    memory allows no second), all of them in one wave."""
    return max(sm_count(device.index if device.index is not None else torch.cuda.current_device()) // m_tiles, 1)


if HAS_GLUON:
    @gluon.jit
    def _segment(plan_ptr, k):
        """(sequence, start, end, its 64-key tiles) of segment slot k (after the P + 1 program starts)."""
        base = plan_ptr + gl.num_programs(1) + 1 + 3 * k
        start, end = gl.load(base + 1), gl.load(base + 2)
        return gl.load(base), start, end, (gl.maximum(end - start, 0) + BLOCK - 1) // BLOCK

    @gluon.jit
    def _zero_quarters():
        """A warpgroup's four 64-wide fp32 output accumulators, zero."""
        return (gl.zeros([BLOCK, BLOCK], gl.float32, MMA), gl.zeros([BLOCK, BLOCK], gl.float32, MMA),
                gl.zeros([BLOCK, BLOCK], gl.float32, MMA), gl.zeros([BLOCK, BLOCK], gl.float32, MMA))

    @gluon.jit
    def _head_rows(head0_in_seq, HQ):
        """(the tile's 64 output columns, its 64 head rows, which rows are the sequence's heads)."""
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, MMA))
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA))
        return cols, rows, head0_in_seq + rows < HQ

    @gluon.jit
    def _my_segments(plan_ptr):
        """This program's segment slots [lo, hi)."""
        p = gl.program_id(1)
        return gl.load(plan_ptr + p), gl.load(plan_ptr + p + 1)

    @gluon.jit
    def _runs_loader(q_desc, k_desc, k_ptr, table_ptr, plan_ptr, q_smem, k_smem, q_bar, q_free, ready, free,
                     head0_in_seq, HQ, num_blocks, st_s, sk_b, sk_t, PAGE: gl.constexpr):
        """The program's segments' key tiles into the ring (one counter n across segments); a segment's
        queries after its first tile is issued and once the scores warpgroup has released the last
        segment's (q_free)."""
        lo, hi = _my_segments(plan_ptr)
        n = 0
        for k in range(lo, hi):
            s, start, end, tiles = _segment(plan_ptr, k)
            head0 = s * HQ + head0_in_seq
            if tiles == 0:
                if k > lo:
                    mbarrier.wait(q_free, (k - lo - 1) & 1)
                _load_queries(q_desc, q_smem, q_bar, head0)
            for t in range(tiles):
                stage = n % STAGES
                j0 = start + t * BLOCK
                if n >= STAGES:
                    mbarrier.wait(free.index(stage), ((n // STAGES) - 1) & 1)
                blk = _checked_id(table_ptr, s, st_s, j0, num_blocks, PAGE)
                _load_tile(k_desc, k_ptr, k_smem, ready, stage, blk, j0, end, sk_b, sk_t, PAGE)
                if t == 0:
                    if k > lo:
                        mbarrier.wait(q_free, (k - lo - 1) & 1)
                    _load_queries(q_desc, q_smem, q_bar, head0)
                n += 1

    @gluon.jit
    def _runs_scores_and_low_half(q_smem, k_smem, p_smem, a_smem, q_bar, q_free, ready, free, p_ready, p_free,
                                  table_ptr, glens_ptr, plan_ptr, o_ptr, lse_ptr, head0_in_seq, dcp_size, dcp_rank,
                                  interleave, table_w, num_blocks, st_s, qk_scale, so_k, so_h, sl_k, HQ,
                                  PAGE: gl.constexpr):
        """Warpgroup 0, per segment: the scores, the online softmax, the weights and factors published
        for warpgroup 1 (pub counts them across segments), output dims [0, 256) and the lse stored at
        the segment's partial row."""
        row_l: gl.constexpr = gl.SliceLayout(1, MMA)
        cols, rows, live = _head_rows(head0_in_seq, HQ)
        lo, hi = _my_segments(plan_ptr)
        n = 0
        pub = 0
        for k in range(lo, hi):
            s, start, end, tiles = _segment(plan_ptr, k)
            local = _dcp_local_len(glens_ptr, s, dcp_size, dcp_rank, interleave)
            bad = (gl.load(glens_ptr + s) < 0) | (local > table_w * PAGE)
            m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_l)
            l_i = gl.zeros([BLOCK], gl.float32, row_l)
            r_i = gl.zeros([BLOCK], gl.float32, row_l)
            o0, o1, o2, o3 = _zero_quarters()
            mbarrier.wait(q_bar, (k - lo) & 1)
            for t in range(tiles):
                stage = n % STAGES
                j0 = start + t * BLOCK
                blk = gl.load(table_ptr + s.to(gl.int64) * st_s + j0 // PAGE)
                bad = bad | (blk < 0) | (blk >= num_blocks)
                sc = _score_tile(q_smem, k_smem, ready, stage, (n // STAGES) & 1,
                                 gl.zeros([BLOCK, BLOCK], gl.float32, MMA))
                if t == tiles - 1:      # (the segment's queries are free for the next one's)
                    mbarrier.arrive(q_free)
                sc = gl.where((j0 + cols < end)[None, :], sc * qk_scale, float("-inf"))
                p, alpha, m_i, l_i, r_i = _softmax_step(sc, m_i, l_i, r_i, m_i, 1, False)
                if pub > 0:     # warpgroup 1 is done with what was published last
                    mbarrier.wait(p_free, (pub - 1) & 1)
                p_smem.store(p.to(p_smem.dtype))
                a_smem.store(alpha)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready)
                pub += 1
                o0, o1, o2, o3 = _pv(o0, o1, o2, o3, alpha, p_smem, k_smem, stage * CHUNKS + 0)
                mbarrier.arrive(free.index(stage))
                n += 1
            if tiles == 0:
                mbarrier.arrive(q_free)
            factor, lse = _finish(m_i, l_i, r_i, bad, False)
            if pub > 0:
                mbarrier.wait(p_free, (pub - 1) & 1)
            a_smem.store(factor)
            gl.thread_barrier()
            mbarrier.arrive(p_ready)
            pub += 1
            gl.store(lse_ptr + k.to(gl.int64) * sl_k + head0_in_seq + rows, lse, mask=live)
            o_row = k.to(gl.int64) * so_k + (head0_in_seq + rows).to(gl.int64) * so_h
            _store_quarter_rows(o_ptr + o_row[:, None] + cols[None, :], o0, o1, o2, o3, factor, live)

    @gluon.jit
    def _runs_high_half(k_smem, p_smem, a_smem, ready, free, p_ready, p_free, plan_ptr, o_ptr, head0_in_seq,
                        so_k, so_h, HQ):
        """Warpgroup 1, per segment: output dims [256, 512) from the published weights; every publication
        acked on p_free (the final factors too)."""
        row_l: gl.constexpr = gl.SliceLayout(1, MMA)
        cols, rows, live = _head_rows(head0_in_seq, HQ)
        lo, hi = _my_segments(plan_ptr)
        n = 0
        pub = 0
        for k in range(lo, hi):
            s, start, end, tiles = _segment(plan_ptr, k)
            o0, o1, o2, o3 = _zero_quarters()
            for t in range(tiles):
                stage = n % STAGES
                mbarrier.wait(ready.index(stage), (n // STAGES) & 1)
                mbarrier.wait(p_ready, pub & 1)
                alpha = a_smem.load(row_l)
                o0, o1, o2, o3 = _pv(o0, o1, o2, o3, alpha, p_smem, k_smem, stage * CHUNKS + 4)
                gl.thread_barrier()
                mbarrier.arrive(p_free)
                mbarrier.arrive(free.index(stage))
                n += 1
                pub += 1
            mbarrier.wait(p_ready, pub & 1)
            factor = a_smem.load(row_l)
            gl.thread_barrier()
            mbarrier.arrive(p_free)
            pub += 1
            o_row = k.to(gl.int64) * so_k + (head0_in_seq + rows).to(gl.int64) * so_h
            _store_quarter_rows(o_ptr + o_row[:, None] + (4 * BLOCK + cols)[None, :], o0, o1, o2, o3, factor, live)

    @gluon.jit
    def _mla_decode_runs_kernel(q_desc, k_desc, k_ptr, table_ptr, glens_ptr, plan_ptr, o_ptr, lse_ptr, qk_scale, HQ,
                                dcp_size, dcp_rank, interleave, table_w, num_blocks, st_s, sk_b, sk_t, so_k, so_h,
                                sl_k, PAGE: gl.constexpr, PDL: gl.constexpr = False):
        """Program (head tile, p): the segments of run p (`runs_plan`) for 64 heads, the partitions of
        `gluon_mla._mla_decode_ws_kernel` looping over them."""
        head0_in_seq = gl.program_id(0) * BLOCK
        box: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, BLOCK, BLOCK], box)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS, BLOCK, BLOCK], box)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, BLOCK], box)
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_free, count=1)
        q_bar, ready, free, p_ready, p_free = _barriers()      # (its fence covers q_free's init too)
        if PDL:     # (launched early: the set-up above overlaps the kernel before)
            _gdc_wait_and_release()
        gl.warp_specialize([
            (_runs_scores_and_low_half, (q_smem, k_smem, p_smem, a_smem, q_bar, q_free, ready, free, p_ready, p_free,
                                         table_ptr, glens_ptr, plan_ptr, o_ptr, lse_ptr, head0_in_seq, dcp_size,
                                         dcp_rank, interleave, table_w, num_blocks, st_s, qk_scale, so_k, so_h, sl_k,
                                         HQ, PAGE)),
            (_runs_high_half, (k_smem, p_smem, a_smem, ready, free, p_ready, p_free, plan_ptr, o_ptr, head0_in_seq,
                               so_k, so_h, HQ)),
            (_runs_loader, (q_desc, k_desc, k_ptr, table_ptr, plan_ptr, q_smem, k_smem, q_bar, q_free, ready, free,
                            head0_in_seq, HQ, num_blocks, st_s, sk_b, sk_t, PAGE)),
        ], [4, 4], [200, 48])


def launch(q: Tensor, k: Tensor, table: Tensor, seq_lens: Tensor, o: Tensor, lse: Tensor, scale_log2: float,
           dcp_size: int, dcp_rank: int, interleave: int, plan: Tensor, programs: int, pdl: bool = False) -> None:
    """Fill the segments' partials o [slots, 1, Hq, 512] / lse [slots, 1, Hq] (fp32) of a token-run
    plan's table `plan` (`runs_plan` for `programs` programs) over a bf16 latent cache
    (`gluon_mla.gluon_mla_ok`, one query token, heads a multiple of 64); the slots past the plan's
    segments are not written (the segment merge does not read them)."""
    s, _, hq, d = q.shape
    nb, page = k.shape[0], k.shape[1]
    box = shared_box(_BLOCK, _BLOCK, gl.bfloat16)
    q2 = q.view(s * hq, d)
    k2 = k.view(nb * page, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [_BLOCK, _BLOCK], box)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [_BLOCK, _BLOCK], box)
    extra = {"PDL": True, "launch_pdl": True} if pdl else {}
    _mla_decode_runs_kernel[(-(-hq // _BLOCK), programs)](
        q_desc, k_desc, k, table, seq_lens, plan, o, lse, scale_log2, hq, dcp_size, dcp_rank, interleave,
        table.shape[1], nb, table.stride(0), k.stride(0), k.stride(1), o.stride(0), o.stride(2), lse.stride(0),
        PAGE=page, num_warps=4, **extra)
