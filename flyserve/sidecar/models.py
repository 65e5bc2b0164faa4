"""Pydantic response (and request) models: the documented schema of the sidecar's JSON.

These are what OpenAPI shows and what the schemathesis fuzz validates responses against;
a field added here is a field every client may rely on.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ThresholdValue = int | str | bool


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class KeyProvenance(_Frozen):
    """A key whose value differs from the profile's default, and which layer set it."""

    value: ThresholdValue
    default: ThresholdValue = Field(description="The profile's value for this key.")
    provenance: str = Field(description="'file' (operator config file) or 'override' (API/CLI).")


class ThresholdsView(_Frozen):
    """The thresholds in force, as published by the control plane."""

    version: int
    sha256: str
    source: str = Field(description="default | file | api | cli | rollback")
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


class Totals(_Frozen):
    """Decision counts and derived ratios. Each engine step counts once per engine, not once per rank."""

    batches: int = Field(description="Decisions counted (engine steps).")
    decisions: dict[str, int] = Field(description="Batches per path (unified, prefill).")
    reasons: dict[str, int] = Field(description="Batches per reason (admitted, short_context, ...).")
    prefill_ratio: float | None = Field(description="prefill / all batches; null with no batches.")
    prefill_ratio_of_prefill_batches: float | None = Field(
        description="prefill / batches that had a prefill row (reason != no_prefill_rows)."
    )
    tokens: dict[str, int] = Field(description="Query tokens per path.")
    rows: dict[str, dict[str, int]] = Field(description="{path: {prefill: rows, decode: rows}}.")
    lpt_share: float | None = Field(description="Share of prefill-path batches run with LPT ordering.")


class Window(Totals):
    """Totals over a sliding window, from periodic snapshots of the counters."""

    span_s: float = Field(description="Seconds the window actually covers (less than asked early on).")
    complete: bool = Field(description="True when the snapshot history covers the whole window.")


class KernelStats(_Frozen):
    """Sampled kernel time of one path, from the flyserve_kernel_seconds histogram (all ranks pooled)."""

    count: int
    mean_s: float | None
    p50_s: float | None = Field(description="Interpolated within histogram buckets, as histogram_quantile.")
    p99_s: float | None


class PrefillKernelView(_Frozen):
    """The rank's prefill kernel as found at start: which one, its revision, or why it is off."""

    kernel: str = Field(max_length=64)
    revision: str | None = Field(
        None, max_length=200, description="e.g. FlyDSL's: has causal_lpt, page sizes."
    )
    off_reason: str | None = Field(
        None,
        max_length=400,
        description="Why the prefill path cannot run on this rank at all (null: it can).",
    )


class RankView(_Frozen):
    """One rank's last report (ranks/<rank>.json) and its own counters."""

    rank: int
    engine: int
    pid: int | None
    step: int | None
    applied_version: int | None
    applied_step: int | None
    applied_sha256: str | None = Field(
        None,
        description="The content hash of the applied version (64 lowercase hex digits, as `flyserve "
        "thresholds show` prints it); null when the report has none or a malformed one.",
    )
    circuit_open: bool | None = None
    control_mode: str | None = Field(
        None, description='How the rank learns of versions: "engine channel" or "file polling".'
    )
    prefill_kernel: PrefillKernelView | None = None
    age_s: float | None = Field(
        description="Seconds since the rank's last report; null if it never reported."
    )
    stale: bool = Field(description="No report for stale_after_s seconds (or never): not an error.")
    totals: Totals | None = Field(None, description="This rank's own counters (equal across TP ranks).")
    late_applies: int | None = Field(
        None,
        description="Versions this rank learned of after their effective step and applied at once (at a "
        "step other ranks may not share). Should stay 0.",
    )
    liveness: str | None = Field(
        None,
        description='What the process table says of the report (flyserve.control.reports.liveness): "confirmed" '
        "(this host and pid namespace, pid alive with the start time the rank recorded, the file owned by its "
        'uid), "unconfirmed" (another host or pid namespace, a report without proc_start, or a forgery: counts '
        'toward effective_step only in an engine with no confirmed rank), "gone" (its process exited, or its '
        "pid now names another process); null when the report is not a valid one.",
    )


