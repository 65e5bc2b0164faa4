"""Compaction of dead processes' metric files (flyserve.telemetry.compaction).

The files come from real processes (flyserve's own metrics backend in a child that then dies
without its exit handlers, as a killed worker does), so the merge is checked on the format the
ranks really write. What must hold: every total a scrape shows is the same before and after (and
at every point of a crash), live processes' files are never touched, and the directory shrinks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flyserve.sidecar.stats import read_counters, totals_of
from flyserve.telemetry import compaction
from flyserve.telemetry.compaction import JOURNAL, compact, parse_name, reading
from flyserve.telemetry.multiprocess import SoundFilesCollector
from flyserve.telemetry.prom import encode_values_file, read_values_file

pytestmark = pytest.mark.slow  # its metrics files are written by python subprocesses (dead ranks)

ROOT = Path(__file__).resolve().parents[2]

# One child process: counts for `rank`, sets its live gauges and the control "max" gauge, then
# dies with os._exit (no atexit: its live-gauge files stay, as a SIGKILLed worker's do).
WRITER = textwrap.dedent(
    """
    import os, sys
    from flyserve.telemetry import metrics as tm
    d, rank, n, stamp = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    tm.setup_multiprocess(d)
    tm.DISPATCH_DECISIONS.labels("prefill", "chunk", rank).inc(n)
    tm.DISPATCH_DECISIONS.labels("unified", "decode_only", rank).inc(2 * n)
    tm.DISPATCH_TOKENS.labels("prefill", rank).inc(1000 * n)
    for i in range(n):
        tm.DISPATCH_QUERY_TOKENS.labels("prefill", rank).observe(100 * (i + 1))
        tm.KERNEL_SECONDS.labels("prefill", rank).observe(0.001 * (i + 1) / 7)
    tm.ENGINE_STEP.labels(rank).set(n)
    tm.CONFIG_LAST_SUCCESS.set(stamp)
    sys.stdout.flush()
    os._exit(0)
    """
)


def _write(d: Path, rank: str, n: int, stamp: float) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [sys.executable, "-c", WRITER, str(d), rank, str(n), str(stamp)],
        check=False,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr.decode()[-2000:]


@pytest.fixture(scope="module")
def dead_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three dead processes: rank 0, rank 0 again (a restart), rank 1."""
    d = tmp_path_factory.mktemp("dead-metrics")
    for rank, n, stamp in (("0", 5, 1000.0), ("0", 3, 3000.0), ("1", 4, 2000.0)):
        _write(d, rank, n, stamp)
    assert len(list(d.glob("counter_*.db"))) == 3
    return d


@pytest.fixture
def metrics_dir(dead_files: Path, tmp_path: Path) -> Path:
    d = tmp_path / "metrics"
    shutil.copytree(dead_files, d)
    return d


def exposition(d: Path) -> dict[str, float]:
    """Sample line (name and labels) -> value, as /metrics would show these files."""
    reg = CollectorRegistry()
    SoundFilesCollector(reg, path=str(d))
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _without_live_gauges(e: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in e.items() if not k.startswith("flyserve_engine_step")}


