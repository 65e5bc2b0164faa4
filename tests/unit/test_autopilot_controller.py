"""The autopilot's state machine: modes, the trigger's refusals, a trial run block pair by block pair,
guardrails, decisions and their audit records.

What must hold: equal arms never promote; a measured improvement promotes (auto) or waits for an
approval (trial); a candidate the cost table favours but the blocks measure slower rolls back to
the operator's version; a guardrail rolls back at the block that breaches it; advise never starts a
trial; off, pause and the kill switch do what they say; every refusal is named; a block that is
forged, stale or thinly sampled never becomes a pair.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from autopilot_rig import ADVICE, OPERATOR, OPERATOR_VERSION, Run, block, config, observation

from flyserve.autopilot import audit_parse as parsed
from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import controller as ap
from flyserve.autopilot import trigger
from flyserve.autopilot.actions import (
    AwaitApproval,
    Nothing,
    Promote,
    ProposeTrial,
    Rollback,
    StartTrial,
)
from flyserve.autopilot.inputs import AutopilotConfig, InputError, KnobBound, Mode
from flyserve.autopilot.sequential import SequentialConfig
from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.policy.thresholds import Thresholds


def started(mode: Mode = Mode.AUTO, **cfg: object) -> tuple[Run, object]:
    run = Run(config(**cfg))
    run.set_mode(mode)
    return run, run.start()


def decisions(run: Run) -> list[dict[str, object]]:
    return [r for r in run.records if r["kind"] == rec.DECISION]


# ---------------------------------------------------------------------- decisions by measurement


def _aa_verdicts(trials: int, max_pairs: int) -> list[object]:
    verdicts = []
    for seed in range(trials):
        run, spec = started(test=SequentialConfig(max_pairs=max_pairs))
        action, _ = run.run_blocks(spec, 0.0, random.Random(seed))
        assert not isinstance(action, Promote | AwaitApproval)
        verdicts.append(decisions(run)[-1]["verdict"])
    return verdicts


def test_equal_arms_never_promote_in_bounded_seeded_runs():
    """A/A: 6 trials of up to 120 pairs each, every pair decided on; none promotes."""
    verdicts = _aa_verdicts(6, 120)
    assert "promote" not in verdicts
    assert set(verdicts) <= {"rollback", "inconclusive"}


@pytest.mark.slow  # about 3 s: 40 trials of up to 300 pairs through the whole state machine
def test_equal_arms_never_promote_in_forty_seeded_runs():
    assert "promote" not in _aa_verdicts(40, 300)


def test_a_measured_20_percent_improvement_is_promoted_in_auto():
    run, spec = started(Mode.AUTO)
    action, b = run.run_blocks(spec, 0.20, random.Random(1))
    assert isinstance(action, Promote)
    assert action.trial_id == spec.trial_id and action.thresholds == spec.candidate
    assert action.thresholds.min_seq_len == ADVICE["min_seq_len"]
    [d] = decisions(run)
    assert (d["verdict"], d["source"], d["action"]) == ("promote", "test", "promote")
    assert d["statistic"]["estimate"] < -0.1 and b < 200
    assert run.state.trial is None and run.state.cooldown_until == run.now + run.cfg.cooldown_s


def test_in_trial_mode_a_promotion_awaits_approval_then_promotes_on_approve():
    run, spec = started(Mode.TRIAL)
    action, _ = run.run_blocks(spec, 0.20, random.Random(2))
    assert isinstance(action, AwaitApproval)
    # While it waits the engine runs the operator's version: nothing unapproved keeps running.
    assert action.thresholds == OPERATOR and action.to_version == OPERATOR_VERSION
    assert decisions(run)[-1]["action"] == "await-approval"
    assert run.observe() == Nothing(trigger.AWAITING)
    wrong = run.apply(ap.approve(run.cfg, run.state, "ap-9-9", run.now, "alice"))
    assert isinstance(wrong, Nothing) and run.state.awaiting is not None
    ok = run.apply(ap.approve(run.cfg, run.state, spec.trial_id, run.now + 1, "alice"))
    assert ok == Promote(spec.trial_id, spec.candidate)
    assert run.records[-1] == {
        "schema": 1,
        "kind": rec.APPROVAL,
        "time": run.now + 1,
        "trial": spec.trial_id,
        "actor": "alice",
        "action": "promote",
    }
    again = run.apply(ap.approve(run.cfg, run.state, spec.trial_id, run.now + 2, "alice"))
    assert isinstance(again, Nothing)


def test_an_awaited_approval_is_dropped_when_the_operators_version_moves():
    run, spec = started(Mode.TRIAL)
    run.run_blocks(spec, 0.20, random.Random(2))
    assert run.state.awaiting is not None
    action = run.observe(operator_version=OPERATOR_VERSION + 1)
    assert isinstance(action, Nothing) and ap.OPERATOR_CHANGE in action.reason
    assert run.records[-1]["action"] == ap.OPERATOR_CHANGE and run.state.awaiting is None
    assert isinstance(run.apply(ap.approve(run.cfg, run.state, spec.trial_id, run.now, "bob")), Nothing)


def test_an_approval_that_waits_too_long_expires():
    run, spec = started(Mode.TRIAL)
    run.run_blocks(spec, 0.20, random.Random(2))
    run.now += run.cfg.approval_wait_s + 1
    assert "expired" in run.observe().reason  # type: ignore[union-attr]
    assert run.records[-1]["action"] == "expired" and run.state.awaiting is None
    assert isinstance(run.apply(ap.approve(run.cfg, run.state, spec.trial_id, run.now, "bob")), Nothing)


def test_a_candidate_the_table_favours_but_measures_10_percent_worse_rolls_back():
    """The advice predicts a 2% saving; the blocks say 10% slower: measurement decides."""
    run, spec = started(Mode.AUTO)
    action, _ = run.run_blocks(spec, -0.10, random.Random(3))
    assert isinstance(action, Rollback)
    assert action.thresholds == OPERATOR and action.to_version == OPERATOR_VERSION
    assert action.reason in ("worse", "abort: far worse", "no better than the minimum effect")
    d = decisions(run)[-1]
    assert d["statistic"]["estimate"] > 0.05
    assert (d["verdict"], d["source"], d["action"], d["result_version"]) == (
        "rollback",
        "test",
        "rollback",
        OPERATOR_VERSION,
    )


def test_the_budget_spent_is_inconclusive_and_rolls_back():
    run, spec = started(test=SequentialConfig(max_pairs=20))
    action, b = run.run_blocks(spec, 0.0, random.Random(4), cv=0.3)
    assert isinstance(action, Rollback) and b == 39
    assert (action.reason, decisions(run)[-1]["verdict"]) == ("budget spent", "inconclusive")


# ---------------------------------------------------------------------- guardrails


def slow_steps(s, b, now, pt):  # type: ignore[no-untyped-def]
    """A block measurement whose candidate steps take twice the current arm's 30 ms."""
    m = block(s, b, now, pt)
    return replace(m, step_s=0.030 * (2.0 if m.arm == 1 else 1.0))


