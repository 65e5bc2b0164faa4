"""The autopilot's lease on a running trial (flyserve.control.trial_lease): a trial whose sidecar
stopped renewing its lease is published again without the trial by the engine's side, at once
and once; a live lease, another change published meanwhile, or no trial leaves everything as is;
a lease file that is not a lease is no lease, never a hang or a crash."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from flyserve.control import ControlPlane, RankControl
from flyserve.control.snapshot import ConfigSnapshot, Trial
from flyserve.control.trial_lease import (
    ACTOR,
    DEFAULT_TTL_S,
    KEEPER_LOCK_TIMEOUT_S,
    KEEPER_RETRY_S,
    Lease,
    LeaseError,
    LeaseKeeper,
    end_expired_trial,
    expiry,
    read_lease,
    write_lease,
)

TRIAL = "ap-0-1"


def _plane_with_trial(tmp_path: Path) -> tuple[ControlPlane, ConfigSnapshot]:
    plane = ControlPlane(tmp_path / "state", step_margin=1, lead_s=0.0)
    cur = plane.snapshot()
    candidate = cur.thresholds.merged({"min_seq_len": cur.thresholds.min_seq_len + 512})
    plane.publish_autopilot(
        cur.thresholds, trial=Trial(TRIAL, 3, 4, 20, candidate), request={"autopilot": "start"}
    )
    snap = plane.store.read_current()
    assert snap is not None and snap.trial is not None
    return plane, snap


def test_a_renewed_lease_keeps_the_trial_and_a_stale_one_ends_it_once(tmp_path: Path) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    t0 = trial_version.time
    write_lease(plane.state_dir, TRIAL, now=t0, ttl_s=5.0)
    assert end_expired_trial(plane, now=t0 + 4.9) is None
    assert plane.store.read_current() == trial_version

    ended = end_expired_trial(plane, now=t0 + 5.1)
    assert ended == trial_version.version + 1
    cur = plane.store.read_current()
    assert cur is not None and cur.version == ended and cur.trial is None
    # the trial's current arm, nothing else moved: same thresholds, layers and circuit
    assert cur.thresholds == trial_version.thresholds and cur.overrides == trial_version.overrides
    assert cur.source == "rollback" and cur.actor == ACTOR
    last = plane.store.read_audit()[-1]
    assert last["actor"] == ACTOR and last["version"] == ended
    assert last["request"]["trial"] == TRIAL and "not renewed for 5 s" in last["request"]["reason"]
    # nothing left to end: a second look publishes nothing
    assert end_expired_trial(plane, now=t0 + 60) is None
    assert plane.store.read_current() == cur


def test_no_lease_counts_from_the_versions_publish_time(tmp_path: Path) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    t0 = trial_version.time
    assert end_expired_trial(plane, now=t0 + DEFAULT_TTL_S - 1) is None
    assert end_expired_trial(plane, now=t0 + DEFAULT_TTL_S + 1) == trial_version.version + 1
    assert "no lease on trial" in plane.store.read_audit()[-1]["request"]["reason"]


def test_a_lease_on_another_trial_is_no_lease(tmp_path: Path) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    t0 = trial_version.time
    write_lease(plane.state_dir, "ap-0-0", now=t0 + DEFAULT_TTL_S + 1)
    assert end_expired_trial(plane, now=t0 + DEFAULT_TTL_S + 1) == trial_version.version + 1
    assert "names another trial" in plane.store.read_audit()[-1]["request"]["reason"]


def test_a_lease_dated_over_an_hour_ahead_of_the_clock_ends_the_trial(tmp_path: Path) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    t0 = trial_version.time
    write_lease(plane.state_dir, TRIAL, now=t0 + 3000, ttl_s=10.0)  # a clock ahead: still a lease
    assert end_expired_trial(plane, now=t0 + 1) is None
    write_lease(plane.state_dir, TRIAL, now=t0 + 3602, ttl_s=10.0)
    assert end_expired_trial(plane, now=t0 + 1) == trial_version.version + 1
    assert "ahead of this clock" in plane.store.read_audit()[-1]["request"]["reason"]


def test_a_version_published_meanwhile_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check reads the version, then publishes If-Match it: an operator's change that lands in
    between is never overwritten (it has ended the trial already)."""
    plane, trial_version = _plane_with_trial(tmp_path)
    real_read = plane.store.read_current

    def read_then_operator_publishes(*args, **kwargs):
        seen = real_read(*args, **kwargs)
        monkeypatch.undo()  # once: the operator's publish reads the store itself
        plane.apply_overrides({"min_qblock_rows": 3}, actor="operator", source="api")
        return seen

    monkeypatch.setattr(plane.store, "read_current", read_then_operator_publishes)
    assert end_expired_trial(plane, now=trial_version.time + 3600) is None
    cur = plane.store.read_current()
    assert cur is not None and cur.actor == "operator" and cur.thresholds.min_qblock_rows == 3


