"""Two pure-ASGI middlewares: a request-body size limit (413) and the sidecar's own request metrics.

Pure ASGI rather than BaseHTTPMiddleware: they must not buffer a streaming response
(/dispatch-stats/stream) and they run on every request, so they stay small.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flyserve.telemetry import metrics as tm

STREAM_ROUTES = frozenset({"/dispatch-stats/stream"})


class BodyTooLarge(Exception):
    pass


async def _send_413(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"request body larger than {limit} bytes", "field": "<body>"}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: by Content-Length up front, or while a chunked body arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    too_big = int(v) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await _send_413(send, self.max_bytes)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _send_413(send, self.max_bytes)


class RequestMetricsMiddleware:
    """flyserve_sidecar_requests_total{route,method,code} and flyserve_sidecar_request_seconds{route}.

    ``route`` is the matched route template (never the raw path: bounded label values); unmatched
    paths count as "<unmatched>". For the SSE stream the time is to the response start, not the
    stream's whole life.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status: list[Any] = [500, None]  # code, time to response start

        async def send_wrapper(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
                status[1] = time.perf_counter() - t0
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "<unmatched>"
            elapsed = (
                status[1]
                if template in STREAM_ROUTES and status[1] is not None
                else (time.perf_counter() - t0)
            )
            tm.SIDECAR_REQUESTS.labels(template, scope.get("method", ""), str(status[0])).inc()
            tm.SIDECAR_REQUEST_SECONDS.labels(template).observe(elapsed)
