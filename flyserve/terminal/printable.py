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

Log lines are text bound for a terminal too (an operator's, a journal that one reads): the message
of a ``flyserve`` log record may carry a config key, a file's name or a rank report's words, so
``install_log_filter`` escapes the records of flyserve's loggers as ``printable`` does, once, when a
record is emitted (a logger whose level drops it never makes one).

This module imports nothing of flyserve (tests/unit/test_layout.py), so every command may use it,
arms included; rich only where a rich object is asked for.
"""

from __future__ import annotations

import logging
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


LOGGER = "flyserve"
"""The root of flyserve's loggers; vLLM's, uvicorn's and everyone else's records pass untouched."""
_LOGGERS = ("flyserve.control", "flyserve.sidecar", "flyserve.startup", "flyserve.telemetry", "flyserve.vllm")
"""The loggers flyserve's modules log to (tests/unit/test_log_lines_are_printable.py checks the list):
made here, so one imported after install_log_filter already has the filter."""
_DONE = "_flyserve_printable"


def _is_flyserve(name: str) -> bool:
    return name == LOGGER or name.startswith(LOGGER + ".")


class PrintableLogFilter(logging.Filter):
    """Makes a flyserve log record printable-safe: the message, its arguments merged in, becomes one
    line (``printable``: a newline in an argument would forge a log line) of at most LINE_LIMIT
    characters; a traceback and a stack keep their lines (``printable_block``). In place, so every
    handler after this one sees the escaped record, and once (a record marked done passes as is).
    Never drops a record; one whose arguments do not fit its format is left for the handler to
    report, as logging does."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _DONE, False) or not _is_flyserve(record.name):
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - any argument's __str__: the handler reports it, as logging does
            return True
        record.msg, record.args = printable(message, LINE_LIMIT), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = printable_block(record.exc_text)
        if record.stack_info:
            record.stack_info = printable_block(record.stack_info)
        setattr(record, _DONE, True)
        return True


LOG_FILTER = PrintableLogFilter()


def install_log_filter(*handlers: logging.Handler) -> None:
    """LOG_FILTER on flyserve's loggers and on ``handlers`` (those flyserve set up). Both: a logger's
    filter sees only the records logged to that very logger, not its children's, so it goes on
    ``flyserve`` and every ``flyserve.*`` logger made so far (escaped before any handler, a test's
    or a site's included); a handler's sees every record it writes, one of a logger made later too.
    Idempotent. Costs nothing per call of a logger whose level drops the record."""
    manager = logging.Logger.manager
    names = {LOGGER, *_LOGGERS, *(n for n in list(manager.loggerDict) if _is_flyserve(n))}
    for name in sorted(names):
        logging.getLogger(name).addFilter(LOG_FILTER)
    for handler in handlers:
        handler.addFilter(LOG_FILTER)
