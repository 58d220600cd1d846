"""The split-KV paged decode kernel (TRITON_INTERPRET=1 on CPU, full size on CUDA) against the
torch reference over gathered pages, and both against attention over the dense KV of each
sequence (tests.helpers.reference_attention) for the DCP shards."""

from __future__ import annotations

import math

import pytest
import torch

from parallel.cp import DCPLayout, PagedKVCache
from parallel.cp.paged import paged_decode_attention
from parallel.cp.state import AttnState
from tests.helpers import check_state, compiled_decode_kernels, fill_paged_cache, mla_paged_cache

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("tq", [1, 4])
def test_kernel_matches_reference_single_rank(hq, hkv, tq):
    lens = [1, 37, 0, 130, 5] if tq == 1 else [4, 37, 130, 9]
    cache, table, layout, ks, vs = fill_paged_cache(lens, hkv, 32, 32, 16, 1, 0, 1, torch.float32, seed=hq * 10 + tq)
    q = torch.randn(len(lens), tq, hq, 32)
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, backend="triton")
    check_state(got, ref, 1e-4)
    # independent check: dense causal attention of the last tq tokens over each sequence
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.isinf(got.lse[i]).all() and (got.lse[i] < 0).all() and (got.out[i] == 0).all()
            continue
        g = hq // hkv
        k = ks[i].repeat_interleave(g, 1)                                  # [n, hq, d]
        v = vs[i].repeat_interleave(g, 1)
        s = torch.einsum("thd,nhd->thn", q[i], k) / math.sqrt(32)
        pos = n - tq + torch.arange(tq)
        s = s.masked_fill(torch.arange(n)[None, None, :] > pos[:, None, None], -math.inf)
        torch.testing.assert_close(got.lse[i], torch.logsumexp(s, -1), atol=1e-4, rtol=0)
        torch.testing.assert_close(got.out[i], torch.einsum("thn,nhd->thd", s.softmax(-1), v), atol=1e-4, rtol=0)


@pytest.mark.parametrize("size,interleave", [(2, 1), (4, 2), (3, 4)])
@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("dcp_constexpr", [0, 1])
def test_kernel_dcp_shards_merge_to_full_attention(size, interleave, tq, dcp_constexpr, monkeypatch):
    """Each rank's kernel output over its shard; the LSE merge of all ranks = dense attention.
    dcp_constexpr: the group size and interleave built into the kernel (CONFIG dcp_constexpr)."""
    from parallel.cp import merge_attn_states, triton_decode

    monkeypatch.setitem(triton_decode.CONFIG, "dcp_constexpr", dcp_constexpr)

    lens = [3, 70, 1, 200] if tq > 1 else [0, 70, 1, 200]
    hq, hkv, d, dv = 8, 2, 32, 16
    q = torch.randn(len(lens), tq, hq, d)
    seq = torch.tensor(lens).clamp(min=tq) if tq > 1 else torch.tensor(lens)
    states = []
    for rank in range(size):
        cache, table, layout, ks, vs = fill_paged_cache(lens, hkv, d, dv, 8, size, rank, interleave, torch.float32, seed=7)
        ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch")
        got = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton")
        check_state(got, ref, 1e-4)
        states.append(got)
    merged = merge_attn_states([s.out for s in states], [s.lse for s in states], backend="torch")
    full_cache, full_table, full_layout, _, _ = fill_paged_cache(lens, hkv, d, dv, 8, 1, 0, 1, torch.float32, seed=7)
    full = paged_decode_attention(q, full_cache, full_table, seq, backend="torch")
    check_state(merged, full, 1e-4)


@pytest.mark.parametrize("size,rank,interleave", [(1, 0, 1), (3, 1, 2), (4, 3, 1)])
def test_speculative_tokens_as_one_token_decodes(size, rank, interleave):
    """`triton_decode._expanded` (CONFIG expand_wide: a speculative step's tokens over full head tiles
    as one-token decodes of lengths L - Tq + 1 + t over the sequence's table row, repeated): the
    causal attention of the step's tokens on every DCP rank, lengths shorter than the step included
    (tokens that see no key: lse -inf, out 0), as the torch path and the kernel over the Tq tokens
    give it (here the interpreted Triton kernel)."""
    from parallel.cp import triton_decode

    lens, tq = [3, 70, 1, 200, 0, 2], 3
    hq, hkv, d, dv = 8, 2, 32, 16
    cache, table, layout, _, _ = fill_paged_cache(lens, hkv, d, dv, 8, size, rank, interleave, torch.float32, seed=11)
    q = torch.randn(len(lens), tq, hq, d, generator=torch.Generator().manual_seed(12))
    seq = torch.tensor(lens, dtype=torch.int32 if size == 3 else torch.int64)
    # (lengths under the step's tokens are refused by validation; unvalidated the kernels give the
    # tokens that see no key lse -inf, and so does the torch path)
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch", validate=False)
    kw = dict(dcp_size=size, dcp_rank=rank, interleave=interleave, capacity=table.shape[1] * 8)
    got = triton_decode._expanded(q, cache.k, cache.v, None, None, table, seq, d ** -0.5, **kw)
    direct = triton_decode.paged_decode_triton(q, cache.k, cache.v, None, None, table, seq, d ** -0.5, **kw)
    check_state(got, ref, 1e-4)
    check_state(got, direct, 1e-4)
    assert torch.isinf(got.lse[4]).all() and torch.isinf(got.lse[5, 0]).all() and (got.out[4] == 0).all()
    # a negative length stays the kernels' bad length (NaN), not a clamped empty one
    # a table in another layout (int64, column-major): the same rows
    other = triton_decode._expanded(q, cache.k, cache.v, None, None, table.long().t().contiguous().t(), seq,
                                    d ** -0.5, **kw)
    check_state(other, got, 0)
    bad = triton_decode._expanded(q, cache.k, cache.v, None, None, table.long(),
                                  torch.tensor([3, 70, 1, 200, 0, -5]), d ** -0.5, **kw)
    assert torch.isnan(bad.lse[5]).all() and torch.equal(bad.lse[:5], got.lse[:5])


def test_kernel_splits_and_fp8_cache(monkeypatch):
    """Long sequences cut into several splits, fp8 cache with per-(token, head) scales."""
    from parallel.cp import triton_decode

    monkeypatch.setitem(triton_decode.CONFIG, "min_split_fp8", 256)   # several splits at these lengths

    lens = [600, 3, 0, 1100]
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, 64, 64, 16, 2, 1, 1, torch.float8_e4m3fn, seed=3)
    assert cache.is_fp8
    q = torch.randn(len(lens), 8, 64)
    seq = torch.tensor(lens)
    settings = triton_decode.launch_settings(64, q.dtype, cache.k.dtype, 4)
    assert settings["min_split"] == 256
    splits, _ = triton_decode.plan_splits(table.shape[1] * 16, len(lens) * 2, settings["block_n"], 256)
    assert splits > 1
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton")
    check_state(got, ref, 1e-4)
    assert torch.isinf(got.lse[2]).all()


@pytest.mark.parametrize("q_dtype,fp8", [(torch.float16, False), (torch.bfloat16, True)], ids=["f16", "bf16-fp8"])
def test_half_partials_are_merged_in_fp32(q_dtype, fp8, monkeypatch):
    """CONFIG half_partials: a call of several splits stores its partials in the query's 16-bit
    dtype and merges them in fp32 (the output stays fp32); one split keeps its fp32 output. Against
    the torch path, and within one rounding of the output's scale of the fp32 partials' result.
    (On the interpreter a bf16 cache is not run: its bf16 dots are wrong there, not on a GPU.)"""
    from parallel.cp import triton_decode

    lens = [600, 3, 0, 1100]
    dtype = torch.float8_e4m3fn if fp8 else q_dtype
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, 64, 64, 16, 2, 1, 1, dtype, seed=21)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(22)).to(q_dtype)
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q.float(), cache, table, seq, layout=layout, backend="torch")
    seen = []
    merge = triton_decode.merge_states_triton
    monkeypatch.setattr(triton_decode, "merge_states_triton",
                        lambda o, lse, **kw: seen.append(o.dtype) or merge(o, lse, **kw))
    for key in ("min_split", "min_split_fp8"):
        monkeypatch.setitem(triton_decode.CONFIG, key, 64)       # several splits at these lengths
    runs = {}
    for half in (0, 1):
        monkeypatch.setitem(triton_decode.CONFIG, "half_partials", half)
        runs[half] = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton")
    assert seen == [torch.float32, q_dtype]
    span = (cache.v.float().abs() * (cache.v_scale[..., None] if fp8 else 1)).amax()
    for half, got in runs.items():
        assert got.out.dtype == torch.float32 and got.lse.dtype == torch.float32
        torch.testing.assert_close(got.lse, ref.lse, atol=2e-2, rtol=0)
        err = (got.out - ref.out).abs().max() / span
        assert err <= (2e-2 if half else 1.5e-2), (half, err)
        assert torch.isinf(got.lse[2]).all() and (got.out[2] == 0).all()
    assert (runs[1].out - runs[0].out).abs().max() <= 2.0 ** -8 * span
    assert not torch.equal(runs[1].out, runs[0].out)        # (the bf16 rounding did happen)
    # one split: no partials to halve, the kernel's fp32 output is the call's
    for key in ("min_split", "min_split_fp8"):
        monkeypatch.setitem(triton_decode.CONFIG, key, 1 << 20)
    seen.clear()
    one = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton")
    assert seen == [] and one.out.dtype == torch.float32
    torch.testing.assert_close(one.out, runs[0].out, atol=2.0 ** -8 * span, rtol=0)


def test_kernel_mla_layout_v_is_prefix_of_k():
    """One latent 'kv head' with k = [c_kv, k_rope] (D = 80 = 64 + 16) and v = c_kv = k[..., :64]."""
    nb, block, lens = 20, 8, [17, 40, 2]
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(nb, block, 1, 80, generator=gen)
    cache = PagedKVCache(kv, kv[..., :64])
    table = torch.randperm(nb, generator=gen)[:3 * 6].view(3, 6).int()
    q = torch.randn(3, 16, 80, generator=gen)
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, scale=0.1, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, scale=0.1, backend="triton")
    check_state(got, ref, 1e-4)


def test_auto_keeps_cpu_on_torch_and_bad_input_raises():
    cache, table, layout, _, _ = fill_paged_cache([5, 9], 2, 16, 16, 4, 1, 0, 1, torch.float32, seed=1)
    q = torch.randn(2, 4, 16)
    seq = torch.tensor([5, 9])
    from parallel.cp.paged import DECODE

    assert DECODE.resolve("auto", device=torch.device("cpu"), dtype=torch.float32, head_dim=16, v_head_dim=16) == "torch"
    bad = table.clone()
    bad[1, 0] = 99
    with pytest.raises(ValueError, match=r"block ids \[99\] outside the cache's \[0, "):
        paged_decode_attention(q, cache, bad, seq, backend="triton")
    with pytest.raises(ValueError, match=r"local lengths \[40\] outside \[0, 12\]"):
        paged_decode_attention(q, cache, table, torch.tensor([5, 40]), backend="triton")
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of the cache's kv heads \(2\)"):
        paged_decode_attention(torch.randn(2, 3, 16), cache, table, seq)
    with pytest.raises(ValueError, match=r"q_len \(9\) must be in \[1, 8\]"):
        paged_decode_attention(torch.randn(2, 9, 4, 16), cache, table, torch.tensor([9, 9]))
    with pytest.raises(ValueError, match="fp8 cache needs k_scale"):
        fp8 = PagedKVCache.allocate(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
        fp8.k_scale = torch.ones(4, 4, 1)
        paged_decode_attention(q, fp8, table, seq)
    with pytest.raises(ValueError, match="seq_lens .* must be >= q_len"):
        paged_decode_attention(torch.randn(2, 4, 4, 16), cache, table, torch.tensor([2, 9]))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype,f16,stage16", [(torch.bfloat16, 0, 0), (torch.float8_e4m3fn, 0, 0),
                                                    (torch.float8_e4m3fn, 1, 0), (torch.float8_e4m3fn, 0, 1),
                                                    (torch.float8_e4m3fn, 1, 1), (torch.float8_e4m3fn, 1, 2)],
                         ids=["bf16", "fp8", "fp8-f16", "fp8-stage1", "fp8-f16-stage1", "fp8-f16-stage2"])
@pytest.mark.parametrize("hq,hkv,d,dv,tq,tma", [(32, 4, 128, 128, 1, 0), (32, 4, 128, 128, 4, 0), (32, 4, 128, 128, 1, 1),
                                               (32, 4, 128, 128, 4, 1), (32, 4, 128, 128, 1, 2), (16, 1, 576, 512, 1, 0),
                                               (128, 1, 576, 512, 2, 0)])
def test_kernel_full_size_on_gpu(cache_dtype, f16, stage16, hq, hkv, d, dv, tq, tma, monkeypatch):
    """The kernel at serving sizes against the torch path; GQA also with its TMA tiles (tma 1: MLA's
    structure options have their own tests) and its whole tiles unmasked (tma 2: CONFIG even); over fp8 with fp16 operands and the tiles staged as
    16-bit (stage16: GQA and MLA's narrow 16-head tiles; 128 heads run the halves kernel, where
    it does not apply)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from parallel.cp import triton_decode     # (after the env: a first import binds its kernels to the mode)

    monkeypatch.setitem(triton_decode.CONFIG, "gluon_gqa_fp8", 0)    # (the Triton kernel's options under test)
    monkeypatch.setitem(triton_decode.CONFIG, "f16_fp8", f16)    # (GQA over fp8: fp16 operands or not)
    monkeypatch.setitem(triton_decode.CONFIG, "f16_wide_narrow", f16)
    monkeypatch.setitem(triton_decode.CONFIG, "stage16_fp8", stage16)
    monkeypatch.setitem(triton_decode.CONFIG, "stage16_wide_narrow", stage16)
    monkeypatch.setitem(triton_decode.CONFIG, "tma", int(tma == 1))   # (GQA's TMA tiles: block_n 64 inside pages of 64)
    monkeypatch.setitem(triton_decode.CONFIG, "tma_fp8", int(tma == 1))
    monkeypatch.setitem(triton_decode.CONFIG, "even", int(tma == 2))
    monkeypatch.setitem(triton_decode.CONFIG, "even_fp8", int(tma == 2))
    if tma == 1:
        monkeypatch.setitem(triton_decode.CONFIG, "block_n_fp8", 64)
    lens = [8192, 1, 0, 3000, 20000, 77]
    lens = [max(n, tq) if n else 0 for n in lens]
    cache, table, layout, _, _ = fill_paged_cache(lens, hkv, d, dv, 64, 4, 2, 1, cache_dtype, seed=11, device="cuda")
    if dv != d:    # MLA: v is the prefix of k
        cache = PagedKVCache(cache.k, cache.k[..., :dv], cache.k_scale, cache.k_scale)
    q = torch.randn(len(lens), tq, hq, d, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, device="cuda")
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch", scale=0.07)
    got = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton", scale=0.07)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(finite, torch.isfinite(got.lse))
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], atol=2e-2, rtol=0)
    torch.testing.assert_close(got.out, ref.out, atol=2e-2, rtol=0)


STRUCTURE = [dict(halves_wide=1), dict(halves_wide=1, tma_wide=1), dict(halves_wide=1, lazy_rescale_wide=1),
             dict(lazy_rescale_wide=1), dict(halves_wide=1, tma_wide=1, lazy_rescale_wide=1)]


@pytest.mark.parametrize("structure", STRUCTURE, ids=lambda s: "+".join(sorted(s)))
@pytest.mark.parametrize("tq", [1, 2])
def test_mla_structure_options_match_reference(structure, tq, monkeypatch):
    """The kernel's MLA structure options (latent in halves, TMA loads, lazy rescale) against the
    torch path, with NaN in every slot past a sequence's length and sequences of 0, short and
    several-split lengths (MLA's min_split 16: many splits, then the LSE merge)."""
    from parallel.cp import triton_decode as td

    monkeypatch.setitem(td.CONFIG, "min_split_wide", 16)
    monkeypatch.setitem(td.CONFIG, "block_n_wide_f32", 16)
    monkeypatch.setitem(td.CONFIG, "block_m_wide_f32", 16)
    for key, value in structure.items():
        monkeypatch.setitem(td.CONFIG, key, value)
    lens = [33, 0, 5, 16] if tq == 1 else [33, 2, 5, 16]
    cache, table = mla_paged_cache(lens, 16, torch.float32, seed=3 + tq)
    q = torch.randn(len(lens), tq, 4, 576) * 0.2
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, scale=0.05, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, scale=0.05, backend="triton")
    assert torch.isfinite(got.out).all()
    check_state(got, ref, 1e-4)
    if lens[1] == 0:
        assert torch.isinf(got.lse[1]).all() and (got.out[1] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("structure", STRUCTURE, ids=lambda s: "+".join(sorted(s)))
def test_mla_structure_options_on_gpu(cache_dtype, structure, monkeypatch):
    """The MLA structure options at full size (128 heads, 576 / 512, page 64) on the GPU: NaN past
    every sequence's end, lengths that end inside a tile, one empty sequence, several splits."""
    td = compiled_decode_kernels(monkeypatch)
    for key, value in structure.items():
        monkeypatch.setitem(td.CONFIG, key, value)
    lens = [3000, 0, 77, 1, 640]
    cache, table = mla_paged_cache(lens, 64, cache_dtype, seed=9, device="cuda")
    q = torch.randn(len(lens), 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, device="cuda")
    ref = paged_decode_attention(q, cache, table, seq, scale=0.07, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, scale=0.07, backend="triton")
    assert torch.isfinite(got.out).all()
    finite = torch.isfinite(ref.lse)
    assert torch.equal(finite, torch.isfinite(got.lse)) and not finite[1].any()
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], atol=2e-2, rtol=0)
    torch.testing.assert_close(got.out, ref.out, atol=2e-2, rtol=0)


