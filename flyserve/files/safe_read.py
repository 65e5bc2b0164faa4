"""The one way flyserve reads a file that someone else wrote.

Every file the sidecar, the ranks or the CLI read from the state directory (shape samples, rank
reports, metrics, history, audit, current.json) or from an operator (cost tables, thresholds and
config files, the token file, lab inputs) may be a FIFO, a symlink to ``/dev/zero``, a directory,
a device, huge, half-written, nested 5000 deep or hold a 5000-digit number. Each of those once hung
or exhausted a reader (a FIFO in ``shapes/`` froze the sampler for ever; a
``/dev/zero`` link grew the sidecar by 2.65 GB; a deep cost table printed a RecursionError).

So a file is read here and only here:

* opened with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``: a symlink is refused (ELOOP), and open()
  of a FIFO returns at once instead of waiting for a writer;
* ``fstat`` of the open descriptor must say regular file (a FIFO, socket, device or directory is
  refused before any read);
* its size is capped twice: by fstat before reading, and by reading at most ``cap + 1`` bytes
  (a file that grows while read, or lies about its size, still stops at the cap);
* JSON is parsed with a depth cap and number caps: an integer literal longer than
  MAX_INT_DIGITS digits, a float literal longer than MAX_FLOAT_CHARS characters, NaN, Infinity and
  a float that overflows (``1e400``) are refused, each named by its field path;
* every error is a SafeReadError naming the file (a basename or state-directory relative name the
  caller gives) and, where there is one, the field, never the value: an error lands in logs, the
  audit log and HTTP bodies, and the file may be a link to a secret.

This module is pure standard library (it sits in ``flyserve.policy`` so every layer may use it)
and does no I/O beyond the read it is asked for. Timestamps inside files are the callers'
business; an mtime is never used for anything here.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64
"""Nesting deeper than this is refused: no flyserve file nests more than 5 levels."""
MAX_INT_DIGITS = 30
"""Integer literals with more digits are refused before int() sees them (no real count has 31)."""
MAX_FLOAT_CHARS = 64
"""Float literals longer than this are refused (a double needs at most 25 characters)."""
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_LONG_DIGITS = re.compile(f"(?:^|[\\s:,\\[-])[0-9]{{{MAX_INT_DIGITS + 1}}}")
"""A JSON number starts the text or follows one of these: a run of digits after a quote or a
letter is inside a string (an all-zero sha256 hex digest), which json.loads never makes an int."""


class SafeReadError(ValueError):
    """A file was refused. ``source`` names the file (as the caller showed it), ``field`` the
    place inside it (``<file>`` for the file itself, ``<document>`` for its syntax), ``reason``
    what is wrong; none of them holds a value read from the file."""

    def __init__(self, source: str, reason: str, field: str = "<file>") -> None:
        self.source, self.reason, self.field = source, reason, field
        where = "" if field in ("<file>", "<document>") else f"field '{field}': "
        super().__init__(f"{source}: {where}{reason}")


class NotRegularFileError(SafeReadError):
    """A symlink (where symlinks are not followed), a directory, a FIFO, a socket or a device."""


class UnreadableError(SafeReadError):
    """The file could not be opened or read (missing permission, an I/O error): the environment, not
    its content."""


class TooLargeError(SafeReadError):
    """Larger than the reader's cap (or it grew past the cap while read)."""


class NotJSONError(SafeReadError):
    """Bad JSON syntax: most likely a half-written file."""


