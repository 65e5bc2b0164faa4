"""StepWitness: what this reader saw of each rank's steps, so a report must agree with its own history.

A rank's step only goes up, and no faster than MAX_PLAUSIBLE_STEPS_PER_S: between two looks at
ranks/ by one reader (the sidecar reads it for every probe, page and change), a report of the same
process (same (engine, rank), pid and start time) whose step grew faster than that, timed by the
reader's clock and not by the report's own numbers, is not that rank: someone else wrote its
file (issue 22 item 3). It is refused for that look, and the last credible observation stays the
reference, so the rank's next own report is believed again. A step that went down is taken as the
new reference (the earlier one was the lie: a process's steps never go down).

What the plan may do with unknown or static forgeries is bounded elsewhere (control.effective);
this catches a forgery written over a live rank's own file, which carries a confirmed pid.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyserve.control.reports import CLOCK_SKEW_S, MAX_PLAUSIBLE_STEPS_PER_S, RankReport


@dataclass(frozen=True, slots=True)
class _Seen:
    pid: int
    started: float
    step: int
    at: float  # the reader's clock


class StepWitness:
    """One reader's observations, one per (engine, rank) seen at its last look (so it stays as
    small as one look: at most MAX_RANK_FILES entries)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], _Seen] = {}

    def look(self, reports: list[RankReport], now: float) -> set[tuple[int, int]]:
        """Record one look's reports; return the keys whose report contradicts its history."""
        seen: dict[tuple[int, int], _Seen] = {}
        refused: set[tuple[int, int]] = set()
        for r in reports:
            prev = self._seen.get(r.key)
            if prev is not None and prev.pid == r.pid and prev.started == r.started:
                allowed = (max(0.0, now - prev.at) + CLOCK_SKEW_S) * MAX_PLAUSIBLE_STEPS_PER_S
                if r.step - prev.step > allowed:
                    refused.add(r.key)
                    seen[r.key] = prev
                    continue
            seen[r.key] = _Seen(r.pid, r.started, r.step, now)
        self._seen = seen
        return refused
