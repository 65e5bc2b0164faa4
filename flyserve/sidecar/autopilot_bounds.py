"""The knobs the operator opens to the autopilot, and how far: ``--autopilot-bounds FILE``.

A small YAML mapping, knob -> {min, max} (both ends included), read with the project's hardened
reader (thresholds_files.read_yaml_file: size-capped, no FIFO, safe loader). Every bad entry is
refused by field name before the sidecar starts. A knob with no bound is never moved (the trigger
refuses "out of bounds"); without a file the autopilot moves nothing and says so.

    min_seq_len: {min: 256, max: 8192}
    block_m: {min: 64, max: 512}
    prefill_enabled: {min: false, max: true}    # a switch: false..true lets it go either way
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from flyserve.autopilot.inputs import MAX_COUNT, KnobBound
from flyserve.policy.thresholds import START_ONLY_FIELDS, Thresholds, ThresholdsError
from flyserve.thresholds_files import read_yaml_file

MAX_BOUNDS = 64
"""Entries a bounds file may hold (there are a dozen integer knobs)."""
_ENDS = frozenset({"min", "max"})


class BoundsError(ValueError):
    """A bounds file or entry is unusable; ``field`` names it (``min_seq_len.max``)."""

    def __init__(self, field: str, reason: str, *, source: str = "") -> None:
        self.field, self.reason = field, reason
        where = f"{source}: " if source else ""
        super().__init__(f"{where}field '{field}': {reason}")


def integer_knobs() -> frozenset[str]:
    """The run-time integer thresholds a bound may open (start-only fields never)."""
    return _knobs_of(int)


def switch_knobs() -> frozenset[str]:
    """The run-time true/false thresholds a bound may open (prefill_enabled)."""
    return _knobs_of(bool)


def _knobs_of(kind: type) -> frozenset[str]:
    return frozenset(
        k for k, f in Thresholds.model_fields.items() if f.annotation is kind and k not in START_ONLY_FIELDS
    )


def _switch_end(knob: str, end: str, v: object, source: str) -> int:
    if not isinstance(v, bool):
        raise BoundsError(f"{knob}.{end}", f"must be true or false, got {type(v).__name__}", source=source)
    return int(v)


def _end(knob: str, end: str, v: object, source: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BoundsError(f"{knob}.{end}", f"must be an integer, got {type(v).__name__}", source=source)
    if not 0 <= v <= MAX_COUNT:
        raise BoundsError(f"{knob}.{end}", f"must be 0..{MAX_COUNT}", source=source)
    return v


def parse_bounds(data: object, *, source: str = "") -> Mapping[str, KnobBound]:
    """{knob: KnobBound} from a mapping; BoundsError naming the first bad field."""
    if not isinstance(data, Mapping):
        raise BoundsError("<file>", f"must be a mapping of knob -> {{min, max}}, got {type(data).__name__}")
    if len(data) > MAX_BOUNDS:
        raise BoundsError("<file>", f"at most {MAX_BOUNDS} knobs, got {len(data)}", source=source)
    knobs, switches = integer_knobs(), switch_knobs()
    out: dict[str, KnobBound] = {}
    for knob, spec in data.items():
        name = str(knob)[:64]
        if knob not in knobs and knob not in switches:
            raise BoundsError(name, "not a run-time threshold the autopilot may move", source=source)
        if not isinstance(spec, Mapping):
            raise BoundsError(name, "must be a mapping {min, max}", source=source)
        # each odd key classed by the key itself: its name alone (3 -> "3") would read as missing
        odd = sorted(
            [(str(k)[:32], "unknown key") for k in spec if k not in _ENDS]
            + [(k, "missing") for k in _ENDS if k not in spec]
        )
        if odd:
            raise BoundsError(f"{name}.{odd[0][0]}", odd[0][1], source=source)
        end = _switch_end if knob in switches else _end
        low, high = end(name, "min", spec["min"], source), end(name, "max", spec["max"], source)
        if high < low:
            least = str(spec["min"]).lower() if knob in switches else spec["min"]  # YAML's false, not False
            raise BoundsError(f"{name}.max", f"must be at least min ({least})", source=source)
        out[name] = KnobBound(low, high, boolean=knob in switches)
    return MappingProxyType(out)


def read_bounds(path: Path) -> Mapping[str, KnobBound]:
    """The bounds file at ``path``; BoundsError naming the file and field."""
    try:
        data = read_yaml_file(path)
    except ThresholdsError as exc:
        raise BoundsError(exc.field or "<file>", exc.reason, source=str(path)) from None
    return parse_bounds(data, source=str(path))
