"""The exploration-cost bound: a trial's expected extra cost (the candidate's blocks before the
decision times its slowdown, at the worst slowdown) over its plan's attention time, measured with
the real decision code; the trigger's refusal when a plan is too short for it; the setting, the
sidecar's flag and the start record's field, each refused by name when out of range."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from autopilot_rig import OPERATOR_VERSION, Run, config, observation
from typer.testing import CliRunner

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import exploration as ex
from flyserve.autopilot import trigger
from flyserve.autopilot.actions import Promote, TrialSpec
from flyserve.autopilot.audit_parse import StartRecord, parse_record
from flyserve.autopilot.audit_records import AuditRecordError
from flyserve.autopilot.inputs import AutopilotConfig, InputError, Mode
from flyserve.autopilot.replay import replay
from flyserve.autopilot.sequential import SequentialConfig
from flyserve.autopilot.trials import SyntheticBlocks, run_trial, scenario_rng

BOUNDED = 0.005
"""The default bound (the rig's config turns it off: its budgets are short on purpose)."""


def _check(cfg: AutopilotConfig, **obs: Any) -> TrialSpec | trigger.Refusal:
    return trigger.check(cfg, observation(1000.0, **obs), busy=None, cooldown_until=0.0, number=1)


# ---------------------------------------------------------------------- the measurement


def test_the_all_prefixes_rule_reaches_the_decision_pair_by_pair_decide_reaches():
    """Every trial's decision pair, found over all prefixes at once, is the one run_trial (the
    pair-by-pair loop of ``flyserve autopilot trials``) reaches, from the same seeded pairs."""
    cfg = SequentialConfig(max_pairs=80)
    for d in (0.005, 0.05, 0.5, 1.0):
        blocks = SyntheticBlocks(effect=-d, cv=0.10, noise=ex.NOISE)
        want = [run_trial(cfg, blocks, scenario_rng(ex.SEED, -d, i)).pairs for i in range(12)]
        assert ex._mean_candidate_blocks(cfg, d, 0.10, 12) == sum(want) / 12, d


def test_a_limit_no_plan_can_exceed_measures_nothing():
    assert ex.MAX_SHARE == 0.5  # at most half the plan is the candidate's, each block at most 100% slower
    assert trigger.exploration_estimate(config(max_exploration_share=ex.MAX_SHARE)) is None
    assert trigger.exploration_refusal(config(max_exploration_share=ex.MAX_SHARE)) is None


def test_larger_budgets_get_fewer_trials_never_below_the_floor():
    assert ex.trials_for(300) == ex.trials_for(1500) == ex.TRIALS
    assert ex.trials_for(15_000) == 20 == ex.MIN_TRIALS and ex.trials_for(100_000) == ex.MIN_TRIALS


def test_the_estimate_refuses_cuped_and_a_bad_cv():
    with pytest.raises(ValueError, match="cuped"):
        ex.expected_exploration(SequentialConfig(cuped=True), 0.1)
    for cv in (0.0, -0.1, math.nan, math.inf, 2.5):
        with pytest.raises(ValueError, match="cv"):
            ex.expected_exploration(SequentialConfig(), cv)


@pytest.mark.slow  # 1.5-3 s on the 2-core VM: the defaults' and a 200-pair plan's 1,800 trials each
def test_the_defaults_are_inside_the_bound_and_a_shorter_plan_costs_a_larger_share():
    est = ex.expected_exploration(SequentialConfig(), 0.10)
    assert est.plan_blocks == 3000 and [r.slowdown for r in est.rows] == list(ex.SLOWDOWNS)
    # measured: worst at 1% slower, about 750 candidate blocks, 7.5 blocks' worth: 0.25% of 3000
    assert 4.0 < est.worst.cost_blocks < 10.0 and est.worst.slowdown <= 0.05
    assert 0.0015 < est.share < 0.004
    assert est.share <= AutopilotConfig().max_exploration_share
    by = {r.slowdown: r for r in est.rows}
    assert by[1.0].candidate_blocks < 10 and by[0.02].candidate_blocks > by[0.1].candidate_blocks
    short = ex.expected_exploration(SequentialConfig(max_pairs=200), 0.10)
    assert short.plan_blocks == 400 and short.share > 2 * est.share
    assert ex.expected_exploration(SequentialConfig(), 0.10) is est  # measured once


@pytest.mark.slow  # shares the measurement above (cached), 1.5-3 s when run alone
def test_the_trigger_refuses_a_plan_too_short_for_the_bound_and_starts_a_long_enough_one():
    short = config(max_exploration_share=BOUNDED, test=SequentialConfig(max_pairs=200))
    got = _check(short)
    assert isinstance(got, trigger.Refusal) and got.code == trigger.EXPLORATION_COST
    assert "of the plan's attention time" in got.detail and "bound 0.50%" in got.detail
    assert "400 blocks" in got.detail and "--autopilot-max-blocks" in got.detail
    # after the cool-down (config only, cheaper first), before the window's figures
    assert isinstance(_check(short, priced_samples=0), trigger.Refusal)
    assert _check(short, priced_samples=0).code == trigger.EXPLORATION_COST  # type: ignore[union-attr]
    refused = trigger.check(short, observation(1000.0), busy=None, cooldown_until=2000.0, number=1)
    assert isinstance(refused, trigger.Refusal) and refused.code == trigger.COOLDOWN
    # the same settings with the default budget start, and the start record carries the share
    long = config(max_exploration_share=BOUNDED, test=SequentialConfig())
    assert isinstance(_check(long), TrialSpec)
    run = Run(long)
    run.set_mode(Mode.AUTO)
    spec = run.start()
    assert spec.blocks == 3000
    [start] = [r for r in run.records if r["kind"] == rec.START]
    share = ex.expected_exploration(SequentialConfig(), 0.10).share
    assert start["expected_exploration_share"] == share
    parsed = parse_record(json.loads(json.dumps(start)))
    assert isinstance(parsed, StartRecord) and parsed.expected_exploration_share == share


def test_the_refusals_keep_their_order():
    codes = trigger.REFUSALS
    assert codes.index(trigger.COOLDOWN) + 1 == codes.index(trigger.EXPLORATION_COST)
    assert codes.index(trigger.EXPLORATION_COST) + 1 == codes.index(trigger.TOO_FEW_SAMPLES)


# ---------------------------------------------------------------------- the settings


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"max_exploration_share": 0.0}, "max_exploration_share"),
        ({"max_exploration_share": 1.0}, "max_exploration_share"),
        ({"max_exploration_share": -0.01}, "max_exploration_share"),
        ({"max_exploration_share": math.nan}, "max_exploration_share"),
        ({"max_exploration_share": math.inf}, "max_exploration_share"),
        ({"max_exploration_share": True}, "max_exploration_share"),
        ({"max_exploration_share": "0.005"}, "max_exploration_share"),
        ({"assumed_cv": 0.0}, "assumed_cv"),
        ({"assumed_cv": 2.5}, "assumed_cv"),
        ({"assumed_cv": math.nan}, "assumed_cv"),
    ],
)
def test_a_setting_out_of_range_is_refused_by_field(kw, field):
    with pytest.raises(InputError) as got:
        AutopilotConfig(**kw)
    assert got.value.field == field


