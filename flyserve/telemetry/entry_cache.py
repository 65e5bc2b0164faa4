"""Where each entry of a metrics file holds its value, parsed once per file and extended as it grows.

A metrics file is append-only (prometheus_client's ``MmapedDict``: a new series is appended, an
existing one keeps its offset for the life of the file), so a reader that parses a file's keys once
can read later values straight from their offsets: one read of the used bytes per file and one
float64 index per entry. The sidecar's /dispatch-stats reader (flyserve.sidecar.stats) spent most of
its time re-parsing every key of every file on every computation (cProfile, 64 ranks).

``transform`` turns a key into what the caller wants to keep (None: not wanted); it runs once per
key per file. A file replaced under the same name (a compaction's rename: a new inode) or that
shrank is parsed again from the start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from flyserve.telemetry.prom import entry_offsets, read_used

T = TypeVar("T")
_EMPTY = memoryview(b"").cast("d")
MAX_FILES = 100_000


class EntryCache(Generic[T]):
    """Thread-safe per-file cache of ``[(transform(key), value index)]`` for one directory."""

    def __init__(self, transform: Callable[[str], T | None]) -> None:
        self._transform = transform
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, int, list[tuple[T, int]]]] = {}

    def read(self, path: str) -> tuple[memoryview[float], list[tuple[T, int]]]:
        """(the file's used bytes as float64s, its wanted entries). ValueError for a file whose
        header or entries cannot be true, OSError (FileNotFoundError) as open() raises it."""
        st, data = read_used(path)  # via safe_read.open_regular; size-capped
        if not data:
            return _EMPTY, []
        used, ino = len(data), st.st_ino
        with self._lock:
            hit = self._files.get(path)
        if hit is not None and hit[0] == ino and hit[1] <= used:
            entries = hit[2]
            if hit[1] < used:
                entries = entries + self._parse(data, hit[1], used)
        else:
            entries = self._parse(data, 8, used)
        with self._lock:
            if len(self._files) < MAX_FILES or path in self._files:
                self._files[path] = (ino, used, entries)
        return memoryview(data).cast("d"), entries

    def _parse(self, data: bytes, start: int, used: int) -> list[tuple[T, int]]:
        out = []
        for key, i in entry_offsets(data, start, used):
            t = self._transform(key)
            if t is not None:
                out.append((t, i))
        return out

    def forget_missing(self, present: set[str]) -> None:
        """Drop the entries of files no longer there (removed by a compaction or a wipe)."""
        with self._lock:
            for p in [p for p in self._files if p not in present]:
                del self._files[p]
