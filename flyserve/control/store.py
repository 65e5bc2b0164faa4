"""Store: one state directory's reader and writer, assembled from its parts.

Each part is a module of its own: snapshot_files (current.json, thresholds.yaml, history),
audit_log (audit.jsonl, rotated under writers_lock's lock), rank_files (ranks/*.json); every file
is read through state_files. Every write that a reader may see goes temp file (same directory) ->
fsync -> os.replace, so a reader sees the old file or the new one, never half of one. Writers
serialise on an fcntl lock on control/lock, so versions stay monotonic when the sidecar and rank 0
both publish.
"""

from __future__ import annotations

import os

from flyserve.control.audit_files import AuditRotation
from flyserve.control.audit_log import AuditLog
from flyserve.control.paths import StateDir
from flyserve.control.rank_files import RankReportFiles
from flyserve.control.snapshot_files import SnapshotFiles


class Store(SnapshotFiles, AuditLog, RankReportFiles):
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
        self._init_rank_reading()
