"""The sidecar's uvicorn server, hardened against slow, half-open and greedy clients.

uvicorn closes idle keep-alive connections but has no deadline for a request's head or body: 1,100
connections that each sent half a request line kept /healthz down for 25 s at ``ulimit -n 1024``.
And its connection cap counts connections that never finished their head: about 530 half-open
unauthenticated connections made every request, /healthz included, answer 503, which in Kubernetes
failed the probes of the pod that serves vLLM. Here:

* a request head must arrive whole within ``head_timeout_s`` (5 s) of the connection (or of the
  previous response), and the whole request within ``request_timeout_s`` (10 s);
* at ``max_connections`` a new connection evicts the oldest one still waiting for its head (a
  half-open one, or an idle keep-alive); only when every connection is inside a request is the
  new one refused (closed at once). A flood of half-open connections therefore cannot keep a
  prober out: each new connection displaces the oldest, and a probe sends its head at once;
* requests over the cap are shed with 503 by AdmissionMiddleware, except the ones that matter
  (/healthz, /readyz, changes with the valid token);
* a stream the stream hub reclaims (a client that does not read: flyserve.sidecar.stream) is
  aborted here, through ``stream_connection``: its queued bytes discarded (SO_LINGER 0: a reset,
  not a FIN the kernel would retry against a zero window for minutes) and its socket closed now.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
import time
from collections.abc import Mapping
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


_OPEN: dict[tuple[Any, Any], DeadlineH11Protocol] = {}
"""Open connections by (server address, client address): how a route finds its own connection
(an ASGI scope carries both addresses, not the transport). One process may run several servers
(tests); their server addresses differ."""

_TIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None)
"""Linux: bytes a socket holds unsent or unacknowledged (the client has not made room for them)."""


class StreamConnection:
    """A stream's connection as the stream hub sees it (flyserve.sidecar.stream.Connection)."""

    def __init__(self, protocol: DeadlineH11Protocol) -> None:
        self._protocol = protocol

    def queued_bytes(self) -> int | None:
        """The transport's buffer plus the kernel's send queue (None where neither can be read)."""
        transport = self._protocol.transport
        if transport.is_closing():
            return None
        queued = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if sock is None or _TIOCOUTQ is None:
            return queued
        try:
            return queued + struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            return queued

    def abort(self) -> None:
        """Close now, discarding what is queued: the client did not read it and never will."""
        self._protocol.abort_stream()


def stream_connection(scope: Mapping[str, Any]) -> StreamConnection | None:
    """The connection serving this request's scope, when this module's protocol serves it."""
    server, client = scope.get("server"), scope.get("client")
    if server is None or client is None:
        return None
    p = _OPEN.get((tuple(server), tuple(client)))
    return None if p is None or p.transport.is_closing() else StreamConnection(p)


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
        self._open_key = self._key()
        if self._open_key is not None:
            _OPEN[self._open_key] = self
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
        key = getattr(self, "_open_key", None)
        if key is not None and _OPEN.get(key) is self:
            del _OPEN[key]
        super().connection_lost(exc)

    def _key(self) -> tuple[Any, Any] | None:
        """(server address, client address) as uvicorn puts them in the scope; None on a socket
        that has none (a Unix socket: no stream of it can be aborted by address)."""
        if not self.server or not self.client:
            return None
        return (tuple(self.server), tuple(self.client))

    def abort_stream(self) -> None:
        """Reset the connection now (the stream hub reclaimed its slot): a send blocked on it returns."""
        self._cancel()
        self._waiting_since = None
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

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
            self._request_timer = self.loop.call_later(
                self.request_timeout_s, self._timed_out, "request_timeout"
            )
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
        http=protocol_class(
            request_timeout_s, head_timeout_s=head_timeout_s, max_connections=max_connections
        ),
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=int(max(1, keep_alive_s)),
        limit_concurrency=None,
        backlog=max(2048, 2 * max_connections),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        access_log=False,
    )
