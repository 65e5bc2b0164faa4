"""select()'s host-int fast paths decide exactly what decide() decides on the full shape.

select() reads vLLM's host ints (``num_reqs``, ``num_actual_tokens``, ``max_query_len``,
``max_seq_len``) first: a decode-only step touches no array, a mixed step counts only the rows a
rule or the recorder reads. These properties rebuild the full BatchShape from the row lengths
(``from_query_lens``, every count) and check select()'s decision and what it records against
decide() on it, over random batches and random thresholds, the fast path's boundaries included
(max_query_len == decode_query_len_max, == min_query_len - 1, == min_query_len, >= block_m,
zero-length padding rows, a padded num_actual_tokens, 0 rows).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from _support import lazy_module
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flyserve.policy import PREFILL, UNIFIED, BatchShape, Thresholds, decide, decision_for
from flyserve.policy.rules import ShortRowsNotCounted, lpt_rule
from flyserve.thresholds_files import load_profile
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.host_view import HostView
from flyserve.vllm.routing import routing_class
from flyserve.vllm.runtime import RankRuntime

torch = lazy_module("torch")  # imported when a test runs, not at collection

SEED = load_profile("gfx950")
HEADS = 4


class FakeRecorder:
    """Keeps what select() records: record()'s shape, or record_decode()'s ints as the BatchShape
    they stand for (every row a decode row, short rows not counted)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def record(self, decision, shape, step, version) -> None:
        self.calls.append((decision, shape, step, version))

    def record_decode(self, decision, num_reqs, num_tokens, max_query_len, max_seq_len, heads, step, version):
        shape = BatchShape(num_reqs, num_tokens, max_query_len, max_seq_len, heads, True, num_reqs, -1)
        self.calls.append((decision, shape, step, version))

    def set_circuit_open(self, is_open: bool) -> None:
        pass


def layer():
    impl = SimpleNamespace(
        num_heads=HEADS,
        head_size=32,
        scale=32**-0.5,
        alibi_slopes=None,
        sinks=None,
        logits_soft_cap=0,
        sliding_window=-1,
        kv_cache_dtype="auto",
    )
    return SimpleNamespace(impl=impl, sliding_window=None)


def vllm_config(layers: dict):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype="bfloat16", get_num_attention_heads=lambda parallel: HEADS),
        parallel_config=SimpleNamespace(),
    )


@st.composite
def thresholds_st(draw) -> Thresholds:
    dq = draw(st.integers(1, 4))
    min_seq = draw(st.integers(0, 4096))
    return SEED.merged(
        {
            "decode_query_len_max": dq,
            "min_query_len": dq + draw(st.integers(1, 4)),
            "block_m": 2 ** draw(st.integers(0, 9)),
            "min_qblock_rows": draw(st.integers(0, 64)),
            "min_seq_len": min_seq,
            "max_seq_len": draw(st.sampled_from([0, min_seq, min_seq + 2048, 131072])),
            "decode_rows_base": draw(st.integers(0, 16)),
            "decode_ctx_unit": draw(st.integers(1, 16384)),
            "lpt": draw(st.sampled_from(["auto", "always", "never"])),
            "lpt_qblocks_always": draw(st.integers(0, 8)),
            "lpt_qblocks_one_short": draw(st.integers(0, 8)),
            "lpt_min_short_rows": draw(st.integers(0, 8)),
            "lpt_qblocks_many_short_max": draw(st.integers(0, 8)),
            "prefill_enabled": draw(st.booleans()),
            "decode_path": draw(st.sampled_from(["unified", "prefill"])),
        }
    )


# Row lengths: mostly around the boundaries (0 = CUDA-graph padding, 1..5 = decode_query_len_max
# and min_query_len, powers of two = block_m), a few long chunks.
row_st = st.one_of(
    st.integers(0, 6), st.sampled_from([31, 32, 33, 255, 256, 257, 511, 512]), st.integers(0, 3000)
)
lens_st = st.lists(row_st, min_size=0, max_size=40)


