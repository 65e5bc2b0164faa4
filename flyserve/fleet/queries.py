"""The canary-vs-stable analysis queries: the one place they are written.

Argo Rollouts' AnalysisTemplate and Flagger's MetricTemplate in deploy/ carry these queries verbatim,
with ``$CANARY`` and ``$STABLE`` replaced by the label matchers of that engine (``ENGINES``); a test
checks the manifests hold exactly ``render(query, engine)``. ``flyserve fleet queries --engine argo``
prints them. tests/integration/test_fleet_prometheus_live.py runs them against a real Prometheus
scraping a simulated fleet, with the matchers naming one replica as the canary and the rest as stable.

Each query reads the recording rules of config/fleet_rules.yml (flyserve.fleet.rules) and returns one
number, or nothing. Nothing (an empty result) means no data: the canary's replicas do not report, or
one of the replicas seen in the last 10 minutes stopped reporting, or the stable side has none. It is
never a pass: Argo Rollouts counts a measurement it cannot evaluate as an error, Flagger a query
without a value as a failed check, and the templates in deploy/ keep it so (docs/fleet.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from flyserve.fleet import rules as r

CANARY: Final = "$CANARY"
STABLE: Final = "$STABLE"

KERNEL_MARGIN: Final = 0.10
"""How much more kernel time per token the canary may spend than the stable replicas: 10%. Replica-
to-replica spread of this number on one workload is a few percent over 5-minute windows (docs/fleet.md
says how it was measured); a margin under twice that fails good canaries."""
REGRET_MARGIN: Final = 0.02
"""How much more regret (priced time over the per-batch best) the canary may have: 2 points."""
SEEN_WINDOW: Final = "10m"
"""A canary replica seen reporting within this window that does not report now makes every canary
query empty (no data): a canary must not pass on the replicas that still answer."""


@dataclass(frozen=True)
class AnalysisQuery:
    """One metric of the analysis: the query passes when its one value is at most ``pass_max``."""

    name: str
    template: str
    pass_max: float
    meaning: str

    def render(self, canary: str, stable: str) -> str:
        """The query with the two sides' label matchers (PromQL, without braces)."""
        return self.template.replace(CANARY, canary).replace(STABLE, stable)


@dataclass(frozen=True)
class Engine:
    """How one rollout engine selects canary and stable replicas (the PodMonitor's target labels)."""

    canary: str
    stable: str
    note: str


ENGINES: Final[dict[str, Engine]] = {
    "argo": Engine(
        canary='namespace="{{args.namespace}}", rollouts_pod_template_hash="{{args.canary-hash}}"',
        stable='namespace="{{args.namespace}}", rollouts_pod_template_hash="{{args.stable-hash}}"',
        note="Argo Rollouts: args canary-hash and stable-hash from valueFrom.podTemplateHashValue "
        "(Latest, Stable); the PodMonitor copies the pod label rollouts-pod-template-hash "
        "(podTargetLabels) to the target label rollouts_pod_template_hash.",
    ),
    "flagger": Engine(
        canary='namespace="{{ namespace }}", pod=~"{{ target }}-[0-9a-zA-Z]+-[0-9a-zA-Z]+"',
        stable='namespace="{{ namespace }}", pod=~"{{ target }}-primary-[0-9a-zA-Z]+-[0-9a-zA-Z]+"',
        note="Flagger: the canary Deployment is {{ target }}, the stable one {{ target }}-primary; "
        "a pod of either is <deployment>-<replicaset hash>-<suffix>.",
    ),
}


def _guarded(expr: str) -> str:
    """``expr`` only while every canary replica seen within SEEN_WINDOW reports now."""
    return (
        f"({expr})\n"
        f"and on () (\n"
        f"  count(last_over_time({r.REPLICA_LIVE}{{{CANARY}}}[{SEEN_WINDOW}]))\n"
        f"  <= count({r.REPLICA_LIVE}{{{CANARY}}})\n"
        f")"
    )


QUERIES: Final[tuple[AnalysisQuery, ...]] = (
    AnalysisQuery(
        "kernel-time-per-token",
        _guarded(f"avg({r.KERNEL_US_PER_TOKEN}{{{CANARY}}})\n/ avg({r.KERNEL_US_PER_TOKEN}{{{STABLE}}})"),
        1.0 + KERNEL_MARGIN,
        "Canary's mean kernel time per token (all paths) over the stable replicas' mean: the canary "
        f"fails above {1.0 + KERNEL_MARGIN:g}.",
    ),
    AnalysisQuery(
        "regret",
        _guarded(f"avg({r.REGRET}{{{CANARY}}})\n- avg({r.REGRET}{{{STABLE}}})"),
        REGRET_MARGIN,
        "Canary's mean routing regret minus the stable replicas' (needs `flyserve sidecar --costs`): "
        f"the canary fails above {REGRET_MARGIN:g}.",
    ),
    AnalysisQuery(
        "late-applies",
        _guarded(f"sum({r.LATE_APPLIES}{{{CANARY}}})"),
        0.0,
        "Thresholds versions per second the canary's ranks applied late: any is a failure.",
    ),
    AnalysisQuery(
        "canary-contents",
        _guarded(
            f"count(count by ({r.FP}) ({r.FINGERPRINT_INFO}{{{CANARY}}}))\n"
            f'+ (count({r.FINGERPRINT_INFO}{{{CANARY}, {r.FP}="{r.MIXED}"}}) or vector(0))'
        ),
        1.0,
        "Distinct thresholds contents among the canary's replicas, plus one per replica whose own "
        "ranks disagree: anything but 1 means the canary's ranks did not all apply the version.",
    ),
)

BY_NAME: Final = {q.name: q for q in QUERIES}


def render(query: AnalysisQuery, engine: str) -> str:
    """``query`` as the ``engine``'s template carries it."""
    e = ENGINES[engine]
    return query.render(e.canary, e.stable)


def judge(query: AnalysisQuery, values: list[float]) -> str:
    """ "pass", "fail" or "no data": what the rollout engines make of the query's result."""
    if not values:
        return "no data"
    v = values[0]
    return "pass" if math.isfinite(v) and v <= query.pass_max else "fail"
