"""Shared test fixtures: the facts the tests check against, carried inside the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def seed_cases() -> dict:
    """The seed PR's measured MI350X dispatch cases (tests/data/seed_dispatch_cases.json)."""
    path = TEST_DATA / "seed_dispatch_cases.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: the seed's measured cases are required test data")
    return json.loads(path.read_text())


# Fast to slow, so a broken unit test shows in seconds, before the servers and vLLM start.
# Within a tier, collection order (file, then definition order) is kept.
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


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: tier_of(Path(str(item.path))))
