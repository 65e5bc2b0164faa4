"""Sampled per-path kernel timing that never waits for the device.

1 in N calls of each kernel path is timed. On CUDA a pair of
``torch.cuda.Event(enable_timing=True)`` is recorded around the call on the current stream and
put on a bounded pending queue; later sampled calls harvest the queue's head with
``event.query()`` (a non-blocking cudaEventQuery) and read ``start.elapsed_time(end)`` only once
``end`` has completed, so nothing ever calls ``synchronize()`` or ``.item()``. While the stream
is capturing a CUDA graph nothing is recorded (an event recorded into a graph would be timed on
every replay and never harvested here). On a CPU path the call is timed with
``time.perf_counter_ns`` and observed at once.

Each timing is observed into ``flyserve_kernel_seconds{path,rank}``; a full queue (the GPU is
far behind, or nothing harvests) drops the new sample and counts it in
``flyserve_kernel_timer_dropped_total{path,rank}``. A timed call that also wins the span draw
(``random() < sampler.ratio``) becomes a ``flyserve.kernel`` span, created when the timing is
harvested, with explicit start (host wall clock when the call was enqueued) and end (start +
measured device time) timestamps.

torch is imported lazily (when a CUDA timer is built), never at module import.

Use from a step loop (one timer per rank process, bound per path once)::

    timer = KernelTimer(rank, every=16, clock="cuda", tracing=tracing)
    unified = timer.path("unified")          # pre-bound: no lookups per call
    for step in ...:
        for layer in layers:
            tok = unified.start()            # None unless this call is sampled
            out = attention(...)             # the kernel launch(es) of this path
            unified.stop(tok)                # records the end event; never waits
    timer.harvest()                          # optional: observe whatever has completed
    timer.close()                            # optional: drop what is still pending

``timer.path(p).call(fn, *args)`` wraps one call the same way.

Per-step mode (what a vLLM rank uses): the routing, once per engine step, calls
``timer.arm(step)`` when ``step >= timer.next_step`` (one int compare per step), and the forward
wrapper reads one attribute per call::

    tok = timer.forward_start(variant) if timer.armed else None   # the armed forward only
    out = attention(...)
    if tok is not None:
        timer.forward_stop(tok)

so one forward in ``every_steps`` steps is timed and any other forward that reads ``armed`` pays one
truth test. With ``step_source`` and ``on_step_timed`` set (the leader routing sets them), the timed
forward is tagged with the engine step it ran in and its harvested time goes to
``on_step_timed(step, path, seconds)``: the shape sample of that step takes it as ``kernel_s`` for
the sidecar's drift check (ShapeSampleWriter.add_kernel_time). In vLLM the forward that reads it is installed only on timed or prefill steps
(flyserve/vllm/forward_switch.py), so the other forwards pay nothing (benchmarks/test_bench_routing.py,
group forward-per-call).

Notes for an overhead loop: an unsampled call costs one int decrement and a None check (about
0.2 us on the 2-core CI VM); a sampled one records two events (reused from a pool, so steady
state allocates none) and first harvests completed ones, so the work is on 1 in ``every`` calls.
The first call of each path is timed, so the histogram has data from the first step. Call
everything from the thread that launches the kernels (no lock). Safe under
``torch.cuda.set_sync_debug_mode("error")`` and inside ``torch.cuda.graph`` capture: checked on
an H200 by tests/gpu/test_telemetry_gpu_timer_cuda.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from random import random
from typing import Any, Final, Protocol

from flyserve.policy.vocabulary import PATHS, VARIANT
from flyserve.telemetry import metrics
from flyserve.telemetry.prom import value_of
from flyserve.telemetry.recorder import HistogramBinding
from flyserve.telemetry.tracing import KERNEL_SPAN, ROOT_CONTEXT, Tracing

DEFAULT_EVERY: Final = 16
DEFAULT_EVERY_STEPS: Final = 16
DEFAULT_MAX_PENDING: Final = 64
CLOCKS: Final = ("cuda", "host")


class TimingEvent(Protocol):
    """What the timer needs from an event (torch.cuda.Event(enable_timing=True) fits)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


class _Pending:
    __slots__ = ("end", "path", "span", "start", "step", "wall_ns")

    def __init__(
        self, path: _PathTimer, start: TimingEvent, end: TimingEvent, wall_ns: int, span: bool, step: int
    ):
        self.path = path
        self.start = start
        self.end = end
        self.wall_ns = wall_ns
        self.span = span
        self.step = step  # the engine step of a per-step timed forward; -1: not tagged


