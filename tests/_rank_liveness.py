"""What the in-process liveness tests share (tests/unit/test_liveness_attacks.py and
tests/unit/test_liveness_confirms_the_ranks_own_process.py; imported as ``_rank_liveness``: tests/
is on sys.path via its conftest): one frozen clock, read by the plane and written into every report
so that the step projections are exact; the plane built on it; the "another host" forgery; a live
process of this user that is not a rank. A test module binds the fixtures by name
(``plane = _rank_liveness.plane``) so that pytest finds them there."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane

STEP_MARGIN, LEAD_S = 8, 3.0
FORGED_STARTED = 1_577_836_800.0  # 2020-01-01, the earliest start a report may claim


class FrozenClock:
    """The planes' clock and the reports' time: set once per test (frozen_clock), then still."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


CLOCK = FrozenClock()


@pytest.fixture(autouse=True)
def frozen_clock() -> FrozenClock:
    """CLOCK set to now at the start of each test of a module that binds this fixture."""
    CLOCK.now = time.time()
    return CLOCK


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "state", step_margin=STEP_MARGIN, lead_s=LEAD_S, clock=CLOCK)


def forged_report(rank: int, **over: Any) -> dict[str, Any]:
    """The "another host" forgery: plausible values, another host, a step of 1e11."""
    d = {"pid": 4242 + rank, "host": "elsewhere", "pidns": "", "rank": rank, "engine": 0,
         "started": FORGED_STARTED, "step": 10**11, "applied_version": 0, "time": CLOCK.now}  # fmt: skip
    d.update(over)
    return d


@pytest.fixture
def other_process() -> Iterator[int]:
    """A live process of this user that is not a rank: what a local forger would name as its pid."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait(timeout=10)
