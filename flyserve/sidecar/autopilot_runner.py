"""The sidecar's autopilot: the pure state machine (flyserve.autopilot.controller) fed and obeyed.

A background thread of its own (periodic.py; never a thread that answers probes or PATCH: a tick
reads the ranks' reports and may publish a version, under the writers' lock) calls ``tick`` every
``interval_s``: it feeds each block the ranks finished to ``controller.on_block``, then hands
``controller.observe`` what the sidecar sees (live regret and priced samples, the advice and its
predicted saving, the flags, the operator's version), and carries out the action each returns
through the ControlPlane, with actor "autopilot":

* StartTrial: the operator's thresholds with the trial attached (ControlPlane.publish_autopilot);
* Promote: the candidate, no trial; Rollback, AwaitApproval: the operator's thresholds, no trial;
* the kill switch: the last version an operator (not the autopilot) published.

How each is published (If-Match, a failed rollback owed and retried): autopilot_publish.py.

Every audit record the state machine returns is appended through Store.audit after the publish
(a promotion's record then names the version it published). The HTTP routes (routes/autopilot.py)
call set_mode, pause, resume, kill and approve, which take the same lock as a tick.

Blocks: a rank adds each timed kernel sample inside a trial's block to that block
(control.trial_blocks) and reports its newest finished blocks. A block is handed on once every
confirmed rank (control.reports.liveness: this host, pid namespace, process and owner checked; an
unconfirmed or forged report never counts) has passed it; its figures are those ranks' sums
(autopilot_blocks.py). A runner whose next block is older than the oldest a full report still
holds has lost blocks: the trial ends inconclusive ("runner lagged"), not by a guardrail.

The lease: every tick while a trial runs (and just before its version is published) the runner
renews control/autopilot-lease.json; if the sidecar dies and stays down, the engine's side ends the
trial ``lease_s`` later (control.trial_lease), long before its plan would end by itself.

The baseline: the newest version published by an operator or by an autopilot promotion; a trial
found in force at start is rolled back, audited (autopilot_baseline.py). What GET /autopilot shows
and the trials metric counts: autopilot_views.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import controller as ap
from flyserve.autopilot.actions import (
    Action,
    AwaitApproval,
    Nothing,
    Promote,
    ProposeTrial,
    Rollback,
    StartTrial,
    TrialSpec,
)
from flyserve.autopilot.inputs import AutopilotConfig, KnobBound, Mode, Observation
from flyserve.autopilot.state import AutopilotState, Outcome
from flyserve.autopilot.trigger import REFUSALS, exploration_estimate
from flyserve.control import ControlIOError, ControlPlane
from flyserve.control.reports import Liveness, liveness
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.trial_lease import DEFAULT_TTL_S as LEASE_TTL_S
from flyserve.control.trial_lease import write_lease
from flyserve.policy.thresholds import Thresholds
from flyserve.sidecar.autopilot_baseline import ACTOR
from flyserve.sidecar.autopilot_blocks import (
    BlockReader,
    ExplorationCost,
    Reports,
    arm_now,
    block_measurements,
    lagged_behind,
)
from flyserve.sidecar.autopilot_publish import CONFLICT, KILL, Publisher
from flyserve.sidecar.autopilot_views import (
    NO_INPUTS,
    DecisionView,
    LiveInputs,
    decision_view,
    finite_or_none,
    outcome_of,
    status_view,
)
from flyserve.sidecar.periodic import PeriodicThread
from flyserve.telemetry import metrics as tm

log = logging.getLogger("flyserve.sidecar")

RESTART_ONLY = frozenset({"decode_path", "block_size"})
MAX_DECISIONS_KEPT = 20
NO_BOUNDS = "no --autopilot-bounds: the autopilot moves no knob"
LEASE_TICKS = 5
"""A trial's lease lasts at least this many ticks (control.trial_lease)."""
LEASE_ERROR_EVERY_S = 60.0
"""A lease that cannot be renewed (disk full, read-only) is logged when it first fails, then at most
once a minute while it keeps failing, and once when it is renewed again: not at every tick."""