def reference(lens: list[int], max_seq_len: int, causal: bool, t: Thresholds, capture_variant: int):
    """What select() must return: decide() on the full shape, then its capture-variant rule."""
    shape = BatchShape.from_query_lens(
        np.asarray(lens, dtype=np.int64),
        max_seq_len=max_seq_len,
        num_heads=HEADS,
        causal=causal,
        thresholds=t,
    )
    d = decide(shape, t)
    if shape.max_query_len < t.min_query_len and d.variant != capture_variant:
        d = decision_for(PREFILL if capture_variant else UNIFIED, d.reason, lpt_rule(shape, t))
    return d, shape


def step_metadata(lens: list[int], max_seq_len: int, causal: bool, pad_tokens: int = 0):
    q = np.asarray(lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    return SimpleNamespace(
        query_start_loc_cpu=qsl,
        num_reqs=len(lens),
        num_actual_tokens=int(q.sum()) + pad_tokens,
        max_query_len=int(q.max()) if len(lens) else 0,
        max_seq_len=max_seq_len,
        causal=causal,
        seq_lens=np.full(len(lens), max_seq_len, dtype=np.int32),
        seq_lens_cpu_upper_bound=None,
    )


class _Control:
    """RankControl's one hot-path call, with thresholds the test chooses per example."""

    def __init__(self) -> None:
        self.snapshot = SimpleNamespace(thresholds=SEED, version=0, circuit_open=False)

    def set(self, t: Thresholds) -> None:
        v = self.snapshot.version + 1
        self.snapshot = SimpleNamespace(thresholds=t, version=v, circuit_open=False)

    def current(self, step: int):
        return self.snapshot


@pytest.fixture(scope="module")
def routings(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    mp.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    mp.delenv("FLYSERVE_FORCE_PATH", raising=False)
    mp.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    rt = RankRuntime(state_dir=tmp_path_factory.mktemp("state"), rank=0, start=False, setup_metrics=False)
    rt.recorder = FakeRecorder()
    rt.control = _Control()
    layers = {"model.layers.0.attn": layer()}
    by_capture = {}
    for dp in ("unified", "prefill"):
        cls = routing_class(PrefillKernelSpec("test-prefill"), dp)
        by_capture[cls.capture_variant] = cls(list(layers), vllm_config(layers), runtime=rt)
    try:
        yield rt, by_capture
    finally:
        RankRuntime.reset_for_tests()
        mp.undo()


# vLLM's query_start_loc_cpu: a prefix slice of one persistent CPU buffer, rewritten every step.
@functools.cache
def _qsl_buffer():
    return torch.zeros(64, dtype=torch.int32)


def _check_select(
    routings, lens, max_seq_len, causal, t, capture_variant, pad_tokens=0, torch_buffer=False, pad_rows=0
):
    """pad_rows: query_start_loc_cpu runs that many entries past num_reqs + 1, each the last
    offset again (vLLM's slice runs to num_reqs_padded + 1: zero-length rows that num_reqs leaves
    out, so a read past num_reqs would count them as decode rows)."""
    rt, by_capture = routings
    r = by_capture[capture_variant]
    rt.leader = r  # this object counts and records the step
    r.is_leader = True
    rt.control.set(t)
    md = step_metadata(lens, max_seq_len, causal, pad_tokens)
    qsl = md.query_start_loc_cpu
    qsl = np.concatenate([qsl, np.full(pad_rows, qsl[-1], dtype=qsl.dtype)])
    md.query_start_loc_cpu = qsl
    if torch_buffer:
        n = qsl.size
        _qsl_buffer()[:n] = torch.from_numpy(qsl)
        _qsl_buffer()[n:] = -7  # stale rows past the batch must never be read
        md.query_start_loc_cpu = _qsl_buffer()[:n]
    variant = r.select(md)
    if torch_buffer:
        _qsl_buffer()[:] = -9  # vLLM rewrites its buffer for the next step
    ring = rt.shape_sample._ring
    if ring and ring[-1][0] == rt.step:  # a sampled step (1 in N): the sample holds its own copy
        assert [int(x) for x in ring[-1][1]] == list(lens)
        assert [int(x) for x in ring[-1][5]] == [max_seq_len] * len(lens)
    want, full = reference(lens, max_seq_len, causal, t, capture_variant)
    assert r.last_decision is want  # interned: the same object
    assert variant == want.variant
    d, recorded, step, version = rt.recorder.calls[-1]
    assert (d, step, version) == (want, rt.step, rt.control.snapshot.version)
    # The recorder sees the full shape's counts (num_actual_tokens as vLLM gave it).
    assert recorded.num_reqs == full.num_reqs
    assert recorded.num_actual_tokens == full.num_actual_tokens + pad_tokens
    assert recorded.max_query_len == full.max_query_len
    assert recorded.max_seq_len == full.max_seq_len
    assert recorded.num_decode_rows == full.num_decode_rows
    assert recorded.num_short_query_rows in (-1, full.num_short_query_rows)
    return recorded


@pytest.mark.slow  # 3.6 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=lens_st,
    max_seq_len=st.integers(1, 140_000),
    causal=st.booleans(),
    t=thresholds_st(),
    capture_variant=st.sampled_from([0, 1]),
    torch_buffer=st.booleans(),
)
@example(
    lens=[1] * 8, max_seq_len=8192, causal=True, t=SEED, capture_variant=0, torch_buffer=True
)  # plain decode step
@example(
    lens=[1, 1, 2], max_seq_len=8192, causal=True, t=SEED, capture_variant=0, torch_buffer=True
)  # max_query_len == min
@example(lens=[], max_seq_len=1, causal=True, t=SEED, capture_variant=0, torch_buffer=True)  # no rows
@example(
    lens=[0, 0, 1], max_seq_len=4096, causal=True, t=SEED, capture_variant=1, torch_buffer=True
)  # padding rows
@example(  # max_query_len == decode_query_len_max: the fast path's last batch
    lens=[3, 1, 3],
    max_seq_len=4096,
    causal=True,
    t=SEED.merged({"decode_query_len_max": 3, "min_query_len": 6}),
    capture_variant=0,
    torch_buffer=True,
)
@example(  # dq < max_query_len < min_query_len: no prefill row, yet rows to count
    lens=[4, 1, 5],
    max_seq_len=4096,
    causal=True,
    t=SEED.merged({"decode_query_len_max": 3, "min_query_len": 6}),
    capture_variant=0,
    torch_buffer=True,
)
@example(  # prefill capture variant, LPT left to the rule: the decode step is counted in full
    lens=[1, 1],
    max_seq_len=4096,
    causal=True,
    t=SEED.merged({"decode_path": "prefill"}),
    capture_variant=1,
    torch_buffer=True,
)
@example(  # admitted, long rows: the short rows are counted for the LPT rule
    lens=[1] * 9 + [300] * 20,
    max_seq_len=9000,
    causal=True,
    t=SEED.merged({"min_qblock_rows": 0}),
    capture_variant=0,
    torch_buffer=True,
)
def test_select_equals_decide_on_the_full_shape(
    routings, lens, max_seq_len, causal, t, capture_variant, torch_buffer
):
    """torch_buffer: query_start_loc_cpu is a slice of one reused torch buffer, as vLLM passes it
    (select() keeps a numpy view of it across steps: _qsl_view)."""
    _check_select(routings, lens, max_seq_len, causal, t, capture_variant, torch_buffer=torch_buffer)


@pytest.mark.slow  # 1.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=lens_st,
    max_seq_len=st.integers(1, 140_000),
    t=thresholds_st(),
    capture_variant=st.sampled_from([0, 1]),
    torch_buffer=st.booleans(),
    pad_rows=st.integers(1, 6),
)
@example(  # 8 decode rows and 2 chunks, 6 padding entries past num_reqs + 1
    lens=[1] * 8 + [300] * 2,
    max_seq_len=8192,
    t=SEED.merged({"decode_rows_base": 8, "min_qblock_rows": 0}),
    capture_variant=0,
    torch_buffer=False,
    pad_rows=6,
)
def test_select_reads_only_num_reqs_rows(
    routings, lens, max_seq_len, t, capture_variant, torch_buffer, pad_rows
):
    """query_start_loc_cpu longer than num_reqs + 1 (numpy or a torch slice): only the first
    num_reqs + 1 entries count, for the decision, the recorder and the shape sample."""
    _check_select(
        routings, lens, max_seq_len, True, t, capture_variant, torch_buffer=torch_buffer, pad_rows=pad_rows
    )