@pytest.mark.parametrize("q_exp,tq,d", [(0, 2, 80), (-60, 1, 64), (70, 2, 80)])
def test_kernel_fp8_cache_f16_operands(monkeypatch, q_exp, tq, d):
    """CONFIG f16_fp8: bf16 queries scaled into fp16 by a power of two, fp16 weights over the
    running per-row maximum. Value scales spread over 2^-40..2^40 per token (weights that fp16
    could not hold as p * v_scale), keys' over 2^-20..2^20, queries at 2^q_exp; a rest dim
    (d = 80 = 64 + 16) with Tq = 2; an empty sequence; several splits."""
    from parallel.cp import triton_decode

    monkeypatch.setitem(triton_decode.CONFIG, "min_split_fp8", 64)
    monkeypatch.setitem(triton_decode.CONFIG, "f16_fp8", 1)
    monkeypatch.setitem(triton_decode.CONFIG, "maxnreg_fp8", 168)     # (a launch option; the interpreter drops it)
    lens = [300, 2, 0, 190]
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, d, 64, 16, 1, 0, 1, torch.float8_e4m3fn, seed=11 + d)
    gen = torch.Generator().manual_seed(q_exp + 100)
    cache.v_scale.mul_(torch.exp2(torch.randint(-40, 41, cache.v_scale.shape, generator=gen).float()))
    cache.k_scale.mul_(torch.exp2(torch.randint(-20, 21, cache.k_scale.shape, generator=gen).float()) / 2 ** 10)
    q = (torch.randn(len(lens), tq, 8, d, generator=gen) * 2.0 ** q_exp).to(torch.bfloat16)
    seq = torch.tensor(lens).clamp(min=tq) if tq > 1 else torch.tensor(lens)   # (Tq queries need Tq tokens)
    settings = triton_decode.launch_settings(d, q.dtype, cache.k.dtype, tq * 4)
    assert settings["f16"] == 1
    ref = paged_decode_attention(q.float(), cache, table, seq, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, backend="triton")
    # error bound: fp16 weights (2^-11 of each, 2^-25 of the row's largest in subnormals) against
    # the output's scale, the largest |v * v_scale| a row can weigh
    span = (cache.v.float().abs() * cache.v_scale[..., None]).amax()
    torch.testing.assert_close(got.lse, ref.lse, atol=2e-3, rtol=2e-5)     # (2^70 queries: scores ~ 1e22)
    assert ((got.out - ref.out).abs() <= 2e-3 * span).all(), (got.out - ref.out).abs().max() / span
    if tq == 1:
        assert torch.isinf(got.lse[2]).all() and (got.out[2] == 0).all()


@pytest.mark.parametrize("tma,tq", [(0, 1), (1, 2)])
def test_mla_halves_fp8_f16_operands(monkeypatch, tma, tq):
    """CONFIG f16_wide_fp8: MLA's halves kernel over an fp8 latent cache with fp16 operands (bf16
    queries scaled into fp16 by one power of two, weights over the running per-row maximum), with
    per-token scales spread over 2^-30..2^30, NaN past every sequence's end, an empty sequence and
    several splits; 16-row head tiles so the halves kernel runs at interpreter sizes."""
    from parallel.cp import triton_decode as td

    for key, value in (("block_m_wide", 16), ("block_m_wide_fp8", 16), ("block_n_wide_fp8", 16),
                       ("min_split_wide_fp8", 48), ("halves_wide_fp8", 1), ("tma_wide_fp8", tma),
                       ("f16_wide_fp8", 1)):
        monkeypatch.setitem(td.CONFIG, key, value)
    lens = [70, 0, 5, 33] if tq == 1 else [70, 2, 5, 33]
    cache, table = mla_paged_cache(lens, 16, torch.float8_e4m3fn, seed=21 + tq)
    gen = torch.Generator().manual_seed(5 + tq)
    finite = torch.isfinite(cache.k_scale)
    spread = torch.exp2(torch.randint(-30, 31, cache.k_scale.shape, generator=gen).float())
    cache.k_scale.copy_(torch.where(finite, cache.k_scale * spread, cache.k_scale))
    q = (torch.randn(len(lens), tq, 16, 576, generator=gen) * 0.3).to(torch.bfloat16)
    seq = torch.tensor(lens)
    settings = td.launch_settings(576, q.dtype, cache.k.dtype, tq * 16)
    assert (settings["halves"], settings["f16"]) == (1, 1)
    ref = paged_decode_attention(q.float(), cache, table, seq, scale=0.05, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, scale=0.05, backend="triton")
    torch.testing.assert_close(got.lse, ref.lse, atol=2e-3, rtol=2e-5)
    for i, n in enumerate(lens):     # bound against each sequence's largest |value * scale|
        if n == 0:
            continue
        tokens = torch.arange(n)
        blocks = table[i, tokens // 16].long()
        span = (cache.k[blocks, tokens % 16, 0, :512].float().abs() * cache.k_scale[blocks, tokens % 16]).amax()
        err = (got.out[i] - ref.out[i]).abs().max()
        assert err <= 2e-3 * span, (i, err / span)
    if tq == 1:
        assert torch.isinf(got.lse[1]).all() and (got.out[1] == 0).all()


@pytest.mark.parametrize("mla,fp8", [(False, False), (False, True), (True, False)],
                         ids=["gqa", "gqa-fp8-scan", "mla-halves"])
def test_a_length_past_the_splits_reach_is_nan_not_its_first_tokens(mla, fp8, monkeypatch):
    """A CUDA call does not read the lengths on the host: the grid is sized by max_seq_len. A
    sequence longer than the splits reach (splits x split_len) was attention over its first
    tokens, silently; now its out and lse are NaN, and the sequences within reach stay exact."""
    from parallel.cp import triton_decode as td

    reach = []
    plan = td.plan_splits
    monkeypatch.setattr(td, "plan_splits", lambda *a, **kw: reach.append(plan(*a, **kw)) or reach[-1])
    lens = [150, 9]
    if mla:
        monkeypatch.setitem(td.CONFIG, "halves_wide", 1)
        monkeypatch.setitem(td.CONFIG, "block_n_wide_f32", 16)
        monkeypatch.setitem(td.CONFIG, "block_m_wide_f32", 16)
        cache, table = mla_paged_cache(lens, 16, torch.float32, seed=3)
        q = torch.randn(len(lens), 1, 4, 576) * 0.2
    else:
        cache, table, _, _, _ = fill_paged_cache(lens, 2, 32, 32, 16, 1, 0, 1, torch.float8_e4m3fn if fp8 else torch.float32,
                                      seed=3)
        q = torch.randn(len(lens), 1, 8, 32)
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, scale=0.1, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, scale=0.1, backend="triton", validate=False, max_seq_len=9)
    splits, split_len = reach[-1]
    assert 9 <= splits * split_len < 150, reach
    assert torch.isnan(got.out[0]).all() and torch.isnan(got.lse[0]).all()
    check_state(AttnState(got.out[1:], got.lse[1:]), AttnState(ref.out[1:], ref.lse[1:]), 1e-4)


@pytest.mark.parametrize("mla,fp8", [(False, False), (False, True), (True, False)],
                         ids=["gqa", "gqa-fp8-scan", "mla-halves"])
def test_kernel_reports_bad_tables_as_nan_without_reading_past_them(mla, fp8, monkeypatch):
    """A CUDA call reads no values on the host (validate=False here): a used block id outside the
    cache, a length past the table's capacity or a negative length make that sequence's out and
    lse NaN (in every split, through the merge), read nothing outside the table and the cache,
    and leave the other sequences exact. GQA over bf16 / fp32 checks each tile's ids; over fp8 and
    for MLA's halves the split's ids are scanned before the loop."""
    from parallel.cp import triton_decode as td

    monkeypatch.setitem(td.CONFIG, "min_split", 16)
    monkeypatch.setitem(td.CONFIG, "min_split_fp8", 16)
    monkeypatch.setitem(td.CONFIG, "min_split_wide", 16)
    if mla:
        monkeypatch.setitem(td.CONFIG, "halves_wide", 1)
        monkeypatch.setitem(td.CONFIG, "block_n_wide_f32", 16)
        monkeypatch.setitem(td.CONFIG, "block_m_wide_f32", 16)
        lens = [40, 30, 20, 16, 12, 9]
        cache, table = mla_paged_cache(lens, 16, torch.float32, seed=9)
        q = torch.randn(len(lens), 1, 4, 576) * 0.2
    else:
        lens = [40, 30, 20, 16, 12, 9]
        cache, table, _, _, _ = fill_paged_cache(lens, 2, 32, 32, 16, 1, 0, 1, torch.float8_e4m3fn if fp8 else torch.float32,
                                      seed=9)
        q = torch.randn(len(lens), 1, 8, 32)
    nb, width = cache.k.shape[0], table.shape[1]
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, scale=0.1, backend="torch")
    bad_table, bad_seq = table.clone(), seq.clone()
    bad_table[0, 1] = nb + 5            # tokens 16..31 of sequence 0 (its second split)
    bad_table[1, 0] = -1
    bad_seq[2] = width * 16 + 1         # past the table's capacity
    bad_seq[3] = -4
    bad_seq[4] = 2 ** 32 + 12           # past int32: narrowed, it would read as a valid 12
    got = paged_decode_attention(q, cache, bad_table, bad_seq, scale=0.1, backend="triton", validate=False)
    for i in range(5):
        assert torch.isnan(got.out[i]).all() and torch.isnan(got.lse[i]).all(), i
    check_state(AttnState(got.out[5:], got.lse[5:]), AttnState(ref.out[5:], ref.lse[5:]), 1e-4)
    with pytest.raises(ValueError, match=r"block ids \[-1, " + str(nb + 5) + r"\] outside the cache's \[0, " + str(nb)):
        paged_decode_attention(q, cache, bad_table, seq, backend="triton")      # (CPU tensors: checked first)


@pytest.mark.parametrize("tq,fp8", [(1, False), (1, True), (2, False)])
def test_unmerged_splits_are_the_kernels_partials(tq, fp8, monkeypatch):
    """merge=False: the split-KV kernel's P partial states as it leaves them (P > 1 here, DCP rank 1
    of 2, an empty sequence among them), whose merge is the merged call's result; the torch path
    gives its merged state as P = 1."""
    from parallel.cp import triton_decode as td
    from parallel.cp.merge import merge_attn_states

    for key in ("min_split", "min_split_fp8", "block_n", "block_n_fp8"):    # (several splits at these lengths)
        monkeypatch.setitem(td.CONFIG, key, 16)
    lens = [80, 30, 0, 47, 9] if tq == 1 else [80, 30, 2, 47, 9]
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, 32, 32, 16, 2, 1, 1, torch.float8_e4m3fn if fp8 else torch.float32,
                                       seed=17)
    q = torch.randn(len(lens), tq, 8, 32)
    q = q[:, 0] if tq == 1 else q
    seq = torch.tensor(lens)
    merged = paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.1, backend="triton")
    parts = paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.1, backend="triton", merge=False)
    assert parts.out.shape[0] > 1 and parts.out.shape[1:] == merged.out.shape, parts.out.shape
    assert parts.lse.shape == parts.out.shape[:-1]
    check_state(merge_attn_states(parts.out, parts.lse, backend="torch"), merged, 1e-6)
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.1, backend="torch")
    ref_parts = paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.1, backend="torch", merge=False)
    assert torch.equal(ref_parts.out, ref.out.unsqueeze(0)) and torch.equal(ref_parts.lse, ref.lse.unsqueeze(0))
    check_state(merged, ref, 1e-4 if fp8 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("several", [False, True], ids=["one-split", "splits"])
def test_out_dtype_is_written_by_the_merge_or_the_single_split(dtype, several, monkeypatch):
    """out_dtype: the merged out in a 16-bit dtype, written by the split merge (several splits) or by
    the kernel itself (one split): the fp32 call's out rounded once (fp16 exactly; bf16 within one
    step: the interpreter converts by its own rules), the lse the fp32 call's; the torch path
    casts; refused with merge=False and for other dtypes."""
    from parallel.cp import triton_decode as td

    for key in ("min_split", "min_split_fp8"):
        monkeypatch.setitem(td.CONFIG, key, 16 if several else 4096)
    for key in ("block_n", "block_n_fp8"):
        monkeypatch.setitem(td.CONFIG, key, 16)
    merges = []
    real = td.merge_states_triton
    monkeypatch.setattr(td, "merge_states_triton", lambda *a, **kw: merges.append(kw["out"].dtype) or real(*a, **kw))
    lens = [80, 30, 0, 47, 9]
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, 32, 32, 16, 2, 1, 1, torch.float32, seed=23)
    q, seq = torch.randn(len(lens), 8, 32), torch.tensor(lens)
    call = lambda **kw: paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.1, **kw)
    full = call(backend="triton")
    got = call(backend="triton", out_dtype=dtype)
    assert got.out.dtype == dtype and got.lse.dtype == torch.float32
    assert merges == ([torch.float32, dtype] if several else [])
    if dtype == torch.float16:
        assert torch.equal(got.out, full.out.to(dtype))
    else:
        torch.testing.assert_close(got.out.float(), full.out, atol=0, rtol=2.0 ** -7)     # (one bf16 step)
    assert torch.equal(got.lse, full.lse)
    ref = call(backend="torch", out_dtype=dtype)
    assert ref.out.dtype == dtype and torch.equal(ref.out, call(backend="torch").out.to(dtype))
    with pytest.raises(ValueError, match="applies to the merged out"):
        call(backend="triton", out_dtype=dtype, merge=False)
    with pytest.raises(ValueError, match="out_dtype must be"):
        call(backend="triton", out_dtype=torch.float8_e4m3fn)


def test_pdl_is_off_where_it_cannot_apply_and_its_switch_is_validated():
    """Programmatic dependent launch only on CUDA (sm_90+), never under the interpreter; CONFIG
    "pdl" takes 0/1 through apply_tuning like every launch setting."""
    from parallel.cp import triton_decode
    from parallel.cp.triton_merge import pdl_ok

    assert pdl_ok(torch.device("cpu")) is False
    before = dict(triton_decode.CONFIG)
    try:
        triton_decode.apply_tuning({"config": {"pdl": 0}})
        assert triton_decode.CONFIG["pdl"] == 0
        with pytest.raises(ValueError, match="pdl = 2 is invalid"):
            triton_decode.apply_tuning({"config": {"pdl": 2}})
        assert triton_decode.CONFIG["pdl"] == 0
    finally:
        triton_decode.CONFIG.clear()
        triton_decode.CONFIG.update(before)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,dv", [(32, 4, 128, 128), (16, 1, 576, 512)], ids=["gqa", "mla16"])
