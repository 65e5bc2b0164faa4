"""The autopilot: GET /autopilot (open, like the other reads) and its changes behind the bearer
token: POST /autopilot/mode, /pause, /resume, /kill, /approve/{trial_id}. Each change runs on a
worker thread (it may publish a version under the writers' lock) and answers the new status."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import anyio
from fastapi import Depends, HTTPException, Path, Request

from flyserve.autopilot.inputs import Mode
from flyserve.autopilot.switchback import TRIAL_ID
from flyserve.sidecar.auth import require_token
from flyserve.sidecar.autopilot_runner import AutopilotRunner, UnknownTrial
from flyserve.sidecar.models import AutopilotModeRequest, AutopilotStatus, ErrorDetail
from flyserve.sidecar.routes.deps import INVALID_INPUT, limiter, resource_router

router = resource_router()

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorDetail, "description": "The body is not JSON."},
    401: {"model": ErrorDetail, "description": "No bearer token."},
    403: {"model": ErrorDetail, "description": "Wrong bearer token, or mutations disabled."},
    413: {"model": ErrorDetail, "description": "Request body too large."},
    422: INVALID_INPUT,
    503: {"model": ErrorDetail, "description": "The state directory could not be read or written."},
}
Actor = Annotated[str, Depends(require_token)]
_CHANGE: dict[str, Any] = {"response_model": AutopilotStatus, "responses": ERRORS, "tags": ["autopilot"]}


def _runner(request: Request) -> AutopilotRunner:
    return request.app.state.autopilot


async def _change(request: Request, change: Callable[[AutopilotRunner], None]) -> AutopilotStatus:
    """Run ``change`` on a worker thread of the changes' limiter, then answer the status."""
    runner = _runner(request)

    def run() -> AutopilotStatus:
        change(runner)
        if runner.state.mode is not Mode.OFF:
            runner.start()  # a sidecar started with --autopilot off starts its thread on the first mode
        return AutopilotStatus.model_validate(runner.status())

    return await anyio.to_thread.run_sync(run, limiter=limiter(request, "change", 4))


@router.get("/autopilot", response_model=AutopilotStatus, tags=["autopilot"])
def autopilot_status(request: Request) -> AutopilotStatus:
    """The mode, the running trial (its estimate: negative = the candidate is faster), the proposal
    (advise mode), why no trial started, and the last 20 decisions."""
    return AutopilotStatus.model_validate(_runner(request).status())


@router.post("/autopilot/mode", **_CHANGE)
async def autopilot_mode(request: Request, actor: Actor, body: AutopilotModeRequest) -> AutopilotStatus:
    """Set the mode: to off or advise, a running trial is rolled back and an awaited promotion dropped."""
    return await _change(request, lambda r: r.set_mode(Mode(body.mode)))


@router.post("/autopilot/pause", **_CHANGE)
async def autopilot_pause(request: Request, actor: Actor) -> AutopilotStatus:
    """No new trial until resume; a running trial is rolled back now."""
    return await _change(request, lambda r: r.pause())


@router.post("/autopilot/resume", **_CHANGE)
async def autopilot_resume(request: Request, actor: Actor) -> AutopilotStatus:
    return await _change(request, lambda r: r.resume())


@router.post("/autopilot/kill", **_CHANGE)
async def autopilot_kill(request: Request, actor: Actor) -> AutopilotStatus:
    """The kill switch: mode off, any trial ended, the last operator version published again now."""
    return await _change(request, lambda r: r.kill())


@router.post(
    "/autopilot/approve/{trial_id}",
    **{
        **_CHANGE,
        "responses": {
            **ERRORS,
            404: {"model": ErrorDetail, "description": "No promotion awaits under that id."},
        },
    },
)
async def autopilot_approve(
    request: Request,
    actor: Actor,
    trial_id: Annotated[str, Path(pattern=TRIAL_ID.pattern, max_length=64, description="The trial id.")],
) -> AutopilotStatus:
    """Trial mode: publish the candidate of the promotion awaiting under ``trial_id``."""

    def approve(r: AutopilotRunner) -> None:
        try:
            r.approve(trial_id, actor)
        except UnknownTrial:
            raise HTTPException(404, detail=f"no promotion awaits approval as {trial_id!r}") from None

    return await _change(request, approve)
