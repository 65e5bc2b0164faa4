"""DispatchRecorder.record_decode moves every series exactly as record() of the same step's shape.

Two recorders (ranks 70 and 71) see the same decode-only steps, one through record() with the
full BatchShape, the other through record_decode() with vLLM's host ints; every sample of one rank
must equal the other's, counters, histograms (buckets and sums), the step and version gauges.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flyserve.policy import NO_PREFILL_ROWS, PREFILL, UNIFIED, BatchShape, decision_for
from flyserve.telemetry import metrics
from flyserve.telemetry.recorder import DispatchRecorder

pytestmark = pytest.mark.slow  # 6 s on the 2-core VM: hypothesis examples


def _rank_samples(rank: str) -> dict[tuple, float]:
    out = {}
    for fam in metrics.REGISTRY.collect():
        for s in fam.samples:
            if s.labels.get("rank") == rank and not s.name.endswith("_created"):
                key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank")))
                out[key] = s.value
    return out


# (num_reqs, padding rows of length 0, max_seq_len, thresholds version, decision)
step_st = st.tuples(
    st.integers(1, 512),
    st.integers(0, 8),
    st.integers(1, 300_000),
    st.integers(0, 3),
    st.sampled_from(
        [
            decision_for(UNIFIED, NO_PREFILL_ROWS),
            decision_for(PREFILL, NO_PREFILL_ROWS, True),
            decision_for(PREFILL, NO_PREFILL_ROWS, False),
        ]
    ),
)

_RANKS = iter(range(7000, 9000, 2))


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(step_st, min_size=1, max_size=20))
def test_record_decode_equals_record_of_the_full_shape(steps):
    a_rank = next(_RANKS)
    full, fast = DispatchRecorder(a_rank), DispatchRecorder(a_rank + 1)
    for i, (rows, pad, msl, version, d) in enumerate(steps, start=1):
        n = rows + pad  # padding rows have length 0: decode rows with no token
        shape = BatchShape(n, rows, 1, msl, 16, True, n, n)
        full.record(d, shape, i, version)
        fast.record_decode(d, n, rows, 1, msl, 16, i, version)
    a, b = _rank_samples(str(a_rank)), _rank_samples(str(a_rank + 1))
    assert a and a == b


def test_record_decode_rebinds_after_a_metrics_backend_change(tmp_path):
    d = decision_for(UNIFIED, NO_PREFILL_ROWS)
    rec = DispatchRecorder(7990)
    rec.record_decode(d, 4, 4, 1, 1000, 16, 1, 0)
    metrics.setup_multiprocess(tmp_path / "metrics", wipe=True)
    try:
        rec.record_decode(d, 4, 4, 1, 1000, 16, 2, 0)
        labels = {"path": UNIFIED, "reason": NO_PREFILL_ROWS, "rank": "7990"}
        assert metrics.REGISTRY.get_sample_value("flyserve_dispatch_decisions_total", labels) == 1.0
    finally:
        metrics.setup_in_process()
