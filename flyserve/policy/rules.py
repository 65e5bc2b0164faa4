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
        for _l in (True, False) if _p == PREFILL else (None,):
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


# The unified decision per reason: decide()'s fallbacks without building a tuple key per call.
_UNIFIED_BY_REASON: dict[str, Decision] = {r: _INTERNED[(UNIFIED, r, None)] for r in REASONS}


def _fallback(reason: str) -> Decision:
    return _UNIFIED_BY_REASON[reason]


def decide(shape: BatchShape, t: Thresholds) -> Decision:
    """Route one batch. The first check that fails is the reason; see docs/policy.md.

    Called once per engine step that has a prefill row: each field is read once, and the rules are
    written out rather than looped over (0.46 us for a batch that reaches the decode-row rule, on
    the CI VM, against 0.77 us before; ``max(1, x)`` alone was a tenth of that)."""
    if shape.max_query_len < t.min_query_len:
        if t.decode_path == PREFILL:
            return _INTERNED[(PREFILL, NO_PREFILL_ROWS, lpt_rule(shape, t))]
        return _UNIFIED_BY_REASON[NO_PREFILL_ROWS]
    if not t.prefill_enabled:
        return _UNIFIED_BY_REASON[DISABLED]
    if not shape.causal:
        return _UNIFIED_BY_REASON[NOT_CAUSAL]
    msl = shape.max_seq_len
    cap = t.max_seq_len
    if cap and msl > cap:
        return _UNIFIED_BY_REASON[CONTEXT_TOO_LONG]
    if msl < t.min_seq_len:
        return _UNIFIED_BY_REASON[SHORT_CONTEXT]
    if shape.num_heads * shape.num_actual_tokens < t.min_qblock_rows * t.block_m:
        return _UNIFIED_BY_REASON[LOW_OCCUPANCY]
    units = msl // t.decode_ctx_unit
    if shape.num_decode_rows > t.decode_rows_base * (units if units > 1 else 1):  # noqa: FURB136 (max() is a call)
        return _UNIFIED_BY_REASON[TOO_MANY_DECODE_ROWS]
    return _INTERNED[(PREFILL, ADMITTED, lpt_rule(shape, t))]
