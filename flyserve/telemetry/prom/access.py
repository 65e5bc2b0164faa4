"""What the rest of flyserve may ask of a metric, in public names.

The recorder and the kernel timer bind value cells, the docs test reads label names, multiprocess
re-creates values when the directory changes: each reads a private attribute of a prometheus_client
object (``_value``, ``_buckets``, ``_labelnames``, ``_metrics``, ``_metric_init``, ...), so each asks
here and no module outside flyserve.telemetry.prom touches those names
(tests/unit/test_prom_backend.py scans the rest of the package).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flyserve.telemetry.prom.values import cell


def value_of(child: Any) -> Any:
    """The value object of a counter or gauge child (or an unlabelled metric)."""
    return child._value


def value_cell(child: Any) -> tuple[Any, int]:
    """(buffer, index) of a rank-side counter or gauge child: ``buf[i] += n`` updates it."""
    return cell(child._value)


def histogram_cells(child: Any) -> tuple[list[float], list[tuple[Any, int]], tuple[Any, int]]:
    """(upper bounds, one cell per bucket, the sum cell) of a rank-side histogram child.

    Bucket cells hold per-bucket counts (not cumulative), as prometheus_client stores them."""
    return list(child._upper_bounds), [cell(b) for b in child._buckets], cell(child._sum)


def exposed_name(m: Any) -> str:
    """The name a scrape shows (and the multiprocess files hold): counters get their _total suffix."""
    return m._name + ("_total" if m._type == "counter" else "")


def metric_type(m: Any) -> str:
    """counter, gauge or histogram."""
    return str(m._type)


def label_names(m: Any) -> tuple[str, ...]:
    return tuple(m._labelnames)


def reinit_values(metrics: Iterable[Any]) -> None:
    """Re-create the value of every existing child in place (the child objects stay), so they
    follow the backend's current directory (or in-process state)."""
    for m in metrics:
        if m._labelnames:
            with m._lock:
                children = list(m._metrics.values())
            for child in children:
                child._metric_init()
        else:
            m._metric_init()
