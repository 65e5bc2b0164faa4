"""Check a JSON request body before anything parses it for real: one place for every JSON endpoint.

Python's json module turns a 5000-digit integer into a ValueError (the int-to-str digit limit,
4300) and 5000-deep nesting into a RecursionError; FastAPI answered both with a 400 that named no
field. Here the body is parsed once with hooks that never raise on a long number
(they mark it), then walked without recursion: the first too-long number is refused naming its
field, too-deep nesting naming the body, and the value itself is never echoed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_NUMBER_CHARS = 64
"""A JSON number literal longer than this is refused ("number too long"): no threshold needs more
than 20 digits, and int() of 4301+ digits raises (Python's digit limit)."""
MAX_DEPTH = 32
"""Nesting deeper than this is refused ("nesting too deep"): bodies here are flat objects."""
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
"""A key that matches this (every field the API knows does) is named as is in an error."""
KEY_PLACEHOLDER = "<key>"
"""Stands for any other key in an error: the body is unauthenticated, so a key that is not a short
identifier is the sender's text (64 characters a level were echoed before), never repeated back."""


@dataclass(frozen=True, slots=True)
class BodyRefusal:
    """Why a body must not reach the app: HTTP status, a message, and the field it is about."""

    status: int
    detail: str
    field: str


class _TooLong:
    """Stands in for a number literal over MAX_NUMBER_CHARS (found by the walk, never echoed)."""

    __slots__ = ("chars",)

    def __init__(self, chars: int) -> None:
        self.chars = chars


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _int(text: str) -> int | _TooLong:
    return _TooLong(len(text)) if len(text) > MAX_NUMBER_CHARS else int(text)


def _float(text: str) -> float | _TooLong:
    return _TooLong(len(text)) if len(text) > MAX_NUMBER_CHARS else float(text)


def _name(key: str) -> str:
    """``key`` if it is a short identifier, else KEY_PLACEHOLDER."""
    return key if FIELD_NAME.fullmatch(key) else KEY_PLACEHOLDER


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path or '<body>'}[{part}]"
    return f"{path}.{_name(part)}" if path else _name(part)


def _walk(doc: Any) -> BodyRefusal | None:
    """The first too-long number (by field path) or nesting over MAX_DEPTH, iteratively."""
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, _TooLong):
            field = path or "<body>"
            return BodyRefusal(
                422,
                f"field '{field}': number too long ({node.chars} characters; at most {MAX_NUMBER_CHARS})",
                field,
            )
        if isinstance(node, dict | list):
            if depth >= MAX_DEPTH:
                return BodyRefusal(
                    400, f"request body: nesting too deep (more than {MAX_DEPTH} levels)", "<body>"
                )
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((v, _join(path, k), depth + 1) for k, v in reversed(list(items)))
    return None


def check_json_body(body: bytes) -> BodyRefusal | None:
    """A refusal for a body that must not reach the app, else None (an empty body passes).

    Not UTF-8 or not JSON: 400 naming the body (FastAPI answered 422 "field '0': JSON decode
    error"). A key twice in one object: 422 naming it (otherwise the last one would silently win).
    A number literal over MAX_NUMBER_CHARS: 422 naming its field. A key in either name that is not
    a short identifier (FIELD_NAME) is named KEY_PLACEHOLDER. Nesting over MAX_DEPTH (or deep
    enough to exhaust the parser's recursion): 400 naming the body."""
    if not body.strip():
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BodyRefusal(400, f"request body is not UTF-8 (byte {exc.start})", "<body>")
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_int, parse_float=_float)
    except _DuplicateKey as exc:
        key = _name(exc.key)
        return BodyRefusal(422, f"field '{key}': given more than once", key)
    except RecursionError:
        return BodyRefusal(400, f"request body: nesting too deep (more than {MAX_DEPTH} levels)", "<body>")
    except json.JSONDecodeError as exc:
        return BodyRefusal(
            400, f"request body is not valid JSON (line {exc.lineno}, column {exc.colno})", "<body>"
        )
    except ValueError:  # any other literal Python refuses: never echo it
        return BodyRefusal(400, "request body: a value cannot be parsed", "<body>")
    return _walk(doc)
