"""`--costs` tables are operator-supplied input read through flyserve.policy.
safe_read. Deep nesting, a FIFO, a /dev/zero link, a cost of 1e308 ms and a 400-digit num_heads
each give an error naming the file and field (never the value), at once, with no traceback."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flyserve.cli import app as cli
from flyserve.pricing.costs import MAX_COST_MS, CostTableError, load_costs

REPO_TABLE = Path(__file__).resolve().parents[2] / "config" / "costs" / "cpu.json"


def table_doc() -> dict:
    return json.loads(REPO_TABLE.read_text())


def load_in_thread(path: Path) -> Exception | None:
    """load_costs in a daemon thread: a reader that blocks on a FIFO (or reads /dev/zero without
    end) fails this test after 20 s instead of hanging the suite."""
    box: dict[str, Exception | None] = {}

    def run() -> None:
        try:
            load_costs(path)
            box["v"] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects whatever it raised
            box["v"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "load_costs blocked or read without end"
    return box["v"]


def test_the_committed_tables_still_load() -> None:
    assert load_costs("h200").entries and load_costs("cpu").entries


def test_deep_nesting_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "deep.json"
    p.write_text('{"format": "flyserve-costs", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}")
    exc = load_in_thread(p)
    assert isinstance(exc, CostTableError) and "deep.json" in str(exc) and "nested too deeply" in str(exc)


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    p = tmp_path / "fifo.json"
    os.mkfifo(p)
    exc = load_in_thread(p)
    assert isinstance(exc, CostTableError) and "fifo.json: not a regular file (a FIFO)" in str(exc)


def test_a_dev_zero_link_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "zero.json"
    p.symlink_to("/dev/zero")
    exc = load_in_thread(p)
    assert isinstance(exc, CostTableError) and "not a regular file (a character device)" in str(exc)


@pytest.mark.parametrize("ms", [1e308, MAX_COST_MS * 1.01, 0.0, -1.0])
def test_costs_must_be_finite_and_bounded(tmp_path: Path, ms: float) -> None:
    doc = table_doc()
    doc["entries"][3]["ms"]["prefill"] = ms
    p = tmp_path / "big.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(CostTableError) as e:
        load_costs(p)
    assert "entries[3]: field 'ms.prefill'" in str(e.value) and "at most 1e+06" in str(e.value)
    assert repr(ms) not in str(e.value)


def test_a_400_digit_num_heads_names_the_field_without_echoing_it(tmp_path: Path) -> None:
    text = REPO_TABLE.read_text()
    doc = table_doc()
    digits = "4" * 400
    p = tmp_path / "heads.json"
    p.write_text(text.replace(f'"num_heads": {doc["meta"]["num_heads"]}', f'"num_heads": {digits}', 1))
    assert digits in p.read_text()
    with pytest.raises(CostTableError) as e:
        load_costs(p)
    assert "heads.json: field 'meta.num_heads': an integer of 400 digits" in str(e.value)
    assert "4444" not in str(e.value)
    # A short but absurd value: named with its bound, not echoed
    doc["meta"]["num_heads"] = 10**20
    p.write_text(json.dumps(doc))
    with pytest.raises(CostTableError, match="field 'meta.num_heads' must be an integer from 1 to 4096") as e:
        load_costs(p)
    assert str(10**20) not in str(e.value)


def test_the_sidecar_refuses_a_deep_table_at_start_without_a_traceback(tmp_path: Path) -> None:
    p = tmp_path / "deep.json"
    p.write_text("[" * 50_000 + "]" * 50_000)
    token = tmp_path / "token"
    token.write_text("t0ken-for-tests-0123456789\n")
    token.chmod(0o600)
    r = CliRunner().invoke(
        cli,
        ["sidecar", "--state-dir", str(tmp_path / "s"), "--token-file", str(token), "--costs", str(p),
         "--port", "9"],  # never bound: the table is refused first
    )  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "error: --costs: deep.json: nested too deeply" in r.output and "Traceback" not in r.output
