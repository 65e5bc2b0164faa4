"""The control plane's two metrics, taken from flyserve.telemetry.metrics (where every metric is
defined once). Until that module defines them, unregistered local stand-ins with the same names
and labels keep the counting code and its tests honest without double registration.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

RELOADS_NAME = "flyserve_config_reloads"  # exposed as flyserve_config_reloads_total
LAST_SUCCESS_NAME = "flyserve_config_last_success_timestamp_seconds"


def _find(module: Any, name: str) -> Any:
    for value in vars(module).values():
        if isinstance(value, (Counter, Gauge)) and getattr(value, "_name", None) == name:
            return value
    return None


def _load() -> tuple[Any, Any]:
    reloads = last = None
    try:
        from flyserve.telemetry import metrics as tm
    except ImportError:
        tm = None
    if tm is not None:
        reloads, last = _find(tm, RELOADS_NAME), _find(tm, LAST_SUCCESS_NAME)
    if reloads is None:
        reloads = Counter(
            RELOADS_NAME,
            "Threshold changes tried, by result and source.",
            ["result", "source"],
            registry=None,
        )
    if last is None:
        last = Gauge(LAST_SUCCESS_NAME, "Unix time of the last successful threshold change.", registry=None)
    return reloads, last


CONFIG_RELOADS, CONFIG_LAST_SUCCESS = _load()


def count_reload(result: str, source: str, *, at: float | None = None) -> None:
    """result: success | invalid | io_error. Never raises: metrics must not break a reload."""
    try:
        CONFIG_RELOADS.labels(result=result, source=source).inc()
        if result == "success" and at is not None:
            CONFIG_LAST_SUCCESS.set(at)
    except Exception as exc:  # noqa: BLE001 - a metrics backend problem is not a config problem
        import logging

        logging.getLogger("flyserve.control").debug("reload metric not counted: %s", exc)


def reload_count(result: str, source: str) -> float:
    """The counter's value in this process (for tests and `thresholds show`)."""
    return CONFIG_RELOADS.labels(result=result, source=source)._value.get()
