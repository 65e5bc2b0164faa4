"""create_app(settings): the sidecar's FastAPI application.

Everything the app needs hangs off ``app.state`` (settings, control plane, stats service,
metrics registry, a shutdown flag), so several apps with different state directories can live
in one process (tests) and nothing is global but the metric objects themselves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from flyserve.autopilot.inputs import Mode
from flyserve.control import ControlIOError, ControlPlane, VersionConflict
from flyserve.control.paths import make_private_dir
from flyserve.policy.errors import MAX_ERRORS_SHOWN, MAX_MESSAGE_CHARS, redact_field
from flyserve.policy.thresholds import ThresholdsError
from flyserve.sidecar.actor import actor_id
from flyserve.sidecar.advice_job import compute_advice
from flyserve.sidecar.advice_worker import FitWorker
from flyserve.sidecar.autopilot_live import live_inputs
from flyserve.sidecar.autopilot_runner import AutopilotRunner
from flyserve.sidecar.cache import TtlCache
from flyserve.sidecar.compactor import MetricsCompactor
from flyserve.sidecar.fingerprint import fingerprint_of
from flyserve.sidecar.middleware import (
    AdmissionMiddleware,
    BodyLimitMiddleware,
    HeaderGuardMiddleware,
    RequestMetricsMiddleware,
)
from flyserve.sidecar.models import RankView
from flyserve.sidecar.routes import router
from flyserve.sidecar.service import MAX_LATE_S, StatsService
from flyserve.sidecar.settings import SidecarSettings
from flyserve.sidecar.stream import RECLAIM_REASONS, StreamHub
from flyserve.telemetry import metrics as tm
from flyserve.telemetry.files_exposition import FilesExposition
from flyserve.terminal.printable import printable

log = logging.getLogger("flyserve.sidecar")

DESCRIPTION = """\
The flyserve sidecar runs next to `vllm serve` and shares its state directory.

* **Read** (open): `/dispatch-stats` (JSON), `/dispatch-stats/stream` (SSE), `/thresholds`,
  `/thresholds/history`, `/metrics` (Prometheus), `/healthz`, `/readyz`.
* **Change** (bearer token): `PUT`/`PATCH /thresholds`, `POST /thresholds/rollback`, `POST /reload`.
  Every change goes through the control plane: validated in full, versioned, audited, and applied
  by every rank at the same engine step. `If-Match: <version>` guards against lost updates;
  `?dry_run=true` reports the diff and the routing change on recently sampled batch shapes.

Binds to 127.0.0.1 by default: put it behind your own network policy before binding wider.
"""


def _registry(metrics_dir: Path, share: bool) -> CollectorRegistry:
    """The /metrics registry of this process's sidecar metrics; the ranks' files are rendered
    beside it by FilesExposition (prometheus_client's collector took 5-10x longer).

    In a real sidecar process this also makes the control plane's counters (reloads done through
    this API) land in the shared files, via telemetry's exposition_registry. A process that
    already writes its metrics elsewhere (tests building several apps) gets the read-only variant.
    """
    make_private_dir(metrics_dir.parent)  # the state directory: 0700 when created here
    metrics_dir.mkdir(parents=True, exist_ok=True)
    if share:
        try:
            return tm.exposition_registry(metrics_dir, files=False)
        except ValueError as exc:
            log.warning("control metrics stay in-process: %s", exc)
    reg = CollectorRegistry()
    for m in tm.SIDECAR_METRICS:
        reg.register(m)
    return reg


def update_ignored_files(control: ControlPlane) -> int:
    """flyserve_sidecar_ignored_files: what the last looks at metrics/ and ranks/ skipped (a
    poisoned metrics file, 20,000 rank files: exported, not only logged).
    Returns the metrics count it set."""
    from flyserve.telemetry.multiprocess import SKIPPED_FILES

    n = len(SKIPPED_FILES)
    tm.SIDECAR_IGNORED_FILES.labels("metrics").set(float(n))
    tm.SIDECAR_IGNORED_FILES.labels("rank_reports").set(float(control.store.skipped_rank_files))
    return n


def update_rank_gauges(views: list[RankView]) -> None:
    """flyserve_rank_up / _report_age_seconds / flyserve_ranks_agree / flyserve_thresholds_fingerprint
    from the ranks' reports."""
    for v in views:
        tm.RANK_UP.labels(str(v.rank)).set(0.0 if v.stale else 1.0)
        if v.age_s is not None:
            tm.RANK_REPORT_AGE.labels(str(v.rank)).set(v.age_s)
    versions = {v.applied_version for v in views if not v.stale}
    agree = len(versions) <= 1 if versions else None
    # No live rank: NaN, not 1 ("agree") - there is nobody to agree; an alert on == 0 stays quiet
    # and the dashboard shows no value.
    tm.RANKS_AGREE.set(float("nan") if agree is None else 1.0 if agree else 0.0)
    tm.THRESHOLDS_FINGERPRINT.set(fingerprint_of(views))  # which content, comparable across replicas


