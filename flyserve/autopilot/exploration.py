"""The exploration-cost bound: how much attention time a trial is expected to spend on a worse arm.

The autopilot's spec: the expected extra cost of a trial (blocks spent on the worse arm) stays under
0.5% of the attention time in the trial's window. Here the window is the trial's plan, its
``2 * max_pairs`` blocks of K steps, so its attention time is ``plan_blocks`` block-equivalents. A
candidate ``d`` slower (0.02: 2%) costs ``d`` block-equivalents for each of its blocks that runs
before the decision, one per pair; a trial that spends the budget counts all ``max_pairs``. The
share is the worst, over a grid of slowdowns (SLOWDOWNS), of

    d * E[candidate blocks before the decision | d] / plan_blocks

E[...] is measured with the real decision code: ``sequential.decide`` on the synthetic pairs of
``flyserve autopilot trials`` (trials.py, GPU-like noise at the assumed coefficient of variation),
TRIALS trials per slowdown, seeded by SEED: the same config always gives the same figure.

Speed. Deciding pair by pair in Python costs about 20 us a pair and the slight slowdowns run most
trials to the budget (0.25% slower: 1300 of 1500 pairs on average): 200 trials a slowdown took
about 13 s. So the running mean and sum of squares of every prefix are computed at once with numpy,
the decision rule is applied to all prefixes at once to find the first final pair, and that pair is
then confirmed by ``decide`` itself (final there, not final one pair before, on the state of those
pairs); a trial where they disagree (a rounding at a bound) is run pair by pair through
``SequentialState.update`` and ``decide``. Measured at the defaults: about 0.3 s. Cached per
(test settings, cv): the sidecar's autopilot thread pays it once, never a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from flyserve.autopilot.sequential import (
    SequentialConfig,
    SequentialState,
    decide,
    halfwidth_factor,
)
from flyserve.autopilot.trials import SyntheticBlocks, scenario_rng

if TYPE_CHECKING:
    import numpy as np

SLOWDOWNS: tuple[float, ...] = (0.0025, 0.005, 0.01, 0.02, 0.05, 0.10, 0.20, 0.50, 1.00)
"""The slowdowns the worst case is taken over: from below the minimum effect to twice as slow."""
TRIALS = 200
"""Synthetic trials per slowdown at the default budget (the mean's standard error is then a few
percent of it)."""
PAIRS_MEASURED = TRIALS * 1500
"""A larger budget gets fewer trials (at least MIN_TRIALS), so that a plan of 100,000 pairs costs
seconds, not minutes (measured on the 2-core machine: 11-14 s, against 1 s at the default 1500);
such plans are far inside the bound: measured, a worst share of 4e-05 (0.5% slower, 1639 candidate
blocks of 200,000), because even slight slowdowns are decided long before so large a budget."""
MIN_TRIALS = 20
SEED = 1
NOISE = "gpu"
"""trials.py's heavier-tailed noise (Student-t, stalls, drift), the noise its table is measured with."""
MAX_SHARE = max(SLOWDOWNS) / 2
"""No plan can exceed this share: at most half the plan's blocks are the candidate's, each costing at
most max(SLOWDOWNS). A limit at or above it holds without measuring."""


@dataclass(frozen=True, slots=True)
class SlowdownCost:
    """One slowdown's row: the candidate's mean blocks before the decision and their cost."""

    slowdown: float
    candidate_blocks: float
    """Mean candidate blocks before the decision (one per pair; the budget for a trial that spends it)."""

    @property
    def cost_blocks(self) -> float:
        """Extra attention time, in blocks' worth: slowdown times candidate blocks."""
        return self.slowdown * self.candidate_blocks


@dataclass(frozen=True, slots=True)
class ExplorationEstimate:
    """The expected extra cost of a trial at these settings, against its plan."""

    plan_blocks: int
    cv: float
    rows: tuple[SlowdownCost, ...]

    @property
    def worst(self) -> SlowdownCost:
        return max(self.rows, key=lambda r: r.cost_blocks)

    @property
    def share(self) -> float:
        """The worst expected extra cost as a share of the plan's attention time."""
        return self.worst.cost_blocks / self.plan_blocks


