"""One live test's processes and the real Prometheus among them (imported as ``_prometheus_live``:
tests/integration is on sys.path when pytest runs this folder). test_drift_alert_live.py and
test_fleet_prometheus_live.py each start sidecars and simulators, then one Prometheus that scrapes
them every second and evaluates a test copy of its rules; every process is stopped at the end."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml
from _dashboards_live import REPO, _stop, free_port


class LiveProcesses:
    """Processes started by one test, each in its own session with its output in <root>/<name>.log,
    without the caller's PROMETHEUS_MULTIPROC_DIR and FLYSERVE_STATE_DIR. stop_all() stops them,
    newest first, and closes the logs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {
            k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "FLYSERVE_STATE_DIR")
        }
        self.env["PYTHONUNBUFFERED"] = "1"
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list[IO[bytes]] = []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("wb")
        self._logs.append(log)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs[name] = p
        return p

    def stop_all(self) -> None:
        for p in reversed(list(self.procs.values())):
            _stop(p)
        for log in self._logs:
            log.close()


def start_prometheus(
    processes: LiveProcesses,
    prometheus: str,
    rules_in: Callable[[Path], Path],
    static_configs: list[dict[str, Any]],
) -> str:
    """Prometheus as the process "prometheus", in <root>/prometheus/: config/prometheus.yml as
    shipped but scraping and evaluating every second, with the rules file ``rules_in`` writes into
    that folder as its only rules and ``static_configs`` as the flyserve job's targets. Returns its
    URL; the caller waits for /-/ready."""
    prom_dir = processes.root / "prometheus"
    prom_dir.mkdir()
    cfg = yaml.safe_load((REPO / "config" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    cfg["rule_files"] = [str(rules_in(prom_dir))]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "flyserve"]
    job["static_configs"] = static_configs
    (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    processes.spawn(
        "prometheus",
        [prometheus, f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={prom_dir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
    )  # fmt: skip
    return f"http://127.0.0.1:{port}"
