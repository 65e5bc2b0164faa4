"""The advice worker's job (flyserve.sidecar.advice_worker runs it, one fit at a time, off the
request threads): read and price the new shape samples, check them against the ranks' decision
counters, then fit (flyserve.sidecar.advice_fit)."""

from __future__ import annotations

from dataclasses import dataclass

from flyserve.sidecar.advice_fit import AdviceResult
from flyserve.sidecar.live_costs import REGRET_WINDOWS
from flyserve.sidecar.sample_evidence import Evidence
from flyserve.sidecar.service import StatsService


@dataclass(frozen=True, slots=True)
class FittedAdvice:
    """One advice fit: what it returned and the thresholds version it was fitted against."""

    result: AdviceResult
    version: int
    evidence: Evidence | None = None


class UncorroboratedSamples(Exception):
    """The window's samples are not what their ranks' decision counters counted: no fit (409,
    field ``samples``)."""

    def __init__(self, evidence: Evidence) -> None:
        super().__init__(evidence.reason)
        self.evidence = evidence


def compute_advice(service: StatsService, window: str) -> FittedAdvice:
    """The fit itself (on the advice worker's thread, flyserve.sidecar.advice_worker): read and
    price the new shape samples, check them against the ranks' decision counters, then fit.
    ValueError: nothing to fit (the route's 409); UncorroboratedSamples: samples refused (409)."""
    assert service.pricing is not None
    service.price_new_samples()
    snap = service.snapshot()
    # Before any fit (the expensive part): are the window's samples what the ranks counted?
    evidence = service.sample_evidence(
        (p.sample for p in service.pricing.window(REGRET_WINDOWS[window])), REGRET_WINDOWS[window]
    )
    if not evidence.corroborated:
        raise UncorroboratedSamples(evidence)
    try:
        res = service.pricing.advise(
            snap.thresholds, window_s=REGRET_WINDOWS[window], max_shapes=service.settings.advice_shape_limit
        )
    except ValueError as exc:
        why = service.pricing.unpriceable
        raise ValueError(f"{exc}" + (f" ({why})" if why else "")) from None
    return FittedAdvice(res, snap.version, evidence)
