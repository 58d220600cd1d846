"""Audit of `megapar bench` rows that did not measure what they say: each test fails on the code
before its fix (a row timing a different weight or path than a user's, an anchor timed another way
than ours in the same row, a result recorded without being compared to its reference)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megapar.launch.bench.common import BenchContext


def test_gemm_deep_gemm_section_times_our_slab_calls_on_the_layers_weight(monkeypatch):
    """The DeepGEMM section's "triton_w4a16 / triton_w4a8 slab" rows call grouped_gemm with the
    weight as the MoE layer prepares it (w["layer"]: octb under bf16 activations on CUDA), as the
    main and routed rows do; they took w["pw"] (oct), the probe's packing, whose W4A16 decode
    kernel is 1.10-1.24x slower, so ours were timed on a path no layer runs."""
    from megapar.launch.bench import gemm
    from megapar.moe.kernels import deep_gemm as dgm
    from megapar.moe.kernels.grouped_gemm import GEMM

    monkeypatch.setattr(GEMM, "usable", lambda **_: {"deep_gemm": None})
    monkeypatch.setattr(dgm, "deep_gemm_weight", lambda pw: SimpleNamespace(source="stand-in", extra_bytes=0))
    monkeypatch.setattr(dgm, "_module", lambda: None)
    monkeypatch.setattr(dgm, "alignment", lambda dg: 1 << 30)
    monkeypatch.setattr(gemm, "DG_PREFILL_TOKENS", (8,))
    E, N, K = 4, 256, 128
    ctx = BenchContext(suite="gemm", device=torch.device("cpu"), quick=True)
    w = gemm._weights(ctx, E, N, K, seed=1)
    w["fp8"] = None
    w["layer"] = SimpleNamespace(name="the layer's weight")     # (on CPU the two are one object)
    calls = []

    def grouped(x, weight, counts=None, layout="contiguous", backend=None, rows_hint=None):
        calls.append((backend, layout, weight))
        return torch.zeros(*x.shape[:-1], N, dtype=torch.bfloat16)

    assert gemm._deep_gemm_rows(ctx, "tiny", "L2", w, grouped)
    ours = [c for c in calls if c[0].startswith("triton")]
    assert ours and {c[1] for c in ours} == {"slab"}
    assert all(c[2] is w["layer"] for c in ours), [(c[0], c[2] is w["pw"]) for c in ours]


def test_quant_anchor_is_timed_as_ours_is(monkeypatch):
    """Each quantize / dequantize row times ours as a CUDA-graph replay (`graph_time`); its torch
    anchor was an eager call between events (`ctx.time_fn` straight), so the anchor's Python and
    its many kernel launches counted against it alone and speedup_vs_anchor was inflated. Both
    sides now go through graph_time (eager on CPU and where a capture fails: column anchor_timing)."""
    from megapar.launch.bench import quant as bench_quant

    state = {"depth": 0}
    real_graph_time = bench_quant.graph_time

    def graph_time(ctx, fn, iters=None):
        state["depth"] += 1
        try:
            return real_graph_time(ctx, fn, iters=iters)
        finally:
            state["depth"] -= 1

    class Ctx(BenchContext):
        timed: list = []

        def time_fn(self, fn, **kw):
            self.timed.append(state["depth"] > 0)
            return super().time_fn(fn, **kw)

    monkeypatch.setattr(bench_quant, "graph_time", graph_time)
    monkeypatch.setattr(bench_quant, "WEIGHT_FORMATS", (("mxfp4", {}),))
    monkeypatch.setattr(bench_quant, "ACT_FORMATS", (("fp8_token", {}),))
    ctx = Ctx(suite="quant", device=torch.device("cpu"), quick=True)
    bench_quant.run(ctx)
    rows = [r for r in ctx.rows if "anchor_us" in r]
    assert len(rows) == 4
    assert len(ctx.timed) == 2 * len(rows) and all(ctx.timed), ctx.timed   # ours and anchor, both in graph_time
    assert all(r["anchor_timing"] == r["timing"] == "eager" for r in rows)    # (CPU: graph_time is eager)


def test_merge_ring_step_row_says_whether_the_in_place_merge_is_right(monkeypatch):
    """The ring step's row (fp32 accumulator merged in place with a block) recorded a time without
    comparing the in-place result to the reference, unlike the N-way rows (matches_reference): a
    wrong in-place kernel gave a row like a right one. A stand-in that drops the block must now
    read matches_reference=False, the real merge True."""
    from megapar.launch.bench import merge as bench_merge

    def ring_rows(fn):
        monkeypatch.setattr(bench_merge, "merge_two_attn_states", fn)
        ctx = BenchContext(suite="merge", device=torch.device("cpu"), quick=True)
        bench_merge.run(ctx)
        return [r for r in ctx.rows if r["case"].startswith("ring step")]

    real = bench_merge.merge_two_attn_states

    def wrong(out_a, lse_a, out_b, lse_b, *, out=None, out_lse=None, backend="auto"):
        if backend == "torch":
            return real(out_a, lse_a, out_b, lse_b, out=out, out_lse=out_lse, backend=backend)
        # "ours" keeps the accumulator as it was: the block is lost
        return SimpleNamespace(out=out if out is not None else out_a.clone(),
                               lse=out_lse if out_lse is not None else lse_a.clone())

    (bad,) = ring_rows(wrong)
    assert bad.get("matches_reference") is False
    (good,) = ring_rows(real)
    assert good.get("matches_reference") is True


def test_route_fused_rows_say_whether_the_kernel_routes_as_torch_does(monkeypatch):
    """On CUDA each preset's "triton" and "triton graph" rows timed the fused kernel with no look at
    what it returned: a kernel routing to the wrong experts gave a row like a right one. The rows
    now carry matches_reference (experts per token as sets, weights id by id). CUDA is stood in for:
    a context that says CUDA, the timers stubbed, `route(backend="triton")` the torch path
    (right) or the torch path with a token's experts shifted (wrong)."""
    from megapar.launch.bench import route as bench_route

    FakeCuda = _FakeCuda

    monkeypatch.setattr(bench_route, "_loop_us", lambda fn, **kw: 1.0)
    monkeypatch.setattr(bench_route, "_graph_us", lambda ctx, fn, **kw: (fn(), 1.0)[1])
    real = bench_route.route

    def rows(shift: int):
        def route(logits, backend="auto", **kw):
            res = real(logits, backend="torch", **kw)
            if backend == "triton" and shift:
                res.topk_ids[0] = (res.topk_ids[0] + shift) % logits.shape[1]
            return res
        monkeypatch.setattr(bench_route, "route", route)
        ctx = FakeCuda(suite="route", device=torch.device("cpu"), quick=True)
        bench_route.run(ctx)
        fused = [r for r in ctx.rows if "triton" in r["case"]]
        assert len(fused) == 2 * len(bench_route.PRESETS) * 2        # (T = 1, 64) x (triton, triton graph)
        return fused

    assert all(r.get("matches_reference") is True for r in rows(0))
    assert all(r.get("matches_reference") is False for r in rows(1))


