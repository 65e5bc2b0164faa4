"""The state directory on disk: atomic writes, the writers' lock, history, the audit log, rank reports.

Every write that a reader may see goes temp file (same directory) -> fsync -> os.replace, so a
reader sees the old file or the new one, never half of one. Writers serialise on an fcntl lock on
control/lock, so versions stay monotonic when the sidecar and rank 0 both publish.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flyserve.control.audit_files import AuditRotation, read_log_tail, rotate_if_due
from flyserve.control.errors import ControlIOError
from flyserve.control.paths import MAX_VERSION, StateDir, history_version, make_private_dir
from flyserve.control.profile_trust import stored_profile_refusal
from flyserve.control.reports import CLOCK_SKEW_S, RankReport, parse_report, process_confirmed
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.version_trust import believed, ceiling_for, credible_max
from flyserve.control.witness import StepWitness
from flyserve.files import safe_read
from flyserve.files.atomic import atomic_write
from flyserve.policy.errors import describe_value
from flyserve.policy.thresholds import ThresholdsError

log = logging.getLogger("flyserve.control")


MAX_JSON_BYTES = 1 << 20
"""current.json, a history entry or a rank report is a few kB; a larger one is not read."""

MAX_AUDIT_LINE = 8192
"""One audit line at most (a 50 MB string value once made a 105 MB line)."""


MAX_RANK_FILES = 256
"""Rank reports read per look at ranks/: far above any real TP x DP size (which ones: rank_file_order)."""

_RANK_FILE_NAME = re.compile(r"(?:([1-9][0-9]{0,3})-)?(0|[1-9][0-9]{0,3})\.json", re.ASCII)
"""The names StateDir.rank_file writes: ``<rank>.json`` (engine 0), ``<engine>-<rank>.json``,
ASCII digits without leading zeros, so one (engine, rank) has exactly one name."""


def rank_file_order(engine: int, rank: int, confirmed_last_look: bool) -> tuple[int, int, int, int]:
    """Which rank reports are read first when ranks/ holds more than MAX_RANK_FILES candidates:
    those the process table confirmed at the reader's last look, then by key, square by square
    (max(engine, rank), engine, rank). A deployment's own ranks are numbered from 0 (engines
    0..DP-1, ranks 0..TP-1), so with DP and TP of at most 16 they are all read before any other
    name, whatever mtimes or names anyone else writes; larger ones are found as the long-lived
    reader (the sidecar) confirms them. Never by mtime: anyone can date a file."""
    return (0 if confirmed_last_look else 1, max(engine, rank), engine, rank)


def _open_regular(path: Path) -> tuple[int, os.stat_result] | None:
    """(fd, fstat) of ``path`` opened read-only, or None if it does not exist: safe_read.open_regular
    (a symlink, FIFO, socket, device or directory raises SafeReadError, a ValueError). The caller
    closes fd."""
    return safe_read.open_regular(path)


def read_regular_file(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of ``path``, or None if it does not exist (safe_read.read_bytes). A symlink, FIFO,
    socket, device or directory, or a file over ``max_bytes``, raises ValueError: a FIFO among the
    rank reports once blocked /readyz, /dispatch-stats and a PATCH holding the writers' lock for
    ever."""
    return safe_read.read_bytes(path, max_bytes)


def read_regular_file_owned(path: Path, max_bytes: int) -> tuple[bytes, int] | None:
    """read_regular_file, with the uid that owns the file read: the fstat of the descriptor the
    bytes came from, never a separate stat of the path (a file renamed over it in between would
    lend its owner to the other's content)."""
    opened = _open_regular(path)
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size > max_bytes:
            raise safe_read.SafeReadError(path.name, f"larger than {max_bytes} bytes ({st.st_size})")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise safe_read.SafeReadError(
            path.name, f"cannot read: {exc.strerror or type(exc).__name__}"
        ) from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise safe_read.SafeReadError(path.name, f"larger than {max_bytes} bytes (grew while read)")
    return raw, st.st_uid


AUDIT_READ_MAX = 64 << 20
"""Bytes of audit.jsonl's tail read at most: its newest lines (8192 of the longest, 4096 changes)."""


