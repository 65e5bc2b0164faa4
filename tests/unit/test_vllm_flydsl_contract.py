"""Contract tests of the ROCm FlyDSL dualwave backend against a fake FlyDSL checkout.

No gfx950 here: these check the call flyserve makes (arguments, the persistent cu_seqlens_kv
buffer, host-int max lengths, the LPT flag from the routing decision, warm-up of both variants
outside graph capture, the circuit-breaker fallback), not the kernel.
"""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest
from _support import require_module

torch = require_module("torch")
require_module("vllm")

FAKE_KERNEL = textwrap.dedent(
    """
    CALLS = []
    FAIL = []

    def flydsl_flash_attn_func(q, k, v, **kwargs):
        if FAIL:
            raise RuntimeError(FAIL[0])
        CALLS.append((q, k, v, kwargs))
        out = kwargs.get("out")
        if out is not None:
            out.fill_(7.0)
        return out
    """
)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    pkg = tmp_path / "FlyDSL" / "kernels" / "attention"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "flash_attn_interface.py").write_text(FAKE_KERNEL)
    monkeypatch.setenv("VLLM_FLYDSL_KERNELS_PATH", str(tmp_path / "FlyDSL"))
    monkeypatch.delenv("FLYSERVE_FLYDSL_MODULE", raising=False)
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        sys.modules.pop(name, None)


@pytest.fixture
def flydsl():
    from flyserve.vllm import flydsl

    return flydsl


def fake_module():
    return sys.modules["kernels.attention.flash_attn_interface"]


def test_kernel_is_loaded_from_the_checkout(checkout, flydsl):
    fn = flydsl.load_flydsl_attn_func()
    assert fn.__module__ == "kernels.attention.flash_attn_interface"


def test_missing_checkout_names_the_variable(tmp_path, monkeypatch, flydsl):
    monkeypatch.setenv("VLLM_FLYDSL_KERNELS_PATH", str(tmp_path / "nope"))
    with pytest.raises(flydsl.FlyDSLUnavailable, match="VLLM_FLYDSL_KERNELS_PATH"):
        flydsl.load_flydsl_attn_func()


def test_prefix_sum_buffer_is_persistent(flydsl):
    buf = flydsl.PrefixSumBuffer(8, "cpu")
    a = buf.fill(torch.tensor([5, 3, 10], dtype=torch.int32), 3)
    ptr = a.data_ptr()
    assert a.tolist() == [0, 5, 8, 18] and a.dtype == torch.int32
    b = buf.fill(torch.tensor([1, 2], dtype=torch.int32), 2)
    assert b.data_ptr() == ptr and b.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="exceed"):
        buf.fill(torch.ones(9, dtype=torch.int32), 9)


def md_for(flydsl, query_lens, seq_lens, buf):
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return SimpleNamespace(
        num_actual_tokens=int(sum(query_lens)),
        query_start_loc=qsl,
        seq_lens=seq,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table=torch.zeros(len(seq_lens), 4, dtype=torch.int32),
        cu_seqlens_kv=buf.fill(seq, len(seq_lens)),
        causal=True,
    )


