"""The engine channel's view in /dispatch-stats: its pusher, every engine and worker (any node)."""

from __future__ import annotations

from pydantic import Field

from flyserve.sidecar.models.base import FrozenModel


class ChannelWorkerView(FrozenModel):
    """One worker as its last report through the engine channel gave it (any node)."""

    rank: int
    engine: int | None
    host: str | None = Field(description="The worker's host name: which node it runs on.")
    pid: int | None
    step: int | None = Field(description="Its engine's last step it ran.")
    applied_version: int | None
    applied_step: int | None = Field(description="The step its applied version is in force from.")
    control_mode: str | None
    steps_per_s: float | None
    decisions: dict[str, float] = Field(description="Its dispatch decisions per path so far.")
    impossible: bool = Field(
        False,
        description="Its applied_version is above the control plane's current version: a version never "
        "issued (a forged or corrupt status).",
    )
    verified: bool = Field(
        False,
        description="A live rank report of this node (ranks/*.json) names this engine and rank (and host, "
        "where both name one). Workers on other nodes are never verified here: only a claim.",
    )


class ChannelEngineView(FrozenModel):
    """One engine (a DP rank: its own scheduler and step counter) as the engine channel sees it."""

    engine: int
    confirmed_version: int | None = Field(description="The newest version every worker of it confirmed.")
    from_step: int | None = Field(
        description="The engine step that version is in force from, on all its workers."
    )
    unconfirmed: list[int] = Field(description="Versions pushed to it that it has not confirmed yet.")
    error: str | None = Field(description="Why its last push or report failed; null when none did.")
    workers: list[ChannelWorkerView]
    impossible: bool = Field(
        False,
        description="A version it claims (confirmed, unconfirmed, a worker's applied one) is above the "
        "control plane's current version.",
    )
    confirmed: bool = Field(
        False,
        description="confirmed_version counts as a confirmation: the status is fresh, the version one the "
        "control plane issued, and the file claims no impossible version anywhere.",
    )
    verified: bool = Field(
        False,
        description="A live rank report of this node (ranks/*.json) is of this engine. Engines on other "
        "nodes are never verified here (their reports are in their own node's state directory).",
    )
    workers_left_out: int = Field(
        0, description="Worker entries not shown: malformed, or over the caps (256 per engine, 1024 in all)."
    )


class ChannelView(FrozenModel):
    """The engine channel's pusher (vLLM's API server on the head node): every engine, every node."""

    pid: int | None
    age_s: float | None = Field(description="Seconds since the pusher last wrote its status.")
    pushed_version: int | None = Field(description="The newest version every engine confirmed.")
    pushes: int
    split_steps: int = Field(
        description="Versions some engine's workers applied at different steps (must be 0)."
    )
    errors: int
    last_error: str | None
    engines: list[ChannelEngineView]
    time: float | None = Field(
        None, description="The status file's own time: when its writer says it wrote it (a claim)."
    )
    future: bool = Field(
        False,
        description="That time is more than 2 s ahead of this sidecar's clock: age_s is null (never 0) "
        "and the status is stale.",
    )
    stale: bool = Field(
        False,
        description="No usable time, a future one, or age_s over stale_after_s: the pusher is not known "
        "to be writing it; nothing in it counts as confirmed.",
    )
    stale_after_s: float = Field(15.0, description="The age over which the status is stale.")
    reported_at: float | None = Field(
        None, description="When the workers' reports in it were fetched, as the file claims."
    )
    reports_age_s: float | None = Field(
        None, description="Seconds since reported_at; null with none or one in the future."
    )
    reports_future: bool = False
    reports_stale: bool = Field(
        False, description="The workers' reports are older than stale_after_s, absent, or dated ahead."
    )
    control_version: int | None = Field(
        None,
        description="The control plane's current version (control/current.json), read after the status: "
        "no honest status claims a version above it. Null when it could not be read.",
    )
    pushed_confirmed: bool = Field(
        False,
        description="pushed_version counts as every engine's confirmation: the status fresh, the version "
        "at most control_version, no impossible claim in the file.",
    )
    impossible: list[str] = Field(
        default_factory=list,
        description="The claims above control_version, named (at most 32; impossible_count has them all).",
    )
    impossible_count: int = 0
    unverified_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts the status names that no live rank report of this node names (at most 32): "
        "other nodes, or nodes that do not exist.",
    )
    engines_left_out: int = Field(
        0, description="Engine entries not shown: malformed, repeated, or over the cap (256)."
    )
    workers_left_out: int = Field(0, description="Worker entries not shown, over the engines shown.")
