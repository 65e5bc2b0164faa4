"""Hold off SIGTERM/SIGINT/SIGHUP while a change is being published, then act on them.

A `flyserve thresholds set` sent SIGTERM while it published left a 'publishing' audit line with no
completion and an orphan temp file (1 of 16 tries) until `repair`.
The publish is a few small writes (milliseconds), so finishing it before dying is the right
answer. Only the main thread can install handlers: elsewhere (the sidecar's request threads, the
watcher) this is a no-op, and those processes stop through their own handlers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

DEFERRED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within the block, the signals in DEFERRED are recorded, not acted on; on exit the previous
    handlers come back and the first recorded signal is delivered again (so the default action -
    exit - or the caller's handler happens after the block)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old: dict[signal.Signals, Any] = {}

    def record(signum: int, _frame: object) -> None:
        got.append(signum)

    try:
        for s in DEFERRED:
            prev = signal.getsignal(s)
            if prev is None:  # installed outside Python: cannot be put back, so leave it alone
                continue
            old[s] = prev
            signal.signal(s, record)
    except (ValueError, OSError):  # not the main interpreter, or a platform without the signal
        for s, prev in old.items():
            signal.signal(s, prev)
        yield
        return
    try:
        yield
    finally:
        for s, prev in old.items():
            signal.signal(s, prev)
        if got:
            os.kill(os.getpid(), got[0])
