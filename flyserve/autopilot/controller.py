"""The autopilot's state machine: modes, the trigger, a trial block pair by block pair, guardrails,
the decision and its audit records. Pure: every function takes the config, the state and a plain
input and returns the next state, one action and the audit records to write; no clock, no I/O.

The caller (the sidecar) calls ``observe`` about once a second with what it sees (an Observation),
``on_block`` once per block of a running trial with the block's measurement, ``approve`` when an
operator approves a promotion, and ``set_mode``/``pause``/``resume``/``kill`` from its surfaces.
It publishes the version each action names and appends each record to the audit log; from those
records alone ``flyserve autopilot replay`` recomputes every decision.

Measured, never priced: a pair's figure is the two blocks' measured kernel seconds per token (from
corroborated samples only); the cost table only proposes the candidate (the advice). Blocks are
paired as the switchback plan pairs them, and the sequential test decides after every pair.
The state it passes along is in state.py, the guardrails' tallies and limits in guardrails.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import trigger
from flyserve.autopilot.actions import (
    Action,
    AwaitApproval,
    Nothing,
    Promote,
    ProposeTrial,
    Rollback,
    StartTrial,
    TrialSpec,
)
from flyserve.autopilot.guardrails import breached, tally
from flyserve.autopilot.inputs import AutopilotConfig, BlockMeasurement, Mode, Observation
from flyserve.autopilot.sequential import Decision, SequentialState, Verdict, decide
from flyserve.autopilot.state import AutopilotState, Awaiting, Outcome, RunningTrial
from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.policy.thresholds import Thresholds

# Reasons an operator-side event ends a trial (decision records, source "operator").
PAUSED = "paused"
OFF = "off"
KILLED = "kill switch"
MODE_CHANGED = "mode changed"
FROZEN = "control frozen"
OPERATOR_CHANGE = "operator change"
PLAN_ENDED = "plan ended"
"""The plan's last block passed with the test still running (some blocks did not count)."""
RUNNER_LAGGED = "runner lagged"
"""The caller fell behind the ranks' reports: blocks it never read are gone (decision source "test",
verdict inconclusive: nothing was measured against the candidate)."""
START_NOT_PUBLISHED = "start not published"
"""The version that carried the trial was refused (decision source "publish"; its reason adds why)."""

# Reasons a block is not used (Nothing's reason).
NOT_THIS_TRIAL = "block of no running trial"
STALE_BLOCK = "stale or repeated block"
WRONG_ARM = "arm does not match the plan"
BEYOND_PLAN = "block beyond the plan"


def _empty_decision(config: AutopilotConfig, test: SequentialState) -> Decision:
    return decide(config.test, test)


def _exploration_share(config: AutopilotConfig) -> float | None:
    """The share the trigger held the plan to (None: the bound is off: the limit is one no plan exceeds)."""
    est = trigger.exploration_estimate(config)
    return None if est is None else est.share


def _guard_settings(config: AutopilotConfig) -> dict[str, float]:
    return {k: float(getattr(config, k)) for k in rec.GUARD_KEYS}


# ---------------------------------------------------------------------------- ending a trial


def _flush(t: RunningTrial, now: float) -> tuple[RunningTrial, list[dict[str, Any]]]:
    """Pair-summary records for the unwritten pairs (all of them)."""
    out: list[dict[str, Any]] = []
    chain, written, rest = t.chain, t.written, t.unwritten
    while rest:
        chunk, rest = rest[: rec.PAIRS_PER_RECORD], rest[rec.PAIRS_PER_RECORD :]
        r = rec.pairs_record(
            time=now, trial=t.spec.trial_id, first=written, pairs=chunk, previous_chain=chain
        )
        out.append(r)
        chain, written = r["chain"], written + len(chunk)
    return replace(t, unwritten=(), written=written, chain=chain), out


