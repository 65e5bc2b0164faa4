"""Where this process's shared metrics live: flyserve's own multiprocess directory, or in-process.

Who wipes ``<state>/metrics/``: the rank-0 process calls ``setup_multiprocess(dir, wipe=True)``
(the launcher may call :func:`wipe_metrics_dir` before starting vLLM). Wiping removes the files
of processes that are no longer alive only, so a rank that started first never loses its open
files to a slower rank 0.

The metric definitions are in flyserve.telemetry.metrics (which re-exports these functions);
this module knows only the backend, so it imports nothing from there.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from flyserve.files.processes import pid_alive
from flyserve.telemetry.compaction import reading
from flyserve.telemetry.prom import BACKEND, close_files, reinit_values, values_file_used

log = logging.getLogger("flyserve.telemetry")


def wipe_metrics_dir(metrics_dir: str | os.PathLike[str], *, only_dead: bool = True) -> int:
    """Remove metric files from ``metrics_dir``; returns how many.

    only_dead=True (the default) keeps the files of processes still alive (a rank that started
    before rank 0 keeps its counts); only_dead=False removes every ``*.db`` (before any rank starts).
    """
    removed = 0
    for path in glob.glob(os.path.join(os.fspath(metrics_dir), "*.db")):
        stem = os.path.basename(path)[:-3]
        pid_text = stem.rsplit("_", 1)[-1]
        if only_dead and pid_text.isdigit() and (int(pid_text) == os.getpid() or pid_alive(int(pid_text))):
            continue
        try:
            os.remove(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _mark_dead_at_exit() -> None:
    d = BACKEND.directory
    if d is None:
        return
    # Like prometheus_client.multiprocess.mark_process_dead: live-mode gauges of a finished
    # process must not be reported.
    for path in glob.glob(os.path.join(d, f"gauge_live*_{os.getpid()}.db")):
        try:
            os.remove(path)
        except OSError:
            pass


_atexit_registered = False


def setup_multiprocess(metrics_dir: str | os.PathLike[str], *, wipe: bool = False) -> Path:
    """Write this process's shared (rank and control) metrics into ``metrics_dir``, whatever
    ``PROMETHEUS_MULTIPROC_DIR`` says.

    Call once per process before routing starts; the rank-0 process passes ``wipe=True``
    (removes the files of dead processes: earlier runs, crashed workers). Existing children keep
    their identity, their values restart from the files (in-process counts so far are dropped).
    Pre-bound recorders notice the change and re-bind. Idempotent for the same directory.
    """
    global _atexit_registered
    d = Path(metrics_dir)
    d.mkdir(parents=True, exist_ok=True)
    if not os.access(d, os.W_OK):
        raise PermissionError(f"metrics_dir {d} is not writable")
    if wipe:
        wipe_metrics_dir(d, only_dead=True)
    if BACKEND.directory is not None and BACKEND.directory.resolve() == d.resolve():
        return d
    close_files()
    BACKEND.directory = d
    reinit_values(list(BACKEND.shared))
    BACKEND.bump()
    if not _atexit_registered:
        atexit.register(_mark_dead_at_exit)
        _atexit_registered = True
    return d


def setup_in_process() -> None:
    """Back to in-process values (tests; a process that stops writing files)."""
    if BACKEND.directory is None:
        return
    close_files()
    BACKEND.directory = None
    reinit_values(list(BACKEND.shared))
    BACKEND.bump()


def multiprocess_dir() -> Path | None:
    """The directory this process's shared metrics write to, or None (in-process)."""
    return BACKEND.directory


def exposition_registry(
    metrics_dir: str | os.PathLike[str] | None,
    *,
    every_metric: Iterable[Any],
    in_process_metrics: Iterable[Any],
    files: bool = True,
) -> CollectorRegistry:
    """The registry a scrape endpoint serves (flyserve.telemetry.metrics.exposition_registry
    passes the metric lists).

    With ``metrics_dir``: ``in_process_metrics`` (the sidecar's own) plus every process's shared
    metrics read from the files (MultiProcessCollector over flyserve's directory, never vLLM's).
    This process's own shared metrics must be in those files too (so a reload done here is not
    reported twice or lost): if the process is still in-process, it is switched with
    setup_multiprocess(metrics_dir). Without: ``every_metric`` of this process, in-process.
    """
    reg = CollectorRegistry()
    if metrics_dir is None:
        for m in every_metric:
            reg.register(m)
        return reg
    d = Path(metrics_dir)
    current = multiprocess_dir()
    if current is None:
        setup_multiprocess(d)
    elif current.resolve() != d.resolve():
        raise ValueError(f"this process writes its metrics to {current}, not {d}")
    for m in in_process_metrics:
        reg.register(m)
    if files:  # False: the caller renders the files itself (flyserve.telemetry.files_exposition)
        SoundFilesCollector(reg, path=str(d))
    return reg


SKIPPED_FILES: set[str] = set()
"""Names of metric files left out as corrupt (a lying header, an entry that cannot be parsed), by
SoundFilesCollector or the sidecar's own reader (flyserve.sidecar.stats), at most _SKIPPED_MAX;
each logged once. The sidecar exports how many."""
_SKIPPED_MAX = 1024


def note_skipped_file(path: str, why: str) -> None:
    """Count and log (once per name) a metrics file left out; ``why`` is cut to 200 characters."""
    name = os.path.basename(path)
    if name not in SKIPPED_FILES and len(SKIPPED_FILES) < _SKIPPED_MAX:
        SKIPPED_FILES.add(name)
        log.warning("metrics file left out: %s: %s", name, why[:200])


class SoundFilesCollector(MultiProcessCollector):
    """MultiProcessCollector that leaves out files it cannot read: a header that cannot be true
    (the used size over the file's size: prometheus_client would try to read that many bytes, and
    one file claiming 2^31-1 made every scrape 500), or an entry prometheus_client fails on (a key
    that is not UTF-8 or not JSON: also a 500 on every scrape). The files are merged together as
    prometheus_client does; only when that fails is each merged alone, to find the ones to leave
    out (a scrape of sound files pays nothing more)."""

    def collect(self) -> Iterable[Metric]:
        # Under the read lock: a compaction never commits while the files are read, and sources
        # an archive already holds (a crashed compaction's, until it is finished) are left out.
        with reading(self._path) as excluded:
            return self._collect(excluded)

    def _collect(self, excluded: frozenset[str]) -> Iterable[Metric]:
        files = []
        for f in glob.glob(os.path.join(self._path, "*.db")):
            if excluded and os.path.basename(f) in excluded:
                continue
            try:
                used = values_file_used(f)
            except OSError:  # gone since the glob, or unreadable: as if absent
                continue
            except ValueError as exc:  # a FIFO, symlink or directory (safe_read): never opened by the merge
                note_skipped_file(f, str(exc))
                continue
            if used is None:
                note_skipped_file(f, "its header claims a size the file cannot hold")
            elif used:  # 0: a file still being created, no entries yet
                files.append(f)
        try:
            return self.merge(files, accumulate=True)
        except Exception:  # noqa: BLE001 - a corrupt file, found below and left out
            good = []
            for f in files:
                try:
                    self.merge([f], accumulate=True)
                except Exception as exc:  # noqa: BLE001 - whatever the parser raised on this file
                    note_skipped_file(f, f"{type(exc).__name__}: {exc}")
                else:
                    good.append(f)
            return self.merge(good, accumulate=True)
