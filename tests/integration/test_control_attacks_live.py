"""The control plane with real processes: the same step on every rank for a change made in the
ranks' first second under CPU load, a full disk under `thresholds set`, a writer killed with
SIGKILL or sent SIGTERM in the middle of publishing, and a forged rank report. Waits poll for
events with generous deadlines; the same-step property is asserted on the applied step numbers,
never on timing."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _live_sidecar import wait_for

from flyserve.control import ControlPlane, Store

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("_control_rank_worker.py")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flyserve.cli", "thresholds", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@contextlib.contextmanager
def cpu_load() -> Iterator[None]:
    """One busy process for the duration (the machine has few cores: one is plenty of load)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait(timeout=10)


# ---------------------------------------------------------------- same step in the first second


@contextlib.contextmanager
def rank_workers(tmp_path: Path, ranks: int, *, interval: str, step_sleep: str) -> Iterator[None]:
    """``ranks`` processes of _control_rank_worker.py on tmp_path/state, each reporting every
    ``interval`` s and writing what it applied to tmp_path/rank<r>.json; at the end the stop file
    is written and each is waited for (killed after 60 s)."""
    stop = tmp_path / "stop"
    procs = []
    for r in range(ranks):
        args = [
            "--state-dir",
            str(tmp_path / "state"),
            "--rank",
            str(r),
            "--out",
            str(tmp_path / f"rank{r}.json"),
        ]
        args += ["--stop-file", str(stop), "--interval", interval, "--step-sleep", step_sleep]
        args += ["--max-steps", "200000", "--max-seconds", "150"]
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args]))
    try:
        yield
    finally:
        stop.write_text("")
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def one_trial(tmp_path: Path, ranks: int = 2) -> list[tuple[int, int, int]]:
    """Start ranks (default 1 s report interval), publish a change the moment every rank has written
    its first report, and return each rank's (version, effective_step, applied_step) for it."""
    state = tmp_path / "state"
    ControlPlane(state).reload(actor="startup", startup=True)
    store = Store(state)
    with rank_workers(tmp_path, ranks, interval="1.0", step_sleep="0.002"):
        wait_for(
            lambda: len(store.rank_reports()) == ranks,
            what="every rank's first report",
            timeout=60,
            every=0.02,
        )
        snap = ControlPlane(state).apply_overrides({"min_seq_len": 4096}, actor="early").snapshot
        assert snap.version == 2
        wait_for(
            lambda: all(d.get("applied_version") == 2 for d in store.rank_reports()),
            what="every rank to apply version 2",
            timeout=150,
            every=0.02,
        )
    out = []
    for r in range(ranks):
        applied = json.loads((tmp_path / f"rank{r}.json").read_text())["applied"]
        out.append(next(tuple(a) for a in applied if a[0] == 2))
    return out


def test_a_change_in_the_ranks_first_second_applies_at_one_step_under_cpu_load(tmp_path: Path) -> None:
    """With the ranks' first reports saying step 0 and rate 0 and the 8-step floor as the margin,
    ranks applied late (10 of 50 trials) and at different steps (7 of 50)."""
    with cpu_load():
        for trial in range(3):
            got = one_trial(tmp_path / f"t{trial}")
            steps = {applied for _, _, applied in got}
            assert len(steps) == 1, f"trial {trial}: ranks applied at different steps {got}"
            assert all(applied == eff for _, eff, applied in got), f"trial {trial}: applied late {got}"


# ---------------------------------------------------------------- a full disk


def _mount_small_tmpfs(where: Path) -> bool:
    where.mkdir()
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, check=False
        )
    except OSError:
        return False
    return r.returncode == 0


