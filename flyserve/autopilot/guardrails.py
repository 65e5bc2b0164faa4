"""The guardrails of a running trial: the block's tallies (steps, fallbacks, errors, mean step
times, empty blocks in a row) and the first limit a block breaches, checked on every block before
the test (docs/autopilot.md, "Guardrails"). Pure functions of the config, the trial and the block."""

from __future__ import annotations

from dataclasses import replace

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot.inputs import AutopilotConfig, BlockMeasurement
from flyserve.autopilot.state import RunningTrial


def breached(
    config: AutopilotConfig, before: RunningTrial, after: RunningTrial, m: BlockMeasurement
) -> tuple[str, float, float] | None:
    """The first guardrail this block breaches, as (name, figure, limit). ``before``/``after``: the
    trial's tallies without and with this block."""
    if m.circuit_open:
        return (rec.CIRCUIT_OPENED, 1.0, 1.0)
    if after.empty_in_row >= config.max_empty_blocks:
        return (rec.SAMPLES_STOPPED, float(after.empty_in_row), float(config.max_empty_blocks))
    ratio = step_ratio(before, m)
    if ratio is not None and ratio > config.p99_ratio_limit and after.slow_in_row >= config.step_time_blocks:
        return (rec.STEP_TIME, ratio, config.p99_ratio_limit)
    if after.candidate_steps > 0:
        base = after.current_steps or 1
        for name, cand, cur, excess in (
            (rec.ERROR_RATE, after.candidate_errors, after.current_errors, config.error_rate_excess),
            (
                rec.FALLBACK_RATE,
                after.candidate_fallbacks,
                after.current_fallbacks,
                config.fallback_rate_excess,
            ),
        ):
            rate, limit = cand / after.candidate_steps, cur / base + excess
            if rate > limit:
                return (name, rate, limit)
    return None


def step_ratio(t: RunningTrial, m: BlockMeasurement) -> float | None:
    """The mean step time of the candidate block this block lets us judge, over the current arm's:
    a candidate block against the current arm's latest; or a current block against the candidate
    block that came before any current block did. None when no candidate block is judged.
    Mean step times, not p99s: the ranks time a block's two boundaries, never each step."""
    slow, ref = (_timed(m.step_s), t.current_step_s) if m.arm == 1 else (t.waiting_step_s, _timed(m.step_s))
    if slow is None or ref is None:
        return None
    return slow / ref


def _timed(step_s: float | None) -> float | None:
    """A block's mean step time, or None when it says nothing: a block of no wall time is not
    measured (a reported 0 judged as a candidate's would end the streak; as the current arm's, it
    would leave every later candidate block unjudged)."""
    return step_s if step_s is not None and step_s > 0.0 else None


def tally(config: AutopilotConfig, t: RunningTrial, m: BlockMeasurement) -> RunningTrial:
    """The trial's tallies with this block in (steps, fallbacks, errors, step times, empty blocks,
    slow candidate blocks in a row: a judged candidate block within the limit ends the streak)."""
    ratio = step_ratio(t, m)
    if ratio is not None:
        t = replace(t, slow_in_row=t.slow_in_row + 1 if ratio > config.p99_ratio_limit else 0)
    gap = m.block - t.next_block  # blocks never reported count as empty
    empty = m.corroborated_samples < config.min_block_samples or m.per_token is None
    empty_in_row = (t.empty_in_row + gap + 1) if empty else 0
    if m.arm == 0:
        return replace(
            t,
            empty_in_row=empty_in_row,
            last_block_time=m.now,
            current_step_s=_timed(m.step_s) or t.current_step_s,
            waiting_step_s=None,
            current_steps=t.current_steps + m.steps,
            current_fallbacks=t.current_fallbacks + m.fallbacks,
            current_errors=t.current_errors + m.errors,
        )
    return replace(
        t,
        empty_in_row=empty_in_row,
        last_block_time=m.now,
        waiting_step_s=_timed(m.step_s) if t.current_step_s is None else None,
        candidate_steps=t.candidate_steps + m.steps,
        candidate_fallbacks=t.candidate_fallbacks + m.fallbacks,
        candidate_errors=t.candidate_errors + m.errors,
    )
