"""flyserve_thresholds_fingerprint: which thresholds content a replica routes with, as one number.

A version number counts one replica's changes: two pods started from the same ConfigMap are at
version 1, and one that later picked up an edit through the file watcher is at version 2 while a
pod started after the edit is at version 1 with the same content. A rollout controller comparing
replicas needs the content, and a Prometheus label per content would grow without bound. So the
sidecar exposes the content hash itself as a label-free gauge: the first ``FINGERPRINT_HEX_DIGITS``
hex digits of the applied version's sha256 (flyserve.control.snapshot.content_sha256), an integer
below 2**52 and so exact in a float64. ``count_values`` turns it into a label only where a rule asks,
with at most one value per replica at any moment (docs/fleet.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Final

from flyserve.sidecar.models import RankView

FINGERPRINT_HEX_DIGITS: Final = 13
"""52 bits: every integer up to 2**53 is exact in a float64, so the gauge carries it unchanged through
the text format, Prometheus and count_values (which prints it as a decimal integer)."""
MIXED: Final = -1.0
"""Live ranks applied different contents (a change in flight, or a rank that missed it)."""


def fingerprint(sha256: str) -> int:
    """The fingerprint of one content hash (64 hex digits)."""
    return int(sha256[:FINGERPRINT_HEX_DIGITS], 16)


def fingerprint_of(views: Iterable[RankView]) -> float:
    """The gauge's value over the ranks' views: the fingerprint of the content every live rank applied,
    MIXED when they applied different ones (or one of them reports no hash), NaN with no live rank.

    When confirmed ranks (the process table vouches for them) are live, only they count: a report
    anyone can write must not decide which content a replica says it runs."""
    live = [v for v in views if not v.stale]
    confirmed = [v for v in live if v.liveness == "confirmed"]
    counted = confirmed or live
    if not counted:
        return math.nan
    hashes = {v.applied_sha256 for v in counted}
    if len(hashes) != 1 or None in hashes:
        return MIXED
    (sha,) = hashes
    assert sha is not None
    return float(fingerprint(sha))
