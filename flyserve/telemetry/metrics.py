"""Every flyserve metric, defined once at module level: name, help, labels, buckets.

One concern that reads best whole: the list an operator's dashboards, alerts and docs/metrics.md
are checked against. Each definition is one call of _counter, _gauge, _histogram or _rank_gauge
(registry, scope and shared label sets said once there); consecutive definitions share a shape
(name, help, labels) because each is one metric's own data, prometheus_client style.

Three groups, by which process writes them:

* rank side: written by each vLLM worker process (the routing's DispatchRecorder and the
  kernel timer); in production they are mmap-backed files in ``<state>/metrics/``;
* control side: written by whichever process publishes or reloads thresholds (the sidecar,
  the CLI); also mmap-backed when that process called :func:`setup_multiprocess`;
* sidecar side: the sidecar's own registry, always in-process.

Why our own value classes (the ``scope=`` argument below): prometheus_client picks its value
class from ``PROMETHEUS_MULTIPROC_DIR`` once, at import, and vLLM sets that variable to its own
directory. flyserve's value backend (flyserve.telemetry.prom, the one package that touches
prometheus_client internals) writes rank and control metrics to the directory given to
:func:`setup_multiprocess` (flyserve.telemetry.multiprocess, re-exported here) and keeps them
in-process until then; the sidecar metrics are always in-process. Rank-side values take no lock
(one engine thread writes them), control and sidecar values do.

This module is the list: add a metric here, at module level, with its scope.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Final

from prometheus_client import CollectorRegistry

from flyserve.policy.vocabulary import PATHS, REASONS
from flyserve.telemetry import prom as _backend
from flyserve.telemetry.multiprocess import exposition_registry as _exposition_registry
from flyserve.telemetry.multiprocess import (
    multiprocess_dir,
    setup_in_process,
    setup_multiprocess,
    wipe_metrics_dir,
)
from flyserve.telemetry.prom import (
    CONTROL,
    RANK,
    SCOPES,
    SIDECAR,
    FlyCounter,
    FlyGauge,
    FlyHistogram,
    cell,
    exposed_name,
    metric_type,
    read_values_file,
)

__all__ = [
    "CONTROL",
    "RANK",
    "SCOPES",
    "SIDECAR",
    "FlyCounter",
    "FlyGauge",
    "FlyHistogram",
    "cell",
    "exposed_name",
    "exposition_registry",
    "multiprocess_dir",
    "read_values_file",
    "setup_in_process",
    "setup_multiprocess",
    "wipe_metrics_dir",
]

_BACKEND: Final = _backend.BACKEND  # the backend state (generation, listeners) bound objects watch

# --------------------------------------------------------------------------------------------
# Label values and buckets
# --------------------------------------------------------------------------------------------

ROW_KINDS: Final = ("prefill", "decode")
ORDERINGS: Final = ("lpt", "plain")
RELOAD_RESULTS: Final = ("success", "invalid", "io_error")
RELOAD_SOURCES: Final = ("default", "file", "api", "cli", "rollback", "autopilot")

# Powers of two: batch sizes in tokens are set by max_num_batched_tokens (a power of two or
# close); 1 token = a single decode row.
QUERY_TOKEN_BUCKETS: Final = tuple(float(2**i) for i in range(17))  # 1 .. 65536
# Context lengths: 1536 is the seed's min_seq_len and 131072 its max_seq_len, so the
# short_context / context_too_long boundaries are bucket edges.
MAX_SEQ_LEN_BUCKETS: Final = (
    256.0,
    512.0,
    1024.0,
    1536.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
    32768.0,
    61440.0,
    65536.0,
    131072.0,
    262144.0,
    524288.0,
    1048576.0,
)
# 10 microseconds (a decode step's attention on a small batch) to 1 second (a long prefill
# on the slow path), 1-2.5-5 per decade.
KERNEL_SECONDS_BUCKETS: Final = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
)
SIDECAR_SECONDS_BUCKETS: Final = (5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)

# --------------------------------------------------------------------------------------------
# The metrics. registry=None: nothing lands in prometheus_client's global REGISTRY (which
# vLLM's API server exposes); REGISTRY below is flyserve's in-process view of all of them.
# --------------------------------------------------------------------------------------------


def _counter(name: str, help_text: str, labels: Sequence[str] = (), *, scope: str = RANK) -> FlyCounter:
    return FlyCounter(name, help_text, labels, registry=None, scope=scope)


def _gauge(
    name: str, help_text: str, labels: Sequence[str] = (), *, mode: str | None = None, scope: str = RANK
) -> FlyGauge:
    """``mode``: how the files of several processes combine (prometheus_client's multiprocess_mode;
    None keeps its default)."""
    kwargs = {} if mode is None else {"multiprocess_mode": mode}
    return FlyGauge(name, help_text, labels, registry=None, scope=scope, **kwargs)


def _histogram(
    name: str, help_text: str, labels: Sequence[str], buckets: Sequence[float], *, scope: str = RANK
) -> FlyHistogram:
    return FlyHistogram(name, help_text, labels, buckets=buckets, registry=None, scope=scope)


def _rank_gauge(name: str, help_text: str) -> FlyGauge:
    """A per-rank state (step, version, breaker): the newest live writer's value wins."""
    return _gauge(name, help_text, ["rank"], mode="livemostrecent")


