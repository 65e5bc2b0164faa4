"""When the autopilot starts a trial, and every reason it does not, by name.

A trial is worth its cost (the candidate's blocks run at whatever speed it has) only when the
thresholds measurably cost something: live regret above a bound over a window with enough priced
samples, and advice predicting a saving above a minimum. It must also be safe to run: control not
frozen, no operator change pending, no circuit open, no other trial running or awaiting approval,
the cool-down after the last trial over, a plan long enough that the trial's expected extra cost
stays within its share of the plan's attention time (autopilot.exploration), every knob the candidate moves inside the operator's
bounds, no restart-only knob moved, and nothing that would start a compile (the start-only check
of control.snapshot.Trial, reused). Pure: ``check`` reads its arguments only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from flyserve.autopilot.actions import TrialSpec
from flyserve.autopilot.exploration import MAX_SHARE, ExplorationEstimate, expected_exploration
from flyserve.autopilot.inputs import AutopilotConfig, Observation
from flyserve.autopilot.switchback import MAX_SEED
from flyserve.control.snapshot import Trial
from flyserve.policy.thresholds import ThresholdsError

# The refusals (stable strings: tests, the status and the docs name them).
FROZEN = "control frozen"
PENDING = "operator change pending"
CIRCUIT_OPEN = "circuit open"
BUSY = "trial running"
AWAITING = "awaiting approval"
COOLDOWN = "cool-down"
EXPLORATION_COST = "exploration cost"
TOO_FEW_SAMPLES = "too few priced samples"
REGRET_BELOW = "regret below bound"
NO_ADVICE = "no advice"
SAVING_SMALL = "saving too small"
RESTART_ONLY = "restart-only knob"
OUT_OF_BOUNDS = "out of bounds"
START_ONLY = "would start a compile"
INVALID = "invalid candidate"

REFUSALS: tuple[str, ...] = (
    FROZEN,
    PENDING,
    CIRCUIT_OPEN,
    BUSY,
    AWAITING,
    COOLDOWN,
    EXPLORATION_COST,
    TOO_FEW_SAMPLES,
    REGRET_BELOW,
    NO_ADVICE,
    SAVING_SMALL,
    RESTART_ONLY,
    OUT_OF_BOUNDS,
    START_ONLY,
    INVALID,
)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why no trial starts: ``code`` one of REFUSALS, ``detail`` the figures or fields behind it."""

    code: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


def trial_id_for(operator_version: int, number: int) -> str:
    """``ap-<operator version>-<n>``: the n-th trial of this autopilot, over that version."""
    return f"ap-{operator_version}-{number}"


def seed_for(config_seed: int, trial_id: str) -> int:
    """The trial's coin seed: from the configured seed and the trial id (sha256: the same anywhere)."""
    digest = hashlib.sha256(f"{config_seed}\x1f{trial_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def exploration_estimate(config: AutopilotConfig) -> ExplorationEstimate | None:
    """The expected extra cost of a trial at these settings (measured once per config, then
    cached), or None when ``max_exploration_share`` is at or above MAX_SHARE, which no plan can
    exceed (then nothing is measured). The first call takes about a second at the defaults: the
    sidecar makes it on its autopilot thread, never on a request."""
    if config.max_exploration_share >= MAX_SHARE:
        return None
    return expected_exploration(config.test, config.assumed_cv)


def exploration_refusal(config: AutopilotConfig) -> Refusal | None:
    """EXPLORATION_COST with the figures when the plan is too short for the bound, else None."""
    est = exploration_estimate(config)
    if est is None or est.share <= config.max_exploration_share:
        return None
    worst = est.worst
    return Refusal(
        EXPLORATION_COST,
        f"expected {est.share:.2%} of the plan's attention time ({worst.cost_blocks:.1f} of "
        f"{est.plan_blocks} blocks' worth, {worst.slowdown:.2%} slower, CV {est.cv:g}), bound "
        f"{config.max_exploration_share:.2%}: raise --autopilot-max-blocks",
    )


def check(
    config: AutopilotConfig,
    obs: Observation,
    *,
    busy: str | None,
    cooldown_until: float,
    number: int,
) -> TrialSpec | Refusal:
    """The trial to start now, or the first reason not to (in the order of the checks below).
    ``busy``: BUSY or AWAITING when a trial holds the autopilot; ``number``: the next trial's number."""
    if obs.frozen:
        return Refusal(FROZEN)
    if obs.change_pending:
        return Refusal(PENDING)
    if obs.circuit_open:
        return Refusal(CIRCUIT_OPEN)
    if busy is not None:
        return Refusal(busy)
    if obs.now < cooldown_until:
        return Refusal(COOLDOWN, f"{cooldown_until - obs.now:.0f} s left")
    costly = exploration_refusal(config)
    if costly is not None:
        return costly
    if obs.priced_samples < config.min_priced_samples:
        return Refusal(TOO_FEW_SAMPLES, f"{obs.priced_samples} < {config.min_priced_samples}")
    if obs.regret is None or obs.regret <= config.regret_bound:
        shown = "none" if obs.regret is None else f"{obs.regret:.2%}"
        return Refusal(REGRET_BELOW, f"{shown} <= {config.regret_bound:.2%}")
    current = obs.operator_thresholds
    moved = {k: v for k, v in obs.advice_changes.items() if getattr(current, k, object()) != v}
    if not moved or obs.advice_saving is None:
        return Refusal(NO_ADVICE)
    if obs.advice_saving < config.min_saving:
        return Refusal(SAVING_SMALL, f"{obs.advice_saving:.2%} < {config.min_saving:.2%}")
    restart = sorted(k for k in moved if k in obs.restart_only)
    if restart:
        return Refusal(RESTART_ONLY, "reported, never tried: " + ", ".join(restart))
    try:
        candidate = current.merged(moved, source="autopilot candidate")
    except ThresholdsError as exc:
        return Refusal(INVALID, "; ".join(f"{f}: {r}" for f, r in exc.errors))
    trial_id = trial_id_for(obs.operator_version, number)
    seed = seed_for(config.seed, trial_id)
    try:
        Trial(trial_id, seed, config.block_steps, config.plan_blocks, candidate).check_against(
            current, source="autopilot candidate"
        )
    except ThresholdsError as exc:
        return Refusal(START_ONLY, ", ".join(f for f, _ in exc.errors))
    diff = current.diff(candidate)
    out = sorted(k for k in diff if k not in obs.knob_bounds or not obs.knob_bounds[k].holds(diff[k][1]))
    if out:
        return Refusal(OUT_OF_BOUNDS, ", ".join(out))
    return TrialSpec(
        trial_id=trial_id,
        seed=seed,
        block_steps=config.block_steps,
        blocks=config.plan_blocks,
        candidate=candidate,
        changes=diff,
        operator_version=obs.operator_version,
    )
