"""ThresholdsError: the one error of the policy layer, in a module of its own so that the YAML
reader, the Thresholds model and the profile lookup (flyserve.thresholds_files) can all raise it
without importing each other.
"""

from __future__ import annotations

import re
from typing import Any

from flyserve.terminal.printable import printable

MAX_ERRORS_SHOWN = 5
"""A document with 10,000 unknown keys gets a message naming five, not a 10,000-line one."""

MAX_MESSAGE_CHARS = 1000

_NAME = re.compile(r"[A-Za-z_<>][A-Za-z0-9_.<>-]{0,47}", re.ASCII)
_PLACEHOLDER = re.compile(r"<[A-Za-z0-9_ .-]{1,46}>", re.ASCII)
"""flyserve's own placeholders (``<document>``, ``<unknown key of 12 chars>``): a strict charset, so
an ESC, a bidi override or rich markup between angle brackets is not one of them."""


def redact_field(name: object) -> str:
    """A field name as an error may show it: names that look like names (ASCII letters, digits,
    ``_.<>-``) and flyserve's ``<...>`` placeholders are shown; anything else (a line of a secrets
    file parsed as a key, a key carrying an escape sequence) only by its length."""
    s = str(name)
    if _NAME.fullmatch(s) or _PLACEHOLDER.fullmatch(s):
        return s
    return f"<key of {len(s)} chars>"


def describe_value(value: Any) -> str:
    """A short, redacted description of a rejected value: never more than a few characters of the
    input itself (a config file may be a symlink to a secrets file; error text lands in the audit log)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        # bit_length, not str(): str() of a 5000-digit int raises (Python's int_max_str_digits)
        return repr(value) if value.bit_length() <= 64 else "an integer of more than 20 digits"
    if isinstance(value, float):
        return repr(value) if len(repr(value)) <= 24 else "a float"
    if isinstance(value, str):
        return repr(value) if len(value) <= 12 else f"a string of {len(value)} chars"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"a mapping of {len(value)} keys"
    return f"a {type(value).__name__}"


class ThresholdsError(ValueError):
    """A thresholds document was rejected. Names every bad field and why.

    ``errors`` is a list of (field, reason) pairs; ``field`` and ``reason`` are the first.
    Raised before anything is applied, so the caller's running state is never half-changed.
    The message is bounded (five errors, 1000 characters): it goes to logs, audit lines and HTTP
    bodies, and must never carry a document's content.
    """

    def __init__(self, errors: list[tuple[str, str]], *, source: str | None = None) -> None:
        # reasons may quote a file or a request (a YAML problem, a path): escaped and bounded too
        errors = [(redact_field(f), printable(r, 300)) for f, r in (errors or [("<document>", "invalid")])]
        self.errors = errors[:MAX_ERRORS_SHOWN] + (
            [("<document>", f"and {len(errors) - MAX_ERRORS_SHOWN} more errors")]
            if len(errors) > MAX_ERRORS_SHOWN
            else []
        )
        self.source = None if source is None else printable(source, 300)
        self.field, self.reason = self.errors[0]
        where = f"{self.source}: " if self.source else ""
        detail = "; ".join(f"field '{f}': {r}" for f, r in self.errors)
        super().__init__(f"{where}{detail}"[:MAX_MESSAGE_CHARS])
