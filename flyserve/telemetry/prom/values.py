"""The value backend of flyserve's metrics: the one module that touches prometheus_client internals.

Why a backend of our own: prometheus_client picks its value class from ``PROMETHEUS_MULTIPROC_DIR``
once, at import, and vLLM sets that variable to its own directory when it runs several API-server
processes. flyserve's rank and control metrics must land in flyserve's directory whatever the
environment says, and the rank-side hot path binds value cells to update them without a method
call. Both need names prometheus_client does not document: ``MmapedDict`` and ``mmap_key`` (the
file format), ``MmapedDict._positions`` / ``._m`` (where a value lives), ``MetricWrapperBase
._metric_init`` / ``._value`` / ``._kwargs`` / ``._metrics`` / ``._lock`` (how a child gets its
value), ``Histogram._upper_bounds`` / ``._buckets`` / ``._sum``, ``MutexValue`` and
``floatToGoString``. Every such name is used here and nowhere else (tests/unit/test_prom_backend.py
checks the rest of the package), and :data:`TESTED_VERSIONS` is the range they were checked
against: an import under any other prometheus-client version fails loudly
(:class:`UnsupportedPrometheusClient`) instead of writing files the sidecar cannot read.
pyproject.toml pins the same range.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.mmap_dict import _read_all_values as mmap_read_all_values
from prometheus_client.utils import floatToGoString
from prometheus_client.values import MutexValue

from flyserve.files import safe_read

# --------------------------------------------------------------------------------------------
# Version gate
# --------------------------------------------------------------------------------------------

TESTED_VERSIONS: Final = ((0, 20), (0, 26))
"""Inclusive (major, minor) range of prometheus-client whose internals this module was run against
(tests/unit/test_prom_backend.py and test_telemetry_metrics.py, each minor release in the range)."""


class UnsupportedPrometheusClient(ImportError):
    """The installed prometheus-client is outside :data:`TESTED_VERSIONS`."""


def check_version(version: str) -> tuple[int, int]:
    """(major, minor) of ``version`` if it is in the tested range; else UnsupportedPrometheusClient."""
    lo, hi = TESTED_VERSIONS
    try:
        major_minor = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        major_minor = ()
    if len(major_minor) != 2 or not (lo <= major_minor <= hi):
        raise UnsupportedPrometheusClient(
            f"prometheus-client {version!r} is not in the range flyserve's metrics backend was tested "
            f"with ({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}.x): it uses prometheus_client internals "
            "(flyserve/telemetry/_prom_backend.py). Install a tested version: "
            f"pip install 'prometheus-client>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}'"
        )
    return major_minor


def installed_version() -> str:
    try:
        return _dist_version("prometheus-client")
    except PackageNotFoundError:  # imported from a source tree: trust its own attribute if any
        import prometheus_client

        return str(getattr(prometheus_client, "__version__", "unknown"))


check_version(installed_version())

# --------------------------------------------------------------------------------------------
# Value backend: in-process floats, or mmap files in flyserve's own directory.
# --------------------------------------------------------------------------------------------


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
    BACKEND.release_views()
    for f in BACKEND.files.values():
        with contextlib.suppress(Exception):  # best effort in a fresh child
            f.close()
    BACKEND.files.clear()
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


def _new_value(typ: str, scope: str, *args: Any, **kwargs: Any) -> Any:
    if scope == SIDECAR:
        return MutexValue(typ, *args, **kwargs)
    if BACKEND.directory is not None:
        cls = _MmapValueSingleWriter if scope == RANK else _MmapValue
        return cls(typ, *args, **kwargs)
    return _LocalValue() if scope == RANK else MutexValue(typ, *args, **kwargs)


class _ScopeMixin:
    """Adds ``scope=`` (rank, control, sidecar): who writes the metric, so which value class it gets."""

    def _init_scope(self, scope: str) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self._scope = scope

    def _after_init(self) -> None:
        self._kwargs["scope"] = self._scope  # type: ignore[attr-defined]  # children inherit it
        if self._scope != SIDECAR and not self._labelvalues:  # type: ignore[attr-defined]
            BACKEND.shared.add(self)  # a parent (or an unlabelled metric): its values move with the files


class FlyCounter(_ScopeMixin, Counter):
    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        self._init_scope(scope)
        super().__init__(*args, **kwargs)
        self._after_init()

    def _metric_init(self) -> None:
        self._value = _new_value(
            self._type,
            self._scope,
            self._name,
            self._name + "_total",
            self._labelnames,
            self._labelvalues,
            self._documentation,
        )
        self._created = time.time()


class FlyGauge(_ScopeMixin, Gauge):
    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        self._init_scope(scope)
        super().__init__(*args, **kwargs)
        self._after_init()

    def _metric_init(self) -> None:
        self._value = _new_value(
            self._type,
            self._scope,
            self._name,
            self._name,
            self._labelnames,
            self._labelvalues,
            self._documentation,
            multiprocess_mode=self._multiprocess_mode,
        )


class FlyHistogram(_ScopeMixin, Histogram):
    def __init__(self, *args: Any, scope: str = RANK, **kwargs: Any) -> None:
        self._init_scope(scope)
        super().__init__(*args, **kwargs)
        self._after_init()

    def _metric_init(self) -> None:
        self._created = time.time()
        self._sum = _new_value(
            self._type,
            self._scope,
            self._name,
            self._name + "_sum",
            self._labelnames,
            self._labelvalues,
            self._documentation,
        )
        self._buckets = [
            _new_value(
                self._type,
                self._scope,
                self._name,
                self._name + "_bucket",
                self._labelnames + ("le",),
                self._labelvalues + (floatToGoString(b),),
                self._documentation,
            )
            for b in self._upper_bounds
        ]


# --------------------------------------------------------------------------------------------
# What the rest of flyserve may ask of a metric (public names only outside this module)
# --------------------------------------------------------------------------------------------


def value_of(child: Any) -> Any:
    """The value object of a counter or gauge child (or an unlabelled metric)."""
    return child._value


def value_cell(child: Any) -> tuple[Any, int]:
    """(buffer, index) of a rank-side counter or gauge child: ``buf[i] += n`` updates it."""
    return cell(child._value)


def histogram_cells(child: Any) -> tuple[list[float], list[tuple[Any, int]], tuple[Any, int]]:
    """(upper bounds, one cell per bucket, the sum cell) of a rank-side histogram child.

    Bucket cells hold per-bucket counts (not cumulative), as prometheus_client stores them."""
    return list(child._upper_bounds), [cell(b) for b in child._buckets], cell(child._sum)


def exposed_name(m: Any) -> str:
    """The name a scrape shows (and the multiprocess files hold): counters get their _total suffix."""
    return m._name + ("_total" if m._type == "counter" else "")


def metric_type(m: Any) -> str:
    """counter, gauge or histogram."""
    return str(m._type)


def label_names(m: Any) -> tuple[str, ...]:
    return tuple(m._labelnames)


def reinit_values(metrics: Iterable[Any]) -> None:
    """Re-create the value of every existing child in place (the child objects stay), so they
    follow the backend's current directory (or in-process state)."""
    for m in metrics:
        if m._labelnames:
            with m._lock:
                children = list(m._metrics.values())
            for child in children:
                child._metric_init()
        else:
            m._metric_init()


