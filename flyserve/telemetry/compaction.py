"""Compaction of dead processes' metric files, so ``<state>/metrics/`` stays bounded.

Every rank process writes its own ``counter_<pid>.db``, ``histogram_<pid>.db`` and
``gauge_<mode>_<pid>.db`` (prometheus_client's multiprocess layout). A crashed worker restarted
100 times leaves 100 sets behind, and every scrape reads them all: prometheus_client's own
collector takes seconds with thousands of files (0.8-1.25 s for 3,000 files). The files
cannot simply be removed: the dead ranks' counts are part of the totals, and a counter that goes
down reads as a reset to Prometheus.

So :func:`compact` merges the files of processes that are gone into one archive per kind, whose
"pid" is ``dead`` (``counter_dead.db``, ``histogram_dead.db``, ``gauge_<mode>_dead.db``), as
prometheus_client's ``MultiProcessCollector`` would merge them at scrape time:

* counters and histograms (per-bucket counts and sums): summed, series by series, so every total a
  scrape shows is the same before and after;
* gauges of a ``live*`` mode: dropped (the collector must not report a dead process's value; a
  cleanly exited process removes them itself at exit, a killed one cannot);
* gauges of mode ``min`` / ``max`` / ``sum`` / ``mostrecent``: merged the same way (the pid label
  is not shown for these modes, so the exposition does not change);
* gauges of mode ``all`` show one series per pid: left alone (flyserve defines none).

Crash safety. Sources are only removed after the archive that contains them is durable, and a
journal names the sources an archive already contains while they are being removed:

1. merge the archive and the sources into ``.compact-<archive>.tmp``, fsync it;
2. under the read lock (exclusive): write the journal (archive, temp, sources), fsync; rename the
   temporary over the archive, fsync the directory; remove the sources; remove the journal.

A crash in 1 leaves a stray temporary (removed on the next run); in 2 before the rename, the
journal and a complete temporary (the next run renames it and goes on); after the rename, the
journal names sources the archive already holds: readers (:func:`reading`) leave them out, and the
next run removes them. A scrape never sees a source counted twice or missing: readers hold the
read lock (shared) while they list and read the files. A journal is obeyed only if it names what
this module writes (:func:`parse_journal`): anyone who can write the directory could otherwise
forge one that renames over, or removes, any file the sidecar can write.

The liveness test is the caller's (``is_alive``): the sidecar passes one that also refuses to
compact when rank reports come from another pid namespace, where ``kill(pid, 0)`` says nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from flyserve.files import safe_read
from flyserve.files.processes import pid_alive
from flyserve.telemetry.prom import encode_values_file, read_values_file

log = logging.getLogger("flyserve.telemetry")

ARCHIVE_PID = "dead"
"""The "pid" of an archive file: never a number, so it is never taken for a live process."""
COMPACT_LOCK = ".compaction.lock"
"""Held (exclusive, non-blocking) by a compaction for its whole run: one compactor at a time."""
READ_LOCK = ".read.lock"
"""Shared by readers while they list and read the files; exclusive while a compaction commits."""
JOURNAL = ".compaction.journal"
TEMP_PREFIX = ".compact-"
MERGED_GAUGE_MODES = frozenset({"min", "max", "sum", "mostrecent"})
LIVE_GAUGE_MODES = frozenset({"livemin", "livemax", "livesum", "livemostrecent", "liveall"})
COMMIT_LOCK_WAIT_S = 5.0


@dataclass(frozen=True)
class MetricFile:
    """One ``*.db`` name, parsed: ``group`` is the archive it merges into (``counter``,
    ``histogram``, ``gauge_<mode>``), ``pid`` the writer's pid as text (``dead`` for an archive)."""

    name: str
    group: str
    kind: str
    mode: str
    pid: str

    @property
    def archive_name(self) -> str:
        return f"{self.group}_{ARCHIVE_PID}.db"


