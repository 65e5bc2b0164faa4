"""The Fleet dashboard (flyserve-fleet.json): many replicas side by side, from the expressions
`flyserve fleet status` asks (flyserve.fleet.promql)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import prometheus as prom_m

from flyserve.dashboards.panels import DATASOURCE, _dashboard, _stat, _target, _timeseries, _variables
from flyserve.dashboards.queries import INSTANCE_SEL, RATE
from flyserve.fleet import promql as fleet_promql

# Every replica's numbers, from the expressions `flyserve fleet status` asks and config/fleet_rules.yml
# records (flyserve.fleet.promql), at Grafana's rate interval over the selected instances: the
# dashboard needs no recording rule loaded. A replica is one instance (one sidecar, one vLLM server).
FLEET_KERNEL = fleet_promql.kernel_us_per_token(RATE, INSTANCE_SEL)
FLEET_KERNEL_BY_PATH = fleet_promql.kernel_us_per_token_by_path(RATE, INSTANCE_SEL)
FLEET_REGRET = fleet_promql.regret(RATE, INSTANCE_SEL)
FLEET_FALLBACK = fleet_promql.fallback_ratio(RATE, INSTANCE_SEL)
FLEET_LATE = fleet_promql.late_applies(RATE, INSTANCE_SEL)
FLEET_CONTENT = fleet_promql.fingerprint_info(INSTANCE_SEL)
FLEET_VERSION = fleet_promql.thresholds_version(INSTANCE_SEL)
FLEET_FINGERPRINT = fleet_promql.fingerprint_value(INSTANCE_SEL)
FLEET_LIVE = fleet_promql.live(INSTANCE_SEL)
_FP = fleet_promql.FINGERPRINT_LABEL


def _by_content(aggregation: str, per_replica: str) -> str:
    return (
        f"{aggregation} by ({_FP}) (({per_replica}) * ignoring ({_FP}) group_left ({_FP}) ({FLEET_CONTENT}))"
    )


def _fleet_table() -> table.Panel:
    """One row per replica, instant queries merged on the target labels."""
    columns = {
        "version": ("thresholds version", FLEET_VERSION),
        "content": ("content fingerprint", FLEET_FINGERPRINT),
        "kernel": ("kernel us/token", FLEET_KERNEL),
        "regret": ("regret", FLEET_REGRET),
        "late": ("late applies/s", FLEET_LATE),
    }
    p = (
        table.Panel()
        .title("Replicas now")
        .description(
            "One row per replica, right now: the version its ranks apply (its own count of changes, not "
            "comparable across replicas), its thresholds content (a fingerprint: equal contents, equal "
            "numbers; -1 while its ranks disagree), kernel time per token, regret and late applies (its "
            "fallbacks: 'Fallback ratio per replica'). A replica missing here stopped reporting. "
            "`flyserve fleet status` prints the same with the fingerprint in hex and says which replicas "
            "disagree."
        )
        .datasource(DATASOURCE)
        .span(24)
        .height(9)
    )
    for ref, (_, expr) in columns.items():
        p = p.with_target(_target(expr, "", ref, instant=True, fmt=prom_m.PromQueryFormat.TABLE))
    return p.with_transformation(
        dash_m.DataTransformerConfig(id_val="merge", options={})
    ).with_transformation(
        dash_m.DataTransformerConfig(
            id_val="organize",
            options={
                "excludeByName": {"Time": True, "__name__": True},
                "renameByName": {f"Value #{ref}": title for ref, (title, _) in columns.items()},
            },
        )
    )


def fleet() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-fleet",
        "flyserve / Fleet",
        "Many replicas side by side: which thresholds content each runs, its kernel time per token and "
        "regret, and which replica disagrees with the rest (docs/fleet.md).",
    )
    d = _variables(d, with_rank=False).annotation(
        dash.AnnotationQuery()
        .name("Thresholds content change")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("orange")
        .expr(f"changes(max by (instance) ({FLEET_FINGERPRINT})[1m:]) > 0")
    )
    d = d.with_row(dash.Row("Now"))
    d = d.with_panel(
        _stat(
            "Replicas reporting",
            "Replicas (sidecars) whose every rank reports now. Fewer than you run: a replica stopped "
            "reporting, and a rollout analysis has no data for it (never a pass).",
            _target(f"count({FLEET_LIVE})", "replicas", instant=True),
            unit="none",
            decimals=0,
        )
    )
    d = d.with_panel(
        _stat(
            "Thresholds contents in the fleet",
            "Distinct thresholds contents among the reporting replicas. 1 is a fleet in agreement; 2 during "
            "a canary; more, or 2 outside a rollout, is drift (a pod with its own override, a ConfigMap "
            "update that did not reach every pod).",
            _target(f"count(count by ({_FP}) ({FLEET_CONTENT}))", "contents", instant=True),
            unit="none",
            decimals=0,
            thresholds=[(None, "green"), (2, "yellow"), (3, "red")],
        )
    )
    d = d.with_panel(
        _stat(
            "Worst replica over the median",
            "The highest kernel time per token of any replica over the fleet's median. Above 1.1 (the "
            "analysis margin) a replica spends 10% more kernel time per token than the middle of the fleet: "
            "find it in 'Kernel time per token per replica'.",
            _target(f"max({FLEET_KERNEL}) / scalar(quantile(0.5, {FLEET_KERNEL}))", "worst/median"),
            unit="none",
            decimals=2,
            thresholds=[(None, "green"), (1.1, "red")],
        )
    )
    d = d.with_panel(
        _stat(
            "Late applies",
            "Thresholds versions per second that some replica's ranks applied after their effective step, "
            "summed over the fleet. Should stay 0: a late apply routes some steps differently from the other "
            "ranks, and fails a canary's analysis.",
            _target(f"sum({FLEET_LATE})", "late/s"),
            unit="ops",
            thresholds=[(None, "green"), (1e-9, "red")],
        )
    )
    d = d.with_panel(_fleet_table())
    d = d.with_row(dash.Row("Per replica"))
    d = d.with_panel(
        _timeseries(
            "Kernel time per token per replica",
            "Microseconds of attention-kernel time per query token, over every path timed: the number a "
            "canary is judged by. Replicas on one workload and one thresholds content lie within a few "
            "percent of each other; a line far above the rest is a replica to look at.",
            [_target(FLEET_KERNEL, "{{instance}}")],
            unit="µs",
            legend_calcs=["mean", "lastNotNull", "max"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Kernel time per token over the fleet median",
            "Each replica's kernel time per token over the median of the selected replicas: 1 is the middle "
            "of the fleet; above 1.1 is what `flyserve fleet status` flags (its --margin).",
            [_target(f"({FLEET_KERNEL}) / scalar(quantile(0.5, {FLEET_KERNEL}))", "{{instance}}")],
            unit="none",
            legend_calcs=["mean", "lastNotNull", "max"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Kernel time per token per replica and path",
            "The same per kernel path. Read with care: a threshold change moves batches between paths, and "
            "both paths can look cheaper per token while the replica as a whole got slower.",
            [_target(FLEET_KERNEL_BY_PATH, "{{instance}} {{path}}")],
            unit="µs",
        )
    )
    d = d.with_panel(
        _timeseries(
            "Regret per replica",
            "Priced attention time of the paths each replica's steps ran over the per-step best, minus 1 "
            "(needs `flyserve sidecar --costs`). A canary whose regret rises above the stable replicas' "
            "routes worse.",
            [_target(FLEET_REGRET, "{{instance}}")],
            unit="percentunit",
        )
    )
    d = d.with_panel(
        _timeseries(
            "Fallback ratio per replica",
            "Share of the batches with a prefill row that the unified kernel ran. Replicas on one content "
            "and workload agree; a thresholds change moves it on purpose, so compare it with the kernel time.",
            [_target(FLEET_FALLBACK, "{{instance}}")],
            unit="percentunit",
            min_val=0,
            max_val=1,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Thresholds version per replica",
            "The version each replica's ranks apply. Replicas count their own changes, so two replicas on "
            "one ConfigMap can show different numbers; 'Replicas per content' says whether they run the same.",
            [_target(FLEET_VERSION, "{{instance}}")],
            unit="none",
        )
    )
    d = d.with_row(dash.Row("Per thresholds content"))
    d = d.with_panel(
        _timeseries(
            "Replicas per content",
            "Replicas per thresholds content (the legend is the fingerprint as a decimal integer; `flyserve "
            "fleet status` prints it in hex, the first 13 digits of `flyserve thresholds show`'s sha256). "
            "During a rollout the new content's line rises as the old one's falls.",
            [_target(f"count by ({_FP}) ({FLEET_CONTENT})", "{{fingerprint}}")],
            unit="none",
            stacked=True,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Kernel time per token per content",
            "The mean over each content's replicas of their kernel time per token: the canary's content "
            "against the stable one's, what the rollout analysis compares.",
            [_target(_by_content("avg", FLEET_KERNEL), "{{fingerprint}}")],
            unit="µs",
            legend_calcs=["mean", "lastNotNull", "max"],
        )
    )
    return d
