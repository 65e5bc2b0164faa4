"""audit.jsonl: one JSON line per change tried (append-only, O_APPEND + fsync, mode 0640), rotated
under the writers' lock (flyserve.control.audit_files), and its readers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping
from typing import Any

from flyserve.control.audit_files import AuditRotation, read_log_tail, rotate_if_due
from flyserve.control.errors import ControlIOError
from flyserve.control.paths import MAX_VERSION, make_private_dir
from flyserve.control.state_files import read_file_tail
from flyserve.control.version_trust import credible_max
from flyserve.control.writers_lock import WritersLock
from flyserve.files import safe_read
from flyserve.policy.errors import describe_value

log = logging.getLogger("flyserve.control")

MAX_AUDIT_LINE = 8192
"""One audit line at most (a 50 MB string value once made a 105 MB line)."""


AUDIT_READ_MAX = 64 << 20
"""Bytes of audit.jsonl's tail read at most: its newest lines (8192 of the longest, 4096 changes)."""


class AuditLog(WritersLock):
    """The Store's audit log (a part of flyserve.control.store.Store, which sets ``audit_rotation``):
    rotated only under the writers' lock, hence built on WritersLock."""

    audit_rotation: AuditRotation
    last_audit_error: str | None = None
    """Why the last audit() failed (None when it wrote its line)."""

    def audit(self, entry: Mapping[str, Any]) -> bool:
        """Append one JSON line to audit.jsonl (O_APPEND, fsync; mode 0640, at most MAX_AUDIT_LINE
        bytes). Returns False (and logs) if it cannot: an unwritable state directory must not turn a
        rejection into a crash."""
        line = bounded_audit_line(entry)
        self.last_audit_error = None
        try:
            make_private_dir(self.dir.audit_log.parent)
            self._rotate_audit_if_due(len(line.encode()))
            fd, st = self._open_audit_log()
            try:
                data = line.encode()
                if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
                    data = b"\n" + data  # a torn last line (a writer killed mid-append) keeps to itself
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            self.last_audit_error = exc.strerror or str(exc)
            # The entry still reaches the process log, so no change goes unrecorded.
            log.error(
                "audit log not writable (%s): %s; audit entry: %s",
                self.dir.audit_log,
                exc.strerror or exc,
                line.strip()[:1000],
            )
            return False

    def _open_audit_log(self) -> tuple[int, os.stat_result]:
        """(fd, fstat) of audit.jsonl opened for appending. O_NOFOLLOW + regular-file check: a
        symlinked audit.jsonl was followed and a decoy got the lines; O_NONBLOCK: a FIFO never
        blocks. A planted symlink, FIFO, device or directory in its place is set aside (renamed
        ``audit.jsonl.not-regular``, which no reader takes for a rotated file) by a writer holding
        the writers' lock, and a fresh log begun: the write-ahead line must be written before a
        change is published, so a FIFO there once refused every change, ``circuit open`` included."""
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK  # RDWR: pread
        path = self.dir.audit_log
        for attempt in (1, 2):
            try:
                fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o640)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO) or not self._set_aside_audit_log(
                    attempt
                ):
                    raise
                continue
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                return fd, st
            os.close(fd)
            if not self._set_aside_audit_log(attempt):
                raise OSError(errno.EINVAL, "audit log is not a regular file")
        raise OSError(errno.EINVAL, "audit log is not a regular file")

    def _set_aside_audit_log(self, attempt: int) -> bool:
        """Rename a non-regular audit.jsonl aside (first attempt, under the writers' lock only)."""
        if attempt != 1 or self._lock_owner != threading.get_ident():
            return False
        path = self.dir.audit_log
        # A fresh name each time: a directory planted at a fixed name once made the rename fail.
        aside = path.with_name(f"{path.name}.not-regular.{time.time_ns()}.{os.getpid()}")
        try:
            os.replace(path, aside)
        except OSError as exc:
            log.error("audit log %s is not a regular file and cannot be set aside: %s", path, exc.strerror)
            return False
        log.error("audit log %s was not a regular file: set aside as %s, a new log begun", path, aside.name)
        return True

    def _rotate_audit_if_due(self, incoming: int) -> None:
        """Rotate audit.jsonl before an append that would take it past the limit (audit_files), under
        the writers' lock: the lock this thread holds, or the lock if free right now; when another
        writer holds it, that writer's own next line rotates. A rotation that fails is logged and the
        line is appended anyway: an entry is never lost to rotation."""
        try:
            if self._lock_owner == threading.get_ident():
                rotate_if_due(self.dir.audit_log, incoming, self.audit_rotation)
                return
            with self._lock_if_free() as held:
                if held:
                    rotate_if_due(self.dir.audit_log, incoming, self.audit_rotation)
        except OSError as exc:
            log.error("audit log not rotated (%s): %s", self.dir.audit_log, exc.strerror or exc)

    def _read_audit_text(self, max_bytes: int, *, strict: bool = False) -> str | None:
        """The newest ``max_bytes`` of the audit log across its rotated files, oldest first (see
        audit_files.read_log_tail: an unreadable rotated file is skipped unless ``strict``), each file
        read with read_file_tail."""
        return read_log_tail(
            self.dir.audit_log, max_bytes, self.audit_rotation.keep, read_file_tail, strict=strict
        )

    def read_audit(self, limit: int | None = None, *, raw: bool = False) -> list[dict[str, Any]]:
        """Audit entries, oldest first; a torn last line (crash mid-append) is skipped. A write-ahead
        'publishing' line whose completion follows is left out unless ``raw``: one change, one entry.

        Reads the log's newest AUDIT_READ_MAX bytes at most (with ``limit``, four lines' worth per
        entry asked for), across audit.jsonl and its rotated files (audit.jsonl.1 ..), oldest first.
        An audit log file that is a symlink, FIFO or other non-regular file raises ControlIOError
        naming it (it is never followed or waited on)."""
        want = AUDIT_READ_MAX if not limit else min(AUDIT_READ_MAX, 4 * MAX_AUDIT_LINE * max(1, limit))
        try:
            text = self._read_audit_text(want, strict=True)
        except (OSError, ValueError) as exc:
            raise ControlIOError(f"cannot read the audit log: {exc}", path=str(self.dir.audit_log)) from None
        if text is None:
            return []
        lines = text.splitlines()
        out = []
        for ln in lines:
            with contextlib.suppress(ValueError, RecursionError):
                e = safe_read.loads_record(ln)
                if isinstance(e, dict):
                    out.append(e)
        if not raw:
            done = {e.get("id") for e in out if e.get("result") != "publishing" and e.get("id")}
            out = [e for e in out if not (e.get("result") == "publishing" and e.get("id") in done)]
        return out[-limit:] if limit else out

    def max_audited_version(self, tail_bytes: int = 1 << 20) -> int:
        """The highest version of the credible chain the audit log's last ``tail_bytes`` mention (only
        read when current.json and history are both unusable: the audit log is then the last witness
        of how far versions went).
        An audit log that cannot be read, or is not a regular file, witnesses nothing (0)."""
        try:
            text = self._read_audit_text(tail_bytes)
        except (OSError, ValueError) as exc:
            log.warning("audit log not read for the version floor: %s", exc)
            return 0
        lines = text.splitlines() if text else []
        seen: list[int] = []
        for ln in lines:
            with contextlib.suppress(ValueError, AttributeError, TypeError, RecursionError):
                v = safe_read.loads_record(ln).get("version")
                if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_VERSION:
                    seen.append(v)
        # The credible chain, as for history names: one forged line must not set the floor.
        return credible_max(seen)


