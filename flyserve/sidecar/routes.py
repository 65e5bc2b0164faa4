"""The sidecar's routes: stats (read-only, open), thresholds (mutations behind the bearer token), ops.

Handlers are plain ``def`` where they do file I/O (FastAPI runs them in its thread pool, so a
slow state directory never blocks the event loop); the SSE stream is async and checks for
shutdown and client disconnect between events.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import anyio
from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from flyserve.control import ChangeResult, ControlPlane
from flyserve.policy.errors import MAX_MESSAGE_CHARS
from flyserve.policy.thresholds import Thresholds, ThresholdsError
from flyserve.sidecar.advice_fit import AdviceResult
from flyserve.sidecar.advice_worker import FitWorker
from flyserve.sidecar.auth import require_token
from flyserve.sidecar.live_costs import REGRET_WINDOWS
from flyserve.sidecar.models import (
    Advice,
    AdvicePatch,
    AdviceSampleRank,
    AdviceShape,
    ChangeResponse,
    DispatchStats,
    ErrorDetail,
    Health,
    History,
    Readiness,
    RegretWindow,
    RestartAdvice,
    RollbackRequest,
    RoutingChange,
    ThresholdsView,
)
from flyserve.sidecar.regret import RegretSummary
from flyserve.sidecar.sample_evidence import Evidence
from flyserve.sidecar.server import stream_connection
from flyserve.sidecar.service import StatsService
from flyserve.sidecar.stream import StreamHub, StreamsFull
from flyserve.sidecar.thresholds_view import history_view, thresholds_view
from flyserve.telemetry.shape_sample import read_shape_samples, routing_change
from flyserve.terminal.printable import printable

T = TypeVar("T")
STREAM_RETRY_AFTER_MAX_S = 10
"""The longest Retry-After a refused stream is given, whatever interval it asked for."""

router = APIRouter(
    responses={422: {"model": ErrorDetail, "description": "Invalid input: names the field and the reason."}}
)

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorDetail, "description": "The body is not JSON."},
    401: {"model": ErrorDetail, "description": "No bearer token."},
    403: {"model": ErrorDetail, "description": "Wrong bearer token, or mutations disabled."},
    409: {"model": ErrorDetail, "description": "If-Match names a version that is no longer current."},
    413: {"model": ErrorDetail, "description": "Request body too large."},
    422: {"model": ErrorDetail, "description": "Invalid input: names the field and the reason."},
    503: {"model": ErrorDetail, "description": "The state directory could not be written."},
}


def _service(request: Request) -> StatsService:
    return request.app.state.stats


def _plane(request: Request) -> ControlPlane:
    return request.app.state.control


Actor = Annotated[str, Depends(require_token)]
DryRun = Annotated[bool, Query(description="Validate and report the diff and routing change; apply nothing.")]
IfMatch = Annotated[
    str | None,
    Header(
        alias="If-Match",
        pattern=r'^\s*(\*|(W/)?"?[0-9]{1,18}"?)\s*$',
        description="The version the change is based on (from GET /thresholds or its ETag); 409 if stale.",
    ),
]


def parse_if_match(value: str | None) -> int | None:
    """``3``, ``"3"`` or ``W/"3"`` -> 3; ``*`` or absent -> None; anything else is a 422 on If-Match."""
    if value is None:
        return None
    v = value.strip()
    if v == "*":
        return None
    v = v.removeprefix("W/").strip('"')
    if not v.isdigit():
        raise ThresholdsError([("If-Match", f"must be a thresholds version number, got {value!r}")])
    return int(v)


def _thresholds_body_schema(nullable: bool) -> dict[str, Any]:
    props = Thresholds.model_json_schema()["properties"]
    if nullable:
        props = {
            k: {
                "anyOf": [v, {"type": "null"}],
                **({"description": v["description"]} if "description" in v else {}),
            }
            for k, v in props.items()
        }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"type": "object", "properties": props, "additionalProperties": False}
                }
            },
        }
    }


# ----------------------------------------------------------------------------- stats


@router.get("/dispatch-stats", response_model=DispatchStats, tags=["stats"])
def dispatch_stats(request: Request) -> Response:
    """Decisions by path and reason, prefill ratio (total and 60s/300s/900s windows), tokens and rows
    per path, sampled kernel time, LPT share, the thresholds in force, and every rank's state."""
    # Pre-serialised once per computation (stats TTL); FastAPI's per-request re-validation of a
    # 10 kB model would cost more than serving it.
    return Response(_service(request).dispatch_stats_json(), media_type="application/json")


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


