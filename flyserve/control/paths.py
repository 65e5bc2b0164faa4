"""Where the shared control state lives: one directory shared by the ranks and the sidecar.

/dev/shm by default (tmpfs: writes never wait on a disk, and it is per host like the ranks);
an emptyDir volume shared by the vLLM and sidecar containers in Kubernetes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

AUDIT_DIR_ENV = "FLYSERVE_AUDIT_DIR"
"""Where audit.jsonl (and its rotated files) live instead of the state directory, if set."""

MAX_VERSION = 10**18 - 1
"""The highest version number: 18 decimal digits, what If-Match (and a rank report) can carry."""

_HISTORY_NAME = re.compile(r"([0-9]{1,18})\.json(\.bad)?")


def history_version(name: str, *, set_aside: bool = False) -> int | None:
    """The version a history file name carries ('00000012.json' -> 12), or None for any other name.

    Strict: ASCII digits only (str.isdigit() also takes '²³' and '٣٣', which int() rejects or reads
    as 33), at most 18 of them, 1..MAX_VERSION. A stray name never counts as a version, so it cannot
    push version numbers out of range. ``set_aside`` also accepts repair's '.json.bad'.
    """
    m = _HISTORY_NAME.fullmatch(name)
    if m is None or (m.group(2) and not set_aside):
        return None
    v = int(m.group(1))
    return v if 1 <= v <= MAX_VERSION else None


def default_state_dir() -> Path:
    """$FLYSERVE_STATE_DIR, else /dev/shm/flyserve/$FLYSERVE_INSTANCE (instance "default")."""
    env = os.environ.get("FLYSERVE_STATE_DIR")
    if env:
        return Path(env)
    return Path("/dev/shm/flyserve") / (os.environ.get("FLYSERVE_INSTANCE") or "default")


@dataclass(frozen=True, slots=True)
class StateDir:
    """The layout of a state directory. Creating one touches nothing on disk."""

    path: Path

    def __init__(self, path: str | os.PathLike[str] | StateDir) -> None:
        object.__setattr__(self, "path", Path(path.path if isinstance(path, StateDir) else path))

    @property
    def control_dir(self) -> Path:
        return self.path / "control"

    @property
    def thresholds_yaml(self) -> Path:
        """The effective thresholds as YAML, for people and tools (ranks read current.json)."""
        return self.control_dir / "thresholds.yaml"

    @property
    def current_json(self) -> Path:
        """The published snapshot, self-contained and sha-checked: the one file every rank reads."""
        return self.control_dir / "current.json"

    @property
    def history_dir(self) -> Path:
        return self.control_dir / "history"

    @property
    def lock_file(self) -> Path:
        return self.control_dir / "lock"

    @property
    def trial_lease(self) -> Path:
        """The autopilot's lease on the trial in force, renewed by the sidecar (control.trial_lease)."""
        return self.control_dir / "autopilot-lease.json"

    @property
    def audit_log(self) -> Path:
        """<state dir>/audit.jsonl, or $FLYSERVE_AUDIT_DIR/audit.jsonl: in Kubernetes the audit log
        lives on a disk volume of its own (deploy/base), not in the state directory's memory volume,
        whose pages count against the writing container's memory and whose overflow evicts the pod."""
        audit_dir = os.environ.get(AUDIT_DIR_ENV)
        return (Path(audit_dir) if audit_dir else self.path) / "audit.jsonl"

    @property
    def ranks_dir(self) -> Path:
        return self.path / "ranks"

    @property
    def metrics_dir(self) -> Path:
        return self.path / "metrics"

    def history_file(self, version: int) -> Path:
        return self.history_dir / f"{version:08d}.json"

    def rank_file(self, rank: int, engine: int = 0) -> Path:
        """ranks/<rank>.json (engine 0) or ranks/<engine>-<rank>.json, so data-parallel engines never clash."""
        name = f"{rank}.json" if engine == 0 else f"{engine}-{rank}.json"
        return self.ranks_dir / name

    def __fspath__(self) -> str:
        return str(self.path)


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create ``path`` (and missing parents) if absent, the directory itself mode 0700: it holds the
    audit log and the thresholds (docs/operations.md recommends 0700; ``set --create`` and the
    sidecar would otherwise make 0755 ones). An existing directory's mode is left alone."""
    p = Path(path)
    if p.is_dir():
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    p.mkdir(mode=0o700, exist_ok=True)
