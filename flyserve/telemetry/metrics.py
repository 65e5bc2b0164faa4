"""Every flyserve metric, defined once at module level: name, help, labels, buckets.

Three groups, by which process writes them:

* rank side: written by each vLLM worker process (the routing's DispatchRecorder and the
  kernel timer); in production they are mmap-backed files in ``<state>/metrics/``;
* control side: written by whichever process publishes or reloads thresholds (the sidecar,
  the CLI); also mmap-backed when that process called :func:`setup_multiprocess`;
* sidecar side: the sidecar's own registry, always in-process.

Why our own value classes (the ``scope=`` argument below) instead of prometheus_client's
``PROMETHEUS_MULTIPROC_DIR`` switch: prometheus_client picks its value class from that
environment variable once, when it is imported, and vLLM sets the variable itself (to its own
temp directory) when it runs several API-server processes. flyserve's metrics would then land
in vLLM's directory, or stay in-process where nobody scrapes them. So flyserve ignores the
variable: the rank and control metrics write to the directory given to
:func:`setup_multiprocess` (explicitly, whatever the environment says) and stay in-process
until then; the sidecar metrics are always in-process. Rank-side values take no lock (one
engine thread writes them; see _MmapValueSingleWriter), control and sidecar values do.

Who wipes ``<state>/metrics/``: the rank-0 process calls ``setup_multiprocess(dir, wipe=True)``
(the launcher may call :func:`wipe_metrics_dir` before starting vLLM). Wiping removes the
files of processes that are no longer alive only, so a rank that started first never loses
its open files to a slower rank 0.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.values import MutexValue

from flyserve.policy.vocabulary import PATHS, REASONS

# --------------------------------------------------------------------------------------------
# Value backend: in-process floats, or mmap files in flyserve's own directory.
# --------------------------------------------------------------------------------------------


class _Backend:
    """Which value class the shared metrics use in this process.

    ``generation`` increases whenever the values are re-created (setup_multiprocess,
    setup_in_process, a fork), so objects that bound value cells (DispatchRecorder, KernelTimer)
    notice with one int compare and re-bind.
    """

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.generation = 0
        self.lock = threading.Lock()
        self.files: dict[str, MmapedDict] = {}
        self.views: dict[int, tuple[Any, memoryview]] = {}  # id(mmap) -> (mmap, its float64 view)
        self.pid = os.getpid()
        self.values: list[_MmapValue] = []
        # Objects holding bound cells; bump() calls their _invalidate() so their hot path needs no
        # generation check of its own (the next call misses its lookup and re-binds).
        self.listeners: weakref.WeakSet[Any] = weakref.WeakSet()

    def bump(self) -> None:
        self.generation += 1
        for obj in list(self.listeners):
            obj._invalidate()

    def view(self, m: Any) -> memoryview:
        """A float64 view of an mmap (one per mapping; MmapedDict maps a larger one when it grows)."""
        got = self.views.get(id(m))
        if got is None or got[0] is not m:
            got = self.views[id(m)] = (m, memoryview(m).cast("d"))
        return got[1]

    def release_views(self) -> None:
        """Views pin their mappings (mmap.close() refuses while one exists): release before closing."""
        for _, v in self.views.values():
            v.release()
        self.views.clear()


_BACKEND: Final = _Backend()


class _MmapValue:
    """A float in an mmap file of flyserve's metrics directory (prometheus_client's file format).

    Same file names and layout as prometheus_client's ``MmapedValue`` (``counter_<pid>.db``,
    ``gauge_<mode>_<pid>.db``), so ``MultiProcessCollector(registry, path=dir)`` reads them;
    unlike it, the directory is explicit, never read from ``PROMETHEUS_MULTIPROC_DIR``, and a
    fork is handled by ``os.register_at_fork`` instead of a ``getpid()`` on every write.

    The value is the cell ``_buf[_i]`` of a float64 view of the mapping (entries are 8-byte
    aligned, value then timestamp): an aligned 8-byte store, so a scraper never reads a torn
    or zeroed value (prometheus_client avoids ``struct.pack_into`` for that reason). The
    recorder binds ``(_buf, _i)`` and updates the cell without a method call. This class locks
    (control side: several threads may write).
    """

    _multiprocess = True
    __slots__ = ("_buf", "_i", "_params")

    def __init__(
        self,
        typ: str,
        metric_name: str,
        name: str,
        labelnames: Iterable[str],
        labelvalues: Iterable[str],
        help_text: str,
        multiprocess_mode: str = "",
        **_: Any,
    ) -> None:
        self._params = (
            typ,
            metric_name,
            name,
            tuple(labelnames),
            tuple(labelvalues),
            help_text,
            multiprocess_mode,
        )
        with _BACKEND.lock:
            self._reset()
            _BACKEND.values.append(self)

    def _reset(self) -> None:
        typ, metric_name, name, labelnames, labelvalues, help_text, mode = self._params
        prefix = f"{typ}_{mode}" if typ == "gauge" else typ
        f = _BACKEND.files.get(prefix)
        if f is None:
            assert _BACKEND.directory is not None
            f = _BACKEND.files[prefix] = MmapedDict(str(_BACKEND.directory / f"{prefix}_{_BACKEND.pid}.db"))
        key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
        _, ts = f.read_value(key)  # creates the entry: a zero series from the first scrape
        pos = f._positions[key]
        assert pos % 8 == 0
        # The mapping that holds the entry now. When MmapedDict grows it maps a larger view but
        # the old one stays valid while our view pins it, and both share the file (MAP_SHARED).
        self._buf = _BACKEND.view(f._m)
        self._i = pos // 8
        if mode.endswith("mostrecent") and not ts:
            # MultiProcessCollector reports a "mostrecent" gauge only with a timestamp > 0. The
            # creation time is stamped once: between a live rank and a dead one's leftover file
            # the newer process wins, and set() stays one store (no clock read per step).
            self._buf[self._i + 1] = time.time()

    def inc(self, amount: float) -> None:
        with _BACKEND.lock:
            self._buf[self._i] += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        with _BACKEND.lock:
            self._buf[self._i] = value
            if timestamp:
                self._buf[self._i + 1] = timestamp

    def set_exemplar(self, exemplar: Any) -> None:  # not supported in files
        return

    def get(self) -> float:
        return self._buf[self._i]

    def get_exemplar(self) -> None:
        return None


class _MmapValueSingleWriter(_MmapValue):
    """Rank side: written by the engine thread only, so no lock (a lock round trip costs as much
    as the write itself: measured 0.3 us on the 2-core CI VM)."""

    __slots__ = ()

    def inc(self, amount: float) -> None:
        self._buf[self._i] += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._buf[self._i] = value
        if timestamp:
            self._buf[self._i + 1] = timestamp


class _LocalValue:
    """Rank side, in-process: a one-element list, single writer (the engine thread), no lock.

    Same ``(_buf, _i)`` cell interface as the mmap value, so the recorder binds either."""

    _multiprocess = False
    __slots__ = ("_buf",)
    _i = 0

    def __init__(self, *_: Any, **__: Any) -> None:
        self._buf = [0.0]

    def inc(self, amount: float) -> None:
        self._buf[0] += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._buf[0] = value

    def set_exemplar(self, exemplar: Any) -> None:
        return

    def get(self) -> float:
        return self._buf[0]

    def get_exemplar(self) -> None:
        return None


def cell(value: Any) -> tuple[Any, int]:
    """(buffer, index) of a rank-side value: ``buf[i] += n`` updates it with no method call."""
    return value._buf, value._i


def _after_fork_in_child() -> None:
    """A forked child must not write into its parent's files: reopen under the child's pid.

    Values restart at zero in the child (its parent's counts stay in the parent's files)."""
    _BACKEND.lock = threading.Lock()
    _BACKEND.pid = os.getpid()
    if _BACKEND.directory is None:
        return
    _BACKEND.release_views()
    for f in _BACKEND.files.values():
        with contextlib.suppress(Exception):  # best effort in a fresh child
            f.close()
    _BACKEND.files.clear()
    for v in _BACKEND.values:
        v._reset()
    _BACKEND.bump()


os.register_at_fork(after_in_child=_after_fork_in_child)


RANK: Final = "rank"
"""Written by one thread of a rank process; shared through the metrics directory."""
CONTROL: Final = "control"
"""Written by any thread of a publishing process; shared through the metrics directory."""
SIDECAR: Final = "sidecar"
"""The sidecar's own metrics: always in-process, thread-safe."""
SCOPES: Final = (RANK, CONTROL, SIDECAR)