# ----------------------------------------------------------------------------- thresholds


@router.get("/thresholds", response_model=ThresholdsView, tags=["thresholds"])
def get_thresholds(request: Request, response: Response) -> ThresholdsView:
    """The thresholds in force (the published snapshot). ETag is the version, for If-Match."""
    view = thresholds_view(_service(request).snapshot())
    response.headers["ETag"] = f'"{view.version}"'
    return view


@router.get("/thresholds/history", response_model=History, tags=["thresholds"])
def get_history(
    request: Request, limit: Annotated[int, Query(ge=1, le=1000, description="Newest N versions.")] = 50
) -> History:
    """Kept versions, oldest first (rollback targets)."""
    return history_view(_plane(request).history(limit))


def _respond(request: Request, result: ChangeResult, dry_run: bool) -> ChangeResponse:
    rc = None
    if dry_run:
        settings = request.app.state.settings
        current = _service(request).snapshot().thresholds
        samples = read_shape_samples(
            settings.state_dir, limit=settings.dry_run_shape_limit, live=_service(request).live_rank_keys()
        )
        rc = RoutingChange(**routing_change(samples, current, result.snapshot.thresholds))
    else:
        request.app.state.stats.invalidate()
        request.app.state.advice_worker.invalidate()
    return ChangeResponse(
        dry_run=dry_run,
        changed=result.changed,
        diff={k: [a, b] for k, (a, b) in result.diff.items()},
        thresholds=thresholds_view(result.snapshot),
        routing_change=rc,
    )


def _limiter(request: Request, name: str, tokens: int) -> anyio.CapacityLimiter:
    """A capacity limiter of this app's, made on first use (an anyio limiter needs the running loop)."""
    attr = f"{name}_limiter"
    lim = getattr(request.app.state, attr, None)
    if lim is None:
        lim = anyio.CapacityLimiter(tokens)
        setattr(request.app.state, attr, lim)
    return lim


async def _change_thread(request: Request, fn: Callable[[], T]) -> T:
    """Run a change (file I/O under the control plane's lock) on a worker thread of its own limiter:
    a flood of slow anonymous reads that takes every slot of FastAPI's shared pool (40) must not
    make a change with the token wait."""
    return await anyio.to_thread.run_sync(fn, limiter=_limiter(request, "change", 4))


_MUTATION = {"response_model": ChangeResponse, "responses": _ERRORS, "tags": ["thresholds"]}


@router.put("/thresholds", openapi_extra=_thresholds_body_schema(False), **_MUTATION)
async def put_thresholds(
    request: Request,
    actor: Actor,
    body: Annotated[dict[str, Any], Body()],
    if_match: IfMatch = None,
    dry_run: DryRun = False,
) -> ChangeResponse:
    """Replace the whole override layer: keys left out fall back to the config file, then the profile."""

    def run() -> ChangeResponse:
        r = _plane(request).replace(
            body, actor=actor, source="api", if_match=parse_if_match(if_match), dry_run=dry_run
        )
        return _respond(request, r, dry_run)

    return await _change_thread(request, run)


@router.patch("/thresholds", openapi_extra=_thresholds_body_schema(True), **_MUTATION)
async def patch_thresholds(
    request: Request,
    actor: Actor,
    body: Annotated[dict[str, Any], Body()],
    if_match: IfMatch = None,
    dry_run: DryRun = False,
) -> ChangeResponse:
    """Set some overrides; a key set to null drops its override (JSON merge-patch style)."""

    def run() -> ChangeResponse:
        r = _plane(request).apply_overrides(
            body, actor=actor, source="api", if_match=parse_if_match(if_match), dry_run=dry_run
        )
        return _respond(request, r, dry_run)

    return await _change_thread(request, run)


