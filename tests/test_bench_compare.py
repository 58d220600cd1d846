"""`launch.bench.compare` and `megapar bench SUITE --compare OLD.json`: rows matched by their
identifying fields, new/old per timing column, > 5 % slower in time_us flagged, rows of one file
listed; on synthetic files with known ratios and on the recorded results."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from launch.bench.compare import compare, main as compare_main, timing_columns, to_markdown, write_comparison
from launch.cli import main as cli_main

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _file(suite: str, rows: list[dict]) -> dict:
    return {"suite": suite, "command": f"megapar bench {suite}", "device": "h200", "date": "2026-01-01T00:00:00Z",
            "versions": {"torch": "2.11", "gpu": "NVIDIA H200"}, "rows": rows, "notes": []}


OLD = [
    {"case": "a", "time_us": 100.0, "anchor": "torch", "anchor_us": 200.0, "floor_us": 50.0, "T": 1},
    {"case": "b", "time_us": 80.0, "anchor_us": 100.0, "floor_us": 40.0, "T": 2},
    {"case": "c", "time_us": 40.0, "T": 3},
    {"case": "gone", "time_us": 10.0},
]
NEW = [
    {"case": "a", "time_us": 110.0, "anchor": "torch", "anchor_us": 200.0, "floor_us": 50.0, "T": 1},   # 10 % slower
    {"case": "b", "time_us": 82.0, "anchor_us": 125.0, "floor_us": 45.0, "T": 2},   # 2.5 %; anchor 25 % slower
    {"case": "c", "time_us": 30.0, "T": 3},                                          # faster
    {"case": "new row", "time_us": 5.0},
]


def test_synthetic_files_give_the_known_ratios_and_flag_the_regression(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_file("moe", OLD)))
    new.write_text(json.dumps(_file("moe", NEW)))
    c = compare(new, old)
    assert c.columns == ["time_us", "anchor_us"]                 # floors are models, not measurements
    ratios = {r.name: r.ratios for r in c.rows}
    assert ratios == {"a": {"time_us": 1.1, "anchor_us": 1.0}, "b": {"time_us": 82 / 80, "anchor_us": 1.25},
                      "c": {"time_us": 0.75}}
    assert [r.name for r in c.regressions] == ["a"]              # b's slower anchor decides nothing
    assert c.only_new == ["new row"] and c.only_old == ["gone"]
    assert c.verdict().startswith("1 of 3 rows slower by > 5% in time_us: a (time_us x1.100)")
    md = to_markdown(c)
    assert "| a | 100.0 | 110.0 | 1.100! | 1.000 | **yes** |" in md
    assert "| b | 80.0 | 82.0 | 1.025 | 1.250! |  |" in md
    assert "| c | 40.0 | 30.0 | 0.750 |  |  |" in md
    assert "Only in the new file (1):\n- new row" in md and "Only in the old file (1):\n- gone" in md
    # a larger threshold: no regression
    assert not compare(new, old, threshold=0.2).regressions
    path = write_comparison(c, tmp_path)
    assert path == tmp_path / "moe-compare.md" and path.read_text() == md
    assert compare_main([str(new), str(old), "--fail-on-regression"]) == 1
    assert compare_main([str(new), str(old)]) == 0


def test_repeated_case_names_match_by_their_parameters():
    old = [{"case": "x", "T": t, "fmt": f, "time_us": 10.0 * t} for t in (1, 2) for f in ("bf16", "fp8")]
    new = [dict(r, time_us=r["time_us"] * (1.2 if r["fmt"] == "fp8" and r["T"] == 2 else 1.0)) for r in old[::-1]]
    c = compare(_file("gemm", new), _file("gemm", old))
    assert len(c.rows) == 4 and not c.only_new and not c.only_old
    assert [r.name for r in c.regressions] == ["case=x, fmt=fp8, T=2"]
    assert c.regressions[0].ratios["time_us"] == pytest.approx(1.2)


def test_bad_files_raise_naming_them(tmp_path):
    with pytest.raises(ValueError, match="different suites: <new> is 'cp', <old> is 'moe'"):
        compare(_file("cp", NEW), _file("moe", OLD))
    with pytest.raises(ValueError, match="no such result file"):
        compare(tmp_path / "missing.json", _file("moe", OLD))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"suite": "moe"}))
    with pytest.raises(ValueError, match="'rows' list"):
        compare(bad, _file("moe", OLD))
    with pytest.raises(ValueError, match="two rows share"):
        compare(_file("moe", NEW + NEW[:1]), _file("moe", OLD))
    with pytest.raises(ValueError, match="threshold"):
        compare(_file("moe", NEW), _file("moe", OLD), threshold=-1)


@pytest.mark.parametrize("name", ["cp-h200.json", "moe-h200.json", "gemm-h200.json"])
def test_a_recorded_file_against_itself_is_all_ones(name):
    path = RESULTS / name
    data = json.loads(path.read_text())
    c = compare(path, path)
    assert len(c.rows) == len(data["rows"]) and not c.only_new and not c.only_old and not c.regressions
    assert all(v == 1.0 for r in c.rows for v in r.ratios.values())
    assert sum(len(r.ratios) for r in c.rows) >= len(data["rows"])
    assert "time_us" in c.columns and not any("floor" in col for col in c.columns)
    assert c.verdict().startswith(f"no regression: {len(data['rows'])} rows")


def test_a_recorded_file_with_one_slower_row_is_flagged():
    data = json.loads((RESULTS / "cp-h200.json").read_text())
    slower = copy.deepcopy(data)
    slower["rows"][3]["time_us"] *= 1.08
    del slower["rows"][5]
    c = compare(slower, data)
    assert [r.name for r in c.regressions] == [data["rows"][3]["case"]]
    assert c.regressions[0].ratios["time_us"] == pytest.approx(1.08)
    assert c.only_old == [data["rows"][5]["case"]] and len(c.rows) == len(data["rows"]) - 1
    assert timing_columns(data["rows"]) == ["time_us", "anchor_us"]


def test_cli_bench_compare_writes_the_table(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli_main(["bench", "merge", "--quick", "--device", "cpu", "--out", str(first)]) == 0
    old = first / "merge-cpu-quick.json"
    assert cli_main(["bench", "merge", "--quick", "--device", "cpu", "--out", str(second),
                     "--compare", str(old)]) == 0
    table = (second / "merge-compare.md").read_text()
    cases = [r["case"] for r in json.loads(old.read_text())["rows"]]
    assert table.startswith("# bench merge: new vs old") and "**Verdict:" in table
    assert all(f"| {c.replace('|', chr(92) + '|')} |" in table for c in cases)
    assert "Only in" not in table
    assert cli_main(["bench", "all", "--compare", str(old)]) == 2
    assert cli_main(["bench", "merge", "--compare", str(tmp_path / "missing.json")]) == 2


def test_files_of_different_devices_say_so_in_the_verdict():
    """An H100 run against an H200 file: the rows still compare, but the verdict and the table's
    header say the devices differ (a ratio is then the devices' difference as much as the code's)."""
    new = dict(_file("moe", NEW), device="h100", versions={"torch": "2.11", "gpu": "NVIDIA H100"})
    c = compare(new, _file("moe", OLD))
    assert c.verdict().startswith("different devices (new h100, old h200): ratios compare the devices too; "
                                  "1 of 3 rows slower by > 5% in time_us")
    assert c.devices == ("h100", "h200") and [r.name for r in c.regressions] == ["a"]
    md = to_markdown(c)
    assert "- new: `<new>` (device h100;" in md and "- old: `<old>` (device h200;" in md
    assert not compare(_file("moe", NEW), _file("moe", OLD)).verdict().startswith("different devices")