# rank side ------------------------------------------------------------------------------
DISPATCH_DECISIONS: Final = _counter(
    "flyserve_dispatch_decisions",
    "Dispatch decisions, one per engine step per rank, by kernel path and reason.",
    ["path", "reason", "rank"],
)
DISPATCH_TOKENS: Final = _counter(
    "flyserve_dispatch_tokens",
    "Query tokens (num_actual_tokens) routed to each kernel path.",
    ["path", "rank"],
)
DISPATCH_ROWS: Final = _counter(
    "flyserve_dispatch_rows",
    "Batch rows routed to each kernel path, by kind (prefill rows or decode rows).",
    ["path", "kind", "rank"],
)
DISPATCH_LPT: Final = _counter(
    "flyserve_dispatch_lpt",
    "Prefill-path decisions by q-block ordering (lpt = longest-first, plain = in order).",
    ["ordering", "rank"],
)
DISPATCH_QUERY_TOKENS: Final = _histogram(
    "flyserve_dispatch_query_tokens",
    "Query tokens per batch (num_actual_tokens), by the path that ran it.",
    ["path", "rank"],
    QUERY_TOKEN_BUCKETS,
)
DISPATCH_MAX_SEQ_LEN: Final = _histogram(
    "flyserve_dispatch_max_seq_len",
    "Longest context (max_seq_len) per batch, by the path that ran it.",
    ["path", "rank"],
    MAX_SEQ_LEN_BUCKETS,
)
KERNEL_SECONDS: Final = _histogram(
    "flyserve_kernel_seconds",
    "Sampled device time of one attention call per kernel path (CUDA events; host clock on CPU).",
    ["path", "rank"],
    KERNEL_SECONDS_BUCKETS,
)
KERNEL_TIMER_DROPPED: Final = _counter(
    "flyserve_kernel_timer_dropped",
    "Kernel timings skipped because the pending-event queue was full (the GPU ran far behind).",
    ["path", "rank"],
)
ENGINE_STEP: Final = _rank_gauge("flyserve_engine_step", "The last engine step this rank routed.")
THRESHOLDS_VERSION: Final = _rank_gauge(
    "flyserve_thresholds_version", "The thresholds version this rank routes with."
)
CIRCUIT_OPEN: Final = _rank_gauge(
    "flyserve_circuit_open",
    "1 when this rank's prefill-path circuit breaker is open (every batch takes the unified path).",
)
LATE_APPLIES: Final = _counter(
    "flyserve_control_late_applies",
    "Thresholds versions this rank learned of after their effective step and applied at once (at a "
    "step other ranks may not share); should stay 0.",
    ["rank"],
)

# control side ----------------------------------------------------------------------------
CONFIG_RELOADS: Final = _counter(
    "flyserve_config_reloads",
    "Thresholds changes attempted, by result (success, invalid, io_error) and source.",
    ["result", "source"],
    scope=CONTROL,
)
CONFIG_LAST_SUCCESS: Final = _gauge(
    "flyserve_config_last_success_timestamp_seconds",
    "Unix time of the last thresholds change that was published.",
    mode="max",
    scope=CONTROL,
)