@router.post("/thresholds/rollback", **_MUTATION)
async def rollback_thresholds(
    request: Request,
    actor: Actor,
    body: RollbackRequest,
    if_match: IfMatch = None,
    dry_run: DryRun = False,
) -> ChangeResponse:
    """Publish a new version whose values equal an earlier one's (see /thresholds/history)."""

    def run() -> ChangeResponse:
        r = _plane(request).rollback(
            body.version, actor=actor, if_match=parse_if_match(if_match), dry_run=dry_run
        )
        return _respond(request, r, dry_run)

    return await _change_thread(request, run)


@router.post("/reload", **_MUTATION)
async def reload_config(
    request: Request, actor: Actor, if_match: IfMatch = None, dry_run: DryRun = False
) -> ChangeResponse:
    """Re-read the operator config file and publish it (what SIGHUP or a file edit would do)."""

    # Counted in flyserve_config_reloads_total by the control plane.
    def run() -> ChangeResponse:
        r = _plane(request).reload(actor=actor, if_match=parse_if_match(if_match), dry_run=dry_run)
        return _respond(request, r, dry_run)

    return await _change_thread(request, run)


@dataclass(frozen=True, slots=True)
class FittedAdvice:
    """One advice fit: what it returned and the thresholds version it was fitted against."""

    result: AdviceResult
    version: int
    evidence: Evidence | None = None


class UncorroboratedSamples(Exception):
    """The window's samples are not what their ranks' decision counters counted: no fit (409,
    field ``samples``)."""

    def __init__(self, evidence: Evidence) -> None:
        super().__init__(evidence.reason)
        self.evidence = evidence


def compute_advice(service: StatsService, window: str) -> FittedAdvice:
    """The fit itself (on the advice worker's thread, flyserve.sidecar.advice_worker): read and
    price the new shape samples, check them against the ranks' decision counters, then fit.
    ValueError: nothing to fit (the route's 409); UncorroboratedSamples: samples refused (409)."""
    assert service.pricing is not None
    service.price_new_samples()
    snap = service.snapshot()
    # Before any fit (the expensive part): are the window's samples what the ranks counted?
    evidence = service.sample_evidence(
        (p.sample for p in service.pricing.window(REGRET_WINDOWS[window])), REGRET_WINDOWS[window]
    )
    if not evidence.corroborated:
        raise UncorroboratedSamples(evidence)
    try:
        res = service.pricing.advise(
            snap.thresholds, window_s=REGRET_WINDOWS[window], max_shapes=service.settings.advice_shape_limit
        )
    except ValueError as exc:
        why = service.pricing.unpriceable
        raise ValueError(f"{exc}" + (f" ({why})" if why else "")) from None
    return FittedAdvice(res, snap.version, evidence)


def _render_limiter(request: Request) -> anyio.CapacityLimiter:
    """Turning a fit into the response (up to 10,000 listed shapes) takes a thread of its own, one
    at a time: never the event loop, never a slot of FastAPI's shared pool."""
    return _limiter(request, "advice_render", 1)


