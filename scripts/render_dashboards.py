#!/usr/bin/env python
"""Render flyserve's dashboards from live Prometheus data to PNG (matplotlib), for docs/dashboards.md.

It starts the same live stack as the integration test (tests/integration/_dashboards_live.py):
the real sidecar, `flyserve simulate` playing two ranks, a real Prometheus scraping the sidecar
every second, and runs the same scenario (circuit open/close, a thresholds change that refuses
every prefill, an invalid change, the change undone). Then it evaluates every panel's queries
from dashboards/*.json through Prometheus's HTTP API and draws each panel the way Grafana would
(time series, stacked series, stats, heatmaps, histogram bars, state timeline, table), with the
dashboards' annotations as vertical marks. One PNG per dashboard in --out.

Kernel times come from the stack's numpy stand-in (host clock, CPU), because simulate runs no
kernels; the Kernel paths picture says so. Nothing here is a GPU measurement.

    .venv/bin/python scripts/render_dashboards.py [--out docs/img] [--phase-seconds 10]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from _dashboards_live import (
    LiveStack,
    resolve_variables,
    run_scenario,
    samples,
    substitute,
)

from flyserve.dashboards import build as dashboards

STEP_S = 1.0
PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]


def _legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _scale(unit: str) -> tuple[float, str]:
    return {"percentunit": (100.0, "%"), "s": (1.0, "s"), "ops": (1.0, "per s"), "reqps": (1.0, "req/s")}.get(
        unit, (1.0, "")
    )


def _fmt_value(v: float, unit: str, decimals: int | None) -> str:
    if not math.isfinite(v):
        return "n/a"
    if unit == "percentunit":
        return f"{v * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "s":
        if v >= 3600:
            return f"{v / 3600:.1f} h"
        if v >= 60:
            return f"{v / 60:.1f} min"
        return f"{v:.2f} s" if v >= 1 else f"{v * 1000:.2f} ms"
    if decimals == 0:
        return f"{v:.0f}"
    return f"{v:.3g}"


class Renderer:
    def __init__(self, stack: LiveStack, scenario, out: Path) -> None:
        self.stack, self.sc, self.out = stack, scenario, out

    def query(self, target: dict, values: dict) -> list[dict]:
        expr = substitute(target["expr"], values, range_s=self.sc.end - self.sc.start)
        if target.get("instant"):
            return self.stack.query(expr, at=self.sc.end)
        return self.stack.query_range(expr, self.sc.start, self.sc.end, STEP_S)

    def marks(self, model: dict, values: dict) -> list[tuple[float, str]]:
        """Annotation marks: where an annotation query's changes() count goes up (one mark per change)."""
        out = set()
        for ann in model["annotations"]["list"]:
            res = self.stack.query_range(substitute(ann["expr"], values), self.sc.start, self.sc.end, STEP_S)
            for series in res:
                prev_t, prev_v = None, 0.0
                for t, v in ((float(t), float(v)) for t, v in series["values"]):
                    if prev_t is not None and t - prev_t > 1.5 * STEP_S:
                        prev_v = 0.0  # a gap: the series was absent (no change) in between
                    if v > prev_v:
                        out.add((round(t - self.sc.start), ann["iconColor"]))
                    prev_t, prev_v = t, v
        return sorted(out)

    # -- panel kinds ---------------------------------------------------------------------------

    def timeseries(self, ax, panel, values, marks) -> None:
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        k, ylabel = _scale(unit)
        stacked = (
            panel["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "normal"
        )
        bars = panel["fieldConfig"]["defaults"].get("custom", {}).get("drawStyle") == "bars"
        lines = []
        for target in panel["targets"]:
            for series in self.query(target, values):
                pts = [(float(t) - self.sc.start, float(v) * k) for t, v in series["values"]]
                lines.append((_legend(target.get("legendFormat", ""), series["metric"]), pts))
        if stacked and lines:
            grid = sorted({t for _, pts in lines for t, _ in pts})
            ys = []
            for _, pts in lines:
                d = dict(pts)
                ys.append([d.get(t, 0.0) if math.isfinite(d.get(t, 0.0)) else 0.0 for t in grid])
            keep = [i for i, y in enumerate(ys) if any(v > 0 for v in y)] or list(range(len(ys)))
            if bars:
                bottom = [0.0] * len(grid)
                for n, i in enumerate(keep):
                    ax.bar(
                        grid,
                        ys[i],
                        bottom=bottom,
                        width=STEP_S * 0.9,
                        label=lines[i][0],
                        color=PALETTE[n % len(PALETTE)],
                    )
                    bottom = [b + y for b, y in zip(bottom, ys[i], strict=True)]
            else:
                ax.stackplot(
                    grid,
                    [ys[i] for i in keep],
                    labels=[lines[i][0] for i in keep],
                    colors=[PALETTE[n % len(PALETTE)] for n in range(len(keep))],
                    alpha=0.8,
                )
        else:
            for n, (label, pts) in enumerate(lines):
                ax.plot(
                    [t for t, _ in pts],
                    [v for _, v in pts],
                    label=label,
                    lw=1.4,
                    color=PALETTE[n % len(PALETTE)],
                    ls="--" if label.endswith(" up") else "-",
                )
        positive = [v for _, pts in lines for _, v in pts if math.isfinite(v) and v > 0]
        if unit == "s" and positive and max(positive) / min(positive) > 100:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        self._marks(ax, marks)
        if lines:
            ax.legend(fontsize=7, loc="upper left", ncol=2 if len(lines) > 4 else 1, framealpha=0.8)

    def stat(self, ax, panel, values, marks) -> None:
        defaults = panel["fieldConfig"]["defaults"]
        unit, decimals = defaults.get("unit", ""), defaults.get("decimals")
        target = panel["targets"][0]
        res = self.query(target, values)
        vals = [v for _, _, v in samples(res) if math.isfinite(v)]
        v = vals[-1] if vals else float("nan")
        text = _fmt_value(v, unit, decimals)
        color = "#333333"
        for m in defaults.get("mappings", []):
            for key, r in m.get("options", {}).items():
                if math.isfinite(v) and float(key) == v:
                    text, color = (
                        r.get("text", text),
                        {"green": "#2ca02c", "red": "#d62728"}.get(r.get("color"), color),
                    )
        ax.axis("off")
        ax.text(
            0.5,
            0.45,
            text,
            ha="center",
            va="center",
            fontsize=26,
            color=color,
            weight="bold",
            transform=ax.transAxes,
        )

    def heatmap(self, ax, panel, values, marks) -> None:
        (target,) = panel["targets"]
        res = self.query(target, values)
        by_le = {}
        for series in res:
            le = float(series["metric"]["le"])
            by_le[le] = {float(t): float(v) for t, v in series["values"]}
        les = sorted(by_le)
        times = sorted({t for d in by_le.values() for t in d})
        import numpy as np

        cum = np.array([[by_le[le].get(t, 0.0) for t in times] for le in les])
        cum = np.nan_to_num(cum)
        dens = np.diff(np.vstack([np.zeros(len(times)), cum]), axis=0).clip(min=0)
        x = [t - self.sc.start for t in times]
        keep = [i for i in range(len(les)) if dens[i].sum() > 0] or list(range(len(les)))
        lo, hi = max(0, min(keep) - 1), min(len(les) - 1, max(keep) + 1)
        ax.pcolormesh(x, range(lo, hi + 1), dens[lo : hi + 1] ** 0.5, cmap="Oranges", shading="nearest")
        ax.set_yticks(range(lo, hi + 1))
        ax.set_yticklabels(
            [_fmt_value(le, "s", None) if math.isfinite(le) else "+Inf" for le in les[lo : hi + 1]],
            fontsize=6,
        )
        ax.set_ylabel("le (bucket upper bound)")
        self._marks(ax, marks)

    def bargauge(self, ax, panel, values, marks) -> None:
        (target,) = panel["targets"]
        res = self.query(target, values)
        pts = sorted((float(s["metric"]["le"]), float(s["value"][1])) for s in res)
        counts, prev = [], 0.0
        for _, v in pts:
            counts.append(max(0.0, v - prev))
            prev = v
        labels = [f"{le:g}" if math.isfinite(le) else "+Inf" for le, _ in pts]
        ax.bar(range(len(counts)), counts, color="#1f77b4")
        ax.set_xticks(range(len(counts)))
        ax.set_xticklabels(labels, rotation=60, fontsize=6)
        ax.set_ylabel("batches (increase over the run)")

    def state_timeline(self, ax, panel, values, marks) -> None:
        (target,) = panel["targets"]
        res = sorted(self.query(target, values), key=lambda s: s["metric"].get("rank", ""))
        named = {"green": "#2ca02c", "red": "#d62728"}
        mapping = {}
        for m in panel["fieldConfig"]["defaults"].get("mappings", []):
            for key, r in m.get("options", {}).items():
                mapping[float(key)] = (
                    r.get("text", key),
                    named.get(r.get("color"), r.get("color", "#999999")),
                )
        for row, series in enumerate(res):
            for t, v in series["values"]:
                color = mapping.get(float(v), ("", "#999999"))[1]
                ax.barh(row, STEP_S, left=float(t) - self.sc.start, color=color, height=0.7)
        ax.set_yticks(range(len(res)))
        ax.set_yticklabels([_legend(target.get("legendFormat", ""), s["metric"]) for s in res])
        legend = " / ".join(
            f"{text} = {color_name}"
            for text, color_name in (
                (t, next((n for n, c in named.items() if c == col), col)) for t, col in mapping.values()
            )
        )
        ax.text(1.0, 1.02, legend, transform=ax.transAxes, ha="right", fontsize=7)
        self._marks(ax, marks)

    def table(self, ax, panel, values, marks) -> None:
        rows: dict[str, dict[str, str]] = {}
        cols = []
        for target in panel["targets"]:
            cols.append(target["refId"])
            for s in self.query(target, values):
                rows.setdefault(s["metric"].get("rank", "?"), {})[target["refId"]] = (
                    f"{float(s['value'][1]):g}"
                )
        ax.axis("off")
        cells = [[r, *[rows[r].get(c, "") for c in cols]] for r in sorted(rows)]
        tbl = ax.table(cellText=cells, colLabels=["rank", *cols], loc="center", cellLoc="center")
        tbl.scale(1, 1.6)

    def _marks(self, ax, marks) -> None:
        for t, color in marks:
            ax.axvline(
                t, color={"orange": "#ff7f0e", "red": "#d62728"}.get(color, color), lw=1, ls=":", alpha=0.9
            )

    # -- one dashboard -------------------------------------------------------------------------

    def render(self, filename: str, model: dict) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        values = resolve_variables(self.stack, model)
        marks = self.marks(model, values)
        panels = list(dashboards.iter_panels(model))
        stats = [p for p in panels if p["type"] == "stat"]
        others = [p for p in panels if p["type"] != "stat"]
        ncols = 2
        nrows = math.ceil(len(others) / ncols) + (1 if stats else 0)
        fig = plt.figure(figsize=(15, 3.3 * nrows + 0.8))
        gs = fig.add_gridspec(
            nrows,
            max(ncols, len(stats)) if stats else ncols,
            height_ratios=([0.55] if stats else []) + [1] * (nrows - (1 if stats else 0)),
        )
        row0 = 0
        if stats:
            width = max(ncols, len(stats))
            for i, p in enumerate(stats):
                ax = fig.add_subplot(gs[0, i * width // len(stats) : (i + 1) * width // len(stats)])
                self.stat(ax, p, values, marks)
                ax.set_title(p["title"], fontsize=9)
            row0 = 1
        width = max(ncols, len(stats)) if stats else ncols
        for i, p in enumerate(others):
            r, c = row0 + i // ncols, i % ncols
            span = width // ncols
            ax = fig.add_subplot(gs[r, c * span : (c + 1) * span])
            kind = p["type"].replace("-", "_")
            getattr(self, kind)(ax, p, values, marks)
            ax.set_title(p["title"], fontsize=10)
            if kind in ("timeseries", "heatmap", "state_timeline"):
                ax.set_xlabel("seconds into the run", fontsize=7)
            ax.tick_params(labelsize=7)
        note = (
            "Live data: flyserve simulate (2 ranks, seed-60k-c32) -> sidecar -> Prometheus. "
            "Dotted marks: orange = thresholds version change, red = circuit breaker change."
        )
        if "kernel" in filename:
            note += (
                "\nKernel times here are a numpy stand-in attention timed on the CPU (host clock), "
                "NOT GPU kernel measurements: simulate runs no kernels."
            )
        fig.suptitle(f"{model['title']}\n{note}", fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.97 if "kernel" not in filename else 0.955))
        path = self.out / filename.replace(".json", ".png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="Directory for the PNGs.")
    ap.add_argument("--phase-seconds", type=float, default=10.0, help="Length of each scenario phase.")
    ap.add_argument("--keep-dir", type=Path, default=None, help="Keep the stack's files (logs, TSDB) here.")
    a = ap.parse_args(argv)
    if a.phase_seconds <= 0 or a.phase_seconds > 60:
        ap.error("--phase-seconds must be in (0, 60]")
    a.out.mkdir(parents=True, exist_ok=True)
    models = {p.name: json.loads(p.read_text()) for p in sorted((REPO / "dashboards").glob("*.json"))}
    if not models:
        ap.error("no dashboards/*.json: run `flyserve dashboards build` first")
    t0 = time.time()
    print("starting sidecar, simulate, Prometheus ...", flush=True)
    with LiveStack(
        workload="seed-60k-c32", steps=100000, step_interval_s=0.01, kernel_load_s=600, keep_dir=a.keep_dir
    ) as stack:
        print(f"  sidecar :{stack.sidecar_port}, Prometheus :{stack.prom_port}; scenario:", flush=True)
        sc = run_scenario(stack, phase_s=a.phase_seconds, log=lambda m: print(m, flush=True))
        r = Renderer(stack, sc, a.out)
        for name, model in models.items():
            path = r.render(name, model)
            print(f"  wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except (FileNotFoundError, TimeoutError, RuntimeError) as exc:  # the stack could not start or run
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
