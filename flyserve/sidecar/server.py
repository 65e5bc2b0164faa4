"""The sidecar's uvicorn server, hardened against slow and greedy clients (issue 13, attack 10).

uvicorn closes idle keep-alive connections but has no deadline for a request's head or body: 1,100
connections that each sent half a request line kept /healthz down for 25 s at ``ulimit -n 1024``.
Here a request must arrive whole within ``request_timeout_s`` of its first byte (or of the
connection), the head is capped in size, idle keep-alive connections close after a few seconds,
and the number of connections is capped (over it: an immediate 503, never a queue).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_REQUEST_TIMEOUT_S = 10.0
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_MAX_CONNECTIONS = 512
MAX_HEAD_BYTES = 16 * 1024


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for receiving each whole request (head and body).

    The timer runs while h11 waits for a request's head (IDLE) or body (SEND_BODY) and is cancelled
    once the request is complete; a response in progress (an SSE stream) is never cut.
    """

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._request_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_or_cancel()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm_or_cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel()  # idle between requests: uvicorn's keep-alive timer takes over

    def _arm_or_cancel(self) -> None:
        waiting = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
        if waiting and self._request_timer is None and not self.transport.is_closing():
            self._request_timer = self.loop.call_later(self.request_timeout_s, self._timed_out)
        elif not waiting:
            self._cancel()

    def _cancel(self) -> None:
        timer = getattr(self, "_request_timer", None)
        if timer is not None:
            timer.cancel()
            self._request_timer = None

    def _timed_out(self) -> None:
        self._request_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_class(request_timeout_s: float) -> type[DeadlineH11Protocol]:
    """A DeadlineH11Protocol subclass with this deadline (uvicorn takes a class, not an instance)."""
    return type("SidecarH11Protocol", (DeadlineH11Protocol,), {"request_timeout_s": float(request_timeout_s)})


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> uvicorn.Config:
    """The uvicorn.Config the sidecar runs with (one worker, loopback by default)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        workers=1,
        http=protocol_class(request_timeout_s),
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
        timeout_keep_alive=int(max(1, keep_alive_s)),
        limit_concurrency=max_connections,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        access_log=False,
    )