class UnknownTrial(LookupError):
    """No promotion awaits approval under that trial id (the route's 404)."""


class AutopilotRunner:
    """The state machine, its thread and what it publishes (module docstring)."""

    def __init__(
        self,
        control: ControlPlane,
        *,
        config: AutopilotConfig,
        mode: Mode = Mode.OFF,
        bounds: Mapping[str, KnobBound] | None = None,
        live_inputs: Callable[[], LiveInputs] = lambda: NO_INPUTS,
        clock: Callable[[], float] = time.time,
        interval_s: float = 1.0,
        stale_after_s: float = 30.0,
        lease_s: float = LEASE_TTL_S,
        on_publish: Callable[[], None] | None = None,
    ) -> None:
        self.control = control
        self.config = config
        self.bounds: Mapping[str, KnobBound] = dict(bounds or {})
        self._live_inputs = live_inputs
        self._clock = clock
        self.interval_s = float(interval_s)
        self.stale_after_s = float(stale_after_s)
        # at least LEASE_TICKS ticks: a lease shorter than a few ticks would expire under a live runner
        self.lease_s = max(float(lease_s), LEASE_TICKS * self.interval_s)
        self._lease_failing_since: float | None = None  # the first failed renewal of a failing run
        self._lease_error_logged = 0.0
        self._lock = threading.RLock()
        self._periodic = PeriodicThread(
            self.tick,
            interval_s=interval_s,
            name="flyserve-autopilot",
            log=log,
            failed="autopilot tick failed",
        )
        self._state = AutopilotState(mode=mode)
        self._started = False  # the first tick looks for a trial left in force
        self._proposal: TrialSpec | None = None
        self.last_refusal: str | None = None if self.bounds else NO_BOUNDS
        self._pub = Publisher(control, on_publish=on_publish, on_refused=self._refused)
        self._versions = self._pub.versions
        self._decisions: deque[DecisionView] = deque(maxlen=MAX_DECISIONS_KEPT)
        self._exploration = ExplorationCost()
        self._expected_share: float | None = None
        self._arm_now = -1
        self._blocks = BlockReader()
        self._set_mode_gauge(mode)
        tm.AUTOPILOT_ARM.set(-1.0)
        for outcome in tm.AUTOPILOT_OUTCOMES:
            tm.AUTOPILOT_TRIALS.labels(outcome)
        tm.AUTOPILOT_EXPLORATION_COST.inc(0.0)

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        """Start the thread (once: two concurrent mode changes start one; periodic.py)."""
        self._periodic.interval_s = self.interval_s
        self._periodic.start()

    def stop(self) -> None:
        self._periodic.stop()

    def _refused(self, text: str) -> None:
        self.last_refusal = text

    @property
    def publish_refusal(self) -> str:
        """The category of the last failed publish (autopilot_publish.PUBLISH_REFUSALS)."""
        return self._pub.refusal

    # ------------------------------------------------------------------ one tick

    @property
    def state(self) -> AutopilotState:
        return self._state

    def tick(self) -> None:
        """Blocks to the test, then one observation, each action carried out (public for tests).
        The advice is asked for before the lock is taken (a fit may take its deadline): GET
        /autopilot and the operator's changes never wait for it."""
        could_start = self._could_start(self._clock())
        if could_start and self._expected_share is None:
            # the trigger's exploration cost, measured once per config (about a second at the
            # defaults, then cached): here, before the lock, never on a request's thread
            est = exploration_estimate(self.config)
            self._expected_share = None if est is None else est.share
        live = self._live_inputs() if could_start else NO_INPUTS
        with self._lock:
            now = self._clock()
            reports = self._confirmed_reports(now)
            cur = self.control.snapshot()
            self._versions.track(cur, self.control.history)
            if not self._started:
                self._started = True
                if self._state.trial is None:
                    self._pub.recover(cur)
            self._pub.settle_owed(cur)
            obs = self._observation(cur, reports, now, live)
            if obs is None or not self._operator_moved(obs):
                # an operator's version that landed since the last tick ends the trial first: no
                # block may end it by publishing over that version
                self._feed_blocks(reports, now)
            if obs is not None:
                self._apply(ap.observe(self.config, self._state, obs), now)
            self._update_arm(reports)
            t = self._state.trial
            if t is not None:
                self._renew_lease(t.spec.trial_id, now)

    def _renew_lease(self, trial_id: str, now: float) -> None:
        """The running trial's lease (control.trial_lease): without it renewed, the engine's side
        ends the trial ``lease_s`` after the last renewal."""
        try:
            write_lease(self.control.state_dir, trial_id, now=now, ttl_s=self.lease_s)
        except OSError as exc:
            first = self._lease_failing_since is None
            if first or now - self._lease_error_logged >= LEASE_ERROR_EVERY_S:
                since = "" if first else f" (failing for {now - (self._lease_failing_since or now):.0f} s)"
                log.error("autopilot: cannot renew the lease on trial %s%s: %s", trial_id, since, exc)
                self._lease_error_logged = now
            if first:
                self._lease_failing_since = now
            return
        if self._lease_failing_since is not None:
            log.warning(
                "autopilot: the lease on trial %s is renewed again after %.0f s of failed renewals",
                trial_id,
                now - self._lease_failing_since,
            )
            self._lease_failing_since = None

    def _operator_moved(self, obs: Observation) -> bool:
        t = self._state.trial
        return t is not None and (
            obs.frozen or obs.change_pending or obs.operator_version != t.spec.operator_version
        )

    def _refresh(self) -> ConfigSnapshot:
        """The operator surfaces: follow the current version (a PATCH since the last tick) and hand
        its baseline to the state machine, so a rollback never returns to older thresholds."""
        cur = self.control.snapshot()
        self._versions.track(cur, self.control.history)
        if self._versions.baseline is not None:
            version, thresholds = self._versions.baseline
            self._state = replace(self._state, operator_version=version, operator_thresholds=thresholds)
        return cur

    def _confirmed_reports(self, now: float) -> Reports:
        try:
            got = self.control.store.read_rank_reports(now=now)
        except (OSError, ControlIOError) as exc:
            log.error("autopilot: cannot read the ranks' reports: %s", exc)
            return []
        return [
            (d, r)
            for d, r in got
            if liveness(r, now=now, stale_after_s=self.stale_after_s) is Liveness.CONFIRMED
        ]

    def _could_start(self, now: float) -> bool:
        """Whether observe could start (or propose) a trial now: only then is the advice asked for."""
        st = self._state  # one reference read: the state is a frozen value
        return (
            st.trial is None
            and st.awaiting is None
            and st.mode is not Mode.OFF
            and not st.paused
            and now >= st.cooldown_until
        )

    def _observation(
        self,
        cur: ConfigSnapshot,
        reports: Reports,
        now: float,
        live: LiveInputs,
    ) -> Observation | None:
        if self._versions.baseline is None:
            return None
        version, thresholds = self._versions.baseline
        pending = (
            not self._versions.is_ours(cur.version)
            and cur.source != ACTOR
            and any(r.applied_version is not None and r.applied_version < cur.version for _, r in reports)
        )
        circuit = cur.circuit_open or any(d.get("circuit_open") is True for d, _ in reports)
        return Observation(
            now=now,
            regret=finite_or_none(live.regret),
            priced_samples=max(0, int(live.priced_samples)),
            advice_changes=dict(live.advice_changes),
            advice_saving=finite_or_none(live.advice_saving),
            operator_version=version,
            operator_thresholds=thresholds,
            knob_bounds=self.bounds,
            restart_only=RESTART_ONLY,
            change_pending=pending,
            circuit_open=circuit,
        )

    # ------------------------------------------------------------------ blocks

    def _feed_blocks(self, reports: Reports, now: float) -> None:
        t = self._state.trial
        if t is None:
            return
        trial_id = t.spec.trial_id
        ranks = self._blocks.trial_blocks(reports, trial_id)
        if lagged_behind(t, ranks):
            log.warning("autopilot: trial %s: %s at block %d", trial_id, ap.RUNNER_LAGGED, t.next_block)
            self._apply(ap.end_runner_lagged(self.config, self._state, now), now)
            return
        circuit = any(d.get("circuit_open") is True for d, _ in reports)
        for m in block_measurements(t, ranks, circuit_open=circuit, now=now):
            self._exploration.add(m, self.config.min_block_samples)
            self._apply(ap.on_block(self.config, self._state, m), now)
            if self._state.trial is None or self._state.trial.spec.trial_id != trial_id:
                break

    def _update_arm(self, reports: Reports) -> None:
        self._arm_now = arm_now(reports, self._state.trial)
        tm.AUTOPILOT_ARM.set(float(self._arm_now))

    # ------------------------------------------------------------------ actions

    def _apply(self, out: Outcome, now: float, *, kill: bool = False) -> Action:
        before = self._state
        running = before.trial.spec.trial_id if before.trial is not None else None
        self._state = out.state
        action = out.action
        result_version: int | None = None
        published = True  # False: a publish this action owed was not made
        request: dict[str, Any]
        if isinstance(action, StartTrial):
            spec = action.spec
            self._proposal = None
            self._exploration.reset()
            request = {
                "autopilot": "start",
                "trial": spec.trial_id,
                "changes": {k: list(v) for k, v in spec.changes.items()},
            }
            self._renew_lease(spec.trial_id, now)  # before the trial is in force: never leaseless
            started = self._pub.publish(
                self._current_arm(spec), spec.trial(), request, "trial", if_match=self._versions.seen_version
            )
            self._pub.trial_version = started
            if started is None:  # the trial never ran: end it now, not at the samples-stopped timeout
                ended = ap.start_not_published(
                    self.config, self._state, spec.trial_id, self.publish_refusal, now
                )
                self._state = ended.state
                out = Outcome(ended.state, action, (*out.records, *ended.records))
        elif isinstance(action, Promote | Rollback | AwaitApproval):
            thresholds = action.thresholds
            if isinstance(action, Promote):
                request = {"autopilot": "promote", "trial": action.trial_id}
                kind = "promote"
            elif isinstance(action, Rollback):
                to = action.to_version
                operator = self._versions.back_to_operator() if kill else None
                if operator is not None:  # the kill switch: the last operator version
                    to, thresholds = operator
                request = {
                    "autopilot": "rollback",
                    "trial": action.trial_id,
                    "reason": action.reason[:200],
                    "to": to,
                }
                kind = "rollback"
            else:
                request = {"autopilot": "await-approval", "trial": action.trial_id, "to": action.to_version}
                kind = "rollback"
            ends_trial = running is not None and action.trial_id == running
            result_version, published = self._pub.end_trial(
                thresholds, request, kind, ends_trial=ends_trial, kill=kill
            )
            conflict = self.publish_refusal == CONFLICT
            if ends_trial and not published and running is not None:
                self._pub.trial_version = None
                if conflict and self._ended_by(out) != rec.BY_OPERATOR:
                    # an operator's version superseded the trial's: it already dropped the trial
                    ended = ap.end_by_operator_change(self.config, before, now)
                    self._state = ended.state
                    out = Outcome(ended.state, action, ended.records)
                elif not conflict:
                    self._pub.owe(running, thresholds, request, kind)
            elif ends_trial:
                self._pub.trial_version = None
            elif kill and not published and self._pub.refusal and not conflict:
                # the kill switch over a promotion, not published (the writers' lock, the disk):
                # owed like a rollback, so the operator's version still comes back within a tick
                self._pub.owe(action.trial_id, thresholds, request, KILL)
        elif isinstance(action, ProposeTrial):
            self._proposal = action.spec
        elif isinstance(action, Nothing):
            code = action.reason.split(":", 1)[0]
            if action.reason in (ap.PAUSED, ap.OFF):
                # why nothing starts now: not the refusal the trigger gave before the pause
                self.last_refusal = action.reason
            elif code in REFUSALS:
                self.last_refusal = action.reason if self.bounds or code != "out of bounds" else NO_BOUNDS
        if self._state.trial is None and running is not None and not isinstance(action, StartTrial):
            self._pub.trial_version = None
        for record in out.records:
            if record.get("kind") == rec.DECISION and record.get("action") in (
                "promote",
                "rollback",
                "await-approval",
            ):
                if record.get("action") == "promote":
                    record = {**record, "result_version": result_version}
                elif not published:  # no version published: the record names none
                    record = {**record, "result_version": None}
            if not self.control.store.audit(record):
                log.error("autopilot: audit record not written: %s", record.get("kind"))
            self._count(record)
        return action

    @staticmethod
    def _ended_by(out: Outcome) -> str | None:
        return next((str(r.get("source")) for r in out.records if r.get("kind") == rec.DECISION), None)

    def _count(self, record: Mapping[str, Any]) -> None:
        outcome = outcome_of(record)
        if outcome is not None:
            tm.AUTOPILOT_TRIALS.labels(outcome).inc()
        if record.get("kind") == rec.DECISION:
            self._decisions.append(decision_view(record))

    @staticmethod
    def _current_arm(spec: TrialSpec) -> Thresholds:
        """The operator's thresholds the trial runs over: the candidate with its changes undone."""
        return spec.candidate.merged({k: a for k, (a, _) in spec.changes.items()})

    # ------------------------------------------------------------------ operator surfaces

    def _set_mode_gauge(self, mode: Mode) -> None:
        for m in tm.AUTOPILOT_MODES:
            tm.AUTOPILOT_MODE.labels(m).set(1.0 if m == mode.value else 0.0)

    def set_mode(self, mode: Mode) -> None:
        with self._lock:
            now = self._clock()
            self._refresh()
            self._apply(ap.set_mode(self.config, self._state, mode, now), now)
            if mode in (Mode.OFF, Mode.ADVISE):
                self._proposal = None if mode is Mode.OFF else self._proposal
            self._set_mode_gauge(mode)

    def pause(self) -> None:
        with self._lock:
            now = self._clock()
            self._refresh()
            self._apply(ap.pause(self.config, self._state, now), now)

    def resume(self) -> None:
        with self._lock:
            now = self._clock()
            self._refresh()
            self._apply(ap.resume(self.config, self._state, now), now)

    def kill(self) -> None:
        with self._lock:
            now = self._clock()
            self._refresh()
            self._apply(ap.kill(self.config, self._state, now), now, kill=True)
            self._proposal = None
            self._set_mode_gauge(Mode.OFF)

    def approve(self, trial_id: str, actor: str) -> None:
        """Publish the promotion awaiting under ``trial_id``; UnknownTrial when none does."""
        with self._lock:
            a = self._state.awaiting
            if a is None or a.spec.trial_id != trial_id:
                raise UnknownTrial(trial_id)
            now = self._clock()
            self._refresh()
            if self._state.operator_version != a.spec.operator_version:
                # the operator's version moved: the candidate was built on the old one
                self._apply(ap.drop_stale_approval(self._state, now), now)
                raise UnknownTrial(trial_id)
            self._apply(ap.approve(self.config, self._state, trial_id, now, actor), now)

    # ------------------------------------------------------------------ GET /autopilot

    def status(self) -> dict[str, Any]:
        with self._lock:
            owed = self._pub.owed
            return status_view(
                self._state,
                clock=self._clock,
                arm_now=self._arm_now,
                proposal=self._proposal,
                last_refusal=self.last_refusal,
                owed=None
                if owed is None
                else {"trial": owed.trial_id, "kind": owed.kind, "reason": owed.why},
                decisions=self._decisions,
                exploration_bound={
                    "expected_share": self._expected_share,
                    "limit": self.config.max_exploration_share,
                },
            )
