"""A rank report is confirmed live only by the rank's own process: what a writer of the state
directory cannot do beyond the forged reports of tests/unit/test_liveness_attacks.py.

* a forged rank report claiming an ``applied_version`` does not make `repair` record a version that
  never was in force as 'success', nor (with no confirmed rank) exhaust version numbers;
* a forgery renamed over a confirmed rank's own file is not trusted because its name matches (with
  a rank alone in its engine it would pin the change), and a bad file for one look does not erase
  the rank's history;
* the owner that liveness checks is the owner of the bytes read, not of an earlier stat of the
  path: a file renamed in between would lend the genuine file's owner to the forgery;
* a report naming a pid that died and was reused by another process is not live;
* a writer of another uid naming its own live process is not confirmed like a rank;
* /readyz counts only what the process table vouches for, and still counts ranks it cannot confirm.

The start time of a process is read here from /proc/<pid>/stat independently of flyserve."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _rank_liveness
import pytest
from _rank_liveness import CLOCK, LEAD_S, STEP_MARGIN, forged_report

from flyserve.control import ControlPlane
from flyserve.control.reports import HOST, PIDNS, Liveness, liveness, parse_report

OTHER_UID = 54321  # a uid nobody here runs as: "another user who can write in ranks/"
# The frozen clock, the plane on it and a live non-rank process (shared with
# test_liveness_attacks.py): bound here so that pytest finds them.
frozen_clock = _rank_liveness.frozen_clock
plane = _rank_liveness.plane
other_process = _rank_liveness.other_process

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def start_ticks(pid: int) -> int:
    """/proc/<pid>/stat field 22 (the process's start, clock ticks since boot)."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    return int(raw[raw.rfind(b")") + 1 :].split()[19])


def real_report(rank: int, *, step: int = 2000, rate: float = 20.0, **over: Any) -> dict[str, Any]:
    """As a rank of this process writes it (RankControl.report_dict): with its /proc start time."""
    d = {"pid": os.getpid(), "host": HOST, "pidns": PIDNS, "proc_start": start_ticks(os.getpid()),
         "rank": rank, "engine": 0, "started": CLOCK.now - 100.0, "step": step, "steps_per_s": rate,
         "applied_version": 0, "time": CLOCK.now}  # fmt: skip
    d.update(over)
    return d


def bound_steps(step: int, rate: float) -> int:
    """control/effective.py's bound for an honest rank at ``step`` stepping at ``rate``."""
    return step + math.ceil(rate * 2.0) + 64 + max(STEP_MARGIN, math.ceil(2 * rate * LEAD_S))


def rename_over(path: Path, d: dict[str, Any], *, uid: int | None = None) -> None:
    """Write ``d`` beside ``path`` and os.replace it over ``path`` (owned by ``uid`` if given)."""
    tmp = path.with_name(".forged.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(d))
    if uid is not None:
        os.chown(tmp, uid, uid)
    os.replace(tmp, path)


@pytest.fixture
def foreign_process() -> Iterator[int]:
    """A live process of OTHER_UID: what a writer of another uid can name as its "rank"."""
    p = subprocess.Popen(["/bin/sleep", "120"], user=OTHER_UID, group=OTHER_UID, cwd="/")
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait(timeout=10)


# ---------------------------------------------------------------- repair and applied versions


def _unfinished_publish(plane: ControlPlane, version: int) -> None:
    """A write-ahead line of ``version`` with no completion: its writer was killed after the line,
    before current.json (so it never was in force); nothing later names it."""
    cur = plane.store.read_current()
    plane.store.audit({"id": "doomed", "time": CLOCK.now, "actor": "a", "source": "api", "action": "set",
                       "result": "publishing", "version": version,
                       "version_before": cur.version if cur else 0})  # fmt: skip


def test_repair_does_not_take_a_forged_applied_version_as_in_force(plane: ControlPlane) -> None:
    """No rank is running (the ranks stopped; `thresholds repair` from the CLI): a report "from
    another host" claiming version 2 applied. Was: 'success' - a version no rank ever saw recorded
    as in force."""
    from flyserve.control.repair import repair

    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    _unfinished_publish(plane, 2)
    plane.store.write_rank_report(forged_report(2, applied_version=2), rank=2)
    repair(plane)
    done = [(e["version"], e["result"]) for e in plane.store.read_audit(raw=True) if e.get("recovered")]
    assert done == [(2, "abandoned")]


def test_repair_still_takes_a_confirmed_ranks_applied_version(plane: ControlPlane) -> None:
    """The other half: a confirmed rank running version 2 is the record that it was in force."""
    from flyserve.control.repair import repair

    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    _unfinished_publish(plane, 2)
    plane.store.write_rank_report(real_report(0, applied_version=2), rank=0)
    repair(plane)
    done = [(e["version"], e["result"]) for e in plane.store.read_audit(raw=True) if e.get("recovered")]
    assert done == [(2, "success")]


def test_a_forged_applied_version_with_no_confirmed_rank_does_not_exhaust_versions(
    plane: ControlPlane,
) -> None:
    """Ranks in another pid namespace (none confirmed) and a forgery claiming 10**18 - 1 applied.
    Was: the next version 10**18, 'version numbers exhausted': every change refused."""
    plane.store.write_rank_report(real_report(0, host="elsewhere-but-real", applied_version=3), rank=0)
    plane.store.write_rank_report(forged_report(2, applied_version=10**18 - 1), rank=2)
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s.version == 4  # above the real rank's version 3, not the forged one


# ---------------------------------------------------------------- one key, one live process


def test_a_forgery_renamed_over_a_lone_confirmed_ranks_file_does_not_pin(plane: ControlPlane) -> None:
    """A single-rank engine (TP 1); its file replaced (os.replace) by the "another host" forgery
    between the rank's writes. Was: the forgery was the engine's only report - effective step near 1e11."""
    plane.store.write_rank_report(real_report(0), rank=0)
    assert plane.store.live_ranks(now=CLOCK.now) == 1  # the reader has seen the confirmed rank
    rename_over(plane.state_dir.ranks_dir / "0.json", forged_report(0))
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert 2000 < s.effective_step <= bound_steps(2000, 20.0), s.effective_step
    assert plane.store.live_ranks(now=CLOCK.now) == 1  # the rank stays live (its last own report)


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_another_live_pid_under_a_confirmed_ranks_name_is_refused(
    plane: ControlPlane, other_process: int
) -> None:
    """Both ranks' files replaced by reports naming another live process of this user, with its
    true start time (confirmed by the process table), step 1e9: while the ranks' own processes
    live, their keys are theirs. Was: both keys taken, the anchor lifted with them."""
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r), rank=r)
    plane.store.reports(now=CLOCK.now)
    forged = {"pid": other_process, "proc_start": start_ticks(other_process), "step": 10**9,
              "started": CLOCK.now - 200_000, "steps_per_s": 10_000.0}  # fmt: skip
    for r in (0, 1):
        rename_over(plane.state_dir.ranks_dir / f"{r}.json", real_report(r, **forged))
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert 2000 < s.effective_step <= bound_steps(2000, 20.0), s.effective_step


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_a_restarted_rank_takes_its_key_once_the_old_process_is_gone(plane: ControlPlane) -> None:
    """The rule does not lock out a real restart: the old process exited, the new one reports."""
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    old_start = start_ticks(old.pid)
    plane.store.write_rank_report(real_report(0, pid=old.pid, proc_start=old_start, step=9000), rank=0)
    assert [r.step for r in plane.store.reports(now=CLOCK.now)] == [9000]
    old.kill()
    old.wait(timeout=10)
    plane.store.write_rank_report(real_report(0, step=5, started=CLOCK.now - 1), rank=0)
    assert [(r.pid, r.step) for r in plane.store.reports(now=CLOCK.now)] == [(os.getpid(), 5)]


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
@needs_root
def test_a_writer_of_another_uid_naming_its_own_process_is_not_confirmed(
    plane: ControlPlane, foreign_process: int
) -> None:
    """Another user who can write in ranks/ names its own live process (file and process both
    its uid, so the file-owner check agreed). Was: confirmed like a rank."""
    d = real_report(5, pid=foreign_process, proc_start=start_ticks(foreign_process))
    rename_over(plane.state_dir.ranks_dir / "5.json", d, uid=OTHER_UID)
    (r,) = plane.store.reports(now=CLOCK.now)
    assert r.file_uid == OTHER_UID
    assert liveness(r, now=CLOCK.now, stale_after_s=30) is Liveness.UNCONFIRMED


