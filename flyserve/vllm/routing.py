"""FlyserveRouting: the CompositeAttentionRouting that asks the policy, per batch.

vLLM's composite builder calls ``select(common_attn_metadata)`` once per engine step per
attention group, on the host, before the forward pass, also when the step replays a CUDA
graph; graph capture itself goes through ``build_for_cudagraph_capture`` and takes
``capture_variant`` without calling select(). So this is where decisions are made and counted.

The hot path (select) is: one int compare in RankControl.current(step); on a decode-only step
(``max_query_len`` below the decode bound, most serving steps) nothing else but the recorder's
pre-bound stores (``record_decode``); on any other step one count of the decode rows over a kept
numpy view of ``query_start_loc_cpu`` (host memory, host_view.py), decide(), and ``record``. No
device tensor is read, nothing is synchronised, no label is looked up, nothing is written to disk.
docs/performance.md section 11 has the per-part costs.

New-step detection: the first routing object built in a process (attention group 0, the leader)
advances the step counter; vLLM builds every group's metadata exactly once per step, so the other
groups see the same step number. Only the leader records, so a step counts once however many
attention groups the model has.

vLLM's start-up batches (its memory profile, warm-ups and, from 0.34, KV-cache sizing steps) come
through select() too. Until the engine core's first serving step (startup_phase.py) the leader
counts them in the rank's start-up tally instead: one bool read per step on the leader.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

import numpy as np

from flyserve.policy import (
    CIRCUIT_OPEN,
    CONTEXT_TOO_LONG,
    NO_PREFILL_ROWS,
    NOT_CAUSAL,
    PREFILL,
    UNIFIED,
    UNSUPPORTED,
    BatchShape,
    decide,
    decision_for,
)
from flyserve.policy.rules import ShortRowsNotCounted, lpt_rule
from flyserve.policy.shape import FEW_ROWS, int_bound
from flyserve.policy.vocabulary import VARIANT
from flyserve.vllm.eligibility import PrefillKernelSpec, group_problems
from flyserve.vllm.forward_switch import SWITCH
from flyserve.vllm.host_view import HostView
from flyserve.vllm.runtime import RankRuntime
from flyserve.vllm.startup_phase import STARTUP_BATCH_LIMIT

log = logging.getLogger("flyserve.vllm")

# tuple.__new__(BatchShape, values): the NamedTuple's generated __new__ is a Python frame around it.
_tuple_new = tuple.__new__


def _layers(vllm_config: Any, layer_names: list[str]) -> list[Any]:
    ctx = vllm_config.compilation_config.static_forward_context
    return [ctx[n] for n in layer_names if n in ctx]


def _num_heads(vllm_config: Any, layers: list[Any]) -> int:
    """Query heads per rank for this group (the occupancy rule counts heads x tokens): the layers'
    own count, as vLLM's get_num_attention_heads_from_layers reads it, else the model-wide one."""
    heads = {getattr(getattr(layer, "impl", layer), "num_heads", None) for layer in layers}
    heads.discard(None)
    if len(heads) == 1:
        return int(heads.pop())
    return int(vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config))


def decode_fast_path(t: Any, capture_variant: int) -> tuple[int, Any]:
    """(bound, decision): a batch whose ``max_query_len`` is below ``bound`` has only decode rows
    (``max_query_len <= decode_query_len_max < min_query_len``) and takes ``decision``, the capture
    variant with reason no_prefill_rows, as decide() plus select()'s capture override give it.

    Bound 0 (never taken) when that decision would depend on the rows: a prefill capture variant
    whose LPT ordering is left to the rule (``lpt: auto``).
    """
    if not capture_variant:
        return t.decode_query_len_max + 1, decision_for(UNIFIED, NO_PREFILL_ROWS)
    if t.lpt == "auto":
        return 0, decision_for(PREFILL, NO_PREFILL_ROWS, False)
    return t.decode_query_len_max + 1, decision_for(PREFILL, NO_PREFILL_ROWS, t.lpt == "always")