def display_name(path: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> str:
    """How an error names ``path``: relative to ``base`` (the state directory) when under it,
    else its basename. Never the absolute path: errors go to clients that need not know it."""
    p = Path(path)
    if base is not None:
        try:
            return p.relative_to(base).as_posix()
        except ValueError:
            pass
    return p.name or str(p)


def open_regular(
    path: str | os.PathLike[str], *, source: str | None = None, follow_symlinks: bool = False
) -> tuple[int, os.stat_result] | None:
    """(fd, fstat) of ``path`` opened read-only, or None when it does not exist. A symlink (unless
    ``follow_symlinks``), FIFO, socket, device or directory raises SafeReadError without blocking;
    the caller closes fd. ``follow_symlinks`` is for the few files an orchestrator mounts as links
    (a Kubernetes ConfigMap's ..data swap, a Secret): what the link leads to must still be a
    regular file, so a link to /dev/zero or a FIFO is refused all the same."""
    name = source or display_name(path)
    flags = _OPEN_FLAGS & ~os.O_NOFOLLOW if follow_symlinks else _OPEN_FLAGS
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFileError(
                name, "a symlink, not a regular file (symlinks are not followed)"
            ) from None
        if exc.errno == errno.EISDIR:
            raise NotRegularFileError(name, "not a regular file (a directory)") from None
        if exc.errno in (errno.ENXIO, errno.EWOULDBLOCK):
            raise NotRegularFileError(name, "not a regular file (a socket or FIFO)") from None
        raise UnreadableError(name, f"cannot open: {exc.strerror or type(exc).__name__}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(name, f"not a regular file (a {_kind(st.st_mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return word
    return "special file"


def _read_at_most(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes from ``fd`` (stops at end of file); os.read loops, no buffered layer."""
    chunks: list[bytes] = []
    left = n
    while left > 0:
        try:
            b = os.read(fd, min(left, 1 << 20))
        except BlockingIOError:  # a regular file never does this; be safe rather than spin
            break
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def read_file(
    path: str | os.PathLike[str], max_bytes: int, *, source: str | None = None, follow_symlinks: bool = False
) -> tuple[bytes, os.stat_result] | None:
    """(bytes, fstat) of a regular file, or None when it does not exist. Over ``max_bytes`` (by
    fstat, or by what a read returns: at most ``max_bytes + 1`` bytes are read) raises
    SafeReadError; so does anything open_regular refuses."""
    name = source or display_name(path)
    opened = open_regular(path, source=name, follow_symlinks=follow_symlinks)
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size > max_bytes:
            raise TooLargeError(name, f"larger than {max_bytes} bytes ({st.st_size})")
        raw = _read_at_most(fd, max_bytes + 1)
    except OSError as exc:
        raise UnreadableError(name, f"cannot read: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise TooLargeError(name, f"larger than {max_bytes} bytes (grew while read)")
    return raw, st


def read_bytes(
    path: str | os.PathLike[str], max_bytes: int, *, source: str | None = None, follow_symlinks: bool = False
) -> bytes | None:
    """read_file without the stat: the bytes, or None when the file does not exist."""
    got = read_file(path, max_bytes, source=source, follow_symlinks=follow_symlinks)
    return None if got is None else got[0]


def read_text(
    path: str | os.PathLike[str], max_bytes: int, *, source: str | None = None, follow_symlinks: bool = False
) -> str | None:
    """read_bytes decoded as UTF-8 (a bad byte is an error naming the file, not the byte)."""
    name = source or display_name(path)
    raw = read_bytes(path, max_bytes, source=name, follow_symlinks=follow_symlinks)
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SafeReadError(name, f"not UTF-8 text (at byte {exc.start})", "<document>") from None


def read_tail(path: str | os.PathLike[str], max_bytes: int, *, source: str | None = None) -> str | None:
    """The last ``max_bytes`` of a regular file as text, starting at a whole line (a cut first line
    is dropped), or None when it does not exist. For append-only logs (audit.jsonl)."""
    name = source or display_name(path)
    opened = open_regular(path, source=name)
    if opened is None:
        return None
    fd, st = opened
    try:
        start = max(0, st.st_size - max_bytes)
        # From the byte before the window: if it ends a line, the window's first line is whole.
        os.lseek(fd, max(0, start - 1), os.SEEK_SET)
        raw = _read_at_most(fd, max_bytes + (start > 0))
    except OSError as exc:
        raise UnreadableError(name, f"cannot read: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
    if start > 0:
        cut = raw.find(b"\n")
        raw = raw[cut + 1 :] if cut >= 0 else b""
    return raw.decode("utf-8", "replace")


# ----------------------------------------------------------------------------- JSON


class _Bad:
    """Stands in for a refused number while json builds the document; found and named by _check."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _long_int(token: str) -> Any:
    digits = len(token.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return _Bad(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(token)


def _float_or_refusal(token: str) -> float | str:
    """The float, or why it is refused: one rule for parse_json (which names the field) and
    loads_record (which skips the line)."""
    if len(token) > MAX_FLOAT_CHARS:
        return f"a number of {len(token)} characters (at most {MAX_FLOAT_CHARS})"
    v = float(token)
    if v in (float("inf"), float("-inf")):
        return "a number out of range (not finite)"
    return v


def _float(token: str) -> Any:
    v = _float_or_refusal(token)
    return _Bad(v) if isinstance(v, str) else v


def _constant(token: str) -> Any:
    return _Bad("a non-finite number (NaN or Infinity)")


def _check(doc: Any, name: str, max_depth: int) -> None:
    """Walk the parsed document once (no recursion): the first refused number or a nesting deeper
    than ``max_depth`` raises SafeReadError naming its field path."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, _Bad):
            raise SafeReadError(name, node.reason, where or "<document>")
        if isinstance(node, dict):
            items: Any = ((f"{where}.{k}" if where else str(k), v) for k, v in node.items())
        elif isinstance(node, list):
            items = ((f"{where}[{i}]", v) for i, v in enumerate(node))
        else:
            continue
        if depth >= max_depth:
            raise SafeReadError(
                name, f"nested too deeply (more than {max_depth} levels)", where or "<document>"
            )
        for child_where, child in items:
            if isinstance(child, dict | list | _Bad):
                stack.append((child, _short(child_where), depth + 1))


def _short(where: str) -> str:
    """A field path as errors show it: keys come from the file, so long ones are cut."""
    return where if len(where) <= 120 else where[:117] + "..."


def parse_json(raw: bytes | str, *, source: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON document, or SafeReadError naming ``source`` and the field: bad syntax (with line and
    column), nesting deeper than ``max_depth``, an integer over MAX_INT_DIGITS digits, a float over
    MAX_FLOAT_CHARS characters, NaN, Infinity or an overflowing float."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SafeReadError(source, f"not UTF-8 text (at byte {exc.start})", "<document>") from None
    else:
        text = raw
    long_ints = _LONG_DIGITS.search(text) is not None
    try:
        # parse_int is a Python call per integer: only when a long run of digits is present.
        doc = json.loads(
            text,
            parse_float=_float,
            parse_constant=_constant,
            parse_int=_long_int if long_ints else None,  # None: json.loads' default, as if not passed
        )
    except RecursionError:
        raise SafeReadError(
            source, f"nested too deeply (more than {max_depth} levels)", "<document>"
        ) from None
    except json.JSONDecodeError as exc:
        raise NotJSONError(
            source,
            f"not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}; a half-written file?)",
            "<document>",
        ) from None
    except ValueError:  # int() over Python's digit limit inside a string-free token; never echo it
        raise SafeReadError(source, "a number out of range", "<document>") from None
    _check(doc, source, max_depth)
    return doc


def read_json(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    source: str | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    follow_symlinks: bool = False,
) -> Any:
    """read_bytes + parse_json: the document, or None when the file does not exist. A file whose
    document is JSON ``null`` raises SafeReadError: None means "no file", and a forged ``null``
    current.json or channel status was once taken for one that was never written."""
    name = source or display_name(path)
    raw = read_bytes(path, max_bytes, source=name, follow_symlinks=follow_symlinks)
    if raw is None:
        return None
    doc = parse_json(raw, source=name, max_depth=max_depth)
    if doc is None:
        raise SafeReadError(name, "a JSON null document", "<document>")
    return doc


def _refuse_constant(token: str) -> Any:
    raise ValueError("a non-finite number (NaN or Infinity)")


def _finite_float(token: str) -> float:
    v = _float_or_refusal(token)
    if isinstance(v, str):
        raise ValueError(v)  # noqa: TRY004 - a refused number, not a wrong type
    return v


def loads_record(line: str) -> Any:
    """One line of a JSON-lines file (shape samples, audit entries) whose caller validates every
    field itself and skips a bad line: the fast path of parse_json, no walk. A line with a run of
    more than MAX_INT_DIGITS digits, NaN, Infinity, an overflowing or overlong float, or nesting
    deep enough to exhaust the recursion limit raises ValueError (the line is skipped, never
    echoed). Nesting below that limit is the caller's type checks' business."""
    if _LONG_DIGITS.search(line) is not None:
        raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits")
    try:
        return json.loads(line, parse_float=_finite_float, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None