# ---------------------------------------------------------------- the owner of the bytes read


@needs_root
def test_the_owner_checked_is_the_one_of_the_file_read(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 5's genuine file is listed (owned by the ranks' uid); between that and the open, a
    forgery owned by another uid is renamed over it, naming a live process of the ranks' uid. Was:
    the listing's owner (the ranks') checked against the forgery's pid - confirmed."""
    from flyserve.control import state_files

    path = plane.state_dir.ranks_dir / "5.json"
    plane.store.write_rank_report(real_report(5), rank=5)
    real_open = state_files._open_regular

    def swapped(p: Path) -> Any:
        if p == path:
            rename_over(path, real_report(5, step=10**6), uid=OTHER_UID)
        return real_open(p)

    monkeypatch.setattr(state_files, "_open_regular", swapped)
    (r,) = plane.store.reports(now=CLOCK.now)
    assert r.step == 10**6 and r.file_uid == OTHER_UID
    assert liveness(r, now=CLOCK.now, stale_after_s=30) is not Liveness.CONFIRMED


# ---------------------------------------------------------------- pid reuse


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_a_reused_pid_is_not_the_rank(plane: ControlPlane, other_process: int) -> None:
    """A rank's report names a pid that now belongs to another process (started later than the
    rank recorded). Was: live and confirmed - a dead rank counted, its step planned from."""
    d = real_report(0, pid=other_process, proc_start=start_ticks(other_process) - 1)
    plane.store.write_rank_report(d, rank=0)
    (r,) = plane.store.reports(now=CLOCK.now)
    assert liveness(r, now=CLOCK.now, stale_after_s=30) is Liveness.GONE
    assert plane.store.live_ranks(now=CLOCK.now) == 0


