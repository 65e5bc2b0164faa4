"""A planted cost-table drift fires FlyserveCostTableDrift in a real Prometheus; no drift keeps it silent.

Two instances side by side, each a real `flyserve sidecar --costs h200` (uvicorn) reading a real
`flyserve simulate --costs h200` rank: instance "drift" plants ``--drift prefill=1.5``, instance
"clean" plants nothing. One real Prometheus scrapes both every second and evaluates the shipped
config/alerts.yml with only the pricing alerts' ``for: 30m`` shortened to 5 s in a test copy (the
30 minutes themselves are covered by promtool's unit tests in config/alerts_test.yml). Bounded:
every wait has a deadline, every process is stopped at the end.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from _dashboards_live import _wait, free_port
from _prometheus_live import LiveProcesses, start_prometheus

from tests._support import require_binary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SHORT_FOR = "5s"


def _test_rules(dest: Path) -> Path:
    """config/alerts.yml with the pricing group's `for: 30m` shortened; everything else as shipped."""
    doc = yaml.safe_load((REPO / "config" / "alerts.yml").read_text())
    (group,) = [g for g in doc["groups"] if g["name"] == "flyserve-pricing"]
    for rule in group["rules"]:
        assert rule["for"] == "30m", rule["alert"]  # the shipped value
        rule["for"] = SHORT_FOR
    path = dest / "alerts.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _alerts(prom: str, name: str) -> list[dict]:
    body = httpx.get(f"{prom}/api/v1/alerts", timeout=5).json()
    return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == name]


def test_planted_drift_fires_the_drift_alert_and_no_drift_stays_silent(tmp_path: Path):
    prometheus = require_binary("prometheus")
    processes = LiveProcesses(tmp_path)
    spawn = processes.spawn
    cli = [sys.executable, "-m", "flyserve.cli"]
    ports = {}
    try:
        for name, drift in (("drift", ["--drift", "prefill=1.5"]), ("clean", [])):
            state = tmp_path / name
            ports[name] = free_port()
            side = spawn(
                f"sidecar-{name}",
                [*cli, "sidecar", "--state-dir", str(state), "--port", str(ports[name]),
                 "--profile", "h200", "--costs", "h200", "--log-level", "warning"],
            )  # fmt: skip
            _wait(
                f"sidecar {name}",
                lambda p=ports[name]: (
                    httpx.get(f"http://127.0.0.1:{p}/healthz", timeout=1).status_code == 200
                ),
                60,
                side,
                tmp_path / f"sidecar-{name}.log",
            )
            # The h200 profile sends every batch to FA3 (its decode_path): every sample is a prefill-path
            # kernel time. 6000 steps at 20 ms: longer than the test waits.
            spawn(
                f"simulate-{name}",
                [*cli, "simulate", "--state-dir", str(state), "--ranks", "1", "--workload", "seed-8k-c8",
                 "--steps", "6000", "--step-interval", "0.02", "--profile", "h200", "--costs", "h200", *drift],
            )  # fmt: skip

        targets = [
            {"targets": [f"127.0.0.1:{ports[n]}"], "labels": {"service": n}} for n in ("drift", "clean")
        ]
        prom = start_prometheus(processes, prometheus, _test_rules, targets)
        pp = processes.procs["prometheus"]
        _wait("prometheus", lambda: httpx.get(f"{prom}/-/ready", timeout=1).status_code == 200, 60, pp)

        drift_instance = f"127.0.0.1:{ports['drift']}"
        clean_instance = f"127.0.0.1:{ports['clean']}"

        def firing() -> list[dict]:
            return [a for a in _alerts(prom, "FlyserveCostTableDrift") if a["state"] == "firing"]

        _wait(
            "the drift alert", lambda: any(a["labels"]["instance"] == drift_instance for a in firing()), 150
        )
        (fired,) = [a for a in firing() if a["labels"]["instance"] == drift_instance]
        assert fired["labels"]["path"] == "prefill"
        assert float(fired["value"]) == pytest.approx(1.5, rel=1e-6)
        assert (
            "flyserve\ncalibrate" in fired["annotations"]["runbook"]
            or "flyserve calibrate" in fired["annotations"]["runbook"]
        )

        # The clean instance is scraped and priced (its drift gauge is there, at 1.0) but never alerts.
        q = httpx.get(
            f"{prom}/api/v1/query",
            params={"query": f'flyserve_cost_drift_ratio{{instance="{clean_instance}",path="prefill"}}'},
            timeout=5,
        ).json()["data"]["result"]
        assert q and float(q[0]["value"][1]) == pytest.approx(1.0, rel=1e-6)
        time.sleep(2 * 5)  # two `for:` periods more: a pending clean alert would have fired by now
        assert not [
            a for a in _alerts(prom, "FlyserveCostTableDrift") if a["labels"]["instance"] == clean_instance
        ]
    finally:
        processes.stop_all()
