"""Route many batches through decide() and price the routing: the one loop live costs, restart
advice, replay and the fitter share (each used to write it again).

Pure: no I/O, no clock. A batch is anything with ``shape(thresholds) -> BatchShape`` (a rank's
ShapeSample has one; :class:`Rows` wraps the host ints of a trace step or a cost entry). The shape
is built per thresholds because BatchShape counts rows against the thresholds' own query length
floor. The breaker is taken as closed: what a rank would do with the prefill path available.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flyserve.policy.rules import Decision, decide
from flyserve.policy.shape import BatchShape
from flyserve.policy.thresholds import Thresholds
from flyserve.policy.vocabulary import PREFILL


class Routable(Protocol):
    def shape(self, t: Thresholds) -> BatchShape: ...


@dataclass(frozen=True, slots=True)
class Rows:
    """One batch's host ints: per-row query lengths (sequence or numpy), its longest context, the
    layer's query heads and whether attention is causal."""

    query_lens: Any
    max_seq_len: int
    num_heads: int
    causal: bool = True

    def shape(self, t: Thresholds) -> BatchShape:
        return BatchShape.from_query_lens(
            self.query_lens,
            max_seq_len=self.max_seq_len,
            num_heads=self.num_heads,
            causal=self.causal,
            thresholds=t,
        )


def decisions_under(batches: Iterable[Routable], t: Thresholds) -> list[Decision]:
    """decide()'s Decision for each batch under ``t``."""
    return [decide(b.shape(t), t) for b in batches]


def paths_under(batches: Iterable[Routable], t: Thresholds) -> list[str]:
    """decide()'s path for each batch under ``t``."""
    return [decide(b.shape(t), t).path for b in batches]


def routed_seconds(prices: Iterable[Sequence[float]], paths: Iterable[str]) -> float:
    """The time of the routing: each batch's (unified_s, prefill_s) price on the path it took, summed
    in order (the same order gives the same float, so callers compare totals exactly)."""
    total = 0.0
    for (unified_s, prefill_s), path in zip(prices, paths, strict=True):
        total += prefill_s if path == PREFILL else unified_s
    return float(total)
