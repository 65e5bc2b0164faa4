"""The autopilot's audit records read back: each kind as a frozen value, and ``parse_record``,
which refuses a bad record by field name (audit_records.py builds them and says what each holds).

Anything not of its type, NaN or infinite numbers, integers out of range (a 5000-digit one
included), lists or strings over their bounds, unknown or missing keys: the audit log is a file
anyone with the state directory's permissions can edit, and replay reads it as such.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from flyserve.autopilot.audit_records import (
    ACTIONS,
    APPROVAL,
    APPROVAL_ACTIONS,
    AT_LEAST,
    DECISION,
    GUARD_KEYS,
    GUARDRAILS,
    KINDS,
    MAX_INT,
    MAX_TEXT,
    MAX_TIME,
    MODE,
    MODE_REASONS,
    MODES,
    PAIRS,
    PAIRS_PER_RECORD,
    SCHEMA,
    SOURCES,
    START,
    VERDICTS,
    AuditRecordError,
)
from flyserve.autopilot.sequential import SequentialConfig, SequentialConfigError
from flyserve.autopilot.switchback import SwitchbackPlanError, check_trial_id
from flyserve.policy.thresholds import FIELDS

_DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)
_TEXT = re.compile(r"[\x20-\x7e]*", re.ASCII)


@dataclass(frozen=True)
class StartRecord:
    time: float
    trial: str
    mode: str
    operator_version: int
    seed: int
    block_steps: int
    blocks: int
    changes: Mapping[str, tuple[Any, Any]]
    regret: float | None
    priced_samples: int
    saving: float | None
    test: SequentialConfig
    guard: Mapping[str, float]
    expected_exploration_share: float | None = None
    """The trial's expected extra cost over its plan's attention time (None: not measured, or a log
    written before the record carried it)."""


@dataclass(frozen=True)
class PairsRecord:
    time: float
    trial: str
    first: int
    pairs: tuple[tuple[float, float], ...]
    digest: str
    chain: str


@dataclass(frozen=True)
class Statistic:
    pairs: int
    estimate: float | None
    lower: float | None
    upper: float | None


@dataclass(frozen=True)
class Guardrail:
    name: str
    value: float
    limit: float

    @property
    def breached(self) -> bool:
        return self.value >= self.limit if self.name in AT_LEAST else self.value > self.limit


@dataclass(frozen=True)
class DecisionRecord:
    time: float
    trial: str
    verdict: str
    reason: str
    source: str
    statistic: Statistic
    guardrail: Guardrail | None
    blocks: int
    chain: str
    action: str
    result_version: int | None


@dataclass(frozen=True)
class ApprovalRecord:
    time: float
    trial: str
    actor: str
    action: str


@dataclass(frozen=True)
class ModeRecord:
    time: float
    mode_before: str
    mode: str
    paused: bool
    reason: str


AuditRecord = StartRecord | PairsRecord | DecisionRecord | ApprovalRecord | ModeRecord

# ---------------------------------------------------------------------------- parser

_KEYS: dict[str, frozenset[str]] = {
    START: frozenset(
        (
            "operator_version",
            "mode",
            "seed",
            "block_steps",
            "blocks",
            "changes",
            "regret",
            "priced_samples",
            "saving",
            "test",
            "guard",
        )
    ),
    PAIRS: frozenset(("first", "pairs", "digest", "chain")),
    DECISION: frozenset(
        (
            "verdict",
            "reason",
            "source",
            "statistic",
            "guardrail",
            "blocks",
            "chain",
            "action",
            "result_version",
        )
    ),
    APPROVAL: frozenset(("actor", "action")),
    MODE: frozenset(("mode_before", "mode", "paused", "reason")),
}
_COMMON = frozenset(("schema", "kind", "time"))
_OPTIONAL: dict[str, frozenset[str]] = {START: frozenset(("expected_exploration_share",))}
"""Keys a record may lack: added after logs were written without them."""


def _int(name: str, v: object, lo: int = 0, hi: int = MAX_INT) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise AuditRecordError(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise AuditRecordError(name, f"must be {lo}..{hi}")
    return v


def _float(name: str, v: object, lo: float = -1e300, hi: float = 1e300) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise AuditRecordError(name, f"must be a number, got {type(v).__name__}")
    if isinstance(v, int) and abs(v) > MAX_INT:
        raise AuditRecordError(name, "integer too large")
    f = float(v)
    if not (math.isfinite(f) and lo <= f <= hi):
        raise AuditRecordError(name, f"must be a finite number in [{lo:g}, {hi:g}]")
    return f


def _opt_float(name: str, v: object, lo: float = -1e300, hi: float = 1e300) -> float | None:
    return None if v is None else _float(name, v, lo, hi)


def _text(name: str, v: object, max_len: int = MAX_TEXT) -> str:
    if not isinstance(v, str):
        raise AuditRecordError(name, f"must be a string, got {type(v).__name__}")
    if len(v) > max_len or not _TEXT.fullmatch(v):
        raise AuditRecordError(name, f"must be at most {max_len} printable ASCII characters")
    return v


def _choice(name: str, v: object, allowed: Sequence[str]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise AuditRecordError(name, "must be one of " + ", ".join(allowed))
    return v


def _digest(name: str, v: object) -> str:
    if not isinstance(v, str) or not _DIGEST.fullmatch(v):
        raise AuditRecordError(name, "must be 64 lowercase hex digits")
    return v


def _mapping(name: str, v: object, max_len: int) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise AuditRecordError(name, f"must be an object, got {type(v).__name__}")
    if len(v) > max_len:
        raise AuditRecordError(name, f"more than {max_len} entries")
    return v


def _keys(
    name: str, d: Mapping[str, Any], allowed: frozenset[str], optional: frozenset[str] = frozenset()
) -> None:
    unknown = sorted(str(k)[:40] for k in d if k not in allowed and k not in optional)
    if unknown:
        raise AuditRecordError(f"{name}{unknown[0]}", "unknown key")
    missing = sorted(k for k in allowed if k not in d)
    if missing:
        raise AuditRecordError(f"{name}{missing[0]}", "missing")


def _threshold_value(name: str, v: object) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return _int(name, v, 0, MAX_INT)
    if isinstance(v, str):
        return _text(name, v, 32)
    raise AuditRecordError(name, f"must be an integer, a string or a boolean, got {type(v).__name__}")


def _parse_start(d: Mapping[str, Any], time: float, trial: str) -> StartRecord:
    changes_raw = _mapping("changes", d["changes"], len(FIELDS))
    changes: dict[str, tuple[Any, Any]] = {}
    for k, v in changes_raw.items():
        if k not in FIELDS:
            raise AuditRecordError(f"changes.{str(k)[:40]}", "not a threshold")
        if not isinstance(v, list) or len(v) != 2:
            raise AuditRecordError(f"changes.{k}", "must be [before, after]")
        changes[k] = (_threshold_value(f"changes.{k}", v[0]), _threshold_value(f"changes.{k}", v[1]))
    test_raw = _mapping("test", d["test"], 16)
    test_names = frozenset(f.name for f in fields(SequentialConfig))
    _keys("test.", test_raw, test_names)
    for k, v in test_raw.items():  # a 5000-digit integer would reach SequentialConfig's checks
        if isinstance(v, bool):
            continue
        _float(f"test.{k}", v)
    try:
        test = SequentialConfig(**dict(test_raw))
    except SequentialConfigError as exc:
        raise AuditRecordError(f"test.{exc.field}", str(exc).split(": ", 1)[-1]) from None
    guard_raw = _mapping("guard", d["guard"], len(GUARD_KEYS))
    _keys("guard.", guard_raw, frozenset(GUARD_KEYS))
    guard = {k: _float(f"guard.{k}", guard_raw[k], 0.0, 1e9) for k in GUARD_KEYS}
    return StartRecord(
        time=time,
        trial=trial,
        mode=_choice("mode", d["mode"], ("trial", "auto")),
        operator_version=_int("operator_version", d["operator_version"]),
        seed=_int("seed", d["seed"], 0, (1 << 63) - 1),
        block_steps=_int("block_steps", d["block_steps"], 1, 1 << 20),
        blocks=_int("blocks", d["blocks"], 2, 200_000),
        changes=changes,
        regret=_opt_float("regret", d["regret"]),
        priced_samples=_int("priced_samples", d["priced_samples"]),
        saving=_opt_float("saving", d["saving"]),
        test=test,
        guard=guard,
        expected_exploration_share=_opt_float(
            "expected_exploration_share", d.get("expected_exploration_share"), 0.0, 1.0
        ),
    )


def _parse_pairs(d: Mapping[str, Any], time: float, trial: str) -> PairsRecord:
    raw = d["pairs"]
    if not isinstance(raw, list):
        raise AuditRecordError("pairs", f"must be a list, got {type(raw).__name__}")
    if not 1 <= len(raw) <= PAIRS_PER_RECORD:
        raise AuditRecordError("pairs", f"must hold 1..{PAIRS_PER_RECORD} pairs")
    pairs: list[tuple[float, float]] = []
    for i, p in enumerate(raw):
        if not isinstance(p, list) or len(p) != 2:
            raise AuditRecordError(f"pairs.{i}", "must be [current, candidate]")
        pairs.append((_float(f"pairs.{i}.0", p[0], 1e-300, 1e9), _float(f"pairs.{i}.1", p[1], 1e-300, 1e9)))
    return PairsRecord(
        time=time,
        trial=trial,
        first=_int("first", d["first"], 0, 100_000),
        pairs=tuple(pairs),
        digest=_digest("digest", d["digest"]),
        chain=_digest("chain", d["chain"]),
    )


def _parse_decision(d: Mapping[str, Any], time: float, trial: str) -> DecisionRecord:
    st = _mapping("statistic", d["statistic"], 4)
    _keys("statistic.", st, frozenset(("pairs", "estimate", "lower", "upper")))
    statistic = Statistic(
        pairs=_int("statistic.pairs", st["pairs"], 0, 100_000),
        estimate=_opt_float("statistic.estimate", st["estimate"]),
        lower=_opt_float("statistic.lower", st["lower"]),
        upper=_opt_float("statistic.upper", st["upper"]),
    )
    guardrail = None
    if d["guardrail"] is not None:
        g = _mapping("guardrail", d["guardrail"], 3)
        _keys("guardrail.", g, frozenset(("name", "value", "limit")))
        guardrail = Guardrail(
            name=_choice("guardrail.name", g["name"], GUARDRAILS),
            value=_float("guardrail.value", g["value"]),
            limit=_float("guardrail.limit", g["limit"]),
        )
    rv = d["result_version"]
    return DecisionRecord(
        time=time,
        trial=trial,
        verdict=_choice("verdict", d["verdict"], VERDICTS),
        reason=_text("reason", d["reason"]),
        source=_choice("source", d["source"], SOURCES),
        statistic=statistic,
        guardrail=guardrail,
        blocks=_int("blocks", d["blocks"], 0, 200_000),
        chain=_digest("chain", d["chain"]),
        action=_choice("action", d["action"], ACTIONS),
        result_version=None if rv is None else _int("result_version", rv),
    )


def parse_record(obj: object) -> AuditRecord:
    """The typed record, or AuditRecordError naming the first bad field."""
    if not isinstance(obj, Mapping):
        raise AuditRecordError("<record>", f"must be an object, got {type(obj).__name__}")
    if len(obj) > 32:
        raise AuditRecordError("<record>", "more than 32 keys")
    kind = _choice("kind", obj.get("kind"), KINDS)
    schema = obj.get("schema")
    if isinstance(schema, bool) or schema != SCHEMA:
        raise AuditRecordError("schema", f"must be {SCHEMA}")
    trial_keys = frozenset() if kind == MODE else frozenset(("trial",))
    _keys("", obj, _COMMON | trial_keys | _KEYS[kind], _OPTIONAL.get(kind, frozenset()))
    time = _float("time", obj["time"], 0.0, MAX_TIME)
    if kind == MODE:
        return ModeRecord(
            time=time,
            mode_before=_choice("mode_before", obj["mode_before"], MODES),
            mode=_choice("mode", obj["mode"], MODES),
            paused=_bool("paused", obj["paused"]),
            reason=_choice("reason", obj["reason"], MODE_REASONS),
        )
    try:
        trial = check_trial_id(obj["trial"])
    except SwitchbackPlanError as exc:
        raise AuditRecordError("trial", exc.reason) from None
    if kind == START:
        return _parse_start(obj, time, trial)
    if kind == PAIRS:
        return _parse_pairs(obj, time, trial)
    if kind == DECISION:
        return _parse_decision(obj, time, trial)
    return ApprovalRecord(
        time=time,
        trial=trial,
        actor=_text("actor", obj["actor"], 64),
        action=_choice("action", obj["action"], APPROVAL_ACTIONS),
    )


def _bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise AuditRecordError(name, f"must be true or false, got {type(v).__name__}")
    return v
