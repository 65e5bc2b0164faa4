"""StepWitness: what this reader saw of each rank, so a report must agree with its own history.

A rank's step only goes up, and no faster than MAX_PLAUSIBLE_STEPS_PER_S: between two looks at
ranks/ by one reader (the sidecar reads it for every probe, page and change), a report of the same
process (same (engine, rank), pid, ``proc_start`` and start time) whose step grew faster than that,
timed by the reader's clock and not by the report's own numbers, is not that rank: someone else
wrote its file. A step that went down is taken as the new reference (the earlier
one was the lie: a process's steps never go down).

One key, one process: once the process table confirmed a process under an (engine, rank)
(flyserve.control.reports.liveness), a report under that key that is not confirmed as that same
process - another pid or start time, a file owned by another uid, a report "from another host" -
is refused for as long as that process lives, whatever its file name says (a forgery renamed over
a live rank's file). A restarted rank is a new process only once the old one is
gone from the process table (one re-created inside the same process keeps its identity: its
``started`` and steps start again).

A refused report is replaced by the last credible one of its key (its age keeps growing, so it
goes stale as the rank would), so the rank stays live and its engine's step stays planned from
what the rank itself wrote; the rank's next own report is believed again.

What the plan may do with unknown or static forgeries is bounded elsewhere (control.effective).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyserve.control.reports import CLOCK_SKEW_S, MAX_PLAUSIBLE_STEPS_PER_S, RankReport, proc_start_ticks

KEEP_S = 30.0
"""How long a key's last credible report is remembered while its file is missing or unreadable
(a report older than the default 30 s staleness no longer counts anyway)."""
MAX_KEYS = 512
"""At most this many keys remembered (twice the rank files read per look)."""

Seen = tuple[dict[str, Any], RankReport]
"""A report as read (its JSON object) and as validated."""


@dataclass(frozen=True, slots=True)
class _Seen:
    raw: dict[str, Any]
    report: RankReport
    confirmed: bool  # the process table confirmed it at that look
    at: float  # the reader's clock


def _same_process(a: RankReport, b: RankReport) -> bool:
    return a.identity == b.identity and a.started == b.started


def _still_alive(r: RankReport) -> bool:
    """The confirmed process ``r`` names still runs (same pid, same start time)."""
    return r.proc_start is not None and proc_start_ticks(r.pid) == r.proc_start


class StepWitness:
    """One reader's observations, one per (engine, rank) seen at its last look or within KEEP_S
    (at most MAX_KEYS entries)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], _Seen] = {}
        self.refused = 0
        """Reports refused at the last look (replaced by their key's last credible one, or dropped)."""

    def look(self, reports: list[Seen], now: float, confirmed: Callable[[RankReport], bool]) -> list[Seen]:
        """Record one look's reports; return them with each one that contradicts its history
        replaced by the last credible report of its key (or left out when there is none)."""
        seen: dict[tuple[int, int], _Seen] = {}
        out: list[Seen] = []
        refused = 0
        for d, r in reports:
            prev = self._seen.get(r.key)
            ok = confirmed(r)
            if prev is not None and self._contradicts(prev, r, ok, now):
                refused += 1
                seen[r.key] = prev
                out.append((prev.raw, prev.report))
                continue
            seen[r.key] = _Seen(d, r, ok, now)
            out.append((d, r))
        # A key missing from this look (its file made unreadable, garbage or removed) keeps its
        # history for KEEP_S: otherwise a forger could erase it with one bad file and have its
        # forgery taken as a new process at the next look. While its confirmed process lives, its
        # last credible report stands in (the rank is still there: /readyz and the plan see it).
        for key, prev in self._seen.items():
            if key not in seen and now - prev.at <= KEEP_S and len(seen) < MAX_KEYS:
                seen[key] = prev
                if prev.confirmed and _still_alive(prev.report):
                    out.append((prev.raw, prev.report))
        self._seen = seen
        self.refused = refused
        return out

    @staticmethod
    def _contradicts(prev: _Seen, r: RankReport, confirmed: bool, now: float) -> bool:
        if (
            prev.confirmed
            and not (confirmed and prev.report.identity == r.identity)
            and _still_alive(prev.report)
        ):
            return True  # the key belongs to a live confirmed process: this is not it
        if _same_process(prev.report, r):
            allowed = (max(0.0, now - prev.at) + CLOCK_SKEW_S) * MAX_PLAUSIBLE_STEPS_PER_S
            return r.step - prev.report.step > allowed
        return False