def test_thresholds_set_on_a_full_disk_is_a_clean_error_then_works_when_space_returns(
    tmp_path: Path,
) -> None:
    """A real 2 MiB tmpfs, filled. `thresholds set` used to die with "Bus error" (rc 135): the
    metrics files are mmapped, and a full tmpfs answers a page fault with SIGBUS. Where this test
    may not mount a filesystem (not root), ENOSPC is injected at every write instead."""
    mnt = tmp_path / "mnt"
    mounted = _mount_small_tmpfs(mnt)
    try:
        sd = mnt / "state"
        assert (
            cli("set", "min_seq_len=2048", "--state-dir", str(sd), "--actor", "a", "--create").returncode == 0
        )
        filler = mnt / "filler"
        if mounted:
            with open(filler, "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            res = cli("set", "min_seq_len=4096", "--state-dir", str(sd), "--actor", "a")
        else:
            inject = (
                "import errno, os, sys; real = os.write\n"
                "def full(fd, b):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
                "os.write = full\nimport flyserve.cli as c; sys.argv = ['flyserve'] + sys.argv[1:]; c.main()"
            )
            res = subprocess.run(
                [sys.executable, "-c", inject, "thresholds", "set", "min_seq_len=4096", "--state-dir", str(sd)],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
        assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
        assert "No space left on device" in res.stderr and "Traceback" not in res.stderr
        assert ControlPlane(sd).snapshot().thresholds.min_seq_len == 2048  # nothing half-applied
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
        ok = cli("set", "min_seq_len=4096", "--state-dir", str(sd), "--actor", "a")
        assert ok.returncode == 0, ok.stderr[-2000:]
        snap = ControlPlane(sd).snapshot()
        assert snap.thresholds.min_seq_len == 4096 and snap.version == 2
        if mounted:  # the same for a read-only state directory
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            ro = cli("set", "min_seq_len=5000", "--state-dir", str(sd), "--actor", "a")
            assert ro.returncode == 2 and "Read-only file system" in ro.stderr, ro.stderr[-2000:]
            assert "Traceback" not in ro.stderr
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
            assert cli("set", "min_seq_len=5000", "--state-dir", str(sd)).returncode == 0
            assert ControlPlane(sd).snapshot().version == 3
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------- a writer killed mid-publish

_KILLER = """
import os, signal, sys
import flyserve.control.snapshot_files as snapshot_files
target, n = sys.argv[1], int(sys.argv[2])
real = snapshot_files.atomic_write
seen = []
def write(path, data, **kw):
    real(path, data, **kw)
    if path.name == target or (target == "history" and path.parent.name == "history"):
        seen.append(path)
        if len(seen) >= n:
            os.kill(os.getpid(), signal.SIGKILL)
snapshot_files.atomic_write = write
from flyserve.control import ControlPlane
p = ControlPlane(sys.argv[3])
for i in range(100):
    p.apply_overrides({"min_seq_len": 2000 + i}, actor="doomed")
"""


@pytest.mark.parametrize("target", ["history", "current.json"], ids=["after-history", "after-current"])
def test_a_writer_killed_mid_publish_leaves_every_version_audited_and_no_orphans(
    tmp_path: Path, target: str
) -> None:
    sd = tmp_path / "state"
    for kill_at in (1, 3):
        r = subprocess.run(
            [sys.executable, "-c", _KILLER, target, str(kill_at), str(sd)],
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == -9
        (sd / "control" / ".current.json.zz.tmp").write_text("left by a killed writer")
        rep = cli("repair", "--state-dir", str(sd))
        assert rep.returncode == 0, rep.stderr[-2000:]
    plane = ControlPlane(sd)
    cur = plane.snapshot()
    history = plane.store.history_versions()
    assert history and max(history) == cur.version  # no orphan above current
    audited = {e["version"] for e in plane.audit_log() if e.get("result") == "success"}
    assert set(history) <= audited, (history, sorted(audited))
    assert not list((sd / "control").glob(".*.tmp")) and not list((sd / "control" / "history").glob(".*.tmp"))
    assert plane.apply_overrides({"min_seq_len": 9999}, actor="a").snapshot.version == cur.version + 1


# ---------------------------------------------------------------- a forged rank report


def test_a_forged_rank_report_does_not_pin_changes_for_real_ranks(tmp_path: Path) -> None:
    """A ranks/7.json from 'another host' (started 0.0, time 4.9 s ahead, step 1e9) uncapped gave
    a change effective_step 1000000064, which real ranks never applied. The forged report is
    capped by its engine's real ranks, and both apply the change at one step."""
    state = tmp_path / "state"
    plane = ControlPlane(state)
    plane.reload(actor="startup", startup=True)
    store = Store(state)
    with rank_workers(tmp_path, 2, interval="0.5", step_sleep="0.01"):
        wait_for(
            lambda: (
                len(store.rank_reports()) == 2 and all(d.get("steps_per_s") for d in store.rank_reports())
            ),
            what="both ranks to report a measured rate",
            timeout=60,
            every=0.02,
        )
        now = time.time()
        forged = {"pid": 4242, "host": "", "pidns": "", "rank": 7, "engine": 0, "started": 0.0,
                  "step": 10**9, "steps_per_s": None, "applied_version": 1, "time": now + 4.9}  # fmt: skip
        store.write_rank_report(forged, rank=7)
        snap = plane.apply_overrides({"min_seq_len": 4096}, actor="attacked").snapshot
        real = max(d["step"] for d in store.rank_reports() if d["rank"] != 7)
        assert snap.effective_step < real + 5000, (snap.effective_step, real)  # was 1000000064
        wait_for(
            lambda: all(
                d.get("applied_version") == snap.version for d in store.rank_reports() if d["rank"] != 7
            ),
            what="both real ranks to apply the change",
            timeout=150,
            every=0.02,
        )
    got = [
        next(
            tuple(a)
            for a in json.loads((tmp_path / f"rank{r}.json").read_text())["applied"]
            if a[0] == snap.version
        )
        for r in range(2)
    ]
    assert len({applied for _, _, applied in got}) == 1, got  # one step for both ranks


# ---------------------------------------------------------------- SIGTERM mid-publish

_TERMINATED = """
import os, signal, sys
import flyserve.control.snapshot_files as snapshot_files
real = snapshot_files.atomic_write
def write(path, data, **kw):
    real(path, data, **kw)
    if path.parent.name == "history":  # mid-publish: history written, current.json not yet
        os.kill(os.getpid(), signal.SIGTERM)
snapshot_files.atomic_write = write
from flyserve.control import ControlPlane
ControlPlane(sys.argv[1]).apply_overrides({"min_seq_len": 3000}, actor="terminated")
print("returned", flush=True)
"""


def test_sigterm_mid_publish_finishes_the_publish_then_exits(tmp_path: Path) -> None:
    """SIGTERM while `thresholds set` publishes would leave a 'publishing' audit line with no
    completion (and maybe a temp file) until `repair`. The writer finishes the publish and its
    audit line, then dies of the SIGTERM."""
    sd = tmp_path / "state"
    ControlPlane(sd).apply_overrides({"min_seq_len": 2000}, actor="a")
    r = subprocess.run([sys.executable, "-c", _TERMINATED, str(sd)], capture_output=True, text=True,
                       timeout=120, check=False)  # fmt: skip
    assert r.returncode == -15, r.stderr[-2000:]  # it still dies of the signal ...
    assert "returned" not in r.stdout  # ... right after the publish, not at the end of the script
    plane = ControlPlane(sd)
    assert plane.snapshot().version == 2 and plane.store.history_versions() == [1, 2]
    raw = plane.store.read_audit(raw=True)
    assert [e["result"] for e in raw if e.get("version") == 2] == ["publishing", "success"]
    assert not list((sd / "control").glob(".*.tmp")) and not list((sd / "control" / "history").glob(".*.tmp"))
