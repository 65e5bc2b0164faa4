"""Helpers shared by the test modules (imported as ``_support``: tests/ is on sys.path via its conftest).

Why not ``pytest.importorskip``: when ``import vllm`` breaks, about 30 tests turn into skips and a
green run says nothing. Under CI (``FLYSERVE_CI=1``, set by .ci/run) a missing dependency fails
the run; on a developer machine without the extra it still skips, saying what to install.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import pytest

CI_VARIABLE = "FLYSERVE_CI"


def under_ci() -> bool:
    return os.environ.get(CI_VARIABLE, "") not in ("", "0")


def _missing(what: str, install: str, detail: str) -> None:
    msg = f"{what} is not available ({detail}); {install}"
    if under_ci():
        pytest.fail(f"{msg}. {CI_VARIABLE} is set: a missing dependency fails the run", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require_module(name: str, install: str = "run scripts/setup.sh") -> ModuleType:
    """``import name``, or fail under CI / skip elsewhere. Any import error counts, not only a missing
    module: a vllm that is installed but broken is exactly what must not pass quietly."""
    try:
        return importlib.import_module(name)
    except Exception as exc:
        _missing(f"python module {name!r}", install, f"{type(exc).__name__}: {str(exc)[:200]}")
        raise  # unreachable: fail/skip raise


def require_binary(name: str, install: str = "install Debian's `prometheus` package (scripts/setup.sh does)") -> str:
    """The path of executable ``name`` on PATH, or fail under CI / skip elsewhere."""
    path = shutil.which(name)
    if path is None:
        _missing(f"executable {name!r}", install, "not on PATH")
        raise AssertionError("unreachable")
    return path


# Fast to slow, so a broken unit test shows in seconds, before the servers and vLLM start (the
# order tests/conftest.py gives a run). Within a tier, collection order is kept.
REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "benchmarks", "integration", "e2e", "gpu")


def tier_of(path: Path) -> int:
    """The tier of a test file: the first directory under the repository named in TIERS."""
    try:
        parts = path.resolve().relative_to(REPO).parts
    except ValueError:
        return len(TIERS)
    for part in parts[:2]:
        if part in TIERS:
            return TIERS.index(part)
    return len(TIERS)


def require_flydsl_checkout(root: Path, revision: str) -> Path:
    """The FlyDSL checkout ``root/FlyDSL-<revision>``, or fail under CI / skip elsewhere.

    scripts/flydsl-compile-setup.sh makes it: a copy of the revision's vendored files
    (third_party/flydsl/<revision>/, what flyserve's call imports: FlyDSL's kernels/ package is not
    in the flydsl wheel and CI cannot reach github.com), or a ``git archive`` of a whole tree.
    .ci/run runs it (for flydsl 0.4.2 and 0.5.0), so under CI a missing checkout is a failure like
    any other missing dependency.
    """
    tree = root / f"FlyDSL-{revision}"
    if not (tree / "kernels" / "attention").is_dir():
        _missing(
            f"the FlyDSL checkout {tree.name}/",
            "run scripts/flydsl-compile-setup.sh (.ci/run does) to compile flyserve's call with FlyDSL's compiler",
            f"none under {root.name}/",
        )
    return tree


def require_executable(path: Path, install: str) -> Path:
    """``path`` if it is an executable file, or fail under CI / skip elsewhere (a tool installed into
    a venv of its own, like checkov in .venv-checkov, is not on PATH)."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        _missing(f"executable {path.name!r}", install, f"no {path.parent.parent.name}/bin/{path.name}")
        raise AssertionError("unreachable")
    return path
