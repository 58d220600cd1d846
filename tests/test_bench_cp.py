"""`megapar bench cp`'s speculative-decode rows: their anchors (SDPA with the kv head's query heads
folded into its rows, torch absorbed MLA) given the tokens' mask compute what the paged decode
reference computes over the same tokens, and the rows run end to end at small CPU sizes."""

from __future__ import annotations

import math

import pytest
import torch

from launch.bench.common import BenchContext
from megapar.launch.bench import cp as bench_cp
from megapar.parallel.cp.dcp import DCPLayout, gather_local_kv
from megapar.parallel.cp.paged import paged_decode_attention


@pytest.mark.parametrize("size,rank,block,interleave", [(1, 0, 16, 1), (4, 0, 16, 1), (4, 3, 16, 4),
                                                         (3, 1, 8, 2), (8, 5, 64, 16)])
def test_global_positions_invert_the_slot_mapping(size, rank, block, interleave):
    layout = DCPLayout(size=size, rank=rank, block_size=block, interleave=interleave)
    length = 5 * block * size + 7                     # a partial last virtual block
    blocks = -(-length // (block * size))
    table = torch.randperm(3 * blocks)[:blocks]       # any physical blocks, in table order
    positions = torch.arange(length)
    slots = layout.slot_mapping(positions, table)
    mine = positions[slots >= 0]
    # this rank's tokens in cache order: by block in table order, then offset in the block
    order = torch.tensor([(int((table == s // block).nonzero()), s % block) for s in slots[slots >= 0].tolist()])
    in_cache_order = mine[torch.argsort(order[:, 0] * block + order[:, 1])]
    assert int(layout.local_lengths(length)) == len(mine)
    assert torch.equal(layout.global_positions(torch.arange(len(mine))), in_cache_order)


def _contiguous(cache, table, seq, layout):
    """The rank's tokens of each sequence as the anchors read them: [S, Hkv, L, D], [S, Hkv, L, Dv]."""
    k, v, valid = gather_local_kv(cache, table, layout.local_lengths(seq))
    assert bool(valid.all())                          # equal lengths: no padding
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


@pytest.mark.parametrize("tokens,rank,interleave", [(2, 0, 1), (4, 3, 1), (3, 1, 4)])
def test_gqa_anchor_with_the_tokens_mask_is_the_reference(tokens, rank, interleave):
    torch.manual_seed(tokens * 10 + rank)
    batch, context, heads, kv_heads, d, block, n = 3, 8 * 16 * 4 + 5, 8, 2, 32, 16, 4
    layout = DCPLayout(size=n, rank=rank, block_size=block, interleave=interleave)
    per_seq = -(-context // (block * n))
    table = torch.randperm(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    cache = bench_cp.PagedKVCache.allocate(batch * per_seq, block, kv_heads, d, dtype=torch.float32)
    for s in range(batch):
        positions = torch.arange(context)
        bench_cp.write_kv_slots(cache, torch.randn(context, kv_heads, d), torch.randn(context, kv_heads, d),
                                layout.slot_mapping(positions, table[s]))
    seq = torch.full((batch,), context)
    q = torch.randn(batch, tokens, heads, d)
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch")
    k, v = _contiguous(cache, table, seq, layout)
    mask = bench_cp.speculative_mask(layout, k.shape[2], tokens, context)
    assert not bool(mask.all()) and bool(mask[-1].all())    # each case's rank holds a token the first can't see
    rows = mask.repeat(heads // kv_heads, 1)                          # (rows: head in group, token)
    out = bench_cp._sdpa_contiguous(q.transpose(1, 2).contiguous(), k, v, rows)      # [B, Hq, Tq, D]
    torch.testing.assert_close(out.transpose(1, 2), ref.out, rtol=1e-5, atol=1e-5)
    # and without the mask it is a different answer (the mask is doing something)
    unmasked = bench_cp._sdpa_contiguous(q.transpose(1, 2).contiguous(), k, v, torch.ones_like(rows))
    assert not torch.allclose(unmasked.transpose(1, 2), ref.out, atol=1e-4)


def test_mla_anchor_with_the_tokens_mask_is_the_reference():
    from megapar.parallel.cp.mla import MLADims

    torch.manual_seed(7)
    dims, batch, heads, tokens, block, n = MLADims(), 2, 4, 2, 16, 4
    context = 3 * block * n + 1                       # the newest tokens: positions 191, 192 (rank 0 holds 192)
    layout = DCPLayout(size=n, rank=0, block_size=block)
    latent, table = bench_cp._mla_decode_setup(batch, context, dims, block, n, torch.device("cpu"), torch.float32)
    seq = torch.full((batch,), context)
    q = torch.randn(batch, tokens, heads, dims.latent_dim)
    ref = paged_decode_attention(q, latent.paged, table, seq, layout=layout, scale=dims.scale, backend="torch")
    k, _ = _contiguous(latent.paged, table, seq, layout)
    mask = bench_cp.speculative_mask(layout, k.shape[2], tokens, context)
    assert mask.tolist()[0][-1] is False and bool(mask[1].all())     # token 0 does not see position 192
    out = bench_cp._mla_torch_contiguous(q.reshape(batch, tokens * heads, -1), k[:, 0], dims.kv_lora_rank,
                                         dims.scale, ~mask.repeat_interleave(heads, 0))
    torch.testing.assert_close(out.view(batch, tokens, heads, -1), ref.out, rtol=1e-5, atol=1e-5)


def test_speculative_rows_run_at_small_sizes_on_cpu():
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    bench_cp._speculative_rows(ctx, batch=2, context=16 * 4 * 3 + 9, n=4, block=16)
    assert len(ctx.rows) == 2 * len(bench_cp.SPECULATIVE)
    for (kind, heads, tokens), row in zip([s for s in bench_cp.SPECULATIVE for _ in range(2)], ctx.rows):
        assert f"Tq={tokens}" in row["case"] and (kind == "gqa") == ("Hkv" in row["case"])
        assert math.isfinite(row["time_us"]) and math.isfinite(row["anchor_us"]) and row["time_us"] > 0
        assert math.isfinite(row["fixed_us"])


@pytest.mark.parametrize("flops_per_us", [1e4, 1e6])
def test_dcp_breakdown_floor_is_the_longer_of_kv_bytes_and_flops(monkeypatch, flops_per_us):
    """Section 2's roofline, as section 4's: the KV bytes the rank reads at the copy ceiling or the
    attention FLOPs (q.k over the key width and p.v over the value width, per query head and token)
    at the matmul rate, whichever is longer. Off CUDA neither floor exists, so both are stood in for:
    the bytes without the device check, the FLOPs at `flops_per_us` (1e4: compute-bound, 1e6: bytes)."""
    from megapar.parallel.cp.mla import MLADims

    monkeypatch.setattr(bench_cp, "kv_read_bytes_of", lambda cache, tokens, kv_heads, d, dv, v_from_k:
                        tokens * kv_heads * (d + (0 if v_from_k else dv)) * cache.k.element_size())
    monkeypatch.setattr(bench_cp, "_flop_floor_us", lambda ctx, flops: flops / flops_per_us)
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    with torch.no_grad():
        bench_cp._dcp_breakdown(ctx)
    # the --quick sizes of the section, fp32 caches (4 bytes), copy ceiling 10 GB/s off CUDA
    batch, context, heads, kv_heads, d = 2, 256, 4, 1, 16
    dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    mla_heads, gbps = 2, bench_cp.copy_ceiling_gbps(torch.device("cpu"))
    shapes = {"gqa": (heads, kv_heads * 2 * d * 4, d, d),                       # k and v of each kv head
              "mla": (mla_heads, (dims.kv_lora_rank + dims.qk_rope_head_dim) * 4,  # one latent row
                      dims.kv_lora_rank + dims.qk_rope_head_dim, dims.kv_lora_rank)}
    rows = [r for r in ctx.rows if r["case"].startswith("dcp decode")]
    assert len(rows) == 2 * 3
    for row in rows:
        kind = "gqa" if " gqa " in row["case"] else "mla"
        n = 1 if "full KV" in row["case"] else int(row["case"].split("over 1/")[1].split(" ")[0])
        hq, bytes_per_token, dk, dv = shapes[kind]
        tokens = batch * context // n                                # rank 0's share, every sequence
        byte_floor = tokens * bytes_per_token / (gbps * 1e3)
        flop_floor = 2 * tokens * hq * (dk + dv) / flops_per_us
        assert row["floor_us"] == pytest.approx(max(byte_floor, flop_floor), abs=1e-3), row["case"]
        assert row["byte_floor_us"] == pytest.approx(byte_floor, abs=1e-3), row["case"]
        assert row["flop_floor_us"] == pytest.approx(flop_floor, abs=1e-3), row["case"]
        if n > 1:
            full = next(r for r in rows if r["case"].startswith(f"dcp decode {kind} full"))
            assert row["anchor_us"] == full["time_us"]
            assert row["work_ratio_local_x_n_over_full"] == pytest.approx(
                row["time_us"] * n / full["time_us"], rel=1e-3, abs=1e-3)


def test_dcp_local_rows_time_the_full_kv_again_right_after_them(monkeypatch):
    """Each local row times the full-KV call again right after its own (full_again_us; the clock drifts
    under a long load, and a full-KV time taken minutes before moves the ratio) and gives its ratio to
    that time (work_ratio_over_full_again). A stand-in step_time returns 1000 + the DCP size of the call it
    timed, so each column names the call behind it."""
    import megapar.parallel.cp.paged as paged

    sizes, real = [], paged.paged_decode_attention
    monkeypatch.setattr(paged, "paged_decode_attention",
                        lambda *a, layout=None, **kw: sizes.append(layout.size) or real(*a, layout=layout, **kw))

    def stand_in(ctx, fns, **kw):
        sizes.clear()
        fns[0]()
        return 1000.0 + sizes[-1], {"timing": "stand-in", "input_sets": len(fns)}
    monkeypatch.setattr(bench_cp, "step_time", stand_in)
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    with torch.no_grad():
        bench_cp._dcp_breakdown(ctx)
    local = [r for r in ctx.rows if r["case"].startswith("dcp decode") and "full KV" not in r["case"]]
    assert len(local) == 4
    for row in local:
        n = int(row["case"].split("over 1/")[1].split(" ")[0])
        assert row["time_us"] == 1000 + n and row["full_again_us"] == 1001
        assert row["work_ratio_over_full_again"] == pytest.approx((1000 + n) * n / 1001, abs=1e-4)


def test_dcp_breakdown_times_the_merges_a_rank_runs(monkeypatch):
    """The combine's merge as one rank of N runs it: the a2a form merges the N ranks' partials of its
    own hq / N heads (it timed all hq heads: N times a rank's work, 38 against ~5 µs at N = 8 for
    MLA's 128 heads); the ag_rs form rescales the rank's local o over every head it attended."""
    real_merge, real_rescale = bench_cp.merge_attn_states, bench_cp.rescale_to_merged
    merged, combined = [], []
    monkeypatch.setattr(bench_cp, "merge_attn_states",
                        lambda o, lse: merged.append(tuple(o.shape)) or real_merge(o, lse))
    monkeypatch.setattr(bench_cp, "rescale_to_merged",
                        lambda o, lses, i: combined.append((len(lses), tuple(o.shape[:-1]))) or real_rescale(o, lses, i))
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    with torch.no_grad():
        bench_cp._dcp_breakdown(ctx)
    rows = [r for r in ctx.rows if r["case"].startswith("dcp decode") and "over 1/" in r["case"]]
    want_merged, want_combined = set(), set()
    for row in rows:
        n = int(row["case"].split("over 1/")[1].split(" ")[0])
        # the section's --quick sizes: GQA 4 heads of 16 dims, MLA 2 heads over a 32-wide latent
        hq, dv = (4, 16) if " gqa " in row["case"] else (2, 32)
        want_merged.add((n, 2, max(1, hq // n), dv))
        want_combined.add((n, (2, hq)))
        # a rank's whole work between ag_rs's collectives, both forms: the splits merged, then rescaled,
        # or (unmerged, `rescale_parts_to_merged`) both in one kernel
        assert row["ag_rs_step_us"] > 0 and row["ag_rs_fused_us"] > 0 and row["splits"] >= 1, row
    for row in ctx.rows:      # the one-GPU rows: the out in q's dtype, cast after the call or written by it
        if row["case"].startswith("dcp decode") and " full KV " in row["case"]:
            assert row["cast_out_us"] > 0 and row["q_dtype_out_us"] > 0, row
    assert want_merged <= set(merged) and want_combined <= set(combined)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kv_read_floor_is_the_bytes_a_token_holds_in_the_cache(kind, cache_dtype):
    """The decode rows' byte floor (`kv_read_bytes_of`, with the arguments the rows pass), checked
    against the cache itself: per token, the bytes of each distinct tensor it lives in (GQA: k, v
    and with fp8 their two fp32 scales per kv head; MLA: the one latent row, k and v being views
    of it, and its one scale). The rows' shapes by hand too: GQA Hkv 4 D 128: 2048 B bf16, 1056 B
    fp8; MLA latent 576: 1152 B bf16, 580 B fp8."""
    from types import SimpleNamespace

    from megapar.parallel.cp.mla import MLADims

    batch, context, block, n = 2, 4 * 16 * 2, 16, 4
    if kind == "gqa":
        kv_heads, d, dv, v_from_k = 2, 16, 16, False
        cache, _, _, _ = bench_cp._decode_setup(batch, context, 4, kv_heads, d, block, n, torch.device("cpu"),
                                                cache_dtype)
    else:
        dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
        kv_heads, d, dv, v_from_k = 1, dims.latent_dim, dims.kv_lora_rank, True
        cache = bench_cp._mla_decode_setup(batch, context, dims, block, n, torch.device("cpu"), cache_dtype)[0].paged
    slots = cache.k.shape[0] * cache.k.shape[1]
    parts = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None}
    per_token = sum(parts.values()) // slots
    on_cuda = SimpleNamespace(k=SimpleNamespace(device=torch.device("cuda"), element_size=cache.k.element_size),
                              is_fp8=cache.is_fp8)          # (the floor exists for CUDA caches only)
    tokens = batch * context // n
    assert bench_cp.kv_read_bytes_of(on_cuda, tokens, kv_heads, d, dv, v_from_k) == tokens * per_token
    assert bench_cp.kv_read_bytes_of(cache, tokens, kv_heads, d, dv, v_from_k) is None       # CPU: none
    full = {("gqa", False): 4 * (128 + 128) * 2, ("gqa", True): 4 * (128 + 128) + 4 * 4 * 2,
            ("mla", False): 576 * 2, ("mla", True): 576 + 4}[(kind, cache.is_fp8)]
    elem = SimpleNamespace(k=SimpleNamespace(device=torch.device("cuda"), element_size=lambda: 1 if cache.is_fp8 else 2),
                           is_fp8=cache.is_fp8)
    args = (4, 128, 128, False) if kind == "gqa" else (1, 576, 512, True)
    assert bench_cp.kv_read_bytes_of(elem, 1000, *args) == 1000 * full


@pytest.mark.parametrize("flops_per_us", [1e2, 1e7])
def test_speculative_floor_is_one_kv_read_or_every_tokens_flops(monkeypatch, flops_per_us):
    """The speculative rows' roofline: the KV is read once for all Tq tokens (bytes: rank 0's share
    of every sequence, k and v per kv head for GQA, one latent row for MLA), the FLOPs are per query
    token and head (q.k over the key width, p.v over the value width); the longer of the two. Off
    CUDA neither exists, so both are stood in for as in the breakdown test (1e2: FLOPs, 1e7: bytes)."""
    from megapar.parallel.cp.mla import MLADims

    monkeypatch.setattr(bench_cp, "kv_read_bytes_of", lambda cache, tokens, kv_heads, d, dv, v_from_k:
                        tokens * kv_heads * (d + (0 if v_from_k else dv)) * cache.k.element_size())
    monkeypatch.setattr(bench_cp, "_flop_floor_us", lambda ctx, flops: flops / flops_per_us)
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    batch, context, n, block = 2, 16 * 4 * 3 + 9, 4, 16
    with torch.no_grad():
        bench_cp._speculative_rows(ctx, batch=batch, context=context, n=n, block=block)
    local = int(DCPLayout(size=n, rank=0, block_size=block).local_lengths(context))
    dims, gbps = MLADims(), bench_cp.copy_ceiling_gbps(torch.device("cpu"))
    for (kind, heads, tokens), row in zip([s for s in bench_cp.SPECULATIVE for _ in range(2)], ctx.rows):
        elem = 2 if "(bfloat16 cache" in row["case"] else 1                # the stand-in counts no scales
        if kind == "gqa":
            per_token, dk, dv = 4 * (128 + 128) * elem, 128, 128          # Hkv 4
        else:
            per_token, dk, dv = dims.latent_dim * elem, dims.latent_dim, dims.kv_lora_rank
        byte_floor = batch * local * per_token / (gbps * 1e3)
        flop_floor = 2 * batch * local * heads * tokens * (dk + dv) / flops_per_us
        assert row["byte_floor_us"] == pytest.approx(byte_floor, abs=1e-3), row["case"]
        assert row["flop_floor_us"] == pytest.approx(flop_floor, abs=1e-3), row["case"]
        assert row["floor_us"] == pytest.approx(max(byte_floor, flop_floor), abs=1e-3), row["case"]


def test_mixed_length_rows_run_and_match_on_cpu(monkeypatch):
    """The mixed-length rows (`_mixed_length_rows`) at small sizes on the CPU (the kernels under the
    interpreter): every kind recorded for both batches, the planned call matching the capacity plan's,
    and the batches as documented (two long among short; log-uniform, seeded)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from megapar.launch.bench.common import BenchContext
    from megapar.parallel.cp import triton_decode

    for key in [k for k in triton_decode.CONFIG if k.startswith(("min_split", "target_programs"))]:
        monkeypatch.setitem(triton_decode.CONFIG, key, 16)
    monkeypatch.setattr(bench_cp, "MIXED_KINDS", (("gqa", 4, torch.float32), ("mla", 2, torch.float32)))
    batches = bench_cp.mixed_batches(4, 2048)
    assert batches["2 x 2K among 2 x 32"] == [2048] * 2 + [32] * 2
    assert all(16 <= n <= 2048 for n in batches["log-uniform 16-2K"])
    assert list(bench_cp.mixed_batches()) == ["2 x 128K among 30 x 2K", "log-uniform 1K-128K"]
    ctx = BenchContext(suite="cp", device=torch.device("cpu"))
    # (one interpreted call a timing: step_time's warm-up call and its timed one each cost seconds here)
    monkeypatch.setattr(bench_cp, "step_time", lambda ctx, fns, **kw: ((fns[0](), 1.0)[1], {"timing": "eager"}))
    bench_cp._mixed_length_rows(ctx, batch=4, context=1024, n=2, block=16)
    assert len(ctx.rows) == 4 and not ctx.wrong
    for row in ctx.rows:
        assert row["matches"] and row["local_tokens"] > 0, row

    assert all(row["padded_torch_us"] > 0 for row in ctx.rows)


def test_the_padded_anchors_equal_each_sequence_alone():
    """The mixed rows' plain-torch anchors over a padded batch with a key mask (`_sdpa_contiguous`
    key_mask, `_mla_torch_contiguous` hidden [B, 1, L]) = each sequence's attention over its own
    keys only, whatever the padding holds."""
    gen = torch.Generator().manual_seed(5)
    lens, b, hq, hkv, d = [7, 1, 12], 3, 4, 2, 8
    q = torch.randn(b, hq, 1, d, generator=gen)
    k, v = (torch.randn(b, hkv, 12, d, generator=gen) for _ in range(2))
    held = torch.arange(12)[None, :] < torch.tensor(lens)[:, None]
    got = bench_cp._sdpa_contiguous(q, k, v, key_mask=held)
    for i, n in enumerate(lens):
        want = torch.nn.functional.scaled_dot_product_attention(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                                                                enable_gqa=True)
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)
    latent = torch.randn(b, 12, 10, generator=gen)
    ql = torch.randn(b, hq, 10, generator=gen)
    got = bench_cp._mla_torch_contiguous(ql, latent, 6, 0.3, ~held[:, None, :])
    for i, n in enumerate(lens):
        s = (ql[i] @ latent[i, :n].T) * 0.3
        torch.testing.assert_close(got[i], torch.softmax(s, -1) @ latent[i, :n, :6], atol=1e-5, rtol=1e-5)


def test_dcp_section_runs_once_per_context_of_the_env_list(monkeypatch):
    """MEGAPAR_BENCH_CP_DCP_CONTEXT as a comma list: the DCP section's rows at each L (full KV and
    every N, both kinds), each local row against the full-KV row of its own L; its note once; a bad
    list is refused with the value named."""
    monkeypatch.setenv("MEGAPAR_BENCH_CP_DCP_CONTEXT", "256,512")
    ctx = BenchContext(suite="cp", device=torch.device("cpu"), quick=True)
    with torch.no_grad():
        bench_cp._dcp_breakdown(ctx)
    rows = [r for r in ctx.rows if r["case"].startswith("dcp decode")]
    assert len(rows) == 2 * 2 * 3          # two lengths x (gqa, mla) x (full, N = 2, 4)
    for length in (256, 512):
        mine = [r for r in rows if f"L={length}," in r["case"]]
        assert len(mine) == 6
        for kind in ("gqa", "mla"):
            full = next(r for r in mine if f" {kind} full KV" in r["case"])
            for r in mine:
                if f" {kind} local" in r["case"]:
                    assert r["anchor_us"] == full["time_us"], r["case"]
    assert sum("dcp breakdown" in note for note in ctx.notes) == 1
    for bad in ("32K", "0", "4096,,8192"):
        monkeypatch.setenv("MEGAPAR_BENCH_CP_DCP_CONTEXT", bad)
        with pytest.raises(ValueError, match="MEGAPAR_BENCH_CP_DCP_CONTEXT"):
            bench_cp.dcp_contexts(32768)
    monkeypatch.delenv("MEGAPAR_BENCH_CP_DCP_CONTEXT")
    assert bench_cp.dcp_contexts(32768) == [32768]


@pytest.mark.parametrize("rows,width,page_bytes,pool_bytes", [(32, 128, 37120, 12 * 2 ** 20), (3, 5, 100, 250),
                                                               (2, 4, 1000, 10 ** 9), (4, 3, 10 ** 9, 100)])
def test_pooled_table_reads_the_same_lengths_from_a_small_pool(rows, width, page_bytes, pool_bytes):
    table = torch.randperm(rows * width * 2, dtype=torch.int32)[: rows * width].view(rows, width)
    pooled = bench_cp.pooled_table(table, page_bytes, pool_bytes)
    pool = max(1, min(table.numel(), pool_bytes // page_bytes))
    assert pooled.shape == table.shape and pooled.dtype == table.dtype
    assert torch.equal(pooled.long(), table.long() % pool)       # every id inside the pool, table order kept
    assert int(pooled.max()) < pool and int(pooled.min()) >= 0
    assert int(pooled.max()) * page_bytes < max(pool_bytes, page_bytes)
    with pytest.raises(ValueError, match="page_bytes must be positive, got 0"):
        bench_cp.pooled_table(table, 0)


def test_a_decode_over_the_pooled_table_reads_the_pool_pages():
    # the pooled call is a valid decode: the torch path over it equals the one over a table that names
    # the pool's pages explicitly
    torch.manual_seed(3)
    layout = DCPLayout(size=2, rank=1, block_size=8)
    cache = bench_cp.PagedKVCache.allocate(40, 8, 2, 16, dtype=torch.float32)
    cache.k.normal_()
    cache.v.normal_()
    table = torch.arange(3 * 10, dtype=torch.int32).view(3, 10)
    seq, q = torch.tensor([150, 3, 97]), torch.randn(3, 4, 16)
    pooled = bench_cp.pooled_table(table, 8 * 2 * 16 * 4 * 2, 7 * 8 * 2 * 16 * 4 * 2)     # 7 pages
    explicit = torch.tensor([[(s * 10 + j) % 7 for j in range(10)] for s in range(3)], dtype=torch.int32)
    got = paged_decode_attention(q, cache, pooled, seq, layout=layout, backend="torch")
    want = paged_decode_attention(q, cache, explicit, seq, layout=layout, backend="torch")
    torch.testing.assert_close(got.out, want.out, rtol=0, atol=0)
    assert not torch.allclose(got.out, paged_decode_attention(q, cache, table, seq, layout=layout,
                                                              backend="torch").out)


@pytest.mark.parametrize("us,l2_us,fixed,ceiling,paced", [
    (70.0, 50.0, 10.0, 3000.0, "reads"),       # DRAM under the ceiling, L2 over it: the reads pace it
    (54.0, 50.0, 10.0, 4264.0, "kernel"),      # from L2 still under the ceiling: the kernel paces it
    (150.0, 160.0, 20.0, 3000.0, "kernel"),    # L2 slower than DRAM (contention) and DRAM under the ceiling
    (51.0, 60.0, 1.0, 3000.0, "reads"),        # DRAM at the ceiling, L2 slower: still the reads
    (5.0, 4.0, 6.0, 3000.0, "kernel")])        # no streamed part left: no rate, nothing says reads
def test_pace_columns_name_what_paces_a_row(us, l2_us, fixed, ceiling, paced):
    nbytes = 150e6
    cols = bench_cp.pace_columns(nbytes, us, l2_us, fixed, ceiling)
    assert cols["paced_by"] == paced and cols["l2_us"] == l2_us
    for key, t in (("streamed_gbps", us), ("l2_streamed_gbps", l2_us)):
        if t > fixed:
            assert cols[key] == pytest.approx(nbytes / ((t - fixed) * 1e-6) / 1e9)
        else:
            assert cols[key] is None