def test_the_defaults():
    cfg = AutopilotConfig()
    assert cfg.max_exploration_share == 0.005 and cfg.assumed_cv == 0.10


# ---------------------------------------------------------------------- the start record


def _start_record(**kw: Any) -> dict[str, Any]:
    return rec.start_record(
        time=1.0,
        trial="ap-3-1",
        mode="auto",
        operator_version=3,
        seed=7,
        block_steps=32,
        blocks=3000,
        changes={"min_seq_len": (1024, 2048)},
        regret=0.05,
        priced_samples=5000,
        saving=0.02,
        test=SequentialConfig(),
        guard={k: 1.0 for k in rec.GUARD_KEYS},
        **kw,
    )


def test_the_start_record_reads_back_with_without_and_with_a_null_share():
    with_share = parse_record(json.loads(json.dumps(_start_record(expected_exploration_share=0.0025))))
    assert isinstance(with_share, StartRecord) and with_share.expected_exploration_share == 0.0025
    null = parse_record(json.loads(json.dumps(_start_record())))
    assert isinstance(null, StartRecord) and null.expected_exploration_share is None
    old = {k: v for k, v in _start_record().items() if k != "expected_exploration_share"}
    parsed = parse_record(old)
    assert isinstance(parsed, StartRecord) and parsed.expected_exploration_share is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1.5, -0.1, "0.1", True, 10**400, [0.1]])
def test_a_bad_share_in_a_start_record_is_refused_by_field(bad):
    with pytest.raises(AuditRecordError) as got:
        parse_record({**_start_record(), "expected_exploration_share": bad})
    assert got.value.field == "expected_exploration_share"


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("1.5", "expected_exploration_share"),
        ('"0.1"', "expected_exploration_share"),
        ("NaN", "<line>"),  # the log's reader refuses NaN and Infinity before any field
        ("Infinity", "<line>"),
        ("1e999", "<line>"),
    ],
)
def test_replay_names_a_bad_share(bad, field):
    text = json.dumps(_start_record(expected_exploration_share=0.25)).replace(
        '"expected_exploration_share": 0.25', f'"expected_exploration_share": {bad}'
    )
    report = replay([text])
    assert [(b.line, b.field) for b in report.bad] == [(1, field)]


def test_replay_agrees_with_or_without_the_share_in_the_start_record():
    run = Run(config())
    run.set_mode(Mode.AUTO)
    spec = run.start()
    assert isinstance(run.run_blocks(spec, 0.20, random.Random(1))[0], Promote)
    assert spec.trial_id == f"ap-{OPERATOR_VERSION}-1"
    lines = [json.dumps(r) for r in run.records]
    without = [
        json.dumps({k: v for k, v in r.items() if k != "expected_exploration_share"}) for r in run.records
    ]
    valued = [
        json.dumps({**r, "expected_exploration_share": 0.003} if r["kind"] == rec.START else r)
        for r in run.records
    ]
    for variant in (lines, without, valued):
        report = replay(variant)
        assert report.ok and [t.agrees for t in report.trials] == [True]


# ---------------------------------------------------------------------- the sidecar's flag


@pytest.mark.parametrize("bad", ["0", "1", "-0.1", "nan", "1.5"])
def test_the_sidecar_flag_out_of_range_is_refused_by_name(tmp_path, bad):
    from flyserve.cli import app

    r = CliRunner().invoke(
        app, ["sidecar", "--state-dir", str(tmp_path / "s"), "--autopilot-max-exploration-share", bad]
    )
    assert r.exit_code == 2 and "--autopilot-max-exploration-share" in r.output, r.output
    assert not (tmp_path / "s").exists()  # refused before anything was created


def test_the_sidecar_setting_reaches_the_state_machine(tmp_path):
    from flyserve.sidecar.settings import SidecarSettings

    settings = SidecarSettings(state_dir=tmp_path, autopilot_max_exploration_share=0.01)
    assert settings.autopilot_config().max_exploration_share == 0.01
    for bad in (0.0, 1.0, math.nan):
        with pytest.raises(ValueError, match="autopilot_max_exploration_share"):
            SidecarSettings(state_dir=tmp_path, autopilot_max_exploration_share=bad)
