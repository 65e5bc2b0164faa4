"""The one sanitiser of text bound for a terminal.

Values that come from the network (the sidecar's stream and answers, an arm's server) or from files
that other processes can write (the state directory's versions, rank reports, audit log and history,
shape logs, cost tables, config files) end up on an operator's terminal. Printed raw, an ESC starts
a sequence the terminal obeys: OSC 52 writes the clipboard, CSI 2J clears the screen, OSC 0 sets the
window title, DCS talks to the terminal itself; the C1 bytes U+0080-U+009F do the same in one
character on some terminals; a bidi override (U+202E) or isolate (U+2066) reorders what follows, and
zero-width characters (U+200B) hide text in plain sight. And rich reads ``[red]`` as markup and
``[link=...]`` as a hyperlink, which it then writes as an OSC 8 sequence of its own.

Each such character (everything ``str.isprintable`` refuses: C0 and C1 controls, DEL, format
characters, line and paragraph separators, surrogates, private and unassigned code points) is
replaced by a visible escape (``\\x1b``, ``\\u202e``), never dropped, so an operator sees that
something was there. A field is cut at a bound (the cut says how much was left out), so one huge
value cannot fill the screen. The sequence's other characters (``]52;c;...``) are left as text:
without its ESC no terminal reads them as anything but text.

This module imports nothing of flyserve (tests/unit/test_layout.py), so every command may use it,
arms included; rich only where a rich object is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

FIELD_LIMIT = 256
"""Characters of one field once escaped: a path, a reason, an actor fits; a payload does not."""
LINE_LIMIT = 4096
"""Characters of one line of a block of text (a rendered report) once escaped."""


def _escape(c: str) -> str:
    n = ord(c)
    if n < 0x100:
        return f"\\x{n:02x}"
    if n < 0x10000:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"


def _bounded(text: str, limit: int | None) -> str:
    """``text`` with every unprintable character escaped, cut at ``limit`` output characters."""
    if text.isprintable() and (limit is None or len(text) <= limit):
        return text  # the common case: one C-level scan, no copy
    out: list[str] = []
    size = 0
    for i, c in enumerate(text):
        piece = c if c.isprintable() else _escape(c)
        if limit is not None and size + len(piece) > limit:
            return "".join(out) + f"...(+{len(text) - i} chars)"
        out.append(piece)
        size += len(piece)
    return "".join(out)


def printable(value: object, limit: int | None = FIELD_LIMIT) -> str:
    """One field, safe to print on one line: every control and format character (newlines and tabs
    included: a newline in a field forges a line of output) as a visible escape, and at most
    ``limit`` characters (None: no bound, for text that is bounded already)."""
    return _bounded(value if isinstance(value, str) else str(value), limit)


def printable_block(text: object, line_limit: int | None = LINE_LIMIT) -> str:
    """A block of lines (a rendered report), safe to print: newlines and tabs are kept, every other
    control and format character escaped, each line at most ``line_limit`` characters. For the
    output boundary of a plain-text command, over text that holds fields of others."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and line_limit is None:
        return s
    return "\n".join(
        "\t".join(_bounded(part, line_limit) for part in line.split("\t")) for line in s.split("\n")
    )


def printable_text(value: object, limit: int | None = FIELD_LIMIT, style: str | None = None) -> Text:
    """One field as a rich ``Text``: escaped as ``printable`` does, and never read as markup
    (``[red]``, ``[link=...]``) or emoji codes, which rich applies to plain strings only."""
    from rich.text import Text

    return Text(printable(value, limit), style=style or "")
