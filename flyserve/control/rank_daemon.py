"""The rank's background side: a daemon thread (about once a second) that looks at
control/current.json, queues a new version (with the ones history holds between it and the last
known one) for RankControl's hot path to switch to at its effective step, and writes
ranks/<rank>.json. A mixin of flyserve.control.rank.RankControl, which sets the attributes below;
nothing here runs per engine step.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from flyserve.autopilot.switchback import SwitchbackPlan
from flyserve.control._metrics import count_late_applies
from flyserve.control.errors import ControlIOError
from flyserve.control.paths import StateDir
from flyserve.control.rank_modes import ENGINE_CHANNEL
from flyserve.control.reports import HOST, PIDNS, own_proc_start
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.store import Store
from flyserve.control.trial_blocks import TrialBlockMeter
from flyserve.control.trial_lease import LeaseKeeper
from flyserve.control.version_trust import anchored_ceiling, live_anchor

log = logging.getLogger("flyserve.control")

MIN_RATE_WINDOW_S = 1.0
"""A rate is measured over at least this long ..."""
MIN_RATE_STEPS = 16
"""... and once the engine has taken this many steps (before: null, the publisher assumes a high rate)."""
RATE_PEAK_REPORTS = 30
PEER_STALE_AFTER_S = 30.0
"""A peer's report older than this is not a live rank a starting rank anchors on (the control
plane's default rank_stale_after_s)."""


