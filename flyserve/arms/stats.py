"""From raw responses to the figures of the report, and the significance tests.

Pairs compared (P prompts, K runs per arm):
- cross-arm: every run of A against every run of B for each prompt (P*K*K pairs), A on the left;
- self (the noise floor): each arm's run i against its run j, i < j (P*K*(K-1)/2 pairs per arm),
  run i on the left.
With deterministic serving the K runs of an arm are identical and the noise floor is 0; with batch-
dependent numerics (different batches on each run) they are not, and a cross-arm divergence rate
is only news when it is above that floor.

Tests (both a paired bootstrap over prompts: prompts are resampled with replacement, each keeps
its own pair of measurements, the RNG seed is fixed so the figures are reproducible):
- accuracy difference: per prompt, accuracy of B minus accuracy of A (mean over runs);
- divergence rate vs noise: per prompt, cross-arm divergence share minus self-divergence share
  (mean over both arms' self pairs).
The p-value is two-sided for "the mean difference is 0": the share of resamples whose mean lies at
least as far from the observed mean as the observed mean lies from 0 (the bootstrap distribution
shifted to the null), with the +1 correction so it is never reported as exactly 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from flyserve.arms.align import PairComparison, Response, compare_pair
from flyserve.arms.extract import Extractor
from flyserve.arms.prompts import PromptItem

ARMS = ("a", "b")
BOOTSTRAP_SEED = 20251129
_CHUNK = 1000


@dataclass(frozen=True)
class BootstrapResult:
    observed: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    resamples: int
    seed: int

    def to_json(self) -> dict:
        return {
            "observed": self.observed,
            "ci95": [self.ci_low, self.ci_high],
            "p_value": self.p_value,
            "prompts": self.n,
            "resamples": self.resamples,
            "seed": self.seed,
        }


def paired_bootstrap(
    diffs: Sequence[float] | npt.NDArray[np.float64], *, resamples: int = 10000, seed: int = BOOTSTRAP_SEED
) -> BootstrapResult:
    """Bootstrap the mean of per-prompt differences; 95% percentile CI and a two-sided p-value."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        raise ValueError("paired_bootstrap needs at least one prompt")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    n = d.size
    for start in range(0, resamples, _CHUNK):  # chunks bound the index matrix (1319 prompts: 10 MB)
        stop = min(start + _CHUNK, resamples)
        idx = rng.integers(0, n, size=(stop - start, n))
        means[start:stop] = d[idx].mean(axis=1)
    observed = float(d.mean())
    # Compare with a small tolerance: resample means of identical values differ from `observed` by ulps.
    tol = 1e-12
    extreme = int(np.count_nonzero(np.abs(means - observed) >= abs(observed) - tol))
    p = (1 + extreme) / (resamples + 1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return BootstrapResult(observed, float(lo), float(hi), min(1.0, p), int(n), resamples, seed)


def _share(flags: Sequence[bool]) -> float | None:
    return float(np.mean(flags)) if len(flags) else None


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def _drift_summary(pairs: Sequence[PairComparison]) -> dict | None:
    """How far the best-token logprobs differ on the shared prefix (numerics that flipped nothing)."""
    drifts = [c.prefix_drift for c in pairs if c.prefix_drift is not None]
    if not drifts:
        return None
    return {
        "pairs": len(drifts),
        "share_nonzero": _share([d > 0.0 for d in drifts]),
        "median": _median(drifts),
        "max": float(max(drifts)),
    }


def cross_pairs(
    responses: Mapping[tuple[str, int, int], Response], prompts: int, runs: int, extractor: Extractor
):
    out: list[PairComparison] = []
    for p in range(prompts):
        for i, j in itertools.product(range(runs), range(runs)):
            out.append(compare_pair(responses[("a", i, p)], responses[("b", j, p)], extractor))
    return out


def self_pairs(responses, arm: str, prompts: int, runs: int, extractor: Extractor):
    out: list[PairComparison] = []
    for p in range(prompts):
        for i, j in itertools.combinations(range(runs), 2):
            out.append(compare_pair(responses[(arm, i, p)], responses[(arm, j, p)], extractor))
    return out


def _per_prompt_share(pairs: Sequence[PairComparison], prompts: int) -> np.ndarray:
    tot = np.zeros(prompts)
    cnt = np.zeros(prompts)
    for c in pairs:
        tot[c.prompt] += c.diverged
        cnt[c.prompt] += 1
    return tot / np.maximum(cnt, 1)


#: Below this many prompts the bootstrap's CI and p-value are rough (the resamples see few distinct sets).
FEW_PROMPTS = 30


def _caveat(n: int) -> str:
    return (
        f" Caution: only {n} prompts; a bootstrap over so few is rough (use hundreds)."
        if n < FEW_PROMPTS
        else ""
    )


def _plain_accuracy(acc_a: float, acc_b: float, t: BootstrapResult) -> str:
    pts = 100 * t.observed
    direction = "higher" if pts > 0 else "lower" if pts < 0 else "no different"
    amount = f"{abs(pts):.2f} points {direction} than" if pts else "no different from"
    verdict = (
        "unlikely to be run-to-run luck (p < 0.05)"
        if t.p_value < 0.05
        else "not distinguishable from chance at the 5% level"
    )
    return (
        f"Arm B's accuracy ({100 * acc_b:.2f}%) is {amount} arm A's ({100 * acc_a:.2f}%); "
        f"95% CI of B - A: {100 * t.ci_low:+.2f} to {100 * t.ci_high:+.2f} points, p = {t.p_value:.3g} "
        f"(paired bootstrap over {t.n} prompts): {verdict}.{_caveat(t.n)}"
    )


def _plain_divergence(cross: float, noise: float, t: BootstrapResult) -> str:
    if t.p_value < 0.05 and t.observed > 0:
        verdict = "the arms differ from each other more than each arm differs from itself (p < 0.05)"
    elif t.p_value < 0.05:
        verdict = "the arms differ from each other LESS than the arms differ from themselves (p < 0.05)"
    else:
        verdict = "the cross-arm divergence is within each arm's own run-to-run noise at the 5% level"
    return (
        f"{100 * cross:.1f}% of cross-arm response pairs diverge, against a noise floor of {100 * noise:.1f}% "
        f"(each arm against itself); difference {100 * t.observed:+.1f} points, 95% CI "
        f"{100 * t.ci_low:+.1f} to {100 * t.ci_high:+.1f}, p = {t.p_value:.3g} (paired bootstrap over "
        f"{t.n} prompts): {verdict}.{_caveat(t.n)}"
    )


def analyze(
    items: Sequence[PromptItem],
    responses: Mapping[tuple[str, int, int], Response],
    runs: int,
    extractor: Extractor,
    *,
    resamples: int = 10000,
    seed: int = BOOTSTRAP_SEED,
) -> dict:
    """All figures of the report as a JSON-ready dict. `responses` must hold (arm, run, prompt) for
    every arm in ('a', 'b'), run < runs and prompt index of `items`."""
    P = len(items)
    missing = [(a, r, p) for a in ARMS for r in range(runs) for p in range(P) if (a, r, p) not in responses]
    if missing:
        raise ValueError(f"{len(missing)} responses missing, e.g. (arm, run, prompt) = {missing[0]}")

    cross = cross_pairs(responses, P, runs, extractor)
    diverged = [c for c in cross if c.diverged]
    margins = [c.margin for c in diverged if c.margin is not None]
    selfs = {arm: self_pairs(responses, arm, P, runs, extractor) for arm in ARMS}

    report: dict = {
        "prompts": P,
        "runs": runs,
        "extractor": extractor.name,
        "pairs_compared": len(cross),
        "diverged_share": _share([c.diverged for c in cross]),
        "answer_changed_share": _share([c.answer_changed for c in cross]),
        "answer_changed_given_diverged_share": _share([c.answer_changed for c in diverged]),
        "first_divergence_positions": [c.first_divergence for c in diverged],
        "first_divergence_position_median": _median([c.first_divergence for c in diverged]),
        "divergence_margins": margins,
        "margin_definition": "at the first divergence, arm A's logprob(top-1) - logprob(top-2) "
        "(self pairs: the lower-numbered run's)",
        "margin_median": _median(margins),
        "margin_quartiles": [float(q) for q in np.percentile(margins, [25, 50, 75])] if margins else None,
        "margin_zero_share": _share([m == 0.0 for m in margins]),
        "divergences_without_margin": len(diverged) - len(margins),
        "self_divergence_share": {arm: _share([c.diverged for c in selfs[arm]]) for arm in ARMS},
        "self_answer_changed_share": {arm: _share([c.answer_changed for c in selfs[arm]]) for arm in ARMS},
        "self_divergence_margins": {
            arm: [c.margin for c in selfs[arm] if c.diverged and c.margin is not None] for arm in ARMS
        },
        "logprob_drift": {
            "a_vs_b": _drift_summary(cross),
            "a_vs_a": _drift_summary(selfs["a"]),
            "b_vs_b": _drift_summary(selfs["b"]),
        },
        "accuracy": None,
        "accuracy_stderr": None,
        "answered_prompts": 0,
        "tests": {},
        "pairs": [c.to_json() for c in cross],
        "self_pairs": {arm: [c.to_json() for c in selfs[arm]] for arm in ARMS},
    }

    answered = [(it.index, extractor.normalize_answer(it.answer)) for it in items if it.answer is not None]
    if answered:
        per_prompt = {arm: np.zeros(len(answered)) for arm in ARMS}
        for arm in ARMS:
            for k, (p, key) in enumerate(answered):
                hits = [
                    key is not None and extractor.extract(responses[(arm, r, p)].text) == key
                    for r in range(runs)
                ]
                per_prompt[arm][k] = np.mean(hits)
        acc = {arm: float(per_prompt[arm].mean()) for arm in ARMS}
        n = len(answered)
        report["answered_prompts"] = n
        report["accuracy"] = acc
        # lm-eval's stderr of a mean of per-prompt scores: sample std / sqrt(n).
        report["accuracy_stderr"] = {
            arm: float(per_prompt[arm].std(ddof=1) / np.sqrt(n)) if n > 1 else None for arm in ARMS
        }
        t = paired_bootstrap(per_prompt["b"] - per_prompt["a"], resamples=resamples, seed=seed)
        report["tests"]["accuracy_difference"] = {
            **t.to_json(),
            "measure": "accuracy(B) - accuracy(A), per prompt mean over runs",
            "statement": _plain_accuracy(acc["a"], acc["b"], t),
        }

    if runs >= 2:
        cross_pp = _per_prompt_share(cross, P)
        self_pp = (_per_prompt_share(selfs["a"], P) + _per_prompt_share(selfs["b"], P)) / 2
        t = paired_bootstrap(cross_pp - self_pp, resamples=resamples, seed=seed)
        noise = float(self_pp.mean())
        report["noise_floor_share"] = noise
        report["tests"]["divergence_vs_noise"] = {
            **t.to_json(),
            "measure": "cross-arm divergence share - self-divergence share (mean of both arms), per prompt",
            "statement": _plain_divergence(float(cross_pp.mean()), noise, t),
        }
    else:
        report["noise_floor_share"] = None
        report["tests"]["divergence_vs_noise"] = {
            "statement": "Only one run per arm: no noise floor and no divergence test (use --runs 2 or more)."
        }
    return report