def test_call_passes_host_max_lengths_and_the_persistent_buffer(checkout, flydsl):
    fn = flydsl.load_flydsl_attn_func()
    buf = flydsl.PrefixSumBuffer(16, "cpu")
    q = torch.randn(40, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    out = torch.zeros(48, 8 * 128, dtype=torch.bfloat16)  # padded: only the first 40 rows are real
    for lens, lpt in ((([1, 7, 32], [100, 7, 64]), True), (([40], [40]), False)):
        md = md_for(flydsl, lens[0], lens[1], buf)
        flydsl.call_kernel(fn, q, kc, kc, md, out, num_kv_heads=2, scale=128**-0.5, lpt=lpt)
        qq, _k, _v, kw = fake_module().CALLS[-1]
        assert qq.shape[0] == 40 and kw["out"].shape[0] == 40
        assert kw["causal"] is True and kw["lpt"] is lpt
        assert type(kw["max_seqlen_kv"]) is int and kw["max_seqlen_kv"] == max(lens[1])
        assert type(kw["max_seqlen_q"]) is int and kw["max_seqlen_q"] == max(lens[0])
        assert kw["cu_seqlens_kv"].data_ptr() == buf.buf.data_ptr()
        assert kw["cu_seqlens_kv"].tolist() == [0, *torch.tensor(lens[1]).cumsum(0).tolist()]
        assert kw["cu_seqlens_q"] is md.query_start_loc and kw["block_table"] is md.block_table
        assert kw["num_kv_heads"] == 2 and kw["softmax_scale"] == pytest.approx(128**-0.5)
    assert torch.all(out[:40] == 7) and torch.all(out[40:] == 0)


def test_warm_up_compiles_both_lpt_variants_outside_capture(checkout, flydsl):
    fn = flydsl.load_flydsl_attn_func()
    kw = {
        "dtype": torch.bfloat16,
        "device": "cpu",
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_size": 128,
        "block_size": 16,
    }
    flydsl.warm_up(fn, is_capturing=lambda: False, **kw)
    assert [c[3]["lpt"] for c in fake_module().CALLS] == [False, True]
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        flydsl.warm_up(fn, is_capturing=lambda: True, **kw)
    assert len(fake_module().CALLS) == 2


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    from flyserve.vllm.runtime import RankRuntime

    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    monkeypatch.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    rt = RankRuntime(state_dir=tmp_path / "state", rank=0, start=False, setup_metrics=False)
    RankRuntime._instance = rt
    yield rt
    RankRuntime.reset_for_tests()


def test_builder_adds_the_prefix_sum_and_the_decisions_lpt(checkout, flydsl, runtime, monkeypatch):
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionMetadataBuilder

    from flyserve.policy import ADMITTED, PREFILL, decision_for

    monkeypatch.setattr(
        RocmAiterUnifiedAttentionMetadataBuilder,
        "build",
        lambda self, cpl, cm, fast_build=False: SimpleNamespace(),
    )
    b = object.__new__(flydsl.FlyDSLDualwaveMetadataBuilder)
    b.cu_seqlens_kv = flydsl.PrefixSumBuffer(8, "cpu")
    cm = SimpleNamespace(seq_lens=torch.tensor([9, 4], dtype=torch.int32), num_reqs=2)
    for lpt in (True, False):
        runtime.last_decision = decision_for(PREFILL, ADMITTED, lpt)
        md = b.build(0, cm)
        assert md.lpt is lpt and md.cu_seqlens_kv.tolist() == [0, 9, 13]


def test_kernel_failure_reruns_on_aiter_unified_and_opens_the_circuit(checkout, flydsl, runtime, monkeypatch):
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionImpl

    from flyserve.control import ControlPlane

    unified_calls = []

    def unified_forward(self, layer, query, key, value, kv_cache, md, output, *rest):
        unified_calls.append(md)
        output.fill_(3.0)
        return output

    monkeypatch.setattr(RocmAiterUnifiedAttentionImpl, "forward", unified_forward)
    impl = object.__new__(flydsl.FlyDSLDualwaveImpl)
    impl.flydsl_attn = flydsl.load_flydsl_attn_func()
    impl.head_size, impl.num_kv_heads, impl.scale = 128, 2, 128**-0.5
    kv = torch.zeros(4, 2, 16, 256, dtype=torch.bfloat16)
    md = md_for(flydsl, [8, 8], [8, 8], flydsl.PrefixSumBuffer(4, "cpu"))
    md.lpt = True
    q = torch.randn(16, 8, 128, dtype=torch.bfloat16)
    out = torch.zeros(16, 8 * 128, dtype=torch.bfloat16)
    impl.forward(None, q, q, q, kv, md, out)
    assert torch.all(out == 7) and not unified_calls  # the FlyDSL kernel ran
    fake_module().FAIL.append("kernel exploded")
    impl.forward(None, q, q, q, kv, md, out)
    assert unified_calls == [md] and torch.all(out == 3)  # the batch was re-run, not lost
    assert runtime.local_circuit_open
    snap = ControlPlane(runtime.state_dir).snapshot()
    assert snap.circuit_open and "kernel exploded" in snap.circuit_reason


def test_composite_pairs_aiter_unified_with_flydsl(flydsl):
    from vllm.v1.attention.backends.composite import create_composite_attention_backend
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionBackend

    from flyserve.vllm.backends import ROCM_PREFILL_SPEC
    from flyserve.vllm.routing import routing_class

    routing = routing_class(ROCM_PREFILL_SPEC, "unified", name="R")
    cls = create_composite_attention_backend(
        RocmAiterUnifiedAttentionBackend,
        flydsl.FlyDSLDualwaveBackend,
        name="X",
        backend_name="CUSTOM",
        module=__name__,
        routing_policy=routing,
    )
    assert cls is not RocmAiterUnifiedAttentionBackend  # a real composite, not collapsed
    assert cls.general_backend_cls is RocmAiterUnifiedAttentionBackend
    assert cls.causal_backend_cls is flydsl.FlyDSLDualwaveBackend
    assert cls.get_name() == "CUSTOM"
    assert (
        flydsl.FlyDSLDualwaveBackend.get_builder_cls().__mro__[1].__name__
        == "RocmAiterUnifiedAttentionMetadataBuilder"
    )
    assert flydsl.FlyDSLDualwaveBackend.supports_head_size(
        128
    ) and not flydsl.FlyDSLDualwaveBackend.supports_head_size(96)
