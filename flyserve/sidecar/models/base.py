"""What every model of the sidecar's JSON shares: frozen values, and the type of a threshold's value."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

ThresholdValue = int | str | bool


class FrozenModel(BaseModel):
    """A response value: built once, never changed while it is served."""

    model_config = ConfigDict(frozen=True)
