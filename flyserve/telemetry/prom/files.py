"""The multiprocess files: read, check and write prometheus_client's metrics-file layout.

A metrics file is what ``MmapedDict`` writes (a used-size header, then per entry: key length, UTF-8
key padded to 8-byte alignment, value, timestamp). The sidecar reads every process's files on each
scrape and compaction rewrites dead processes' files into archives, so every reader here opens a
file through flyserve.files.safe_read (a FIFO, a symlink or a directory is refused, never waited
on) and believes a header only as far as the file can hold it. The format is prometheus_client's
undocumented one (``_read_all_values``, ``floatToGoString``): only this package uses it.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable, Iterator

from prometheus_client.mmap_dict import _read_all_values as mmap_read_all_values
from prometheus_client.utils import floatToGoString

from flyserve.files import safe_read

MAX_VALUES_FILE_BYTES = 256 << 20
"""A rank's metrics file holds a few thousand series (under 1 MiB); a sparse file claiming more is
refused rather than read into memory."""


def _used_of(head: bytes, size: int) -> int | None:
    if len(head) < 8:
        return 0
    used = struct.unpack_from("i", head, 0)[0]
    if used == 0:
        return 0
    return used if 8 <= used <= size else None


def _open_values_file(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    """(fd, fstat) of a metrics file through flyserve.files.safe_read.open_regular: a FIFO, a
    symlink (to /dev/zero) or a directory among the metrics files is refused at once (ValueError),
    never waited on (a plain open() of a FIFO blocked every /metrics and /dispatch-stats for ever).
    FileNotFoundError if gone. The caller closes fd."""
    name = os.path.basename(path)
    opened = safe_read.open_regular(path, source=name)
    if opened is None:
        raise FileNotFoundError(errno.ENOENT, "metrics file is gone", name)
    return opened


def values_file_used(path: str | os.PathLike[str]) -> int | None:
    """The used size a metrics file's header claims, or None if that cannot be true: the header
    claims less than 8 (but not 0) or more than the file holds.
    prometheus_client's reader believes the header and reads that many bytes: a header saying
    2^31-1 made /metrics and /dispatch-stats answer 500 (MemoryError) until the file was removed.

    0 for a file still being created: shorter than 8 bytes or a zero header (prometheus_client's
    MmapedDict creates the file, truncates it to its first size, then writes the header): no
    entries yet, not a bad file. A file that is not regular raises ValueError (safe_read)."""
    fd, st = _open_values_file(path)
    try:
        return _used_of(os.pread(fd, 8, 0), st.st_size)
    finally:
        os.close(fd)


def read_used(path: str | os.PathLike[str]) -> tuple[os.stat_result, bytes]:
    """(fstat, the used bytes, header included) of one metrics file: the one header check both
    cached readers (flyserve.telemetry.files_exposition, flyserve.telemetry.entry_cache) share.

    Opened through safe_read.open_regular (a FIFO, symlink or directory: ValueError, never waited
    on); FileNotFoundError if gone. ``b""`` for a file still being created (shorter than 8 bytes
    or a zero header). ValueError for a header claiming less than 8 bytes, more than the file
    holds, a size that is not a multiple of 8, or more than MAX_VALUES_FILE_BYTES: a sparse 2 GB
    file with a matching header is refused, not read in full on every scrape."""
    name = os.path.basename(path)
    fd, st = _open_values_file(path)
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return st, b""
        used = int.from_bytes(head[:4], "little", signed=True)
        if used == 0:
            return st, b""
        if used < 8 or used > st.st_size or used % 8:
            raise ValueError(f"{name}: its header claims a size the file cannot hold")
        if used > MAX_VALUES_FILE_BYTES:
            raise ValueError(f"{name}: larger than {MAX_VALUES_FILE_BYTES} bytes")
        data = os.pread(fd, used, 0)
    finally:
        os.close(fd)
    if len(data) < used:
        raise ValueError(f"{name}: shorter than its header claims")
    return st, data


def read_values_file(path: str | os.PathLike[str]) -> Iterator[tuple[str, float, float, int]]:
    """(key, value, timestamp, position) of every entry of one metrics file (read-only).

    A key is prometheus_client's JSON ``[metric_name, name, labels, help]``. Raises ValueError for
    a file whose header or entries cannot be true (values_file_used) or that is not a regular
    file, FileNotFoundError if gone. One open, header and entries read from it."""
    fd, st = _open_values_file(path)
    try:
        used = _used_of(os.pread(fd, 8, 0), st.st_size)
        if used is None:
            raise ValueError(f"{os.path.basename(path)}: header's used size does not fit the file")
        if used == 0:  # still being created
            return iter(())
        if used > MAX_VALUES_FILE_BYTES:
            raise ValueError(f"{os.path.basename(path)}: larger than {MAX_VALUES_FILE_BYTES} bytes")
        data = os.pread(fd, used, 0)
    finally:
        os.close(fd)
    try:
        return iter(list(mmap_read_all_values(data, used)))
    except (RuntimeError, struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"{os.path.basename(path)}: corrupt entry ({type(exc).__name__})") from None


def encode_values_file(entries: Iterable[tuple[str, float, float]]) -> bytes:
    """The bytes of a metrics file holding ``entries`` (key, value, timestamp), in the layout
    prometheus_client's ``MmapedDict`` writes (a used-size header, then per entry: key length,
    UTF-8 key padded with spaces to 8-byte alignment, value, timestamp), so its readers and
    :func:`read_values_file` read it. Used to write compacted archives (flyserve.telemetry.compaction)
    in one piece to a temporary file, never through a live mapping."""
    parts = [b"\0" * 8]
    used = 8
    for key, value, timestamp in entries:
        encoded = key.encode("utf-8")
        padding = b" " * (8 - (len(encoded) + 4) % 8)
        entry = struct.pack(
            f"i{len(encoded)}s{len(padding)}sdd", len(encoded), encoded, padding, value, timestamp
        )
        parts.append(entry)
        used += len(entry)
    data = bytearray(b"".join(parts))
    struct.pack_into("i", data, 0, used)
    return bytes(data)


def float_text(value: float) -> str:
    """A sample value as prometheus_client's text format writes it (``+Inf``, ``1.0``, ``1e+06``)."""
    return floatToGoString(value)


def entry_offsets(data: bytes, start: int, used: int) -> list[tuple[str, int]]:
    """(key, index of the value as a float64 of ``data``) of every entry from byte ``start`` (8 for
    the first) up to ``used``, in a metrics file's layout (:func:`encode_values_file`). The
    timestamp is the next float64. Raises ValueError for an entry that cannot be true."""
    out = []
    pos = start
    unpack = struct.unpack_from
    while pos < used:
        n = unpack("i", data, pos)[0]
        if n <= 0 or pos + 4 + n > used:
            raise ValueError(f"entry at byte {pos} claims a key of {n} bytes")
        key = data[pos + 4 : pos + 4 + n].decode("utf-8")  # UnicodeDecodeError is a ValueError
        pos += 4 + n + (8 - (n + 4) % 8)
        if pos + 16 > used:
            raise ValueError(f"entry at byte {pos} runs past the used size")
        out.append((key, pos // 8))
        pos += 16
    return out