def test_pdl_chain_in_a_graph_matches_plain_launches(hq, hkv, d, dv, monkeypatch):
    """Decode calls back to back in one CUDA graph with programmatic dependent launch (each kernel
    and split merge may start while the one before finishes; the partial buffers of one call reuse
    the memory the previous call's merge reads): the same as the calls launched without it (to
    1e-5), and to the torch path within the kernel's bound."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from parallel.cp import triton_decode
    from parallel.cp.triton_merge import pdl_ok

    if not pdl_ok(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton that launches with it")
    lens = [6000, 1, 0, 2500, 9000, 64]
    cache, table, layout, _, _ = fill_paged_cache(lens, hkv, d, dv, 64, 2, 1, 1, torch.bfloat16, seed=5, device="cuda")
    if dv != d:
        cache = PagedKVCache(cache.k, cache.k[..., :dv], None, None)
    seq = torch.tensor(lens, device="cuda")
    qs = [torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    run = lambda q: paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton", scale=0.06,
                                           max_seq_len=max(lens))
    # ("pdl_wide_narrow": MLA's narrow head tiles' own switch, off as installed: on here with the rest)
    monkeypatch.setitem(triton_decode.CONFIG, "pdl", 0)
    monkeypatch.setitem(triton_decode.CONFIG, "pdl_wide_narrow", 0)
    plain = [run(q) for q in qs]
    monkeypatch.setitem(triton_decode.CONFIG, "pdl", 1)
    monkeypatch.setitem(triton_decode.CONFIG, "pdl_wide_narrow", 1)
    outs = []

    def chain():
        outs.clear()
        for q in qs:     # the previous call's partials are freed: this call's may take their memory
            outs.append(run(q))
    chain()                                              # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got, want, q in zip(outs, plain, qs):
        # (the same arithmetic; a race on the reused partials would be off by far more)
        torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=0, equal_nan=True)
        torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=0)
        ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch", scale=0.06)
        finite = torch.isfinite(ref.lse)
        assert torch.equal(finite, torch.isfinite(got.lse))
        torch.testing.assert_close(got.out, ref.out, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "fp8"])
@pytest.mark.parametrize("tq", [1, 2])
@pytest.mark.parametrize("option", ["tma", "even"])
def test_gqa_tma_tiles_match_reference(dtype, tq, option, monkeypatch):
    """GQA's whole tiles by TMA (CONFIG tma / tma_fp8) or by pointer loads without masks (even /
    even_fp8, one query token), the partial last tile of a split through the masked loads (the cache
    holds NaN past a sequence's end there), an empty sequence, an out-of-cache block id (NaN, no read
    outside the cache)."""
    from parallel.cp import triton_decode

    for key, value in ((option, 1), (option + "_fp8", 1), ("block_n", 16), ("block_n_fp8", 16), ("min_split", 32),
                       ("min_split_fp8", 32), ("f16_fp8", 0)):
        monkeypatch.setitem(triton_decode.CONFIG, key, value)
    used = []
    real = triton_decode._gqa_tma_ok
    monkeypatch.setattr(triton_decode, "_gqa_tma_ok", lambda *a: used.append(real(*a)) or used[-1])
    lens = [300, 1, 0, 170, 64, 47] if tq == 1 else [300, 2, 5, 170, 64, 47]     # (q_len 2: no empty one)
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, 32, 32, 16, 2, 1, 1, dtype, seed=41)
    # past every sequence's end the cache holds NaN: a whole-tile load there must not reach out
    held = torch.zeros(cache.k.shape[:2], dtype=torch.bool)
    for i, n in enumerate(lens):
        local = int(layout.local_lengths(torch.tensor(n)))
        for j in range(local):
            held[table[i, j // 16], j % 16] = True
    for t in (cache.k, cache.v):
        t.view(torch.uint8)[~held] = 0xFF          # NaN in bf16/fp32 bytes and fp8 e4m3
    q = torch.randn(len(lens), tq, 4, 32)
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton")
    assert (used and all(used)) if option == "tma" else not used
    check_state(got, ref, 1e-4 if dtype == torch.float32 else 2e-2)
    # where TMA does not apply, the pointer loads run: key dims with a rest part (80 = 64 + 16), a
    # 512-wide value (past a box), tiles across pages, v a prefix view of k, unaligned strides
    k = torch.zeros(4, 16, 2, 128)
    ok = lambda k, v, d_rest=0, block_n=16, v_from_k=False: triton_decode._gqa_tma_ok(k, v, d_rest, v.shape[-1],
                                                                                      block_n, v_from_k)
    assert ok(k, k.clone())
    assert not ok(k, k.clone(), d_rest=16) and not ok(k, torch.zeros(4, 16, 2, 512))
    assert not ok(k, k.clone(), block_n=32) and not ok(k, k[..., :64], v_from_k=True)
    assert not ok(torch.zeros(4, 16, 2, 130)[..., :128], k.clone())       # (a 520-byte head stride)
    bad = table.clone()
    bad[3, 2] = cache.k.shape[0] + 5                  # a used block id outside the cache
    got = paged_decode_attention(q, cache, bad, seq, layout=layout, backend="triton", validate=False)
    assert torch.isnan(got.lse[3]).all() and torch.isnan(got.out[3]).all()
    keep = torch.arange(len(lens)) != 3
    check_state(AttnState(got.out[keep], got.lse[keep]), AttnState(ref.out[keep], ref.lse[keep]),
           1e-4 if dtype == torch.float32 else 2e-2)


def test_gluon_mla_applies_only_to_its_layout():
    """The Gluon MLA kernel's conditions (`gluon_mla_ok`): bf16 queries and latent cache, one query
    token, 64-head tiles, pages of a multiple of 64, contiguous latent rows, v the latent's first
    512 dims; never on CPU."""
    from parallel.cp import gluon_mla

    q = torch.zeros(2, 1, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    assert not gluon_mla.gluon_mla_ok(q, kv, kv[..., :512], 1, 64)          # a CPU tensor
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and gluon_mla.HAS_GLUON):
        return
    q, kv = q.cuda(), kv.cuda()
    assert gluon_mla.gluon_mla_ok(q, kv, kv[..., :512], 1, 64)
    assert not gluon_mla.gluon_mla_ok(q[:, :, :96], kv, kv[..., :512], 1, 64)             # 96 heads
    assert gluon_mla.gluon_mla_ok(q[:, :, :16].contiguous(), kv, kv[..., :512], 1, 64)    # 16: one padded tile
    assert not gluon_mla.gluon_mla_ok(q, kv.to(torch.float8_e4m3fn), kv[..., :512], 1, 64)
    assert not gluon_mla.gluon_mla_ok(q.expand(2, 2, 128, 576), kv, kv[..., :512], 2, 64)  # two tokens
    assert not gluon_mla.gluon_mla_ok(q, kv[:, :32], kv[:, :32, :, :512], 1, 32)          # 32-token pages
    assert not gluon_mla.gluon_mla_ok(q, kv, kv.clone()[..., :512], 1, 64)                # v elsewhere


def _gluon_on_off(monkeypatch, key, call):
    """(the call with CONFIG key 0: the Triton kernel, with key 1: the Gluon kernel), after checking
    that the second launched the Gluon kernel."""
    from parallel.cp import gluon_mla, triton_decode as td

    used = []
    real = gluon_mla.launch_gluon_mla
    monkeypatch.setattr(gluon_mla, "launch_gluon_mla", lambda *a, **kw: used.append(1) or real(*a, **kw))
    monkeypatch.setitem(td.CONFIG, key, 0)
    plain = call()
    monkeypatch.setitem(td.CONFIG, key, 1)
    got = call()
    assert used
    return plain, got


def _check_against_torch(got, ref, empty: int):
    """Rows of a sequence with no token (and only those) have lse -inf; out is finite everywhere
    (NaN past the ends never reached it) and within the GPU bound of the torch path."""
    finite = torch.isfinite(ref.lse)
    assert torch.equal(finite, torch.isfinite(got.lse)) and not finite[empty].any()
    assert torch.isfinite(got.out).all()
    torch.testing.assert_close(got.lse[finite], ref.lse[finite], atol=2e-2, rtol=0)
    torch.testing.assert_close(got.out, ref.out, atol=2e-2, rtol=0)


def _replays_to(run, got, times: int = 2) -> None:
    """A decode step's CUDA graph of `run()` replays to `got` exactly."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(times):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.out, got.out, atol=0, rtol=0)
    torch.testing.assert_close(captured.lse, got.lse, atol=0, rtol=0)


def _nan_row_5_only(nan, got) -> None:
    """Sequence 5's first block id was bad: its rows NaN, the rows before it as `got`."""
    assert torch.isnan(nan.lse[5]).all() and torch.isnan(nan.out[5]).all()
    torch.testing.assert_close(nan.out[:5], got.out[:5], atol=0, rtol=0)