def test_a_report_without_its_start_time_is_not_confirmed(plane: ControlPlane) -> None:
    """A report from an older flyserve (no proc_start): still read, live, but unconfirmed (its pid
    cannot be told from a reused one). Was: confirmed."""
    d = real_report(0)
    del d["proc_start"]
    plane.store.write_rank_report(d, rank=0)
    (r,) = plane.store.reports(now=CLOCK.now)
    assert liveness(r, now=CLOCK.now, stale_after_s=30) is Liveness.UNCONFIRMED
    assert plane.store.live_ranks(now=CLOCK.now) == 1


def test_a_rank_records_its_own_start_time(tmp_path: Path) -> None:
    from flyserve.control import RankControl

    rc = RankControl(tmp_path / "state", rank=0, report=False)
    d = rc.report_dict()
    assert d["pid"] == os.getpid() and d["proc_start"] == start_ticks(os.getpid())
    r = parse_report(d, now=time.time(), file_uid=os.getuid())
    assert r is not None and liveness(r, now=time.time(), stale_after_s=30) is Liveness.CONFIRMED


@pytest.mark.parametrize(
    "field,value",
    [
        ("proc_start", -1),
        ("proc_start", 1 << 70),
        ("proc_start", 1.5),
        ("proc_start", "12"),
        ("proc_start", True),
    ],
)
def test_an_implausible_start_time_refuses_the_report(field: str, value: Any) -> None:
    assert parse_report(real_report(0, **{field: value}), now=CLOCK.now) is None


# ---------------------------------------------------------------- ranks/ is sticky


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_ranks_dir_is_sticky_so_another_uid_cannot_replace_a_ranks_file() -> None:
    """ranks/ writable by another uid (a shared volume): that uid could os.replace its forgery
    over a rank's own file. A rank now gives ranks/ the sticky bit: only a file's owner may rename
    over it."""
    import shutil
    import stat
    import tempfile

    from flyserve.control.store import Store

    top = Path(tempfile.mkdtemp(prefix="flyserve-sticky-", dir="/tmp"))
    try:
        top.chmod(0o755)
        store = Store(top / "state")
        store.write_rank_report(real_report(0), rank=0)
        ranks = store.dir.ranks_dir
        (top / "state").chmod(0o755)
        ranks.chmod(stat.S_IMODE(ranks.stat().st_mode) | 0o777)  # the shared volume's mode
        assert ranks.stat().st_mode & stat.S_ISVTX
        if os.geteuid() != 0:
            return  # the bit is what the kernel enforces; showing it needs a second uid
        forger = subprocess.run(
            ["/bin/sh", "-c", "echo '{}' > .f.json && mv -f .f.json 0.json"],
            cwd=ranks, user=OTHER_UID, group=OTHER_UID, capture_output=True, timeout=30, check=False,
        )  # fmt: skip
        assert forger.returncode != 0, forger
        assert json.loads((ranks / "0.json").read_text())["step"] == 2000
    finally:
        shutil.rmtree(top)


