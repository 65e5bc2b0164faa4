"""A running trial's blocks as the sidecar's autopilot reads them from the confirmed ranks'
reports: each rank's ``trial_blocks`` parsed as hostile input (a refused report named once in the
log, its blocks dropped), every block all ranks have passed summed into one BlockMeasurement, the
arm the ranks run now, whether the runner fell behind what the ranks still report, and the
exploration cost of each counted pair.

The arm of a block is the plan's, never a report's: a block a rank reports under the other arm is
not added. The block's kernel seconds, tokens and samples are the ranks' sums; its step time is the
slowest rank's and its fallbacks and errors the most any one rank counted (the ranks of an engine
step together and route the same batch: a sum would count one step once per rank).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

from flyserve.autopilot.inputs import BlockMeasurement
from flyserve.autopilot.state import RunningTrial
from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.control.reports import RankReport
from flyserve.control.trial_blocks import (
    MAX_REPORTED_BLOCKS,
    TrialBlocks,
    TrialBlocksError,
    parse_trial_blocks,
)
from flyserve.telemetry import metrics as tm

log = logging.getLogger("flyserve.sidecar")

Reports = list[tuple[dict[str, Any], RankReport]]
"""The confirmed ranks' reports: (the report as read, its RankReport)."""


class BlockReader:
    """The ranks' ``trial_blocks`` of one trial; remembers which report it refused and why, so the
    log says it once per rank and field, not every tick."""

    def __init__(self) -> None:
        self._refused: dict[tuple[int, int], str] = {}

    def trial_blocks(self, reports: Reports, trial_id: str) -> list[TrialBlocks]:
        out = []
        for d, r in reports:
            try:
                got = parse_trial_blocks(d.get("trial_blocks"))
            except TrialBlocksError as exc:
                if self._refused.get(r.key) != exc.field:
                    log.warning("autopilot: rank %d-%d report refused: %s", r.engine, r.rank, exc)
                self._refused[r.key] = exc.field
                continue
            self._refused.pop(r.key, None)
            if got is not None and got.trial_id == trial_id:
                out.append(got)
        return out


def lagged_behind(t: RunningTrial, ranks: list[TrialBlocks]) -> bool:
    """Whether the trial's next block is older than the oldest block some rank still reports, with
    that rank's report full (MAX_REPORTED_BLOCKS blocks): the blocks in between may have left its
    report unread, so they can no longer be told from blocks that held no sample."""
    return any(
        len(tb.blocks) >= MAX_REPORTED_BLOCKS and min(f.block for f in tb.blocks) > t.next_block
        for tb in ranks
    )


def block_measurements(
    t: RunningTrial, ranks: list[TrialBlocks], *, circuit_open: bool, now: float
) -> Iterator[BlockMeasurement]:
    """The trial's next blocks every rank in ``ranks`` has passed, in order (at most two reports'
    worth at once), each summed over the ranks."""
    if not ranks:
        return
    spec = t.spec
    last = min(min(tb.through for tb in ranks), spec.blocks - 1, t.next_block + 2 * MAX_REPORTED_BLOCKS - 1)
    plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
    for b in range(t.next_block, last + 1):
        arm = plan.arm_of_block(b)
        figures = [f for tb in ranks for f in tb.blocks if f.block == b and f.arm == arm]
        step_times = [f.step_seconds for f in figures if f.step_seconds is not None]
        yield BlockMeasurement(
            trial_id=spec.trial_id,
            block=b,
            arm=arm,
            kernel_seconds=min(math.fsum(f.kernel_seconds for f in figures), 1e9),
            tokens=sum(f.tokens for f in figures),
            corroborated_samples=sum(f.samples for f in figures),
            steps=spec.block_steps,
            step_s=max(step_times, default=None),
            fallbacks=max((f.fallbacks for f in figures), default=0),
            errors=max((f.errors for f in figures), default=0),
            circuit_open=circuit_open,
            now=now,
        )


class ExplorationCost:
    """flyserve_autopilot_exploration_cost_seconds_total: per pair, the slower block's tokens times
    its excess seconds per token over the faster block's."""

    def __init__(self) -> None:
        self._first: tuple[int, float, int] | None = None  # (block, per token, tokens) of a pair's first

    def reset(self) -> None:
        self._first = None

    def add(self, m: BlockMeasurement, min_block_samples: int) -> None:
        per_token = m.per_token
        usable = m.corroborated_samples >= min_block_samples and per_token is not None
        if m.block % 2 == 0:
            self._first = (m.block, per_token, m.tokens) if usable and per_token is not None else None
            return
        first, self._first = self._first, None
        if first is None or first[0] != m.block - 1 or not usable or per_token is None:
            return
        (_, pt_a, tok_a), pt_b, tok_b = first, per_token, m.tokens
        slow_pt, fast_pt, slow_tokens = (pt_a, pt_b, tok_a) if pt_a > pt_b else (pt_b, pt_a, tok_b)
        tm.AUTOPILOT_EXPLORATION_COST.inc((slow_pt - fast_pt) * slow_tokens)


def arm_now(reports: Reports, t: RunningTrial | None) -> int:
    """The arm the first rank that reports the trial runs now (0 or 1), or -1 (no trial)."""
    if t is None:
        return -1
    for d, _ in reports:
        now_in = d.get("trial")
        if isinstance(now_in, dict) and now_in.get("id") == t.spec.trial_id and now_in.get("arm") in (0, 1):
            return int(now_in["arm"])
    return -1
