"""Rank-side cost of the live-pricing sample: FlyserveRouting.select() on an unsampled step, on a
sampled step as it is now (query and context lengths, path, time), and on a sampled step as it was
before (query lengths only), side by side; plus the sidecar's price of one sample.

Run: .venv/bin/python -m pytest benchmarks/test_bench_shape_sample.py --benchmark-enable
Unsampled steps run the same code as before the change (one ``step % every`` compare); the
sampled step's extra work (one seq_lens copy, one time.time(), a wider tuple) happens on 1 step in
SHAPE_SAMPLE_EVERY (8). Absolute CPU times on the 2-core VM are indicative only.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from flyserve.pricing.costs import load_costs
from flyserve.sidecar.live_costs import LivePricing
from flyserve.telemetry.shape_sample import ShapeSample
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.routing import routing_class
from flyserve.vllm.runtime import RankRuntime

# A chunked-prefill step: 248 decode rows at 8k context, then 8 chunks of 1024 tokens.
Q = np.array([1] * 248 + [1024] * 8, dtype=np.int32)
S = np.array([8192] * 248 + [1024] * 8, dtype=np.int32)


class _NoRecorder:
    def record(self, *a) -> None: ...
    def set_circuit_open(self, is_open: bool) -> None: ...


def _layer():
    impl = SimpleNamespace(
        head_size=128, scale=128**-0.5, alibi_slopes=None, sinks=None, logits_soft_cap=0,
        sliding_window=-1, kv_cache_dtype="auto",
    )  # fmt: skip
    return SimpleNamespace(impl=impl, sliding_window=None)


@pytest.fixture
def routing(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYSERVE_PROFILE", "gfx950")
    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    monkeypatch.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    rt = RankRuntime(state_dir=tmp_path, rank=0, start=False, setup_metrics=False)
    rt.recorder = _NoRecorder()
    layers = {"l0": _layer()}
    cfg = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype="bfloat16", get_num_attention_heads=lambda p: 16),
        parallel_config=SimpleNamespace(),
        cache_config=SimpleNamespace(block_size=16),
    )
    r = routing_class(PrefillKernelSpec("p"), "unified")(list(layers), cfg, runtime=rt)
    md = SimpleNamespace(
        query_start_loc_cpu=np.concatenate([[0], np.cumsum(Q)]).astype(np.int32),
        max_seq_len=int(S.max()),
        num_actual_tokens=int(Q.sum()),
        num_reqs=int(Q.size),
        max_query_len=int(Q.max()),
        causal=True,
        seq_lens=S,
        seq_lens_cpu_upper_bound=None,
    )
    yield rt, r, md
    RankRuntime.reset_for_tests()


@pytest.mark.benchmark(group="select-256-rows")
def test_select_unsampled_step(benchmark, routing):
    rt, r, md = routing
    rt.shape_sample_every = 1 << 62  # never sampled: every call is an unsampled step
    r._next_sample = 1 << 62
    benchmark(r.select, md)
    assert len(rt.shape_sample._ring) == 0


@pytest.mark.benchmark(group="select-256-rows")
def test_select_sampled_step_now(benchmark, routing):
    rt, r, md = routing
    rt.shape_sample_every = 1
    r._next_sample = 0  # every call sampled from the first (CI's quick mode calls select() twice)
    benchmark(r.select, md)
    assert rt.shape_sample._ring[-1][5] is not None  # seq_lens carried


@pytest.mark.benchmark(group="select-256-rows")
def test_select_sampled_step_before(benchmark, routing):
    """The sample as it was before live pricing: query lengths only."""
    rt, r, md = routing
    rt.shape_sample_every = 1

    def old_sample(metadata, step, path, qsl=None):
        qsl = metadata.query_start_loc_cpu
        lens = qsl[1:] - qsl[:-1]
        rt.shape_sample.add(step, lens, int(metadata.max_seq_len), r.num_heads, metadata.causal is True)

    r._add_shape_sample = old_sample
    benchmark(r.select, md)


@pytest.mark.benchmark(group="sidecar-price-one-sample")
def test_sidecar_prices_one_sample(benchmark):
    lp = LivePricing(load_costs("h200"))
    s = ShapeSample(1, tuple(Q.tolist()), int(S.max()), 32, True, tuple(S.tolist()), "unified", 0.0, 128, 16)
    p = benchmark(lp.price, s, 0.0)
    assert not isinstance(p, str)
