"""A trial's blocks as one rank measured them: kept by the rank, reported, validated on read.

The rank already times one step in N (the GPU timer, or the simulator's measured times); each timed
sample that falls in a trial's block is added here: kernel seconds, tokens, one sample. At each
block boundary (RankControl's switch, once per K steps) the rank adds the block's guardrail
figures (``end_block``): its mean step time (wall time between the two boundaries over the steps
between them) and the fallbacks and kernel errors it counted in the block (the difference of its
running counters at the two boundaries). Nothing is done per step: the per-step path stays the one
compare of RankControl.current (docs/autopilot.md, "Why the hot path is one compare"). The rank's report carries the last MAX_REPORTED_BLOCKS blocks
it finished and ``through``, the highest block it has passed; the sidecar's autopilot sums the
confirmed ranks' figures per block once every rank has passed it.

A report is a file anyone who can write ranks/ controls: ``parse_trial_blocks`` refuses, naming
the field, any value that is not a finite number in range (NaN, Infinity, a negative, an integer of
thousands of digits, a list of a million blocks). A refused report's blocks never reach a trial.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from flyserve.autopilot.switchback import MAX_BLOCKS, SwitchbackPlan, SwitchbackPlanError, check_trial_id

MAX_REPORTED_BLOCKS = 32
"""Finished blocks a report carries (newest last): at 1 report a second, 32 blocks a second."""
MAX_BLOCK_KERNEL_S = 86_400.0
"""No block's summed kernel time is above a day (a block is at most 2^20 steps)."""
MAX_BLOCK_COUNT = 1 << 53
"""Tokens and samples above this are not believed (and lose precision as floats)."""
MAX_STEP_SECONDS = 3_600.0
"""No engine step's mean time is above an hour."""
ENDS_KEPT = 4
"""Block ends held for blocks that have no sample yet (a late harvest); older ones are dropped."""
_BLOCK_KEYS = frozenset({"block", "arm", "kernel_seconds", "tokens", "samples"})
_GUARD_KEYS = frozenset({"step_seconds", "fallbacks", "errors"})
"""Optional in a block: a report written before the rank measured them still reads."""
_KEYS = frozenset({"id", "through", "blocks"})


class TrialBlocksError(ValueError):
    """A report's ``trial_blocks`` is malformed; ``field`` names the part (``trial_blocks.blocks[3].tokens``)."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True, slots=True)
class BlockEnd:
    """A block's guardrail figures, taken at its closing boundary: the mean step time (None when
    no step was seen between the boundaries), the fallbacks and the kernel errors counted in it."""

    step_seconds: float | None
    fallbacks: int
    errors: int


NO_END = BlockEnd(None, 0, 0)


@dataclass(frozen=True, slots=True)
class BlockFigures:
    """One finished block of one rank: its arm, the kernel seconds of its timed samples, the tokens
    those samples covered and how many samples they were; and its guardrail figures (BlockEnd),
    absent (None, 0, 0) until the block's closing boundary has been seen."""

    block: int
    arm: int
    kernel_seconds: float
    tokens: int
    samples: int
    step_seconds: float | None = None
    fallbacks: int = 0
    errors: int = 0

    def with_end(self, end: BlockEnd) -> BlockFigures:
        return replace(self, step_seconds=end.step_seconds, fallbacks=end.fallbacks, errors=end.errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "block": self.block,
            "arm": self.arm,
            "kernel_seconds": self.kernel_seconds,
            "tokens": self.tokens,
            "samples": self.samples,
            "step_seconds": self.step_seconds,
            "fallbacks": self.fallbacks,
            "errors": self.errors,
        }


@dataclass(frozen=True, slots=True)
class TrialBlocks:
    """What a rank reports of a trial: its id, the highest block it has passed (-1: none yet) and
    its newest finished blocks that held a sample."""

    trial_id: str
    through: int
    blocks: tuple[BlockFigures, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.trial_id, "through": self.through, "blocks": [b.to_dict() for b in self.blocks]}


class TrialBlockMeter:
    """The rank's tally of the running trial's blocks. ``add`` runs where a timed sample is taken
    (one step in N), ``report`` on the report thread; the caller serialises them (RankControl's lock)."""

    def __init__(self) -> None:
        self._trial_id: str | None = None
        self._through = -1
        self._block = -1
        self._arm = 0
        self._seconds = 0.0
        self._tokens = 0
        self._samples = 0
        self._done: deque[BlockFigures] = deque(maxlen=MAX_REPORTED_BLOCKS)
        self._ends: dict[int, BlockEnd] = {}  # ends of blocks not closed yet (at most ENDS_KEPT)

    def _begin(self, trial_id: str) -> None:
        self._trial_id, self._through, self._block = trial_id, -1, -1
        self._done.clear()
        self._ends.clear()
        self._seconds, self._tokens, self._samples = 0.0, 0, 0

    def add(self, plan: SwitchbackPlan, block: int, seconds: float, tokens: int) -> None:
        """One timed sample of ``block`` of ``plan``'s trial (a sample not finite or negative is dropped)."""
        if not (math.isfinite(seconds) and seconds >= 0.0) or tokens < 0:
            return
        if plan.trial_id != self._trial_id:
            self._begin(plan.trial_id)
        if block != self._block:
            self._close()
            self._block, self._arm = block, plan.arm_of_block(block)  # once per block, not per sample
        self._seconds += seconds
        self._tokens += tokens
        self._samples += 1

    def end_block(self, plan: SwitchbackPlan, block: int, end: BlockEnd) -> None:
        """``block`` of ``plan``'s trial has closed with ``end``'s figures (once per block, at the
        boundary). A block already reported as finished takes them in its next report; one with no
        sample yet keeps them until its samples close it (a report carries sampled blocks only)."""
        if plan.trial_id != self._trial_id:
            self._begin(plan.trial_id)
        for i, done in enumerate(self._done):
            if done.block == block:
                self._done[i] = done.with_end(end)
                return
        self._ends[block] = end
        while len(self._ends) > ENDS_KEPT:
            del self._ends[next(iter(self._ends))]

    def _close(self) -> None:
        if self._block >= 0 and self._samples > 0:
            end = self._ends.pop(self._block, NO_END)
            self._done.append(
                BlockFigures(self._block, self._arm, self._seconds, self._tokens, self._samples).with_end(end)
            )
        self._seconds, self._tokens, self._samples = 0.0, 0, 0
        self._block = -1

    def report(self, plan: SwitchbackPlan | None, step: int) -> TrialBlocks | None:
        """The tally as of ``step``: the blocks before ``step``'s are finished. With no plan (or
        another trial's) the meter's trial ended: every block it holds is finished."""
        if self._trial_id is None:
            if plan is None:
                return None
            self._trial_id = plan.trial_id
        if plan is not None and plan.trial_id == self._trial_id:
            current = plan.block_of(step)
            passed = (plan.blocks - 1 if step >= plan.end_step else -1) if current is None else current - 1
        else:
            passed = max(self._through, self._block)
        if self._block >= 0 and self._block <= passed:
            self._close()
        self._through = max(self._through, passed)
        return TrialBlocks(self._trial_id, self._through, tuple(self._done))