def test_candidate_blocks_with_a_mean_step_time_far_above_the_current_arms_roll_back_at_the_second():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(5), until=6)

    action, b = run.run_blocks(spec, 0.0, random.Random(5), first=6, measure=slow_steps)
    assert isinstance(action, Rollback) and action.reason == rec.STEP_TIME
    # pairs 3 and 4 (blocks 6-9) hold one candidate block each: the second of them breaches
    assert b in (8, 9)
    g = decisions(run)[-1]["guardrail"]
    assert g == {"name": rec.STEP_TIME, "value": pytest.approx(2.0), "limit": 1.5}


def test_with_one_block_in_a_row_the_first_slow_candidate_block_rolls_back():
    run, spec = started(step_time_blocks=1)
    run.run_blocks(spec, 0.0, random.Random(5), until=6)

    action, b = run.run_blocks(spec, 0.0, random.Random(5), first=6, measure=slow_steps)
    assert isinstance(action, Rollback) and action.reason == rec.STEP_TIME
    assert b in (6, 7)  # the first candidate block after the breach began


def test_one_slow_candidate_block_alone_does_not_roll_back():
    """A host stall, or an idle gap in the traffic inside one block (the rank's boundary clocks
    count it as step time), slows one block with no arm to blame: the streak needs two."""
    run, spec = started()
    plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
    stalled = next(b for b in range(6, 40) if plan.arm_of_block(b) == 1)

    def one_stall(s, b, now, pt):  # type: ignore[no-untyped-def]
        m = block(s, b, now, pt)
        return replace(m, step_s=0.030 * (12.0 if b == stalled else 1.0))

    action, b = run.run_blocks(spec, 0.0, random.Random(5), until=40, measure=one_stall)
    assert run.state.trial is not None, (action, b)  # still running: no guardrail rolled it back
    assert all(d.get("guardrail") is None for d in decisions(run))


