"""The generated dashboards: committed JSON is current, structure follows the rules operators rely on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flyserve.dashboards import build as dashboards
from flyserve.dashboards import cli as dashboards_cli

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "dashboards"

MODERN_TYPES = {"timeseries", "stat", "heatmap", "bargauge", "table", "state-timeline"}
ANGULAR_TYPES = {"graph", "singlestat", "table-old", "grafana-piechart-panel", "grafana-worldmap-panel"}
DS = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def built() -> dict[str, dict]:
    return {f.filename: f.model for f in dashboards.build_all()}


def _cli() -> typer.Typer:
    app = typer.Typer()
    dashboards_cli.register(app)
    return app


def test_committed_json_is_exactly_what_the_code_generates(built):
    """Regenerate and compare byte for byte: a stale or hand-edited dashboards/*.json fails here."""
    committed = sorted(p.name for p in COMMITTED.glob("*.json"))
    assert committed == sorted(built), "dashboards/ holds files the generator does not make (or misses some)"
    for name, model in built.items():
        on_disk = (COMMITTED / name).read_text(encoding="utf-8")
        assert on_disk == dashboards.render(model), (
            f"dashboards/{name} differs from flyserve.dashboards: run `flyserve dashboards build`"
        )


def test_generation_is_deterministic():
    a = [dashboards.render(f.model) for f in dashboards.build_all()]
    b = [dashboards.render(f.model) for f in dashboards.build_all()]
    assert a == b


def test_cli_build_then_check_then_detect_a_hand_edit(tmp_path):
    runner = CliRunner()
    out = tmp_path / "dash"
    r = runner.invoke(_cli(), ["dashboards", "build", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.glob("*.json")) == sorted(dashboards.DASHBOARDS)
    r = runner.invoke(_cli(), ["dashboards", "build", "--out", str(out), "--check"])
    assert r.exit_code == 0, r.output
    assert "up to date" in r.output

    victim = out / "flyserve-kernels.json"
    edited = victim.read_text().replace("flyserve_kernel_seconds_bucket", "flyserve_kernel_secs_bucket")
    victim.write_text(edited)
    r = runner.invoke(_cli(), ["dashboards", "build", "--out", str(out), "--check"])
    assert r.exit_code == 1
    assert "flyserve-kernels.json" in r.output
    assert victim.read_text() == edited  # --check writes nothing

    r = runner.invoke(_cli(), ["dashboards", "build", "--out", str(out)])
    assert r.exit_code == 0 and "written" in r.output
    assert "flyserve_kernel_secs_bucket" not in victim.read_text()


def test_cli_check_against_the_committed_directory():
    r = CliRunner().invoke(_cli(), ["dashboards", "build", "--out", str(COMMITTED), "--check"])
    assert r.exit_code == 0, r.output


def test_cli_refuses_a_file_as_out_dir(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    r = CliRunner().invoke(_cli(), ["dashboards", "build", "--out", str(f)])
    assert r.exit_code == 2
    assert "not a directory" in r.output


def test_four_dashboards_with_stable_uids(built):
    uids = {m["uid"] for m in built.values()}
    assert uids == {"flyserve-dispatch", "flyserve-kernels", "flyserve-control", "flyserve-fleet"}
    titles = {m["title"] for m in built.values()}
    assert titles == {
        "flyserve / Dispatch overview",
        "flyserve / Kernel paths",
        "flyserve / Control plane",
        "flyserve / Fleet",
    }


FLEET = "flyserve-fleet.json"
"""Its unit is the replica (one instance), not the rank: no rank variable, every query over instances."""


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_modern_panel_types_only(built, name):
    for panel in dashboards.iter_panels(built[name]):
        assert panel["type"] in MODERN_TYPES, f"{name}: panel {panel['title']!r} is {panel['type']}"
        assert panel["type"] not in ANGULAR_TYPES


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_panel_has_a_description_and_queries(built, name):
    for panel in dashboards.iter_panels(built[name]):
        desc = panel.get("description", "")
        assert len(desc) >= 60, f"{name}: panel {panel['title']!r} lacks a description that says what to read"
        assert panel.get("targets"), f"{name}: panel {panel['title']!r} has no query"
        for t in panel["targets"]:
            assert t.get("expr", "").strip(), f"{name}: panel {panel['title']!r} has an empty query"


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_datasource_is_the_variable_everywhere(built, name):
    model = built[name]
    for panel in dashboards.iter_panels(model):
        assert panel["datasource"] == DS, panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == DS, panel["title"]
    for ann in model["annotations"]["list"]:
        assert ann["datasource"] == DS
    for var in model["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"] == DS

    # No hard-coded datasource UID anywhere: every "uid" but the dashboard's own is the variable.
    def walk(node, path="$"):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "uid" and path != "$":
                    assert v == "${datasource}", f"{name}: hard-coded uid {v!r} at {path}"
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(model)


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_variables_datasource_instance_rank(built, name):
    by_name = {v["name"]: v for v in built[name]["templating"]["list"]}
    assert by_name["datasource"]["type"] == "datasource"
    assert by_name["datasource"]["query"] == "prometheus"
    assert ("rank" in by_name) == (name != FLEET)
    for var in ("instance", "rank") if name != FLEET else ("instance",):
        v = by_name[var]
        assert v["type"] == "query"
        assert v["query"].startswith("label_values(") and v["query"].endswith(f", {var})")
        assert v["includeAll"] and v["multi"] and v["allValue"] == ".*"


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_every_query_honours_the_instance_and_rank_variables(built, name):
    rank_metrics = (
        "flyserve_dispatch_",
        "flyserve_kernel_",
        "flyserve_engine_step",
        "flyserve_thresholds_version",
        "flyserve_circuit_open",
        "flyserve_rank_",
    )
    for panel in dashboards.iter_panels(built[name]):
        for t in panel["targets"]:
            expr = t["expr"]
            selectors = re.findall(r"(flyserve_\w+)\{([^}]*)\}", expr)
            assert selectors, f"{panel['title']!r}: no label selector in {expr!r}"
            for metric, matchers in selectors:
                assert 'instance=~"$instance"' in matchers, f"{panel['title']!r}: {metric} ignores $instance"
                if metric.startswith(rank_metrics) and name != FLEET:
                    assert 'rank=~"$rank"' in matchers, f"{panel['title']!r}: {metric} ignores $rank"


def test_the_panels_the_issue_asks_for(built):
    titles = {m["uid"]: {p["title"] for p in dashboards.iter_panels(m)} for m in built.values()}
    assert {
        "Prefill ratio",
        "Fallback reasons",
        "Decisions per second by path",
        "LPT share",
        "Thresholds version per rank",
        "Ranks in agreement",
    } <= titles["flyserve-dispatch"]
    assert {
        "Kernel time per path (p50, p99)",
        "Kernel time heatmap: prefill",
        "Kernel time heatmap: unified",
        "Kernel time share per path",
        "Query tokens per batch: unified (fallbacks and decode)",
        "max_seq_len per batch: unified (fallbacks and decode)",
    } <= titles["flyserve-kernels"]
    assert {
        "Reload results",
        "Since last successful reload",
        "Config version per rank",
        "Circuit breaker per rank",
        "Sidecar request latency",
        "Autopilot trials by outcome",
        "Autopilot arm",
        "Autopilot mode",
        "Autopilot exploration cost",
    } <= titles["flyserve-control"]
    assert {
        "Replicas now",
        "Kernel time per token per replica",
        "Kernel time per token over the fleet median",
        "Regret per replica",
        "Thresholds version per replica",
        "Replicas per content",
        "Kernel time per token per content",
    } <= titles["flyserve-fleet"]


def test_the_fleet_dashboard_asks_what_fleet_status_asks(built):
    """Its numbers are flyserve.fleet.promql's (the recording rules' and `fleet status`'s), over the
    selected instances at Grafana's rate interval: it needs no recording rule loaded."""
    from flyserve.fleet import promql

    exprs = {t["expr"] for p in dashboards.iter_panels(built[FLEET]) for t in p["targets"]}
    sel = 'instance=~"$instance"'
    for expr in (
        promql.kernel_us_per_token("$__rate_interval", sel),
        promql.regret("$__rate_interval", sel),
        promql.fallback_ratio("$__rate_interval", sel),
        promql.thresholds_version(sel),
        promql.fingerprint_value(sel),
    ):
        assert expr in exprs
    assert not any("flyserve:" in e for e in exprs)  # no recording rule needed


def test_prefill_ratio_panel_has_decision_and_token_views(built):
    panel = next(
        p for p in dashboards.iter_panels(built["flyserve-dispatch.json"]) if p["title"] == "Prefill ratio"
    )
    exprs = " ".join(t["expr"] for t in panel["targets"])
    assert "flyserve_dispatch_decisions_total" in exprs and "flyserve_dispatch_tokens_total" in exprs


def test_heatmaps_and_histogram_bars_use_heatmap_format(built):
    for model in built.values():
        for panel in dashboards.iter_panels(model):
            if panel["type"] in ("heatmap", "bargauge"):
                for t in panel["targets"]:
                    assert t["format"] == "heatmap" and t["legendFormat"] == "{{le}}"
                    assert "_bucket" in t["expr"] and "by (le)" in t["expr"]


def test_thresholds_change_annotations(built):
    for name in ("flyserve-dispatch.json", "flyserve-control.json"):
        anns = built[name]["annotations"]["list"]
        assert any("flyserve_thresholds_version" in a.get("expr", "") for a in anns), name


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_layout_ids_unique_and_inside_the_grid(built, name):
    ids = []
    for panel in built[name]["panels"]:
        ids.append(panel["id"])
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
    assert len(ids) == len(set(ids))


def test_committed_files_are_valid_json_with_schema_version():
    for p in COMMITTED.glob("*.json"):
        model = json.loads(p.read_text())
        assert model["schemaVersion"] >= 39  # Grafana 11
        assert "__inputs" not in model  # nothing to fill in at import


def test_queries_take_metric_names_from_the_definitions():
    """No metric name is typed into a module of flyserve/dashboards: each comes from flyserve.telemetry.metrics,
    so a renamed metric renames every query (and the committed JSON diff shows it)."""
    import ast
    import re

    from flyserve.telemetry.metrics import METRIC_NAMES

    sources = sorted((Path(__file__).resolve().parents[2] / "flyserve" / "dashboards").glob("*.py"))
    assert len(sources) > 2  # the package's modules, not an empty glob
    names = set(METRIC_NAMES)
    typed = []
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for token in re.findall(r"flyserve_[a-z_]+", node.value):
                    base = re.sub(r"_(bucket|sum|count)$", "", token)
                    if token in names or base in names:
                        typed.append((source.name, node.lineno, token))
    assert typed == []
