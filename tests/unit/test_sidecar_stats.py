"""Stats arithmetic: counters -> totals, windows, kernel quantiles; read from real multiprocess files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flyserve.sidecar.stats import (
    CounterHistory,
    CounterSnapshot,
    RankCounters,
    histogram_quantile,
    kernels_of,
    read_counters,
    representative,
    totals_of,
    window_of,
)


def rc(prefill_admitted: float = 0, unified_short: float = 0, unified_decode: float = 0, lpt: float = 0):
    return RankCounters(
        decisions={
            ("prefill", "admitted"): prefill_admitted,
            ("unified", "short_context"): unified_short,
            ("unified", "no_prefill_rows"): unified_decode,
        },
        lpt={"lpt": lpt, "plain": prefill_admitted - lpt},
    )


def test_totals_ratios_and_reasons():
    t = totals_of([rc(prefill_admitted=30, unified_short=10, unified_decode=60, lpt=12)])
    assert t.batches == 100
    assert t.decisions == {"unified": 70, "prefill": 30}
    assert t.reasons["short_context"] == 10 and t.reasons["no_prefill_rows"] == 60
    assert t.prefill_ratio == pytest.approx(0.30)
    assert t.prefill_ratio_of_prefill_batches == pytest.approx(30 / 40)
    assert t.lpt_share == pytest.approx(12 / 30)


def test_totals_empty_has_null_ratios():
    t = totals_of([])
    assert t.batches == 0 and t.prefill_ratio is None and t.lpt_share is None


def test_representative_most_decisions_ties_lowest():
    c = {0: rc(unified_decode=5), 1: rc(unified_decode=9), 2: rc(unified_decode=9)}
    assert representative(c, [0, 1, 2]) == 1
    assert representative({0: rc(unified_decode=3), 1: rc(unified_decode=3)}, [1, 0]) == 0
    assert representative({}, [4]) == 4  # a rank with no counters yet still stands for its engine
    assert representative(c, []) is None


def test_minus_handles_counter_reset():
    later = rc(prefill_admitted=5, unified_decode=50)
    earlier = rc(prefill_admitted=2, unified_decode=80)  # unified went down: files were wiped
    d = later.minus(earlier)
    assert d.decisions[("prefill", "admitted")] == 3
    assert d.decisions[("unified", "no_prefill_rows")] == 50


def test_histogram_quantile_like_prometheus():
    buckets = {0.001: 10.0, 0.01: 90.0, 0.1: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001 + 0.009 * (50 - 10) / 80)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.01 + 0.09 * (99 - 90) / 10)
    assert histogram_quantile(0.05, buckets) == pytest.approx(0.0005)
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 4.0}) == 0.1  # +Inf bucket -> last bound
    assert histogram_quantile(0.5, {}) is None


def test_windows_use_snapshot_history():
    h = CounterHistory(interval_s=5.0)
    for t, n in [(0.0, 0), (100.0, 10), (200.0, 30), (290.0, 60)]:
        h.add(CounterSnapshot(t, {0: rc(prefill_admitted=n, unified_decode=n)}))
    now = CounterSnapshot(300.0, {0: rc(prefill_admitted=100, unified_decode=100)})
    base, complete = h.baseline(300.0, 60.0)
    assert complete and base.time == 200.0
    w = window_of(now, base, complete, {0: [0]})
    assert w.batches == 140 and w.decisions["prefill"] == 70 and w.span_s == 100.0
    base, complete = h.baseline(300.0, 900.0)  # history shorter than the window: the oldest, flagged
    assert not complete and base.time == 0.0
    assert window_of(now, base, complete, {0: [0]}).batches == 200


def test_window_counts_each_engine_once_and_follows_live_rank():
    base = CounterSnapshot(0.0, {0: rc(unified_decode=10), 1: rc(unified_decode=10)})
    # rank 0 died after 10 steps; rank 1 went on to 40: the engine did 30 more steps, not 30 + 0.
    now = CounterSnapshot(60.0, {0: rc(unified_decode=10), 1: rc(unified_decode=40)})
    assert window_of(now, base, True, {0: [0, 1]}).batches == 30


def test_ring_is_bounded():
    h = CounterHistory(interval_s=5.0)
    for i in range(1000):
        h.add(CounterSnapshot(float(i), {}))
    assert len(h) == 900 // 5 + 2


WRITER = textwrap.dedent(
    """
    import sys
    from flyserve.policy import BatchShape, decision_for
    from flyserve.telemetry import metrics
    from flyserve.telemetry.recorder import DispatchRecorder
    metrics.setup_multiprocess(sys.argv[1])
    shape = BatchShape.from_query_lens([1, 1, 4000], max_seq_len=9000, num_heads=16)
    for rank in (0, 1):
        r = DispatchRecorder(rank)
        for step in range(7):
            r.record(decision_for("prefill", "admitted", True), shape, step, 3)
        for step in range(5):
            r.record(decision_for("unified", "no_prefill_rows"), shape, step, 3)
    for v in (0.002, 0.003, 0.004, 0.2):
        metrics.KERNEL_SECONDS.labels("prefill", "0").observe(v)
    """
)


@pytest.mark.slow  # a python subprocess writes the files
def test_read_counters_from_real_multiprocess_files(tmp_path: Path):
    # A separate process writes through the real recorder, as a rank does.
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], check=True, timeout=60)
    counters = read_counters(tmp_path)
    assert set(counters) == {0, 1}
    c0 = counters[0]
    assert c0.decisions[("prefill", "admitted")] == 7
    assert c0.decisions[("unified", "no_prefill_rows")] == 5
    assert c0.tokens["prefill"] == 7 * 4002
    assert c0.rows[("prefill", "decode")] == 14 and c0.rows[("prefill", "prefill")] == 7
    assert c0.lpt["lpt"] == 7
    # Engine totals from one representative: 12 steps, not 24.
    t = totals_of([counters[representative(counters, [0, 1])]])
    assert t.batches == 12 and t.decisions == {"unified": 5, "prefill": 7}
    k = kernels_of(counters.values())
    assert k["prefill"].count == 4 and k["unified"].count == 0
    assert k["prefill"].mean_s == pytest.approx((0.002 + 0.003 + 0.004 + 0.2) / 4)
    # histogram_quantile is deterministic: 0.002 in (0.001, 0.0025], 0.003 and 0.004 in (0.0025, 0.005],
    # 0.2 in (0.1, 0.25]. p50: rank 2 of 4, 1 below the bucket, 2 in it -> 0.0025 + 0.0025 * 1/2.
    # p99: rank 3.96, 3 below, 1 in (0.1, 0.25] -> 0.1 + 0.15 * 0.96.
    assert k["prefill"].p50_s == pytest.approx(0.00375, rel=1e-12)
    assert k["prefill"].p99_s == pytest.approx(0.244, rel=1e-12)
    assert json.loads(k["prefill"].model_dump_json())["count"] == 4


def test_read_counters_missing_dir_raises(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        read_counters(tmp_path / "nope")


def test_read_counters_skips_a_file_with_a_deeply_nested_key(tmp_path: Path):
    """json.loads of '[' * 50000 raises RecursionError: unskipped, /dispatch-stats 500 for ever."""
    from flyserve.telemetry.multiprocess import SKIPPED_FILES
    from flyserve.telemetry.prom import encode_values_file

    (tmp_path / "counter_999994.db").write_bytes(encode_values_file([("[" * 50_000, 1.0, 0.0)]))
    assert read_counters(tmp_path) == {}
    assert "counter_999994.db" in SKIPPED_FILES
