"""The control plane's metrics, defined once in flyserve.telemetry.metrics:
flyserve_config_reloads_total{result,source} and flyserve_config_last_success_timestamp_seconds."""

from __future__ import annotations

import logging

from flyserve.telemetry.metrics import CONFIG_RELOADS, LATE_APPLIES, record_config_reload

log = logging.getLogger("flyserve.control")


def count_reload(result: str, source: str) -> None:
    """result: success | invalid | io_error. Never raises: a metrics problem must not fail a change."""
    try:
        record_config_reload(result, source)
    except Exception as exc:  # noqa: BLE001
        log.debug("reload metric not counted: %s", exc)


def count_late_applies(rank: int, n: int) -> None:
    """flyserve_control_late_applies_total{rank}: versions a rank learned of past their effective step
    (it applied them at once, at a step other ranks may not share). Off the hot path (the rank's
    background thread); never raises."""
    try:
        LATE_APPLIES.labels(str(rank)).inc(n)
    except Exception as exc:  # noqa: BLE001
        log.debug("late-apply metric not counted: %s", exc)


def reload_count(result: str, source: str) -> float:
    """The counter's value as this process sees it (tests and `thresholds show`)."""
    for metric in CONFIG_RELOADS.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels == {"result": result, "source": source}:
                return s.value
    return 0.0
