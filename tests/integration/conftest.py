"""Fixtures the live tests of this folder share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _live_sidecar import LiveSidecar, stop_process


@pytest.fixture
def stopper() -> Iterator[list[LiveSidecar]]:
    """Sidecars a test appends here are stopped when it ends, passed or failed."""
    started: list[LiveSidecar] = []
    yield started
    for sc in started:
        stop_process(sc.proc, kill_wait_s=5)