# ---------------------------------------------------------------------------- reading a report


def _count(field: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TrialBlocksError(field, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise TrialBlocksError(field, f"must be {lo}..{hi}")
    return v


def _seconds(field: str, v: object, hi: float = MAX_BLOCK_KERNEL_S) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TrialBlocksError(field, f"must be a number, got {type(v).__name__}")
    if isinstance(v, int) and v.bit_length() > 64:
        raise TrialBlocksError(field, f"must be a finite number in [0, {hi:g}]")
    x = float(v)
    if not (math.isfinite(x) and 0.0 <= x <= hi):
        raise TrialBlocksError(field, f"must be a finite number in [0, {hi:g}]")
    return x


def _step_seconds(field: str, v: object) -> float | None:
    return None if v is None else _seconds(field, v, MAX_STEP_SECONDS)


def _block(i: int, d: object) -> BlockFigures:
    name = f"trial_blocks.blocks[{i}]"
    if not isinstance(d, dict):
        raise TrialBlocksError(name, f"must be a mapping, got {type(d).__name__}")
    keys = set(d)
    if not _BLOCK_KEYS <= keys <= _BLOCK_KEYS | _GUARD_KEYS:
        odd = sorted(str(k)[:32] for k in (keys - _BLOCK_KEYS - _GUARD_KEYS) | (_BLOCK_KEYS - keys))
        raise TrialBlocksError(f"{name}.{odd[0]}", "unknown key" if odd[0] in keys else "missing")
    return BlockFigures(
        block=_count(f"{name}.block", d["block"], 0, MAX_BLOCKS - 1),
        arm=_count(f"{name}.arm", d["arm"], 0, 1),
        kernel_seconds=_seconds(f"{name}.kernel_seconds", d["kernel_seconds"]),
        tokens=_count(f"{name}.tokens", d["tokens"], 0, MAX_BLOCK_COUNT),
        samples=_count(f"{name}.samples", d["samples"], 0, MAX_BLOCK_COUNT),
        step_seconds=_step_seconds(f"{name}.step_seconds", d.get("step_seconds")),
        fallbacks=_count(f"{name}.fallbacks", d.get("fallbacks", 0), 0, MAX_BLOCK_COUNT),
        errors=_count(f"{name}.errors", d.get("errors", 0), 0, MAX_BLOCK_COUNT),
    )


def parse_trial_blocks(d: object) -> TrialBlocks | None:
    """A report's ``trial_blocks`` (None when absent), or TrialBlocksError naming the bad field."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise TrialBlocksError("trial_blocks", f"must be a mapping, got {type(d).__name__}")
    keys = set(d)
    if keys != _KEYS:
        odd = sorted(str(k)[:32] for k in keys ^ _KEYS)
        raise TrialBlocksError(f"trial_blocks.{odd[0]}", "unknown key" if odd[0] in keys else "missing")
    try:
        trial_id = check_trial_id(d["id"])
    except SwitchbackPlanError as exc:
        raise TrialBlocksError("trial_blocks.id", exc.reason) from None
    through = _count("trial_blocks.through", d["through"], -1, MAX_BLOCKS - 1)
    raw = d["blocks"]
    if not isinstance(raw, list):
        raise TrialBlocksError("trial_blocks.blocks", f"must be a list, got {type(raw).__name__}")
    if len(raw) > MAX_REPORTED_BLOCKS:
        raise TrialBlocksError("trial_blocks.blocks", f"at most {MAX_REPORTED_BLOCKS} blocks, got {len(raw)}")
    blocks = tuple(_block(i, b) for i, b in enumerate(raw))
    seen: set[int] = set()
    for i, b in enumerate(blocks):
        if b.block in seen:
            raise TrialBlocksError(f"trial_blocks.blocks[{i}].block", "repeated")
        if b.block > through:
            raise TrialBlocksError(f"trial_blocks.blocks[{i}].block", "beyond 'through' (not finished)")
        seen.add(b.block)
    return TrialBlocks(trial_id, through, blocks)
