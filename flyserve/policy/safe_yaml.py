"""A YAML reader for operator files that cannot be turned against the process reading it.

PyYAML's safe_load still expands aliases (a 500-byte "billion laughs" document grew the sidecar
past 6 GB), reads ``25:36`` as 1536 (YAML 1.1 sexagesimal), ``on``/``no`` as booleans,
and keeps the last of two duplicate keys silently. This loader:

* refuses anchors and aliases (a thresholds file has no use for them) and merge keys (``<<``);
* resolves plain scalars by the YAML 1.2 core schema: true/false, null/~, decimal, 0o/0x ints,
  floats; everything else (``25:36``, ``on``, ``2026-01-01``) stays a string;
* makes a duplicate key an error naming the key;
* caps document size (bytes), nesting depth and integer length (a 5000-digit integer is refused
  before Python's int() sees it).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, ScalarNode

from flyserve.policy.errors import ThresholdsError

MAX_DOCUMENT_BYTES = 1 << 20
"""1 MiB: a thresholds file is about 1 kB; the cap keeps a 90 MB file from being parsed at all."""
MAX_DEPTH = 32
MAX_INT_DIGITS = 24


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class SafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader without aliases, YAML 1.1 scalars, duplicate keys or unbounded nesting."""

    # Replaced below: YAML 1.2 core schema only. A class attribute, as in yaml.resolver.BaseResolver
    # (types-PyYAML declares it an instance attribute: mypy's "cannot override" is the stub's).
    yaml_implicit_resolvers: ClassVar[dict[Any, Any]] = {}  # type: ignore[misc]
    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused("anchors and aliases (&, *) are not allowed", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, MappingNode):
            raise ConstructorError(None, None, f"expected a mapping, found {node.id}", node.start_mark)
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _Refused("merge keys (<<) are not allowed", key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool) and key is not None:
                raise _Refused("keys must be scalars", key_node.start_mark)
            if key in out:
                raise _Refused(f"duplicate key {str(key)[:48]!r}", key_node.start_mark)
            out[key] = self.construct_object(value_node, deep=deep)
        return out

    def construct_yaml_int(self, node: ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        digits = text.lstrip("+-")
        if len(digits) > MAX_INT_DIGITS:
            raise _Refused(f"integer of {len(digits)} digits (at most {MAX_INT_DIGITS})", node.start_mark)
        sign = -1 if text.startswith("-") else 1
        if digits.startswith(("0x", "0X", "0o", "0O")):
            return sign * int(digits, 0)
        return sign * int(digits, 10)

    def construct_yaml_float(self, node: ScalarNode) -> float:
        text = str(self.construct_scalar(node)).lower()
        if len(text) > 64:
            raise _Refused(f"number of {len(text)} characters", node.start_mark)
        if text in (".inf", "+.inf"):
            return float("inf")
        if text == "-.inf":
            return float("-inf")
        if text == ".nan":
            return float("nan")
        return float(text)


SafeLoader.add_constructor("tag:yaml.org,2002:int", SafeLoader.construct_yaml_int)
SafeLoader.add_constructor("tag:yaml.org,2002:float", SafeLoader.construct_yaml_float)
# YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1023-core-schema), nothing else.
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+0123456789"),
)
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]
)


def load(text: str) -> Any:
    """Parse one YAML document with SafeLoader. Raises yaml.YAMLError (with problem_mark when known)."""
    loader = SafeLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise _Refused("nested too deeply") from None
    except (KeyError, ValueError, TypeError, OverflowError):
        # PyYAML's own constructors raise these (not YAMLError) on an explicit tag whose text is
        # not its type: `!!bool maybe` (KeyError), `!!int abc`, `!!float abc` (ValueError).
        raise _Refused("a tagged value that is not of its tag's type (!!bool, !!int, !!float)") from None
    finally:
        loader.dispose()


def parse_scalar(raw: str) -> Any:
    """One command-line value (``KEY=VALUE``) as the config file would read it; text that is not a
    plain YAML scalar stays a string."""
    if len(raw) > 4096:
        raise ThresholdsError([("<value>", f"a value of {len(raw)} characters (at most 4096)")])
    try:
        value = load(raw)
    except _Refused as exc:
        raise ThresholdsError([("<value>", exc.problem)]) from None
    except yaml.YAMLError:
        return raw
    return value if isinstance(value, str | int | float | bool) or value is None else raw


def parse_mapping(text: str | bytes, *, source: str | None = None) -> dict[str, Any]:
    """YAML text -> mapping of string keys, with errors that say where (never what the text says).
    Empty documents are refused: an empty file is almost always a truncated write."""
    if len(text) > MAX_DOCUMENT_BYTES:
        raise ThresholdsError(
            [("<document>", f"larger than {MAX_DOCUMENT_BYTES} bytes ({len(text)})")], source=source
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ThresholdsError([("<document>", f"not UTF-8 text: {exc.reason}")], source=source) from None
    try:
        data = load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ThresholdsError([("<document>", f"malformed YAML{where}: {problem}")], source=source) from None
    if data is None:
        raise ThresholdsError([("<document>", "empty document (a truncated write?)")], source=source)
    if not isinstance(data, dict):
        raise ThresholdsError(
            [("<document>", f"must be a mapping of threshold names to values, got {type(data).__name__}")],
            source=source,
        )
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ThresholdsError([(str(bad[0]), "keys must be strings")], source=source)
    return data
