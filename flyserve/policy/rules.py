"""decide(shape, thresholds): the dispatch rules of vLLM PR 53335, every number from Thresholds.

A pure function: the same (shape, thresholds) gives the same Decision on every rank, so ranks
that share a thresholds version never disagree on a step. Decisions are interned (there are
only a few dozen distinct ones), so deciding allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyserve.policy.shape import BatchShape
from flyserve.policy.thresholds import Thresholds
from flyserve.policy.vocabulary import (
    ADMITTED,
    CONTEXT_TOO_LONG,
    DISABLED,
    LOW_OCCUPANCY,
    NO_PREFILL_ROWS,
    NOT_CAUSAL,
    PATHS,
    PREFILL,
    REASONS,
    SHORT_CONTEXT,
    TOO_MANY_DECODE_ROWS,
    UNIFIED,
    VARIANT,
)


@dataclass(frozen=True, slots=True)
class Decision:
    """Which path runs the batch (``path``), why (``reason``), and with LPT ordering or not.

    ``lpt`` is a bool when the path is prefill, else None. ``variant`` is the child index of a
    vLLM composite backend (0 unified, 1 prefill).
    """

    path: str
    reason: str
    lpt: bool | None
    variant: int

    @property
    def ordering(self) -> str:
        """'lpt', 'plain', or 'none' (unified path): a ready label value."""
        return "none" if self.lpt is None else ("lpt" if self.lpt else "plain")


_INTERNED: dict[tuple[str, str, bool | None], Decision] = {}
for _p in PATHS:
    for _r in REASONS:
        for _l in ((True, False) if _p == PREFILL else (None,)):
            _INTERNED[(_p, _r, _l)] = Decision(_p, _r, _l, VARIANT[_p])


def decision_for(path: str, reason: str, lpt: bool | None = None) -> Decision:
    """The interned Decision for (path, reason, lpt). Raises KeyError on an unknown combination."""
    if path == PREFILL and lpt is None:
        lpt = False
    return _INTERNED[(path, reason, lpt if path == PREFILL else None)]


class ShortRowsNotCounted(LookupError):
    """lpt_rule was given a shape whose short-row count was left uncounted (-1, by
    BatchShape.from_step): count it (``shape.with_short_rows``) and decide again."""


def lpt_rule(shape: BatchShape, t: Thresholds) -> bool:
    """The seed's causal q-block LPT ordering rule (overridden by ``t.lpt`` always/never)."""
    if t.lpt != "auto":
        return t.lpt == "always"
    short = shape.num_short_query_rows
    if short < 0:
        raise ShortRowsNotCounted("num_short_query_rows was not counted")
    qb = -(-shape.max_query_len // t.block_m)
    return (
        short == 0
        or qb >= t.lpt_qblocks_always
        or (short == 1 and qb >= t.lpt_qblocks_one_short)
        or (short >= t.lpt_min_short_rows and qb <= t.lpt_qblocks_many_short_max)
    )


def _fallback(reason: str) -> Decision:
    return _INTERNED[(UNIFIED, reason, None)]


def decide(shape: BatchShape, t: Thresholds) -> Decision:
    """Route one batch. The first check that fails is the reason; see docs/policy.md."""
    if shape.max_query_len < t.min_query_len:
        if t.decode_path == PREFILL:
            return _INTERNED[(PREFILL, NO_PREFILL_ROWS, lpt_rule(shape, t))]
        return _fallback(NO_PREFILL_ROWS)
    if not t.prefill_enabled:
        return _fallback(DISABLED)
    if not shape.causal:
        return _fallback(NOT_CAUSAL)
    if t.max_seq_len and shape.max_seq_len > t.max_seq_len:
        return _fallback(CONTEXT_TOO_LONG)
    if shape.max_seq_len < t.min_seq_len:
        return _fallback(SHORT_CONTEXT)
    if shape.num_heads * shape.num_actual_tokens < t.min_qblock_rows * t.block_m:
        return _fallback(LOW_OCCUPANCY)
    if shape.num_decode_rows > t.decode_rows_base * max(1, shape.max_seq_len // t.decode_ctx_unit):
        return _fallback(TOO_MANY_DECODE_ROWS)
    return _INTERNED[(PREFILL, ADMITTED, lpt_rule(shape, t))]