def close_files() -> None:
    """Close every open metrics file of this process and forget its values."""
    with BACKEND.lock:
        BACKEND.release_views()
        for f in BACKEND.files.values():
            with contextlib.suppress(Exception):
                f.close()
        BACKEND.files.clear()
        BACKEND.values.clear()


MAX_VALUES_FILE_BYTES = 256 << 20
"""A rank's metrics file holds a few thousand series (under 1 MiB); a sparse file claiming more is
refused rather than read into memory."""


def _used_of(head: bytes, size: int) -> int | None:
    if len(head) < 8:
        return 0
    used = struct.unpack_from("i", head, 0)[0]
    if used == 0:
        return 0
    return used if 8 <= used <= size else None


def _open_values_file(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(fd, size) of a metrics file through flyserve.files.safe_read.open_regular: a FIFO, a
    symlink (to /dev/zero) or a directory among the metrics files is refused at once (ValueError),
    never waited on (a plain open() of a FIFO blocked every /metrics and /dispatch-stats for ever).
    FileNotFoundError if gone. The caller closes fd."""
    name = os.path.basename(path)
    opened = safe_read.open_regular(path, source=name)
    if opened is None:
        raise FileNotFoundError(errno.ENOENT, "metrics file is gone", name)
    return opened[0], opened[1].st_size


def values_file_used(path: str | os.PathLike[str]) -> int | None:
    """The used size a metrics file's header claims, or None if that cannot be true: the header
    claims less than 8 (but not 0) or more than the file holds.
    prometheus_client's reader believes the header and reads that many bytes: a header saying
    2^31-1 made /metrics and /dispatch-stats answer 500 (MemoryError) until the file was removed.

    0 for a file still being created: shorter than 8 bytes or a zero header (prometheus_client's
    MmapedDict creates the file, truncates it to its first size, then writes the header): no
    entries yet, not a bad file. A file that is not regular raises ValueError (safe_read)."""
    fd, size = _open_values_file(path)
    try:
        return _used_of(os.pread(fd, 8, 0), size)
    finally:
        os.close(fd)


def read_used(path: str | os.PathLike[str]) -> tuple[os.stat_result, bytes]:
    """(fstat, the used bytes, header included) of one metrics file: the one header check both
    cached readers (flyserve.telemetry.files_exposition, flyserve.telemetry.entry_cache) share.

    Opened through safe_read.open_regular (a FIFO, symlink or directory: ValueError, never waited
    on); FileNotFoundError if gone. ``b""`` for a file still being created (shorter than 8 bytes
    or a zero header). ValueError for a header claiming less than 8 bytes, more than the file
    holds, a size that is not a multiple of 8, or more than MAX_VALUES_FILE_BYTES: a sparse 2 GB
    file with a matching header is refused, not read in full on every scrape."""
    name = os.path.basename(path)
    opened = safe_read.open_regular(path, source=name)
    if opened is None:
        raise FileNotFoundError(errno.ENOENT, "metrics file is gone", name)
    fd, st = opened
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return st, b""
        used = int.from_bytes(head[:4], "little", signed=True)
        if used == 0:
            return st, b""
        if used < 8 or used > st.st_size or used % 8:
            raise ValueError(f"{name}: its header claims a size the file cannot hold")
        if used > MAX_VALUES_FILE_BYTES:
            raise ValueError(f"{name}: larger than {MAX_VALUES_FILE_BYTES} bytes")
        data = os.pread(fd, used, 0)
    finally:
        os.close(fd)
    if len(data) < used:
        raise ValueError(f"{name}: shorter than its header claims")
    return st, data


def read_values_file(path: str | os.PathLike[str]) -> Iterator[tuple[str, float, float, int]]:
    """(key, value, timestamp, position) of every entry of one metrics file (read-only).

    A key is prometheus_client's JSON ``[metric_name, name, labels, help]``. Raises ValueError for
    a file whose header or entries cannot be true (values_file_used) or that is not a regular
    file, FileNotFoundError if gone. One open, header and entries read from it."""
    fd, size = _open_values_file(path)
    try:
        used = _used_of(os.pread(fd, 8, 0), size)
        if used is None:
            raise ValueError(f"{os.path.basename(path)}: header's used size does not fit the file")
        if used == 0:  # still being created
            return iter(())
        if used > MAX_VALUES_FILE_BYTES:
            raise ValueError(f"{os.path.basename(path)}: larger than {MAX_VALUES_FILE_BYTES} bytes")
        data = os.pread(fd, used, 0)
    finally:
        os.close(fd)
    try:
        return iter(list(mmap_read_all_values(data, used)))
    except (RuntimeError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{os.path.basename(path)}: corrupt entry ({type(exc).__name__})") from None


def encode_values_file(entries: Iterable[tuple[str, float, float]]) -> bytes:
    """The bytes of a metrics file holding ``entries`` (key, value, timestamp), in the layout
    prometheus_client's ``MmapedDict`` writes (a used-size header, then per entry: key length,
    UTF-8 key padded with spaces to 8-byte alignment, value, timestamp), so its readers and
    :func:`read_values_file` read it. Used to write compacted archives (flyserve.telemetry.compaction)
    in one piece to a temporary file, never through a live mapping."""
    parts = [b"\0" * 8]
    used = 8
    for key, value, timestamp in entries:
        encoded = key.encode("utf-8")
        padding = b" " * (8 - (len(encoded) + 4) % 8)
        entry = struct.pack(
            f"i{len(encoded)}s{len(padding)}sdd", len(encoded), encoded, padding, value, timestamp
        )
        parts.append(entry)
        used += len(entry)
    data = bytearray(b"".join(parts))
    struct.pack_into("i", data, 0, used)
    return bytes(data)


def float_text(value: float) -> str:
    """A sample value as prometheus_client's text format writes it (``+Inf``, ``1.0``, ``1e+06``)."""
    return floatToGoString(value)


def entry_offsets(data: bytes, start: int, used: int) -> list[tuple[str, int]]:
    """(key, index of the value as a float64 of ``data``) of every entry from byte ``start`` (8 for
    the first) up to ``used``, in a metrics file's layout (:func:`encode_values_file`). The
    timestamp is the next float64. Raises ValueError for an entry that cannot be true."""
    out = []
    pos = start
    unpack = struct.unpack_from
    while pos < used:
        n = unpack("i", data, pos)[0]
        if n <= 0 or pos + 4 + n > used:
            raise ValueError(f"entry at byte {pos} claims a key of {n} bytes")
        key = data[pos + 4 : pos + 4 + n].decode("utf-8")  # UnicodeDecodeError is a ValueError
        pos += 4 + n + (8 - (n + 4) % 8)
        if pos + 16 > used:
            raise ValueError(f"entry at byte {pos} runs past the used size")
        out.append((key, pos // 8))
        pos += 16
    return out
