"""flyserve's Grafana dashboards, as code (grafana-foundation-sdk, Grafana 11.6 build).

Why code and not hand-edited JSON: a renamed metric must fail a test, not quietly turn a panel
into "No data" (the most common dashboard complaint in vLLM's production-stack issues). The JSON
under ``dashboards/`` is generated from this module by ``flyserve dashboards build``; the test
suite regenerates it and fails on any difference, checks every metric name against
``flyserve.telemetry.metrics.METRIC_NAMES`` and evaluates every query against a real Prometheus.

Why grafana-foundation-sdk and not grafana-dashboard-builder: the latter's releases are alphas
that emit Angular-era ``graph``/``singlestat`` panels (Grafana 11 no longer renders them by
default) and it validates nothing. The foundation SDK is generated from Grafana's own schema, so
its builders only offer fields that Grafana 11.6 knows.

Conventions every panel follows:
- the datasource is the ``$datasource`` variable, never a UID, so an import needs no editing;
- rank-side series are filtered by ``instance=~"$instance", rank=~"$rank"`` and always
  aggregated (``sum``/``max by (rank)``): in prometheus_client's multiprocess mode gauges carry a
  ``pid`` label, which an aggregation drops, so a restarted rank never shows as two lines;
- ratios divide rates of counters taken over the same window, so they are exact, not sampled;
- every panel has a description that says what to read from it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prom_m

from flyserve.files.atomic import atomic_write
from flyserve.fleet import promql as fleet_promql
from flyserve.telemetry import metrics as tm

# Metric names as a scrape shows them, from the definitions (flyserve.telemetry.metrics): a renamed
# metric changes every query here, and test_dashboards_promql checks each name is exposed.
DECISIONS = tm.exposed_name(tm.DISPATCH_DECISIONS)
TOKENS = tm.exposed_name(tm.DISPATCH_TOKENS)
ROWS = tm.exposed_name(tm.DISPATCH_ROWS)
LPT = tm.exposed_name(tm.DISPATCH_LPT)
QUERY_TOKENS = tm.exposed_name(tm.DISPATCH_QUERY_TOKENS)
MAX_SEQ_LEN = tm.exposed_name(tm.DISPATCH_MAX_SEQ_LEN)
KERNEL_SECONDS = tm.exposed_name(tm.KERNEL_SECONDS)
KERNEL_TIMER_DROPPED = tm.exposed_name(tm.KERNEL_TIMER_DROPPED)
ENGINE_STEP = tm.exposed_name(tm.ENGINE_STEP)
THRESHOLDS_VERSION = tm.exposed_name(tm.THRESHOLDS_VERSION)
CIRCUIT_OPEN = tm.exposed_name(tm.CIRCUIT_OPEN)
LATE_APPLIES = tm.exposed_name(tm.LATE_APPLIES)
COST_DRIFT = tm.exposed_name(tm.COST_DRIFT)
CONFIG_RELOADS = tm.exposed_name(tm.CONFIG_RELOADS)
CONFIG_LAST_SUCCESS = tm.exposed_name(tm.CONFIG_LAST_SUCCESS)
SIDECAR_REQUESTS = tm.exposed_name(tm.SIDECAR_REQUESTS)
SIDECAR_REQUEST_SECONDS = tm.exposed_name(tm.SIDECAR_REQUEST_SECONDS)
RANK_UP = tm.exposed_name(tm.RANK_UP)
RANK_REPORT_AGE = tm.exposed_name(tm.RANK_REPORT_AGE)
RANKS_AGREE = tm.exposed_name(tm.RANKS_AGREE)
SIDECAR_IGNORED_FILES = tm.exposed_name(tm.SIDECAR_IGNORED_FILES)
SIDECAR_DROPPED_CONNECTIONS = tm.exposed_name(tm.SIDECAR_DROPPED_CONNECTIONS)
SIDECAR_SHED_REQUESTS = tm.exposed_name(tm.SIDECAR_SHED_REQUESTS)
SIDECAR_STREAM_RECLAIMS = tm.exposed_name(tm.SIDECAR_STREAM_RECLAIMS)
SIDECAR_COMPACTED_FILES = tm.exposed_name(tm.SIDECAR_COMPACTED_FILES)
SIDECAR_METRICS_FILES = tm.exposed_name(tm.SIDECAR_METRICS_FILES)
KERNEL_SECONDS_BUCKET = KERNEL_SECONDS + "_bucket"
KERNEL_SECONDS_COUNT = KERNEL_SECONDS + "_count"
KERNEL_SECONDS_SUM = KERNEL_SECONDS + "_sum"
MAX_SEQ_LEN_BUCKET = MAX_SEQ_LEN + "_bucket"
QUERY_TOKENS_BUCKET = QUERY_TOKENS + "_bucket"
SIDECAR_REQUEST_SECONDS_BUCKET = SIDECAR_REQUEST_SECONDS + "_bucket"

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel, variable and annotation queries the datasource chosen by ``$datasource``."""

RATE = "$__rate_interval"
"""Grafana's rate window: at least four scrape intervals, so rate() always sees two samples."""

