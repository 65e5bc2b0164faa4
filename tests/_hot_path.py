"""A rank's hot path, driven step by step with I/O forbidden and memory traced (imported as
``_hot_path``: tests/ is on sys.path via its conftest). RankControl.current(step) runs on every
decode step of every rank: the tests that call this pin that it never opens or stats a file, takes
its slow path (_switch) only where a version or a trial block starts, and keeps nothing per step."""

from __future__ import annotations

import builtins
import os
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from flyserve.control import RankControl


@dataclass(frozen=True)
class HotPathRun:
    """What one run of the hot path did: the steps at which the slow path ran, and the bytes still
    allocated after the last step that were not before the first."""

    slow_calls: list[int]
    retained: int


def _no_io(*a: object, **k: object) -> None:
    raise AssertionError("I/O on the hot path")


def run_hot_path(rc: RankControl, steps: Sequence[int]) -> HotPathRun:
    """rc.current(step) for each step (build ``steps`` up front: the loop itself allocates nothing)
    with open, os.stat and os.open raising, counting rc's slow path. Every patch is undone before
    this returns, so the caller's assertions may read files."""
    slow_calls: list[int] = []
    real_switch = rc._switch

    def counting_switch(step: int) -> None:
        slow_calls.append(step)
        real_switch(step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rc, "_switch", counting_switch)
        mp.setattr(builtins, "open", _no_io)
        mp.setattr(os, "stat", _no_io)
        mp.setattr(os, "open", _no_io)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for step in steps:
                rc.current(step)
            retained = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    return HotPathRun(slow_calls=slow_calls, retained=retained)
