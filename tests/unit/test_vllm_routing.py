"""FlyserveRouting with fake vLLM metadata: decisions, step counting, eligibility, circuit, control.

No engine here (tests/e2e runs real vLLM); vllm is imported only for its attention-utils helper.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from flyserve.control import ControlPlane
from flyserve.policy import (
    ADMITTED,
    CIRCUIT_OPEN,
    NO_PREFILL_ROWS,
    PREFILL,
    UNIFIED,
    UNSUPPORTED,
    BatchShape,
    decide,
)
from flyserve.thresholds_files import load_profile
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.routing import routing_class
from flyserve.vllm.runtime import RankRuntime

HEADS = 4
HEAD_SIZE = 32


class FakeRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.circuit: list[bool] = []

    def record(self, decision, shape, step, version) -> None:
        self.calls.append((decision, shape, step, version))

    def record_decode(self, decision, num_reqs, num_tokens, max_query_len, max_seq_len, heads, step, version):
        """A decode-only step, kept as the BatchShape it stands for (every row a decode row)."""
        shape = BatchShape(num_reqs, num_tokens, max_query_len, max_seq_len, heads, True, num_reqs, num_reqs)
        self.calls.append((decision, shape, step, version))

    def set_circuit_open(self, is_open: bool) -> None:
        self.circuit.append(is_open)


def layer(**impl_fields):
    impl = SimpleNamespace(
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        alibi_slopes=None,
        sinks=None,
        logits_soft_cap=0,
        sliding_window=-1,
        kv_cache_dtype="auto",
    )
    for k, v in impl_fields.items():
        setattr(impl, k, v)
    return SimpleNamespace(impl=impl, sliding_window=None)


def vllm_config(layers: dict, dtype: str = "bfloat16"):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype=dtype, get_num_attention_heads=lambda parallel: HEADS),
        parallel_config=SimpleNamespace(),
    )


def metadata(query_lens, seq_lens, causal=True):
    q = np.asarray(query_lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    s = np.asarray(seq_lens, dtype=np.int32)
    return SimpleNamespace(  # the fields of vLLM's CommonAttentionMetadata that the routing reads
        query_start_loc_cpu=qsl,
        num_reqs=int(q.size),
        max_query_len=int(q.max()) if q.size else 0,
        max_seq_len=int(s.max()),
        num_actual_tokens=int(q.sum()),
        causal=causal,
        seq_lens=s,
        seq_lens_cpu_upper_bound=None,
    )


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    monkeypatch.delenv("FLYSERVE_FORCE_PATH", raising=False)
    monkeypatch.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    yield tmp_path / "state"
    RankRuntime.reset_for_tests()


def make(state_dir, *, layers=None, decode_path="unified", runtime=None, **rt_kw):
    rt = runtime or RankRuntime(state_dir=state_dir, rank=0, start=False, setup_metrics=False, **rt_kw)
    rt.recorder = FakeRecorder()
    cls = routing_class(PrefillKernelSpec("test-prefill"), decode_path)
    layers = layers or {"model.layers.0.attn": layer(), "model.layers.1.attn": layer()}
    return rt, cls(list(layers), vllm_config(layers), runtime=rt)


MIXED = ([1, 1, 200], [300, 120, 200])  # 2 decode rows + one 200-token chunk: admitted on cpu-tiny
DECODE = ([1, 1, 1], [300, 120, 50])


def test_decisions_equal_decide_on_random_batches(state):
    rt, r = make(state)
    t = load_profile("cpu-tiny")
    rng = random.Random(1)
    seen = set()
    for step in range(1, 401):
        n = rng.randint(1, 12)
        q = [rng.choice([1, 1, 1, rng.randint(2, 256)]) for _ in range(n)]
        s = [qi + rng.randint(0, 600) for qi in q]
        md = metadata(q, s)
        variant = r.select(md)
        expected = decide(BatchShape.from_query_lens(q, max_seq_len=max(s), num_heads=HEADS, thresholds=t), t)
        assert r.last_decision is expected  # interned: same object
        assert variant == expected.variant
        d, shape, st, version = rt.recorder.calls[-1]
        assert (d, st, version) == (expected, step, 0)
        assert shape.num_actual_tokens == sum(q) and shape.num_heads == HEADS
        seen.add((expected.path, expected.reason))
    assert {p for p, _ in seen} == {UNIFIED, PREFILL}  # the batches exercised both paths


def test_one_step_counts_once_across_attention_groups(state):
    rt, leader = make(state)
    cls = type(leader)
    groups = {"model.layers.1.attn": layer()}
    other = cls(list(groups), vllm_config(groups), runtime=rt)
    assert leader.is_leader and not other.is_leader
    for _ in range(5):
        leader.select(metadata(*MIXED))
        other.select(metadata(*MIXED))
    assert rt.step == 5
    assert [c[2] for c in rt.recorder.calls] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "fields,problem",
    [
        ({"alibi_slopes": [0.5]}, "alibi"),
        ({"sinks": object()}, "sinks"),
        ({"logits_soft_cap": 30.0}, "soft-cap"),
        ({"sliding_window": 128}, "sliding window"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "quantised KV cache"),
        ({"scale": 0.5}, "softmax scale"),
    ],
)
def test_static_eligibility_reports_unsupported(state, fields, problem):
    layers = {"model.layers.0.attn": layer(), "model.layers.1.attn": layer(**fields)}
    _rt, r = make(state, layers=layers)
    assert r.unsupported and any(problem in p for p in r.problems)
    r.select(metadata(*MIXED))
    assert (r.last_decision.path, r.last_decision.reason) == (UNIFIED, UNSUPPORTED)
    r.select(metadata(*DECODE))  # no prefill row: the usual reason, the capture variant
    assert (r.last_decision.path, r.last_decision.reason) == (UNIFIED, NO_PREFILL_ROWS)


def test_fp32_model_and_head_size_are_unsupported(state):
    layers = {"l0": layer()}
    rt = RankRuntime(state_dir=state, rank=0, start=False, setup_metrics=False)
    rt.recorder = FakeRecorder()
    cls = routing_class(PrefillKernelSpec("k", head_sizes=(64, 128)), "unified")
    r = cls(list(layers), vllm_config(layers, dtype="float32"), runtime=rt)
    assert any("dtype float32" in p for p in r.problems) and any("head size 32" in p for p in r.problems)


def test_eligible_group_is_admitted(state):
    _rt, r = make(state)
    assert not r.problems
    r.select(metadata(*MIXED))
    assert (r.last_decision.path, r.last_decision.reason) == (PREFILL, ADMITTED)


def test_threshold_change_applies_at_its_effective_step(state):
    rt, r = make(state)
    r.select(metadata(*MIXED))
    assert r.last_decision.path == PREFILL
    res = ControlPlane(state, profile="cpu-tiny").apply_overrides({"min_seq_len": 1000}, actor="test")
    eff = res.snapshot.effective_step
    rt.control.poll()  # the rank thread's round, run by hand
    while rt.step + 1 < eff:
        r.select(metadata(*MIXED))
        assert r.last_decision.path == PREFILL  # not yet
    r.select(metadata(*MIXED))
    assert rt.step == eff and r.last_decision.reason == "short_context"
    assert rt.recorder.calls[-1][3] == res.snapshot.version


def test_circuit_breaker_local_then_control_plane_then_operator_closes(state):
    from flyserve.vllm.breaker import trip

    rt, r = make(state)
    r.select(metadata(*MIXED))
    trip(rt, RuntimeError("boom"), kernel="test-prefill")
    assert rt.local_circuit_open and rt.recorder.circuit[-1] is True
    r.select(metadata(*MIXED))
    assert (r.last_decision.path, r.last_decision.reason) == (UNIFIED, CIRCUIT_OPEN)
    r.select(metadata(*DECODE))
    assert r.last_decision.reason == NO_PREFILL_ROWS
    plane = ControlPlane(state, profile="cpu-tiny")
    snap = plane.snapshot()
    assert snap.circuit_open and "boom" in snap.circuit_reason
    trip(rt, RuntimeError("again"), kernel="test-prefill")  # reported once only
    assert plane.snapshot().version == snap.version
    # The operator closes it: every rank goes back to the prefill path at the effective step.
    closed = plane.set_circuit(False, actor="operator")
    rt.control.poll()
    for _ in range(closed.snapshot.effective_step + 2):
        r.select(metadata(*MIXED))
    assert (r.last_decision.path, r.last_decision.reason) == (PREFILL, ADMITTED)
    assert not rt.local_circuit_open


def test_forced_path(state, monkeypatch):
    monkeypatch.setenv("FLYSERVE_FORCE_PATH", "prefill")
    _rt, r = make(state)
    r.select(metadata([1, 5], [10, 5]))  # decide: unified (short context) -> forced prefill
    assert r.last_decision.path == PREFILL and r.last_decision.reason == "short_context"
    r.select(metadata(*DECODE))  # decode-only batches keep the capture variant
    assert r.last_decision.path == UNIFIED
    monkeypatch.setenv("FLYSERVE_FORCE_PATH", "sideways")
    with pytest.raises(ValueError, match="FLYSERVE_FORCE_PATH"):
        RankRuntime(state_dir=state, rank=0, start=False, setup_metrics=False)


def test_capture_variant_is_the_decode_path(state):
    rt, r = make(state, decode_path="prefill")
    assert type(r).capture_variant == 1
    r.select(metadata(*DECODE))
    assert r.last_decision.path == PREFILL and r.last_decision.reason == NO_PREFILL_ROWS
    _, u = make(state, runtime=rt)
    assert type(u).capture_variant == 0
    with pytest.raises(ValueError, match="decode_path"):
        routing_class(PrefillKernelSpec("k"), "sideways")


def test_non_causal_batches_stay_unified(state):
    _rt, r = make(state)
    r.select(metadata(*MIXED, causal=False))
    assert (r.last_decision.path, r.last_decision.reason) == (UNIFIED, "not_causal")


def test_shape_log_is_a_loadable_trace(state, tmp_path, monkeypatch):
    from flyserve.lab.workloads import load_trace

    log_path = tmp_path / "shapes-{rank}.jsonl"
    monkeypatch.setenv("FLYSERVE_SHAPE_LOG", str(log_path))
    rt, r = make(state)
    batches = [MIXED, DECODE, ([3, 40], [50, 40])]
    for q, s in batches:
        r.select(metadata(q, s))
    rt.shape_log.close()
    path = tmp_path / "shapes-0.jsonl"
    trace = load_trace(path)
    assert [list(st.query_lens) for st in trace] == [q for q, _ in batches]
    assert [list(st.seq_lens) for st in trace] == [s for _, s in batches]
    lines = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    assert [x["path"] for x in lines] == [PREFILL, UNIFIED, UNIFIED]


def test_shape_log_skips_steps_without_host_seq_lens(state, tmp_path, monkeypatch, caplog):
    """A vLLM whose seq_lens live only on the device (no seq_lens_cpu_upper_bound): no shape-log
    line (that would be a device read), one warning, and the step is still routed."""
    import logging

    monkeypatch.setenv("FLYSERVE_SHAPE_LOG", str(tmp_path / "shapes-{rank}.jsonl"))
    rt, r = make(state)
    appended = []
    rt.shape_log.append = lambda *a: appended.append(a)
    on_device = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    with caplog.at_level(logging.WARNING, logger="flyserve.vllm"):
        for q, s in (MIXED, DECODE):
            md = metadata(q, s)
            md.seq_lens = on_device
            r.select(md)
    assert appended == []
    assert [m for m in caplog.messages if "no host copy of seq_lens" in m] == [
        "flyserve shape log: no host copy of seq_lens in this vLLM; not logging"
    ]
    assert r.last_decision.path == UNIFIED  # routed all the same


def test_select_hot_path_benchmark(state, benchmark):
    """select() with the real DispatchRecorder on a 16-row mixed batch (pytest-benchmark table with
    --benchmark-enable; a plain single run otherwise)."""
    import torch

    rt = RankRuntime(state_dir=state, rank=0, start=False, setup_metrics=False)
    cls = routing_class(PrefillKernelSpec("test-prefill"), "unified")
    layers = {"l0": layer()}
    r = cls(list(layers), vllm_config(layers), runtime=rt)
    q = [1] * 14 + [120, 200]
    seqs = [300] * 14 + [120, 200]
    md = metadata(q, seqs)
    md.query_start_loc_cpu = torch.from_numpy(md.query_start_loc_cpu)  # what vLLM passes
    variant = benchmark(r.select, md)
    # The answer decide() gives on the same batch and thresholds, computed here without select().
    t = load_profile("cpu-tiny")
    expected = decide(BatchShape.from_query_lens(q, max_seq_len=max(seqs), num_heads=HEADS, thresholds=t), t)
    assert variant == expected.variant
    assert r.last_decision is expected


def test_shape_sample_feeds_the_sidecars_dry_run(state):
    """The leader puts 1 step in 8 into the dry-run sample; flushed, the sidecar's reader gets the
    exact row lengths vLLM passed, and a dry run over them predicts the same routing decide() makes."""
    from flyserve.telemetry.shape_sample import read_shape_samples, routing_change

    rt, r = make(state)
    for _ in range(32):
        r.select(metadata(*MIXED))
    rt.shape_sample.flush()
    samples = read_shape_samples(rt.state_dir.path, limit=100)
    assert [s.step for s in samples] == [32, 24, 16, 8]
    assert all(s.query_lens == tuple(MIXED[0]) and s.max_seq_len == max(MIXED[1]) for s in samples)
    assert all(s.num_heads == HEADS for s in samples)
    # What the sidecar's live pricing needs: the rows' context lengths, the path run, when, the layer.
    assert all(s.seq_lens == tuple(MIXED[1]) and s.path == PREFILL for s in samples)
    assert all(s.time is not None and s.head_size == HEAD_SIZE for s in samples)
    t = load_profile("cpu-tiny")
    change = routing_change(samples, t, t.merged({"prefill_enabled": False}))
    assert change["current"] == {"unified": 0, "prefill": 4}
    assert change["proposed"] == {"unified": 4, "prefill": 0}


def test_forced_prefill_keeps_non_causal_and_unsupported_batches_on_unified(state, monkeypatch):
    """FLYSERVE_FORCE_PATH=prefill overrides thresholds, never what the causal kernel cannot do:
    the FlyDSL forward has no causal guard, so a forced non-causal batch would get causal attention."""
    monkeypatch.setenv("FLYSERVE_FORCE_PATH", "prefill")
    _rt, r = make(state)
    r.select(metadata(*MIXED, causal=False))
    assert (r.last_decision.path, r.last_decision.reason) == (UNIFIED, "not_causal")
    r.select(metadata(*MIXED))  # a causal batch is still forced
    assert r.last_decision.path == PREFILL
    _, bad = make(state, layers={"l0": layer(alibi_slopes=[1.0])})
    bad.select(metadata(*MIXED))
    assert (bad.last_decision.path, bad.last_decision.reason) == (UNIFIED, UNSUPPORTED)


@pytest.mark.parametrize("force", [None, "prefill"])
def test_batches_past_the_kernels_kv_limit_take_unified_whatever_max_seq_len_says(state, monkeypatch, force):
    """FlyDSL raises NotImplementedError past 2048 64-token KV tiles per split (131072 tokens): with
    max_seq_len 0 (no operator limit) such a batch must not reach it and open the circuit."""
    from flyserve.vllm.flydsl_kernel import FLYDSL_SPEC, MAX_KV_LEN

    if force:
        monkeypatch.setenv("FLYSERVE_FORCE_PATH", force)
    ControlPlane(state, profile="cpu-tiny").apply_overrides({"max_seq_len": 0}, actor="test")  # no limit
    rt = RankRuntime(state_dir=state, rank=0, start=False, setup_metrics=False)
    rt.recorder = FakeRecorder()
    layers = {"model.layers.0.attn": layer(head_size=128, scale=128**-0.5)}
    r = routing_class(FLYDSL_SPEC, "unified")(list(layers), vllm_config(layers), runtime=rt)
    assert rt.control.current(1).thresholds.max_seq_len == 0
    r.select(metadata([1, 1, 200], [300, 120, MAX_KV_LEN]))  # at the limit: the kernel takes it
    assert r.last_decision.path == PREFILL
    r.select(metadata([1, 1, 200], [300, 120, MAX_KV_LEN + 1]))
    assert (r.last_decision.path, r.last_decision.reason) == (UNIFIED, "context_too_long")


def test_shape_sample_rate_from_the_environment(state, monkeypatch):
    from flyserve.vllm.runtime import _shape_sample_every

    monkeypatch.setenv("FLYSERVE_SHAPE_SAMPLE_EVERY", "1")
    assert _shape_sample_every() == 1
    monkeypatch.delenv("FLYSERVE_SHAPE_SAMPLE_EVERY")
    assert _shape_sample_every() == 8
    for bad in ("0", "-3", "eight"):
        monkeypatch.setenv("FLYSERVE_SHAPE_SAMPLE_EVERY", bad)
        with pytest.raises(ValueError, match="FLYSERVE_SHAPE_SAMPLE_EVERY"):
            _shape_sample_every()


def test_kernel_timer_rate_from_the_environment_is_checked_by_name(state, monkeypatch):
    """A typo in $FLYSERVE_KERNEL_TIMER_EVERY stops the rank with the variable's name, as every
    number a rank reads from its environment does (it was a bare int(): a ValueError with no name)."""
    from flyserve.vllm.runtime import _kernel_timer

    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    assert _kernel_timer(0, None) is None  # 0: timing off
    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "4")
    assert _kernel_timer(0, None) is not None
    for bad in ("-1", "sixteen", "9" * 5000):
        monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", bad)
        with pytest.raises(ValueError, match="FLYSERVE_KERNEL_TIMER_EVERY") as e:
            _kernel_timer(0, None)
        assert len(str(e.value)) < 200
