"""What the thresholds cost (the regret section of /dispatch-stats) and GET /thresholds/advice."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from flyserve.sidecar.models.base import FrozenModel, ThresholdValue


class PathDrift(FrozenModel):
    samples: int = Field(description="Samples of this path that carry a measured kernel time.")
    median_ratio: float | None = Field(description="Median measured / predicted; 1.0 = the table holds.")


class RegretWindow(FrozenModel):
    """Priced sampled steps of one window (seconds of one attention call per sampled step)."""

    samples: int
    span_s: float
    routed_s: float = Field(description="The path each step ran.")
    oracle_s: float = Field(description="The faster path for each step.")
    always_unified_s: float
    always_prefill_s: float
    routed_over_oracle: float | None = Field(description="1.0: no batch went to the slower kernel.")
    regret: float | None = Field(
        description="routed_over_oracle - 1: the share of time spent beyond the oracle."
    )
    always_unified_over_oracle: float | None
    always_prefill_over_oracle: float | None
    wrong_samples: int = Field(description="Sampled steps that ran the slower path.")
    prefill_batches: dict[str, Any] = Field(
        description="The same over the batches with a prefill row (what run-time thresholds route; "
        "the rest take decode_path, fixed at start): samples, routed_s, oracle_s, routed_over_oracle."
    )
    drift: dict[str, PathDrift]


class Regret(FrozenModel):
    """What the thresholds cost, priced with the cost table the sidecar was started with (--costs)."""

    costs: str = Field(description="The cost table's name.")
    measured_on: dict[str, Any] = Field(description="GPU, platform, kernels and layer of the table.")
    unpriceable: str | None = Field(description="Why the latest unpriced sample could not be priced.")
    unpriceable_samples: int
    future_samples: int = Field(
        0,
        description="Samples dated more than 5 s ahead of the sidecar's clock: never priced (a clock that far ahead is not believed).",
    )
    sample_ranks: dict[str, int] = Field(
        default_factory=dict,
        description='Priced samples of the 15-minute horizon per rank ("<engine>-<rank>"): only live '
        "ranks' files are read.",
    )
    uncorroborated_ranks: list[str] = Field(
        default_factory=list,
        description="Ranks whose samples their own decision counters do not corroborate "
        "(flyserve.sidecar.sample_evidence): left out of the windows and drift; advice refuses them (409).",
    )
    windows: dict[str, RegretWindow] = Field(description='Keys "60s", "900s".')


class AdviceSampleRank(FrozenModel):
    """One rank whose shape samples advice used, checked against its decision counters."""

    engine: int
    rank: int
    samples: int = Field(description="Samples of this rank in the window.")
    samples_by_path: dict[str, int]
    decisions: int | None = Field(
        description="Its dispatch decisions counted over the window (or since start)."
    )
    corroborated: bool
    reason: str | None = None


class AdviceShape(FrozenModel):
    """One sampled step the advice was fitted on, with its path before and after."""

    engine: int
    step: int
    query_lens: list[int]
    seq_lens: list[int]
    unified_ms: float
    prefill_ms: float
    before: str
    after: str


class AdvicePatch(FrozenModel):
    """The request that applies the advice (an operator action): PATCH /thresholds with If-Match."""

    method: str = "PATCH"
    path: str = "/thresholds"
    headers: dict[str, str]
    body: dict[str, ThresholdValue]


class RestartAdvice(FrozenModel):
    """A knob fixed at start (decode_path, the KV block size) whose change would save time: a
    restart, never part of the ready PATCH (flyserve.sidecar.restart_advice)."""

    knob: str
    current: ThresholdValue
    advised: ThresholdValue
    needs_restart: bool = Field(True, description="Always true: this change takes a restart.")
    saving: float = Field(description="Share of the window's routed attention time it would remove.")
    routed_s_before: float = Field(description="Routed seconds with the ready PATCH applied.")
    routed_s_after: float = Field(description="The same with this knob changed (and a restart).")
    routed_over_oracle_before: float | None
    routed_over_oracle_after: float | None
    samples_moved: int = Field(description="Sampled steps that would take the other path.")
    how: str = Field(description="What to do: which file or flag, then restart vLLM.")


class Advice(FrozenModel):
    """Threshold values that would have routed the window's sampled batches best (calibrate's fitter)."""

    window: str
    samples: int = Field(description="Priced shapes the fit used.")
    thresholds_version: int
    changes: dict[str, list[ThresholdValue]] = Field(
        description="Only the run-time knobs that change: {knob: [in force, advised]}. Never decode_path."
    )
    before: RegretWindow = Field(description="The window's shapes routed by the thresholds in force.")
    after: RegretWindow = Field(description="The same shapes routed by the advised thresholds.")
    patch: AdvicePatch | None = Field(description="Null when nothing would change.")
    shapes_total: int
    shapes: list[AdviceShape] = Field(description="The newest fitted shapes (at most ?shapes=N).")
    restart: list[RestartAdvice] = Field(
        default_factory=list,
        description="Knobs fixed at start worth a restart, biggest saving first; never in `patch`.",
    )
    sample_ranks: list[AdviceSampleRank] = Field(
        default_factory=list,
        description="The live ranks whose samples the window holds, each corroborated by its decision counters.",
    )
    stale: bool = Field(
        False,
        description="True: the fit in progress did not finish within the deadline (2 s); this is the "
        "last finished one, `age_s` old.",
    )
    age_s: float = Field(0.0, description="Seconds since this fit finished (fits are reused for 5 s).")
