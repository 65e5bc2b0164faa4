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

import math
from bisect import bisect_left
from random import random
from time import time
from typing import Any

from flyserve.policy.rules import Decision, decision_for
from flyserve.policy.shape import BatchShape
from flyserve.policy.vocabulary import CIRCUIT_OPEN, PATHS, REASONS, UNSUPPORTED
from flyserve.telemetry import metrics
from flyserve.telemetry.prom import histogram_cells, value_cell, value_of
from flyserve.telemetry.tracing import DISPATCH_SPAN, ROOT_CONTEXT, Tracing

FALLBACK_REASONS = (UNSUPPORTED, CIRCUIT_OPEN)
"""The reasons the routing sets over decide()'s choice (the layer group rules the prefill kernel
out, its breaker is open): a trial block's fallbacks (docs/autopilot.md, "Guardrails")."""


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
    """A histogram child's value cells, bound for observe() without prometheus_client's Python loop.

    ``observe(v)`` == child.observe(v): bisect on the upper bounds (C), one bucket cell += 1, the
    sum cell += v. Callers on the hot path inline those three lines.
    """

    __slots__ = ("bounds", "bucket_bufs", "bucket_idx", "sum_buf", "sum_i")

    def __init__(self, child: Any) -> None:
        bounds, cells, (self.sum_buf, self.sum_i) = histogram_cells(child)
        # Integral bounds as ints: bisect_left of an int count over int bounds cost 0.14 us against
        # 0.22 us over the same bounds as floats (int-float compares are slower; timeit, CI VM), and
        # Python compares ints with floats exactly, so every value lands in the same bucket.
        self.bounds = [int(b) if math.isfinite(b) and b == int(b) else b for b in bounds]
        self.bucket_bufs = [c[0] for c in cells]
        self.bucket_idx = [c[1] for c in cells]

    def observe(self, v: float) -> None:
        k = bisect_left(self.bounds, v)
        self.bucket_bufs[k][self.bucket_idx[k]] += 1
        self.sum_buf[self.sum_i] += v


class _PathBinding:
    """The per-path cells, flattened into one tuple so record() unpacks them in one step."""

    __slots__ = ("cells",)

    def __init__(self, path: str, rank: str) -> None:
        q = HistogramBinding(metrics.DISPATCH_QUERY_TOKENS.labels(path, rank))
        m = HistogramBinding(metrics.DISPATCH_MAX_SEQ_LEN.labels(path, rank))
        self.cells = (
            *value_cell(metrics.DISPATCH_TOKENS.labels(path, rank)),
            *value_cell(metrics.DISPATCH_ROWS.labels(path, "prefill", rank)),
            *value_cell(metrics.DISPATCH_ROWS.labels(path, "decode", rank)),
            q.bounds,
            q.bucket_bufs,
            q.bucket_idx,
            q.sum_buf,
            q.sum_i,
            m.bounds,
            m.bucket_bufs,
            m.bucket_idx,
            m.sum_buf,
            m.sum_i,
        )


_NO_LPT = ([0.0], 0)  # a scratch cell for unified decisions (no ordering): no branch in record()


