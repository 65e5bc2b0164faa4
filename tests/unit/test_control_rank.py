"""RankControl: switching at the effective step, late learners, versions in order, the hot path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from _hot_path import run_hot_path

from flyserve.control import ControlPlane, RankControl
from flyserve.policy import Thresholds
from flyserve.thresholds_files import load_profile


def report_step(plane: ControlPlane, step: int, rank: int = 9) -> None:
    """Pretend a live rank (this process, measured idle rate) is at ``step``: what effective_step
    is computed from."""
    now = time.time()
    report = {
        "rank": rank,
        "engine": 0,
        "pid": os.getpid(),
        "started": now - 60,
        "step": step,
        "steps_per_s": 0.0,
        "time": now,
    }
    plane.store.write_rank_report(report, rank=rank)


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)  # margins in steps only
    p.reload(actor="startup", startup=True)
    return p


def test_starts_from_the_published_version_or_the_profile(tmp_path: Path, plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    assert rc.current(0).version == 1
    empty = RankControl(tmp_path / "nothing", 0, profile="gfx950", report=False)
    assert empty.current(0).version == 0 and empty.current(0).thresholds == load_profile("gfx950")


def test_switches_exactly_at_the_effective_step(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    for step in range(100):
        rc.current(step)
    report_step(plane, 100)
    s2 = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s2.effective_step == 108
    rc.poll()
    assert [rc.current(step).version for step in range(100, 108)] == [1] * 8
    assert rc.current(108) is rc.snapshot and rc.snapshot.version == 2
    assert rc.applied_step == 108 and rc.applied[-1] == (2, 108, 108)
    assert rc.current(109).thresholds.min_seq_len == 4096


def test_a_rank_that_learns_late_switches_at_once_and_says_so(plane: ControlPlane) -> None:
    report_step(plane, 10)
    plane.apply_overrides({"min_seq_len": 4096}, actor="a")  # effective at 18
    rc = RankControl(plane.state_dir, 0, report=False)  # a rank that starts now starts at v2
    assert rc.current(0).version == 2
    late = RankControl(plane.state_dir, 1, report=False)
    report_step(plane, 10)
    plane.apply_overrides({"min_seq_len": 5000}, actor="a")  # effective at 18 (planned from the ranks alone)
    for step in range(40):
        late.current(step)
    late.poll()
    assert late.current(40).version == 3
    assert late.applied[-1] == (3, 18, 40) and late.applied_step == 40
    late.write_report()
    rep = json.loads(late.state_dir.rank_file(1).read_text())
    assert (rep["applied_version"], rep["applied_step"], rep["step"]) == (3, 40, 40)
    # ... and says so: in its report (-> /dispatch-stats) and in flyserve_control_late_applies_total
    from flyserve.telemetry.metrics import LATE_APPLIES

    assert rep["late_applies"] == 1 and late.late_applies == 1
    assert LATE_APPLIES.labels("1")._value.get() >= 1


def test_versions_published_between_two_polls_are_each_applied_in_order(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    rc.current(0)
    report_step(plane, 0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="a")  # v2 at 8
    report_step(plane, 5)
    plane.apply_overrides({"min_seq_len": 4000}, actor="a")  # v3 at 13
    report_step(plane, 5)
    plane.apply_overrides({"min_seq_len": 5000}, actor="a")  # v4 at 13
    rc.poll()
    seen = [rc.current(step).version for step in range(20)]
    assert seen == [1] * 8 + [2] * 5 + [4] * 7
    assert [(v, eff, at) for v, eff, at in rc.applied[1:]] == [(2, 8, 8), (3, 13, 13), (4, 13, 13)]


def test_a_torn_current_json_is_ignored_until_it_is_whole(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    good = plane.state_dir.current_json.read_text()
    plane.state_dir.current_json.write_text(good[: len(good) // 2])
    rc.poll()
    assert rc.current(1000).version == 1
    doc = json.loads(good)
    doc["thresholds"]["min_seq_len"] = 7  # whole JSON, but not what was published: sha mismatch
    plane.state_dir.current_json.write_text(json.dumps(doc))
    rc.poll()
    assert rc.current(1001).thresholds.min_seq_len == Thresholds().min_seq_len
    report_step(plane, 1001)
    plane.apply_overrides({"min_seq_len": 4096}, actor="a")  # repairs current.json
    rc.poll()
    assert rc.current(2000).thresholds.min_seq_len == 4096


def test_the_background_thread_reports_and_picks_up(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 3, engine=0, interval_s=0.02)
    with rc:
        rc.current(50)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and plane.store.max_rank_step() < 50:
            time.sleep(0.01)
        s = plane.set_circuit(True, actor="rank3", reason="boom").snapshot
        eff = s.effective_step
        assert eff >= 58  # the reported step (projected to now by its rate) + the margin
        while time.monotonic() < deadline and not rc._pending:
            time.sleep(0.01)
        assert not rc.current(eff - 1).circuit_open
        assert rc.current(eff).circuit_open
    rep = json.loads(plane.state_dir.rank_file(3).read_text())
    assert rep["pid"] == os.getpid() and rep["rank"] == 3 and rep["engine"] == 0
    assert (rep["step"], rep["applied_version"], rep["applied_step"]) == (eff, 2, eff)
    assert rep["circuit_open"] is True
    assert abs(rep["time"] - time.time()) < 10


def test_the_hot_path_does_no_io_takes_the_slow_path_once_and_keeps_nothing(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    report_step(plane, 10_000)
    plane.apply_overrides({"min_seq_len": 4096}, actor="a")  # effective at 10_008
    rc.poll()
    run = run_hot_path(rc, list(range(20_000)))
    assert run.slow_calls == [10_008], "the slow path must run once, at the effective step"
    assert rc.snapshot.version == 2
    # The one switch appends an (version, effective_step, applied_step) record; nothing per step.
    assert run.retained < 2_000, f"{run.retained} bytes retained over 20000 steps"


def test_a_rank_without_a_measured_rate_gets_the_assumed_high_rate_margin(plane: ControlPlane) -> None:
    """A change published in a rank's first second would otherwise get the 8-step floor (its
    report says step 0, rate 0) and be applied late. Until a rank has measured its rate its
    report says null, and the publisher assumes a high rate (ASSUMED_STEPS_PER_S) for the margin."""
    from flyserve.control.effective import ASSUMED_STEPS_PER_S

    rc = RankControl(plane.state_dir, 0, report=False)
    for step in range(1, 201):
        rc.current(step)
    rc.write_report()
    (report_file,) = plane.state_dir.ranks_dir.glob("*.json")
    assert json.loads(report_file.read_text())["steps_per_s"] is None  # well under a second old
    timed = ControlPlane(plane.state_dir, step_margin=8, lead_s=3.0)
    res = timed.apply_overrides({"min_seq_len": 2048}, actor="t")
    assert res.snapshot.effective_step >= 200 + ASSUMED_STEPS_PER_S * 3.0


def test_a_rank_measures_its_rate_after_a_second_of_steps(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    rc.started -= 2.0  # as if constructed two seconds ago ...
    rc._last_rate_sample = (rc.started, 0)
    for step in range(1, 401):  # ... and 400 steps since
        rc.current(step)
    rate = rc.report_dict()["steps_per_s"]
    assert rate is not None and 150 < rate < 250


def test_each_engine_switches_at_its_own_step(plane: ControlPlane) -> None:
    """Data-parallel engines count steps independently: a version carries one step per engine,
    each planned from that engine's live ranks only."""
    now = time.time()
    for engine, step in ((0, 1000), (1, 50)):
        report = {"rank": 0, "engine": engine, "pid": os.getpid(), "started": now - 60, "step": step,
                  "steps_per_s": 0.0, "time": now}  # fmt: skip
        plane.store.write_rank_report(report, rank=0, engine=engine)
    e0 = RankControl(plane.state_dir, 0, engine=0, report=False)
    e1 = RankControl(plane.state_dir, 0, engine=1, report=False)
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert (s.step_for(0), s.step_for(1)) == (1008, 58)
    e0.poll()
    e1.poll()
    assert e1.current(57).version == 1 and e1.current(58).version == 2
    assert e0.current(58).version == 1 and e0.current(1008).version == 2
