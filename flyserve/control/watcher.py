"""Watcher: reload the operator's config file when it changes, however it changes.

A Kubernetes ConfigMap volume replaces the file by swapping a symlinked directory (..data ->
..2026_xx_xx); a watch on the file itself goes deaf after the first swap. So: watch the file's
DIRECTORY (any event there triggers a check), compare the content's sha256 with the last one
handled, poll on a timer as a backstop (lost events, network filesystems), and reload on SIGHUP.
Any number of processes may watch: publishing is idempotent by content hash and serialised by the lock.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
from pathlib import Path
from typing import Any, Self

from flyserve.control.errors import ControlIOError
from flyserve.files import safe_read
from flyserve.policy.safe_yaml import MAX_DOCUMENT_BYTES
from flyserve.policy.thresholds import ThresholdsError

DEFAULT_SETTLE_S = 0.5
"""A changed file is published only once two reads this far apart give the same content (a file
written in two parts 0.2 s apart would otherwise publish its first half); a file that does not
end in a newline (mid-line, most likely) must stay the same four times as long."""
MAX_SETTLE_ROUNDS = 40

log = logging.getLogger("flyserve.control")


def _read_capped(path: str | Path) -> bytes | None:
    """The bytes of the regular file behind ``path`` (symlinks followed), at most MAX_DOCUMENT_BYTES + 1;
    None if it cannot be read. A FIFO or device is not read (it would block the watcher for ever):
    its hash is that of a marker, and the reload that follows reports it."""
    try:
        return safe_read.read_bytes(path, MAX_DOCUMENT_BYTES, follow_symlinks=True)
    except safe_read.NotRegularFileError:
        return b"\0not a regular file"
    except safe_read.TooLargeError:
        return b"\0larger than the cap"
    except safe_read.SafeReadError:
        return None


def file_sha256(path: str | Path) -> str | None:
    """Content hash of the file behind ``path`` (symlinks followed); None if it cannot be read."""
    raw = _read_capped(path)
    return None if raw is None else hashlib.sha256(raw).hexdigest()


class _Wake:
    """An object watchfiles polls (is_set) to end its wait: on stop or on a SIGHUP request."""

    def __init__(self, stop: threading.Event, hup: threading.Event) -> None:
        self._stop, self._hup = stop, hup

    def is_set(self) -> bool:
        return self._stop.is_set() or self._hup.is_set()


class Watcher:
    """Background thread that keeps the published file layer equal to the operator's file.

    The same bad content is reported once (one invalid count, one audit entry), not every poll;
    a new content hash, or SIGHUP, is always tried again.
    """

    def __init__(
        self,
        plane: Any,
        config_file: str | Path | None = None,
        *,
        poll_interval_s: float = 5.0,
        debounce_ms: int = 100,
        actor: str = "watcher",
        use_watchfiles: bool = True,
        settle_s: float = DEFAULT_SETTLE_S,
    ) -> None:
        self.plane = plane
        path = config_file or plane.config_file
        if path is None:
            raise ValueError("Watcher needs a config file (ControlPlane(config_file=...) or config_file=)")
        self.path = Path(path)
        if plane.config_file is None:
            plane.config_file = str(self.path)
        self.poll_interval_s = float(poll_interval_s)
        self.debounce_ms = int(debounce_ms)
        self.actor = actor
        self.use_watchfiles = use_watchfiles
        self.settle_s = float(settle_s)
        self._stop = threading.Event()
        self._hup = threading.Event()
        self._wakeup = threading.Event()  # set on stop and on a reload request: ends a poll wait early
        self._thread: threading.Thread | None = None
        self._handled: str | None = self._published_file_sha()  # last content hash tried
        self._missing_reported = False
        self.checks = 0  # how many times the file was looked at (tests read it)
        self.last_error: Exception | None = None

    def _published_file_sha(self) -> str | None:
        try:
            snap = self.plane.snapshot()
        except (ControlIOError, ThresholdsError):
            return None
        return snap.file_sha256 if snap.config_file == str(self.path) else None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        self.check()  # the file as it is now, before waiting for any event
        self._thread = threading.Thread(target=self._run, name="flyserve-config-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def request_reload(self) -> None:
        """Ask for a reload regardless of the content hash (what SIGHUP does). Safe from a signal handler."""
        self._hup.set()
        self._wakeup.set()

    def install_sighup(self) -> None:
        """Reload on SIGHUP. Main thread only (Python's rule). The handler only sets an event: the
        reload runs on the watcher thread, never inside the handler, where it could block on the
        lock this very process holds."""
        previous = signal.getsignal(signal.SIGHUP)

        def handler(signum: int, frame: Any) -> None:
            self.request_reload()
            if callable(previous) and previous not in (signal.SIG_IGN, signal.SIG_DFL):
                previous(signum, frame)

        signal.signal(signal.SIGHUP, handler)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        wake = _Wake(self._stop, self._hup)
        use_wf = self.use_watchfiles
        failures = 0
        while not self._stop.is_set():
            if use_wf:
                try:
                    self._watch_once(wake)
                    failures = 0
                except Exception as exc:  # noqa: BLE001
                    # A watched ..<timestamp> directory that kubelet deletes after a swap ends the watch
                    # with an error: look at the file and watch again. Only a watch that keeps failing
                    # (inotify limits, an exotic filesystem) falls back to polling alone.
                    failures += 1
                    self.check()
                    if failures >= 5:
                        log.warning(
                            "directory watch on %s keeps failing (%s); polling every %.1fs instead",
                            self.path.parent,
                            exc,
                            self.poll_interval_s,
                        )
                        use_wf = False
                    else:
                        self._stop.wait(0.01 * failures)
            else:
                self._wakeup.wait(self.poll_interval_s)
                self._wakeup.clear()
                if not self._stop.is_set():
                    self.check()
            if self._hup.is_set():
                self._hup.clear()
                self.check(force=True)

    def _watch_dirs(self) -> list[Path]:
        """The file's directory, plus the directory its symlinks resolve to when that differs: an
        in-place edit of a ConfigMap's ..2026_xx/flyserve.yaml raises events only there."""
        dirs = [self.path.parent]
        try:
            real = self.path.resolve(strict=True).parent
        except OSError:
            real = None
        if real is not None and real != self.path.parent.resolve():
            dirs.append(real)
        return [d for d in dirs if d.is_dir()]

    def _watch_once(self, wake: _Wake) -> None:
        """Block on directory events; check the file on every batch of events and on each poll
        timeout. Returns (to be called again) when the symlink target moved, on stop, or on SIGHUP.

        RustNotify (watchfiles' engine, which watchfiles.watch wraps) starts watching when it is
        built, so the check made right after it closes the gap in which an edit would go unseen
        until the next poll; with watchfiles.watch() the watch starts only at the first next().
        """
        from watchfiles._rust_notify import RustNotify

        dirs = self._watch_dirs()
        if not dirs:
            self.check()
            self._wakeup.wait(self.poll_interval_s)
            self._wakeup.clear()
            return
        with RustNotify([str(d) for d in dirs], False, False, 300, False, False) as notify:
            self.check()  # anything that changed while no watch was running
            while not wake.is_set():
                res = notify.watch(self.debounce_ms, 50, int(self.poll_interval_s * 1000), wake)
                if res in ("stop", "signal"):
                    return
                self.check()  # on events and on each timeout (the poll backstop)
                if self._watch_dirs() != dirs:
                    return

    def check(self, *, force: bool = False) -> bool:
        """Look at the file once; reload if its content hash is new (or ``force``) and has settled.
        True if it published a new version."""
        self.checks += 1
        raw = _read_capped(self.path)
        if raw is None:
            if force or not self._missing_reported:
                self._missing_reported = True
                return self._reload(None)
            return False
        self._missing_reported = False
        sha = hashlib.sha256(raw).hexdigest()
        if not force and sha == self._handled:
            return False
        settled = self._settled(raw, sha)
        if settled is None:
            return False
        if not force and settled == self._handled:
            return False
        return self._reload(settled)

    def _settled(self, raw: bytes, sha: str) -> str | None:
        """The content's hash once two reads ``settle_s`` apart agree (None: stopped, or gone)."""
        for _ in range(MAX_SETTLE_ROUNDS):
            wait = self.settle_s * (1 if raw.endswith(b"\n") else 4)
            if self._stop.wait(wait):
                return None
            again = _read_capped(self.path)
            if again is None:
                return None
            again_sha = hashlib.sha256(again).hexdigest()
            if again_sha == sha:
                return sha
            raw, sha = again, again_sha
        return sha  # still changing after many rounds: take the latest, the next check sees any more

    def _reload(self, sha: str | None) -> bool:
        try:
            res = self.plane.reload(actor=self.actor)
        except ControlIOError as exc:
            # The state directory is full or read-only (or the file vanished mid-read): not handled,
            # so every poll tries again and the edit is published once the directory recovers.
            self.last_error = exc
            return False
        except ThresholdsError as exc:
            self.last_error = exc  # already counted, logged and audited by the plane
            if sha is not None:
                self._handled = sha
            return False
        except Exception as exc:  # a bug must not kill the watcher thread
            log.exception("reloading %s failed unexpectedly", self.path)
            self.last_error = exc
            if sha is not None:
                self._handled = sha
            return False
        self.last_error = None
        # The hash this check read, not the snapshot's: a comment-only edit publishes nothing (same
        # values), so the snapshot keeps the old file hash and would make every poll reload again.
        self._handled = sha
        return res.changed