def _mla_dcp_cache(lens, layout, dtype, gen):
    """(cache, ref_cache, table, blocks) on the GPU: a latent cache in a DCP rank's layout whose unheld
    slots hold NaN (and, fp8, NaN bytes with NaN scales: anything may be there), and a copy with
    zeros there (unit scales) that the torch path reads; fp8 tokens are quantized per token."""
    size = layout.size
    per_seq = -(-max(lens) // (64 * size)) + 1
    nb = len(lens) * per_seq + 2
    table = torch.randperm(nb, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int().cuda()
    kv = torch.full((nb, 64, 1, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    clean = torch.zeros_like(kv)
    sc = torch.full((nb, 64, 1), float("nan"), device="cuda")
    sc_clean = torch.ones_like(sc)
    for s, n in enumerate(lens):
        if n:
            slots = layout.slot_mapping(torch.arange(n, device="cuda"), table[s])
            x = torch.randn(n, 1, 576, generator=gen).to(torch.bfloat16).cuda()
            mine = slots >= 0
            kv.view(-1, 1, 576)[slots[mine]] = x[mine]
            clean.view(-1, 1, 576)[slots[mine]] = x[mine]
            amax = x[mine].float().abs().amax(-1) / 448.0
            sc.view(-1, 1)[slots[mine]] = amax
            sc_clean.view(-1, 1)[slots[mine]] = amax
    if dtype != torch.float8_e4m3fn:
        return PagedKVCache(kv, kv[..., :512]), PagedKVCache(clean, clean[..., :512]), table, nb
    k8 = (kv.float() / sc[..., None]).to(dtype)
    c8 = (clean.float() / sc_clean[..., None]).to(dtype)
    return (PagedKVCache(k8, k8[..., :512], sc, sc), PagedKVCache(c8, c8[..., :512], sc_clean, sc_clean), table, nb)


def _spy(monkeypatch, module, name):
    """module.name replaced by a wrapper that records each call's (args, kwargs) in the list returned
    and then makes the call."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    return calls


def _gluon_mla_kernels(monkeypatch):
    """(triton_decode, gluon_mla, gluon_mla_narrow) built for the GPU (`_compiled`); the test is skipped
    without an sm_90 GPU and a Triton with Gluon."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_mla, gluon_mla_narrow

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_mla.HAS_GLUON):
        pytest.skip("the Gluon MLA kernels need an sm_90 GPU and a Triton with Gluon")
    return td, gluon_mla, gluon_mla_narrow


def _mla_gpu_problem(dtype, size, rank, heads, tq, seed):
    """A full-size MLA decode on the GPU over DCP rank `rank` of `size` (`_mla_dcp_cache`: NaN in every
    unheld slot; lengths ending inside a tile, empty and one-token sequences), bf16 queries of tq
    tokens x heads: (cache, table, the cache's block count, run(cache, table) -> the Triton path's
    AttnState, the torch path's result)."""
    lens = [3000, 0, 77, 1, 640, 4096, 129]
    gen = torch.Generator().manual_seed(seed)
    layout = DCPLayout(size=size, rank=rank, block_size=64)
    cache, ref_cache, table, nb = _mla_dcp_cache(lens, layout, dtype, gen)
    q = torch.randn(len(lens), tq, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")

    def run(c, t, backend="triton", merge=True):
        return paged_decode_attention(q, c, t, seq, layout=layout, scale=0.07, backend=backend, validate=False,
                                      merge=merge)
    return cache, table, nb, run, run(ref_cache, table, "torch")


@pytest.mark.gpu
@pytest.mark.parametrize("seesaw,split", [(0, 0), (1, 0), (0, 1)], ids=["ws", "seesaw", "split"])
@pytest.mark.parametrize("size,rank,heads", [(1, 0, 128), (2, 1, 128), (4, 2, 128), (2, 1, 16), (1, 0, 32)])
def test_gluon_mla_kernel_on_gpu(size, rank, heads, seesaw, split, monkeypatch):
    """The warp-specialized Gluon MLA kernel (CONFIG gluon_wide) at full size over every kind of
    DCP rank: NaN in every slot past a sequence's end, lengths that end inside a tile, empty and
    one-token sequences, several splits, against the torch path; the Triton kernel's results to
    1e-5 (the same arithmetic) for full head tiles; a bad block id gives that sequence NaN rows; a
    CUDA graph of it replays to the same result. 16 and 32 heads (TP 8 / 4: one head tile padded
    to 64 rows, CONFIG gluon_wide_narrow) too. seesaw: its seesaw form (CONFIG seesaw_wide; the
    rescales in another order: the Triton kernel's results to rounding). split: its split form (CONFIG
    split_wide: the same MMAs and sums in other warpgroups, the Triton kernel's results to 1e-5)."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_mla

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_mla.HAS_GLUON):
        pytest.skip("the Gluon MLA kernel needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setitem(td.CONFIG, "min_split_wide", 256)      # several splits at these lengths
    monkeypatch.setitem(td.CONFIG, "gluon_wide_narrow", 1)
    monkeypatch.setitem(td.CONFIG, "swap_wide_narrow", 0)      # (the padded tile: the swapped kernel's own test)
    monkeypatch.setitem(td.CONFIG, "seesaw_wide", seesaw)
    monkeypatch.setitem(td.CONFIG, "split_wide", split)
    lens = [3000, 0, 77, 1, 640, 4096, 129]
    gen = torch.Generator().manual_seed(21 + rank)
    layout = DCPLayout(size=size, rank=rank, block_size=64)
    cache, ref_cache, table, nb = _mla_dcp_cache(lens, layout, torch.bfloat16, gen)
    q = torch.randn(len(lens), 1, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")
    run = lambda c, t, backend: paged_decode_attention(q, c, t, seq, layout=layout, scale=0.07, backend=backend)
    ref = run(ref_cache, table, "torch")
    plain, got = _gluon_on_off(monkeypatch, "gluon_wide", lambda: run(cache, table, "triton"))
    _check_against_torch(got, ref, 1)
    # (narrow tiles: the Triton kernel's MMA shapes differ; the seesaw form rounds its weights against
    # other maxima)
    same = 1e-5 if heads % 64 == 0 and not seesaw else 1e-2
    torch.testing.assert_close(got.out, plain.out, atol=same, rtol=0)
    torch.testing.assert_close(got.lse, plain.lse, atol=same, rtol=0)
    bad = table.clone()
    bad[5, 0] = nb + 7
    _nan_row_5_only(paged_decode_attention(q, cache, bad, seq, layout=layout, scale=0.07, backend="triton",
                                           validate=False), got)
    _replays_to(lambda: run(cache, table, "triton"), got)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 16])
def test_gluon_mla_kernel_over_fp8_on_gpu(heads, monkeypatch):
    """The Gluon MLA kernel over an fp8 latent cache with per-token scales (CONFIG gluon_wide_fp8):
    NaN bytes and NaN scales past every sequence's end, lengths that end inside a tile, an empty
    and a one-token sequence, several splits; against the torch path and the Triton kernel; the
    converter's forms (64-key tiles with or without a raw TMA ring: one result; 32-key tiles with two
    or three fp16 stages: one result, the 64-key one to rounding; replayed in a CUDA graph); a bad
    block id gives NaN rows."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_mla

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_mla.HAS_GLUON):
        pytest.skip("the Gluon MLA kernel needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setitem(td.CONFIG, "min_split_wide_fp8", 256)
    monkeypatch.setitem(td.CONFIG, "min_split_wide_narrow", 256)
    monkeypatch.setitem(td.CONFIG, "gluon_wide_narrow_fp8", 1)
    monkeypatch.setitem(td.CONFIG, "swap_wide_narrow_fp8", 0)  # (the padded tile: the swapped kernel's own test)
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 0)       # (the converter's kernel: the direct one's own test)
    lens = [3000, 0, 77, 1, 640]
    cache, table = mla_paged_cache(lens, 64, torch.float8_e4m3fn, seed=19, device="cuda")
    q = torch.randn(len(lens), 1, heads, 576, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, device="cuda")
    ref = paged_decode_attention(q, cache, table, seq, scale=0.07, backend="torch")
    plain, got = _gluon_on_off(monkeypatch, "gluon_wide_fp8",
                               lambda: paged_decode_attention(q, cache, table, seq, scale=0.07, backend="triton"))
    _check_against_torch(got, ref, 1)
    torch.testing.assert_close(got.out, plain.out, atol=2e-3, rtol=0)
    assert cache.k_scale.is_contiguous()        # (else the raw ring does not apply)
    # (got: the installed form, 32-key tiles.) 64-key tiles: the converter's own loads into two fp16
    # stages (raw 0) or a raw TMA ring of 1 or 2 tiles in front of one: the same conversion and the
    # same steps, the same result
    run = lambda: paged_decode_attention(q, cache, table, seq, scale=0.07, backend="triton")
    wide = {}
    for raw in (0, 1, 2):
        for key, value in (("raw_ring_wide_fp8", raw), ("keys_wide_fp8", 64), ("ring_wide_fp8", 1)):
            monkeypatch.setitem(td.CONFIG, key, value)
        wide[raw] = run()
        _check_against_torch(wide[raw], ref, 1)
        torch.testing.assert_close(wide[raw].out, wide[0].out, atol=0, rtol=0)
        torch.testing.assert_close(wide[raw].lse, wide[0].lse, atol=0, rtol=0)
    # 32-key tiles with 2 or 3 fp16 stages and 2 or 4 raw ones: one result among them; against 64-key
    # tiles the online softmax steps over 32 keys (fp32 rounding apart, the weights' fp16 unit moves at
    # other points)
    for keys, ring, raw in ((32, 2, 2), (32, 2, 4), (32, 3, 2)):
        for key, value in (("raw_ring_wide_fp8", raw), ("keys_wide_fp8", keys), ("ring_wide_fp8", ring)):
            monkeypatch.setitem(td.CONFIG, key, value)
        short = run()
        torch.testing.assert_close(short.out, got.out, atol=0, rtol=0)
        torch.testing.assert_close(short.lse, got.lse, atol=0, rtol=0)
    torch.testing.assert_close(got.out, wide[0].out, atol=2e-3, rtol=0)
    torch.testing.assert_close(got.lse, wide[0].lse, atol=1e-4, rtol=0)
    # a decode step's CUDA graph replays the installed form to the same result
    for key, value in (("raw_ring_wide_fp8", 2), ("keys_wide_fp8", 32), ("ring_wide_fp8", 2)):
        monkeypatch.setitem(td.CONFIG, key, value)
    run()
    _replays_to(run, got, times=1)
    for raw, keys, ring in ((0, 64, 1), (2, 64, 1), (2, 32, 2)):
        monkeypatch.setitem(td.CONFIG, "raw_ring_wide_fp8", raw)
        monkeypatch.setitem(td.CONFIG, "keys_wide_fp8", keys)
        monkeypatch.setitem(td.CONFIG, "ring_wide_fp8", ring)
        bad = table.clone()
        bad[4, 0] = cache.k.shape[0] + 1
        nan = paged_decode_attention(q, cache, bad, seq, scale=0.07, backend="triton", validate=False)
        assert torch.isnan(nan.lse[4]).all() and torch.isfinite(nan.lse[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("size,rank,heads", [(1, 0, 128), (4, 3, 128), (2, 1, 64), (1, 0, 256)])
def test_gluon_mla_direct_wide_fp8_on_gpu(size, rank, heads, monkeypatch):
    """The direct fp8 kernel over full 64-head tiles (`gluon_mla_direct`, CONFIG direct_wide_fp8: no
    converter) at full size over DCP ranks: NaN bytes and NaN scales in every unheld slot, lengths ending
    inside a tile, empty and one-token sequences, several splits and one (its partial the output, in q's
    dtype where asked), a length plan; against the torch path and the converter's kernel (rounding
    apart: the direct kernel's queries are e4m3 hi + lo parts); 1-3 raw stages, the ids loaded ahead or
    not, the output's dim pairs stored together or not: the same result; a speculative step expanded
    into one-token decodes runs it too; a bad block id gives NaN rows of that sequence only; a CUDA
    graph replays it to the same result."""
    td, _, _ = _gluon_mla_kernels(monkeypatch)
    from parallel.cp import gluon_mla_direct
    from parallel.cp.paged import plan_paged_decode

    monkeypatch.setitem(td.CONFIG, "min_split_wide_fp8", 256)      # several splits at these lengths
    lens = [3000, 0, 77, 1, 640, 4096, 129]
    gen = torch.Generator().manual_seed(43 + rank + heads)
    layout = DCPLayout(size=size, rank=rank, block_size=64)
    cache, ref_cache, table, nb = _mla_dcp_cache(lens, layout, torch.float8_e4m3fn, gen)
    q = torch.randn(len(lens), 1, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")
    run = lambda t=table, **kw: paged_decode_attention(q, cache, t, seq, layout=layout, scale=0.07,
                                                        backend="triton", validate=False, **kw)
    ref = paged_decode_attention(q, ref_cache, table, seq, layout=layout, scale=0.07, backend="torch")
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 0)
    conv = run()
    used = _spy(monkeypatch, gluon_mla_direct, "launch")
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 3)
    got = run()
    assert used and all(kw["raw"] == 3 for _, kw in used), "the direct kernel was not launched"
    # (more stages than fit run the most that do)
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 12)
    torch.testing.assert_close(run().out, got.out, atol=0, rtol=0)
    assert used[-1][1]["raw"] == gluon_mla_direct.MAX_RAW
    assert used[0][0][7] > 1, "expected several splits"
    _check_against_torch(got, ref, 1)
    torch.testing.assert_close(got.out, conv.out, atol=4e-3, rtol=0)
    torch.testing.assert_close(got.lse, conv.lse, atol=4e-3, rtol=0)
    for raw in (1, 2):      # (the same MMAs in the same order at any ring depth)
        monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", raw)
        other = run()
        torch.testing.assert_close(other.out, got.out, atol=0, rtol=0)
        torch.testing.assert_close(other.lse, got.lse, atol=0, rtol=0)
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 3)
    _same_when_flipped(monkeypatch, td, "ids_ahead_wide_fp8", run, got)
    _same_when_flipped(monkeypatch, td, "paired_store_direct_fp8", run, got)
    # unmerged splits, and one split a sequence whose partial is the output (in q's dtype where asked)
    parts = run(merge=False)
    assert parts.lse.shape[0] > 1
    used.clear()
    monkeypatch.setitem(td.CONFIG, "min_split_wide_fp8", 1 << 16)
    one = run(out_dtype=torch.bfloat16)
    assert used and used[0][0][7] == 1 and one.out.dtype == torch.bfloat16
    torch.testing.assert_close(one.out.float(), got.out, atol=1e-2, rtol=0)
    torch.testing.assert_close(one.lse, got.lse, atol=1e-4, rtol=0, equal_nan=True)
    monkeypatch.setitem(td.CONFIG, "min_split_wide_fp8", 256)
    # a length plan: the splits cut from the lengths, the items the grid's second axis
    plan = plan_paged_decode(q, cache, table, seq, layout=layout, backend="triton")
    used.clear()
    planned = run(plan=plan)
    assert used and used[0][1].get("plan") is not None
    _check_against_torch(planned, ref, 1)
    torch.testing.assert_close(planned.out, got.out, atol=1e-3, rtol=0)       # (other splits, other sums)
    bad = table.clone()
    bad[5, 0] = nb + 7
    for ahead in (0, 1):    # (ids ahead: the check's loads beside the length, evaluated after the loop)
        monkeypatch.setitem(td.CONFIG, "ids_ahead_wide_fp8", ahead)
        _nan_row_5_only(run(bad), got)
    _replays_to(run, got)
    # a speculative step's 2 tokens over full head tiles, expanded into one-token decodes (expand_wide_fp8)
    monkeypatch.setitem(td.CONFIG, "expand_wide_fp8", 1)
    long = torch.tensor([i for i, n in enumerate(lens) if n >= 2], device="cuda")     # (2 tokens held)
    q2 = torch.randn(len(long), 2, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    used.clear()
    spec = paged_decode_attention(q2, cache, table[long], seq[long], layout=layout, scale=0.07, backend="triton",
                                  validate=False)
    assert used, "the expanded step did not run the direct kernel"
    spec_ref = paged_decode_attention(q2, ref_cache, table[long], seq[long], layout=layout, scale=0.07,
                                      backend="torch")
    torch.testing.assert_close(spec.out, spec_ref.out, atol=2e-2, rtol=0)
    fin = torch.isfinite(spec_ref.lse)
    assert torch.equal(fin, torch.isfinite(spec.lse))
    torch.testing.assert_close(spec.lse[fin], spec_ref.lse[fin], atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size,rank,heads,tq", [(1, 0, 16, 1), (4, 3, 16, 1), (2, 1, 12, 1), (1, 0, 32, 1),
                                                (2, 0, 8, 1), (1, 0, 16, 2), (4, 1, 8, 4), (2, 1, 12, 2)])
def test_gluon_mla_narrow_swapped_on_gpu(dtype, size, rank, heads, tq, monkeypatch):
    """The swapped narrow-tile MLA kernel (`gluon_mla_narrow`, CONFIG swap_wide_narrow*: keys as
    wgmma's M, at most 32 query rows as N) at full size over DCP ranks, NaN (bytes and scales) in
    every unheld slot, lengths ending inside a tile, empty and one-token sequences, several splits,
    12 heads (columns past them padding), and a speculative step's 2-4 query tokens (causal within
    the step, over DCP's interleaved positions): against the torch path and the kernel it replaces
    (the padded-tile Gluon one, or the Triton one for several tokens; rounding apart), over fp8 its
    direct form at other raw depths bit-identical; a bad block id gives NaN rows of that sequence
    only; a CUDA graph replays it to the same result."""
    td, gluon_mla, gluon_mla_narrow = _gluon_mla_kernels(monkeypatch)
    fp8 = dtype == torch.float8_e4m3fn
    swap = "swap_wide_narrow_fp8" if fp8 else "swap_wide_narrow"
    for key in ("min_split_wide", "min_split_wide_fp8", "min_split_wide_narrow"):
        monkeypatch.setitem(td.CONFIG, key, 256)
    monkeypatch.setitem(td.CONFIG, "gluon_wide_narrow_fp8" if fp8 else "gluon_wide_narrow", 1)
    cache, table, nb, run, ref = _mla_gpu_problem(dtype, size, rank, heads, tq, 31 + rank + heads + tq)
    monkeypatch.setitem(td.CONFIG, swap, 0)
    padded = run(cache, table)
    used = _spy(monkeypatch, gluon_mla_narrow, "launch")
    monkeypatch.setitem(td.CONFIG, swap, 1)
    got = run(cache, table)
    assert used, "the swapped kernel was not launched"
    _check_against_torch(got, ref, 1)
    # the loader's first block ids loaded beside the length (bf16, and over fp8 the direct form where
    # installed): the same result
    _same_when_flipped(monkeypatch, td, td.ids_ahead_key(fp8, narrow=True), lambda: run(cache, table), got)
    # (over fp8 the direct form's scores as fp8 MMAs round the queries differently)
    torch.testing.assert_close(got.out, padded.out, atol=4e-3 if fp8 else 1e-3, rtol=0)
    torch.testing.assert_close(got.lse, padded.lse, atol=4e-3 if fp8 else 1e-4, rtol=0)
    if fp8:     # the direct form (the only one over fp8) at other raw depths: the same MMAs in the same
        # order, the same result; with direct_wide_narrow_fp8 0 the padded-tile kernel runs instead
        direct, direct32 = td.CONFIG["direct_wide_narrow_fp8"], td.CONFIG["direct_wide_narrow_fp8_32"]
        assert all(kw["raw"] == gluon_mla_narrow.direct_stages(tq * heads, direct if tq * heads <= 16 else direct32)
                   for _, kw in used)
        for raw in (1, 3):     # (over more than 16 columns, direct_wide_narrow_fp8_32's)
            monkeypatch.setitem(td.CONFIG, "direct_wide_narrow_fp8", raw)
            monkeypatch.setitem(td.CONFIG, "direct_wide_narrow_fp8_32", raw)
            other = run(cache, table)
            torch.testing.assert_close(other.out, got.out, atol=0, rtol=0)
            torch.testing.assert_close(other.lse, got.lse, atol=0, rtol=0)
            # the next tile's score MMAs issued before this tile's softmax (CONFIG pipe_wide_narrow_fp8; at
            # least 2 raw stages, at most 16 columns) or after it: the same MMAs and sums
            _same_when_flipped(monkeypatch, td, "pipe_wide_narrow_fp8", lambda: run(cache, table), got)
        monkeypatch.setitem(td.CONFIG, "direct_wide_narrow_fp8_32", direct32)
        # the output's dim pairs stored together: the same values, the same result
        _same_when_flipped(monkeypatch, td, "paired_store_direct_fp8", lambda: run(cache, table), got)
        # the value MMAs in fp8 against the weights' e4m3 hi + lo parts (CONFIG values8_narrow_fp8, at most
        # 16 columns a tile): the same scores, so the same lse; the output within the parts' rounding
        monkeypatch.setitem(td.CONFIG, "values8_narrow_fp8", 1)
        used.clear()
        v8 = run(cache, table)
        assert used and all(kw["values8"] for _, kw in used)
        _check_against_torch(v8, ref, 1)
        torch.testing.assert_close(v8.lse, got.lse, atol=0, rtol=0)
        torch.testing.assert_close(v8.out, got.out, atol=4e-3, rtol=0)
        if gluon_mla_narrow.values8_apply(tq * heads):
            assert not torch.equal(v8.out, got.out), "values8 changed nothing: the fp8 value MMAs did not run"
        bad8 = table.clone()
        bad8[5, 0] = nb + 7
        _nan_row_5_only(run(cache, bad8), v8)
        _replays_to(lambda: run(cache, table), v8)
        monkeypatch.setitem(td.CONFIG, "values8_narrow_fp8", 0)
        # one softmax maximum a tile (CONFIG one_max_narrow_fp8: the maximum over the scores plus log2 of the
        # keys' scales) against two (the running unit's): the same weights and sums up to fp32 rounding,
        # alone and with the fp8 value MMAs (the installed choice put back after, for the checks below)
        one_installed = td.CONFIG["one_max_narrow_fp8"]
        for values8 in (0, 1):
            monkeypatch.setitem(td.CONFIG, "values8_narrow_fp8", values8)
            monkeypatch.setitem(td.CONFIG, "one_max_narrow_fp8", 0)
            used.clear()
            two = run(cache, table)
            assert used and not any(kw["one_max"] for _, kw in used)
            monkeypatch.setitem(td.CONFIG, "one_max_narrow_fp8", 1)
            used.clear()
            one = run(cache, table)
            assert used and all(kw["one_max"] for _, kw in used)
            _check_against_torch(one, ref, 1)
            _check_against_torch(two, ref, 1)
            torch.testing.assert_close(one.lse, two.lse, atol=2e-4, rtol=0)
            torch.testing.assert_close(one.out, two.out, atol=4e-3, rtol=0)
            _nan_row_5_only(run(cache, bad8), one)
            _replays_to(lambda: run(cache, table), one)
            monkeypatch.setitem(td.CONFIG, "one_max_narrow_fp8", 0)
        monkeypatch.setitem(td.CONFIG, "values8_narrow_fp8", 0)
        # keys of scale 0 (zero bytes: a score of 0, a weight in the sums, nothing in the values): the
        # first three slots of sequence 0's first block, which every rank holds
        zk, zs = cache.k.clone(), cache.k_scale.clone()
        zk[table[0, 0].long(), :3] = 0
        zs[table[0, 0].long(), :3] = 0
        zeros = PagedKVCache(zk, zk[..., :512], zs, zs)
        # (the torch path's copy: the unheld slots' NaN bytes and scales as zeros and unit scales)
        unheld = torch.isnan(zs)
        zc = zk.clone()
        zc.view(torch.uint8).masked_fill_(unheld[..., None], 0)
        zcs = zs.masked_fill(unheld, 1.0)
        zeros_ref = run(PagedKVCache(zc, zc[..., :512], zcs, zcs), table, "torch")
        plain, two_max = run(cache, table), run(zeros, table)
        monkeypatch.setitem(td.CONFIG, "one_max_narrow_fp8", 1)
        one_plain, one = run(cache, table), run(zeros, table)
        monkeypatch.setitem(td.CONFIG, "one_max_narrow_fp8", 0)
        # (only sequence 0's keys changed, in either form: its rows move, the others' are the same bits)
        for a, b in ((two_max, plain), (one, one_plain)):
            assert not torch.equal(a.lse[0], b.lse[0]), "the zero-scale keys changed nothing"
            torch.testing.assert_close(a.lse[1:], b.lse[1:], atol=0, rtol=0)
            torch.testing.assert_close(a.out[1:], b.out[1:], atol=0, rtol=0)
        _check_against_torch(one, zeros_ref, 1)
        _check_against_torch(two_max, zeros_ref, 1)
        torch.testing.assert_close(one.lse, two_max.lse, atol=2e-4, rtol=0)
        torch.testing.assert_close(one.out, two_max.out, atol=4e-3, rtol=0)
        monkeypatch.setitem(td.CONFIG, "one_max_narrow_fp8", one_installed)
        used.clear()
        monkeypatch.setitem(td.CONFIG, "direct_wide_narrow_fp8", 0)
        off = run(cache, table)
        assert not used, "direct_wide_narrow_fp8 0 still launched the swapped fp8 kernel"
        torch.testing.assert_close(off.out, padded.out, atol=0, rtol=0)
        torch.testing.assert_close(off.lse, padded.lse, atol=0, rtol=0)
        monkeypatch.setitem(td.CONFIG, "direct_wide_narrow_fp8", direct)
    bad = table.clone()
    bad[5, 0] = nb + 7
    for ahead in (0, 1):    # (ids_ahead: the id check's loads beside the length, evaluated after the loop)
        monkeypatch.setitem(td.CONFIG, td.ids_ahead_key(fp8, narrow=True), ahead)
        _nan_row_5_only(run(cache, bad), got)
    _replays_to(lambda: run(cache, table), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size,rank,heads,tq", [(1, 0, 128, 1), (4, 3, 128, 1), (2, 1, 64, 1), (1, 0, 48, 1),
                                                (2, 1, 16, 3), (4, 1, 128, 2)])
