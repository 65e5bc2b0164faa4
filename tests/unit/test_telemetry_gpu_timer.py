"""flyserve.telemetry.gpu_timer: 1-in-N sampling, a harvest that never blocks, bounded queue, spans."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _support import require_module
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flyserve.policy import PREFILL, UNIFIED
from flyserve.telemetry import metrics
from flyserve.telemetry.gpu_timer import KernelTimer
from flyserve.telemetry.tracing import KERNEL_SPAN, setup_tracing

REPO = Path(__file__).resolve().parents[2]


class FakeEvent:
    """A CUDA event stand-in: ready only when the test says so; any blocking call fails the test."""

    clock_ms = 0.0

    def __init__(self, log: list[FakeEvent]) -> None:
        self.ready = False
        self.t_ms: float | None = None
        self.queries = 0
        log.append(self)

    def record(self) -> None:
        self.t_ms = FakeEvent.clock_ms
        self.ready = False

    def query(self) -> bool:
        self.queries += 1
        return self.ready

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.ready and end.ready):
            raise AssertionError("elapsed_time on an event that has not completed (would fail on CUDA)")
        assert self.t_ms is not None and end.t_ms is not None
        return end.t_ms - self.t_ms

    def synchronize(self) -> None:
        raise AssertionError("the timer must never synchronize")

    def wait(self, *a: object) -> None:
        raise AssertionError("the timer must never wait")


def _count(path: str, rank: int) -> float:
    return metrics.REGISTRY.get_sample_value(
        "flyserve_kernel_seconds_count", {"path": path, "rank": str(rank)}
    )


def _timer(rank: int, log: list[FakeEvent], capturing: list[bool] | None = None, **kw) -> KernelTimer:
    cap = capturing if capturing is not None else [False]
    return KernelTimer(
        rank, clock="cuda", event_factory=lambda: FakeEvent(log), is_capturing=lambda: cap[0], **kw
    )


def test_harvest_never_blocks_on_an_event_that_is_not_ready() -> None:
    log: list[FakeEvent] = []
    timer = _timer(60, log, every=1)
    p = timer.path(UNIFIED)
    FakeEvent.clock_ms = 100.0
    tok = p.start()
    FakeEvent.clock_ms = 100.25
    p.stop(tok)
    assert timer.pending == 1
    start, end = log
    # not ready: harvest returns at once, keeps it pending, observes nothing
    assert timer.harvest() == 0
    assert timer.pending == 1 and end.queries == 1
    assert _count(UNIFIED, 60) == 0
    # a later sampled call harvests again, still not ready: still pending, no wait
    tok = p.start()
    p.stop(tok)
    assert timer.pending == 2 and _count(UNIFIED, 60) == 0
    # the GPU catches up with the first pair only
    start.ready = end.ready = True
    assert timer.harvest() == 1
    assert timer.pending == 1
    assert _count(UNIFIED, 60) == 1
    s = metrics.REGISTRY.get_sample_value("flyserve_kernel_seconds_sum", {"path": UNIFIED, "rank": "60"})
    assert s == pytest.approx(0.25e-3)
    le = metrics.REGISTRY.get_sample_value(
        "flyserve_kernel_seconds_bucket", {"path": UNIFIED, "rank": "60", "le": "0.00025"}
    )
    assert le == 1.0


def test_one_in_n_calls_is_timed_per_path() -> None:
    log: list[FakeEvent] = []
    timer = _timer(61, log, every=4)
    u, pf = timer.path(UNIFIED), timer.path(PREFILL)
    timed_u = sum(u.start() is not None for _ in range(40))  # start() without stop: count tokens only
    assert timed_u == 10
    calls = []
    for i in range(8):
        pf.call(lambda i=i: calls.append(i))
    assert calls == list(range(8))
    # calls 1 and 5 of prefill timed: two event pairs; the 10 unified starts made one event each
    assert len(log) == 10 + 2 * 2
    assert timer.pending == 2


def test_no_events_while_the_stream_is_capturing() -> None:
    log: list[FakeEvent] = []
    cap = [True]
    timer = _timer(62, log, cap, every=1)
    p = timer.path(PREFILL)
    for _ in range(5):
        p.stop(p.start())
    assert log == [] and timer.pending == 0
    cap[0] = False
    p.stop(p.start())
    assert len(log) == 2 and timer.pending == 1


def test_bounded_queue_drops_and_counts() -> None:
    log: list[FakeEvent] = []
    timer = _timer(63, log, every=1, max_pending=3)
    p = timer.path(UNIFIED)
    for _ in range(10):
        p.stop(p.start())
    assert timer.pending == 3
    dropped = metrics.REGISTRY.get_sample_value(
        "flyserve_kernel_timer_dropped_total", {"path": UNIFIED, "rank": "63"}
    )
    assert dropped == 7
    for e in log:
        e.ready = True
    p.stop(p.start())  # the next sampled call harvests the three, then times itself
    assert _count(UNIFIED, 63) == 3 and timer.pending == 1
    assert len(log) == 6  # the new pair reuses completed events: none allocated


def test_host_clock_times_cpu_calls_at_once() -> None:
    timer = KernelTimer(64, every=2, clock="host")
    p = timer.path(PREFILL)
    out = [p.call(lambda: sum(range(2000))) for _ in range(6)]
    assert out == [sum(range(2000))] * 6
    assert _count(PREFILL, 64) == 3  # calls 1, 3, 5
    assert timer.pending == 0
    s = metrics.REGISTRY.get_sample_value("flyserve_kernel_seconds_sum", {"path": PREFILL, "rank": "64"})
    assert 0 < s < 1.0


def test_kernel_span_is_ended_at_harvest_with_explicit_timestamps() -> None:
    exp = InMemorySpanExporter()
    t = setup_tracing(ratio=1.0, exporter=exp)
    assert t is not None
    log: list[FakeEvent] = []
    timer = _timer(65, log, every=1, tracing=t)
    p = timer.path(PREFILL)
    FakeEvent.clock_ms = 10.0
    tok = p.start()
    FakeEvent.clock_ms = 13.0
    p.stop(tok)
    assert exp.get_finished_spans() == ()  # not before the timing is known
    for e in log:
        e.ready = True
    timer.harvest()
    (span,) = exp.get_finished_spans()
    assert span.name == KERNEL_SPAN
    assert span.attributes["flyserve.path"] == PREFILL
    assert span.attributes["flyserve.rank"] == 65
    assert span.attributes["flyserve.kernel_seconds"] == pytest.approx(3e-3)
    assert span.end_time - span.start_time == 3_000_000
    t.set_ratio(0.0)
    p.stop(p.start())
    for e in log:
        e.ready = True
    timer.harvest()
    assert len(exp.get_finished_spans()) == 1  # timed, but not traced at ratio 0
    t.shutdown()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="every"):
        KernelTimer(0, every=0, clock="host")
    with pytest.raises(ValueError, match="max_pending"):
        KernelTimer(0, max_pending=0, clock="host")
    with pytest.raises(ValueError, match="clock"):
        KernelTimer(0, clock="sundial")
    with pytest.raises(ValueError, match="kernel path"):
        KernelTimer(0, clock="host").path("mystery")


@pytest.mark.slow  # a python subprocess (a fresh interpreter)
def test_importing_telemetry_does_not_import_torch() -> None:
    code = (
        "import sys; import flyserve.telemetry.gpu_timer, flyserve.telemetry.recorder, "
        "flyserve.telemetry.tracing; from flyserve.telemetry.gpu_timer import KernelTimer; "
        "KernelTimer(0, clock='auto'); print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_cuda_clock_on_a_machine_without_cuda_uses_torch_lazily() -> None:
    """clock='cuda' binds torch.cuda's event and capture check (on this CPU machine: unavailable)."""
    torch = require_module("torch")
    timer = KernelTimer(66, clock="cuda", every=1)
    assert timer._is_capturing is torch.cuda.is_current_stream_capturing
    if not torch.cuda.is_available():
        assert KernelTimer(67, clock="auto").clock == "host"


