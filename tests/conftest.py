"""Shared test fixtures: where the shared facts live."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """../shared/data beside the checkout (as in CI), or $FLYSERVE_SHARED_DATA."""
    env = os.environ.get("FLYSERVE_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def seed_cases() -> dict:
    path = shared_data_dir() / "seed_dispatch_cases.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: the seed's measured cases are required test data")
    return json.loads(path.read_text())