RANK_SEL = 'instance=~"$instance", rank=~"$rank"'
INSTANCE_SEL = 'instance=~"$instance"'

TAGS = ["flyserve", "vllm", "attention"]


@dataclass(frozen=True)
class DashboardFile:
    """One generated dashboard: the file name under dashboards/ and its JSON model."""

    filename: str
    model: dict


# --------------------------------------------------------------------------- helpers


def _target(
    expr: str,
    legend: str = "",
    ref: str = "A",
    *,
    instant: bool = False,
    fmt: prom_m.PromQueryFormat | None = None,
) -> prom.Dataquery:
    q = prom.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    q = q.instant() if instant else q.range()
    if fmt is not None:
        q = q.format(fmt)
    return q


def _targets(panel, targets: Iterable[prom.Dataquery]):
    for t in targets:
        panel = panel.with_target(t)
    return panel


def _legend_table(calcs: list[str]) -> common_b.VizLegendOptions:
    return (
        common_b.VizLegendOptions()
        .show_legend(True)
        .display_mode(common_m.LegendDisplayMode.TABLE)
        .placement(common_m.LegendPlacement.BOTTOM)
        .calcs(calcs)
    )


def _timeseries(
    title: str,
    description: str,
    targets: Iterable[prom.Dataquery],
    *,
    unit: str,
    w: int = 12,
    h: int = 8,
    stacked: bool = False,
    percent: bool = False,
    bars: bool = False,
    min_val: float | None = None,
    max_val: float | None = None,
    legend_calcs: list[str] | None = None,
) -> timeseries.Panel:
    p = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(h)
        .fill_opacity(15 if not stacked else 60)
        .line_width(1)
        .tooltip(
            common_b.VizTooltipOptions()
            .mode(common_m.TooltipDisplayMode.MULTI)
            .sort(common_m.SortOrder.DESCENDING)
        )
        .legend(_legend_table(legend_calcs or ["lastNotNull", "max"]))
    )
    if stacked:
        mode = common_m.StackingMode.PERCENT if percent else common_m.StackingMode.NORMAL
        p = p.stacking(common_b.StackingConfig().mode(mode))
    if bars:
        p = p.draw_style(common_m.GraphDrawStyle.BARS)
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    return _targets(p, targets)


def _stat(
    title: str,
    description: str,
    target: prom.Dataquery,
    *,
    unit: str,
    w: int = 6,
    h: int = 5,
    thresholds: list[tuple[float | None, str]] | None = None,
    mappings: dict[str, tuple[str, str]] | None = None,
    decimals: float | None = None,
) -> stat.Panel:
    p = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(w)
        .height(h)
        .graph_mode(common_m.BigValueGraphMode.AREA)
        .color_mode(common_m.BigValueColorMode.BACKGROUND if thresholds else common_m.BigValueColorMode.VALUE)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if thresholds:
        p = p.thresholds(_thresholds(thresholds))
    if mappings:
        p = p.mappings(_value_mappings(mappings))
    if decimals is not None:
        p = p.decimals(decimals)
    return p.with_target(target)


def _thresholds(steps: list[tuple[float | None, str]]) -> dash.ThresholdsConfig:
    return (
        dash.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=v, color=c) for v, c in steps])
    )


def _value_mappings(mapping: dict[str, tuple[str, str]]) -> list[dash_m.ValueMapping]:
    options = {
        value: dash_m.ValueMappingResult(text=text, color=color, index=i)
        for i, (value, (text, color)) in enumerate(mapping.items())
    }
    return [dash_m.ValueMap(options=options)]


def _bargauge_histogram(
    title: str, description: str, expr: str, *, unit: str, w: int = 12, h: int = 8
) -> bargauge.Panel:
    """A histogram's buckets in the chosen time range as bars (format=heatmap de-cumulates le)."""
    return (
        bargauge.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(w)
        .height(h)
        .unit("short")
        .display_mode(common_m.BarGaugeDisplayMode.GRADIENT)
        .orientation(common_m.VizOrientation.VERTICAL)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(_target(expr, "{{le}}", instant=True, fmt=prom_m.PromQueryFormat.HEATMAP))
    )