def test_no_trial_in_force_reads_no_lease(tmp_path: Path) -> None:
    plane = ControlPlane(tmp_path / "state", step_margin=1, lead_s=0.0)
    plane.apply_overrides({"min_qblock_rows": 3}, actor="operator", source="api")
    (plane.state_dir.control_dir).mkdir(parents=True, exist_ok=True)
    os.mkfifo(plane.state_dir.trial_lease)  # would hang a reader that opened it
    assert end_expired_trial(plane, now=1e10) is None


@pytest.mark.parametrize(
    "content",
    [
        b'{"trial": "ap-0-1", "renewed": NaN, "ttl_s": 10}',
        b'{"trial": "ap-0-1", "renewed": 1e400, "ttl_s": 10}',
        b'{"trial": "ap-0-1", "renewed": ' + b"9" * 5000 + b', "ttl_s": 10}',
        b'{"trial": "ap-0-1", "renewed": 100, "ttl_s": 0}',
        b'{"trial": "ap-0-1", "renewed": 100, "ttl_s": true}',
        b'{"trial": "../../etc", "renewed": 100, "ttl_s": 10}',
        b'{"trial": "ap-0-1", "renewed": 100, "ttl_s": 10, "extra": 1}',
        b'{"trial": "ap-0-1", "renewed": 1',
        b"[]",
        b"null",
        b"x" * 10_000,
    ],
    ids=["nan", "overflow", "5000-digits", "zero-ttl", "bool-ttl", "bad-id", "extra-key", "half-written",
         "list", "null", "huge"],
)  # fmt: skip
def test_a_lease_file_that_is_not_a_lease_reads_as_none(tmp_path: Path, content: bytes) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    plane.state_dir.trial_lease.write_bytes(content)
    assert read_lease(plane.state_dir) is None
    # no lease: the trial still has its grace from the publish time, then ends
    assert end_expired_trial(plane, now=trial_version.time + 1) is None
    assert end_expired_trial(plane, now=trial_version.time + DEFAULT_TTL_S + 1) == trial_version.version + 1


def test_a_symlink_or_a_fifo_as_the_lease_is_no_lease_and_no_hang(tmp_path: Path) -> None:
    plane, _ = _plane_with_trial(tmp_path)
    os.symlink("/dev/zero", plane.state_dir.trial_lease)
    assert read_lease(plane.state_dir) is None
    os.unlink(plane.state_dir.trial_lease)
    os.mkfifo(plane.state_dir.trial_lease)
    assert read_lease(plane.state_dir) is None


def test_lease_values_are_checked_by_name() -> None:
    with pytest.raises(LeaseError, match="ttl_s"):
        Lease(TRIAL, 1.0, float("inf"))
    with pytest.raises(LeaseError, match="renewed"):
        Lease(TRIAL, -1.0, 10.0)
    with pytest.raises(LeaseError, match="trial"):
        Lease("", 1.0, 10.0)
    lease = Lease(TRIAL, 5.0, 10.0)
    assert json.loads(lease.to_json()) == {"trial": TRIAL, "renewed": 5.0, "ttl_s": 10.0}


def test_expiry_is_pure_and_says_why(tmp_path: Path) -> None:
    _, v = _plane_with_trial(tmp_path)
    assert expiry(v, Lease(TRIAL, v.time, 10.0), now=v.time + 10.0) is None
    assert "not renewed for 11 s" in (expiry(v, Lease(TRIAL, v.time, 10.0), now=v.time + 11.0) or "")
    no_trial = v.replace(trial=None)
    assert expiry(no_trial, None, now=v.time + 1e6) is None


