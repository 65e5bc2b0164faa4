"""FlyserveRouting.select() per engine step, with the real DispatchRecorder, beside a bare np.diff.

Run: .venv/bin/python -m pytest benchmarks/test_bench_routing.py --benchmark-enable

Three groups, each with the yardstick (a bare ``np.diff`` of the same ``query_start_loc``, as a
numpy array) and select() on vLLM's own ``CommonAttentionMetadata`` (``query_start_loc_cpu`` a CPU
torch tensor, as vLLM passes it):

  select-decode-256  256 decode rows (the common serving step): the decode fast path
  select-mixed-256   248 decode rows and 8 prefill chunks of 1024 tokens
  select-2-rows      one decode row and one 2048-token chunk

The recorder writes into flyserve's multiprocess metrics files (as a served rank does), spans are
sampled out (ratio 0), the kernel timer is not involved (it wraps forward(), not select()). The
targets are the ratios select / np.diff (decode <= 1.5x, mixed <= 2.5x); absolute times
on the 2-core CI VM move with the other tenants' load, the ratios of one run much less.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pytest
from _support import lazy_module, module_requires

from flyserve.telemetry import metrics
from flyserve.vllm.eligibility import PrefillKernelSpec
from flyserve.vllm.routing import routing_class
from flyserve.vllm.runtime import RankRuntime

if TYPE_CHECKING:
    from vllm.v1.attention.backend import CommonAttentionMetadata

# vLLM's own CommonAttentionMetadata: importing vLLM runs `uname -p` (its platform probe), so slow; vllm
# and torch are imported when a benchmark runs, not when the module is collected
pytestmark = pytest.mark.slow
torch = lazy_module("torch")
required_modules = module_requires("torch", "vllm")

HEADS = 16
STEPS = {
    "decode-256": ([1] * 256, 8192),
    "mixed-256": ([1] * 248 + [1024] * 8, 61440),
    "2-rows": ([1, 2048], 4096),
}


def _metadata(query_lens: list[int], max_seq_len: int) -> CommonAttentionMetadata:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = np.asarray(query_lens, dtype=np.int32)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q)]).astype(np.int32))
    n = len(query_lens)
    seq = torch.full((n,), max_seq_len, dtype=torch.int32)
    # vLLM 0.32 hands both as prefixes of persistent CPU buffers (gpu_model_runner.py):
    # query_start_loc.cpu[: num_reqs_padded + 1] and optimistic_seq_lens_cpu[:num_reqs_padded].
    seq_host = torch.zeros(1024, dtype=torch.int32)
    seq_host[:n] = seq
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        num_reqs=n,
        num_actual_tokens=int(q.sum()),
        max_query_len=int(q.max()),
        max_seq_len=max_seq_len,
        block_table_tensor=torch.zeros((n, 1), dtype=torch.int32),
        slot_mapping=torch.zeros(int(q.sum()), dtype=torch.int64),
        causal=True,
        seq_lens_cpu_upper_bound=seq_host[:n],
    )


def _layer() -> SimpleNamespace:
    impl = SimpleNamespace(
        num_heads=HEADS,
        head_size=128,
        scale=128**-0.5,
        alibi_slopes=None,
        sinks=None,
        logits_soft_cap=0,
        sliding_window=-1,
        kv_cache_dtype="auto",
    )
    return SimpleNamespace(impl=impl, sliding_window=None)


@pytest.fixture(scope="module")
def routing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The leader routing object of one rank: real RankRuntime, control and recorder (mmap metrics)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FLYSERVE_PROFILE", "gfx950")
    mp.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    mp.delenv("FLYSERVE_FORCE_PATH", raising=False)
    mp.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    mp.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    state: Path = tmp_path_factory.mktemp("state")
    rt = RankRuntime(state_dir=state, rank=0, start=False, setup_metrics=True)
    layers = {"model.layers.0.attn": _layer()}
    vcfg = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(dtype="bfloat16", get_num_attention_heads=lambda parallel: HEADS),
        parallel_config=SimpleNamespace(),
    )
    cls = routing_class(PrefillKernelSpec("bench-prefill"), "unified")
    try:
        yield cls(list(layers), vcfg, runtime=rt)
    finally:
        RankRuntime.reset_for_tests()
        metrics.setup_in_process()
        mp.undo()


def _bench_np_diff(benchmark, name: str) -> None:
    benchmark.group = f"select-{name}"
    md = _metadata(*STEPS[name])
    qsl = md.query_start_loc_cpu.numpy()
    out = benchmark(np.diff, qsl)
    assert out.size == len(STEPS[name][0])


def _bench_select(benchmark, routing, name: str, expect: tuple[str, str]) -> None:
    benchmark.group = f"select-{name}"
    md = _metadata(*STEPS[name])
    assert routing.rt.tracing is None or not routing.rt.tracing.sampler.ratio  # spans sampled out
    variant = benchmark(routing.select, md)
    d = routing.last_decision
    assert (d.path, d.reason) == expect and variant == d.variant


def test_decode_256_np_diff(benchmark) -> None:
    _bench_np_diff(benchmark, "decode-256")


def test_decode_256_select(benchmark, routing) -> None:
    _bench_select(benchmark, routing, "decode-256", ("unified", "no_prefill_rows"))


def test_mixed_256_np_diff(benchmark) -> None:
    _bench_np_diff(benchmark, "mixed-256")


def test_mixed_256_select(benchmark, routing) -> None:
    _bench_select(benchmark, routing, "mixed-256", ("unified", "too_many_decode_rows"))


def test_2_rows_np_diff(benchmark) -> None:
    _bench_np_diff(benchmark, "2-rows")


def test_2_rows_select(benchmark, routing) -> None:
    _bench_select(benchmark, routing, "2-rows", ("prefill", "admitted"))


# ----------------------------------------------------------------- per attention forward


class _PlainImpl:
    """Stands for vLLM's composite impl (an empty forward: what is measured is the call)."""

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
        return output


