"""Shared test fixtures: the facts the tests check against, carried inside the repository."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import (
    FAST_TIER_GUARD,
    FastTierGuard,
    fast_tier_guard,
    in_slow_tier,
    make_xdist_scheduler,
    tier_of,
    xdist_order,
)

REPO = Path(__file__).resolve().parents[1]
TEST_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def seed_cases() -> dict:
    """The seed PR's measured MI350X dispatch cases (tests/data/seed_dispatch_cases.json)."""
    path = TEST_DATA / "seed_dispatch_cases.json"
    if not path.is_file():
        pytest.fail(f"{path} is missing: the seed's measured cases are required test data")
    return json.loads(path.read_text())


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items) -> None:
    """Every test under tests/integration, tests/e2e and tests/gpu is slow. In one process the run
    goes fast to slow (unit, benchmarks, integration, e2e, gpu): a broken unit test shows in seconds.
    On xdist's workers the longest modules go first (_support.xdist_order): the tail is what a
    parallel run waits for."""
    for item in items:
        if in_slow_tier(Path(str(item.path))):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):  # an xdist worker (not its env var: subprocesses inherit it)
        items.sort(key=lambda item: xdist_order(Path(str(item.path))))
    else:
        items.sort(key=lambda item: tier_of(Path(str(item.path))))


def pytest_xdist_make_scheduler(config, log):
    """Work units of _support.xdist_work_unit: a module sharing a fixture runs on one worker."""
    return make_xdist_scheduler(config, log)


# The fast tier's guard (_support.FastTierGuard): a test not marked slow that starts a subprocess or
# connects a socket fails, saying "mark it slow". Around each phase, not a function-scoped fixture:
# a module-scoped fixture (kubectl kustomize in test_deploy_manifests) is set up before any of those.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with fast_tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with fast_tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with fast_tier_guard(item):
        return (yield)


@pytest.fixture
def fast_tier(request) -> FastTierGuard | None:
    """The guard of this test (None when it is marked slow): its tests read and clear its violations."""
    return request.node.stash.get(FAST_TIER_GUARD, None)
