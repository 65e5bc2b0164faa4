"""`flyserve doctor` tells AMD's aiter from the unrelated package that owns the name on PyPI.

``pip install aiter`` gives "Useful patterns building upon asynchronous iterators" (aiter 0.13.20191203);
AMD's is built from github ROCm/aiter (distribution amd-aiter) or comes in ROCm's vLLM images. Each case
is a package written into a temp dir put first on sys.path: nothing is imported from it.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from flyserve.doctor import aiter_package, checks

PYPI_METADATA = (
    "Metadata-Version: 2.1\nName: aiter\nVersion: 0.13.20191203\n"
    "Summary: Useful patterns building upon asynchronous iterators.\n"
    "Home-page: https://github.com/richardkiss/aiter\n"
)


def _put(root, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder first on sys.path; ``import aiter`` must never happen while the doctor identifies it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    _put(tmp_path, "aiter/__init__.py", "raise AssertionError('the doctor imported aiter')\n")
    yield tmp_path
    importlib.invalidate_caches()


def pypi_aiter(root, *, with_metadata: bool = True) -> None:
    for m in ("map_aiter.py", "azip.py", "iter_to_aiter.py", "push_aiter.py"):
        _put(root, f"aiter/{m}")
    if with_metadata:
        _put(root, "aiter-0.13.20191203.dist-info/METADATA", PYPI_METADATA)


def amd_aiter(root) -> None:
    _put(root, "aiter/ops/__init__.py")
    _put(root, "aiter/ops/triton/__init__.py")
    _put(root, "aiter/ops/triton/unified_attention.py")
    _put(
        root, "amd_aiter-0.1.6.dist-info/METADATA", "Metadata-Version: 2.1\nName: amd-aiter\nVersion: 0.1.6\n"
    )


def test_the_pypi_package_is_named_by_its_metadata_and_modules(site):
    pypi_aiter(site)
    found = aiter_package.identify()
    assert found.kind == "unrelated" and found.where == str(site / "aiter")
    assert found.distribution == "aiter 0.13.20191203"
    assert "no aiter/ops/triton/ package" in found.why and "map_aiter.py" in found.why
    assert "asynchronous iterators" in found.why
    status, detail, fix = aiter_package.assess(found)
    assert (
        status == "warn" and "is not AMD's aiter" in detail and "unrelated async-iterator library" in detail
    )
    assert "pip uninstall aiter" in fix and "github.com/ROCm/aiter" in fix and "not on PyPI" in fix


def test_an_aiter_without_amds_ops_is_flagged_even_without_metadata(site):
    pypi_aiter(site, with_metadata=False)
    found = aiter_package.identify()
    assert found.kind == "unrelated" and found.distribution == ""


def test_amds_aiter_is_ok(site):
    amd_aiter(site)
    found = aiter_package.identify()
    assert found.kind == "amd" and found.distribution == "amd-aiter 0.1.6"
    assert aiter_package.assess(found)[0] == "ok"


def test_amds_files_with_pypis_distribution_over_them_warn(site):
    amd_aiter(site)
    _put(site, "aiter-0.13.20191203.dist-info/METADATA", PYPI_METADATA)
    found = aiter_package.identify()
    assert found.kind == "mixed" and "shares the aiter/ folder" in found.why
    assert aiter_package.assess(found)[0] == "warn"


def test_the_doctor_reports_it_on_any_platform(site):
    pypi_aiter(site)
    (line,) = [c for c in checks.check_aiter_package() if c.name == "aiter-package"]
    assert line.status == "warn" and "is not AMD's aiter" in line.detail


def test_no_aiter_no_line(monkeypatch):
    monkeypatch.setattr(aiter_package.importlib.util, "find_spec", lambda name: None)
    assert aiter_package.identify().kind == "absent"
    assert checks.check_aiter_package() == []
