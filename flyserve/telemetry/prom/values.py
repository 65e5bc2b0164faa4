"""The value backend: where a flyserve metric's numbers live in this process.

Why a backend of our own: prometheus_client picks its value class from ``PROMETHEUS_MULTIPROC_DIR``
once, at import, and vLLM sets that variable to its own directory when it runs several API-server
processes. flyserve's rank and control metrics must land in flyserve's directory whatever the
environment says, and the rank-side hot path binds value cells to update them without a method
call. So a value here is an in-process float, or a cell of an mmap file in flyserve's own
directory written in prometheus_client's file format (``MmapedDict``, ``mmap_key``, its
``_positions`` and ``_m``: names it does not document, used only in this package); the sidecar's
own metrics keep prometheus_client's ``MutexValue``. Which one a metric gets follows its scope
(rank, control, sidecar) and whether setup_multiprocess named a directory.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.values import MutexValue


class _Backend:
    """Which value class the shared metrics use in this process.

    ``generation`` increases whenever the values are re-created (setup_multiprocess,
    setup_in_process, a fork), so objects that bound value cells (DispatchRecorder, KernelTimer)
    notice with one int compare and re-bind.
    """

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.generation = 0
        self.lock = threading.Lock()
        self.files: dict[str, MmapedDict] = {}
        self.views: dict[int, tuple[Any, memoryview[float]]] = {}  # id(mmap) -> (mmap, its float64 view)
        self.pid = os.getpid()
        self.values: list[_MmapValue] = []
        # Objects holding bound cells; bump() calls their _invalidate() so their hot path needs no
        # generation check of its own (the next call misses its lookup and re-binds).
        self.listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        # Every shared (rank or control) metric parent: setup_multiprocess re-creates their values.
        self.shared: weakref.WeakSet[Any] = weakref.WeakSet()

    def bump(self) -> None:
        self.generation += 1
        for obj in list(self.listeners):
            obj._invalidate()

    def view(self, m: Any) -> memoryview[float]:
        """A float64 view of an mmap (one per mapping; MmapedDict maps a larger one when it grows)."""
        got = self.views.get(id(m))
        if got is None or got[0] is not m:
            got = self.views[id(m)] = (m, memoryview(m).cast("d"))
        return got[1]

    def release_views(self) -> None:
        """Views pin their mappings (mmap.close() refuses while one exists): release before closing."""
        for _, v in self.views.values():
            v.release()
        self.views.clear()

    def close_files(self) -> None:
        """Close every open metrics file of this process (best effort: a fresh child, an exit)."""
        self.release_views()
        for f in self.files.values():
            with contextlib.suppress(Exception):
                f.close()
        self.files.clear()


BACKEND: Final = _Backend()
"""This process's backend state; ``generation`` and ``listeners`` are what bound objects watch."""


class _MmapValue:
    """A float in an mmap file of flyserve's metrics directory (prometheus_client's file format).

    Same file names and layout as prometheus_client's ``MmapedValue`` (``counter_<pid>.db``,
    ``gauge_<mode>_<pid>.db``), so ``MultiProcessCollector(registry, path=dir)`` reads them;
    unlike it, the directory is explicit, never read from ``PROMETHEUS_MULTIPROC_DIR``, and a
    fork is handled by ``os.register_at_fork`` instead of a ``getpid()`` on every write.

    The value is the cell ``_buf[_i]`` of a float64 view of the mapping (entries are 8-byte
    aligned, value then timestamp): an aligned 8-byte store, so a scraper never reads a torn
    or zeroed value (prometheus_client avoids ``struct.pack_into`` for that reason). The
    recorder binds ``(_buf, _i)`` and updates the cell without a method call. This class locks
    (control side: several threads may write).
    """

    _multiprocess = True
    __slots__ = ("_buf", "_i", "_params")

    def __init__(
        self,
        typ: str,
        metric_name: str,
        name: str,
        labelnames: Iterable[str],
        labelvalues: Iterable[str],
        help_text: str,
        multiprocess_mode: str = "",
        **_: Any,
    ) -> None:
        self._params = (
            typ,
            metric_name,
            name,
            tuple(labelnames),
            tuple(labelvalues),
            help_text,
            multiprocess_mode,
        )
        with BACKEND.lock:
            self._reset()
            BACKEND.values.append(self)

    def _reset(self) -> None:
        typ, metric_name, name, labelnames, labelvalues, help_text, mode = self._params
        prefix = f"{typ}_{mode}" if typ == "gauge" else typ
        f = BACKEND.files.get(prefix)
        if f is None:
            assert BACKEND.directory is not None
            f = BACKEND.files[prefix] = MmapedDict(str(BACKEND.directory / f"{prefix}_{BACKEND.pid}.db"))
        key = mmap_key(metric_name, name, list(labelnames), list(labelvalues), help_text)
        _, ts = f.read_value(key)  # creates the entry: a zero series from the first scrape
        pos = f._positions[key]
        assert pos % 8 == 0
        # The mapping that holds the entry now. When MmapedDict grows it maps a larger view but
        # the old one stays valid while our view pins it, and both share the file (MAP_SHARED).
        self._buf = BACKEND.view(f._m)
        self._i = pos // 8
        if mode.endswith("mostrecent") and not ts:
            # MultiProcessCollector reports a "mostrecent" gauge only with a timestamp > 0. The
            # creation time is stamped once: between a live rank and a dead one's leftover file
            # the newer process wins, and set() stays one store (no clock read per step).
            self._buf[self._i + 1] = time.time()

    def inc(self, amount: float) -> None:
        with BACKEND.lock:
            self._buf[self._i] += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        with BACKEND.lock:
            self._buf[self._i] = value
            if timestamp:
                self._buf[self._i + 1] = timestamp

    def set_exemplar(self, exemplar: Any) -> None:  # not supported in files
        return

    def get(self) -> float:
        return self._buf[self._i]

    def get_exemplar(self) -> None:
        return None


