"""The thresholds resource: the snapshot in force, its history, and what a change answers."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flyserve.sidecar.models.base import FrozenModel, ThresholdValue


class KeyProvenance(FrozenModel):
    """A key whose value differs from the profile's default, and which layer set it."""

    value: ThresholdValue
    default: ThresholdValue = Field(description="The profile's value for this key.")
    provenance: str = Field(description="'file' (operator config file) or 'override' (API/CLI).")


class ThresholdsView(FrozenModel):
    """The thresholds in force, as published by the control plane."""

    version: int
    sha256: str
    source: str = Field(description="default | file | api | cli | rollback | autopilot")
    actor: str | None = None
    time: float | None = Field(None, description="Unix time of the change.")
    effective_step: int = Field(description="Engine step at which ranks switch to this version.")
    profile: str
    circuit_open: bool = False
    values: dict[str, ThresholdValue]
    overrides: dict[str, ThresholdValue] = Field(default_factory=dict)
    differs_from_profile: dict[str, KeyProvenance] = Field(
        default_factory=dict, description="Keys whose value is not the profile's, with the layer that set it."
    )


class RoutingChange(FrozenModel):
    """What a dry-run change would do to the recent batch shapes the ranks sampled."""

    samples: int = Field(description="Recent shapes replayed through decide().")
    current: dict[str, int] = Field(description="Batches per path with the thresholds in force.")
    proposed: dict[str, int] = Field(description="Batches per path with the proposed thresholds.")
    prefill_ratio_current: float | None
    prefill_ratio_proposed: float | None
    changed: int = Field(description="Samples whose path or reason would change.")
    transitions: dict[str, int] = Field(
        description='"path/reason -> path/reason": count, for the samples that change.'
    )


class ChangeResponse(FrozenModel):
    """The answer to a mutation (or its dry run)."""

    dry_run: bool
    changed: bool
    diff: dict[str, list[Any]] = Field(description="{key: [old, new]} of the effective values.")
    thresholds: ThresholdsView = Field(description="The resulting snapshot (the would-be one for a dry run).")
    routing_change: RoutingChange | None = Field(None, description="Dry runs only.")


class HistoryEntry(FrozenModel):
    version: int
    sha256: str
    source: str
    actor: str | None = None
    time: float | None = None
    effective_step: int | None = None
    overrides: dict[str, ThresholdValue] = Field(default_factory=dict)


class History(FrozenModel):
    entries: list[HistoryEntry]


class RollbackRequest(BaseModel):
    # strict: {"version": true} used to be read as version 1, {"version": "2"} as 2
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    version: int = Field(ge=0, le=1 << 62, description="The version to return to (from /thresholds/history).")
