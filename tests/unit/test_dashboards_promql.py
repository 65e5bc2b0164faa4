"""Every metric a dashboard or an alert queries exists in flyserve's metric registry, and every
dashboard query is valid PromQL according to Prometheus's own parser (promtool).

A renamed metric turns a panel into "No data" without any error in Grafana; these tests make it
a red test instead.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from flyserve.dashboards import build as dashboards
from flyserve.telemetry.metrics import METRIC_NAMES, METRIC_TYPES

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "config" / "alerts.yml"

# ----------------------------------------------------------------------------- the extractor

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME_MATCHER = re.compile(r'__name__\s*=\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(
    r"(?P<num>\d[\w.]*)|(?P<id>[A-Za-z_:][\w:]*)|(?P<var>\$\{?\w+\}?)|(?P<other>.)", re.DOTALL
)
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "atan2",
    "start",
    "end",
}
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((?P<expr>.*),\s*(?P<label>\w+)\s*\)\s*$", re.DOTALL)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed).

    Strings are dropped (a label value may look like PromQL) except a ``__name__`` matcher's
    value; label matchers ``{...}``, ranges/subqueries ``[...]`` and grouping label lists
    (``by (...)``, ``on (...)``, ``group_left (...)``...) are dropped; what remains is tokenised
    and an identifier counts as a metric unless it is a keyword or is called (``name(``).
    ``label_values(expr, label)`` (a Grafana variable query) contributes its expression only.
    """
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group("expr")
    names = {s[1:-1] for s in _NAME_MATCHER.findall(expr)}
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    tokens = [(mo.lastgroup, mo.group()) for mo in _TOKEN.finditer(text)]
    for i, (kind, value) in enumerate(tokens):
        if kind != "id" or value.lower() in _KEYWORDS:
            continue
        rest = [v for k, v in tokens[i + 1 :] if not (k == "other" and v.isspace())]
        if rest and rest[0] == "(":
            continue  # a function or an aggregation operator
        names.add(value)
    return names


def registry_name(name: str) -> str | None:
    """The METRIC_NAMES entry ``name`` refers to (histogram series map to their base), or None."""
    if name in METRIC_NAMES:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and METRIC_TYPES.get(base) == "histogram":
            return base
    return None


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('sum by (le, path) (rate(foo_bucket{path="x", a=~"$v"}[$__rate_interval]))', {"foo_bucket"}),
        ("histogram_quantile(0.99, sum(rate(x_bucket[5m])) by (le))", {"x_bucket"}),
        ("a / ignoring(path) group_left sum(b)", {"a", "b"}),
        ("a / on(instance) group_right(rank) b", {"a", "b"}),
        ('count(count_values("version", max by (rank) (v{rank=~".*"})))', {"v"}),
        ('{__name__="m", job="x"}', {"m"}),
        ("time() - max(g)", {"g"}),
        ("x offset 1h and y > bool 1e-5", {"x", "y"}),
        ('rate(m{label="sum(fake) + other_metric"}[1m])', {"m"}),
        ('m{label="a\\"b other"} > 0', {"m"}),
        ("vector(1) + scalar(z)", {"z"}),
        ("x unless on(instance) y or z", {"x", "y", "z"}),
        ("max_over_time(deriv(a[5m])[30m:1m])", {"a"}),
        ("changes(max by (rank) (v)[1m:]) > 0", {"v"}),
        ("ns:recorded:rate5m > 0x1F", {"ns:recorded:rate5m"}),
        ('label_values(flyserve_engine_step{instance=~"$instance"}, rank)', {"flyserve_engine_step"}),
        ("sum without (pid) (a) / sum (b)", {"a", "b"}),
        ("(a)/(b)*100", {"a", "b"}),
        ("topk(5, a) and bottomk(3, b)", {"a", "b"}),
    ],
)
def test_metric_name_extractor(expr, expected):
    assert metric_names(expr) == expected


def test_registry_name_maps_histogram_series_only():
    assert registry_name("flyserve_kernel_seconds_bucket") == "flyserve_kernel_seconds"
    assert registry_name("flyserve_kernel_seconds_count") == "flyserve_kernel_seconds"
    assert registry_name("flyserve_dispatch_decisions_total") == "flyserve_dispatch_decisions_total"
    assert registry_name("flyserve_dispatch_decisions_total_sum") is None  # a counter has no _sum
    assert registry_name("flyserve_kernel_secs_bucket") is None


# ----------------------------------------------------------------------------- queries in use


def _dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for f in dashboards.build_all():
        m = f.model
        for panel in dashboards.iter_panels(m):
            for t in panel["targets"]:
                out.append((f"{f.filename}: {panel['title']} [{t['refId']}]", t["expr"]))
        for ann in m["annotations"]["list"]:
            if ann.get("expr"):
                out.append((f"{f.filename}: annotation {ann['name']}", ann["expr"]))
        for var in m["templating"]["list"]:
            if var["type"] == "query":
                out.append((f"{f.filename}: variable {var['name']}", var["query"]))
    return out


def _alert_queries() -> list[tuple[str, str]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [
        (f"alerts.yml: {r.get('alert') or r.get('record')}", r["expr"])
        for g in doc["groups"]
        for r in g["rules"]
    ]


def _recorded_names() -> set[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def test_every_dashboard_and_alert_metric_is_registered():
    queries = _dashboard_queries() + _alert_queries()
    assert len(queries) > 40
    recorded = _recorded_names()
    unknown = []
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r} (extractor bug or a metric-less query)"
        for name in names:
            if name not in recorded and registry_name(name) is None:
                unknown.append(f"{where}: {name}")
    assert not unknown, "metrics missing from flyserve.telemetry.metrics.METRIC_NAMES:\n" + "\n".join(unknown)


def test_every_registered_metric_is_shown_somewhere():
    """The reverse check: a metric nobody charts or alerts on is a metric nobody reads."""
    used = {registry_name(n) for _, e in _dashboard_queries() + _alert_queries() for n in metric_names(e)}
    unused = sorted(set(METRIC_NAMES) - used)
    assert not unused, f"registered but on no dashboard or alert: {unused}"


def substitute_variables(
    expr: str, *, instance: str = ".*", rank: str = ".*", rate_interval: str = "1m", range_: str = "1h"
) -> str:
    """Replace Grafana's variables the way Grafana does before it sends a query to Prometheus."""
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group("expr")
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__range", range_)
        .replace("$instance", instance)
        .replace("$rank", rank)
    )


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (scripts/setup.sh does)")
    return path


@pytest.mark.slow  # runs promtool
def test_every_dashboard_query_parses_with_promtool(tmp_path):
    """Each query (variables substituted) as a recording rule: promtool parses it with Prometheus's parser."""
    rules = [
        {"record": f"flyserve:dashboard_query_{i}", "expr": substitute_variables(expr)}
        for i, (_, expr) in enumerate(_dashboard_queries())
    ]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    r = subprocess.run(
        [_promtool(), "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules)} rules found" in r.stdout


@pytest.mark.slow  # runs promtool
def test_promtool_would_catch_a_broken_query(tmp_path):
    """The check above can fail: a query with a syntax error is refused."""
    path = tmp_path / "bad.yml"
    path.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "g", "rules": [{"record": "x:y", "expr": "sum by (le (rate(a[1m]))"}]}]}
        )
    )
    r = subprocess.run(
        [_promtool(), "check", "rules", str(path)], check=False, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
