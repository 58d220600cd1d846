"""Token-run plans for MLA's full head tiles (`gluon_mla_runs`, CONFIG runs_wide): the plan's tables
against a plain Python walk of the tile stream on CPU, and the Gluon kernel under it against the torch
path on a GPU (several segments a program, empty and bad rows, DCP shards, a CUDA graph)."""

from __future__ import annotations

import random

import pytest
import torch

from parallel.cp import DCPLayout
from parallel.cp.gluon_mla_runs import runs_plan
from parallel.cp.paged import paged_decode_attention, plan_paged_decode, plan_reference
from parallel.cp.state import AttnState

from tests.helpers import check_state, compiled_decode_kernels, mla_paged_cache


def _walk(n: list[int], bad: list[bool], programs: int, unit: int,
          overhead: int = 0) -> tuple[list[list[tuple]], list[int]]:
    """The plan by hand: each row with a tile as `overhead` units, then its tiles, end to end; program p
    owning units [p * per, (p + 1) * per) -> (each program's segments (row, start, end) in stream order,
    each row's segment count)."""
    tiles = [-(-x // unit) for x in n]
    per = max(-(-sum(t + overhead for t in tiles if t) // programs), 1)
    progs: list[list[tuple]] = [[] for _ in range(programs)]
    counts = [0] * len(n)
    pos = 0
    for r, (x, t_r) in enumerate(zip(n, tiles)):
        if t_r == 0:
            if bad[r]:
                progs[min(pos // per, programs - 1)].append((r, 0, 0))
                counts[r] = 1
            continue
        pos += overhead
        t = 0
        while t < t_r:
            p = (pos + t) // per
            stop = min(t_r, (p + 1) * per - pos)
            progs[p].append((r, t * unit, min(stop * unit, x)))
            counts[r] += 1
            t = stop
        pos += t_r
    return progs, counts


def _tables(table: torch.Tensor, programs: int) -> list[list[tuple]]:
    """Each program's segments read back from a plan's table."""
    t = table.tolist()
    lo, seg = t[:programs + 1], t[programs + 1:]
    return [[tuple(seg[3 * k:3 * k + 3]) for k in range(lo[p], lo[p + 1])] for p in range(programs)]


CASES = [  # (local lengths, bad rows, programs)
    ([3000, 1, 40, 2200, 64, 128, 65, 0], [], 66),
    ([3000, 1, 40, 2200, 64, 128, 65, 0], [], 3),
    ([0, 0, 0], [], 4),                          # nothing to read: no segment at all
    ([0, 5, 0], [0, 2], 4),                      # bad rows: one empty segment each
    ([64] * 10, [], 10),                         # one tile each, one program each
    ([64] * 10, [], 32),                         # more programs than tiles
    ([1], [], 1),
    ([640, 640], [], 7),                         # boundaries off the programs' edges
    ([], [], 5),
]


@pytest.mark.parametrize("overhead", [0, 5])
@pytest.mark.parametrize("lens,bad,programs", CASES)
def test_runs_plan_matches_a_walk_of_the_tile_stream(lens, bad, programs, overhead):
    bad_t = torch.zeros(len(lens), dtype=torch.bool)
    bad_t[bad] = True
    n = torch.tensor(lens, dtype=torch.long)
    table, segments = runs_plan(n, bad_t, programs, overhead=overhead)
    want, counts = _walk(lens, bad_t.tolist(), programs, 64, overhead)
    assert _tables(table, programs) == want
    assert segments.tolist() == [0] + torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()
    assert table.dtype == torch.int32 and table.numel() == programs + 1 + 3 * (programs + len(lens))


def test_runs_plan_on_random_batches():
    """Random lengths and program counts: the walk's tables; every row's segments tile [0, n) in order,
    and no program holds more than its share of tiles."""
    rng = random.Random(0)
    for _ in range(200):
        rows = rng.randint(0, 40)
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 5000)]) for _ in range(rows)]
        bad = [rng.random() < 0.05 for _ in range(rows)]
        lens = [0 if b else x for x, b in zip(lens, bad)]
        programs, overhead = rng.randint(1, 140), rng.choice([0, 1, 5, 9])
        table, segments = runs_plan(torch.tensor(lens, dtype=torch.long), torch.tensor(bad, dtype=torch.bool),
                                    programs, overhead=overhead)
        got = _tables(table, programs)
        want, _ = _walk(lens, bad, programs, 64, overhead)
        assert got == want
        flat = [s for p in got for s in p]
        seg = segments.tolist()
        per = max(-(-sum(-(-x // 64) + overhead for x in lens if x) // programs), 1)
        assert all(sum(-(-(e - s) // 64) for _, s, e in p) <= per for p in got)
        for r, x in enumerate(lens):
            mine = flat[seg[r]:seg[r + 1]]
            assert all(row == r for row, _, _ in mine)
            if x:       # (contiguous from 0 to the row's length)
                assert [s for _, s, _ in mine] == [0] + [e for _, _, e in mine[:-1]]
            assert (mine[-1][2] if mine else 0) == x


def test_runs_charge_is_the_cheapest_walk():
    """`runs_plan(choose=True)`: of RUNS_CHARGES the charge whose walk of the tile stream (`_walk`) has the
    cheapest busiest program, a segment costing `cost` tiles beyond its tiles (the first of equal ones),
    and that charge's plan; at uniform lengths that halve into the programs no charge, among many short
    sequences and a few long ones a charge."""
    from parallel.cp.gluon_mla_runs import RUNS_CHARGES, runs_charge

    def span(lens, bad, programs, charge, cost):
        got, _ = _walk(lens, bad, programs, 64, charge)
        return max(sum(-(-(e - s) // 64) + cost for _, s, e in p if e > s) for p in got)

    rng = random.Random(3)
    cases = [([2048] * 32, [False] * 32, 66, 5), ([32768] * 2 + [512] * 30, [False] * 32, 66, 5)]
    for _ in range(60):
        rows = rng.randint(1, 40)
        lens = [rng.choice([0, 1, 65, rng.randint(0, 3000), rng.randint(0, 40000)]) for _ in range(rows)]
        bad = [rng.random() < 0.05 for _ in range(rows)]
        cases.append(([0 if b else x for x, b in zip(lens, bad)], bad, rng.randint(1, 140), rng.choice([0, 3, 5])))
    for lens, bad, programs, cost in cases:
        spans = [span(lens, bad, programs, f, cost) for f in RUNS_CHARGES]
        want = RUNS_CHARGES[spans.index(min(spans))]
        n, b = torch.tensor(lens, dtype=torch.long), torch.tensor(bad, dtype=torch.bool)
        assert int(runs_charge(n, programs, 64, cost)) == want, (lens, programs, cost, spans)
        table, segments = runs_plan(n, b, programs, overhead=cost, choose=True)
        t2, s2 = runs_plan(n, b, programs, overhead=want)
        assert torch.equal(table, t2) and torch.equal(segments, s2)
    assert int(runs_charge(torch.tensor([2048] * 32), 66, 64, 5)) == 0
    assert int(runs_charge(torch.tensor([32768] * 2 + [512] * 30), 66, 64, 5)) > 0


def test_plan_reference_makes_a_runs_plan_from_its_key():
    """A key with runs > 0 (what `plan_settings` gives the 128-head bf16 Gluon kernel under CONFIG
    runs_wide) makes the token-run plan of the DCP shard's local lengths, bad rows marked."""
    layout = DCPLayout(size=4, rank=3, block_size=64, interleave=1)
    lens = torch.tensor([5000, -1, 0, 300, 10 ** 6])
    key = (("items_target", 2), ("unit", 64), ("min_chunk", 64), ("fit", 0), ("table_blocks", 32), ("page", 64),
           ("dcp", (4, 3, 1)), ("expand", 1), ("order", 1), ("runs", 6), ("runs_overhead", 3))
    plan = plan_reference(lens, 5, key)
    local = layout.local_lengths(lens.clamp(min=0))
    bad = (lens < 0) | (local > 32 * 64)
    table, segments = runs_plan(torch.where(bad, 0, local), bad, 6, overhead=3)
    assert torch.equal(plan.items_table, table) and torch.equal(plan.segments, segments)
    assert plan.items == 6 + 5 and plan.rows == 5
    assert _walk(torch.where(bad, 0, local).tolist(), bad.tolist(), 6, 64)[1][1] == 1    # the bad row's segment


def test_runs_plan_refuses_no_programs_and_a_negative_overhead():
    with pytest.raises(ValueError, match="at least one program, got 0"):
        runs_plan(torch.tensor([5]), torch.tensor([False]), 0)
    with pytest.raises(ValueError, match="count of tiles >= 0, got -1"):
        runs_plan(torch.tensor([5]), torch.tensor([False]), 2, overhead=-1)


# ---- the GPU: the kernel under token-run plans against the torch path ----

@pytest.mark.gpu
@pytest.mark.parametrize("heads", [128, 64])
@pytest.mark.parametrize("programs", [None, 1, 3, 7])
@pytest.mark.parametrize("size,rank", [(1, 0), (4, 3)])
def test_runs_kernel_matches_the_torch_path(heads, programs, size, rank, monkeypatch):
    """Two long sequences among short ones (one of 1 token, one empty on some ranks) over a latent
    cache whose slots past each length hold NaN, under a token-run plan with the GPU's programs or with
    few (every program then walks many segments: the ring and the barriers' phases run on across
    them): against the torch path and the length plan's call; then plan and call captured in a CUDA
    graph and replayed after the lengths changed in place."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    triton_decode = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_mla_runs

    if programs is not None:
        monkeypatch.setattr(gluon_mla_runs, "programs_for", lambda device, m_tiles: programs)
    gen = torch.Generator().manual_seed(heads + (programs or 0))
    lens = [3000, 1, 40, 2200, 0] + torch.randint(1, 300, (4,), generator=gen).tolist()
    layout = DCPLayout(size=size, rank=rank, block_size=64)
    cache, table = mla_paged_cache(layout.local_lengths(torch.tensor(lens)).tolist(), 64, torch.bfloat16, heads,
                                   device="cuda")
    q = (torch.randn(len(lens), 1, heads, 576, generator=gen) * 0.3).to(torch.bfloat16).cuda()
    seq = torch.tensor(lens).cuda()
    scale = 0.07
    ref = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="torch")
    items = plan_paged_decode(q, cache, table, seq, layout=layout)
    by_items = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, plan=items)
    monkeypatch.setitem(triton_decode.CONFIG, "runs_wide", 1)
    plan = plan_paged_decode(q, cache, table, seq, layout=layout)
    want_programs = programs or gluon_mla_runs.programs_for(q.device, heads // 64)
    assert dict(plan.key)["runs"] == want_programs
    got = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, plan=plan)
    check_state(got, ref, 1e-2)
    check_state(got, by_items, 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_g = plan_paged_decode(q, cache, table, seq, layout=layout)
        out_g = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, plan=plan_g)
    seq.copy_(torch.where(seq > 1000, seq // 3, seq // 2))      # (within the cache's rows: NaN past them)
    graph.replay()
    torch.cuda.synchronize()
    ref2 = paged_decode_attention(q, cache, table, seq, layout=layout, scale=scale, backend="torch")
    check_state(out_g, ref2, 1e-2)


@pytest.mark.gpu
def test_runs_kernel_bad_rows_are_nan_and_the_rest_exact(monkeypatch):
    """Unvalidated lengths: a negative one and one past the table give NaN rows, the others their values
    (three programs: the bad rows' empty segments sit between the others')."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    triton_decode = compiled_decode_kernels(monkeypatch)
    from parallel.cp import gluon_mla_runs

    monkeypatch.setattr(gluon_mla_runs, "programs_for", lambda device, m_tiles: 3)
    monkeypatch.setitem(triton_decode.CONFIG, "runs_wide", 1)
    lens = [400, 300, 70, 200]
    cache, table = mla_paged_cache(lens, 64, torch.bfloat16, 9, device="cuda")
    q = (torch.randn(len(lens), 1, 128, 576) * 0.3).to(torch.bfloat16).cuda()
    ref = paged_decode_attention(q, cache, table, torch.tensor(lens).cuda(), scale=0.07, backend="torch")
    bad = torch.tensor([400, -1, 70, 10_000]).cuda()
    plan = plan_paged_decode(q, cache, table, bad, validate=False)
    got = paged_decode_attention(q, cache, table, bad, scale=0.07, plan=plan, validate=False)
    assert got.out[[1, 3]].isnan().all() and got.lse[[1, 3]].isnan().all()
    check_state(AttnState(got.out[[0, 2]], got.lse[[0, 2]]), AttnState(ref.out[[0, 2]], ref.lse[[0, 2]]), 1e-2)


@pytest.mark.parametrize("size,rank,interleave,tq", [(1, 0, 1, 1), (4, 3, 1, 1), (3, 1, 2, 1), (2, 0, 1, 3)])
@pytest.mark.parametrize("programs,overhead,choose", [(66, 5, 0), (3, 0, 0), (7, 2, 0), (200, 5, 0), (66, 5, 1),
                                                     (7, 3, 1)])
def test_runs_planner_kernel_matches_the_torch_plan(size, rank, interleave, tq, programs, overhead, choose,
                                                     monkeypatch):
    """The planner kernel (`triton_decode._runs_plan_kernel`, what `plan_paged_decode` launches on a GPU;
    here in the interpreter) against `runs_plan` through `plan_reference`: lengths with 0, 1, tile edges,
    long ones, a negative one and one past the table, over more rows than one of the kernel's blocks; with
    the charge chosen (CONFIG runs_choose_wide) the same choice."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")  # noqa: F841
    from parallel.cp import triton_decode

    gen = torch.Generator().manual_seed(programs + size)
    lens = [0, 1, 64, 65, 5000, -3, 10 ** 7] + torch.randint(0, 9000, (90,), generator=gen).tolist()
    rows = len(lens) * tq
    key = (("items_target", 2), ("unit", 64), ("min_chunk", 64), ("fit", 0), ("table_blocks", 60), ("page", 64),
           ("dcp", (size, rank, interleave)), ("expand", tq), ("order", 1), ("runs", programs),
           ("runs_overhead", overhead), ("runs_choose", choose))
    seq = torch.tensor(lens)
    got = triton_decode.plan_by_lengths(seq, rows, key)
    want = plan_reference(seq, rows, key)
    assert torch.equal(got.items_table, want.items_table)
    assert torch.equal(got.segments, want.segments)
    assert (got.items, got.rows) == (want.items, want.rows)


_RUNS_PLANNER_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from parallel.cp import triton_decode
sig = {"glens_ptr": "*i64", "table_ptr": "*i32", "seg_ptr": "*i32", "R": "i32", "P": "i32", "cap": "i32",
       "dcp_size": "i32", "dcp_rank": "i32", "interleave": "i32", "UNIT": "i32", "OVERHEAD": "i32",
       "TQ": "constexpr", "BLOCK": "constexpr", "BLOCK_P": "constexpr"}
charges = dict(zip(("C0", "C1", "C2", "C3"), triton_decode.gluon_mla_runs.RUNS_CHARGES))
sig.update(dict.fromkeys(["CHOOSE", *charges], "constexpr"))
for tq, choose in ((1, True), (2, False)):
    src = ASTSource(fn=triton_decode._runs_plan_kernel, signature=sig,
                    constexprs={"TQ": tq, "BLOCK": 64, "BLOCK_P": 128, "CHOOSE": choose, **charges})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert c.asm["cubin"]
    print("built")
"""


def test_runs_planner_kernel_builds_for_sm90():
    """The token-run planner compiles for sm_90 (a child process: the interpreter accepts what the
    compiler may not)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", _RUNS_PLANNER_BUILD], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["built", "built"], (done.stdout,
                                                                                          done.stderr[-3000:])
