"""Rank reports (ranks/<rank>.json) as the operator side may trust them.

A report is a file anyone with write access to the state directory can drop: a stray
``{"step": 1000000000}`` once pinned every later change, ``"step": Infinity`` made every page
answer 500, and three plausible reports "from another host" outvoted two real ranks. So a report
counts only when every field is a finite, plausible number, and what a report says about its own
process is checked against the process table where it can be (liveness()):

* ``CONFIRMED``: fresh, written on this host in this pid namespace, its pid alive and still the
  same process (its start time in /proc/<pid>/stat equals the ``proc_start`` the rank recorded
  of itself: a pid that died and was reused by another process is not the rank), and - where the
  reader knows the file's owner (Store does, from the descriptor it read) - that process runs as
  the uid that owns the file, a uid the reader trusts (its own or the state directory's owner:
  ``foreign_writer`` otherwise). Only a process that can act as the ranks' own user on this host
  can forge one; such a user can also kill or ptrace the ranks and is out of scope.
* ``UNCONFIRMED``: fresh, but from another host or pid namespace (a container that does not share
  the pid namespace, or a forgery), or a report without ``proc_start`` (written by an older
  flyserve: its pid cannot be told from a reused one): nothing but its age can be checked.
* ``GONE``: stale, or its process is gone or exited (a zombie not reaped yet), or the pid now
  belongs to another process (its start time differs from the recorded one).

``is_live()`` is the one question the other modules ask (the effective step, /readyz, shape
samples); control.effective decides how much an unconfirmed report may count.
"""

from __future__ import annotations

import enum
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

from flyserve.control.paths import MAX_VERSION
from flyserve.files.processes import PidState, pid_state

MAX_PLAUSIBLE_STEPS_PER_S = 10_000.0
"""No engine steps faster than this (vLLM: ~10/s long prefills to ~200/s small decode batches)."""
MAX_RANK = 65_535
CLOCK_SKEW_S = 5.0
EARLIEST_START = 1_577_836_800.0
"""2020-01-01: a rank that says it started before is not believed ('started: 0.0' once made the
step cap, (time - started) * MAX_PLAUSIBLE_STEPS_PER_S, allow 10^13 steps)."""


def pid_namespace() -> str:
    """This process's pid namespace ('pid:[4026531836]'): a pid is only meaningful inside it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def proc_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (/proc/<pid>/stat field 22), or None
    when there is no such process, it has exited (a zombie) or /proc cannot tell. The comm field (2) may hold spaces and
    parentheses, so fields are counted after its last ')'. A pid's (pid, start) pair names one
    process for the life of the machine: a reused pid has a later start."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read(4096)
    except (OSError, ValueError):
        return None
    rest = raw[raw.rfind(b")") + 1 :].split()
    try:
        if rest[0] in (b"Z", b"X"):
            return None  # exited, not reaped yet: no longer the rank (nor holding its name)
        return int(rest[19])  # fields 3.. follow the comm: field 22 is the 20th of them
    except (IndexError, ValueError):
        return None


HOST = socket.gethostname()
PIDNS = pid_namespace()
_OWN_START: tuple[int, int | None] = (-1, None)


def own_proc_start() -> int | None:
    """This process's own start (ticks since boot), which a rank records in its report
    (``proc_start``). Cached per pid, not at import: a worker forked after import has its own."""
    global _OWN_START
    pid = os.getpid()
    if _OWN_START[0] != pid:
        _OWN_START = (pid, proc_start_ticks(pid))
    return _OWN_START[1]


MAX_PROC_START = 1 << 62


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
    file_uid: int | None = None
    """The uid that owns the report file, where the reader knows it (Store does: the fstat of the
    descriptor it read the report from, not a separate stat of the path)."""
    proc_start: int | None = None
    """The rank's own /proc start time (ticks since boot) as it recorded it; None in reports
    written by an older flyserve (never confirmed: a reused pid cannot be told apart)."""
    foreign_writer: bool = False
    """The file's owner is neither the reader's uid nor the state directory's owner (Store): a
    process of that uid is never taken for a rank (it could name its own live pid)."""

    @property
    def identity(self) -> tuple[int, int | None]:
        """(pid, proc_start): one process for the life of the machine (control.witness)."""
        return (self.pid, self.proc_start)

    @property
    def key(self) -> tuple[int, int]:
        """(engine, rank): the report's identity, the same as its file name's."""
        return (self.engine, self.rank)

    def age(self, now: float) -> float:
        return max(0.0, now - self.time)

    def local(self) -> bool:
        """Written on this host in this pid namespace: its pid means something here."""
        return self.host == HOST and bool(self.pidns) and self.pidns == PIDNS

    def process_gone(self) -> bool:
        """True when the rank ran in this pid namespace on this host and its pid no longer exists."""
        return self.local() and process_check(self) is _Process.GONE

    def is_live(self, now: float, stale_after_s: float) -> bool:
        """Fresh and not known gone: confirmed or unconfirmed (see liveness())."""
        return liveness(self, now=now, stale_after_s=stale_after_s) is not Liveness.GONE


class Liveness(enum.Enum):
    """What the process table says about a report (module docstring)."""

    CONFIRMED = "confirmed"
    UNCONFIRMED = "unconfirmed"
    GONE = "gone"


class _Process(enum.Enum):
    OURS = 1  # alive, the same process (start time), run by the uid that owns the report file
    GONE = 2  # no such process, or the pid now names another process (a later start time)
    NOT_OURS = 3  # alive but another uid than the file's owner, a foreign writer, no proc_start


def process_check(report: RankReport) -> _Process:
    """Ask the process table about a local report's pid (callers check report.local() first)."""
    if report.proc_start is not None:
        now_start = proc_start_ticks(report.pid)
        if now_start is None:
            return _Process.GONE
        if now_start != report.proc_start:
            return _Process.GONE  # the rank's pid was reused: the rank is gone
    state = pid_state(report.pid)
    if state is PidState.GONE:
        return _Process.GONE
    if state is PidState.UNKNOWN:
        return _Process.NOT_OURS
    # alive (another user's included: the uid check below decides)
    if report.file_uid is not None:
        try:
            if os.stat(f"/proc/{report.pid}").st_uid != report.file_uid:
                return _Process.NOT_OURS
        except FileNotFoundError:
            return _Process.GONE
        except OSError:
            return _Process.NOT_OURS
    if report.proc_start is None or report.foreign_writer:
        return _Process.NOT_OURS
    return _Process.OURS


