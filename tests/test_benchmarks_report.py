"""Unit tests of the benchmark report helpers (no timings)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import report


def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert report.percentile(values, 0) == 1.0
    assert report.percentile(values, 100) == 4.0
    assert report.percentile(values, 50) == pytest.approx(2.5)
    assert report.percentile(values, 25) == pytest.approx(1.75)  # numpy's linear method
    assert report.percentile([7.0], 90) == 7.0


def test_median_of_odd_and_even_counts():
    assert report.median([3.0, 1.0, 2.0]) == 2.0
    assert report.median([1, 2, 3, 10]) == pytest.approx(2.5)


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_rejects_bad_input(values, q):
    with pytest.raises(ValueError):
        report.percentile(values, q)


def test_spread_reports_median_range_and_relative_spread():
    s = report.spread([10.0, 12.0, 8.0])
    assert s == {"median": 10.0, "min": 8.0, "max": 12.0, "rel_spread": pytest.approx(0.4), "n": 3}
    assert report.spread([5.0])["rel_spread"] == 0.0


def test_ratio_handles_missing_denominator():
    assert report.ratio(6.0, 3.0) == 2.0
    assert report.ratio(1.0, 0.0) is None
    assert report.ratio(1.0, None) is None


def test_fmt_uses_significant_figures_and_dashes():
    assert report.fmt(None) == "-"
    assert report.fmt(12345.678) == "12346"
    assert report.fmt(2.34567) == "2.35"
    assert report.fmt(0.0123456) == "0.0123"
    assert report.fmt(0.0) == "0"
    assert report.fmt(7) == "7"
    assert report.fmt(True) == "yes"
    assert report.fmt("x") == "x"
    assert report.fmt(math.nan) == "nan"
    assert report.fmt_ratio(2.345) == "2.35x"
    assert report.fmt_ratio(None) == "-"


def test_markdown_table_layout_and_escaping():
    table = report.markdown_table(["system", "tok/s"], [["a|b", 1.5], ["c", None]])
    assert table.splitlines() == [
        "| system | tok/s |",
        "|---|---|",
        "| a\\|b | 1.50 |",
        "| c | - |",
    ]


def test_markdown_table_rejects_ragged_rows():
    with pytest.raises(ValueError):
        report.markdown_table(["a", "b"], [[1]])


def test_headline_format():
    assert report.headline("engine", "tandem/hf_static 2.30x mixed", "2.0x") == (
        "engine: tandem/hf_static 2.30x mixed (goal 2.0x)"
    )


def test_write_json_creates_parent_folders(tmp_path):
    path = report.write_json(tmp_path / "a" / "b" / "r.json", {"x": 1.5, "p": tmp_path})
    assert json.loads(path.read_text()) == {"x": 1.5, "p": str(tmp_path)}


def test_write_json_rejects_unknown_objects(tmp_path):
    with pytest.raises(TypeError):
        report.write_json(tmp_path / "r.json", {"x": object()})


def test_finish_writes_json_and_prints_headline_last(tmp_path, capsys):
    out = tmp_path / "results" / "demo.json"
    line = report.finish("demo", out, {"value": 3}, "3.00x", "2.0x")
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    assert printed[-1] == line == "demo: 3.00x (goal 2.0x)"
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "demo" and payload["value"] == 3 and payload["headline"] == line


def test_machine_info_is_json_ready():
    info = report.machine_info()
    assert info["cpu_count"] >= 1
    json.dumps(info)
