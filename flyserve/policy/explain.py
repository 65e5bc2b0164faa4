"""Why a batch went where: decide()'s rules one by one, each with its threshold, the batch's value
and the verdict (``flyserve explain``).

This is a second, table-shaped statement of the rules in flyserve.policy.rules, written out
independently rather than instrumenting decide() (which must stay a straight line of compares on
the hot path). Every rule is evaluated, also after the first that fails, so an operator sees how
far the batch is from each threshold; the path and reason come from the first failing rule.
tests/unit/test_policy_explain.py checks on 10,000 random shapes and thresholds that the two
statements agree, so an edit to one that is not made to the other fails there.

Not covered here, as in decide(): what the vLLM routing adds on top (``unsupported`` for a layer
group the prefill kernel cannot run, ``circuit_open`` after the prefill path raised, the prefill
kernel's own KV limit): see flyserve.vllm.routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flyserve.policy.shape import BatchShape
from flyserve.policy.thresholds import Thresholds
from flyserve.policy.vocabulary import (
    ADMITTED,
    CONTEXT_TOO_LONG,
    DISABLED,
    LOW_OCCUPANCY,
    NO_PREFILL_ROWS,
    NOT_CAUSAL,
    PREFILL,
    SHORT_CONTEXT,
    TOO_MANY_DECODE_ROWS,
    UNIFIED,
)


@dataclass(frozen=True, slots=True)
class RuleCheck:
    """One rule: what it compares (``threshold``, ``value``), whether the batch passed, and whether
    decide() reached it (it stops at the first failure)."""

    rule: str
    reason: str
    threshold: str
    value: str
    passed: bool
    reached: bool

    @property
    def verdict(self) -> str:
        if not self.passed:
            return f"FAIL -> {self.reason}" if self.reached else "fail (not reached)"
        return "pass" if self.reached else "pass (not reached)"

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "reason_if_failed": self.reason,
            "threshold": self.threshold,
            "value": self.value,
            "passed": self.passed,
            "reached": self.reached,
            "verdict": self.verdict,
        }


@dataclass(frozen=True, slots=True)
class Explanation:
    """The rules in order, and what they add up to: path, reason, LPT ordering."""

    checks: tuple[RuleCheck, ...]
    path: str
    reason: str
    lpt: bool | None
    lpt_detail: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "rules": [c.to_json() for c in self.checks],
            "path": self.path,
            "reason": self.reason,
            "lpt": self.lpt,
            "lpt_detail": self.lpt_detail,
        }


# (rule name, reason when it fails, threshold text, value text, passes?) per rule, in decide()'s order.
_Rule = tuple[
    str,
    str,
    Callable[[Thresholds], str],
    Callable[[BatchShape, Thresholds], str],
    Callable[[BatchShape, Thresholds], bool],
]


def _cap(s: BatchShape, t: Thresholds) -> int:
    units = s.max_seq_len // t.decode_ctx_unit
    return t.decode_rows_base * max(1, units)


RULES: tuple[_Rule, ...] = (
    (
        "has a prefill row",
        NO_PREFILL_ROWS,
        lambda t: f"min_query_len = {t.min_query_len}",
        lambda s, t: f"max_query_len = {s.max_query_len}",
        lambda s, t: s.max_query_len >= t.min_query_len,
    ),
    (
        "prefill path enabled",
        DISABLED,
        lambda t: f"prefill_enabled = {str(t.prefill_enabled).lower()}",
        lambda s, t: "-",
        lambda s, t: t.prefill_enabled,
    ),
    (
        "causal attention",
        NOT_CAUSAL,
        lambda t: "causal only",
        lambda s, t: f"causal = {str(s.causal).lower()}",
        lambda s, t: s.causal,
    ),
    (
        "context at most max_seq_len",
        CONTEXT_TOO_LONG,
        lambda t: f"max_seq_len = {t.max_seq_len}" + (" (0: no limit)" if t.max_seq_len == 0 else ""),
        lambda s, t: f"max_seq_len = {s.max_seq_len}",
        lambda s, t: t.max_seq_len == 0 or s.max_seq_len <= t.max_seq_len,
    ),
    (
        "context at least min_seq_len",
        SHORT_CONTEXT,
        lambda t: f"min_seq_len = {t.min_seq_len}",
        lambda s, t: f"max_seq_len = {s.max_seq_len}",
        lambda s, t: s.max_seq_len >= t.min_seq_len,
    ),
    (
        "enough q-blocks (occupancy)",
        LOW_OCCUPANCY,
        lambda t: (
            f"min_qblock_rows * block_m = {t.min_qblock_rows} * {t.block_m} = {t.min_qblock_rows * t.block_m}"
        ),
        lambda s, t: (
            f"num_heads * tokens = {s.num_heads} * {s.num_actual_tokens} = {s.num_heads * s.num_actual_tokens}"
        ),
        lambda s, t: s.num_heads * s.num_actual_tokens >= t.min_qblock_rows * t.block_m,
    ),
    (
        "decode rows within the cap",
        TOO_MANY_DECODE_ROWS,
        lambda t: f"decode_rows_base {t.decode_rows_base} per decode_ctx_unit {t.decode_ctx_unit} of ctx",
        lambda s, t: f"{s.num_decode_rows} decode rows (cap {_cap(s, t)} at ctx {s.max_seq_len})",
        lambda s, t: s.num_decode_rows <= _cap(s, t),
    ),
)


def explain_lpt(shape: BatchShape, t: Thresholds) -> tuple[bool, str]:
    """The LPT ordering of a prefill-path batch, and which clause decided it."""
    if t.lpt != "auto":
        return t.lpt == "always", f"lpt = {t.lpt} (forced)"
    qb = -(-shape.max_query_len // t.block_m)
    short = shape.num_short_query_rows
    clauses = (
        (short == 0, "no short rows"),
        (qb >= t.lpt_qblocks_always, f"q-blocks {qb} >= lpt_qblocks_always {t.lpt_qblocks_always}"),
        (
            short == 1 and qb >= t.lpt_qblocks_one_short,
            f"one short row and q-blocks {qb} >= lpt_qblocks_one_short {t.lpt_qblocks_one_short}",
        ),
        (
            short >= t.lpt_min_short_rows and qb <= t.lpt_qblocks_many_short_max,
            (
                f"{short} short rows >= lpt_min_short_rows {t.lpt_min_short_rows} and q-blocks {qb} <= "
                f"lpt_qblocks_many_short_max {t.lpt_qblocks_many_short_max}"
            ),
        ),
    )
    for ok, why in clauses:
        if ok:
            return True, f"LPT: {why}"
    return False, f"plain: no LPT clause holds ({short} short rows of < block_m {t.block_m}, {qb} q-blocks)"


def explain(shape: BatchShape, t: Thresholds) -> Explanation:
    """Every rule with its verdict; the path and reason are the first failing rule's (or admitted).
    A batch without a prefill row takes ``decode_path`` (fixed at start), ordered by the LPT rule
    when that is the prefill path."""
    results = [
        (name, reason, thr(t), val(shape, t), bool(ok(shape, t))) for name, reason, thr, val, ok in RULES
    ]
    first_fail = next((i for i, r in enumerate(results) if not r[4]), None)
    checks = tuple(
        RuleCheck(name, reason, thr, val, passed, first_fail is None or i <= first_fail)
        for i, (name, reason, thr, val, passed) in enumerate(results)
    )
    if first_fail is None:
        lpt, detail = explain_lpt(shape, t)
        return Explanation(checks, PREFILL, ADMITTED, lpt, detail)
    reason = results[first_fail][1]
    if reason == NO_PREFILL_ROWS and t.decode_path == PREFILL:
        lpt, detail = explain_lpt(shape, t)
        return Explanation(checks, PREFILL, reason, lpt, f"decode_path = prefill; {detail}")
    note = "decode_path = unified" if reason == NO_PREFILL_ROWS else None
    return Explanation(checks, UNIFIED, reason, None, note)
