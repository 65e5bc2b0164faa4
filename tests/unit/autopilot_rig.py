"""A sidecar stand-in for the autopilot's state machine: observations, synthetic blocks, and a loop
that runs a trial block by block the way the sidecar will, collecting actions and audit records.

A block's kernel time per token is lognormal: the arm's effect (log(1 - effect) on the candidate's
blocks) plus noise of sd ``cv``, drawn from a seeded random.Random, so every run is reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flyserve.autopilot import controller as ap
from flyserve.autopilot.actions import Action, Nothing, StartTrial, TrialSpec
from flyserve.autopilot.exploration import MAX_SHARE
from flyserve.autopilot.inputs import AutopilotConfig, BlockMeasurement, KnobBound, Mode, Observation
from flyserve.autopilot.sequential import SequentialConfig
from flyserve.autopilot.state import AutopilotState, Outcome
from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.policy.thresholds import Thresholds

OPERATOR = Thresholds()
OPERATOR_VERSION = 3
ADVICE = {"min_seq_len": 2048}
"""What the cost table favours: a candidate the blocks below make faster, slower or equal."""


UNBOUNDED_EXPLORATION = MAX_SHARE
"""A max_exploration_share no plan exceeds: these trials' short budgets (20 to 300 pairs) keep the
tests quick; the bound itself is tested in test_autopilot_exploration.py."""


def config(**kw: Any) -> AutopilotConfig:
    args: dict[str, Any] = {
        "block_steps": 4,
        "cooldown_s": 60.0,
        "max_exploration_share": UNBOUNDED_EXPLORATION,
        "test": SequentialConfig(max_pairs=300),
    }
    args.update(kw)
    return AutopilotConfig(**args)


def observation(now: float, **kw: Any) -> Observation:
    args: dict[str, Any] = {
        "now": now,
        "regret": 0.05,
        "priced_samples": 5000,
        "advice_changes": ADVICE,
        "advice_saving": 0.02,
        "operator_version": OPERATOR_VERSION,
        "operator_thresholds": OPERATOR,
        "knob_bounds": {"min_seq_len": KnobBound(0, 8192), "block_m": KnobBound(64, 512)},
        "restart_only": frozenset({"decode_path", "block_size"}),
    }
    args.update(kw)
    return Observation(**args)


def block(spec: TrialSpec, b: int, now: float, per_token: float, **kw: Any) -> BlockMeasurement:
    plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
    args: dict[str, Any] = {
        "trial_id": spec.trial_id,
        "block": b,
        "arm": plan.arm_of_block(b),
        "kernel_seconds": per_token * 1000,
        "tokens": 1000,
        "corroborated_samples": 20,
        "steps": spec.block_steps,
        "step_s": 0.030,
        "fallbacks": 0,
        "errors": 0,
        "circuit_open": False,
        "now": now,
    }
    args.update(kw)
    return BlockMeasurement(**args)


@dataclass
class Run:
    """A state machine driven like the sidecar drives it; every action and record kept."""

    cfg: AutopilotConfig
    state: AutopilotState = field(default_factory=AutopilotState)
    now: float = 1000.0
    actions: list[Action] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)

    def apply(self, out: Outcome) -> Action:
        self.state = out.state
        self.actions.append(out.action)
        self.records.extend(out.records)
        return out.action

    def set_mode(self, mode: Mode) -> Action:
        return self.apply(ap.set_mode(self.cfg, self.state, mode, self.now))

    def observe(self, **kw: Any) -> Action:
        return self.apply(ap.observe(self.cfg, self.state, observation(self.now, **kw)))

    def start(self, **kw: Any) -> TrialSpec:
        action = self.observe(**kw)
        assert isinstance(action, StartTrial), action
        return action.spec

    def run_blocks(
        self,
        spec: TrialSpec,
        effect: float,
        rng: random.Random,
        *,
        cv: float = 0.10,
        first: int = 0,
        until: int | None = None,
        measure: Callable[[TrialSpec, int, float, float], BlockMeasurement] | None = None,
    ) -> tuple[Action, int]:
        """Blocks from ``first`` until an action other than Nothing (returned with its block) or
        ``until`` (then Nothing and the next block)."""
        plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
        end = spec.blocks if until is None else until
        for b in range(first, end):
            self.now += 0.1
            arm = plan.arm_of_block(b)
            per_token = 1e-6 * math.exp(arm * math.log1p(-effect) + rng.gauss(0.0, cv))
            m = (measure or block)(spec, b, self.now, per_token)
            action = self.apply(ap.on_block(self.cfg, self.state, m))
            if not isinstance(action, Nothing):
                return action, b
        return Nothing("blocks ran out"), end
