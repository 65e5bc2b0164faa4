"""Named threshold profiles: YAML files shipped in config/profiles.

Reading a profile is start-up and control-plane work, never hot-path work.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from flyserve.policy.thresholds import Thresholds, ThresholdsError

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
    raise ThresholdsError(
        [("profile", f"unknown profile {name!r} (available: {', '.join(available_profiles()) or 'none'})")]
    )


def parse_yaml_mapping(text: str, *, source: str | None = None) -> dict[str, Any]:
    """YAML text -> mapping, with errors that say where. Empty documents are refused."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ThresholdsError([("<document>", f"malformed YAML{where}: {problem}")], source=source) from None
    if data is None:
        raise ThresholdsError([("<document>", "empty document (a truncated write?)")], source=source)
    if not isinstance(data, dict):
        raise ThresholdsError(
            [("<document>", f"must be a mapping of threshold names to values, got {type(data).__name__}")],
            source=source,
        )
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ThresholdsError([(str(bad[0]), "keys must be strings")], source=source)
    return data


def read_yaml_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ThresholdsError([("<file>", "no such file")], source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ThresholdsError([("<file>", f"cannot read: {exc}")], source=str(path)) from None
    return parse_yaml_mapping(text, source=str(path))


def load_profile(name_or_path: str | Path) -> Thresholds:
    """A profile by name, or a thresholds file by path (anything with a '/' or a .yaml/.yml suffix)."""
    s = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in s or s.endswith((".yaml", ".yml")):
        path = Path(s)
    else:
        path = profile_path(s)
    return Thresholds.parse(read_yaml_file(path), source=str(path))
