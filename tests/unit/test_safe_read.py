"""flyserve.files.safe_read, the one reader of files someone else wrote.

No thread and no timeout is needed to show a FIFO does not hang: open() with O_NONBLOCK of a FIFO
with no writer returns at once, and fstat refuses it before any read. On a reader without that
open flag this test would block, which the suite's own timeout reports as a failure."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flyserve.control.state_files import read_file_tail, read_json, read_regular_file
from flyserve.files import safe_read
from flyserve.files.safe_read import SafeReadError


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    p = tmp_path / "pipe.json"
    os.mkfifo(p)
    return p


@pytest.fixture
def zero_link(tmp_path: Path) -> Path:
    p = tmp_path / "zero.json"
    p.symlink_to("/dev/zero")
    return p


def test_a_fifo_with_no_writer_is_refused_without_blocking(fifo: Path) -> None:
    with pytest.raises(SafeReadError, match="pipe.json: not a regular file \\(a FIFO\\)"):
        safe_read.read_bytes(fifo, 1024)
    with pytest.raises(SafeReadError, match="FIFO"):
        safe_read.read_tail(fifo, 1024)
    # the store's names are thin wrappers over the same reader
    with pytest.raises(ValueError, match="FIFO"):
        read_regular_file(fifo, 1024)
    with pytest.raises(ValueError, match="FIFO"):
        read_json(fifo)


def test_a_symlink_to_dev_zero_is_refused_followed_or_not(zero_link: Path) -> None:
    with pytest.raises(SafeReadError, match="a symlink"):
        safe_read.read_bytes(zero_link, 1 << 20)
    # Following links (operator files a ConfigMap mounts as links): the target must be regular.
    with pytest.raises(SafeReadError, match="character device"):
        safe_read.read_bytes(zero_link, 1 << 20, follow_symlinks=True)
    with pytest.raises(ValueError, match="symlink"):
        read_file_tail(zero_link, 1 << 20)


def test_a_link_to_a_regular_file_is_followed_only_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text('{"a": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert safe_read.read_json(link, 100, follow_symlinks=True) == {"a": 1}
    with pytest.raises(SafeReadError, match="symlink"):
        safe_read.read_json(link, 100)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "dir.json"
    d.mkdir()
    with pytest.raises(SafeReadError, match="dir.json: not a regular file \\(a directory\\)"):
        safe_read.read_bytes(d, 100)


def test_missing_is_none_not_an_error(tmp_path: Path) -> None:
    assert safe_read.read_bytes(tmp_path / "nope", 100) is None
    assert safe_read.read_json(tmp_path / "nope", 100) is None


def test_oversize_is_refused_by_fstat_before_reading(tmp_path: Path) -> None:
    p = tmp_path / "big.json"
    p.write_bytes(b" " * 2000)
    with pytest.raises(SafeReadError, match="big.json: larger than 1000 bytes"):
        safe_read.read_bytes(p, 1000)
    assert safe_read.read_bytes(p, 2000) == b" " * 2000


def test_a_half_written_json_names_the_file_and_where(tmp_path: Path) -> None:
    p = tmp_path / "half.json"
    p.write_text('{"step": 12, "query_lens": [1, 2')
    with pytest.raises(SafeReadError) as e:
        safe_read.read_json(p, 1000)
    assert e.value.source == "half.json" and e.value.field == "<document>"
    assert "not JSON" in str(e.value) and "line 1" in str(e.value)


@pytest.mark.parametrize("depth", [65, 5000, 100_000])
def test_deep_nesting_is_an_error_not_a_recursion_traceback(tmp_path: Path, depth: int) -> None:
    p = tmp_path / "deep.json"
    p.write_text("[" * depth + "]" * depth)
    with pytest.raises(SafeReadError, match="nested too deeply"):
        safe_read.read_json(p, 1 << 20)
    assert safe_read.parse_json("[" * 64 + "]" * 64, source="x") is not None  # the cap itself passes


def test_a_5000_digit_number_names_the_field_and_is_never_echoed(tmp_path: Path) -> None:
    digits = "7" * 5000
    p = tmp_path / "n.json"
    p.write_text(f'{{"meta": {{"num_heads": {digits}}}}}')
    with pytest.raises(SafeReadError) as e:
        safe_read.read_json(p, 1 << 20)
    assert e.value.field == "meta.num_heads" and "5000 digits" in str(e.value)
    assert "7777" not in str(e.value)
    # 30 digits still read; 31 do not
    assert safe_read.parse_json('{"a": ' + "9" * 30 + "}", source="x") == {"a": int("9" * 30)}
    with pytest.raises(SafeReadError, match="31 digits"):
        safe_read.parse_json('{"a": [' + "9" * 31 + "]}", source="x")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
def test_non_finite_numbers_are_refused_by_field(token: str) -> None:
    with pytest.raises(SafeReadError) as e:
        safe_read.parse_json(f'{{"entries": [{{"ms": {{"unified": {token}}}}}]}}', source="t.json")
    assert e.value.field == "entries[0].ms.unified" and "finite" in str(e.value)
    assert token.lstrip("-") not in str(e.value).replace("(NaN or Infinity)", "")


def test_a_future_mtime_changes_nothing(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    p.write_text(json.dumps({"a": 1}))
    ahead = time.time() + 10 * 365 * 86400
    os.utime(p, (ahead, ahead))
    assert safe_read.read_json(p, 100) == {"a": 1}


def test_the_tail_starts_at_a_whole_line(tmp_path: Path) -> None:
    p = tmp_path / "audit.jsonl"
    p.write_text("".join(f'{{"n": {i}}}\n' for i in range(100)))
    tail = safe_read.read_tail(p, 50)
    assert tail is not None and tail.splitlines()[-1] == '{"n": 99}'
    assert all(json.loads(line) for line in tail.splitlines())


def test_loads_record_refuses_what_a_line_reader_must_skip() -> None:
    assert safe_read.loads_record('{"step": 1, "time": 1.5}') == {"step": 1, "time": 1.5}
    for bad in ('{"step": ' + "1" * 5000 + "}", '{"time": NaN}', '{"time": 1e400}', "[" * 100_000):
        with pytest.raises(ValueError):
            safe_read.loads_record(bad)


def test_errors_name_the_file_relative_to_the_state_dir(tmp_path: Path) -> None:
    assert safe_read.display_name(tmp_path / "shapes" / "0-1.jsonl", tmp_path) == "shapes/0-1.jsonl"
    assert safe_read.display_name("/elsewhere/secret.json", tmp_path) == "secret.json"


def test_metrics_files_that_are_not_regular_are_skipped_not_waited_on(tmp_path: Path) -> None:
    """A FIFO or a /dev/zero link named like a rank's metrics file: the sidecar's counter read and
    the /metrics collector skip it (a plain open() of the FIFO blocked both for ever)."""
    import threading

    from flyserve.sidecar.stats import read_counters
    from flyserve.telemetry.multiprocess import SoundFilesCollector

    os.mkfifo(tmp_path / "counter_123.db")
    (tmp_path / "histogram_124.db").symlink_to("/dev/zero")
    box: dict[str, object] = {}

    def run() -> None:
        box["counters"] = read_counters(tmp_path)
        box["metrics"] = list(SoundFilesCollector(None, path=str(tmp_path)).collect())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "a metrics reader blocked on a FIFO"
    assert box["counters"] == {} and box["metrics"] == []
