"""`megapar bench cp`: context-parallel attention costs.

1. Ring compute path on one GPU. Every rank's ring steps for a causal zigzag-sharded sequence of
   S tokens (P = 4; also 2 and 8 at 32K): the attention over each KV block plus the in-place LSE
   merges, exactly as `ring_attention` runs them but without communication
   (`simulate_ring_forward`), against ONE attention call over the whole sequence (the anchor,
   `aten._scaled_dot_product_flash_attention`). Target: <= 1.15x at S = 32K, P = 4. The floor is
   the causal attention FLOPs at the bf16 matmul ceiling. At 32K the backward is timed too.
2. DCP decode end to end on one GPU (GQA and MLA, bf16 and fp8 on CUDA): rank 0's local attention (the
   decode kernel) over 1/N of the paged KV for N = 2, 4, 8 next to the kernel over the whole
   KV (what one GPU without DCP does), the ratio N * local / full, and the merge of the N
   partial states (LSE rescale of ag_rs; N-way merge of a2a). Collectives are not in these numbers.
   L = 32K; MEGAPAR_BENCH_CP_DCP_CONTEXT=8192 runs it at another L (at 8K, 1/8 of the KV is 1024
   tokens per sequence: where GQA's min_split decides between 1 and 2 splits), a comma list at
   each (32768,131072: at 128K a call's fixed part weighs a quarter as much). Where FlashMLA is
   built (MEGAPAR_FLASHMLA_SRC), it runs over the same shards beside the MLA bf16 rows.
3. With >= 2 GPUs (NCCL): ring attention over P GPUs against one GPU's attention over the whole
   sequence (efficiency = T1 / (P * TP); target >= 85%) for both variants, and the DCP decode
   latency with both combine modes, for P = 2, 4, 8 up to the GPU count (`--world-size P`: that P
   alone). Without them the section is skipped with a note; on CPU it runs as a 2-rank gloo smoke
   test (numbers say nothing about GPUs; `--world-size P`: P ranks).
4. Paged decode kernel (CUDA; `parallel.cp.paged`, op "cp.decode"): the split-KV Triton kernel
   over this rank's 1/N of a paged cache, GQA (Hq = 32, Hkv = 4) and MLA (128 heads over one
   576-wide latent head), B = 32, L = 8K, 32K, 128K, bf16 and fp8, against the torch path
   (gathered pages) and SDPA on a contiguous copy of the same KV; floor = the KV bytes at the
   copy ceiling (target >= 70% and faster than SDPA). The fused MLA prep (`parallel.cp.mla_prep`)
   against the unfused torch sequence at 1, 16, 64, 256 tokens (target >= 60% of copy, >= 3x).
   Speculative decode (Tq = 2, 4 new tokens a sequence, causal over their global positions) at
   L = 32K: GQA and MLA with 16 heads against the same anchors given the tokens' mask. Where
   MEGAPAR_FLASHMLA_SRC names FlashMLA's source (`launch.bench.flashmla`, bench/fetch_flashmla.sh),
   the MLA bf16 rows also time FlashMLA's dense decode over the same paged cache (flashmla_*
   columns: what a DeepSeek server runs, the anchor that says what the MLA targets ask of a kernel).
   Each decode row also times the same call with its block ids taken modulo 12 MB of pages
   (`pooled_table`: its tiles from L2, column l2_us) and says what paces it on this card
   (`pace_columns`: streamed_gbps / l2_streamed_gbps, the KV's bytes over the time less fixed_us;
   paced_by "kernel" where even from L2 it streams under 0.95 of the copy ceiling, else "reads").
Sections 2 and 4 time every decode call (ours and the SDPA / torch bmm anchors) as a decode step's
CUDA graph runs it (`common.step_time`): µs per call of ten calls captured in one graph, over
copies of the inputs taken in turn so that a call reads its KV from DRAM, not from the L2 the call
before left it in (column input_sets; `common.l2_sets`: >= 3x the L2 between two uses of a copy).
Column `replay_us` is one call per graph replay: it also holds the host's launch of the replay
(5-10 µs), which a real step's graph pays once for all its kernels. `timing` says "graph x10", or
"eager (ExceptionName)" where capture failed; `eager_us` is the same call launched from Python.
--quick: tiny CPU sizes for every section.

`python -m megapar.launch.bench.cp --probe --out DIR` runs the decode-kernel tuning probe instead
(`launch.bench.decode_probe`): launch settings of `parallel.cp.triton_decode.CONFIG` for GQA and
MLA, each checked against the torch path and timed as a graph replay; the best valid ones go to
DIR/decode-tuning.json (install with `triton_decode.apply_tuning` or MEGAPAR_DECODE_TUNING=path).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

from megapar.launch.bench.common import (BenchContext, ceilings, copy_ceiling_gbps, graph_time,
                                         input_copies, l2_sets, probe_main, step_time)
from megapar.parallel.cp import PagedKVCache, attention_with_lse, dcp_kv_insert, zigzag_shard
from megapar.parallel.cp.dcp import DCPLayout, write_kv_slots
from megapar.parallel.cp.merge import merge_attn_states, rescale_parts_to_merged, rescale_to_merged
from megapar.parallel.cp.ring import simulate_ring_backward, simulate_ring_forward

RING_TARGET = 1.15
SCALING_TARGET = 0.85


def _causal_flops(s: int, heads: int, d: int) -> float:
    return 4.0 * s * s * heads * d / 2          # QK^T and PV, half the matrix


def _flop_floor_us(ctx: BenchContext, flops: float) -> float | None:
    return flops / (ceilings(ctx.device).bf16_tflops * 1e12) * 1e6 if ctx.is_cuda else None


def _one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The anchor: one causal attention over the whole sequence (PyTorch's flash kernel on CUDA)."""
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                  v.transpose(1, 2), 0.0, True, False)[0]
    return attention_with_lse(q, k, v, causal=True).out


def _ring_compute(ctx: BenchContext) -> None:
    if ctx.quick:
        cases, heads, d = [(64, 2), (128, 4)], 2, 16
    elif ctx.is_cuda:
        cases, heads, d = [(8192, 4), (16384, 4), (32768, 2), (32768, 4), (32768, 8), (65536, 4), (131072, 4)], 32, 128
    else:
        cases, heads, d = [(1024, 4)], 4, 64
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    for s, p in cases:
        torch.manual_seed(s + p)
        q, k, v = (torch.randn(1, s, heads, d, device=ctx.device, dtype=dtype) for _ in range(3))
        shards = [[zigzag_shard(x, r, p, dim=1) for r in range(p)] for x in (q, k, v)]
        iters = 5 if s >= 65536 else None
        anchor_us = ctx.time_fn(lambda: _one_call(q, k, v), iters=iters)
        ours_us = ctx.time_fn(lambda: simulate_ring_forward(*shards, causal=True), iters=iters)
        flops = _causal_flops(s, heads, d)
        ctx.record(f"ring compute fwd S={s} P={p} H={heads} D={d}", ours_us, anchor="one attention call, whole sequence",
                   anchor_us=anchor_us, floor_us=_flop_floor_us(ctx, flops), ratio_vs_one_call=ours_us / anchor_us,
                   target_ratio=RING_TARGET if (s, p) == (32768, 4) else None, tflops=flops / ours_us / 1e6)
        if (s, p) in ((32768, 4), (128, 4), (1024, 4)):
            _ring_backward_row(ctx, q, k, v, shards, s, p, heads, d, iters)
        del q, k, v, shards


def _ring_backward_row(ctx, q, k, v, shards, s, p, heads, d, iters) -> None:
    states = simulate_ring_forward(*shards, causal=True)
    dout = torch.randn_like(q)
    dout_shards = [zigzag_shard(dout, r, p, dim=1) for r in range(p)]
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention_with_lse(qr, kr, vr, causal=True).out
    anchor_us = ctx.time_fn(lambda: torch.autograd.grad(out, (qr, kr, vr), dout, retain_graph=True), iters=iters)
    ours_us = ctx.time_fn(lambda: simulate_ring_backward(dout_shards, *shards, states, causal=True), iters=iters)
    flops = 2.5 * _causal_flops(s, heads, d)
    ctx.record(f"ring compute bwd S={s} P={p} H={heads} D={d}", ours_us, anchor="one attention backward, whole sequence",
               anchor_us=anchor_us, floor_us=_flop_floor_us(ctx, flops), ratio_vs_one_call=ours_us / anchor_us,
               tflops=flops / ours_us / 1e6)