def test_a_start_that_was_not_published_ends_the_trial_now_with_a_publish_decision():
    run, spec = started()
    other = run.apply(ap.start_not_published(run.cfg, run.state, "ap-9-9", "version conflict", run.now))
    assert isinstance(other, Nothing) and run.state.trial is not None  # another trial's: nothing
    action = run.apply(ap.start_not_published(run.cfg, run.state, spec.trial_id, "version conflict", run.now))
    assert isinstance(action, Nothing) and run.state.trial is None
    assert run.state.cooldown_until == run.now + run.cfg.cooldown_s
    d = decisions(run)[-1]
    assert (d["source"], d["verdict"], d["blocks"], d["result_version"]) == ("publish", "rollback", 0, None)
    assert d["reason"] == "start not published: version conflict"
    assert parsed.parse_record(json.loads(json.dumps(d))).source == rec.BY_PUBLISH


def test_a_block_with_the_circuit_open_rolls_back_at_that_block():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(6), until=5)
    action, b = run.run_blocks(
        spec,
        0.0,
        random.Random(6),
        first=5,
        measure=lambda s, b, now, pt: block(s, b, now, pt, circuit_open=True),
    )
    assert isinstance(action, Rollback) and action.reason == rec.CIRCUIT_OPENED and b == 5


def test_the_circuit_opening_between_blocks_rolls_back_at_the_next_look():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(6), until=5)
    action = run.observe(circuit_open=True)
    assert isinstance(action, Rollback) and action.reason == rec.CIRCUIT_OPENED


def test_samples_that_stop_roll_back():
    """Blocks with too few corroborated samples form no pair; max_empty_blocks of them in a row is
    the samples-stopped guardrail."""
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(7), until=4)
    pairs = run.state.trial.pairs  # type: ignore[union-attr]
    action, b = run.run_blocks(
        spec,
        0.0,
        random.Random(7),
        first=4,
        measure=lambda s, b, now, pt: block(s, b, now, pt, corroborated_samples=2),
    )
    assert isinstance(action, Rollback) and action.reason == rec.SAMPLES_STOPPED
    assert b == 4 + run.cfg.max_empty_blocks - 1
    assert decisions(run)[-1]["statistic"]["pairs"] == pairs == 2


def test_no_block_for_too_long_is_samples_stopped():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(7), until=3)
    run.now += run.cfg.block_timeout_s
    action = run.observe()
    assert isinstance(action, Rollback) and action.reason == rec.SAMPLES_STOPPED