def parse_name(name: str) -> MetricFile | None:
    """A metrics file name -> MetricFile, or None for anything not in the multiprocess layout."""
    if not name.endswith(".db"):
        return None
    parts = name[:-3].split("_")
    if len(parts) == 2 and parts[0] in ("counter", "histogram"):
        return MetricFile(name, parts[0], parts[0], "", parts[1])
    if len(parts) == 3 and parts[0] == "gauge" and parts[1]:
        return MetricFile(name, f"gauge_{parts[1]}", "gauge", parts[1], parts[2])
    return None


@dataclass(frozen=True)
class CompactionReport:
    """What one run did. ``busy``: another compaction held the lock, nothing was done."""

    merged: int = 0
    dropped: int = 0
    archives: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    recovered: str | None = None
    busy: bool = False
    files_before: int = 0
    files_after: int = 0


# ----------------------------------------------------------------------------- locks and journal


def _lock_fd(metrics_dir: Path, name: str) -> int | None:
    """An fd on the lock file ``name`` (created if missing), or None if it cannot be opened (a
    read-only directory: a reader then reads without the lock, as before compaction existed)."""
    try:
        return os.open(metrics_dir / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        try:
            return os.open(metrics_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None


@dataclass(frozen=True)
class Journal:
    """A journal that names what a compaction of this module could have written: ``archive`` a
    ``<group>_dead.db`` name, ``temp`` its temporary, ``sources`` dead processes' files of that
    group. Anything else is refused, so a forged journal cannot rename over or remove other files."""

    archive: str
    temp: str
    sources: tuple[str, ...]


def _plain_name(name: object) -> TypeGuard[str]:
    return isinstance(name, str) and bool(name) and "/" not in name and ".." not in name and "\0" not in name


def parse_journal(raw: bytes) -> Journal:
    """The journal's content, or ValueError (safe_read.SafeReadError for bad or deeply nested JSON)
    when it is not one this module writes: an archive that is not a ``dead`` archive name, a temp
    not ``.compact-<archive>.tmp``, a source that is not a ``*.db`` file of a process that is gone
    (:func:`pid_alive`) in the archive's group, or any name with ``/`` or ``..``."""
    j = safe_read.parse_json(raw, source=JOURNAL)
    if not isinstance(j, dict):
        raise safe_read.SafeReadError(JOURNAL, "not a JSON object", "<document>")
    archive, temp, sources = j.get("archive"), j.get("temp"), j.get("sources")
    mf = parse_name(archive) if _plain_name(archive) else None
    if mf is None or mf.pid != ARCHIVE_PID or mf.archive_name != archive:
        raise safe_read.SafeReadError(JOURNAL, f"not a <kind>_{ARCHIVE_PID}.db name", "archive")
    if temp != f"{TEMP_PREFIX}{archive}.tmp":
        raise safe_read.SafeReadError(JOURNAL, "not the archive's temporary", "temp")
    if not isinstance(sources, list):
        raise safe_read.SafeReadError(JOURNAL, "not a list", "sources")
    for s in sources:
        src = parse_name(s) if _plain_name(s) else None
        if src is None or src.archive_name != archive or not src.pid.isdigit() or pid_alive(int(src.pid)):
            raise safe_read.SafeReadError(
                JOURNAL, f"names a file that is not a dead process's {mf.group} file", "sources"
            )
    return Journal(str(archive), str(temp), tuple(sources))


def committed_sources(metrics_dir: Path) -> frozenset[str]:
    """Source files that an archive already contains (a compaction crashed after its rename and
    before it removed them): readers must leave them out. Empty almost always (no journal)."""
    try:
        raw = safe_read.read_bytes(metrics_dir / JOURNAL, 1 << 20)
        if raw is None:
            return frozenset()
        j = parse_journal(raw)
    except (OSError, ValueError):
        # A torn journal: written before the rename, so nothing is committed. A refused one (a
        # forgery, deep nesting): leaving nothing out is what the next compaction will decide too.
        return frozenset()
    if (metrics_dir / j.temp).exists():
        return frozenset()  # the rename has not happened: the sources still count, the archive is old
    return frozenset(j.sources)


@contextlib.contextmanager
def reading(metrics_dir: str | os.PathLike[str]) -> Iterator[frozenset[str]]:
    """Hold the read lock (shared) while listing and reading the metrics files; yields the names to
    leave out (:func:`committed_sources`). A compaction's commit (renames and removals, a few ms)
    waits for readers and readers wait for it, so no read sees an archive and its sources both."""
    d = Path(metrics_dir)
    fd = _lock_fd(d, READ_LOCK)
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield committed_sources(d)
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it. Whatever is at ``path`` is unlinked
    first and the file is created O_EXCL | O_NOFOLLOW: a symlink planted there (by anyone who can
    write the metrics directory) is removed, never followed, so its target is never overwritten."""
    _remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _flock_exclusive(fd: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                return False
        time.sleep(0.005)


def recover(metrics_dir: Path) -> str | None:
    """Finish what a crashed compaction left: roll a journalled commit forward, remove a stray
    temporary. Call with the compaction lock held. Returns what was done, None if nothing."""
    journal = metrics_dir / JOURNAL
    done = None
    j: Journal | None = None
    try:
        raw = safe_read.read_bytes(journal, 1 << 20)
        j = None if raw is None else parse_journal(raw)
    except (OSError, ValueError) as exc:
        # Torn while being written, so before its rename (the journal is fsynced first): the
        # archive is the old one and every source still counts. Or not a journal this module
        # writes (forged, nested too deep): acting on it could rename over or remove any file.
        # Drop it either way; the temp goes below.
        log.warning("metrics compaction: dropped the journal: %s", str(exc)[:200])
        _remove(journal)
        done = "dropped a torn or invalid journal"
    if j is not None:
        archive, temp = metrics_dir / j.archive, metrics_dir / j.temp
        if temp.exists():
            os.replace(temp, archive)  # complete: fsynced before the journal was written
            _fsync_dir(metrics_dir)
        for s in j.sources:
            _remove(metrics_dir / s)
        _fsync_dir(metrics_dir)
        _remove(journal)
        done = f"finished an interrupted compaction into {j.archive} ({len(j.sources)} source file(s))"
    for name in os.listdir(metrics_dir):
        if name.startswith(TEMP_PREFIX) and name.endswith(".tmp"):
            _remove(metrics_dir / name)
            done = done or "removed a stray temporary file"
    return done


# ----------------------------------------------------------------------------- merging


def read_entries(path: Path) -> list[tuple[str, float, float]]:
    """(key, value, timestamp) of every entry; ValueError/OSError for a file that cannot be read."""
    return [(k, v, ts) for k, v, ts, _pos in read_values_file(path)]


def merge_entries(group: str, files: list[list[tuple[str, float, float]]]) -> list[tuple[str, float, float]]:
    """The entries of one archive holding ``files``' entries (the old archive's among them, if any).

    Counters and histograms are summed per key (a histogram file holds per-bucket counts and the
    sum, all additive); gauges follow their mode."""
    mode = group.split("_", 1)[1] if group.startswith("gauge_") else ""
    values: dict[str, tuple[float, float]] = {}
    for entries in files:
        for key, value, ts in entries:
            old = values.get(key)
            if old is None:
                values[key] = (value, ts)
            elif mode in ("", "sum"):
                values[key] = (old[0] + value, max(old[1], ts))
            elif mode == "max":
                values[key] = (max(old[0], value), max(old[1], ts))
            elif mode == "min":
                values[key] = (min(old[0], value), max(old[1], ts))
            elif mode == "mostrecent" and ts > old[1]:
                values[key] = (value, ts)
    return [(k, v, ts) for k, (v, ts) in values.items()]


def compact(
    metrics_dir: str | os.PathLike[str],
    *,
    is_alive: Callable[[int], bool] = pid_alive,
    after_step: Callable[[str], None] | None = None,
) -> CompactionReport:
    """Merge every dead process's files into the archives (module docstring). Live pids' files,
    ``all``-mode gauges and files that cannot be read are never touched. ``after_step`` is a test
    hook called with a step name ("temp", "journal", "rename", "sources") after each step of a
    commit; raising there simulates a crash at that point."""
    d = Path(metrics_dir)
    lock = _lock_fd(d, COMPACT_LOCK)
    if lock is None:
        raise OSError(f"metrics directory {d}: cannot open {COMPACT_LOCK}")
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return CompactionReport(busy=True)
        recovered = recover(d)
        names = [n for n in os.listdir(d) if n.endswith(".db")]
        groups: dict[str, list[MetricFile]] = {}
        to_drop: list[MetricFile] = []
        for n in names:
            mf = parse_name(n)
            if mf is None or mf.pid == ARCHIVE_PID or not mf.pid.isdigit():
                continue
            if mf.kind == "gauge" and mf.mode not in MERGED_GAUGE_MODES | LIVE_GAUGE_MODES:
                continue  # "all": one series per pid, nothing to merge into
            if int(mf.pid) == os.getpid() or is_alive(int(mf.pid)):
                continue
            if mf.mode in LIVE_GAUGE_MODES:
                to_drop.append(mf)
            else:
                groups.setdefault(mf.group, []).append(mf)
        merged, skipped, archives = 0, [], []
        for group, members in sorted(groups.items()):
            sources: list[MetricFile] = []
            inputs = []
            for mf in members:  # a file that cannot be read is left where it is (and logged)
                try:
                    inputs.append(read_entries(d / mf.name))
                except (ValueError, OSError) as exc:
                    skipped.append(mf.name)
                    log.warning("compaction: left %s alone: %s", mf.name, str(exc)[:200])
                else:
                    sources.append(mf)
            if not sources:
                continue
            archive = d / members[0].archive_name
            if archive.exists():  # an archive that cannot be read fails this run (logged by the caller)
                inputs.insert(0, read_entries(archive))
            entries = merge_entries(group, inputs)
            temp = d / f"{TEMP_PREFIX}{archive.name}.tmp"
            _write_durable(temp, encode_values_file(entries))
            _step(after_step, "temp")
            if not _commit(d, archive, temp, [mf.name for mf in sources], is_alive, after_step):
                _remove(temp)
                continue
            merged += len(sources)
            archives.append(archive.name)
        dropped = 0
        if to_drop:
            fd = _lock_fd(d, READ_LOCK)
            try:
                if fd is not None and not _flock_exclusive(fd, COMMIT_LOCK_WAIT_S):
                    to_drop = []
                for mf in to_drop:
                    if not is_alive(int(mf.pid)):
                        _remove(d / mf.name)
                        dropped += 1
            finally:
                if fd is not None:
                    os.close(fd)
        after = sum(1 for n in os.listdir(d) if n.endswith(".db"))
        return CompactionReport(
            merged=merged,
            dropped=dropped,
            archives=tuple(archives),
            skipped=tuple(skipped),
            recovered=recovered,
            files_before=len(names),
            files_after=after,
        )
    finally:
        os.close(lock)


def _step(hook: Callable[[str], None] | None, name: str) -> None:
    if hook is not None:
        hook(name)


def _commit(
    d: Path,
    archive: Path,
    temp: Path,
    sources: list[str],
    is_alive: Callable[[int], bool],
    after_step: Callable[[str], None] | None,
) -> bool:
    """Steps 2 of the module docstring, under the exclusive read lock. False (nothing changed)
    when readers held it too long or a source's pid came back to life (pid reuse)."""
    fd = _lock_fd(d, READ_LOCK)
    try:
        if fd is not None and not _flock_exclusive(fd, COMMIT_LOCK_WAIT_S):
            log.warning(
                "compaction of %s postponed: readers held the lock for %.0f s",
                archive.name,
                COMMIT_LOCK_WAIT_S,
            )
            return False
        for s in sources:
            mf = parse_name(s)
            if mf is not None and mf.pid.isdigit() and is_alive(int(mf.pid)):
                return False  # the pid was reused since the merge: its file may be written again
        journal = {"archive": archive.name, "temp": temp.name, "sources": sources}
        _write_durable(d / JOURNAL, json.dumps(journal).encode())
        _fsync_dir(d)
        _step(after_step, "journal")
        os.replace(temp, archive)
        _fsync_dir(d)
        _step(after_step, "rename")
        for s in sources:
            _remove(d / s)
        _fsync_dir(d)
        _step(after_step, "sources")
        _remove(d / JOURNAL)
        return True
    finally:
        if fd is not None:
            os.close(fd)