class _Base:
    @staticmethod
    def get_impl_cls():
        return _PlainImpl

    @staticmethod
    def get_builder_cls():
        return object


@pytest.fixture(scope="module")
def flyserve_impl():
    from flyserve.vllm.backends import PrefillStatus, _with_flyserve_parts

    return _with_flyserve_parts(_Base, "BenchComposite", PrefillStatus("bench")).get_impl_cls()()


_AMD = SimpleNamespace(_attention_backend_variant=0)


def test_forward_vllm_impl(benchmark) -> None:
    """The yardstick: vLLM's impl forward, called as vLLM's attention op calls it."""
    benchmark.group = "forward-per-call"
    impl = _PlainImpl()
    benchmark(lambda: impl.forward(None, None, None, None, None, _AMD, None))


@pytest.mark.parametrize("checked", [False, True], ids=["plain-step", "checked-step"])
def test_forward_flyserve_impl(benchmark, flyserve_impl, checked: bool) -> None:
    """flyserve's impl on a plain step (vLLM's forward installed: no flyserve frame) and on a step
    that installs the checked forward (a prefill or timed step; the timer not armed here)."""
    from flyserve.vllm.forward_switch import SWITCH

    benchmark.group = "forward-per-call"
    SWITCH.set(checked)
    try:
        assert (type(flyserve_impl).forward is _PlainImpl.forward) is not checked
        benchmark(lambda: flyserve_impl.forward(None, None, None, None, None, _AMD, None))
    finally:
        SWITCH.set(False)


# ----------------------------------------------------------------- during a switchback trial


@pytest.fixture
def trial_control(routing, tmp_path: Path) -> Iterator[object]:
    """The routing's rank on a version that runs a switchback trial (blocks of 32 steps, the
    candidate routing decode steps the same way), in place of its own control for one benchmark."""
    from flyserve.control import RankControl
    from flyserve.control.snapshot import Trial

    rc = RankControl(tmp_path / "state", 0, profile="gfx950", report=False)
    base = rc.snapshot
    candidate = base.thresholds.merged({"min_seq_len": base.thresholds.min_seq_len + 1})
    trial = Trial("bench", 1, 32, 200_000, candidate)
    rc.current(routing.rt.step)  # the blocks start at the routing's next step
    assert rc.apply_pushed(base.replace(version=1, trial=trial)) == (True, "applied")
    real = routing.rt.control
    routing.rt.control = rc
    try:
        yield rc
    finally:
        routing.rt.control = real


def test_decode_256_select_during_a_trial(benchmark, routing, trial_control) -> None:
    """select() on decode steps while the ranks alternate arms: the same one compare per step
    (the block boundary is the pending step), beside test_decode_256_select in the same group."""
    _bench_select(benchmark, routing, "decode-256", ("unified", "no_prefill_rows"))
    assert trial_control.report_dict()["trial"] is not None
