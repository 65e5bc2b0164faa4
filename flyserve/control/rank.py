"""RankControl: the rank side. The hot path is current(step): one int compare, no I/O, no allocation.

A daemon thread (about once a second; flyserve.control.rank_daemon) writes ranks/<rank>.json and
looks at control/current.json; when a new version appears it is queued with its effective_step, and
current() switches when the step reaches it. Every rank gets the same effective_step from the publisher, so all switch together;
a rank that learns of a version late switches at its next step and reports applied_step.

A version that carries a switchback trial runs the current thresholds and the candidate in blocks
(flyserve.autopilot.switchback): the next block boundary is folded into the same pending step, so
a trial's step costs the same one compare, and the arm of a step is a function of the plan and the
step alone, the same on every rank of the engine. After the last block the rank is back on the
current thresholds by itself, whether or not anything is published again.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

from flyserve.autopilot.switchback import CANDIDATE_ARM, CURRENT_ARM, SwitchbackPlan
from flyserve.control._metrics import count_late_applies
from flyserve.control.paths import StateDir, default_state_dir
from flyserve.control.rank_daemon import RATE_PEAK_REPORTS, RankFilePolling
from flyserve.control.rank_modes import ENGINE_CHANNEL, FILE_POLLING, FILE_POLLING_UNORDERED
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.store import Store
from flyserve.control.trial_blocks import BlockEnd, TrialBlockMeter
from flyserve.control.version_trust import believed
from flyserve.thresholds_files import load_profile

_NEVER = sys.maxsize


BlockCounters = Callable[[], tuple[int, int]]
"""The rank's running (fallbacks, kernel errors) totals; read at block boundaries only."""


def _no_counters() -> tuple[int, int]:
    return (0, 0)


class _BlockStart(NamedTuple):
    """Where the running trial block began: its plan and index, the monotonic time, the step and
    the (fallbacks, errors) totals then."""

    plan: SwitchbackPlan
    block: int
    time: float | None
    step: int
    fallbacks: int
    errors: int


