"""audit.jsonl and its rotated files: when to rotate, how to rotate, how to read them all in order.

Why: an audit.jsonl that is never rotated grows without end; in Kubernetes it lives in a 256Mi
memory volume whose overflow evicts the pod. It rotates at ``max_bytes`` (8 MiB) into audit.jsonl.1
(the newest rotated) .. audit.jsonl.<keep> (the oldest; 4 by default), so the log never takes more than
about (keep + 1) x max_bytes. Rotation is a chain of renames done by a writer that holds the store's
writers' lock (Store.audit), so two writers never rotate at once. Readers (Store.read_audit and
Store.max_audited_version, hence `flyserve thresholds audit`, `repair` and the sidecar) read the
rotated files too, oldest first, so an entry a reader relies on only disappears when it falls out of
the retention, never at a rotation. A reader that races a rotation sees the same file under two names
(the inodes tell) and reads again, so it never returns an entry twice or drops one that was kept.

This module holds no state and imports nothing from the store: the store passes its safe reader
(read_file_tail: no-follow, regular files only, non-blocking, size-capped) in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("flyserve.control")

DEFAULT_MAX_BYTES = 8 << 20
"""audit.jsonl rotates once the next line would take it past this (8 MiB: about 4000 changes)."""

DEFAULT_KEEP = 4
"""Rotated files kept: audit.jsonl.1 .. audit.jsonl.4."""

MAX_BYTES_ENV = "FLYSERVE_AUDIT_MAX_BYTES"
KEEP_ENV = "FLYSERVE_AUDIT_KEEP"
MIN_MAX_BYTES = 64 << 10  # well above one audit line (audit_log.MAX_AUDIT_LINE, 8 KiB)
MAX_MAX_BYTES = 1 << 30
MAX_KEEP = 99

READ_ATTEMPTS = 5
"""Reads of the whole set before a reader gives up waiting for a quiet moment between rotations."""


@dataclass(frozen=True, slots=True)
class AuditRotation:
    """When audit.jsonl rotates (``max_bytes``) and how many rotated files are kept (``keep``)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    keep: int = DEFAULT_KEEP

    def __post_init__(self) -> None:
        if not MIN_MAX_BYTES <= self.max_bytes <= MAX_MAX_BYTES:
            raise ValueError(f"audit rotation max_bytes: must be {MIN_MAX_BYTES}..{MAX_MAX_BYTES}")
        if not 1 <= self.keep <= MAX_KEEP:
            raise ValueError(f"audit rotation keep: must be 1..{MAX_KEEP}")

    @property
    def bound_bytes(self) -> int:
        """About the most the log and its rotated files take together."""
        return (self.keep + 1) * self.max_bytes

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AuditRotation:
        """From $FLYSERVE_AUDIT_MAX_BYTES and $FLYSERVE_AUDIT_KEEP (each optional). A value that is
        not a plain decimal integer in range raises ValueError naming the variable (never the value:
        it may be huge)."""
        env = os.environ if env is None else env
        fields: dict[str, int] = {}
        for name, field, lo, hi in (
            (MAX_BYTES_ENV, "max_bytes", MIN_MAX_BYTES, MAX_MAX_BYTES),
            (KEEP_ENV, "keep", 1, MAX_KEEP),
        ):
            raw = env.get(name, "").strip()
            if not raw:
                continue
            if not (raw.isascii() and raw.isdigit() and len(raw) <= 10) or not lo <= int(raw) <= hi:
                raise ValueError(f"${name}: must be a decimal integer {lo}..{hi}")
            fields[field] = int(raw)
        return cls(**fields)

    @classmethod
    def from_env_or_default(cls, env: Mapping[str, str] | None = None) -> AuditRotation:
        """from_env, or the defaults with an error logged: a bad variable must not stop a rank
        process (serving) or the sidecar from writing the audit log at all."""
        try:
            return cls.from_env(env)
        except ValueError as exc:
            log.error("%s; using the defaults (%d bytes, %d files)", exc, DEFAULT_MAX_BYTES, DEFAULT_KEEP)
            return cls()


def rotated_path(log_path: Path, n: int) -> Path:
    """audit.jsonl.<n>: 1 is the newest rotated file."""
    return log_path.with_name(f"{log_path.name}.{n}")


def log_paths_oldest_first(log_path: Path, keep: int) -> list[Path]:
    """audit.jsonl.<keep> .. audit.jsonl.1, audit.jsonl: the order entries were written in."""
    return [rotated_path(log_path, n) for n in range(keep, 0, -1)] + [log_path]


