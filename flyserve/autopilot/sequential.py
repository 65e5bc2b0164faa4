"""The autopilot's statistical core: an anytime-valid paired test on switchback blocks.

A trial alternates the current thresholds and a candidate in blocks of engine steps (the order inside
each pair of blocks randomised). Each *pair* gives one number: the log ratio of the two blocks' measured
per-token kernel times, ``x = log(candidate / current)`` (negative: the candidate is faster).

Why a log ratio and not the relative difference ``(cand - cur) / cur``: with the same noise on both
arms, the relative difference is biased upwards (E[cand/cur] = E[cand] E[1/cur] > 1 under A/A, by about
CV^2: 1% at CV 0.10, half the effect the test must find), while the log ratio of two identically
distributed measurements is symmetric about zero; it turns multiplicative noise into additive noise,
and swapping the arms only flips its sign. For small effects it equals the relative difference.

The test is Lai's (1976) mixture sequential probability ratio test for a normal mean with *unknown*
variance (the "t-mSPRT"; Wang & Ramdas 2023, "Anytime-valid t-tests and confidence sequences for
Gaussian means with unknown variance"). With S = sum(x - m) and V = sum((x - m)^2) over n pairs,

    M_n(m) = sqrt(c / (n + c)) * (1 - S^2 / ((n + c) V)) ** (-n / 2)

is a nonnegative martingale when the mean is m, whatever the noise level: it is the likelihood ratio of
the scale-invariant part of the data, mixed over a normal prior N(0, 1/c) on the standardised effect
(mean / sd). Ville's inequality gives P(M_n(m) >= 1/alpha for some n) <= alpha, so the set of m with
M_n(m) < 1/alpha is a confidence sequence: it covers the true mean at every n at once, and may be looked
at after every pair. It has a closed form (``t_mixture_halfwidth``), so an update is O(1). Unlike the
normal-mixture mSPRT with a plug-in variance (Johari et al. 2017), nothing is plugged in: the variance
is mixed out, exactly, so the first blocks (where a variance estimate is poor) cannot fool it.

Decisions (``decide``), with t = log(1 - min_effect):

- ``promote``: the upper bound is below t: the candidate is faster by at least ``min_effect``;
- ``rollback``: the lower bound is above t: the candidate is not faster by ``min_effect`` (reason
  ``worse`` when the lower bound is above 0, ``no better than the minimum effect`` otherwise), or the
  abort check: a second confidence sequence, with a wide mixture that is tight after a few pairs,
  whose lower bound exceeds log(1 + abort_margin) (reason ``abort``);
- ``inconclusive`` once ``max_pairs`` pairs are in (the caller rolls back);
- ``continue`` otherwise.

Under its model (pair log ratios independent, normal, same variance) a false promotion (candidate not
faster by ``min_effect``, promoted) happens with probability <= 1 - confidence, however often one looks.
``flyserve autopilot trials`` measures the rates under heavier-tailed, drifting, GPU-like noise.

Optional CUPED-style adjustment: each pair may carry a covariate z, the log of the ratio of the
predicted costs of the two blocks' batches, both priced with the same thresholds, so that it carries
the workload's difference between the two blocks and nothing of the arms'. The first ``cuped_pairs``
pairs estimate the slope of x on z; the slope is then frozen and the main test runs on the later pairs'
x - slope * z, which (given the slope) are independent and identically distributed again, so the test
stays exact. No centring is needed: with the order inside a pair a coin flip, z is as likely to be
+d as -d, so its mean is 0 by design, as long as the arm does not change the batches themselves (then
leave cuped off: the adjusted test would measure the effect at fixed batches, not the total). The
abort check always runs on the unadjusted pairs, from the first.

Pure Python and math: this is what the sidecar will run per block, and what the trials command runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property, lru_cache


class SequentialConfigError(ValueError):
    """A configuration value out of range; the message starts with the field's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.field = name


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SequentialConfigError(name, f"must be a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise SequentialConfigError(name, f"must be finite, got {v!r}")
    return v


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SequentialConfigError(name, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise SequentialConfigError(name, f"must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class SequentialConfig:
    """What a trial decides with. Defaults: docs/autopilot.md (why each, and the trials table)."""

    confidence: float = 0.95
    """Coverage of the confidence sequence at every pair at once: P(false promotion) <= 1 - confidence."""
    min_effect: float = 0.005
    """Relative speed-up the candidate must show, at the confidence, to be promoted (0.005: 0.5%)."""
    max_pairs: int = 1500
    """Budget in block pairs: no decision by then is ``inconclusive`` (roll back)."""
    mixture_sd: float = 0.1
    """Sd of the normal mixture over the standardised effect (mean log ratio / its sd): the test is
    most sensitive to effects of about this size (0.1: a 1.4% effect at CV 0.10 per block)."""
    abort_margin: float = 0.10
    """Hard abort when the abort check's lower bound of the slowdown exceeds this (0.10: 10% slower)."""
    abort_mixture_sd: float = 1.0
    """The abort check's mixture sd: wide, so that its sequence is tight after a few pairs."""
    cuped: bool = False
    """Adjust each pair by its covariate (the blocks' predicted cost ratio); every pair must carry one."""
    cuped_pairs: int = 30
    """With cuped: the first pairs, which estimate the covariate's slope; the main test runs on the
    pairs after them (the abort check on all)."""

    def __post_init__(self) -> None:
        c = _number("confidence", self.confidence)
        if not 0.5 <= c < 1.0:
            raise SequentialConfigError("confidence", f"must be in [0.5, 1), got {c!r}")
        e = _number("min_effect", self.min_effect)
        if not 0.0 <= e < 0.5:
            raise SequentialConfigError("min_effect", f"must be in [0, 0.5), got {e!r}")
        _integer("max_pairs", self.max_pairs, 1)
        for name in ("mixture_sd", "abort_mixture_sd"):
            s = _number(name, getattr(self, name))
            if not 0.0 < s <= 100.0:
                raise SequentialConfigError(name, f"must be in (0, 100], got {s!r}")
        a = _number("abort_margin", self.abort_margin)
        if not 0.0 < a <= 100.0:
            raise SequentialConfigError("abort_margin", f"must be in (0, 100], got {a!r}")
        if not isinstance(self.cuped, bool):
            raise SequentialConfigError("cuped", f"must be true or false, got {type(self.cuped).__name__}")
        _integer("cuped_pairs", self.cuped_pairs, 3)

    @cached_property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @cached_property
    def promote_below(self) -> float:
        """The log ratio the upper bound must be under for a promotion: log(1 - min_effect)."""
        return math.log1p(-self.min_effect)

    @cached_property
    def abort_above(self) -> float:
        """The log ratio the abort check's lower bound must exceed for an abort: log(1 + abort_margin)."""
        return math.log1p(self.abort_margin)


def t_mixture_halfwidth(n: int, m2: float, alpha: float, mixture_sd: float) -> float:
    """Half-width of Lai's t-mixture confidence sequence after n observations.

    ``m2`` is the sum of squared deviations from their mean. The set {m: M_n(m) < 1/alpha} is
    {m: S(m)^2 < q V(m)} with q = (1 - 1/K)(n + c), log K = (2/n)(log(1/alpha) + log((n + c)/c)/2),
    c = 1/mixture_sd^2; solving the quadratic in m gives mean +- sqrt(q m2 / (n (n - q))) when n > q,
    and the whole line otherwise (too few observations for any conclusion at this confidence).
    """
    f = halfwidth_factor(n, alpha, mixture_sd)
    return math.inf if f == math.inf else math.sqrt(f * max(m2, 0.0))


@lru_cache(maxsize=65536)
def halfwidth_factor(n: int, alpha: float, mixture_sd: float) -> float:
    """q / (n (n - q)) of ``t_mixture_halfwidth``: the half-width is sqrt(factor * m2). It depends on
    neither the data nor their scale, so it is computed once per (n, alpha, mixture_sd)."""
    if n < 2:
        return math.inf
    c = 1.0 / (mixture_sd * mixture_sd)
    log_k = (2.0 / n) * (-math.log(alpha) + 0.5 * math.log1p(n / c))
    q = -math.expm1(-log_k) * (n + c)
    if q >= n:
        return math.inf
    return q / (n * (n - q))


class Verdict(str, Enum):
    CONTINUE = "continue"
    PROMOTE = "promote"
    ROLLBACK = "rollback"
    INCONCLUSIVE = "inconclusive"


# The reasons a decision gives (stable strings: the audit and replay will compare them).
REASON_RUNNING = "running"
REASON_BETTER = "better by at least the minimum effect"
REASON_WORSE = "worse"
REASON_NOT_BETTER = "no better than the minimum effect"
REASON_ABORT = "abort: far worse"
REASON_BUDGET = "budget spent"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    pairs: int
    estimate: float
    """Relative change of the candidate's kernel time per token (exp(mean log ratio) - 1; -0.02: 2% faster)."""
    lower: float
    upper: float
    """The confidence sequence's bounds on that relative change at this pair (-1 and inf when open)."""

    @property
    def final(self) -> bool:
        return self.verdict is not Verdict.CONTINUE

    def to_dict(self) -> dict[str, object]:
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        return {
            "verdict": self.verdict.value,
            "reason": self.reason,
            "pairs": self.pairs,
            "estimate": num(self.estimate),
            "lower": num(self.lower),
            "upper": num(self.upper),
        }


_PLAIN = (float, int)


def _pair_log_ratio(current: float, candidate: float) -> float:
    if (
        type(current) in _PLAIN
        and type(candidate) in _PLAIN
        and 0 < current < math.inf
        and 0 < candidate < math.inf
    ):
        return math.log(candidate / current)  # the common case, checked cheaply
    for name, v in (("current", current), ("candidate", candidate)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                f"{name}: a block's kernel time per token must be a finite number > 0, got {v!r}"
            )
    return math.log(candidate / current)


@dataclass(frozen=True)
class SequentialState:
    """The running statistics of one trial: O(1) memory, O(1) per pair (Welford updates).

    ``pairs``, ``mean``, ``m2``: all the pairs' log ratios (count, mean, sum of squared deviations).
    With CUPED, the first ``config.cuped_pairs`` pairs also estimate the slope of the log ratio on the
    covariate (``z_*``, ``xz_c``); the slope is then frozen, and ``adj_*`` hold the later pairs'
    adjusted log ratios x - slope * z, on which the main test runs (given the slope they are
    independent and identically distributed, as the test assumes). The abort check always runs on all
    the pairs, unadjusted.
    """

    pairs: int = 0
    mean: float = 0.0
    m2: float = 0.0
    z_mean: float = 0.0
    z_m2: float = 0.0
    xz_c: float = 0.0
    adj_pairs: int = 0
    adj_mean: float = 0.0
    adj_m2: float = 0.0

    @property
    def slope(self) -> float:
        """The covariate's slope from the first pairs (0 when their covariates do not vary)."""
        return self.xz_c / self.z_m2 if self.z_m2 > 0.0 else 0.0

    def update(
        self,
        config: SequentialConfig,
        current: float,
        candidate: float,
        covariate: float | None = None,
    ) -> SequentialState:
        """The state after one more pair: ``current`` and ``candidate`` are the pair's two blocks'
        measured kernel times per token (any unit, the same for both). ``covariate`` (used only with
        ``config.cuped``, then required): the log of the ratio of the two blocks' predicted costs,
        candidate's block over current's, both priced with the same thresholds."""
        x = _pair_log_ratio(current, candidate)
        n = self.pairs + 1
        dx = x - self.mean
        mean = self.mean + dx / n
        m2 = self.m2 + dx * (x - mean)
        if not config.cuped:
            return SequentialState(pairs=n, mean=mean, m2=m2)
        if (
            isinstance(covariate, bool)
            or not isinstance(covariate, int | float)
            or not math.isfinite(covariate)
        ):
            raise ValueError(f"covariate: with cuped on every pair needs a finite number, got {covariate!r}")
        z = float(covariate)
        if n <= config.cuped_pairs:  # still estimating the slope
            dz = z - self.z_mean
            z_mean = self.z_mean + dz / n
            return SequentialState(
                pairs=n,
                mean=mean,
                m2=m2,
                z_mean=z_mean,
                z_m2=self.z_m2 + dz * (z - z_mean),
                xz_c=self.xz_c + dx * (z - z_mean),
            )
        y = x - self.slope * z
        k = self.adj_pairs + 1
        dy = y - self.adj_mean
        adj_mean = self.adj_mean + dy / k
        return SequentialState(
            pairs=n,
            mean=mean,
            m2=m2,
            z_mean=self.z_mean,
            z_m2=self.z_m2,
            xz_c=self.xz_c,
            adj_pairs=k,
            adj_mean=adj_mean,
            adj_m2=self.adj_m2 + dy * (y - adj_mean),
        )

    def bounds(self, alpha: float, mixture_sd: float, *, adjusted: bool = False) -> tuple[float, float]:
        """The confidence sequence on the mean log ratio at this pair (lower, upper): of all the pairs,
        or (``adjusted``) of the CUPED-adjusted ones."""
        if adjusted:
            n, mean, m2 = self.adj_pairs, self.adj_mean, self.adj_m2
        else:
            n, mean, m2 = self.pairs, self.mean, self.m2
        w = t_mixture_halfwidth(n, m2, alpha, mixture_sd)
        return mean - w, mean + w


def _relative(log_ratio: float) -> float:
    if log_ratio == math.inf:
        return math.inf
    if log_ratio == -math.inf:
        return -1.0
    return math.expm1(log_ratio)


def decide(config: SequentialConfig, state: SequentialState) -> Decision:
    """The decision after ``state.pairs`` pairs (pure: the same state always gives the same decision)."""
    lo, hi = state.bounds(config.alpha, config.mixture_sd, adjusted=config.cuped)
    estimate = state.adj_mean if config.cuped and state.adj_pairs else state.mean

    def out(verdict: Verdict, reason: str) -> Decision:
        return Decision(verdict, reason, state.pairs, _relative(estimate), _relative(lo), _relative(hi))

    # The lower bound is below the mean: no abort to look for unless the mean is past the margin.
    if state.mean > config.abort_above:
        abort_lo, _ = state.bounds(config.alpha, config.abort_mixture_sd)
        if abort_lo > config.abort_above:
            return out(Verdict.ROLLBACK, REASON_ABORT)
    t = config.promote_below
    if hi < t:
        return out(Verdict.PROMOTE, REASON_BETTER)
    if lo > t:
        return out(Verdict.ROLLBACK, REASON_WORSE if lo > 0.0 else REASON_NOT_BETTER)
    if state.pairs >= config.max_pairs:
        return out(Verdict.INCONCLUSIVE, REASON_BUDGET)
    return out(Verdict.CONTINUE, REASON_RUNNING)


def run_pairs(
    config: SequentialConfig,
    pairs: object,
) -> tuple[Decision, SequentialState]:
    """Feed (current, candidate[, covariate]) pairs in order, deciding after each, until a final
    decision or the pairs run out (then the last decision, ``continue`` if the budget is not spent)."""
    state = SequentialState()
    decision = decide(config, state)
    for pair in pairs:  # type: ignore[attr-defined]
        cur, cand, *rest = pair
        state = state.update(config, cur, cand, rest[0] if rest else None)
        decision = decide(config, state)
        if decision.final:
            break
    return decision, state
