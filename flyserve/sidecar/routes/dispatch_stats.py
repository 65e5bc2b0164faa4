"""GET /dispatch-stats and its SSE stream: decisions, windows, kernels, ranks (read-only, open)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from flyserve.sidecar.models import DispatchStats
from flyserve.sidecar.routes.deps import resource_router, stats_service
from flyserve.sidecar.server import stream_connection
from flyserve.sidecar.stream import StreamHub, StreamsFull

STREAM_RETRY_AFTER_MAX_S = 10
"""The longest Retry-After a refused stream is given, whatever interval it asked for."""

router = resource_router()


@router.get("/dispatch-stats", response_model=DispatchStats, tags=["stats"])
def dispatch_stats(request: Request) -> Response:
    """Decisions by path and reason, prefill ratio (total and 60s/300s/900s windows), tokens and rows
    per path, sampled kernel time, LPT share, the thresholds in force, and every rank's state."""
    # Pre-serialised once per computation (stats TTL); FastAPI's per-request re-validation of a
    # 10 kB model would cost more than serving it.
    return Response(stats_service(request).dispatch_stats_json(), media_type="application/json")


@router.get(
    "/dispatch-stats/stream",
    tags=["stats"],
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "SSE: one `stats` event per interval."}
    },
)
async def dispatch_stats_stream(
    request: Request,
    interval: Annotated[
        float | None, Query(gt=0, le=3600, description="Seconds between events (default: the sidecar's).")
    ] = None,
    max_events: Annotated[int | None, Query(ge=1, le=1_000_000, description="Stop after this many.")] = None,
) -> StreamingResponse:
    """Server-sent events: the /dispatch-stats payload every few seconds (never more often than the
    sidecar's --stream-min-interval; every client shares one computed payload per tick). Ends on
    shutdown or disconnect, or when the sidecar reclaims the slot of a client that does not read
    (flyserve.sidecar.stream); at --max-streams a new stream takes the slot of the most-stalled one
    (not draining), else of the oldest one open over --stream-lease (that stream ends: its client
    reconnects), and gets 503 with Retry-After when there is neither."""
    settings = request.app.state.settings
    hub: StreamHub = request.app.state.stream_hub
    every = max(interval or settings.stream_interval_s, settings.stream_min_interval_s)
    shutting_down = request.app.state.shutting_down
    try:
        client = hub.subscribe(stream_connection(request.scope), evictable=True)
    except StreamsFull as exc:
        return JSONResponse(  # type: ignore[return-value]
            {"detail": f"too many streams: {exc}; retry later", "field": None, "errors": []},
            status_code=503,
            # A slot frees when a stream stalls (about a second) or ends: a client asking for
            # ?interval=3600 is not told to wait an hour.
            headers={"Retry-After": str(max(1, min(int(every), STREAM_RETRY_AFTER_MAX_S)))},
        )

    def ended() -> bool:
        return shutting_down.is_set() or client.dropped is not None

    async def events():
        loop = asyncio.get_running_loop()
        sent, last = 0, 0
        try:
            while not ended():
                got = await hub.next(last, timeout_s=0.25)
                if got is None:
                    if await request.is_disconnected():
                        return
                    continue
                if client.dropped is not None:  # reclaimed while it waited
                    return
                last, payload = got
                event = f"event: stats\nid: {sent}\ndata: {payload.decode()}\n\n"
                hub.sending(client, len(event))  # the hub times the write: this yield returns once sent
                yield event
                hub.sent(client)
                sent += 1
                if max_events is not None and sent >= max_events:
                    return
                # Sleep in short slices so a shutdown, a gone client or a reclaim ends it within ~0.25 s.
                deadline = loop.time() + every
                while not ended():
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    if await request.is_disconnected():
                        return
                    await asyncio.sleep(min(0.25, left))
        finally:
            hub.unsubscribe(client)

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