def test_fallbacks_on_the_candidate_above_the_current_arms_roll_back():
    run, spec = started()
    action, _ = run.run_blocks(
        spec,
        0.0,
        random.Random(8),
        measure=lambda s, b, now, pt: block(s, b, now, pt, fallbacks=1 if b >= 4 and b % 2 else 0),
    )
    # Which arm the odd blocks ran is the coin's; some of them are the candidate's.
    assert isinstance(action, Rollback) and action.reason in (rec.FALLBACK_RATE,)


# ---------------------------------------------------------------------- what never becomes a pair


def test_forged_stale_and_foreign_blocks_change_nothing():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(9), until=4)
    before = run.state
    good = block(spec, 4, run.now, 1e-6)
    for m, why in (
        (replace(good, arm=1 - good.arm), ap.WRONG_ARM),
        (replace(good, trial_id="ap-0-1"), ap.NOT_THIS_TRIAL),
        (replace(good, block=3), ap.STALE_BLOCK),
        (replace(good, block=spec.blocks), ap.BEYOND_PLAN),
    ):
        assert run.apply(ap.on_block(run.cfg, run.state, m)) == Nothing(why)
        assert run.state == before


def test_a_pair_needs_both_blocks_with_enough_corroborated_samples():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(10), until=2)
    assert run.state.trial.pairs == 1  # type: ignore[union-attr]
    run.apply(ap.on_block(run.cfg, run.state, block(spec, 2, run.now, 1e-6, corroborated_samples=7)))
    run.apply(ap.on_block(run.cfg, run.state, block(spec, 3, run.now, 1e-6)))
    assert run.state.trial.pairs == 1  # type: ignore[union-attr]
    run.apply(ap.on_block(run.cfg, run.state, block(spec, 4, run.now, 1e-6, tokens=0)))
    run.apply(ap.on_block(run.cfg, run.state, block(spec, 5, run.now, 1e-6)))
    assert run.state.trial.pairs == 1  # type: ignore[union-attr]
    run.apply(ap.on_block(run.cfg, run.state, block(spec, 6, run.now, 1e-6)))
    run.apply(ap.on_block(run.cfg, run.state, block(spec, 7, run.now, 1e-6)))
    assert run.state.trial.pairs == 2  # type: ignore[union-attr]


# ---------------------------------------------------------------------- modes


def test_off_does_nothing():
    run = Run(config())
    assert run.observe() == Nothing("off")
    assert run.records == [] and run.state.trial is None


def test_advise_proposes_and_never_starts_a_trial():
    run = Run(config())
    run.set_mode(Mode.ADVISE)
    for _ in range(3):
        run.now += 1000
        action = run.observe()
        assert isinstance(action, ProposeTrial)
        assert dict(action.spec.changes) == {"min_seq_len": (1536, 2048)}
    assert run.state.trial is None and run.state.trials_started == 0
    assert [r["kind"] for r in run.records] == [rec.MODE]
    assert not any(isinstance(a, StartTrial) for a in run.actions)


def test_one_trial_at_a_time_then_a_cool_down():
    run, spec = started()
    assert run.observe() == Nothing(trigger.BUSY)
    run.run_blocks(spec, -0.5, random.Random(11))
    assert run.state.trial is None
    assert run.observe().reason.startswith(trigger.COOLDOWN)  # type: ignore[union-attr]
    run.now += run.cfg.cooldown_s
    assert isinstance(run.observe(), StartTrial)
    assert run.state.trial.spec.trial_id == f"ap-{OPERATOR_VERSION}-2"  # type: ignore[union-attr]


def test_pause_rolls_back_a_running_trial_and_starts_none_until_resume():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(12), until=6)
    action = run.apply(ap.pause(run.cfg, run.state, run.now))
    assert isinstance(action, Rollback) and action.reason == ap.PAUSED and action.thresholds == OPERATOR
    assert decisions(run)[-1]["source"] == "operator"
    run.now += 10_000
    assert run.observe() == Nothing(ap.PAUSED)
    run.apply(ap.resume(run.cfg, run.state, run.now))
    assert isinstance(run.observe(), StartTrial)


