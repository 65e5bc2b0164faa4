"""A rank's per-block tally of a trial (control.trial_blocks): what it adds up from timed samples
only, what its report carries, and every hostile value of a report refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.control.trial_blocks import (
    MAX_REPORTED_BLOCKS,
    BlockEnd,
    TrialBlockMeter,
    TrialBlocksError,
    parse_trial_blocks,
)

PLAN = SwitchbackPlan("ap-1-1", 7, 100, 4, 20)


def _sample_every_step(
    meter: TrialBlockMeter, steps: range, seconds: float = 0.001, tokens: int = 10
) -> None:
    for step in steps:
        block = PLAN.block_of(step)
        if block is not None:
            meter.add(PLAN, block, seconds, tokens)


def test_blocks_before_the_current_step_are_finished_and_summed() -> None:
    meter = TrialBlockMeter()
    _sample_every_step(meter, range(96, 110))  # blocks 0 and 1 whole, block 2 begun (step 108..109)
    got = meter.report(PLAN, 110)
    assert got is not None and got.trial_id == "ap-1-1" and got.through == 1
    assert [(b.block, b.samples, b.tokens) for b in got.blocks] == [(0, 4, 40), (1, 4, 40)]
    assert [b.arm for b in got.blocks] == [PLAN.arm_of_block(0), PLAN.arm_of_block(1)]
    assert got.blocks[0].kernel_seconds == pytest.approx(0.004)
    # the plan's end: every block passed, the open one closed
    _sample_every_step(meter, range(110, 180))
    end = meter.report(PLAN, 180)
    assert end is not None and end.through == PLAN.blocks - 1
    assert [b.block for b in end.blocks][-1] == PLAN.blocks - 1


def test_a_report_holds_the_newest_blocks_only_and_a_new_trial_starts_afresh() -> None:
    long = SwitchbackPlan("ap-1-2", 7, 0, 1, 200)
    meter = TrialBlockMeter()
    for step in range(150):
        meter.add(long, step, 0.001, 1)
    got = meter.report(long, 150)
    assert got is not None and len(got.blocks) == MAX_REPORTED_BLOCKS and got.blocks[-1].block == 149
    meter.add(PLAN, 0, 0.001, 1)
    fresh = meter.report(PLAN, 104)
    assert fresh is not None and fresh.trial_id == "ap-1-1" and [b.block for b in fresh.blocks] == [0]


def test_no_trial_no_report_and_bad_samples_are_dropped() -> None:
    meter = TrialBlockMeter()
    assert meter.report(None, 5) is None
    meter.add(PLAN, 0, float("nan"), 10)
    meter.add(PLAN, 0, -1.0, 10)
    got = meter.report(PLAN, 104)
    assert got is not None and got.blocks == ()


def test_a_report_round_trips_through_json() -> None:
    meter = TrialBlockMeter()
    _sample_every_step(meter, range(100, 112))
    got = meter.report(PLAN, 112)
    assert got is not None
    assert parse_trial_blocks(json.loads(json.dumps(got.to_dict()))) == got


GOOD: dict[str, Any] = {
    "id": "ap-1-1",
    "through": 3,
    "blocks": [{"block": 2, "arm": 0, "kernel_seconds": 0.5, "tokens": 100, "samples": 9}],
}


def _with_block(**kw: Any) -> dict[str, Any]:
    return {**GOOD, "blocks": [{**GOOD["blocks"][0], **kw}]}


@pytest.mark.parametrize(
    ("report", "field"),
    [
        (_with_block(kernel_seconds=float("nan")), "trial_blocks.blocks[0].kernel_seconds"),
        (_with_block(kernel_seconds=float("inf")), "trial_blocks.blocks[0].kernel_seconds"),
        (_with_block(kernel_seconds=-1.0), "trial_blocks.blocks[0].kernel_seconds"),
        (_with_block(kernel_seconds=10**5000), "trial_blocks.blocks[0].kernel_seconds"),
        (_with_block(tokens=-5), "trial_blocks.blocks[0].tokens"),
        (_with_block(tokens=10**5000), "trial_blocks.blocks[0].tokens"),
        (_with_block(tokens=1.5), "trial_blocks.blocks[0].tokens"),
        (_with_block(samples=True), "trial_blocks.blocks[0].samples"),
        (_with_block(arm=2), "trial_blocks.blocks[0].arm"),
        (_with_block(block=10**6), "trial_blocks.blocks[0].block"),
        (_with_block(block=5), "trial_blocks.blocks[0].block"),  # beyond 'through'
        (_with_block(extra=1), "trial_blocks.blocks[0].extra"),
        ({**GOOD, "through": 10**6}, "trial_blocks.through"),
        ({**GOOD, "through": -2}, "trial_blocks.through"),
        ({**GOOD, "id": "x" * 100}, "trial_blocks.id"),
        ({**GOOD, "id": "\x1b[31m"}, "trial_blocks.id"),
        ({**GOOD, "blocks": GOOD["blocks"] * 2}, "trial_blocks.blocks[1].block"),  # repeated
        ({**GOOD, "blocks": [GOOD["blocks"][0]] * 10**6}, "trial_blocks.blocks"),
        ({**GOOD, "blocks": "many"}, "trial_blocks.blocks"),
        ({"id": "ap-1-1", "through": 3}, "trial_blocks.blocks"),
        ([1, 2], "trial_blocks"),
    ],
)
def test_hostile_values_are_refused_by_name(report: Any, field: str) -> None:
    with pytest.raises(TrialBlocksError) as got:
        parse_trial_blocks(report)
    assert got.value.field == field


def test_absent_is_none() -> None:
    assert parse_trial_blocks(None) is None


def test_the_rank_report_carries_the_blocks_of_the_running_trial(tmp_path: Any) -> None:
    from flyserve.control import ControlPlane, RankControl
    from flyserve.control.snapshot import Trial

    plane = ControlPlane(tmp_path / "state", step_margin=1, lead_s=0.0)
    cur = plane.snapshot()
    candidate = cur.thresholds.merged({"min_seq_len": cur.thresholds.min_seq_len + 512})
    plane.publish_autopilot(
        cur.thresholds, trial=Trial("ap-0-1", 3, 4, 20, candidate), request={"autopilot": "start"}
    )
    rc = RankControl(plane.state_dir, 0, report=False)
    first = rc.snapshot.step_for(0)
    assert rc.report_dict()["trial_blocks"] == {"id": "ap-0-1", "through": -1, "blocks": []}
    for step in range(first, first + 10):
        snap = rc.current(step)
        rc.record_kernel_sample(step, 0.002 if snap.arm == 1 else 0.001, 50)
    blocks = parse_trial_blocks(rc.report_dict()["trial_blocks"])
    assert blocks is not None and blocks.through == 1
    plan = Trial("ap-0-1", 3, 4, 20, candidate).plan(first)
    for b in blocks.blocks:
        assert b.samples == 4 and b.tokens == 200 and b.arm == plan.arm_of_block(b.block)
        assert b.kernel_seconds == pytest.approx(0.008 if b.arm == 1 else 0.004)


def test_a_block_end_reaches_its_block_whether_it_comes_before_or_after_the_close() -> None:
    meter = TrialBlockMeter()
    _sample_every_step(meter, range(100, 104))  # block 0 (steps 100..103), still open
    meter.end_block(PLAN, 0, BlockEnd(0.02, 3, 1))
    got = meter.report(PLAN, 104)
    assert got is not None
    assert got.blocks[0].step_seconds == 0.02 and (got.blocks[0].fallbacks, got.blocks[0].errors) == (3, 1)
    _sample_every_step(meter, range(104, 108))  # block 1, closed by a report before its end came
    first = meter.report(PLAN, 108)
    assert first is not None and first.blocks[1].step_seconds is None and first.blocks[1].fallbacks == 0
    meter.end_block(PLAN, 1, BlockEnd(0.01, 0, 0))
    then = meter.report(PLAN, 108)
    assert then is not None and then.blocks[1].step_seconds == 0.01
    assert parse_trial_blocks(json.loads(json.dumps(then.to_dict()))) == then


def test_the_rank_times_each_block_and_counts_its_fallbacks_and_errors(tmp_path: Any) -> None:
    from flyserve.control import ControlPlane, RankControl
    from flyserve.control.snapshot import Trial

    plane = ControlPlane(tmp_path / "state", step_margin=1, lead_s=0.0)
    cur = plane.snapshot()
    candidate = cur.thresholds.merged({"min_seq_len": cur.thresholds.min_seq_len + 512})
    plane.publish_autopilot(
        cur.thresholds, trial=Trial("ap-0-1", 3, 4, 20, candidate), request={"autopilot": "start"}
    )
    clock, counts = [0.0], [0, 0]
    rc = RankControl(plane.state_dir, 0, report=False, block_clock=lambda: clock[0])
    rc.count_blocks_with(lambda: (counts[0], counts[1]))
    first = rc.snapshot.step_for(0)
    for step in range(first, first + 10):  # blocks 0 and 1 whole, block 2 begun
        snap = rc.current(step)
        rc.record_kernel_sample(step, 0.001, 50)
        clock[0] += 0.05 if snap.arm == 1 else 0.01  # this step's wall time
        counts[0] += 1 if snap.arm == 1 else 0  # a fallback every candidate step
        counts[1] += 1 if step == first + 1 else 0  # one kernel error, in block 0
    blocks = parse_trial_blocks(rc.report_dict()["trial_blocks"])
    assert blocks is not None and blocks.through == 1 and len(blocks.blocks) == 2
    for b in blocks.blocks:
        assert b.step_seconds == pytest.approx(0.05 if b.arm == 1 else 0.01)
        assert b.fallbacks == (4 if b.arm == 1 else 0)
        assert b.errors == (1 if b.block == 0 else 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("step_seconds", float("nan")),
        ("step_seconds", float("inf")),
        ("step_seconds", -0.5),
        ("step_seconds", 1e9),
        ("step_seconds", 10**400),
        ("fallbacks", -1),
        ("fallbacks", 10**400),
        ("fallbacks", 1.5),
        ("errors", -1),
        ("errors", True),
        ("errors", 10**400),
    ],
)
def test_hostile_guardrail_figures_are_refused_by_name(key: str, value: Any) -> None:
    with pytest.raises(TrialBlocksError) as err:
        parse_trial_blocks(_with_block(**{key: value}))
    assert err.value.field == f"trial_blocks.blocks[0].{key}"


def test_the_recorder_counts_a_blocks_fallbacks_as_the_routing_overrides_only() -> None:
    from flyserve.policy import BatchShape, decision_for
    from flyserve.policy.vocabulary import (
        ADMITTED,
        CIRCUIT_OPEN,
        PREFILL,
        SHORT_CONTEXT,
        UNIFIED,
        UNSUPPORTED,
    )
    from flyserve.telemetry.recorder import DispatchRecorder

    rec = DispatchRecorder(rank=57)
    shape = BatchShape.from_query_lens([512, 1], max_seq_len=2048, num_heads=8)
    before = rec.fallbacks()
    for reason in (CIRCUIT_OPEN, UNSUPPORTED, SHORT_CONTEXT):  # the last is decide()'s own choice
        rec.record(decision_for(UNIFIED, reason), shape, 1, 1)
    rec.record(decision_for(PREFILL, ADMITTED, True), shape, 2, 1)
    assert rec.fallbacks() == before + 2
