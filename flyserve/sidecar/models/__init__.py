"""Pydantic response (and request) models: the documented schema of the sidecar's JSON, one module per
resource (thresholds, stats, channel, advice, ops, autopilot).

These are what OpenAPI shows and what the schemathesis fuzz validates responses against;
a field added here is a field every client may rely on.
"""

from __future__ import annotations

from flyserve.sidecar.models.advice import (
    Advice,
    AdvicePatch,
    AdviceSampleRank,
    AdviceShape,
    PathDrift,
    Regret,
    RegretWindow,
    RestartAdvice,
)
from flyserve.sidecar.models.autopilot import (
    AutopilotDecisionView,
    AutopilotExplorationBound,
    AutopilotModeRequest,
    AutopilotStatus,
    AutopilotTrialView,
)
from flyserve.sidecar.models.base import FrozenModel, ThresholdValue
from flyserve.sidecar.models.channel import ChannelEngineView, ChannelView, ChannelWorkerView
from flyserve.sidecar.models.ops import ErrorDetail, Health, Readiness
from flyserve.sidecar.models.stats import (
    DispatchStats,
    EngineStats,
    KernelStats,
    PrefillKernelView,
    RankView,
    Totals,
    Window,
)
from flyserve.sidecar.models.thresholds import (
    ChangeResponse,
    History,
    HistoryEntry,
    KeyProvenance,
    RollbackRequest,
    RoutingChange,
    ThresholdsView,
)

__all__ = [
    "Advice",
    "AdvicePatch",
    "AdviceSampleRank",
    "AdviceShape",
    "AutopilotDecisionView",
    "AutopilotExplorationBound",
    "AutopilotModeRequest",
    "AutopilotStatus",
    "AutopilotTrialView",
    "ChangeResponse",
    "ChannelEngineView",
    "ChannelView",
    "ChannelWorkerView",
    "DispatchStats",
    "EngineStats",
    "ErrorDetail",
    "FrozenModel",
    "Health",
    "History",
    "HistoryEntry",
    "KernelStats",
    "KeyProvenance",
    "PathDrift",
    "PrefillKernelView",
    "RankView",
    "Readiness",
    "Regret",
    "RegretWindow",
    "RestartAdvice",
    "RollbackRequest",
    "RoutingChange",
    "ThresholdValue",
    "ThresholdsView",
    "Totals",
    "Window",
]