# ---------------------------------------------------------------- /readyz does not count what a file says


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Any]:
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    settings = SidecarSettings(
        state_dir=tmp_path / "state", token=SecretStr("t0ken-for-tests-0123456789"),
        share_control_metrics=False, stats_ttl_s=0.0, metrics_ttl_s=0.0,
    )  # fmt: skip
    with TestClient(create_app(settings)) as c:
        yield c


def _write(state: Path, rank: int, d: dict[str, Any]) -> None:
    (state / "ranks").mkdir(parents=True, exist_ok=True)
    (state / "ranks" / f"{rank}.json").write_text(json.dumps(d))


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_readyz_forged_reports_do_not_stand_in_for_ranks_that_are_gone(
    sidecar: Any, tmp_path: Path, other_process: int
) -> None:
    """The real rank (confirmed) stops; three forgeries "from another host" stay fresh. Was: /readyz
    200 with 3 live ranks - serving looked ready with no rank at all."""
    state = tmp_path / "state"
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        _write(state, 0, real_report(0, pid=rank.pid, proc_start=start_ticks(rank.pid), time=time.time()))
        assert sidecar.get("/readyz").json()["live_ranks"] == 1
    finally:
        rank.kill()
        rank.wait(timeout=10)
    for r in (2, 3, 4):
        _write(state, r, forged_report(r, time=time.time()))
    got = sidecar.get("/readyz")
    assert got.status_code == 503 and got.json()["live_ranks"] == 0, got.text
    assert "3 unconfirmed" in got.json()["detail"]


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_readyz_a_reused_pid_is_not_a_live_rank(sidecar: Any, tmp_path: Path, other_process: int) -> None:
    """A fresh report whose pid now belongs to another process (the rank died, the pid was
    reused). Was: /readyz 200 for up to the 30 s staleness window, and the rank gauge 1."""
    d = real_report(0, pid=other_process, proc_start=start_ticks(other_process) - 1, time=time.time())
    _write(tmp_path / "state", 0, d)
    got = sidecar.get("/readyz")
    assert got.status_code == 503 and got.json()["live_ranks"] == 0, got.text


def test_readyz_still_counts_ranks_it_cannot_confirm(sidecar: Any, tmp_path: Path) -> None:
    """The other half: ranks in another pid namespace (never confirmed here) are live ranks."""
    _write(tmp_path / "state", 0, real_report(0, host="another-container", time=time.time()))
    got = sidecar.get("/readyz")
    assert got.status_code == 200 and got.json()["live_ranks"] == 1, got.text


def test_a_bad_file_for_one_look_does_not_erase_the_ranks_history(plane: ControlPlane) -> None:
    """The forger first renames garbage over the lone rank's file (a look drops the key), then its
    forgery. Was: the rank missing from /readyz at that look, then the key's history gone and the
    forgery taken as a new process - step near 1e11."""
    path = plane.state_dir.ranks_dir / "0.json"
    plane.store.write_rank_report(real_report(0), rank=0)
    assert plane.store.live_ranks(now=CLOCK.now) == 1
    path.write_text("{torn")
    assert plane.store.live_ranks(now=CLOCK.now) == 1  # its live process's last report stands in
    path.unlink()
    assert plane.store.live_ranks(now=CLOCK.now) == 1
    rename_over(path, forged_report(0))
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert 2000 < s.effective_step <= bound_steps(2000, 20.0), s.effective_step


@pytest.mark.slow  # subprocesses (live, dead and reused pids)
def test_an_exited_unreaped_rank_does_not_hold_its_key(plane: ControlPlane) -> None:
    """The old rank process exited but its parent has not reaped it (a zombie: kill 0 and /proc
    still answer). Its successor under the same name must not be refused as a forgery."""
    old = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    d = real_report(0, pid=old.pid, proc_start=start_ticks(old.pid), step=9000)
    plane.store.write_rank_report(d, rank=0)
    (seen,) = plane.store.reports(now=CLOCK.now)
    assert seen.step == 9000 and liveness(seen, now=CLOCK.now, stale_after_s=30) is Liveness.CONFIRMED
    assert old.stdin is not None
    old.stdin.close()  # it exits; not waited for, so not reaped
    deadline = time.monotonic() + 30
    while Path(f"/proc/{old.pid}/stat").read_bytes().split(b")")[-1].split()[0] != b"Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)
    try:
        plane.store.write_rank_report(real_report(0, step=5, started=CLOCK.now - 1), rank=0)
        assert [(r.pid, r.step) for r in plane.store.reports(now=CLOCK.now)] == [(os.getpid(), 5)]
    finally:
        old.wait(timeout=10)
