"""The one atomic write: readers of the file see the old content or the new, never half of one.

Temp file in the same directory (a rename across filesystems is a copy) -> write -> fsync -> chmod ->
os.replace (or link, for write-once files) -> fsync of the directory. A crash or a full disk leaves
the old file and no stray temp file. The temp name is ``.<name>.<random>.tmp``, which the state
directory's repair recognises as a killed writer's leftover.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    mode: int = 0o644,
    overwrite: bool = True,
    durable: bool = True,
) -> None:
    """Write ``data`` (str: UTF-8) to ``path`` so that a reader sees either the old or the new file.

    ``overwrite=False`` links the temp file into place instead (link() fails with FileExistsError
    when ``path`` exists): history files are written once and never replaced. ``durable=False``
    skips the two fsyncs, for files that are rewritten every few seconds and worth nothing after a
    power cut (shape samples on tmpfs); the rename keeps them whole either way.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:  # the rename itself is durable only once the directory is synced (free on tmpfs)
        with contextlib.suppress(OSError):
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
