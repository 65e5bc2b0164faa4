"""Priced samples and what a window of them cost: routed, oracle, always-one-path, drift.

One sampled step is priced once (flyserve.sidecar.live_costs.LivePricing) into a PricedSample; the
regret section of /dispatch-stats and both sides of advice sum windows of them here, in sample
order, with the arithmetic of ``flyserve replay`` (flyserve.lab.replay).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flyserve.policy import PATHS, PREFILL
from flyserve.telemetry.shape_sample import ShapeSample

PREFILL_ROW_MIN_QUERY = 2
"""Thresholds.min_query_len's default: a batch with a row this long has a prefill row."""


@dataclass(frozen=True, slots=True)
class PricedSample:
    """One sampled step, priced once: seconds of one attention call on each path."""

    time: float
    sample: ShapeSample
    unified_s: float
    prefill_s: float
    routed_path: str
    routed_s: float

    @property
    def oracle_s(self) -> float:
        return min(self.unified_s, self.prefill_s)

    @property
    def has_prefill_row(self) -> bool:
        """A row of 2+ query tokens: the batches run-time thresholds route. The others (decode only)
        always take decode_path, fixed at start; their share of regret needs a restart to change."""
        return max(self.sample.query_lens, default=0) >= PREFILL_ROW_MIN_QUERY

    def predicted(self, path: str) -> float:
        return self.prefill_s if path == PREFILL else self.unified_s


@dataclass(frozen=True)
class RegretSummary:
    """Priced totals over one window. Seconds are sums of one attention call per sampled step."""

    samples: int
    span_s: float
    routed_s: float
    oracle_s: float
    always_unified_s: float
    always_prefill_s: float
    wrong_samples: int
    drift: dict[str, dict[str, Any]]
    prefill_batches: dict[str, Any]

    def ratio(self, num: float) -> float | None:
        return num / self.oracle_s if self.oracle_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        r = self.ratio(self.routed_s)
        return {
            "samples": self.samples,
            "span_s": round(self.span_s, 3),
            "routed_s": self.routed_s,
            "oracle_s": self.oracle_s,
            "always_unified_s": self.always_unified_s,
            "always_prefill_s": self.always_prefill_s,
            "routed_over_oracle": r,
            "regret": None if r is None else r - 1.0,
            "always_unified_over_oracle": self.ratio(self.always_unified_s),
            "always_prefill_over_oracle": self.ratio(self.always_prefill_s),
            "wrong_samples": self.wrong_samples,
            "prefill_batches": self.prefill_batches,
            "drift": self.drift,
        }


def summarize(priced: Sequence[PricedSample], span_s: float) -> RegretSummary:
    """Totals of ``priced``, summed in sample order (so the same samples give the same floats as
    ``flyserve replay`` summing the same steps)."""
    n = len(priced)
    u = np.fromiter((p.unified_s for p in priced), dtype=np.float64, count=n)
    pf = np.fromiter((p.prefill_s for p in priced), dtype=np.float64, count=n)
    routed = np.fromiter((p.routed_s for p in priced), dtype=np.float64, count=n)
    oracle = np.minimum(u, pf)
    has_prefill = np.fromiter((p.has_prefill_row for p in priced), dtype=bool, count=n)
    pr, po = float(routed[has_prefill].sum()), float(oracle[has_prefill].sum())
    return RegretSummary(
        samples=n,
        span_s=span_s,
        routed_s=float(routed.sum()),
        oracle_s=float(oracle.sum()),
        always_unified_s=float(u.sum()),
        always_prefill_s=float(pf.sum()),
        wrong_samples=int(np.count_nonzero(routed > oracle)),
        drift=drift_of(priced),
        prefill_batches={
            "samples": int(has_prefill.sum()),
            "routed_s": pr,
            "oracle_s": po,
            "routed_over_oracle": pr / po if po > 0 else None,
        },
    )


def drift_of(priced: Iterable[PricedSample]) -> dict[str, dict[str, Any]]:
    """Per path: how many samples carry a measured kernel time, and the median measured/predicted."""
    ratios: dict[str, list[float]] = {p: [] for p in PATHS}
    for p in priced:
        k = p.sample.kernel_s
        pred = p.predicted(p.routed_path)
        if k is not None and pred > 0:
            ratios[p.routed_path].append(k / pred)
    return {
        path: {"samples": len(rs), "median_ratio": statistics.median(rs) if rs else None}
        for path, rs in ratios.items()
    }