@pytest.mark.slow  # 0.7 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 300),
    padding=st.integers(0, 64),
    zeros=st.integers(0, 16),
    t=thresholds_st(),
    capture_variant=st.sampled_from([0, 1]),
)
def test_padded_decode_step_records_vllms_token_count(routings, rows, padding, zeros, t, capture_variant):
    """A uniform-decode CUDA-graph step: vLLM pads num_reqs with zero-length rows and
    num_actual_tokens with padding tokens; the decision is decide()'s, the rows and tokens counted
    are vLLM's (docs/metrics.md)."""
    lens = [1] * rows + [0] * zeros
    _check_select(routings, lens, 2048, True, t, capture_variant, pad_tokens=padding)


def test_decode_fast_path_touches_no_array(routings):
    """A decode-only step never reads query_start_loc_cpu (the metadata's field would raise)."""
    rt, by_capture = routings
    r = by_capture[0]
    rt.leader, r.is_leader = r, True
    rt.control.set(SEED)

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"query_start_loc_cpu.{name} read on a decode-only step")

        def __len__(self):
            raise AssertionError("query_start_loc_cpu read on a decode-only step")

    md = step_metadata([1] * 64, 8192, True)
    md.query_start_loc_cpu = Untouchable()
    r._next_sample = rt.step + 10  # not a shape-sample step
    assert r.select(md) == 0 and r.last_decision.reason == "no_prefill_rows"


