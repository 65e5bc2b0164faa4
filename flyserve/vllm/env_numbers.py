"""A number a rank or the API server reads from its environment, checked once at start-up.

An unset or empty variable gives the default; a value that does not parse, or parses outside the
allowed range, is refused with the variable's name, what it must be and what it held (cut to 40
characters), so that a typo in a launch script stops the process instead of serving on a guess.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def env_number(
    name: str, default: N, parse: Callable[[str], N], *, ok: Callable[[N], bool], expect: str
) -> N:
    """$name parsed by ``parse`` (int or float) and accepted by ``ok``, else ``default`` when unset.

    ``expect`` words the rule for the error ("an integer >= 1"): ``{name} must be {expect}``."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name} must be {expect}, got {raw[:40]!r}") from None
    if not ok(value):
        raise ValueError(f"{name} must be {expect}, got {value}")
    return value
