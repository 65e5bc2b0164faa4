"""Helpers shared by the test modules (imported as ``_support``: tests/ is on sys.path via its conftest).

Why not ``pytest.importorskip``: when ``import vllm`` breaks, about 30 tests turn into skips and a
green run says nothing. Under CI (``FLYSERVE_CI=1``, set by .ci/run) a missing dependency fails
the run; on a developer machine without the extra it still skips, saying what to install.
"""

from __future__ import annotations

import importlib
import os
import shutil
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