# ----------------------------------------------------------------- per-step mode (vLLM ranks)


def _serve_steps(timer: KernelTimer, steps: int, layers: int, variant_of_step) -> list[tuple[int, int]]:
    """What a rank does: the routing arms the timer (one compare per step), the forward wrapper
    reads ``armed`` once per forward. Returns the (step, layer) of every timed forward."""
    timed = []
    for step in range(1, steps + 1):
        if step >= timer.next_step:
            timer.arm(step)
        v = variant_of_step(step)
        for layer in range(layers):
            tok = timer.forward_start(v) if timer.armed else None
            if tok is not None:
                timer.forward_stop(tok)
                timed.append((step, layer))
    return timed


def test_per_step_mode_times_one_forward_every_n_steps_rotating_over_layers() -> None:
    log: list[FakeEvent] = []
    timer = _timer(66, log, every_steps=4)
    timer.forwards_per_step = 3
    timed = _serve_steps(timer, 24, 3, lambda step: 1 if step % 8 == 1 else 0)
    # steps 1, 5, 9, ... timed (the first step too), one forward each, the layer rotating 0, 1, 2, 0, ...
    assert timed == [(1, 0), (5, 1), (9, 2), (13, 0), (17, 1), (21, 2)]
    assert timer.pending == 6 and len(log) == 12  # one event pair per timed forward, nothing else
    for e in log:
        e.ready = True
    assert timer.harvest() == 6
    assert _count(PREFILL, 66) == 3.0  # steps 1, 9 and 17 ran the prefill path (variant 1)
    assert _count(UNIFIED, 66) == 3.0


def test_per_step_mode_an_armed_forward_that_never_comes_is_taken_by_the_next() -> None:
    """A step that calls no forward (a CUDA-graph replay) leaves the timer armed: the next step's
    forward is timed instead, once; the next arm() starts over."""
    log: list[FakeEvent] = []
    timer = _timer(67, log, every_steps=3, max_pending=64)
    timer.arm(1)
    assert timer.armed == 1  # no forward in step 1
    tok = timer.forward_start(0)  # step 2's first forward
    assert tok is not None and timer.armed == 0
    timer.forward_stop(tok)
    assert timer.pending == 1 and timer.next_step == 4


def test_per_step_mode_records_nothing_while_capturing() -> None:
    log: list[FakeEvent] = []
    timer = _timer(68, log, capturing=[True], every_steps=1)
    timed = _serve_steps(timer, 5, 2, lambda step: 0)
    assert timed == [] and log == [] and timer.pending == 0


def test_every_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every_steps"):
        KernelTimer(0, clock="host", every_steps=0)