# sidecar side (always in-process) ---------------------------------------------------------
SIDECAR_REQUESTS: Final = _counter(
    "flyserve_sidecar_requests",
    "HTTP requests the sidecar answered, by route template, method and status code.",
    ["route", "method", "code"],
    scope=SIDECAR,
)
SIDECAR_REQUEST_SECONDS: Final = _histogram(
    "flyserve_sidecar_request_seconds",
    "Time the sidecar took to answer, by route template.",
    ["route"],
    SIDECAR_SECONDS_BUCKETS,
    scope=SIDECAR,
)
SIDECAR_DROPPED_CONNECTIONS: Final = _counter(
    "flyserve_sidecar_dropped_connections",
    "Connections the sidecar closed before answering: reason=head_timeout (no whole request head "
    "within --head-timeout), request_timeout (no whole request within --request-timeout), "
    "evicted (at --max-connections, the oldest connection still waiting for its head made room), "
    "refused (at --max-connections with every connection busy in a request).",
    ["reason"],
    scope=SIDECAR,
)
SIDECAR_SHED_REQUESTS: Final = _counter(
    "flyserve_sidecar_shed_requests",
    "Requests answered 503 at once because --max-connections requests were already in progress "
    "(probes and authenticated changes are always admitted).",
    scope=SIDECAR,
)
SIDECAR_STREAM_RECLAIMS: Final = _counter(
    "flyserve_sidecar_stream_reclaims",
    "SSE streams (/dispatch-stats/stream) the sidecar ended to free their slot, or refused: "
    "reason=stalled (an event's write did not complete within --stream-write-timeout, or at "
    "--max-streams a new stream took the slot of one not draining: a write waiting over 1 s or over "
    "2 events queued unsent), backlog (more than --stream-max-queued events' worth of bytes queued "
    "unsent for the client), lease (at --max-streams with none stalled, a new stream took the slot of "
    "the oldest one open over --stream-lease), full (at --max-streams with no stream stalled and none "
    "past its lease, a new one got 503).",
    ["reason"],
    scope=SIDECAR,
)
RANK_UP: Final = _gauge(
    "flyserve_rank_up",
    "1 if the rank's report (ranks/<rank>.json) is fresh, 0 if stale.",
    ["rank"],
    scope=SIDECAR,
)
RANK_REPORT_AGE: Final = _gauge(
    "flyserve_rank_report_age_seconds",
    "Seconds since the rank last wrote its report.",
    ["rank"],
    scope=SIDECAR,
)
RANKS_AGREE: Final = _gauge(
    "flyserve_ranks_agree", "1 if every live rank applied the same thresholds version.", scope=SIDECAR
)
THRESHOLDS_FINGERPRINT: Final = _gauge(
    "flyserve_thresholds_fingerprint",
    "The thresholds content the live ranks route with, as a number comparable across replicas: the "
    "first 13 hex digits (52 bits, exact in a float) of the sha256 of the version they applied; -1 when "
    "live ranks applied different contents, NaN with no live rank. Version numbers count one "
    "replica's changes; equal contents have equal fingerprints on every replica.",
    scope=SIDECAR,
)
SIDECAR_IGNORED_FILES: Final = _gauge(
    "flyserve_sidecar_ignored_files",
    "Files the sidecar did not use: kind=metrics (metric files skipped as corrupt or foreign, "
    "distinct names since start), kind=rank_reports (files in ranks/ at the last look that are "
    "badly named, beyond the newest 256, unreadable or refused as implausible).",
    ["kind"],
    scope=SIDECAR,
)

SIDECAR_COMPACTED_FILES: Final = _counter(
    "flyserve_sidecar_compacted_files",
    "Dead processes' metric files the sidecar's compaction handled: action=merged (counters, "
    "histograms, min/max/sum/mostrecent gauges, summed into the <kind>_dead.db archives) or "
    "action=dropped (live-mode gauges of a dead process).",
    ["action"],
    scope=SIDECAR,
)
SIDECAR_METRICS_FILES: Final = _gauge(
    "flyserve_sidecar_metrics_files",
    "Metric files (*.db) in <state>/metrics after the last compaction: about 4 per live process "
    "plus one archive per kind; growing means compaction is off or cannot run.",
    scope=SIDECAR,
)

