"""flyserve's Grafana dashboards, as code (grafana-foundation-sdk, Grafana 11.6 build).

Why code and not hand-edited JSON: a renamed metric must fail a test, not quietly turn a panel
into "No data" (the most common dashboard complaint in vLLM's production-stack issues). The JSON
under ``dashboards/`` is generated from this package by ``flyserve dashboards build``; the test
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from flyserve.dashboards.control import control_plane
from flyserve.dashboards.dispatch import dispatch_overview
from flyserve.dashboards.fleet import fleet
from flyserve.dashboards.kernels import kernel_paths
from flyserve.files.atomic import atomic_write


@dataclass(frozen=True)
class DashboardFile:
    """One generated dashboard: the file name under dashboards/ and its JSON model."""

    filename: str
    model: dict


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
