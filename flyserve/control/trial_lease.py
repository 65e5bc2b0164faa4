"""The autopilot's lease on a running trial: a sidecar that dies mid-trial has its trial ended
within seconds by the engine's side, not at the end of the trial's plan.

Why: a trial travels inside a published version and the ranks run its plan by themselves, to its
last block (96,000 steps at the default budget), whether or not the sidecar that started it is still
there. A sidecar that restarts ends the trial at its first tick (sidecar/autopilot_baseline.py); one
that stays down (a crash loop, a deleted pod) would leave the engine alternating between the two
arms for the rest of the plan.

How: while a trial it runs is in force, the sidecar's runner renews ``control/autopilot-lease.json``
every tick: ``{"trial": id, "renewed": wall time, "ttl_s": seconds}``. The processes that already
watch the state directory for the engine (the engine channel's pusher in vLLM's API server; with
file polling, the control thread of engine 0's rank 0) look once a second through a LeaseKeeper:
when the version in force carries a trial and its lease is missing, names another trial, was not
renewed for ``ttl_s`` or is dated more than an hour ahead of now, they publish that version again
without the trial (ControlPlane.end_trial: only if it is still the version in force under the
writers' lock, so a change published meanwhile wins and the second of two keepers does nothing),
audited with actor ``autopilot-lease`` and the reason. Every rank then leaves the trial at one step,
as with any version. A missing lease counts from the version's publish time, so a trial is never
ended in the moment between the sidecar publishing it and renewing its lease.

The lease file is read like every file someone else wrote (flyserve.files.safe_read): a FIFO, a
symlink, a huge or half-written file, NaN or a 5000-digit number is no lease, never a hang or a
crash. A forged lease can only keep a trial running to the end of its own plan, as without leases.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from flyserve.autopilot.switchback import SwitchbackPlanError, check_trial_id
from flyserve.control.errors import ControlIOError
from flyserve.control.paths import StateDir
from flyserve.control.plane import ControlPlane
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.files.atomic import atomic_write
from flyserve.files.safe_read import SafeReadError, read_json
from flyserve.policy.thresholds import ThresholdsError

log = logging.getLogger("flyserve.control")

ACTOR = "autopilot-lease"
"""The audit's actor of a version that ended a trial whose lease expired."""
DEFAULT_TTL_S = 10.0
"""A lease not renewed for this long has expired. The runner renews it every tick (1 s by default,
0.5 s in the demo) from a thread of its own: ten missed ticks is a sidecar that is gone or wedged,
not a slow one."""
MIN_TTL_S = 1.0
MAX_TTL_S = 3600.0
MAX_LEASE_BYTES = 4096
MAX_AHEAD_S = MAX_TTL_S
"""A lease dated further ahead of the reader's clock than this is forged or from a clock gone wrong:
no lease. Within it a lease dated ahead counts as fresh (the sidecar's clock may run ahead of the
reader's, and tests drive the runner on a clock of their own)."""


