"""Is a path a flyserve state directory? The guard that keeps a typo from becoming a new, empty one.

Without it, ``flyserve thresholds set --state-dir /tmp/fss ...`` (a typo for /tmp/fs) created
/tmp/fss, printed "published version 1 ... effective from engine step 8" and exited 0 while the
real server never saw the change. So commands that change state only write into a directory that
was initialised: by ``flyserve init``, by a server that uses it (sidecar, simulate, a vLLM rank:
each creates ``control/`` or ``ranks/``), or with ``--create``. Commands that only read refuse a
directory that does not exist.
"""

from __future__ import annotations

import os
from pathlib import Path

from flyserve.control.paths import StateDir, default_state_dir, make_private_dir

INIT_HINT = "create it with `flyserve init --state-dir {path}` (or pass --create)"


class StateDirError(ValueError):
    """The state directory is missing, not a directory, or was never initialised; the message says
    which, names the path and how to fix it."""


def is_initialised(state_dir: StateDir | str | os.PathLike[str]) -> bool:
    """True when a server or ``flyserve init`` has laid the directory out (control/ or ranks/)."""
    sd = StateDir(state_dir)
    return sd.path.is_dir() and (sd.control_dir.is_dir() or sd.ranks_dir.is_dir())


def initialise(state_dir: StateDir | str | os.PathLike[str]) -> bool:
    """Create the directory and its control/ folder. True if it was not initialised before.
    Raises StateDirError if the path exists and is not a directory, or cannot be created."""
    sd = StateDir(state_dir)
    if sd.path.exists() and not sd.path.is_dir():
        raise StateDirError(f"state directory {sd.path} exists and is not a directory")
    was = is_initialised(sd)
    try:
        make_private_dir(sd.path)
        sd.control_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StateDirError(f"state directory {sd.path}: cannot create ({exc.strerror or exc})") from None
    return not was


def resolve(state_dir: Path | None) -> tuple[Path, bool]:
    """(path, implicit): the given path, else the default (then implicit is True, and the caller
    prints it, so nobody works on /dev/shm/flyserve/default without knowing)."""
    if state_dir is not None:
        return Path(state_dir), False
    return default_state_dir(), True


def implicit_note(path: Path) -> str:
    return f"state directory: {path} (the default; choose one with --state-dir or $FLYSERVE_STATE_DIR)"


def require_for_write(state_dir: Path, *, create: bool = False) -> Path:
    """The directory a state-changing command may write into. With ``create``, initialise it first."""
    p = Path(state_dir)
    if create:
        initialise(p)
        return p
    if p.exists() and not p.is_dir():
        raise StateDirError(f"state directory {p} exists and is not a directory")
    if not p.exists():
        raise StateDirError(f"state directory {p} does not exist; {INIT_HINT.format(path=p)}")
    return _initialised(p)


def require_for_read(state_dir: Path) -> Path:
    """The directory a read-only command reads: it must exist and be a flyserve state directory."""
    p = Path(state_dir)
    if not p.exists():
        raise StateDirError(
            f"state directory {p} does not exist (a typo? a server creates it when it starts; "
            f"or `flyserve init --state-dir {p}`)"
        )
    if not p.is_dir():
        raise StateDirError(f"state directory {p} exists and is not a directory")
    return _initialised(p)


def _initialised(p: Path) -> Path:
    """``p``, a directory that exists, if it is a flyserve state directory; else the error that says
    how to make one."""
    if not is_initialised(p):
        raise StateDirError(
            f"{p} is not a flyserve state directory (no control/ or ranks/ in it); "
            + INIT_HINT.format(path=p)
        )
    return p
