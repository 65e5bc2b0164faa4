"""The sidecar's routes, one module per resource: dispatch_stats.py (the payload and its SSE stream,
read-only, open), thresholds.py (the thresholds in force and their history, open), changes.py (the
mutations, behind the bearer token), advice.py (what would have routed the window best), autopilot.py
(the autopilot's status, open; its mode, pause, resume, kill and approve, behind the token), ops.py
(/metrics and the probes). ``router`` holds them all, in that order (the order OpenAPI lists them).

Handlers are plain ``def`` where they do file I/O (FastAPI runs them in its thread pool, so a
slow state directory never blocks the event loop); the SSE stream is async and checks for
shutdown and client disconnect between events.
"""

from __future__ import annotations

from fastapi import APIRouter

from flyserve.sidecar.routes import advice, autopilot, changes, dispatch_stats, ops, thresholds

router = APIRouter()
for _resource in (dispatch_stats, thresholds, changes, advice, autopilot, ops):
    router.include_router(_resource.router)

__all__ = ["router"]