def _new_value(typ: str, scope: str, *args: Any, **kwargs: Any) -> Any:
    if scope == SIDECAR:
        return MutexValue(typ, *args, **kwargs)
    if _BACKEND.directory is not None:
        cls = _MmapValueSingleWriter if scope == RANK else _MmapValue
        return cls(typ, *args, **kwargs)
    return _LocalValue() if scope == RANK else MutexValue(typ, *args, **kwargs)


class _ScopeMixin:
    """Adds ``scope=`` (rank, control, sidecar): who writes the metric, so which value class it gets."""

    def _init_scope(self, scope: str) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self._scope = scope

    def _after_init(self) -> None:
        self._kwargs["scope"] = self._scope  # type: ignore[attr-defined]  # children inherit it


class FlyCounter(_ScopeMixin, Counter):
    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        self._init_scope(scope)
        super().__init__(*args, **kwargs)
        self._after_init()

    def _metric_init(self) -> None:
        self._value = _new_value(
            self._type,
            self._scope,
            self._name,
            self._name + "_total",
            self._labelnames,
            self._labelvalues,
            self._documentation,
        )
        self._created = time.time()


class FlyGauge(_ScopeMixin, Gauge):
    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        self._init_scope(scope)
        super().__init__(*args, **kwargs)
        self._after_init()

    def _metric_init(self) -> None:
        self._value = _new_value(
            self._type,
            self._scope,
            self._name,
            self._name,
            self._labelnames,
            self._labelvalues,
            self._documentation,
            multiprocess_mode=self._multiprocess_mode,
        )


