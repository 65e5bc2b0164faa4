"""The readers of the state directory's files: regular files only, never followed through a symlink,
never waited on (a FIFO), capped in size, through flyserve.files.safe_read. Every part of the Store
(snapshot_files, audit_log, rank_files) and the sidecar read the state directory through these.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flyserve.files import safe_read

MAX_JSON_BYTES = 1 << 20
"""current.json, a history entry or a rank report is a few kB; a larger one is not read."""


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
