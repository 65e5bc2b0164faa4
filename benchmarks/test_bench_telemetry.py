"""Cost of DispatchRecorder.record() per decision, beside the bare decide() it follows.

Run: .venv/bin/python -m pytest benchmarks/test_bench_telemetry.py --benchmark-enable
Groups:
  record-in-process  values are plain floats (unit tests, a single-process engine)
  record-mmap        values in flyserve's metrics directory (production: several rank processes)
Each group has the bare decide() so the ratio record/decide comes from one side-by-side run.
"every span" exports through a SimpleSpanProcessor to an exporter that drops the batch, so it
measures span creation, attributes and the processor hand-off, not a network.
Absolute CPU times on the 2-core CI VM are indicative only; docs/metrics.md quotes the ratios.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from flyserve.policy import BatchShape, decide
from flyserve.telemetry import metrics
from flyserve.telemetry.gpu_timer import KernelTimer
from flyserve.telemetry.recorder import DispatchRecorder
from flyserve.telemetry.tracing import Tracing, setup_tracing
from flyserve.thresholds_files import load_profile

SEED = load_profile("gfx950")
# A chunked-prefill step (as in benchmarks/test_bench_policy.py): 248 decode rows, 8 chunks of 1024.
_LENS = np.array([1] * 248 + [1024] * 8, dtype=np.int32)
SHAPE = BatchShape.from_query_lens(_LENS, max_seq_len=61440, num_heads=16, thresholds=SEED)
DECISION = decide(SHAPE, SEED)


class _NullExporter(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _tracing(ratio: float) -> Tracing:
    t = setup_tracing(ratio=ratio, exporter=_NullExporter())
    assert t is not None
    return t


@pytest.fixture(params=["in-process", "mmap"])
def mode(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "mmap":
        metrics.setup_multiprocess(tmp_path_factory.mktemp("metrics"))
    try:
        yield request.param
    finally:
        metrics.setup_in_process()


def _decisions(rank: str) -> float:
    labels = {"path": DECISION.path, "reason": DECISION.reason, "rank": rank}
    return metrics.REGISTRY.get_sample_value("flyserve_dispatch_decisions_total", labels) or 0.0


def _group(benchmark, mode: str) -> None:
    benchmark.group = f"record-{mode}"


def test_bare_decide(benchmark, mode: str) -> None:
    _group(benchmark, mode)
    d = benchmark(decide, SHAPE, SEED)
    assert d is DECISION


def test_record_metrics_only(benchmark, mode: str) -> None:
    _group(benchmark, mode)
    rec = DispatchRecorder(900)
    before = _decisions("900")
    benchmark(rec.record, DECISION, SHAPE, 1000, 3)
    benchmark.assert_effect_per_call(_decisions("900") - before)  # one count per call, nothing lost


def test_record_spans_sampled_out(benchmark, mode: str) -> None:
    _group(benchmark, mode)
    t = _tracing(0.0)
    rec = DispatchRecorder(901, tracing=t)
    before = _decisions("901")
    benchmark(rec.record, DECISION, SHAPE, 1000, 3)
    benchmark.assert_effect_per_call(_decisions("901") - before)
    t.shutdown()


def test_record_every_span(benchmark, mode: str) -> None:
    _group(benchmark, mode)
    t = _tracing(1.0)
    rec = DispatchRecorder(902, tracing=t)
    before = _decisions("902")
    benchmark(rec.record, DECISION, SHAPE, 1000, 3)
    benchmark.assert_effect_per_call(_decisions("902") - before)
    t.shutdown()


def test_decide_then_record(benchmark, mode: str) -> None:
    """The whole per-step telemetry hot path as the routing runs it (spans sampled out)."""
    _group(benchmark, mode)
    t = _tracing(0.0)
    rec = DispatchRecorder(903, tracing=t)

    def step() -> None:
        rec.record(decide(SHAPE, SEED), SHAPE, 1000, 3)

    before = _decisions("903")
    benchmark(step)
    benchmark.assert_effect_per_call(_decisions("903") - before)
    t.shutdown()


def test_kernel_timer_unsampled_call(benchmark, mode: str) -> None:
    """What an untimed attention call pays: start() (an int decrement) and stop(None)."""
    _group(benchmark, mode)
    p = KernelTimer(904, clock="host", every=1 << 30).path("unified")
    p.start()  # the first call is timed; the benchmark measures the untimed ones

    def call() -> None:
        p.stop(p.start())

    benchmark(call)
    assert p._left > 0 and p._owner.pending == 0  # every benchmarked call was an untimed one
