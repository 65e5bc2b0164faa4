"""flyserve.files: the one atomic write and the one pid check every package uses."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from flyserve.files.atomic import atomic_write
from flyserve.files.processes import PidState, pid_alive, pid_state


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "f.json"
    atomic_write(target, "old")
    atomic_write(target, b"new", mode=0o600, durable=False)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.json"]


def test_write_once_refuses_an_existing_file_and_cleans_up(tmp_path):
    target = tmp_path / "h.json"
    atomic_write(target, "first", overwrite=False)
    with pytest.raises(FileExistsError):
        atomic_write(target, "second", overwrite=False)
    assert target.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["h.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "c.json"
    atomic_write(target, "old")

    def boom(*_a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["c.json"]


@pytest.mark.slow
def test_pid_state_tells_a_live_pid_from_a_gone_one():
    assert pid_state(os.getpid()) is PidState.ALIVE and pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert pid_state(child.pid) is PidState.GONE and not pid_alive(child.pid)


def test_a_pid_that_names_a_process_group_is_never_signalled():
    # kill(0, 0) and kill(-1, 0) would ask about process groups: unknown, and kept as maybe alive
    for pid in (0, -1, -4242):
        assert pid_state(pid) is PidState.UNKNOWN and pid_alive(pid)
    assert pid_state(2**70) is PidState.UNKNOWN
