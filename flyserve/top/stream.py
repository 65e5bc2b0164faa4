"""The SSE reader behind `flyserve top`: one thread holds GET /dispatch-stats/stream open, keeps the
newest payload, and reconnects (once a second) when the sidecar goes away, saying why in words a
person can act on. The drawing loop only reads ``latest()``; it never waits on the network.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

RETRY_S = 1.0


@dataclass(frozen=True)
class Latest:
    stats: dict[str, Any] | None
    error: str | None
    received_at: float | None  # time.monotonic() of the newest payload
    events: int


def iter_sse_data(lines) -> Any:
    """The ``data`` of each server-sent event of ``lines`` (an iterator of text lines)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))


class StatsStream:
    """Reads the stream in a daemon thread; ``latest()`` is safe from any thread."""

    def __init__(self, url: str, *, interval: float, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.interval = interval
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._lock = threading.Lock()
        self._latest = Latest(None, None, None, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flyserve-top-stream", daemon=True)

    def start(self) -> StatsStream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def latest(self) -> Latest:
        with self._lock:
            return self._latest

    def _set(self, **kw: Any) -> None:
        with self._lock:
            cur = self._latest
            self._latest = Latest(
                kw.get("stats", cur.stats),
                kw.get("error", cur.error),
                kw.get("received_at", cur.received_at),
                kw.get("events", cur.events),
            )

    def _run(self) -> None:
        import httpx

        endpoint = f"{self.url}/dispatch-stats/stream"
        timeout = httpx.Timeout(connect=2.0, read=max(10.0, self.interval * 5), write=2.0, pool=2.0)
        while not self._stop.is_set():
            try:
                with (
                    httpx.Client(timeout=timeout, headers=self._headers) as client,
                    client.stream("GET", endpoint, params={"interval": self.interval}) as r,
                ):
                    if r.status_code in (401, 403):
                        self._set(
                            error=f"the sidecar at {self.url} refused the stream (HTTP {r.status_code}): it needs "
                            "a token: --token-file or $FLYSERVE_SIDECAR_TOKEN; retrying"
                        )
                    elif r.status_code != 200:
                        self._set(error=f"the sidecar at {self.url} answered HTTP {r.status_code}; retrying")
                    else:
                        for data in iter_sse_data(r.iter_lines()):
                            try:
                                stats = json.loads(data)
                            except ValueError:
                                self._set(error="the sidecar sent an event that is not JSON; skipped")
                                continue
                            n = self.latest().events + 1
                            self._set(stats=stats, error=None, received_at=time.monotonic(), events=n)
                            if self._stop.is_set():
                                return
                        self._set(error=f"the stream from {self.url} ended; reconnecting")
            except httpx.ConnectError:
                self._set(error=f"sidecar at {self.url} not reachable (connection refused), retrying")
            except httpx.TimeoutException:
                self._set(error=f"sidecar at {self.url} not answering (timeout), retrying")
            except httpx.HTTPError as exc:
                self._set(error=f"sidecar at {self.url}: {type(exc).__name__}, retrying")
            self._stop.wait(RETRY_S)
