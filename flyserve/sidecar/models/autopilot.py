"""GET /autopilot and the bodies of its changes: the autopilot's mode, its trial, its decisions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flyserve.sidecar.models.base import FrozenModel, ThresholdValue

ModeName = Literal["off", "advise", "trial", "auto"]


class AutopilotTrialView(FrozenModel):
    """The running trial (or a promotion awaiting approval, or advise mode's proposal)."""

    id: str = Field(description="The trial id, ap-<operator version>-<n>.")
    changed: dict[str, list[ThresholdValue]] = Field(
        description="Each knob the candidate moves: [current, candidate]."
    )
    block_steps: int = Field(description="Engine steps per block (K).")
    blocks: int = Field(description="Blocks the trial's plan holds (the test's budget, twice).")
    operator_version: int = Field(description="The version whose thresholds are the current arm.")
    blocks_seen: int | None = Field(None, description="Blocks handed to the test so far.")
    pairs: int | None = Field(None, description="Block pairs the test has counted.")
    arm_now: int = Field(-1, description="The arm the ranks run now: -1 none, 0 current, 1 candidate.")
    estimate: float | None = Field(
        None,
        description="Relative change of the candidate's kernel time per token against the current "
        "thresholds' (negative: the candidate is faster; -0.2: 20% less time).",
    )
    interval: list[float | None] | None = Field(
        None, description="The confidence sequence's bounds [lo, hi] on that change (null: open)."
    )
    verdict: str | None = Field(None, description="continue, promote, rollback or inconclusive.")
    reason: str | None = Field(None, description="The test's reason for its verdict.")


class AutopilotDecisionView(FrozenModel):
    trial_id: str
    decision: str = Field(description="The verdict: promote, rollback or inconclusive.")
    reason: str
    pairs: int
    effect: float | None = Field(description="The estimate at the decision (negative: candidate faster).")
    at: float = Field(description="Unix time of the decision.")
    result_version: int | None = Field(
        description="The version published: the promoted one, or the operator's rolled back to."
    )


class AutopilotExplorationBound(FrozenModel):
    """The exploration-cost bound the trigger holds a trial's plan to (docs/autopilot.md)."""

    expected_share: float | None = Field(
        description="The configured plan's expected extra cost (the worse arm's blocks times its "
        "slowdown, at the worst slowdown) over its attention time; null until measured (the "
        "autopilot's thread measures it once) or when the limit is one no plan can exceed."
    )
    limit: float = Field(description="--autopilot-max-exploration-share: no trial starts above it.")


class AutopilotOwedPublish(FrozenModel):
    """A version the runner must still publish (a rollback or promotion whose publish failed)."""

    trial: str
    kind: str = Field(description="rollback, promote or await-approval.")
    reason: str


class AutopilotStatus(FrozenModel):
    """GET /autopilot."""

    mode: ModeName
    paused: bool
    state: Literal["idle", "cooldown", "running", "awaiting_approval", "rolling_back", "off"] = Field(
        description="rolling_back: a rollback or promotion publish failed and is retried every tick."
    )
    trial: AutopilotTrialView | None
    proposal: AutopilotTrialView | None = Field(description="Advise mode: the trial that would start.")
    last_refusal: str | None = Field(
        description="Why no trial started at the last look (the trigger's words)."
    )
    owed_publish: AutopilotOwedPublish | None = Field(
        None, description="The publish the runner owes the engine (null: none): retried every tick."
    )
    last_decisions: list[AutopilotDecisionView] = Field(description="The last 20 decisions, newest first.")
    exploration_bound: AutopilotExplorationBound | None = Field(
        None, description="The exploration-cost bound: the configured plan's expected share, and its limit."
    )


class AutopilotModeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    mode: ModeName = Field(description="off, advise, trial or auto.")