class _MmapValueSingleWriter(_MmapValue):
    """Rank side: written by the engine thread only, so no lock (a lock round trip costs as much
    as the write itself: measured 0.3 us on the 2-core CI VM)."""

    __slots__ = ()

    def inc(self, amount: float) -> None:
        self._buf[self._i] += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._buf[self._i] = value
        if timestamp:
            self._buf[self._i + 1] = timestamp


class _LocalValue:
    """Rank side, in-process: a one-element list, single writer (the engine thread), no lock.

    Same ``(_buf, _i)`` cell interface as the mmap value, so the recorder binds either."""

    _multiprocess = False
    __slots__ = ("_buf",)
    _i = 0

    def __init__(self, *_: Any, **__: Any) -> None:
        self._buf = [0.0]

    def inc(self, amount: float) -> None:
        self._buf[0] += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._buf[0] = value

    def set_exemplar(self, exemplar: Any) -> None:
        return

    def get(self) -> float:
        return self._buf[0]

    def get_exemplar(self) -> None:
        return None


def cell(value: Any) -> tuple[Any, int]:
    """(buffer, index) of a rank-side value: ``buf[i] += n`` updates it with no method call."""
    return value._buf, value._i


def _after_fork_in_child() -> None:
    """A forked child must not write into its parent's files: reopen under the child's pid.

    Values restart at zero in the child (its parent's counts stay in the parent's files)."""
    BACKEND.lock = threading.Lock()
    BACKEND.pid = os.getpid()
    if BACKEND.directory is None:
        return
    BACKEND.close_files()
    for v in BACKEND.values:
        v._reset()
    BACKEND.bump()


os.register_at_fork(after_in_child=_after_fork_in_child)


RANK: Final = "rank"
"""Written by one thread of a rank process; shared through the metrics directory."""
CONTROL: Final = "control"
"""Written by any thread of a publishing process; shared through the metrics directory."""
SIDECAR: Final = "sidecar"
"""The sidecar's own metrics: always in-process, thread-safe."""
SCOPES: Final = (RANK, CONTROL, SIDECAR)


def new_value(typ: str, scope: str, *args: Any, **kwargs: Any) -> Any:
    """The value object of one sample of a metric of ``scope`` (prometheus_client's ValueClass
    arguments): prometheus_client's MutexValue for the sidecar, else per the backend's state."""
    if scope == SIDECAR:
        return MutexValue(typ, *args, **kwargs)
    if BACKEND.directory is not None:
        cls = _MmapValueSingleWriter if scope == RANK else _MmapValue
        return cls(typ, *args, **kwargs)
    return _LocalValue() if scope == RANK else MutexValue(typ, *args, **kwargs)


def close_files() -> None:
    """Close every open metrics file of this process and forget its values."""
    with BACKEND.lock:
        BACKEND.close_files()
        BACKEND.values.clear()
