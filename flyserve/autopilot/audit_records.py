"""The autopilot's audit records: the JSON shape of every trial event, built bounded (the parser
that reads them back strictly is audit_parse.py).

Each record is one line of the state directory's audit log (control's store writes it, with the
operators' changes), versioned (``"schema": 1``) and at most MAX_RECORD_BYTES, well under the
store's line bound, so the store never truncates one. Kinds:

* ``autopilot.trial.start``: the trial's id, the operator version it runs over, the fields the
  candidate moves, the trigger's figures, the blocks, the test's settings, the guardrails' limits and
  the trial's expected extra cost as a share of its plan (``expected_exploration_share``: null when
  the bound was off; absent in logs written before it);
* ``autopilot.trial.pair-summary``: up to PAIRS_PER_RECORD consecutive pairs (current, candidate:
  each block's measured kernel seconds per token), the sha256 of those pairs and a chain digest over
  every pair of the trial so far;
* ``autopilot.trial.decision``: verdict, reason, what decided (the test, a guardrail with its
  figure and limit, or the operator), the statistic (pairs, estimate, bounds), the chain digest of
  all the pairs it saw, the action (promote, rollback, await-approval) and the resulting version;
* ``autopilot.trial.approval``: an awaited promotion approved (by whom) or expired;
* ``autopilot.mode``: a mode change, pause, resume or the kill switch.

From these alone ``flyserve autopilot replay`` recomputes every decision (flyserve.autopilot.replay).
The parser refuses a bad record by field name: anything not of its type, NaN or infinite numbers,
integers out of range (a 5000-digit one included), lists or strings over their bounds, unknown or
missing keys; the audit log is a file anyone with the state directory's permissions can edit.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from flyserve.autopilot.sequential import Decision, SequentialConfig

SCHEMA = 1
PREFIX = "autopilot."
START = "autopilot.trial.start"
PAIRS = "autopilot.trial.pair-summary"
DECISION = "autopilot.trial.decision"
APPROVAL = "autopilot.trial.approval"
MODE = "autopilot.mode"
KINDS = (START, PAIRS, DECISION, APPROVAL, MODE)

MAX_RECORD_BYTES = 4096
"""One record's JSON at most (the store's line bound is 8192: a record is never truncated)."""
PAIRS_PER_RECORD = 48
"""Pairs per pair-summary record: 48 x 2 floats of at most 24 characters stay under the bound."""
MAX_TEXT = 200
MAX_INT = 1 << 53
MAX_TIME = 1e12
ZERO_CHAIN = "0" * 64
"""The chain digest before the first pair."""

# What decided (the ``source`` of a decision record).
BY_TEST = "test"
BY_GUARDRAIL = "guardrail"
BY_OPERATOR = "operator"
BY_PUBLISH = "publish"
"""The trial's start was not published (refused or conflicting): it never ran."""
SOURCES = (BY_TEST, BY_GUARDRAIL, BY_OPERATOR, BY_PUBLISH)

ACTIONS = ("promote", "rollback", "await-approval")
APPROVAL_ACTIONS = ("promote", "expired", "operator change")
VERDICTS = ("promote", "rollback", "inconclusive")
MODES = ("off", "advise", "trial", "auto")
MODE_REASONS = ("set", "pause", "resume", "kill")

# The guardrails (names in decision records; docs/autopilot.md, "Guardrails").
P99 = "step-time p99"
"""Read in older logs only: the step-time guardrail compared p99s before the ranks measured
blocks; it now compares mean step times (STEP_TIME)."""
STEP_TIME = "step time"
FALLBACK_RATE = "fallback rate"
ERROR_RATE = "error rate"
CIRCUIT_OPENED = "circuit opened"
SAMPLES_STOPPED = "samples stopped"
GUARDRAILS = (P99, FALLBACK_RATE, ERROR_RATE, CIRCUIT_OPENED, SAMPLES_STOPPED, STEP_TIME)
AT_LEAST = frozenset((CIRCUIT_OPENED, SAMPLES_STOPPED))
"""Guardrails breached when the figure reaches the limit; the others when it exceeds it."""


class AuditRecordError(ValueError):
    """A record refused; ``field`` names the field (dotted), ``reason`` says why (never its value)."""

    def __init__(self, name: str, reason: str) -> None:
        self.field, self.reason = name, reason
        super().__init__(f"field '{name}': {reason}")


