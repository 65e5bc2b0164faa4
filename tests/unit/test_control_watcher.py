"""Watcher: file edits, Kubernetes ConfigMap symlink swaps, the poll backstop, SIGHUP, bad content once."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flyserve.control import ControlPlane, Watcher
from flyserve.control._metrics import reload_count

pytestmark = pytest.mark.slow  # 19 s on the 2-core VM: waits on file events and the poll backstop


def wait_for(cond: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll ``cond``; the deadline is generous (a loaded 2-core machine) and costs time only on failure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class ConfigMap:
    """flyserve.yaml -> ..data/flyserve.yaml, ..data -> ..<ts>: a Kubernetes ConfigMap volume's layout."""

    def __init__(self, root: Path, text: str) -> None:
        self.root, self.n = root, 0
        root.mkdir()
        self.cur = self._new(text)
        (root / "..data").symlink_to(self.cur.name)
        (root / "flyserve.yaml").symlink_to("..data/flyserve.yaml")
        self.file = root / "flyserve.yaml"

    def _new(self, text: str) -> Path:
        self.n += 1
        d = self.root / f"..2026_11_29_23_59_{self.n:02d}.123"
        d.mkdir()
        (d / "flyserve.yaml").write_text(text)
        return d

    def swap(self, text: str) -> None:
        new = self._new(text)
        (self.root / "..data_tmp").symlink_to(new.name)
        os.rename(self.root / "..data_tmp", self.root / "..data")
        (self.cur / "flyserve.yaml").unlink()
        self.cur.rmdir()
        self.cur = new


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "state")


@pytest.fixture
def stopper() -> Iterator[list[Watcher]]:
    started: list[Watcher] = []
    yield started
    for w in started:
        w.stop()


def min_seq_len(plane: ControlPlane) -> int:
    return plane.snapshot().thresholds.min_seq_len


def test_configmap_swaps_are_caught_every_time(tmp_path: Path, plane: ControlPlane, stopper: list) -> None:
    cm = ConfigMap(tmp_path / "cm", "min_seq_len: 2000\n")
    plane.config_file = str(cm.file)
    # A long poll interval: only directory events can explain a quick pickup.
    w = Watcher(plane, poll_interval_s=30, debounce_ms=20, actor="w").start()
    stopper.append(w)
    assert min_seq_len(plane) == 2000  # start() reads the file as it is
    for value in (3000, 4000, 5000):
        cm.swap(f"min_seq_len: {value}\n")
        assert wait_for(lambda v=value: min_seq_len(plane) == v, 10), f"swap to {value} missed"
    # An in-place edit inside the ..<ts> directory (no event in the watched directory itself).
    (cm.cur / "flyserve.yaml").write_text("min_seq_len: 6000\n")
    assert wait_for(lambda: min_seq_len(plane) == 6000, 10)
    assert [s.source for s in plane.history()] == ["file"] * 5


def test_the_poll_backstop_without_events(tmp_path: Path, plane: ControlPlane, stopper: list) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 2000\n")
    w = Watcher(plane, cfg, poll_interval_s=0.1, use_watchfiles=False).start()
    stopper.append(w)
    cfg.write_text("min_seq_len: 2500\n")
    assert wait_for(lambda: min_seq_len(plane) == 2500, 10)


def test_bad_content_is_reported_once_then_a_fix_is_taken(
    tmp_path: Path, plane: ControlPlane, stopper: list
) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 2000\n")
    w = Watcher(plane, cfg, poll_interval_s=0.05, use_watchfiles=False).start()
    stopper.append(w)
    n = reload_count("invalid", "file")
    cfg.write_text("min_seq_len: [\n")
    assert wait_for(lambda: reload_count("invalid", "file") == n + 1)
    checks = w.checks
    assert wait_for(lambda: w.checks > checks + 5)  # it keeps looking ...
    assert reload_count("invalid", "file") == n + 1  # ... but reports the same bad content once
    assert min_seq_len(plane) == 2000 and w.last_error is not None
    cfg.unlink()  # gone: reported once as an I/O error
    m = reload_count("io_error", "file")
    assert wait_for(lambda: reload_count("io_error", "file") == m + 1)
    checks = w.checks
    assert wait_for(lambda: w.checks > checks + 5)
    assert reload_count("io_error", "file") == m + 1 and min_seq_len(plane) == 2000
    cfg.write_text("min_seq_len: 2100\n")
    assert wait_for(lambda: min_seq_len(plane) == 2100)
    # The completion line follows the publish (a write-ahead 'publishing' line precedes it).
    expected = ["success", "invalid", "io_error", "success"]
    assert wait_for(lambda: [e["result"] for e in plane.audit_log()] == expected)