def _heatmap(title: str, description: str, expr: str, *, unit: str, w: int = 12, h: int = 8) -> heatmap.Panel:
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(w)
        .height(h)
        .calculate(False)
        .color(
            heatmap.HeatmapColorOptions()
            .mode(heatmap_m.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .scale(heatmap_m.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
        )
        .y_axis(heatmap.YAxisConfig().unit(unit))
        .cell_gap(1)
        .with_target(_target(expr, "{{le}}", fmt=prom_m.PromQueryFormat.HEATMAP))
    )


def _state_timeline(
    title: str,
    description: str,
    expr: str,
    mapping: dict[str, tuple[str, str]],
    steps: list[tuple[float | None, str]],
) -> statetimeline.Panel:
    return (
        statetimeline.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .mappings(_value_mappings(mapping))
        .thresholds(_thresholds(steps))
        .with_target(_target(expr, "rank {{rank}}"))
    )


def _variables(d: dash.Dashboard, *, with_rank: bool = True) -> dash.Dashboard:
    d = d.with_variable(
        dash.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .description(
            "The Prometheus that scrapes the flyserve sidecars: chosen at import, no UID in the JSON."
        )
    )
    d = d.with_variable(
        dash.QueryVariable("instance")
        .label("Instance")
        .datasource(DATASOURCE)
        .query(f"label_values({ENGINE_STEP}, instance)")
        .description("The flyserve sidecar(s) (one per vLLM server) to show.")
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
    )
    if with_rank:
        d = d.with_variable(
            dash.QueryVariable("rank")
            .label("Rank")
            .datasource(DATASOURCE)
            .query(f'label_values({ENGINE_STEP}{{instance=~"$instance"}}, rank)')
            .description("The tensor/pipeline-parallel ranks (worker processes) to show.")
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_m.VariableSort.NUMERICAL_ASC)
        )
    return d


def _annotation_thresholds_change() -> dash.AnnotationQuery:
    return (
        dash.AnnotationQuery()
        .name("Thresholds version change")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("orange")
        .expr(f"changes(max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})[1m:]) > 0")
    )


def _annotation_circuit_change() -> dash.AnnotationQuery:
    return (
        dash.AnnotationQuery()
        .name("Circuit breaker change")
        .datasource(DATASOURCE)
        .enable(True)
        .icon_color("red")
        .expr(f"changes(max by (rank) ({CIRCUIT_OPEN}{{{RANK_SEL}}})[1m:]) > 0")
    )