def read_file_tail(path: Path, max_bytes: int) -> str | None:
    """The last ``max_bytes`` of ``path`` as text, starting at a line (safe_read.read_tail), or None
    if it does not exist. The audit log was read with a plain open(): a symlink to /dev/zero filled
    the reader's memory, a FIFO blocked it."""
    return safe_read.read_tail(path, max_bytes)


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if the file does not exist (safe_read.read_json, capped
    at MAX_JSON_BYTES). Bad JSON, a symlink or a file that is not regular, deep nesting, a
    non-finite or overlong number, or a document that is not an object raises ValueError."""
    data = safe_read.read_json(path, MAX_JSON_BYTES)
    if data is None:
        return None
    return _json_object(data, path)


def read_json_owned(path: Path) -> tuple[dict[str, Any], int] | None:
    """read_json, with the owner of the file it was read from (read_regular_file_owned)."""
    got = read_regular_file_owned(path, MAX_JSON_BYTES)
    if got is None:
        return None
    return _json_object(safe_read.parse_json(got[0], source=path.name), path), got[1]


def _json_object(data: Any, path: Path) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise safe_read.SafeReadError(path.name, "not a JSON object", "<document>")
    return data


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


class Store:
    """Reads and writes one state directory. Holds no state of its own beyond the paths."""

    def __init__(
        self,
        state_dir: StateDir | str | os.PathLike[str],
        *,
        history_keep: int = 50,
        audit_rotation: AuditRotation | None = None,
        check_profile: bool = True,
        own_profile: str | None = None,
    ) -> None:
        self.dir = StateDir(state_dir)
        # Whether snapshots read here must load their profile (snapshot.check_layers): the plane's
        # stores do; a rank's does not (it may lack the profile file the plane was given).
        self.check_profile = check_profile
        # The profile this process was given (ControlPlane's ``profile``): a stored snapshot naming
        # another profile *path* is believed only where control.profile_trust says so.
        self.own_profile = own_profile
        self.history_keep = max(1, int(history_keep))
        # When audit.jsonl rotates and how many rotated files are kept (flyserve.control.audit_files);
        # $FLYSERVE_AUDIT_MAX_BYTES / $FLYSERVE_AUDIT_KEEP unless given.
        self.audit_rotation = audit_rotation or AuditRotation.from_env_or_default()
        # The thread that holds lock() through this Store, if any: audit() rotates only under the lock.
        self._lock_owner: int | None = None
        # Files in ranks/ not used at the last look: left unread (odd names, past the newest
        # MAX_RANK_FILES) or read and refused (unreadable, implausible). One assignment per look, so
        # a reader never sees parts of two looks (_read_reports).
        self.skipped_rank_files = 0
        # Names whose report the process table confirmed at the last look: read first next time.
        self._confirmed_names: frozenset[str] = frozenset()
        self._witness = StepWitness()
        self._witness_lock = threading.Lock()  # one look at a time (_read_reports)
        self._ranks_dir_sticky = False  # ranks/ checked for its sticky bit (write_rank_report)
        self.confirmed_seen = False
        """Some look of this reader confirmed a rank (flyserve.control.reports.liveness): ranks run
        in its pid namespace, so an unconfirmed report is not taken for a live rank by /readyz."""

    # ------------------------------------------------------------------ lock

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

    # ------------------------------------------------------------------ snapshots

    def read_current(self, *, anchor: int | None = None) -> ConfigSnapshot | None:
        """The published snapshot, or None if nothing has been published yet.

        A current.json that exists but is unreadable, fails its sha check or its layers' check
        (ConfigSnapshot.from_dict), or carries a version the reader cannot believe raises
        ControlIOError: callers keep what they have rather than guess. ``anchor`` is the highest
        version the reader itself knows to be credible (a running rank: the one it applied); None:
        the credible chain of history names decides (control.version_trust).
        """
        path = self.dir.current_json
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise ControlIOError(f"cannot read the current snapshot: {exc}", path=str(path)) from exc
        if data is None:
            return None
        self._check_stored_profile(data, path, "current snapshot rejected")
        try:
            snap = ConfigSnapshot.from_dict(data, source=str(path), check_profile=self.check_profile)
        except ThresholdsError as exc:
            raise ControlIOError(f"current snapshot rejected: {exc}", path=str(path)) from exc
        base = self.version_floor() if anchor is None else anchor
        if not believed(snap.version, base):
            raise ControlIOError(
                f"current snapshot rejected: version {snap.version} does not continue the versions on "
                f"record (at most {ceiling_for(base)} is believed after version {base})",
                path=str(path),
            )
        return snap

    def read_version(self, version: int) -> ConfigSnapshot | None:
        """A snapshot from history, or None if it was never published or has been pruned."""
        path = self.dir.history_file(version)
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise ControlIOError(f"cannot read history: {exc}", path=str(path)) from exc
        if data is None:
            return None
        self._check_stored_profile(data, path, "history entry rejected")
        try:
            return ConfigSnapshot.from_dict(data, source=str(path), check_profile=self.check_profile)
        except ThresholdsError as exc:
            raise ControlIOError(f"history entry rejected: {exc}", path=str(path)) from exc

    def _check_stored_profile(self, data: Any, path: Path, what: str) -> None:
        """Refuse, before anything loads it, a stored profile path the operator could not have given
        (control.profile_trust); a rank never loads the profile and skips this."""
        if not self.check_profile or not isinstance(data, dict):
            return
        reason = stored_profile_refusal(
            data.get("profile"), own_profile=self.own_profile, state_dir=self.dir.path
        )
        if reason is not None:
            raise ControlIOError(f"{what}: profile: {reason}", path=str(path))

    def history_versions(self) -> list[int]:
        try:
            names = os.listdir(self.dir.history_dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ControlIOError(
                f"cannot list history: {exc.strerror}", path=str(self.dir.history_dir)
            ) from exc
        return sorted({v for n in names if (v := history_version(n)) is not None})

    def history(self, limit: int | None = None) -> list[ConfigSnapshot]:
        """Kept snapshots, oldest first (at most the last ``limit``)."""
        versions = self.history_versions()
        if limit is not None:
            versions = versions[-limit:]
        snaps = []
        for v in versions:
            try:
                s = self.read_version(v)
            except ControlIOError as exc:  # one garbage file must not hide the rest (`repair` drops it)
                log.error("%s; skipped", exc)
                continue
            if s is not None:
                snaps.append(s)
        return snaps

    def newest_credible_history(self, *, at_most: int | None = None) -> ConfigSnapshot | None:
        """The newest history entry that reads, passes its checks and continues the versions on
        record (version_floor), or None: what stands in for a current.json that is missing, damaged
        or forged."""
        floor = self.version_floor(at_most=at_most)
        for v in reversed([v for v in self.history_versions() if v <= floor]):
            try:
                snap = self.read_version(v)
            except ControlIOError:
                continue
            if snap is not None:
                return snap
        return None

    def history_file_exists(self, version: int) -> bool:
        return self.dir.history_file(version).exists()

    def version_floor(self, *, at_most: int | None = None) -> int:
        """The highest version number of the credible chain of history file names, readable or not
        (``.bad`` included; control.version_trust.credible_max): a new version must be above it,
        so no history file of the plane's is ever overwritten. Only names history_version() accepts
        count (a stray name is never a floor), and a name past a gap in the chain is not one either:
        a forged history file named 10**18 - 2 once exhausted version numbers. ``at_most``: names
        above it are left out (the highest version live ranks believe, control.version_trust)."""
        try:
            names = os.listdir(self.dir.history_dir)
        except OSError:
            return 0
        limit = MAX_VERSION if at_most is None else at_most
        return credible_max(
            v for n in names if (v := history_version(n, set_aside=True)) is not None and v <= limit
        )

    def stray_history_names(self) -> list[str]:
        """Names in history/ that look like entries (end in .json) but carry no valid version."""
        try:
            names = os.listdir(self.dir.history_dir)
        except OSError:
            return []
        return sorted(
            n for n in names if n.endswith(".json") and not n.startswith(".") and history_version(n) is None
        )

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

    def publish(self, snap: ConfigSnapshot) -> None:
        """Make ``snap`` current. Call under lock(). Order matters: history first, then the YAML view,
        then current.json last - the one rename that commits the version for every rank."""
        body = snap.to_json()
        history_written = False
        try:
            atomic_write(self.dir.history_file(snap.version), body, overwrite=False)
            history_written = True
            self._write_views(snap)
            atomic_write(self.dir.current_json, body)
        except FileExistsError as exc:
            raise ControlIOError(
                f"cannot publish version {snap.version}: it is already in history (run `flyserve "
                "thresholds repair`)",
                path=str(self.dir.history_file(snap.version)),
            ) from exc
        except OSError as exc:
            if history_written:  # never made current: no orphan left behind
                with contextlib.suppress(OSError):
                    os.unlink(self.dir.history_file(snap.version))
            raise ControlIOError(
                f"cannot publish version {snap.version}: {exc.strerror or exc}",
                path=getattr(exc, "filename", None) or str(self.dir.control_dir),
            ) from exc
        self._prune()

    def restore_current(self, snap: ConfigSnapshot) -> None:
        """Rewrite current.json (and the YAML view) from a snapshot already in history (repair)."""
        try:
            self._write_views(snap)
            atomic_write(self.dir.current_json, snap.to_json())
        except OSError as exc:
            raise ControlIOError(
                f"cannot restore current.json: {exc.strerror or exc}", path=str(self.dir.current_json)
            ) from exc

    def _write_views(self, snap: ConfigSnapshot) -> None:
        import yaml

        header = (
            f"# flyserve effective thresholds: version {snap.version}, sha256 {snap.sha256}\n"
            f"# effective from engine step {snap.effective_step}; source {snap.source}, actor {snap.actor}, "
            f"{snap.time_iso}\n# written by the control plane - change thresholds with the config file, "
            "`flyserve thresholds set` or PATCH /thresholds, not here\n"
        )
        atomic_write(
            self.dir.thresholds_yaml, header + yaml.safe_dump(snap.thresholds.model_dump(), sort_keys=False)
        )

    def _prune(self) -> None:
        versions = self.history_versions()
        for v in versions[: -self.history_keep]:
            with contextlib.suppress(OSError):
                os.unlink(self.dir.history_file(v))

    # ------------------------------------------------------------------ audit

    def audit(self, entry: Mapping[str, Any]) -> bool:
        """Append one JSON line to audit.jsonl (O_APPEND, fsync; mode 0640, at most MAX_AUDIT_LINE
        bytes). Returns False (and logs) if it cannot: an unwritable state directory must not turn a
        rejection into a crash."""
        line = bounded_audit_line(entry)
        self.last_audit_error: str | None = None
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

    # ------------------------------------------------------------------ ranks

    def rank_reports(self, *, now: float | None = None) -> list[dict[str, Any]]:
        """Every ranks/*.json whose fields are all finite and plausible (see reports.parse_report);
        a half-written, foreign or poisoned file is skipped, never fatal."""
        now = time.time() if now is None else now
        return [d for d, r in self._read_reports(now) if r is not None]

    def reports(self, *, now: float | None = None) -> list[RankReport]:
        """The validated reports (flyserve.control.reports.RankReport)."""
        now = time.time() if now is None else now
        return [r for _, r in self._read_reports(now) if r is not None]

    def read_rank_reports(self, *, now: float | None = None) -> list[tuple[dict[str, Any], RankReport]]:
        """One look: each validated report with its JSON object (for views that show its fields)."""
        now = time.time() if now is None else now
        return [(d, r) for d, r in self._read_reports(now) if r is not None]

    def _rank_file_names(self) -> tuple[list[str], int]:
        """The rank report names worth reading, at most MAX_RANK_FILES (see
        rank_file_order), and how many other entries ranks/ holds. 20,000 stale files once made a
        PATCH hold the writers' lock for 5 s; 300 files dated an hour ahead once pushed the live
        ranks out of "the 256 newest by mtime": mtimes are anyone's to set, so they decide nothing
        but that a file dated in the future is skipped.
        Dot files (a rank's own atomic-write temp file, an NFS silly-rename) are neither read nor
        counted."""
        try:
            entries = list(os.scandir(self.dir.ranks_dir))
        except OSError:
            return [], 0
        latest = time.time() + CLOCK_SKEW_S  # mtimes are the file system's: the real clock, not a plane's
        keyed: list[tuple[tuple[int, int, int, int], str]] = []
        others = 0
        for e in entries:
            if e.name.startswith("."):
                continue
            m = _RANK_FILE_NAME.fullmatch(e.name)
            if m is None:
                others += 1
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:  # gone since the scan
                continue
            if st.st_mtime > latest:
                others += 1
                continue
            engine, rank = int(m.group(1) or 0), int(m.group(2))
            keyed.append((rank_file_order(engine, rank, e.name in self._confirmed_names), e.name))
        keyed.sort()
        others += max(0, len(keyed) - MAX_RANK_FILES)
        return [n for _, n in keyed[:MAX_RANK_FILES]], others

    def _trusted_uids(self) -> frozenset[int]:
        """Whose rank report files may be confirmed: the reader's own uid and the state directory's
        owner. A process of any other uid that can write in ranks/ could name its own live pid."""
        uids = {os.geteuid()}
        with contextlib.suppress(OSError):
            uids.add(os.stat(self.dir.path).st_uid)
        return frozenset(uids)

    def _read_reports(self, now: float) -> list[tuple[dict[str, Any], RankReport | None]]:
        out: list[tuple[dict[str, Any], RankReport | None]] = []
        names, skipped = self._rank_file_names()
        trusted = self._trusted_uids()
        for n in names:
            try:
                got = read_json_owned(self.dir.ranks_dir / n)
            except (OSError, ValueError):
                skipped += 1
                continue
            if got is not None:
                d, uid = got
                r = parse_report(d, now=now, file_uid=uid, foreign_writer=uid not in trusted)
                if r is not None and self.dir.rank_file(r.rank, r.engine).name != n:
                    r = None  # a report under another rank's name: one key, one file
                out.append((d, r))
        # A report must agree with what this reader saw of the same key (control.witness): a
        # contradicting one is replaced by the key's last credible report.
        # The witness is shared by every thread of this reader (probes, sampler, compactor,
        # requests): its look and the refused count it leaves are read as one step under
        # _witness_lock, or two looks lose each other's observations and one reads the other's
        # count. The process table is asked before taking it (the look itself is in memory).
        found = [(d, r) for d, r in out if r is not None]
        confirmed = {id(r): process_confirmed(r) for _, r in found}

        def is_confirmed(r: RankReport) -> bool:
            got = confirmed.get(id(r))
            return process_confirmed(r) if got is None else got

        with self._witness_lock:
            judged = self._witness.look(found, now, is_confirmed)
            refused = self._witness.refused
        skipped += sum(r is None for _, r in out) + refused
        out = [(d, r) for d, r in out if r is None] + list(judged)
        self.skipped_rank_files = skipped
        self._confirmed_names = frozenset(
            self.dir.rank_file(r.rank, r.engine).name for _, r in judged if is_confirmed(r)
        )
        self.confirmed_seen = self.confirmed_seen or bool(self._confirmed_names)
        return out

    def live_ranks(self, *, stale_after_s: float = 30.0, now: float | None = None) -> int:
        """How many ranks are live (fresh report, process not known to be gone)."""
        now = time.time() if now is None else now
        return sum(1 for r in self.reports(now=now) if r.is_live(now, stale_after_s))

    def max_rank_step(self, *, stale_after_s: float = 30.0, now: float | None = None) -> int:
        """The highest step a live rank reported."""
        now = time.time() if now is None else now
        return max((r.step for r in self.reports(now=now) if r.is_live(now, stale_after_s)), default=0)

    def write_rank_report(self, report: Mapping[str, Any], *, rank: int, engine: int = 0) -> None:
        if not self._ranks_dir_sticky:
            self._make_ranks_dir_sticky()
        atomic_write(self.dir.rank_file(rank, engine), json.dumps(dict(report), sort_keys=True))

    def _make_ranks_dir_sticky(self) -> None:
        """Create ranks/ and give it the sticky bit (when this process owns it), once per Store: in a
        sticky directory only a file's owner may rename over it or remove it, so another uid that
        can write in ranks/ cannot replace a rank's own report with a forgery (see
        control.effective "Where it does not hold"). A directory this process does not own, or a
        file system that refuses the bit, is left as it is."""
        self._ranks_dir_sticky = True
        with contextlib.suppress(OSError):
            self.dir.ranks_dir.mkdir(parents=True, exist_ok=True)
            st = os.stat(self.dir.ranks_dir)
            if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
                os.chmod(self.dir.ranks_dir, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)


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
