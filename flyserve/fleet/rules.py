"""config/fleet_rules.yml: the fleet's recording rules, built from flyserve.fleet.promql.

``flyserve fleet rules`` prints the file; tests/unit/test_fleet_rules.py checks the committed file is
exactly that text, that promtool accepts it and that its unit tests (config/fleet_rules_test.yml)
pass. Two kinds of rules, in one group (rules of a group run in order, so the second kind reads the
first's results of the same evaluation):

* per replica (every target label kept; see flyserve.fleet.promql), guarded by ``live``;
* per content fingerprint across replicas: ``by (fingerprint)``, where the label takes at most one
  value per replica at any moment, so the series are bounded by the number of replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from flyserve.fleet import promql as q

WINDOW: Final = "5m"
GROUP: Final = "flyserve-fleet"

# Per replica.
KERNEL_US_PER_TOKEN_BY_PATH: Final = "flyserve:fleet_kernel_us_per_token:rate5m"
KERNEL_US_PER_TOKEN: Final = "flyserve:fleet_replica_kernel_us_per_token:rate5m"
REGRET: Final = "flyserve:fleet_regret:avg5m"
FALLBACK_RATIO: Final = "flyserve:fleet_fallback_ratio:rate5m"
LATE_APPLIES: Final = "flyserve:fleet_late_applies:rate5m"
REPLICA_LIVE: Final = "flyserve:fleet_replica_live"
THRESHOLDS_VERSION: Final = "flyserve:fleet_thresholds_version:max"
FINGERPRINT_INFO: Final = "flyserve:fleet_thresholds_fingerprint:info"
# Across replicas.
VERSION_REPLICAS: Final = "flyserve:fleet_version_replicas:count"
VERSION_KERNEL_US_PER_TOKEN: Final = "flyserve:fleet_version_kernel_us_per_token:avg5m"
VERSION_REGRET: Final = "flyserve:fleet_version_regret:avg5m"
VERSION_FALLBACK_RATIO: Final = "flyserve:fleet_version_fallback_ratio:avg5m"
VERSION_LATE_APPLIES: Final = "flyserve:fleet_version_late_applies:rate5m"
MIXED_VERSIONS: Final = "flyserve:fleet_mixed_versions"

FP: Final = q.FINGERPRINT_LABEL
MIXED: Final = q.MIXED_FINGERPRINT


def _by_version(aggregation: str, per_replica: str) -> str:
    """``aggregation`` of a per-replica rule over the replicas of each fingerprint."""
    return f"{aggregation} by ({FP}) ({per_replica} * ignoring ({FP}) group_left ({FP}) {FINGERPRINT_INFO})"


_MIXED_EXPR: Final = (
    f"max without ({FP}) ("
    f'({FINGERPRINT_INFO}{{{FP}!="{MIXED}"}} * on ({FP}) group_left () {VERSION_REPLICAS})'
    f' < bool on () group_left () max({VERSION_REPLICAS}{{{FP}!="{MIXED}"}})'
    f")"
    f' or max without ({FP}) ({FINGERPRINT_INFO}{{{FP}="{MIXED}"}})'
)


@dataclass(frozen=True)
class Rule:
    record: str
    expr: str
    why: str
    """The comment above the rule in the file."""


RULES: Final[tuple[Rule, ...]] = (
    Rule(
        REPLICA_LIVE,
        q.live(),
        "1 per replica whose sidecar is scraped and whose every rank reports; absent otherwise. Every "
        "per-replica rule below is guarded by it: a replica that stops reporting has no number at once.",
    ),
    Rule(
        KERNEL_US_PER_TOKEN_BY_PATH,
        q.kernel_us_per_token_by_path(WINDOW),
        "Kernel time per query token (microseconds, one attention call), per replica and path: the mean "
        "timed call (the kernel timer times 1 call in N) x calls per second / tokens per second.",
    ),
    Rule(
        KERNEL_US_PER_TOKEN,
        q.kernel_us_per_token(WINDOW),
        "The same over every path timed in the window, per replica: what a canary is judged by (a "
        "threshold change moves batches between paths; each path can look better while the replica "
        "gets worse).",
    ),
    Rule(
        REGRET,
        q.regret(WINDOW),
        "Routing regret per replica (needs `flyserve sidecar --costs`): priced attention time of the "
        "paths the steps ran over the per-step best, minus 1 (0.05 = 5% more than the best routing).",
    ),
    Rule(
        FALLBACK_RATIO,
        q.fallback_ratio(WINDOW),
        "Share of the batches with a prefill row that the unified kernel ran (a fallback), per replica.",
    ),
    Rule(
        LATE_APPLIES,
        q.late_applies(WINDOW),
        "Thresholds versions per second the replica's ranks applied after their effective step (should "
        "stay 0: a rank that applies late routes some steps differently from the others).",
    ),
    Rule(
        THRESHOLDS_VERSION,
        q.thresholds_version(),
        "The version the replica's ranks apply: the replica's own count of changes, NOT comparable "
        "across replicas (the fingerprint below is).",
    ),
    Rule(
        FINGERPRINT_INFO,
        q.fingerprint_info(),
        "1 per replica, labelled fingerprint=<its thresholds content> (flyserve_thresholds_fingerprint "
        'through count_values; "-1" while its live ranks applied different contents). One label value '
        "per replica at a time: the fleet's series are bounded by its replicas.",
    ),
    Rule(
        VERSION_REPLICAS,
        f"count by ({FP}) ({FINGERPRINT_INFO})",
        "Replicas per thresholds content.",
    ),
    Rule(
        VERSION_KERNEL_US_PER_TOKEN,
        _by_version("avg", KERNEL_US_PER_TOKEN),
        "Mean over the replicas of each content of their kernel time per token.",
    ),
    Rule(VERSION_REGRET, _by_version("avg", REGRET), "Mean regret of the replicas of each content."),
    Rule(
        VERSION_FALLBACK_RATIO,
        _by_version("avg", FALLBACK_RATIO),
        "Mean fallback ratio of the replicas of each content.",
    ),
    Rule(
        VERSION_LATE_APPLIES,
        _by_version("sum", LATE_APPLIES),
        "Late applies per second, summed over the replicas of each content.",
    ),
    Rule(
        MIXED_VERSIONS,
        _MIXED_EXPR,
        "Per replica: 1 if its thresholds content is not the fleet's most common one (or its own ranks "
        "disagree), else 0. A tie for most common (a canary at half the fleet) flags neither side. "
        "sum(flyserve:fleet_mixed_versions) counts the replicas that differ.",
    ),
)


def _wrap(expr: str, indent: str) -> str:
    """The expression over several lines, broken before top-level operators (for people: PromQL
    ignores the whitespace)."""
    breaks = (" and ", " or ", " / ", " < bool ")
    lines, cur, depth, i = [], "", 0, 0
    while i < len(expr):
        if depth == 0:
            hit = next((b for b in breaks if expr.startswith(b, i)), None)
            if hit is not None and cur.strip():
                lines.append(cur)
                cur, i = hit.lstrip(), i + len(hit)
                continue
        c = expr[i]
        depth += c in "({[" and 1 or 0
        depth -= c in ")}]" and 1 or 0
        cur += c
        i += 1
    lines.append(cur)
    return "\n".join(indent + line.strip() for line in lines)


HEADER: Final = """\
# flyserve fleet recording rules: GENERATED by `flyserve fleet rules` (flyserve/fleet/rules.py);
# edit the code, then `flyserve fleet rules > config/fleet_rules.yml` (a test checks this file is that).
#
# Load beside alerts.yml (rule_files in config/prometheus.yml). Unit tests with synthetic series:
# `promtool test rules config/fleet_rules_test.yml`. What each number means, the cardinality bound and
# how a rollout controller uses them: docs/fleet.md.
#
# A replica is one scrape target (one sidecar beside one vLLM server). Per-replica rules aggregate
# `without (rank, ...)`, so every target label (instance, pod, namespace, rollouts_pod_template_hash,
# ...) is kept; the only label added is `fingerprint`, one value per replica at any moment.
"""


def render() -> str:
    out = [HEADER, "groups:\n", f"  - name: {GROUP}\n", "    rules:\n"]
    for r in RULES:
        for line in _comment_lines(r.why):
            out.append(f"      # {line}\n")
        out.append(f"      - record: {r.record}\n")
        out.append("        expr: |-\n")
        out.append(_wrap(r.expr, " " * 10) + "\n")
    return "".join(out)


def _comment_lines(text: str, width: int = 92) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        lines.append(cur)
    return lines