def test_gluon_mla_head_tiles_on_gpu(dtype, size, rank, heads, tq, monkeypatch):
    """More than 32 query columns through the swapped narrow kernels in head tiles of 32 (CONFIG
    tiles_wide / tiles_wide_fp8 2: everywhere; `gluon_mla_narrow.head_tiles`): 128 / 64 heads (4 / 2
    tiles), 48 (a last tile half padding), a speculative step's tokens (16 x 3, 128 x 2: causal within
    the step, over DCP ranks), at full size with NaN in every unheld slot, lengths ending inside a
    tile, empty and one-token sequences, one split and several: against the torch path and the kernel
    it replaces (the full-head-tile Gluon kernels, or the Triton one over several tokens; over fp8 the
    queries' fp8 parts round apart), every tile's columns stored; over fp8 other raw depths
    bit-identical; a bad block id gives NaN rows of that sequence only; a CUDA graph replays it to the
    same result."""
    td, gluon_mla, gluon_mla_narrow = _gluon_mla_kernels(monkeypatch)
    fp8 = dtype == torch.float8_e4m3fn
    key = "tiles_wide_fp8" if fp8 else "tiles_wide"
    # (a step over full 64-head tiles runs as one-token decodes where expand_wide* is on: the tiles' own test)
    monkeypatch.setitem(td.CONFIG, "expand_wide_fp8" if fp8 else "expand_wide", 0)
    # (over fp8 the full-tile kernel compared against is the converter's, whose fp16 MMAs round least: the
    # direct one's e4m3 query parts round apart from the tiles', up to 4.7e-3 between the two in lse)
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 0)
    cache, table, nb, run, ref = _mla_gpu_problem(dtype, size, rank, heads, tq, 57 + rank + heads + tq)
    monkeypatch.setitem(td.CONFIG, key, 0)
    before = run(cache, table)
    used = _spy(monkeypatch, gluon_mla_narrow, "launch")
    monkeypatch.setitem(td.CONFIG, key, 2)
    for target, width in ((132, 32), (1000, 32), (132, 16)):     # (one split and several: their merge)
        monkeypatch.setitem(td.CONFIG, "target_programs_tiles", target)
        monkeypatch.setitem(td.CONFIG, "tile_columns_fp8" if fp8 else "tile_columns", width)
        for split_key in ("min_split_wide", "min_split_wide_fp8", "min_split_wide_narrow"):
            monkeypatch.setitem(td.CONFIG, split_key, 256)
        used.clear()
        got = run(cache, table)
        assert used, "the head-tiled kernel was not launched"
        assert all(kw["width"] == width for _, kw in used)
        if fp8:
            assert all(kw["raw"] == gluon_mla_narrow.direct_stages(width, td.CONFIG["direct_tiles_fp8"])
                       for _, kw in used)
        _check_against_torch(got, ref, 1)
        # (bf16: P rounded to bf16 in both, sums in another order: 1.05-1.15e-3 seen at 1 or 2 of 2e5-5e5)
        torch.testing.assert_close(got.out, before.out, atol=4e-3 if fp8 else 2e-3, rtol=0)
        torch.testing.assert_close(got.lse, before.lse, atol=4e-3 if fp8 else 1e-4, rtol=0)
    if fp8:
        for raw in (1, 5):      # (other raw depths: the same MMAs in the same order)
            monkeypatch.setitem(td.CONFIG, "direct_tiles_fp8", raw)
            other = run(cache, table)
            torch.testing.assert_close(other.out, got.out, atol=0, rtol=0)
            torch.testing.assert_close(other.lse, got.lse, atol=0, rtol=0)
        _same_when_flipped(monkeypatch, td, "paired_store_direct_fp8", lambda: run(cache, table), got)
    # the installed setting (1): tiles for a speculative step's tokens only
    monkeypatch.setitem(td.CONFIG, key, 1)
    used.clear()
    run(cache, table)
    assert bool(used) == (tq > 1)
    monkeypatch.setitem(td.CONFIG, key, 2)
    bad = table.clone()
    bad[5, 0] = nb + 7
    for ahead in (0, 1):
        monkeypatch.setitem(td.CONFIG, td.ids_ahead_key(fp8, narrow=True), ahead)
        _nan_row_5_only(run(cache, bad), got)
    _replays_to(lambda: run(cache, table), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size,rank,heads,tq", [(1, 0, 128, 2), (4, 3, 128, 2), (2, 1, 64, 3), (4, 1, 128, 4)])
def test_gluon_mla_speculative_tokens_expanded_on_gpu(dtype, size, rank, heads, tq, monkeypatch):
    """A speculative step's tokens over full 64-head tiles as one-token decodes through the
    full-head-tile Gluon kernels (CONFIG expand_wide / expand_wide_fp8, `triton_decode._expanded`) at
    full size over DCP ranks, NaN in every unheld slot, lengths ending inside a tile, empty, one-token
    and shorter than the step: against the torch path and the head tiles it precedes (rounding apart);
    the full-tile kernel launched, the tiles not; a bad block id gives NaN rows of that sequence only;
    a CUDA graph replays it to the same result."""
    td, gluon_mla, gluon_mla_narrow = _gluon_mla_kernels(monkeypatch)
    fp8 = dtype == torch.float8_e4m3fn
    key = "expand_wide_fp8" if fp8 else "expand_wide"
    monkeypatch.setitem(td.CONFIG, "direct_wide_fp8", 0)       # (the converter's kernel: the direct one's own test)
    cache, table, nb, run, ref = _mla_gpu_problem(dtype, size, rank, heads, tq, 71 + rank + heads + tq)
    monkeypatch.setitem(td.CONFIG, key, 0)
    tiles = run(cache, table)
    wide, narrow = _spy(monkeypatch, gluon_mla, "launch_gluon_mla"), _spy(monkeypatch, gluon_mla_narrow, "launch")
    monkeypatch.setitem(td.CONFIG, key, 1)
    got = run(cache, table)
    assert [a[0].shape for a, _ in wide] == [(table.shape[0] * tq, 1, heads, 576)] and not narrow
    _check_against_torch(got, ref, 1)
    torch.testing.assert_close(got.out, tiles.out, atol=4e-3 if fp8 else 2e-3, rtol=0)
    torch.testing.assert_close(got.lse, tiles.lse, atol=4e-3 if fp8 else 1e-4, rtol=0)
    bad = table.clone()
    bad[5, 0] = nb + 7
    _nan_row_5_only(run(cache, bad), got)
    _replays_to(lambda: run(cache, table), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size,rank,heads", [(1, 0, 128), (4, 2, 128), (2, 1, 16)])
def test_gluon_mla_half_partials_on_gpu(dtype, size, rank, heads, monkeypatch):
    """CONFIG half_partials on the Gluon MLA kernels (full head tiles; 16 heads: the swapped narrow
    kernel) at full size over DCP ranks with several splits: the partials reach the merge in bf16, the
    result is fp32, against the torch path and within one bf16 rounding (2^-8 of the partials' largest
    magnitude) of the fp32 partials' result; a bad block id gives NaN rows of that sequence only; a
    CUDA graph replays it to the same result."""
    td, gluon_mla, gluon_mla_narrow = _gluon_mla_kernels(monkeypatch)
    from parallel.cp import gluon_mla_direct
    for key in ("min_split_wide", "min_split_wide_fp8", "min_split_wide_narrow"):
        monkeypatch.setitem(td.CONFIG, key, 256)         # several splits at these lengths
    cache, table, nb, run, ref = _mla_gpu_problem(dtype, size, rank, heads, 1, 83 + rank + heads)
    monkeypatch.setitem(td.CONFIG, "half_partials", 0)
    full = run(cache, table)
    merges = _spy(monkeypatch, td, "merge_states_triton")
    direct = dtype == torch.float8_e4m3fn and heads >= 64 and td.CONFIG["direct_wide_fp8"]
    launched = _spy(monkeypatch, gluon_mla_narrow if heads < 64 else gluon_mla_direct if direct else gluon_mla,
                    "launch" if heads < 64 or direct else "launch_gluon_mla")
    monkeypatch.setitem(td.CONFIG, "half_partials", 1)
    got = run(cache, table)
    assert launched and [a[0].dtype for a, _ in merges] == [torch.bfloat16] and merges[0][0][0].shape[0] > 1
    assert got.out.dtype == torch.float32
    _check_against_torch(got, ref, 1)
    span = merges[0][0][0].float().nan_to_num(0).abs().max()     # (merged with weights that sum to 1)
    torch.testing.assert_close(got.out, full.out, atol=float(2.0 ** -8 * span), rtol=0)
    torch.testing.assert_close(got.lse, full.lse, atol=0, rtol=0)       # (the lse stays fp32)
    bad = table.clone()
    bad[5, 0] = nb + 7
    _nan_row_5_only(run(cache, bad), got)
    _replays_to(lambda: run(cache, table), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [128, 16])
def test_unmerged_splits_fuse_with_the_dcp_rescale_on_gpu(dtype, heads, monkeypatch):
    """DCP's ag_rs combine on the GPU as one rank runs it (rank 2 of 4, the Gluon MLA kernels, several
    splits): the kernel's splits unmerged (merge=False) and `rescale_parts_to_merged` over every rank's
    split lses (the other ranks' made up) give what the merged call and `rescale_to_merged` give, to
    fp32 rounding, in one merge launch; the torch forms agree; a CUDA graph replays it."""
    from parallel.cp.merge import rescale_parts_to_merged, rescale_to_merged

    td, _, _ = _gluon_mla_kernels(monkeypatch)
    for key in ("min_split_wide", "min_split_wide_fp8", "min_split_wide_narrow"):
        monkeypatch.setitem(td.CONFIG, key, 256)         # several splits at these lengths
    size, rank = 4, 2
    cache, table, _, run, ref = _mla_gpu_problem(dtype, size, rank, heads, 1, 97 + heads)
    merged = run(cache, table)
    parts = run(cache, table, merge=False)
    p = parts.lse.shape[0]
    assert p > 1 and parts.out.shape[1:] == merged.out.shape
    gen = torch.Generator(device="cuda").manual_seed(5)
    near = torch.where(torch.isfinite(merged.lse), merged.lse, 0.0)      # (the other ranks' lses near this one's)
    lses = torch.randn(size, p, *parts.lse.shape[1:], device="cuda", generator=gen) * 3 + near
    lses[rank] = parts.lse
    lses[1, :, 1] = float("-inf")                          # (a rank with nothing of a sequence)
    one_each = torch.logsumexp(lses, 1)                    # each rank's merged lse, as the merged path gathers
    one_each[rank] = merged.lse
    want = rescale_to_merged(merged.out, one_each, rank)
    merges = _spy(monkeypatch, td, "merge_states_triton")
    got = rescale_parts_to_merged(parts.out, lses, rank)
    assert not merges
    # (fp32 rounding: the merged path rounds the splits' merge and its lse once more)
    torch.testing.assert_close(got.lse, want.lse, atol=5e-5, rtol=0, equal_nan=True)
    torch.testing.assert_close(got.out, want.out, atol=5e-5, rtol=0, equal_nan=True)
    slow = rescale_parts_to_merged(parts.out, lses, rank, backend="torch")
    torch.testing.assert_close(got.out, slow.out, atol=1e-6, rtol=0, equal_nan=True)
    _check_against_torch(merged, ref, 1)
    _replays_to(lambda: rescale_parts_to_merged(run(cache, table, merge=False).out, lses, rank), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["gqa", "mla128", "mla16", "mla128x2"])
def test_out_dtype_on_gpu(dtype, kind, monkeypatch):
    """out_dtype=bf16 through the installed kernels (Gluon GQA; MLA's full head tiles, its narrow ones,
    a speculative step through the expansion), rank 1 of 2, one split a sequence and several: the
    fp32 call's out rounded once (the split merge, or one split's kernel, stores it), the same lse;
    a CUDA graph replays it."""
    td = compiled_decode_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(41)
    layout = DCPLayout(size=2, rank=1, block_size=64)
    lens = [3000, 0, 77, 1, 640, 4096, 129, 64]
    if kind == "gqa":
        cache, _, table = _nan_gqa_cache(lens, 4, layout, dtype, gen)
        q = torch.randn(len(lens), 1, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    else:
        cache, _, table, _ = _mla_dcp_cache(lens, layout, dtype, gen)
        tq, heads = (2, 128) if kind == "mla128x2" else (1, int(kind[3:]))
        q = torch.randn(len(lens), tq, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")
    run = lambda **kw: paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.08, backend="triton",
                                              validate=False, **kw)
    for key in ("min_split", "min_split_fp8", "min_split_wide", "min_split_wide_fp8", "min_split_wide_narrow"):
        monkeypatch.setitem(td.CONFIG, key, 256)
    for programs in (1, 4096):      # (one split a sequence, then several)
        for key in ("target_programs_gluon_gqa", "target_programs_wide", "target_programs_wide_fp8",
                    "target_programs_tiles"):
            monkeypatch.setitem(td.CONFIG, key, programs)
        full = run()
        got = run(out_dtype=torch.bfloat16)
        assert got.out.dtype == torch.bfloat16
        torch.testing.assert_close(got.out.float(), full.out, atol=0, rtol=2.0 ** -8)    # (one rounding)
        torch.testing.assert_close(got.lse, full.lse, atol=0, rtol=0)
    _replays_to(lambda: run(out_dtype=torch.bfloat16), got)


def test_head_tiles_and_where_they_apply():
    """The swapped kernels' head tiles (`gluon_mla_narrow.head_tiles`): one tile of the columns rounded
    up to a power of two up to 32, else tiles of 32 (the last one padded); over an fp8 cache they
    need contiguous scales (`tiles_ok`: the direct kernel's loader brings them by TMA)."""
    from parallel.cp import gluon_mla_narrow as gn

    assert [gn.head_tiles(r) for r in (1, 12, 32, 33, 48, 64, 128, 256)] == [
        (8, 1), (16, 1), (32, 1), (32, 2), (32, 2), (32, 2), (32, 4), (32, 8)]
    assert [gn.head_tiles(r, 16) for r in (12, 16, 17, 48, 128)] == [(16, 1), (16, 1), (16, 2), (16, 3), (16, 8)]
    with pytest.raises(ValueError, match="16 or 32 columns wide, not 24"):
        gn.head_tiles(48, 24)
    fp8, bf16 = torch.zeros(1, dtype=torch.float8_e4m3fn), torch.zeros(1, dtype=torch.bfloat16)
    assert gn.tiles_ok(128, fp8, torch.ones(4, 2, 1)) == gn.HAS_GLUON
    assert not gn.tiles_ok(128, fp8, torch.ones(4, 2, 1)[:, :1])
    assert not gn.tiles_ok(128, fp8, None) and not gn.tiles_ok(0, fp8, torch.ones(4, 2, 1))
    assert gn.tiles_ok(128, bf16, None) == gn.HAS_GLUON


def test_narrow_mla_tiles_of_several_tokens_get_more_warps(monkeypatch):
    """The Triton kernel's narrow MLA tile over fp8 with more than 16 rows (a speculative step: 16
    heads x 2 tokens) launches with at least CONFIG num_warps_wide_narrow_fp8_32 warps (4 warps
    spilled 9 KB); one token, bf16 (slower with 8) and GQA keep their own."""
    from parallel.cp import triton_decode as td

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    narrow = td.CONFIG["num_warps_wide_narrow"]
    assert td.launch_settings(576, bf16, fp8, 16)["num_warps"] == narrow
    assert td.launch_settings(576, bf16, fp8, 32)["num_warps"] == 8
    assert td.launch_settings(576, bf16, bf16, 32)["num_warps"] == narrow
    monkeypatch.setitem(td.CONFIG, "num_warps_wide_narrow_fp8_32", 4)
    assert td.launch_settings(576, bf16, fp8, 32)["num_warps"] == max(4, narrow)
    assert td.launch_settings(128, bf16, fp8, 32)["num_warps"] == td.CONFIG["num_warps_fp8"]


def test_narrow_mla_columns_and_where_the_swapped_kernel_applies():
    """The swapped kernel's columns (heads rounded up to a power of two, at least 8) and its
    conditions: at most 32 query rows, over fp8 contiguous scales (its loader brings them by TMA)."""
    from parallel.cp import gluon_mla_narrow as gn

    assert [gn.columns(h) for h in (1, 8, 12, 16, 17, 32)] == [8, 8, 16, 16, 32, 32]
    assert not gn.narrow_ok(64, torch.zeros(1, dtype=torch.bfloat16), None)
    assert not gn.narrow_ok(16, torch.zeros(1, dtype=torch.float8_e4m3fn), torch.ones(4, 2, 1)[:, :1])
    assert gn.narrow_ok(16, torch.zeros(1, dtype=torch.float8_e4m3fn), torch.ones(4, 2, 1)) == gn.HAS_GLUON


def test_fp8_query_parts_hold_bf16_queries():
    """The direct fp8 kernels' query split (GQA and MLA's narrow tiles, docs/numerics.md §8.2): each row
    times 2^e with its largest magnitude in [2^7, 2^8) (e = 134 - its biased exponent, clamped to
    [-120, 107]), hi = e4m3(x 2^e), lo = e4m3(x 2^e - hi): no part saturates, hi + lo is the bf16 value
    exactly wherever |x 2^e| >= 8, and within 2^-10 of it (half e4m3's subnormal step) elsewhere, on rows
    whose elements spread over 2^40 across rows and 2^12 within one."""
    gen = torch.Generator().manual_seed(5)
    scale = torch.exp2(torch.randint(-20, 21, (256, 1), generator=gen).float())
    spread = torch.exp2(torch.randint(-12, 1, (256, 128), generator=gen).float())
    x = (torch.randn(256, 128, generator=gen) * scale * spread).to(torch.bfloat16).float()
    biased = (x.abs().amax(1).view(torch.int32) >> 23) & 0xFF
    xs = x * torch.exp2((134 - biased).clamp(-120, 107).float())[:, None]
    assert xs.abs().amax(1).ge(2 ** 7).all() and xs.abs().amax(1).lt(2 ** 8).all()     # (e4m3's max: 448)
    hi = xs.to(torch.float8_e4m3fn).float()
    lo = (xs - hi).to(torch.float8_e4m3fn).float()
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all()
    err = (hi + lo - xs).abs()
    assert (err[xs.abs() >= 8] == 0).all()
    assert err.max() <= 2 ** -10 and err.max() > 0        # (the bound is reached: subnormal parts round)


def _same_when_flipped(monkeypatch, td, key, call, got):
    """The call with the 0 / 1 CONFIG entry `key` flipped gives got exactly (a structure option that
    changes when work is issued, not what is computed). Restores the entry."""
    was = td.CONFIG[key]
    monkeypatch.setitem(td.CONFIG, key, 1 - was)
    other = call()
    monkeypatch.setitem(td.CONFIG, key, was)
    torch.testing.assert_close(other.out, got.out, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(other.lse, got.lse, atol=0, rtol=0, equal_nan=True)


def test_direct_narrow_mla_fp8_stages_fit_shared_memory():
    """The direct fp8 form's shared memory (`gluon_mla_narrow.direct_fits`: queries, raw stages of
    37.1 KB, two weight buffers): five raw stages fit at 8-32 columns (the sm_90a builds take 208.7 KB
    at 16 and 231.6 KB at 32, within the 232448 bytes), six do not; the dispatcher cuts the configured
    depth to what fits (`direct_stages`, 0: off), and the launcher refuses what does not fit with the
    numbers, before building anything."""
    from parallel.cp import gluon_mla_narrow as gn

    assert all(gn.direct_fits(h, 5) and not gn.direct_fits(h, 6) for h in (8, 16, 32))
    assert not gn.direct_fits(33, 1) and not gn.direct_fits(16, 0)
    assert gn.direct_stages(16, 5) == 5 and gn.direct_stages(32, 9) == 5 and gn.direct_stages(16, 0) == 0
    assert gn.direct_stages(64, 5) == 0
    # tile pairs: two raw stages (a pair's tiles) and at most 16 columns (at 32 they spilled)
    assert gn.pairs_apply(16, 2) and gn.pairs_apply(8, 5)
    assert not (gn.pairs_apply(32, 5) or gn.pairs_apply(16, 1))
    if gn.HAS_GLUON:
        k = torch.zeros(4, 64, 1, 576, dtype=torch.float8_e4m3fn)
        q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"direct fp8 MLA kernel with 1 x 16 query rows in 1 tile\(s\) of 16 columns and 6 raw stages"):
            gn.launch(q, k, torch.zeros(1, 4, dtype=torch.int32), torch.ones(1), None, None, 0.1, 1, 256, 1, 0, 1,
                      torch.ones(4, 64, 1), raw=6)


def test_bf16_gqa_kernel_takes_a_step_of_at_most_64_rows():
    """The bf16 Gluon GQA kernel's speculative steps (`gluon_gqa.bf16_max_tq`): tokens x query heads a kv
    head fill at most its 64-row tile, so 8 tokens at 8 heads a kv head, 4 at 16, 1 at 64, none past 64
    heads; the launcher refuses a wider step with its numbers, before building anything."""
    from parallel.cp import gluon_gqa

    assert [gluon_gqa.bf16_max_tq(g) for g in (1, 8, 16, 33, 64, 65, 0)] == [64, 8, 4, 1, 1, 0, 0]
    if gluon_gqa.HAS_GLUON:
        k = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
        q = torch.zeros(1, 5, 32, 128, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"at most 64 rows \(tokens x query heads a kv head\); got 5 x 16"):
            gluon_gqa.launch_gluon_gqa(q, k, k.clone(), torch.zeros(1, 4, dtype=torch.int32), torch.ones(1),
                                       None, None, 0.1, 1, 256, 1, 0, 1)


def test_direct_wide_mla_fp8_stages_fit_shared_memory():
    """The full-head-tile direct fp8 kernel's shared memory (`gluon_mla_direct.direct_fits`: the queries'
    e4m3 parts, raw stages of 37.1 KB, two weight buffers): three raw stages fit (its sm_90a build takes
    202.6 KB, under the estimate), four do not; where it applies (`direct_ok`: an fp8 cache with scales a
    TMA can read, one query token, heads a multiple of 64); the launcher refuses a depth that does not
    fit with the numbers, before building anything."""
    from parallel.cp import gluon_mla_direct as gd

    assert gd.direct_fits(gd.MAX_RAW) and not gd.direct_fits(gd.MAX_RAW + 1) and not gd.direct_fits(0)
    if not gd.HAS_GLUON:
        return
    k8 = torch.zeros(4, 64, 1, 576, dtype=torch.float8_e4m3fn)
    scales = torch.ones(4, 64, 1)
    q = torch.zeros(2, 1, 128, 576, dtype=torch.bfloat16)
    assert gd.direct_ok(q, k8, scales)
    assert not gd.direct_ok(q, k8.view(torch.uint8).view(torch.float8_e4m3fn), None)     # (no scales)
    assert not gd.direct_ok(q, k8, scales.transpose(0, 1))              # (not contiguous: no TMA over them)
    assert not gd.direct_ok(q, k8, torch.ones(4 * 64 + 1)[1:].view(4, 64, 1))   # (an unaligned base)
    assert not gd.direct_ok(torch.zeros(2, 2, 128, 576, dtype=torch.bfloat16), k8, scales)   # (two tokens)
    assert not gd.direct_ok(torch.zeros(2, 1, 96, 576, dtype=torch.bfloat16), k8, scales)    # (96 heads)
    assert not gd.direct_ok(q, torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16), scales)     # (bf16)
    with pytest.raises(ValueError, match=r"direct fp8 MLA kernel with 4 raw stages of 64 keys does not fit"):
        gd.launch(q, k8, torch.zeros(2, 4, dtype=torch.int32), torch.ones(2), None, None, 0.1, 1, 256, 1, 0, 1,
                  scales, raw=4)


def test_gluon_gqa_applies_only_to_its_layout():
    """The Gluon GQA kernel's conditions (`gluon_gqa_ok`): bf16 queries [S, 1, Hq, 128], a bf16 or
    fp8 (with fp32 scales) cache of separate contiguous k and v, <= 64 query heads per kv head,
    pages of a multiple of 64, one query token; never on CPU."""
    from parallel.cp import gluon_gqa

    q = torch.zeros(2, 1, 32, 128, dtype=torch.bfloat16)
    k, v = torch.zeros(4, 64, 4, 128, dtype=torch.bfloat16), torch.zeros(4, 64, 4, 128, dtype=torch.bfloat16)
    assert not gluon_gqa.gluon_gqa_ok(q, k, v, 1)          # a CPU tensor
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and gluon_gqa.HAS_GLUON):
        return
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    sc = torch.ones(4, 64, 4, device="cuda")
    assert gluon_gqa.gluon_gqa_ok(q, k, v, 1)
    assert gluon_gqa.gluon_gqa_ok(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), 1, sc, sc.clone())
    assert not gluon_gqa.gluon_gqa_ok(q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), 1)  # no scales
    assert not gluon_gqa.gluon_gqa_ok(q.float(), k, v, 1)                                      # fp32 queries
    assert not gluon_gqa.gluon_gqa_ok(q.expand(2, 2, 32, 128), k, v, 2)                         # two tokens
    assert not gluon_gqa.gluon_gqa_ok(q[..., :64].contiguous(), k[..., :64].contiguous(),
                                      v[..., :64].contiguous(), 1)                              # head dim 64
    assert not gluon_gqa.gluon_gqa_ok(q, k[:, :32], v[:, :32], 1)                               # 32-token pages
    assert not gluon_gqa.gluon_gqa_ok(q, k, k, 1)                                               # v is k
    assert not gluon_gqa.gluon_gqa_ok(torch.zeros(2, 1, 128, 128, dtype=torch.bfloat16, device="cuda"),
                                      k[:, :, :1].contiguous(), v[:, :, :1].contiguous(), 1)   # 128 per kv head


