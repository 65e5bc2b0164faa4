"""config/alerts.yml, config/alerts_test.yml and config/prometheus.yml, checked by promtool.

`promtool test rules` runs the synthetic-series unit tests of every alert (fires when it should,
silent when it should not); the tests here also make sure no alert is left without such a test.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (scripts/setup.sh does)")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), *args], check=False, capture_output=True, text=True, timeout=120, cwd=REPO
    )


def _alerts() -> list[dict]:
    doc = yaml.safe_load((CONFIG / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.slow  # runs promtool
def test_promtool_check_rules():
    r = _run("check", "rules", "config/alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


@pytest.mark.slow  # runs promtool
def test_promtool_unit_tests_of_every_alert_pass():
    r = _run("test", "rules", "config/alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.mark.slow  # runs promtool
def test_promtool_check_config():
    r = _run("check", "config", "config/prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_alerts_the_issue_asks_for():
    names = {a["alert"] for a in _alerts()}
    assert names == {
        "FlyservePrefillRatioCollapsed",
        "FlyserveRanksDisagreeOnThresholds",
        "FlyserveConfigReloadFailing",
        "FlyserveCircuitOpen",
        "FlyserveRankStale",
        "FlyserveKernelTimeRegression",
        "FlyserveRoutingRegretHigh",
        "FlyserveCostTableDrift",
        "FlyserveAutopilotRepeatedRollbacks",
    }


@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_every_alert_has_runbook_text_and_severity(alert):
    ann = alert["annotations"]
    assert set(ann) >= {"summary", "description", "runbook"}
    assert len(ann["runbook"]) >= 200, "a runbook says what to check and what to do"
    assert alert["labels"]["severity"] in ("warning", "critical")


def _tested_alerts() -> tuple[set[str], set[str]]:
    """Alerts expected to fire somewhere, and alerts asserted silent somewhere, in alerts_test.yml."""
    doc = yaml.safe_load((CONFIG / "alerts_test.yml").read_text())
    fires, silent = set(), set()
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    return fires, silent


def test_each_alert_is_unit_tested_both_ways():
    fires, silent = _tested_alerts()
    names = {a["alert"] for a in _alerts()}
    assert names <= fires, f"no firing case for {sorted(names - fires)}"
    assert names <= silent, f"no silent case for {sorted(names - silent)}"


# Each threshold, window and `for` of the rules, loosened or tightened: the unit tests must notice.
MUTANTS = [
    ("FlyservePrefillRatioCollapsed", "< 0.25 *", "< 0.5 *"),
    ("FlyservePrefillRatioCollapsed", ") > 0.1", ") > -1"),
    ("FlyservePrefillRatioCollapsed", "[10m])) > 0.05", "[10m])) > 0"),
    ("FlyservePrefillRatioCollapsed", "for: 5m", "for: 0m"),
    ("FlyserveRanksDisagreeOnThresholds", "(flyserve_ranks_agree) == 0", "(flyserve_ranks_agree) < 0"),
    (
        "FlyserveRanksDisagreeOnThresholds",
        "(flyserve_thresholds_version))) > 1)",
        "(flyserve_thresholds_version))) > 2)",
    ),
    ("FlyserveRanksDisagreeOnThresholds", "for: 2m", "for: 0m"),
    ("FlyserveConfigReloadFailing", '{result!="success"}[15m]', '{result!="success"}[60m]'),
    ("FlyserveConfigReloadFailing", "[15m])) > 0", "[15m])) >= 0"),
    ("FlyserveCircuitOpen", "(flyserve_circuit_open) > 0", "(flyserve_circuit_open) >= 0"),
    (
        "FlyserveCircuitOpen",
        "(flyserve_circuit_open) > 0\n        for: 1m",
        "(flyserve_circuit_open) > 0\n        for: 0m",
    ),
    (
        "FlyserveRankStale",
        "(flyserve_rank_up) == 0\n        for: 1m",
        "(flyserve_rank_up) == 0\n        for: 0m",
    ),
    ("FlyserveRankStale", "(flyserve_rank_up) == 0", "(flyserve_rank_up) <= 1"),
    ("FlyserveKernelTimeRegression", "> 1.5", "> 2"),
    ("FlyserveKernelTimeRegression", ">= 20", ">= 0"),
    ("FlyserveKernelTimeRegression", "for: 10m", "for: 5m"),
    ("FlyserveRoutingRegretHigh", ") > 1.05", ") > 1.2"),
    ("FlyserveRoutingRegretHigh", ") > 1.05\n        for: 30m", ") > 1.05\n        for: 20m"),
    ("FlyserveCostTableDrift", "(flyserve_cost_drift_ratio) > 1.4)", "(flyserve_cost_drift_ratio) > 1.6)"),
    ("FlyserveCostTableDrift", "(flyserve_cost_drift_ratio) < 0.7)", "(flyserve_cost_drift_ratio) < 0.4)"),
    ("FlyserveCostTableDrift", "< 0.7)\n        for: 30m", "< 0.7)\n        for: 10m"),
    ("FlyserveAutopilotRepeatedRollbacks", "[1h])) >= 3", "[1h])) >= 4"),
    ("FlyserveAutopilotRepeatedRollbacks", "[1h])) >= 3", "[1h])) >= 2"),
    ("FlyserveAutopilotRepeatedRollbacks", '|inconclusive"}[1h]', '|inconclusive"}[15m]'),
    ("FlyserveAutopilotRepeatedRollbacks", '"rolled_back|inconclusive"', '"rolled_back"'),
    (
        "FlyserveAutopilotRepeatedRollbacks",
        '"rolled_back|inconclusive"',
        '"rolled_back|inconclusive|aborted"',
    ),
    (
        "FlyserveAutopilotRepeatedRollbacks",
        '"rolled_back|inconclusive"',
        '"rolled_back|inconclusive|promoted"',
    ),
    ("FlyserveAutopilotRepeatedRollbacks", "for: 3m", "for: 0m"),
]


@pytest.mark.slow  # runs promtool
@pytest.mark.parametrize(("alert", "old", "new"), MUTANTS, ids=[f"{a}:{n}" for a, _, n in MUTANTS])
def test_promtool_unit_tests_notice_a_changed_rule(tmp_path, alert, old, new):
    """The unit tests bite: with one clause of one alert changed, promtool reports that alert."""
    rules = (CONFIG / "alerts.yml").read_text()
    assert rules.count(old) == 1, f"mutant anchor {old!r} not unique in alerts.yml"
    (tmp_path / "alerts.yml").write_text(rules.replace(old, new))
    shutil.copy(CONFIG / "alerts_test.yml", tmp_path / "alerts_test.yml")
    r = subprocess.run(
        [_promtool(), "test", "rules", "alerts_test.yml"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode != 0
    assert f"alertname: {alert}" in r.stdout + r.stderr


def test_prometheus_config_scrapes_the_sidecar_and_loads_the_alerts_and_fleet_rules():
    cfg = yaml.safe_load((CONFIG / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml", "fleet_rules.yml"]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "flyserve"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