def _end(
    config: AutopilotConfig,
    state: AutopilotState,
    now: float,
    *,
    verdict: str,
    reason: str,
    source: str,
    guardrail: tuple[str, float, float] | None = None,
) -> Outcome:
    """Close the running trial: flush its pairs, write the decision, start the cool-down and say
    what to publish (the candidate, the operator's thresholds, or nothing more)."""
    t = state.trial
    assert t is not None
    t, records = _flush(t, now)
    spec = t.spec
    statistic = t.decision if t.decision is not None else _empty_decision(config, t.test)
    to_version = state.operator_version if state.operator_version is not None else spec.operator_version
    to_thresholds = state.operator_thresholds or _current_arm(spec)
    cooled = replace(state, trial=None, cooldown_until=now + config.cooldown_s)
    action: Action
    if verdict == Verdict.PROMOTE.value and state.mode is Mode.AUTO:
        act, result_version = "promote", None
        action = Promote(spec.trial_id, spec.candidate)
    elif verdict == Verdict.PROMOTE.value:
        act, result_version = "await-approval", to_version
        action = AwaitApproval(spec.trial_id, to_thresholds, to_version)
        cooled = replace(cooled, awaiting=Awaiting(spec, now))
    else:
        act, result_version = "rollback", to_version
        action = Rollback(spec.trial_id, reason, to_thresholds, to_version)
    records.append(
        rec.decision_record(
            time=now,
            trial=spec.trial_id,
            verdict=verdict,
            reason=reason,
            source=source,
            statistic=statistic,
            guardrail=guardrail,
            blocks=t.next_block,
            chain=t.chain,
            action=act,
            result_version=result_version,
        )
    )
    return Outcome(cooled, action, tuple(records))


def _current_arm(spec: TrialSpec) -> Thresholds:
    """The operator's thresholds the trial ran over: the candidate with its changes undone."""
    return spec.candidate.merged({k: a for k, (a, _) in spec.changes.items()})


def _end_by_operator(config: AutopilotConfig, state: AutopilotState, now: float, reason: str) -> Outcome:
    return _end(config, state, now, verdict="rollback", reason=reason, source=rec.BY_OPERATOR)


def start_not_published(
    config: AutopilotConfig, state: AutopilotState, trial_id: str, why: str, now: float
) -> Outcome:
    """The caller could not publish the version that starts ``trial_id`` (``why``: a short
    category, never the error's text): the trial never ran, so it ends now, with nothing to publish
    back, audited and followed by the cool-down (a refused candidate is not retried at once)."""
    t = state.trial
    if t is None or t.spec.trial_id != trial_id:
        return Outcome(state, Nothing(NOT_THIS_TRIAL))
    record = rec.decision_record(
        time=now,
        trial=trial_id,
        verdict="rollback",
        reason=f"{START_NOT_PUBLISHED}: {why}",
        source=rec.BY_PUBLISH,
        statistic=_empty_decision(config, t.test),
        guardrail=None,
        blocks=0,
        chain=t.chain,
        action="rollback",
        result_version=None,
    )
    cooled = replace(state, trial=None, cooldown_until=now + config.cooldown_s)
    return Outcome(cooled, Nothing(f"trial {trial_id}: {START_NOT_PUBLISHED}: {why}"), (record,))


def end_runner_lagged(config: AutopilotConfig, state: AutopilotState, now: float) -> Outcome:
    """The caller's next block is older than the oldest block a rank still reports: the blocks in
    between are lost, and feeding them as empty would trip the samples-stopped guardrail and blame
    the candidate. The trial ends inconclusive instead, its operator's thresholds published back."""
    if state.trial is None:
        return Outcome(state, Nothing(NOT_THIS_TRIAL))
    return _end(config, state, now, verdict="inconclusive", reason=RUNNER_LAGGED, source=rec.BY_TEST)


# ---------------------------------------------------------------------------- observe


