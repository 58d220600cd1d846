"""Every `megapar bench` suite runs at a tiny size on CPU and writes its result files."""

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
