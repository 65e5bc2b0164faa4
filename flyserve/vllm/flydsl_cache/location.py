"""Check 1 of the FlyDSL cache check: the folder and every directory above it.

Who could have written the folder or swapped the path to it: owners (this user or root), modes
(nothing writable by others, but a sticky directory above it), no symlinked folder; a folder not made
yet needs a parent a stranger cannot make it in. The rules are in flyserve.vllm.flydsl_cache's
docstring; what is inside the folder is flyserve.vllm.flydsl_cache.contents'.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from flyserve.vllm.flydsl_cache.refused import CacheRefused

WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def trusted_owners() -> frozenset[int]:
    """Who may own the folder and its entries: this process's user, and root (who can write anything anyway)."""
    return frozenset({os.geteuid(), 0})


def lstat_or_none(path: Path) -> os.stat_result | None:
    """The path's own stat (a link is not followed), or None when it does not exist."""
    return stat_or_none(path, follow_symlinks=False)


def stat_or_none(path: Path, *, follow_symlinks: bool = True) -> os.stat_result | None:
    """os.stat, or None when the path does not exist; any other error refuses the cache."""
    try:
        return os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CacheRefused(str(path), f"cannot be examined ({exc.strerror or type(exc).__name__})") from None


def owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid in trusted_owners():
        return None
    return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"


def folder_problem(st: os.stat_result) -> str | None:
    """Why a folder FlyDSL reads entries from is not private: any write by another user could add one."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (FlyDSL would follow it wherever it is pointed)"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_mode & WRITABLE_BY_OTHERS:
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return owner_problem(st)


def _ancestor_problem(st: os.stat_result) -> str | None:
    """Why a directory above the folder would let a stranger swap the path below it."""
    owner = owner_problem(st)
    if owner or stat.S_ISLNK(st.st_mode):  # a link's own mode means nothing; its owner and parent do
        return owner
    if st.st_mode & WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
        return f"group- or world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _ancestors(root: Path) -> list[Path]:
    """Every directory above ``root``, as written and as resolved (a symlinked parent is checked on
    both sides: the link where it sits, and what it leads to)."""
    resolved = Path(os.path.realpath(root.parent))
    return list(dict.fromkeys((*root.parents, resolved, *resolved.parents)))


def check_location(root: Path) -> None:
    """Raise CacheRefused unless ``root`` and every directory above it are as check 1 of the package
    docstring says."""
    st = lstat_or_none(root)
    if st is not None:
        problem = folder_problem(st)
        if problem:
            raise CacheRefused(str(root), f"the cache directory is {problem}")
    else:
        base = next((p for p in root.parents if lstat_or_none(p) is not None), Path("/"))
        bst = stat_or_none(base)  # a link there is checked with the ancestors below
        problem = folder_problem(bst) if bst is not None else "a dangling symlink"
        if problem:
            raise CacheRefused(
                str(root), f"does not exist yet and {base}, where it would be made, is {problem}"
            )
    for parent in _ancestors(root):
        pst = lstat_or_none(parent)
        problem = _ancestor_problem(pst) if pst is not None else None
        if problem:
            raise CacheRefused(str(root), f"{parent} (above the cache directory) is {problem}")
