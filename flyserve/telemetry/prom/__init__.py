"""flyserve's prometheus_client internals: the only package that touches its private names.

Why: prometheus_client picks its value class from ``PROMETHEUS_MULTIPROC_DIR`` once, at import, and
vLLM sets that variable to its own directory; flyserve's rank and control metrics must land in
flyserve's directory whatever the environment says, and the rank-side hot path updates bound value
cells without a method call. Both need names prometheus_client does not document: ``MmapedDict`` and
``mmap_key`` (the file format), ``MmapedDict._positions`` / ``._m`` (where a value lives),
``MetricWrapperBase._metric_init`` / ``._value`` / ``._kwargs`` / ``._metrics`` / ``._lock`` (how a
child gets its value), ``Histogram._upper_bounds`` / ``._buckets`` / ``._sum``, ``MutexValue`` and
``floatToGoString``. Every such name is used in this package and nowhere else
(tests/unit/test_prom_backend.py checks the rest of flyserve).

version         the gate: prometheus-client versions these internals were run against (0.20-0.26);
                it runs here, before any module below imports an internal
values          the value backend: in-process floats or mmap cells in flyserve's directory, by scope
metric_classes  FlyCounter, FlyGauge, FlyHistogram: prometheus_client's classes with ``scope=``
access          what the rest of flyserve may ask of a metric (bound cells, names, re-init)
files           the multiprocess files: read, check and write prometheus_client's file layout
"""

from flyserve.telemetry.prom.version import (
    TESTED_VERSIONS,
    UnsupportedPrometheusClient,
    check_version,
    installed_version,
)

check_version(installed_version())  # an untested version fails here, before an internal is imported

from flyserve.telemetry.prom.access import (
    exposed_name,
    histogram_cells,
    label_names,
    metric_type,
    reinit_values,
    value_cell,
    value_of,
)
from flyserve.telemetry.prom.files import (
    encode_values_file,
    entry_offsets,
    float_text,
    read_used,
    read_values_file,
    values_file_used,
)
from flyserve.telemetry.prom.metric_classes import FlyCounter, FlyGauge, FlyHistogram
from flyserve.telemetry.prom.values import (
    BACKEND,
    CONTROL,
    RANK,
    SCOPES,
    SIDECAR,
    cell,
    close_files,
    new_value,
)

__all__ = [
    "BACKEND",
    "CONTROL",
    "RANK",
    "SCOPES",
    "SIDECAR",
    "TESTED_VERSIONS",
    "FlyCounter",
    "FlyGauge",
    "FlyHistogram",
    "UnsupportedPrometheusClient",
    "cell",
    "check_version",
    "close_files",
    "encode_values_file",
    "entry_offsets",
    "exposed_name",
    "float_text",
    "histogram_cells",
    "installed_version",
    "label_names",
    "metric_type",
    "new_value",
    "read_used",
    "read_values_file",
    "reinit_values",
    "value_cell",
    "value_of",
    "values_file_used",
]
