"""StreamHub: one /dispatch-stats payload per tick, shared by every SSE client.

Each SSE client used to compute (or fetch) its own payload on its own timer, with no floor on the
interval: three unauthenticated streams at ``?interval=0.000001`` held the sidecar at 99% CPU and
100 clients raised /dispatch-stats p99 from 4.6 ms to 201 ms (issue 13). Now one task computes the
payload every ``tick_s`` (the interval floor) while at least one client listens, clients wait on
it, and the number of concurrent streams is capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger("flyserve.sidecar")


class StreamsFull(Exception):
    """Every stream slot is taken (the caller answers 503)."""


class StreamHub:
    """Shared payload source for SSE clients. Lives on one event loop (the server's)."""

    def __init__(self, compute: Callable[[], bytes], *, tick_s: float, max_streams: int) -> None:
        self._compute = compute
        self.tick_s = float(tick_s)
        self.max_streams = int(max_streams)
        self.clients = 0
        self.computed = 0  # payloads computed since start (benchmarks and tests read it)
        self._seq = 0
        self._payload = b""
        self._cond: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None

    def subscribe(self) -> None:
        """Take a stream slot; raise StreamsFull when none is left."""
        if self.clients >= self.max_streams:
            raise StreamsFull(f"{self.max_streams} streams already open")
        self.clients += 1
        if self._cond is None:
            self._cond = asyncio.Condition()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def unsubscribe(self) -> None:
        self.clients = max(0, self.clients - 1)
        if self.clients == 0 and self._task is not None:
            self._task.cancel()
            self._task = None

    async def next(self, after: int, timeout_s: float) -> tuple[int, bytes] | None:
        """The first payload with a sequence number above ``after`` (None after ``timeout_s``)."""
        assert self._cond is not None
        async with self._cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cond.wait_for(lambda: self._seq > after), timeout_s)
            if self._seq > after:
                return self._seq, self._payload
        return None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.clients > 0:
            started = loop.time()
            try:
                payload = await asyncio.to_thread(self._compute)
            except Exception:
                log.exception("stream payload failed")
            else:
                self.computed += 1
                assert self._cond is not None
                async with self._cond:
                    self._seq += 1
                    self._payload = payload
                    self._cond.notify_all()
            await asyncio.sleep(max(0.0, self.tick_s - (loop.time() - started)))
