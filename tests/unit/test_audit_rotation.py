"""audit.jsonl rotates (audit.jsonl.1 .. .<keep>) under the writers' lock, keeps
what the retention says, and every reader (Store.read_audit, max_audited_version, `repair`, the
CLI) follows the rotated files in order. Unrotated, the log grows without end (in deploy/, inside
a memory volume whose overflow evicts the pod) and readers would see audit.jsonl only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flyserve.control import ControlIOError, ControlPlane
from flyserve.control.audit_files import (
    AuditRotation,
    log_paths_oldest_first,
    read_log_tail,
    rotate_if_due,
)
from flyserve.control.state_files import read_file_tail
from flyserve.control.store import Store

SMALL = AuditRotation(max_bytes=64 << 10, keep=2)
PAD = "x" * 900  # about 1 kB a line: 64 kB hold about 64 lines


def _store(tmp_path: Path, policy: AuditRotation = SMALL) -> Store:
    return Store(tmp_path / "state", audit_rotation=policy)


def _write(store: Store, first: int, n: int) -> None:
    for i in range(first, first + n):
        assert store.audit({"id": f"e{i}", "seq": i, "result": "success", "pad": PAD})


def _seqs(store: Store, limit: int | None = None) -> list[int]:
    return [e["seq"] for e in store.read_audit(limit) if "seq" in e]


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_writes_past_the_limit_rotate_and_the_retention_holds(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 0, 400)  # about 400 kB: six times the limit
    log_path = store.dir.audit_log
    names = sorted(p.name for p in log_path.parent.iterdir() if p.name.startswith("audit"))
    assert names == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]  # keep=2: no .3
    for p in log_paths_oldest_first(log_path, SMALL.keep):
        assert 0 < p.stat().st_size <= SMALL.max_bytes
    total = sum(p.stat().st_size for p in log_paths_oldest_first(log_path, SMALL.keep))
    assert total <= SMALL.bound_bytes


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_a_lowered_retention_drops_the_surplus_files_at_the_next_rotation(tmp_path: Path) -> None:
    store = _store(tmp_path, AuditRotation(max_bytes=64 << 10, keep=4))
    _write(store, 0, 330)
    assert store.dir.audit_log.with_name("audit.jsonl.4").exists()
    store.audit_rotation = SMALL  # keep=2
    _write(store, 330, 70)
    names = sorted(p.name for p in store.dir.audit_log.parent.iterdir() if p.name.startswith("audit"))
    assert names == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]


def test_readers_see_the_entries_across_files_in_order(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 0, 400)
    seqs = _seqs(store)
    # contiguous, oldest first, ending at the newest; the oldest kept is the first line of .2
    oldest = json.loads(store.dir.audit_log.with_name("audit.jsonl.2").read_text().splitlines()[0])["seq"]
    assert seqs == list(range(oldest, 400))
    assert len(seqs) > 64 * 2  # more than audit.jsonl alone holds: the rotated files are read
    assert _seqs(store, limit=100) == list(range(300, 400))  # a limit reaches back across files too


def test_a_fresh_audit_jsonl_still_witnesses_the_highest_version(tmp_path: Path) -> None:
    """max_audited_version (the version floor when current.json and history are lost) must not
    drop to 0 because the version lines just rotated out of audit.jsonl."""
    store = _store(tmp_path)
    store.audit({"id": "v", "result": "success", "version": 41, "pad": PAD})
    _write(store, 0, 100)  # rotates: version 41 is now in a rotated file only
    assert "41" not in store.dir.audit_log.read_text()
    assert store.max_audited_version() == 41


def test_a_half_written_last_line_is_tolerated_and_swallows_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 0, 100)
    rotated = store.dir.audit_log.with_name("audit.jsonl.1")
    with rotated.open("a") as f:  # a writer killed mid-append, then the log rotated past it
        f.write('{"id": "torn", "seq": 99999, "res')
    with store.dir.audit_log.open("a") as f:  # and the live file's own last line is torn too
        f.write('{"id": "torn2", "se')
    seqs = _seqs(store)
    assert 99999 not in seqs
    assert seqs == sorted(seqs) and seqs[-1] == 99 and len(seqs) == len(set(seqs))
    first_live = json.loads(store.dir.audit_log.read_text().splitlines()[0])["seq"]
    assert first_live in seqs  # the line after the torn one (the next file's first) is whole
    _write(store, 100, 1)  # the next append after a torn line still reads
    assert _seqs(store)[-1] == 100


def test_rotation_happens_only_under_the_writers_lock(tmp_path: Path) -> None:
    store = _store(tmp_path)
    other = _store(tmp_path)  # another writer (its own descriptor: flock excludes it like a process)
    _write(store, 0, 60)
    with other.lock():
        _write(store, 60, 20)  # past the limit, but the lock is another's: appended, not rotated
        assert not store.dir.audit_log.with_name("audit.jsonl.1").exists()
        other.audit({"id": "holder", "seq": 80, "pad": PAD})  # the holder's own line rotates
        assert store.dir.audit_log.with_name("audit.jsonl.1").exists()
    assert _seqs(store) == list(range(81))


def test_a_reader_racing_a_rotation_sees_each_entry_once(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 0, 100)
    log_path = store.dir.audit_log
    calls = {"n": 0}

    def read_then_rotate(path: Path, max_bytes: int) -> str | None:
        text = read_file_tail(path, max_bytes)
        calls["n"] += 1
        if calls["n"] == 1:  # the newest file was read; now it rotates before the older ones are
            _write(store, 100, 1)
            assert rotate_if_due(log_path, SMALL.max_bytes, SMALL)
        return text

    text = read_log_tail(log_path, 1 << 30, SMALL.keep, read_then_rotate)
    seqs = [json.loads(ln)["seq"] for ln in (text or "").splitlines()]
    assert calls["n"] > 3  # it read again
    assert seqs == sorted(set(seqs)) and seqs[-1] == 100


def test_repair_completes_a_write_ahead_entry_that_rotated_out_of_audit_jsonl(tmp_path: Path) -> None:
    from flyserve.control.repair import repair

    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    plane.store.audit_rotation = SMALL
    v1 = plane.apply_overrides({"min_seq_len": 2048}, actor="a").snapshot
    plane.store.audit({"id": "w1", "action": "set", "result": "publishing", "version": v1.version})
    _write(plane.store, 0, 100)  # the 'publishing' line is now in a rotated file
    assert "w1" not in plane.store.dir.audit_log.read_text()
    repair(plane)
    done = {e["id"]: e["result"] for e in plane.store.read_audit(raw=True) if e.get("recovered")}
    assert done == {"w1": "success"}


def test_the_cli_audit_command_follows_rotated_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flyserve.cli import app

    monkeypatch.setenv("FLYSERVE_AUDIT_MAX_BYTES", str(SMALL.max_bytes))
    monkeypatch.setenv("FLYSERVE_AUDIT_KEEP", "3")
    state = tmp_path / "state"
    store = Store(state)
    assert store.audit_rotation == AuditRotation(max_bytes=SMALL.max_bytes, keep=3)
    _write(store, 0, 150)
    assert store.dir.audit_log.with_name("audit.jsonl.2").exists()
    out = CliRunner().invoke(app, ["thresholds", "audit", "--state-dir", str(state), "-n", "120"])
    assert out.exit_code == 0, out.output
    assert [json.loads(ln)["seq"] for ln in out.output.splitlines()] == list(range(30, 150))


def test_a_planted_symlink_among_the_rotated_files_is_refused_by_name(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _write(store, 0, 10)
    (tmp_path / "decoy").write_text('{"id": "forged", "seq": -1}\n')
    os.symlink(tmp_path / "decoy", store.dir.audit_log.with_name("audit.jsonl.1"))
    with pytest.raises(ControlIOError, match=r"audit\.jsonl\.1: a symlink"):
        store.read_audit()


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_planted_file_at_the_oldest_rotated_name_costs_the_version_floor_nothing(
    tmp_path: Path, plant: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO or symlink at audit.jsonl.2 made the whole read raise, and max_audited_version fell to
    0 (the floor lost). Now that one file is skipped, named once in a warning, and the others count."""
    store = _store(tmp_path)
    store.audit({"id": "v", "result": "success", "version": 41, "pad": PAD})
    _write(store, 0, 100)  # version 41 now sits in audit.jsonl.1 only
    oldest = store.dir.audit_log.with_name("audit.jsonl.2")
    assert not oldest.exists()
    (tmp_path / "decoy").write_text('{"id": "forged", "version": 999}\n')
    if plant == "fifo":
        os.mkfifo(oldest)
    else:
        os.symlink(tmp_path / "decoy", oldest)
    with caplog.at_level("WARNING", logger="flyserve.control"):
        assert store.max_audited_version() == 41  # the decoy's 999 is not read either
        assert store.max_audited_version() == 41
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1  # once per file, not per read
    assert all("audit.jsonl.2" in m and "forged" not in m for m in skipped)


