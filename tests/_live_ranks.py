"""Rank reports for a simulation that has already finished, so the sidecar reads its shape samples.

The sidecar counts shape samples only from live ranks. Tests that run `flyserve
simulate` to the end and then open the sidecar app on its state directory stand in for the finished
ranks with reports written by this (live) test process, on this host and in this pid namespace, and
refreshed every half second: the process table confirms them, as it would the real ranks."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from flyserve.control import Store
from flyserve.control.reports import HOST, PIDNS


@contextlib.contextmanager
def vouched_ranks(state: Path, ranks: Iterable[int], *, step: int, engine: int = 0) -> Iterator[None]:
    store = Store(state)
    keys = list(ranks)
    started = time.time() - 1.0
    stop = threading.Event()

    def write() -> None:
        now = time.time()
        for rank in keys:
            store.write_rank_report(
                {"pid": os.getpid(), "host": HOST, "pidns": PIDNS, "rank": rank, "engine": engine,
                 "started": started, "step": step, "applied_version": None, "time": now},
                rank=rank, engine=engine,
            )  # fmt: skip

    def refresh() -> None:
        while not stop.wait(0.5):
            write()

    write()
    t = threading.Thread(target=refresh, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)
