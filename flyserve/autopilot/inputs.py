"""What the autopilot's state machine is given: its settings, what the sidecar sees, one block's figures.

All plain frozen values, built by the caller (the sidecar) from what it already has: the live
regret and advice (flyserve.sidecar.live_costs), the control plane's flags, the ranks' corroborated
samples per block. The state machine (flyserve.autopilot.controller) reads them and never anything
else: no clock, no file, no network, so a run is a function of its inputs and can be tested and
replayed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

from flyserve.autopilot.sequential import SequentialConfig
from flyserve.autopilot.switchback import MAX_BLOCKS
from flyserve.policy.thresholds import Thresholds


class Mode(str, Enum):
    """What the autopilot may do (docs/autopilot.md, "Modes")."""

    OFF = "off"
    """Nothing: no proposal, no trial."""
    ADVISE = "advise"
    """Proposes trials (ProposeTrial) and applies nothing."""
    TRIAL = "trial"
    """Runs trials and rolls back by itself; a promotion waits for an operator's approval."""
    AUTO = "auto"
    """Runs trials, rolls back and promotes by itself."""


class InputError(ValueError):
    """A setting or an input out of range; ``field`` names it."""

    def __init__(self, name: str, reason: str) -> None:
        self.field, self.reason = name, reason
        super().__init__(f"{name}: {reason}")


