"""Thresholds: every number of the dispatch rules, as data.

In vLLM pull request 53335 these are module constants of the FlyDSL dualwave backend,
hand-measured on MI350X for one model; here an operator can change each of them while
serving (flyserve.control) and fit them to their own GPU (flyserve.lab.calibrate).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flyserve.policy.errors import ThresholdsError, describe_value
from flyserve.policy.safe_yaml import parse_mapping
from flyserve.terminal.printable import printable

__all__ = [
    "FIELDS",
    "START_ONLY_FIELDS",
    "Thresholds",
    "ThresholdsError",
    "unknown_key_error",
]

# Upper bounds: a threshold past these is a typo or an attack (2**70 was accepted for block_m).
MAX_TOKENS = 1 << 24  # 16M tokens of context: far beyond any model served today
MAX_ROWS = 1 << 20


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Thresholds(BaseModel):
    """The dispatch policy's knobs. Frozen; a change is a new object (and a new version).

    Defaults are the seed's gfx950 constants (MiniMax-M3, TP=4, MI350X, 16 query heads per rank).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True)

    block_m: int = Field(256, le=4096, description="q-block rows of the prefill kernel; a power of two.")
    min_qblock_rows: int = Field(
        48,
        le=MAX_ROWS,
        ge=0,
        description="Occupancy floor: num_heads * num_actual_tokens must reach min_qblock_rows * block_m. "
        "0 disables the check.",
    )
    min_seq_len: int = Field(
        1536,
        le=MAX_TOKENS,
        ge=0,
        description="Shortest max_seq_len the prefill path takes. 0 disables the check.",
    )
    max_seq_len: int = Field(
        131072,
        le=MAX_TOKENS,
        ge=0,
        description="Longest max_seq_len the prefill path takes. 0 means no upper limit.",
    )
    min_query_len: int = Field(
        2, le=MAX_TOKENS, ge=1, description="A batch whose max_query_len is below this has no prefill row."
    )
    decode_rows_base: int = Field(
        8,
        le=MAX_ROWS,
        ge=0,
        description="Decode rows allowed in a prefill batch per decode_ctx_unit of context.",
    )
    decode_ctx_unit: int = Field(
        8192, le=MAX_TOKENS, ge=1, description="Context length per step of the decode-row cap."
    )
    decode_query_len_max: int = Field(
        1,
        le=MAX_TOKENS,
        ge=1,
        description="Rows with query_len up to this are decode rows (raise for speculative decoding).",
    )
    lpt_qblocks_always: int = Field(
        96, le=MAX_ROWS, ge=0, description="LPT rule: this many q-blocks or more -> LPT."
    )
    lpt_qblocks_one_short: int = Field(
        48,
        le=MAX_ROWS,
        ge=0,
        description="LPT rule: exactly one short row and this many q-blocks or more -> LPT.",
    )
    lpt_min_short_rows: int = Field(
        8, le=MAX_ROWS, ge=0, description="LPT rule: at least this many short rows ..."
    )
    lpt_qblocks_many_short_max: int = Field(
        32, le=MAX_ROWS, ge=0, description="... and at most this many q-blocks -> LPT."
    )
    lpt: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: the LPT rule decides; always/never override it."
    )
    prefill_enabled: bool = Field(True, description="false sends every prefill batch to the unified path.")
    decode_path: Literal["unified", "prefill"] = Field(
        "unified",
        description="Where batches with no prefill row go. Fixed at server start (CUDA graphs are "
        "captured for exactly those batches); changing it takes a restart.",
    )

    @model_validator(mode="after")
    def _check_relations(self) -> Thresholds:
        errors: list[tuple[str, str]] = []
        if not _is_power_of_two(self.block_m):
            errors.append(("block_m", f"must be a positive power of two (got {self.block_m})"))
        if self.max_seq_len and self.min_seq_len > self.max_seq_len:
            errors.append(
                ("min_seq_len", f"must not exceed max_seq_len ({self.min_seq_len} > {self.max_seq_len})")
            )
        if self.min_query_len <= self.decode_query_len_max:
            errors.append(
                (
                    "min_query_len",
                    (
                        f"must exceed decode_query_len_max ({self.min_query_len} <= "
                        f"{self.decode_query_len_max}): a row is either a decode row or a prefill row"
                    ),
                )
            )
        if errors:
            # Raised as ValueError inside pydantic; unwrapped to ThresholdsError by parse().
            raise ValueError("|".join(f"{f}\x1f{r}" for f, r in errors))
        return self

    # ----------------------------------------------------------------- constructors

    @classmethod
    def parse(cls, data: Any, *, source: str | None = None) -> Thresholds:
        """Validate a mapping (from YAML, JSON or an HTTP body) in full; raise ThresholdsError.

        Missing keys take the defaults. Use ``base.merged(data)`` to lay keys over another object.
        """
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ThresholdsError(
                [
                    (
                        "<document>",
                        f"must be a mapping of threshold names to values, got {type(data).__name__}",
                    )
                ],
                source=source,
            )
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise ThresholdsError(_pydantic_errors(exc), source=source) from None

    def merged(self, changes: Mapping[str, Any], *, source: str | None = None) -> Thresholds:
        """These thresholds with ``changes`` laid over them, validated as a whole."""
        return type(self).parse({**self.model_dump(), **dict(changes)}, source=source)

    @classmethod
    def from_yaml_text(cls, text: str | bytes, *, source: str | None = None) -> Thresholds:
        """Parse a YAML document (text, or the bytes of a file someone else read: policy reads no
        file, flyserve.thresholds_files does). An empty document is an error: it is almost always a
        truncated write."""
        return cls.parse(parse_mapping(text, source=source), source=source)

    # ----------------------------------------------------------------- views

    def diff(self, other: Thresholds) -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's value)} for every field that differs."""
        a, b = self.model_dump(), other.model_dump()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def decode_row_cap(self, max_seq_len: int) -> int:
        """Decode rows a prefill batch may carry at this context length (grows with context)."""
        return self.decode_rows_base * max(1, max_seq_len // self.decode_ctx_unit)


FIELDS: tuple[str, ...] = tuple(Thresholds.model_fields)
START_ONLY_FIELDS: tuple[str, ...] = ("decode_path",)
"""The fields fixed at server start (the control plane refuses to change them while serving): live
advice prices them separately, marked "needs a restart", and never puts them in a PATCH."""


def _pydantic_errors(exc: ValidationError) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "invalid"))
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            out.append(unknown_key_error(loc))
        elif kind == "value_error" and "\x1f" in msg:
            body = msg.removeprefix("Value error, ")
            for part in body.split("|"):
                f, _, r = part.partition("\x1f")
                out.append((f, r))
        else:
            got = err.get("input")
            shown = f" (got {describe_value(got)})" if not isinstance(got, Mapping) else ""
            out.append((loc or "<document>", f"{msg}{shown}"))
    return out


_PLAIN_KEY = re.compile(r"[a-z_][a-z0-9_]{0,31}", re.ASCII)


def unknown_key_error(key: str) -> tuple[str, str]:
    """(field, reason) for a key that is not a threshold. The key is shown only when it is a likely
    typo of a known one (escaped and bounded: a typo may carry an ESC or a bidi override, and
    ThresholdsError names a field with one only by its length) or a plain one (_PLAIN_KEY); otherwise
    only its length: an unknown key may be a line of whatever file the config path points at (a
    symlink to a secrets file), and errors land in logs and the audit log. The match suggested is one
    of FIELDS, never text of the key."""
    import difflib

    raw = str(key)
    known = f"unknown key (known keys: {', '.join(FIELDS)})"
    close = difflib.get_close_matches(raw[:64], FIELDS, n=1, cutoff=0.75)
    if close:
        return (printable(raw, 64), f"unknown key (did you mean {close[0]!r}?)")
    if _PLAIN_KEY.fullmatch(raw):
        return (raw, known)
    return (f"<unknown key of {len(raw)} chars>", known)
