"""Store's StepWitness is shared by the sidecar's probe, sampler, compactor and request threads.
Its look and the refused count it leaves were read with no lock: a second look between the two
made the first reader report the other look's count (and two looks lost each other's `_seen`).
Now the look and its count are one step under Store._witness_lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flyserve.control.reports import RankReport
from flyserve.control.store import Store
from flyserve.control.witness import StepWitness


class _InterleavingWitness:
    """A witness whose first look pauses after setting its count, until a second look has run
    (or 1 s has passed: with the lock, the second look cannot start before the first ends). Each
    read of ``refused`` is recorded with the reading thread and the look that thread made."""

    def __init__(self) -> None:
        self._refused = 0
        self.calls = 0
        self.first_paused = threading.Event()
        self.second_ran = threading.Event()
        self.look_of: dict[int, int] = {}
        self.reads: list[tuple[int, int]] = []  # (the reader's own look, the count it read)
        self._count_lock = threading.Lock()

    def look(self, reports: list[Any], now: float, confirmed: Callable[[RankReport], bool]) -> list[Any]:
        with self._count_lock:
            self.calls += 1
            n = self.calls
        self.look_of[threading.get_ident()] = n
        self._refused = n  # look n refuses n reports
        if n == 1:
            self.first_paused.set()
            self.second_ran.wait(1.0)
        else:
            self.second_ran.set()
        return []

    @property
    def refused(self) -> int:
        self.reads.append((self.look_of[threading.get_ident()], self._refused))
        return self._refused


@pytest.mark.slow  # 1.0 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_a_reader_gets_the_refused_count_of_its_own_look(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    fake = _InterleavingWitness()
    store._witness = fake  # type: ignore[assignment]
    errors: list[BaseException] = []

    def read() -> None:
        try:
            store.reports(now=1000.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    first = threading.Thread(target=read)
    first.start()
    assert fake.first_paused.wait(5.0)
    second = threading.Thread(target=read)
    second.start()
    first.join(5.0)
    second.join(5.0)
    assert not first.is_alive() and not second.is_alive()
    assert errors == []
    assert sorted(fake.reads) == [(1, 1), (2, 2)]  # never (1, 2): a count from another look


def test_concurrent_reports_keep_the_witness_consistent(tmp_path: Path) -> None:
    """Several threads reading at once (the real witness, no rank files): no exception, and the
    witness ends with the state of one whole look."""
    store = Store(tmp_path / "state")
    assert isinstance(store._witness, StepWitness)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(50):
                store.reports(now=1000.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert store._witness.refused == 0
    assert store.skipped_rank_files == 0
