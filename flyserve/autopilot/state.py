"""The autopilot's state, as the pure state machine (controller.py) passes it from call to call:
the running trial with its test and guardrail tallies, a promotion awaiting approval, the whole
state, and what one call returns (Outcome). Frozen values: every step builds the next one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot.actions import Action, TrialSpec
from flyserve.autopilot.inputs import Mode
from flyserve.autopilot.sequential import Decision, SequentialState
from flyserve.policy.thresholds import Thresholds


@dataclass(frozen=True)
class RunningTrial:
    """A trial in progress: its spec, the test's running state and the guardrails' tallies."""

    spec: TrialSpec
    started: float
    next_block: int = 0
    test: SequentialState = field(default_factory=SequentialState)
    decision: Decision | None = None
    pending: tuple[int, float | None] | None = None
    """The pair's first block seen: (block, its kernel seconds per token or None when empty)."""
    unwritten: tuple[tuple[float, float], ...] = ()
    """Pairs not yet in a pair-summary record: (current, candidate) seconds per token."""
    written: int = 0
    chain: str = rec.ZERO_CHAIN
    empty_in_row: int = 0
    last_block_time: float = 0.0
    current_step_s: float | None = None
    waiting_step_s: float | None = None
    """A candidate block's mean step time seen before any current block to compare it with."""
    slow_in_row: int = 0
    """Candidate blocks judged in a row whose mean step time was above the step-time limit."""
    current_steps: int = 0
    current_fallbacks: int = 0
    current_errors: int = 0
    candidate_steps: int = 0
    candidate_fallbacks: int = 0
    candidate_errors: int = 0

    @property
    def pairs(self) -> int:
        return self.test.pairs


@dataclass(frozen=True)
class Awaiting:
    """A promotion the test decided in trial mode, waiting for ``approve(trial_id)``."""

    spec: TrialSpec
    since: float


@dataclass(frozen=True)
class AutopilotState:
    mode: Mode = Mode.OFF
    paused: bool = False
    trial: RunningTrial | None = None
    awaiting: Awaiting | None = None
    cooldown_until: float = 0.0
    trials_started: int = 0
    operator_version: int | None = None
    operator_thresholds: Thresholds | None = None
    """The last operator version observed: what a rollback and the kill switch return to."""


@dataclass(frozen=True)
class Outcome:
    state: AutopilotState
    action: Action
    records: tuple[dict[str, Any], ...] = ()
