"""FitWorker: expensive advice fits run here, one at a time, never where probes are answered.

When each request fitted on its own (0.85-5 s of CPU apiece), 45 unauthenticated GET
/thresholds/advice took all of FastAPI's 40 worker threads, and /healthz, /readyz and PATCH waited
behind them until they timed out. Here a request only awaits a result (on the event loop, holding
no thread):

* one fit runs at a time, on one dedicated thread; a request never queues a second one behind it
  (at most one job exists, so nothing can queue without bound);
* a result is reused while fresh (``fresh_s``, and until the thresholds change through this
  sidecar): per key (the window), remembering the thresholds version it was fitted for;
* a request waits at most ``deadline_s``; then it gets the last result for its key marked stale,
  or nothing (the route answers 503 with Retry-After).

What ``compute`` raises is remembered like a result (a 409 "nothing priced yet" is not refitted
on every request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("flyserve.sidecar")

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

DEFAULT_DEADLINE_S = 2.0
DEFAULT_FRESH_S = 5.0


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T]):
    """A finished fit: its value or the exception it raised, when, and whether it is stale."""

    value: T | None
    error: BaseException | None
    finished_at: float
    stale: bool = False

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.finished_at)


class FitWorker(Generic[K, T]):
    """Runs ``compute(key)`` on one thread, one key at a time, with per-key results and a deadline."""

    def __init__(
        self,
        compute: Callable[[K], T],
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        fresh_s: float = DEFAULT_FRESH_S,
        clock: Callable[[], float] = time.monotonic,
        name: str = "flyserve-advice",
    ) -> None:
        self._compute = compute
        self.deadline_s, self.fresh_s = deadline_s, fresh_s
        self._clock = clock
        self._name = name
        self._closed = False
        self._lock = threading.Lock()
        self._done: dict[K, Outcome[T]] = {}
        self._running: tuple[K, concurrent.futures.Future[None]] | None = None
        self._generation = 0  # bumped by invalidate(): results of older generations are stale
        self._done_generation: dict[K, int] = {}
        self.fits = 0  # fits started (tests and the benchmark read it)

    # ------------------------------------------------------------------ worker side

    def _start(self, key: K) -> concurrent.futures.Future[None]:
        """Submit a fit for ``key``; the caller holds the lock and has checked nothing is running."""
        # A daemon thread per fit (one at a time): a fit stuck on a bad file must never hold up the
        # process's exit, which a ThreadPoolExecutor's worker would (it is joined at exit).
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        generation = self._generation
        self._running = (key, fut)
        self.fits += 1

        def body() -> None:
            try:
                self._run(key, generation)
            except BaseException as exc:
                # Not an Exception (SystemExit, a KeyboardInterrupt delivered here, a
                # GeneratorExit subclass): _run remembered nothing. Named, then re-raised.
                log.error("advice fit aborted: %s", type(exc).__name__)
                raise
            finally:
                # Always free the slot: _run frees it only when compute returns or raises an
                # Exception, and a slot left taken made every later get() wait out its deadline
                # and no fit ever ran again.
                with self._lock:
                    if self._running is not None and self._running[1] is fut:
                        self._running = None
                fut.set_result(None)

        threading.Thread(target=body, name=f"{self._name}-{self.fits}", daemon=True).start()
        return fut

    def _run(self, key: K, generation: int) -> None:
        """On the worker thread: fit, remember the outcome (value or exception), free the slot."""
        value: T | None = None
        error: BaseException | None = None
        try:
            value = self._compute(key)
        except Exception as exc:  # noqa: BLE001 - remembered and answered, never lost
            error = exc
            if not isinstance(exc, ValueError):
                log.error("advice fit failed: %s: %s", type(exc).__name__, str(exc)[:300])
        out: Outcome[T] = Outcome(value, error, self._clock())
        with self._lock:
            self._done[key] = out
            self._done_generation[key] = generation
            self._running = None

    # ------------------------------------------------------------------ request side

    def _fresh(self, key: K, now: float) -> Outcome[T] | None:
        hit = self._done.get(key)
        if hit is None or self._done_generation.get(key) != self._generation:
            return None
        return hit if hit.age_s(now) < self.fresh_s else None

    async def get(self, key: K) -> Outcome[T] | None:
        """A fresh result for ``key``, waiting at most ``deadline_s`` for a fit; else the last one
        marked stale, or None when there has never been one."""
        deadline = self._clock() + self.deadline_s
        while True:
            with self._lock:
                now = self._clock()
                hit = self._fresh(key, now)
                if hit is not None:
                    return hit
                running = self._running
                if running is None and self._closed:
                    break
                fut = running[1] if running is not None else self._start(key)
            left = deadline - self._clock()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), left)
            except TimeoutError:
                break
        with self._lock:
            last = self._done.get(key)
        if last is None:
            return None
        return Outcome(last.value, last.error, last.finished_at, stale=True)

    def invalidate(self) -> None:
        """The thresholds changed: the next request fits again (older results stay as stale fallbacks)."""
        with self._lock:
            self._generation += 1

    def busy(self) -> bool:
        with self._lock:
            return self._running is not None

    def close(self) -> None:
        """Start no more fits (a running one finishes on its daemon thread, or dies with the process)."""
        with self._lock:
            self._closed = True
