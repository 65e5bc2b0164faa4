"""The SSE reader behind `flyserve top`: one thread holds GET /dispatch-stats/stream open, keeps the
newest payload, and reconnects (once a second) when the sidecar goes away, saying why in words a
person can act on. The drawing loop only reads ``latest()``; it never waits on the network.

What listens on the port may not be the sidecar, so nothing it sends is trusted: lines and events
are bounded (flyserve.top.sse), a payload is parsed with the state files' caps (depth, number
sizes) and kept only when it is a JSON object; anything else is counted as malformed and the view
keeps the last good one.

The bearer token: the sidecar's stream is open (only its mutations want a token), so each connection
first asks without one, and sends it only when that same request to --url is answered 401 (a proxy
in front that guards reads). Redirects are never followed and no proxy from the environment is
used, so the token never goes to another host or port than the one asked (flyserve.top.reader).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from flyserve.top.reader import BackgroundReader, direct_client, parse_object
from flyserve.top.sse import Dropped, iter_lines, iter_sse_data

__all__ = ["Latest", "StatsStream", "iter_sse_data"]

RETRY_S = 1.0


@dataclass(frozen=True)
class Latest:
    stats: dict[str, Any] | None
    error: str | None
    received_at: float | None  # time.monotonic() of the newest payload
    events: int
    malformed: int = 0  # events that were not a JSON object (kept out of ``stats``)
    oversize: int = 0  # lines and events dropped for their size


def parse_payload(data: str) -> dict[str, Any] | None:
    """The payload of one event, or None when it is not a JSON object within the state files' caps
    (a JSON array, a string, a number, nesting past 64 levels, NaN, a 5000-digit number)."""
    return parse_object(data, source="the stream")


class StatsStream(BackgroundReader):
    """Reads the stream in a daemon thread; ``latest()`` is safe from any thread."""

    def __init__(self, url: str, *, interval: float, token: str | None = None) -> None:
        super().__init__(url, token=token, thread_name="flyserve-top-stream")
        self.interval = interval
        self._latest = Latest(None, None, None, 0)
        self._dropped = Dropped()

    def latest(self) -> Latest:
        """The newest state; its ``oversize`` is counted up to now (a line still being skipped
        included), so the view shows a stream that sends nothing usable as it happens."""
        with self._lock:
            cur = self._latest
        seen = self._dropped.lines + self._dropped.events
        return cur if seen == cur.oversize else dataclasses.replace(cur, oversize=seen)

    def _set(self, **kw: Any) -> None:
        with self._lock:
            cur = self._latest
            self._latest = Latest(
                kw.get("stats", cur.stats),
                kw.get("error", cur.error),
                kw.get("received_at", cur.received_at),
                kw.get("events", cur.events),
                kw.get("malformed", cur.malformed),
                cur.oversize,
            )

    def _run(self) -> None:
        import httpx

        endpoint = httpx.URL(f"{self.url}/dispatch-stats/stream", params={"interval": self.interval})
        timeout = httpx.Timeout(connect=2.0, read=max(10.0, self.interval * 5), write=2.0, pool=2.0)
        while not self._stop.is_set():
            try:
                with direct_client(timeout) as c:
                    if self._connect(c, endpoint, with_token=False) == "token wanted":
                        self._connect(c, endpoint, with_token=True)
                    if self._stop.is_set():
                        return
            except httpx.ConnectError:
                self._set(error=f"sidecar at {self.url} not reachable (connection refused), retrying")
            except httpx.TimeoutException:
                self._set(error=f"sidecar at {self.url} not answering (timeout), retrying")
            except httpx.HTTPError as exc:
                self._set(error=f"sidecar at {self.url}: {type(exc).__name__}, retrying")
            except Exception as exc:  # noqa: BLE001 - whatever the peer sends, the reader lives on
                self._set(error=f"the stream from {self.url} failed ({type(exc).__name__}); reconnecting")
            self._stop.wait(RETRY_S)

    def _connect(self, client: Any, endpoint: Any, *, with_token: bool) -> str:
        """One request; "token wanted" when it went without the token, one is given, and the
        endpoint itself (not a redirect: none is followed) answered 401."""
        headers = self._headers("text/event-stream", with_token=with_token)
        with client.stream("GET", endpoint, headers=headers) as r:
            if self._token_wanted(endpoint, r, with_token=with_token):
                return "token wanted"
            if r.status_code == 401:
                self._set(
                    error=f"the sidecar at {self.url} refused the token (HTTP 401); retrying"
                    if with_token
                    else f"the sidecar at {self.url} wants a token (HTTP 401): --token-file or "
                    "$FLYSERVE_SIDECAR_TOKEN; retrying"
                )
            elif r.status_code == 403:
                self._set(error=f"the sidecar at {self.url} refused the stream (HTTP 403); retrying")
            elif 300 <= r.status_code < 400:
                self._set(
                    error=f"{self.url} answered a redirect (HTTP {r.status_code}), not followed: give --url "
                    "the sidecar's own address; retrying"
                )
            elif r.status_code != 200:
                self._set(error=f"the sidecar at {self.url} answered HTTP {r.status_code}; retrying")
            elif r.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
                self._set(error=f"{self.url} sent a compressed stream (not read); retrying")
            else:
                self._read(r)
        return "done"

    def _read(self, r: Any) -> None:
        # iter_raw() with no size: each piece as it is read (httpcore reads at most 64 KiB at a time);
        # with a size httpx would hold a small event back until that many bytes had come.
        lines = iter_lines(r.iter_raw(), dropped=self._dropped)
        for data in iter_sse_data(lines, dropped=self._dropped):
            stats = parse_payload(data)
            if stats is None:
                self._set(
                    error="the sidecar sent an event that is not a JSON object; skipped",
                    malformed=self.latest().malformed + 1,
                )
            else:
                n = self.latest().events + 1
                self._set(stats=stats, error=None, received_at=time.monotonic(), events=n)
            if self._stop.is_set():
                return
        self._set(error=f"the stream from {self.url} ended; reconnecting")