def test_the_kill_switch_returns_to_the_last_operator_version_at_once():
    run, spec = started()
    action, _ = run.run_blocks(spec, 0.20, random.Random(1))
    assert isinstance(action, Promote)  # the autopilot's version is now live
    killed = run.apply(ap.kill(run.cfg, run.state, run.now))
    assert killed == Rollback(None, ap.KILLED, OPERATOR, OPERATOR_VERSION)
    assert run.state.mode is Mode.OFF
    assert run.records[-1]["kind"] == rec.MODE and run.records[-1]["reason"] == "kill"
    run.now += 10_000
    assert run.observe() == Nothing("off")


def test_the_kill_switch_ends_a_running_trial():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(13), until=6)
    killed = run.apply(ap.kill(run.cfg, run.state, run.now))
    assert isinstance(killed, Rollback) and killed.trial_id == spec.trial_id and killed.reason == ap.KILLED
    assert run.state.trial is None and run.state.mode is Mode.OFF


def test_switching_off_mid_trial_rolls_back():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(14), until=4)
    action = run.set_mode(Mode.OFF)
    assert isinstance(action, Rollback) and action.reason == ap.MODE_CHANGED


def test_the_operator_taking_over_mid_trial_ends_it():
    run, spec = started()
    run.run_blocks(spec, 0.0, random.Random(15), until=4)
    assert isinstance(run.observe(frozen=True), Rollback)
    run, spec = started()
    action = run.observe(operator_version=OPERATOR_VERSION + 1)
    assert isinstance(action, Nothing) and decisions(run)[-1]["reason"] == ap.OPERATOR_CHANGE


# ---------------------------------------------------------------------- the trigger's refusals


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"frozen": True}, trigger.FROZEN),
        ({"change_pending": True}, trigger.PENDING),
        ({"circuit_open": True}, trigger.CIRCUIT_OPEN),
        ({"regret": 0.02}, trigger.REGRET_BELOW),
        ({"regret": None}, trigger.REGRET_BELOW),
        ({"priced_samples": 999}, trigger.TOO_FEW_SAMPLES),
        ({"advice_saving": 0.004}, trigger.SAVING_SMALL),
        ({"advice_changes": {}}, trigger.NO_ADVICE),
        ({"advice_changes": {"min_seq_len": 1536}}, trigger.NO_ADVICE),
        ({"advice_changes": {"min_seq_len": 9000}}, trigger.OUT_OF_BOUNDS),
        ({"advice_changes": {"lpt_qblocks_always": 64}}, trigger.OUT_OF_BOUNDS),
        ({"advice_changes": {"block_size": 32}}, trigger.RESTART_ONLY),
        ({"advice_changes": {"decode_path": "prefill"}}, trigger.RESTART_ONLY),
        ({"advice_changes": {"decode_path": "prefill"}, "restart_only": frozenset()}, trigger.START_ONLY),
        ({"advice_changes": {"block_m": 100}}, trigger.INVALID),
    ],
)
def test_each_trigger_refusal_is_named(kw, code):
    run = Run(config())
    run.set_mode(Mode.AUTO)
    action = run.observe(**kw)
    assert isinstance(action, Nothing) and action.reason.split(":")[0] == code
    assert run.state.trial is None and [r["kind"] for r in run.records] == [rec.MODE]


def test_a_start_only_refusal_names_the_field():
    got = trigger.check(
        config(),
        observation(0.0, advice_changes={"decode_path": "prefill"}, restart_only=frozenset()),
        busy=None,
        cooldown_until=0.0,
        number=1,
    )
    assert got == trigger.Refusal(trigger.START_ONLY, "trial.candidate.decode_path")


def test_the_cool_down_and_the_trial_in_progress_refuse_by_name():
    run, _ = started()
    assert run.observe() == Nothing(trigger.BUSY)
    got = trigger.check(config(), observation(10.0), busy=None, cooldown_until=20.0, number=1)
    assert isinstance(got, trigger.Refusal) and got.code == trigger.COOLDOWN


