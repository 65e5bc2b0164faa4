"""What the autopilot's state machine asks its caller to do, as plain frozen values.

The caller (the sidecar) publishes versions; the state machine only says which: a version carrying
a trial (StartTrial), the candidate as the thresholds (Promote), the operator's thresholds again
(Rollback, AwaitApproval), or nothing (Nothing, ProposeTrial: advice for a person).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flyserve.control.snapshot import Trial
from flyserve.policy.thresholds import Thresholds


@dataclass(frozen=True)
class TrialSpec:
    """A trial to run: the candidate thresholds (the operator's with ``changes`` laid over them) and
    its blocks. ``trial()`` is what the published version carries (control.snapshot.Trial)."""

    trial_id: str
    seed: int
    block_steps: int
    blocks: int
    candidate: Thresholds
    changes: Mapping[str, tuple[Any, Any]]
    """{field: (operator's value, candidate's value)} for every field the candidate moves."""
    operator_version: int
    """The version whose thresholds are the current arm, and what a rollback returns to."""

    def trial(self) -> Trial:
        return Trial(self.trial_id, self.seed, self.block_steps, self.blocks, self.candidate)


@dataclass(frozen=True)
class StartTrial:
    """Publish the operator's thresholds with ``spec.trial()`` attached."""

    spec: TrialSpec


@dataclass(frozen=True)
class ProposeTrial:
    """Advise mode: this trial would start; nothing is applied."""

    spec: TrialSpec


@dataclass(frozen=True)
class Promote:
    """Publish ``thresholds`` (the trial's candidate) as the thresholds, without a trial."""

    trial_id: str
    thresholds: Thresholds


@dataclass(frozen=True)
class Rollback:
    """Publish ``thresholds`` (operator version ``to_version``'s) without a trial, now: a rollback
    takes effect within one block of its decision. ``trial_id`` None: the kill switch with no trial."""

    trial_id: str | None
    reason: str
    thresholds: Thresholds
    to_version: int


@dataclass(frozen=True)
class AwaitApproval:
    """Trial mode: the candidate measured better; publish the operator's ``thresholds`` (no trial)
    and wait for ``approve(trial_id)``."""

    trial_id: str
    thresholds: Thresholds
    to_version: int


@dataclass(frozen=True)
class Nothing:
    """Nothing to publish; ``reason`` says why (a trigger refusal, a block that did not count, ...)."""

    reason: str


Action = StartTrial | ProposeTrial | Promote | Rollback | AwaitApproval | Nothing