# live pricing (the sidecar started with --costs; flyserve.sidecar.live_costs) -----------------
PRICED_SECONDS: Final = _counter(
    "flyserve_priced_attention_seconds",
    "Sampled steps priced by the cost table: seconds of one attention call under each policy "
    "(routed = the path each step ran, oracle = the faster path per step, always_unified, "
    "always_prefill). Ratios of their rates are the routing regret.",
    ["policy"],
    scope=SIDECAR,
)
PRICED_BATCHES: Final = ("with_prefill", "decode_only")
"""Label values of PRICED_BY_BATCH: a batch with a prefill row (run-time thresholds route it) or
decode only (it takes decode_path, fixed at start: only a restart moves its regret)."""
PRICED_BY_BATCH: Final = _counter(
    "flyserve_priced_attention_by_batch_seconds",
    "flyserve_priced_attention_seconds split by the kind of batch: batch=with_prefill (a row of 2+ "
    "query tokens: the run-time thresholds route it) or decode_only (it takes decode_path, fixed at "
    "start), policy=routed or oracle. Regret by cause: (routed - oracle) of one kind over all oracle.",
    ["batch", "policy"],
    scope=SIDECAR,
)
COST_DRIFT: Final = _gauge(
    "flyserve_cost_drift_ratio",
    "Median of measured / cost-table-predicted kernel time per path over the last 15 minutes "
    "(NaN without measured samples). Outside [0.7, 1.4]: re-run flyserve calibrate.",
    ["path"],
    scope=SIDECAR,
)

# the autopilot (the sidecar started with --autopilot; flyserve.sidecar.autopilot_runner) -----------
AUTOPILOT_OUTCOMES: Final = (
    "promoted",
    "rolled_back",
    "aborted",
    "inconclusive",
    "killed",
    "expired",
    "refused",
)
"""Label values of AUTOPILOT_TRIALS: how a trial ended (docs/metrics.md, "Sidecar side")."""
AUTOPILOT_MODES: Final = ("off", "advise", "trial", "auto")
AUTOPILOT_TRIALS: Final = _counter(
    "flyserve_autopilot_trials",
    "Autopilot trials ended, by outcome: promoted (the candidate published, or approved), "
    "rolled_back (measured worse or no better, or a guardrail), aborted (an operator-side ending: "
    "pause, a mode change, an operator change, control frozen), inconclusive (the budget or the plan "
    "ran out), killed (the kill switch), expired (an awaited approval timed out), refused (the version "
    "that starts it was refused: it never ran).",
    ["outcome"],
    scope=SIDECAR,
)
AUTOPILOT_ARM: Final = _gauge(
    "flyserve_autopilot_arm",
    "The arm the ranks run now, as the autopilot planned it: -1 no trial, 0 the current thresholds, "
    "1 the candidate.",
    scope=SIDECAR,
)
AUTOPILOT_EXPLORATION_COST: Final = _counter(
    "flyserve_autopilot_exploration_cost_seconds",
    "Kernel seconds the trials spent on the slower arm, as measured: per counted block pair, the "
    "slower block's tokens times its excess kernel seconds per token over the faster block's.",
    scope=SIDECAR,
)
AUTOPILOT_MODE: Final = _gauge(
    "flyserve_autopilot_mode",
    "1 for the autopilot mode in force (off, advise, trial, auto), 0 for the others.",
    ["mode"],
    scope=SIDECAR,
)