@pytest.mark.parametrize("use_watchfiles", [False, True], ids=["polling", "watchfiles"])
def test_sighup_forces_a_reload(
    tmp_path: Path, plane: ControlPlane, stopper: list, use_watchfiles: bool
) -> None:
    cfg = tmp_path / "cfg" / "flyserve.yaml"
    cfg.parent.mkdir()
    cfg.write_text("min_seq_len: 2000\n")
    w = Watcher(plane, cfg, poll_interval_s=30, use_watchfiles=use_watchfiles)
    reloads_done: list[bool] = []
    reload = w._reload

    def counted_reload(sha):  # the watcher thread's reload, observed: the end of each one is an event
        try:
            return reload(sha)
        finally:
            reloads_done.append(True)

    w._reload = counted_reload
    previous = signal.getsignal(signal.SIGHUP)
    w.install_sighup()
    try:
        w.check()  # the start-up load, here and now: the watcher thread then starts from a settled state
        base = len(reloads_done)
        w.start()
        stopper.append(w)
        n = len(plane.audit_log())
        os.kill(os.getpid(), signal.SIGHUP)
        assert wait_for(lambda: len(reloads_done) == base + 1)  # SIGHUP's reload finished, hash recorded
        assert len(plane.audit_log()) == n + 1
        assert plane.audit_log()[-1]["result"] == "unchanged"  # same content: no new version
        # Written behind the watcher's back (the new content's hash is made to look handled), so
        # neither an event nor the 30 s poll would reload it: only SIGHUP does.
        w._handled = hashlib.sha256(b"min_seq_len: 2200\n").hexdigest()
        cfg.write_text("min_seq_len: 2200\n")
        assert w.check() is False  # what an event or the poll does: a plain look, no reload
        assert min_seq_len(plane) == 2000 and len(reloads_done) == base + 1
        os.kill(os.getpid(), signal.SIGHUP)
        assert wait_for(lambda: min_seq_len(plane) == 2200)
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL if previous is None else previous)


def test_two_watchers_of_one_file_publish_once(tmp_path: Path, stopper: list) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 2000\n")
    a = ControlPlane(tmp_path / "state", config_file=cfg)
    b = ControlPlane(tmp_path / "state", config_file=cfg)
    stopper.append(Watcher(a, poll_interval_s=0.05, debounce_ms=10, actor="sidecar").start())
    stopper.append(Watcher(b, poll_interval_s=0.05, debounce_ms=10, actor="rank0").start())
    cfg.write_text("min_seq_len: 2300\n")
    new = hashlib.sha256(b"min_seq_len: 2300\n").hexdigest()
    assert wait_for(lambda: min_seq_len(a) == 2300)
    watchers = stopper[-2:]
    assert wait_for(lambda: all(w._handled == new for w in watchers))  # both have dealt with the edit
    assert [s.thresholds.min_seq_len for s in a.history()] == [2000, 2300]


def test_a_comment_only_edit_is_one_no_op_not_a_reload_loop(
    tmp_path: Path, plane: ControlPlane, stopper: list
) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 2000\n")
    w = Watcher(plane, cfg, poll_interval_s=0.05, use_watchfiles=False).start()
    stopper.append(w)
    cfg.write_text("# tuned for the new model\nmin_seq_len: 2000\n")
    assert wait_for(lambda: len(plane.audit_log()) == 2)
    checks = w.checks
    assert wait_for(lambda: w.checks > checks + 5)
    assert [e["result"] for e in plane.audit_log()] == ["success", "unchanged"]
    assert plane.snapshot().version == 1


def test_an_edit_made_while_the_state_dir_cannot_be_written_is_published_once_it_can(
    tmp_path: Path, plane: ControlPlane, stopper: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config edit made while the state directory is read-only or full is published once it
    recovers, without a SIGHUP. ENOSPC is injected at the publish step
    (tests/integration/test_control_attacks_live.py fills a real tmpfs for the CLI)."""
    import errno

    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 2000\n")
    plane.config_file = str(cfg)
    plane.reload(actor="startup")
    real_publish = plane.store.publish
    failures: list[int] = []

    def full_disk(snap):
        if len(failures) < 3:
            failures.append(snap.version)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_publish(snap)

    monkeypatch.setattr(plane.store, "publish", lambda snap: _io(full_disk, snap))
    w = Watcher(plane, cfg, poll_interval_s=0.05, use_watchfiles=False).start()
    stopper.append(w)
    cfg.write_text("min_seq_len: 2100\n")
    assert wait_for(lambda: min_seq_len(plane) == 2100, timeout_s=30)
    assert len(failures) == 3


def _io(fn, snap):
    from flyserve.control import ControlIOError

    try:
        return fn(snap)
    except OSError as exc:
        raise ControlIOError(f"cannot publish version {snap.version}: {exc.strerror}") from exc


def test_a_file_written_in_two_parts_publishes_only_the_whole(
    tmp_path: Path, plane: ControlPlane, stopper: list
) -> None:
    """`min_seq_len: 20`, then 0.2 s later `48\\n`: without settling, a version with 20 was
    published before the one with 2048 (5 of 5 trials)."""
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 1600\n")
    plane.config_file = str(cfg)
    plane.reload(actor="startup")
    w = Watcher(plane, cfg, poll_interval_s=0.05).start()
    stopper.append(w)
    with open(cfg, "w") as f:
        f.write("min_seq_len: 20")
        f.flush()
        time.sleep(0.2)
        f.write("48\n")
    assert wait_for(lambda: min_seq_len(plane) == 2048, timeout_s=30)
    seen = [s.thresholds.min_seq_len for s in plane.history()]
    assert 20 not in seen, seen
