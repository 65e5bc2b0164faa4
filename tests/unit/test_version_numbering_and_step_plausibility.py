"""Version numbering and effective-step plausibility: versions never restart below what live ranks
applied, stray or non-ASCII history file names never count as versions, and a forged rank report
(from the future, started at 0, or inside every limit) does not pin the effective step. Each test
plants one such state and pins the version or step that comes out of it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane
from flyserve.control.reports import HOST, PIDNS, own_proc_start


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)


def live_report(plane: ControlPlane, rank: int, **fields: Any) -> dict[str, Any]:
    """A report as a live rank of this process writes it (pid alive on this host)."""
    now = time.time()
    d = {
        "pid": os.getpid(),
        "host": HOST,
        "pidns": PIDNS,
        "proc_start": own_proc_start(),
        "rank": rank,
        "engine": 0,
        "started": now - 100.0,
        "step": 2000,
        "steps_per_s": 20.0,
        "applied_version": 1,
        "time": now,
    }
    d.update(fields)
    plane.store.write_rank_report(d, rank=rank)
    return d


# ---------------------------------------------------------------- ranks' applied version is a floor


def test_versions_do_not_restart_below_what_live_ranks_applied(plane: ControlPlane) -> None:
    for n in range(5):
        plane.apply_overrides({"min_seq_len": 2000 + n}, actor="a")
    live_report(plane, 0, applied_version=5)
    live_report(plane, 1, applied_version=5)
    # current.json garbage, history and the audit log gone
    sd = plane.state_dir
    for f in sd.history_dir.iterdir():
        f.unlink()
    sd.current_json.write_text("garbage")
    sd.audit_log.unlink()
    assert plane.snapshot().version == 5  # what GET /thresholds and /dispatch-stats show (was 0)
    r = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert r.version == 6  # was 1: every rank (on v5) ignored it


def test_repair_with_everything_lost_publishes_above_the_ranks(plane: ControlPlane) -> None:
    for n in range(5):
        plane.apply_overrides({"min_seq_len": 2000 + n}, actor="a")
    live_report(plane, 0, applied_version=5)
    sd = plane.state_dir
    for f in sd.history_dir.iterdir():
        f.unlink()
    sd.current_json.unlink()
    sd.audit_log.unlink()
    assert plane_repair(plane).version == 6  # was: nothing to repair, the next change v1


def test_a_dead_or_stale_rank_does_not_raise_the_floor(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    live_report(plane, 0, applied_version=500, time=time.time() - 300)  # stale
    r = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert r.version == 2


# ---------------------------------------------------------------- history file names


@pytest.mark.parametrize(
    "name", ["99999999999999999999.json", "1" * 30 + ".json", "99999999999999999999.json.bad"]
)
def test_a_stray_huge_history_name_never_counts_as_a_version(plane: ControlPlane, name: str) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    (plane.state_dir.history_dir / name).touch()
    r = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert r.version == 2
    rep = plane_repair(plane)
    assert r.version == rep.version == 2
    assert plane.apply_overrides({"min_seq_len": 2002}, actor="a").snapshot.version == 3
    assert plane.rollback(1, actor="a").snapshot.version == 4


def test_repair_sets_a_stray_name_aside(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    (plane.state_dir.history_dir / "99999999999999999999.json").touch()
    rep = plane_repair(plane)
    assert any("not a version number" in d for d in rep.dropped)
    assert (plane.state_dir.history_dir / "99999999999999999999.json.stray").exists()
    assert not (plane.state_dir.history_dir / "99999999999999999999.json").exists()


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize("name", ["²³.json", "٣٣.json", "+5.json", " 7.json", "0.json"])
def test_non_ascii_digit_history_names_are_ignored(plane: ControlPlane, name: str) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    (plane.state_dir.history_dir / name).touch()
    assert [s.version for s in plane.history()] == [1]  # raised ValueError ('²³')
    r = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert r.version == 2  # '٣٣' made it 34
    assert plane.rollback(1, actor="a").snapshot.version == 3
    plane_repair(plane)
    assert plane.apply_overrides({"min_seq_len": 2002}, actor="a").snapshot.version == 4


def plane_repair(plane: ControlPlane):
    from flyserve.control.repair import repair

    return repair(plane)


# ---------------------------------------------------------------- forged rank reports


def forged(plane: ControlPlane, **fields: Any) -> None:
    """ranks/7.json as the attacker wrote it: another host (only its age is checked), rank 7."""
    now = time.time()
    d = {
        "pid": 4242,
        "host": "",
        "pidns": "",
        "rank": 7,
        "engine": 0,
        "started": now - 100.0,
        "step": 4000,
        "steps_per_s": 20.0,
        "applied_version": 1,
        "time": now,
    }
    d.update(fields)
    plane.store.write_rank_report(d, rank=7)


def two_real_ranks(plane: ControlPlane, step: int = 4000) -> None:
    live_report(plane, 0, step=step)
    live_report(plane, 1, step=step)


def test_a_forged_report_from_the_future_with_started_0_does_not_pin_the_step(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    two_real_ranks(plane)
    forged(plane, started=0.0, step=10**9, time=time.time() + 4.9)
    s = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert 4000 < s.effective_step < 4200  # was 1000000064


def test_a_forged_report_inside_every_limit_is_capped_by_its_engine(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    two_real_ranks(plane)
    far = ControlPlane(plane.state_dir, step_margin=8, lead_s=3.0)
    forged(plane, steps_per_s=10_000.0, step=4000 + 10_000 * 50, started=time.time() - 3600)
    s = far.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    # ~4000 + 64 slack + 40 (2 s at 20/s) + 500/s assumed cap * 3 s: no more than ~75 s at 20 steps/s
    assert (
        4000 < s.effective_step <= 4000 + 64 + 40 + 1500 + 20
    )  # (+1 s of age) was 34967 (25 min at 20 steps/s)
    forged(plane, steps_per_s=10_000.0, step=4000)
    s = far.apply_overrides({"min_seq_len": 2002}, actor="a").snapshot
    assert 4000 < s.effective_step <= 4000 + 64 + 40 + 1500 + 20


def test_a_version_published_with_a_poisoned_step_is_superseded_by_the_next(plane: ControlPlane) -> None:
    from flyserve.control import RankControl

    ranks = [RankControl(plane.state_dir, r, report=False) for r in (0, 1)]
    for rc in ranks:
        rc.current(4000)
    two_real_ranks(plane)
    poisoned = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    # What the old code published with the forged file present; written as a publisher would.
    bad = poisoned.replace(
        version=poisoned.version + 1, effective_step=10**9, engine_steps={"0": 10**9, "*": 8}
    )
    with plane.store.lock():
        plane.store.publish(bad)
    for rc in ranks:
        rc.poll()
    two_real_ranks(plane, step=4001)
    for rc in ranks:
        live_report(plane, rc.rank, step=4001, applied_version=rc.snapshot.version)
    fix = plane.apply_overrides({"min_seq_len": 3000}, actor="a").snapshot
    assert fix.version == bad.version + 1 and fix.effective_step < 4200  # no floor from the bad one
    for rc in ranks:
        rc.poll()
    seen = [[rc.current(step).version for step in range(4001, 4200)] for rc in ranks]
    assert seen[0] == seen[1]  # the same step on every rank
    assert seen[0][-1] == fix.version and seen[0].index(fix.version) + 4001 == fix.effective_step