def _nan_gqa_cache(lens, hkv, layout, dtype, gen):
    """(cache with NaN in every unheld slot, and NaN scales there over fp8; the same cache with
    zeros / unit scales there for the torch path; the table) for sequences of `lens` tokens."""
    block, d = layout.block_size, 128
    per_seq = -(-max(lens) // (block * layout.size)) + 1
    nb = len(lens) * per_seq + 3
    table = torch.randperm(nb, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int().cuda()
    kv = [torch.full((nb, block, hkv, d), float("nan"), device="cuda") for _ in range(2)]
    sc = [torch.full((nb, block, hkv), float("nan"), device="cuda") for _ in range(2)]
    clean, clean_sc = [torch.zeros_like(x) for x in kv], [torch.ones_like(x) for x in sc]
    for s, n in enumerate(lens):
        if n:
            slots = layout.slot_mapping(torch.arange(n, device="cuda"), table[s])
            mine = slots >= 0
            for i in range(2):
                x = torch.randn(n, hkv, d, generator=gen).cuda()[mine]
                for dst, sdst in ((kv[i], sc[i]), (clean[i], clean_sc[i])):
                    dst.view(-1, hkv, d)[slots[mine]] = x
                    sdst.view(-1, hkv)[slots[mine]] = x.abs().amax(-1) / 448.0
    if dtype == torch.float8_e4m3fn:
        q8 = lambda x, s: (x / s[..., None]).to(dtype)
        return (PagedKVCache(q8(kv[0], sc[0]), q8(kv[1], sc[1]), *sc),
                PagedKVCache(q8(clean[0], clean_sc[0]), q8(clean[1], clean_sc[1]), *clean_sc), table)
    return PagedKVCache(*(x.to(dtype) for x in kv)), PagedKVCache(*(x.to(dtype) for x in clean)), table


@pytest.mark.gpu
@pytest.mark.parametrize("q_exp,hq,hkv", [(0, 32, 4), (-60, 16, 1), (70, 32, 2)])
def test_gluon_gqa_direct_fp8_extreme_scales_on_gpu(q_exp, hq, hkv, monkeypatch):
    """The direct fp8 GQA kernel (CONFIG direct_gluon_gqa_fp8) with per-token value scales spread over
    2^-40..2^40, keys' over 2^-30..2^10, queries at 2^q_exp (their e4m3 hi + lo parts take a power of
    two per row), 8 / 16 query heads per kv head, lengths ending inside a tile and inside a step of
    four, an empty sequence and several splits, against the torch path in fp32: lse within 4e-3 of the
    largest sum_d |q_d k_d| over the sequence's keys (the fp8 score MMAs accumulate with ~14 bits, which
    bounds a score's error by its terms, not by itself: a score near zero carries their error whole),
    each output within 4e-3 of the largest |v * v_scale| among the sequence's tokens."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_gqa

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_gqa.HAS_GLUON):
        pytest.skip("the Gluon GQA kernel needs an sm_90 GPU and a Triton with Gluon")
    monkeypatch.setitem(td.CONFIG, "gluon_gqa_fp8", 1)
    monkeypatch.setitem(td.CONFIG, "direct_gluon_gqa_fp8", 8)
    monkeypatch.setitem(td.CONFIG, "target_programs_gluon_gqa", 1024)
    ran = []
    real = gluon_gqa.direct_stages
    monkeypatch.setattr(gluon_gqa, "direct_stages", lambda *a: ran.append(real(*a)) or ran[-1])
    lens = [3000, 2, 0, 190, 1100, 64]
    cache, table, layout, _, _ = fill_paged_cache(lens, hkv, 128, 128, 64, 1, 0, 1, torch.float8_e4m3fn, seed=7 + hq,
                                       device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(q_exp + 200)
    cache.v_scale.mul_(torch.exp2(torch.randint(-40, 41, cache.v_scale.shape, generator=gen, device="cuda").float()))
    cache.k_scale.mul_(torch.exp2(torch.randint(-30, 11, cache.k_scale.shape, generator=gen, device="cuda").float()))
    q = (torch.randn(len(lens), 1, hq, 128, generator=gen, device="cuda") * 2.0 ** q_exp).to(torch.bfloat16)
    seq = torch.tensor(lens, device="cuda")
    ref = paged_decode_attention(q.float(), cache, table, seq, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, backend="triton")
    assert ran and ran[-1] >= 8, ran
    finite = torch.isfinite(ref.lse)
    assert torch.equal(finite, torch.isfinite(got.lse)) and not finite[2].any()
    g = hq // hkv
    for i, n in enumerate(lens):
        if not n:
            continue
        blocks = table[i, : -(-n // 64)].long()
        dense = lambda x, sc: x[blocks].float().flatten(0, 1)[:n] * sc[blocks].flatten(0, 1)[:n, :, None]
        k, v = dense(cache.k, cache.k_scale), dense(cache.v, cache.v_scale)      # [n, hkv, 128]
        # lse: a score's error is relative to sum_d |q_d k_d| (the fp8 MMAs' accumulation, the queries' hi + lo
        # parts), not to the score, which may cancel to near zero; lse moves by at most the largest such error
        mags = torch.einsum("hd,nhd->hn", q[i, 0].float().abs(), k.abs().repeat_interleave(g, 1)) * 128 ** -0.5
        bound = 4e-3 * mags.amax(-1) + 4e-3
        assert ((got.lse[i, 0] - ref.lse[i, 0]).abs() <= bound).all(), (i, (got.lse[i, 0] - ref.lse[i, 0]).abs()
                                                                         / bound)
        # out: within 4e-3 of the largest |v * v_scale| among the sequence's own tokens
        span = v.abs().amax()
        err = (got.out[i] - ref.out[i]).abs().max()
        assert err <= 4e-3 * span, (i, err / span)
    assert (got.out[2] == 0).all()


def _gqa_step_problem(monkeypatch, size, rank, interleave, hq, hkv, tq, dtype, seed):
    """A speculative GQA step on the GPU for the Gluon kernels' tests: NaN in every unheld slot, lengths
    ending inside a tile and as short as the step. Returns (the kernels' CONFIG module, call(q, seq) on
    the Triton backend, the torch path's result, the list the Gluon launches append their options to,
    q, seq, gen); skips without an sm_90 GPU and Gluon."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_gqa

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_gqa.HAS_GLUON):
        pytest.skip("the Gluon GQA kernel needs an sm_90 GPU and a Triton with Gluon")
    lens = [max(n, tq) for n in (3000, 2, 77, 5, 640, 4096, 129, 64)]
    gen = torch.Generator().manual_seed(seed + rank + tq)
    layout = DCPLayout(size=size, rank=rank, block_size=64, interleave=interleave)
    cache, ref_cache, table = _nan_gqa_cache(lens, hkv, layout, dtype, gen)
    q = torch.randn(len(lens), tq, hq, 128, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")
    call = lambda q, seq: paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.088, backend="triton")
    ref = paged_decode_attention(q, ref_cache, table, seq, layout=layout, scale=0.088, backend="torch")
    used = []
    real = gluon_gqa.launch_gluon_gqa
    monkeypatch.setattr(gluon_gqa, "launch_gluon_gqa", lambda *a, **kw: used.append(kw) or real(*a, **kw))
    return td, call, ref, used, q, seq, gen


@pytest.mark.gpu
@pytest.mark.parametrize("size,rank,interleave,hq,hkv,tq", [(1, 0, 1, 32, 4, 2), (2, 1, 1, 32, 4, 4),
                                                            (4, 3, 16, 16, 4, 4), (2, 0, 1, 8, 8, 3)])
def test_gluon_gqa_direct_fp8_speculative_tokens_on_gpu(size, rank, interleave, hq, hkv, tq, monkeypatch):
    """The direct fp8 GQA kernel with a speculative step's query tokens as more columns (tokens x heads
    a kv head, at most 32), causal within the step over DCP's (interleaved) global positions: against
    the torch path and the Triton kernel that serves it elsewhere, NaN in every unheld slot, lengths
    ending inside a tile, one split and several; more than 32 columns stay on the Triton kernel; a CUDA
    graph replays it to the same result."""
    td, call, ref, used, q, seq, _ = _gqa_step_problem(monkeypatch, size, rank, interleave, hq, hkv, tq,
                                                       torch.float8_e4m3fn, 71)
    run = lambda: call(q, seq)
    monkeypatch.setitem(td.CONFIG, "gluon_gqa_fp8", 0)
    plain = run()
    assert not used
    monkeypatch.setitem(td.CONFIG, "gluon_gqa_fp8", 1)
    for programs in (132, 4096):        # (one split a sequence, then several)
        monkeypatch.setitem(td.CONFIG, "target_programs_gluon_gqa", programs)
        got = run()
        assert used and used[-1]["direct"] > 0, used
        used.clear()
        finite = torch.isfinite(ref.lse)        # (a rank may hold none of a short sequence's tokens)
        assert torch.equal(finite, torch.isfinite(got.lse)) and torch.isfinite(got.out).all()
        torch.testing.assert_close(got.lse[finite], ref.lse[finite], atol=2e-2, rtol=0)
        torch.testing.assert_close(got.out, ref.out, atol=2e-2, rtol=0)
        torch.testing.assert_close(got.out, plain.out, atol=4e-3, rtol=0)
        torch.testing.assert_close(got.lse[finite], plain.lse[finite], atol=4e-3, rtol=0)
        for key in ("paired_store_direct_fp8", "ids_ahead_direct_fp8"):    # (the same values, moved otherwise)
            _same_when_flipped(monkeypatch, td, key, run, got)
        used.clear()
    _replays_to(run, got)
    used.clear()                # (the capture's launch)
    if tq * hq // hkv <= 16:     # (twice the tokens: more than 32 columns only where the step is wider)
        return
    call(torch.cat([q, q], 1), seq.clamp(min=2 * tq))
    assert not used, "more than 32 columns went to the Gluon kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("size,rank,interleave,hq,hkv,tq", [(1, 0, 1, 32, 4, 2), (2, 1, 1, 32, 4, 4),
                                                            (4, 3, 16, 16, 4, 4), (2, 0, 1, 64, 8, 8),
                                                            (2, 1, 1, 8, 8, 3), (1, 0, 1, 64, 4, 2)])