class RankFilePolling:
    """RankControl's daemon thread: file polling and the rank's report (a part of
    flyserve.control.rank.RankControl, which sets the attributes below)."""

    state_dir: StateDir
    store: Store
    rank: int
    engine: int
    interval_s: float
    report: bool
    started: float
    late_applies: int
    mode: str
    prefill_kernel: dict[str, Any] | None
    applied_step: int
    _lock: threading.Lock
    _stop: threading.Event
    _thread: threading.Thread | None
    _step: int
    _pending: list[ConfigSnapshot]
    _pending_step: int
    _seen_stat: tuple[int, int, int] | None
    _refused_stat: tuple[int, int, int] | None
    _last_rate_sample: tuple[float, int]
    _recent_rates: deque[float]
    _known_version: int
    _start_anchor: int | None
    _snapshot: ConfigSnapshot
    _lease_keeper: LeaseKeeper | None
    _effective: int
    _plan: SwitchbackPlan | None
    _boundary: int
    _meter: TrialBlockMeter
    _next_pending_step: Callable[[], int]
    trial_at: Callable[[int], dict[str, Any] | None]

    def start(self) -> Self:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"flyserve-control-rank{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, *, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.poll()  # a last report, so the final step and version are on record

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception:
                log.exception("rank %d: control poll failed", self.rank)
            self._stop.wait(self.interval_s)

    def poll(self) -> None:
        """One round of the background thread: pick up a new version, then report. Public for tests."""
        self._refresh()
        if self.report:
            self.write_report()
        self._end_trial_if_lease_expired()

    def _end_trial_if_lease_expired(self) -> None:
        """With file polling, engine 0's rank 0 keeps the autopilot's lease (control.trial_lease):
        a trial in force whose sidecar stopped renewing it is published again without the trial,
        which every rank then applies at one step. With the engine channel the pusher does it. Reads
        a file only while the version this rank runs carries a trial; after the report, and never
        longer than the keeper's short wait for the writers' lock (LeaseKeeper), so this thread
        still picks up the next version in time."""
        if self.mode == ENGINE_CHANNEL or self.rank != 0 or self.engine != 0 or not self.report:
            return
        if self._snapshot.trial is None:
            return
        if self._lease_keeper is None:
            self._lease_keeper = LeaseKeeper(self.state_dir)
        self._lease_keeper.check()

    def _read_current_quiet(self, stat_key: tuple[int, int, int] | None = None) -> ConfigSnapshot | None:
        """current.json if this rank believes it, else None (logged once per file content seen).

        A version is believed only where it continues what this rank applied (at most
        MAX_VERSION_STEP above it; before it applied anything, above what the live confirmed ranks
        applied when it started, and with none the chain of history names: control.version_trust):
        a forged current.json numbered near the numeric limit, taken as fact, once pinned every
        later change out of reach."""
        anchor = self._known_version if self._known_version > 0 else self._start_anchor
        try:
            return self.store.read_current(anchor=anchor)
        except ControlIOError as exc:
            if stat_key is None or stat_key != self._refused_stat:
                log.error("rank %d: %s; keeping the running thresholds", self.rank, exc)
            self._refused_stat = stat_key
            return None

    def _peer_anchor(self) -> int | None:
        """The lowest version the live ranks report as applied (confirmed ones; with none confirmed,
        fresh unconfirmed ones: control.version_trust.live_anchor), one look at ranks/; None with
        none (or when ranks/ cannot be read)."""
        try:
            return live_anchor(
                self.store.reports(now=time.time()),
                now=time.time(),
                stale_after_s=PEER_STALE_AFTER_S,
                record=self.store.version_floor(),
            )
        except (OSError, ControlIOError) as exc:
            log.error("rank %d: cannot read the other ranks' reports: %s", self.rank, exc)
            return None

    def _newest_history_quiet(self) -> ConfigSnapshot | None:
        try:
            return self.store.newest_credible_history(at_most=anchored_ceiling(self._start_anchor))
        except ControlIOError as exc:
            log.error("rank %d: %s; starting on the profile", self.rank, exc)
            return None

    def _refresh(self) -> None:
        if self.mode == ENGINE_CHANNEL:
            return  # versions come from the engine channel only (see apply_pushed)
        path: Path = self.state_dir.current_json
        try:
            st = os.stat(path)
        except OSError:
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen_stat:
            return
        snap = self._read_current_quiet(key)
        if snap is None:
            return  # unreadable or refused: try again next round (stat key not recorded)
        self._seen_stat = key
        if snap.version <= self._known_version:
            return
        # Versions published between two polls: take them from history so no rank skips one.
        new = self.store.versions_up_to(snap, after=self._known_version)
        self._known_version = snap.version
        with self._lock:
            if self.mode == ENGINE_CHANNEL:  # switched while this poll read the files
                return
            self._pending.extend(new)
            self._pending.sort(key=lambda s: s.version)
            self._pending_step = min(self._next_pending_step(), self._boundary)
        late = [s.version for s in new if s.step_for(self.engine) < self._step]
        if late:
            self.late_applies += len(late)
            count_late_applies(self.rank, len(late))
            log.warning(
                "rank %d learned of version(s) %s at step %d, past their effective_step: applying at once",
                self.rank,
                late,
                self._step,
            )

    def _rate(self, now: float) -> float | None:
        """Steps per second for the publisher to size effective_step in time, not in a fixed number
        of steps; None until measured. The peak of the last RATE_PEAK_REPORTS intervals, not the
        mean: an engine that went idle steps at its busy rate again the moment requests arrive."""
        t0, s0 = self._last_rate_sample
        if now - t0 < MIN_RATE_WINDOW_S:
            return max(self._recent_rates) if self._recent_rates else None
        self._last_rate_sample = (now, self._step)
        if self._recent_rates or self._step >= MIN_RATE_STEPS:
            self._recent_rates.append(max(0.0, (self._step - s0) / (now - t0)))
        return max(self._recent_rates) if self._recent_rates else None

    def report_dict(self) -> dict[str, Any]:
        s = self._snapshot
        now = time.time()
        rate = self._rate(now)
        return {
            "pid": os.getpid(),
            "host": HOST,
            "pidns": PIDNS,
            "proc_start": own_proc_start(),  # with pid: this process, not a later one that reuses the pid
            "rank": self.rank,
            "engine": self.engine,
            "started": self.started,
            "step": self._step,
            "applied_version": s.version,
            "applied_sha256": s.sha256,
            "applied_step": self.applied_step,
            "effective_step": self._effective,
            "pending_version": self._pending[-1].version if self._pending else None,
            "circuit_open": s.circuit_open,
            "control_mode": self.mode,
            "prefill_kernel": self.prefill_kernel,
            "steps_per_s": None if rate is None else round(rate, 3),
            "late_applies": self.late_applies,
            "trial": self.trial_at(self._step),
            "trial_blocks": self._trial_blocks(),
            "time": now,
        }

    def _trial_blocks(self) -> dict[str, Any] | None:
        with self._lock:
            got = self._meter.report(self._plan, self._step)
        return None if got is None else got.to_dict()

    def write_report(self) -> None:
        try:
            self.store.write_rank_report(self.report_dict(), rank=self.rank, engine=self.engine)
        except OSError as exc:
            log.error("rank %d: cannot write its report: %s", self.rank, exc)