def test_ep_local_mover_rows_say_whether_ours_match_the_torch_movers(monkeypatch):
    """The local permute / unpermute rows timed our movers (Triton on CUDA) beside the torch ones
    without comparing what they wrote: a mover dropping rows gave a row like a right one. The rows
    now carry matches_reference; stand-ins that drop a row must read False, the real movers True."""
    import megapar.parallel.ep as ep_pkg
    from megapar.launch.bench import ep as bench_ep

    monkeypatch.setenv("MEGAPAR_BENCH_EP_SECTIONS", "local")
    real_rows, real_reduce = ep_pkg.gather_rows, ep_pkg.gather_reduce

    def movers(broken: bool):
        def gather_rows(x, row_src, *a, **kw):
            out = real_rows(x, row_src, *a, **kw)
            return out[1:].new_zeros(1, out.shape[1]).expand_as(out).clone() if broken else out

        def gather_reduce(y, pair_pos, w, *a, **kw):
            out = real_reduce(y, pair_pos, w, *a, **kw)
            return out * 0 if broken else out
        monkeypatch.setattr(ep_pkg, "gather_rows", gather_rows)
        monkeypatch.setattr(ep_pkg, "gather_reduce", gather_reduce)
        ctx = BenchContext(suite="ep", device=torch.device("cpu"), quick=True)
        bench_ep.run(ctx)
        rows = [r for r in ctx.rows if "permute rows" in r["case"]]
        assert len(rows) == 2
        return rows

    assert all(r.get("matches_reference") is True for r in movers(False))
    assert all(r.get("matches_reference") is False for r in movers(True))


class _FakeCuda(BenchContext):
    """A context that says CUDA on the CPU, its timer one call and a constant."""

    @property
    def is_cuda(self) -> bool:
        return True

    def time_fn(self, fn, **kw):
        fn()
        return 1.0