def _prefix_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and sum of squared deviations of every prefix of ``x`` (computed around the first value,
    so a large common offset does not cancel away the spread)."""
    import numpy as np

    n = np.arange(1, len(x) + 1, dtype=float)
    y = x - x[0]
    s1 = np.cumsum(y)
    s2 = np.cumsum(y * y)
    mean_y = s1 / n
    m2 = np.maximum(s2 - s1 * mean_y, 0.0)
    return mean_y + x[0], m2


def _state(n: int, mean: np.ndarray, m2: np.ndarray) -> SequentialState:
    return (
        SequentialState()
        if n == 0
        else SequentialState(pairs=n, mean=float(mean[n - 1]), m2=float(m2[n - 1]))
    )


def _pairs_pair_by_pair(config: SequentialConfig, cur: np.ndarray, cand: np.ndarray) -> int:
    state = SequentialState()
    for a, b in zip(cur.tolist(), cand.tolist(), strict=True):
        state = state.update(config, a, b)
        if decide(config, state).final:
            return state.pairs
    return state.pairs


def _decision_pairs(
    config: SequentialConfig,
    factors: np.ndarray,
    abort_factors: np.ndarray,
    cur: np.ndarray,
    cand: np.ndarray,
) -> int:
    """Pairs to the final decision of one trial (the rule of ``sequential.decide``, all prefixes at
    once, confirmed by ``decide`` at the pair found and the one before)."""
    import numpy as np

    x = np.log(cand / cur)
    mean, m2 = _prefix_stats(x)
    with np.errstate(invalid="ignore"):  # inf * 0 at an open band
        w = np.sqrt(factors * m2)
        abort_lo = mean - np.sqrt(abort_factors * m2)
    t = config.promote_below
    final = (mean + w < t) | (mean - w > t) | ((mean > config.abort_above) & (abort_lo > config.abort_above))
    final[-1] = True  # the budget
    n = int(np.argmax(final)) + 1
    if decide(config, _state(n, mean, m2)).final and not decide(config, _state(n - 1, mean, m2)).final:
        return n
    return _pairs_pair_by_pair(config, cur, cand)


def _mean_candidate_blocks(config: SequentialConfig, slowdown: float, cv: float, trials: int) -> float:
    import numpy as np

    blocks = SyntheticBlocks(effect=-slowdown, cv=cv, noise=NOISE)
    n = np.arange(1, config.max_pairs + 1)
    factors = np.array([halfwidth_factor(int(k), config.alpha, config.mixture_sd) for k in n])
    abort_factors = np.array([halfwidth_factor(int(k), config.alpha, config.abort_mixture_sd) for k in n])
    total = 0
    for i in range(trials):
        cur, cand, _ = blocks.pair_arrays(scenario_rng(SEED, blocks.effect, i), config.max_pairs)
        total += _decision_pairs(config, factors, abort_factors, cur, cand)
    return total / trials


@lru_cache(maxsize=32)
def _estimate(config: SequentialConfig, cv: float, trials: int) -> ExplorationEstimate:
    rows = tuple(SlowdownCost(d, _mean_candidate_blocks(config, d, cv, trials)) for d in SLOWDOWNS)
    return ExplorationEstimate(plan_blocks=2 * config.max_pairs, cv=cv, rows=rows)


def trials_for(max_pairs: int) -> int:
    """Synthetic trials per slowdown for a budget of ``max_pairs``: TRIALS up to the default budget,
    fewer beyond (PAIRS_MEASURED)."""
    return max(MIN_TRIALS, min(TRIALS, PAIRS_MEASURED // max_pairs))


def expected_exploration(
    config: SequentialConfig, cv: float, trials: int | None = None
) -> ExplorationEstimate:
    """The expected extra cost of a trial run with ``config`` at pair noise ``cv`` (cached: the same
    arguments are measured once per process). Without CUPED: the pairs carry no covariate."""
    if config.cuped:
        raise ValueError("test.cuped: the exploration cost is measured without the covariate")
    if not (math.isfinite(cv) and 0.0 < cv <= 2.0):
        raise ValueError(f"cv: must be in (0, 2], got {cv!r}")
    return _estimate(config, float(cv), trials_for(config.max_pairs) if trials is None else trials)
