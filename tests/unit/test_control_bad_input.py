"""Bad input tried and survived: each case leaves the running snapshot byte-for-byte unchanged,
names the field and reason, is counted (flyserve_config_reloads_total{result}) and audited."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flyserve.control import ControlIOError, ControlPlane, StateDir, VersionConflict
from flyserve.control._metrics import reload_count
from flyserve.policy import ThresholdsError


@pytest.fixture
def running(tmp_path: Path) -> tuple[ControlPlane, Path]:
    cfg = tmp_path / "cfg" / "flyserve.yaml"
    cfg.parent.mkdir()
    cfg.write_text("min_seq_len: 2048\n")
    plane = ControlPlane(tmp_path / "state", config_file=cfg)
    plane.reload(actor="startup", startup=True)
    plane.apply_overrides({"lpt": "never"}, actor="alice")
    return plane, cfg


def published_bytes(plane: ControlPlane) -> tuple[bytes, bytes]:
    sd = plane.state_dir
    return sd.current_json.read_bytes(), sd.thresholds_yaml.read_bytes()


FILE_CASES = {
    "malformed YAML": ("min_seq_len: [2048\n", "<document>", "malformed YAML"),
    "wrong type": ("min_seq_len: lots\n", "min_seq_len", "valid integer"),
    "wrong type (bool for int)": ("min_qblock_rows: true\n", "min_qblock_rows", "valid integer"),
    "out of range": ("min_seq_len: -5\n", "min_seq_len", "greater than or equal to 0"),
    "not a power of two": ("block_m: 100\n", "block_m", "power of two"),
    "inconsistent": ("min_seq_len: 9000\nmax_seq_len: 4096\n", "min_seq_len", "must not exceed max_seq_len"),
    "unknown key": ("min_seq_lenn: 4096\n", "min_seq_lenn", "unknown key"),
    "empty file": ("", "<document>", "empty document"),
    "truncated write (mid key)": ("min_seq_len: 2048\nmin_qblock_ro", "<document>", "malformed YAML"),
    "truncated write (no value)": ("min_seq_len: 2048\nmin_qblock_rows:", "min_qblock_rows", "valid integer"),
    "not a mapping": ("- 1\n- 2\n", "<document>", "mapping"),
}


@pytest.mark.slow  # 0.7 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize("case", list(FILE_CASES))
def test_a_bad_config_file_changes_nothing(running: tuple[ControlPlane, Path], case: str) -> None:
    plane, cfg = running
    text, field, reason = FILE_CASES[case]
    before, snap = published_bytes(plane), plane.snapshot()
    n_invalid = reload_count("invalid", "file")
    cfg.write_text(text)
    with pytest.raises(ThresholdsError) as ei:
        plane.reload(actor="watcher")
    assert ei.value.field == field and reason in ei.value.reason, str(ei.value)
    assert published_bytes(plane) == before and plane.snapshot() == snap
    assert reload_count("invalid", "file") == n_invalid + 1
    entry = plane.audit_log()[-1]
    assert (entry["result"], entry["field"], entry["source"]) == ("invalid", field, "file")
    assert reason in entry["reason"] and entry["version_before"] == snap.version


API_CASES = {
    "wrong type": ({"min_seq_len": "2048"}, "min_seq_len"),  # strict: a string is not an int
    "out of range": ({"decode_ctx_unit": 0}, "decode_ctx_unit"),
    "unknown key": ({"nope": 1}, "nope"),
    "bad enum": ({"lpt": "sometimes"}, "lpt"),
    "not a mapping": ([("min_seq_len", 1)], "<document>"),
    "decode_path at run time": ({"decode_path": "prefill"}, "decode_path"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_a_bad_api_change_changes_nothing(running: tuple[ControlPlane, Path], case: str) -> None:
    plane, _ = running
    body, field = API_CASES[case]
    before = published_bytes(plane)
    n = reload_count("invalid", "api")
    with pytest.raises(ThresholdsError) as ei:
        plane.apply_overrides(body, actor="mallory")
    assert ei.value.field == field
    assert published_bytes(plane) == before
    assert reload_count("invalid", "api") == n + 1
    e = plane.audit_log()[-1]
    assert (e["result"], e["field"], e["actor"]) == ("invalid", field, "mallory")


def test_one_bad_key_rejects_the_whole_change(running: tuple[ControlPlane, Path]) -> None:
    plane, _ = running
    before = published_bytes(plane)
    with pytest.raises(ThresholdsError) as ei:
        plane.apply_overrides({"min_seq_len": 4096, "block_m": 3}, actor="a")
    assert ei.value.field == "block_m"
    assert published_bytes(plane) == before  # min_seq_len did not sneak through


def test_a_file_that_disappears(running: tuple[ControlPlane, Path]) -> None:
    plane, cfg = running
    before = published_bytes(plane)
    n = reload_count("io_error", "file")
    cfg.unlink()
    with pytest.raises(ControlIOError) as ei:
        plane.reload(actor="watcher")
    assert "missing" in str(ei.value) and str(cfg) in str(ei.value)
    assert published_bytes(plane) == before
    assert reload_count("io_error", "file") == n + 1
    e = plane.audit_log()[-1]
    assert e["result"] == "io_error" and "missing" in e["reason"]


_AS_NOBODY = """
import json, os, sys
from flyserve.control import ControlPlane, ControlIOError
plane = ControlPlane(sys.argv[1])
plane.snapshot()  # every module imported while still root (the interpreter may live in root's home, unreadable to nobody)
os.setgid(65534)
os.setuid(65534)
try:
    plane.apply_overrides({"min_seq_len": 4096}, actor="nobody")
    print(json.dumps({"error": None}))
