"""The sidecar's periodic compaction of dead processes' metric files (flyserve.telemetry.compaction).

A daemon thread of its own (periodic.py), never a request thread: a compaction reads and writes whole files
(tens of ms with hundreds of dead files). It runs once at start and then every
``compact_interval_s``. It refuses to run while any fresh rank report comes from another host or pid
namespace: there ``kill(pid, 0)`` cannot tell a live rank from a dead one, and merging a live
rank's file would freeze its counts (the rank keeps writing into a file no reader sees). Pids named
by fresh reports also count as alive whatever the process table says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from flyserve.control import ControlPlane
from flyserve.files.processes import pid_alive
from flyserve.sidecar.periodic import PeriodicThread
from flyserve.telemetry import metrics as tm
from flyserve.telemetry.compaction import CompactionReport, compact

log = logging.getLogger("flyserve.sidecar")


class MetricsCompactor:
    """Start/stop a thread that compacts ``<state>/metrics`` every ``interval_s`` (0: never)."""

    def __init__(
        self,
        control: ControlPlane,
        *,
        interval_s: float,
        stale_after_s: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.control = control
        self.metrics_dir: Path = control.state_dir.metrics_dir
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._wall = wall
        self._refused_logged = False
        self.last: CompactionReport | None = None
        self._periodic = PeriodicThread(
            self.run_once,
            interval_s=interval_s,
            name="flyserve-metrics-compactor",
            log=log,
            failed="metrics compaction failed (the files are left as they were)",
        )

    def start(self) -> None:
        if self.interval_s > 0:
            self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def run_once(self) -> CompactionReport | None:
        """One compaction, or None when refused (reports from another pid namespace) or no directory."""
        if not self.metrics_dir.is_dir():
            return None
        now = self._wall()
        fresh = [r for r in self.control.store.reports(now=now) if r.age(now) <= self.stale_after_s]
        foreign = [r for r in fresh if not r.local()]
        if foreign:
            if not self._refused_logged:
                log.warning(
                    "metrics compaction off: %d rank report(s) come from another host or pid namespace "
                    "(e.g. engine %d rank %d), where a live rank cannot be told from a dead one; "
                    "<state>/metrics grows by ~4 files per rank restart",
                    len(foreign),
                    foreign[0].engine,
                    foreign[0].rank,
                )
                self._refused_logged = True
            return None
        self._refused_logged = False
        reported = {r.pid for r in fresh}
        report = compact(self.metrics_dir, is_alive=lambda pid: pid in reported or pid_alive(pid))
        if report.busy:
            return report
        if report.merged:
            tm.SIDECAR_COMPACTED_FILES.labels("merged").inc(report.merged)
        if report.dropped:
            tm.SIDECAR_COMPACTED_FILES.labels("dropped").inc(report.dropped)
        tm.SIDECAR_METRICS_FILES.set(float(report.files_after))
        if report.recovered:
            log.warning("metrics compaction: %s", report.recovered)
        if report.merged or report.dropped:
            log.info(
                "metrics compaction: %d dead file(s) merged, %d dropped; %d -> %d files",
                report.merged,
                report.dropped,
                report.files_before,
                report.files_after,
            )
        self.last = report
        return report
