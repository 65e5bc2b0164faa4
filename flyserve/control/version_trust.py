"""Which version numbers a reader believes: the sequence the control plane issues, and no further.

Every file in the state directory can be written by whoever can write the directory (a faulty or
hostile sidecar included). A version number is the one field a forgery could use to pin the
control plane: ranks ignore versions at or below the one they applied, so a ``current.json``
numbered 10**18 - 2 once made every later change, ``circuit open`` included, fail as "version
numbers exhausted" until vLLM restarted. The plane issues versions one above the highest it has on
record, so a real sequence climbs by one per change (by more only after a lost state directory,
bounded by MAX_VERSION_STEP); a reader believes a version only where it continues a sequence it
can see:

* a running rank: at most MAX_VERSION_STEP above the version it applied (its own memory);
* the control plane, repair, a rank that starts and the engine-channel pusher before its first
  push: with live ranks (live_anchor: the confirmed ones, else fresh unconfirmed reports), at most
  MAX_VERSION_STEP above the lowest version they applied (what every one of them believes); with
  no report, at most MAX_VERSION_STEP above the highest number of the
  *credible chain* of history file names (credible_max) - the lowest name at most
  FIRST_VERSION_CEILING, each next name at most MAX_VERSION_STEP above the one before. A forged
  chain stepping by at most MAX_VERSION_STEP looks credible by its names alone; the live ranks'
  versions are what refute it, so a reader that starts beside running ranks anchors on them.

A forger who can write the directory can still publish a *valid* change (so can anyone who can run
``flyserve thresholds set``): what a forgery can no longer do is jump the sequence out of reach.
Climbing to MAX_VERSION takes 10**12 forgeries each applied by a rank (a rank looks once a
second): the plane can always continue, and always accepts ``circuit open``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

from flyserve.control.paths import MAX_VERSION
from flyserve.control.reports import Liveness, RankReport, liveness

MAX_VERSION_STEP = 1_000_000
"""The largest jump a reader believes above a version it can see. The plane climbs by one per
change; its largest real jump follows a lost state directory and is itself bounded by this (the
unconfirmed ranks' applied versions count up to this far above every other record)."""

FIRST_VERSION_CEILING = 10**15
"""The highest version a reader believes with nothing below it to continue from (a fresh reader of
a state directory whose history was pruned or lost): far above any real count of changes (a change
a millisecond for 31 years), far below MAX_VERSION (10**18 - 1), so what it starts from can always
continue for ~10**18 more changes."""


def credible_max(versions: Iterable[int]) -> int:
    """The highest version of the credible chain in ``versions`` (0 with none): walk them ascending;
    the first counts if it is at most FIRST_VERSION_CEILING, each next one if it is at most
    MAX_VERSION_STEP above the last counted. A number past a gap ends the chain: a forged history
    file named 10**18 - 2 beside 1..12 is not a floor (12 is).

    Pruning keeps history's newest entries, which are consecutive, so a real chain has no gap."""
    best = 0
    for v in sorted(set(versions)):
        if v < 1:
            continue
        limit = FIRST_VERSION_CEILING if best == 0 else best + MAX_VERSION_STEP
        if v > min(limit, MAX_VERSION):
            break
        best = v
    return best


def believed(version: int, anchor: int) -> bool:
    """Whether ``version`` continues a sequence whose highest credible version is ``anchor`` (0: the
    reader has nothing to continue from, and FIRST_VERSION_CEILING bounds it)."""
    limit = FIRST_VERSION_CEILING if anchor <= 0 else anchor + MAX_VERSION_STEP
    return 0 <= version <= min(limit, MAX_VERSION)


def ceiling_for(anchor: int) -> int:
    """The highest version believed above ``anchor`` (for messages and caps)."""
    return min(FIRST_VERSION_CEILING if anchor <= 0 else anchor + MAX_VERSION_STEP, MAX_VERSION)


def confirmed_anchor(
    reports: Iterable[RankReport], *, now: float, stale_after_s: float, record: int
) -> int | None:
    """The anchor a reader believes from while ranks run: the lowest version a live rank the
    process table confirms (Liveness.CONFIRMED) has applied, or None with none. The lowest, not the
    highest: a version at most MAX_VERSION_STEP above it is one *every* confirmed rank believes, so
    one rank that took a forged version (or a forged-but-valid history entry above the others) does
    not lift the plane out of the others' reach; the ranks of a real sequence differ by the few
    versions a lagging rank has not applied yet. Only a report whose own version is believed after
    ``record`` (the credible chain of history names, Store.version_floor) counts. One look at the
    reports; the plane, repair, a starting rank and the engine-channel pusher all ask this."""
    return _lowest_applied(reports, Liveness.CONFIRMED, now=now, stale_after_s=stale_after_s, record=record)


def live_anchor(
    reports: Iterable[RankReport], *, now: float, stale_after_s: float, record: int
) -> int | None:
    """confirmed_anchor, or, where no rank is confirmed (ranks in another pid namespace, or on
    another host), the lowest version a fresh unconfirmed report has applied and the chain
    believes. Without it three planted history names 1,000,000 apart (even empty ``*.bad`` files)
    lifted the chain's floor: ``circuit open`` was published as 3000001, every rank (at 3) refused
    it and every later change, and ``repair`` found nothing to do. A forged unconfirmed claim can
    only lower this anchor, which bounds the plane at 1,000,000 above it: no real sequence is that
    long. With no report at all, None: the chain of history names decides."""
    reports = list(reports)
    anchor = confirmed_anchor(reports, now=now, stale_after_s=stale_after_s, record=record)
    if anchor is not None:
        return anchor
    return _lowest_applied(reports, Liveness.UNCONFIRMED, now=now, stale_after_s=stale_after_s, record=record)


def _lowest_applied(
    reports: Iterable[RankReport], state: Liveness, *, now: float, stale_after_s: float, record: int
) -> int | None:
    """The lowest applied version among reports in ``state`` whose version the chain believes."""
    applied = [
        r.applied_version
        for r in reports
        if r.applied_version
        and believed(r.applied_version, record)
        and liveness(r, now=now, stale_after_s=stale_after_s) is state
    ]
    return min(applied, default=None)


@overload
def anchored_ceiling(anchor: int) -> int: ...
@overload
def anchored_ceiling(anchor: None) -> None: ...
@overload
def anchored_ceiling(anchor: int | None) -> int | None: ...
def anchored_ceiling(anchor: int | None) -> int | None:
    """The highest version a reader anchored on ``anchor`` stands on from history (None: no
    anchor, no bound): one below the highest believed above it, so the next version the plane
    numbers above it is believed too."""
    return None if anchor is None else ceiling_for(anchor) - 1
