"""Panel builders every dashboard uses (time series, stat, heatmap, state timeline, bar gauge),
the datasource variable, the template variables, the annotations and the dashboard frame."""

from __future__ import annotations

from collections.abc import Iterable

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models import prometheus as prom_m

from flyserve.dashboards.queries import CIRCUIT_OPEN, ENGINE_STEP, RANK_SEL, THRESHOLDS_VERSION

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel, variable and annotation queries the datasource chosen by ``$datasource``."""

TAGS = ["flyserve", "vllm", "attention"]


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
    *,
    legend: str = "rank {{rank}}",
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
        .with_target(_target(expr, legend))
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
        _query_variable(
            "instance",
            "Instance",
            f"label_values({ENGINE_STEP}, instance)",
            "The flyserve sidecar(s) (one per vLLM server) to show.",
            dash_m.VariableSort.ALPHABETICAL_ASC,
        )
    )
    if with_rank:
        d = d.with_variable(
            _query_variable(
                "rank",
                "Rank",
                f'label_values({ENGINE_STEP}{{instance=~"$instance"}}, rank)',
                "The tensor/pipeline-parallel ranks (worker processes) to show.",
                dash_m.VariableSort.NUMERICAL_ASC,
            )
        )
    return d


def _query_variable(
    name: str, label: str, query: str, description: str, sort: dash_m.VariableSort
) -> dash.QueryVariable:
    """A multi-select variable with All (any value), refreshed when the time range changes."""
    return (
        dash.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .description(description)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
    )


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