RANK_METRICS: Final = (
    DISPATCH_DECISIONS,
    DISPATCH_TOKENS,
    DISPATCH_ROWS,
    DISPATCH_LPT,
    DISPATCH_QUERY_TOKENS,
    DISPATCH_MAX_SEQ_LEN,
    KERNEL_SECONDS,
    KERNEL_TIMER_DROPPED,
    ENGINE_STEP,
    THRESHOLDS_VERSION,
    CIRCUIT_OPEN,
    LATE_APPLIES,
)
CONTROL_METRICS: Final = (CONFIG_RELOADS, CONFIG_LAST_SUCCESS)
SIDECAR_METRICS: Final = (
    SIDECAR_REQUESTS,
    SIDECAR_REQUEST_SECONDS,
    SIDECAR_DROPPED_CONNECTIONS,
    SIDECAR_SHED_REQUESTS,
    SIDECAR_STREAM_RECLAIMS,
    RANK_UP,
    RANK_REPORT_AGE,
    RANKS_AGREE,
    THRESHOLDS_FINGERPRINT,
    SIDECAR_IGNORED_FILES,
    SIDECAR_COMPACTED_FILES,
    SIDECAR_METRICS_FILES,
    PRICED_SECONDS,
    PRICED_BY_BATCH,
    COST_DRIFT,
    AUTOPILOT_TRIALS,
    AUTOPILOT_ARM,
    AUTOPILOT_EXPLORATION_COST,
    AUTOPILOT_MODE,
)
SHARED_METRICS: Final = RANK_METRICS + CONTROL_METRICS
ALL_METRICS: Final = SHARED_METRICS + SIDECAR_METRICS


METRIC_NAMES: Final[tuple[str, ...]] = tuple(exposed_name(m) for m in ALL_METRICS)
"""Every metric name as an operator queries it (counters with ``_total``; histograms' base name,
whose series are ``<name>_bucket``, ``_sum``, ``_count``)."""
METRIC_TYPES: Final[dict[str, str]] = {exposed_name(m): metric_type(m) for m in ALL_METRICS}

REGISTRY: Final = CollectorRegistry()
"""In-process view of every flyserve metric of this process (tests, single-process use)."""
for _m in ALL_METRICS:
    REGISTRY.register(_m)


# --------------------------------------------------------------------------------------------
# Series that exist before the first event
# --------------------------------------------------------------------------------------------


def precreate_rank_series(rank: int | str) -> None:
    """Create every rank-side series of ``rank`` (zero-valued), so ratios exist from the first scrape.

    DispatchRecorder and KernelTimer call this; it is idempotent."""
    r = str(rank)
    for p in PATHS:
        for reason in REASONS:
            DISPATCH_DECISIONS.labels(p, reason, r)
        DISPATCH_TOKENS.labels(p, r)
        for k in ROW_KINDS:
            DISPATCH_ROWS.labels(p, k, r)
        DISPATCH_QUERY_TOKENS.labels(p, r)
        DISPATCH_MAX_SEQ_LEN.labels(p, r)
        KERNEL_SECONDS.labels(p, r)
        KERNEL_TIMER_DROPPED.labels(p, r)
    for o in ORDERINGS:
        DISPATCH_LPT.labels(o, r)
    ENGINE_STEP.labels(r)
    THRESHOLDS_VERSION.labels(r)
    CIRCUIT_OPEN.labels(r)
    LATE_APPLIES.labels(r)  # a zero series from the first scrape: the "should stay 0" panel has data


def precreate_control_series() -> None:
    """Create every result x source series of flyserve_config_reloads_total (zero-valued)."""
    for res in RELOAD_RESULTS:
        for src in RELOAD_SOURCES:
            CONFIG_RELOADS.labels(res, src)


precreate_control_series()


def record_config_reload(result: str, source: str) -> None:
    """Count one thresholds change attempt (control side; not a hot path)."""
    if result not in RELOAD_RESULTS:
        raise ValueError(f"result must be one of {RELOAD_RESULTS}, got {result!r}")
    CONFIG_RELOADS.labels(result, source).inc()
    if result == "success":
        CONFIG_LAST_SUCCESS.set(time.time())


def exposition_registry(
    metrics_dir: str | os.PathLike[str] | None = None, *, files: bool = True
) -> CollectorRegistry:
    """The registry a scrape endpoint serves (the sidecar's /metrics).

    With ``metrics_dir``: this process's sidecar metrics plus every process's shared metrics read
    from the files (this process is switched to that directory if it was still in-process).
    Without: every flyserve metric of this process, in-process (tests, single-process demos).
    """
    return _exposition_registry(
        metrics_dir, every_metric=ALL_METRICS, in_process_metrics=SIDECAR_METRICS, files=files
    )
