"""One daemon thread that calls a function every interval until stopped: the loop the sidecar's
autopilot runner and metrics compactor share.

The function runs at once and then every ``interval_s`` (waited on the stop event, so ``stop``
never waits out an interval); an exception is logged and the loop goes on. ``start`` and ``stop``
hold one lock: two concurrent starts start one thread, and ``stop`` joins the thread (up to 10 s)
before a new ``start`` may run another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

STOP_JOIN_S = 10.0
"""How long ``stop`` waits for a call in progress to return."""


class PeriodicThread:
    """Calls ``fn`` every ``interval_s`` on a daemon thread named ``name`` between start and stop;
    a failure is logged on ``log`` with ``failed`` as its message."""

    def __init__(
        self,
        fn: Callable[[], object],
        *,
        interval_s: float,
        name: str,
        log: logging.Logger,
        failed: str,
    ) -> None:
        self.interval_s = float(interval_s)
        self._fn = fn
        self._name = name
        self._log = log
        self._failed = failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=STOP_JOIN_S)
                self._thread = None

    def _run(self) -> None:
        log = self._log
        while not self._stop.is_set():
            try:
                self._fn()
            except Exception:
                log.exception(self._failed)
            self._stop.wait(self.interval_s)
