"""Ranks that crash and restart, with the real sidecar compacting their files.

`flyserve simulate --engines 2 --ranks 2 --restart-every 0.7 --max-restarts 12` kills one rank
process at a time (SIGKILL, so its files stay, live gauges included) and starts it again as a new
pid; `flyserve sidecar --compact-interval 1` merges the dead ones. Without compaction the directory
would gain 3 files per restart (36 here, on top of 12); with it, it stays near 3 per live process
plus the archives. And the counter totals /metrics shows never go down while files are merged and
removed under its feet (a lost or double-counted file would show as a drop or a jump back).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _live_sidecar import free_port, stop_process

pytestmark = pytest.mark.integration

RESTARTS = 12


def _pids(metrics: Path) -> set[str]:
    """Writers whose own files are in the directory (archives, pid "dead", not counted)."""
    return {n[:-3].rsplit("_", 1)[1] for n in os.listdir(metrics) if n.endswith(".db")} - {"dead"}


def _totals(body: str) -> dict[str, float]:
    """Every counter sample (and histogram count/sum) of the ranks' files, by line."""
    out = {}
    for line in body.splitlines():
        if line.startswith(("flyserve_dispatch_", "flyserve_kernel_")) and (
            "_total{" in line or "_count{" in line or "_bucket{" in line
        ):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_restarting_ranks_keep_the_metrics_dir_bounded_and_totals_monotone(tmp_path: Path):
    state = tmp_path / "state"
    port = free_port()
    sim_log, side_log = (tmp_path / "sim.log").open("w"), (tmp_path / "sidecar.log").open("w")
    env = {
        k: v for k, v in os.environ.items() if k not in ("FLYSERVE_SIDECAR_TOKEN", "PROMETHEUS_MULTIPROC_DIR")
    }
    # 4000 steps (400 s, past the loop's deadline; stopped in `finally`): with 400, a loaded machine
    # ended the run after 11 of the 12 restarts (each restart starts an interpreter).
    sim = subprocess.Popen(
        [sys.executable, "-m", "flyserve.cli", "simulate", "--state-dir", str(state), "--engines", "2",
         "--ranks", "2", "--workload", "seed-8k-c8", "--steps", "4000", "--step-interval", "0.1",
         "--restart-every", "0.7", "--max-restarts", str(RESTARTS)],
        env=env, stdout=sim_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    side = subprocess.Popen(
        [sys.executable, "-m", "flyserve.cli", "sidecar", "--state-dir", str(state), "--port", str(port),
         "--compact-interval", "1", "--stale-after", "5", "--metrics-ttl", "0", "--log-level", "info"],
        env=env, stdout=side_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    files_seen: list[int] = []
    previous: dict[str, float] = {}
    drops: list[str] = []
    try:
        with httpx.Client(timeout=10) as c:
            deadline = time.monotonic() + 240
            while True:  # until every restart is done and the last dead files are merged
                assert time.monotonic() < deadline, (
                    "the restarts did not finish in time:\n" + (tmp_path / "sim.log").read_text()[-3000:]
                )
                assert sim.poll() is None, (tmp_path / "sim.log").read_text()[-3000:]
                assert side.poll() is None, (tmp_path / "sidecar.log").read_text()[-3000:]
                time.sleep(0.4)
                metrics = state / "metrics"
                if metrics.is_dir():
                    files_seen.append(sum(1 for n in os.listdir(metrics) if n.endswith(".db")))
                try:
                    body = c.get(base + "/metrics").text
                except httpx.HTTPError:
                    continue
                now = _totals(body)
                for k, v in previous.items():
                    if now.get(k, 0.0) < v:
                        drops.append(f"{k}: {v} -> {now.get(k)}")
                previous = now
                log_text = (tmp_path / "sim.log").read_text()
                if f"{RESTARTS} restart(s)" in log_text and metrics.is_dir() and len(_pids(metrics)) <= 5:
                    break  # left: 4 live ranks and the sidecar itself; every dead pid merged
    finally:
        stop_process(sim, kill_wait_s=5)
        stop_process(side, kill_wait_s=5)
    side_text = (tmp_path / "sidecar.log").read_text()
    assert drops == [], drops
    # Never near the 12 + 36 files of no compaction: dead files are merged within a second or two.
    assert max(files_seen) < 4 * 3 + 3 * RESTARTS, files_seen
    archives = sorted(n for n in os.listdir(state / "metrics") if n.endswith("_dead.db"))
    assert "counter_dead.db" in archives and "histogram_dead.db" in archives
    assert "dead file(s) merged" in side_text
    assert sum(previous.values()) > 0
