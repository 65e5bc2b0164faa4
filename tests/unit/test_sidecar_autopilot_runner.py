"""The sidecar's autopilot runner over a real ControlPlane in a tmp state directory, with a real
RankControl in this process as the rank (its report is confirmed: this process, this user) and a
clock the test moves: a trial started, run block by block from the rank's timed samples, promoted
or rolled back, every decision replayed from the audit log; a sidecar restarted mid-trial rolls
back; forged reports never reach a trial; the kill switch returns the operator's version.

Marked slow: a trial runs a few hundred steps of a real RankControl, each report and version
written with fsync (2-6 s a test on the 2-core VM)."""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from flyserve.autopilot.audit_log import read_audit_lines
from flyserve.autopilot.exploration import MAX_SHARE
from flyserve.autopilot.inputs import AutopilotConfig, KnobBound, Mode
from flyserve.autopilot.replay import replay
from flyserve.autopilot.sequential import SequentialConfig
from flyserve.control import ControlPlane, RankControl
from flyserve.control.snapshot import Trial
from flyserve.control.trial_lease import end_expired_trial, read_lease
from flyserve.policy.thresholds import ThresholdsError
from flyserve.sidecar.autopilot_runner import NO_BOUNDS, AutopilotRunner, UnknownTrial
from flyserve.sidecar.autopilot_views import LiveInputs
from flyserve.sidecar.models import AutopilotStatus
from flyserve.telemetry import metrics as tm

pytestmark = pytest.mark.slow

OPERATOR_MIN_SEQ_LEN = 1024
CANDIDATE_MIN_SEQ_LEN = 4096


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _config(**kw: Any) -> AutopilotConfig:
    args: dict[str, Any] = {
        "block_steps": 4,
        "cooldown_s": 60.0,
        "min_priced_samples": 100,
        "min_block_samples": 2,
        "max_exploration_share": MAX_SHARE,  # short plans, quick tests: no plan exceeds it
        "test": SequentialConfig(max_pairs=200),
    }
    args.update(kw)
    return AutopilotConfig(**args)


def _advice() -> LiveInputs:
    return LiveInputs(0.08, 5000, {"min_seq_len": CANDIDATE_MIN_SEQ_LEN}, 0.03)


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", step_margin=1, lead_s=0.0)
    p.apply_overrides({"min_seq_len": OPERATOR_MIN_SEQ_LEN}, actor="operator")
    return p


def _runner(plane: ControlPlane, clock: Clock, *, mode: Mode = Mode.AUTO, **kw: Any) -> AutopilotRunner:
    args: dict[str, Any] = {
        "config": _config(),
        "mode": mode,
        "bounds": {"min_seq_len": KnobBound(256, 8192)},
        "live_inputs": _advice,
        "clock": clock,
        "stale_after_s": 1e6,
    }
    args.update(kw)
    return AutopilotRunner(plane, **args)


class Rank:
    """A rank in this process: steps, a timed sample every step (kernel seconds per token set by
    the arm it runs: the candidate ``effect`` faster), a report before and after each run.

    Its steps take STEP_S on a clock of its own (``candidate_step_s`` on the candidate's blocks),
    so a block's mean step time is what the test sets, not this VM's scheduling; the candidate's
    steps each count ``candidate_fallbacks`` fallbacks and ``candidate_errors`` errors."""

    STEP_S = 0.01

    def __init__(
        self,
        plane: ControlPlane,
        effect: float,
        seed: int = 1,
        *,
        candidate_step_s: float = STEP_S,
        candidate_fallbacks: int = 0,
        candidate_errors: int = 0,
    ) -> None:
        self.elapsed = 0.0
        self.rc = RankControl(plane.state_dir, 0, report=True, block_clock=lambda: self.elapsed)
        self.counts = [0, 0]  # fallbacks, errors so far
        self.rc.count_blocks_with(lambda: (self.counts[0], self.counts[1]))
        self.effect = effect
        self.candidate = (candidate_step_s, candidate_fallbacks, candidate_errors)
        self.rng = random.Random(seed)
        self.step = 0

    def run(self, steps: int) -> None:
        self.rc.poll()
        for _ in range(steps):
            snap = self.rc.current(self.step)
            per_token = 1e-6 * math.exp(
                (math.log1p(-self.effect) if snap.arm == 1 else 0.0) + self.rng.gauss(0.0, 0.05)
            )
            self.rc.record_kernel_sample(self.step, per_token * 100, 100)
            if snap.arm == 1:
                step_s, fallbacks, errors = self.candidate
                self.counts[0] += fallbacks
                self.counts[1] += errors
            else:
                step_s = self.STEP_S
            self.elapsed += step_s
            self.step += 1
        self.rc.poll()


