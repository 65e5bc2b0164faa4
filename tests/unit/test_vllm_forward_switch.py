"""forward_switch: vLLM's own forward on plain steps, flyserve's checked one where a step needs it.

The checked forward (timing, circuit breaker) is installed on the impl class by select() for a
step that runs the prefill path or has an armed kernel timer, and removed on the next plain step,
so a plain decode step runs no flyserve frame per attention forward.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest

from flyserve.policy import PREFILL, UNIFIED
from flyserve.telemetry.gpu_timer import KernelTimer
from flyserve.vllm.backends import PrefillStatus, _with_flyserve_parts
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.forward_switch import SWITCH
from flyserve.vllm.routing import routing_class
from flyserve.vllm.runtime import RankRuntime

HEADS = 4


class PlainImpl:
    """Stands for vLLM's composite impl: records the calls it runs."""

    calls: ClassVar[list[int]] = []

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        PlainImpl.calls.append(getattr(attn_metadata, "_attention_backend_variant", 0))
        return "out"


class _Base:
    @staticmethod
    def get_impl_cls():
        return PlainImpl

    @staticmethod
    def get_builder_cls():
        return object


def _layer():
    impl = SimpleNamespace(
        num_heads=HEADS, head_size=32, scale=32**-0.5, alibi_slopes=None, sinks=None,
        logits_soft_cap=0, sliding_window=-1, kv_cache_dtype="auto",
    )  # fmt: skip
    return SimpleNamespace(impl=impl, sliding_window=None)


def _md(query_lens, max_seq_len=300):
    q = np.asarray(query_lens, dtype=np.int32)
    return SimpleNamespace(
        query_start_loc_cpu=np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
        num_reqs=len(query_lens), num_actual_tokens=int(q.sum()), max_query_len=int(q.max()),
        max_seq_len=max_seq_len, causal=True, seq_lens_cpu_upper_bound=None,
        seq_lens=np.full(len(query_lens), max_seq_len, dtype=np.int32),  # vLLM's metadata always has it
    )  # fmt: skip


@pytest.fixture
def rank(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "4")
    monkeypatch.delenv("FLYSERVE_FORCE_PATH", raising=False)
    monkeypatch.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    rt = RankRuntime(state_dir=tmp_path / "state", rank=0, start=False, setup_metrics=False)
    rt.kernel_timer = KernelTimer(0, clock="host", every_steps=4)
    layers = {f"model.layers.{i}.attn": _layer() for i in range(2)}
    vcfg = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype="bfloat16", get_num_attention_heads=lambda parallel: HEADS),
        parallel_config=SimpleNamespace(),
    )
    r = routing_class(PrefillKernelSpec("test-prefill"), "unified")(list(layers), vcfg, runtime=rt)
    impl = _with_flyserve_parts(_Base, "SwitchTestComposite", PrefillStatus("test-prefill")).get_impl_cls()()
    yield rt, r, impl
    SWITCH.set(False)
    RankRuntime.reset_for_tests()


def _step(r, impl, md):
    """One engine step: select(), then the two layers' forwards as vLLM calls them."""
    variant = r.select(md)
    amd = SimpleNamespace(_attention_backend_variant=variant)
    checked = type(impl).forward is not PlainImpl.forward
    for layer in range(2):
        assert impl.forward(layer, None, None, None, None, amd, None) == "out"
    return checked


def test_plain_steps_run_vllms_forward_and_timed_or_prefill_steps_the_checked_one(rank):
    rt, r, impl = rank
    decode, mixed = _md([1, 1, 1]), _md([1, 1, 200], 300)
    plan = [decode, decode, mixed, decode, decode, decode, decode, decode, decode]
    checked = [_step(r, impl, md) for md in plan]
    # step 1: timed (the timer's first step); 3: prefill; 5 and 9: timed (every 4 steps)
    assert checked == [True, False, True, False, True, False, False, False, True]
    assert PlainImpl.calls[-18:] == [0, 0, 0, 0, 1, 1] + [0] * 12  # vLLM's forward ran every call
    timer = rt.kernel_timer
    assert timer.armed == 0  # every armed forward came and was timed
    u, pf = (timer.path(p).hist for p in (UNIFIED, PREFILL))
    assert sum(b[i] for b, i in zip(u.bucket_bufs, u.bucket_idx, strict=True)) == 3.0  # steps 1, 5, 9
    assert sum(b[i] for b, i in zip(pf.bucket_bufs, pf.bucket_idx, strict=True)) == 0.0


def test_a_step_without_forwards_hands_its_timed_forward_on(rank):
    """A CUDA-graph replay calls select() but no forward: the armed forward is the next step's,
    and the checked forward stays installed until it has run."""
    rt, r, impl = rank
    r.select(_md([1, 1]))  # step 1: armed, no forward
    assert SWITCH.checked and rt.kernel_timer.armed == 1
    assert _step(r, impl, _md([1, 1])) is True  # step 2: still armed, so still checked
    assert rt.kernel_timer.armed == 0
    assert _step(r, impl, _md([1, 1])) is False


def test_no_timer_means_checked_only_on_prefill_steps(rank):
    rt, r, impl = rank
    rt.kernel_timer = None
    SWITCH.timer = None
    assert [_step(r, impl, md) for md in (_md([1, 1]), _md([1, 200]), _md([1, 1]))] == [False, True, False]