class EngineStats(_Frozen):
    """One engine (a TP group of ranks): its totals come from one representative rank."""

    engine: int
    representative_rank: int | None = Field(
        description="The rank whose counters stand for the engine: the one with the most decisions "
        "(all TP ranks record the same decisions; a dead rank's counters stop growing)."
    )
    ranks: list[int]
    ranks_agree: bool | None = Field(description="Null when no rank of this engine is live.")
    totals: Totals
    windows: dict[str, Window]
    kernels: dict[str, KernelStats]


class PathDrift(_Frozen):
    samples: int = Field(description="Samples of this path that carry a measured kernel time.")
    median_ratio: float | None = Field(description="Median measured / predicted; 1.0 = the table holds.")


class RegretWindow(_Frozen):
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


class Regret(_Frozen):
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


class ChannelWorkerView(_Frozen):
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


class ChannelEngineView(_Frozen):
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


class ChannelView(_Frozen):
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


class DispatchStats(_Frozen):
    """GET /dispatch-stats: everything about dispatch, totals over all engines."""

    time: float = Field(description="Unix time the stats were computed.")
    thresholds: ThresholdsView | None = Field(description="Null if the control plane could not be read.")
    totals: Totals
    windows: dict[str, Window] = Field(description='Keys "60s", "300s", "900s".')
    ranks: list[RankView]
    ranks_agree: bool | None = Field(
        description="All live ranks applied the same thresholds version; null when no rank is live."
    )
    live_ranks: int
    control_mode: str | None = Field(
        None,
        description='The live ranks\' mode: "engine channel" (vLLM pushes each version between two '
        'steps), "file polling" (the fallback), "mixed", or null when no rank is live.',
    )
    late_applies: int = Field(
        0, description="Sum of the ranks' late_applies: versions some rank applied at a step of its own."
    )
    kernels: dict[str, KernelStats]
    engines: list[EngineStats]
    errors: list[str] = Field(default_factory=list, description="Problems reading the state directory.")
    regret: Regret | None = Field(None, description="Null unless the sidecar was started with --costs.")
    channel: ChannelView | None = Field(
        None,
        description="The engine channel's view of every engine and worker (all nodes); null without one.",
    )


class RoutingChange(_Frozen):
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


class ChangeResponse(_Frozen):
    """The answer to a mutation (or its dry run)."""

    dry_run: bool
    changed: bool
    diff: dict[str, list[Any]] = Field(description="{key: [old, new]} of the effective values.")
    thresholds: ThresholdsView = Field(description="The resulting snapshot (the would-be one for a dry run).")
    routing_change: RoutingChange | None = Field(None, description="Dry runs only.")


class HistoryEntry(_Frozen):
    version: int
    sha256: str
    source: str
    actor: str | None = None
    time: float | None = None
    effective_step: int | None = None
    overrides: dict[str, ThresholdValue] = Field(default_factory=dict)


class History(_Frozen):
    entries: list[HistoryEntry]


class RollbackRequest(BaseModel):
    # strict: {"version": true} used to be read as version 1, {"version": "2"} as 2
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    version: int = Field(ge=0, le=1 << 62, description="The version to return to (from /thresholds/history).")


class Health(_Frozen):
    status: str


class Readiness(_Frozen):
    ready: bool
    state_dir_readable: bool
    live_ranks: int
    detail: str


class ErrorDetail(_Frozen):
    """422/409/413/503 bodies: which field, and why."""

    detail: str
    field: str | None = None
    errors: list[dict[str, str]] = Field(default_factory=list)
    samples: dict[str, Any] | None = Field(
        None,
        description="Advice's 409 with field `samples` only: the samples used and, per rank, whether "
        "its decision counters corroborate them.",
    )


class AdviceSampleRank(_Frozen):
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


class AdviceShape(_Frozen):
    """One sampled step the advice was fitted on, with its path before and after."""

    engine: int
    step: int
    query_lens: list[int]
    seq_lens: list[int]
    unified_ms: float
    prefill_ms: float
    before: str
    after: str


class AdvicePatch(_Frozen):
    """The request that applies the advice (an operator action): PATCH /thresholds with If-Match."""

    method: str = "PATCH"
    path: str = "/thresholds"
    headers: dict[str, str]
    body: dict[str, ThresholdValue]


class RestartAdvice(_Frozen):
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


class Advice(_Frozen):
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
