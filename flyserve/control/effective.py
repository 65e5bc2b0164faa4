"""When a new version takes effect: one engine step per engine, the same for every rank of it.

A rank's background thread notices a new version up to one report interval after it is published
(longer on a loaded machine), so the step must lie ``lead_s`` seconds ahead of where the engine's
fastest rank is now. The rules (issue 13):

* only live ranks count (fresh report, pid alive where visible, finite plausible values), so a
  dead engine's or a stray file's step cannot pin later changes;
* per engine: data-parallel engines count steps independently;
* a rank that has not measured its step rate yet (its first second, or an engine that has not
  stepped) is assumed to step at ``assumed_steps_per_s`` - late is worse than a few seconds' wait;
* the ranks of one engine step together (tensor parallel: the same step within a report interval),
  so with two or more live ranks no rank is believed far above the engine's lower median: a forged
  ranks/7.json (step 1e9, or steps_per_s at the 10000 limit) once pinned every later change for
  25 minutes (issue 13 review). Each rank's projected step is capped at the lower median plus
  CONSENSUS_S seconds at the median rate plus CONSENSUS_STEPS, its rate at twice the median's or the
  assumed rate, whichever is higher.
  A forged report can at worst make a change apply late (counted as late applies), never pin it;
* no floor from the previous version: a rank applies a newer version whose step has come even
  when an older one is still pending (RankControl), so a version published with a bad step is
  superseded by the next change instead of holding every later one back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flyserve.control.reports import RankReport

CONSENSUS_S = 2.0
"""How far (in seconds of the engine's median rate) one rank may be believed ahead of its engine's
lower median: reports are written about once a second, so live ranks of one engine differ by less."""
CONSENSUS_STEPS = 64
"""... plus this many steps (an idle engine's ranks report rate 0 but may differ by a few steps)."""
ASSUMED_STEPS_PER_S = 500.0
"""Step rate assumed for a rank that has not measured one: above vLLM's ~200/s small-batch decode."""
DEFAULT_ENGINE = "*"
"""engine_steps key for engines with no live rank at publish time (they have not reported yet, so
they are in their first second: step 0 plus the assumed rate's margin)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """engine -> effective step (DEFAULT_ENGINE for engines not seen), and what it was based on."""

    engine_steps: Mapping[str, int]
    live_ranks: int
    assumed_rate: bool  # some live rank had no measured rate

    @property
    def effective_step(self) -> int:
        """The step shown for the version: engine 0's, else the default's."""
        return self.engine_steps.get("0", self.engine_steps[DEFAULT_ENGINE])


def _lower_median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def plan_steps(
    reports: Iterable[RankReport],
    *,
    now: float,
    stale_after_s: float,
    step_margin: int,
    lead_s: float,
    assumed_steps_per_s: float = ASSUMED_STEPS_PER_S,
) -> StepPlan:
    """The effective step of a new version for each engine with a live rank, plus a default."""
    by_engine: dict[str, list[RankReport]] = {}
    for r in reports:
        if r.is_live(now, stale_after_s):
            by_engine.setdefault(str(r.engine), []).append(r)
    steps: dict[str, int] = {}
    assumed = False
    for engine, ranks in by_engine.items():
        rates = []
        for r in ranks:
            if r.steps_per_s is None:
                assumed = True
            rates.append(assumed_steps_per_s if r.steps_per_s is None else r.steps_per_s)
        projected = [r.step + math.ceil(rate * r.age(now)) for r, rate in zip(ranks, rates, strict=True)]
        if len(ranks) >= 2:  # one engine's ranks agree: a rank far above the rest is not believed
            median_rate = _lower_median(rates)
            slack = math.ceil(median_rate * CONSENSUS_S) + max(step_margin, CONSENSUS_STEPS)
            top = _lower_median(projected) + slack
            projected = [min(p, top) for p in projected]
            cap = max(2.0 * median_rate, assumed_steps_per_s)  # no faster than an unmeasured rank
            rates = [min(rate, cap) for rate in rates]
        step = max(projected) + max(step_margin, math.ceil(max(rates) * lead_s))
        steps[engine] = int(step)
    steps[DEFAULT_ENGINE] = max(step_margin, math.ceil(assumed_steps_per_s * lead_s))
    return StepPlan(steps, sum(len(v) for v in by_engine.values()), assumed)
