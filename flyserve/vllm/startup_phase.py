"""Where vLLM's start-up ends and serving begins, in this process, and the start-up's own tally.

Why: before its first request vLLM runs batches of its own through the attention backends, and each
reaches FlyserveRouting.select() exactly like a serving step. vLLM 0.34 made them real batches:
``compile_or_warm_up_model`` runs the JIT warm-up (``warmup_kernels``) and, with an extensible KV
cache, the sizing warm-up (``run_kv_cache_sizing_warmup``: full-budget mixed prefill+decode steps), both
through the worker's own ``execute_model`` (vllm/v1/worker/gpu_worker.py:1079 and 1087,
vllm/v1/worker/gpu/warmup.py); the CPU worker runs ``warmup_kernels`` too (cpu_worker.py:272).
0.32's V2 model runner does the JIT warm-up the same way (gpu_worker.py:955). Counted as serving,
those sizing batches were the first rows of flyserve's decision counters, shape sample and kernel
timings: decisions no operator's traffic made.

The boundary, in every recorded release (0.30-0.34): each of those batches runs inside a worker
method the engine core calls by name on vLLM's ``WorkerWrapperBase``: ``determine_available_memory``
(the memory profile), then ``compile_or_warm_up_model`` (compile sizes, kernel warm-ups, CUDA-graph
capture), then, in 0.34, ``extend_kv_cache`` (adaptive verification's timed dummy runs); the
warm-ups call the worker's ``execute_model``, never the wrapper's. A serving step reaches the worker
through ``WorkerWrapperBase.execute_model`` (every executor resolves the method name on the wrapper),
except 0.32's legacy Ray compiled DAG, which calls ``RayWorkerWrapper.execute_model_ray``. So serving
begins at the first call of either, and ``install()`` hooks both once:

* ``execute_model`` on the wrapper class, from the start (a launch that skips the warm-up, such as
  ``VLLM_ELASTIC_EP_SCALE_UP_LAUNCH``, goes straight to it);
* ``execute_model_ray`` on the wrapper's own class, when ``compile_or_warm_up_model`` returns (the
  wrapper has no such method of its own: vLLM's ``__getattr__`` hands it to the worker, and the
  method flyserve adds does the same, then notes that the warm-up is over).

Each hook puts vLLM's method back on its first call, so serving steps run with no flyserve frame.
On the hot path the routing reads one bool (``RankRuntime.serving``): no I/O, no lookup.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("flyserve.vllm")

STEP_METHODS = ("execute_model", "execute_model_ray")
"""The worker-wrapper methods through which the engine core runs a serving step."""
WARM_UP_METHOD = "compile_or_warm_up_model"

STARTUP_BATCH_LIMIT = 4096
"""A backstop, not a measurement: vLLM's start-up runs tens of batches through select() (compile sizes,
kernel warm-ups, 0.34's sizing steps, adaptive verification's profile). A process still counting
start-up batches past this many never saw the boundary (an executor that reaches the worker some other
way): it logs that and counts as serving from then on, rather than hiding every decision."""


class StartupPhase:
    """This process's phase: start-up until the engine core's first serving step, then serving.

    Outside vLLM (tests, the lab) nothing installs the hooks and the phase reads as serving, so a
    routing built there counts from its first batch.
    """

    def __init__(self) -> None:
        self.installed = False
        self.serving = False
        self.why = ""
        self._listeners: list[Callable[[], Callable[[str], None] | None]] = []

    def serving_now(self) -> bool:
        return self.serving or not self.installed

    def on_serving(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(why)`` once, when serving begins (now, if it has). Held weakly when it is a
        bound method, so a runtime dropped by a test is not kept alive."""
        if self.serving_now():
            callback(self.why or "not inside vLLM")
            return
        try:
            ref: Callable[[], Callable[[str], None] | None] = weakref.WeakMethod(callback)  # type: ignore[arg-type]
        except TypeError:
            ref = lambda cb=callback: cb  # a plain function: kept as it is
        self._listeners.append(ref)

    def begin_serving(self, why: str) -> None:
        if self.serving:
            return
        self.serving, self.why = True, why
        listeners, self._listeners = self._listeners, []
        for ref in listeners:
            cb = ref()
            if cb is not None:
                cb(why)