def test_gluon_gqa_bf16_speculative_tokens_on_gpu(size, rank, interleave, hq, hkv, tq, monkeypatch):
    """The bf16 Gluon GQA kernel with a speculative step's query tokens as more rows of its 64-row tile
    (tokens x heads a kv head, at most 64; CONFIG gluon_gqa_tokens), causal within the step over DCP's
    (interleaved) global positions: against the torch path and the Triton kernel that served those
    steps before, NaN in every unheld slot, lengths ending inside a tile, sequences as short as the
    step (where a rank holds no key at or before a token's position, that row's lse is -inf and its
    out 0), one split and several; the ids loaded ahead or after give the same bits; more than 64 rows
    stay on the Triton kernel; a CUDA graph replays it to the same result."""
    td, call, ref, used, q, seq, gen = _gqa_step_problem(monkeypatch, size, rank, interleave, hq, hkv, tq,
                                                         torch.bfloat16, 83)
    run = lambda: call(q, seq)
    monkeypatch.setitem(td.CONFIG, "gluon_gqa_tokens", 0)
    plain = run()
    assert not used, "with gluon_gqa_tokens 0 a step of several tokens went to the Gluon kernel"
    monkeypatch.setitem(td.CONFIG, "gluon_gqa_tokens", 1)
    for programs in (132, 4096):        # (one split a sequence, then several)
        monkeypatch.setitem(td.CONFIG, "target_programs_gluon_gqa", programs)
        monkeypatch.setitem(td.CONFIG, "min_split", 64)
        got = run()
        assert used, "the step did not launch the Gluon kernel"
        used.clear()
        finite = torch.isfinite(ref.lse)        # (a rank may hold none of a short sequence's tokens)
        assert torch.equal(finite, torch.isfinite(got.lse)) and torch.isfinite(got.out).all()
        assert (got.lse[~finite] == float("-inf")).all() and (got.out[~finite] == 0).all()
        torch.testing.assert_close(got.lse[finite], ref.lse[finite], atol=2e-2, rtol=0)
        torch.testing.assert_close(got.out, ref.out, atol=2e-2, rtol=0)
        torch.testing.assert_close(got.out, plain.out, atol=2e-3, rtol=0)
        torch.testing.assert_close(got.lse[finite], plain.lse[finite], atol=1e-4, rtol=0)
        _same_when_flipped(monkeypatch, td, td.ids_ahead_key(False), run, got)
        used.clear()
    _replays_to(run, got)
    used.clear()                # (the capture's launch)
    wide = 64 // (hq // hkv) + 1     # (the fewest tokens that take more than 64 rows: where the API allows them)
    if wide > 8:
        return
    call(torch.randn(len(seq), wide, hq, 128, generator=gen).to(torch.bfloat16).cuda(), seq.clamp(min=wide))
    assert not used, "more than 64 rows went to the Gluon kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("size,rank,hq,hkv", [(1, 0, 32, 4), (2, 1, 32, 4), (4, 2, 8, 8), (1, 0, 64, 1)])
def test_gluon_gqa_kernel_on_gpu(dtype, size, rank, hq, hkv, monkeypatch):
    """The warp-specialized Gluon GQA kernels (CONFIG gluon_gqa / gluon_gqa_fp8) over every kind of
    DCP rank, 1 / 8 / 64 query heads per kv head, 2- and 4-stage rings over bf16, over fp8 the direct
    form (8, 9 raw stages; tiles in steps of four, splits of every remainder of them; at 64 heads a kv
    head, or with direct_gluon_gqa_fp8 0, the Triton kernel serves it instead): NaN in every slot past a sequence's end (NaN scales too over fp8),
    lengths that end inside a tile, empty and one-token
    sequences, one split and several, against the torch path and the Triton kernel (each setting
    must launch the Gluon kernel); a bad block id gives that sequence NaN rows; a CUDA graph of it
    replays to the same result."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_gqa

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_gqa.HAS_GLUON):
        pytest.skip("the Gluon GQA kernel needs an sm_90 GPU and a Triton with Gluon")
    key = "gluon_gqa_fp8" if dtype == torch.float8_e4m3fn else "gluon_gqa"
    lens = [3000, 0, 77, 1, 640, 4096, 129, 64]
    gen = torch.Generator().manual_seed(31 + rank + hq)
    layout = DCPLayout(size=size, rank=rank, block_size=64)
    cache, ref_cache, table = _nan_gqa_cache(lens, hkv, layout, dtype, gen)
    q = torch.randn(len(lens), 1, hq, 128, generator=gen).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens, device="cuda")
    run = lambda c, t: paged_decode_attention(q, c, t, seq, layout=layout, scale=0.088, backend="triton")
    ref = paged_decode_attention(q, ref_cache, table, seq, layout=layout, scale=0.088, backend="torch")
    used, direct_used = [], []
    real, real_stages = gluon_gqa.launch_gluon_gqa, gluon_gqa.direct_stages
    monkeypatch.setattr(gluon_gqa, "launch_gluon_gqa", lambda *a, **kw: used.append(1) or real(*a, **kw))
    monkeypatch.setattr(gluon_gqa, "direct_stages", lambda *a: direct_used.append(real_stages(*a)) or direct_used[-1])
    fp8 = dtype == torch.float8_e4m3fn
    # one split a sequence, then several; over bf16 a 2-, 3- and 4-stage ring; over fp8 the direct form with
    # 8, 9 and 1 (raised to its least, 8) raw stages, and 0: the Triton kernel (as more than 32 heads a kv head)
    settings = (((132, 3, 0), (132, 3, 8), (4096, 2, 9), (4096, 3, 1)) if fp8
                else ((132, 3, 8), (4096, 3, 8), (132, 2, 8), (4096, 4, 8)))
    for programs, stages, direct in settings:
        monkeypatch.setitem(td.CONFIG, "direct_gluon_gqa_fp8", direct)
        monkeypatch.setitem(td.CONFIG, "target_programs_gluon_gqa", programs)
        monkeypatch.setitem(td.CONFIG, "stages_gluon_gqa", stages)
        monkeypatch.setitem(td.CONFIG, "min_split", 256)
        monkeypatch.setitem(td.CONFIG, "min_split_fp8", 256)
        monkeypatch.setitem(td.CONFIG, key, 0)
        plain = run(cache, table)
        assert not used
        monkeypatch.setitem(td.CONFIG, key, 1)
        got = run(cache, table)
        # (over fp8 without the direct form, or more than 32 heads a kv head: the Triton kernel)
        gluon = not fp8 or (direct > 0 and hq // hkv <= 32)
        assert bool(used) == gluon, f"setting {programs, stages, direct}: Gluon kernel launched {used}"
        ran_direct = bool(fp8 and used and direct_used and direct_used[-1] > 0)
        assert ran_direct == (fp8 and direct > 0 and hq // hkv <= 32), (direct, direct_used)
        used.clear()
        direct_used.clear()
        _check_against_torch(got, ref, 1)
        # (the direct form's scores see the queries as two e4m3 parts, ~8 significant bits: a bf16 query's)
        torch.testing.assert_close(got.out, plain.out, atol=4e-3 if ran_direct else 2e-3, rtol=0)
        torch.testing.assert_close(got.lse, plain.lse, atol=4e-3 if ran_direct else 1e-4, rtol=0)
        # the loader's first block ids loaded beside the length (the bf16 and direct forms), the direct
        # form's paired output stores: when and how the same values move, the same result
        for flip in (td.ids_ahead_key(fp8), "paired_store_direct_fp8") if gluon else ():
            _same_when_flipped(monkeypatch, td, flip, lambda: run(cache, table), got)
        used.clear()
        direct_used.clear()
    bad = table.clone()
    bad[5, 0] = cache.k.shape[0] + 7
    for ahead in (0, 1):
        monkeypatch.setitem(td.CONFIG, td.ids_ahead_key(fp8), ahead)
        _nan_row_5_only(paged_decode_attention(q, cache, bad, seq, layout=layout, scale=0.088, backend="triton",
                                               validate=False), got)
    _replays_to(lambda: run(cache, table), got)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gqa-bf16", "gqa-fp8", "mla16-bf16", "mla16-fp8"])
def test_gluon_kernels_check_block_ids_past_a_splits_first_64_pages(kind, monkeypatch):
    """A split longer than 64 pages (one split over 5000 tokens): a bad block id at page 70 makes that
    sequence's rows NaN, with the check after the loop and with ids_ahead, whose first 64
    ids are loaded beside the length and the rest after the loop (`gluon_mla._bad_ids_after`); the
    other sequence exact, and without the bad id both forms the same to the bit. A grid sized by a
    max_seq_len below a sequence's length makes that sequence NaN too."""
    td = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_gqa, gluon_mla

    if not (torch.cuda.get_device_capability() == (9, 0) and gluon_mla.HAS_GLUON and gluon_gqa.HAS_GLUON):
        pytest.skip("the Gluon decode kernels need an sm_90 GPU and a Triton with Gluon")
    dtype = torch.float8_e4m3fn if kind.endswith("fp8") else torch.bfloat16
    for key in ("target_programs_gluon_gqa", "target_programs_wide", "target_programs_wide_fp8"):
        monkeypatch.setitem(td.CONFIG, key, 1)          # (one split a sequence)
    lens = [5000, 300]
    gen = torch.Generator().manual_seed(77)
    layout = DCPLayout(size=1, rank=0, block_size=64)
    seq = torch.tensor(lens, device="cuda")
    if kind.startswith("gqa"):
        cache, _, table = _nan_gqa_cache(lens, 4, layout, dtype, gen)
        q = torch.randn(len(lens), 1, 32, 128, generator=gen).to(torch.bfloat16).cuda()
        used, real = [], gluon_gqa.launch_gluon_gqa
        monkeypatch.setattr(gluon_gqa, "launch_gluon_gqa", lambda *a, **kw: used.append(1) or real(*a, **kw))
    else:
        from parallel.cp import gluon_mla_narrow

        cache, _, table, _ = _mla_dcp_cache(lens, layout, dtype, gen)
        q = torch.randn(len(lens), 1, 16, 576, generator=gen).to(torch.bfloat16).cuda()
        used, real = [], gluon_mla_narrow.launch
        monkeypatch.setattr(gluon_mla_narrow, "launch", lambda *a, **kw: used.append(1) or real(*a, **kw))
    run = lambda t: paged_decode_attention(q, cache, t, seq, layout=layout, scale=0.08, backend="triton",
                                           validate=False)
    bad = table.clone()
    bad[0, 70] = cache.k.shape[0] + 3
    results = {}
    for ahead in (0, 1):
        monkeypatch.setitem(td.CONFIG, td.ids_ahead_key(dtype == torch.float8_e4m3fn, narrow=kind.startswith("mla")),
                            ahead)
        results[ahead] = run(table)
        nan = run(bad)
        assert used, "the Gluon kernel was not launched"
        assert torch.isnan(nan.out[0]).all() and torch.isnan(nan.lse[0]).all(), ahead
        torch.testing.assert_close(nan.out[1], results[ahead].out[1], atol=0, rtol=0)
        assert torch.isfinite(results[ahead].out).all()
    torch.testing.assert_close(results[1].out, results[0].out, atol=0, rtol=0)
    torch.testing.assert_close(results[1].lse, results[0].lse, atol=0, rtol=0)
    # the grid sized by max_seq_len 300: sequence 0 (5000 tokens) lies past every split's reach -> NaN, not
    # attention over its first tokens; sequence 1 as before
    short = paged_decode_attention(q, cache, table, seq, layout=layout, scale=0.08, backend="triton", validate=False,
                                   max_seq_len=300)
    assert torch.isnan(short.out[0]).all() and torch.isnan(short.lse[0]).all()
    torch.testing.assert_close(short.out[1], results[0].out[1])
    torch.testing.assert_close(short.lse[1], results[0].lse[1])