def observe(config: AutopilotConfig, state: AutopilotState, obs: Observation) -> Outcome:
    """What to do now, given what the sidecar sees: start (or propose) a trial, end one the
    operator's side overtook (frozen, an operator change, the circuit, samples stopped), drop an
    approval that waited too long, or nothing, with the reason."""
    state = replace(state, operator_version=obs.operator_version, operator_thresholds=obs.operator_thresholds)
    now = obs.now
    if state.awaiting is not None and now > state.awaiting.since + config.approval_wait_s:
        spec = state.awaiting.spec
        record = rec.approval_record(time=now, trial=spec.trial_id, actor="", action="expired")
        state = replace(state, awaiting=None)
        return Outcome(state, Nothing(f"approval of {spec.trial_id} expired"), (record,))
    if state.awaiting is not None and obs.operator_version != state.awaiting.spec.operator_version:
        return drop_stale_approval(state, now)
    t = state.trial
    if t is not None:
        if obs.frozen:
            return _end_by_operator(config, state, now, FROZEN)
        if obs.change_pending or obs.operator_version != t.spec.operator_version:
            out = _end_by_operator(config, state, now, OPERATOR_CHANGE)
            return Outcome(out.state, Nothing(f"trial ended: {OPERATOR_CHANGE}"), out.records)
        if obs.circuit_open:
            return _end(
                config,
                state,
                now,
                verdict="rollback",
                reason=rec.CIRCUIT_OPENED,
                source=rec.BY_GUARDRAIL,
                guardrail=(rec.CIRCUIT_OPENED, 1.0, 1.0),
            )
        quiet = now - max(t.last_block_time, t.started)
        if quiet >= config.block_timeout_s:
            return _end(
                config,
                state,
                now,
                verdict="rollback",
                reason=rec.SAMPLES_STOPPED,
                source=rec.BY_GUARDRAIL,
                guardrail=(rec.SAMPLES_STOPPED, quiet, config.block_timeout_s),
            )
        return Outcome(state, Nothing(trigger.BUSY))
    if state.mode is Mode.OFF:
        return Outcome(state, Nothing(OFF))
    if state.paused:
        return Outcome(state, Nothing(PAUSED))
    busy = trigger.AWAITING if state.awaiting is not None else None
    got = trigger.check(
        config, obs, busy=busy, cooldown_until=state.cooldown_until, number=state.trials_started + 1
    )
    if isinstance(got, trigger.Refusal):
        return Outcome(state, Nothing(str(got)))
    if state.mode is Mode.ADVISE:
        return Outcome(state, ProposeTrial(got))
    record = rec.start_record(
        time=now,
        trial=got.trial_id,
        mode=state.mode.value,
        operator_version=got.operator_version,
        seed=got.seed,
        block_steps=got.block_steps,
        blocks=got.blocks,
        changes=got.changes,
        regret=obs.regret,
        priced_samples=obs.priced_samples,
        saving=obs.advice_saving,
        test=config.test,
        guard=_guard_settings(config),
        expected_exploration_share=_exploration_share(config),
    )
    running = RunningTrial(spec=got, started=now, last_block_time=now)
    state = replace(state, trial=running, trials_started=state.trials_started + 1)
    return Outcome(state, StartTrial(got), (record,))


# ---------------------------------------------------------------------------- blocks


def on_block(config: AutopilotConfig, state: AutopilotState, m: BlockMeasurement) -> Outcome:
    """One block of the running trial: guardrails first (a breach rolls back now, so the rollback
    takes effect within a block of the breach), then, when the block completes a pair whose two
    blocks both carry enough corroborated samples, the pair goes to the test and the test decides.

    A block of another trial, out of order, repeated or with the wrong arm for its index (the plan
    says which arm every block runs) changes nothing: a forged report never becomes a pair."""
    t = state.trial
    if t is None or m.trial_id != t.spec.trial_id:
        return Outcome(state, Nothing(NOT_THIS_TRIAL))
    if m.block < t.next_block:
        return Outcome(state, Nothing(STALE_BLOCK))
    if m.block >= t.spec.blocks:
        return Outcome(state, Nothing(BEYOND_PLAN))
    plan = SwitchbackPlan(t.spec.trial_id, t.spec.seed, 0, t.spec.block_steps, t.spec.blocks)
    if plan.arm_of_block(m.block) != m.arm:
        return Outcome(state, Nothing(WRONG_ARM))

    before, t = t, tally(config, t, m)
    breach = breached(config, before, t, m)
    empty = m.corroborated_samples < config.min_block_samples or m.per_token is None
    per_token = None if empty else m.per_token
    pending = t.pending if t.pending is not None and t.pending[0] // 2 == m.block // 2 else None
    test, unwritten, decision, paired = t.test, t.unwritten, t.decision, False
    if m.block % 2 == 0:
        pending = (m.block, per_token)
    elif pending is not None:
        first = pending[1]
        if first is not None and per_token is not None:
            cur, cand = (first, per_token) if m.arm == 1 else (per_token, first)
            test = test.update(config.test, cur, cand)
            unwritten = (*unwritten, (cur, cand))
            decision, paired = decide(config.test, test), True
        pending = None
    t = replace(t, next_block=m.block + 1, pending=pending, test=test, unwritten=unwritten, decision=decision)
    records: list[dict[str, Any]] = []
    if len(t.unwritten) >= rec.PAIRS_PER_RECORD:
        t, records = _flush(t, m.now)
    state = replace(state, trial=t)

    def ended(out: Outcome) -> Outcome:
        return Outcome(out.state, out.action, (*records, *out.records))

    if breach is not None:
        name = breach[0]
        return ended(
            _end(
                config,
                state,
                m.now,
                verdict="rollback",
                reason=name,
                source=rec.BY_GUARDRAIL,
                guardrail=breach,
            )
        )
    if paired and decision is not None and decision.final:
        return ended(
            _end(
                config,
                state,
                m.now,
                verdict=decision.verdict.value,
                reason=decision.reason,
                source=rec.BY_TEST,
            )
        )
    if t.next_block >= t.spec.blocks:
        return ended(
            _end(config, state, m.now, verdict="inconclusive", reason=PLAN_ENDED, source=rec.BY_TEST)
        )
    return Outcome(state, Nothing("block counted" if not empty else "block empty"), tuple(records))


