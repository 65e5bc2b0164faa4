"""Where named threshold profiles live (config/profiles, or $FLYSERVE_PROFILE_PATH).

Path lookup only, no reading or parsing: read.py reads what this finds.
"""

from __future__ import annotations

import os
from pathlib import Path

from flyserve.policy.errors import ThresholdsError

_PACKAGE_PROFILES = Path(__file__).resolve().parent.parent / "profiles"  # inside a built wheel
_REPO_PROFILES = Path(__file__).resolve().parents[2] / "config" / "profiles"  # editable / source tree


def profile_dirs() -> list[Path]:
    """Where profiles are looked up, first match wins: $FLYSERVE_PROFILE_PATH (os.pathsep-separated),
    then the shipped ones."""
    dirs = [Path(p) for p in os.environ.get("FLYSERVE_PROFILE_PATH", "").split(os.pathsep) if p]
    dirs += [d for d in (_PACKAGE_PROFILES, _REPO_PROFILES) if d.is_dir()]
    return dirs


def available_profiles() -> list[str]:
    names: set[str] = set()
    for d in profile_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def profile_path(name: str) -> Path:
    for d in profile_dirs():
        p = d / f"{name}.yaml"
        if p.is_file():
            return p
    shown = name if len(name) <= 48 else name[:48] + "..."
    raise ThresholdsError(
        [("profile", f"unknown profile {shown!r} (available: {', '.join(available_profiles()) or 'none'})")]
    )


def is_path_like(name_or_path: str | Path) -> bool:
    """A path (anything with a '/' or a .yaml/.yml suffix), not a profile name."""
    s = str(name_or_path)
    return isinstance(name_or_path, Path) or "/" in s or s.endswith((".yaml", ".yml"))