PHASE = StartupPhase()
"""The phase of this process (one engine's worker, or the engine core with a uniprocess executor)."""


def _one_shot(cls: type, name: str) -> None:
    """Wrap ``cls.<name>`` so that its first call marks serving begun and puts vLLM's method back."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "_flyserve_first_step", False):
        return

    @functools.wraps(original)
    def first_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if cls.__dict__.get(name) is first_step:
            setattr(cls, name, original)
        PHASE.begin_serving(f"the engine core's first step ({cls.__name__}.{name})")
        return original(self, *args, **kwargs)

    first_step._flyserve_first_step = True  # type: ignore[attr-defined]
    setattr(cls, name, first_step)


def _warm_up_method(original: Callable[..., Any] | None) -> Callable[..., Any]:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's warm-up, run as vLLM runs it (the wrapper's own method, else the worker's); then the
        step hook on this wrapper's class where its executor steps through ``execute_model_ray``."""
        if original is not None:
            out = original(self, *args, **kwargs)
        else:
            out = self.worker.compile_or_warm_up_model(*args, **kwargs)
        for klass in type(self).__mro__:
            if STEP_METHODS[1] in klass.__dict__:
                _one_shot(klass, STEP_METHODS[1])
                break
        log.debug("flyserve: vLLM's warm-up (%s) returned; serving begins at the first step", WARM_UP_METHOD)
        return out

    compile_or_warm_up_model._flyserve_warm_up = True  # type: ignore[attr-defined]
    return compile_or_warm_up_model


def install(wrapper_cls: type | None = None) -> bool:
    """Hook vLLM's worker wrapper (``WorkerWrapperBase`` unless given): from now on this process is in
    start-up until the first serving step. Idempotent. False when vLLM is not importable."""
    if wrapper_cls is None:
        try:
            from vllm.v1.worker.worker_base import WorkerWrapperBase
        except ImportError:
            return False
        wrapper_cls = WorkerWrapperBase
    current = wrapper_cls.__dict__.get(WARM_UP_METHOD)
    if not getattr(current, "_flyserve_warm_up", False):
        setattr(wrapper_cls, WARM_UP_METHOD, _warm_up_method(current))
    _one_shot(wrapper_cls, STEP_METHODS[0])
    PHASE.installed = True
    return True


class StartupBatches:
    """The batches of vLLM's start-up that reached the routing, counted apart from the serving counters.

    Plain ints in a dict: start-up batches are tens, and none of this runs once serving begins.
    """

    __slots__ = ("by_decision", "first_step", "last_step", "total")

    def __init__(self) -> None:
        self.by_decision: dict[tuple[str, str], int] = {}
        self.total = 0
        self.first_step = 0
        self.last_step = 0

    def count(self, decision: Any, step: int) -> int:
        """Count one start-up batch; returns how many there have been."""
        key = (decision.path, decision.reason)
        self.by_decision[key] = self.by_decision.get(key, 0) + 1
        self.total += 1
        self.first_step = self.first_step or step
        self.last_step = step
        return self.total

    def by_path(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (path, _reason), n in sorted(self.by_decision.items()):
            out[path] = out.get(path, 0) + n
        return out

    def summary(self) -> str:
        """One line for the log: how many start-up batches there were, where they went."""
        if not self.total:
            return "no start-up batch of vLLM's reached the composite"
        paths = ", ".join(f"{p} {n}" for p, n in self.by_path().items())
        return (
            f"vLLM's start-up ran {self.total} batch(es) through the composite (steps {self.first_step}-"
            f"{self.last_step}: {paths}), counted apart, not in flyserve's serving counters"
        )