def test_the_candidate_never_leaves_the_operators_bounds():
    bounds = {"min_seq_len": KnobBound(1536, 2047)}
    got = trigger.check(
        config(), observation(0.0, knob_bounds=bounds), busy=None, cooldown_until=0.0, number=1
    )
    assert got == trigger.Refusal(trigger.OUT_OF_BOUNDS, "min_seq_len")


# ---------------------------------------------------------------------- inputs and records


def test_settings_out_of_range_are_refused_by_name():
    with pytest.raises(InputError) as e:
        AutopilotConfig(regret_bound=float("nan"))
    assert e.value.field == "regret_bound"
    with pytest.raises(InputError) as e:
        AutopilotConfig(test=SequentialConfig(max_pairs=200_000))
    assert e.value.field == "test.max_pairs"
    with pytest.raises(InputError) as e:
        AutopilotConfig(test=SequentialConfig(cuped=True))
    assert e.value.field == "test.cuped"
    with pytest.raises(InputError) as e:
        observation(0.0, priced_samples=True)
    assert e.value.field == "priced_samples"
    with pytest.raises(InputError):
        KnobBound(10, 5)


def test_every_record_of_a_long_trial_is_bounded_and_plain_json():
    run, spec = started(test=SequentialConfig(max_pairs=200))
    run.run_blocks(spec, 0.0, random.Random(16), cv=0.3)
    kinds = [r["kind"] for r in run.records]
    assert kinds[:2] == [rec.MODE, rec.START] and kinds[-1] == rec.DECISION
    assert kinds.count(rec.PAIRS) == -(-200 // rec.PAIRS_PER_RECORD)
    for r in run.records:
        text = json.dumps(r, sort_keys=True, allow_nan=False)
        assert len(text.encode()) <= rec.MAX_RECORD_BYTES
        assert parsed.parse_record(json.loads(text)) is not None
    assert Thresholds.parse({**OPERATOR.model_dump(), **ADVICE}) == spec.candidate


def test_a_candidate_block_within_the_limit_ends_the_slow_streak():
    """slow, within, slow: never two slow candidate blocks in a row, so no rollback."""
    run, spec = started()
    plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
    cand = [b for b in range(6, 60) if plan.arm_of_block(b) == 1]
    slow = set(cand[0::2])  # every other candidate block slow

    def alternating(s, b, now, pt):  # type: ignore[no-untyped-def]
        m = block(s, b, now, pt)
        return replace(m, step_s=0.030 * (3.0 if b in slow else 1.0))

    run.run_blocks(spec, 0.0, random.Random(5), until=60, measure=alternating)
    assert run.state.trial is not None
    assert all(d.get("guardrail") is None for d in decisions(run))


def test_a_block_that_reports_no_wall_time_neither_ends_a_streak_nor_blinds_the_guardrail():
    """A step time of 0 says nothing: a candidate block's does not reset the streak, a current
    block's does not become the reference (a ratio against 0 would judge nothing after it)."""
    run, spec = started()
    plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
    cand = [b for b in range(6, 60) if plan.arm_of_block(b) == 1]
    zero_cand = cand[1]  # between two slow candidate blocks
    zero_cur = next(b for b in range(6, 60) if plan.arm_of_block(b) == 0)

    def odd(s, b, now, pt):  # type: ignore[no-untyped-def]
        m = block(s, b, now, pt)
        if b in (zero_cand, zero_cur):
            return replace(m, step_s=0.0)
        return replace(m, step_s=0.030 * (3.0 if m.arm == 1 and b >= cand[0] else 1.0))

    action, b = run.run_blocks(spec, 0.0, random.Random(5), until=60, measure=odd)
    assert isinstance(action, Rollback) and action.reason == rec.STEP_TIME
    assert b == cand[2]  # cand[0] slow, cand[1] unmeasured, cand[2] slow: the second in a row
