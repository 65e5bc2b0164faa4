"""Rank reports (ranks/<rank>.json) as the operator side may trust them.

A report is a file anyone with write access to the state directory can drop: a stray
``{"step": 1000000000}`` once pinned every later change (issue 13), ``"step": Infinity`` made
every page answer 500. So a report counts only when every field is a finite, plausible number,
and a rank counts as live only when its report is fresh and - where this process can see it -
its pid is still alive.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Any

MAX_PLAUSIBLE_STEPS_PER_S = 10_000.0
"""No engine steps faster than this (vLLM: ~10/s long prefills to ~200/s small decode batches)."""
MAX_RANK = 65_535
CLOCK_SKEW_S = 5.0


def pid_namespace() -> str:
    """This process's pid namespace ('pid:[4026531836]'): a pid is only meaningful inside it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


HOST = socket.gethostname()
PIDNS = pid_namespace()


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return None
    return v


def _float(d: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    v = float(v)
    return v if math.isfinite(v) and lo <= v <= hi else None


@dataclass(frozen=True, slots=True)
class RankReport:
    """One validated report. ``steps_per_s`` is None while the rank has not measured its rate yet."""

    rank: int
    engine: int
    pid: int
    step: int
    time: float
    started: float
    steps_per_s: float | None
    applied_version: int | None
    late_applies: int
    host: str
    pidns: str

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)

    def process_gone(self) -> bool:
        """True when the rank ran in this pid namespace on this host and its pid no longer exists."""
        if self.host != HOST or not self.pidns or self.pidns != PIDNS:
            return False  # another container or host: only the report's age can tell
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def is_live(self, now: float, stale_after_s: float) -> bool:
        return self.age(now) <= stale_after_s and not self.process_gone()


def parse_report(d: Any, *, now: float) -> RankReport | None:
    """A RankReport, or None when any field is missing, non-finite or implausible."""
    if not isinstance(d, dict):
        return None
    rank, engine = _int(d, "rank", 0, MAX_RANK), _int(d, "engine", 0, MAX_RANK)
    pid = _int(d, "pid", 1, 1 << 31)
    t = _float(d, "time", 0.0, now + CLOCK_SKEW_S)
    started = _float(d, "started", 0.0, now + CLOCK_SKEW_S)
    if None in (rank, engine, pid, t, started) or started > t + CLOCK_SKEW_S:  # type: ignore[operator]
        return None
    # A step count the rank cannot have reached since it started is not believed.
    most = int((t - started + 60.0) * MAX_PLAUSIBLE_STEPS_PER_S)  # type: ignore[operator]
    step = _int(d, "step", 0, most)
    if step is None:
        return None
    rate = None
    if d.get("steps_per_s") is not None:
        rate = _float(d, "steps_per_s", 0.0, MAX_PLAUSIBLE_STEPS_PER_S)
        if rate is None:
            return None
    applied = d.get("applied_version")
    applied = _int(d, "applied_version", 0, 1 << 62) if applied is not None else None
    late = _int(d, "late_applies", 0, 1 << 62) or 0
    host = d.get("host") if isinstance(d.get("host"), str) else ""
    pidns = d.get("pidns") if isinstance(d.get("pidns"), str) else ""
    return RankReport(
        rank=rank,  # type: ignore[arg-type]
        engine=engine,  # type: ignore[arg-type]
        pid=pid,  # type: ignore[arg-type]
        step=step,
        time=t,  # type: ignore[arg-type]
        started=started,  # type: ignore[arg-type]
        steps_per_s=rate,
        applied_version=applied,
        late_applies=late,
        host=host[:256],
        pidns=pidns[:64],
    )