except ControlIOError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A temp dir every user can traverse (pytest's own is 0700 to root)."""
    d = Path(tempfile.mkdtemp(prefix="flyserve-control-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow  # python subprocesses
def test_a_state_dir_that_is_not_writable(open_tmp: Path) -> None:
    """Really unwritable: control/ is read-only and the writer is not root (root ignores modes, so
    as root the attempt runs in a child process that drops to user nobody). audit.jsonl stays appendable."""
    plane = ControlPlane(open_tmp / "state")
    plane.apply_overrides({"lpt": "never"}, actor="alice")
    sd = plane.state_dir
    before = published_bytes(plane)
    os.chmod(
        sd.path, 0o755
    )  # flyserve creates it 0700; here another user must reach control/ to be refused there
    os.chmod(sd.lock_file, 0o666)
    os.chmod(sd.audit_log, 0o666)
    modes = {p: p.stat().st_mode for p in (sd.control_dir, sd.history_dir)}
    try:
        for p in modes:
            os.chmod(p, 0o555)
        if os.geteuid() == 0:
            out = subprocess.run(
                [sys.executable, "-c", _AS_NOBODY, str(sd.path)],
                check=False,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            error = json.loads(out.stdout.strip().splitlines()[-1])["error"]
        else:
            try:
                plane.apply_overrides({"min_seq_len": 4096}, actor="nobody")
                error = None
            except ControlIOError as exc:
                error = str(exc)
    finally:
        for p, m in modes.items():
            os.chmod(p, m)
    assert error is not None and "cannot publish" in error and "ermission denied" in error
    assert published_bytes(plane) == before
    e = plane.audit_log()[-1]
    assert (e["result"], e["actor"]) == ("io_error", "nobody") and "ermission denied" in e["reason"]
    assert not [p for p in sd.control_dir.rglob(".*.tmp")]


def wait_until(cond, *, what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` until true; the deadline is generous (a loaded 2-core machine), never a pass/fail clock."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)


def blocked_flock_waiters(path: Path) -> int:
    """Processes blocked in flock() on ``path`` right now (the ``->`` lines of /proc/locks)."""
    ino = os.stat(path).st_ino
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(
        1 for line in lines if "->" in line and " FLOCK " in line and line.split()[6].endswith(f":{ino}")
    )


_WRITER = """
import os, sys, time
from flyserve.control import ControlPlane
plane = ControlPlane(sys.argv[1])
key = sys.argv[2]
open(sys.argv[4] + "." + key, "w").close()  # ready
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[4]) and time.monotonic() < deadline:  # start together
    time.sleep(0.005)
for n in range(int(sys.argv[3])):
    plane.apply_overrides({key: 100 + n}, actor=key)
"""


@pytest.mark.slow  # python subprocesses
def test_two_writers_at_once_serialise(tmp_path: Path) -> None:
    """Two processes publish concurrently: no lost update, versions 1..N each exactly once."""
    state, n = tmp_path / "state", 10
    go = tmp_path / "go"
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(state), key, str(n), str(go)])
        for key in ("min_qblock_rows", "lpt_qblocks_always")
    ]
    try:
        wait_until(lambda: len(list(tmp_path.glob("go.*"))) == 2, what="both writers ready")
        # Hold the writers' lock while they start, until both are blocked in flock on it: then they
        # really contend. A LOCK_NB retry loop (which starved one writer: AAAAAAAAAABBBBBBBBBB) never
        # shows as a blocked waiter, so this wait fails on it.
        lock_file = StateDir(state).lock_file
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        holder = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(holder, fcntl.LOCK_EX)
        try:
            go.touch()
            wait_until(lambda: blocked_flock_waiters(lock_file) == 2, what="2 writers blocked on the lock")
        finally:
            os.close(holder)
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    plane = ControlPlane(state)
    s = plane.snapshot()
    assert s.version == 2 * n
    assert (s.thresholds.min_qblock_rows, s.thresholds.lpt_qblocks_always) == (100 + n - 1, 100 + n - 1)
    audit = plane.audit_log()
    assert sorted(e["version"] for e in audit) == list(range(1, 2 * n + 1))
    assert all(e["version"] == e["version_before"] + 1 for e in audit)
    assert sorted(e["actor"] for e in audit) == sorted(["min_qblock_rows", "lpt_qblocks_always"] * n)


def test_two_writers_from_the_same_version_one_wins(running: tuple[ControlPlane, Path]) -> None:
    plane, _ = running
    v = plane.snapshot().version
    other = ControlPlane(plane.state_dir)
    results: list[object] = []
    barrier = threading.Barrier(2)

    def write(p: ControlPlane, value: int) -> None:
        barrier.wait()
        try:
            results.append(p.apply_overrides({"min_seq_len": value}, actor=str(value), if_match=v))
        except VersionConflict as exc:
            results.append(exc)

    ts = [threading.Thread(target=write, args=(p, val)) for p, val in ((plane, 3000), (other, 4000))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert sorted(type(r).__name__ for r in results) == ["ChangeResult", "VersionConflict"]
    assert plane.snapshot().version == v + 1
    assert [e["result"] for e in plane.audit_log()[-2:]].count("conflict") == 1


def test_a_writer_that_holds_the_lock_too_long(running: tuple[ControlPlane, Path]) -> None:
    """A hung writer: the change fails as an I/O error after lock_timeout_s, nothing leaks, and once
    the lock is free changes work again."""
    import fcntl

    plane, _ = running
    impatient = ControlPlane(plane.state_dir, lock_timeout_s=0.2)
    before = published_bytes(plane)
    fds_before = len(os.listdir("/proc/self/fd"))
    holder = os.open(plane.state_dir.lock_file, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(ControlIOError) as ei:
            impatient.apply_overrides({"min_seq_len": 4096}, actor="impatient")
        assert "held the lock" in str(ei.value)
        assert published_bytes(plane) == before
    finally:
        os.close(holder)
    # The abandoned waiter takes the lock, then lets it go (closes its descriptor).
    wait_until(lambda: len(os.listdir("/proc/self/fd")) == fds_before, what="the waiter's descriptor closed")
    assert impatient.apply_overrides({"min_seq_len": 4096}, actor="impatient").changed
    assert [e["result"] for e in plane.audit_log()[-2:]] == ["io_error", "success"]
