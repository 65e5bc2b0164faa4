"""The version gate: prometheus-client versions whose internals this package was run against.

Every module of flyserve.telemetry.prom uses names prometheus_client does not document, so an import
under any other prometheus-client version fails loudly (:class:`UnsupportedPrometheusClient`)
instead of writing files the sidecar cannot read. The package's ``__init__`` runs the check before
any of its modules imports prometheus_client's internals; pyproject.toml pins the same range.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Final

TESTED_VERSIONS: Final = ((0, 20), (0, 26))
"""Inclusive (major, minor) range of prometheus-client whose internals this package was run against
(tests/unit/test_prom_backend.py and test_telemetry_metrics.py, each minor release in the range)."""


class UnsupportedPrometheusClient(ImportError):
    """The installed prometheus-client is outside :data:`TESTED_VERSIONS`."""


def check_version(version: str) -> tuple[int, int]:
    """(major, minor) of ``version`` if it is in the tested range; else UnsupportedPrometheusClient."""
    lo, hi = TESTED_VERSIONS
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    if len(major_minor) != 2 or not (lo <= major_minor <= hi):
        raise UnsupportedPrometheusClient(
            f"prometheus-client {version!r} is not in the range flyserve's metrics backend was tested "
            f"with ({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.x): it uses prometheus_client internals "
            "(flyserve/telemetry/prom/). Install a tested version: "
            f"pip install 'prometheus-client>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'"
        )
    return major_minor


def installed_version() -> str:
    try:
        return _dist_version("prometheus-client")
    except PackageNotFoundError:  # imported from a source tree: trust its own attribute if any
        import prometheus_client

        return str(getattr(prometheus_client, "__version__", "unknown"))
