"""What a FlyDSL checkout says about itself, for the revision label: its commit and the paged KV
layouts and paths its interface module names.

FlyDSL has no version inside ``kernels/``: which tree is installed is read, not assumed. The commit
comes from the checkout's ``.git`` (a ``git clone``: ``HEAD``, a loose ref or ``packed-refs``), or
from the ``PROVENANCE.json`` of a vendored copy (third_party/flydsl/<rev>/, which
scripts/flydsl-compile-setup.sh copies to .flydsl/FlyDSL-<rev>/) when every file it lists still has
its sha256; a ``git archive`` has neither, and then the label says so instead of guessing. The layouts are the ``kv_cache_layout`` names the module's source spells (``"linear"``,
``"vectorized"``, from later main ``"linear3d"``, FlyDSL's page-1 layout); paged FP8 is the
``_build_paged_fp8`` builder later main has. No git is run and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import ModuleType

KNOWN_LAYOUTS = ("linear", "linear3d", "vectorized")
_SHA = re.compile(r"[0-9a-f]{40}")
MAX_GIT_FILE = 1 << 20
PROVENANCE = "PROVENANCE.json"  # a vendored copy's record (scripts/flydsl_vendor.py writes it)
MAX_VENDORED_FILE = 8 << 20  # FlyDSL's largest kernel module is ~200 KB


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


def provenance_problem(root: str | Path) -> tuple[dict | None, str | None]:
    """(the vendored copy's PROVENANCE.json, None) when it names a 40-hex commit and every file it
    lists has its sha256 here; (record or None, what is wrong) otherwise, also when there is none."""
    root = Path(root)
    text = _read(root / PROVENANCE)
    if text is None:
        return None, f"no {PROVENANCE}"
    try:
        record = json.loads(text)
    except ValueError as exc:
        return None, f"{PROVENANCE} is not JSON ({exc})"
    if not isinstance(record, dict):
        return None, f"{PROVENANCE} is not an object"
    commit, files = record.get("commit"), record.get("files")
    if not (isinstance(commit, str) and _SHA.fullmatch(commit)) or not isinstance(files, dict) or not files:
        return record, f"{PROVENANCE} names no 40-hex commit or no files"
    for name, digest in sorted(files.items()):
        if not isinstance(name, str) or ".." in Path(name).parts or Path(name).is_absolute():
            return record, f"{PROVENANCE} lists {name!r}, outside the copy"
        path = root / name
        try:
            if not path.is_file() or path.stat().st_size > MAX_VENDORED_FILE:
                return record, f"{name} is missing (or over {MAX_VENDORED_FILE >> 20} MB)"
            if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                return record, f"{name} differs from commit {commit[:8]}'s (sha256 in {PROVENANCE})"
        except OSError as exc:
            return record, f"{name} unreadable ({exc})"
    return record, None


def vendored_commit(root: str | Path) -> str | None:
    """The commit a vendored copy at ``root`` was taken from, or None (no record, or a file changed)."""
    record, problem = provenance_problem(root)
    return None if problem or record is None else record["commit"]


def checkout_commit(root: str | Path) -> str | None:
    """The commit the checkout at ``root`` has checked out (40 hex), or None when it cannot be read.
    Without a ``.git``: the commit of a vendored copy whose files match its PROVENANCE.json."""
    git = _git_dir(Path(root))
    if git is None:
        return vendored_commit(root)
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
