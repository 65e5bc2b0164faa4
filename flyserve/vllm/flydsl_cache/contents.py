"""Check 2 of the FlyDSL cache check: what is inside the folder, by kind, owner, mode and size.

Function folders holding files, nothing deeper; each one owned by this user or root, not group- or
world-writable, a directory or a regular file (no symlink, FIFO, socket, device), a file at most
MAX_ENTRY_BYTES, at most MAX_FILES in all. Nothing is opened here: each entry is read by
flyserve.vllm.flydsl_cache.entries.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flyserve.vllm.flydsl_cache.location import WRITABLE_BY_OTHERS, folder_problem, owner_problem
from flyserve.vllm.flydsl_cache.refused import CacheRefused

MAX_ENTRY_BYTES = 64 << 20  # a dualwave artifact is about 15 KB; the cap is only against a huge file

MAX_FILES = 4096


def node_problem(st: os.stat_result) -> str | None:
    """Why one thing inside the cache is refused (a folder: FlyDSL's function folder; else a file)."""
    if stat.S_ISDIR(st.st_mode):
        return folder_problem(st)
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (a {_kind(st.st_mode)})"
    if st.st_mode & WRITABLE_BY_OTHERS:
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_size > MAX_ENTRY_BYTES:
        return f"larger than {MAX_ENTRY_BYTES} bytes ({st.st_size})"
    return owner_problem(st)


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):  # fmt: skip
        if test(mode):
            return word
    return "special file"


def _scan(folder: Path) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each thing in ``folder``, symlinks not followed."""
    try:
        with os.scandir(folder) as it:
            return [(e.name, e.stat(follow_symlinks=False)) for e in it]
    except OSError as exc:
        raise CacheRefused(str(folder), f"cannot be listed ({exc.strerror or type(exc).__name__})") from None


def scan_entries(root: Path) -> list[str]:
    """The ``.pkl`` entries under ``root`` ("<function folder>/<name>.pkl"), after checking every file
    and folder there; raises CacheRefused on the first one refused."""
    entries: list[str] = []
    files = 0
    for name, st in sorted(_scan(root)):
        files += 1
        problem = node_problem(st)
        if problem:
            raise CacheRefused(str(root), f"{name} is {problem}")
        if not stat.S_ISDIR(st.st_mode):
            continue
        inside = _scan(root / name)
        if files + len(inside) > MAX_FILES:
            raise CacheRefused(str(root), f"holds more than {MAX_FILES} files")
        for inner, ist in sorted(inside):
            files += 1
            rel = f"{name}/{inner}"
            if stat.S_ISDIR(ist.st_mode):
                raise CacheRefused(
                    str(root), f"{rel} is a directory inside a function folder (FlyDSL makes none)"
                )
            problem = node_problem(ist)
            if problem:
                raise CacheRefused(str(root), f"{rel} is {problem}")
            if inner.endswith(".pkl"):
                entries.append(rel)
    return entries
