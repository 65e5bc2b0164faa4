"""The probes (/healthz, /readyz) and the error body every route answers with."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from flyserve.sidecar.models.base import FrozenModel


class Health(FrozenModel):
    status: str


class Readiness(FrozenModel):
    ready: bool
    state_dir_readable: bool
    live_ranks: int
    detail: str


class ErrorDetail(FrozenModel):
    """422/409/413/503 bodies: which field, and why."""

    detail: str
    field: str | None = None
    errors: list[dict[str, str]] = Field(default_factory=list)
    samples: dict[str, Any] | None = Field(
        None,
        description="Advice's 409 with field `samples` only: the samples used and, per rank, whether "
        "its decision counters corroborate them.",
    )
