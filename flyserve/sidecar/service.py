"""StatsService: builds the /dispatch-stats payload, caches it briefly, keeps the counter history.

One instance per app. A daemon thread snapshots the counters every ``counter_snapshot_interval_s``
for the sliding windows; request handlers call ``dispatch_stats()``, which reuses the last result
for ``stats_ttl_s`` (reading every rank's multiprocess files is the costly part; see
docs/performance.md "Sidecar latency").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flyserve.control import ConfigSnapshot, ControlPlane
from flyserve.control.reports import is_live as report_is_live
from flyserve.control.reports import liveness as report_liveness
from flyserve.sidecar.cache import TtlCache
from flyserve.sidecar.channel_view import Witnesses, read_channel_view
from flyserve.sidecar.live_costs import HORIZON_S, LivePricing
from flyserve.sidecar.models import DispatchStats, EngineStats, RankView, Regret, ThresholdsView
from flyserve.sidecar.rank_views import control_mode_of, rank_views, ranks_agree
from flyserve.sidecar.regret import PricedSample
from flyserve.sidecar.sample_evidence import Evidence, corroborate
from flyserve.sidecar.settings import SidecarSettings
from flyserve.sidecar.stats import (
    WINDOWS,
    CounterHistory,
    CounterSnapshot,
    kernels_of,
    read_counters,
    representative,
    totals_of,
    window_of,
)
from flyserve.sidecar.thresholds_view import thresholds_view
from flyserve.telemetry import metrics as tm
from flyserve.telemetry.shape_sample import ShapeSample, read_shape_samples

log = logging.getLogger("flyserve.sidecar")


MAX_LATE_S = 2.0
"""How late the background refresh may run before a request computes a cached payload itself."""


def count_priced(p: PricedSample) -> None:
    """flyserve_priced_attention_seconds_total: one sampled step priced under each policy."""
    tm.PRICED_SECONDS.labels("routed").inc(p.routed_s)
    tm.PRICED_SECONDS.labels("oracle").inc(p.oracle_s)
    tm.PRICED_SECONDS.labels("always_unified").inc(p.unified_s)
    tm.PRICED_SECONDS.labels("always_prefill").inc(p.prefill_s)
    batch = tm.PRICED_BATCHES[0] if p.has_prefill_row else tm.PRICED_BATCHES[1]
    tm.PRICED_BY_BATCH.labels(batch, "routed").inc(p.routed_s)
    tm.PRICED_BY_BATCH.labels(batch, "oracle").inc(p.oracle_s)


class StatsService:
    """Computes DispatchStats; thread-safe; owns the sampler thread (start/stop)."""

    def __init__(
        self,
        settings: SidecarSettings,
        control: ControlPlane,
        *,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.control = control
        self.metrics_dir = control.state_dir.metrics_dir
        self.history = CounterHistory(settings.counter_snapshot_interval_s)
        self._wall, self._mono = wall, mono
        self._cache: TtlCache[tuple[DispatchStats, bytes]] = TtlCache(
            self._compute_payload, settings.stats_ttl_s, max_stale_s=settings.stats_ttl_s + MAX_LATE_S
        )
        self.extra_caches: list[TtlCache] = []  # e.g. the /metrics exposition, refreshed by the same thread
        self.on_stats: Callable[[DispatchStats], None] | None = None  # e.g. update the rank gauges
        self._snap_lock = threading.Lock()
        self._snap: tuple[tuple | None, ConfigSnapshot] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pricing: LivePricing | None = None
        if settings.costs is not None:
            from flyserve.pricing.costs import load_costs

            self.pricing = LivePricing(load_costs(settings.costs), clock=wall, on_priced=count_priced)
        self._next_pricing = 0.0
        # The regret section, computed by the sampler thread after each pricing pass: reading the
        # shape files and summing the windows never runs on a request's thread.
        self._regret: dict[str, Any] | None = None
        self._priced_once = threading.Event()
        self._waited_for_pricing = False

    # ------------------------------------------------------------------ control snapshot

    def snapshot(self) -> ConfigSnapshot:
        """control.snapshot(), re-read only when current.json changes (stat: inode, mtime, size).

        Before the first publish the control plane builds version 0 from the profile (a YAML
        parse) on every call; this keeps that off the per-request path.
        """
        path = self.control.state_dir.current_json
        try:
            st = os.stat(path)
            key: tuple | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            key = None
        with self._snap_lock:
            hit = self._snap
            if hit is not None and hit[0] == key:
                return hit[1]
        snap = self.control.snapshot()
        with self._snap_lock:
            self._snap = (key, snap)
        return snap

    # ------------------------------------------------------------------ sampler

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="flyserve-sidecar-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def sample_once(self) -> None:
        try:
            self.history.add(CounterSnapshot(self._mono(), read_counters(self.metrics_dir)))
        except OSError:
            pass  # no metrics dir yet (no rank started): nothing to remember

    def price_new_samples(self) -> int:
        """Read the ranks' shape samples and price the new ones (a no-op without --costs)."""
        if self.pricing is None:
            return 0
        # Every rank file's ring (256 lines each): more than a second's worth at any real step rate.
        # Only live ranks' files: a file of a rank that is not running is not read.
        n = self.pricing.ingest(
            read_shape_samples(self.settings.state_dir, limit=1 << 16, live=self.live_rank_keys())
        )
        # Regret and drift leave out the ranks whose decision counters do not back their samples.
        ev = self.sample_evidence((p.sample for p in self.pricing.window(HORIZON_S)), HORIZON_S)
        self.pricing.set_uncorroborated(
            frozenset((r.engine, r.rank) for r in ev.ranks if r.refused is not None)
        )
        drift = self.pricing.regret_drift()
        for path, ratio in drift.items():
            tm.COST_DRIFT.labels(path).set(float("nan") if ratio is None else ratio)
        return n

    def _run(self) -> None:
        """Counter snapshots every counter_snapshot_interval_s; between them, keep the cached
        payloads fresh while they are being read (so no request pays for a computation)."""
        next_snapshot = 0.0
        tick = min(self.settings.counter_snapshot_interval_s, max(0.05, 0.8 * self.settings.stats_ttl_s))
        while not self._stop.is_set():
            now = self._mono()
            if now >= next_snapshot:
                self.sample_once()
                next_snapshot = now + self.settings.counter_snapshot_interval_s
            if self.pricing is not None and now >= self._next_pricing:
                self._next_pricing = now + self.settings.pricing_interval_s
                try:
                    self.price_new_samples()
                    self._regret = self.pricing.regret()
                except Exception:
                    log.exception("live pricing failed")
                finally:
                    self._priced_once.set()
            for cache in (self._cache, *self.extra_caches):
                try:
                    cache.refresh_if_used(idle_s=30.0)
                except Exception:
                    log.exception("background refresh failed")
            self._stop.wait(tick)

    # ------------------------------------------------------------------ payload

    def dispatch_stats(self) -> DispatchStats:
        return self._cache.get()[0]

    def dispatch_stats_json(self) -> bytes:
        """The payload, serialised once per computation (not once per request)."""
        return self._cache.get()[1]

    def _compute_payload(self) -> tuple[DispatchStats, bytes]:
        stats = self._compute(self._mono())
        if self.on_stats is not None:
            self.on_stats(stats)
        return stats, stats.model_dump_json().encode()

    def invalidate(self) -> None:
        """Drop the cached payload (after a change made through this sidecar)."""
        self._cache.invalidate()

    def rank_views_only(self) -> list[RankView]:
        """Rank liveness without reading counters (for /readyz and the rank gauges): one look at
        ranks/, each report with what the process table says of it (a fresh report whose process
        is gone, or whose pid another process reuses, is stale)."""
        wall = self._wall()
        reports, states, _ = self._reports(wall)
        return rank_views(reports, {}, now=wall, stale_after_s=self.settings.stale_after_s, liveness=states)

    def live_rank_keys(self) -> set[tuple[int, int]]:
        """(engine, rank) of the ranks live now (flyserve.control.reports.is_live): whose shape
        samples count."""
        wall = self._wall()
        return {
            r.key
            for r in self.control.store.reports(now=wall)
            if report_is_live(r, now=wall, stale_after_s=self.settings.stale_after_s)
        }

    def sample_evidence(self, samples: Iterable[ShapeSample], window_s: float) -> Evidence:
        """The window's samples against each rank's decision counters (flyserve.sidecar.
        sample_evidence): deltas over a baseline at least ``window_s`` old when the history has
        one, else the counters' totals (an upper bound of any window)."""
        try:
            now = read_counters(self.metrics_dir)
        except OSError:
            now = {}
        base, complete = self.history.baseline(self._mono(), window_s)
        if complete and base is not None:
            counts = {r: c.minus(base.counters.get(r)) for r, c in now.items()}
        else:
            counts = now
        return corroborate(samples, counts)

    def _reports(self, wall: float) -> tuple[list[Mapping[str, Any]], dict[tuple[int, int], str], Witnesses]:
        """One look at ranks/: the reports, (engine, rank) -> confirmed / unconfirmed / gone (what
        the process table says of each), and what the live ones can vouch for in the engine
        channel's status (flyserve.sidecar.channel_view.Witnesses, for /dispatch-stats)."""
        looked = self.control.store.read_rank_reports(now=wall)
        states = {
            r.key: report_liveness(r, now=wall, stale_after_s=self.settings.stale_after_s).value
            for _, r in looked
        }
        live = Witnesses.of((r.engine, r.rank, r.host) for _, r in looked if states.get(r.key) != "gone")
        return [d for d, _ in looked], states, live

    def _control_version(self) -> int | None:
        """The control plane's current version (None when it cannot be read): what the engine
        channel's status is checked against, read after that file."""
        try:
            return self.snapshot().version
        except Exception:  # noqa: BLE001 - the page must show what it can
            return None

    def _compute(self, now_mono: float) -> DispatchStats:
        errors: list[str] = []
        wall = self._wall()
        try:
            counters = read_counters(self.metrics_dir)
        except OSError as exc:
            counters = {}
            errors.append(f"metrics: {exc}")
        try:
            view: ThresholdsView | None = thresholds_view(self.snapshot())
        except Exception as exc:  # noqa: BLE001 - the page must show what it can
            view = None
            errors.append(f"thresholds: {exc}")
        reports, states, witnesses = self._reports(wall)
        ranks = rank_views(
            reports, counters, now=wall, stale_after_s=self.settings.stale_after_s, liveness=states
        )
        engines: dict[int, list[int]] = {}
        for v in ranks:
            engines.setdefault(v.engine, []).append(v.rank)
        now_snap = CounterSnapshot(now_mono, counters)
        bases = {name: self.history.baseline(now_mono, secs) for name, secs in WINDOWS.items()}

        engine_stats = []
        for e, members in sorted(engines.items()):
            rep = representative(counters, members)
            member_views = [v for v in ranks if v.engine == e]
            engine_stats.append(
                EngineStats(
                    engine=e,
                    representative_rank=rep,
                    ranks=sorted(members),
                    ranks_agree=ranks_agree(member_views),
                    totals=totals_of([counters[rep]] if rep in counters else []),
                    windows={
                        name: window_of(now_snap, base, complete, {e: members})
                        for name, (base, complete) in bases.items()
                    },
                    kernels=kernels_of(counters[r] for r in members if r in counters),
                )
            )
        reps = [es.representative_rank for es in engine_stats]
        try:
            channel = read_channel_view(
                self.control.state_dir, now=wall, control_version=self._control_version, witnesses=witnesses
            )
        except (ValueError, OSError) as exc:
            channel = None
            errors.append(f"channel: {exc}")
        regret = None
        if self.pricing is not None:
            # The sampler thread's last pass (at most pricing_interval_s old). Just after start, the
            # first computation waits briefly for its first pass rather than read the shape files
            # here; only once: a pass stuck on a bad file must not make every computation wait.
            if not self._waited_for_pricing:
                self._waited_for_pricing = True
                self._priced_once.wait(timeout=2.0)
            last = self._regret
            if last is None:
                errors.append("regret: not computed yet (the first pricing pass is still running)")
            else:
                try:
                    regret = Regret(**last)
                except Exception as exc:  # noqa: BLE001 - the page must show what it can
                    errors.append(f"regret: {exc}")
        return DispatchStats(
            time=wall,
            thresholds=view,
            totals=totals_of(counters[r] for r in reps if r is not None and r in counters),
            windows={
                name: window_of(now_snap, base, complete, engines) for name, (base, complete) in bases.items()
            },
            ranks=ranks,
            ranks_agree=ranks_agree(ranks),
            live_ranks=sum(1 for v in ranks if not v.stale),
            control_mode=control_mode_of(ranks),
            late_applies=sum(v.late_applies or 0 for v in ranks),
            kernels=kernels_of(counters.values()),
            engines=engine_stats,
            errors=errors,
            regret=regret,
            channel=channel,
        )
