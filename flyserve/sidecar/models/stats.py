"""The /dispatch-stats resource: decision totals and windows, kernels, ranks and engines."""

from __future__ import annotations

from pydantic import Field

from flyserve.sidecar.models.advice import Regret
from flyserve.sidecar.models.base import FrozenModel
from flyserve.sidecar.models.channel import ChannelView
from flyserve.sidecar.models.thresholds import ThresholdsView


class Totals(FrozenModel):
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


class KernelStats(FrozenModel):
    """Sampled kernel time of one path, from the flyserve_kernel_seconds histogram (all ranks pooled)."""

    count: int
    mean_s: float | None
    p50_s: float | None = Field(description="Interpolated within histogram buckets, as histogram_quantile.")
    p99_s: float | None


class PrefillKernelView(FrozenModel):
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


class RankView(FrozenModel):
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


class EngineStats(FrozenModel):
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


class DispatchStats(FrozenModel):
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