class FlyHistogram(_ScopeMixin, Histogram):
    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        self._init_scope(scope)
        super().__init__(*args, **kwargs)
        self._after_init()

    def _metric_init(self) -> None:
        from prometheus_client.utils import floatToGoString

        self._created = time.time()
        self._sum = _new_value(
            self._type,
            self._scope,
            self._name,
            self._name + "_sum",
            self._labelnames,
            self._labelvalues,
            self._documentation,
        )
        self._buckets = [
            _new_value(
                self._type,
                self._scope,
                self._name,
                self._name + "_bucket",
                self._labelnames + ("le",),
                self._labelvalues + (floatToGoString(b),),
                self._documentation,
            )
            for b in self._upper_bounds
        ]


# --------------------------------------------------------------------------------------------
# Label values and buckets
# --------------------------------------------------------------------------------------------

ROW_KINDS: Final = ("prefill", "decode")
ORDERINGS: Final = ("lpt", "plain")
RELOAD_RESULTS: Final = ("success", "invalid", "io_error")
RELOAD_SOURCES: Final = ("default", "file", "api", "cli", "rollback")

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

# rank side ------------------------------------------------------------------------------
DISPATCH_DECISIONS: Final = FlyCounter(
    "flyserve_dispatch_decisions",
    "Dispatch decisions, one per engine step per rank, by kernel path and reason.",
    ["path", "reason", "rank"],
    registry=None,
)
DISPATCH_TOKENS: Final = FlyCounter(
    "flyserve_dispatch_tokens",
    "Query tokens (num_actual_tokens) routed to each kernel path.",
    ["path", "rank"],
    registry=None,
)
DISPATCH_ROWS: Final = FlyCounter(
    "flyserve_dispatch_rows",
    "Batch rows routed to each kernel path, by kind (prefill rows or decode rows).",
    ["path", "kind", "rank"],
    registry=None,
)
DISPATCH_LPT: Final = FlyCounter(
    "flyserve_dispatch_lpt",
    "Prefill-path decisions by q-block ordering (lpt = longest-first, plain = in order).",
    ["ordering", "rank"],
    registry=None,
)
DISPATCH_QUERY_TOKENS: Final = FlyHistogram(
    "flyserve_dispatch_query_tokens",
    "Query tokens per batch (num_actual_tokens), by the path that ran it.",
    ["path", "rank"],
    buckets=QUERY_TOKEN_BUCKETS,
    registry=None,
)
DISPATCH_MAX_SEQ_LEN: Final = FlyHistogram(
    "flyserve_dispatch_max_seq_len",
    "Longest context (max_seq_len) per batch, by the path that ran it.",
    ["path", "rank"],
    buckets=MAX_SEQ_LEN_BUCKETS,
    registry=None,
)
KERNEL_SECONDS: Final = FlyHistogram(
    "flyserve_kernel_seconds",
    "Sampled device time of one attention call per kernel path (CUDA events; host clock on CPU).",
    ["path", "rank"],
    buckets=KERNEL_SECONDS_BUCKETS,
    registry=None,
)
KERNEL_TIMER_DROPPED: Final = FlyCounter(
    "flyserve_kernel_timer_dropped",
    "Kernel timings skipped because the pending-event queue was full (the GPU ran far behind).",
    ["path", "rank"],
    registry=None,
)
ENGINE_STEP: Final = FlyGauge(
    "flyserve_engine_step",
    "The last engine step this rank routed.",
    ["rank"],
    multiprocess_mode="livemostrecent",
    registry=None,
)
THRESHOLDS_VERSION: Final = FlyGauge(
    "flyserve_thresholds_version",
    "The thresholds version this rank routes with.",
    ["rank"],
    multiprocess_mode="livemostrecent",
    registry=None,
)
CIRCUIT_OPEN: Final = FlyGauge(
    "flyserve_circuit_open",
    "1 when this rank's prefill-path circuit breaker is open (every batch takes the unified path).",
    ["rank"],
    multiprocess_mode="livemostrecent",
    registry=None,
)

