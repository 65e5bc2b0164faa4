"""Final-answer extractors: does a token-level divergence change the answer?

A divergence only matters to an evaluation when the extracted answer changes, so the
extractor is pluggable: `number` (gsm8k-style), `exact` (the whole text) or `regex:<pattern>`.
Each extractor also normalises the answer key the same way, so a gsm8k solution ("... #### 72")
and a bare "72" both work as `answer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

# A number as gsm8k writes them: optional minus and dollar, thousands commas, optional decimals.
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


class ExtractorError(ValueError):
    """A bad --extractor value; the message names the flag."""


def normalize_number(token: str) -> str | None:
    """'$1,234.50' -> '1234.5', '18.00' -> '18', '-0' -> '0'; None if it is not a number."""
    cleaned = token.replace("$", "").replace(",", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


@dataclass(frozen=True)
class NumberExtractor:
    """gsm8k: the first number after the first '####' (lm-eval's strict match) if there is one,
    else the last number in the text (lm-eval's flexible match)."""

    name: str = "number"

    def extract(self, text: str) -> str | None:
        marker = text.find("####")
        if marker >= 0:
            m = _NUMBER.search(text, marker + 4)
            if m:
                return normalize_number(m.group(0))
        found = _NUMBER.findall(text)
        return normalize_number(found[-1]) if found else None

    def normalize_answer(self, answer: str) -> str | None:
        return self.extract(answer)


@dataclass(frozen=True)
class ExactExtractor:
    """The whole completion, stripped of surrounding whitespace."""

    name: str = "exact"

    def extract(self, text: str) -> str | None:
        return text.strip()

    def normalize_answer(self, answer: str) -> str | None:
        return answer.strip()


@dataclass(frozen=True)
class RegexExtractor:
    """The last match of the pattern; its first capture group if it has one, else the whole match."""

    pattern: str
    compiled: re.Pattern[str] = field(compare=False, repr=False)  # re.compile(pattern): make_extractor()

    @property
    def name(self) -> str:
        return f"regex:{self.pattern}"

    def extract(self, text: str) -> str | None:
        last = None
        for last in self.compiled.finditer(text):
            pass
        if last is None:
            return None
        value = last.group(1) if self.compiled.groups else last.group(0)
        return value.strip() if value is not None else None

    def normalize_answer(self, answer: str) -> str | None:
        return answer.strip()


Extractor = NumberExtractor | ExactExtractor | RegexExtractor


def make_extractor(spec: str) -> Extractor:
    """Parse --extractor: 'number', 'exact' or 'regex:<pattern>'."""
    if spec == "number":
        return NumberExtractor()
    if spec == "exact":
        return ExactExtractor()
    if spec.startswith("regex:"):
        pattern = spec[len("regex:") :]
        if not pattern:
            raise ExtractorError("--extractor: regex:<pattern> needs a pattern")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ExtractorError(f"--extractor: invalid regular expression {pattern!r}: {exc}") from None
        return RegexExtractor(pattern=pattern, compiled=compiled)
    raise ExtractorError(f"--extractor: expected number, exact or regex:<pattern>, got {spec!r}")