@router.get(
    "/thresholds/advice",
    response_model=Advice,
    tags=["thresholds"],
    responses={
        409: {
            "model": ErrorDetail,
            "description": "No cost table (--costs), nothing priced yet, or (field `samples`) the window's "
            "samples are not corroborated by the ranks' decision counters.",
        },
        503: {"model": ErrorDetail, "description": "No fit finished yet within the deadline; Retry-After."},
    },
)
async def get_advice(
    request: Request,
    window: Annotated[
        str, Query(pattern=r"^(60s|900s)$", description="Which window's sampled shapes to fit: 60s or 900s.")
    ] = "900s",
    shapes: Annotated[int, Query(ge=0, le=10_000, description="Newest fitted shapes to list.")] = 100,
) -> Any:
    """Threshold values that would have routed this window's sampled batches best (calibrate's fitter
    on live shapes priced by the cost table), routed/oracle before and after, and the PATCH that
    applies them. Applying stays an operator action; decode_path is never proposed.

    Fitted on the sidecar's advice worker, one fit at a time, reused while fresh; a fit that takes
    longer than the deadline (2 s) gets the last result marked ``stale: true``, or 503 with
    Retry-After when there is none yet."""
    service = _service(request)
    if service.pricing is None:
        return _conflict("the sidecar was started without --costs: nothing to price advice with", "costs")
    worker: FitWorker[str, FittedAdvice] = request.app.state.advice_worker
    got = await worker.get(window)
    if got is None:
        return JSONResponse(
            {"detail": "advice is being computed; retry shortly", "field": None, "errors": []},
            status_code=503,
            headers={"Retry-After": str(max(1, math.ceil(worker.deadline_s)))},
        )
    if isinstance(got.error, UncorroboratedSamples):
        ev = got.error.evidence
        # the ranks' refusals quote what their shape files and reports hold: escaped and bounded
        detail = None if ev.reason is None else printable(ev.reason, MAX_MESSAGE_CHARS)
        return JSONResponse({"detail": detail, "field": "samples", "samples": ev.to_json()}, status_code=409)
    if isinstance(got.error, ValueError):
        return _conflict(str(got.error), "window")
    if got.error is not None or got.value is None:
        return JSONResponse(
            {"detail": "advice computation failed; see the sidecar log", "field": None, "errors": []},
            status_code=503,
            headers={"Retry-After": str(max(1, math.ceil(worker.fresh_s)))},
        )
    fitted, age = got.value, got.age_s(time.monotonic())

    def render() -> bytes:
        view = advice_view(
            fitted.result, window, fitted.version, shapes, fitted.evidence, stale=got.stale, age_s=age
        )
        return view.model_dump_json().encode()

    body = await anyio.to_thread.run_sync(render, limiter=_render_limiter(request))
    return Response(body, media_type="application/json")


def _conflict(detail: str, field: str) -> JSONResponse:
    return JSONResponse({"detail": printable(detail, MAX_MESSAGE_CHARS), "field": field}, status_code=409)


def _window_view(s: RegretSummary) -> RegretWindow:
    return RegretWindow(**s.to_json())


def advice_view(
    res: AdviceResult,
    window: str,
    version: int,
    shapes: int,
    evidence: Evidence | None = None,
    *,
    stale: bool = False,
    age_s: float = 0.0,
) -> Advice:
    changes = res.changes
    body = {k: new for k, (_old, new) in changes.items()}
    listed = res.samples[-shapes:] if shapes else []
    offset = len(res.samples) - len(listed)
    return Advice(
        window=window,
        samples=len(res.samples),
        thresholds_version=version,
        changes={k: [a, b] for k, (a, b) in changes.items()},
        before=_window_view(res.before),
        after=_window_view(res.after),
        patch=AdvicePatch(headers={"If-Match": f'"{version}"'}, body=body) if body else None,
        shapes_total=len(res.samples),
        shapes=[
            AdviceShape(
                engine=p.sample.engine,
                step=p.sample.step,
                query_lens=list(p.sample.query_lens),
                seq_lens=list(p.sample.seq_lens or ()),
                unified_ms=p.unified_s * 1e3,
                prefill_ms=p.prefill_s * 1e3,
                before=res.paths_before[offset + i],
                after=res.paths_after[offset + i],
            )
            for i, p in enumerate(listed)
        ],
        restart=[RestartAdvice(**r.to_json()) for r in res.restart],
        sample_ranks=[AdviceSampleRank(**r.to_json()) for r in evidence.ranks] if evidence else [],
        stale=stale,
        age_s=round(age_s, 3),
    )


# ----------------------------------------------------------------------------- ops


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
    return await anyio.to_thread.run_sync(lambda: _readiness(request), limiter=_limiter(request, "probe", 4))


def _readiness(request: Request) -> JSONResponse:
    settings = request.app.state.settings
    readable = settings.state_dir.is_dir()
    try:
        next(iter(settings.state_dir.iterdir()), None)
    except OSError:
        readable = False
    views = [v for v in _service(request).rank_views_only() if not v.stale] if readable else []
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