def test_a_planted_fifo_at_the_live_log_still_raises(tmp_path: Path) -> None:
    """audit.jsonl itself is the live log: unreadable, it is reported (changes are refused), not skipped."""
    store = _store(tmp_path)
    _write(store, 0, 100)
    store.dir.audit_log.unlink()
    os.mkfifo(store.dir.audit_log)
    with pytest.raises(ControlIOError, match=r"audit\.jsonl"):
        store.read_audit()
    with pytest.raises(ValueError, match=r"audit\.jsonl"):
        read_log_tail(store.dir.audit_log, 1 << 20, SMALL.keep, read_file_tail)


def test_the_audit_log_can_live_outside_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/ puts it on a disk volume of its own ($FLYSERVE_AUDIT_DIR)."""
    monkeypatch.setenv("FLYSERVE_AUDIT_DIR", str(tmp_path / "audit"))
    store = _store(tmp_path)
    _write(store, 0, 3)
    assert (tmp_path / "audit" / "audit.jsonl").is_file()
    assert not (tmp_path / "state" / "audit.jsonl").exists()
    assert _seqs(store) == [0, 1, 2]


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"FLYSERVE_AUDIT_MAX_BYTES": "12"}, "FLYSERVE_AUDIT_MAX_BYTES"),
        ({"FLYSERVE_AUDIT_MAX_BYTES": "9" * 400}, "FLYSERVE_AUDIT_MAX_BYTES"),
        ({"FLYSERVE_AUDIT_KEEP": "0"}, "FLYSERVE_AUDIT_KEEP"),
        ({"FLYSERVE_AUDIT_KEEP": "-1"}, "FLYSERVE_AUDIT_KEEP"),
        ({"FLYSERVE_AUDIT_KEEP": "²"}, "FLYSERVE_AUDIT_KEEP"),
    ],
)
def test_bad_rotation_settings_name_the_variable_not_the_value(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        AuditRotation.from_env(env)
    assert next(iter(env.values())) not in str(info.value)
    assert AuditRotation.from_env_or_default(env) == AuditRotation()  # a rank keeps writing its log


def test_the_defaults_are_8_mib_and_4_files() -> None:
    assert AuditRotation.from_env({}) == AuditRotation(max_bytes=8 << 20, keep=4)