# ---- the kernel against float64 attention computed by hand on awkward cases (interpreter, tiny) ----


def _poisoned_cache(lens, tq, hkv, d, dv, layout, width, dtype, gen, latent=False, table_dtype=torch.int32):
    """A cache whose slots hold random values for this rank's tokens of each sequence and NaN everywhere
    else (spare blocks, slots past a length), and a table of `width` entries a sequence whose unused
    entries are garbage: ids outside the cache (negative, past it, near int32's end) or poisoned spare
    blocks. fp8 caches are built by torch (the interpreter's fp32 -> fp8 rounding is not trusted), with
    per-(token, head) scales; latent: one head whose value is the key's first dv dims (MLA's layout)."""
    bs = layout.block_size
    local = [int(layout.local_lengths(n)) for n in lens]
    used = [-(-n // bs) for n in local]
    nb = sum(used) + 3                                           # 3 spare (poisoned) blocks
    ids = torch.randperm(nb, generator=gen)
    table = torch.empty(len(lens), width, dtype=torch.int64)
    garbage = [-1, -7, nb, nb + 5, 2 ** 31 - 1, *ids[-3:].tolist()]
    at = 0
    for s, u in enumerate(used):
        table[s, :u] = ids[at:at + u]
        at += u
        for w in range(u, width):
            table[s, w] = garbage[(s + w) % len(garbage)]
    k = torch.full((nb, bs, hkv, d), float("nan"))
    v = torch.full((nb, bs, hkv, dv), float("nan"))
    ks = torch.full((nb, bs, hkv), float("nan"))
    vs = torch.full((nb, bs, hkv), float("nan"))
    for s, n in enumerate(local):
        for j in range(n):
            b, o = int(table[s, j // bs]), j % bs
            k[b, o] = torch.randn(hkv, d, generator=gen)
            v[b, o] = torch.randn(hkv, dv, generator=gen)
            ks[b, o] = torch.rand(hkv, generator=gen) * 0.1 + 0.01
            vs[b, o] = torch.rand(hkv, generator=gen) * 0.1 + 0.01
    if latent:
        v, vs = k[..., :dv], ks
    if dtype == torch.float8_e4m3fn:
        k8 = (k / ks[..., None]).to(torch.float8_e4m3fn)                                  # (NaN stays NaN)
        v8 = k8[..., :dv] if latent else (v / vs[..., None]).to(torch.float8_e4m3fn)
        return PagedKVCache(k8, v8, ks, vs), table.to(table_dtype)
    return PagedKVCache(k, v), table.to(table_dtype)


def _attention_by_hand(q, cache, table, seq_lens, layout, scale):
    """float64 (out, lse) of each query over this rank's tokens of its sequence: the rank's tokens are
    the global positions p < L with (p // I) % N == rank, stored densely in position order (local token
    j at block table[s, j // B], offset j % B), dequantized by their scales; query t sits at
    L - Tq + t and sees the tokens at positions <= its own."""
    s_count, tq, hq, d = q.shape
    hkv, bs, dv = cache.k.shape[2], cache.block_size, cache.v.shape[-1]
    n, i, rank = layout.size, layout.interleave, layout.rank
    out = torch.zeros(s_count, tq, hq, dv, dtype=torch.float64)
    lse = torch.full((s_count, tq, hq), -math.inf, dtype=torch.float64)
    for s in range(s_count):
        length = int(seq_lens[s])
        mine = [p for p in range(length) if (p // i) % n == rank]
        if not mine:
            continue
        slots = [(int(table[s, j // bs]), j % bs) for j in range(len(mine))]
        k = torch.stack([cache.k[b, o].double() for b, o in slots])                 # [n, Hkv, D]
        v = torch.stack([cache.v[b, o].double() for b, o in slots])
        if cache.is_fp8:
            k = k * torch.stack([cache.k_scale[b, o].double() for b, o in slots])[..., None]
            v = v * torch.stack([cache.v_scale[b, o].double() for b, o in slots])[..., None]
        pos = torch.tensor(mine)
        for t in range(tq):
            seen = pos <= length - tq + t
            if not seen.any():
                continue
            for h in range(hq):
                kv_head = h // (hq // hkv)
                scores = (k[seen, kv_head] @ q[s, t, h].double()) * scale
                lse[s, t, h] = torch.logsumexp(scores, 0)
                out[s, t, h] = torch.softmax(scores, 0) @ v[seen, kv_head]
    return out, lse


AWKWARD = {
    # one token, GQA 4 heads per kv head; an empty sequence, one ending at a block's end, one a token past it
    "tq1-gqa": dict(lens=[5, 0, 16, 17], tq=1, hq=8, hkv=2, d=32, dv=32, size=1, rank=0, interleave=1, block=8,
                    width=5, dtype=torch.float32, table_dtype=torch.int32),
    # speculative tokens, one kv head for 4 query heads, v narrower than k, int64 table, several splits
    "tq3-splits": dict(lens=[3, 24, 9, 40], tq=3, hq=4, hkv=1, d=16, dv=32, size=1, rank=0, interleave=1, block=8,
                       width=7, dtype=torch.float32, table_dtype=torch.int64, splits=True),
    # one sequence, 8 speculative tokens, DCP rank 1 of 2 with interleave 2, fp8 with per-(token, head) scales
    "tq8-dcp-fp8": dict(lens=[27], tq=8, hq=4, hkv=2, d=16, dv=16, size=2, rank=1, interleave=2, block=4,
                        width=6, dtype=torch.float8_e4m3fn, table_dtype=torch.int32),
    # DCP rank 2 of 3, interleave 2: the first sequence has no token here (lse -inf, out 0), one ends at a
    # virtual block's end (3 ranks x 4); fp8 with bf16 queries (fp16 operands) and several splits
    "tq2-dcp-empty-fp8": dict(lens=[4, 12, 60, 2], tq=2, hq=4, hkv=2, d=16, dv=16, size=3, rank=2, interleave=2,
                              block=4, width=8, dtype=torch.float8_e4m3fn, table_dtype=torch.int32, splits=True,
                              q_dtype=torch.bfloat16),
    # MLA's latent layout (one head, v = k[..., :32] of a 48-wide key), fp8 with one scale per token,
    # DCP rank 0 of 2, speculative tokens
    "mla-latent-fp8": dict(lens=[6, 19], tq=4, hq=4, hkv=1, d=48, dv=32, size=2, rank=0, interleave=1, block=4,
                           width=4, dtype=torch.float8_e4m3fn, table_dtype=torch.int32, latent=True),
}


@pytest.mark.parametrize("case", list(AWKWARD))
def test_kernel_matches_float64_attention_by_hand(case, monkeypatch):
    """The Triton kernel (and the torch path) against float64 attention gathered token by token from the
    block table, with NaN in every slot no sequence holds and garbage past each table's used entries;
    the grid sized by the table (max_seq_len None) and by the longest sequence (max_seq_len given)."""
    from parallel.cp import triton_decode as td

    c = AWKWARD[case]
    if c.get("splits"):     # (short splits: several per sequence, some past a sequence's end, then the merge)
        for key in ("min_split", "min_split_fp8", "block_n", "block_n_fp8"):
            monkeypatch.setitem(td.CONFIG, key, 16)
        for key in ("target_programs", "target_programs_fp8"):
            monkeypatch.setitem(td.CONFIG, key, 1 << 12)
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    layout = DCPLayout(size=c["size"], rank=c["rank"], block_size=c["block"], interleave=c["interleave"])
    cache, table = _poisoned_cache(c["lens"], c["tq"], c["hkv"], c["d"], c["dv"], layout, c["width"], c["dtype"], gen,
                                   latent=c.get("latent", False), table_dtype=c["table_dtype"])
    q = torch.randn(len(c["lens"]), c["tq"], c["hq"], c["d"], generator=gen).to(c.get("q_dtype", torch.float32))
    seq = torch.tensor(c["lens"])
    scale = 0.3
    want_out, want_lse = _attention_by_hand(q, cache, table, seq, layout, scale)
    empty = torch.isinf(want_lse)
    if c.get("splits"):
        settings = td.launch_settings(c["d"], q.dtype, cache.k.dtype, c["tq"] * c["hq"] // c["hkv"])
        assert td.plan_splits(c["width"] * c["block"], 1, settings["block_n"], settings["min_split"])[0] > 1
    atol = 2e-3 if q.dtype == torch.bfloat16 else 2e-5     # (bf16 queries over fp8: fp16 weights)
    for backend in ("triton", "torch"):
        for max_seq_len in (None, max(c["lens"])):
            got = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend=backend,
                                         max_seq_len=max_seq_len)
            where = f"{backend}, max_seq_len {max_seq_len}"
            assert torch.equal(torch.isinf(got.lse), empty) and (got.lse[empty] < 0).all(), where
            assert (got.out[empty] == 0).all() and torch.isfinite(got.out).all(), where
            torch.testing.assert_close(got.lse.double(), want_lse, atol=atol, rtol=1e-5, msg=where)
            torch.testing.assert_close(got.out.double(), want_out, atol=atol, rtol=1e-5, msg=where)
    if case == "tq2-dcp-empty-fp8":
        # (4 and 2 tokens: ranks 0 and 1 hold them all)
        assert empty[0].all() and empty[3].all() and not empty[1:3].any()


def test_kernel_is_not_chosen_for_queries_of_another_dtype_than_the_cache(monkeypatch):
    """The kernel's MMAs take both operands in one dtype (an fp8 cache is converted to the queries'):
    fp32 queries over a bf16 cache, or bf16 over fp32, are the torch path's under "auto" on CUDA and a
    ValueError naming the dtypes when "triton" is asked for, before any launch (it failed inside the
    Triton compile: "Both operands must be same dtype")."""
    from parallel.cp import triton_decode
    from parallel.cp.paged import DECODE

    cuda = dict(device=torch.device("cuda"), head_dim=16, v_head_dim=16)
    assert DECODE.resolve("auto", dtype=torch.float32, cache_dtype=torch.bfloat16, **cuda) == "torch"
    assert DECODE.resolve("auto", dtype=torch.float16, cache_dtype=torch.bfloat16, **cuda) == "torch"
    for q_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert DECODE.resolve("auto", dtype=q_dtype, cache_dtype=q_dtype, **cuda) == "triton"
        assert DECODE.resolve("auto", dtype=q_dtype, cache_dtype=torch.float8_e4m3fn, **cuda) == "triton"

    launched = []
    monkeypatch.setattr(triton_decode, "paged_decode_triton", lambda *a, **kw: launched.append(1))
    cache = PagedKVCache(torch.randn(4, 8, 1, 16), torch.randn(4, 8, 1, 16))
    table, seq = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5])
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match=r"'triton' cannot run here: the kernel reads a torch.float32 cache with "
                                         r"torch.float32 queries .*got torch.bfloat16 queries"):
        paged_decode_attention(q.bfloat16(), cache, table, seq, backend="triton")
    assert not launched
    ref = paged_decode_attention(q, cache, table, seq, backend="torch")
    got = paged_decode_attention(q.bfloat16(), cache, table, seq)           # ("auto": the torch path)
    torch.testing.assert_close(got.lse, ref.lse, atol=0.05, rtol=0)


def test_bad_input_raises_naming_the_values_before_any_launch(monkeypatch):
    """Values checked on CPU tensors before the kernel is launched: a used block id past int32 in an
    int64 table, a length past max_seq_len, a negative length, a length past the table's capacity that
    this DCP rank's own share would fit (rank 1 of 2), head counts that do not divide, an fp8 cache
    whose scales went missing."""
    from parallel.cp import triton_decode

    def launch(*args, **kwargs):
        raise RuntimeError("launched")

    monkeypatch.setattr(triton_decode, "paged_decode_triton", launch)
    cache = PagedKVCache(torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16))
    table, q = torch.tensor([[0, 1], [2, 3]]), torch.randn(2, 4, 16)
    run = lambda *a, **kw: paged_decode_attention(*a, backend="triton", **kw)
    with pytest.raises(ValueError, match=r"block ids \[1099511627776\] outside the cache's \[0, 4\)"):
        run(q, cache, torch.tensor([[0, 2 ** 40], [2, 3]]), torch.tensor([5, 3]))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 5 exceeds max_seq_len \(4\)"):
        run(q, cache, table, torch.tensor([5, 3]), max_seq_len=4)
    with pytest.raises(ValueError, match=r"seq_lens must be >= 0; seq_lens\[1\] = -1"):
        run(q, cache, table, torch.tensor([5, -1]))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 17 exceeds the block table's capacity: 2 blocks x 8 "
                                         r"tokens \(block_size 4 x 2 ranks\) = 16"):
        run(q, cache, table, torch.tensor([5, 17]), layout=DCPLayout(2, 1, 4))
    with pytest.raises(ValueError, match=r"query heads \(5\) must be a multiple of the cache's kv heads \(2\)"):
        run(torch.randn(2, 5, 16), cache, table, torch.tensor([5, 3]))
    fp8 = PagedKVCache.allocate(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    fp8.v_scale = None
    with pytest.raises(ValueError, match=r"fp8 cache needs v_scale float32 \(4, 4, 2\), got None"):
        run(q, fp8, table, torch.tensor([5, 3]))
    with pytest.raises(RuntimeError, match="launched"):      # (good values reach the launch)
        run(q, cache, table, torch.tensor([5, 3]), max_seq_len=5)


def test_apply_tuning_sets_every_config_entry_and_refuses_a_bad_config_whole():
    """Every CONFIG entry is settable through {"config": {...}} (ids_ahead, ids_ahead_direct_fp8 and
    paired_store_direct_fp8 raised KeyError: no validity rule matched their names); a "config" that is
    not a dict and a bad entry after good ones raise ValueError and install nothing."""
    from parallel.cp import triton_decode as td

    before = dict(td.CONFIG)
    try:
        for name, value in before.items():
            td.apply_tuning({"config": {name: value}})
        td.apply_tuning({"config": {"ids_ahead": 0, "ids_ahead_direct_fp8": 1, "paired_store_direct_fp8": 0}})
        assert (td.CONFIG["ids_ahead"], td.CONFIG["ids_ahead_direct_fp8"], td.CONFIG["paired_store_direct_fp8"]) == (0, 1, 0)
        td.CONFIG.update(before)
        for bad, match in (({"config": {"ids_ahead": 2}}, r"decode CONFIG ids_ahead = 2 is invalid; valid: 0, 1"),
                           ({"config": {"paired_store_direct_fp8": True}}, r"paired_store_direct_fp8 = True is invalid"),
                           ({"gqa": {"block_n": 16}, "config": [("pdl", 0)]}, r"'config' must be a dict"),
                           ({"gqa": {"block_n": 16}, "mla": {"num_warps": 8},
                             "config": {"pdl": 0, "ids_ahead": 0, "min_split": 0}}, r"min_split = 0 is invalid")):
            with pytest.raises(ValueError, match=match):
                td.apply_tuning(bad)
            assert td.CONFIG == before, bad
    finally:
        td.CONFIG.clear()
        td.CONFIG.update(before)
