"""Every panel of every committed dashboard returns data from a real Prometheus scraping the real
sidecar while `flyserve simulate` plays two ranks, a circuit opens and closes and the thresholds
change (one change refused as invalid).

The queries are taken from dashboards/*.json (what an operator imports), the dashboard variables
are resolved through Prometheus the way Grafana resolves them, and each query runs through
Prometheus's HTTP API (query_range, or query for instant panels). The whole module is bounded:
about 45 s of scenario plus start-up; every process is stopped at the end.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from _dashboards_live import (
    RATE_INTERVAL,
    SCRAPE_INTERVAL_S,
    LiveStack,
    resolve_variables,
    run_scenario,
    samples,
    substitute,
)

from flyserve.dashboards import build as dashboards

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
STEP_S = 1.0
RATE_WINDOW_S = float(RATE_INTERVAL.removesuffix("s"))


@pytest.fixture(scope="module")
def live():
    with LiveStack(workload="seed-60k-c32", steps=9000, step_interval_s=0.01, kernel_load_s=90) as stack:
        scenario = run_scenario(stack, phase_s=7.0)
        yield stack, scenario


@pytest.fixture(scope="module")
def models() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((REPO / "dashboards").glob("*.json"))}


def _eval_target(stack, scenario, values, target) -> list[dict]:
    expr = substitute(target["expr"], values, range_s=scenario.end - scenario.start)
    if target.get("instant"):
        return stack.query(expr, at=scenario.end)
    return stack.query_range(expr, scenario.start, scenario.end, STEP_S)


def _finite_values(result) -> list[float]:
    return [v for _, _, v in samples(result) if math.isfinite(v)]


def _panel(models, name, title) -> dict:
    return next(p for p in dashboards.iter_panels(models[name]) if p["title"] == title)


def _series_by(stack, scenario, models, name, title, label, ref="A"):
    """{label value: [(t, v)...]} of one panel target, over the scenario."""
    values = resolve_variables(stack, models[name])
    target = next(t for t in _panel(models, name, title)["targets"] if t["refId"] == ref)
    out: dict[str, list[tuple[float, float]]] = {}
    for labels, t, v in samples(_eval_target(stack, scenario, values, target)):
        out.setdefault(labels.get(label, ""), []).append((t, v))
    return out


def test_variables_resolve_to_the_live_instance_and_ranks(live, models):
    stack, _ = live
    for model in models.values():
        values = resolve_variables(stack, model)
        assert values["instance"] == [f"127.0.0.1:{stack.sidecar_port}"]
        if model["uid"] != "flyserve-fleet":  # the fleet's unit is the replica: no rank variable
            assert values["rank"] == ["0", "1"]


def test_every_panel_query_returns_data(live, models):
    stack, scenario = live
    empty = []
    checked = 0
    for name, model in models.items():
        values = resolve_variables(stack, model)
        for panel in dashboards.iter_panels(model):
            for target in panel["targets"]:
                checked += 1
                result = _eval_target(stack, scenario, values, target)
                if not _finite_values(result):
                    empty.append(f"{name}: {panel['title']} [{target['refId']}]: {target['expr']}")
    assert checked >= 35
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_annotations_mark_the_thresholds_and_circuit_changes(live, models):
    stack, scenario = live
    for name, model in models.items():
        values = resolve_variables(stack, model)
        for ann in model["annotations"]["list"]:
            expr = substitute(ann["expr"], values)
            points = [
                (t, v) for _, t, v in samples(stack.query_range(expr, scenario.start, scenario.end, STEP_S))
            ]
            hits = [t for t, v in points if v > 0]
            assert hits, f"{name}: annotation {ann['name']!r} marks nothing"
            # Grafana draws a mark at every point the query returns: a point where nothing changed
            # (a `>= 0` filter, say) would mark every step of the range.
            assert len(hits) == len(points), f"{name}: annotation {ann['name']!r} marks unchanged moments"
            if "circuit" in ann["expr"]:
                # Between the open command and Prometheus seeing the circuit closed; STEP_S: a
                # range query's sample is reported at the step boundary after it.
                first = min(hits)
                assert (
                    scenario.at("circuit open") - STEP_S
                    <= first
                    <= scenario.at("circuit closed seen") + STEP_S
                )


def test_versions_step_together_and_end_equal(live, models):
    stack, scenario = live
    by_rank = _series_by(
        stack, scenario, models, "flyserve-dispatch.json", "Thresholds version per rank", "rank"
    )
    assert set(by_rank) == {"0", "1"}
    for rank, points in by_rank.items():
        versions = sorted({v for _, v in points})
        # circuit open (1), closed (2), min_seq_len (3), override dropped (4); the invalid one published nothing
        assert versions[-1] - versions[0] >= 3, (rank, versions)
    assert by_rank["0"][-1][1] == by_rank["1"][-1][1] == 4.0
    agree = _series_by(stack, scenario, models, "flyserve-dispatch.json", "Ranks in agreement", "", "B")
    assert agree[""][-1][1] == 1.0


def test_circuit_panel_shows_open_then_closed(live, models):
    stack, scenario = live
    by_rank = _series_by(stack, scenario, models, "flyserve-control.json", "Circuit breaker per rank", "rank")
    for rank, points in by_rank.items():
        assert max(v for _, v in points) == 1.0, rank
        assert points[-1][1] == 0.0, rank
        opened = [t for t, v in points if v == 1.0]
        assert scenario.at("circuit open") - STEP_S <= min(opened)
        assert max(opened) <= scenario.at("circuit closed seen") + STEP_S


def test_fallback_reasons_show_the_circuit_and_the_refusing_change(live, models):
    stack, scenario = live
    by_reason = _series_by(stack, scenario, models, "flyserve-dispatch.json", "Fallback reasons", "reason")
    peak = {r: max(v for _, v in pts) for r, pts in by_reason.items()}
    assert peak["circuit_open"] > 0
    assert peak["short_context"] > 0
    t_short = [t for t, v in by_reason["short_context"] if v > 0]
    assert min(t_short) >= scenario.at("min_seq_len=100000 (every prefill refused)") - STEP_S


def _applied_at(by_rank: dict[str, list[tuple[float, float]]], version: int, *, every: bool) -> float:
    """When every rank (or the first rank) reported ``version`` or later, per the version panel."""
    firsts = [min(t for t, v in pts if v >= version) for pts in by_rank.values()]
    return max(firsts) if every else min(firsts)


def test_prefill_ratio_collapses_while_every_prefill_is_refused(live, models):
    stack, scenario = live
    series = _series_by(stack, scenario, models, "flyserve-dispatch.json", "Prefill ratio", "", "B")[""]
    versions = _series_by(
        stack, scenario, models, "flyserve-dispatch.json", "Thresholds version per rank", "rank"
    )
    collapse_v = scenario.responses["collapse"][1]["thresholds"]["version"]
    undo_v = scenario.responses["undo"][1]["thresholds"]["version"]
    # From when both ranks run the refusing version plus one rate window and a scrape (the ratio is a
    # rate over that window), to when the first rank runs the undo.
    refused_from = _applied_at(versions, collapse_v, every=True) + RATE_WINDOW_S + SCRAPE_INTERVAL_S
    refused_to = _applied_at(versions, undo_v, every=False)
    before = [v for t, v in series if t < scenario.at("circuit open") and math.isfinite(v)]
    during = [v for t, v in series if refused_from <= t < refused_to and math.isfinite(v)]
    assert before and max(before) > 0.5
    assert during, f"no batch with prefill rows between {refused_from:.0f} and {refused_to:.0f}"
    assert max(during) == 0.0


def test_reload_results_and_last_success(live, models):
    stack, scenario = live
    assert scenario.responses["collapse"][0] == 200
    assert scenario.responses["invalid"][0] == 422
    assert scenario.responses["invalid"][1]["field"] == "min_seq_len"
    values = resolve_variables(stack, models["flyserve-control.json"])
    panel = _panel(models, "flyserve-control.json", "Reload results")
    result = _eval_target(stack, scenario, values, panel["targets"][0])
    peaks = {}
    for labels, _, v in samples(result):
        key = (labels["result"], labels["source"])
        peaks[key] = max(peaks.get(key, 0.0), v)
    assert peaks[("success", "api")] > 0
    assert peaks[("invalid", "api")] > 0
    age_panel = _panel(models, "flyserve-control.json", "Since last successful reload")
    (age,) = _finite_values(_eval_target(stack, scenario, values, age_panel["targets"][0]))
    assert 0 <= age <= scenario.end - scenario.at("override dropped (back to the profile)") + 2


def test_kernel_panels_show_both_paths(live, models):
    stack, scenario = live
    p = _series_by(
        stack, scenario, models, "flyserve-kernels.json", "Kernel time per path (p50, p99)", "path"
    )
    for path in ("unified", "prefill"):
        finite = [v for _, v in p[path] if math.isfinite(v)]
        assert finite and all(1e-6 < v <= 1.0 for v in finite), path  # 1.0: the top finite bucket


def test_alert_rules_evaluate_on_live_data(live):
    stack, scenario = live
    rules = stack.rules()
    # every alert of config/alerts.yml is loaded and evaluated, none more
    expected = {r["alert"] for g in yaml.safe_load((REPO / "config" / "alerts.yml").read_text())["groups"]
                for r in g["rules"] if "alert" in r}  # fmt: skip
    assert {r["name"] for r in rules} == expected and len(rules) == len(expected) == 9
    bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    # Real alerts on real series: the refused change fires at once (no `for`); the open circuit
    # was pending while it lasted (its `for: 1m` is longer than the test).
    assert "firing" in scenario.alert_states.get("FlyserveConfigReloadFailing", set())
    assert "pending" in scenario.alert_states.get("FlyserveCircuitOpen", set())
    firing = {a["labels"]["alertname"] for a in stack.alerts() if a["state"] == "firing"}
    assert "FlyserveRankStale" not in firing and "FlyserveRanksDisagreeOnThresholds" not in firing


def test_the_scenario_ran_every_phase_in_order(live):
    """Every phase happened, once, in order; each wait in it has a deadline (_dashboards_live), so the
    stack is bounded by construction rather than by a wall-clock assertion."""
    _, scenario = live
    assert [n for _, n in scenario.events] == [
        "baseline",
        "circuit open",
        "circuit open seen",
        "circuit closed",
        "circuit closed seen",
        "min_seq_len=100000 (every prefill refused)",
        "invalid change (422)",
        "refusal seen",
        "override dropped (back to the profile)",
        "end",
    ]
    times = [t for t, _ in scenario.events]
    assert times == sorted(times) and scenario.start <= times[0]
