"""Every `megapar bench` suite runs at a tiny size on CPU and writes its result files; results go
only into the output folder, the summary only when asked, reduced sizes are tagged -quick, the
console shows aligned tables, and the speedup plot's bars mean something."""

from __future__ import annotations

import importlib.util
import json

import pytest

from launch.cli import SUITES, main as cli_main


@pytest.mark.parametrize("suite", SUITES)
def test_bench_suite_quick_writes_results(suite, tmp_path):
    if importlib.util.find_spec(f"launch.bench.{suite}") is None:
        pytest.fail(f"benchmark suite launch/bench/{suite}.py is missing")
    rc = cli_main(["bench", suite, "--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    path = tmp_path / f"{suite}-cpu-quick.json"
    data = json.loads(path.read_text())
    assert data["suite"] == suite and data["command"].startswith("megapar bench")
    assert data["rows"], "a suite must record at least one case"
    assert all(r["time_us"] > 0 for r in data["rows"] if "time_us" in r)
    assert (tmp_path / f"{suite}-cpu-quick.md").exists()


def test_plot_writes_a_png_for_gemm_roofline_and_for_speedups(tmp_path):
    pytest.importorskip("matplotlib")
    from launch.bench.plot import plot_results

    rows = [{"case": f"v3 L1 tok={t} {impl}", "time_us": 100.0 * t ** 0.5 * (2 if impl == "b" else 1),
             "anchor": "torch bf16 _grouped_mm", "anchor_us": 150.0 * t ** 0.5, "floor_us": 50.0,
             "fp8_anchor_us": 90.0 * t ** 0.5, "shape": "v3", "gemm": "L1", "tok_per_expert": t, "impl": impl,
             "speedup_vs_anchor": 1.5}
            for t in (1, 8, 64) for impl in ("a", "b")]
    for suite in ("gemm", "merge"):
        path = tmp_path / f"{suite}.json"
        path.write_text(json.dumps({"suite": suite, "device": "h200", "rows": rows}))
        png = plot_results(path)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# ---------------------------------------------------------------- where results go, and how they look
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_bench_without_out_writes_only_its_output_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEGAPAR_BENCH_DIR", raising=False)
    assert cli_main(["bench", "route", "--quick", "--device", "cpu"]) == 0
    assert _files(tmp_path) == ["megapar-bench/route-cpu-quick.json", "megapar-bench/route-cpu-quick.md"]
    out = capsys.readouterr().out
    # an aligned table, not key=value lines: every table line starts its time_us column at the same place
    header = next(ln for ln in out.splitlines() if ln.startswith("case ") and "time_us" in ln)
    assert "time_us=" not in out and "case=" not in out
    rows = json.loads((tmp_path / "megapar-bench/route-cpu-quick.json").read_text())["rows"]
    body = out[out.index(header):].splitlines()[2:2 + len(rows)]
    col = header.index("time_us") + len("time_us")              # numbers right-aligned under the header
    assert len(body) == len(rows) and all(ln[col - 1] != " " and ln[col] == " " for ln in body), (header, body)


def test_bench_summary_only_when_asked(tmp_path):
    out = tmp_path / "res"
    assert cli_main(["bench", "route", "--quick", "--device", "cpu", "--out", str(out)]) == 0
    assert not (out / "BENCHMARKS.md").exists()
    assert cli_main(["bench", "--out", str(out), "--summary"]) == 0          # no suite: the summary alone
    text = (out / "BENCHMARKS.md").read_text()
    rows = json.loads((out / "route-cpu-quick.json").read_text())["rows"]
    assert "## route on cpu-quick ([route-cpu-quick.json](route-cpu-quick.json))" in text
    assert f"| {rows[0]['case']} | {rows[0]['time_us']} |" in text
    elsewhere = tmp_path / "docs" / "SUMMARY.md"
    assert cli_main(["bench", "--out", str(out), "--summary", str(elsewhere)]) == 0
    assert "(../res/route-cpu-quick.json)" in elsewhere.read_text()


def test_reduced_sizes_without_quick_are_labelled_quick(tmp_path, monkeypatch):
    from launch.bench import gemm
    from launch.bench.common import BenchContext, write_results

    sizes = []
    monkeypatch.setattr(gemm, "_weights", lambda ctx, e, n, k, seed: {"shape": (e, n, k)})
    monkeypatch.setattr(gemm, "Case", lambda ctx, shape, g, tok, w: (shape, tok, w["shape"]))
    monkeypatch.setattr(gemm, "_run_case", lambda ctx, c, fn: (sizes.append(c), ctx.record(str(c), 1.0)))
    monkeypatch.setattr(gemm, "_routed_rows", lambda ctx, shape, g, w, fn: sizes.append((shape, "routed", w["shape"])))
    ctx = BenchContext(suite="gemm", device=torch.device("cpu"), quick=False)
    gemm.run(ctx)
    assert sizes and all(shape == "tiny" for shape, _, _ in sizes)     # CPU has no full size
    assert any(what == "routed" for _, what, _ in sizes)                 # the routed decode rows too
    path = write_results(ctx, tmp_path, "megapar bench gemm --device cpu")
    assert path.name == "gemm-cpu-quick.json"
    assert any("results tagged -quick" in n for n in json.loads(path.read_text())["notes"])
    full = BenchContext(suite="x", device=torch.device("cpu"))
    full.record("a", 1.0)
    full.note("skipped at L=8")
    full.note("other")
    full.note("skipped at L=8")          # a loop reaching the same note again: kept once
    assert full.notes == ["skipped at L=8", "other"]
    assert write_results(full, tmp_path).name == "x-cpu.json"


def test_gemm_quick_without_triton_runs_the_rows_it_can(tmp_path):
    hide = tmp_path / "hide" / "triton"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('triton is hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=f"{hide.parent}{os.pathsep}{REPO}", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "gemm", "--quick", "--device", "cpu",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "gemm-cpu-quick.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"torch", "torch_grouped_mm"} and all(r["rel_err"] < 1e-2 for r in rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_bench_device_cuda_without_cuda_is_one_line(capsys):
    assert cli_main(["bench", "route", "--quick", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("megapar bench: --device cuda but CUDA is not available here "
                           "(torch.cuda.is_available() is False); use --device cpu")


def test_speedup_bars_start_at_parity_and_show_their_values():
    pytest.importorskip("matplotlib")
    from launch.bench.plot import speedup_figure

    long = "a case label that is much longer than seventy characters, so the old plot cut it off"
    rows = [{"case": long, "speedup_vs_anchor": 4.0}, {"case": "slow", "speedup_vs_anchor": 0.5},
            {"case": "no anchor", "time_us": 1.0}]
    fig = speedup_figure(rows, "t")
    ax = fig.axes[0]
    spans = sorted((round(min(b.get_x(), b.get_x() + b.get_width()), 6), round(max(b.get_x(), b.get_x() + b.get_width()), 6))
                   for b in ax.patches)
    assert spans == [(0.5, 1.0), (1.0, 4.0)]
    assert {t.get_text() for t in ax.texts} == {"4.00x", "0.50x"}
    labels = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
    assert labels == [long, "slow"]


def test_gemm_slab_rows_of_our_fp4_kernels_have_their_own_roofline(monkeypatch):
    """The DeepGEMM section's slab rows: DeepGEMM (FP8 weights) against the FP8 roofline, ours (FP4
    weights) against max(flops at the rate of their MMAs: bf16 for W4A16, FP8 for W4A8; the MXFP4
    weight + bf16 activation and output bytes at the copy ceiling). The DeepGEMM module and the grouped
    GEMM are stood in for (only the rows' bookkeeping runs); the rates are scaled down so the tiny
    shape is compute-bound at 128 rows per expert and bound by bytes at 8."""
    from types import SimpleNamespace

    from megapar.launch.bench import gemm
    from megapar.launch.bench.common import BenchContext
    from megapar.moe.kernels import deep_gemm as dgm
    from megapar.moe.kernels.grouped_gemm import GEMM

    monkeypatch.setattr(GEMM, "usable", lambda **_: {"deep_gemm": None})
    monkeypatch.setattr(dgm, "deep_gemm_weight", lambda pw: SimpleNamespace(source="stand-in", extra_bytes=0))
    monkeypatch.setattr(dgm, "_module", lambda: None)
    monkeypatch.setattr(dgm, "alignment", lambda dg: 1 << 30)        # no "aligned" / "gemm only" rows
    bf16_tflops, fp8_tflops = 0.5, 0.8
    monkeypatch.setenv("MEGAPAR_BENCH_CEILINGS", f"10,{bf16_tflops},{fp8_tflops}")

    def grouped(x, w, counts=None, layout="contiguous", backend=None, rows_hint=None):
        return torch.zeros(*x.shape[:-1], N, dtype=torch.bfloat16)

    ctx = BenchContext(suite="gemm", device=torch.device("cpu"), quick=True)
    E, N, K = 4, 256, 128
    monkeypatch.setattr(gemm, "DG_PREFILL_TOKENS", (8,))
    w = gemm._weights(ctx, E, N, K, seed=1)
    w["fp8"] = None                                  # no fp8 anchor (its quantizer is slow interpreted)
    assert gemm._deep_gemm_rows(ctx, "tiny", "L2", w, grouped)
    gbps = gemm.copy_ceiling_gbps(ctx.device)
    slab = [r for r in ctx.rows if "slab" in r["case"] or "masked" in r["case"]]
    assert {r["tok_per_expert"] for r in slab} == set(gemm.DG_DECODE_TOKENS)
    for r in slab:
        M = E * min(r["tok_per_expert"], gemm.DG_SLAB_CAPACITY)
        flops = 2.0 * M * N * K
        fp4_bytes = E * N * K // 2 + E * N * K // 32 + M * K * 2 + M * N * 2     # e2m1 pairs, e8m0 per 32
        fp8_bytes = E * N * K + E * (N // 128) * (K // 128) * 4 + M * K + M * (K // 128) * 4 + M * N * 2
        if r["impl"].startswith("deep_gemm"):
            want = max(flops / (fp8_tflops * 1e6), fp8_bytes / (gbps * 1e3))
        else:
            rate = fp8_tflops if r["impl"].startswith("triton_w4a8") else bf16_tflops
            want = max(flops / (rate * 1e6), fp4_bytes / (gbps * 1e3))
        assert r["floor_us"] == pytest.approx(want, abs=1e-3), r["case"]
        assert r["roofline_fraction"] == pytest.approx(r["floor_us"] / r["time_us"], abs=2e-3), r["case"]
    ours = [r for r in slab if r["impl"].startswith("triton")]
    assert {r["impl"] for r in ours} == {"triton_w4a16 slab C=128", "triton_w4a16 slab C=128 rows_hint=8",
                                         "triton_w4a16 slab C=128 rows_hint=32",
                                         "triton_w4a16 slab C=128 rows_hint=128", "triton_w4a8 slab C=128",
                                         "triton_w4a8 slab C=128 rows_hint=8", "triton_w4a8 slab C=128 rows_hint=32",
                                         "triton_w4a8 slab C=128 rows_hint=128"}


def test_merge_copy_reference_moves_the_ring_steps_bytes():
    """The merge suite's copy row stands for a copy of the ring step's bytes, read + written (its
    floor and GB/s count `moved` once): source and destination hold half of them each."""
    from megapar.launch.bench import merge

    t, h, d = 64, 8, 32                               # the --quick size of the ring step
    moved = t * h * (d * 4 + 4) * 2 + t * h * (d * 2 + 4)    # fp32 acc read + written, bf16 block read
    src, dst = merge._copy_buffers(moved, torch.device("cpu"))
    assert src.shape == dst.shape
    assert src.numel() * src.element_size() + dst.numel() * dst.element_size() == moved


def test_ep_local_floors_count_the_bytes_each_mover_moves(monkeypatch):
    """The local permute writes every layout row (align 128: padding rows too, as zeros) and reads
    each token's row once: (T + R) * H * 2 bytes; the unpermute and combine read only the rows of
    the T * K pairs (never the padding) and write each token once: (T * K + T) * H * 2. Both aligns
    run (CUDA stood in for: the CPU run stops after align 1, where R = T * K); the floors are
    recomputed from the routing by hand."""
    from megapar.launch.bench import ep
    from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps

    monkeypatch.setattr(BenchContext, "is_cuda", property(lambda self: True))
    ctx = BenchContext(suite="ep", device=torch.device("cpu"), quick=True)
    monkeypatch.setattr(ctx, "time_fn", lambda fn, **kw: (fn(), 2.0)[1])
    ep._local_cases(ctx)
    t, h, k, e = 64, 256, 4, 16                                    # the --quick sizes
    ids, _ = ep._routing(t, e, k, torch.device("cpu"), 0)
    counts = torch.bincount(ids.flatten(), minlength=e).tolist()
    gbps = copy_ceiling_gbps(torch.device("cpu"))
    for align in (1, 128):
        rows = sum(-(-c // align) * align for c in counts)
        permute, unpermute = (t + rows) * h * 2, (t * k + t) * h * 2
        got = {r["case"].split(" T=")[0]: r for r in ctx.rows if r["case"].endswith(f"align={align}")}
        assert set(got) == {"local permute rows", "local dispatch (plan + permute)", "local unpermute rows",
                            "local combine"}
        assert got["local permute rows"]["rows"] == rows and (align == 1) == (rows == t * k)
        for case, nbytes in (("local permute rows", permute), ("local dispatch (plan + permute)", permute),
                             ("local unpermute rows", unpermute), ("local combine", unpermute)):
            assert got[case]["floor_us"] == pytest.approx(nbytes / (gbps * 1e3), abs=1e-3), (align, case)
            assert got[case]["gbps"] == pytest.approx(nbytes / 2.0 / 1e3, rel=1e-3), (align, case)


def test_mhc_floors_count_each_cases_bytes_once():
    """mHC floors from the sizes, by hand (bf16 residual [T, 4, H] = R bytes, a row [T, H] = W, the
    fp32 parameters fn [24, 4H], base [24], scale [3] = F, the fp32 post [T, 4] + comb [T, 4, 4] = S):
    pre R + F + W + S, post 2R + W + S, post+pre fused 2R + 2W + 2S + F (post's bytes, F and pre's
    outputs; the read of the new residual that fusing saves is not in its floor: with it, the fused
    floor was the unfused pair's 3R + 2W). F (fn is read once a call) was left out: at T = 1 it is
    most of pre's bytes."""
    from megapar.launch.bench import mhc
    from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps

    ctx = BenchContext(suite="mhc", device=torch.device("cpu"), quick=True)
    mhc.run(ctx)
    gbps = copy_ceiling_gbps(ctx.device)
    seen = set()
    for r in ctx.rows:
        name = r["case"].split(" T=")[0]
        t, h = r["T"], r["H"]
        res, row = t * 4 * h * 2, t * h * 2
        params, mix = (24 * 4 * h + 24 + 3) * 4, (t * 4 + t * 16) * 4
        nbytes = {"pre": res + params + row + mix, "post": 2 * res + row + mix,
                  "post+pre fused": 2 * res + 2 * row + 2 * mix + params}[name]
        assert r["floor_us"] == pytest.approx(nbytes / (gbps * 1e3), abs=1e-3), r["case"]
        seen.add(name)
    assert seen == {"pre", "post", "post+pre fused"}


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_moe_serving_flop_floor_takes_the_shared_expert_at_the_bf16_rate(monkeypatch, fmt):
    """The serving rows' FLOP floor, by hand: the routed experts' 2 x 3 H I per token and pick at the
    fp8 rate for mxfp4 experts (bf16 rate for bf16 experts), plus the shared expert's 2 x 3 H I_s per
    token at the bf16 rate in both formats (its weights are bf16; it was taken at the fp8 rate with
    mxfp4 experts). The CUDA-only steps are stood in for (tiny layer on CPU, rates scaled down so
    the FLOPs decide the floor)."""
    from megapar.launch.bench import moe
    from megapar.launch.bench.common import BenchContext
    from megapar.moe.layer import MoEConfig, MoELayer

    cfg = MoEConfig(hidden=64, inter=32, num_experts=8, top_k=2, n_group=4, topk_group=2, shared_inter=48,
                    expert_format="mxfp4", dtype=torch.bfloat16)
    monkeypatch.setattr(moe, "_shard_config", lambda name, f, dtype: MoEConfig(**{**cfg.__dict__, "expert_format": f}))
    monkeypatch.setattr(moe, "SERVING_TOKENS", (1, 4))
    monkeypatch.setattr(moe, "_graph_replay_us", lambda ctx, fn, flush: 1.0)
    monkeypatch.setattr(MoELayer, "enable_cuda_graphs", lambda self, sizes: None)
    fp8, bf16 = 2e-3, 1e-3                                       # TFLOP/s
    monkeypatch.setenv("MEGAPAR_BENCH_CEILINGS", f"10,{bf16},{fp8}")
    ctx = BenchContext(suite="moe", device=torch.device("cpu"), quick=True)
    monkeypatch.setattr(ctx, "time_fn", lambda fn, **kw: 1.0)
    moe._bench_serving(ctx, "v3")
    rows = [r for r in ctx.rows if r["case"].endswith("eager") and r.get("fmt") == fmt and "flop_floor_us" in r]
    assert [r["T"] for r in rows] == [1, 4]
    for r in rows:
        routed = 2 * r["T"] * cfg.top_k * 3 * cfg.hidden * cfg.inter
        shared = 2 * r["T"] * 3 * cfg.hidden * cfg.shared_inter
        want = routed / ((fp8 if fmt == "mxfp4" else bf16) * 1e6) + shared / (bf16 * 1e6)
        assert r["flop_floor_us"] == pytest.approx(want, abs=1e-3), r["case"]
        assert r["floor_us"] == pytest.approx(max(want, r["byte_floor_us"]), abs=1e-3), r["case"]


def test_moe_cpu_layer_floor_counts_the_shared_expert():
    """The CPU rows' byte floor (`bench_layer`), by hand: the weights of the experts the tokens hit
    (fp32: 3 H I x 4 bytes each) plus the shared expert's (3 H I_s x 4; it runs on every token and
    was left out) plus the activations, at the CPU copy ceiling."""
    from megapar.launch.bench import moe
    from megapar.launch.bench.common import BenchContext, copy_ceiling_gbps
    from megapar.moe.layer import MoELayer

    ctx = BenchContext(suite="moe", device=torch.device("cpu"), quick=True)
    cfg = moe._quick_config("fp32")
    layer = MoELayer(cfg, device=ctx.device)
    torch.manual_seed(0)
    moe.bench_layer(ctx, "tiny fp32", layer, 16)
    hit = int((layer.expert_counts > 0).sum())
    inter_s = cfg.num_shared * (cfg.shared_inter or cfg.inter)
    nbytes = hit * 3 * cfg.hidden * cfg.inter * 4 + 3 * cfg.hidden * inter_s * 4 + 2 * 16 * cfg.hidden * 4 * (1 + cfg.top_k)
    assert 0 < hit <= cfg.num_experts and ctx.rows[0]["T"] == 16
    assert ctx.rows[0]["floor_us"] == pytest.approx(nbytes / (copy_ceiling_gbps(ctx.device) * 1e3), abs=1e-3)


def test_gemm_plot_keeps_routed_and_deep_gemm_rows_out_of_the_main_lines(tmp_path, monkeypatch):
    """A gemm panel's series and reference lines hold one problem each: the routed rows (only the
    experts hit; same impl name as a main row) are their own series, and the floor and anchor lines
    come from the main rows alone (not from a routed row's floor over the experts hit, nor from a
    DeepGEMM slab row's floor or its whole-slab bmm anchor)."""
    pytest.importorskip("matplotlib")
    from launch.bench import plot

    plt = plot._pyplot()
    figs = []

    class Keep:                           # pyplot, but the figures stay open for the test to read
        def __getattr__(self, name):
            return getattr(plt, name)

        def subplots(self, *a, **k):
            fig, axes = plt.subplots(*a, **k)
            figs.append(fig)
            return fig, axes

        def close(self, fig=None):
            pass
    monkeypatch.setattr(plot, "_pyplot", lambda: Keep())
    main = [{"case": f"v3 L1 tok={t} triton_w4a16", "time_us": us, "anchor": "torch bf16 _grouped_mm",
             "anchor_us": a, "fp8_anchor_us": a8, "floor_us": f, "shape": "v3", "gemm": "L1", "tok_per_expert": t,
             "impl": "triton_w4a16"} for t, us, a, a8, f in ((1, 100.0, 300.0, 250.0, 50.0), (8, 200.0, 400.0, 350.0, 60.0))]
    routed = {"case": "v3 L1 routed T=1 top8 triton_w4a16", "time_us": 30.0, "anchor": "torch bf16 _grouped_mm",
              "anchor_us": 90.0, "floor_us": 10.0, "shape": "v3", "gemm": "L1", "tok_per_expert": 1.0,
              "impl": "triton_w4a16", "experts_hit": 8}
    slab = {"case": "v3 L1 tok=8 triton_w4a16 slab C=128", "time_us": 150.0, "anchor": "torch bf16 bmm (whole slab)",
            "anchor_us": 500.0, "floor_us": 70.0, "shape": "v3", "gemm": "L1", "tok_per_expert": 8,
            "impl": "triton_w4a16 slab C=128"}
    plot.plot_gemm(main + [routed, slab], tmp_path / "g.png", "t")
    lines = {ln.get_label(): [tuple(map(float, p)) for p in ln.get_xydata()] for ln in figs[0].axes[0].get_lines()}
    assert lines["ours: triton_w4a16"] == [(1.0, 100.0), (8.0, 200.0)]
    assert lines["torch bf16 _grouped_mm"] == [(1.0, 300.0), (8.0, 400.0)]
    assert lines["torch fp8 _scaled_grouped_mm"] == [(1.0, 250.0), (8.0, 350.0)]
    assert lines["FP4 floor (bytes / copy bw)"] == [(1.0, 50.0), (8.0, 60.0)]
    assert lines["ours: triton_w4a16 slab C=128"] == [(8.0, 150.0)]
    assert [pts for label, pts in lines.items() if "routed" in label] == [[(1.0, 30.0)]]


@pytest.mark.parametrize("cuda", [False, True])
def test_world_size_picks_the_ranks_of_every_multi_process_suite(monkeypatch, cuda):
    """`--world-size N` (ctx.options["world_size"]) is the rank count of every suite's multi-process
    cases: cp multi, sp overlap, ubatch, eplb migration, moe EP > 1 (on CUDA with 8 GPUs: N alone, not
    2, 4 and 8; on CPU: N gloo processes, not 2 or 4). The processes are stood in for: the test
    records the world size each launch asks for."""
    import megapar.launch.local as local
    from megapar.launch.bench import cp, eplb, moe, sp, ubatch
    from megapar.launch.bench.common import BenchContext

    asked: list[tuple[str, int]] = []

    def launch(fn, world, **kwargs):
        asked.append((fn.__module__.rsplit(".", 1)[-1], world))
        if fn.__module__.endswith("eplb"):
            return [dict(us=1.0, allgather_us=1.0, sent=1, received=1, changed=1, slot_bytes=1, slots=world)] * world
        return [{}] if fn.__module__.endswith("moe") else [[]] * world
    monkeypatch.setattr(local, "launch_local", launch)
    if cuda:
        monkeypatch.setattr(BenchContext, "is_cuda", property(lambda self: True))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(moe, "_bench_serving", lambda ctx, name: None)

    def ctx_of(suite, world=3):
        return BenchContext(suite=suite, device=torch.device("cpu"), options={"world_size": world})
    cp._multi_gpu(ctx_of("cp"))
    sp._overlap(ctx_of("sp"))
    if cuda:
        monkeypatch.setattr(ubatch, "_single_device", lambda ctx, shape: None)
        moe.run(ctx_of("moe"))
    else:
        eplb._bench_migration(ctx_of("eplb"))
    ubatch.run(ctx_of("ubatch"))
    want = ["cp", "sp"] + (["moe", "moe"] if cuda else ["eplb"]) + ["ubatch"]     # moe: the v3 and v4flash layers
    assert asked == [(name, 3) for name in want]
    if cuda:                      # more ranks than GPUs: not run, and a note says so
        asked.clear()
        ctx = ctx_of("sp", 16)
        sp._overlap(ctx)
        assert asked == [] and any("--world-size 16 > 8 GPUs" in n for n in ctx.notes)
        sp._overlap(BenchContext(suite="sp", device=torch.device("cpu")))       # default: every size up to 8
        assert asked == [("sp", 2), ("sp", 4), ("sp", 8)]


def test_eplb_balance_time_is_a_median_of_warm_calls(monkeypatch):
    """The balance rows' time_us is a median over warm calls of the planner, as every time in the
    results: on a fake clock where a (shape, policy)'s first call costs 100 µs and the next ones
    10 µs, it reads 10 (it was one call, the first: 100)."""
    import time as time_mod

    from megapar.launch.bench import eplb
    from megapar.launch.bench.common import BenchContext

    clock = [0.0]
    seen: set = set()
    real = eplb.rebalance_experts

    def planner(load, num_physical, groups, nodes, ranks, *rest):
        key = (tuple(load.shape), num_physical, groups, nodes, ranks)
        clock[0] += 10e-6 if key in seen else 100e-6
        seen.add(key)
        return real(load, num_physical, groups, nodes, ranks, *rest)
    monkeypatch.setattr(eplb, "rebalance_experts", planner)
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock[0])
    ctx = BenchContext(suite="eplb", device=torch.device("cpu"), quick=True)
    eplb._bench_balance(ctx)
    rows = [r for r in ctx.rows if r["case"].startswith("balance")]
    assert len(rows) == 6 and all(r["time_us"] == pytest.approx(10.0) for r in rows), [r["time_us"] for r in rows]
