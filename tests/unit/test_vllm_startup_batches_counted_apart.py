"""vLLM's start-up batches (memory profile, warm-ups, 0.34's KV-cache sizing steps) stay out of flyserve's
serving counters: counted apart until the engine core's first serving step (flyserve/vllm/startup_phase.py).

The boundary is read at vLLM's real WorkerWrapperBase (a subclass here, so the class itself stays as
vLLM made it): its compile_or_warm_up_model, which every executor calls by name, and its first
execute_model.
"""

from __future__ import annotations

import pytest
from _support import module_requires
from test_vllm_routing import DECODE, MIXED, layer, metadata, vllm_config

from flyserve.policy import PREFILL, UNIFIED
from flyserve.vllm import startup_phase
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.forward_switch import SWITCH
from flyserve.vllm.routing import routing_class
from flyserve.vllm.runtime import RankRuntime

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
required_modules = module_requires("vllm")  # imported when a test runs, not at collection


class CountingRecorder:
    """The serving counters, as the routing sees them: every record()/record_decode() call."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def record(self, decision, shape, step, version) -> None:
        self.steps.append(step)

    def record_decode(self, decision, num_reqs, num_tokens, mql, msl, heads, step, version) -> None:
        self.steps.append(step)

    def set_circuit_open(self, is_open: bool) -> None:
        pass


@pytest.fixture
def phase(monkeypatch, tmp_path):
    """A fresh, installed phase for this process (as the plugin leaves it in a vLLM worker)."""
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "1")  # a timer that would arm on every step
    monkeypatch.setenv("FLYSERVE_SHAPE_SAMPLE_EVERY", "1")
    monkeypatch.delenv("FLYSERVE_FORCE_PATH", raising=False)
    p = startup_phase.StartupPhase()
    p.installed = True
    monkeypatch.setattr(startup_phase, "PHASE", p)
    monkeypatch.setattr(SWITCH, "checked", False)
    yield p
    RankRuntime.reset_for_tests()


def make_rank(tmp_path, *, serving=None):
    """A rank built with a rank number (as tests build them): ``serving`` False stands for a vLLM
    worker before its first step (inside vLLM the phase decides; here the fixture's phase flips it)."""
    rt = RankRuntime(state_dir=tmp_path / "state", rank=0, start=False, setup_metrics=False, serving=serving)
    rt.recorder = CountingRecorder()
    layers = {"model.layers.0.attn": layer(), "model.layers.1.attn": layer()}
    routing = routing_class(PrefillKernelSpec("test-prefill"), UNIFIED)(
        list(layers), vllm_config(layers), runtime=rt
    )
    return rt, routing


def test_start_up_batches_are_counted_apart_and_serving_ones_in_the_counters(phase, tmp_path):
    rt, r = make_rank(tmp_path, serving=False)
    for _ in range(3):  # the sizing warm-up's mixed prefill+decode steps, then a decode step
        r.select(metadata(*MIXED))
    r.select(metadata(*DECODE))
    assert rt.recorder.steps == []  # nothing in the serving counters
    assert rt.shape_sample._ring == type(rt.shape_sample._ring)()  # nor in the dry-run shape sample
    assert rt.kernel_timer.armed == 0  # no start-up forward is timed
    assert rt.startup.total == 4 and (rt.startup.first_step, rt.startup.last_step) == (1, 4)
    assert rt.startup.by_path() == {PREFILL: 3, UNIFIED: 1}
    assert "4 batch(es)" in rt.startup.summary() and "prefill 3" in rt.startup.summary()
    assert SWITCH.checked is False  # the decode step took vLLM's forward back
    phase.begin_serving("the engine core's first step")
    assert rt.serving
    r.select(metadata(*MIXED))
    r.select(metadata(*DECODE))
    assert rt.recorder.steps == [5, 6]  # steps keep counting; the counters start at serving
    assert rt.startup.total == 4
    assert len(rt.shape_sample._ring) == 2 and rt.kernel_timer.armed


def test_a_start_up_prefill_batch_still_runs_flyserves_checked_forward(phase, tmp_path):
    """The breaker guards a warm-up's prefill kernel as it guards serving."""
    _rt, r = make_rank(tmp_path, serving=False)
    r.select(metadata(*MIXED))
    assert r.last_decision.path == PREFILL and SWITCH.checked is True


def test_outside_vllm_a_runtime_serves_from_its_first_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    monkeypatch.setattr(startup_phase, "PHASE", startup_phase.StartupPhase())  # nothing installed
    rt, r = make_rank(tmp_path)
    assert rt.serving
    r.select(metadata(*MIXED))
    assert rt.recorder.steps == [1] and rt.startup.total == 0
    RankRuntime.reset_for_tests()


def test_past_the_backstop_every_batch_counts_as_serving(phase, tmp_path, monkeypatch, caplog):
    from flyserve.vllm import routing as routing_mod

    monkeypatch.setattr(routing_mod, "STARTUP_BATCH_LIMIT", 3)
    rt, r = make_rank(tmp_path, serving=False)
    for _ in range(5):
        r.select(metadata(*DECODE))
    assert rt.serving and rt.startup.total == 4 and rt.recorder.steps == [5]
    assert "has not started serving" in caplog.text


@pytest.fixture
def wrapper_cls():
    """A subclass of vLLM's WorkerWrapperBase: hooks land on it, vLLM's class is left alone."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    class Wrapper(WorkerWrapperBase):
        def execute_model(self, scheduler_output):  # the wrapper's own, as vLLM's defines one
            return self.worker.execute_model(scheduler_output)

    return Wrapper


class FakeWorker:
    """A worker whose warm-up runs batches through the routing the way vLLM 0.34's does (the worker's
    own execute_model, never the wrapper's)."""

    def __init__(self, routing) -> None:
        self.routing = routing
        self.warmed = False

    def execute_model(self, scheduler_output):
        self.routing.select(metadata(*scheduler_output))
        return "out"

    def compile_or_warm_up_model(self):
        for _ in range(2):
            self.execute_model(MIXED)  # the sizing warm-up's steps
        self.warmed = True
        return "compilation times"


def _instance(cls, worker):
    w = object.__new__(cls)
    w.worker = worker  # vLLM's __getattr__ hands unknown names to it
    return w


def test_the_boundary_is_the_first_serving_step_after_vllms_warm_up(phase, tmp_path, wrapper_cls):
    rt, r = make_rank(tmp_path, serving=False)  # built before the warm-up, as vLLM builds the backends
    assert startup_phase.install(wrapper_cls)
    w = _instance(wrapper_cls, FakeWorker(r))
    assert w.compile_or_warm_up_model() == "compilation times" and w.worker.warmed  # vLLM's result
    assert rt.startup.total == 2 and rt.recorder.steps == [] and not rt.serving
    assert w.execute_model(MIXED) == "out"  # the engine core's first step
    assert rt.serving and rt.recorder.steps == [3]
    # the hook put vLLM's method back: later steps run with no flyserve frame
    assert not getattr(wrapper_cls.__dict__["execute_model"], "_flyserve_first_step", False)
    w.execute_model(DECODE)
    assert rt.recorder.steps == [3, 4]
    assert startup_phase.install(wrapper_cls)  # idempotent: no second warm-up wrapper


def test_a_launch_without_warm_up_serves_from_its_first_step(phase, tmp_path, wrapper_cls):
    """VLLM_ELASTIC_EP_SCALE_UP_LAUNCH: the engine core never calls compile_or_warm_up_model."""
    rt, r = make_rank(tmp_path, serving=False)
    startup_phase.install(wrapper_cls)
    _instance(wrapper_cls, FakeWorker(r)).execute_model(MIXED)
    assert rt.serving and rt.recorder.steps == [1] and rt.startup.total == 0


def test_an_executor_stepping_through_execute_model_ray_is_hooked_after_the_warm_up(
    phase, tmp_path, wrapper_cls
):
    """vLLM 0.32's legacy Ray compiled DAG calls RayWorkerWrapper.execute_model_ray, not the wrapper's
    execute_model; the warm-up hook puts the one-shot step hook on that method of the wrapper's class."""

    class RayWrapper(wrapper_cls):
        def execute_model_ray(self, scheduler_output):
            return self.worker.execute_model(scheduler_output)

    rt, r = make_rank(tmp_path, serving=False)
    startup_phase.install(wrapper_cls)
    w = _instance(RayWrapper, FakeWorker(r))
    w.compile_or_warm_up_model()
    assert getattr(RayWrapper.__dict__["execute_model_ray"], "_flyserve_first_step", False)
    w.execute_model_ray(DECODE)
    assert rt.serving and rt.recorder.steps == [3] and rt.startup.total == 2
    assert not getattr(RayWrapper.__dict__["execute_model_ray"], "_flyserve_first_step", False)


def test_a_runtime_built_inside_vllm_takes_the_processs_phase(phase, tmp_path, monkeypatch):
    """No rank given (as vLLM's worker builds it): start-up while the plugin's hooks are in and no step
    came yet; serving once the phase flips."""
    from flyserve.vllm import runtime

    monkeypatch.setattr(runtime, "_vllm_parallel_config", lambda: None)
    monkeypatch.setattr(runtime, "_vllm_rank", lambda: (0, 0))
    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "state"))
    rt = RankRuntime(start=False, setup_metrics=False)
    assert rt.serving is False
    phase.begin_serving("the engine core's first step (WorkerWrapperBase.execute_model)")
    assert rt.serving is True
    late = RankRuntime(start=False, setup_metrics=False)  # built after the boundary
    assert late.serving is True
