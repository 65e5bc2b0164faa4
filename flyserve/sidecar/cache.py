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
    def __init__(
        self, compute: Callable[[], T], ttl_s: float, *, clock: Callable[[], float] = time.monotonic
    ):
        self._compute = compute
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._value: tuple[float, T] | None = None
        self.last_get = float("-inf")  # clock time of the last get(): refresh only while in use

    def get(self) -> T:
        if self.ttl_s <= 0:
            return self._compute()
        now = self._clock()
        self.last_get = now
        c = self._value
        if c is not None and now - c[0] < self.ttl_s:
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
            v = self._compute()
            self._value = (now, v)
            return v
        finally:
            self._lock.release()

    def refresh_if_used(self, idle_s: float) -> bool:
        """Recompute now if someone asked within ``idle_s`` (a background thread calls this a bit
        more often than the TTL, so requests find a fresh value and never pay for the compute)."""
        if self.ttl_s <= 0 or self._clock() - self.last_get > idle_s:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # a request is computing it already
        try:
            now = self._clock()
            self._value = (now, self._compute())
            return True
        finally:
            self._lock.release()

    def invalidate(self) -> None:
        """Forget the value: the next get() computes a fresh one (and waits for it)."""
        self._value = None