class RankControl(RankFilePolling):
    """One per rank process (vLLM creates one routing object per attention group: share this one)."""

    def __init__(
        self,
        state_dir: StateDir | str | os.PathLike[str] | None = None,
        rank: int = 0,
        *,
        engine: int = 0,
        profile: str = "gfx950",
        interval_s: float = 1.0,
        report: bool = True,
        block_clock: Callable[[], float] | None = time.monotonic,
    ) -> None:
        self.state_dir = StateDir(state_dir if state_dir is not None else default_state_dir())
        self.store = Store(self.state_dir, check_profile=False)
        self.rank, self.engine = int(rank), int(engine)
        self.interval_s = float(interval_s)
        self.report = report
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step = 0
        self._pending: list[ConfigSnapshot] = []  # ascending version; touched under _lock only
        self._pending_step = _NEVER
        self._seen_stat: tuple[int, int, int] | None = None
        self._refused_stat: tuple[int, int, int] | None = None  # the last current.json refused (logged once)
        self.started = time.time()
        # Until the rank has measured a rate (MIN_RATE_STEPS steps over MIN_RATE_WINDOW_S), its
        # report says steps_per_s null and the publisher assumes a high rate: a change published in
        # a rank's first second would otherwise get the 8-step floor and be applied late.
        self._last_rate_sample: tuple[float, int] = (self.started, 0)
        self._recent_rates: deque[float] = deque(maxlen=RATE_PEAK_REPORTS)
        self.late_applies = 0  # versions this rank learned of after their effective step
        count_late_applies(
            self.rank, 0
        )  # the series exists from the start: panels and alerts read 0, not no data
        self.applied: list[tuple[int, int, int]] = []  # (version, effective_step, applied_step), bounded
        self.mode = FILE_POLLING  # becomes ENGINE_CHANNEL at the first apply_pushed(); never goes back
        # The prefill kernel as found at start (kernel, revision, off_reason), set by the vLLM
        # composite once; reported so /dispatch-stats shows which FlyDSL runs, or why none does.
        self.prefill_kernel: dict[str, Any] | None = None
        self._known_version = 0  # nothing applied yet: the first read is judged by the live peers
        # What the live ranks it joins applied (control.version_trust.live_anchor), read once:
        # until this rank applies a version of its own, it believes only what they believe. A
        # forged chain of history names stepping by at most MAX_VERSION_STEP looks credible by its
        # names alone; a rank that took it at start reported it applied, became the plane's anchor
        # and made the running ranks refuse every later change. None: no live peer report, the chain
        # of history names decides.
        self._start_anchor = self._peer_anchor()
        snap = self._read_current_quiet()
        if snap is None and self.state_dir.current_json.exists():
            # Damaged or forged: start where the control plane stands (ControlPlane.snapshot), not
            # on the profile beside ranks that run the newest believed version.
            snap = self._newest_history_quiet()
        if snap is None:
            snap = ConfigSnapshot.build(
                version=0,
                thresholds=load_profile(profile),
                source="default",
                actor="",
                time=0.0,
                effective_step=0,
                profile=profile,
            )
        self._snapshot = snap
        self._effective = snap.step_for(self.engine)
        self.applied_step = 0
        self._known_version = snap.version
        self.applied.append((snap.version, snap.effective_step, 0))
        # What current() returns: the applied version, or during a trial's block the arm's snapshot
        self._active = snap
        self._plan: SwitchbackPlan | None = None
        self._arms: tuple[ConfigSnapshot, ConfigSnapshot] = (snap, snap)
        self._boundary = _NEVER  # the next step at which the trial's arm may change
        self._meter = TrialBlockMeter()  # the running trial's blocks as this rank's timed samples saw them
        self._counters: BlockCounters = _no_counters
        # Read at trial block boundaries: a block's mean step time. None: the steps' wall time says
        # nothing of the arm (a simulator paced by a schedule), so blocks report no step time.
        self._block_clock = block_clock
        self._block_start: _BlockStart | None = None
        self._lease_keeper = None  # the LeaseKeeper that ends a trial whose lease expired (rank_daemon)
        self._start_trial(snap, snap.step_for(self.engine))
        self._enter_block(0)
        self._pending_step = self._boundary

    # ------------------------------------------------------------------ hot path

    def current(self, step: int) -> ConfigSnapshot:
        """The snapshot for this engine step. Once per step per rank: keep it tiny."""
        self._step = step
        if step >= self._pending_step:
            self._switch(step)
        return self._active

    def _switch(self, step: int) -> None:
        """Apply the newest queued version whose effective_step has come (rare: once per version),
        then take the trial's arm for this step (once per block).

        Versions are whole snapshots, so older queued ones are applied with it (in order, at this
        step) even if their own step lies ahead: a version published with a step far ahead (a
        forged rank report) is superseded by the next change instead of holding
        it back. Every rank of an engine holds the same steps, so all do the same at the same step."""
        with self._lock:
            n = 0  # 1 + the index of the newest due version
            for i, s in enumerate(self._pending):
                if s.step_for(self.engine) <= step:
                    n = i + 1
            if n:
                due, self._pending = self._pending[:n], self._pending[n:]
                for s in due:
                    self.applied.append((s.version, s.step_for(self.engine), step))
                del self.applied[:-256]
                self._snapshot = due[-1]
                self._effective = due[-1].step_for(self.engine)
                self.applied_step = step
                # A new version ends the running trial here; its own trial (if any) starts at its
                # effective step, which every rank of the engine holds (a late rank joins mid-plan).
                self._start_trial(due[-1], self._effective)
            self._enter_block(step)
            self._pending_step = min(self._next_pending_step(), self._boundary)

    def _start_trial(self, snap: ConfigSnapshot, first_step: int) -> None:
        """Take ``snap``'s trial (or none) with its blocks from ``first_step``: the two arms'
        snapshots are built here, once per version, so a block boundary only picks one."""
        self._active = snap
        self._plan = None if snap.trial is None else snap.trial.plan(first_step)
        if snap.trial is None:
            self._arms = (snap, snap)
            return
        tid = snap.trial.trial_id
        self._arms = (
            replace(snap, arm=CURRENT_ARM, trial_id=tid),
            replace(snap, thresholds=snap.trial.candidate, arm=CANDIDATE_ARM, trial_id=tid),
        )

    def _enter_block(self, step: int) -> None:
        """The arm ``step`` runs and the step at which that may change (the plan alone decides:
        every rank of the engine, however late it learned of the version, gets the same)."""
        plan = self._plan
        if plan is None:
            self._active, self._boundary = self._snapshot, _NEVER
            self._mark_block(step, None, None)
            return
        block = plan.block_of(step)
        self._active = self._snapshot if block is None else self._arms[plan.arm_of_block(block)]
        nxt = plan.next_boundary(step)
        self._boundary = _NEVER if nxt is None else nxt
        self._mark_block(step, plan, block)

    def _mark_block(self, step: int, plan: SwitchbackPlan | None, block: int | None) -> None:
        """At a boundary (once per block or version, never per step): close the block that ran
        with its mean step time and the fallbacks and errors counted in it, and note where the new
        one begins."""
        run = self._block_start
        if run is not None and run.plan is plan and run.block == block:
            return
        now = None if self._block_clock is None else self._block_clock()
        fallbacks, errors = self._counters() if plan is not None or run is not None else (0, 0)
        if run is not None:
            steps = step - run.step
            self._meter.end_block(
                run.plan,
                run.block,
                BlockEnd(
                    (now - run.time) / steps
                    if steps > 0 and now is not None and run.time is not None
                    else None,
                    max(0, fallbacks - run.fallbacks),
                    max(0, errors - run.errors),
                ),
            )
        self._block_start = (
            None if plan is None or block is None else _BlockStart(plan, block, now, step, fallbacks, errors)
        )

    def count_blocks_with(self, counters: BlockCounters) -> None:
        """Where this rank's running fallback and kernel-error totals are read at each trial block
        boundary (the recorder's fallback decisions, the breaker's trips): each block reports the
        difference. Without it a block reports none."""
        with self._lock:
            self._counters = counters

    def _next_pending_step(self) -> int:
        """The earliest step at which a queued version is due (call under _lock)."""
        return min((s.step_for(self.engine) for s in self._pending), default=_NEVER)

    @property
    def snapshot(self) -> ConfigSnapshot:
        """The applied version, without reporting a step (during a trial's block current() returns
        the arm's snapshot of it: ``active``)."""
        return self._snapshot

    @property
    def active(self) -> ConfigSnapshot:
        """What current() returned last: the applied version, or its trial arm's snapshot."""
        return self._active

    def trial_at(self, step: int) -> dict[str, Any] | None:
        """{"id", "block", "arm"} of the trial block ``step`` falls in, or None outside one."""
        plan = self._plan
        block = None if plan is None else plan.block_of(step)
        if plan is None or block is None:
            return None
        return {"id": plan.trial_id, "block": block, "arm": plan.arm_of_block(block)}

    @property
    def step(self) -> int:
        return self._step

    def record_kernel_sample(self, step: int, seconds: float, tokens: int) -> None:
        """One timed kernel sample of ``step`` (the GPU timer's one step in N, never every step):
        inside a trial's block it is added to that block's kernel seconds, tokens and sample count,
        which the report carries (``trial_blocks``) for the sidecar's autopilot to pair."""
        plan = self._plan
        block = None if plan is None else plan.block_of(step)
        if plan is None or block is None:
            return
        with self._lock:
            self._meter.add(plan, block, float(seconds), int(tokens))

    # ------------------------------------------------------------------ engine channel

    def apply_pushed(self, snap: ConfigSnapshot | None) -> tuple[bool, str]:
        """Apply ``snap`` from the next engine step on; refuse a version lower than the applied one.

        Called between two engine steps on the thread that calls current() (vLLM runs a collective
        RPC there, in the same order relative to execute_model on every worker), so every worker
        applies it at the same step without a margin. The first call switches this rank to the
        engine channel for good: versions the file poll had queued are dropped and it stops queueing
        (two sources of one version would apply it at two steps). ``snap=None`` only switches.
        Returns (applied, why): why is "applied", "switched", "already applied", "lower version",
        "implausible version" (more than MAX_VERSION_STEP above the applied one, or, before this rank
        applied any, above what its live peers applied at its start: control.version_trust), "same version, other content" or "unordered executor" (this rank
        keeps file polling).
        """
        with self._lock:
            if self.mode == FILE_POLLING_UNORDERED:
                return False, "unordered executor"
            self.mode = ENGINE_CHANNEL
            self._pending.clear()
            self._pending_step = self._boundary  # a running trial goes on until a version replaces it
            if snap is None:
                return False, "switched"
            cur = self._snapshot.version
            if snap.version < cur:
                return False, "lower version"
            anchor = cur if cur > 0 else self._start_anchor  # nothing applied: what its peers run
            if anchor and not believed(snap.version, anchor):
                return False, "implausible version"
            if snap.version == cur:
                same = snap.sha256 == self._snapshot.sha256
                return False, "already applied" if same else "same version, other content"
            step = self._step + 1
            # The step it really applies from, for this rank's engine: the publisher's effective
            # steps (computed for file polling) do not hold here.
            self._snapshot = snap.replace(effective_step=step, engine_steps={})
            self._effective = step
            # Its trial's blocks start at that step (every worker applies it at the same one);
            # current(step) takes the first block's arm.
            self._start_trial(self._snapshot, step)
            self._boundary = step if self._plan is not None else _NEVER
            self._pending_step = self._boundary
            self._known_version = max(self._known_version, snap.version)
            self.applied.append((snap.version, step, step))
            del self.applied[:-256]
            self.applied_step = step
            return True, "applied"
