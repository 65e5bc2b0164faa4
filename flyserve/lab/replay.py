"""Replay a batch-shape trace through candidate thresholds and price every path.

For each step of a trace: the BatchShape the routing would build, the Decision ``decide`` makes
under the thresholds, and the time of one attention call on each path (from a cost model or
measured live). Totals:

* routed: the path the thresholds chose, per step;
* always-unified / always-prefill: one path for every step;
* oracle: the faster path for every step (the best any per-batch policy can do with these two
  kernels). ``routed_over_oracle`` = routed / oracle; 1.0 means the thresholds never picked the
  slower kernel for a batch.

Times are per attention layer call, summed over steps (multiply by the model's layer count for a
forward pass). The CUDA-graph question is outside this arithmetic: batches with no prefill row run
under captured graphs in vLLM, and the cost table times eager calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flyserve.lab.workloads import Trace, TraceStep
from flyserve.policy import PATHS, PREFILL, REASONS, UNIFIED, Thresholds
from flyserve.policy.routing import Rows, decisions_under

PriceFn = Callable[[TraceStep, str], float]
"""(step, path) -> seconds of one attention call."""


@dataclass(frozen=True)
class StepCosts:
    """Per-step seconds on each path for one trace: computed once, replayed under many thresholds."""

    trace_name: str
    unified: np.ndarray
    prefill: np.ndarray

    @property
    def oracle(self) -> np.ndarray:
        return np.minimum(self.unified, self.prefill)


def price_trace(trace: Trace, price: PriceFn) -> StepCosts:
    u = np.fromiter((price(s, UNIFIED) for s in trace), dtype=np.float64, count=len(trace))
    p = np.fromiter((price(s, PREFILL) for s in trace), dtype=np.float64, count=len(trace))
    return StepCosts(trace.name, u, p)


@dataclass(frozen=True)
class ReplayResult:
    """The outcome of one trace under one set of thresholds. Times in seconds."""

    trace: str
    profile: str
    steps: int
    routed_s: float
    unified_s: float
    prefill_s: float
    oracle_s: float
    prefill_ratio: float
    reasons: dict[str, int]
    prefill_steps: int
    wrong_steps: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def routed_over_oracle(self) -> float:
        return self.routed_s / self.oracle_s if self.oracle_s > 0 else 1.0

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "profile": self.profile,
            "steps": self.steps,
            "routed_s": self.routed_s,
            "unified_s": self.unified_s,
            "prefill_s": self.prefill_s,
            "oracle_s": self.oracle_s,
            "routed_over_oracle": self.routed_over_oracle,
            "unified_over_oracle": self.unified_s / self.oracle_s if self.oracle_s > 0 else 1.0,
            "prefill_over_oracle": self.prefill_s / self.oracle_s if self.oracle_s > 0 else 1.0,
            "prefill_ratio": self.prefill_ratio,
            "prefill_steps": self.prefill_steps,
            "wrong_steps": self.wrong_steps,
            "reasons": dict(self.reasons),
            **self.extra,
        }


def route_trace(trace: Trace, thresholds: Thresholds, *, num_heads: int) -> list[tuple[str, str]]:
    """(path, reason) per step, exactly as the routing would decide them."""
    batches = (Rows(s.query_lens, s.max_seq_len, num_heads) for s in trace)
    return [(d.path, d.reason) for d in decisions_under(batches, thresholds)]


def replay(
    trace: Trace,
    thresholds: Thresholds,
    costs: StepCosts,
    *,
    num_heads: int,
    profile: str = "custom",
) -> ReplayResult:
    """Route every step of ``trace`` under ``thresholds`` and add up the priced steps."""
    if len(costs.unified) != len(trace):
        raise ValueError(f"costs were priced for {len(costs.unified)} steps, the trace has {len(trace)}")
    decisions = route_trace(trace, thresholds, num_heads=num_heads)
    to_prefill = np.fromiter((p == PREFILL for p, _ in decisions), dtype=bool, count=len(decisions))
    routed = np.where(to_prefill, costs.prefill, costs.unified)
    oracle = costs.oracle
    reasons = dict.fromkeys(REASONS, 0)
    for _, r in decisions:
        reasons[r] += 1
    n = len(trace)
    # Batches with a prefill row: the ones run-time thresholds route (the rest take decode_path,
    # fixed at start), so their routed/oracle is what live advice can move.
    has_prefill = np.fromiter(
        (s.max_query_len >= thresholds.min_query_len for s in trace), dtype=bool, count=n
    )
    pr, po = float(routed[has_prefill].sum()), float(oracle[has_prefill].sum())
    return ReplayResult(
        trace=trace.name,
        profile=profile,
        steps=n,
        routed_s=float(routed.sum()),
        unified_s=float(costs.unified.sum()),
        prefill_s=float(costs.prefill.sum()),
        oracle_s=float(oracle.sum()),
        prefill_ratio=float(to_prefill.mean()) if n else 0.0,
        reasons={k: v for k, v in reasons.items() if v},
        prefill_steps=int(to_prefill.sum()),
        wrong_steps=int(np.count_nonzero(routed > oracle)),
        extra={
            "prefill_batches": int(has_prefill.sum()),
            "prefill_batches_routed_over_oracle": pr / po if po > 0 else 1.0,
        },
    )


def replay_many(
    trace: Trace, profiles: Mapping[str, Thresholds], price: PriceFn, *, num_heads: int
) -> list[ReplayResult]:
    """Price the trace once, replay it under each named set of thresholds."""
    costs = price_trace(trace, price)
    return [replay(trace, t, costs, num_heads=num_heads, profile=name) for name, t in profiles.items()]


def model_price(model: Any) -> PriceFn:
    """A PriceFn from a CostModel (no GPU)."""

    def price(step: TraceStep, path: str) -> float:
        return model.predict(step.query_lens, step.seq_lens, path)

    return price


def plot_results(results: list[ReplayResult], path: str) -> None:
    """Bars per trace: each profile's routed time, always-unified, always-prefill, over the oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r.trace for r in results))
    profiles = list(dict.fromkeys(r.profile for r in results))
    series: dict[str, list[float]] = {f"routed: {p}": [] for p in profiles}
    series["always unified"] = []
    series["always prefill"] = []
    for t in traces:
        rs = [r for r in results if r.trace == t]
        by_p = {r.profile: r for r in rs}
        for p in profiles:
            series[f"routed: {p}"].append(by_p[p].routed_over_oracle if p in by_p else np.nan)
        series["always unified"].append(rs[0].unified_s / rs[0].oracle_s)
        series["always prefill"].append(rs[0].prefill_s / rs[0].oracle_s)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(traces) + 2), 4.2))
    width = 0.8 / len(series)
    x = np.arange(len(traces))
    for i, (label, ys) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, ys, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, traces, rotation=20, ha="right")
    ax.set_ylabel("time / oracle (lower is better, 1 = oracle)")
    ax.set_title("Attention time per path choice, relative to the per-batch oracle")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "PATHS",
    "ReplayResult",
    "StepCosts",
    "model_price",
    "plot_results",
    "price_trace",
    "replay",
    "replay_many",
    "route_trace",
]
