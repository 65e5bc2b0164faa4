"""The sidecar's uvicorn server, hardened against slow, half-open and greedy clients.

uvicorn closes idle keep-alive connections but has no deadline for a request's head or body: 1,100
connections that each sent half a request line kept /healthz down for 25 s at ``ulimit -n 1024``
(issue 13). And its connection cap counted connections that never finished their head: about 530
half-open unauthenticated connections made every request, /healthz included, answer 503 (issue 22
item 2), which in Kubernetes failed the probes of the pod that serves vLLM. Here:

* a request head must arrive whole within ``head_timeout_s`` (5 s) of the connection (or of the
  previous response), and the whole request within ``request_timeout_s`` (10 s);
* at ``max_connections`` a new connection evicts the oldest one still waiting for its head (a
  half-open one, or an idle keep-alive); only when every connection is inside a request is the
  new one refused (closed at once). A flood of half-open connections therefore cannot keep a
  prober out: each new connection displaces the oldest, and a probe sends its head at once;
* requests over the cap are shed with 503 by AdmissionMiddleware, except the ones that matter
  (/healthz, /readyz, changes with the valid token).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from flyserve.sidecar.middleware import MAX_HEAD_BYTES
from flyserve.telemetry import metrics as tm

log = logging.getLogger("flyserve.sidecar")

DEFAULT_HEAD_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_MAX_CONNECTIONS = 512
DROP_LOG_EVERY_S = 10.0
"""Dropped connections are logged as one summary line at most this often (a flood is thousands)."""

_drops: dict[str, int] = {}
_drops_logged_at = [0.0]


def _dropped(reason: str) -> None:
    """Count a dropped connection; log a summary at most every DROP_LOG_EVERY_S."""
    tm.SIDECAR_DROPPED_CONNECTIONS.labels(reason).inc()
    _drops[reason] = _drops.get(reason, 0) + 1
    now = time.monotonic()
    if now - _drops_logged_at[0] >= DROP_LOG_EVERY_S:
        _drops_logged_at[0] = now
        summary = ", ".join(f"{n} {r}" for r, n in sorted(_drops.items()))
        _drops.clear()
        log.warning("sidecar: dropped connections (%s): a slow or half-open client flood?", summary)


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus deadlines for a request's head and whole request, and a
    connection cap that evicts the oldest connection still waiting for its head.

    The head timer runs while h11 waits for a request's head (IDLE); the request timer while it
    waits for a head or body (IDLE, SEND_BODY). Both stop once the request is complete: a
    response in progress (an SSE stream) is never cut.
    """

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._request_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None
        super().connection_made(transport)
        self._waiting_since = self.loop.time()
        if not self._make_room():
            return
        self._arm_or_cancel()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm_or_cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._waiting_since = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel()  # idle between requests: uvicorn's keep-alive timer takes over
        self._waiting_since = self.loop.time()  # and it may be evicted like a half-open one

    # ------------------------------------------------------------------ the cap

    def waiting_for_head(self) -> bool:
        """No request in progress on this connection: nothing is lost by closing it."""
        return (
            self._waiting_since is not None
            and self.conn.their_state == h11.IDLE
            and (self.cycle is None or self.cycle.response_complete)
            and not self.transport.is_closing()
        )

    def _make_room(self) -> bool:
        """At the cap: close the oldest connection waiting for its head; with none, this one.
        False when this connection was the one closed."""
        if len(self.connections) <= self.max_connections:
            return True
        oldest: DeadlineH11Protocol | None = None
        for p in self.connections:
            if p is self or not isinstance(p, DeadlineH11Protocol) or not p.waiting_for_head():
                continue
            if oldest is None or (p._waiting_since or 0.0) < (oldest._waiting_since or 0.0):
                oldest = p
        if oldest is not None:
            oldest._drop("evicted")
            return True
        self._drop("refused")
        return False

    def _drop(self, reason: str) -> None:
        self._cancel()
        self._waiting_since = None
        if not self.transport.is_closing():
            _dropped(reason)
            self.transport.close()

    # ------------------------------------------------------------------ deadlines

    def _arm_or_cancel(self) -> None:
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state == h11.IDLE and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._timed_out, "head_timeout")
        elif state != h11.IDLE and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
            self._waiting_since = None  # inside a request now: never evicted
        waiting = state in (h11.IDLE, h11.SEND_BODY)
        if waiting and self._request_timer is None:
            self._request_timer = self.loop.call_later(self.request_timeout_s, self._timed_out, "request_timeout")
        elif not waiting and self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _cancel(self) -> None:
        for name in ("_request_timer", "_head_timer"):
            timer = getattr(self, name, None)
            if timer is not None:
                timer.cancel()
                setattr(self, name, None)

    def _timed_out(self, reason: str) -> None:
        if reason == "head_timeout":
            self._head_timer = None
        else:
            self._request_timer = None
        self._drop(reason)


def protocol_class(
    request_timeout_s: float,
    *,
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> type[DeadlineH11Protocol]:
    """A DeadlineH11Protocol subclass with these limits (uvicorn takes a class, not an instance)."""
    return type(
        "SidecarH11Protocol",
        (DeadlineH11Protocol,),
        {
            "request_timeout_s": float(request_timeout_s),
            "head_timeout_s": float(min(head_timeout_s, request_timeout_s)),
            "max_connections": int(max_connections),
        },
    )


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> uvicorn.Config:
    """The uvicorn.Config the sidecar runs with (one worker, loopback by default).

    uvicorn's own ``limit_concurrency`` is off: it counted half-open connections. The connection
    cap is the protocol's (evicting), the request cap AdmissionMiddleware's (reserving)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        workers=1,
        http=protocol_class(request_timeout_s, head_timeout_s=head_timeout_s, max_connections=max_connections),
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=int(max(1, keep_alive_s)),
        limit_concurrency=None,
        backlog=max(2048, 2 * max_connections),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        access_log=False,
    )
