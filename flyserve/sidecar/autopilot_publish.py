"""What the sidecar's autopilot publishes, and how a failed publish is handled.

Every version goes through ControlPlane.publish_autopilot with If-Match: a trial's start matches
the version the runner last saw, a publish that ends a trial matches the version that carries it,
so an operator's version published in between is never overwritten (a version conflict). A failed
publish is kept as a category (PUBLISH_REFUSALS, never the error's text: it may name a path). A
publish that ends a trial and failed for another reason is owed (OwedPublish): retried every tick
while the current version still carries the trial, so a rejected candidate never stays in force
for the rest of its plan; so is the kill switch's, retried while the autopilot's own version
(a promotion) is still in force. A sidecar that starts and finds a trial in force that it does not hold
publishes the operator's thresholds back (``recover``; autopilot_baseline.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flyserve.control import ControlIOError, ControlPlane, VersionConflict
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.policy.thresholds import Thresholds, ThresholdsError
from flyserve.sidecar.autopilot_baseline import RESTART_REASON, Baselines, by_operator, recovery

log = logging.getLogger("flyserve.sidecar")

PUBLISH_REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (VersionConflict, "version conflict"),
    (ThresholdsError, "candidate refused"),
    (ControlIOError, "state directory error"),
)
"""Why a publish failed, as the audit says it: a category, never the error's text (a path)."""
CONFLICT = "version conflict"
KILL = "kill"
"""An owed publish of the kill switch: the last operator version over the autopilot's own."""


@dataclass(frozen=True)
class OwedPublish:
    """A publish that ends a trial and failed (not a version conflict: an operator's version would
    have dropped the trial): retried every tick while the current version still carries the trial,
    so a rejected candidate never stays in force for the rest of its plan."""

    trial_id: str
    thresholds: Thresholds
    request: Mapping[str, Any]
    kind: str
    why: str


class Publisher:
    """The runner's publishes: the versions seen (``versions``), the version carrying the running
    trial (``trial_version``), the category of the last failure (``refusal``) and an owed publish."""

    def __init__(
        self,
        control: ControlPlane,
        *,
        on_publish: Callable[[], None] | None,
        on_refused: Callable[[str], None],
    ) -> None:
        self.control = control
        self.versions = Baselines()
        self.refusal = ""  # the category of the last failed publish (PUBLISH_REFUSALS)
        self.trial_version: int | None = None  # the version that carries the running trial
        self.owed: OwedPublish | None = None
        self._on_publish = on_publish
        self._on_refused = on_refused

    def publish(
        self,
        thresholds: Thresholds,
        trial: Any,
        request: Mapping[str, Any],
        kind: str,
        *,
        if_match: int | None = None,
    ) -> int | None:
        """Publish through the control plane; the new version, or None (logged, handed to
        ``on_refused``, its category in ``refusal``)."""
        self.refusal = ""
        try:
            res = self.control.publish_autopilot(thresholds, trial=trial, request=request, if_match=if_match)
        except (ThresholdsError, ControlIOError, VersionConflict) as exc:
            self._on_refused(f"publish refused: {exc}"[:300])
            self.refusal = next(why for cls, why in PUBLISH_REFUSALS if isinstance(exc, cls))
            log.error("autopilot: %s publish refused: %s", kind, exc)
            return None
        version = res.snapshot.version
        self.versions.published(res.snapshot, kind, changed=res.changed)
        if self._on_publish is not None:
            self._on_publish()
        return version

    def end_trial(
        self,
        thresholds: Thresholds,
        request: Mapping[str, Any],
        kind: str,
        *,
        ends_trial: bool,
        kill: bool,
    ) -> tuple[int | None, bool]:
        """Publish a promotion, rollback or the operator's thresholds back: (the new version or
        None, whether it was published). The kill switch leaves an operator's own version (no
        trial) alone: (None, False) with no publish tried."""
        cur = self.control.snapshot() if not ends_trial else None
        if cur is not None and kill and cur.trial is None and by_operator(cur):
            self.refusal = ""  # nothing tried, nothing failed
            return None, False
        if_match = self.trial_version if ends_trial else self.versions.seen_version
        version = self.publish(thresholds, None, request, kind, if_match=if_match)
        return version, version is not None

    def owe(self, trial_id: str, thresholds: Thresholds, request: Mapping[str, Any], kind: str) -> None:
        self.owed = OwedPublish(trial_id, thresholds, request, kind, self.refusal)
        log.error("autopilot: %s of trial %s owed (%s): retried every tick", kind, trial_id, self.refusal)

    def settle_owed(self, cur: ConfigSnapshot) -> None:
        """Retry an owed publish while the current version still carries its trial (a kill's: while
        the version in force is still the autopilot's)."""
        owed = self.owed
        if owed is None:
            return
        if owed.kind == KILL:
            still_owed = cur.trial is None and not by_operator(cur)
        else:
            still_owed = cur.trial is not None and cur.trial.trial_id == owed.trial_id
        if not still_owed:
            log.warning(
                "autopilot: owed %s of trial %s dropped: version %d no longer carries it",
                owed.kind,
                owed.trial_id,
                cur.version,
            )
            self.owed = None
            return
        version = self.publish(owed.thresholds, None, owed.request, owed.kind, if_match=cur.version)
        if version is not None:
            log.warning(
                "autopilot: owed %s of trial %s published as version %d", owed.kind, owed.trial_id, version
            )
            self.owed = None
        else:
            log.error(
                "autopilot: owed %s of trial %s still not published (%s): retried next tick",
                owed.kind,
                owed.trial_id,
                self.refusal,
            )

    def recover(self, cur: ConfigSnapshot) -> None:
        """A version with a trial in force and no trial in the runner's memory (the caller checks
        that): the sidecar that ran it is gone; the operator's thresholds go back now, audited with
        the reason."""
        undo = recovery(cur, self.versions.baseline)
        if undo is None or cur.trial is None:
            return
        thresholds, request = undo
        log.warning(
            "autopilot: %s (%s): publishing version %d's thresholds",
            RESTART_REASON,
            cur.trial.trial_id,
            request["to"],
        )
        self.publish(thresholds, None, request, "rollback")