def _drive(runner: AutopilotRunner, rank: Rank, clock: Clock, *, rounds: int = 400) -> None:
    """Rank steps and runner ticks until the trial ends."""
    for _ in range(rounds):
        rank.run(16)
        clock.now += 0.5
        runner.tick()
        if runner.state.trial is None:
            return
    raise AssertionError("the trial did not end")


def _replayed_ok(plane: ControlPlane) -> None:
    report = replay(read_audit_lines(plane.state_dir.path))
    assert report.ok, [(t.trial, t.problems) for t in report.trials] + [b for b in report.bad]
    assert report.trials and all(t.agrees for t in report.trials)


def test_a_faster_candidate_is_tried_and_promoted(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    before = tm.AUTOPILOT_TRIALS.labels("promoted")._value.get()
    runner.tick()
    cur = plane.snapshot()
    assert cur.trial is not None and cur.source == "autopilot"
    assert cur.thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    assert cur.trial.candidate.min_seq_len == CANDIDATE_MIN_SEQ_LEN
    assert runner.status()["state"] == "running"
    _drive(runner, Rank(plane, effect=0.2), clock)
    cur = plane.snapshot()
    assert cur.trial is None and cur.thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN
    st = runner.status()
    assert st["state"] == "cooldown"
    last = st["last_decisions"][0]
    assert last["decision"] == "promote" and last["result_version"] == cur.version
    assert last["effect"] < 0  # negative: the candidate faster
    assert tm.AUTOPILOT_TRIALS.labels("promoted")._value.get() == before + 1
    _replayed_ok(plane)


def test_a_slower_candidate_is_rolled_back_to_the_operators_thresholds(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    runner.tick()
    trial_version = plane.snapshot().version
    _drive(runner, Rank(plane, effect=-0.1), clock)
    cur = plane.snapshot()
    assert cur.version > trial_version and cur.trial is None
    assert cur.thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    assert runner.status()["last_decisions"][0]["decision"] == "rollback"
    _replayed_ok(plane)


@pytest.mark.parametrize(
    ("rank_kw", "guardrail"),
    [
        ({"candidate_step_s": 2.0 * Rank.STEP_S}, "step time"),
        ({"candidate_fallbacks": 1}, "fallback rate"),
        ({"candidate_errors": 1}, "error rate"),
    ],
)
def test_a_candidate_whose_blocks_breach_a_guardrail_is_rolled_back_at_that_block(
    plane: ControlPlane, rank_kw: dict[str, Any], guardrail: str
) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    before = tm.AUTOPILOT_TRIALS.labels("rolled_back")._value.get()
    runner.tick()
    trial = plane.snapshot().trial
    assert trial is not None
    _drive(runner, Rank(plane, effect=0.2, **rank_kw), clock)
    cur = plane.snapshot()
    assert cur.trial is None and cur.thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    last = runner.status()["last_decisions"][0]
    assert last["decision"] == "rollback" and last["reason"] == guardrail
    # at the first candidate block the rank finished, not after the test; the step-time guardrail
    # at the second in a row (AutopilotConfig.step_time_blocks: one slow block is a stall's)
    assert last["pairs"] <= (2 if guardrail == "step time" else 1)
    assert tm.AUTOPILOT_TRIALS.labels("rolled_back")._value.get() == before + 1
    _replayed_ok(plane)


def test_a_runner_that_falls_behind_the_ranks_reports_ends_the_trial_inconclusive(
    plane: ControlPlane,
) -> None:
    """44 blocks pass between two ticks: the rank reports only its newest 32, so the first blocks
    are gone; the trial ends inconclusive, not rolled back by the samples-stopped guardrail."""
    clock = Clock()
    runner = _runner(plane, clock)
    before = tm.AUTOPILOT_TRIALS.labels("inconclusive")._value.get()
    runner.tick()
    assert plane.snapshot().trial is not None
    Rank(plane, effect=0.0).run(44 * 4)
    clock.now += 0.5
    runner.tick()
    assert runner.state.trial is None
    cur = plane.snapshot()
    assert cur.trial is None and cur.thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    last = runner.status()["last_decisions"][0]
    assert (last["decision"], last["reason"]) == ("inconclusive", "runner lagged")
    assert tm.AUTOPILOT_TRIALS.labels("inconclusive")._value.get() == before + 1
    decision = json.loads(read_audit_lines(plane.state_dir.path)[-1])
    assert decision["kind"] == "autopilot.trial.decision" and decision["guardrail"] is None
    _replayed_ok(plane)


def test_trial_mode_waits_for_the_approval_and_an_unknown_id_is_refused(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock, mode=Mode.TRIAL)
    runner.tick()
    trial_id = plane.snapshot().trial.trial_id  # type: ignore[union-attr]
    _drive(runner, Rank(plane, effect=0.2), clock)
    assert runner.status()["state"] == "awaiting_approval"
    assert plane.snapshot().thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    with pytest.raises(UnknownTrial):
        runner.approve("ap-99-9", "operator")
    runner.approve(trial_id, "operator")
    assert plane.snapshot().thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN
    _replayed_ok(plane)


def test_the_kill_switch_returns_the_operators_version_after_a_promotion(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    runner.tick()
    _drive(runner, Rank(plane, effect=0.2), clock)
    assert plane.snapshot().thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN
    runner.kill()
    assert plane.snapshot().thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    assert runner.status()["mode"] == "off"
    assert tm.AUTOPILOT_MODE.labels("off")._value.get() == 1.0


def test_a_kill_switch_that_was_not_published_is_owed_and_lands_at_the_next_tick(plane: ControlPlane) -> None:
    """The kill over a promotion, no trial running, when the writers' lock is busy: the operator's
    version must still come back (retried every tick while the autopilot's own version is in force)."""
    from flyserve.control import ControlIOError

    clock = Clock()
    runner = _runner(plane, clock)
    runner.tick()
    _drive(runner, Rank(plane, effect=0.2), clock)
    assert plane.snapshot().thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN and plane.snapshot().trial is None
    publish = plane.publish_autopilot
    failures = [1]

    def busy(*a: Any, **k: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise ControlIOError("writers' lock not acquired")
        return publish(*a, **k)

    plane.publish_autopilot = busy  # type: ignore[method-assign]
    runner.kill()
    assert plane.snapshot().thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN  # not yet
    assert runner.status()["owed_publish"]["kind"] == "kill"
    clock.now += 1
    runner.tick()
    assert plane.snapshot().thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    assert runner.status()["owed_publish"] is None and runner.status()["mode"] == "off"


@pytest.mark.parametrize("failure", ["version conflict", "candidate refused"])
def test_a_start_that_is_not_published_ends_the_trial_at_once_audited_and_counted(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    publish = plane.publish_autopilot
    secret_path = "/very/secret/state/path"

    def refused_start(thresholds: Any, *, trial: Any, request: Any, if_match: int | None = None) -> Any:
        if trial is None:
            return publish(thresholds, trial=trial, request=request, if_match=if_match)
        if failure == "version conflict":  # an operator publishes between the tick's read and its publish
            plane.apply_overrides({"block_m": 128}, actor="operator")
            return publish(thresholds, trial=trial, request=request, if_match=if_match)
        raise ThresholdsError([("trial.candidate.min_seq_len", f"refused, see {secret_path}")])

    monkeypatch.setattr(plane, "publish_autopilot", refused_start)
    before = tm.AUTOPILOT_TRIALS.labels("refused")._value.get()
    version_before = plane.snapshot().version
    runner.tick()
    assert runner.state.trial is None and runner.status()["state"] == "cooldown"
    assert plane.snapshot().trial is None
    assert plane.snapshot().version == version_before + (1 if failure == "version conflict" else 0)
    last = runner.status()["last_decisions"][0]
    assert last["decision"] == "rollback" and last["reason"] == f"start not published: {failure}"
    assert last["result_version"] is None
    assert tm.AUTOPILOT_TRIALS.labels("refused")._value.get() == before + 1
    lines = read_audit_lines(plane.state_dir.path)
    decision = json.loads(lines[-1])
    assert decision["kind"] == "autopilot.trial.decision" and decision["source"] == "publish"
    assert secret_path not in "\n".join(lines)
    _replayed_ok(plane)


def test_a_sidecar_restarted_mid_trial_rolls_back_and_says_why(plane: ControlPlane) -> None:
    operator = plane.snapshot()
    candidate = operator.thresholds.merged({"min_seq_len": CANDIDATE_MIN_SEQ_LEN})
    plane.publish_autopilot(
        operator.thresholds,
        trial=Trial("ap-1-1", 7, 4, 400, candidate),
        request={"autopilot": "start", "trial": "ap-1-1"},
    )
    assert plane.snapshot().trial is not None
    runner = _runner(plane, Clock(), mode=Mode.OFF)
    runner.tick()
    cur = plane.snapshot()
    assert cur.trial is None and cur.thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    last = json.loads(read_audit_lines(plane.state_dir.path)[-1])
    assert last["source"] == "autopilot" and "restarted" in last["request"]["reason"]


def test_without_bounds_the_autopilot_moves_nothing_and_says_so(plane: ControlPlane) -> None:
    runner = _runner(plane, Clock(), bounds=None)
    version = plane.snapshot().version
    runner.tick()
    assert plane.snapshot().version == version
    assert runner.status()["last_refusal"] == NO_BOUNDS


def test_forged_and_unconfirmed_block_reports_never_reach_the_trial(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    runner.tick()
    trial = plane.snapshot().trial
    assert trial is not None
    now = time.time()
    base = {
        "pid": os.getpid(),
        "rank": 1,
        "engine": 0,
        "started": now - 10,
        "time": now,
        "step": 100,
        "applied_version": plane.snapshot().version,
        "trial": None,
    }
    blocks = [{"block": b, "arm": 0, "kernel_seconds": 1.0, "tokens": 100, "samples": 50} for b in range(4)]
    hostile = [
        {"id": trial.trial_id, "through": 3, "blocks": [{**blocks[0], "kernel_seconds": float("nan")}]},
        {"id": trial.trial_id, "through": 3, "blocks": [{**blocks[0], "tokens": -1}]},
        {"id": trial.trial_id, "through": 3, "blocks": [{**blocks[0], "tokens": "HUGE"}]},
        {"id": trial.trial_id, "through": 10**6, "blocks": blocks},
        {"id": trial.trial_id, "through": 3, "blocks": blocks * 20},
    ]
    from flyserve.control.reports import HOST, PIDNS, own_proc_start

    plane.state_dir.rank_file(1, 0).parent.mkdir(parents=True, exist_ok=True)
    for forged in hostile:
        text = json.dumps(
            {**base, "host": HOST, "pidns": PIDNS, "proc_start": own_proc_start(), "trial_blocks": forged}
        )
        # an integer of 5000 digits, as a file can hold it (json.dumps refuses to write one)
        plane.state_dir.rank_file(1, 0).write_text(text.replace('"HUGE"', "1" + "0" * 4999))
        clock.now += 0.1
        runner.tick()
        assert runner.state.trial is not None and runner.state.trial.next_block == 0
    # a report "from another host" (unconfirmed) with well-formed blocks: not counted either
    plane.store.write_rank_report(
        {
            **base,
            "host": "elsewhere",
            "pidns": "pid:[1]",
            "trial_blocks": {"id": trial.trial_id, "through": 3, "blocks": blocks},
        },
        rank=1,
    )
    runner.tick()
    assert runner.state.trial is not None and runner.state.trial.next_block == 0


def test_operator_surfaces_pause_resume_and_mode(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    runner.tick()
    assert plane.snapshot().trial is not None
    runner.tick()
    assert runner.status()["last_refusal"] == "trial running"
    runner.pause()
    assert plane.snapshot().trial is None and runner.status()["paused"] is True
    runner.tick()
    assert runner.status()["last_refusal"] == "paused"  # not the trial's "trial running" any more
    runner.resume()
    runner.set_mode(Mode.ADVISE)
    clock.now += 120
    runner.tick()
    st = runner.status()
    assert st["mode"] == "advise" and st["proposal"]["changed"] == {
        "min_seq_len": [OPERATOR_MIN_SEQ_LEN, CANDIDATE_MIN_SEQ_LEN]
    }
    assert plane.snapshot().trial is None
    assert tm.AUTOPILOT_MODE.labels("advise")._value.get() == 1.0


def _started(plane: ControlPlane, **kw: Any) -> tuple[AutopilotRunner, Rank, Clock]:
    clock = Clock()
    runner = _runner(plane, clock, **kw)
    rank = Rank(plane, effect=0.5)
    rank.run(4)
    runner.tick()
    assert runner.status()["state"] == "running"
    return runner, rank, clock


def test_the_runner_renews_the_lease_of_its_trial_every_tick(plane: ControlPlane) -> None:
    """Its lease (control.trial_lease) is on file before the trial's version is published and is
    renewed at every tick while the trial runs, good for at least 5 ticks."""
    runner, rank, clock = _started(plane, interval_s=3.0)
    trial_id = runner.status()["trial"]["id"]
    lease = read_lease(plane.state_dir)
    assert lease is not None and lease.trial == trial_id and lease.renewed == clock.now
    assert lease.ttl_s == 15.0  # 5 ticks of 3 s, above the 10 s default
    clock.now += 0.5
    rank.run(4)
    runner.tick()
    renewed = read_lease(plane.state_dir)
    assert renewed is not None and renewed.renewed == clock.now


def test_a_lease_that_cannot_be_renewed_is_logged_once_a_minute_not_every_tick(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full or read-only disk fails every renewal: the first failure is an error, then one a
    minute saying for how long, and a renewal that works again says so once."""
    import logging

    from flyserve.sidecar import autopilot_runner

    runner, _, clock = _started(plane, interval_s=1.0)
    trial_id = runner.status()["trial"]["id"]

    def full(*args: Any, **kw: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(autopilot_runner, "write_lease", full)
    caplog.set_level(logging.WARNING, logger="flyserve.sidecar")
    start = clock.now
    for tick in range(150):  # 150 ticks of 1 s
        runner._renew_lease(trial_id, start + tick)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, errors  # at 0 s, 60 s and 120 s
    assert all("No space left on device" in e and trial_id in e for e in errors)
    assert (
        "failing for" not in errors[0]
        and "failing for 60 s" in errors[1]
        and "failing for 120 s" in errors[2]
    )
    monkeypatch.undo()
    caplog.clear()
    runner._renew_lease(trial_id, start + 150)
    runner._renew_lease(trial_id, start + 151)
    assert [r.getMessage() for r in caplog.records] == [
        f"autopilot: the lease on trial {trial_id} is renewed again after 150 s of failed renewals"
    ]
    lease = read_lease(plane.state_dir)
    assert lease is not None and lease.renewed == start + 151


def test_a_trial_ended_by_its_expired_lease_ends_here_and_the_kill_switch_still_returns_the_operators(
    plane: ControlPlane,
) -> None:
    """After a promotion, a second trial runs over the promoted thresholds; the engine's side ends
    it when its lease expires (a wedged sidecar). The runner ends its trial without publishing
    anything, and the lease's version is not an operator's: the kill switch returns the operator's
    thresholds, not the promoted ones the lease's version repeats."""
    clock = Clock()
    advice = [_advice()]
    runner = _runner(plane, clock, live_inputs=lambda: advice[0])
    runner.tick()
    _drive(runner, Rank(plane, effect=0.2), clock)
    assert plane.snapshot().thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN
    advice[0] = LiveInputs(0.08, 5000, {"min_seq_len": 2048}, 0.03)
    clock.now += 120.0  # past the cool-down
    runner.tick()
    second = plane.snapshot()
    assert second.trial is not None and second.thresholds.min_seq_len == CANDIDATE_MIN_SEQ_LEN
    ended = end_expired_trial(plane, now=clock.now + 3600.0)
    assert ended == second.version + 1
    clock.now += 0.5
    runner.tick()
    assert runner.state.trial is None and plane.snapshot().version == ended  # nothing published since
    runner.kill()
    assert plane.snapshot().thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN


@pytest.mark.parametrize("surface", ["pause", "kill", "mode-off"])
def test_an_operator_surface_never_reverts_an_operator_patch_made_since_the_last_tick(
    plane: ControlPlane, surface: str
) -> None:
    runner, _, _ = _started(plane)
    patched = plane.apply_overrides({"min_qblock_rows": 64}, actor="operator").snapshot
    {"pause": runner.pause, "kill": runner.kill, "mode-off": lambda: runner.set_mode(Mode.OFF)}[surface]()
    cur = plane.snapshot()
    assert cur.version == patched.version and cur.thresholds.min_qblock_rows == 64 and cur.trial is None
    _replayed_ok(plane)


def test_the_kill_switch_leaves_an_operators_own_version_alone(plane: ControlPlane) -> None:
    clock = Clock()
    runner = _runner(plane, clock)
    runner.tick()
    patched = plane.apply_overrides({"min_qblock_rows": 64}, actor="operator").snapshot
    runner.kill()
    assert plane.snapshot().version == patched.version


def test_an_operator_patch_since_the_last_tick_ends_the_trial_before_any_block(plane: ControlPlane) -> None:
    runner, rank, clock = _started(plane)
    rank.run(200)
    clock.now += 0.5
    patched = plane.apply_overrides({"min_qblock_rows": 64}, actor="operator").snapshot
    runner.tick()
    cur = plane.snapshot()
    assert cur.version == patched.version and cur.thresholds.min_qblock_rows == 64
    last = runner.status()["last_decisions"][0]
    assert (last["decision"], last["reason"]) == ("rollback", "operator change")
    _replayed_ok(plane)


def test_a_patch_landing_while_a_block_decides_wins_over_the_promotion(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flyserve.sidecar.autopilot_runner as runner_module
    from flyserve.autopilot.actions import Promote

    on_block = runner_module.ap.on_block

    def patched_while_deciding(*a: Any, **k: Any) -> Any:
        out = on_block(*a, **k)
        if isinstance(out.action, Promote):
            plane.apply_overrides({"min_qblock_rows": 64}, actor="operator")
        return out

    monkeypatch.setattr(runner_module.ap, "on_block", patched_while_deciding)
    runner, rank, clock = _started(plane)
    _drive(runner, rank, clock)
    cur = plane.snapshot()
    assert cur.source != "autopilot" and cur.thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    assert cur.thresholds.min_qblock_rows == 64
    last = runner.status()["last_decisions"][0]
    assert (last["decision"], last["reason"], last["result_version"]) == ("rollback", "operator change", None)
    _replayed_ok(plane)


def test_an_awaited_approval_is_dropped_when_the_operators_version_moves(plane: ControlPlane) -> None:
    runner, rank, clock = _started(plane, mode=Mode.TRIAL)
    _drive(runner, rank, clock)
    st = runner.status()
    assert st["state"] == "awaiting_approval"
    patched = plane.apply_overrides({"min_qblock_rows": 64}, actor="operator").snapshot
    with pytest.raises(UnknownTrial):
        runner.approve(st["trial"]["id"], "someone")
    assert plane.snapshot().version == patched.version
    assert runner.status()["state"] != "awaiting_approval"
    _replayed_ok(plane)


def test_a_failed_rollback_is_owed_and_retried_until_the_trial_is_gone(plane: ControlPlane) -> None:
    from flyserve.control import ControlIOError

    clock = Clock()
    runner = _runner(plane, clock)
    rank = Rank(plane, effect=-0.5)  # the candidate is slower: the test rolls it back
    publish = plane.publish_autopilot
    failures = [1]

    def flaky(*a: Any, **k: Any) -> Any:
        if k.get("trial") is None and failures[0]:
            failures[0] -= 1
            raise ControlIOError("writers' lock not acquired")
        return publish(*a, **k)

    plane.publish_autopilot = flaky  # type: ignore[method-assign]
    rank.run(4)
    runner.tick()
    _drive(runner, rank, clock)
    st = runner.status()
    assert st["state"] == "rolling_back" and st["owed_publish"]["kind"] == "rollback"
    assert st["last_decisions"][0]["result_version"] is None
    # GET /autopilot answers this body through its response model: the state and the owed publish
    # must pass it as they are (the model once knew no rolling_back: a 500 while a publish was owed).
    shown = AutopilotStatus.model_validate(st).model_dump()
    assert shown["state"] == "rolling_back" and shown["owed_publish"] == st["owed_publish"]
    assert plane.snapshot().trial is not None
    clock.now += 1
    runner.tick()
    assert plane.snapshot().trial is None and plane.snapshot().thresholds.min_seq_len == OPERATOR_MIN_SEQ_LEN
    assert runner.status()["owed_publish"] is None
    _replayed_ok(plane)


def test_two_concurrent_starts_run_one_thread(plane: ControlPlane) -> None:
    import threading

    runner = _runner(plane, Clock(), interval_s=60.0)
    barrier = threading.Barrier(8)

    def go() -> None:
        barrier.wait()
        runner.start()

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sum(1 for t in threading.enumerate() if t.name == "flyserve-autopilot") == 1
    finally:
        runner.stop()
