"""The state directory's audit log as lines, oldest first, for `flyserve autopilot history|replay`.

Read the way control's store reads it (control.audit_files.read_log_tail over audit.jsonl's rotated
files, each through files.safe_read.read_tail: no symlink followed, no FIFO waited on, size capped),
so the autopilot sees exactly the lines `flyserve thresholds audit` sees, including where
$FLYSERVE_AUDIT_DIR moves the log (control.paths.StateDir.audit_log). Unlike the store's reader,
every line comes back, unparsed: a line that does not parse must be named by replay, not dropped.
"""

from __future__ import annotations

from pathlib import Path

from flyserve.control.audit_files import AuditRotation, read_log_tail
from flyserve.control.paths import StateDir
from flyserve.files import safe_read

READ_MAX_BYTES = 64 << 20
"""The newest 64 MiB of the log at most (the store's reader reads as much)."""


def audit_log_path(state_dir: Path) -> Path:
    return StateDir(state_dir).audit_log


def read_audit_lines(state_dir: Path) -> list[str]:
    """The audit log's lines across its rotated files, oldest first ([] when there is no log).
    Raises OSError or ValueError (safe_read's refusals) naming the file that cannot be read."""
    keep = AuditRotation.from_env_or_default().keep
    text = read_log_tail(audit_log_path(state_dir), READ_MAX_BYTES, keep, safe_read.read_tail, strict=True)
    return [] if text is None else text.splitlines()
