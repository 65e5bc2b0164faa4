"""The type-check gate (.ci/run runs `.venv/bin/mypy`) covers at least the policy, the control plane
and the telemetry: pyproject's [tool.mypy] files list cannot silently shrink.

Runs no type checker: .ci/run does, once, before the suite.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = ("flyserve/policy", "flyserve/control", "flyserve/telemetry")


def _mypy_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["mypy"]


def test_mypy_files_include_policy_control_and_telemetry():
    files = _mypy_config()["files"]
    assert isinstance(files, list)
    missing = [p for p in REQUIRED if p not in files]
    assert not missing, f"[tool.mypy] files no longer lists {missing}"


def test_mypy_files_exist():
    # a renamed package would make mypy fail ("can't find"); say which entry
    assert [p for p in _mypy_config()["files"] if not (ROOT / p).exists()] == []
