"""What the sidecar's autopilot rolls back to, and a crash's trial left in force.

The baseline is the newest version published by an operator or by an autopilot promotion; the
operator's version the newest one an operator (not the autopilot) published, where the kill switch
returns. Both are followed from each new current version (at start, from the history); the
versions the runner published itself are told apart by number (``published``).

A sidecar that starts and finds a version with a trial in force and no trial in its memory (a crash
mid-trial: the plan would end by itself) publishes the baseline's thresholds again at once and
audits why (``recovery``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.trial_lease import ACTOR as LEASE_ACTOR
from flyserve.policy.thresholds import Thresholds

ACTOR = "autopilot"
RESTART_REASON = "sidecar restarted with a trial in force and no running trial in memory"
PUBLISHED_KEPT = 256
"""Versions the runner remembers publishing (older ones count as an operator's if seen again)."""


class Baselines:
    """The baseline and the operator's version, as (version, thresholds); None until the first track."""

    def __init__(self) -> None:
        self.seen_version = -1
        self.baseline: tuple[int, Thresholds] | None = None
        self.operator: tuple[int, Thresholds] | None = None
        self._published: dict[int, str] = {}  # versions the runner published -> what for

    def track(self, cur: ConfigSnapshot, history: Callable[[], Sequence[ConfigSnapshot]]) -> None:
        """Follow a new current version (``history`` is read once, at the first)."""
        if cur.version == self.seen_version:
            return
        first = self.seen_version < 0
        self.seen_version = cur.version
        if first:
            newest = [cur, *reversed(history())]
            self.operator = next(((s.version, s.thresholds) for s in newest if by_operator(s)), None)
            self.baseline = next(((s.version, s.thresholds) for s in newest if s.trial is None), None)
            if self.operator is None:
                self.operator = (cur.version, cur.thresholds)
            if self.baseline is None:
                self.baseline = self.operator
            return
        kind = self._published.get(cur.version)
        if kind == "promote":
            self.baseline = (cur.version, cur.thresholds)
        elif kind is None and cur.actor == LEASE_ACTOR:
            # the engine's side ended a trial whose lease expired: the trial's version without
            # the trial, so the thresholds it ran over, which need not be the operator's
            self.baseline = (cur.version, cur.thresholds)
        elif kind is None and by_operator(cur):
            self.operator = self.baseline = (cur.version, cur.thresholds)

    def published(self, snapshot: ConfigSnapshot, kind: str, *, changed: bool) -> None:
        """The runner published ``snapshot`` (``kind``: trial, promote, rollback)."""
        version = snapshot.version
        self._published[version] = kind
        if len(self._published) > PUBLISHED_KEPT:
            self._published.pop(next(iter(self._published)))
        if changed:
            self.seen_version = max(self.seen_version, version)
        if kind == "promote":
            self.baseline = (version, snapshot.thresholds)

    def is_ours(self, version: int) -> bool:
        return version in self._published

    def back_to_operator(self) -> tuple[int, Thresholds] | None:
        """The kill switch: the operator's version becomes the baseline again (whatever the
        autopilot promoted since is gone); returned to publish."""
        if self.operator is not None:
            self.baseline = self.operator
        return self.operator


def by_operator(snap: ConfigSnapshot) -> bool:
    """Whether an operator published ``snap``: not the autopilot, nor the keeper of its lease
    (control.trial_lease), whose version repeats the thresholds of the trial it ended."""
    return snap.source != ACTOR and snap.actor != LEASE_ACTOR


def recovery(
    cur: ConfigSnapshot, baseline: tuple[int, Thresholds] | None
) -> tuple[Thresholds, dict[str, Any]] | None:
    """The thresholds and request that undo a trial a crash left in force (the caller has none
    running), or None."""
    if cur.trial is None or baseline is None:
        return None
    version, thresholds = baseline
    return thresholds, {
        "autopilot": "rollback",
        "trial": cur.trial.trial_id,
        "reason": RESTART_REASON,
        "to": version,
    }