def _finite(name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(name, f"must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise InputError(name, f"must be a finite number in [{lo:g}, {hi:g}]")
    return float(value)


def _count(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InputError(name, f"must be {lo}..{hi}")
    return value


MAX_COUNT = 1 << 53
"""Counts (samples, tokens, steps) above this are not believed (and lose precision as floats)."""


@dataclass(frozen=True, slots=True)
class KnobBound:
    """The range an operator lets the autopilot move one threshold in (both ends included). A knob
    with no bound is never changed by the autopilot. A switch (``boolean``: prefill_enabled) is a
    range of 0 (false) and 1 (true): {0, 1} lets the autopilot turn it either way, {0, 0} only off."""

    low: int
    high: int
    boolean: bool = False

    def __post_init__(self) -> None:
        _count("low", self.low, 0, 1 if self.boolean is True else MAX_COUNT)
        _count("high", self.high, self.low, 1 if self.boolean is True else MAX_COUNT)
        if not isinstance(self.boolean, bool):
            raise InputError("boolean", f"must be true or false, got {type(self.boolean).__name__}")

    def holds(self, value: object) -> bool:
        if self.boolean:  # a switch holds only true or false, never 0 or 1
            return isinstance(value, bool) and self.low <= int(value) <= self.high
        return not isinstance(value, bool) and isinstance(value, int) and self.low <= value <= self.high


@dataclass(frozen=True)
class AutopilotConfig:
    """The autopilot's settings (defaults and why: docs/autopilot.md, "The trigger", "Guardrails")."""

    regret_bound: float = 0.03
    """A trial is considered only while the live regret (routed / oracle - 1) is above this."""
    min_priced_samples: int = 1000
    """... over a window with at least this many priced shape samples."""
    min_saving: float = 0.005
    """... and advice predicting at least this share of the window's attention time saved."""
    cooldown_s: float = 600.0
    """No new trial for this long after a trial ends, whatever its decision."""
    block_steps: int = 32
    """Engine steps per block (K)."""
    min_block_samples: int = 8
    """A block counts only with at least this many corroborated kernel samples; with fewer it is
    empty (no pair is formed with it)."""
    max_empty_blocks: int = 4
    """This many empty blocks in a row: the "samples stopped" guardrail rolls back."""
    block_timeout_s: float = 300.0
    """No block reported for this long during a trial: "samples stopped" too."""
    p99_ratio_limit: float = 1.5
    """Candidate blocks' mean step time above this multiple of the current arm's latest, in
    ``step_time_blocks`` blocks in a row: rolled back (the name is the settings' and audit records'
    key, kept from when it limited a p99)."""
    step_time_blocks: int = 2
    """Candidate blocks in a row above ``p99_ratio_limit`` before the step-time guardrail rolls
    back. Measured on the CPU demo: single blocks of 32-64 steps measured 3.2x, 4.7x and over 10x
    their neighbour's mean step time with no arm to blame (a host stall; an idle gap in the traffic
    inside the block, which the rank's two boundary clocks count as step time). One block in a
    row rolled three sound trials back; a candidate that truly slows the step breaches on every
    block and runs one candidate block more (up to three blocks later). Not a sidecar flag, and
    not in the audit's start record: replay checks the figure against the limit only."""
    fallback_rate_excess: float = 0.01
    """Fallbacks per step on the candidate's blocks above the current arm's rate by more: rolled back."""
    error_rate_excess: float = 0.001
    """Errors per step on the candidate's blocks above the current arm's rate by more: rolled back."""
    approval_wait_s: float = 3600.0
    """A promotion not approved within this long is dropped (the operator's version stays)."""
    max_exploration_share: float = 0.005
    """A trial starts only when its expected extra cost (its candidate's blocks times the slowdown,
    at the worst slowdown: autopilot.exploration) is at most this share of its plan's attention time."""
    assumed_cv: float = 0.10
    """The block-to-block coefficient of variation that expected cost is measured at."""
    seed: int = 0
    """Where every trial's coin seed comes from (each trial's is derived from it and the trial's id)."""
    test: SequentialConfig = field(default_factory=SequentialConfig)
    """The sequential test that decides (flyserve.autopilot.sequential)."""

    def __post_init__(self) -> None:
        _finite("regret_bound", self.regret_bound, 0.0, 100.0)
        _count("min_priced_samples", self.min_priced_samples, 1, MAX_COUNT)
        _finite("min_saving", self.min_saving, 0.0, 1.0)
        _finite("cooldown_s", self.cooldown_s, 0.0, 7 * 86400.0)
        _count("block_steps", self.block_steps, 1, 1 << 20)
        _count("min_block_samples", self.min_block_samples, 1, MAX_COUNT)
        _count("max_empty_blocks", self.max_empty_blocks, 1, 1000)
        _finite("block_timeout_s", self.block_timeout_s, 1.0, 86400.0)
        _finite("p99_ratio_limit", self.p99_ratio_limit, 1.0, 100.0)
        _count("step_time_blocks", self.step_time_blocks, 1, 64)
        _finite("fallback_rate_excess", self.fallback_rate_excess, 0.0, 1e6)
        _finite("error_rate_excess", self.error_rate_excess, 0.0, 1e6)
        _finite("approval_wait_s", self.approval_wait_s, 1.0, 30 * 86400.0)
        if not 0.0 < _finite("max_exploration_share", self.max_exploration_share, -1e300, 1e300) < 1.0:
            raise InputError("max_exploration_share", "must be a finite number in (0, 1)")
        if not 0.0 < _finite("assumed_cv", self.assumed_cv, -1e300, 1e300) <= 2.0:
            raise InputError("assumed_cv", "must be a finite number in (0, 2]")
        _count("seed", self.seed, 0, (1 << 63) - 1)
        if not isinstance(self.test, SequentialConfig):
            raise InputError("test", "must be a SequentialConfig")
        if self.test.cuped:  # a block carries no covariate yet (docs/autopilot.md, CUPED)
            raise InputError("test.cuped", "must be off: blocks carry no covariate")
        if self.plan_blocks > MAX_BLOCKS:
            raise InputError("test.max_pairs", f"a plan holds at most {MAX_BLOCKS // 2} pairs")

    @property
    def plan_blocks(self) -> int:
        """Blocks a trial's plan holds: the test's budget in pairs, twice. The plan ends by itself
        there, so the engine is back on the current thresholds if no decision ever comes."""
        return 2 * self.test.max_pairs


def _frozen_map(m: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True)
class Observation:
    """What the sidecar sees now, handed to ``controller.observe`` (once a second or so).

    ``operator_version`` and ``operator_thresholds``: the last version an operator published (not
    the autopilot): what a rollback and the kill switch return to. ``advice_changes``: the fields
    and values the live advice proposes, over ``operator_thresholds`` (empty: no advice);
    ``advice_saving`` its predicted share of the window's attention time saved."""

    now: float
    regret: float | None
    priced_samples: int
    advice_changes: Mapping[str, Any]
    advice_saving: float | None
    operator_version: int
    operator_thresholds: Thresholds
    knob_bounds: Mapping[str, KnobBound] = field(default_factory=dict)
    restart_only: frozenset[str] = frozenset()
    """Knobs that need a restart (decode_path, the KV block size): never tried, only reported."""
    frozen: bool = False
    """Control is frozen: no change of thresholds at all."""
    change_pending: bool = False
    """An operator's change is queued and not yet applied by every rank."""
    circuit_open: bool = False
    """A rank's circuit breaker is open (it fell back to one path)."""

    def __post_init__(self) -> None:
        _finite("now", self.now, 0.0, 1e12)
        if self.regret is not None:
            _finite("regret", self.regret, -1.0, 1e6)
        _count("priced_samples", self.priced_samples, 0, MAX_COUNT)
        if self.advice_saving is not None:
            _finite("advice_saving", self.advice_saving, -1e6, 1.0)
        _count("operator_version", self.operator_version, 0, MAX_COUNT)
        if not isinstance(self.operator_thresholds, Thresholds):
            raise InputError("operator_thresholds", "must be a Thresholds")
        object.__setattr__(self, "advice_changes", _frozen_map(self.advice_changes))
        object.__setattr__(self, "knob_bounds", _frozen_map(self.knob_bounds))
        object.__setattr__(self, "restart_only", frozenset(self.restart_only))


@dataclass(frozen=True, slots=True)
class BlockMeasurement:
    """One block of a running trial, as the ranks measured it.

    ``kernel_seconds`` and ``tokens``: the attention kernel time the block's corroborated samples
    measured and the tokens they covered (the block's kernel time per token is their ratio);
    ``corroborated_samples``: how many samples those are (forged or stale samples are not
    counted by the caller: sidecar.sample_evidence); ``steps``: the engine steps the block held;
    ``step_s``: the block's mean step time (None: not measured); ``fallbacks``/``errors``: the
    block's counts;
    ``circuit_open``: whether any rank's circuit breaker was open during the block."""

    trial_id: str
    block: int
    arm: int
    kernel_seconds: float
    tokens: int
    corroborated_samples: int
    steps: int
    step_s: float | None
    fallbacks: int
    errors: int
    circuit_open: bool
    now: float

    def __post_init__(self) -> None:
        _count("block", self.block, 0, 1 << 40)
        _count("arm", self.arm, 0, 1)
        _finite("kernel_seconds", self.kernel_seconds, 0.0, 1e9)
        _count("tokens", self.tokens, 0, MAX_COUNT)
        _count("corroborated_samples", self.corroborated_samples, 0, MAX_COUNT)
        _count("steps", self.steps, 0, MAX_COUNT)
        if self.step_s is not None:
            _finite("step_s", self.step_s, 0.0, 1e6)
        _count("fallbacks", self.fallbacks, 0, MAX_COUNT)
        _count("errors", self.errors, 0, MAX_COUNT)
        if not isinstance(self.circuit_open, bool):
            raise InputError("circuit_open", "must be true or false")
        _finite("now", self.now, 0.0, 1e12)

    @property
    def per_token(self) -> float | None:
        """Kernel seconds per token, or None when the block measured nothing usable."""
        if self.tokens <= 0 or self.kernel_seconds <= 0.0:
            return None
        return self.kernel_seconds / self.tokens
