"""Reading a value from the sidecar's JSON by type, for `flyserve top`'s views.

What answers on the port may not be the sidecar: a string where a number belongs, a list where an
object belongs. Each read here takes what the view expects or stands in for it (an empty dict, an
empty list, None), so a view draws something for any payload instead of raising.
"""

from __future__ import annotations

from typing import Any


def as_dict(x: Any) -> dict[str, Any]:
    """``x`` when it is a JSON object, else an empty one."""
    return x if isinstance(x, dict) else {}


def as_list(x: Any) -> list[Any]:
    """``x`` when it is a JSON array, else an empty one."""
    return x if isinstance(x, list) else []


def real(x: Any) -> float | None:
    """A JSON number as a float (None for anything else, or an integer too big for one)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    try:
        return float(x)
    except OverflowError:
        return None


def fixed(x: Any, fmt: str) -> str:
    """A number in ``fmt``, or "?" when ``x`` is not one."""
    v = real(x)
    return "?" if v is None else format(v, fmt)