def _repair_state_dir(control: ControlPlane) -> None:
    """At start: make the state directory consistent (flyserve.control.repair) - a lost current.json
    rebuilt from history, a killed writer's temp/orphan files removed, its audit entries completed.
    A directory that cannot be repaired now is logged, not fatal: the API reports it (503)."""
    from flyserve.control.repair import repair

    try:
        report = repair(control, actor="sidecar-start")
    except ControlIOError as exc:
        log.error("state directory not repaired at start: %s", exc)
        return
    if report.changed:
        log.warning("state directory repaired at start: %s", report.to_dict())


def _error(status: int, detail: str, field: str | None = None, errors: list[dict[str, str]] | None = None):
    """An error body: its words may echo a request's field names and a file's (a state directory's
    path, a config key), so the detail is escaped and bounded (flyserve.terminal.printable) and a field is
    shown as ThresholdsError shows one (redact_field): a client that prints it prints no ESC."""
    return JSONResponse(
        {
            "detail": printable(detail, MAX_MESSAGE_CHARS),
            "field": None if field is None else redact_field(field),
            "errors": errors or [],
        },
        status_code=status,
    )


DROP_REASONS = ("head_timeout", "request_timeout", "evicted", "refused")
COMPACTION_ACTIONS = ("merged", "dropped")


def _expose_labelled_counters_at_zero() -> None:
    """Every known label of the sidecar's labelled counters, at 0 from the start: a series that
    appears only with its first event has no rate() before it (an empty dashboard panel, an alert
    that cannot fire on the first increase)."""
    for reason in DROP_REASONS:
        tm.SIDECAR_DROPPED_CONNECTIONS.labels(reason)
    for action in COMPACTION_ACTIONS:
        tm.SIDECAR_COMPACTED_FILES.labels(action)
    for reason in RECLAIM_REASONS:
        tm.SIDECAR_STREAM_RECLAIMS.labels(reason)