class DispatchRecorder:
    """Counts every decision of one rank; traces a sampled few.

    rank: label value of every series (the tensor-parallel rank of this worker).
    tracing: from setup_tracing(); None records no spans.
    All of the rank's series are created at construction (zero-valued), so routing ratios and
    fallback reasons exist from the first scrape. Single writer: call it from the engine thread.
    """

    def __init__(self, rank: int, *, tracing: Tracing | None = None) -> None:
        self.rank = int(rank)
        self._rank_label = str(self.rank)
        self.tracing = tracing
        self._sampler = tracing.sampler if tracing is not None else None
        self._tracer = tracing.tracer if tracing is not None else None
        self._version: int | None = None
        self._bind()
        metrics._BACKEND.listeners.add(self)

    # -- binding ---------------------------------------------------------------------------

    def _bind(self) -> None:
        """Resolve every cell once; re-run when the metrics backend changes (generation)."""
        r = self._rank_label
        metrics.precreate_rank_series(r)
        self._backend = metrics._BACKEND
        self._gen = self._backend.generation
        paths = {p: _PathBinding(p, r).cells for p in PATHS}
        lpt = {o: value_cell(metrics.DISPATCH_LPT.labels(o, r)) for o in metrics.ORDERINGS}
        by_id: dict[int, tuple[Any, ...]] = {}
        for d in _all_decisions():
            by_id[id(d)] = (
                *value_cell(metrics.DISPATCH_DECISIONS.labels(d.path, d.reason, r)),
                *lpt.get(d.ordering, _NO_LPT),
                *paths[d.path],
            )
        self._by_id = by_id
        self._decode_for: Decision | None = None  # record_decode()'s one-entry cache, re-filled on use
        self._decode_cells: tuple[Any, ...] = ()
        self._record_for: Decision | None = None  # record()'s one-entry cache (a dict lookup less)
        self._record_cells: tuple[Any, ...] = ()
        self._step_buf, self._step_i = value_cell(metrics.ENGINE_STEP.labels(r))
        self._version_value = value_of(metrics.THRESHOLDS_VERSION.labels(r))
        self._circuit_value = value_of(metrics.CIRCUIT_OPEN.labels(r))
        if self._version is not None:
            self._version_value.set(float(self._version), time())

    def _invalidate(self) -> None:
        """The metrics backend changed: the next record() misses its lookup and re-binds."""
        self._by_id = {}
        self._decode_for = None
        self._record_for = None

    def _lookup_slow(self, decision: Decision) -> tuple[Any, ...]:
        """A lookup miss: cells invalidated by a backend change, or a Decision that is not the
        interned object (built by hand, unpickled), which counts on the same series."""
        if self._gen != self._backend.generation or not self._by_id:
            self._bind()
            b = self._by_id.get(id(decision))
            if b is not None:
                return b
        if decision.path not in PATHS or decision.reason not in REASONS:
            raise ValueError(f"unknown decision {decision!r}: path/reason outside the vocabulary")
        return self._by_id[id(decision_for(decision.path, decision.reason, decision.lpt))]

    # -- hot path --------------------------------------------------------------------------

    def record(self, decision: Decision, shape: BatchShape, step: int, thresholds_version: int) -> None:
        """Count one decision (once per engine step); start a ``flyserve.dispatch`` span if sampled.

        Every update is a store into a bound cell (a float in a list, or a float64 view of the
        metrics file): no label lookup, no method call per series, nothing allocated beyond the
        interpreter's float temporaries.
        """
        b: tuple[Any, ...] | None  # None only until the slow lookup below fills it
        if decision is self._record_for:
            b = self._record_cells
        else:
            b = self._by_id.get(id(decision))
            if b is None:
                b = self._lookup_slow(decision)
            self._record_cells = b
            self._record_for = decision
        (
            db,
            di,
            lb,
            li,
            tb,
            ti,
            pb,
            pi,
            rb,
            ri,
            qbounds,
            qbufs,
            qidx,
            qsb,
            qsi,
            mbounds,
            mbufs,
            midx,
            msb,
            msi,
        ) = b
        db[di] += 1
        lb[li] += 1
        n = shape.num_actual_tokens
        tb[ti] += n
        dec = shape.num_decode_rows
        rb[ri] += dec
        pb[pi] += shape.num_reqs - dec
        k = bisect_left(qbounds, n)
        qbufs[k][qidx[k]] += 1
        qsb[qsi] += n
        m = shape.max_seq_len
        k = bisect_left(mbounds, m)
        mbufs[k][midx[k]] += 1
        msb[msi] += m
        self._step_buf[self._step_i] = step
        if thresholds_version != self._version:
            self._version = thresholds_version
            self._version_value.set(float(thresholds_version), time())
        s = self._sampler
        if s is not None and s.ratio and random() < s.ratio:
            self._span(decision, shape, step, thresholds_version)

    def record_decode(
        self,
        decision: Decision,
        num_reqs: int,
        num_tokens: int,
        max_query_len: int,
        max_seq_len: int,
        num_heads: int,
        step: int,
        thresholds_version: int,
    ) -> None:
        """record() for a decode-only step (every row a decode row), from the step's host ints.

        Only the sampled span reads ``max_query_len`` and ``num_heads``; its shape says causal,
        and leaves the short-row count out (-1: not counted).

        The same series move by the same amounts as ``record(decision, shape, ...)`` of that step's
        BatchShape (tests/unit/test_telemetry_recorder_decode.py), without building the shape: no
        prefill-row cell (it would add 0), and the decision's cells come from a one-entry cache, so
        a decode-only step is a dict-free run of bound stores.
        """
        if decision is not self._decode_for:
            self._bind_decode(decision)
        # The unpacking and stores below repeat record()'s (less the prefill-row cell) on purpose:
        # one helper for both would add a Python call per step, measured 65-145 ns against
        # record_decode()'s 1.5-2.3 us (timeit on the shared 2-core VM), 5-8% of the recorder's cost.
        (
            db,
            di,
            lb,
            li,
            tb,
            ti,
            rb,
            ri,
            qbounds,
            qbufs,
            qidx,
            qsb,
            qsi,
            mbounds,
            mbufs,
            midx,
            msb,
            msi,
        ) = self._decode_cells
        db[di] += 1
        lb[li] += 1
        tb[ti] += num_tokens
        rb[ri] += num_reqs
        k = bisect_left(qbounds, num_tokens)
        qbufs[k][qidx[k]] += 1
        qsb[qsi] += num_tokens
        k = bisect_left(mbounds, max_seq_len)
        mbufs[k][midx[k]] += 1
        msb[msi] += max_seq_len
        self._step_buf[self._step_i] = step
        if thresholds_version != self._version:
            self._version = thresholds_version
            self._version_value.set(float(thresholds_version), time())
        s = self._sampler
        if s is not None and s.ratio and random() < s.ratio:
            shape = BatchShape(
                num_reqs, num_tokens, max_query_len, max_seq_len, num_heads, True, num_reqs, -1
            )
            self._span(decision, shape, step, thresholds_version)

    # -- rare paths ------------------------------------------------------------------------

    def _bind_decode(self, decision: Decision) -> None:
        """The cells record_decode() writes for ``decision`` (a new decision, or a backend change)."""
        b = self._by_id.get(id(decision))
        if b is None:
            b = self._lookup_slow(decision)
        # record()'s tuple without the prefill-row cell (b[6:8]): decode steps add none.
        self._decode_cells = b[:6] + b[8:]
        self._decode_for = decision

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
        }
        if shape.num_short_query_rows >= 0:  # -1: not counted (no rule read it this step)
            attrs["flyserve.num_short_query_rows"] = shape.num_short_query_rows
        if decision.lpt is not None:
            attrs["flyserve.lpt"] = decision.lpt
        assert self._tracer is not None
        self._tracer.start_span(DISPATCH_SPAN, context=ROOT_CONTEXT, attributes=attrs).end()

    def fallbacks(self) -> int:
        """This rank's decisions so far with a FALLBACK_REASONS reason: read at a trial block's
        boundaries (once per K steps), never per step, so it looks its series up by label."""
        r = self._rank_label
        return int(
            sum(
                value_of(metrics.DISPATCH_DECISIONS.labels(p, reason, r)).get()
                for p in PATHS
                for reason in FALLBACK_REASONS
            )
        )

    def set_circuit_open(self, is_open: bool) -> None:
        """flyserve_circuit_open{rank}: the routing calls this when its breaker opens or closes."""
        if self._gen != self._backend.generation:
            self._bind()
        self._circuit_value.set(1.0 if is_open else 0.0, time())