class FlyserveRouting:
    """Implements vLLM's ``CompositeAttentionRouting`` protocol (structurally).

    Per-platform subclasses (``routing_class``) fix ``capture_variant`` (the start-time profile's
    decode_path) and ``prefill_spec`` (what the causal kernel accepts, for static eligibility).
    """

    capture_variant: ClassVar[int] = VARIANT[UNIFIED]
    prefill_spec: ClassVar[PrefillKernelSpec] = PrefillKernelSpec("prefill")

    def __init__(
        self, layer_names: list[str], vllm_config: Any, *, runtime: RankRuntime | None = None
    ) -> None:
        self.rt = runtime if runtime is not None else RankRuntime.get()
        self.layer_names = list(layer_names)
        if self.rt.leader is None:
            self.rt.leader = self
        self.is_leader = self.rt.leader is self
        layers = _layers(vllm_config, layer_names)
        if self.is_leader:
            SWITCH.timer = self.rt.kernel_timer  # the checked forward times with it
            if self.rt.kernel_timer is not None:
                # The timed forward rotates over the leader group's layers (KernelTimer.arm).
                self.rt.kernel_timer.forwards_per_step = max(1, len(layers))
                # Drift: a timed step's harvested time joins that step's shape sample (ShapeSampleWriter).
                self.rt.kernel_timer.step_source = self.rt
                # And a timed step inside a trial's block adds to that block (the autopilot's pairs).
                self.rt.kernel_timer.on_step_timed = self.rt.on_step_timed
        self.num_heads = _num_heads(vllm_config, layers)
        self.problems = group_problems(layers, vllm_config.model_config.dtype, self.prefill_spec)
        self.unsupported = bool(self.problems)
        self.max_kv_len = self.prefill_spec.max_kv_len
        if self.unsupported:
            log.warning(
                "flyserve: layers %s cannot use the %s kernel (%s): their prefill batches take the "
                "unified path, reason 'unsupported'",
                self.layer_names[:2] + (["..."] if len(self.layer_names) > 2 else []),
                self.prefill_spec.name,
                "; ".join(self.problems),
            )
        if self.is_leader:  # what a cost table must match (the sidecar checks it before pricing)
            head_sizes = {getattr(getattr(x, "impl", x), "head_size", None) for x in layers} - {None}
            cache = getattr(vllm_config, "cache_config", None)
            self.rt.shape_sample.set_layer(
                head_size=head_sizes.pop() if len(head_sizes) == 1 else None,
                block_size=getattr(cache, "block_size", None),
            )
        self._last_snapshot: Any = None
        self._decode_below = 0  # max_query_len below this: the decode fast path (set per snapshot)
        self._decode_decision = decision_for(UNIFIED, "no_prefill_rows")
        self._decode_bound = int_bound(1)  # set per snapshot (_on_new_snapshot)
        self._next_sample = self.rt.shape_sample_every  # the step of the next dry-run shape sample
        # numpy views of vLLM's persistent CPU buffers, kept across steps (host_view.py)
        self._qsl = HostView()
        self._seq = HostView()
        self._qsl_view = self._qsl.view  # (tests and scripts/gpu/overhead_loop.py time it alone)
        self.last_decision = decision_for(UNIFIED, "no_prefill_rows")
        self._warned_no_seq_lens = False

    # ------------------------------------------------------------------ hot path

    def select(self, metadata: Any) -> int:
        rt = self.rt
        if self.is_leader:
            rt.step += 1
        step = rt.step
        snap = rt.control.current(step)
        if snap is not self._last_snapshot:
            self._on_new_snapshot(snap)  # rare: once per applied version (breaker, circuit gauge)
        mql = metadata.max_query_len
        if mql < self._decode_below:
            # Decode-only (every row a decode row): the capture variant, decided from host ints with
            # no array touched. decide() gives the same (tests/unit/test_vllm_routing_fast_path.py).
            d = self._decode_decision
            shape = lens = None
        else:
            t = snap.thresholds
            n = metadata.num_reqs
            qsl = metadata.query_start_loc_cpu
            if n > FEW_ROWS and qsl.__class__ is not np.ndarray:
                # Most steps with a prefill row: the row lengths from the kept slices of vLLM's
                # buffer (host_view.py), one count; the shape BatchShape.from_step would build
                # (which also counts, rather than skip, when max_query_len <= decode_query_len_max:
                # the same count, reached only with a prefill capture variant and lpt auto).
                lens = self._qsl.lens(qsl, n)
                qsl = None
                shape = _tuple_new(
                    BatchShape,
                    (
                        n,
                        metadata.num_actual_tokens,
                        mql,
                        metadata.max_seq_len,
                        self.num_heads,
                        metadata.causal is True,
                        int(np.count_nonzero(lens <= self._decode_bound)),
                        n if mql < t.block_m else -1,  # -1: not counted (the LPT rule asks)
                    ),
                )
            else:
                lens = None
                # The first n + 1 entries: vLLM's slice runs to num_reqs_padded + 1.
                qsl = qsl[: n + 1] if qsl.__class__ is np.ndarray else self._qsl.view(qsl, n + 1)
                shape = BatchShape.from_step(
                    qsl,
                    n,
                    metadata.num_actual_tokens,
                    mql,
                    metadata.max_seq_len,
                    self.num_heads,
                    metadata.causal is True,
                    t.decode_query_len_max,
                    t.block_m,
                )
            try:
                d = decide(shape, t)
                if d.lpt is not None or rt.forced is not None or mql < t.min_query_len:
                    d = self._adjust(d, shape, t, snap)  # a prefill decision, forced, or no prefill row
            except ShortRowsNotCounted:  # the LPT rule runs on this step: count the short rows
                if lens is None:
                    shape = shape.with_short_rows(qsl, t.block_m)
                else:
                    shape = shape._replace(num_short_query_rows=int(np.count_nonzero(lens < t.block_m)))
                d = self._adjust(decide(shape, t), shape, t, snap)
        self.last_decision = rt.last_decision = d  # the causal builder reads .lpt next
        if self.is_leader:
            if rt.serving:
                if shape is None:
                    rt.recorder.record_decode(
                        d,
                        metadata.num_reqs,
                        metadata.num_actual_tokens,
                        mql,
                        metadata.max_seq_len,
                        self.num_heads,
                        step,
                        snap.version,
                    )
                else:
                    rt.recorder.record(d, shape, step, snap.version)
                if step >= self._next_sample:  # the one check for the 1-in-N dry-run shape sample
                    self._next_sample = step + rt.shape_sample_every
                    self._add_shape_sample(metadata, step, d.path, lens)
                if rt.shape_log is not None:
                    self._log_shape(metadata, step, d, snap.version)
                timer = rt.kernel_timer
                if timer is not None and step >= timer.next_step:
                    timer.arm(step)  # one forward of this step is timed (KernelTimer.arm)
                    rt.note_timed_step(step, metadata.num_actual_tokens)
                # flyserve's checked forward only where a step needs it (forward_switch.py).
                if d.variant or (timer is not None and timer.armed):
                    if not SWITCH.checked:
                        SWITCH.set(True)
                elif SWITCH.checked:
                    SWITCH.set(False)
            else:  # vLLM's start-up (profile, warm-ups, sizing): counted apart (startup_phase.py)
                self._count_startup_batch(d, step)
        elif d.variant and not SWITCH.checked:  # another attention group's prefill step
            SWITCH.set(True)
        return d.variant

    def _adjust(self, d: Any, shape: BatchShape, t: Any, snap: Any) -> Any:
        """decide()'s decision, then what this process knows that the policy does not: the capture
        variant for batches with no prefill row, a forced path (never for a non-causal batch),
        static ineligibility, the kernel's own KV limit, an open circuit.
        (A unified decision for a batch with a prefill row, not forced, skips this call.)"""
        rt = self.rt
        if shape.max_query_len < t.min_query_len:
            # No prefill row: always the capture variant, whatever run-time thresholds say.
            if d.variant != self.capture_variant:
                d = decision_for(PREFILL if self.capture_variant else UNIFIED, d.reason, lpt_rule(shape, t))
            return d
        if rt.forced is not None and rt.forced != d.path and d.reason != NOT_CAUSAL:
            # Forcing overrides thresholds, never what the causal kernel cannot do (below too).
            d = decision_for(rt.forced, d.reason, lpt_rule(shape, t))
        if d.path == PREFILL:
            if self.unsupported:
                d = decision_for(UNIFIED, UNSUPPORTED)
            elif self.max_kv_len and shape.max_seq_len > self.max_kv_len:  # the kernel would raise
                d = decision_for(UNIFIED, CONTEXT_TOO_LONG)
            elif snap.circuit_open or rt.local_circuit_open:
                d = decision_for(UNIFIED, CIRCUIT_OPEN)
        return d

    # ------------------------------------------------------------------ rare paths

    def _count_startup_batch(self, d: Any, step: int) -> None:
        """A batch of vLLM's own start-up, not of serving: into the rank's start-up tally only, never the
        serving counters, the shape sample, the shape log or the kernel timer. Its prefill batches
        still run through flyserve's checked forward (the breaker guards a warm-up as it guards
        serving)."""
        rt = self.rt
        if rt.startup.count(d, step) > STARTUP_BATCH_LIMIT:
            log.warning(
                "flyserve rank %d: %d batches and vLLM has not started serving by flyserve's reckoning "
                "(no first step seen through its worker wrapper); counting every batch as serving from now",
                rt.rank,
                STARTUP_BATCH_LIMIT,
            )
            rt.start_serving(f"more than {STARTUP_BATCH_LIMIT} start-up batches")
        if d.variant:
            if not SWITCH.checked:
                SWITCH.set(True)
        elif SWITCH.checked:
            SWITCH.set(False)

    def _on_new_snapshot(self, snap: Any) -> None:
        """Once per applied version: keep the circuit gauge and the local breaker in step, and
        work out the decode fast path's bound and decision for these thresholds."""
        self._last_snapshot = snap
        rt = self.rt
        if rt.local_circuit_open and not snap.circuit_open and snap.version > rt.circuit_trip_version:
            # A version published after the trip, with the circuit closed: an operator closed it
            # (possibly together with the open version, if both arrived in one poll).
            rt.local_circuit_open = False
            rt.circuit_reported = False
            log.warning(
                "flyserve rank %d: circuit closed by the control plane (version %d)", rt.rank, snap.version
            )
        rt.recorder.set_circuit_open(snap.circuit_open or rt.local_circuit_open)
        self._decode_below, self._decode_decision = decode_fast_path(snap.thresholds, self.capture_variant)
        self._decode_bound = int_bound(snap.thresholds.decode_query_len_max)  # for the row count

    def _add_shape_sample(self, metadata: Any, step: int, path: str, lens: np.ndarray | None) -> None:
        """1 step in N: the rows' query and context lengths (what the sidecar's cost model prices),
        the path the step ran and when. Host copies only; unsampled steps never get here.
        ``lens``: the row lengths select() computed (a new array, never a view of vLLM's buffer),
        or None."""
        n = metadata.num_reqs
        if lens is None:
            qsl = metadata.query_start_loc_cpu
            if qsl.__class__ is np.ndarray:
                lens = qsl[1 : n + 1] - qsl[:n]
            else:
                lens = self._qsl.lens(qsl, n)
        seq = self._host_seq_lens(metadata, n)
        causal = metadata.causal
        self.rt.shape_sample.add(
            step, lens, int(metadata.max_seq_len), self.num_heads, causal is True, seq, path, time.time()
        )

    def _host_seq_lens(self, metadata: Any, n: int) -> np.ndarray | None:
        """A copy of the first ``n`` per-row context lengths, from host memory (never a device
        read), or None if this vLLM keeps none: ``seq_lens_cpu_upper_bound`` where it exists (a
        prefix of a persistent CPU buffer: read through a kept view), else ``seq_lens`` when it is
        on the CPU."""
        seq = getattr(metadata, "seq_lens_cpu_upper_bound", None)
        if seq is None:
            seq = metadata.seq_lens
            if getattr(getattr(seq, "device", None), "type", "cpu") != "cpu":
                return None
        if seq.__class__ is np.ndarray:
            return seq[:n].copy()
        if hasattr(seq, "data_ptr"):
            return self._seq.view(seq, n).copy()
        return np.asarray(seq)[:n].copy()

    def _log_shape(self, metadata: Any, step: int, d: Any, version: int) -> None:
        qsl = metadata.query_start_loc_cpu
        q = np.diff(qsl.numpy() if hasattr(qsl, "numpy") else np.asarray(qsl))
        s = self._host_seq_lens(metadata, q.size)
        if s is None:
            if not self._warned_no_seq_lens:
                self._warned_no_seq_lens = True
                log.warning("flyserve shape log: no host copy of seq_lens in this vLLM; not logging")
            return
        self.rt.shape_log.append(step, q, s, int(metadata.max_seq_len), d.path, d.reason, version)

    # ------------------------------------------------------------------ protocol statics

    @staticmethod
    def get_cudagraph_support(vllm_config: Any, kv_cache_spec: Any) -> Any:
        """Full graphs only for uniform single-token decode: those batches always take
        capture_variant, so a replay can never contradict the captured kernel."""
        from vllm.v1.attention.backend import AttentionCGSupport

        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @staticmethod
    def variant_uses_mm_prefix(variant: int) -> bool:
        return False


def routing_class(
    spec: PrefillKernelSpec, decode_path: str, *, name: str = "FlyserveRouting"
) -> type[FlyserveRouting]:
    """A FlyserveRouting subclass for one platform: its capture variant and prefill-kernel spec."""
    if decode_path not in VARIANT:
        raise ValueError(f"decode_path must be one of {list(VARIANT)}, got {decode_path!r}")
    return type(name, (FlyserveRouting,), {"capture_variant": VARIANT[decode_path], "prefill_spec": spec})