class LeaseError(ValueError):
    """A lease file that is not a lease; ``field`` names what is wrong, never its value."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True, slots=True)
class Lease:
    """The sidecar's claim that it still runs ``trial``: renewed at ``renewed`` (wall clock), good
    for ``ttl_s`` seconds."""

    trial: str
    renewed: float
    ttl_s: float

    def __post_init__(self) -> None:
        try:
            check_trial_id(self.trial)
        except SwitchbackPlanError as exc:
            raise LeaseError("trial", exc.reason) from None
        for name, value, lo, hi in (
            ("renewed", self.renewed, 0.0, 1e12),
            ("ttl_s", self.ttl_s, MIN_TTL_S, MAX_TTL_S),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise LeaseError(name, f"must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and lo <= value <= hi):
                raise LeaseError(name, f"must be a finite number from {lo:g} to {hi:g}")

    def to_json(self) -> str:
        return json.dumps({"trial": self.trial, "renewed": self.renewed, "ttl_s": self.ttl_s})


def write_lease(state_dir: StateDir, trial_id: str, *, now: float, ttl_s: float = DEFAULT_TTL_S) -> None:
    """Renew the lease on ``trial_id`` (atomic; not fsynced: worth nothing after a power cut, and
    rewritten every tick). Raises OSError when the state directory cannot be written."""
    lease = Lease(trial_id, float(now), float(ttl_s))
    atomic_write(state_dir.trial_lease, lease.to_json(), durable=False)


def read_lease(state_dir: StateDir) -> Lease | None:
    """The lease on file, or None when there is none or it is not one (logged, never raised)."""
    try:
        doc = read_json(state_dir.trial_lease, MAX_LEASE_BYTES, source="control/autopilot-lease.json")
    except SafeReadError as exc:
        log.warning("autopilot lease refused: %s", exc)
        return None
    if doc is None:
        return None
    try:
        if not isinstance(doc, dict) or set(doc) != {"trial", "renewed", "ttl_s"}:
            raise LeaseError("<document>", "must be an object with exactly trial, renewed and ttl_s")
        return Lease(doc["trial"], doc["renewed"], doc["ttl_s"])
    except LeaseError as exc:
        log.warning("autopilot lease refused: control/autopilot-lease.json: %s", exc)
        return None


def expiry(cur: ConfigSnapshot, lease: Lease | None, *, now: float) -> str | None:
    """Why the trial in force has lost its lease, or None while it holds one (or none runs). Pure."""
    if cur.trial is None:
        return None
    trial = cur.trial.trial_id
    if lease is None or lease.trial != trial:
        held = "no lease" if lease is None else "the lease names another trial"
        if now - cur.time > DEFAULT_TTL_S:
            return f"{held} on trial {trial} for {now - cur.time:.0f} s since its version was published"
        return None
    if now - lease.renewed > lease.ttl_s:
        return f"the lease on trial {trial} was not renewed for {now - lease.renewed:.0f} s (ttl {lease.ttl_s:g} s)"
    if lease.renewed - now > MAX_AHEAD_S:
        return f"the lease on trial {trial} is dated {lease.renewed - now:.0f} s ahead of this clock"
    return None


def end_expired_trial(control: ControlPlane, *, now: float | None = None) -> int | None:
    """If the trial in force has lost its lease, publish its version without it; the new version's
    number, or None (nothing to end, someone else published first, or the store refused: logged)."""
    try:
        return _end_expired_trial(control, now)
    except _CannotEnd:
        return None


class _CannotEnd(Exception):
    """The store refused to read or publish (logged where raised)."""


def _end_expired_trial(control: ControlPlane, now: float | None) -> int | None:
    now = time.time() if now is None else now
    try:
        cur = control.store.read_current()
    except ControlIOError as exc:
        log.error("autopilot lease: cannot read the version in force: %s", exc)
        raise _CannotEnd from None
    if cur is None or cur.trial is None:
        return None
    why = expiry(cur, read_lease(control.state_dir), now=now)
    if why is None:
        return None
    request = {"autopilot": "rollback", "trial": cur.trial.trial_id, "reason": f"lease expired: {why}"[:200]}
    try:
        got = control.end_trial(actor=ACTOR, request=request, if_match=cur.version)
    except (ControlIOError, ThresholdsError, OSError) as exc:
        log.error("autopilot lease: cannot end trial %s: %s", cur.trial.trial_id, exc)
        raise _CannotEnd from None
    if got is None:
        return None  # a version published meanwhile has replaced the trial already
    log.warning("autopilot lease: %s: version %d ends the trial", why, got.snapshot.version)
    return got.snapshot.version


KEEPER_LOCK_TIMEOUT_S = 0.5
"""How long a keeper waits for the writers' lock. It runs on a rank's control thread (which must
pick up the next version before its effective step) or in the engine channel's pusher (which must
push it): neither may stall for the 10 s a CLI writer waits. A busy lock is tried again later."""
KEEPER_RETRY_S = 10.0
"""After a failed look (the lock busy, the state directory unwritable), the keeper tries again this
much later: a writer wedged under the lock costs the keeper's thread 0.5 s per 10 s, not every poll,
and leaves at most one abandoned lock waiter per 10 s (control.writers_lock)."""


class LeaseKeeper:
    """end_expired_trial for a process that watches the state directory for the engine (a rank's
    control thread, the engine channel's pusher): a short wait for the writers' lock, a pause after
    a failure, and never an exception: the lease is a safety net, a fault in it never costs the
    thread its real work."""

    def __init__(self, state_dir: StateDir, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.control = ControlPlane(state_dir, lock_timeout_s=KEEPER_LOCK_TIMEOUT_S)
        self._clock = clock
        self._retry_at = -math.inf

    def check(self, *, now: float | None = None) -> int | None:
        """One look: the version that ended an expired trial, or None."""
        if self._clock() < self._retry_at:
            return None
        try:
            return _end_expired_trial(self.control, now)
        except _CannotEnd:
            pass
        except Exception:
            log.exception("autopilot lease: the check failed")
        self._retry_at = self._clock() + KEEPER_RETRY_S
        return None