def rotate_if_due(log_path: Path, incoming: int, policy: AuditRotation) -> bool:
    """Rotate ``log_path`` if appending ``incoming`` more bytes would take it past policy.max_bytes.
    Call ONLY while holding the store's writers' lock: the renames are one rotation only if no other
    writer rotates meanwhile. Returns whether it rotated.

    The renames go oldest first (.<keep-1> -> .<keep>, replacing the oldest, .., audit.jsonl -> .1),
    so at every instant each kept entry is under some name. The next append creates a new
    audit.jsonl. A log that is not a regular file (a planted symlink or FIFO) is never renamed:
    Store.audit refuses to write it and says so. A rotated name that is not a regular file is
    replaced or shifted like any other name: renaming never follows a link, and readers refuse it."""
    try:
        st = os.lstat(log_path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or st.st_size + incoming <= policy.max_bytes:
        return False
    for n in range(MAX_KEEP, policy.keep, -1):  # names past the retention (it was lowered): dropped
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rotated_path(log_path, n))
    for n in range(policy.keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.replace(rotated_path(log_path, n), rotated_path(log_path, n + 1))
    os.replace(log_path, rotated_path(log_path, 1))
    with contextlib.suppress(OSError):  # the renames are durable once the directory is synced
        dfd = os.open(log_path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    log.info(
        "audit log rotated at %d bytes: %s -> %s", st.st_size, log_path.name, rotated_path(log_path, 1).name
    )
    return True


def _identities(paths: list[Path]) -> list[tuple[int, int, int] | None]:
    """(device, inode, size) of each name (None if absent), without following links."""
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            out.append(None)
        else:
            out.append((st.st_dev, st.st_ino, st.st_size))
    return out


_warned: set[str] = set()
"""Rotated files already warned about as skipped (at most a few names: keep is bounded)."""


def _warn_skipped(path: Path, exc: OSError | ValueError) -> None:
    """One warning per rotated file name and process (a reader runs often: no log flood). Names the
    file and the kind of failure only, never anything read from it."""
    if str(path) in _warned or len(_warned) >= 64:
        return
    _warned.add(str(path))
    reason = type(exc).__name__ if isinstance(exc, OSError) else str(exc)[:200]
    log.warning("audit log: rotated file %s skipped (not readable: %s)", path.name, reason)


def read_log_tail(
    log_path: Path,
    max_bytes: int,
    keep: int,
    read_tail: Callable[[Path, int], str | None],
    *,
    strict: bool = False,
) -> str | None:
    """The newest ``max_bytes`` (about) of the audit log across audit.jsonl.<keep> .. audit.jsonl, as
    text, oldest entry first, or None if none of the files exists.

    A rotated file (audit.jsonl.N) that cannot be read (a planted FIFO or symlink, an I/O error) is
    skipped with one warning naming it, and the others are still read: one bad old file must not
    cost the version floor every other file witnesses. ``strict`` (`thresholds audit`) raises
    instead, naming the file. audit.jsonl itself always raises (the live log is unusable: the
    caller refuses changes or reports it).

    Each file is read with ``read_tail`` (state_files.read_file_tail: a symlink, FIFO or other non-regular
    file raises ValueError naming it; a file cut by the budget loses its cut first line). Each file's
    text ends with a newline here, so a torn last line of a rotated file (a writer killed mid-append)
    stays a line of its own, which JSON refuses, instead of swallowing the next file's first entry.

    A rotation between two reads would show one file under two names: the names' identities
    (device, inode) are taken before and after, and the read is repeated until they match (at most
    READ_ATTEMPTS times; then the last read is used, duplicates dropped by identity, and a warning
    logged)."""
    paths = log_paths_oldest_first(log_path, keep)
    text: str | None = None
    for _attempt in range(READ_ATTEMPTS):
        before = _identities(paths)
        text = _read_set(paths, before, max_bytes, read_tail, strict=strict)
        after = _identities(paths)
        ids = [i[:2] for i in before if i is not None]
        if [i and i[:2] for i in before] == [i and i[:2] for i in after] and len(ids) == len(set(ids)):
            return text
    log.warning(
        "audit log: rotated while read %d times in a row; entries may repeat or be missing", READ_ATTEMPTS
    )
    return text


def _read_set(
    paths: list[Path],
    ids: list[tuple[int, int, int] | None],
    max_bytes: int,
    read_tail: Callable[[Path, int], str | None],
    *,
    strict: bool,
) -> str | None:
    """Newest file first, until ``max_bytes`` are used; returned oldest first. A rotated file that
    raises is skipped unless ``strict`` (see read_log_tail); the live log (the newest) always raises."""
    parts: list[str] = []
    seen: set[tuple[int, int]] = set()
    budget = max_bytes
    found = False
    for path, ident in zip(reversed(paths), reversed(ids), strict=True):
        if budget <= 0:
            break
        if ident is not None:
            if ident[:2] in seen:
                continue
            seen.add(ident[:2])
        try:
            text = read_tail(path, budget)
        except (OSError, ValueError) as exc:
            if strict or path == paths[-1]:
                raise
            _warn_skipped(path, exc)
            continue
        if text is None:
            continue
        found = True
        cut = ident is not None and ident[2] > budget
        budget -= len(text.encode("utf-8", "replace"))
        if text and not text.endswith("\n"):
            text += "\n"
        parts.append(text)
        if cut:
            break  # this file was cut by the budget: older files are further back still
    if not found:
        return None
    return "".join(reversed(parts))