class _PathTimer:
    """The timer of one kernel path; bind it once (``KernelTimer.path``) and call start/stop."""

    __slots__ = ("_left", "_owner", "dropped", "every", "hist", "name", "rank_label")

    def __init__(self, owner: KernelTimer, name: str) -> None:
        self._owner = owner
        self.name = name
        self.every = owner.every
        self._left = 1  # time the first call: a series with data from the first step
        self.rank_label = owner.rank_label
        self._bind()

    def _bind(self) -> None:
        self.hist = HistogramBinding(metrics.KERNEL_SECONDS.labels(self.name, self.rank_label))
        self.dropped = value_of(metrics.KERNEL_TIMER_DROPPED.labels(self.name, self.rank_label)).inc

    def start(self) -> Any:
        """Before the call: None (not sampled: one int decrement) or a token for stop()."""
        self._left -= 1
        if self._left:
            return None
        self._left = self.every
        return self._owner._start(self)

    def stop(self, token: Any) -> None:
        """After the call (enqueued, not finished, on CUDA): never waits for the device."""
        if token is not None:
            self._owner._stop(self, token)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        tok = self.start()
        out = fn(*args, **kwargs)
        if tok is not None:
            self._owner._stop(self, tok)
        return out


class KernelTimer:
    """Times 1 in ``every`` calls of each kernel path of one rank.

    clock: "cuda" (events on the current stream), "host" (perf_counter_ns; CPU kernels),
    or "auto" (cuda when torch is imported and CUDA is available, else host).
    max_pending: CUDA timings waiting for their events; beyond it new samples are dropped.
    event_factory / is_capturing: injectable for tests (fake events); default torch.cuda's.
    """

    def __init__(
        self,
        rank: int,
        *,
        every: int = DEFAULT_EVERY,
        max_pending: int = DEFAULT_MAX_PENDING,
        clock: str = "auto",
        tracing: Tracing | None = None,
        event_factory: Callable[[], TimingEvent] | None = None,
        is_capturing: Callable[[], bool] | None = None,
        every_steps: int = DEFAULT_EVERY_STEPS,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.rank = int(rank)
        self.rank_label = str(self.rank)
        self.every = int(every)
        self.max_pending = int(max_pending)
        self.tracing = tracing
        self._sampler = tracing.sampler if tracing is not None else None
        self.clock = self._pick_clock(clock, event_factory)
        self._event_factory = event_factory
        self._is_capturing = is_capturing
        if self.clock == "cuda" and (event_factory is None or is_capturing is None):
            import torch  # lazy: only a CUDA timer needs it

            if event_factory is None:
                self._event_factory = lambda: torch.cuda.Event(enable_timing=True)
            if is_capturing is None:
                self._is_capturing = torch.cuda.is_current_stream_capturing
        self._pending: deque[_Pending] = deque()
        # Spare events (completed pairs are reused): steady state allocates no event.
        self._spare: list[TimingEvent] = []
        metrics.precreate_rank_series(self.rank_label)
        self._gen = metrics._BACKEND.generation
        self._paths = {p: _PathTimer(self, p) for p in PATHS}
        self._by_variant = tuple(self._paths[p] for p in sorted(PATHS, key=VARIANT.__getitem__))
        # Per-step mode (the vLLM ranks'): the routing arms the timer once per ``every_steps``
        # engine steps and the forward wrapper reads ``armed`` once per call, nothing else.
        self.every_steps = int(every_steps)
        self.forwards_per_step = 1  # the routing sets its layer count: the timed layer rotates
        self.next_step = 1  # time the first step: the histogram has data from the start
        self.armed = 0  # 0: no forward of this step is timed; k > 0: the k-th forward from now is
        self._rotation = 0
        # Step-tagged timings for the drift check (set by the leader routing): ``step_source.step``
        # is read once, when the armed forward starts (the step it really ran in: an armed forward
        # a CUDA-graph replay skipped runs in a later step), and ``on_step_timed(step, path,
        # seconds)`` is called when that timing is harvested. Other calls pay nothing.
        self.step_source: Any = None
        self.on_step_timed: Callable[[int, str, float], None] | None = None
        self._timing_step = -1

    @staticmethod
    def _pick_clock(clock: str, event_factory: Any) -> str:
        if clock not in (*CLOCKS, "auto"):
            raise ValueError(f"clock must be one of {(*CLOCKS, 'auto')}, got {clock!r}")
        if clock != "auto":
            return clock
        if event_factory is not None:
            return "cuda"
        import sys

        torch = sys.modules.get("torch")  # never import torch just to find out
        return "cuda" if torch is not None and torch.cuda.is_available() else "host"

    def path(self, name: str) -> _PathTimer:
        """The pre-bound timer of kernel path ``name`` (unified or prefill)."""
        try:
            return self._paths[name]
        except KeyError:
            raise ValueError(f"unknown kernel path {name!r}; expected one of {PATHS}") from None

    @property
    def pending(self) -> int:
        return len(self._pending)

    # -- per-step mode ---------------------------------------------------------------------

    def arm(self, step: int) -> None:
        """Time one forward of this step (the routing calls this when ``step >= next_step``).

        The timed forward rotates over the first ``forwards_per_step`` forwards of successive
        timed steps, so every layer of the leader's group is sampled in turn. A step whose armed
        forward never comes (a CUDA-graph replay calls no forward) hands it on to the next
        forwards; the next arm() starts over.
        """
        self.next_step = step + self.every_steps
        r = self._rotation
        self.armed = r + 1
        r += 1
        self._rotation = 0 if r >= self.forwards_per_step else r

    def forward_start(self, variant: int) -> Any:
        """Called by the forward wrapper only while ``armed``: None, or a token for forward_stop."""
        self.armed -= 1
        if self.armed:
            return None
        p = self._by_variant[variant]
        src = self.step_source
        self._timing_step = -1 if src is None else src.step
        tok = self._start(p)
        self._timing_step = -1
        return None if tok is None else (p, tok)

    def forward_stop(self, token: Any) -> None:
        """After the timed forward (enqueued, not finished, on CUDA): never waits for the device."""
        self._stop(token[0], token[1])

    # -- sampled calls only below ----------------------------------------------------------

    def _rebind_if_needed(self) -> None:
        if self._gen != metrics._BACKEND.generation:
            metrics.precreate_rank_series(self.rank_label)
            self._gen = metrics._BACKEND.generation
            for p in self._paths.values():
                p._bind()

    def _want_span(self) -> bool:
        s = self._sampler
        return s is not None and bool(s.ratio) and random() < s.ratio

    def _start(self, p: _PathTimer) -> Any:
        self._rebind_if_needed()
        if self.clock == "host":
            return (time.perf_counter_ns(), time.time_ns() if self._want_span() else 0, self._timing_step)
        assert self._is_capturing is not None and self._event_factory is not None
        if self._is_capturing():
            # Checked before harvesting too: an event query during a global-mode capture is an
            # unsafe call that invalidates the capture.
            return None
        if self._pending:
            self.harvest()
        if len(self._pending) >= self.max_pending:
            p.dropped(1)
            return None
        spare = self._spare
        start = spare.pop() if spare else self._event_factory()
        start.record()
        return (start, time.time_ns() if self._want_span() else 0, self._timing_step)

    def _stop(self, p: _PathTimer, token: Any) -> None:
        if self.clock == "host":
            t0, wall, step = token
            ns = time.perf_counter_ns() - t0
            self._observe(p, ns * 1e-9, wall, ns, step)
            return
        start, wall, step = token
        spare = self._spare
        end = spare.pop() if spare else self._event_factory()  # type: ignore[misc]
        end.record()
        self._pending.append(_Pending(p, start, end, wall, wall != 0, step))

    def harvest(self) -> int:
        """Observe every pending timing whose end event has completed, oldest first; returns how many.

        Never blocks: stops at the first entry whose end event's query() is False (one stream per
        rank: events complete in the order they were recorded)."""
        q = self._pending
        n = 0
        while q:
            e = q[0]
            if not e.end.query():
                break
            q.popleft()
            ms = e.start.elapsed_time(e.end)
            self._spare.append(e.start)
            self._spare.append(e.end)
            self._observe(e.path, ms * 1e-3, e.wall_ns if e.span else 0, int(ms * 1e6), e.step)
            n += 1
        return n

    def _observe(self, p: _PathTimer, seconds: float, wall_ns: int, dur_ns: int, step: int = -1) -> None:
        p.hist.observe(seconds)
        if step >= 0 and self.on_step_timed is not None:
            self.on_step_timed(step, p.name, seconds)  # joined with that step's shape sample
        if wall_ns and self.tracing is not None:
            self.tracing.tracer.start_span(
                KERNEL_SPAN,
                context=ROOT_CONTEXT,
                start_time=wall_ns,
                attributes={
                    "flyserve.path": p.name,
                    "flyserve.rank": self.rank,
                    "flyserve.clock": self.clock,
                    "flyserve.kernel_seconds": seconds,
                },
            ).end(end_time=wall_ns + dur_ns)

    def close(self) -> int:
        """Forget what is still pending (never waits); returns how many were dropped."""
        n = len(self._pending)
        self._pending.clear()
        return n