def test_mhc_triton_rows_say_whether_ours_match_the_torch_reference(monkeypatch):
    """On CUDA the pre / post / fused post+pre rows (and their CUDA-graph, fused-vs-unfused and
    launch-switch rows) timed the Triton kernels without looking at what they returned. They now
    carry matches_reference (checked once before timing, at tests/test_mhc.py's GPU tolerances).
    CUDA is stood in for: `backend="triton"` is the torch path (right) or the torch path with the
    result nudged by 0.1 (wrong), the graph replay the eager call."""
    import megapar.model.mhc as mhc
    from megapar.launch.bench import mhc as bench_mhc

    real = {n: getattr(mhc, n) for n in ("mhc_pre", "mhc_post", "mhc_post_pre")}

    def rows(which: str | None):
        def stand_in(name):
            def call(*a, backend="auto", **kw):
                got = real[name](*a, backend="torch", **kw)
                if backend != "triton" or which != name:
                    return got
                if name == "mhc_pre":
                    return got._replace(layer_input=got.layer_input + 0.1)
                if name == "mhc_post":
                    return got + 0.1
                return got[0], got[1]._replace(comb=got[1].comb + 0.1)
            return call
        for n in real:
            monkeypatch.setattr(mhc, n, stand_in(n))
        monkeypatch.setattr(bench_mhc, "_graph_replay", lambda call: call)
        monkeypatch.setattr(bench_mhc, "SWITCH_CHECK_TOKENS", (8,))
        ctx = _FakeCuda(suite="mhc", device=torch.device("cpu"), quick=True)
        bench_mhc.run(ctx)
        return {r["case"]: r.get("matches_reference") for r in ctx.rows}

    good = rows(None)
    assert len(good) == 2 * (3 + 1 + 3) + 1 and all(v is True for v in good.values()), good
    for name, wrong in (("mhc_pre", "pre "), ("mhc_post", "post "), ("mhc_post_pre", "post+pre fused")):
        got = rows(name)
        bad = {c for c, v in got.items() if v is False}
        assert bad and all(c.startswith(wrong) for c in bad), (name, got)
        assert all(v is True for c, v in got.items() if c not in bad)


def test_sp_decomposition_rows_say_whether_the_loopback_engines_compute_the_reference(monkeypatch):
    """The loopback decomposition rows timed the decomposed engines without looking at their
    result. They now carry matches_reference: the all-gather-matmul's output against the gathered
    input times w (one matmul), the matmul-reduce-scatter's (each send delivered into its receive
    for the check, as the timed loopback run leaves the receive buffers as they were) against the
    sum of the P partials. Stand-ins that drop a block must read False, the real engines True."""
    import megapar.parallel.sp.ops as ops
    from megapar.launch.bench import sp as bench_sp

    real_ag, real_rs = ops.decomposed_all_gather_matmul, ops.decomposed_matmul_reduce_scatter

    def rows(broken: bool):
        def ag(*a, **kw):
            gathered, outs = real_ag(*a, **kw)
            if broken:
                outs[0][-1].zero_()             # the last arriving block never multiplied
            return gathered, outs

        def rs(x2d, w, peers, **kw):
            out = real_rs(x2d, w, peers, **kw)
            return out - x2d[:out.shape[0]] @ w if broken else out      # the own partial left out
        monkeypatch.setattr(ops, "decomposed_all_gather_matmul", ag)
        monkeypatch.setattr(ops, "decomposed_matmul_reduce_scatter", rs)
        ctx = BenchContext(suite="sp", device=torch.device("cpu"), quick=True)
        bench_sp.run(ctx)
        assert len(ctx.rows) == 4
        return ctx.rows

    assert all(r.get("matches_reference") is True for r in rows(False))
    assert all(r.get("matches_reference") is False for r in rows(True))


def test_sp_overlap_rows_say_whether_each_backend_matches_the_reference_backend(monkeypatch):
    """The overlap rows (decomposed, symm_mem) timed each backend without comparing its result to
    the reference backend's. They now carry matches_reference (every rank's comparison, MIN over
    the group). On 2 gloo ranks the real backends match; in one process, a decomposed backend that
    returns zeros must read False."""
    import torch.distributed as dist

    import megapar.parallel.sp as sp_pkg
    from megapar.launch.bench import sp as bench_sp

    ctx = BenchContext(suite="sp", device=torch.device("cpu"), quick=True)
    bench_sp._overlap(ctx)
    got = {r["case"]: r.get("matches_reference") for r in ctx.rows}
    assert got == {"all_gather_matmul tp=2 decomposed": True, "all_gather_matmul tp=2 reference": None,
                   "matmul_reduce_scatter tp=2 decomposed": True, "matmul_reduce_scatter tp=2 reference": None}, got

    real_ag = sp_pkg.all_gather_matmul

    def ag(x, weights, group, backend="auto", **kw):
        out = real_ag(x, weights, group, backend=backend, **kw)
        return [o * 0 for o in out] if backend == "decomposed" else out
    monkeypatch.setattr(sp_pkg, "all_gather_matmul", ag)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = bench_sp.overlap_rows(dist.group.WORLD, 16, 32, 64, quick=True)
    finally:
        dist.destroy_process_group()
    got = {r["case"]: r.get("matches_reference") for r in rows}
    assert got["all_gather_matmul tp=1 decomposed"] is False and got["matmul_reduce_scatter tp=1 decomposed"] is True