def _assert_same(before: dict[str, float], after: dict[str, float]) -> None:
    assert set(after) == set(before)
    for k, v in before.items():
        assert after[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_merge_keeps_every_total_and_the_directory_shrinks(metrics_dir: Path):
    before = exposition(metrics_dir)
    counters_before = read_counters(metrics_dir)
    assert before['flyserve_dispatch_decisions_total{path="prefill",rank="0",reason="chunk"}'] == 8.0
    assert before['flyserve_dispatch_query_tokens_count{path="prefill",rank="0"}'] == 8.0
    assert before["flyserve_config_last_success_timestamp_seconds"] == 3000.0  # max over the processes
    n_before = len(list(metrics_dir.glob("*.db")))

    report = compact(metrics_dir)

    assert report.merged == 3 * 3  # counter + histogram + gauge_max of each of the 3 processes
    assert report.dropped == 3  # their gauge_livemostrecent files
    names = sorted(p.name for p in metrics_dir.glob("*.db"))
    assert names == ["counter_dead.db", "gauge_max_dead.db", "histogram_dead.db"]
    assert report.files_before == n_before and report.files_after == 3
    after = exposition(metrics_dir)
    _assert_same(_without_live_gauges(before), after)  # counters, histograms, the max gauge: unchanged
    assert not any(k.startswith("flyserve_engine_step") for k in after)  # dead processes' live gauges: gone
    counters_after = read_counters(metrics_dir)
    assert set(counters_after) == set(counters_before) == {0, 1}
    for r in (0, 1):
        assert counters_after[r].decisions == counters_before[r].decisions
        assert totals_of([counters_after[r]]) == totals_of([counters_before[r]])
    assert not (metrics_dir / JOURNAL).exists()
    assert not list(metrics_dir.glob(".compact-*"))


def test_a_second_compaction_adds_new_dead_files_to_the_archive(metrics_dir: Path, tmp_path: Path):
    compact(metrics_dir)
    _write(metrics_dir, "0", 7, 500.0)  # another restart of rank 0 dies
    before = exposition(metrics_dir)
    assert before['flyserve_dispatch_decisions_total{path="prefill",rank="0",reason="chunk"}'] == 15.0
    report = compact(metrics_dir)
    assert report.merged == 3 and report.dropped == 1
    after = exposition(metrics_dir)
    _assert_same(_without_live_gauges(before), after)
    assert after["flyserve_config_last_success_timestamp_seconds"] == 3000.0  # the max survives the archive
    assert len(list(metrics_dir.glob("*.db"))) == 3


def test_live_processes_files_are_never_touched(metrics_dir: Path):
    """Files of this process and of a running child stay byte for byte; only the dead ones merge."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = {}
        for pid in (os.getpid(), child.pid):
            for src in sorted(metrics_dir.glob("*.db")):
                mf = parse_name(src.name)
                assert mf is not None
                if mf.kind == "counter":  # one dead process's counter file, copied as a live one's
                    dst = metrics_dir / f"counter_{pid}.db"
                    shutil.copy(src, dst)
                    live[dst] = dst.read_bytes()
                    break
        report = compact(metrics_dir)
        assert report.merged > 0
        for path, data in live.items():
            assert path.exists() and path.read_bytes() == data
    finally:
        child.kill()
        child.wait()


def test_a_pid_the_caller_calls_alive_is_left_alone(metrics_dir: Path):
    before = sorted(p.name for p in metrics_dir.glob("*.db"))
    report = compact(metrics_dir, is_alive=lambda pid: True)
    assert report.merged == 0 and report.dropped == 0
    assert sorted(p.name for p in metrics_dir.glob("*.db")) == before


@pytest.mark.parametrize("crash_after", ["temp", "journal", "rename", "sources"])
def test_a_crash_at_any_step_never_double_counts_or_loses_counts(metrics_dir: Path, crash_after: str):
    """A compaction dies after one step of a commit (the hook raises, as a kill would stop it):
    a scrape at that moment shows the same totals, and the next compaction finishes the job."""
    before = _without_live_gauges(exposition(metrics_dir))

    class Crash(Exception):
        pass

    def hook(step: str) -> None:
        if step == crash_after:
            raise Crash(step)

    with pytest.raises(Crash):
        compact(metrics_dir, after_step=hook)
    mid = exposition(metrics_dir)  # what a scrape sees between the crash and the recovery
    _assert_same(before, _without_live_gauges(mid))
    counters_mid = read_counters(metrics_dir)
    assert counters_mid[0].decisions[("prefill", "chunk")] == 8.0

    report = compact(metrics_dir)
    assert report.recovered is not None  # a stray temporary or a journal was found and dealt with
    after = exposition(metrics_dir)
    _assert_same(before, _without_live_gauges(after))
    assert sorted(p.name for p in metrics_dir.glob("*.db")) == [
        "counter_dead.db",
        "gauge_max_dead.db",
        "histogram_dead.db",
    ]
    assert not (metrics_dir / JOURNAL).exists() and not list(metrics_dir.glob(".compact-*"))


def test_a_torn_journal_means_the_commit_never_happened(metrics_dir: Path):
    before = _without_live_gauges(exposition(metrics_dir))
    (metrics_dir / JOURNAL).write_text('{"archive": "counter_dead.db", "temp": ".compact-coun')
    (metrics_dir / ".compact-counter_dead.db.tmp").write_bytes(b"\0" * 8)
    _assert_same(before, _without_live_gauges(exposition(metrics_dir)))
    report = compact(metrics_dir)
    assert report.recovered is not None
    _assert_same(before, _without_live_gauges(exposition(metrics_dir)))


def test_a_corrupt_dead_file_is_left_alone_and_the_rest_merges(metrics_dir: Path):
    bad = metrics_dir / "counter_999999.db"
    bad.write_bytes(b"\xff\xff\xff\x7f" + b"\0" * 60)  # a header claiming 2 GB
    report = compact(metrics_dir, is_alive=lambda pid: False)
    assert "counter_999999.db" in report.skipped
    assert bad.exists() and report.merged == 9


def test_one_compaction_at_a_time(metrics_dir: Path):
    import fcntl

    fd = os.open(metrics_dir / compaction.COMPACT_LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert compact(metrics_dir).busy
    finally:
        os.close(fd)
    assert not compact(metrics_dir).busy


def _dead_pid() -> int:
    """The pid of a process that has exited (reaped), so pid_alive says False for it."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    assert not compaction.pid_alive(p.pid)
    return p.pid


def test_readers_exclude_sources_an_archive_already_holds(metrics_dir: Path):
    source = f"counter_{_dead_pid()}.db"
    (metrics_dir / JOURNAL).write_text(
        json.dumps(
            {"archive": "counter_dead.db", "temp": ".compact-counter_dead.db.tmp", "sources": [source]}
        )
    )
    with reading(metrics_dir) as excluded:
        assert excluded == {source}  # no temporary: the rename happened
    (metrics_dir / ".compact-counter_dead.db.tmp").write_bytes(b"")
    with reading(metrics_dir) as excluded:
        assert excluded == set()  # the temporary is still there: the sources still count


def test_a_forged_journal_cannot_rename_over_a_file_outside_metrics(metrics_dir: Path, tmp_path: Path):
    """recover() renames the journal's temp over ``metrics/<archive>`` only after checking it."""
    target = tmp_path / "control" / "current.json"
    target.parent.mkdir()
    target.write_text('{"thresholds": "real"}')
    (metrics_dir / JOURNAL).write_text(
        '{"archive": "../control/current.json", "temp": ".compact-x.tmp", "sources": []}'
    )
    (metrics_dir / ".compact-x.tmp").write_text("forged")
    with reading(metrics_dir) as excluded:
        assert excluded == set()
    report = compact(metrics_dir, is_alive=lambda pid: True)
    assert target.read_text() == '{"thresholds": "real"}'
    assert report.recovered is not None and "dropped" in report.recovered
    assert not (metrics_dir / JOURNAL).exists() and not (metrics_dir / ".compact-x.tmp").exists()


def test_a_journal_naming_a_live_process_file_is_refused(metrics_dir: Path):
    """A forged journal's sources would be left out of every scrape and then deleted."""
    live = metrics_dir / f"counter_{os.getpid()}.db"
    live.write_bytes(encode_values_file([]))
    for sources in ([live.name], ["../counter_1.db"], ["gauge_max_dead.db"]):
        (metrics_dir / JOURNAL).write_text(
            json.dumps(
                {"archive": "counter_dead.db", "temp": ".compact-counter_dead.db.tmp", "sources": sources}
            )
        )
        with reading(metrics_dir) as excluded:
            assert excluded == set()
        assert compaction.recover(metrics_dir) is not None
        assert live.exists() and not (metrics_dir / JOURNAL).exists()


def test_a_deeply_nested_journal_is_dropped_not_a_recursion_error(metrics_dir: Path):
    before = _without_live_gauges(exposition(metrics_dir))
    (metrics_dir / JOURNAL).write_text("[" * 100_000)
    with reading(metrics_dir) as excluded:
        assert excluded == set()
    _assert_same(before, _without_live_gauges(exposition(metrics_dir)))
    report = compact(metrics_dir, is_alive=lambda pid: True)
    assert report.recovered is not None and "dropped" in report.recovered
    assert not (metrics_dir / JOURNAL).exists()


def test_write_durable_replaces_a_planted_symlink_never_its_target(tmp_path: Path):
    target = tmp_path / "precious"
    target.write_text("keep")
    for name in (".compact-counter_dead.db.tmp", JOURNAL):
        link = tmp_path / name
        link.symlink_to(target)
        compaction._write_durable(link, b"new")
        assert target.read_text() == "keep"
        assert not link.is_symlink() and link.read_bytes() == b"new"


def test_parse_name():
    assert parse_name("counter_12.db").group == "counter"
    assert parse_name("gauge_livemostrecent_12.db").mode == "livemostrecent"
    assert parse_name("gauge_max_dead.db").pid == "dead"
    assert parse_name("notes.txt") is None and parse_name("gauge_12.db") is None


# ----------------------------------------------------------------------------- the fast exposition


def _lines(text: bytes) -> list[str]:
    return sorted(text.decode().splitlines())


def test_files_exposition_has_the_lines_prometheus_client_writes(metrics_dir: Path):
    """FilesExposition (the sidecar's /metrics for the files) against generate_latest over
    SoundFilesCollector: the same HELP, TYPE and sample lines, before and after a compaction, with
    new processes' files, and after a file grew in place (its cached entries are extended)."""

    from flyserve.telemetry.files_exposition import FilesExposition

    def reference() -> list[str]:
        reg = CollectorRegistry()
        SoundFilesCollector(reg, path=str(metrics_dir))
        return _lines(generate_latest(reg))

    fx = FilesExposition(metrics_dir)
    assert _lines(fx.text()) == reference()
    assert any(line.startswith("flyserve_engine_step{") for line in reference())  # live gauges covered
    compact(metrics_dir)
    assert _lines(fx.text()) == reference()
    _write(metrics_dir, "2", 6, 4000.0)  # new files, new series (rank 2), a larger max gauge
    assert _lines(fx.text()) == reference()
    # A file that grows in place (same inode, entries appended, as a live rank's does).
    archive = metrics_dir / "counter_dead.db"
    entries = [(k, v, ts) for k, v, ts, _ in read_values_file(archive)]
    key = next(k for k, _, _ in entries if '"rank": "0"' in k and "decisions" in k)
    entries.append((key.replace('"rank": "0"', '"rank": "9"'), 42.0, 0.0))
    with open(archive, "r+b") as f:
        f.write(encode_values_file(entries))
    assert _lines(fx.text()) == reference()
    assert any('rank="9"' in line and line.endswith(" 42.0") for line in _lines(fx.text()))
    assert 'flyserve_dispatch_decisions_total{path="prefill",rank="2",reason="chunk"} 6.0' in _lines(
        fx.text()
    )


def test_files_exposition_leaves_out_a_corrupt_file_and_counts_it(metrics_dir: Path):
    from flyserve.telemetry.files_exposition import FilesExposition
    from flyserve.telemetry.multiprocess import SKIPPED_FILES

    good = _lines(FilesExposition(metrics_dir).text())
    (metrics_dir / "counter_999998.db").write_bytes(b"\xff\xff\xff\x7f" + b"\0" * 60)
    (metrics_dir / "counter_999997.db").write_bytes(
        b"\x18\0\0\0\0\0\0\0" + b"\x04\0\0\0\xff\xfe\xfd\xfc" + b"\0" * 16
    )
    assert _lines(FilesExposition(metrics_dir).text()) == good
    assert {"counter_999998.db", "counter_999997.db"} <= SKIPPED_FILES


def test_files_exposition_forgets_files_a_compaction_removed(metrics_dir: Path):
    """Its per-file cache would otherwise grow by every dead process for the life of the sidecar."""
    from flyserve.telemetry.files_exposition import FilesExposition

    fx = FilesExposition(metrics_dir)
    fx.text()
    assert len(fx._files) == len(list(metrics_dir.glob("*.db")))
    compact(metrics_dir)
    fx.text()
    assert sorted(fx._files) == sorted(p.name for p in metrics_dir.glob("*.db"))


def _counter_key(metric: str, rank: str) -> str:
    return json.dumps([metric, metric + "_total", {"rank": rank}, "help"])


def test_files_exposition_skips_a_file_with_a_deeply_nested_key(metrics_dir: Path):
    """json.loads of '[' * 50000 raises RecursionError: unskipped, /metrics 500 for ever."""
    from flyserve.telemetry.files_exposition import FilesExposition
    from flyserve.telemetry.multiprocess import SKIPPED_FILES

    fx = FilesExposition(metrics_dir)
    good = _lines(fx.text())
    (metrics_dir / "counter_999996.db").write_bytes(encode_values_file([("[" * 50_000, 1.0, 0.0)]))
    assert _lines(fx.text()) == good
    assert _lines(fx.text()) == good  # and again: not cached half-way
    assert "counter_999996.db" in SKIPPED_FILES


def test_files_exposition_with_a_full_key_cache_still_renders(metrics_dir: Path, monkeypatch):
    """Keys read after the cache filled are not cached; _render must not look them up there
    (keys[key] raised KeyError: /metrics 500 for ever)."""
    from flyserve.telemetry import files_exposition
    from flyserve.telemetry.files_exposition import FilesExposition

    good = _lines(FilesExposition(metrics_dir).text())
    monkeypatch.setattr(files_exposition, "_KEY_CACHE_MAX", 3)
    fx = FilesExposition(metrics_dir)
    assert _lines(fx.text()) == good
    assert len(fx._keys) <= 3
    assert _lines(fx.text()) == good


def test_files_exposition_and_entry_cache_refuse_a_file_over_the_size_cap(metrics_dir: Path, monkeypatch):
    """A sparse file with a matching header would be read in full on every request; both
    readers share prom.files.read_used and its MAX_VALUES_FILE_BYTES cap."""
    from flyserve.telemetry.entry_cache import EntryCache
    from flyserve.telemetry.files_exposition import FilesExposition
    from flyserve.telemetry.multiprocess import SKIPPED_FILES
    from flyserve.telemetry.prom import files as prom_files

    good = _lines(FilesExposition(metrics_dir).text())
    cap = max(prom_files.values_file_used(p) or 0 for p in metrics_dir.glob("*.db"))
    big = metrics_dir / "counter_999995.db"
    n = cap // 32 + 1  # each entry is at least 32 bytes
    big.write_bytes(
        encode_values_file([(_counter_key("flyserve_oversized", str(i)), 1.0, 0.0) for i in range(n)])
    )
    assert big.stat().st_size > cap
    assert any("flyserve_oversized" in line for line in _lines(FilesExposition(metrics_dir).text()))
    monkeypatch.setattr(prom_files, "MAX_VALUES_FILE_BYTES", cap)
    assert _lines(FilesExposition(metrics_dir).text()) == good
    assert big.name in SKIPPED_FILES
    with pytest.raises(ValueError, match=f"larger than {cap} bytes"):
        EntryCache(lambda key: key).read(str(big))
