"""Length plans for the split-KV decode kernel (`paged.plan_paged_decode`, `triton_decode.LengthPlan`):
the planner kernel against its torch specification, the planned kernels against the torch path
(TRITON_INTERPRET=1 on CPU; the Gluon kernels on a GPU), the segment merge, and the checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.cp import DCPLayout, PagedKVCache
from parallel.cp.paged import paged_decode_attention, plan_paged_decode, plan_reference
from parallel.cp.state import AttnState

triton = pytest.importorskip("triton")

from tests.helpers import check_state, compiled_decode_kernels, fill_paged_cache, mla_paged_cache  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _fp8(cache: PagedKVCache) -> PagedKVCache:
    """The cache in e4m3 with one scale per (token, kv head) each for k and v (their own amax / 448)."""
    parts = []
    for x in (cache.k, cache.v):
        scale = x.abs().amax(-1).clamp(min=1e-3) / 448
        parts.append(((x / scale[..., None]).to(torch.float8_e4m3fn), scale))
    return PagedKVCache(parts[0][0], parts[1][0], parts[0][1], parts[1][1])


def _small_splits(monkeypatch, target: int | None = 24) -> None:
    """Short splits and (target) few programs (the interpreter runs programs one by one), so that the
    plans below cut the long sequences into many items."""
    from parallel.cp import triton_decode

    for key in [k for k in triton_decode.CONFIG if k.startswith("min_split")]:
        monkeypatch.setitem(triton_decode.CONFIG, key, 16)
    for key in [k for k in triton_decode.CONFIG if k.startswith("target_programs") and target]:
        monkeypatch.setitem(triton_decode.CONFIG, key, target)


def _spans(plan) -> dict[int, list[tuple[int, int]]]:
    """Row -> the (split, chunk) of its items at its out rows, from the plan's tables (host copies);
    "rows_of": the row of each out row in use; the launch slots' out rows are a permutation."""
    table = plan.items_table.cpu()
    chunk, slots = int(table[0]), table[2:].view(-1, 3)
    assert sorted(slots[:, 2].tolist()) == list(range(plan.items)), slots[:, 2]
    by_out = slots[slots[:, 2].argsort()]
    seg = plan.segments.cpu()
    return {r: [(int(by_out[v, 1]), chunk) for v in range(int(seg[r]), int(seg[r + 1]))] for r in range(plan.rows)} | {
        "rows_of": [int(by_out[v, 0]) for v in range(int(seg[-1]))]}


