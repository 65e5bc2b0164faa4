"""GET /thresholds and /thresholds/history: the published snapshot and the kept versions (open)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request, Response

from flyserve.sidecar.models import History, ThresholdsView
from flyserve.sidecar.routes.deps import control_plane, resource_router, stats_service
from flyserve.sidecar.thresholds_view import history_view, thresholds_view

router = resource_router()


@router.get("/thresholds", response_model=ThresholdsView, tags=["thresholds"])
def get_thresholds(request: Request, response: Response) -> ThresholdsView:
    """The thresholds in force (the published snapshot). ETag is the version, for If-Match."""
    view = thresholds_view(stats_service(request).snapshot())
    response.headers["ETag"] = f'"{view.version}"'
    return view


@router.get("/thresholds/history", response_model=History, tags=["thresholds"])
def get_history(
    request: Request, limit: Annotated[int, Query(ge=1, le=1000, description="Newest N versions.")] = 50
) -> History:
    """Kept versions, oldest first (rollback targets)."""
    return history_view(control_plane(request).history(limit))
