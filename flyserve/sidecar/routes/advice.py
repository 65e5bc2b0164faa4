"""GET /thresholds/advice: the thresholds that would have routed a window's sampled batches best.

The fit runs on the advice worker (flyserve.sidecar.advice_job, advice_worker); this module turns
its result, or why there is none, into the answer.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

import anyio
from fastapi import Query, Request, Response
from fastapi.responses import JSONResponse

from flyserve.policy.errors import MAX_MESSAGE_CHARS
from flyserve.sidecar.advice_fit import AdviceResult
from flyserve.sidecar.advice_job import FittedAdvice, UncorroboratedSamples
from flyserve.sidecar.advice_worker import FitWorker
from flyserve.sidecar.models import (
    Advice,
    AdvicePatch,
    AdviceSampleRank,
    AdviceShape,
    ErrorDetail,
    RegretWindow,
    RestartAdvice,
)
from flyserve.sidecar.regret import RegretSummary
from flyserve.sidecar.routes.deps import limiter, resource_router, stats_service
from flyserve.sidecar.sample_evidence import Evidence
from flyserve.terminal.printable import printable

router = resource_router()


def _render_limiter(request: Request) -> anyio.CapacityLimiter:
    """Turning a fit into the response (up to 10,000 listed shapes) takes a thread of its own, one
    at a time: never the event loop, never a slot of FastAPI's shared pool."""
    return limiter(request, "advice_render", 1)


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
    service = stats_service(request)
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
