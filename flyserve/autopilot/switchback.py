"""SwitchbackPlan: which arm an engine step of a trial runs, from the plan alone.

A trial alternates the current thresholds (arm 0) and a candidate (arm 1) in blocks of
``block_steps`` engine steps from ``first_step`` on. Blocks come in pairs (pair p = blocks 2p and
2p + 1), one block of each arm; which comes first is a coin flip drawn from a hash of
(trial id, seed, p), so every rank that holds the same plan computes the same arm for every step,
with no message between them. From ``end_step`` on, and before ``first_step``, no block runs: the
rank uses the current thresholds.

Pure and deterministic (hashlib, not Python's per-process ``hash``): a rank calls it once per
block boundary, never per step; the sequential test (flyserve.autopilot.sequential) reads its
pairs in the same order.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

CURRENT_ARM = 0
"""The current thresholds: the arm before, between (never) and after the blocks."""
CANDIDATE_ARM = 1

MAX_STEP = 1 << 62
"""No step of a plan (first_step, end_step) lies beyond this: the ranks' step counters are Python
ints compared with sys.maxsize (never reached), and a plan that ends past it never ends."""
MAX_BLOCK_STEPS = 1 << 20
"""About 7 hours at 25 ms a step: a block longer than that measures drift, not the arms."""
MAX_BLOCKS = 2 * 100_000
"""Far above the sequential test's budget (1500 pairs by default, 3000 blocks)."""
MAX_SEED = (1 << 63) - 1
TRIAL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}", re.ASCII)
"""A trial id is a short name (it lands in rank reports, logs and metric labels)."""


class SwitchbackPlanError(ValueError):
    """A plan field is out of range; ``field`` names it, ``reason`` says why."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"field '{field}': {reason}")


def _int_in(name: str, value: object, lo: int, hi: int) -> int:
    """An int (not a bool, not a float: no NaN, no 1e300) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SwitchbackPlanError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        shown = value if value.bit_length() <= 64 else "an integer of more than 20 digits"
        raise SwitchbackPlanError(name, f"must be {lo}..{hi}, got {shown}")
    return value


def check_trial_id(value: object) -> str:
    """The trial id, or SwitchbackPlanError naming ``trial_id``."""
    if not isinstance(value, str):
        raise SwitchbackPlanError("trial_id", f"must be a string, got {type(value).__name__}")
    if not TRIAL_ID.fullmatch(value):
        raise SwitchbackPlanError(
            "trial_id", "must be 1..64 ASCII letters, digits or _.:- (starting with a letter or digit)"
        )
    return value


def check_block_fields(*, seed: object, block_steps: object, blocks: object) -> None:
    """The fields of a plan that do not depend on when it starts (a snapshot's trial holds these)."""
    _int_in("seed", seed, 0, MAX_SEED)
    _int_in("block_steps", block_steps, 1, MAX_BLOCK_STEPS)
    n = _int_in("blocks", blocks, 2, MAX_BLOCKS)
    if n % 2:
        raise SwitchbackPlanError("blocks", f"must be even (blocks come in pairs), got {n}")


@dataclass(frozen=True, slots=True)
class SwitchbackPlan:
    """A trial's blocks: ``blocks`` blocks of ``block_steps`` steps from ``first_step`` on."""

    trial_id: str
    seed: int
    first_step: int
    block_steps: int
    blocks: int

    def __post_init__(self) -> None:
        check_trial_id(self.trial_id)
        check_block_fields(seed=self.seed, block_steps=self.block_steps, blocks=self.blocks)
        _int_in("first_step", self.first_step, 0, MAX_STEP)
        if self.end_step > MAX_STEP:
            raise SwitchbackPlanError(
                "blocks", f"the plan must end by step {MAX_STEP} (first_step + blocks * block_steps)"
            )

    @property
    def end_step(self) -> int:
        """The first step after the last block: from here on the current thresholds, for good."""
        return self.first_step + self.blocks * self.block_steps

    @property
    def pairs(self) -> int:
        return self.blocks // 2

    def block_of(self, step: int) -> int | None:
        """The block ``step`` falls in (0 .. blocks - 1); None before first_step and from end_step."""
        if step < self.first_step or step >= self.end_step:
            return None
        return (step - self.first_step) // self.block_steps

    def arm_of_block(self, block: int) -> int:
        """0 (current thresholds) or 1 (candidate). Pair p = block // 2 holds one block of each,
        the candidate first when the pair's coin (a hash of trial id, seed and p) says so."""
        if not 0 <= block < self.blocks:
            raise ValueError(f"block must be 0..{self.blocks - 1}, got {block}")
        candidate_first = self.candidate_first(block // 2)
        return CANDIDATE_ARM if (block % 2 == 0) == candidate_first else CURRENT_ARM

    def candidate_first(self, pair: int) -> bool:
        """The coin of ``pair``: the same on every rank, in every process (sha256, not hash())."""
        digest = hashlib.sha256(f"{self.trial_id}\x1f{self.seed}\x1f{pair}".encode()).digest()
        return bool(digest[0] & 1)

    def arm_at(self, step: int) -> int:
        """The arm ``step`` runs: its block's, or the current thresholds outside the blocks."""
        block = self.block_of(step)
        return CURRENT_ARM if block is None else self.arm_of_block(block)

    def next_boundary(self, step: int) -> int | None:
        """The first step after ``step`` at which a block starts or the plan ends; None from
        end_step on (nothing changes any more)."""
        if step < self.first_step:
            return self.first_step
        if step >= self.end_step:
            return None
        return self.first_step + ((step - self.first_step) // self.block_steps + 1) * self.block_steps
