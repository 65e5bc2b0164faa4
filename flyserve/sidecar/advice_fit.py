"""Live advice: calibrate's fitter (flyserve.pricing.fit) on a window's priced shapes.

It starts from the thresholds in force and proposes only the run-time knobs it changes, and only
where they pay (minimal_change), never decode_path. The knobs fixed at start (decode_path, the KV
block size) are priced apart (flyserve.sidecar.restart_advice): named with their saving, "needs a
restart", never in the ready PATCH.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flyserve.policy import PREFILL, UNIFIED, Thresholds, ThresholdsError
from flyserve.policy.routing import paths_under
from flyserve.pricing.costs import CostEntry
from flyserve.pricing.fit import PREFILL_KNOBS, fit_thresholds
from flyserve.sidecar.regret import PricedSample, RegretSummary, summarize
from flyserve.sidecar.restart_advice import Reprice, RestartKnobAdvice, restart_advice

FIT_CANDIDATES = 48
"""Candidate values per knob in a live fit (see flyserve.pricing.fit._thin)."""
ADVICE_KNOBS = PREFILL_KNOBS
"""What advice may change: the knobs the fitter informs, all changeable while serving
(decode_path is fixed at start: the engine captured its CUDA graphs with it)."""


@dataclass(frozen=True)
class AdviceResult:
    samples: list[PricedSample]
    current: Thresholds
    proposed: Thresholds
    before: RegretSummary
    after: RegretSummary
    paths_before: list[str]
    paths_after: list[str]
    restart: list[RestartKnobAdvice] = field(default_factory=list)
    """Start-time knobs (decode_path, KV block size) worth a restart: never part of ``changes``."""

    @property
    def changes(self) -> dict[str, tuple[Any, Any]]:
        return {k: v for k, v in self.current.diff(self.proposed).items() if k in ADVICE_KNOBS}


def route(samples: Sequence[PricedSample], t: Thresholds) -> list[str]:
    """The path decide() picks for each sample under ``t`` (as a rank would, breaker closed)."""
    return paths_under((p.sample for p in samples), t)


def _rerouted(samples: Sequence[PricedSample], paths: Sequence[str]) -> RegretSummary:
    re = [
        PricedSample(p.time, p.sample, p.unified_s, p.prefill_s, path, p.predicted(path))
        for p, path in zip(samples, paths, strict=True)
    ]
    span = (samples[-1].time - samples[0].time) if len(samples) > 1 else 0.0
    return summarize(re, span)


def _routed_s(samples: Sequence[PricedSample], t: Thresholds) -> float:
    return sum(p.predicted(path) for p, path in zip(samples, route(samples, t), strict=True))


def minimal_change(samples: Sequence[PricedSample], current: Thresholds, fitted: Thresholds) -> Thresholds:
    """The fitted values only where they pay: nothing unless they are strictly cheaper on
    ``samples``, then each changed knob put back while that costs nothing. The fitter breaks ties
    toward the most permissive value (right for a calibration grid); live advice must not widen a
    knob the window cannot tell anything about (seen in the CPU demo: four "free" changes)."""
    eps = 1e-12
    best = _routed_s(samples, fitted)
    if not best < _routed_s(samples, current) - eps:
        return current
    out = fitted
    for knob, (old, _new) in current.diff(fitted).items():
        try:
            cand = out.merged({knob: old})
        except ThresholdsError:  # e.g. min_seq_len back above a max_seq_len that moved
            continue
        if _routed_s(samples, cand) <= best + eps:
            out = cand
    return out


def advise(
    samples: Sequence[PricedSample],
    current: Thresholds,
    *,
    block_sizes: Sequence[int] = (),
    reprice: Reprice | None = None,
) -> AdviceResult:
    """Calibrate's fitter on live shapes. Before and after are both decide() under the thresholds
    (not the recorded paths), so the comparison is like for like. The start-time knobs are priced
    on top of the result (flyserve.sidecar.restart_advice), apart from the run-time changes."""
    if not samples:
        raise ValueError("no priced shapes in the window")
    heads = {p.sample.num_heads for p in samples}
    # Batches without a prefill row take decode_path whatever the run-time knobs say: a constant
    # in every candidate's total, so the fit runs on the others only (the bulk of a window is decode).
    routable = [p for p in samples if p.has_prefill_row]
    if len(heads) != 1:
        raise ValueError(f"the window mixes ranks with {sorted(heads)} query heads: advice needs one layer")
    entries = [
        CostEntry(
            "mixed",
            p.sample.query_lens,
            p.sample.seq_lens or (),
            {UNIFIED: p.unified_s, PREFILL: p.prefill_s},
        )
        for p in routable
    ]
    if entries:
        fit = fit_thresholds(
            entries, num_heads=heads.pop(), base=current, fit_decode_path=False, max_candidates=FIT_CANDIDATES
        ).thresholds
    else:
        fit = current
    keep = {k: v for k, v in fit.model_dump().items() if k not in ADVICE_KNOBS}
    proposed = minimal_change(routable, current, fit.merged({k: getattr(current, k) for k in keep}))
    before_paths, after_paths = route(samples, current), route(samples, proposed)
    return AdviceResult(
        list(samples),
        current,
        proposed,
        _rerouted(samples, before_paths),
        _rerouted(samples, after_paths),
        before_paths,
        after_paths,
        restart_advice(samples, proposed, block_sizes=block_sizes, reprice=reprice, paths=after_paths),
    )