def test_file_polling_rank_0_of_engine_0_keeps_the_lease_and_no_other_rank_does(tmp_path: Path) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    # a lease that ran out long ago: the sidecar is gone
    write_lease(plane.state_dir, TRIAL, now=trial_version.time - 3600, ttl_s=5.0)
    others = [RankControl(plane.state_dir, 1), RankControl(plane.state_dir, 0, engine=1)]
    for rc in others:
        rc.poll()
    assert plane.store.read_current() == trial_version
    rank0 = RankControl(plane.state_dir, 0)
    assert rank0.snapshot.trial is not None
    rank0.poll()
    cur = plane.store.read_current()
    assert cur is not None and cur.version == trial_version.version + 1 and cur.trial is None
    # every rank then applies the trial-less version like any other, at its effective step
    for rc in (rank0, *others):
        rc.poll()
        step = cur.step_for(rc.engine)
        assert rc.current(step).version == cur.version and rc.current(step).trial is None


def test_the_second_of_two_keepers_publishes_nothing_and_audits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keepers (two API servers' pushers) that saw the same expired lease: the first ends the
    trial; the second, whose look predates that, finds it replaced under the writers' lock and
    leaves no refused-change line in the audit (nothing happened)."""
    plane, trial_version = _plane_with_trial(tmp_path)
    first = ControlPlane(plane.state_dir, step_margin=1, lead_s=0.0)
    real_read = plane.store.read_current

    def read_then_the_other_keeper_ends_it(*args, **kwargs):
        seen = real_read(*args, **kwargs)
        monkeypatch.undo()
        assert end_expired_trial(first, now=trial_version.time + 3600) == trial_version.version + 1
        return seen

    monkeypatch.setattr(plane.store, "read_current", read_then_the_other_keeper_ends_it)
    lines_before = len(plane.store.read_audit())
    assert end_expired_trial(plane, now=trial_version.time + 3600) is None
    cur = plane.store.read_current()
    assert cur is not None and cur.version == trial_version.version + 1 and cur.trial is None
    new_lines = plane.store.read_audit()[lines_before:]
    assert [line.get("result") for line in new_lines if line.get("actor") == ACTOR] == ["success"]


def test_a_held_writers_lock_stalls_the_keeping_rank_briefly_and_it_tries_again_later(
    tmp_path: Path,
) -> None:
    """A writer that holds the writers' lock (a wedged CLI, a slow disk) must not stall rank 0's
    control thread for the 10 s a CLI writer waits: it would pick up the next version late. The
    keeper waits KEEPER_LOCK_TIMEOUT_S, reports first, and tries again KEEPER_RETRY_S later."""
    plane, trial_version = _plane_with_trial(tmp_path)
    write_lease(plane.state_dir, TRIAL, now=trial_version.time - 3600, ttl_s=5.0)
    rank0 = RankControl(plane.state_dir, 0)
    ticks = [1000.0]
    rank0._lease_keeper = LeaseKeeper(plane.state_dir, clock=lambda: ticks[0])
    fd = os.open(plane.state_dir.lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        rank0.poll()
        assert time.monotonic() - started < KEEPER_LOCK_TIMEOUT_S + 2.0
        assert plane.store.read_current() == trial_version
        assert [d for d, _ in plane.store.read_rank_reports(now=time.time())]  # the report came first
        started = time.monotonic()
        rank0.poll()  # within the retry pause: no wait at all
        assert time.monotonic() - started < KEEPER_LOCK_TIMEOUT_S
    finally:
        os.close(fd)
    rank0.poll()
    assert plane.store.read_current() == trial_version
    ticks[0] += KEEPER_RETRY_S
    rank0.poll()
    cur = plane.store.read_current()
    assert cur is not None and cur.version == trial_version.version + 1 and cur.trial is None


def test_a_fault_in_the_keeper_never_escapes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plane, trial_version = _plane_with_trial(tmp_path)
    keeper = LeaseKeeper(plane.state_dir)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(keeper.control.store, "read_current", broken)
    assert keeper.check(now=trial_version.time + 3600) is None
