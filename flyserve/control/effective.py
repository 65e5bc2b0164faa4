"""When a new version takes effect: one engine step per engine, the same for every rank of it.

A rank's background thread notices a new version up to one report interval after it is published
(longer on a loaded machine), so the step must lie ``lead_s`` seconds ahead of where the engine's
fastest rank is now. The rules (issue 13):

* only live ranks count (fresh report, pid alive where visible, finite plausible values), so a
  dead engine's or a stray file's step cannot pin later changes;
* per engine: data-parallel engines count steps independently;
* a rank that has not measured its step rate yet (its first second, or an engine that has not
  stepped) is assumed to step at ``assumed_steps_per_s`` - late is worse than a few seconds' wait;
* the previous version's step is a floor only for an engine whose live ranks still have that
  version pending: an engine restarted on the same state directory (steps from 0 again, the
  current version loaded at start) starts from its own steps, not the old generation's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flyserve.control.reports import RankReport

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


def plan_steps(
    reports: Iterable[RankReport],
    *,
    now: float,
    stale_after_s: float,
    step_margin: int,
    lead_s: float,
    previous: Mapping[str, int],
    previous_version: int,
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
        best, fastest = 0, 0.0
        for r in ranks:
            rate = r.steps_per_s
            if rate is None:
                rate, assumed = assumed_steps_per_s, True
            best = max(best, r.step + math.ceil(rate * r.age(now)))
            fastest = max(fastest, rate)
        step = best + max(step_margin, math.ceil(fastest * lead_s))
        prev = previous.get(engine, previous.get(DEFAULT_ENGINE))
        if prev is not None and any(
            r.applied_version is not None and r.applied_version < previous_version for r in ranks
        ):
            step = max(step, prev)  # versions apply in order on each rank
        steps[engine] = step
    steps[DEFAULT_ENGINE] = max(step_margin, math.ceil(assumed_steps_per_s * lead_s))
    return StepPlan(steps, sum(len(v) for v in by_engine.values()), assumed)
