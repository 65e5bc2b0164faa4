"""Server-sent events from bytes, in bounded memory, for `flyserve top`.

httpx's ``iter_lines`` keeps a line until its newline comes: a server that never sends one grew the
reader by 150 MB a second until the machine gave out. Here a line longer than ``max_line`` bytes is
dropped as it grows (the reader skips to the next newline and carries on from there), and an event
whose data lines add up past ``max_event`` characters is dropped whole; both are counted, so the
view can say that something was thrown away.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

MAX_LINE_BYTES = 8 << 20
"""One SSE line: the sidecar writes a payload on one ``data:`` line, tens of kB for 64 ranks."""
MAX_EVENT_CHARS = 8 << 20
"""One event's data lines together."""


@dataclass
class Dropped:
    """What the reader threw away: lines over the line bound, events over the event bound (an event
    that held a dropped line is dropped too, counted once, as its line)."""

    lines: int = 0
    events: int = 0


def iter_lines(
    chunks: Iterable[bytes], *, dropped: Dropped, max_line: int = MAX_LINE_BYTES
) -> Iterator[str | None]:
    """The text lines of ``chunks`` (``\\n``, ``\\r\\n`` or ``\\r`` ends one); ``None`` in place
    of each line over ``max_line`` bytes, which is never held whole: its bytes are let go as they
    come, up to the next newline."""
    buf = bytearray()
    skipping = False
    for chunk in chunks:
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                if not skipping:
                    if len(buf) + len(chunk) - start > max_line:
                        buf.clear()
                        skipping = True
                        dropped.lines += 1
                        yield None
                    else:
                        buf += chunk[start:]
                break
            if skipping:
                skipping = False  # the long line ends here: the next one is read again
            elif len(buf) + nl - start > max_line:
                dropped.lines += 1
                yield None
            else:
                buf += chunk[start:nl]
                yield from _split_cr(buf)
            buf.clear()
            start = nl + 1
    if buf and not skipping:
        yield from _split_cr(buf)


def _split_cr(line: bytearray) -> Iterator[str]:
    text = line.decode("utf-8", errors="replace").removesuffix("\r")
    yield from text.split("\r") if "\r" in text else (text,)


def iter_sse_data(
    lines: Iterable[str | None], *, dropped: Dropped | None = None, max_event: int = MAX_EVENT_CHARS
) -> Iterator[str]:
    """The ``data`` of each server-sent event of ``lines`` (text lines; ``None``: a line that was
    dropped, which spoils the event it was in)."""
    dropped = dropped if dropped is not None else Dropped()
    data: list[str] = []
    size = 0
    spoiled = False
    for line in lines:
        if line is None:
            spoiled, data, size = True, [], 0
        elif line == "":
            if data and not spoiled:
                yield "\n".join(data)
            data, size, spoiled = [], 0, False
        elif spoiled:
            continue
        elif line.startswith("data:"):
            value = line[5:].lstrip(" ")
            size += len(value) + 1
            if size > max_event:
                dropped.events += 1
                spoiled, data, size = True, [], 0
            else:
                data.append(value)
