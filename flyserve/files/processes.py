"""The one question to the process table: does a pid live? (signal 0: no signal is sent)."""

from __future__ import annotations

import enum
import os


class PidState(enum.Enum):
    GONE = "gone"  # no such process in this pid namespace
    ALIVE = "alive"  # a process we may signal
    ALIVE_OTHER_USER = "alive, another user's"  # exists, but we may not signal it
    UNKNOWN = "unknown"  # not a pid (<= 0: would name a process group) or the kernel said something else


def pid_state(pid: int) -> PidState:
    """What ``kill(pid, 0)`` says of ``pid``, never raising."""
    if pid <= 0:
        return PidState.UNKNOWN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return PidState.GONE
    except PermissionError:
        return PidState.ALIVE_OTHER_USER
    except (OSError, OverflowError):
        return PidState.UNKNOWN
    return PidState.ALIVE


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` may be a live process: only a definite "no such process" is False, so data a
    live process may still write is never taken for a dead one's."""
    return pid_state(pid) is not PidState.GONE
