"""Named threshold profiles: YAML files shipped in config/profiles.

Reading a profile is start-up and control-plane work, never hot-path work. The lookup lives in
profile_paths, the YAML reader in safe_yaml, the parsing in Thresholds.load: this module only
re-exports them under their historical names (no import circle with thresholds.py).
"""

from __future__ import annotations

from pathlib import Path

from flyserve.policy.profile_paths import available_profiles, profile_dirs, profile_path
from flyserve.policy.safe_yaml import parse_mapping as parse_yaml_mapping
from flyserve.policy.thresholds import Thresholds, read_yaml_file

__all__ = [
    "available_profiles",
    "load_profile",
    "parse_yaml_mapping",
    "profile_dirs",
    "profile_path",
    "read_yaml_file",
]


def load_profile(name_or_path: str | Path) -> Thresholds:
    """A profile by name, or a thresholds file by path (anything with a '/' or a .yaml/.yml suffix)."""
    return Thresholds.load(name_or_path)