def test_ep_multirank_rows_say_whether_every_ranks_round_trip_matches_the_anchor(monkeypatch):
    """The multi-rank dispatch+combine rows timed each backend's round trip without comparing it to
    the naive all_to_all anchor's (identity experts: x times the token's summed weights). Each rank
    now checks its own and the row says whether every rank matched: on 2 gloo ranks both backends
    do; a rank reporting a mismatch makes the row False ([WRONG RESULT]); a round trip that loses a
    token's row does not match."""
    import megapar.launch.local as local
    from megapar.launch.bench import ep as bench_ep

    monkeypatch.setenv("MEGAPAR_BENCH_EP_SECTIONS", "multirank")
    ctx = BenchContext(suite="ep", device=torch.device("cpu"), quick=True)
    bench_ep.run(ctx)
    assert len(ctx.rows) == 2 and all(r.get("matches_reference") is True for r in ctx.rows), ctx.rows

    def one_rank_wrong(fn, world, **kw):
        row = {"pairs": 8, "naive_us": 1.0, "a2a_phys_bytes": 1, "ag_phys_bytes": 1}
        for b in ("all_to_all", "allgather"):
            row.update({f"{b}_us": 1.0, f"{b}_dispatch_us": 1.0, f"{b}_combine_us": 1.0, f"{b}_matches": True})
        return [[dict(row)], [dict(row, all_to_all_matches=False)]]
    monkeypatch.setattr(local, "launch_local", one_rank_wrong)
    ctx = BenchContext(suite="ep", device=torch.device("cpu"), quick=True)
    bench_ep.run(ctx)
    assert [r.get("matches_reference") for r in ctx.rows] == [False, True] and ctx.wrong

    x = torch.randn(8, 16).bfloat16()
    ids, w = bench_ep._routing(8, 4, 2, torch.device("cpu"), 0)
    want = (x.float() * w.sum(1, keepdim=True)).bfloat16()
    assert bench_ep.round_trip_matches(want.clone(), want)
    lost = want.clone()
    lost[3] = 0
    assert not bench_ep.round_trip_matches(lost, want)


def test_moe_quick_layer_rows_say_whether_the_layer_matches_plain_torch(monkeypatch):
    """The CPU / --quick `bench_layer` rows timed the layer with no look at its output. They now
    compare it once with the plain-torch layer on the same (dequantized) weights and say so
    (rel_err_vs_plain_torch, matches_reference: fp32 rows within 1e-4). A layer whose output is
    10% off must read False, the real layer True."""
    from megapar.launch.bench import moe as bench_moe

    def rows(scale: float):
        ctx = BenchContext(suite="moe", device=torch.device("cpu"), quick=True)
        for fmt in ("fp32", "mxfp4"):
            layer = bench_moe.MoELayer(bench_moe._quick_config(fmt), device=ctx.device)
            real = layer.forward
            monkeypatch.setattr(layer, "forward", lambda x, *a, **kw: real(x, *a, **kw) * scale)
            bench_moe.bench_layer(ctx, f"tiny {fmt}", layer, 16)
        return ctx.rows

    good = rows(1.0)
    assert all(r["matches_reference"] is True and r["rel_err_vs_plain_torch"] < 1e-4 for r in good), good
    assert all(r["matches_reference"] is False for r in rows(1.1))


def test_gemm_target_notes_come_from_the_public_call_rows_only():
    """The prefill W4A8 target note took any row whose impl starts with triton_w4a8, so a fast
    "triton_w4a8 gemm only" or "x pre-quantized" part row (fp8 inputs given, no activation
    quantization) could read MET while the public call missed. Only the public-call rows count."""
    from megapar.launch.bench import gemm

    ctx = BenchContext(suite="gemm", device=torch.device("cpu"), quick=False)
    base = dict(tok_per_expert=2048, roofline_fraction=0.5, speedup_vs_anchor=1.0)
    ctx.rows += [dict(base, case="L1 tok=2048 triton_w4a8", impl="triton_w4a8", speedup_vs_fp8=0.8),
                 dict(base, case="L1 tok=2048 triton_w4a8 gemm only", impl="triton_w4a8 gemm only",
                      speedup_vs_fp8=1.3),
                 dict(base, case="L1 tok=2048 triton_w4a8 x pre-quantized", impl="triton_w4a8 x pre-quantized",
                      speedup_vs_fp8=1.2)]
    gemm._targets(ctx)
    w4a8 = [n for n in ctx.notes if n.startswith("prefill W4A8")]
    assert w4a8 == ["prefill W4A8 target missed: L1 tok=2048 triton_w4a8: 0.80x torch fp8 (>= 1.0)"], w4a8
