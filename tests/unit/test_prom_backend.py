"""The metrics value backend: the one package allowed to touch prometheus_client internals.

It is gated on the prometheus-client version it was run against (0.20 to 0.26, each minor release:
tests/unit/test_telemetry_metrics.py passed under every one). These tests make sure an unknown
version fails at import with a message that says what to install, and that no module of flyserve
outside flyserve.telemetry.prom reaches into prometheus_client's private names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from flyserve.telemetry import prom as backend

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flyserve"
BACKEND_DIR = PACKAGE / "telemetry" / "prom"

# prometheus_client modules that are not its documented API, and the private attributes of its
# metric, value and file objects that flyserve's backend uses.
PRIVATE_MODULES = {"prometheus_client.mmap_dict", "prometheus_client.values", "prometheus_client.utils"}
PRIVATE_ATTRIBUTES = {
    "_value",
    "_upper_bounds",
    "_buckets",
    "_sum",
    "_metric_init",
    "_positions",
    "_labelnames",
    "_labelvalues",
    "_metrics",
    "_kwargs",
    "_documentation",
    "_multiprocess_mode",
    "_created",
}


def test_the_installed_version_is_in_the_tested_range():
    assert backend.check_version(backend.installed_version())


@pytest.mark.parametrize("version", ["0.19.1", "0.27.0", "1.0.0", "2", "not-a-version", ""])
def test_an_untested_version_is_refused_naming_it_and_the_range(version: str):
    with pytest.raises(backend.UnsupportedPrometheusClient) as err:
        backend.check_version(version)
    msg = str(err.value)
    assert repr(version) in msg
    assert "0.20 to 0.26" in msg and "pip install" in msg


@pytest.mark.parametrize("version", ["0.20.0", "0.26.0", "0.26.7", "0.23.1rc1"])
def test_each_tested_version_is_accepted(version: str):
    assert backend.check_version(version) >= (0, 20)


@pytest.mark.slow  # a python subprocess
def test_importing_flyserve_metrics_under_an_unknown_version_fails_loudly():
    """A fresh interpreter where prometheus-client reports 0.99.0: the import itself fails."""
    code = (
        "import importlib.metadata as md\n"
        "real = md.version\n"
        "md.version = lambda name: '0.99.0' if name == 'prometheus-client' else real(name)\n"
        "import flyserve.telemetry.metrics\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert r.returncode != 0
    assert "UnsupportedPrometheusClient" in r.stderr and "'0.99.0'" in r.stderr


def _modules() -> list[Path]:
    """Every module of flyserve but the backend package's own."""
    return sorted(p for p in PACKAGE.rglob("*.py") if BACKEND_DIR not in p.parents)


def test_the_backend_package_is_where_the_private_names_are():
    """The scans below leave flyserve.telemetry.prom out: it must exist and be the one using them."""
    backend_modules = sorted(BACKEND_DIR.glob("*.py"))
    assert len(backend_modules) >= 5
    imported = set()
    for path in backend_modules:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
    assert PRIVATE_MODULES <= imported
    assert not [p for p in _modules() if BACKEND_DIR in p.parents]


@pytest.mark.slow  # 2.0 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_no_other_module_imports_a_private_prometheus_client_module():
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(
                n in PRIVATE_MODULES or n.split(".")[-1].startswith("_") and n.startswith("prometheus_client")
                for n in names
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


@pytest.mark.slow  # 0.9 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_no_other_module_touches_a_private_attribute_of_a_prometheus_client_object():
    """Attribute reads like ``child._value`` on anything but ``self`` (a class's own state is its own)."""
    offenders = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in PRIVATE_ATTRIBUTES
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert offenders == []


def test_the_scan_itself_finds_a_private_access(tmp_path: Path):
    """The two scans above would pass on an empty list of modules: show that they see an offender."""
    tree = ast.parse("from prometheus_client.mmap_dict import MmapedDict\nx = child._value\n")
    found_import = any(isinstance(n, ast.ImportFrom) and n.module in PRIVATE_MODULES for n in ast.walk(tree))
    found_attr = any(isinstance(n, ast.Attribute) and n.attr in PRIVATE_ATTRIBUTES for n in ast.walk(tree))
    assert found_import and found_attr
    assert len(_modules()) > 30  # the whole package is scanned


def test_histogram_cells_add_up_to_what_prometheus_client_reports():
    """The cells the recorder writes are the ones the exposition reads (in-process backend)."""
    from prometheus_client import CollectorRegistry, generate_latest

    h = backend.FlyHistogram("t_backend_cells", "test", ["rank"], buckets=(1.0, 10.0), registry=None)
    child = h.labels("0")
    bounds, buckets, (sum_buf, sum_i) = backend.histogram_cells(child)
    assert bounds == [1.0, 10.0, float("inf")]
    for v in (0.5, 5.0, 50.0, 7.0):
        k = next(i for i, b in enumerate(bounds) if v <= b)
        buf, i = buckets[k]
        buf[i] += 1
        sum_buf[sum_i] += v
    reg = CollectorRegistry()
    reg.register(h)
    text = generate_latest(reg).decode()
    assert 't_backend_cells_bucket{le="1.0",rank="0"} 1.0' in text
    assert 't_backend_cells_bucket{le="10.0",rank="0"} 3.0' in text
    assert 't_backend_cells_bucket{le="+Inf",rank="0"} 4.0' in text
    assert 't_backend_cells_sum{rank="0"} 62.5' in text


def test_read_used_refuses_a_sparse_file_over_the_cap_without_reading_it(tmp_path: Path):
    """A 2 GB sparse file whose header claims (nearly) all of it: refused from the header."""
    p = tmp_path / "counter_1.db"
    used = (1 << 31) - 8
    with open(p, "wb") as f:
        f.write(used.to_bytes(4, "little") + b"\0" * 4)
        f.truncate(1 << 31)
    with pytest.raises(ValueError, match="larger than"):
        backend.read_used(p)


def test_read_used_reads_the_used_bytes(tmp_path: Path):
    p = tmp_path / "counter_1.db"
    data = backend.encode_values_file([('["m", "m_total", {}, "h"]', 2.0, 0.0)])
    p.write_bytes(data + b"\0" * 4096)
    st, got = backend.read_used(p)
    assert got == data and st.st_size == len(data) + 4096
    (tmp_path / "counter_2.db").write_bytes(b"\0" * 64)
    assert backend.read_used(tmp_path / "counter_2.db")[1] == b""  # still being created
    with pytest.raises(FileNotFoundError):
        backend.read_used(tmp_path / "counter_3.db")