# ---------------------------------------------------------------------------- operator


def approve(config: AutopilotConfig, state: AutopilotState, trial_id: str, now: float, actor: str) -> Outcome:
    """An operator approves the promotion awaiting under ``trial_id``: publish the candidate."""
    a = state.awaiting
    if a is None or a.spec.trial_id != trial_id:
        return Outcome(state, Nothing(f"no promotion awaits approval as {trial_id[:64]!r}"))
    if now > a.since + config.approval_wait_s:
        record = rec.approval_record(time=now, trial=trial_id, actor=actor, action="expired")
        return Outcome(replace(state, awaiting=None), Nothing(f"approval of {trial_id} expired"), (record,))
    record = rec.approval_record(time=now, trial=trial_id, actor=actor, action="promote")
    return Outcome(replace(state, awaiting=None), Promote(trial_id, a.spec.candidate), (record,))


def drop_stale_approval(state: AutopilotState, now: float) -> Outcome:
    """The operator's version moved while a promotion awaited approval: the candidate was built
    on the old version, so approving it would publish over the operator's change; it is dropped."""
    a = state.awaiting
    if a is None:
        return Outcome(state, Nothing("no promotion awaits approval"))
    record = rec.approval_record(time=now, trial=a.spec.trial_id, actor="", action=OPERATOR_CHANGE)
    return Outcome(
        replace(state, awaiting=None), Nothing(f"approval of {a.spec.trial_id}: {OPERATOR_CHANGE}"), (record,)
    )


def end_by_operator_change(config: AutopilotConfig, state: AutopilotState, now: float) -> Outcome:
    """The running trial ends because an operator's version superseded the one carrying it (the
    caller's publish met that version): a rollback by the operator, with nothing left to publish."""
    return _end_by_operator(config, state, now, OPERATOR_CHANGE)


def _mode_change(
    config: AutopilotConfig,
    state: AutopilotState,
    now: float,
    *,
    mode: Mode,
    paused: bool,
    reason: str,
    trial_reason: str,
) -> Outcome:
    record = rec.mode_record(
        time=now, mode_before=state.mode.value, mode=mode.value, paused=paused, reason=reason
    )
    stops = mode in (Mode.OFF, Mode.ADVISE) or paused
    new = replace(state, mode=mode, paused=paused)
    if stops:
        new = replace(new, awaiting=None)
    if stops and state.trial is not None:
        out = _end_by_operator(config, new, now, trial_reason)
        return Outcome(out.state, out.action, (record, *out.records))
    return Outcome(new, Nothing(f"mode {mode.value}{', paused' if paused else ''}"), (record,))


def set_mode(config: AutopilotConfig, state: AutopilotState, mode: Mode, now: float) -> Outcome:
    """Change the mode. To off or advise: a running trial is rolled back, an awaited promotion dropped."""
    return _mode_change(
        config, state, now, mode=mode, paused=state.paused, reason="set", trial_reason=MODE_CHANGED
    )


def pause(config: AutopilotConfig, state: AutopilotState, now: float) -> Outcome:
    """No new trial until resume; a running trial is rolled back, an awaited promotion dropped."""
    return _mode_change(config, state, now, mode=state.mode, paused=True, reason="pause", trial_reason=PAUSED)


def resume(config: AutopilotConfig, state: AutopilotState, now: float) -> Outcome:
    return _mode_change(
        config, state, now, mode=state.mode, paused=False, reason="resume", trial_reason=PAUSED
    )


def kill(config: AutopilotConfig, state: AutopilotState, now: float) -> Outcome:
    """The kill switch: mode off, any trial ended, an awaited promotion dropped, and the last
    operator version published again at once (whatever the autopilot promoted since)."""
    out = _mode_change(config, state, now, mode=Mode.OFF, paused=False, reason="kill", trial_reason=KILLED)
    if isinstance(out.action, Rollback):
        return out
    if state.operator_version is None or state.operator_thresholds is None:
        return Outcome(out.state, Nothing(f"{KILLED}: no operator version observed yet"), out.records)
    back = Rollback(None, KILLED, state.operator_thresholds, state.operator_version)
    return Outcome(out.state, back, out.records)
