"""Synthetic switchback trials: the real decision code (sequential.py) on planted effects.

``flyserve autopilot trials`` runs these; docs/autopilot.md holds the table and the noise model.

A block's measured kernel time per token, in logs, is

    log(t) = arm + drift(time) + shape(block) + noise(block) [+ stall(block)]

- ``arm``: 0 for the current thresholds, log(1 - effect) for the candidate (effect 0.02: 2% faster);
- ``shape``: the block's batches (normal, a share ``shape_r2`` of the block's variance); the cost
  table predicts it, and a pair's covariate is the candidate's block's shape minus the current's;
- ``noise``: the rest of the block-to-block spread, so that shape + noise has sd sqrt(log(1 + cv^2))
  (a lognormal block time of coefficient of variation ``cv``): normal (``gaussian``), or for ``gpu``
  Student-t with 4 degrees of freedom (heavy tails), with a stall in 1% of blocks (the block is
  slower by an exponential share, mean 25%: a preemption, a clock drop, a noisy neighbour) and a
  random-walk drift over the trial (0.2% a block: clocks and temperature), shared by both arms.

Which arm runs first in a pair is a coin flip, as the switchback will do.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flyserve.autopilot.sequential import (
    REASON_ABORT,
    SequentialConfig,
    SequentialConfigError,
    SequentialState,
    Verdict,
    decide,
)

if TYPE_CHECKING:  # numpy is imported where it is used
    import numpy as np
    from numpy.random import Generator

NOISE_MODELS = ("gpu", "gaussian")
STALL_PROBABILITY = 0.01
STALL_MEAN = 0.25
DRIFT_STEP = 0.002
T_DF = 4


@dataclass(frozen=True)
class SyntheticBlocks:
    """How the synthetic blocks of one scenario are drawn (see the module docstring)."""

    effect: float
    """True relative speed-up of the candidate (0: A/A; 0.02: 2% faster; -0.10: 10% slower)."""
    cv: float = 0.10
    """Block-to-block coefficient of variation of one arm's measured kernel time per token."""
    noise: str = "gpu"
    shape_r2: float = 0.0
    """Share of the block's log variance from its batches' shape, which the covariate predicts."""

    def __post_init__(self) -> None:
        for name, lo, hi in (("effect", -10.0, 0.9), ("cv", 0.0, 2.0), ("shape_r2", 0.0, 0.99)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise SequentialConfigError(name, f"must be a number, got {type(v).__name__}")
            if not math.isfinite(v):
                raise SequentialConfigError(name, f"must be finite, got {float(v)!r}")
            if not lo <= v <= hi:
                raise SequentialConfigError(name, f"must be in [{lo:g}, {hi:g}], got {v!r}")
        if self.noise not in NOISE_MODELS:
            raise SequentialConfigError(
                "noise", f"must be one of {', '.join(NOISE_MODELS)}, got {self.noise!r}"
            )

    def pairs(self, rng: Generator, n: int) -> Iterator[tuple[float, float, float]]:
        """n pairs (current, candidate, covariate), drawn with the numpy Generator ``rng``."""
        cur, cand, z = self.pair_arrays(rng, n)
        return zip(cur.tolist(), cand.tolist(), z.tolist(), strict=True)

    def pair_arrays(self, rng: Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same n pairs as ``pairs`` as three numpy arrays (current, candidate, covariate): for
        callers that work on all of a trial's pairs at once (exploration.py)."""
        import numpy as np

        sd = math.sqrt(math.log1p(self.cv * self.cv))
        shape_sd = sd * math.sqrt(self.shape_r2)
        rest_sd = sd * math.sqrt(1.0 - self.shape_r2)
        blocks = 2 * n
        shape = rng.standard_normal(blocks) * shape_sd
        if self.noise == "gaussian":
            log_t = shape + rng.standard_normal(blocks) * rest_sd
        else:
            t = rng.standard_t(T_DF, blocks) * (rest_sd / math.sqrt(T_DF / (T_DF - 2)))
            stalls = np.where(
                rng.random(blocks) < STALL_PROBABILITY, np.log1p(rng.exponential(STALL_MEAN, blocks)), 0.0
            )
            drift = np.cumsum(rng.standard_normal(blocks)) * DRIFT_STEP
            log_t = shape + t + stalls + drift
        cand_first = rng.random(n) < 0.5
        first, second = log_t[0::2], log_t[1::2]
        cand_log = np.where(cand_first, first, second) + math.log1p(-self.effect)
        cur_log = np.where(cand_first, second, first)
        cand_shape = np.where(cand_first, shape[0::2], shape[1::2])
        cur_shape = np.where(cand_first, shape[1::2], shape[0::2])
        return np.exp(cur_log), np.exp(cand_log), cand_shape - cur_shape


@dataclass(frozen=True)
class TrialOutcome:
    verdict: Verdict
    reason: str
    pairs: int
    estimate: float


def run_trial(config: SequentialConfig, blocks: SyntheticBlocks, rng: Generator) -> TrialOutcome:
    """One trial: pairs fed one at a time, a decision after every pair, until a final one."""
    state = SequentialState()
    for cur, cand, z in blocks.pairs(rng, config.max_pairs):
        state = state.update(config, cur, cand, z)
        d = decide(config, state)
        if d.final:
            return TrialOutcome(d.verdict, d.reason, d.pairs, d.estimate)
    raise AssertionError("the budget ends every trial")  # pragma: no cover


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (95% by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _quantile(sorted_values: list[int], q: float) -> float:
    """Linear-interpolated quantile (numpy's default) of an already sorted list."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class ScenarioResult:
    blocks: SyntheticBlocks
    trials: int
    promote: int
    rollback: int
    abort: int
    inconclusive: int
    pairs: tuple[int, ...] = field(repr=False)
    """Pairs to the final decision, one per trial (the budget for inconclusive ones)."""

    @property
    def role(self) -> str:
        return "A/A" if self.blocks.effect == 0 else ("better" if self.blocks.effect > 0 else "worse")

    def to_dict(self, config: SequentialConfig) -> dict[str, object]:
        n = self.trials
        s = sorted(self.pairs)
        doc: dict[str, object] = {
            "role": self.role,
            "effect": self.blocks.effect,
            "cv": self.blocks.cv,
            "noise": self.blocks.noise,
            "shape_r2": self.blocks.shape_r2,
            "trials": n,
            "promote": self.promote / n,
            "rollback": self.rollback / n,
            "abort": self.abort / n,
            "inconclusive": self.inconclusive / n,
            "promote_ci95": list(wilson(self.promote, n)),
            "rollback_ci95": list(wilson(self.rollback, n)),
            "pairs_median": _quantile(s, 0.5),
            "pairs_p90": _quantile(s, 0.9),
            "pairs_mean": sum(s) / n,
        }
        # What each rate means for this scenario: a promotion of a candidate not faster by the
        # minimum effect is a false promotion; a rollback of a faster one is a false rollback.
        doc["false_promotion"] = self.promote / n if self.blocks.effect < config.min_effect else None
        doc["power"] = self.promote / n if self.blocks.effect >= config.min_effect else None
        doc["false_rollback"] = self.rollback / n if self.blocks.effect > 0 else None
        return doc


def scenario_rng(seed: int, effect: float, trial: int) -> Generator:
    """The Generator of one trial: fixed by (seed, effect, trial), so a scenario's numbers do not depend
    on which other scenarios run or in what order."""
    import numpy as np

    return np.random.default_rng([seed, zlib.crc32(repr(float(effect)).encode()), trial])


def run_scenario(
    config: SequentialConfig,
    blocks: SyntheticBlocks,
    trials: int,
    seed: int,
    progress: Callable[[int], None] | None = None,
) -> ScenarioResult:
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise SequentialConfigError("trials", f"must be an integer >= 1, got {trials!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SequentialConfigError("seed", f"must be an integer >= 0, got {seed!r}")
    counts = {Verdict.PROMOTE: 0, Verdict.ROLLBACK: 0, Verdict.INCONCLUSIVE: 0}
    aborts = 0
    pairs: list[int] = []
    for i in range(trials):
        o = run_trial(config, blocks, scenario_rng(seed, blocks.effect, i))
        counts[o.verdict] += 1
        aborts += o.reason == REASON_ABORT
        pairs.append(o.pairs)
        if progress is not None:
            progress(1)
    return ScenarioResult(
        blocks=blocks,
        trials=trials,
        promote=counts[Verdict.PROMOTE],
        rollback=counts[Verdict.ROLLBACK],
        abort=aborts,
        inconclusive=counts[Verdict.INCONCLUSIVE],
        pairs=tuple(pairs),
    )


# The autopilot's error-rate targets: checked on whichever scenarios a run has.
TARGET_FALSE_PROMOTION = 0.05
TARGET_POWER = 0.80
TARGET_FALSE_ROLLBACK = 0.01
TARGET_AA_TRIALS = 1000


def targets(results: list[ScenarioResult]) -> list[dict[str, object]]:
    """The targets the run's scenarios cover: value and ``met`` (True, False, or None: unproven, too
    few A/A trials for TARGET_FALSE_PROMOTION's bound)."""
    out: list[dict[str, object]] = []
    for r in results:
        e, cv = r.blocks.effect, r.blocks.cv
        if e == 0:
            v = r.promote / r.trials
            enough = r.trials >= TARGET_AA_TRIALS
            out.append(
                {
                    "target": f"false promotion <= {TARGET_FALSE_PROMOTION:.0%} (A/A)",
                    "value": v,
                    "met": (v <= TARGET_FALSE_PROMOTION) if enough else None,
                    "note": None
                    if enough
                    else f"{r.trials} A/A trials, the target needs >= {TARGET_AA_TRIALS}",
                }
            )
        if math.isclose(e, 0.02) and math.isclose(cv, 0.10):
            v = r.promote / r.trials
            out.append(
                {
                    "target": f"power >= {TARGET_POWER:.0%} (2% better, CV 0.10)",
                    "value": v,
                    "met": v >= TARGET_POWER,
                    "note": None,
                }
            )
        if math.isclose(e, 0.02):
            v = r.rollback / r.trials
            out.append(
                {
                    "target": f"false rollback <= {TARGET_FALSE_ROLLBACK:.0%} (2% better)",
                    "value": v,
                    "met": v <= TARGET_FALSE_ROLLBACK,
                    "note": None,
                }
            )
    return out
