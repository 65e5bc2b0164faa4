"""The switchback in the ranks: the plan, the trial a version carries, and RankControl running it.

What must hold: every rank of an engine runs the same arm at the same step (file polling at any
poll times, and the engine channel), blocks come in pairs with one block of each arm, a plan ends
on the current thresholds by itself, a new version ends a trial at its effective step, a bad trial
field is refused by name, and a trial's step takes the same one compare as any other.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from _hot_path import run_hot_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flyserve.autopilot.switchback import (
    CANDIDATE_ARM,
    CURRENT_ARM,
    MAX_STEP,
    SwitchbackPlan,
    SwitchbackPlanError,
)
from flyserve.control import ControlPlane, RankControl
from flyserve.control.snapshot import ConfigSnapshot, Trial
from flyserve.policy import Thresholds
from flyserve.policy.thresholds import ThresholdsError

# ---------------------------------------------------------------------- the plan


def plan(**kw: object) -> SwitchbackPlan:
    args: dict[str, object] = {"trial_id": "t1", "seed": 7, "first_step": 100, "block_steps": 4, "blocks": 8}
    args.update(kw)
    return SwitchbackPlan(**args)  # type: ignore[arg-type]


def test_blocks_run_from_first_step_to_end_step() -> None:
    p = plan()
    assert p.end_step == 132 and p.pairs == 4
    assert [p.block_of(s) for s in (99, 100, 103, 104, 131, 132)] == [None, 0, 0, 1, 7, None]
    assert [p.next_boundary(s) for s in (0, 99, 100, 103, 104, 131)] == [100, 100, 104, 104, 108, 132]
    assert p.next_boundary(132) is None and p.next_boundary(10**9) is None
    assert p.arm_at(99) == CURRENT_ARM and p.arm_at(132) == CURRENT_ARM


@given(
    trial_id=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True),
    seed=st.integers(0, 2**63 - 1),
    blocks=st.integers(1, 200).map(lambda n: 2 * n),
)
@settings(max_examples=60, deadline=None)
@pytest.mark.slow  # 0.3 s on the 2-core VM: hypothesis examples
def test_each_pair_holds_one_block_of_each_arm(trial_id: str, seed: int, blocks: int) -> None:
    p = plan(trial_id=trial_id, seed=seed, blocks=blocks)
    arms = [p.arm_of_block(b) for b in range(blocks)]
    assert all(sorted(arms[i : i + 2]) == [CURRENT_ARM, CANDIDATE_ARM] for i in range(0, blocks, 2))
    # The same plan computes the same arms anywhere (a fresh object: nothing cached per process)
    assert [plan(trial_id=trial_id, seed=seed, blocks=blocks).arm_of_block(b) for b in range(blocks)] == arms


def test_the_order_inside_a_pair_is_a_coin_flip() -> None:
    """Both orders occur, about half each, and the seed changes them."""
    p, q = plan(blocks=2000), plan(blocks=2000, seed=8)
    first = [p.arm_of_block(2 * i) for i in range(1000)]
    assert 400 < sum(first) < 600
    assert first != [q.arm_of_block(2 * i) for i in range(1000)]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"block_steps": 0}, "block_steps"),
        ({"block_steps": 1.5}, "block_steps"),
        ({"block_steps": float("nan")}, "block_steps"),
        ({"block_steps": True}, "block_steps"),
        ({"block_steps": 1 << 40}, "block_steps"),
        ({"blocks": 7}, "blocks"),
        ({"blocks": 0}, "blocks"),
        ({"blocks": 10**30}, "blocks"),
        ({"seed": -1}, "seed"),
        ({"seed": 1e300}, "seed"),
        ({"first_step": -1}, "first_step"),
        ({"first_step": MAX_STEP}, "blocks"),  # it would end past MAX_STEP
        ({"trial_id": ""}, "trial_id"),
        ({"trial_id": "a\x1b[31m"}, "trial_id"),
        ({"trial_id": 5}, "trial_id"),
    ],
)
def test_a_bad_plan_field_is_refused_by_name(kw: dict[str, object], field: str) -> None:
    with pytest.raises(SwitchbackPlanError) as exc:
        plan(**kw)
    assert exc.value.field == field and field in str(exc.value)


# ---------------------------------------------------------------------- the trial a version carries

CANDIDATE = {"min_seq_len": 4096}


def trial_dict(**kw: object) -> dict[str, object]:
    d: dict[str, object] = {
        "id": "t1",
        "seed": 3,
        "block_steps": 4,
        "blocks": 6,
        "candidate": Thresholds().merged(CANDIDATE).model_dump(),
    }
    d.update(kw)
    return d


def snapshot_doc(plane: ControlPlane, **trial: object) -> dict[str, object]:
    base = plane.snapshot()
    t = Trial.from_dict(trial_dict(), source="test")
    doc = base.replace(version=base.version + 1, trial=t).to_dict()
    doc["trial"] = trial_dict(**trial)
    return doc


def test_a_trial_is_content_and_round_trips(plane: ControlPlane) -> None:
    base = plane.snapshot()
    t = Trial.from_dict(trial_dict(), source="test")
    with_trial = base.replace(trial=t)
    assert with_trial.sha256 != base.sha256  # versions differing only by the trial differ in content
    assert base.replace(trial=Trial.from_dict(trial_dict(seed=4))).sha256 != with_trial.sha256
    back = ConfigSnapshot.from_dict(json.loads(with_trial.to_json()), check_profile=False)
    assert back == with_trial and back.trial == t
    # when is not content: the step a trial starts from (its version's effective step) is not hashed
    assert with_trial.replace(effective_step=5000).sha256 == with_trial.sha256


def test_a_version_without_a_trial_is_the_file_it_was(plane: ControlPlane) -> None:
    base = plane.snapshot()
    d = base.to_dict()
    assert "trial" not in d and base.trial is None and base.arm is None and base.trial_id is None
    assert ConfigSnapshot.from_dict(d, check_profile=False).sha256 == base.sha256


@pytest.mark.parametrize(
    ("trial", "field"),
    [
        ({"block_steps": 0}, "trial.block_steps"),
        ({"block_steps": "4"}, "trial.block_steps"),
        ({"blocks": 5}, "trial.blocks"),
        ({"seed": float("nan")}, "trial.seed"),
        ({"id": "no spaces"}, "trial.id"),
        ({"candidate": {"block_m": 3}}, "trial.candidate.block_m"),
        ({"candidate": {"decode_path": "prefill"}}, "trial.candidate.decode_path"),  # start-only
        ({"candidate": None}, "trial.candidate"),
        ({"extra": 1}, "trial.extra"),
    ],
)
def test_a_bad_trial_field_is_refused_by_name(
    plane: ControlPlane, trial: dict[str, object], field: str
) -> None:
    doc = snapshot_doc(plane, **trial)
    with pytest.raises(ThresholdsError) as exc:
        ConfigSnapshot.from_dict(doc, source="current.json", check_profile=False)
    assert exc.value.field == field, exc.value


def test_a_trial_missing_a_field_is_refused_by_name(plane: ControlPlane) -> None:
    doc = snapshot_doc(plane)
    del doc["trial"]["block_steps"]  # type: ignore[attr-defined]
    with pytest.raises(ThresholdsError) as exc:
        ConfigSnapshot.from_dict(doc, check_profile=False)
    assert exc.value.field == "trial.block_steps"


def test_a_trial_that_would_end_past_the_last_step_is_refused(plane: ControlPlane) -> None:
    doc = snapshot_doc(plane, block_steps=1 << 20, blocks=200_000)
    doc["effective_step"] = MAX_STEP - 10
    with pytest.raises(ThresholdsError) as exc:
        ConfigSnapshot.from_dict(doc, check_profile=False)
    assert exc.value.field == "trial.blocks"


# ---------------------------------------------------------------------- the ranks


def report_step(plane: ControlPlane, step: int, *, engine: int = 0) -> None:
    now = time.time()
    report = {"rank": 9, "engine": engine, "pid": os.getpid(), "started": now - 60, "step": step,
              "steps_per_s": 0.0, "time": now}  # fmt: skip
    plane.store.write_rank_report(report, rank=9, engine=engine)


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)  # margins in steps only
    p.reload(actor="startup", startup=True)
    return p


def publish(
    plane: ControlPlane,
    *,
    at: int,
    trial: dict[str, object] | None = None,
    engine_steps: dict[str, int] | None = None,
) -> ConfigSnapshot:
    """A version effective at ``at`` carrying ``trial`` (the sidecar's part, which is not built:
    the snapshot is written through the store as the plane writes one)."""
    base = plane.snapshot()
    t = None if trial is None else Trial.from_dict(trial_dict(**trial))
    snap = base.replace(version=base.version + 1, effective_step=at, trial=t, engine_steps=engine_steps or {})
    with plane.store.lock():
        plane.store.publish(snap)
    return snap


def test_a_rank_runs_the_arms_block_by_block_and_ends_on_the_current_thresholds(
    plane: ControlPlane,
) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    current = rc.snapshot.thresholds
    candidate = current.merged(CANDIDATE)
    v = publish(plane, at=20, trial={"candidate": candidate.model_dump()})
    rc.poll()
    p = v.plan_for(0)
    assert p is not None and (p.first_step, p.end_step) == (20, 44)
    seen = {step: rc.current(step) for step in range(60)}
    for step, snap in seen.items():
        assert snap.version == (1 if step < 20 else 2)
        block = p.block_of(step)
        if block is None:
            assert snap.arm is None and snap.trial_id is None and snap.thresholds == current
        else:
            want = candidate if p.arm_of_block(block) == CANDIDATE_ARM else current
            assert (snap.arm, snap.trial_id, snap.thresholds) == (p.arm_of_block(block), "t1", want)
    # the arm changes only at block boundaries, and the two arms' snapshots are built once
    assert {id(seen[s]) for s in range(20, 44)} == {id(a) for a in rc._arms}
    assert all(seen[s] is seen[s - 1] for s in range(21, 44) if (s - 20) % 4)
    assert seen[44] is rc.snapshot and seen[59] is rc.snapshot  # the plan's end: the version itself


def test_the_rank_reports_its_block_and_arm(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    assert rc.report_dict()["trial"] is None
    v = publish(plane, at=10, trial={})
    rc.poll()
    p = v.plan_for(0)
    assert p is not None
    rc.current(17)
    assert rc.report_dict()["trial"] == {"id": "t1", "block": 1, "arm": p.arm_of_block(1)}
    rc.current(p.end_step)
    rc.write_report()
    assert json.loads(plane.state_dir.rank_file(0).read_text())["trial"] is None


def test_a_new_version_mid_trial_ends_it_at_its_effective_step(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    publish(plane, at=10, trial={"blocks": 1000})
    rc.poll()
    for step in range(10, 30):
        rc.current(step)
    assert rc.report_dict()["trial"] is not None
    after = publish(plane, at=35)  # no trial: what a rollback publishes
    rc.poll()
    assert [rc.current(s).version for s in (33, 34, 35)] == [2, 2, 3]
    assert rc.current(35) is rc.snapshot and rc.snapshot.sha256 == after.sha256
    assert rc.current(35).arm is None and rc.report_dict()["trial"] is None
    # a version with a new trial starts its blocks at its own effective step
    nxt = publish(plane, at=51, trial={"id": "t2", "seed": 99})
    rc.poll()
    assert rc.current(50).arm is None
    p = nxt.plan_for(0)
    assert p is not None and p.first_step == 51
    assert [rc.current(s).arm for s in range(51, 63)] == [p.arm_at(s) for s in range(51, 63)]
    assert rc.current(51).trial_id == "t2"


def test_each_engine_runs_its_blocks_from_its_own_effective_step(plane: ControlPlane) -> None:
    e0 = RankControl(plane.state_dir, 0, engine=0, report=False)
    e1 = RankControl(plane.state_dir, 0, engine=1, report=False)
    v = publish(plane, at=1000, engine_steps={"0": 1000, "1": 58}, trial={})
    e0.poll()
    e1.poll()
    p0, p1 = v.plan_for(0), v.plan_for(1)
    assert p0 is not None and p1 is not None and (p0.first_step, p1.first_step) == (1000, 58)
    assert [e1.current(s).arm for s in range(56, 90)] == [
        None if p1.block_of(s) is None else p1.arm_at(s) for s in range(56, 90)
    ]
    assert e0.current(900).arm is None and e0.current(1000).arm == p0.arm_at(1000)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    polls=st.lists(st.integers(1, 7), min_size=3, max_size=3),
    offsets=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    versions=st.lists(
        st.tuples(st.integers(0, 1), st.integers(1, 5), st.integers(1, 4)), min_size=1, max_size=4
    ),
)
@pytest.mark.slow  # about 2 s on the 2-core VM: hypothesis examples, each a state directory
def test_ranks_of_one_engine_never_run_different_thresholds_at_one_step(
    tmp_path_factory: pytest.TempPathFactory,
    polls: list[int],
    offsets: list[int],
    versions: list[tuple[int, int, int]],
) -> None:
    """Three ranks poll the files at their own times (every 1..7 steps, from their own offset);
    versions, with or without a trial, are published with the plane's margin of 8 steps (more
    than any rank's poll interval, as the publisher sizes it): at every step all three return
    equal thresholds and the same arm."""
    plane = ControlPlane(tmp_path_factory.mktemp("state"), step_margin=8, lead_s=0.0)
    plane.reload(actor="startup", startup=True)
    ranks = [RankControl(plane.state_dir, r, report=False) for r in range(3)]
    base = ranks[0].snapshot.thresholds
    publish_at, when = {}, 5
    for i, (has_trial, k, pairs) in enumerate(versions):
        publish_at[when] = (has_trial, k, pairs, i)
        when += 10 + 2 * k * pairs // 3
    last = when + 40
    for step in range(last):
        if step in publish_at:
            has_trial, k, pairs, i = publish_at[step]
            cand = base.merged({"min_seq_len": 2048 + i})
            trial = {
                "id": f"t{i}",
                "seed": i,
                "block_steps": k,
                "blocks": 2 * pairs,
                "candidate": cand.model_dump(),
            }
            publish(plane, at=step + 8, trial=trial if has_trial else None)
        got = []
        for r, rc in enumerate(ranks):
            if step % polls[r] == offsets[r] % polls[r]:
                rc.poll()
            got.append(rc.current(step))
        assert len({(g.version, g.arm, g.thresholds) for g in got}) == 1, (
            step,
            [(g.version, g.arm) for g in got],
        )
        assert len({g.sha256 for g in got}) == 1
    assert all(rc.late_applies == 0 for rc in ranks)
    assert all(rc.current(last).arm is None for rc in ranks)  # every plan over: the current thresholds


def test_a_late_rank_joins_the_running_plan_where_its_peers_are(plane: ControlPlane) -> None:
    """File polling cannot keep a rank that learns of a version after its effective step on it
    before then; from the step it applies the version on, it runs the arm its peers run."""
    on_time = RankControl(plane.state_dir, 0, report=False)
    late = RankControl(plane.state_dir, 1, report=False)
    publish(plane, at=10, trial={"blocks": 20})
    on_time.poll()
    for step in range(10, 23):
        on_time.current(step)
        late.current(step)
    late.poll()
    for step in range(23, 120):
        a, b = on_time.current(step), late.current(step)
        assert (a.arm, a.thresholds) == (b.arm, b.thresholds)


def test_the_engine_channel_starts_the_blocks_at_the_step_it_applies_from(plane: ControlPlane) -> None:
    ranks = [RankControl(plane.state_dir, r, report=False) for r in range(2)]
    publish(plane, at=5, trial={"blocks": 100})  # a file-polled trial running when the channel starts
    for rc in ranks:
        rc.poll()
        for step in range(5, 41):
            rc.current(step)
    base = plane.snapshot()
    t = Trial.from_dict(trial_dict(id="pushed", seed=11))
    pushed = base.replace(version=base.version + 1, trial=t, effective_step=999)
    assert [rc.apply_pushed(pushed) for rc in ranks] == [(True, "applied")] * 2
    for rc in ranks:
        p = rc.snapshot.plan_for(0)
        assert p is not None and p.first_step == 41 and rc.snapshot.sha256 == pushed.sha256
    for step in range(41, 41 + 4 * 6 + 10):
        a, b = (rc.current(step) for rc in ranks)
        assert a.arm == b.arm == (None if step >= 65 else p.arm_at(step)) and a.thresholds == b.thresholds
    # a push of no version leaves a running trial running; a refused one too
    again = base.replace(version=base.version + 2, trial=Trial.from_dict(trial_dict(id="p2")))
    rc = ranks[0]
    assert rc.apply_pushed(again) == (True, "applied")
    assert rc.apply_pushed(None) == (False, "switched")
    assert rc.apply_pushed(pushed) == (False, "lower version")
    p2 = rc.snapshot.plan_for(0)
    assert p2 is not None
    assert [rc.current(s).arm for s in range(p2.first_step, p2.end_step)] == [
        p2.arm_at(s) for s in range(p2.first_step, p2.end_step)
    ]


def test_a_rank_that_starts_on_a_trial_version_runs_its_plan(plane: ControlPlane) -> None:
    v = publish(plane, at=30, trial={})
    rc = RankControl(plane.state_dir, 0, report=False)
    p = v.plan_for(0)
    assert p is not None
    assert [rc.current(s).arm for s in range(60)] == [
        None if p.block_of(s) is None else p.arm_at(s) for s in range(60)
    ]


def test_a_trial_step_takes_the_slow_path_once_per_block_and_keeps_nothing(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    v = publish(plane, at=1000, trial={"block_steps": 32, "blocks": 500})
    rc.poll()
    p = v.plan_for(0)
    assert p is not None
    run = run_hot_path(rc, list(range(20_000)))
    # the version's step, then every block boundary up to the plan's end: nothing per step
    assert run.slow_calls == [1000 + 32 * b for b in range(501)]
    assert rc.current(p.end_step) is rc.snapshot
    # what is kept: the version's record and two arm snapshots, and this test's own list of calls
    assert run.retained < 2_000 + 9 * len(run.slow_calls), f"{run.retained} bytes retained over 20000 steps"
