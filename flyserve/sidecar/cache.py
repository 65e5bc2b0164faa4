"""TtlCache: reuse a computed value for a short time; refresh it without making readers wait.

A dashboard polling /dispatch-stats, or a load test at 200 req/s, needs no fresher numbers than
a fraction of a second, and the ranks' counters only move once per engine step anyway. When the
value is stale, ONE caller recomputes it while concurrent callers get the previous value (stale
while revalidate), so a refresh never queues the other requests behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class TtlCache(Generic[T]):
    """``max_stale_s``: with a background refresher (refresh_if_used), a value up to this old is
    served at once even when no refresh is running, instead of the request computing it: on a busy
    machine the refresher runs late, and the requests that found the value just past its TTL paid
    the whole computation (the p99 of /dispatch-stats with 64 ranks). Older than that
    (the refresher stopped, or nobody asked for a while), or with no refresher at all (no call of
    refresh_if_used within ``max_stale_s``), a request computes it as before."""

    def __init__(
        self,
        compute: Callable[[], T],
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_stale_s: float = 0.0,
    ):
        self._compute = compute
        self.ttl_s = ttl_s
        self.max_stale_s = max_stale_s
        self._clock = clock
        self._lock = threading.Lock()
        self._value: tuple[float, T] | None = None
        # Bumped by invalidate(): a compute started under an older generation began before the
        # change and may hold the old payload, so its result is returned to its caller but never
        # stored as fresh (else /dispatch-stats showed the old thresholds for TTL + max_stale).
        self._generation = 0
        self._state_lock = threading.Lock()  # generation check + store vs invalidate(); never held long
        self.last_get = float("-inf")  # clock time of the last get(): refresh only while in use
        self.last_refresher = float("-inf")  # clock time of the last refresh_if_used() call

    def get(self) -> T:
        if self.ttl_s <= 0:
            return self._compute()
        now = self._clock()
        self.last_get = now
        c = self._value
        if c is not None and (
            now - c[0] < self.ttl_s
            or (now - c[0] < self.max_stale_s and now - self.last_refresher < self.max_stale_s)
        ):
            return c[1]
        # No value at all: wait for whoever computes it. A stale one: serve it if busy.
        if not self._lock.acquire(blocking=c is None):
            assert c is not None
            return c[1]
        try:
            c = self._value
            now = self._clock()
            if c is not None and now - c[0] < self.ttl_s:
                return c[1]  # refreshed by another thread while we waited
            gen = self._generation
            v = self._compute()
            self._store(gen, now, v)
            return v
        finally:
            self._lock.release()

    def refresh_if_used(self, idle_s: float) -> bool:
        """Recompute now if someone asked within ``idle_s`` (a background thread calls this a bit
        more often than the TTL, so requests find a fresh value and never pay for the compute)."""
        now = self._clock()
        self.last_refresher = now
        if self.ttl_s <= 0 or now - self.last_get > idle_s:
            return False
        c = self._value
        if c is not None and now - c[0] < 0.5 * self.ttl_s:
            return False  # still fresh: a /metrics body (TTL 1 s) is not rebuilt on every 0.4 s tick
        if not self._lock.acquire(blocking=False):
            return False  # a request is computing it already
        try:
            now = self._clock()
            gen = self._generation
            v = self._compute()
            return self._store(gen, now, v)
        finally:
            self._lock.release()

    def _store(self, gen: int, at: float, v: T) -> bool:
        """Keep ``v`` (computed from clock time ``at``) unless invalidate() ran since its compute
        began. The check and the store are one step under _state_lock (not the compute lock:
        invalidate() must never wait behind a slow compute)."""
        with self._state_lock:
            if gen != self._generation:
                return False
            self._value = (at, v)
            return True

    def invalidate(self) -> None:
        """Forget the value: the next get() computes a fresh one (and waits for it). A compute
        already running began before the change: its result is not stored (generation counter)."""
        with self._state_lock:
            self._generation += 1
            self._value = None