def process_confirmed(report: RankReport) -> bool:
    """The process table vouches for the report's process, whatever its age (liveness() adds it)."""
    return report.local() and process_check(report) is _Process.OURS


def liveness(report: RankReport, *, now: float, stale_after_s: float) -> Liveness:
    """CONFIRMED, UNCONFIRMED or GONE (module docstring). A read of /proc/<pid>/stat (4 kB at most),
    kill 0 and a stat of /proc/<pid>: fine per look at ranks/, never on a rank's hot path."""
    if report.age(now) > stale_after_s:
        return Liveness.GONE
    if not report.local():
        return Liveness.UNCONFIRMED
    check = process_check(report)
    if check is _Process.GONE:
        return Liveness.GONE
    return Liveness.CONFIRMED if check is _Process.OURS else Liveness.UNCONFIRMED


def is_live(report: RankReport, *, now: float, stale_after_s: float, confirmed_only: bool = False) -> bool:
    """Whether ``report``'s rank counts as live: fresh and not known gone, and with
    ``confirmed_only`` also confirmed by the process table (liveness()). The stable entry point
    for other modules (the effective step, shape samples from live ranks only)."""
    state = liveness(report, now=now, stale_after_s=stale_after_s)
    return state is Liveness.CONFIRMED if confirmed_only else state is not Liveness.GONE


def parse_report(
    d: Any, *, now: float, file_uid: int | None = None, foreign_writer: bool = False
) -> RankReport | None:
    """A RankReport, or None when any field is missing, non-finite or implausible. ``file_uid``:
    the report file's owner, for liveness()'s uid check; ``foreign_writer``: that owner is not a
    uid the reader trusts (RankReport.foreign_writer)."""
    if not isinstance(d, dict):
        return None
    rank, engine = _int(d, "rank", 0, MAX_RANK), _int(d, "engine", 0, MAX_RANK)
    pid = _int(d, "pid", 1, 1 << 31)
    t = _float(d, "time", 0.0, now + CLOCK_SKEW_S)
    started = _float(d, "started", EARLIEST_START, now + CLOCK_SKEW_S)
    if rank is None or engine is None or pid is None or t is None or started is None:
        return None
    if started > t + CLOCK_SKEW_S:
        return None
    t = min(t, now)  # a report from the future (up to the allowed skew) is as fresh as now, no fresher
    # A step count the rank cannot have reached since it started is not believed.
    most = int((t - started + 60.0) * MAX_PLAUSIBLE_STEPS_PER_S)
    step = _int(d, "step", 0, most)
    if step is None:
        return None
    rate = None
    if d.get("steps_per_s") is not None:
        rate = _float(d, "steps_per_s", 0.0, MAX_PLAUSIBLE_STEPS_PER_S)
        if rate is None:
            return None
    applied = d.get("applied_version")
    applied = _int(d, "applied_version", 0, MAX_VERSION) if applied is not None else None
    late = _int(d, "late_applies", 0, 1 << 62) or 0
    proc_start = d.get("proc_start")
    if proc_start is not None:
        proc_start = _int(d, "proc_start", 0, MAX_PROC_START)
        if proc_start is None:
            return None
    host, pidns = d.get("host"), d.get("pidns")
    host = host if isinstance(host, str) else ""
    pidns = pidns if isinstance(pidns, str) else ""
    return RankReport(
        rank=rank,
        engine=engine,
        pid=pid,
        step=step,
        time=t,
        started=started,
        steps_per_s=rate,
        applied_version=applied,
        late_applies=late,
        host=host[:256],
        pidns=pidns[:64],
        file_uid=file_uid,
        proc_start=proc_start,
        foreign_writer=foreign_writer,
    )
