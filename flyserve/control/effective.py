"""When a new version takes effect: one engine step per engine, the same for every rank of it.

A rank's background thread notices a new version up to one report interval after it is published
(longer on a loaded machine), so the step must lie ``lead_s`` seconds ahead of where the engine's
fastest rank is now. The rules:

* only live ranks count (fresh report, finite plausible values, pid not known gone), so a dead
  engine's or a stray file's step cannot pin later changes;
* per engine: data-parallel engines count steps independently;
* a rank that has not measured its step rate yet (its first second, or an engine that has not
  stepped) is assumed to step at ``assumed_steps_per_s`` - late is worse than a few seconds' wait;
* a report that contradicts what the reader saw of the same process (its step jumped faster than
  any engine steps, by the reader's clock) never gets here (flyserve.control.witness);
* files anyone can write do not decide (three plausible reports "from another
  host" with step 1e11 outvoted two real ranks and pinned every change, ``circuit open`` included).
  A report is CONFIRMED when the process table vouches for it (flyserve.control.reports.liveness:
  this host, this pid namespace, pid alive and still the process the rank recorded (its /proc
  start time), the file read owned by that process's uid, a uid the reader trusts), else
  UNCONFIRMED. Per engine:

  - the step is planned from its confirmed ranks, or from its unconfirmed ranks when it has no
    confirmed one (another container's pid namespace): an unconfirmed report never raises the
    step of an engine that has a confirmed rank;
  - anchored at the lowest: no rank is believed more than CONSENSUS_S seconds at the slowest
    live rank's rate plus max(step_margin, CONSENSUS_STEPS) steps ahead of the lowest projected
    step of the ranks counted (the confirmed ones when the engine has any), and no rate above
    twice the slowest. An unconfirmed report next to confirmed ranks moves nothing: one with a low
    step or a slow rate once pulled the step into the past (each rank then applied at its own next
    step: not one step) - measured by benchmarks/bench_sidecar_under_attack.py.
    A counted report can pull the step down (the ranks then apply at once, each at its own next step,
    counted as late applies) but cannot push it up past the honest ranks' by more than that.

  **The bound.** For any honest live rank R of an engine (projected step p, rate r = its
  ``steps_per_s``, or ``assumed_steps_per_s`` before it has measured one) whose own report the
  reader counts when the change is planned - read from its file, or, where a forgery was renamed
  over that file, R's last credible report put back by flyserve.control.witness - whatever any
  number of other reports say, confirmed or not::

      effective_step <= p + ceil(r * CONSENSUS_S) + max(step_margin, CONSENSUS_STEPS)
                          + max(step_margin, ceil(2 * r * lead_s))

  so R applies the change at most CONSENSUS_S + 2 * lead_s seconds plus CONSENSUS_STEPS + 2 of its
  engine's steps after it is published (defaults: 8 s + 66 steps), against lead_s (3 s) without
  forgeries: forged reports delay a change by at most 5 s + 66 steps. Forged reports of the item-3
  kind (another host: unconfirmed) next to confirmed ranks delay it by nothing. Measured with the
  real simulator and sidecar (scripts/measure_forged_reports.py, docs/operations.md "Failure
  modes"). In the engine-channel mode none of this applies: versions apply from the next step.

  **Where it does not hold.** The reader counts R's own report only if R's file holds it at the
  look, or the reader owns R's key: R was confirmed at an earlier look and its process still
  lives (witness), or ranks/ carries the sticky bit (Store makes it so) and the forger is another
  uid (it cannot rename over R's file). A forger who can replace the files of EVERY rank of an
  engine that the reader cannot confirm - ranks in another pid namespace (containers without a
  shared pid namespace; deploy/'s pod shares it), the typical case a single-rank (TP 1) engine -
  with a report claiming a far step, at the moment a change is planned, pins that change: its
  step for that engine is what the forgery claims (parse_report caps it only at 10,000 steps/s
  since the claimed start). The ranks then hold it as ``pending_version`` and never reach it;
  the next change, planned when the ranks' own reports are back, supersedes it (no floor, below).
  The operator sees the version's ``engine_steps`` far above the ranks' ``step`` and its number
  as ``pending_version`` in /dispatch-stats, the audit line's ``ranks`` with ``confirmed: 0``, and
  the log line ``thresholds: N live rank report(s) cannot be confirmed by the process table``;
  re-issuing the change once the writer is stopped applies it. A process of the ranks' own uid on
  their host can kill or ptrace the ranks and is out of scope;
* no floor from the previous version: a rank applies a newer version whose step has come even
  when an older one is still pending (RankControl), so a version published with a bad step is
  superseded by the next change instead of holding every later one back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flyserve.control.reports import Liveness, RankReport, liveness

CONSENSUS_S = 2.0
"""How far (in seconds of the engine's slowest live rank's rate) one rank may be believed ahead of
the engine's lowest: reports are written about once a second, so live ranks of one engine differ
by less."""
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
    assumed_rate: bool  # some counted rank had no measured rate
    confirmed_ranks: int = 0
    unconfirmed_ranks: int = 0
    unconfirmed_ignored: int = 0  # unconfirmed ranks of engines that had a confirmed one

    @property
    def effective_step(self) -> int:
        """The step shown for the version: engine 0's, else the default's."""
        return self.engine_steps.get("0", self.engine_steps[DEFAULT_ENGINE])


def _rate(r: RankReport, assumed: float) -> float:
    return assumed if r.steps_per_s is None else r.steps_per_s


def _engine_step(
    counted: list[RankReport],
    every: list[RankReport],
    *,
    now: float,
    step_margin: int,
    lead_s: float,
    assumed: float,
) -> int:
    """One engine's effective step: the highest projected step of ``counted`` (its confirmed ranks,
    else its unconfirmed ones), capped at the lowest projection of ``every`` live rank of the
    engine plus the consensus slack, plus the lead margin (the module docstring's bound)."""
    rates = [_rate(r, assumed) for r in counted]
    projected = [r.step + math.ceil(rate * r.age(now)) for r, rate in zip(counted, rates, strict=True)]
    if len(every) >= 2:  # one engine's ranks step together: no rank is believed far above the lowest
        slowest = min(_rate(r, assumed) for r in every)
        anchor = min(r.step + math.ceil(_rate(r, assumed) * r.age(now)) for r in every)
        slack = math.ceil(slowest * CONSENSUS_S) + max(step_margin, CONSENSUS_STEPS)
        projected = [min(p, anchor + slack) for p in projected]
        rates = [min(rate, 2.0 * slowest) for rate in rates]
    return int(max(projected) + max(step_margin, math.ceil(max(rates) * lead_s)))


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
    confirmed: dict[str, list[RankReport]] = {}
    unconfirmed: dict[str, list[RankReport]] = {}
    for r in reports:
        state = liveness(r, now=now, stale_after_s=stale_after_s)
        if state is not Liveness.GONE:
            into = confirmed if state is Liveness.CONFIRMED else unconfirmed
            into.setdefault(str(r.engine), []).append(r)
    steps: dict[str, int] = {}
    assumed = False
    ignored = 0
    for engine in sorted(confirmed.keys() | unconfirmed.keys()):
        sure, unsure = confirmed.get(engine, []), unconfirmed.get(engine, [])
        counted = sure or unsure
        ignored += len(unsure) if sure else 0
        assumed = assumed or any(r.steps_per_s is None for r in counted)
        steps[engine] = _engine_step(
            counted,
            counted,  # an engine with a confirmed rank: unconfirmed reports neither raise nor pull down
            now=now,
            step_margin=step_margin,
            lead_s=lead_s,
            assumed=assumed_steps_per_s,
        )
    steps[DEFAULT_ENGINE] = max(step_margin, math.ceil(assumed_steps_per_s * lead_s))
    n_sure = sum(map(len, confirmed.values()))
    n_unsure = sum(map(len, unconfirmed.values()))
    return StepPlan(steps, n_sure + n_unsure, assumed, n_sure, n_unsure, ignored)
