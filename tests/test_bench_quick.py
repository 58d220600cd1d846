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