def _decode_setup(batch: int, context: int, heads: int, kv_heads: int, d: int, block: int, size: int,
                  device: torch.device, cache_dtype: torch.dtype):
    """Rank 0's paged cache (of a DCP group of `size`) holding its share of `batch` sequences."""
    layout = DCPLayout(size=size, rank=0, block_size=block)
    per_seq = -(-context // (block * size))
    table = torch.arange(batch * per_seq, device=device, dtype=torch.int32).view(batch, per_seq)
    cache = PagedKVCache.allocate(batch * per_seq, block, kv_heads, d, dtype=cache_dtype, device=device)
    torch.manual_seed(size)
    chunk = 8192
    for s in range(batch):
        for lo in range(0, context, chunk):
            positions = torch.arange(lo, min(context, lo + chunk), device=device)
            kv = torch.randn(positions.shape[0], kv_heads, d, device=device)
            write_kv_slots(cache, kv, kv, layout.slot_mapping(positions, table[s]))
    q = torch.randn(batch, heads, d, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return cache, table, q, layout.local_lengths(torch.full((batch,), context, device=device))


def _mla_decode_setup(batch: int, context: int, dims, block: int, size: int, device: torch.device,
                      cache_dtype: torch.dtype):
    """Rank 0's latent cache (one head of r + d_r, v = its first r values) of a DCP group of `size`."""
    from megapar.parallel.cp.mla import MLACache

    per_seq = -(-context // (block * size))
    table = torch.arange(batch * per_seq, device=device, dtype=torch.int32).view(batch, per_seq)
    cache = MLACache.allocate(batch * per_seq, block, dims, dtype=cache_dtype, device=device)
    torch.manual_seed(size)
    for lo in range(0, cache.kv.shape[0], 256):          # random latents, block by block (bounded temporaries)
        part = cache.kv[lo:lo + 256]
        part.view(torch.uint8).copy_(torch.randn(part.shape, device=device).to(cache_dtype).view(torch.uint8))
    return cache, table


def dcp_contexts(default: int) -> list[int]:
    """The L (global tokens a sequence) of each pass of the DCP section: MEGAPAR_BENCH_CP_DCP_CONTEXT, a
    comma list (e.g. 32768,131072: the fixed part of a call weighs less at the longer one), else
    `default`."""
    raw = os.environ.get("MEGAPAR_BENCH_CP_DCP_CONTEXT", "").strip()
    if not raw:
        return [default]
    try:
        values = [int(x) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"MEGAPAR_BENCH_CP_DCP_CONTEXT={raw!r} must be a comma list of token counts, "
                         f"e.g. 32768,131072") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"MEGAPAR_BENCH_CP_DCP_CONTEXT={raw!r}: every token count must be > 0")
    return values


def _dcp_breakdown(ctx: BenchContext) -> None:
    """DCP decode on one GPU: rank 0's local attention over 1/N of the paged KV (the kernel, op
    "cp.decode" auto) for N = 2, 4, 8 next to the same kernel over the whole KV (one GPU without
    DCP), the ratio N * local / full (1.0 = DCP splits the work perfectly) and the same against the full
    KV timed again right after the local call (full_again_us, work_ratio_over_full_again: the SM clock
    drifts under a long tensor load), fixed_us (the same
    launch over one page per rank: grid, splits, merge; what does not shrink with N) and
    streamed_ratio_x_n, the ratio without it, and the merge of the N partial states (ag_rs: LSE
    combine + rescale; a2a: the N-way merge); ag_rs_step_us / ag_rs_fused_us: a rank's work between
    ag_rs's collectives in one graph, the kernel's splits merged and then rescaled, or merged and
    rescaled in one kernel (what `dcp_decode_attention` runs); on the full-KV rows cast_out_us /
    q_dtype_out_us: the call with its fp32 out cast to q's dtype after it, or written in it by the
    merge (`out_dtype`, what `dcp_decode_attention` asks for on one rank); on the MLA bf16 rows,
    where FlashMLA is built (`_flashmla_anchor`), its columns over the same shards and its own
    flashmla_work_ratio_local_x_n_over_full. Collectives: section 3."""
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import paged_decode_attention

    if ctx.quick:
        batch, context, heads, kv_heads, d, block, sizes = 2, 256, 4, 1, 16, 16, (2, 4)
        mla = (2, MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16))
    elif ctx.is_cuda:
        batch, context, heads, kv_heads, d, block, sizes = 32, 32768, 32, 4, 128, 64, (2, 4, 8)
        mla = (128, MLADims())
    else:
        batch, context, heads, kv_heads, d, block, sizes = 4, 4096, 8, 2, 64, 16, (2, 4)
        mla = (8, MLADims(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32))
    ceiling = copy_ceiling_gbps(ctx.device)
    dtypes = [torch.bfloat16, torch.float8_e4m3fn] if ctx.is_cuda else [torch.float32]
    flash = _flashmla_anchor(ctx)
    for context in dcp_contexts(context):   # (MEGAPAR_BENCH_CP_DCP_CONTEXT: the L of each pass)
        seq = torch.full((batch,), context, device=ctx.device)
        # MLA: DeepSeek's 128 heads and 16 (a TP 8 rank's), each cache dtype. DCP gathers the group's query
        # heads (here and in vLLM), so `-tp 8 -dcp 8` runs the 128-head kernel over 1/8 of the KV: the
        # 128-head rows at N = 8; the 16-head rows at N > 1 stand for `same_heads` layouts (PCP peers)
        mla_heads = (mla[0], 16) if ctx.is_cuda and not ctx.quick else (mla[0],)
        cases = [("gqa", dt, heads) for dt in dtypes] + [("mla", dt, h) for h in mla_heads for dt in dtypes]
        for kind, cache_dtype, hq in cases:
            tag = str(cache_dtype).replace("torch.", "")
            if kind == "gqa":
                def setup(n):
                    cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, block, n, ctx.device,
                                                       cache_dtype)
                    return cache, table, q
                what, scale, dk, dv = f"Hq={heads}, Hkv={kv_heads}, D={d}", d ** -0.5, d, d
                read = lambda cache, tokens: kv_read_bytes_of(cache, tokens, kv_heads, d, d, False)
            else:
                dims = mla[1]
                def setup(n):
                    cache, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                    q = torch.randn(batch, hq, dims.latent_dim, device=ctx.device,
                                    dtype=torch.bfloat16 if ctx.is_cuda else torch.float32)
                    return cache.paged, table, q
                what, scale = f"MLA H={hq}, latent {dims.latent_dim}", dims.scale
                dk, dv = dims.latent_dim, dims.kv_lora_rank
                read = lambda cache, tokens: kv_read_bytes_of(cache, tokens, 1, dims.latent_dim, 0, True)
            call = lambda c, t, q, n, lens=seq, merge=True, out_dtype=torch.float32: paged_decode_attention(
                q, c, t, lens, scale=scale, max_seq_len=context, layout=DCPLayout(size=n, rank=0, block_size=block),
                merge=merge, out_dtype=out_dtype)

            def floors(cache, tokens):
                """(floor, byte floor, FLOP floor) of the kernel over `tokens` cached tokens: the KV
                bytes at the copy ceiling or q.k over dk and p.v over dv per query head and token at the
                bf16 ceiling, whichever is longer (MLA's 128 heads over one latent head are compute-bound)."""
                byte_floor = _floor(read(cache, tokens), ceiling)
                flop_floor = _flop_floor_us(ctx, 2.0 * tokens * hq * (dk + dv))
                floor = max(byte_floor, flop_floor) if byte_floor and flop_floor else byte_floor
                return floor, byte_floor, flop_floor

            def copies(n):
                """Rank 0's cache at 1/n, as many copies as `step_time` takes in turn."""
                return input_copies(ctx, lambda: setup(n), lambda c: read(c[0], batch * (context // n)))

            def fixed(c, t, q, n):
                """The part that does not shrink with N: the same grid, splits and merge (capacity L)
                over one page per rank (lengths n x page), timed in a step's graph like the rest."""
                short = torch.full_like(seq, n * block)
                return step_time(ctx, [lambda: call(c, t, q, n, short)])[0]

            variants = row_variants(kind, hq, cache_dtype == torch.float8_e4m3fn)
            full = copies(1)
            full_us, full_cols = _decode_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, 1) for c, t, q in full],
                                              variants)
            full_fixed_us = fixed(*full[0], 1)
            floor, byte_floor, flop_floor = floors(full[0][0], batch * context)
            # a model wants the out in q's dtype: the call's fp32 out cast after it (cast_out_us), against the
            # merge (or one split's kernel) writing it (q_dtype_out_us, what dcp_decode_attention asks for)
            half = full[0][2].dtype != torch.float32
            cast_us = step_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, 1).out.to(q.dtype) for c, t, q in full])[0]
            direct_us = step_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, 1, out_dtype=q.dtype)
                                        for c, t, q in full])[0] if half else cast_us
            # DeepSeek's FlashMLA over the same shards (MLA, not over fp8: its dense decode has none), as a
            # check of what the N-way target asks: its own N x local / full beside ours
            anchored = flash is not None and kind == "mla" and cache_dtype != torch.float8_e4m3fn

            def flash_columns(sets, n, ours_us):
                return flashmla_columns_or_note(
                    ctx, f"dcp H={hq} N={n}", flash, sets, DCPLayout(size=n, rank=0, block_size=block), seq,
                    torch.full_like(seq, n * block), scale, lambda: call(*sets[0], n), ours_us)

            flash_full = flash_columns(full, 1, full_us) if anchored else {}
            ctx.record(f"dcp decode {kind} full KV on one GPU ({tag} cache, B={batch}, L={context}, {what})", full_us,
                       floor_us=floor, fixed_us=full_fixed_us, **full_cols, byte_floor_us=byte_floor,
                       flop_floor_us=flop_floor, cast_out_us=cast_us, q_dtype_out_us=direct_us, **flash_full)
            for n in sizes:
                local = copies(n)
                local_us, local_cols = _decode_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, n) for c, t, q in local],
                                                    variants)
                # the full KV timed again right after: under a long tensor load the SM clock drifts, and a
                # full-KV time taken minutes before at another clock moves the ratio (docs/performance.md 5.1)
                full_again_us = step_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, 1) for c, t, q in full])[0]
                fixed_us = fixed(*local[0], n)
                # the combine's merge as a rank runs it: ag_rs rescales its local o over all hq heads it
                # attended; a2a merges the n ranks' partials of its own hq / n heads
                outs = torch.randn(n, batch, hq, dv, device=ctx.device)
                lses = torch.randn(n, batch, hq, device=ctx.device)
                own = max(1, hq // n)
                a2a_outs, a2a_lses = outs[:, :, :own].contiguous(), lses[:, :, :own].contiguous()

                ag_rs_us, _ = graph_time(ctx, lambda: rescale_to_merged(outs[0], lses, 0))
                a2a_us, _ = graph_time(ctx, lambda: merge_attn_states(a2a_outs, a2a_lses))
                # what a rank runs between ag_rs's collectives, in one step's graph: the kernel, its split
                # merge and the rescale (ag_rs_step_us), against the kernel's splits unmerged and merged with
                # the rescale in one kernel (ag_rs_fused_us, as dcp_decode_attention runs it); the other
                # ranks' lses made up, the same for both
                p = call(*local[0], n, merge=False).lse.shape[0]
                split_lses = torch.randn(n, p, batch, hq, device=ctx.device)
                ag_rs_step_us, _ = step_time(ctx, [lambda c=c, t=t, q=q: rescale_to_merged(
                    call(c, t, q, n).out, lses, 0) for c, t, q in local])
                ag_rs_fused_us, _ = step_time(ctx, [lambda c=c, t=t, q=q: rescale_parts_to_merged(
                    call(c, t, q, n, merge=False).out, split_lses, 0) for c, t, q in local])
                floor, byte_floor, flop_floor = floors(local[0][0], batch * (context // n))
                flash_local = flash_columns(local, n, local_us) if flash_full else {}
                if flash_local:
                    flash_local["flashmla_work_ratio_local_x_n_over_full"] = (
                        flash_local["flashmla_us"] * n / flash_full["flashmla_us"])
                ctx.record(f"dcp decode {kind} local attention over 1/{n} of the KV ({tag} cache, B={batch}, "
                           f"L={context}, {what})", local_us, anchor="the kernel over the whole KV (no DCP)",
                           anchor_us=full_us, floor_us=floor,
                           work_ratio_local_x_n_over_full=local_us * n / full_us, full_again_us=full_again_us,
                           work_ratio_over_full_again=local_us * n / full_again_us, ideal_speedup=n, fixed_us=fixed_us,
                           streamed_ratio_x_n=(local_us - fixed_us) * n / max(full_us - full_fixed_us, 1e-9),
                           merge_ag_rs_us=ag_rs_us, merge_a2a_us=a2a_us,
                           local_plus_merge_us=local_us + min(ag_rs_us, a2a_us), ag_rs_step_us=ag_rs_step_us,
                           ag_rs_fused_us=ag_rs_fused_us, splits=p, **local_cols,
                           byte_floor_us=byte_floor, flop_floor_us=flop_floor, **flash_local)
                del local, outs, lses, a2a_outs, a2a_lses
            del full
    ctx.note("dcp breakdown: the all-gather of q and the combine collectives need >= 2 GPUs (section 3)")
    _note_graph_timing(ctx)


# the same call with one kernel option changed: column -> (module, CONFIG overrides) (`_decode_time`). The
# split merge fused into the decode kernel (the last split of a row tile merging, self-resetting
# counters per stream) was measured this way on 2026-12-03 and lost nearly everywhere (GQA bf16
# 1/4 of 8K / 32K / 128K: 42.1 / 131.0 / 490.7 -> 45.0 / 143.5 / 544.8 µs; docs/performance.md):
# removed after commit be81291
DECODE_VARIANTS = {"no_pdl_us": ("triton_decode", {"pdl": 0}),
                   "pdl_narrow_us": ("triton_decode", {"pdl_wide_narrow": 1}),
                   "unpaired_store_us": ("triton_decode", {"paired_store_direct_fp8": 0}),
                   "ids_after_us": ("triton_decode", {"ids_ahead": 0}),
                   "ids_ahead_fp8_us": ("triton_decode", {"ids_ahead_direct_fp8": 1}),
                   "ids_after_narrow_fp8_us": ("triton_decode", {"ids_ahead_narrow_fp8": 0}),
                   "seesaw_us": ("triton_decode", {"seesaw_wide": 1}),
                   "untiled_us": ("triton_decode", {"tiles_wide": 0}),
                   "untiled_fp8_us": ("triton_decode", {"tiles_wide_fp8": 0}),
                   "expanded_us": ("triton_decode", {"expand_wide": 1}),
                   "expanded_fp8_us": ("triton_decode", {"expand_wide_fp8": 1}),
                   "converter_fp8_us": ("triton_decode", {"direct_wide_fp8": 0}),
                   "values8_us": ("triton_decode", {"values8_narrow_fp8": 1}),
                   "two_max_us": ("triton_decode", {"one_max_narrow_fp8": 0}),
                   "triton_tokens_us": ("triton_decode", {"gluon_gqa_tokens": 0})}
"""Columns timing a decode call again with one CONFIG option of a module of parallel.cp changed."""


def row_variants(kind: str, heads: int, fp8: bool, tokens: int = 1) -> tuple[str, ...]:
    """The DECODE_VARIANTS whose option reaches a decode row's kernel (GQA or MLA, query heads,
    over an fp8 cache or not, query tokens a sequence), as `triton_decode` picks it: programmatic
    dependent launch every kernel (MLA's narrow head tiles, at most 32 columns of tokens x heads,
    through their own switch, pdl_wide_narrow); the paired stores only the direct fp8 kernels; the
    ids loaded ahead the GQA kernels and MLA's swapped kernels (`gluon_mla_narrow`: narrow tiles,
    and wider speculative steps in head tiles), over bf16 (ids_ahead) or fp8 (GQA's
    ids_ahead_direct_fp8, MLA's ids_ahead_narrow_fp8); the seesaw form only MLA's full head tiles
    over bf16; expanded (a speculative step over full 64-head tiles as one-token decodes) only those
    steps; untiled (the Triton kernel instead of the head tiles) only MLA's speculative steps of more
    than 32 columns that the installed CONFIG does not expand; converter (MLA's full head tiles over fp8
    through the converter's kernel) only those tiles of one token, or expanded; values8 (MLA's narrow direct
    fp8 kernel's value MMAs in fp8) only that kernel at most 16 columns; two_max (its softmax with two
    maxima a tile) that kernel; triton_tokens (a speculative step through the Triton kernel instead of
    the Gluon one) only GQA's steps of more than one token over bf16.
    (Elsewhere a variant would time the same
    kernel again: device time for a column equal to time_us up to the spread.)"""
    try:
        from megapar.parallel.cp.triton_decode import CONFIG
    except ImportError:     # (no Triton: no kernel runs, the expansion included)
        CONFIG = {}
    narrow = kind == "mla" and heads * tokens <= 32
    expandable = kind == "mla" and tokens > 1 and heads % 64 == 0
    expanded = expandable and bool(CONFIG.get("expand_wide_fp8" if fp8 else "expand_wide", 0))
    tiled = kind == "mla" and heads * tokens > 32 and tokens > 1 and not expanded
    swapped = narrow or tiled
    # (MLA's full head tiles of one token over fp8, a speculative step's expanded included: the direct
    # kernel, or the converter's, CONFIG direct_wide_fp8)
    full_fp8 = kind == "mla" and fp8 and heads % 64 == 0 and (tokens == 1 or expanded)
    reach = {"no_pdl_us": not narrow, "pdl_narrow_us": narrow,
             "unpaired_store_us": fp8 and (kind == "gqa" or swapped),
             "ids_after_us": not fp8 and (kind == "gqa" or swapped), "ids_ahead_fp8_us": fp8 and kind == "gqa",
             "ids_after_narrow_fp8_us": fp8 and swapped, "seesaw_us": kind == "mla" and not swapped and not fp8,
             "untiled_us": tiled and not fp8, "untiled_fp8_us": tiled and fp8,
             "expanded_us": expandable and not fp8, "expanded_fp8_us": expandable and fp8,
             "converter_fp8_us": full_fp8, "values8_us": fp8 and swapped and heads * tokens <= 16,
             "two_max_us": fp8 and swapped, "triton_tokens_us": kind == "gqa" and not fp8 and tokens > 1}
    return tuple(name for name in DECODE_VARIANTS if reach[name])


def _decode_time(ctx: BenchContext, fns, variants=None) -> tuple[float, dict]:
    """A decode call timed as serving runs it, inside a decode step's CUDA graph (`step_time`:
    µs per call of ten captured in one graph, `fns` = the call over each copy of its inputs, taken
    in turn): (µs, the extra columns timing, replay_us (one call per graph replay, the host's
    launch of the replay included), input_sets, eager_us (the call launched from Python) and, per
    DECODE_VARIANTS, the same with one CONFIG option changed: no_pdl_us without programmatic
    dependent launch, pdl_narrow_us with it for MLA's narrow head tiles (pdl_wide_narrow 1), untiled_us /
    untiled_fp8_us with MLA's wider speculative steps through the Triton kernel, not head tiles
    (tiles_wide / tiles_wide_fp8 0), expanded_us / expanded_fp8_us with those over full 64-head
    tiles as one-token decodes (expand_wide / expand_wide_fp8 1),
    unpaired_store_us with the direct fp8 kernels' output stored a dim at a time (CONFIG
    paired_store_direct_fp8 0), ids_after_us with the bf16 Gluon kernels' first block ids loaded
    after the length (ids_ahead 0), ids_ahead_fp8_us with GQA's direct fp8 kernel's loaded beside it
    (ids_ahead_direct_fp8 1), ids_after_narrow_fp8_us with MLA's narrow direct fp8 kernel's loaded
    after it (ids_ahead_narrow_fp8 0), seesaw_us with the bf16 Gluon MLA kernel in its seesaw form
    (seesaw_wide 1), converter_fp8_us with MLA's full head tiles over fp8 through the converter's kernel
    instead of the direct one (direct_wide_fp8 0), values8_us with MLA's narrow direct fp8 kernel's
    value MMAs in fp8 (values8_narrow_fp8 1), two_max_us with its softmax taking two maxima a tile, the
    form before one_max_narrow_fp8 (one_max_narrow_fp8 0), triton_tokens_us with GQA's speculative steps
    over bf16 through the Triton kernel (gluon_gqa_tokens 0) (where the CONFIG has the changed value
    already, time_us itself). `variants`:
    the names of those to time (`row_variants`: those that reach the row's kernel), all when None."""
    import importlib

    us, cols = step_time(ctx, fns)
    cols["eager_us"] = ctx.time_fn(fns[0]) if ctx.is_cuda else us
    names = DECODE_VARIANTS if variants is None else variants
    for name in names if ctx.is_cuda else ():
        module, change = DECODE_VARIANTS[name]
        config = importlib.import_module(f"megapar.parallel.cp.{module}").CONFIG
        before = {k: config[k] for k in change}
        if before == change:
            cols[name] = us
            continue
        config.update(change)
        try:
            cols[name] = step_time(ctx, fns)[0]
        except Exception as exc:    # (a variant that fails leaves its column out, not the row)
            ctx.note(f"decode variant {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            config.update(before)
    return us, cols


def _fixed_variants(cols: dict) -> dict:
    """The fixed part's DECODE_VARIANTS columns, as fixed_<column> (the variants aim at that part)."""
    return {f"fixed_{name}": cols[name] for name in DECODE_VARIANTS if name in cols}


def _note_graph_timing(ctx: BenchContext) -> None:
    if ctx.is_cuda and "decode timing" not in " ".join(ctx.notes):
        ctx.note("decode timing: time_us of the decode kernel rows and of their SDPA / torch bmm anchors is µs per call of "
                 "ten calls captured in one CUDA graph (timing 'graph x10'), over input_sets copies of the inputs taken "
                 "in turn so that no call reads its KV from L2: a call as a decode step's graph runs it. replay_us "
                 "(anchor_replay_us) is one call per graph replay, which also holds the host's launch of the replay "
                 "(5-10 µs; the time_us of runs before 2026-12-03 evening); eager_us the call launched from Python; "
                 "the gathered-pages torch path is eager")


def _floor(nbytes: int | None, ceiling_gbps: float) -> float | None:
    return None if nbytes is None else nbytes / (ceiling_gbps * 1e3)


def kv_read_bytes_of(cache: PagedKVCache, tokens: int, kv_heads: int, d: int, dv: int, v_from_k: bool) -> int | None:
    """The KV-read byte floor of a decode step over `tokens` cached tokens of `cache` (CUDA only)."""
    if cache.k.device.type != "cuda":
        return None
    from megapar.parallel.cp.triton_decode import kv_read_bytes

    return kv_read_bytes(tokens, kv_heads, d, dv, cache.k.element_size(), v_from_k=v_from_k, fp8=cache.is_fp8)


L2_POOL_BYTES = 12 * 2 ** 20
"""The pool of pages a decode row's L2 timing reads (`pooled_table`): a quarter of an H100's or H200's L2."""


def pooled_table(table: torch.Tensor, page_bytes: float, pool_bytes: float = L2_POOL_BYTES) -> torch.Tensor:
    """`table` with its block ids taken modulo a pool of `pool_bytes` of pages (`page_bytes` each; at
    least one page, at most the table's own): a decode over it has the same lengths, grid and splits
    and, after its first touches, finds every tile in L2, so that its time is the kernel's own pace
    and not the DRAM's."""
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    pool = max(1, min(table.numel(), int(pool_bytes // page_bytes)))
    return (table.long() % pool).to(table.dtype)


def pace_columns(nbytes: float, us: float, l2_us: float, fixed_us: float, ceiling_gbps: float) -> dict:
    """A decode row's streamed rates (the KV's bytes over the time less its fixed part) reading from
    DRAM (`us`) and with its tiles in L2 (`l2_us`, `pooled_table`), and what paces the row on this
    card: "reads" where the kernel streamed at 0.95 of the copy ceiling or more either way (it would
    go faster with faster reads), else "kernel" (with its tiles in L2 it still streams slower than
    this card's DRAM: a card with more bandwidth would not make it faster)."""
    def rate(t: float) -> float | None:
        return nbytes / (t - fixed_us) / 1e3 if t > fixed_us else None
    dram, l2 = rate(us), rate(l2_us)
    best = max(r for r in (dram, l2, 0.0) if r is not None)
    return {"l2_us": l2_us, "streamed_gbps": dram, "l2_streamed_gbps": l2,
            "paced_by": "reads" if best >= 0.95 * ceiling_gbps else "kernel"}


# ---------------------------------------------------------------------------------------------
# multi-GPU section


def _multi_rank(rank: int, seq: int, heads: int, d: int, batch: int, context: int, quick: bool) -> list[dict]:
    from megapar.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megapar.parallel.cp import dcp_decode_attention, ring_attention

    world = int(os.environ["WORLD_SIZE"])
    groups = init_parallel(ParallelConfig(world_size=world, pcp=world))   # DCP below: over these ranks too
    device = torch.device("cuda", torch.cuda.current_device()) if groups.backend == "nccl" else torch.device("cpu")
    ctx = BenchContext(suite="cp", device=device, quick=quick)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    pg = groups.pcp.group
    rows: list[dict] = []

    def timed(fn, iters=None) -> float:
        torch.distributed.barrier(group=pg)
        return ctx.time_fn(fn, iters=iters)

    torch.manual_seed(0)      # the same sequence on every rank
    q, k, v = (torch.randn(1, seq, heads, d, device=device, dtype=dtype) for _ in range(3))
    one_us = ctx.time_fn(lambda: _one_call(q, k, v), iters=5 if seq >= 65536 else None)
    local = [zigzag_shard(x, groups.pcp.rank, world, dim=1) for x in (q, k, v)]
    del q, k, v
    for variant in ("ring", "allgather"):
        us = timed(lambda: ring_attention(*local, groups.pcp, causal=True, variant=variant))
        rows.append(dict(case=f"{variant} attention fwd S={seq} P={world} H={heads} D={d}", time_us=us,
                         anchor="one GPU, whole sequence", anchor_us=one_us, scaling_efficiency=one_us / (world * us),
                         target_efficiency=SCALING_TARGET))
    # DCP decode latency
    cache_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = 64 if device.type == "cuda" else 16
    layout = DCPLayout(size=world, rank=groups.pcp.rank, block_size=block)
    per_seq = -(-context // (block * world))
    table = torch.arange(batch * per_seq, device=device, dtype=torch.int32).view(batch, per_seq)
    cache = PagedKVCache.allocate(batch * per_seq, block, 1, d, dtype=cache_dtype, device=device)
    for s in range(batch):
        kv = torch.randn(context, 1, d, device=device)
        dcp_kv_insert(cache, kv, kv, torch.arange(context, device=device), table[s], groups.pcp)
    qd = torch.randn(batch, max(1, heads // world), d, device=device, dtype=dtype)
    lens = torch.full((batch,), context, device=device)
    for comm in ("ag_rs", "a2a"):
        us = timed(lambda: dcp_decode_attention(qd, cache, table, lens, groups.pcp, comm=comm))
        rows.append(dict(case=f"dcp decode {comm} N={world} B={batch} L={context} Hq/rank={qd.shape[1]}", time_us=us,
                         local_len=int(layout.local_lengths(context))))
    destroy_parallel()
    return rows if rank == 0 else []


def _multi_gpu(ctx: BenchContext) -> None:
    from megapar.launch.local import launch_local

    if ctx.is_cuda:
        available = torch.cuda.device_count()
        if available < 2:
            ctx.note(f"multi-GPU ring scaling and DCP latency skipped: they need >= 2 GPUs (found {available}); "
                     "`megapar bench cp --device cuda` on a multi-GPU machine runs them for P = 2, 4, 8")
            return
        sizes = ctx.world_sizes([p for p in (2, 4, 8) if p <= available], available)
        backend, seq, heads, d, batch, context = "nccl", 65536, 32, 128, 32, 32768
    else:
        sizes, backend = ctx.world_sizes([2]), "gloo"
        seq, heads, d, batch, context = (64, 2, 16, 2, 64) if ctx.quick else (1024, 4, 64, 4, 2048)
        ctx.note("CPU: the multi-rank section runs on 2 gloo processes as a smoke test; the numbers say nothing "
                 "about GPUs")
    for p in sizes:
        rows = launch_local(_multi_rank, p, backend=backend, args=(seq, heads, d, batch, context, ctx.quick),
                            timeout=600)[0]
        for row in rows:
            case = row.pop("case")
            ctx.record(case, row.pop("time_us"), anchor=row.pop("anchor", None), anchor_us=row.pop("anchor_us", None),
                       **row)


# ---------------------------------------------------------------------------------------------
# paged decode kernel, MLA decode, fused MLA prep (CUDA)


def _sdpa_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_mask: torch.Tensor | None = None,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The anchor: SDPA of the query tokens over a contiguous KV (GQA): q [B, Hq, Tq, D], k / v
    [B, Hkv, L, D]. With a mask the Hq / Hkv query heads of a kv head are folded into its query
    rows, so that SDPA reads each kv head once whichever backend the mask leaves it: row_mask
    (speculative tokens) [Hq / Hkv x Tq, L] bool, rows (head in group, token):
    `speculative_mask(...).repeat(Hq / Hkv, 1)`; key_mask (a batch padded to its longest sequence)
    [B, L] bool, the keys each sequence holds. Masks are made once outside the timed call."""
    if row_mask is None and key_mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    b, hq, tq, d = q.shape
    rows = q.reshape(b, k.shape[1], hq // k.shape[1] * tq, d)           # rows (head in group, token)
    mask = row_mask if key_mask is None else key_mask[:, None, None, :]
    if row_mask is not None and key_mask is not None:
        mask = mask & row_mask
    out = torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
    return out.reshape(b, hq, tq, v.shape[-1])


def _mla_torch_contiguous(q: torch.Tensor, latent: torch.Tensor, dv: int, scale: float,
                          hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The MLA anchor: absorbed decode in plain torch over a contiguous latent cache, as a user
    would write it (two batched matmuls; SDPA's GQA expansion of one 576-wide head to 128
    materializes the KV per head: 64 GiB at B = 32, L = 32K). q [B, R, D] (R query rows: heads,
    or tokens x heads), latent [B, L, D], hidden [R, L] bool: what a row does not see
    (speculative tokens; made once outside the timed call) or None."""
    s = torch.matmul(q, latent.transpose(1, 2)).float() * scale           # [B, R, L]
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return torch.matmul(torch.softmax(s, -1).to(latent.dtype), latent[..., :dv])


def speculative_mask(layout: DCPLayout, local: int, tokens: int, context: int, device=None) -> torch.Tensor:
    """[tokens, local] bool: which of this rank's `local` cached tokens (in cache order) each of the
    newest `tokens` of a sequence of global length `context` sees (token t sits at context -
    tokens + t and sees positions <= its own)."""
    seen = layout.global_positions(torch.arange(local, device=device))
    return seen[None, :] <= (context - tokens + torch.arange(tokens, device=device))[:, None]


def _paged_decode_rows(ctx: BenchContext) -> None:
    """GQA (Hq 32, Hkv 4, D 128) and MLA (H 128 and 16, one latent head of 576, v = its first 512) decode,
    B = 32, L = 8K..128K, bf16 and fp8 caches: the split-KV kernel over rank 0's 1/N of the paged
    KV against SDPA on a contiguous bf16 copy of the same tokens and the old gathered-pages torch
    path, with the fraction of the KV-read byte floor (target >= 70% and faster than SDPA)."""
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import paged_decode_attention

    ceiling = copy_ceiling_gbps(ctx.device)
    batch, block, n = 32, 64, 4
    dims = MLADims()
    flash = _flashmla_anchor(ctx)
    # MLA with all 128 heads on the rank (TP 1, or a DCP group's gathered heads: compute-bound) and
    # with 16 (a TP 8 rank's own heads over the latent cache, as vLLM's `-tp 8` without DCP runs them:
    # bound by the latent bytes; over L / 4 tokens here, a TP 8 rank's decode at a quarter of L)
    for kind, mla_heads in (("gqa", 0), ("mla", 128), ("mla", 16)):
        for context in (8192, 32768, 131072):
            for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
                tag = str(cache_dtype).replace("torch.", "")
                local = context // n
                if kind == "gqa":
                    heads, kv_heads, d, dv = 32, 4, 128, 128

                    def make():
                        cache, table, q, _ = _decode_setup(batch, context, heads, kv_heads, d, block, n, ctx.device,
                                                           cache_dtype)
                        return cache, table, q
                    scale, v_from_k, what = d ** -0.5, False, f"Hq={heads}, Hkv={kv_heads}"
                else:
                    heads, kv_heads, d, dv = mla_heads, 1, dims.latent_dim, dims.kv_lora_rank

                    def make():
                        latent, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                        return latent.paged, table, torch.randn(batch, heads, d, device=ctx.device,
                                                                dtype=torch.bfloat16)
                    scale, v_from_k = dims.scale, True
                    what = f"MLA H={heads}{' (TP 8)' if heads == 16 else ''}, latent {d}"
                layout = DCPLayout(size=n, rank=0, block_size=block)
                seq = torch.full((batch,), context, device=ctx.device)
                ours = lambda c, t, q, lens: paged_decode_attention(q, c, t, lens, layout=layout, scale=scale,
                                                                    backend="triton", max_seq_len=context)
                # copies of the cache taken in turn (step_time), so that no call finds its KV in L2
                sets = input_copies(ctx, make, lambda c: kv_read_bytes_of(c[0], batch * local, kv_heads, d, dv,
                                                                          v_from_k))
                nbytes = kv_read_bytes_of(sets[0][0], batch * local, kv_heads, d, dv, v_from_k)
                variants = row_variants(kind, heads, cache_dtype == torch.float8_e4m3fn)
                ours_us, ours_cols = _decode_time(ctx, [lambda c=c, t=t, q=q: ours(c, t, q, seq) for c, t, q in sets],
                                                  variants)
                cache, table, q = sets[0]
                # the part that does not scale with L: the same grid, splits and merge over one page
                # per rank (what is left of the time, streamed_us, is what the KV bytes cost)
                # (the short lengths made outside the timed call: inside, their fill kernel was timed too)
                short = torch.full_like(seq, n * block)
                fixed_us, fixed_cols = _decode_time(ctx, [lambda: ours(cache, table, q, short)], variants)
                # the same call with its tiles in L2: does the kernel or the card's DRAM pace the row?
                pooled = pooled_table(table, nbytes / (batch * local) * block)
                l2_us, _ = step_time(ctx, [lambda: ours(cache, pooled, q, seq)])
                pace = pace_columns(nbytes, ours_us, l2_us, fixed_us, ceiling)
                flash_cols = {}
                if flash is not None and kind == "mla" and cache_dtype == torch.bfloat16:
                    flash_cols = flashmla_columns_or_note(ctx, f"L={context} H={heads}", flash, sets, layout, seq,
                                                          short, scale, lambda: ours(cache, table, q, seq), ours_us)
                # the gathered-pages torch path expands the KV per query head: skip it where that alone
                # would not fit (MLA at L = 128K: 288 GiB)
                if batch * local * heads * d * 2 * 2 <= 32 * 2**30:
                    torch_us = ctx.time_fn(lambda: paged_decode_attention(q, cache, table, seq, layout=layout,
                                                                          scale=scale, backend="torch"), iters=5)
                else:
                    torch_us = float("nan")
                    ctx.note(f"{kind} L={context}: the gathered-pages torch path skipped (its per-head KV copy "
                             f"exceeds 32 GiB)")
                del sets
                # the anchor over as many contiguous copies; GQA's with its own V (with k and v one
                # tensor, the second read of each tile hits L2 and SDPA moves half the bytes)
                kvs = input_copies(ctx, lambda: [torch.randn(batch, kv_heads, local, d, device=ctx.device,
                                                             dtype=torch.bfloat16) for _ in range(1 + (kind == "gqa"))],
                                   lambda kv: sum(t.numel() * t.element_size() for t in kv))
                if kind == "gqa":
                    anchor = "SDPA, contiguous bf16 KV of the same tokens"
                    sdpa_us, anchor_cols = step_time(ctx, [lambda kc=kc, vc=vc: _sdpa_contiguous(q.unsqueeze(2), kc, vc)
                                                           for kc, vc in kvs])
                else:
                    anchor = "torch absorbed MLA (2 bmm + softmax), contiguous bf16 latent of the same tokens"
                    sdpa_us, anchor_cols = step_time(ctx, [lambda kc=kc: _mla_torch_contiguous(q, kc[:, 0], dv, scale)
                                                           for kc, in kvs])
                del kvs
                anchor_timing = anchor_cols["timing"]
                label = "paged decode kernel over" if kind == "gqa" else "MLA absorbed decode kernel over"
                # the roofline: the bytes at the copy ceiling or the matmul FLOPs (q.k over d, p.v over
                # dv, per head and token) at the measured bf16 dense ceiling, whichever takes longer.
                # MLA's 128 heads over one latent head: 128 x 2 x (576 + 512) FLOP per 1152 B token =
                # 242 FLOP/B, above the H200's 799 TFLOP/s / ~4.3 TB/s = 186: compute-bound
                byte_floor = _floor(nbytes, ceiling)
                flop_floor = _flop_floor_us(ctx, 2.0 * batch * local * heads * (d + dv))
                floor = max(byte_floor, flop_floor) if byte_floor and flop_floor else byte_floor
                ctx.record(f"{label} 1/{n} KV ({tag} cache, B={batch}, L={context}, {what})",
                           ours_us, anchor=anchor, anchor_us=sdpa_us, floor_us=floor, byte_floor_us=byte_floor,
                           flop_floor_us=flop_floor, torch_gathered_us=torch_us,
                           speedup_vs_torch=torch_us / ours_us, target_fraction=0.70, anchor_timing=anchor_timing,
                           anchor_replay_us=anchor_cols.get("replay_us"), anchor_input_sets=anchor_cols["input_sets"],
                           fixed_us=fixed_us, streamed_fraction=floor / max(ours_us - fixed_us, 1e-9), **pace,
                           **ours_cols, **_fixed_variants(fixed_cols), **flash_cols)
                del cache, table, q, pooled
    _note_graph_timing(ctx)


_FIT = {"plan_fit": 1, "plan_fit_wide": 1, "plan_fit_wide_narrow": 1}
_TOKENS = {"plan_fit": 0, "plan_fit_wide": 0, "plan_fit_wide_narrow": 0}
PLAN_VARIANTS = {"fit_us": {**_FIT, "plan_order": 0}, "tokens_us": {**_TOKENS, "plan_order": 0},
                 "fit_longest_first_us": {**_FIT, "plan_order": 1},
                 "tokens_longest_first_us": {**_TOKENS, "plan_order": 1}, "waves2_us": {"plan_waves": 2}}
"""The mixed rows' columns of other length-plan settings (`triton_decode.CONFIG` plan_fit(_wide,
_wide_narrow) / plan_order / plan_waves; time_us has the installed ones): the plan made under them,
the call timed as time_us is."""

RUNS_VARIANT = {"runs_us": {"runs_wide": 1}, "items_us": {"runs_wide": 0}}
"""The MLA rows' columns of a token-run plan (`gluon_mla_runs`, CONFIG runs_wide: equal runs of key
tiles across sequences) and of the length plan's items, where the token runs apply (bf16, full head
tiles); time_us has the installed setting (the column that has it repeats time_us, not timed again)."""

MIXED_KINDS = (("gqa", 32, torch.bfloat16), ("gqa", 32, torch.float8_e4m3fn), ("mla", 128, torch.bfloat16),
               ("mla", 128, torch.float8_e4m3fn), ("mla", 16, torch.bfloat16), ("mla", 16, torch.float8_e4m3fn))
"""The mixed-length rows' kernels: (kind, query heads, cache dtype)."""


def mixed_batches(batch: int = 32, context: int = 131072) -> dict[str, list[int]]:
    """The mixed-length rows' batches of global lengths: two long sequences among short ones of 1/64
    their length (a serving batch with two long contexts), and lengths log-uniform in [context / 128,
    context] (seeded)."""
    gen = torch.Generator().manual_seed(0)
    spread = (context * 2 ** (-7 * torch.rand(batch, generator=gen))).long().tolist()
    size = lambda n: f"{n // 1024}K" if n % 1024 == 0 else str(n)
    short = max(context // 64, 1)
    return {f"2 x {size(context)} among {batch - 2} x {size(short)}": [context] * 2 + [short] * (batch - 2),
            f"log-uniform {size(context // 128)}-{size(context)}": spread}


def _mixed_length_rows(ctx: BenchContext, batch: int = 32, context: int = 131072, n: int = 4,
                       block: int = 64) -> None:
    """Batches of very different lengths (`mixed_batches`) over rank 0's 1/N of the paged KV: the
    kernel under a length plan (`plan_paged_decode`, made once a step outside the call as a model
    makes it for all its layers; plan_and_call_us: made inside each call) against the same call
    with the capacity's split plan (every sequence in as many splits: the long ones on a few
    programs), FlashMLA's dense decode (MLA bf16: it plans from the lengths too), and the floor of
    the bytes the batch's tokens hold (MLA 128 heads: or the FLOPs)."""
    from megapar.parallel.cp import triton_decode
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import paged_decode_attention, plan_paged_decode

    ceiling = copy_ceiling_gbps(ctx.device)
    dims = MLADims()
    flash = _flashmla_anchor(ctx)
    layout = DCPLayout(size=n, rank=0, block_size=block)
    ctx.note("mixed lengths rows: time_us is the call under a length plan made once outside it (as a decode step "
             "makes it for all layers), graph-timed like the decode rows; anchor_us the same call with the "
             "capacity's split plan (max_seq_len = the longest length); plan_and_call_us the plan made inside "
             "each call; fit_us / tokens_us: plans whose chunk fits the items' target / is the tokens' share of it "
             "(CONFIG plan_fit, plan_fit_wide and plan_fit_wide_narrow 1 / 0), items launched in row order; "
             "*_longest_first_us: the same with the items launched longest first (plan_order 1); waves2_us: the "
             "installed plan with twice the target (plan_waves 2); runs_us (MLA 128 heads, bf16): a token-run "
             "plan, equal runs of key tiles across sequences, one wave (CONFIG runs_wide 1), items_us: the length "
             "plan's items (runs_wide 0; the installed setting's column is time_us); "
             "padded_torch_us: the plain-torch call a user would otherwise write, over a contiguous bf16 KV of "
             "the batch padded to its longest local length with a key mask (GQA: SDPA, heads folded into rows; "
             "MLA: the absorbed bmm / masked softmax / bmm); "
             "floor_us the bytes of the batch's local tokens at the copy ceiling (MLA 128 heads: or "
             "their FLOPs); matches: the planned out within 2% of the capacity plan's; flashmla_us (MLA bf16): "
             "FlashMLA over the same lengths, its plan made outside the graph")
    for kind, heads, cache_dtype in MIXED_KINDS:
        tag = str(cache_dtype).replace("torch.", "")
        if kind == "gqa":
            kv_heads, d, dv, scale, v_from_k = 4, 128, 128, 128 ** -0.5, False
            make = lambda: _decode_setup(batch, context, heads, kv_heads, d, block, n, ctx.device, cache_dtype)[:3]
            what = f"Hq={heads}, Hkv={kv_heads}"
        else:
            kv_heads, d, dv, scale, v_from_k = 1, dims.latent_dim, dims.kv_lora_rank, dims.scale, True

            def make():
                latent, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                return latent.paged, table, torch.randn(batch, heads, d, device=ctx.device,
                                                        dtype=torch.bfloat16 if ctx.is_cuda else torch.float32)
            what = f"MLA H={heads}, latent {d}"
        batches = mixed_batches(batch, context)
        fewest = min(int(layout.local_lengths(torch.tensor(lens)).sum()) for lens in batches.values())
        # (copies of the cache for the batch that reads the fewest bytes, enough for both)
        sets = input_copies(ctx, make, lambda c: kv_read_bytes_of(c[0], fewest, kv_heads, d, dv, v_from_k))
        for name, lens in batches.items():
            seq = torch.tensor(lens, device=ctx.device)
            tokens = int(layout.local_lengths(seq).sum())
            cache, table, q = sets[0]
            nbytes = kv_read_bytes_of(cache, tokens, kv_heads, d, dv, v_from_k)
            call = lambda c, t, q, plan=None: paged_decode_attention(q, c, t, seq, layout=layout, scale=scale,
                                                                     backend="triton", max_seq_len=context, plan=plan)
            planned_us = lambda: step_time(ctx, [lambda c=c, t=t, q=q, p=p: call(c, t, q, p) for (c, t, q), p in
                                                 zip(sets, [plan_paged_decode(q_, c, t, seq, layout=layout)
                                                            for c, t, q_ in sets])])
            cap_us, cap_cols = step_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q) for c, t, q in sets])
            plans = [plan_paged_decode(q_, c, t, seq, layout=layout) for c, t, q_ in sets]
            ours_us, ours_cols = planned_us()
            variants = {}
            runs = RUNS_VARIANT if kind == "mla" and heads % 64 == 0 and cache_dtype == torch.bfloat16 else {}
            for column, change in {**PLAN_VARIANTS, **runs}.items() if ctx.is_cuda else ():
                before = {k: triton_decode.CONFIG[k] for k in change}
                if column in runs and before == change:
                    variants[column] = ours_us
                    continue
                triton_decode.CONFIG.update(change)
                try:
                    variants[column] = planned_us()[0]
                finally:
                    triton_decode.CONFIG.update(before)
            both_us, _ = step_time(ctx, [lambda c=c, t=t, q=q: call(c, t, q, plan_paged_decode(q, c, t, seq,
                                                                                                 layout=layout))
                                         for c, t, q in sets])
            plain, planned = call(cache, table, q), call(cache, table, q, plans[0])
            err = (planned.out - plain.out).abs().max().item()
            matches = err <= 2e-2 * max(plain.out.abs().max().item(), 1e-6)
            if not matches:
                ctx.note(f"mixed lengths {kind} H={heads} {tag} {name}: the planned call differs from the capacity "
                         f"plan's by {err:.3g}")
            flash_cols = {}
            if flash is not None and kind == "mla" and cache_dtype == torch.bfloat16:
                from megapar.launch.bench.flashmla import FlashMLADecode

                lens_local = layout.local_lengths(seq).to(torch.int32)
                runs = [FlashMLADecode(flash, scale) for _ in sets]
                for run_, (c, t, q_) in zip(runs, sets):      # (its plan made outside the graph, as ours)
                    run_(q_, c.k, t, lens_local)
                f_us, f_cols = step_time(ctx, [lambda r=r, c=c, t=t, q=q: r(q, c.k, t, lens_local)
                                               for r, (c, t, q) in zip(runs, sets)])
                flash_cols = {"flashmla_us": f_us, "speedup_vs_flashmla": f_us / ours_us,
                              "flashmla_timing": f_cols["timing"]}
            padded_us = _padded_torch_us(ctx, kind, q, seq, layout, kv_heads, d, dv, scale)
            byte_floor = _floor(nbytes, ceiling)
            flop_floor = _flop_floor_us(ctx, 2.0 * tokens * heads * (d + dv))
            floor = max(byte_floor, flop_floor) if byte_floor and flop_floor else byte_floor
            label = "paged decode kernel" if kind == "gqa" else "MLA absorbed decode kernel"
            ctx.record(f"mixed lengths: {label}, length plan, 1/{n} KV ({tag} cache, B={batch}, {name}, {what})",
                       ours_us, anchor="the same call with the capacity's split plan", anchor_us=cap_us,
                       floor_us=floor, byte_floor_us=byte_floor, flop_floor_us=flop_floor, local_tokens=tokens,
                       speedup_vs_capacity_plan=cap_us / ours_us, plan_and_call_us=both_us,
                       capacity_plan_timing=cap_cols["timing"], max_abs_diff=err, matches=matches,
                       padded_torch_us=padded_us, speedup_vs_padded_torch=padded_us / ours_us,
                       **ours_cols, **variants, **flash_cols)
            del plans, cache, table, q
        del sets
    _note_graph_timing(ctx)


def _padded_torch_us(ctx: BenchContext, kind: str, q: torch.Tensor, seq: torch.Tensor, layout: DCPLayout,
                     kv_heads: int, d: int, dv: int, scale: float) -> float:
    """The mixed rows' plain-torch anchor: the call a user would write over a contiguous KV of the
    batch (q [B, Hq, D]), padded to its longest local length and masked past each sequence's own,
    timed as the decode anchors are (`step_time` over `input_copies`)."""
    local = layout.local_lengths(seq)
    pad = int(local.max())
    held = torch.arange(pad, device=q.device)[None, :] < local[:, None]            # [B, pad]
    dtype = torch.bfloat16 if ctx.is_cuda else q.dtype
    kvs = input_copies(ctx, lambda: [torch.randn(q.shape[0], kv_heads, pad, d, device=q.device, dtype=dtype)
                                     for _ in range(1 + (kind == "gqa"))],
                       lambda kv: sum(t.numel() * t.element_size() for t in kv))
    qc = q.to(dtype)
    if kind == "gqa":
        fns = [lambda kc=kc, vc=vc: _sdpa_contiguous(qc.unsqueeze(2), kc, vc, key_mask=held) for kc, vc in kvs]
    else:
        hidden = ~held[:, None, :]
        fns = [lambda kc=kc: _mla_torch_contiguous(qc, kc[:, 0], dv, scale, hidden) for kc, in kvs]
    return step_time(ctx, fns)[0]


def _flashmla_anchor(ctx: BenchContext):
    """FlashMLA's dense decode (`launch.bench.flashmla`) where MEGAPAR_FLASHMLA_SRC names its source
    on a CUDA run, else None; a failed build is noted and leaves its columns out."""
    from megapar.launch.bench import flashmla

    if not ctx.is_cuda or not os.environ.get(flashmla.ENV):
        return None
    try:
        module = flashmla.load_from_env()
    except Exception as exc:  # (a compiler's log: the note keeps its end)
        ctx.note(f"FlashMLA anchor: the build from ${flashmla.ENV} failed, its columns are left out: "
                 f"{type(exc).__name__}: ...{str(exc)[-600:]}")
        return None
    ctx.note(f"flashmla_* columns (MLA bf16 rows): FlashMLA's dense sm90 decode (deepseek-ai/FlashMLA "
             f"{flashmla.FLASHMLA_COMMIT}, the split-KV kernel and its combine; its split plan made once outside the "
             "graph, as its Python interface does) over the same paged latent cache, block table and this rank's "
             "lengths, timed like ours (graph x10 over the same input copies); flashmla_fixed_us over one page per "
             "rank; speedup_vs_flashmla = flashmla_us / time_us; flashmla_matches: FlashMLA's result equals ours "
             "(max |out diff| <= 2% of max |out|, lse within 1e-2). FlashMLA's sm90 dense decode has no fp8 cache: "
             "no fp8 columns.")
    return module


def flashmla_columns(ctx: BenchContext, module, sets, layout: DCPLayout, seq: torch.Tensor,
                     short: torch.Tensor, scale: float, ours_state, ours_us: float) -> dict:
    """The FlashMLA anchor's columns of an MLA bf16 decode row (see `_flashmla_anchor`'s note):
    FlashMLA over each input set (c: the latent `PagedKVCache`, t: its table, q [B, H, 576]) with
    this rank's lengths of `seq`, checked against our result `ours_state` (out, lse) on the first set
    (our call took `ours_us`): flashmla_matches (out within 2% of its largest value, lse within
    1e-2: a dropped page moves the lse by more); its fixed part over the lengths `short`. A mismatch
    is noted: the anchor's time is then no comparison (our kernel has its own GPU tests)."""
    from megapar.launch.bench.flashmla import FlashMLADecode

    lens, lens_short = (layout.local_lengths(x).to(torch.int32) for x in (seq, short))
    run, run_short = FlashMLADecode(module, scale), FlashMLADecode(module, scale)
    cache, table, q = sets[0]
    out, lse = run(q, cache.k, table, lens)                 # (plans the splits: outside the timed calls)
    run_short(q, cache.k, table, lens_short)
    err = (out.float() - ours_state.out).abs().max().item()
    lse_err = (lse.reshape(ours_state.lse.shape) - ours_state.lse).abs().max().item()
    ok = err <= 0.02 * ours_state.out.abs().max().item() and lse_err <= 1e-2
    if not ok:
        ctx.note(f"FlashMLA's result differs from ours (max |out diff| {err:.3g}, max |lse diff| {lse_err:.3g}) on "
                 f"a row of {tuple(q.shape)} queries: its columns there are no comparison")
    us, cols = step_time(ctx, [lambda c=c, t=t, q=q: run(q, c.k, t, lens) for c, t, q in sets])
    fixed_us, fixed_cols = step_time(ctx, [lambda: run_short(q, cache.k, table, lens_short)])
    return {"flashmla_us": us, "speedup_vs_flashmla": us / ours_us, "flashmla_timing": cols["timing"],
            "flashmla_replay_us": cols.get("replay_us"), "flashmla_fixed_us": fixed_us,
            "flashmla_fixed_timing": fixed_cols["timing"], "flashmla_max_abs_diff": err,
            "flashmla_max_lse_diff": lse_err, "flashmla_matches": ok}


def flashmla_columns_or_note(ctx: BenchContext, where: str, module, sets, layout: DCPLayout, seq: torch.Tensor,
                             short: torch.Tensor, scale: float, ours: Callable[[], Any], ours_us: float) -> dict:
    """`flashmla_columns` with our state from `ours()`; where either fails, a note naming the row
    (`where`) and no columns: an anchor's failure leaves its columns out, not the row."""
    try:
        return flashmla_columns(ctx, module, sets, layout, seq, short, scale, ours(), ours_us)
    except Exception as exc:  # noqa: BLE001 - said in the note
        ctx.note(f"FlashMLA anchor, {where}: {type(exc).__name__}: {str(exc)[-400:]}; its columns are left out of "
                 "that row")
        return {}


SPECULATIVE = (("gqa", 32, 2), ("gqa", 32, 4), ("gqa", 32, 8), ("mla", 16, 2), ("mla", 16, 3), ("mla", 128, 2))
"""The speculative rows: (kind, query heads, new tokens a sequence)."""


def _speculative_rows(ctx: BenchContext, batch: int = 32, context: int = 32768, n: int = 4, block: int = 64) -> None:
    """Speculative decode (MTP / draft verification: Tq new tokens a sequence, each causal over the
    global positions): GQA (Hq 32, Hkv 4) at Tq = 2, 4 and 8 and MLA with 16 heads at Tq = 2 and 3 and
    128 heads at Tq = 2, bf16 and fp8 caches, rank 0's 1/N of the paged KV, against the decode rows'
    anchors given the tokens' mask (SDPA with the kv head's query heads folded into its rows; torch
    absorbed MLA). The KV
    bytes are one token's, so floor_us is the decode rows' floor; the issue's targets are for Tq = 1
    (none is recorded here). Runs anywhere (the torch path off CUDA: the CPU test's small sizes)."""
    from megapar.parallel.cp.mla import MLADims
    from megapar.parallel.cp.paged import paged_decode_attention

    ceiling = copy_ceiling_gbps(ctx.device)
    backend = "triton" if ctx.is_cuda else "torch"
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    dims = MLADims()
    layout = DCPLayout(size=n, rank=0, block_size=block)
    local = int(layout.local_lengths(context))
    seq = torch.full((batch,), context, device=ctx.device)
    for kind, heads, tokens in SPECULATIVE:
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            if kind == "gqa":
                kv_heads, d, dv, scale, v_from_k = 4, 128, 128, 128 ** -0.5, False
                what = f"Hq={heads}, Hkv={kv_heads}"

                def make_cache():
                    return _decode_setup(batch, context, heads, kv_heads, d, block, n, ctx.device, cache_dtype)[:2]
            else:
                kv_heads, d, dv, scale, v_from_k = 1, dims.latent_dim, dims.kv_lora_rank, dims.scale, True
                what = f"MLA H={heads}, latent {d}"

                def make_cache():
                    latent, table = _mla_decode_setup(batch, context, dims, block, n, ctx.device, cache_dtype)
                    return latent.paged, table

            def make():
                return (*make_cache(), torch.randn(batch, tokens, heads, d, device=ctx.device, dtype=dtype))

            def ours(c, t, q, lens=seq):
                return paged_decode_attention(q, c, t, lens, layout=layout, scale=scale, backend=backend,
                                              max_seq_len=context)
            sets = input_copies(ctx, make, lambda c: kv_read_bytes_of(c[0], batch * local, kv_heads, d, dv, v_from_k))
            nbytes = kv_read_bytes_of(sets[0][0], batch * local, kv_heads, d, dv, v_from_k)
            variants = row_variants(kind, heads, cache_dtype == torch.float8_e4m3fn, tokens)
            ours_us, ours_cols = _decode_time(ctx, [lambda c=c, t=t, q=q: ours(c, t, q) for c, t, q in sets], variants)
            cache, table, q = sets[0]
            short = torch.full_like(seq, n * block)
            fixed_us, fixed_cols = _decode_time(ctx, [lambda: ours(cache, table, q, short)], variants)
            del sets
            mask = speculative_mask(layout, local, tokens, context, ctx.device)
            kvs = input_copies(ctx, lambda: [torch.randn(batch, kv_heads, local, d, device=ctx.device, dtype=dtype)
                                             for _ in range(1 + (kind == "gqa"))],
                               lambda kv: sum(t.numel() * t.element_size() for t in kv))
            if kind == "gqa":
                anchor = "SDPA with the tokens' mask, contiguous KV of the same tokens"
                q_heads = q.transpose(1, 2).contiguous()                     # [B, Hq, Tq, D], as SDPA takes it
                row_mask = mask.repeat(heads // kv_heads, 1)
                anchor_us, anchor_cols = step_time(ctx, [lambda kc=kc, vc=vc: _sdpa_contiguous(q_heads, kc, vc,
                                                                                               row_mask)
                                                         for kc, vc in kvs])
            else:
                anchor = "torch absorbed MLA with the tokens' mask, contiguous latent of the same tokens"
                rows, hidden = q.reshape(batch, tokens * heads, d), ~mask.repeat_interleave(heads, 0)
                anchor_us, anchor_cols = step_time(ctx, [lambda kc=kc: _mla_torch_contiguous(rows, kc[:, 0], dv, scale,
                                                                                             hidden)
                                                         for kc, in kvs])
            del kvs
            byte_floor = _floor(nbytes, ceiling)
            flop_floor = _flop_floor_us(ctx, 2.0 * batch * local * heads * tokens * (d + dv))
            floor = max(byte_floor, flop_floor) if byte_floor and flop_floor else byte_floor
            tag = str(cache_dtype).replace("torch.", "")
            ctx.record(f"speculative decode Tq={tokens} over 1/{n} KV ({tag} cache, B={batch}, L={context}, {what})",
                       ours_us, anchor=anchor, anchor_us=anchor_us, floor_us=floor, byte_floor_us=byte_floor,
                       flop_floor_us=flop_floor, anchor_timing=anchor_cols["timing"],
                       anchor_replay_us=anchor_cols.get("replay_us"), anchor_input_sets=anchor_cols["input_sets"],
                       fixed_us=fixed_us, **ours_cols, **_fixed_variants(fixed_cols))
            del cache, table, q


def _mla_prep_rows(ctx: BenchContext) -> None:
    """Fused MLA prep (one kernel) against the unfused torch sequence at T = 1, 16, 64, 256 new tokens
    (H 128, bf16 inputs, bf16 and fp8 caches); floor = the bytes read (q, kv) and written (q, the
    latent row and its fp8 scale) at the copy ceiling (target >= 60% of it at 256 tokens, >= 3x).
    Calls take their inputs from `input_sets` copies in turn, so none is read from L2."""
    from megapar.parallel.cp.mla import MLACache, MLADims
    from megapar.parallel.cp.mla_prep import mla_prep, rope_table

    ceiling = copy_ceiling_gbps(ctx.device)
    dims, heads = MLADims(), 128
    for tokens in (1, 16, 64, 256):
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            tag = str(cache_dtype).replace("torch.", "")
            cache = MLACache.allocate(tokens // 64 + 64, 64, dims, dtype=cache_dtype, device=ctx.device)
            moved = (2 * tokens * heads * dims.qk_head_dim * 2 + tokens * dims.latent_dim * 2
                     + tokens * (dims.latent_dim * cache.kv.element_size() + (4 if cache.scale is not None else 0)))
            # several input sets, taken in turn, so that consecutive calls (graph_time captures ten
            # of a short call in one graph) find their inputs in DRAM, not in the L2 the previous
            # call left them in: at least 3x the L2 between two uses of a set
            sets = l2_sets(ctx, moved)
            qs = [torch.randn(tokens, heads, dims.qk_head_dim, device=ctx.device, dtype=torch.bfloat16)
                  for _ in range(sets)]
            kvs = [torch.randn(tokens, dims.latent_dim, device=ctx.device, dtype=torch.bfloat16) for _ in range(sets)]
            pos = torch.arange(tokens, device=ctx.device)
            table = torch.arange(cache.kv.shape[0], device=ctx.device, dtype=torch.int32).expand(tokens, -1)
            cos_sin = rope_table(max(tokens, 64), dims.qk_rope_head_dim, device=ctx.device)
            w_kv = torch.ones(dims.kv_lora_rank, device=ctx.device)
            def calls(b: str) -> list:
                return [lambda i=i: mla_prep(qs[i], kvs[i], pos, cache, table, cos_sin, w_kv, backend=b)
                        for i in range(sets)]
            ours_us, cols = step_time(ctx, calls("triton"))    # decode: ten calls a graph, the sets in turn
            # the unfused sequence as a graph replays it too (its cache write took a boolean mask, a
            # host sync that failed the capture, until 2026-12-05: it was timed eager, launches
            # included); eager kept beside it
            torch_eager_us = ctx.time_fn(calls("torch")[0])
            torch_us, anchor_cols = step_time(ctx, calls("torch"))
            ctx.record(f"fused MLA prep T={tokens} H={heads} ({tag} cache)", ours_us, anchor="unfused torch sequence",
                       anchor_us=torch_us, floor_us=moved / (ceiling * 1e3), bytes_moved=moved, target_fraction=0.60,
                       target_speedup=3.0, **cols, anchor_timing=anchor_cols["timing"], anchor_eager_us=torch_eager_us)
            del cache, qs, kvs


def run(ctx: BenchContext) -> None:
    """MEGAPAR_BENCH_CP_SECTIONS (comma list of ring, dcp, decode, mixed, multi; default all) picks sections."""
    sections = set(os.environ.get("MEGAPAR_BENCH_CP_SECTIONS", "ring,dcp,decode,mixed,multi").split(","))
    if "ring" in sections:
        _ring_compute(ctx)
    with torch.no_grad():
        if "dcp" in sections:
            _dcp_breakdown(ctx)
        if "decode" in sections:
            if ctx.is_cuda and not ctx.quick:
                _paged_decode_rows(ctx)
                _speculative_rows(ctx)
                _mla_prep_rows(ctx)
            else:
                ctx.note("paged decode kernel, MLA decode and fused MLA prep rows run on CUDA only")
        if "mixed" in sections:
            if ctx.is_cuda and not ctx.quick:
                _mixed_length_rows(ctx)
            else:
                ctx.note("the mixed-length decode rows run on CUDA only")
    if "multi" in sections:
        _multi_gpu(ctx)


def main(argv: list[str] | None = None) -> int:
    from megapar.launch.bench.decode_probe import probe

    return probe_main("cp", __doc__, probe, "decode-tuning.json", argv)


if __name__ == "__main__":
    sys.exit(main())
