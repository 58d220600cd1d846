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

    class FakeCuda(BenchContext):
        @property
        def is_cuda(self) -> bool:
            return True

        def time_fn(self, fn, **kw):
            fn()
            return 1.0

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