def _launch_classes(plan, lens_local: list[int]) -> list[int]:
    """The length class of each launch slot in use (`PLAN_CLASSES` for a full chunk; the slots past
    the batch's items left out)."""
    from parallel.cp.triton_decode import PLAN_CLASSES

    table = plan.items_table.cpu()
    chunk, slots = int(table[0]), table[2:].view(-1, 3)
    used = int(plan.segments[-1])
    out = []
    for row, split, o in slots.tolist():
        if o < used:
            size = min(lens_local[row] - split * chunk, chunk)
            out.append(PLAN_CLASSES if size == chunk else size * PLAN_CLASSES // chunk)
    return out


@pytest.mark.parametrize("size,rank,interleave,tq,extra", [(1, 0, 1, 1, 20), (3, 1, 2, 1, 20), (4, 3, 1, 1, 20),
                                                             (2, 0, 1, 3, 20), (1, 0, 1, 1, 0), (2, 1, 1, 1, 2),
                                                             (1, 0, 1, 1, 40)])
@pytest.mark.parametrize("fit,order", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_planner_kernel_matches_its_torch_specification(size, rank, interleave, tq, extra, fit, order, monkeypatch):
    """The planner kernel's tables = `plan_reference`'s, on lengths with 0, 1, long, negative and past
    the table (both give one item to those: their partial carries lse -inf or the kernel's NaN), and
    the items of each row cover its local tokens once, in order, with at most items_target + rows
    items in all; the chunk (CONFIG plan_fit 1) is the shortest that fits items_target (fewer rows
    than that: `extra` 0 or 2), or one item a row (more rows: `extra` 40); (plan_fit 0) the local
    tokens over items_target. The launch order (CONFIG plan_order): the out rows' (0), or (1) longest
    first: full chunks, then the partial items by length class."""
    from parallel.cp import triton_decode

    _small_splits(monkeypatch, target=64)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_fit", fit)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_order", order)
    gen = torch.Generator().manual_seed(size * 10 + rank)
    lens = [0, 1, 700, 3, 1500, 64, 5, -2, 10_000] + torch.randint(0, 400, (extra,), generator=gen).tolist()
    if tq > 1:
        lens = [max(n, tq) if n >= 0 else n for n in lens]
    seq = torch.tensor(lens)
    layout = DCPLayout(size=size, rank=rank, block_size=16, interleave=interleave)
    table = torch.zeros(len(lens), 40, dtype=torch.int32)          # 640 local tokens: 10_000 is past it
    q = torch.randn(len(lens), tq, 8, 32)
    k = torch.zeros(4, 16, 2, 32)
    rows, key = triton_decode.plan_settings(q, k, k, None, None, table, dcp_size=size, dcp_rank=rank,
                                            interleave=interleave)
    assert rows == len(lens)        # (the expansion is the GPU's: never under the interpreter)
    got = triton_decode.plan_by_lengths(seq, rows, key)
    ref = plan_reference(seq, rows, key)
    assert torch.equal(got.items_table, ref.items_table) and torch.equal(got.segments, ref.segments)
    assert got.items == ref.items == dict(key)["items_target"] + rows
    spans = _spans(got)
    local = layout.local_lengths(seq.clamp(min=0))
    for r, n in enumerate(local.tolist()):
        n = 0 if lens[r] < 0 or n > 640 else n
        ks = [k for k, _ in spans[r]]
        chunk = spans[r][0][1]
        assert ks == list(range(len(ks))) and len(ks) == max(1, -(-n // chunk)), (r, n, ks)
    assert spans["rows_of"] == sorted(spans["rows_of"])
    assert int(got.segments[-1]) <= got.items
    n_eff = [0 if g < 0 or n > 640 else n for g, n in zip(lens, local.tolist())]
    classes = _launch_classes(got, n_eff)
    outs = got.items_table[2:].view(-1, 3)[:, 2].tolist()
    if order:       # (longest first; the empty slots after every item)
        assert classes == sorted(classes, reverse=True), classes
        assert outs[len(classes):] == list(range(len(classes), got.items)), outs
    else:
        assert outs == list(range(got.items)), outs
    # the chunk: the shortest (in units, from min_chunk) whose items fit items_target, else one a row
    kv = dict(key)
    items = lambda c: sum(max(-(-n // c), 1) for n in n_eff)
    chunk = int(got.items_table[0])
    if not fit:     # the local tokens over the target, up to a unit, at least min_chunk
        share = -(-sum(n_eff) // kv["items_target"])
        assert chunk == max(-(-share // kv["unit"]) * kv["unit"], kv["min_chunk"]), chunk
    elif items(chunk) <= kv["items_target"]:
        assert chunk == kv["min_chunk"] or items(chunk - kv["unit"]) > kv["items_target"], chunk
    else:
        assert items(chunk) == len(lens) and chunk >= max(n_eff), chunk


_PLANNER_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from parallel.cp import triton_decode
sig = {"glens_ptr": "*i64", "items_ptr": "*i32", "seg_ptr": "*i32", "R": "i32", "V": "i32", "ITEMS": "i32",
       "UNIT": "i32", "MIN_CHUNK": "i32", "cap": "i32", "dcp_size": "i32", "dcp_rank": "i32", "interleave": "i32",
       "TQ": "constexpr", "BLOCK": "constexpr", "FIT": "constexpr", "ORDER": "constexpr", "NB": "constexpr"}
for fit in (0, 1):
    for order in (0, 1):
        src = ASTSource(fn=triton_decode._plan_kernel, signature=sig,
                        constexprs={"TQ": 2, "BLOCK": 1024, "FIT": fit, "ORDER": order, "NB": 8})
        assert triton.compile(src, target=GPUTarget("cuda", 90, 64)).asm["cubin"]
print("built")
"""


def test_planner_kernel_builds_for_sm90():
    """The planner in each form (the chunk's two rules x the two launch orders) compiles for sm_90 (a
    child process: this file's kernels are interpreted; the interpreter accepts what the compiler may not)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _PLANNER_BUILD], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("fit", [0, 1])
def test_planner_over_more_rows_than_one_block(fit, monkeypatch):
    """More rows than the planner's block (1024): its passes over the rows carry the item counts and
    the launch slots from block to block (launched longest first); the tables = `plan_reference`'s."""
    from parallel.cp import triton_decode

    _small_splits(monkeypatch, target=512)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_fit", fit)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_order", 1)
    gen = torch.Generator().manual_seed(11 + fit)
    lens = torch.randint(0, 300, (1500,), generator=gen)
    lens[[3, 1100, 1499, 7]] = torch.tensor([5000, 4000, 640, 7000])      # (7000: past the table)
    table = torch.zeros(len(lens), 400, dtype=torch.int32)
    q, k = torch.randn(len(lens), 1, 4, 16), torch.zeros(4, 16, 2, 16)
    rows, key = triton_decode.plan_settings(q, k, k, None, None, table, dcp_size=1, dcp_rank=0, interleave=1)
    got = triton_decode.plan_by_lengths(lens, rows, key)
    ref = plan_reference(lens, rows, key)
    assert torch.equal(got.items_table, ref.items_table) and torch.equal(got.segments, ref.segments)
    n_eff = [0 if n > 6400 else n for n in lens.tolist()]
    classes = _launch_classes(got, n_eff)
    assert classes == sorted(classes, reverse=True) and len(classes) == int(got.segments[-1])
    spans = _spans(got)
    if fit:     # (more rows than the target: one item a row)
        assert all(len(spans[r]) == 1 for r in range(rows))
    else:       # (the long rows split; the one past the table takes one item)
        assert len(spans[3]) > 1 and len(spans[1100]) > 1 and len(spans[7]) == 1


@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("size,rank,interleave", [(1, 0, 1), (3, 1, 2)])
@pytest.mark.parametrize("fp8", [False, True])
def test_planned_gqa_kernel_matches_the_torch_path(tq, size, rank, interleave, fp8, monkeypatch):
    """A batch of very different lengths (0, 1, a few pages, many) through the kernel under a length
    plan = the torch path, merged (fp32 and q's dtype) and unmerged (one partial); the items launched
    in out-row order on one rank, longest first on a DCP rank (CONFIG plan_order)."""
    from parallel.cp import triton_decode

    _small_splits(monkeypatch)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_order", int(size > 1))
    lens = [3, 700, 5, 0 if tq == 1 else 4, 60, 1200, 1]
    if tq > 1:
        lens = [max(n, tq) for n in lens]
    hq, hkv, d, dv = 8, 2, 32, 32
    cache, table, layout, _, _ = fill_paged_cache(lens, hkv, d, dv, 16, size, rank, interleave, torch.float32, seed=3)
    q = torch.randn(len(lens), tq, hq, d)
    if fp8:     # (fp16 queries over an fp8 cache: the interpreter's bf16 dots are wrong)
        cache = _fp8(cache)
        q = q.half()
    seq = torch.tensor(lens)
    plan = plan_paged_decode(q, cache, table, seq, layout=layout, backend="triton")
    assert int(plan.segments[-1]) > len(lens)           # (several items for the long sequences)
    outs = plan.items_table[2:].view(-1, 3)[:, 2]
    assert torch.equal(outs, torch.arange(plan.items, dtype=outs.dtype)) == (size == 1), outs  # (reordered on DCP)
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton", plan=plan)
    atol = 2e-3 if fp8 else 1e-4
    check_state(got, ref, atol)
    half = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton", plan=plan,
                                  out_dtype=torch.float16)
    assert half.out.dtype == torch.float16
    torch.testing.assert_close(half.out.float(), ref.out, atol=atol + 2e-3, rtol=0)
    parts = paged_decode_attention(q, cache, table, seq, layout=layout, backend="triton", plan=plan, merge=False)
    assert parts.out.shape == (1, *ref.out.shape)
    check_state(AttnState(parts.out[0], parts.lse[0]), ref, atol)


def test_planned_mla_layout_matches_the_torch_path(monkeypatch):
    """The latent layout (one 576-wide head, v its first 512) with NaN in every slot past a sequence's
    length: a plan's items end where the sequence does (launched longest first)."""
    from parallel.cp import triton_decode

    _small_splits(monkeypatch)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_order", 1)
    lens = [1, 300, 0, 47, 9]
    cache, table = mla_paged_cache(lens, 16, torch.float32, seed=4)
    q = torch.randn(len(lens), 1, 4, 576)
    seq = torch.tensor(lens)
    plan = plan_paged_decode(q, cache, table, seq, backend="triton")
    ref = paged_decode_attention(q, cache, table, seq, scale=0.05, backend="torch")
    got = paged_decode_attention(q, cache, table, seq, scale=0.05, backend="triton", plan=plan)
    check_state(got, ref, 1e-4)


def test_planned_bad_rows_are_nan_and_the_rest_exact(monkeypatch):
    """Unvalidated values (as on CUDA): a negative length and one past the table give NaN rows under a
    plan as without one; the other rows keep their values."""
    _small_splits(monkeypatch)
    lens = [40, 300, 7, 200]
    cache, table, layout, _, _ = fill_paged_cache(lens, 1, 16, 16, 16, 1, 0, 1, torch.float32, seed=6)
    q = torch.randn(len(lens), 1, 2, 16)
    seq = torch.tensor(lens)
    ref = paged_decode_attention(q, cache, table, seq, backend="torch")
    bad = torch.tensor([40, -1, 7, 10_000])
    plan = plan_paged_decode(q, cache, table, bad, backend="triton", validate=False)
    got = paged_decode_attention(q, cache, table, bad, backend="triton", plan=plan, validate=False)
    assert got.out[[1, 3]].isnan().all() and got.lse[[1, 3]].isnan().all()
    check_state(AttnState(got.out[[0, 2]], got.lse[[0, 2]]), AttnState(ref.out[[0, 2]], ref.lse[[0, 2]]), 1e-4)


def test_a_plan_is_checked_against_its_call(monkeypatch):
    lens = [5, 30]
    cache, table, layout, _, _ = fill_paged_cache(lens, 2, 16, 16, 4, 1, 0, 1, torch.float32, seed=1)
    q = torch.randn(2, 4, 16)
    seq = torch.tensor(lens)
    plan = plan_paged_decode(q, cache, table, seq, backend="triton")
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=r"made for 2 rows .* the call has 3 rows"):
            paged_decode_attention(torch.randn(3, 4, 16), cache, torch.cat([table, table[:1]]),
                                   torch.tensor([5, 30, 5]), backend=backend, plan=plan)
        with pytest.raises(ValueError, match=r"'table_blocks': 8.* 'table_blocks': 9"):
            paged_decode_attention(q, cache, torch.cat([table, table[:, :1]], 1), seq, backend=backend, plan=plan)
        with pytest.raises(ValueError, match=r"'dcp': \(1, 0, 1\).* 'dcp': \(2, 1, 1\)"):
            paged_decode_attention(q, cache, table, seq, layout=DCPLayout(size=2, rank=1, block_size=4),
                                   backend=backend, plan=plan)
    with pytest.raises(ValueError, match="plan must be a LengthPlan of plan_paged_decode, got tuple"):
        paged_decode_attention(q, cache, table, seq, backend="triton", plan=(1, 2))
    # the torch path's plan (CPU, "auto") is the reference's tables, and its call takes it
    auto = plan_paged_decode(q, cache, table, seq)
    assert torch.equal(auto.items_table, plan.items_table)
    check_state(paged_decode_attention(q, cache, table, seq, plan=auto), paged_decode_attention(q, cache, table, seq), 0)
    with pytest.raises(ValueError, match=r"local lengths \[40\] outside \[0, 32\]"):
        plan_paged_decode(q, cache, table, torch.tensor([5, 40]))
    # the DCP and MLA makers: their call's query shapes, named
    from parallel.cp import MLACache, MLADims, plan_dcp_decode, plan_mla_decode

    with pytest.raises(ValueError, match=r"q \(2, 64\) must be \[S, Hq_local, D\]"):
        plan_dcp_decode(torch.randn(2, 64), cache, table, seq)
    latent = MLACache.allocate(4, 16, MLADims())
    with pytest.raises(ValueError, match=r"q_nope \(2, 128\) must be \[S, H_local, d_n\]"):
        plan_mla_decode(torch.randn(2, 128), latent, table, seq)


def _segments_reference(outs, lses, segments):
    """Each row's run of partials merged in float64 (lse -inf and out 0 for an empty run; NaN rows)."""
    rows = []
    for r in range(segments.numel() - 1):
        lo, hi = int(segments[r]), int(segments[r + 1])
        lse = lses[lo:hi].double()
        m = torch.logsumexp(lse, 0) if hi > lo else torch.full(lses.shape[1:], float("-inf"), dtype=torch.float64)
        w = torch.exp(lse - m).nan_to_num(0.0) if hi > lo else lse
        o = (outs[lo:hi].double() * w[..., None]).sum(0) if hi > lo else torch.zeros(outs.shape[1:], dtype=torch.float64)
        nan = lse.isnan().any(0) if hi > lo else torch.zeros(lses.shape[1:], dtype=torch.bool)
        rows.append(AttnState(torch.where(nan[..., None], float("nan"), o), torch.where(nan, float("nan"), m)))
    return AttnState(torch.stack([r.out for r in rows]).float(), torch.stack([r.lse for r in rows]).float())


def test_segment_merge_matches_float64_runs():
    """Runs of 0, 1 and many partials, all-empty partials (lse -inf), a NaN partial, +inf as empty."""
    from parallel.cp.triton_merge import merge_segments_triton

    gen = torch.Generator().manual_seed(2)
    counts = [3, 1, 0, 7, 2, 1, 37, 5]      # (37: more than a round of lse loads and of unrolled partials)
    segments = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    v, t, h, d = sum(counts) + 2, 2, 3, 24
    outs = torch.randn(v, t, h, d, generator=gen)
    lses = torch.randn(v, t, h, generator=gen) * 4
    lses[4, 0, 1] = float("-inf")
    lses[0:3, 1, 2] = float("-inf")            # (row 0 token 1 head 2: every partial empty)
    lses[9, 1, 0] = float("nan")
    lses[12, 0, 0] = float("inf")
    got = merge_segments_triton(outs, lses, segments, torch.empty(len(counts), t, h, d))
    want = _segments_reference(outs, torch.where(lses == float("inf"), float("-inf"), lses), segments)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=0, equal_nan=True)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=0, equal_nan=True)
    assert (got.lse[2] == float("-inf")).all() and (got.out[2] == 0).all()


# ---- the GPU: every kernel family under a plan, against the torch path and the capacity plan ----

GPU_CASES = [  # (kind, heads, tq, cache dtype)
    ("gqa", 32, 1, torch.bfloat16), ("gqa", 32, 1, torch.float8_e4m3fn), ("gqa", 32, 4, torch.float8_e4m3fn),
    ("gqa", 32, 4, torch.bfloat16),
    ("mla", 128, 1, torch.bfloat16), ("mla", 128, 1, torch.float8_e4m3fn), ("mla", 16, 1, torch.bfloat16),
    ("mla", 16, 1, torch.float8_e4m3fn), ("mla", 16, 4, torch.bfloat16), ("mla", 128, 2, torch.bfloat16),
    ("mla", 128, 2, torch.float8_e4m3fn)]


def _gpu_problem(kind, heads, tq, dtype, size, rank, seed):
    """A skewed batch on the GPU: two long sequences among short ones (one of 1 token). (The torch
    path's reference copies the KV per query head: MLA's 128 heads over 3000 tokens x 8 sequences
    take ~7 GB there.)"""
    gen = torch.Generator().manual_seed(seed)
    lens = [3000, 1, 40, 2200] + torch.randint(max(tq, 1), 200, (4,), generator=gen).tolist()
    lens[2] = max(lens[2], tq)
    layout = DCPLayout(size=size, rank=rank, block_size=64)
    if kind == "mla":
        cache, table = mla_paged_cache(layout.local_lengths(torch.tensor(lens)).tolist(), 64, dtype, seed, device="cuda")
        q = (torch.randn(len(lens), tq, heads, 576, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    else:
        cache, table, layout, _, _ = fill_paged_cache(lens, 4, 128, 128, 64, size, rank, 1, torch.float32, seed, device="cuda")
        if dtype == torch.float8_e4m3fn:
            cache = _fp8(cache)
        else:
            cache = PagedKVCache(cache.k.to(dtype), cache.v.to(dtype))
        q = torch.randn(len(lens), tq, heads, 128, generator=gen).to(torch.bfloat16).cuda()
    return q, cache, table, torch.tensor(lens).cuda(), layout


@pytest.mark.gpu
@pytest.mark.parametrize("kind,heads,tq,dtype", GPU_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("size,rank", [(1, 0), (4, 3)])
@pytest.mark.parametrize("order", [0, 1])
def test_planned_kernels_on_gpu(kind, heads, tq, dtype, size, rank, order, monkeypatch):
    """Each kernel family (GQA's Gluon bf16 and direct fp8, MLA's 64-head tiles bf16 / fp8, its narrow
    swapped kernels, the head tiles and the one-token expansion of a speculative step) under a length
    plan against the torch path and against the capacity plan's call; the plan and the call replayed
    in a CUDA graph after the lengths changed in place; the items launched in out-row order and
    longest first (CONFIG plan_order)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    triton_decode = compiled_decode_kernels(monkeypatch)
    monkeypatch.setitem(triton_decode.CONFIG, "plan_order", order)
    _small_splits(monkeypatch, target=None)     # (the long sequences in many items on every rank)
    q, cache, table, seq, layout = _gpu_problem(kind, heads, tq, dtype, size, rank, seed=heads + tq)
    scale = 0.07
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="torch")
    plain = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="triton")
    plan = plan_paged_decode(q, cache, table, seq, layout=layout)
    got = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, plan=plan)
    assert int(plan.segments[-1]) >= len(seq) + 4, plan.segments
    atol = 2e-2 if dtype == torch.float8_e4m3fn else 1e-2
    check_state(got, ref, atol)
    check_state(got, plain, atol)
    # capture: the plan and the call in one graph; new lengths written in place, then a replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_g = plan_paged_decode(q, cache, table, seq, layout=layout)
        out_g = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, plan=plan_g)
    seq.copy_(torch.where(seq > 1000, seq // 3, seq))
    graph.replay()
    torch.cuda.synchronize()
    ref2 = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="torch")
    check_state(out_g, ref2, atol)


def test_the_capacity_plan_counts_the_batchs_programs(monkeypatch):
    """Without a plan the split count comes from the batch's programs (sequences x kv heads x row
    tiles) against target_programs: a batch of more sequences takes fewer splits of each."""
    from parallel.cp import triton_decode

    monkeypatch.setitem(triton_decode.CONFIG, "min_split", 16)
    counts = {}
    for s in (2, 16):
        cache, table, layout, _, _ = fill_paged_cache([1024] * s, 2, 16, 16, 16, 1, 0, 1, torch.float32, seed=s)
        q = torch.randn(s, 1, 4, 16)
        parts = paged_decode_attention(q, cache, table, torch.full((s,), 1024), backend="triton", merge=False)
        block_n = triton_decode.launch_settings(16, q.dtype, cache.k.dtype, 2)["block_n"]
        want = triton_decode.plan_splits(1024, s * 2, block_n, 16, False, triton_decode.CONFIG["target_programs"])
        counts[s] = parts.out.shape[0]
        assert counts[s] == want[0], (s, counts[s], want)
    assert counts[16] < counts[2], counts


def test_an_empty_batch_plans_and_runs():
    """No sequence: a plan of no rows (its items all empty), and an empty out from either path."""
    cache = PagedKVCache.allocate(4, 16, 2, 32, dtype=torch.float32)
    q, table, seq = torch.randn(0, 1, 4, 32), torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.long)
    for backend in ("triton", "torch"):
        plan = plan_paged_decode(q, cache, table, seq, backend=backend)
        assert plan.rows == 0 and plan.segments.tolist() == [0]
        got = paged_decode_attention(q, cache, table, seq, backend=backend, plan=plan)
        assert got.out.shape == (0, 1, 4, 32) and got.lse.shape == (0, 1, 4)
