"""The operator's thresholds file as the control plane reads it: followed through symlinks (a
ConfigMap's ..data swap), a regular file of bounded size, parsed as a YAML mapping, with its hash.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyserve.control.errors import ControlIOError
from flyserve.files import safe_read
from flyserve.policy.safe_yaml import MAX_DOCUMENT_BYTES
from flyserve.policy.safe_yaml import parse_mapping as parse_yaml_mapping
from flyserve.policy.thresholds import ThresholdsError


@dataclass(frozen=True, slots=True)
class FileRead:
    """The operator file as last read: its values and content hash (None when missing)."""

    path: str
    values: Mapping[str, Any]
    sha256: str


def read_config_file(path: str | os.PathLike[str]) -> FileRead:
    """Read and parse the operator file. Symlinks are followed (a ConfigMap's ..data swap) but the
    file they lead to must be a regular file of at most MAX_DOCUMENT_BYTES: a FIFO would block the
    reader for ever, a device or a 90 MB file would hold the writers' lock. Raises ControlIOError if
    it cannot be read and ThresholdsError if it is not a valid YAML mapping."""
    p = Path(path)
    try:
        raw = safe_read.read_bytes(p, MAX_DOCUMENT_BYTES, source=str(p), follow_symlinks=True)
    except safe_read.UnreadableError as exc:
        raise ControlIOError(f"cannot read config file: {exc.reason}", path=str(p)) from None
    except safe_read.SafeReadError as exc:
        raise ThresholdsError([("<file>", exc.reason)], source=str(p)) from None
    if raw is None:
        raise ControlIOError("config file is missing (deleted, or mid-swap?)", path=str(p))
    values = parse_yaml_mapping(raw, source=str(p))
    return FileRead(str(p), values, hashlib.sha256(raw).hexdigest())