def _dashboard(uid: str, title: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .link(
            dash.DashboardLink("flyserve")
            .type(dash_m.DashboardLinkType.DASHBOARDS)
            .tags(["flyserve"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )


# --------------------------------------------------------------------------- shared expressions


def _rate(metric: str, sel: str, by: str = "", extra: str = "") -> str:
    matchers = sel if not extra else f"{extra}, {sel}"
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}(rate({metric}{{{matchers}}}[{RATE}]))"


PREFILL_RATIO_DECISIONS = (
    _rate(DECISIONS, RANK_SEL, extra='path="prefill"') + " / " + _rate(DECISIONS, RANK_SEL)
)
PREFILL_RATIO_ELIGIBLE = (
    _rate(DECISIONS, RANK_SEL, extra='reason="admitted"')
    + " / "
    + _rate(DECISIONS, RANK_SEL, extra='reason!="no_prefill_rows"')
)
"""Among batches that have prefill rows, the share the prefill specialist ran: what thresholds control."""
PREFILL_RATIO_TOKENS = _rate(TOKENS, RANK_SEL, extra='path="prefill"') + " / " + _rate(TOKENS, RANK_SEL)
LPT_SHARE = _rate(LPT, RANK_SEL, extra='ordering="lpt"') + " / " + _rate(LPT, RANK_SEL)


def _mean_kernel_seconds_by_path() -> str:
    return (
        f"({_rate(KERNEL_SECONDS_SUM, RANK_SEL, 'path')} / {_rate(KERNEL_SECONDS_COUNT, RANK_SEL, 'path')})"
    )


def _kernel_time_by_path() -> str:
    """Estimated kernel seconds per second per path: mean sampled time x decisions per second.

    The timer samples 1 in N forwards; multiplying its mean by the (exact) decision rate keeps the
    estimate right even if the two paths were sampled at different rates.
    """
    # ">= 0" drops a path whose mean is NaN (no timing sampled in the window) instead of letting
    # it turn the whole normalised share into NaN.
    return f"(({_mean_kernel_seconds_by_path()} * {_rate(DECISIONS, RANK_SEL, 'path')}) >= 0)"


# --------------------------------------------------------------------------- dashboards


PRICED = tm.exposed_name(tm.PRICED_SECONDS)


def _over_oracle(policy: str, window: str = RATE) -> str:
    return (
        f'sum(rate({PRICED}{{{INSTANCE_SEL}, policy="{policy}"}}[{window}]))'
        f' / sum(rate({PRICED}{{{INSTANCE_SEL}, policy="oracle"}}[{window}]))'
    )


PRICED_BY_BATCH = tm.exposed_name(tm.PRICED_BY_BATCH)


def _regret_by_batch(window: str = "15m") -> str:
    """Each kind of batch's share of the regret: (its routed - its oracle) over ALL oracle time, so
    the two lines add up to the regret stat."""

    def by(policy: str) -> str:
        return f'sum by (batch) (rate({PRICED_BY_BATCH}{{{INSTANCE_SEL}, policy="{policy}"}}[{window}]))'

    return (
        f"({by('routed')} - {by('oracle')})"
        f' / ignoring(batch) group_left() sum(rate({PRICED}{{{INSTANCE_SEL}, policy="oracle"}}[{window}]))'
    )


def _what_the_thresholds_cost(d: dash.Dashboard) -> dash.Dashboard:
    """Live regret and cost-table drift (the sidecar started with --costs; empty without it)."""
    d = d.with_row(dash.Row("What the thresholds cost"))
    d = d.with_panel(
        _stat(
            "Routing regret (15 min)",
            "Attention time the routed paths cost beyond the faster path per batch, over 15 minutes, as a "
            "share of that best (the oracle): sampled steps priced by the sidecar's cost table (--costs). "
            "Above 5% for 30 minutes is the RoutingRegretHigh alert: ask `flyserve thresholds advise`.",
            _target(_over_oracle("routed", "15m") + " - 1", "regret"),
            unit="percentunit",
            decimals=1,
            thresholds=[(None, "green"), (0.05, "orange"), (0.2, "red")],
            w=6,
            h=8,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Attention time relative to the oracle",
            "Priced attention time of the paths the steps ran (routed), and of always-unified and "
            "always-prefill, each over the per-batch best (1.0 = the oracle). routed near 1.0: the "
            "thresholds pick the faster kernel; a gap that opens after an orange mark is that change's cost.",
            [
                _target(_over_oracle("routed"), "routed / oracle", "A"),
                _target(_over_oracle("always_unified"), "always unified / oracle", "B"),
                _target(_over_oracle("always_prefill"), "always prefill / oracle", "C"),
            ],
            unit="none",
            min_val=1,
            legend_calcs=["mean", "lastNotNull"],
            w=10,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Cost-table drift",
            "Median measured / predicted kernel time per path over 15 minutes, from the shape samples "
            "that carry a kernel time of their step (docs/operations.md). Inside [0.7, 1.4] the cost table still describes this GPU "
            "and kernel build; outside it for 30 minutes is the CostTableDrift alert: re-run calibrate.",
            [_target(f"max by (path) ({COST_DRIFT}{{{INSTANCE_SEL}}})", "{{path}}")],
            unit="none",
            legend_calcs=["lastNotNull", "max"],
            w=8,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Regret by cause (15 min)",
            "The regret split by the kind of batch that spent it, each over all oracle time (the two "
            "add up to the regret stat). with_prefill: batches with a prefill row, routed by the run-time "
            "thresholds: `flyserve thresholds advise` proposes a PATCH. decode_only: batches that take "
            "decode_path, fixed at start: only a restart moves it (advice lists it under 'needs a restart').",
            [_target(_regret_by_batch(), "{{batch}}")],
            unit="percentunit",
            min_val=0,
            legend_calcs=["mean", "lastNotNull"],
            w=24,
            h=7,
        )
    )
    return d


def dispatch_overview() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-dispatch",
        "flyserve / Dispatch overview",
        "Which attention kernel path vLLM's batches take, why they fall back, and whether "
        "every rank runs the same thresholds.",
    )
    d = _variables(d).annotation(_annotation_thresholds_change()).annotation(_annotation_circuit_change())
    d = d.with_row(dash.Row("Now"))
    d = d.with_panel(
        _stat(
            "Prefill share of eligible batches",
            "Share of batches WITH prefill rows that the prefill specialist ran (reason=admitted), over the "
            "rate window. Pure-decode batches are left out: they always take the decode path. A sudden drop "
            "right after a thresholds change or a circuit opening is what the PrefillRatioCollapsed alert "
            "looks for.",
            _target(PREFILL_RATIO_ELIGIBLE, "eligible"),
            unit="percentunit",
            decimals=1,
        )
    )
    d = d.with_panel(
        _stat(
            "Decisions per second",
            "Dispatch decisions per second across the selected ranks: one per engine step per rank "
            "(the routing decides once per batch, on CUDA-graph replays too). Zero means the engine is idle "
            "or the ranks stopped reporting.",
            _target(_rate(DECISIONS, RANK_SEL), "decisions/s"),
            unit="ops",
        )
    )
    d = d.with_panel(
        _stat(
            "Thresholds version",
            "The newest thresholds version any selected rank has applied. Compare with 'Ranks agree': a "
            "version that went up on some ranks only is a split configuration.",
            _target(f"max({THRESHOLDS_VERSION}{{{RANK_SEL}}})", "version", instant=True),
            unit="none",
            decimals=0,
        )
    )
    d = d.with_panel(
        _stat(
            "Ranks agree",
            "1 (AGREE) when every live rank applied the same thresholds version, as the sidecar sees it. "
            "DISAGREE for more than a few seconds means a rank missed a change (see the Control plane "
            "dashboard) and ranks now route the same shapes differently.",
            _target(f"min({RANKS_AGREE}{{{INSTANCE_SEL}}})", "agree", instant=True),
            unit="none",
            thresholds=[(None, "red"), (1, "green")],
            mappings={"0": ("DISAGREE", "red"), "1": ("AGREE", "green")},
        )
    )

    d = d.with_row(dash.Row("Routing"))
    d = d.with_panel(
        _timeseries(
            "Prefill ratio",
            "Share of work the prefill specialist ran, three ways: by decisions (all batches, decode "
            "included), by decisions among batches that have prefill rows (the number the thresholds "
            "control), and by tokens (how much of the attention work it carries). Orange marks are "
            "thresholds version changes; a step down right after one is that change's effect.",
            [
                _target(PREFILL_RATIO_DECISIONS, "by decisions (all batches)", "A"),
                _target(PREFILL_RATIO_ELIGIBLE, "by decisions (batches with prefill rows)", "B"),
                _target(PREFILL_RATIO_TOKENS, "by tokens", "C"),
            ],
            unit="percentunit",
            min_val=0,
            max_val=1,
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Fallback reasons",
            "Batches with prefill rows that the unified kernel ran, stacked by the first rule that refused "
            "the prefill path (short_context, low_occupancy, too_many_decode_rows, context_too_long, "
            "not_causal, disabled, unsupported, circuit_open). The tallest band is the threshold worth "
            "tuning; circuit_open or unsupported growing means the prefill kernel is unavailable, not "
            "refused by the thresholds.",
            [
                _target(
                    _rate(DECISIONS, RANK_SEL, "reason", 'reason!~"admitted|no_prefill_rows"'), "{{reason}}"
                )
            ],
            unit="ops",
            stacked=True,
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Decisions per second by path",
            "Batches per second routed to each kernel path (unified = general kernel, prefill = causal "
            "prefill specialist). The total follows the engine step rate; the split follows the workload "
            "and the thresholds.",
            [_target(_rate(DECISIONS, RANK_SEL, "path"), "{{path}}")],
            unit="ops",
            stacked=True,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Rows per second by path and kind",
            "Batch rows (requests in a batch) per second by the path that ran them and their kind: "
            "prefill rows (more than one query token) or decode rows. Prefill rows on the unified path "
            "are prefills the specialist did not get; many decode rows riding along in prefill-path "
            "batches is what the too_many_decode_rows rule limits.",
            [_target(_rate(ROWS, RANK_SEL, "path, kind"), "{{path}} {{kind}} rows")],
            unit="ops",
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "LPT share",
            "Share of prefill-path batches scheduled longest-processing-time first (ordering=lpt) rather "
            "than in plain order. LPT pays off when one long sequence dominates a mixed batch; the "
            "thresholds' lpt mode (auto/always/never) sets it.",
            [_target(LPT_SHARE, "lpt share")],
            unit="percentunit",
            min_val=0,
            max_val=1,
        )
    )

    d = _what_the_thresholds_cost(d)

    d = d.with_row(dash.Row("Configuration"))
    d = d.with_panel(
        _timeseries(
            "Thresholds version per rank",
            "The thresholds version each rank applied. All lines should move together, at the same engine "
            "step; orange annotations mark every change. A rank whose line lags is a rank that missed "
            "the change.",
            [_target(f"max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})", "rank {{rank}}")],
            unit="none",
            legend_calcs=["lastNotNull"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Ranks in agreement",
            "Distinct thresholds versions among the selected ranks (should be 1) and the sidecar's own "
            "verdict over live ranks (1 = agree). Two or more versions for longer than one change "
            "takes is the RanksDisagreeOnThresholds alert. Late applies: versions a rank learned of "
            "after their effective step and applied at a step of its own.",
            [
                _target(
                    f'count(count_values("version", max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})))',
                    "distinct versions",
                    "A",
                ),
                _target(f"min({RANKS_AGREE}{{{INSTANCE_SEL}}})", "sidecar: ranks agree", "B"),
                _target(
                    f"sum(increase({LATE_APPLIES}{{{RANK_SEL}}}[$__rate_interval]))",
                    "late applies (should stay 0)",
                    "C",
                ),
            ],
            unit="none",
            min_val=0,
            legend_calcs=["lastNotNull", "max"],
        )
    )
    return d


def kernel_paths() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-kernels",
        "flyserve / Kernel paths",
        "How long each attention kernel path takes (sampled on the device, no sync) and "
        "which batch shapes each path receives.",
    )
    d = _variables(d).annotation(_annotation_thresholds_change())
    d = d.with_row(dash.Row("Kernel time"))
    d = d.with_panel(
        _timeseries(
            "Kernel time per path (p50, p99)",
            "Sampled per-forward kernel time of each path, from device timers harvested without a sync "
            "(1 in N forwards). p50 is the typical batch, p99 the long tail. A step up that is not "
            "explained by a shape change (see 'Shapes' below) is a regression; the KernelTimeRegression "
            "alert compares each path against its own last hour.",
            [
                _target(
                    f"histogram_quantile(0.5, {_rate(KERNEL_SECONDS_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} p50",
                    "A",
                ),
                _target(
                    f"histogram_quantile(0.99, {_rate(KERNEL_SECONDS_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} p99",
                    "B",
                ),
            ],
            unit="s",
            legend_calcs=["mean", "lastNotNull", "max"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Kernel time share per path",
            "Estimated share of attention kernel time spent in each path: mean sampled time per forward "
            "times decisions per second, normalised. A path with few batches can still dominate the time "
            "(long prefills); this is where tuning pays.",
            [
                _target(
                    f"{_kernel_time_by_path()} / ignoring(path) group_left sum({_kernel_time_by_path()})",
                    "{{path}}",
                )
            ],
            unit="percentunit",
            stacked=True,
            min_val=0,
            max_val=1,
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    d = d.with_panel(
        _heatmap(
            "Kernel time heatmap: prefill",
            "Distribution of sampled prefill-specialist kernel times over time (darker = more samples). "
            "Two bands mean two populations of shapes; a band drifting up is a slowdown.",
            _rate(KERNEL_SECONDS_BUCKET, RANK_SEL, "le", 'path="prefill"'),
            unit="s",
        )
    )
    d = d.with_panel(
        _heatmap(
            "Kernel time heatmap: unified",
            "Distribution of sampled unified-kernel times over time (decode, mixed and refused prefill "
            "batches). Compare with the prefill heatmap: batches the prefill path refused land here.",
            _rate(KERNEL_SECONDS_BUCKET, RANK_SEL, "le", 'path="unified"'),
            unit="s",
        )
    )
    d = d.with_panel(
        _timeseries(
            "Timer samples dropped",
            "Kernel timings skipped per second because the timer's queue of pending device events was "
            "full: the GPU ran far behind the host (the timer never waits for the device). A steady "
            "non-zero rate means the timings above under-represent the slowest forwards.",
            [_target(_rate(KERNEL_TIMER_DROPPED, RANK_SEL, "path"), "{{path}}")],
            unit="ops",
            w=24,
            h=6,
        )
    )

    d = d.with_row(dash.Row("Shapes"))
    d = d.with_panel(
        _bargauge_histogram(
            "Query tokens per batch: unified (fallbacks and decode)",
            "How many query tokens (num_actual_tokens) the batches the unified kernel ran had, over the "
            "dashboard's time range. Large-token bars here are prefills that fell back: check the "
            "Fallback reasons panel for why.",
            f'sum by (le) (increase({QUERY_TOKENS_BUCKET}{{path="unified", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _bargauge_histogram(
            "Query tokens per batch: prefill",
            "How many query tokens the batches the prefill specialist ran had, over the time range. "
            "The left edge is the smallest batch the thresholds admit (min_qblock_rows x block_m / heads).",
            f'sum by (le) (increase({QUERY_TOKENS_BUCKET}{{path="prefill", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _bargauge_histogram(
            "max_seq_len per batch: unified (fallbacks and decode)",
            "Longest sequence (context) in the batches the unified kernel ran, over the time range. Bars "
            "above max_seq_len or below min_seq_len are the context_too_long / short_context fallbacks.",
            f'sum by (le) (increase({MAX_SEQ_LEN_BUCKET}{{path="unified", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _bargauge_histogram(
            "max_seq_len per batch: prefill",
            "Longest sequence in the batches the prefill specialist ran, over the time range: the context "
            "lengths where the specialist is trusted.",
            f'sum by (le) (increase({MAX_SEQ_LEN_BUCKET}{{path="prefill", {RANK_SEL}}}[$__range]))',
            unit="short",
        )
    )
    d = d.with_panel(
        _timeseries(
            "Median shape per path",
            "Median query tokens and median max_seq_len of the batches each path ran, over time. A "
            "kernel-time change that follows a shape change here is the workload, not a regression.",
            [
                _target(
                    f"histogram_quantile(0.5, {_rate(QUERY_TOKENS_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} query tokens p50",
                    "A",
                ),
                _target(
                    f"histogram_quantile(0.5, {_rate(MAX_SEQ_LEN_BUCKET, RANK_SEL, 'le, path')})",
                    "{{path}} max_seq_len p50",
                    "B",
                ),
            ],
            unit="short",
            w=24,
        )
    )
    return d


def control_plane() -> dash.Dashboard:
    d = _dashboard(
        "flyserve-control",
        "flyserve / Control plane",
        "Thresholds reloads, the version every rank runs, circuit breakers, rank liveness "
        "and the sidecar's own latency.",
    )
    d = _variables(d).annotation(_annotation_thresholds_change()).annotation(_annotation_circuit_change())
    d = _control_reloads_row(d)
    d = _control_ranks_row(d)
    return _control_sidecar_row(d)


def _control_reloads_row(d: dash.Dashboard) -> dash.Dashboard:
    """Reload results and the age of the last good one: did a change land, or fail?"""
    d = d.with_row(dash.Row("Reloads"))
    d = d.with_panel(
        _timeseries(
            "Reload results",
            "Thresholds changes and reloads per rate window, by result (success, invalid, io_error) and "
            "source (file, api, cli, rollback). invalid = the new thresholds failed validation and changed "
            "nothing (the reason is in the sidecar log and /dispatch-stats); io_error = the state "
            "directory could not be written.",
            [
                _target(
                    f"sum by (result, source) (increase({CONFIG_RELOADS}{{{INSTANCE_SEL}}}[{RATE}]))",
                    "{{result}} ({{source}})",
                )
            ],
            unit="short",
            bars=True,
            stacked=True,
            w=16,
            legend_calcs=["sum"],
        )
    )
    d = d.with_panel(
        _stat(
            "Since last successful reload",
            "Time since the control plane last published a valid thresholds snapshot. Old is fine; it only "
            "matters next to failed reloads (left): then the running thresholds are older than intended.",
            _target(
                f"time() - max({CONFIG_LAST_SUCCESS}{{{INSTANCE_SEL}}})",
                "age",
                instant=True,
            ),
            unit="s",
            w=8,
            h=8,
        )
    )
    return d


def _control_ranks_row(d: dash.Dashboard) -> dash.Dashboard:
    """What each rank runs: version, circuit, liveness, report age, and the table of all of it now."""
    d = d.with_row(dash.Row("Ranks"))
    d = d.with_panel(
        _timeseries(
            "Config version per rank",
            "Thresholds version applied by each rank. All lines step together (same engine step) on a "
            "change; a lagging line is a rank that did not pick the change up.",
            [_target(f"max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})", "rank {{rank}}")],
            unit="none",
            legend_calcs=["lastNotNull"],
        )
    )
    d = d.with_panel(
        _state_timeline(
            "Circuit breaker per rank",
            "Each rank's prefill circuit breaker: closed (green) or open (red). Open means the "
            "prefill kernel raised (or an operator opened it) and every batch takes the "
            "unified kernel until it is closed: correct results, slower prefills.",
            f"max by (rank) ({CIRCUIT_OPEN}{{{RANK_SEL}}})",
            {"0": ("closed", "green"), "1": ("open", "red")},
            [(None, "green"), (1, "red")],
        )
    )
    d = d.with_panel(
        _state_timeline(
            "Rank liveness",
            "Whether the sidecar sees each rank as live (green, its status file is fresh) or stale "
            "(red, no report within the sidecar's --stale-after). A stale rank is hung, dead or "
            "cannot write the state directory, and cannot apply thresholds changes.",
            f"min by (rank) ({RANK_UP}{{{RANK_SEL}}})",
            {"0": ("stale", "red"), "1": ("live", "green")},
            [(None, "red"), (1, "green")],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Rank report age",
            "Seconds since each rank last wrote its status file (about once a second while alive). "
            "A line climbing past the sidecar's --stale-after turns the rank stale (left); a saw-tooth "
            "below a second or two is healthy.",
            [
                _target(
                    f"max by (rank) ({RANK_REPORT_AGE}{{{RANK_SEL}}})",
                    "rank {{rank}}",
                )
            ],
            unit="s",
            min_val=0,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Files the sidecar skipped",
            "Files in the state directory the sidecar did not use: metrics (corrupt or foreign metric "
            "files, since the sidecar started) and rank_reports (odd, unreadable or implausible files "
            "in ranks/ at its last look). Above 0: something writes there what flyserve did not; the "
            "sidecar's log names each metrics file once (operations.md, Failure modes).",
            [_target(f"max by (kind) ({SIDECAR_IGNORED_FILES}{{{INSTANCE_SEL}}})", "{{kind}}")],
            unit="none",
            min_val=0,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Sidecar connections dropped and requests shed",
            "Connections the sidecar closed before answering, per second, by reason (head_timeout, "
            "request_timeout, evicted at --max-connections, refused), and requests shed with 503 over "
            "the cap. A steady rate is a slow or half-open client flood; /healthz, /readyz and changes "
            "with the token keep being answered through it (operations.md, Failure modes). Also SSE "
            "streams reclaimed from clients that do not read them (stalled, backlog) or past their "
            "--stream-lease at the cap (lease), and new streams refused at --max-streams with none "
            "stalled or past its lease (full).",
            [
                _target(
                    f"sum by (reason) (rate({SIDECAR_DROPPED_CONNECTIONS}{{{INSTANCE_SEL}}}[$__rate_interval]))",
                    "dropped: {{reason}}",
                ),
                _target(
                    f"sum(rate({SIDECAR_SHED_REQUESTS}{{{INSTANCE_SEL}}}[$__rate_interval]))",
                    "shed (503)",
                ),
                _target(
                    f"sum by (reason) (rate({SIDECAR_STREAM_RECLAIMS}{{{INSTANCE_SEL}}}[$__rate_interval]))",
                    "stream reclaimed: {{reason}}",
                    "C",
                ),
            ],
            unit="reqps",
            min_val=0,
        )
    )
    d = d.with_panel(
        _timeseries(
            "Metric files and compaction",
            "Metric files (*.db) in <state>/metrics after the sidecar's last compaction (about 4 per live "
            "rank plus one archive per kind), and dead processes' files it merged or dropped per minute. "
            "Files growing with rank restarts while nothing is merged: compaction is off "
            "(--compact-interval 0) or refused (operations.md, Failure modes).",
            [
                _target(f"max({SIDECAR_METRICS_FILES}{{{INSTANCE_SEL}}})", "files", "A"),
                _target(
                    f"sum by (action) (rate({SIDECAR_COMPACTED_FILES}{{{INSTANCE_SEL}}}[{RATE}])) * 60",
                    "{{action}} per min",
                    "B",
                ),
            ],
            unit="none",
            min_val=0,
        )
    )
    return d.with_panel(_ranks_now_table())


def _ranks_now_table() -> table.Panel:
    """One row per rank, four instant queries merged on the rank label."""
    return (
        table.Panel()
        .title("Ranks now")
        .description(
            "One row per rank: thresholds version, circuit state, liveness and engine step, "
            "right now. A row that differs from the others is the rank to look at."
        )
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .with_target(
            _target(
                f"max by (rank) ({THRESHOLDS_VERSION}{{{RANK_SEL}}})",
                "",
                "version",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_target(
            _target(
                f"max by (rank) ({CIRCUIT_OPEN}{{{RANK_SEL}}})",
                "",
                "circuit",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_target(
            _target(
                f"min by (rank) ({RANK_UP}{{{RANK_SEL}}})",
                "",
                "up",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_target(
            _target(
                f"max by (rank) ({ENGINE_STEP}{{{RANK_SEL}}})",
                "",
                "step",
                instant=True,
                fmt=prom_m.PromQueryFormat.TABLE,
            )
        )
        .with_transformation(dash_m.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(
            dash_m.DataTransformerConfig(
                id_val="organize",
                options={
                    "excludeByName": {"Time": True},
                    "renameByName": {
                        "Value #version": "thresholds version",
                        "Value #circuit": "circuit open",
                        "Value #up": "up",
                        "Value #step": "engine step",
                    },
                },
            )
        )
    )


def _control_sidecar_row(d: dash.Dashboard) -> dash.Dashboard:
    """The sidecar's own latency and answers (it is never in vllm serve's request path)."""
    d = d.with_row(dash.Row("Sidecar"))
    d = d.with_panel(
        _timeseries(
            "Sidecar request latency",
            "p50 and p99 latency of the sidecar's HTTP routes (/metrics, /dispatch-stats, /thresholds). "
            "The sidecar runs beside vllm serve, never in its request path: slow here means a slow scrape "
            "or a slow state directory, not slow inference.",
            [
                _target(
                    f"histogram_quantile(0.5, sum by (le, route) (rate({SIDECAR_REQUEST_SECONDS_BUCKET}"
                    f"{{{INSTANCE_SEL}}}[{RATE}])))",
                    "{{route}} p50",
                    "A",
                ),
                _target(
                    f"histogram_quantile(0.99, sum by (le, route) (rate({SIDECAR_REQUEST_SECONDS_BUCKET}"
                    f"{{{INSTANCE_SEL}}}[{RATE}])))",
                    "{{route}} p99",
                    "B",
                ),
            ],
            unit="s",
            legend_calcs=["mean", "max"],
        )
    )
    d = d.with_panel(
        _timeseries(
            "Sidecar requests by route and code",
            "Requests per second the sidecar answered, by route, method and status code. 401/403 on "
            "/thresholds are rejected tokens; 409 a stale If-Match; 422 invalid thresholds (nothing "
            "changed); 503 an unwritable state directory.",
            [
                _target(
                    f"sum by (route, method, code) (rate({SIDECAR_REQUESTS}{{{INSTANCE_SEL}}}[{RATE}]))",
                    "{{method}} {{route}} {{code}}",
                )
            ],
            unit="reqps",
            legend_calcs=["mean", "lastNotNull"],
        )
    )
    return d


# --------------------------------------------------------------------------- the fleet

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


DASHBOARDS: dict[str, Callable[[], dash.Dashboard]] = {
    "flyserve-dispatch.json": dispatch_overview,
    "flyserve-kernels.json": kernel_paths,
    "flyserve-control.json": control_plane,
    "flyserve-fleet.json": fleet,
}
"""File name under dashboards/ -> the function that builds it."""


def _number_panels(model: dict) -> dict:
    """Give every panel a stable id (1, 2, ...): Grafana links and the render script use them."""
    next_id = 1
    for panel in model.get("panels", []):
        panel["id"] = next_id
        next_id += 1
        for inner in panel.get("panels", []):
            inner["id"] = next_id
            next_id += 1
    return model


def build_all() -> list[DashboardFile]:
    """Every dashboard as a JSON-ready dict (the same bytes on every run)."""
    files = []
    for filename, make in DASHBOARDS.items():
        model = json.loads(json.dumps(make().build(), cls=JSONEncoder))
        files.append(DashboardFile(filename, _number_panels(model)))
    return files


def render(model: dict) -> str:
    """The committed text form: sorted keys, two-space indent, trailing newline (diff-friendly)."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(out_dir: Path, *, check: bool = False) -> list[Path]:
    """Write (or, with check, only compare) every dashboard; return the files that differ(ed)."""
    out_dir = Path(out_dir)
    changed = []
    for f in build_all():
        path = out_dir / f.filename
        text = render(f.model)
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current == text:
            continue
        changed.append(path)
        if not check:
            atomic_write(path, text)
    return changed


def iter_panels(model: dict):
    """Every non-row panel of a dashboard model, rows' nested panels included."""
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel
