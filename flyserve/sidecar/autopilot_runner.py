"""The sidecar's autopilot: the pure state machine (flyserve.autopilot.controller) fed and obeyed.

A background thread of its own (never a thread that answers probes or PATCH: a tick reads the
ranks' reports and may publish a version, under the writers' lock) calls ``tick`` every
``interval_s``: it feeds each block the ranks finished to ``controller.on_block``, then hands
``controller.observe`` what the sidecar sees (live regret and priced samples, the advice and its
predicted saving, the flags, the operator's version), and carries out the action each returns
through the ControlPlane, with actor "autopilot":

* StartTrial: the operator's thresholds with the trial attached (ControlPlane.publish_autopilot);
* Promote: the candidate, no trial; Rollback, AwaitApproval: the operator's thresholds, no trial;
* the kill switch: the last version an operator (not the autopilot) published.

Every audit record the state machine returns is appended through Store.audit after the publish
(a promotion's record then names the version it published). The HTTP routes (routes/autopilot.py)
call set_mode, pause, resume, kill and approve, which take the same lock as a tick.

Blocks: a rank adds each timed kernel sample inside a trial's block to that block
(control.trial_blocks) and reports its newest finished blocks. A block is handed on once every
confirmed rank (control.reports.liveness: this host, pid namespace, process and owner checked; an
unconfirmed or forged report never counts) has passed it; its figures are those ranks' sums.

The baseline: the newest version published by an operator or by an autopilot promotion. A sidecar
that starts and finds a version with a trial in force (a crash mid-trial: its plan would end by
itself) publishes the operator's thresholds again at once and audits why.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
from flyserve.autopilot.inputs import AutopilotConfig, BlockMeasurement, KnobBound, Mode, Observation
from flyserve.autopilot.state import AutopilotState, Outcome
from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.autopilot.trigger import REFUSALS
from flyserve.control import ControlIOError, ControlPlane, VersionConflict
from flyserve.control.reports import Liveness, RankReport, liveness
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.trial_blocks import (
    MAX_REPORTED_BLOCKS,
    TrialBlocks,
    TrialBlocksError,
    parse_trial_blocks,
)
from flyserve.policy.thresholds import Thresholds, ThresholdsError
from flyserve.telemetry import metrics as tm

log = logging.getLogger("flyserve.sidecar")

ACTOR = "autopilot"
RESTART_ONLY = frozenset({"decode_path", "block_size"})
MAX_DECISIONS_KEPT = 20
RESTART_REASON = "sidecar restarted with a trial in force and no running trial in memory"
NO_BOUNDS = "no --autopilot-bounds: the autopilot moves no knob"
PUBLISH_REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (VersionConflict, "version conflict"),
    (ThresholdsError, "candidate refused"),
    (ControlIOError, "state directory error"),
)
"""Why a publish failed, as the audit says it: a category, never the error's text (a path)."""


class UnknownTrial(LookupError):
    """No promotion awaits approval under that trial id (the route's 404)."""


@dataclass(frozen=True, slots=True)
class LiveInputs:
    """What the sidecar's pricing and advice say now (the runner asks only when a trial could start).
    ``advice_changes``: {knob: proposed value}; ``advice_saving``: its predicted share of the window's
    routed attention time saved."""

    regret: float | None
    priced_samples: int
    advice_changes: Mapping[str, Any]
    advice_saving: float | None


NO_INPUTS = LiveInputs(None, 0, {}, None)


@dataclass(frozen=True, slots=True)
class DecisionView:
    """One ended trial, as GET /autopilot lists it."""

    trial_id: str
    decision: str
    reason: str
    pairs: int
    effect: float | None
    at: float
    result_version: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial_id": self.trial_id,
            "decision": self.decision,
            "reason": self.reason,
            "pairs": self.pairs,
            "effect": self.effect,
            "at": self.at,
            "result_version": self.result_version,
        }


def outcome_of(record: Mapping[str, Any]) -> str | None:
    """The flyserve_autopilot_trials_total outcome a decision or approval record stands for (None:
    no trial ended yet, e.g. a promotion that now awaits approval)."""
    kind = record.get("kind")
    if kind == rec.APPROVAL:
        return "promoted" if record.get("action") == "promote" else "expired"
    if kind != rec.DECISION:
        return None
    verdict, source = record.get("verdict"), record.get("source")
    if verdict == "promote":
        return "promoted" if record.get("action") == "promote" else None
    if verdict == "inconclusive":
        return "inconclusive"
    if source == rec.BY_OPERATOR:
        return "killed" if record.get("reason") == ap.KILLED else "aborted"
    if source == rec.BY_PUBLISH:
        return "refused"
    return "rolled_back"


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


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
        on_publish: Callable[[], None] | None = None,
    ) -> None:
        self.control = control
        self.config = config
        self.bounds: Mapping[str, KnobBound] = dict(bounds or {})
        self._live_inputs = live_inputs
        self._clock = clock
        self.interval_s = float(interval_s)
        self.stale_after_s = float(stale_after_s)
        self._on_publish = on_publish
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = AutopilotState(mode=mode)
        self._started = False  # the first tick looks for a trial left in force
        self._seen_version = -1
        self._baseline: tuple[int, Thresholds] | None = None
        self._operator: tuple[int, Thresholds] | None = None
        self._published: dict[int, str] = {}  # versions this runner published -> what for
        self._proposal: TrialSpec | None = None
        self.last_refusal: str | None = None if self.bounds else NO_BOUNDS
        self.publish_refusal = ""  # the category of the last failed publish (PUBLISH_REFUSALS)
        self._decisions: deque[DecisionView] = deque(maxlen=MAX_DECISIONS_KEPT)
        self._pair_first: tuple[int, float, int] | None = None  # (block, per token, tokens) of a pair's first
        self._arm_now = -1
        self._refused_reports: dict[tuple[int, int], str] = {}
        self._set_mode_gauge(mode)
        tm.AUTOPILOT_ARM.set(-1.0)
        for outcome in tm.AUTOPILOT_OUTCOMES:
            tm.AUTOPILOT_TRIALS.labels(outcome)
        tm.AUTOPILOT_EXPLORATION_COST.inc(0.0)

    # ------------------------------------------------------------------ thread

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="flyserve-autopilot", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("autopilot tick failed")
            self._stop.wait(self.interval_s)

    # ------------------------------------------------------------------ one tick

    @property
    def state(self) -> AutopilotState:
        return self._state

    def tick(self) -> None:
        """Blocks to the test, then one observation, each action carried out (public for tests).
        The advice is asked for before the lock is taken (a fit may take its deadline): GET
        /autopilot and the operator's changes never wait for it."""
        live = self._live_inputs() if self._could_start(self._clock()) else NO_INPUTS
        with self._lock:
            now = self._clock()
            reports = self._confirmed_reports(now)
            cur = self.control.snapshot()
            self._track(cur)
            if not self._started:
                self._started = True
                self._recover(cur)
            self._feed_blocks(reports, now)
            obs = self._observation(cur, reports, now, live)
            if obs is not None:
                self._apply(ap.observe(self.config, self._state, obs), now)
            self._update_arm(reports)

    def _confirmed_reports(self, now: float) -> list[tuple[dict[str, Any], RankReport]]:
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

    def _track(self, cur: ConfigSnapshot) -> None:
        """The baseline (an operator's or a promotion's version) and the operator's own version,
        from each new current version (at start, from history)."""
        if cur.version == self._seen_version:
            return
        first = self._seen_version < 0
        self._seen_version = cur.version
        if first:
            newest = [cur, *reversed(self.control.history())]
            self._operator = next(((s.version, s.thresholds) for s in newest if s.source != ACTOR), None)
            self._baseline = next(((s.version, s.thresholds) for s in newest if s.trial is None), None)
            if self._operator is None:
                self._operator = (cur.version, cur.thresholds)
            if self._baseline is None:
                self._baseline = self._operator
            return
        kind = self._published.get(cur.version)
        if kind == "promote":
            self._baseline = (cur.version, cur.thresholds)
        elif kind is None and cur.source != ACTOR:
            self._operator = self._baseline = (cur.version, cur.thresholds)

    def _recover(self, cur: ConfigSnapshot) -> None:
        """A version with a trial in force and no trial in this runner's memory: the sidecar that
        ran it is gone; the operator's thresholds go back now, audited with the reason."""
        if cur.trial is None or self._state.trial is not None or self._baseline is None:
            return
        version, thresholds = self._baseline
        request = {
            "autopilot": "rollback",
            "trial": cur.trial.trial_id,
            "reason": RESTART_REASON,
            "to": version,
        }
        log.warning(
            "autopilot: %s (%s): publishing version %d's thresholds",
            RESTART_REASON,
            cur.trial.trial_id,
            version,
        )
        self._publish(thresholds, None, request, "rollback")

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
        reports: list[tuple[dict[str, Any], RankReport]],
        now: float,
        live: LiveInputs,
    ) -> Observation | None:
        if self._baseline is None:
            return None
        version, thresholds = self._baseline
        pending = (
            cur.version not in self._published
            and cur.source != ACTOR
            and any(r.applied_version is not None and r.applied_version < cur.version for _, r in reports)
        )
        circuit = cur.circuit_open or any(d.get("circuit_open") is True for d, _ in reports)
        return Observation(
            now=now,
            regret=_finite_or_none(live.regret),
            priced_samples=max(0, int(live.priced_samples)),
            advice_changes=dict(live.advice_changes),
            advice_saving=_finite_or_none(live.advice_saving),
            operator_version=version,
            operator_thresholds=thresholds,
            knob_bounds=self.bounds,
            restart_only=RESTART_ONLY,
            change_pending=pending,
            circuit_open=circuit,
        )

    # ------------------------------------------------------------------ blocks

    def _trial_blocks(
        self, reports: list[tuple[dict[str, Any], RankReport]], trial_id: str
    ) -> list[TrialBlocks]:
        out = []
        for d, r in reports:
            try:
                got = parse_trial_blocks(d.get("trial_blocks"))
            except TrialBlocksError as exc:
                if self._refused_reports.get(r.key) != exc.field:
                    log.warning("autopilot: rank %d-%d report refused: %s", r.engine, r.rank, exc)
                self._refused_reports[r.key] = exc.field
                continue
            self._refused_reports.pop(r.key, None)
            if got is not None and got.trial_id == trial_id:
                out.append(got)
        return out

    def _feed_blocks(self, reports: list[tuple[dict[str, Any], RankReport]], now: float) -> None:
        t = self._state.trial
        if t is None:
            return
        spec = t.spec
        ranks = self._trial_blocks(reports, spec.trial_id)
        if not ranks:
            return
        last = min(
            min(tb.through for tb in ranks), spec.blocks - 1, t.next_block + 2 * MAX_REPORTED_BLOCKS - 1
        )
        plan = SwitchbackPlan(spec.trial_id, spec.seed, 0, spec.block_steps, spec.blocks)
        circuit = any(d.get("circuit_open") is True for d, _ in reports)
        for b in range(t.next_block, last + 1):
            arm = plan.arm_of_block(b)
            # another arm for this block: not the plan's
            figures = [f for tb in ranks for f in tb.blocks if f.block == b and f.arm == arm]
            step_times = [f.step_seconds for f in figures if f.step_seconds is not None]
            m = BlockMeasurement(
                trial_id=spec.trial_id,
                block=b,
                arm=arm,
                kernel_seconds=min(math.fsum(f.kernel_seconds for f in figures), 1e9),
                tokens=sum(f.tokens for f in figures),
                corroborated_samples=sum(f.samples for f in figures),
                steps=spec.block_steps,
                # per engine step, so the slowest rank's (the ranks of an engine step together) and
                # the most any one rank counted (every rank of an engine routes the same batch)
                step_s=max(step_times, default=None),
                fallbacks=max((f.fallbacks for f in figures), default=0),
                errors=max((f.errors for f in figures), default=0),
                circuit_open=circuit,
                now=now,
            )
            self._exploration(m)
            self._apply(ap.on_block(self.config, self._state, m), now)
            if self._state.trial is None or self._state.trial.spec.trial_id != spec.trial_id:
                break

    def _exploration(self, m: BlockMeasurement) -> None:
        """flyserve_autopilot_exploration_cost_seconds_total: per pair, the slower block's tokens
        times its excess seconds per token over the faster block's."""
        usable = m.corroborated_samples >= self.config.min_block_samples and m.per_token is not None
        if m.block % 2 == 0:
            self._pair_first = (
                (m.block, m.per_token, m.tokens) if usable and m.per_token is not None else None
            )
            return
        first, self._pair_first = self._pair_first, None
        if first is None or first[0] != m.block - 1 or not usable or m.per_token is None:
            return
        (_, pt_a, tok_a), pt_b, tok_b = first, m.per_token, m.tokens
        slow_pt, fast_pt, slow_tokens = (pt_a, pt_b, tok_a) if pt_a > pt_b else (pt_b, pt_a, tok_b)
        tm.AUTOPILOT_EXPLORATION_COST.inc((slow_pt - fast_pt) * slow_tokens)

    def _update_arm(self, reports: list[tuple[dict[str, Any], RankReport]]) -> None:
        t = self._state.trial
        arm = -1
        if t is not None:
            for d, _ in reports:
                now_in = d.get("trial")
                if (
                    isinstance(now_in, dict)
                    and now_in.get("id") == t.spec.trial_id
                    and now_in.get("arm") in (0, 1)
                ):
                    arm = int(now_in["arm"])
                    break
        self._arm_now = arm
        tm.AUTOPILOT_ARM.set(float(arm))

    # ------------------------------------------------------------------ actions

    def _publish(
        self,
        thresholds: Thresholds,
        trial: Any,
        request: Mapping[str, Any],
        kind: str,
        *,
        if_match: int | None = None,
    ) -> int | None:
        """Publish through the control plane; the new version, or None (logged, kept as last_refusal,
        its category in ``publish_refusal``)."""
        try:
            res = self.control.publish_autopilot(thresholds, trial=trial, request=request, if_match=if_match)
        except (ThresholdsError, ControlIOError, VersionConflict) as exc:
            self.last_refusal = f"publish refused: {exc}"[:300]
            self.publish_refusal = next(why for cls, why in PUBLISH_REFUSALS if isinstance(exc, cls))
            log.error("autopilot: %s publish refused: %s", kind, exc)
            return None
        version = res.snapshot.version
        self._published[version] = kind
        if len(self._published) > 256:
            self._published.pop(next(iter(self._published)))
        self._seen_version = max(self._seen_version, version) if res.changed else self._seen_version
        if kind == "promote":
            self._baseline = (version, res.snapshot.thresholds)
        if self._on_publish is not None:
            self._on_publish()
        return version

    def _apply(self, out: Outcome, now: float, *, kill: bool = False) -> Action:
        self._state = out.state
        action = out.action
        result_version: int | None = None
        request: dict[str, Any]
        if isinstance(action, StartTrial):
            spec = action.spec
            self._proposal = None
            self._pair_first = None
            request = {
                "autopilot": "start",
                "trial": spec.trial_id,
                "changes": {k: list(v) for k, v in spec.changes.items()},
            }
            started = self._publish(
                self._current_arm(spec), spec.trial(), request, "trial", if_match=self._seen_version
            )
            if started is None:  # the trial never ran: end it now, not at the samples-stopped timeout
                ended = ap.start_not_published(
                    self.config, self._state, spec.trial_id, self.publish_refusal, now
                )
                self._state = ended.state
                out = Outcome(ended.state, action, (*out.records, *ended.records))
        elif isinstance(action, Promote):
            request = {"autopilot": "promote", "trial": action.trial_id}
            result_version = self._publish(action.thresholds, None, request, "promote")
        elif isinstance(action, Rollback):
            thresholds, to = action.thresholds, action.to_version
            if kill and self._operator is not None:  # the kill switch: the last operator version
                to, thresholds = self._operator
                self._baseline = self._operator  # whatever the autopilot promoted since is gone
            request = {
                "autopilot": "rollback",
                "trial": action.trial_id,
                "reason": action.reason[:200],
                "to": to,
            }
            self._publish(thresholds, None, request, "rollback")
        elif isinstance(action, AwaitApproval):
            request = {"autopilot": "await-approval", "trial": action.trial_id, "to": action.to_version}
            self._publish(action.thresholds, None, request, "rollback")
        elif isinstance(action, ProposeTrial):
            self._proposal = action.spec
        elif isinstance(action, Nothing):
            code = action.reason.split(":", 1)[0]
            if code in REFUSALS:
                self.last_refusal = action.reason if self.bounds or code != "out of bounds" else NO_BOUNDS
        for record in out.records:
            if (
                record.get("kind") == rec.DECISION
                and record.get("action") == "promote"
                and result_version is not None
            ):
                record = {**record, "result_version": result_version}
            if not self.control.store.audit(record):
                log.error("autopilot: audit record not written: %s", record.get("kind"))
            self._count(record)
        return action

    def _count(self, record: Mapping[str, Any]) -> None:
        outcome = outcome_of(record)
        if outcome is not None:
            tm.AUTOPILOT_TRIALS.labels(outcome).inc()
        if record.get("kind") == rec.DECISION:
            stat = record.get("statistic") or {}
            self._decisions.append(
                DecisionView(
                    trial_id=str(record.get("trial")),
                    decision=str(record.get("verdict")),
                    reason=str(record.get("reason")),
                    pairs=int(stat.get("pairs") or 0),
                    effect=stat.get("estimate"),
                    at=float(record.get("time") or 0.0),
                    result_version=record.get("result_version"),
                )
            )

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
            self._apply(ap.set_mode(self.config, self._state, mode, now), now)
            if mode in (Mode.OFF, Mode.ADVISE):
                self._proposal = None if mode is Mode.OFF else self._proposal
            self._set_mode_gauge(mode)

    def pause(self) -> None:
        with self._lock:
            now = self._clock()
            self._apply(ap.pause(self.config, self._state, now), now)

    def resume(self) -> None:
        with self._lock:
            now = self._clock()
            self._apply(ap.resume(self.config, self._state, now), now)

    def kill(self) -> None:
        with self._lock:
            now = self._clock()
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
            self._apply(ap.approve(self.config, self._state, trial_id, now, actor), now)

    # ------------------------------------------------------------------ GET /autopilot

    def status(self) -> dict[str, Any]:
        with self._lock:
            st = self._state
            if st.mode is Mode.OFF:
                state = "off"
            elif st.trial is not None:
                state = "running"
            elif st.awaiting is not None:
                state = "awaiting_approval"
            elif self._clock() < st.cooldown_until:
                state = "cooldown"
            else:
                state = "idle"
            return {
                "mode": st.mode.value,
                "paused": st.paused,
                "state": state,
                "trial": self._trial_view(),
                "proposal": None if self._proposal is None else _spec_view(self._proposal),
                "last_refusal": self.last_refusal,
                "last_decisions": [d.to_dict() for d in reversed(self._decisions)],
            }

    def _trial_view(self) -> dict[str, Any] | None:
        st = self._state
        t = st.trial
        if t is not None:
            d = t.decision
            return {
                **_spec_view(t.spec),
                "blocks_seen": t.next_block,
                "pairs": t.pairs,
                "arm_now": self._arm_now,
                "estimate": None if d is None else _finite_or_none(d.estimate),
                "interval": None if d is None else [_finite_or_none(d.lower), _finite_or_none(d.upper)],
                "verdict": "continue" if d is None else d.verdict.value,
                "reason": "" if d is None else d.reason,
            }
        if st.awaiting is not None:
            return {
                **_spec_view(st.awaiting.spec),
                "blocks_seen": None,
                "pairs": None,
                "arm_now": -1,
                "estimate": None,
                "interval": None,
                "verdict": "promote",
                "reason": "awaiting approval",
            }
        return None


def _spec_view(spec: TrialSpec) -> dict[str, Any]:
    return {
        "id": spec.trial_id,
        "changed": {k: [a, b] for k, (a, b) in spec.changes.items()},
        "block_steps": spec.block_steps,
        "blocks": spec.blocks,
        "operator_version": spec.operator_version,
    }
