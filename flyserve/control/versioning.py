"""The version record the control plane stands on: the current snapshot (or what stands in for a
missing, damaged or forged one) and the number the next version gets, above every version current.json,
history, the audit log and the live ranks record (control.version_trust: which of them are believed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from flyserve.control.errors import ControlIOError
from flyserve.control.paths import MAX_VERSION, StateDir
from flyserve.control.reports import Liveness, RankReport, liveness
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.store import Store
from flyserve.control.version_trust import MAX_VERSION_STEP, anchored_ceiling, live_anchor
from flyserve.thresholds_files import load_profile

log = logging.getLogger("flyserve.control")

UNCONFIRMED_VERSION_SLACK = MAX_VERSION_STEP - 1
"""How far above every recorded version an unconfirmed rank's applied_version is believed (the
ranks' applied versions matter when current.json, history and audit are all lost; a real rank's
version is a count of changes, far below this; a forged 10**18 - 1 would exhaust version numbers).
One below the step every reader allows (control.version_trust): the next version is numbered one
above it, and a claim of exactly MAX_VERSION_STEP above the record made that one a version every
rank at the record refused ("implausible"), circuit open included."""


class VersionRecord:
    """ControlPlane's reads of the version record (flyserve.control.plane.ControlPlane sets the
    attributes below; repair asks these methods too)."""

    state_dir: StateDir
    store: Store
    profile: str
    rank_stale_after_s: float
    _clock: Callable[[], float]

    def snapshot(self, reports: Iterable[RankReport] | None = None) -> ConfigSnapshot:
        """The current snapshot; before the first publish, version 0 from the profile (not written).

        A current.json that is missing while history exists (deleted by hand), or damaged (torn by a
        full disk, hand-edited), is not trusted: the newest intact history entry stands in for it, so
        the next change repairs current.json and versions keep going up. With nothing readable at all,
        the profile's values stand in, numbered at the highest version on record (history file names,
        the audit log, the versions live ranks report as applied), so the next change publishes
        above every version ranks have seen.

        A current.json whose version does not continue the sequence on record (control.version_trust)
        counts as damaged: with ``reports``, the lowest version the confirmed live ranks applied
        is the record (what they themselves believe), else the chain of history names.
        """
        anchor = self._confirmed_applied(reports)
        try:
            cur = self.store.read_current(anchor=anchor)
        except ControlIOError as exc:
            problem: str | None = str(exc)
        else:
            if cur is not None:
                return cur
            problem = None if self.store.version_floor() == 0 else "current.json is missing"
            if problem is None:
                return self._initial()
        fallback = self.store.newest_credible_history(at_most=self._ceiling(anchor))
        if fallback is not None:
            log.error("%s; using history version %d instead", problem, fallback.version)
            return fallback
        now = self._clock()
        floor = max(
            self._floor(anchor),
            self.store.max_audited_version(),
            self._live_applied_version(self.store.reports(now=now), now),
        )
        log.error(
            "%s and no history entry is readable; the profile's values stand in (versions continue above %d)",
            problem,
            floor,
        )
        return self._initial().replace(version=floor)

    @staticmethod
    def _ceiling(anchor: int | None) -> int | None:
        """The highest version the plane may stand on when confirmed ranks run (None: none run, no
        bound): one below the highest they believe, so the next version is one they believe too."""
        return anchored_ceiling(anchor)

    def _floor(self, anchor: int | None) -> int:
        """The version floor of history names (Store.version_floor), up to what the confirmed ranks
        believe when there are any: a version numbered above it would be refused by every rank."""
        return self.store.version_floor(at_most=self._ceiling(anchor))

    def _confirmed_applied(self, reports: Iterable[RankReport] | None) -> int | None:
        """The lowest version a live rank the process table confirms has applied, or None (no
        reports given, or none confirmed with a version): the anchor a change is numbered from
        when ranks run, so the plane never believes a version one of its ranks refuses
        (control.version_trust.live_anchor, which a starting rank and the pusher ask too; with no
        rank confirmed, the lowest fresh unconfirmed one)."""
        if reports is None:
            return None
        return live_anchor(
            reports,
            now=self._clock(),
            stale_after_s=self.rank_stale_after_s,
            record=self.store.version_floor(),
        )

    def next_version(self, cur: ConfigSnapshot, reports: Iterable[RankReport] = ()) -> int:
        """Above the current version, above every history file name and above every version a live
        rank has applied: versions only go up, so a rank (which ignores versions it has already
        passed) never misses one, and history is never overwritten. The ranks' applied versions
        matter when current.json, history and the audit log are all lost: versions would otherwise
        restart at 1 there and every rank would ignore the new ones. Raises ControlIOError past
        MAX_VERSION."""
        reports = list(reports)
        floor = self._floor(self._confirmed_applied(reports))
        v = max(cur.version, floor, self._live_applied_version(reports, self._clock())) + 1
        if v > MAX_VERSION:
            raise ControlIOError(
                f"version numbers exhausted (next would be {v}); inspect control/history",
                path=str(self.state_dir.history_dir),
            )
        return v

    def _live_applied_version(self, reports: Iterable[RankReport], now: float) -> int:
        """The highest version a live rank reports as applied (0 with none): the confirmed ranks'
        when any rank is confirmed (flyserve.control.reports.liveness), else the unconfirmed ones'
        up to UNCONFIRMED_VERSION_SLACK above every other record of versions (current.json,
        history names, the audit log). A forged report "from another host" with applied_version
        10**18 - 1 would otherwise exhaust version numbers and refuse every later change - next
        to confirmed ranks, and with none (ranks in another pid namespace, or stopped)."""
        reports = list(reports)
        by_state: dict[Liveness, list[int]] = {Liveness.CONFIRMED: [], Liveness.UNCONFIRMED: []}
        for r in reports:
            if r.applied_version is not None:
                state = liveness(r, now=now, stale_after_s=self.rank_stale_after_s)
                if state is not Liveness.GONE:
                    by_state[state].append(r.applied_version)
        if by_state[Liveness.CONFIRMED]:
            # Confirmed only says a live process of a trusted uid is named: a report naming the
            # forger's own process claimed 10**18 - 2 (or just past what the real ranks believe),
            # the plane numbered the next change above it, every rank refused it ("implausible")
            # and every later change, circuit open included, found its number "already in
            # history". Counted only up to one below what every confirmed rank believes
            # (anchored_ceiling of confirmed_anchor), as for the history names.
            # With none believed, they count as unconfirmed ones do (below).
            anchor = self._confirmed_applied(reports)
            if anchor is not None:
                ceiling = anchored_ceiling(anchor)
                return max((v for v in by_state[Liveness.CONFIRMED] if v <= ceiling), default=0)
            by_state[Liveness.UNCONFIRMED] += by_state[Liveness.CONFIRMED]
        if not by_state[Liveness.UNCONFIRMED]:
            return 0
        ceiling = self._recorded_version() + UNCONFIRMED_VERSION_SLACK
        # ...and no higher than every fresh report believes (live_anchor): the record's chain of
        # history names may itself be forged.
        lowest = self._confirmed_applied(reports)
        if lowest is not None:
            ceiling = min(ceiling, anchored_ceiling(lowest))
        believed = [v for v in by_state[Liveness.UNCONFIRMED] if v <= ceiling]
        if len(believed) < len(by_state[Liveness.UNCONFIRMED]):
            log.warning(
                "thresholds: %d unconfirmed rank report(s) claim an applied version more than %d above "
                "every version on record; not believed",
                len(by_state[Liveness.UNCONFIRMED]) - len(believed),
                UNCONFIRMED_VERSION_SLACK,
            )
        return max(believed, default=0)

    def _recorded_version(self) -> int:
        """The highest version current.json, history names or the audit log record (0 with none)."""
        try:
            cur = self.store.read_current()
        except ControlIOError:
            cur = None
        return max(cur.version if cur else 0, self.store.version_floor(), self.store.max_audited_version())

    def _initial(self) -> ConfigSnapshot:
        return ConfigSnapshot.build(
            version=0,
            thresholds=load_profile(self.profile),
            source="default",
            actor="",
            time=0.0,
            effective_step=0,
            profile=self.profile,
        )
