"""The writers' lock of a state directory: an fcntl lock on control/lock that every writer (the
sidecar, rank 0, a CLI command) takes to publish, so versions stay monotonic when several publish.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from typing import Any

from flyserve.control.errors import ControlIOError
from flyserve.control.paths import StateDir, make_private_dir


def _wait_for_flock(fd: int, timeout_s: float, path: str) -> None:
    """Block on flock(fd) for at most ``timeout_s``; return once held. On timeout, raise ControlIOError
    and hand ``fd`` to the waiting thread, which closes it (releasing the lock) if it ever gets it.
    On an flock error, close ``fd`` and raise ControlIOError."""
    guard = threading.Lock()
    done = threading.Event()
    state: dict[str, Any] = {"abandoned": False, "error": None}

    def wait() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            state["error"] = exc
        with guard:
            if state["abandoned"]:
                os.close(fd)
                return
            done.set()

    threading.Thread(target=wait, name="flyserve-control-lock", daemon=True).start()
    if not done.wait(timeout_s):
        with guard:
            if not done.is_set():
                state["abandoned"] = True
                raise ControlIOError(f"another writer held the lock for more than {timeout_s:g}s", path=path)
    if state["error"] is not None:
        os.close(fd)
        raise ControlIOError(f"cannot lock: {state['error'].strerror}", path=path) from state["error"]


class WritersLock:
    """The Store's lock() (a part of flyserve.control.store.Store, which sets ``dir``)."""

    dir: StateDir
    _lock_owner: int | None = None
    """The thread that holds lock() through this Store, if any: audit() rotates only under the lock."""

    @contextlib.contextmanager
    def lock(self, *, timeout_s: float = 10.0) -> Iterator[None]:
        """Exclusive writers' lock (fcntl.flock on control/lock). Raises ControlIOError when the state
        directory cannot be created or the lock is held longer than ``timeout_s``.

        Waiting is a blocking flock (on a helper thread, so it can time out), not a LOCK_NB retry
        loop: a retry loop that sleeps starves against a writer that publishes in a loop (measured:
        two processes x 10 changes ran strictly one after the other), while blocked waiters are
        woken by the kernel at each release.
        """
        try:
            make_private_dir(self.dir.path)
            self.dir.control_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ControlIOError(
                f"state directory not writable: {exc.strerror or exc}", path=str(self.dir.control_dir)
            ) from exc
        owned = True  # False once an abandoned waiter thread owns (and will close) fd
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ControlIOError(
                        f"cannot lock: {exc.strerror}", path=str(self.dir.lock_file)
                    ) from exc
                owned = False  # on timeout the waiter thread keeps fd; on error fd is closed
                _wait_for_flock(fd, timeout_s, str(self.dir.lock_file))
                owned = True
            self._lock_owner = threading.get_ident()
            try:
                yield
            finally:
                self._lock_owner = None
        finally:
            if owned:
                os.close(fd)  # closing the descriptor releases the flock

    @contextlib.contextmanager
    def _lock_if_free(self) -> Iterator[bool]:
        """The writers' lock if nobody holds it right now (True), else False at once: never waits,
        so an audit line written outside lock() (a refused change) is never delayed by a rotation."""
        try:
            self.dir.control_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir.lock_file, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError:
            yield False
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
            yield True
        finally:
            os.close(fd)
