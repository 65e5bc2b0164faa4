"""The published versions on disk: control/current.json (the one file every rank reads),
control/thresholds.yaml (the same values for people), control/history/<version>.json (rollback
targets). Every write goes temp file (same directory) -> fsync -> os.replace, so a reader sees the
old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from flyserve.control.errors import ControlIOError
from flyserve.control.paths import MAX_VERSION, StateDir, history_version
from flyserve.control.profile_trust import stored_profile_refusal
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.state_files import read_json
from flyserve.control.version_trust import believed, ceiling_for, credible_max
from flyserve.files.atomic import atomic_write
from flyserve.policy.thresholds import ThresholdsError

log = logging.getLogger("flyserve.control")


class SnapshotFiles:
    """The Store's versions: current.json, the YAML view, history (a part of
    flyserve.control.store.Store, which sets the attributes below)."""

    dir: StateDir
    check_profile: bool
    own_profile: str | None
    history_keep: int

    def read_current(self, *, anchor: int | None = None) -> ConfigSnapshot | None:
        """The published snapshot, or None if nothing has been published yet.

        A current.json that exists but is unreadable, fails its sha check or its layers' check
        (ConfigSnapshot.from_dict), or carries a version the reader cannot believe raises
        ControlIOError: callers keep what they have rather than guess. ``anchor`` is the highest
        version the reader itself knows to be credible (a running rank: the one it applied); None:
        the credible chain of history names decides (control.version_trust).
        """
        path = self.dir.current_json
        snap = self._read_snapshot(path, "the current snapshot", "current snapshot rejected")
        if snap is None:
            return None
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
        return self._read_snapshot(self.dir.history_file(version), "history", "history entry rejected")

    def versions_up_to(self, newest: ConfigSnapshot, *, after: int) -> list[ConfigSnapshot]:
        """``newest`` and the versions between ``after`` and it from history, oldest first: the
        versions published between two reads of current.json, so no reader skips one. Stops at the
        first one history lacks or refuses going down (the versions above it still come)."""
        out = [newest]
        for v in range(newest.version - 1, after, -1):
            try:
                old = self.read_version(v)
            except ControlIOError:
                old = None
            if old is None:
                break
            out.insert(0, old)
        return out

    def _read_snapshot(self, path: Path, what: str, rejected: str) -> ConfigSnapshot | None:
        """The snapshot stored at ``path``, or None if there is no file. A file that cannot be read
        raises ControlIOError "cannot read ``what``"; one whose profile, sha or layers fail their
        checks raises ControlIOError "``rejected``: why"."""
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise ControlIOError(f"cannot read {what}: {exc}", path=str(path)) from exc
        if data is None:
            return None
        self._check_stored_profile(data, path, rejected)
        try:
            return ConfigSnapshot.from_dict(data, source=str(path), check_profile=self.check_profile)
        except ThresholdsError as exc:
            raise ControlIOError(f"{rejected}: {exc}", path=str(path)) from exc

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
