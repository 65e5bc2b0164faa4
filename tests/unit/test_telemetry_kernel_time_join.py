"""Drift on real ranks: a timed step's harvested kernel time joins the shape sample of that step.

The kernel timer (per-step mode) tags the timed forward with the engine step it ran in and hands the
harvested time to ShapeSampleWriter.add_kernel_time; flush writes it as the sample's kernel_s."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_telemetry_gpu_timer import FakeEvent, _timer

from flyserve.policy import PREFILL, UNIFIED
from flyserve.telemetry.gpu_timer import KernelTimer
from flyserve.telemetry.shape_sample import ShapeSampleWriter, read_shape_samples


def _lines(w: ShapeSampleWriter) -> dict[int, dict]:
    w.flush()
    return {d["step"]: d for d in map(json.loads, w.path.read_text().splitlines())}


def _wired(timer: KernelTimer, w: ShapeSampleWriter) -> SimpleNamespace:
    """What FlyserveRouting.__init__ does for the leader: the runtime is the step source."""
    rt = SimpleNamespace(step=0)
    timer.step_source = rt
    timer.on_step_timed = w.add_kernel_time
    return rt


def _step(rt: SimpleNamespace, timer: KernelTimer, w: ShapeSampleWriter, *, sampled: bool, variant: int,
          path: str) -> None:  # fmt: skip
    """One engine step as the routing runs it: sample (maybe), arm (maybe), two layer forwards."""
    rt.step += 1
    if sampled:
        w.add(rt.step, [1, 40], 300, 4, True, [200, 300], path, 1000.0 + rt.step)
    if rt.step >= timer.next_step:
        timer.arm(rt.step)
    for _ in range(2):
        tok = timer.forward_start(variant) if timer.armed else None
        FakeEvent.clock_ms += 1.5
        if tok is not None:
            timer.forward_stop(tok)


def test_a_timed_and_sampled_step_gets_its_time_out_of_order_harvest_included(tmp_path: Path) -> None:
    log: list[FakeEvent] = []
    timer = _timer(90, log, every_steps=2)
    w = ShapeSampleWriter(tmp_path, rank=0)
    rt = _wired(timer, w)
    _step(rt, timer, w, sampled=True, variant=1, path=PREFILL)  # step 1: timed (the first step is)
    _step(rt, timer, w, sampled=True, variant=0, path=UNIFIED)  # step 2: not timed
    _step(rt, timer, w, sampled=True, variant=0, path=UNIFIED)  # step 3: timed
    assert timer.pending == 2
    # The file is written before any timing is harvested: no kernel_s yet.
    assert all("kernel_s" not in d for d in _lines(w).values())
    # Step 3's events complete first (the harvest stops at the first pending one: nothing yet) ...
    log[2].ready = log[3].ready = True
    assert timer.harvest() == 0
    # ... then step 1's: both harvested; each time goes to its own step, after the samples were written.
    log[0].ready = log[1].ready = True
    assert timer.harvest() == 2
    lines = _lines(w)
    assert lines[1]["kernel_s"] == pytest.approx(1.5e-3) and lines[1]["path"] == PREFILL
    assert "kernel_s" not in lines[2]
    assert lines[3]["kernel_s"] == pytest.approx(1.5e-3) and lines[3]["path"] == UNIFIED
    # The sidecar reads it back (what drift_of compares with the cost model's prediction).
    by_step = {s.step: s for s in read_shape_samples(tmp_path, limit=10)}
    assert by_step[1].kernel_s == pytest.approx(1.5e-3) and by_step[2].kernel_s is None


def test_a_time_harvested_before_its_sample_is_added_is_joined_at_flush(tmp_path: Path) -> None:
    """Host clock (CPU ranks): the timing is observed during the forward; the sample may come later."""
    timer = KernelTimer(91, clock="host", every_steps=1)
    w = ShapeSampleWriter(tmp_path, rank=0)
    rt = _wired(timer, w)
    rt.step = 7
    timer.arm(7)
    timer.forward_stop(timer.forward_start(0))
    w.add(7, [1, 1], 50, 4, True, [50, 20], UNIFIED, 1.0)
    k = _lines(w)[7]["kernel_s"]
    assert 0 < k < 60  # a real perf_counter measurement, in seconds


def test_an_unsampled_timed_step_writes_nothing_extra(tmp_path: Path) -> None:
    log: list[FakeEvent] = []
    timer = _timer(92, log, every_steps=1)
    w = ShapeSampleWriter(tmp_path, rank=0, capacity=4)
    rt = _wired(timer, w)
    _step(rt, timer, w, sampled=False, variant=0, path=UNIFIED)  # step 1: timed, not sampled
    _step(rt, timer, w, sampled=True, variant=0, path=UNIFIED)  # step 2: timed and sampled
    for e in log:
        e.ready = True
    assert timer.harvest() == 2
    lines = _lines(w)
    assert list(lines) == [2] and lines[2]["kernel_s"] == pytest.approx(1.5e-3)
    # The step-keyed times are bounded: ten more unsampled timed steps keep at most `capacity`.
    for _ in range(10):
        _step(rt, timer, w, sampled=False, variant=0, path=UNIFIED)
    for e in log:
        e.ready = True
    timer.harvest()
    assert len(w._kernel_times) == 4 and min(w._kernel_times) == 9
    assert list(_lines(w)) == [2]


def test_a_time_of_another_path_than_the_samples_is_not_joined(tmp_path: Path) -> None:
    """Another attention group's forward ran the other kernel: its time does not price this step."""
    log: list[FakeEvent] = []
    timer = _timer(93, log, every_steps=1)
    w = ShapeSampleWriter(tmp_path, rank=0)
    rt = _wired(timer, w)
    _step(rt, timer, w, sampled=True, variant=1, path=UNIFIED)
    for e in log:
        e.ready = True
    assert timer.harvest() == 1
    assert "kernel_s" not in _lines(w)[1]


def test_an_armed_forward_taken_by_a_later_step_is_tagged_with_that_step(tmp_path: Path) -> None:
    """A CUDA-graph replay calls no forward: the armed forward runs in the next step, and its time
    belongs to that step's shape, not to the step that armed it."""
    log: list[FakeEvent] = []
    timer = _timer(94, log, every_steps=16)
    w = ShapeSampleWriter(tmp_path, rank=0)
    rt = _wired(timer, w)
    rt.step = 1
    w.add(1, [1], 10, 4, True, [10], UNIFIED, 1.0)
    timer.arm(1)  # step 1: a graph replay, no forward
    rt.step = 2
    w.add(2, [1], 11, 4, True, [11], UNIFIED, 2.0)
    tok = timer.forward_start(0)
    FakeEvent.clock_ms += 2.0
    timer.forward_stop(tok)
    for e in log:
        e.ready = True
    timer.harvest()
    lines = _lines(w)
    assert "kernel_s" not in lines[1] and lines[2]["kernel_s"] == pytest.approx(2.0e-3)


def test_calls_outside_per_step_mode_are_not_tagged(tmp_path: Path) -> None:
    timer = KernelTimer(95, clock="host", every=1)
    w = ShapeSampleWriter(tmp_path, rank=0)
    rt = _wired(timer, w)
    rt.step = 3
    timer.path(UNIFIED).call(lambda: None)
    assert w._kernel_times == {}