# control side ----------------------------------------------------------------------------
CONFIG_RELOADS: Final = FlyCounter(
    "flyserve_config_reloads",
    "Thresholds changes attempted, by result (success, invalid, io_error) and source.",
    ["result", "source"],
    registry=None,
    scope=CONTROL,
)
CONFIG_LAST_SUCCESS: Final = FlyGauge(
    "flyserve_config_last_success_timestamp_seconds",
    "Unix time of the last thresholds change that was published.",
    multiprocess_mode="max",
    registry=None,
    scope=CONTROL,
)

# sidecar side (always in-process) ---------------------------------------------------------
SIDECAR_REQUESTS: Final = FlyCounter(
    "flyserve_sidecar_requests",
    "HTTP requests the sidecar answered, by route template, method and status code.",
    ["route", "method", "code"],
    registry=None,
    scope=SIDECAR,
)
SIDECAR_REQUEST_SECONDS: Final = FlyHistogram(
    "flyserve_sidecar_request_seconds",
    "Time the sidecar took to answer, by route template.",
    ["route"],
    buckets=SIDECAR_SECONDS_BUCKETS,
    registry=None,
    scope=SIDECAR,
)
RANK_UP: Final = FlyGauge(
    "flyserve_rank_up",
    "1 if the rank's report (ranks/<rank>.json) is fresh, 0 if stale.",
    ["rank"],
    registry=None,
    scope=SIDECAR,
)
RANK_REPORT_AGE: Final = FlyGauge(
    "flyserve_rank_report_age_seconds",
    "Seconds since the rank last wrote its report.",
    ["rank"],
    registry=None,
    scope=SIDECAR,
)
RANKS_AGREE: Final = FlyGauge(
    "flyserve_ranks_agree",
    "1 if every live rank applied the same thresholds version.",
    registry=None,
    scope=SIDECAR,
)

# live pricing (the sidecar started with --costs; flyserve.sidecar.live_costs) -----------------
PRICED_SECONDS: Final = FlyCounter(
    "flyserve_priced_attention_seconds",
    "Sampled steps priced by the cost table: seconds of one attention call under each policy "
    "(routed = the path each step ran, oracle = the faster path per step, always_unified, "
    "always_prefill). Ratios of their rates are the routing regret.",
    ["policy"],
    registry=None,
    scope=SIDECAR,
)
COST_DRIFT: Final = FlyGauge(
    "flyserve_cost_drift_ratio",
    "Median of measured / cost-table-predicted kernel time per path over the last 15 minutes "
    "(NaN without measured samples). Outside [0.7, 1.4]: re-run flyserve calibrate.",
    ["path"],
    registry=None,
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
)
CONTROL_METRICS: Final = (CONFIG_RELOADS, CONFIG_LAST_SUCCESS)
SIDECAR_METRICS: Final = (
    SIDECAR_REQUESTS,
    SIDECAR_REQUEST_SECONDS,
    RANK_UP,
    RANK_REPORT_AGE,
    RANKS_AGREE,
    PRICED_SECONDS,
    COST_DRIFT,
)
SHARED_METRICS: Final = RANK_METRICS + CONTROL_METRICS
ALL_METRICS: Final = SHARED_METRICS + SIDECAR_METRICS


def exposed_name(m: Any) -> str:
    """The name a scrape shows (and the multiprocess files hold): counters get their _total suffix."""
    return m._name + ("_total" if m._type == "counter" else "")


METRIC_NAMES: Final[tuple[str, ...]] = tuple(exposed_name(m) for m in ALL_METRICS)
"""Every metric name as an operator queries it (counters with ``_total``; histograms' base name,
whose series are ``<name>_bucket``, ``_sum``, ``_count``)."""
METRIC_TYPES: Final[dict[str, str]] = {exposed_name(m): m._type for m in ALL_METRICS}

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


