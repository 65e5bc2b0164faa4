"""Pure-ASGI middlewares: request-head checks (431, 400), a request-body size limit (413) and JSON
check (flyserve.sidecar.json_body: 400/422 naming the field) and the sidecar's own request metrics.

Pure ASGI rather than BaseHTTPMiddleware: they must not buffer a streaming response
(/dispatch-stats/stream) and they run on every request, so they stay small.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flyserve.sidecar.json_body import check_json_body
from flyserve.telemetry import metrics as tm

STREAM_ROUTES = frozenset({"/dispatch-stats/stream"})


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


MAX_HEAD_BYTES = 16 * 1024
"""A request head (request line and headers) over this is refused with 431 (docs/sidecar.md)."""

SINGLE_HEADERS = (b"authorization", b"if-match")
"""Headers a request may carry once: with two, the first won (right then wrong token -> 200), so
a proxy that appends one could be bypassed."""


async def _send_json(send: Send, status: int, detail: str, field: str) -> None:
    body = json.dumps({"detail": detail, "field": field, "errors": []}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class HeaderGuardMiddleware:
    """431 for a request head over ``max_head_bytes``, 400 for a repeated Authorization or If-Match.

    uvicorn's h11 limit only applies while a head is still incomplete: a 100 KB header that
    arrived in one read was accepted, so the size is checked here too."""

    def __init__(self, app: ASGIApp, max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        self.app, self.max_head_bytes = app, max_head_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string", b"")) + 16
        seen: dict[bytes, int] = {}
        for k, v in headers:
            size += len(k) + len(v) + 4
            if k in SINGLE_HEADERS:
                seen[k] = seen.get(k, 0) + 1
        if size > self.max_head_bytes:
            await _send_json(send, 431, f"request head larger than {self.max_head_bytes} bytes", "<headers>")
            return
        for k, n in seen.items():
            if n > 1:
                name = k.decode().title()
                await _send_json(send, 400, f"header {name} given {n} times; send it once", name)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: by Content-Length up front, or while a chunked body arrives.

    Bodies of POST/PUT/PATCH are read here in full (at most ``max_bytes``, 64 KiB by default) and
    replayed to the app: an error raised inside the app's own body parsing would be turned into a
    400 by FastAPI, so the limit is enforced before the app sees a byte.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
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
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # client went away
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await _send_413(send, self.max_bytes)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        refusal = check_json_body(b"".join(chunks))
        if refusal is not None:
            await _send_json(send, refusal.status, refusal.detail, refusal.field)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


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


RESERVED = frozenset({("GET", "/healthz"), ("GET", "/readyz")})
"""Always admitted: the probes a kubelet or load balancer decides with."""
RESERVED_WITH_TOKEN = frozenset(
    {
        ("PATCH", "/thresholds"),
        ("PUT", "/thresholds"),
        ("POST", "/thresholds/rollback"),
        ("POST", "/reload"),
        ("POST", "/autopilot/kill"),
    }
)
"""Admitted over the cap when they carry the valid bearer token: a change must get through a flood."""


class AdmissionMiddleware:
    """At most ``max_requests`` requests in progress; one more is a 503 (Retry-After: 1) at once,
    never a queue, counted in flyserve_sidecar_shed_requests_total. Probes, and changes that carry
    the valid token (compared in constant time), are always admitted: a flood of anonymous
    requests must never fail the probes or block a threshold change."""

    def __init__(self, app: ASGIApp, max_requests: int, token: bytes | None) -> None:
        self.app, self.max_requests, self.token = app, max_requests, token
        self.in_flight = 0

    def _reserved(self, scope: Scope) -> bool:
        key = (scope.get("method", ""), scope.get("path", ""))
        if key in RESERVED:
            return True
        if key not in RESERVED_WITH_TOKEN or self.token is None:
            return False
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                scheme, _, given = v.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_requests and not self._reserved(scope):
            tm.SIDECAR_SHED_REQUESTS.inc()
            body = json.dumps(
                {
                    "detail": f"more than {self.max_requests} requests in progress; retry",
                    "field": None,
                    "errors": [],
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