@pytest.mark.slow  # 1.6 s on the 2-core VM (fast-tier tests take under 0.3 s)
@settings(max_examples=400, deadline=None)
@given(lens=lens_st, dq=st.integers(1, 4), bm_log=st.integers(0, 9), max_seq_len=st.integers(1, 10**6))
def test_from_step_equals_the_full_shape(lens, dq, bm_log, max_seq_len):
    bm = 2**bm_log
    q = np.asarray(lens, dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    full = BatchShape.from_query_start_loc(
        qsl,
        max_seq_len=max_seq_len,
        num_heads=8,
        thresholds=SEED.merged({"decode_query_len_max": dq, "min_query_len": dq + 1, "block_m": bm}),
    )
    mql = int(q.max()) if len(lens) else 0
    s = BatchShape.from_step(qsl, len(lens), int(q.sum()), mql, max_seq_len, 8, True, dq, bm)
    if s.num_short_query_rows == -1:
        assert mql >= bm  # left uncounted only where max_query_len does not give it
        s = s.with_short_rows(qsl, bm)
    assert s == full
    # Python ints, not numpy scalars (the recorder adds them into float cells on the hot path)
    assert all(type(v) is int for v in s[:4] + s[6:]) and type(s.causal) is bool


def test_qsl_view_follows_the_buffer_and_never_reads_a_stale_one(routings):
    """The cached numpy view: same buffer rewritten, a longer prefix, another buffer, another
    dtype over the same memory, a strided tensor: each read gives the tensor's own values."""
    _rt, by_capture = routings
    r = by_capture[0]
    buf = torch.arange(40, dtype=torch.int32)
    assert r._qsl_view(buf[:5], 5).tolist() == [0, 1, 2, 3, 4]
    buf[:5] = torch.tensor([0, 3, 4, 9, 10], dtype=torch.int32)  # rewritten in place (next step)
    assert r._qsl_view(buf[:5], 5).tolist() == [0, 3, 4, 9, 10]
    assert r._qsl_view(buf[:3], 3).tolist() == [0, 3, 4]
    assert r._qsl_view(buf[:12], 12).tolist() == [0, 3, 4, 9, 10, *range(5, 12)]  # longer: new view
    other = torch.arange(100, 140, dtype=torch.int32)
    assert r._qsl_view(other[:4], 4).tolist() == [100, 101, 102, 103]
    as64 = other.view(torch.int64)  # the same address, another dtype
    assert r._qsl_view(as64[:2], 2).tolist() == as64[:2].tolist()
    strided = torch.arange(20, dtype=torch.int32)[::2]
    assert r._qsl_view(strided[:4], 4).tolist() == [0, 2, 4, 6]
    assert r._qsl_view(torch.arange(20, dtype=torch.int32)[::2][:4], 4).tolist() == [0, 2, 4, 6]


def test_lpt_rule_refuses_an_uncounted_short_row_count():
    s = BatchShape(2, 2049, 2048, 4096, 16, True, 1, -1)
    with pytest.raises(ShortRowsNotCounted):
        lpt_rule(s, SEED)
    assert lpt_rule(s, SEED.merged({"lpt": "never"})) is False  # not read: no error


def test_host_view_lens_follows_the_buffer_and_never_reads_a_stale_one():
    """HostView.lens: the row lengths of a query_start_loc prefix, from slices kept per row count:
    the same buffer rewritten (same n, then another n), a longer prefix, another buffer, another
    dtype or a strided tensor over the same memory; and the result is a new array, never a view."""
    hv = HostView()
    buf = torch.arange(40, dtype=torch.int32)
    assert hv.lens(buf[:6], 5).tolist() == [1] * 5
    buf[:6] = torch.tensor([0, 3, 4, 9, 10, 20], dtype=torch.int32)  # the next step, same rows
    out = hv.lens(buf[:6], 5)
    assert out.tolist() == [3, 1, 5, 1, 10]
    buf[1] = 100
    assert out.tolist() == [3, 1, 5, 1, 10]  # a copy: vLLM's rewrite does not reach it
    assert hv.lens(buf[:4], 3).tolist() == [100, -96, 5]
    assert hv.lens(buf[:30], 29).tolist() == [100, -96, 5, 1, 10, -14, *([1] * 23)]  # longer: new view
    other = torch.arange(100, 140, dtype=torch.int32)
    assert hv.lens(other[:4], 3).tolist() == [1, 1, 1]
    as64 = other.view(torch.int64)  # the same address, another dtype
    want = (as64[1:4] - as64[:3]).tolist()
    assert hv.lens(as64[:4], 3).tolist() == want
    strided = other[::2]  # the same address, every other element
    assert hv.lens(strided[:4], 3).tolist() == [2, 2, 2]
    assert hv.lens(other[:4], 3).tolist() == [1, 1, 1]


def test_sampled_mixed_step_keeps_its_rows_after_vllm_rewrites_the_buffer(routings):
    """A shape-sampled step of more than FEW_ROWS rows: the sample's query lengths are select()'s
    own array, so the next step's rewrite of vLLM's buffer leaves them as they were."""
    rt, by_capture = routings
    r = by_capture[0]
    rt.leader, r.is_leader = r, True
    rt.control.set(SEED)
    lens = [1] * 20 + [700, 1300]
    for k in range(3):
        md = step_metadata(lens, 8192, True)
        n = len(lens) + 1
        _qsl_buffer()[:n] = torch.from_numpy(md.query_start_loc_cpu)
        md.query_start_loc_cpu = _qsl_buffer()[:n]
        r._next_sample = rt.step + 1  # sample the next step
        r.select(md)
        step, q = rt.shape_sample._ring[-1][:2]
        assert step == rt.step
        _qsl_buffer()[:] = k  # the next step's rewrite
        assert q.tolist() == lens
