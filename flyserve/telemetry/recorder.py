"""DispatchRecorder: the one object the routing calls per dispatch decision.

Once per engine step per rank, so it does no label lookup, no I/O and no allocation on the
metrics path: every child (per (path, reason), per path, per ordering) is bound when the
recorder is built and found with one dict lookup keyed by the interned Decision's id. The
span is built only when the cheap draw (``random() < sampler.ratio``) says so.

Typical use inside a rank process (set up once, never per step)::

    metrics.setup_multiprocess(state.metrics_dir, wipe=(rank == 0))
    recorder = DispatchRecorder(rank, tracing=setup_tracing())
    ...
    d = decide(shape, snap.thresholds)
    recorder.record(d, shape, step, snap.version)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from random import random
from time import time
from typing import Any

from flyserve.policy.rules import Decision, decision_for
from flyserve.policy.shape import BatchShape
from flyserve.policy.vocabulary import PATHS, REASONS
from flyserve.telemetry import metrics
from flyserve.telemetry.tracing import DISPATCH_SPAN, ROOT_CONTEXT, Tracing

_Inc = Callable[[float], None]


def _all_decisions() -> list[Decision]:
    """Every interned Decision (path x reason x lpt)."""
    out = {}
    for p in PATHS:
        for r in REASONS:
            for lpt in (None, True, False):
                d = decision_for(p, r, lpt)
                out[id(d)] = d
    return list(out.values())


class HistogramBinding:
    """A histogram child's values, bound for observe() without prometheus_client's Python loop.

    ``observe(v)`` == child.observe(v): bisect on the upper bounds (C), one bucket inc, one sum inc.
    """

    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, child: Any) -> None:
        self.bounds: list[float] = list(child._upper_bounds)
        self.buckets: list[_Inc] = [b.inc for b in child._buckets]
        self.sum: _Inc = child._sum.inc

    def observe(self, v: float) -> None:
        self.buckets[bisect_left(self.bounds, v)](1)
        self.sum(v)


class _PathBinding:
    __slots__ = ("decode_rows", "max_seq_len", "prefill_rows", "query_tokens", "tokens")

    def __init__(self, path: str, rank: str) -> None:
        self.tokens: _Inc = metrics.DISPATCH_TOKENS.labels(path, rank)._value.inc
        self.prefill_rows: _Inc = metrics.DISPATCH_ROWS.labels(path, "prefill", rank)._value.inc
        self.decode_rows: _Inc = metrics.DISPATCH_ROWS.labels(path, "decode", rank)._value.inc
        self.query_tokens = HistogramBinding(metrics.DISPATCH_QUERY_TOKENS.labels(path, rank))
        self.max_seq_len = HistogramBinding(metrics.DISPATCH_MAX_SEQ_LEN.labels(path, rank))


class DispatchRecorder:
    """Counts every decision of one rank; traces a sampled few.

    rank: label value of every series (the tensor-parallel rank of this worker).
    tracing: from setup_tracing(); None records no spans.
    All of the rank's series are created at construction (zero-valued), so routing ratios and
    fallback reasons exist from the first scrape.
    """

    def __init__(self, rank: int, *, tracing: Tracing | None = None) -> None:
        self.rank = int(rank)
        self._rank_label = str(self.rank)
        self.tracing = tracing
        self._sampler = tracing.sampler if tracing is not None else None
        self._tracer = tracing.tracer if tracing is not None else None
        self._version: int | None = None
        self._bind()

    # -- binding ---------------------------------------------------------------------------

    def _bind(self) -> None:
        """Resolve every child once; re-run when metrics.setup_multiprocess switches backends."""
        r = self._rank_label
        metrics.precreate_rank_series(r)
        self._gen = metrics._BACKEND.generation
        paths = {p: _PathBinding(p, r) for p in PATHS}
        lpt = {o: metrics.DISPATCH_LPT.labels(o, r)._value.inc for o in metrics.ORDERINGS}
        by_id: dict[int, tuple[_Inc, _PathBinding, _Inc | None]] = {}
        for d in _all_decisions():
            by_id[id(d)] = (
                metrics.DISPATCH_DECISIONS.labels(d.path, d.reason, r)._value.inc,
                paths[d.path],
                lpt.get(d.ordering),
            )
        self._by_id = by_id
        step_child = metrics.ENGINE_STEP.labels(r)._value
        self._set_step = step_child.set
        self._version_value = metrics.THRESHOLDS_VERSION.labels(r)._value
        self._circuit_value = metrics.CIRCUIT_OPEN.labels(r)._value
        if self._version is not None:
            self._version_value.set(float(self._version), time())

    def _lookup_slow(self, decision: Decision) -> tuple[_Inc, _PathBinding, _Inc | None]:
        """A Decision that is not the interned object (built by hand, unpickled): same series."""
        if decision.path not in PATHS or decision.reason not in REASONS:
            raise ValueError(f"unknown decision {decision!r}: path/reason outside the vocabulary")
        return self._by_id[id(decision_for(decision.path, decision.reason, decision.lpt))]

    # -- hot path --------------------------------------------------------------------------

    def record(self, decision: Decision, shape: BatchShape, step: int, thresholds_version: int) -> None:
        """Count one decision (once per engine step); start a ``flyserve.dispatch`` span if sampled."""
        if self._gen != metrics._BACKEND.generation:
            self._bind()
        bound = self._by_id.get(id(decision))
        if bound is None:
            bound = self._lookup_slow(decision)
        inc_decision, p, inc_lpt = bound
        inc_decision(1)
        n = shape.num_actual_tokens
        p.tokens(n)
        dec = shape.num_decode_rows
        pre = shape.num_reqs - dec
        if pre:
            p.prefill_rows(pre)
        if dec:
            p.decode_rows(dec)
        if inc_lpt is not None:
            inc_lpt(1)
        h = p.query_tokens
        h.buckets[bisect_left(h.bounds, n)](1)
        h.sum(n)
        m = shape.max_seq_len
        h = p.max_seq_len
        h.buckets[bisect_left(h.bounds, m)](1)
        h.sum(m)
        self._set_step(step, time())  # timestamp: "most recent" wins across a restarted rank's files
        if thresholds_version != self._version:
            self._version = thresholds_version
            self._version_value.set(float(thresholds_version), time())
        s = self._sampler
        if s is not None and s.ratio and random() < s.ratio:
            self._span(decision, shape, step, thresholds_version)

    # -- rare paths ------------------------------------------------------------------------

    def _span(self, decision: Decision, shape: BatchShape, step: int, thresholds_version: int) -> None:
        attrs: dict[str, Any] = {
            "flyserve.path": decision.path,
            "flyserve.reason": decision.reason,
            "flyserve.ordering": decision.ordering,
            "flyserve.rank": self.rank,
            "flyserve.step": int(step),
            "flyserve.thresholds_version": int(thresholds_version),
            "flyserve.num_reqs": shape.num_reqs,
            "flyserve.num_actual_tokens": shape.num_actual_tokens,
            "flyserve.max_query_len": shape.max_query_len,
            "flyserve.max_seq_len": shape.max_seq_len,
            "flyserve.num_heads": shape.num_heads,
            "flyserve.causal": shape.causal,
            "flyserve.num_decode_rows": shape.num_decode_rows,
            "flyserve.num_prefill_rows": shape.num_reqs - shape.num_decode_rows,
            "flyserve.num_short_query_rows": shape.num_short_query_rows,
        }
        if decision.lpt is not None:
            attrs["flyserve.lpt"] = decision.lpt
        assert self._tracer is not None
        self._tracer.start_span(DISPATCH_SPAN, context=ROOT_CONTEXT, attributes=attrs).end()

    def set_circuit_open(self, is_open: bool) -> None:
        """flyserve_circuit_open{rank}: the routing calls this when its breaker opens or closes."""
        if self._gen != metrics._BACKEND.generation:
            self._bind()
        self._circuit_value.set(1.0 if is_open else 0.0, time())