# --------------------------------------------------------------------------------------------
# Multiprocess set-up
# --------------------------------------------------------------------------------------------


def _live(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wipe_metrics_dir(metrics_dir: str | os.PathLike[str], *, only_dead: bool = True) -> int:
    """Remove metric files from ``metrics_dir``; returns how many.

    only_dead=True (the default) keeps the files of processes still alive (a rank that started
    before rank 0 keeps its counts); only_dead=False removes every ``*.db`` (before any rank starts).
    """
    removed = 0
    for path in glob.glob(os.path.join(os.fspath(metrics_dir), "*.db")):
        stem = os.path.basename(path)[:-3]
        pid_text = stem.rsplit("_", 1)[-1]
        if only_dead and pid_text.isdigit() and (int(pid_text) == os.getpid() or _live(int(pid_text))):
            continue
        try:
            os.remove(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _reinit_shared_values() -> None:
    """Re-create the value of every existing shared child in place (the child objects stay)."""
    for m in SHARED_METRICS:
        if m._labelnames:
            with m._lock:
                children = list(m._metrics.values())
            for child in children:
                child._metric_init()
        else:
            m._metric_init()


def _mark_dead_at_exit() -> None:
    d = _BACKEND.directory
    if d is None:
        return
    # Like prometheus_client.multiprocess.mark_process_dead: live-mode gauges of a finished
    # process must not be reported.
    for path in glob.glob(os.path.join(d, f"gauge_live*_{os.getpid()}.db")):
        try:
            os.remove(path)
        except OSError:
            pass


_atexit_registered = False


def setup_multiprocess(metrics_dir: str | os.PathLike[str], *, wipe: bool = False) -> Path:
    """Write this process's shared (rank and control) metrics into ``metrics_dir``, whatever
    ``PROMETHEUS_MULTIPROC_DIR`` says.

    Call once per process before routing starts; the rank-0 process passes ``wipe=True``
    (removes the files of dead processes: earlier runs, crashed workers). Existing children keep
    their identity, their values restart from the files (in-process counts so far are dropped).
    Pre-bound recorders notice the change and re-bind. Idempotent for the same directory.
    """
    global _atexit_registered
    d = Path(metrics_dir)
    d.mkdir(parents=True, exist_ok=True)
    if not os.access(d, os.W_OK):
        raise PermissionError(f"metrics_dir {d} is not writable")
    if wipe:
        wipe_metrics_dir(d, only_dead=True)
    if _BACKEND.directory is not None and _BACKEND.directory.resolve() == d.resolve():
        return d
    _close_files()
    _BACKEND.directory = d
    _reinit_shared_values()
    _BACKEND.bump()
    if not _atexit_registered:
        atexit.register(_mark_dead_at_exit)
        _atexit_registered = True
    return d


def _close_files() -> None:
    with _BACKEND.lock:
        _BACKEND.release_views()
        for f in _BACKEND.files.values():
            with contextlib.suppress(Exception):
                f.close()
        _BACKEND.files.clear()
        _BACKEND.values.clear()


def setup_in_process() -> None:
    """Back to in-process values (tests; a process that stops writing files)."""
    if _BACKEND.directory is None:
        return
    _close_files()
    _BACKEND.directory = None
    _reinit_shared_values()
    _BACKEND.bump()


def multiprocess_dir() -> Path | None:
    """The directory this process's shared metrics write to, or None (in-process)."""
    return _BACKEND.directory


def exposition_registry(metrics_dir: str | os.PathLike[str] | None = None) -> CollectorRegistry:
    """The registry a scrape endpoint serves (the sidecar's /metrics).

    With ``metrics_dir``: this process's sidecar metrics plus every process's shared metrics read
    from the files (MultiProcessCollector over flyserve's directory, never vLLM's). This process's
    own shared metrics must be in those files too (so a reload done here is not reported twice or
    lost): if the process is still in-process, it is switched with setup_multiprocess(metrics_dir).
    Without: every flyserve metric of this process, in-process (tests, single-process demos).
    """
    reg = CollectorRegistry()
    if metrics_dir is None:
        for m in ALL_METRICS:
            reg.register(m)
        return reg
    d = Path(metrics_dir)
    current = multiprocess_dir()
    if current is None:
        setup_multiprocess(d)
    elif current.resolve() != d.resolve():
        raise ValueError(f"this process writes its metrics to {current}, not {d}")
    for m in SIDECAR_METRICS:
        reg.register(m)
    MultiProcessCollector(reg, path=str(d))
    return reg