def create_app(settings: SidecarSettings) -> FastAPI:
    """Build the app. Starts nothing until the ASGI lifespan starts (the counter sampler thread)."""
    _expose_labelled_counters_at_zero()
    extra = {} if settings.step_margin is None else {"step_margin": settings.step_margin}
    control = ControlPlane(
        settings.state_dir, profile=settings.profile, config_file=settings.config_file, **extra
    )
    stats = StatsService(settings, control)

    def on_stats(st: Any) -> None:  # after each sampled /dispatch-stats
        update_rank_gauges(st.ranks)
        update_ignored_files(control)

    stats.on_stats = on_stats
    shutting_down = threading.Event()
    compactor = MetricsCompactor(
        control, interval_s=settings.compact_interval_s, stale_after_s=settings.stale_after_s
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        shutting_down.clear()
        _repair_state_dir(control)
        stats.start()
        compactor.start()  # its own thread: never where requests are answered
        if settings.autopilot != "off":
            app.state.autopilot.start()  # its own thread too (a POST /autopilot/mode starts it later)
        # The operator's file is watched here, in the one process that always runs beside the
        # ranks: an edit (or a ConfigMap swap, or SIGHUP) is published without anyone calling
        # POST /reload. Publishing is idempotent by content hash, so another watcher is harmless.
        watcher = None
        if settings.config_file is not None and settings.watch_config:
            watcher = control.watch(poll_interval_s=settings.config_poll_s, actor="sidecar-watcher")
            if threading.current_thread() is threading.main_thread():
                watcher.install_sighup()
        app.state.watcher = watcher
        try:
            yield
        finally:
            shutting_down.set()
            if watcher is not None:
                watcher.stop()
            compactor.stop()
            app.state.autopilot.stop()
            stats.stop()
            app.state.advice_worker.close()

    app = FastAPI(
        title="flyserve sidecar",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.control = control
    app.state.stats = stats
    app.state.compactor = compactor
    app.state.shutting_down = shutting_down
    app.state.registry = _registry(control.state_dir.metrics_dir, settings.share_control_metrics)
    app.state.actor_id = actor_id(
        None if settings.token is None else settings.token.get_secret_value(),
        state_dir=control.state_dir,
        actor_name=settings.actor_name,
    )
    registry = app.state.registry
    files = FilesExposition(control.state_dir.metrics_dir)
    app.state.files_exposition = files

    def _exposition() -> bytes:
        views = stats.rank_views_only()
        update_rank_gauges(views)
        # The files first: reading them finds a bad metrics file, so the scrape that left a file
        # out also counts it in flyserve_sidecar_ignored_files.
        files_text = files.text()
        update_ignored_files(control)
        return generate_latest(registry) + files_text

    app.state.advice_worker = FitWorker(
        lambda window: compute_advice(stats, window),
        deadline_s=settings.advice_deadline_s,
        fresh_s=settings.advice_fresh_s,
    )
    app.state.autopilot = AutopilotRunner(
        control,
        config=settings.autopilot_config(),
        mode=Mode(settings.autopilot),
        bounds=settings.autopilot_bounds,
        live_inputs=live_inputs(
            app.state.advice_worker, settings.autopilot_window, priced=lambda: stats.pricing is not None
        ),
        interval_s=settings.autopilot_interval_s,
        lease_s=settings.autopilot_lease_s,
        on_publish=app.state.advice_worker.invalidate,
    )
    app.state.stream_hub = StreamHub(
        stats.dispatch_stats_json,
        tick_s=settings.stream_min_interval_s,
        max_streams=settings.max_streams,
        write_timeout_s=settings.stream_write_timeout_s,
        max_queued_events=settings.stream_max_queued_events,
        lease_s=settings.stream_lease_s,
    )
    app.state.metrics_cache = TtlCache(
        _exposition, settings.metrics_ttl_s, max_stale_s=settings.metrics_ttl_s + MAX_LATE_S
    )
    stats.extra_caches.append(app.state.metrics_cache)

    @app.exception_handler(ThresholdsError)
    async def _thresholds_error(_: Request, exc: ThresholdsError):
        return _error(422, str(exc), exc.field, [{"field": f, "reason": r} for f, r in exc.errors])

    @app.exception_handler(VersionConflict)
    async def _conflict(_: Request, exc: VersionConflict):
        return _error(409, str(exc), "If-Match")

    @app.exception_handler(ControlIOError)
    async def _io(_: Request, exc: ControlIOError):
        return _error(503, f"state directory: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # One route per method under the same path: Starlette's Allow names only the first.
            allowed = set()
            for route in app.router.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                methods = getattr(route, "methods", None)
                if methods and match != Match.NONE and route.path_regex.match(request.url.path):
                    allowed |= methods
            headers["Allow"] = ", ".join(sorted(allowed))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errors = []
        found = exc.errors()
        for e in found[:MAX_ERRORS_SHOWN]:  # a body with 10,000 bad keys gets five named
            loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "header", "path")]
            field = redact_field(".".join(loc) or "<body>")  # a key of the request, escapes and all
            errors.append({"field": field, "reason": printable(e.get("msg", "invalid"), 300)})
        if len(found) > MAX_ERRORS_SHOWN:
            errors.append({"field": "<body>", "reason": f"and {len(found) - MAX_ERRORS_SHOWN} more errors"})
        first = errors[0] if errors else {"field": "<request>", "reason": "invalid"}
        detail = "; ".join(f"field '{x['field']}': {x['reason']}" for x in errors) or "invalid request"
        return _error(422, detail, first["field"], errors)

    app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(HeaderGuardMiddleware)
    app.add_middleware(
        AdmissionMiddleware,
        max_requests=settings.max_requests,
        token=None if settings.token is None else settings.token.get_secret_value().encode(),
    )
    app.add_middleware(RequestMetricsMiddleware)  # added last = outermost: counts 413s too
    return app
