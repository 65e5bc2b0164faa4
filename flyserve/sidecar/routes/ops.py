"""/metrics (every rank's metrics and the sidecar's own), /healthz and /readyz."""

from __future__ import annotations

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from flyserve.sidecar.models import Health, Readiness
from flyserve.sidecar.routes.deps import limiter, resource_router, stats_service

router = resource_router()


@router.get(
    "/metrics", tags=["ops"], response_class=Response, responses={200: {"content": {"text/plain": {}}}}
)
def metrics(request: Request) -> Response:
    """Prometheus exposition: every rank's metrics (multiprocess files) plus the sidecar's own.

    Reused for a short TTL (--metrics-ttl, 1 s): Prometheus scrapes every few seconds, and the
    exposition of 8 ranks' files takes tens of milliseconds of CPU."""
    return Response(request.app.state.metrics_cache.get(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", response_model=Health, tags=["ops"])
async def healthz() -> Health:
    """The process is up and serving. Async on purpose: answered on the event loop, it never waits
    for a worker thread that a flood of slow requests could have taken."""
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, tags=["ops"], responses={503: {"model": Readiness}})
async def readyz(request: Request):
    """Ready when the state directory is readable and at least one rank reports. Once this sidecar
    has confirmed a rank by the process table (its ranks share its pid namespace), only confirmed
    ranks count: fresh reports "from another host", which anyone who can write in ranks/ can
    refresh, do not keep /readyz at 200 after the real ranks are gone. The look
    at the state directory runs on a thread of the probes' own limiter, never behind FastAPI's
    shared pool."""
    return await anyio.to_thread.run_sync(lambda: _readiness(request), limiter=limiter(request, "probe", 4))


def _readiness(request: Request) -> JSONResponse:
    settings = request.app.state.settings
    readable = settings.state_dir.is_dir()
    try:
        next(iter(settings.state_dir.iterdir()), None)
    except OSError:
        readable = False
    views = [v for v in stats_service(request).rank_views_only() if not v.stale] if readable else []
    unconfirmed = 0
    if request.app.state.control.store.confirmed_seen:
        unconfirmed = sum(1 for v in views if v.liveness != "confirmed")
        views = [v for v in views if v.liveness == "confirmed"]
    live = len(views)
    ready = readable and live >= 1
    detail = "ok" if ready else ("state directory not readable" if not readable else "no live rank")
    if not ready and unconfirmed:
        detail += f" ({unconfirmed} unconfirmed report(s): another host or pid namespace, or forgeries)"
    body = Readiness(ready=ready, state_dir_readable=readable, live_ranks=live, detail=detail)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)
