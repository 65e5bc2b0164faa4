"""The mutations of the thresholds (bearer token): PUT and PATCH /thresholds, POST
/thresholds/rollback, POST /reload. Each runs through the control plane (validated, versioned,
audited) on a worker thread of its own; ``?dry_run=true`` also replays the recently sampled shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import Body, Depends, Header, Query, Request

from flyserve.control import ChangeResult, ControlPlane
from flyserve.policy.thresholds import Thresholds, ThresholdsError
from flyserve.sidecar.auth import require_token
from flyserve.sidecar.models import ChangeResponse, ErrorDetail, RollbackRequest, RoutingChange
from flyserve.sidecar.routes.deps import INVALID_INPUT, control_plane, limiter, resource_router, stats_service
from flyserve.sidecar.thresholds_view import thresholds_view
from flyserve.telemetry.shape_sample import read_shape_samples, routing_change

router = resource_router()

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorDetail, "description": "The body is not JSON."},
    401: {"model": ErrorDetail, "description": "No bearer token."},
    403: {"model": ErrorDetail, "description": "Wrong bearer token, or mutations disabled."},
    409: {"model": ErrorDetail, "description": "If-Match names a version that is no longer current."},
    413: {"model": ErrorDetail, "description": "Request body too large."},
    422: INVALID_INPUT,
    503: {"model": ErrorDetail, "description": "The state directory could not be written."},
}


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


@dataclass(frozen=True, slots=True)
class ChangeOptions:
    """What every change takes besides its body: the version it is based on (If-Match, parsed on the
    change's thread), and whether it only reports (``?dry_run=true``)."""

    if_match: str | None
    dry_run: bool


def _change_options(if_match: IfMatch = None, dry_run: DryRun = False) -> ChangeOptions:
    return ChangeOptions(if_match, dry_run)


Options = Annotated[ChangeOptions, Depends(_change_options)]


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


def _respond(request: Request, result: ChangeResult, dry_run: bool) -> ChangeResponse:
    rc = None
    if dry_run:
        settings = request.app.state.settings
        current = stats_service(request).snapshot().thresholds
        samples = read_shape_samples(
            settings.state_dir,
            limit=settings.dry_run_shape_limit,
            live=stats_service(request).live_rank_keys(),
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


async def _change(
    request: Request, options: ChangeOptions, change: Callable[[ControlPlane, int | None], ChangeResult]
) -> ChangeResponse:
    """Run a change (file I/O under the control plane's lock) on a worker thread of its own limiter:
    a flood of slow anonymous reads that takes every slot of FastAPI's shared pool (40) must not
    make a change with the token wait. ``change`` gets the plane and the If-Match version."""

    def run() -> ChangeResponse:
        version = parse_if_match(options.if_match)
        return _respond(request, change(control_plane(request), version), options.dry_run)

    return await anyio.to_thread.run_sync(run, limiter=limiter(request, "change", 4))


_MUTATION: dict[str, Any] = {"response_model": ChangeResponse, "responses": ERRORS, "tags": ["thresholds"]}


def _overrides_route(
    method: str, change: Callable[..., ChangeResult], *, nullable: bool, name: str, description: str
) -> None:
    """PUT and PATCH /thresholds: the same parameters, the body handed to ``change`` (ControlPlane.
    replace or apply_overrides); ``name`` is the operation's (its OpenAPI operationId's stem)."""

    async def change_overrides(
        request: Request,
        actor: Actor,
        body: Annotated[dict[str, Any], Body()],
        options: Options,
    ) -> ChangeResponse:
        return await _change(
            request,
            options,
            lambda plane, version: change(
                plane, body, actor=actor, source="api", if_match=version, dry_run=options.dry_run
            ),
        )

    router.add_api_route(
        "/thresholds",
        change_overrides,
        methods=[method],
        name=name,
        description=description,
        openapi_extra=_thresholds_body_schema(nullable),
        **_MUTATION,
    )


_overrides_route(
    "PUT",
    ControlPlane.replace,
    nullable=False,
    name="put_thresholds",
    description="Replace the whole override layer: keys left out fall back to the config file, then the profile.",
)
_overrides_route(
    "PATCH",
    ControlPlane.apply_overrides,
    nullable=True,
    name="patch_thresholds",
    description="Set some overrides; a key set to null drops its override (JSON merge-patch style).",
)


@router.post("/thresholds/rollback", **_MUTATION)
async def rollback_thresholds(
    request: Request,
    actor: Actor,
    body: RollbackRequest,
    options: Options,
) -> ChangeResponse:
    """Publish a new version whose values equal an earlier one's (see /thresholds/history)."""
    return await _change(
        request,
        options,
        lambda plane, version: plane.rollback(
            body.version, actor=actor, if_match=version, dry_run=options.dry_run
        ),
    )


@router.post("/reload", **_MUTATION)
async def reload_config(request: Request, actor: Actor, options: Options) -> ChangeResponse:
    """Re-read the operator config file and publish it (what SIGHUP or a file edit would do)."""
    # Counted in flyserve_config_reloads_total by the control plane.
    return await _change(
        request,
        options,
        lambda plane, version: plane.reload(actor=actor, if_match=version, dry_run=options.dry_run),
    )