def bounded_audit_line(entry: Mapping[str, Any]) -> str:
    """One JSON line of at most MAX_AUDIT_LINE bytes: first the request's values are replaced by
    short descriptions, then anything else long is dropped and the entry says so."""
    try:
        line = json.dumps(dict(entry), sort_keys=True, default=str)
    except ValueError:  # e.g. an integer too long for str()
        line = "x" * MAX_AUDIT_LINE
    if len(line) < MAX_AUDIT_LINE:
        return line + "\n"
    e = dict(entry)
    req = e.get("request")
    if isinstance(req, Mapping):
        e["request"] = {str(k)[:64]: describe_value(v) for k, v in list(req.items())[:32]}
    e["truncated"] = True
    try:
        line = json.dumps(e, sort_keys=True, default=str)
    except ValueError:
        line = "x" * MAX_AUDIT_LINE
    if len(line) < MAX_AUDIT_LINE:
        return line + "\n"
    keep = ("id", "time", "time_iso", "actor", "source", "action", "result", "version", "version_before")
    e = {k: (str(e[k])[:200] if isinstance(e[k], str) else e[k]) for k in keep if k in e}
    e["truncated"] = True
    return json.dumps(e, sort_keys=True, default=str)[:MAX_AUDIT_LINE] + "\n"
