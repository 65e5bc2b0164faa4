"""A thresholds YAML file read from disk: a profile by name, or an operator's file by path.

Reading a profile is start-up and control-plane work, never hot-path work. The bytes come through
flyserve.files.safe_read (size-capped, regular files only); policy.safe_yaml parses them and
Thresholds validates them, neither of which touches a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flyserve.files.safe_read import SafeReadError, read_bytes
from flyserve.policy.errors import ThresholdsError
from flyserve.policy.safe_yaml import MAX_DOCUMENT_BYTES, parse_mapping
from flyserve.policy.thresholds import Thresholds
from flyserve.thresholds_files.locate import is_path_like, profile_path

__all__ = ["load_profile", "read_yaml_file"]


def read_yaml_file(path: Path) -> dict[str, Any]:
    """A thresholds YAML file as a mapping (size-capped, safe loader); ThresholdsError if not."""
    try:
        raw = read_bytes(path, MAX_DOCUMENT_BYTES, source=str(path), follow_symlinks=True)
    except SafeReadError as exc:
        raise ThresholdsError([("<file>", exc.reason)], source=str(path)) from None
    if raw is None:
        raise ThresholdsError([("<file>", "no such file")], source=str(path))
    return parse_mapping(raw, source=str(path))


def load_profile(name_or_path: str | Path) -> Thresholds:
    """A profile by name (``gfx950``, ``h200``; ``gfx950`` is the seed's values) or a thresholds YAML
    file by path (anything with a '/' or a .yaml/.yml suffix)."""
    path = Path(name_or_path) if is_path_like(name_or_path) else profile_path(str(name_or_path))
    return Thresholds.parse(read_yaml_file(path), source=str(path))
