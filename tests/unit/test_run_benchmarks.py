"""scripts/run_benchmarks.py: tables from pytest-benchmark's JSON, and the doc block it rewrites."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("run_benchmarks", REPO / "scripts" / "run_benchmarks.py")
assert _spec is not None and _spec.loader is not None
rb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rb)


def _bench(group: str, name: str, median: float, minimum: float) -> dict:
    return {"group": group, "name": name, "stats": {"median": median, "min": minimum}}


DATA = {
    "datetime": "2026-11-30T22:40:00",
    "machine_info": {"node": "ci", "python_version": "3.11.9", "cpu": {"brand_raw": "Some CPU"}},
    "benchmarks": [
        _bench("policy", "test_shape", 6.0e-6, 5.5e-6),
        _bench("policy", "test_bare_np_diff", 2.0e-6, 1.9e-6),
        _bench("control", "test_current", 0.3e-6, 0.25e-6),
        _bench("control", "test_bare_attribute_read", 0.1e-6, 0.09e-6),
    ],
}


def test_tables_give_each_group_its_ratios_to_the_yardstick():
    text = rb.tables(DATA)
    assert "| `test_bare_np_diff` | 1.90 us | 2.00 us | 1.00x |" in text
    assert "| `test_shape` | 5.50 us | 6.00 us | 2.89x |" in text  # 5.5 / 1.9: ratios of minimums
    assert "| `test_current` | 0.25 us | 0.30 us | 2.78x |" in text  # 0.25 / 0.09
    assert text.index("**control**") < text.index("**policy**")  # groups sorted


def test_rewrite_replaces_only_the_marked_block():
    doc = f"# Title\n\nprose\n\n{rb.BEGIN}\nold table\n{rb.END}\n\nafter\n"
    out = rb.rewrite(doc, "new table\n")
    assert out == f"# Title\n\nprose\n\n{rb.BEGIN}\nnew table\n{rb.END}\n\nafter\n"
    assert rb.rewrite(out, "new table\n") == out  # idempotent


def test_missing_markers_and_bad_json_are_clear_errors():
    with pytest.raises(rb.BenchmarkDocError, match="needs exactly one"):
        rb.rewrite("no markers here\n", "x")
    with pytest.raises(rb.BenchmarkDocError, match="missing or bad field"):
        rb.tables({"benchmarks": [{"name": "test_x"}]})


def test_the_performance_doc_has_the_block():
    text = (REPO / "docs" / "performance.md").read_text()
    assert text.count(rb.BEGIN) == 1 and text.count(rb.END) == 1


def test_no_run_from_a_saved_json(tmp_path: Path):
    import json

    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(DATA))
    doc = tmp_path / "perf.md"
    doc.write_text(f"x\n{rb.BEGIN}\n{rb.END}\n")
    assert rb.main(["--json", str(saved), "--no-run", "--doc", str(doc)]) == 0
    assert "| `test_shape` | 5.50 us | 6.00 us | 2.89x |" in doc.read_text()
    assert rb.main(["--json", str(tmp_path / "missing.json"), "--no-run", "--doc", str(doc)]) == 1


def test_a_group_without_test_bare_uses_its_np_diff():
    data = {"benchmarks": [_bench("select", "test_2_rows_select", 6e-6, 5e-6),
                           _bench("select", "test_2_rows_np_diff", 2.5e-6, 2e-6)]}  # fmt: skip
    text = rb.tables(data)
    assert (
        "min of `test_2_rows_np_diff`" in text
        and "| `test_2_rows_select` | 5.00 us | 6.00 us | 2.50x |" in text
    )
