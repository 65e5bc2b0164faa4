"""Shared test fixtures: the facts the tests check against, carried inside the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import tier_of

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def seed_cases() -> dict:
    """The seed PR's measured MI350X dispatch cases (tests/data/seed_dispatch_cases.json)."""
    path = TEST_DATA / "seed_dispatch_cases.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: the seed's measured cases are required test data")
    return json.loads(path.read_text())


def pytest_collection_modifyitems(config, items) -> None:
    """Fast to slow (unit, benchmarks, integration, e2e, gpu): a broken unit test shows in seconds."""
    items.sort(key=lambda item: tier_of(Path(str(item.path))))
