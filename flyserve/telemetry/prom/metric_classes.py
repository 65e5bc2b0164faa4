"""FlyCounter, FlyGauge, FlyHistogram: prometheus_client's metric classes with a ``scope=``.

The scope (rank, control, sidecar) says who writes a metric, so which value class its samples get
(flyserve.telemetry.prom.values.new_value). prometheus_client creates a child's values in
``_metric_init``, an undocumented hook, and reads them back through ``_value``, ``_sum`` and
``_buckets``: those overrides are why these classes live in this package.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString

from flyserve.telemetry.prom.values import BACKEND, RANK, SCOPES, SIDECAR, new_value


class _ScopeMixin:
    """Adds ``scope=`` (rank, control, sidecar): who writes the metric, so which value class it gets."""

    _scope: str

    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self._scope = scope  # before prometheus_client's __init__: it creates an unlabelled metric's value
        super().__init__(*args, **kwargs)
        self._kwargs["scope"] = self._scope  # type: ignore[attr-defined]  # children inherit it
        if self._scope != SIDECAR and not self._labelvalues:  # type: ignore[attr-defined]
            BACKEND.shared.add(self)  # a parent (or an unlabelled metric): its values move with the files

    def _sample_value(
        self, sample_name: str, extra_label: tuple[str, str] | None = None, **kwargs: Any
    ) -> Any:
        """A new value for one sample of this child: ``extra_label`` (name, value) is a
        histogram bucket's ``le``."""
        labelnames, labelvalues = self._labelnames, self._labelvalues  # type: ignore[attr-defined]
        if extra_label is not None:
            labelnames, labelvalues = labelnames + (extra_label[0],), labelvalues + (extra_label[1],)
        return new_value(
            self._type,  # type: ignore[attr-defined]
            self._scope,
            self._name,  # type: ignore[attr-defined]
            sample_name,
            labelnames,
            labelvalues,
            self._documentation,  # type: ignore[attr-defined]
            **kwargs,
        )


class FlyCounter(_ScopeMixin, Counter):
    def _metric_init(self) -> None:
        self._value = self._sample_value(self._name + "_total")
        self._created = time.time()


class FlyGauge(_ScopeMixin, Gauge):
    def _metric_init(self) -> None:
        self._value = self._sample_value(self._name, multiprocess_mode=self._multiprocess_mode)


class FlyHistogram(_ScopeMixin, Histogram):
    def _metric_init(self) -> None:
        self._created = time.time()
        self._sum = self._sample_value(self._name + "_sum")
        self._buckets = [
            self._sample_value(self._name + "_bucket", ("le", floatToGoString(b))) for b in self._upper_bounds
        ]