# ---------------------------------------------------------------------------- digests


def pairs_digest(pairs: Sequence[tuple[float, float]]) -> str:
    """sha256 of the pairs as compact JSON (floats as Python writes them: they read back exactly)."""
    text = json.dumps([[a, b] for a, b in pairs], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def chain_digest(previous: str, digest: str) -> str:
    """The chain after one more pair-summary: sha256(previous chain + its digest). A dropped,
    reordered or edited pair-summary changes every chain after it."""
    return hashlib.sha256((previous + digest).encode()).hexdigest()


# ---------------------------------------------------------------------------- builders


def _bounded(record: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(record, sort_keys=True, allow_nan=False)
    if len(text.encode()) > MAX_RECORD_BYTES:
        raise ValueError(f"{record.get('kind')}: record of {len(text)} bytes over {MAX_RECORD_BYTES}")
    return record


def _num(v: float) -> float | None:
    return v if math.isfinite(v) else None


def statistic_of(d: Decision) -> dict[str, Any]:
    return {"pairs": d.pairs, "estimate": _num(d.estimate), "lower": _num(d.lower), "upper": _num(d.upper)}


def start_record(
    *,
    time: float,
    trial: str,
    mode: str,
    operator_version: int,
    seed: int,
    block_steps: int,
    blocks: int,
    changes: Mapping[str, tuple[Any, Any]],
    regret: float | None,
    priced_samples: int,
    saving: float | None,
    test: SequentialConfig,
    guard: Mapping[str, float],
    expected_exploration_share: float | None = None,
) -> dict[str, Any]:
    return _bounded(
        {
            "schema": SCHEMA,
            "kind": START,
            "time": time,
            "trial": trial,
            "mode": mode,
            "operator_version": operator_version,
            "seed": seed,
            "block_steps": block_steps,
            "blocks": blocks,
            "changes": {k: [a, b] for k, (a, b) in sorted(changes.items())},
            "regret": regret,
            "priced_samples": priced_samples,
            "saving": saving,
            "test": {f.name: getattr(test, f.name) for f in fields(test)},
            "guard": dict(guard),
            "expected_exploration_share": expected_exploration_share,
        }
    )


def pairs_record(
    *, time: float, trial: str, first: int, pairs: Sequence[tuple[float, float]], previous_chain: str
) -> dict[str, Any]:
    digest = pairs_digest(pairs)
    return _bounded(
        {
            "schema": SCHEMA,
            "kind": PAIRS,
            "time": time,
            "trial": trial,
            "first": first,
            "pairs": [[a, b] for a, b in pairs],
            "digest": digest,
            "chain": chain_digest(previous_chain, digest),
        }
    )


def decision_record(
    *,
    time: float,
    trial: str,
    verdict: str,
    reason: str,
    source: str,
    statistic: Decision,
    guardrail: tuple[str, float, float] | None,
    blocks: int,
    chain: str,
    action: str,
    result_version: int | None,
) -> dict[str, Any]:
    return _bounded(
        {
            "schema": SCHEMA,
            "kind": DECISION,
            "time": time,
            "trial": trial,
            "verdict": verdict,
            "reason": reason[:MAX_TEXT],
            "source": source,
            "statistic": statistic_of(statistic),
            "guardrail": None
            if guardrail is None
            else {"name": guardrail[0], "value": guardrail[1], "limit": guardrail[2]},
            "blocks": blocks,
            "chain": chain,
            "action": action,
            "result_version": result_version,
        }
    )


def approval_record(*, time: float, trial: str, actor: str, action: str) -> dict[str, Any]:
    shown = "".join(c if c.isascii() and c.isprintable() else "?" for c in actor)[:64]
    return _bounded(
        {"schema": SCHEMA, "kind": APPROVAL, "time": time, "trial": trial, "actor": shown, "action": action}
    )


def mode_record(*, time: float, mode_before: str, mode: str, paused: bool, reason: str) -> dict[str, Any]:
    return _bounded(
        {
            "schema": SCHEMA,
            "kind": MODE,
            "time": time,
            "mode_before": mode_before,
            "mode": mode,
            "paused": paused,
            "reason": reason,
        }
    )


GUARD_KEYS = (
    "min_block_samples",
    "max_empty_blocks",
    "block_timeout_s",
    "p99_ratio_limit",
    "fallback_rate_excess",
    "error_rate_excess",
)
