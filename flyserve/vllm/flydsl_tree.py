"""What a FlyDSL checkout says about itself, for the revision label: its commit and the paged KV
layouts and paths its interface module names.

FlyDSL has no version inside ``kernels/``: which tree is installed is read, not assumed. The commit
comes from the checkout's ``.git`` (a ``git clone``: ``HEAD``, a loose ref or ``packed-refs``); a
``git archive`` (scripts/flydsl-compile-setup.sh) has none, and then the label says so instead of
guessing. The layouts are the ``kv_cache_layout`` names the module's source spells (``"linear"``,
``"vectorized"``, from later main ``"linear3d"``, FlyDSL's page-1 layout); paged FP8 is the
``_build_paged_fp8`` builder later main has. No git is run and nothing is written.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

KNOWN_LAYOUTS = ("linear", "linear3d", "vectorized")
_SHA = re.compile(r"[0-9a-f]{40}")
MAX_GIT_FILE = 1 << 20


def _read(path: Path) -> str | None:
    try:
        if path.is_file() and path.stat().st_size <= MAX_GIT_FILE:
            return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        pass
    return None


def _git_dir(root: Path) -> Path | None:
    """The checkout's git directory: ``.git`` itself, or where a ``.git`` file (a worktree) points."""
    dot = root / ".git"
    if dot.is_dir():
        return dot
    text = _read(dot)
    if text and text.startswith("gitdir:"):
        target = Path(text.split(":", 1)[1].strip())
        return target if target.is_absolute() else root / target
    return None


def checkout_commit(root: str | Path) -> str | None:
    """The commit the checkout at ``root`` has checked out (40 hex), or None when it cannot be read."""
    git = _git_dir(Path(root))
    if git is None:
        return None
    head = (_read(git / "HEAD") or "").strip()
    if _SHA.fullmatch(head):
        return head
    if not head.startswith("ref:"):
        return None
    ref = head.split(":", 1)[1].strip()
    loose = (_read(git / ref) or "").strip()
    if _SHA.fullmatch(loose):
        return loose
    for line in (_read(git / "packed-refs") or "").splitlines():
        sha, _, name = line.partition(" ")
        if name.strip() == ref and _SHA.fullmatch(sha):
            return sha
    return None


def module_source(mod: ModuleType | None) -> str:
    """The module's source text ('' when it has no readable file)."""
    path = getattr(mod, "__file__", None)
    return (_read(Path(path)) or "") if path else ""


def named_layouts(source: str) -> tuple[str, ...]:
    """The paged KV layouts the interface's source names as string literals."""
    return tuple(name for name in KNOWN_LAYOUTS if f'"{name}"' in source or f"'{name}'" in source)


def checkout_root(module_file: str) -> Path | None:
    """The checkout holding ``kernels/attention/<module>.py`` (None for a module elsewhere)."""
    p = Path(module_file).resolve()
    if len(p.parents) >= 3 and p.parent.name == "attention" and p.parent.parent.name == "kernels":
        return p.parents[2]
    return None
