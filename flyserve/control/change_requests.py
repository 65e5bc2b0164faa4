"""What a change request may hold (a mapping of known threshold names) and how its audit line
records it (known keys with their values, huge ones described, unknown ones counted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flyserve.policy.errors import describe_value
from flyserve.policy.thresholds import FIELDS, ThresholdsError, unknown_key_error


def as_request(body: Any) -> dict[str, Any]:
    """The request as the audit line records it: known keys with their values (huge ones described,
    not copied); unknown keys only counted - they may be content of a file that is not a config."""
    if not isinstance(body, Mapping):
        return {"body": describe_value(body)}
    out: dict[str, Any] = {}
    unknown = 0
    for k, v in body.items():
        if k not in FIELDS:
            unknown += 1
            if isinstance(k, str) and k.isidentifier() and k.islower() and len(k) <= 32:
                out[k] = describe_value(v)
            continue
        big = isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64
        out[k] = describe_value(v) if big or (isinstance(v, str) and len(v) > 256) else v
    if unknown:
        out["<unknown keys>"] = unknown
    return out


def check_mapping(m: Any) -> None:
    if not isinstance(m, Mapping):
        raise ThresholdsError(
            [("<document>", f"must be a mapping of threshold names to values, got {type(m).__name__}")],
            source="overrides",
        )


def check_keys(keys: Iterable[str], *, source: str) -> None:
    bad = [k for k in keys if k not in FIELDS]
    if bad:
        raise ThresholdsError([unknown_key_error(k) for k in bad], source=source)
