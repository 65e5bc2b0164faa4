"""What the sidecar's autopilot shows and counts: the live inputs it is handed, GET /autopilot's
body (its state, views of a trial, a proposal and an ended trial), and the flyserve_autopilot_trials_total outcome
a decision record stands for. Plain functions of frozen values: the runner (autopilot_runner.py)
calls them under its lock."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import controller as ap
from flyserve.autopilot.actions import TrialSpec
from flyserve.autopilot.inputs import Mode
from flyserve.autopilot.state import AutopilotState


@dataclass(frozen=True, slots=True)
class LiveInputs:
    """What the sidecar's pricing and advice say now (the runner asks only when a trial could start).
    ``advice_changes``: {knob: proposed value}; ``advice_saving``: its predicted share of the window's
    routed attention time saved."""

    regret: float | None
    priced_samples: int
    advice_changes: Mapping[str, Any]
    advice_saving: float | None


NO_INPUTS = LiveInputs(None, 0, {}, None)


@dataclass(frozen=True, slots=True)
class DecisionView:
    """One ended trial, as GET /autopilot lists it."""

    trial_id: str
    decision: str
    reason: str
    pairs: int
    effect: float | None
    at: float
    result_version: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "decision": self.decision,
            "reason": self.reason,
            "pairs": self.pairs,
            "effect": self.effect,
            "at": self.at,
            "result_version": self.result_version,
        }


def outcome_of(record: Mapping[str, Any]) -> str | None:
    """The flyserve_autopilot_trials_total outcome a decision or approval record stands for (None:
    no trial ended yet, e.g. a promotion that now awaits approval)."""
    kind = record.get("kind")
    if kind == rec.APPROVAL:
        return "promoted" if record.get("action") == "promote" else "expired"
    if kind != rec.DECISION:
        return None
    verdict, source = record.get("verdict"), record.get("source")
    if verdict == "promote":
        return "promoted" if record.get("action") == "promote" else None
    if verdict == "inconclusive":
        return "inconclusive"
    if source == rec.BY_OPERATOR:
        return "killed" if record.get("reason") == ap.KILLED else "aborted"
    if source == rec.BY_PUBLISH:
        return "refused"
    return "rolled_back"


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def trial_view(st: AutopilotState, arm_now: int) -> dict[str, Any] | None:
    """GET /autopilot's ``trial``: the running trial, or the promotion awaiting approval, or None."""
    t = st.trial
    if t is not None:
        d = t.decision
        return {
            **spec_view(t.spec),
            "blocks_seen": t.next_block,
            "pairs": t.pairs,
            "arm_now": arm_now,
            "estimate": None if d is None else finite_or_none(d.estimate),
            "interval": None if d is None else [finite_or_none(d.lower), finite_or_none(d.upper)],
            "verdict": "continue" if d is None else d.verdict.value,
            "reason": "" if d is None else d.reason,
        }
    if st.awaiting is not None:
        return {
            **spec_view(st.awaiting.spec),
            "blocks_seen": None,
            "pairs": None,
            "arm_now": -1,
            "estimate": None,
            "interval": None,
            "verdict": "promote",
            "reason": "awaiting approval",
        }
    return None


def spec_view(spec: TrialSpec) -> dict[str, Any]:
    return {
        "id": spec.trial_id,
        "changed": {k: [a, b] for k, (a, b) in spec.changes.items()},
        "block_steps": spec.block_steps,
        "blocks": spec.blocks,
        "operator_version": spec.operator_version,
    }


def status_view(
    st: AutopilotState,
    *,
    clock: Callable[[], float],
    arm_now: int,
    proposal: TrialSpec | None,
    last_refusal: str | None,
    owed: dict[str, str] | None,
    decisions: Iterable[DecisionView],
    exploration_bound: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """GET /autopilot's body: the mode, the state (off, rolling_back while a publish is owed,
    running, awaiting_approval, cooldown, idle), the trial, the proposal, the last refusal, the
    owed publish, the decisions kept, newest first, and the exploration-cost bound (the expected
    share of the configured plan, null until the autopilot's thread has measured it, and its limit)."""
    if st.mode is Mode.OFF:
        state = "off"
    elif owed is not None:
        state = "rolling_back"
    elif st.trial is not None:
        state = "running"
    elif st.awaiting is not None:
        state = "awaiting_approval"
    elif clock() < st.cooldown_until:
        state = "cooldown"
    else:
        state = "idle"
    return {
        "mode": st.mode.value,
        "paused": st.paused,
        "state": state,
        "trial": trial_view(st, arm_now),
        "proposal": None if proposal is None else spec_view(proposal),
        "last_refusal": last_refusal,
        "owed_publish": owed,
        "last_decisions": [d.to_dict() for d in reversed(list(decisions))],
        "exploration_bound": exploration_bound,
    }


def decision_view(record: Mapping[str, Any]) -> DecisionView:
    """A decision record as GET /autopilot's last_decisions shows it."""
    stat = record.get("statistic") or {}
    return DecisionView(
        trial_id=str(record.get("trial")),
        decision=str(record.get("verdict")),
        reason=str(record.get("reason")),
        pairs=int(stat.get("pairs") or 0),
        effect=stat.get("estimate"),
        at=float(record.get("time") or 0.0),
        result_version=record.get("result_version"),
    )
