"""What every route module shares: the app's objects (FastAPI's app.state, one app per state
directory), per-app thread limiters, and the router every resource starts from."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request

from flyserve.control import ControlPlane
from flyserve.sidecar.models import ErrorDetail
from flyserve.sidecar.service import StatsService

INVALID_INPUT = {"model": ErrorDetail, "description": "Invalid input: names the field and the reason."}


def resource_router() -> APIRouter:
    """A resource's router: every route of it may answer 422 with an ErrorDetail."""
    return APIRouter(responses={422: INVALID_INPUT})


def stats_service(request: Request) -> StatsService:
    return request.app.state.stats


def control_plane(request: Request) -> ControlPlane:
    return request.app.state.control


def limiter(request: Request, name: str, tokens: int) -> anyio.CapacityLimiter:
    """A capacity limiter of this app's, made on first use (an anyio limiter needs the running loop)."""
    attr = f"{name}_limiter"
    lim = getattr(request.app.state, attr, None)
    if lim is None:
        lim = anyio.CapacityLimiter(tokens)
        setattr(request.app.state, attr, lim)
    return lim
