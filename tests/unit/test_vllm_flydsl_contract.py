"""The ROCm FlyDSL dualwave path against FlyDSL's real interface, with no gfx950 here.

The fake FlyDSL (tests/unit/contract_fakes.py) is built from signature descriptions read from
FlyDSL's source at two commits (tests/data/contracts/: main 11c4174d and pull request #1056 at
943152de): it rejects an unknown, missing or positional keyword exactly as Python does for the
real function, enforces the paged path's preconditions, and computes the attention with a
float32 reference from the arguments it got. These tests check flyserve's one call site, the
revision detection, the KV layout check, the warm-up, the builder's decision hand-off, the
circuit breaker, the kernel-block-size declaration and the start-up refusals.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from _support import lazy_module, module_requires
from contract_fakes import FLYDSL_REVISIONS, FakeFlyDSL, PreconditionError

from flyserve.vllm import flydsl_kernel as fk

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
torch = lazy_module("torch")  # vllm and torch are imported when a test runs, not at collection
required_modules = module_requires("torch", "vllm")

REVISIONS = sorted(FLYDSL_REVISIONS)
MAIN, PR1056 = "main-11c4174d", "pr1056-943152de"

# The call flyserve made before this contract existed (commit 9be5d65, flyserve/vllm/flydsl.py
# call_kernel): kept as data so the test shows the real signature rejects it.
OLD_SERVING_KEYWORDS = (
    "causal", "out", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv", "block_table",
    "num_kv_heads", "softmax_scale", "lpt",
)  # fmt: skip


@pytest.fixture(params=REVISIONS)
def fake(request, monkeypatch) -> FakeFlyDSL:
    f = FakeFlyDSL(request.param)
    f.install(monkeypatch)
    return f


def batch(query_lens, seq_lens, *, page=64, heads=8, kv_heads=2, head=128, dtype=None, seed=0):
    """A paged batch in vLLM's terms: random q and K/V, a shuffled block table, 3-D out. dtype: a torch
    dtype or its name (bfloat16 when not given)."""
    dtype = getattr(torch, dtype or "bfloat16") if dtype is None or isinstance(dtype, str) else dtype
    g = torch.Generator().manual_seed(seed)
    nb = [-(-s // page) for s in seq_lens]
    total = sum(nb) + 2
    k = (torch.randn(total, page, kv_heads, head, generator=g) * 0.5).to(dtype)
    v = (torch.randn(total, page, kv_heads, head, generator=g) * 0.5).to(dtype)
    perm = torch.randperm(total, generator=g)
    table = torch.zeros(len(seq_lens), max(nb), dtype=torch.int32)
    off = 0
    for i, n in enumerate(nb):
        table[i, :n] = perm[off : off + n]
        off += n
    q = (torch.randn(sum(query_lens), heads, head, generator=g) * 0.5).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    cu_kv = torch.tensor([0, *seq.cumsum(0).tolist()], dtype=torch.int32)
    return SimpleNamespace(q=q, k=k, v=v, table=table, cu_q=cu_q, seq=seq, cu_kv=cu_kv,
                           out=torch.full_like(q, float("nan")), max_q=max(query_lens), max_kv=max(seq_lens))  # fmt: skip


def call(kernel, b, *, lpt=True):
    fk.call_paged(
        kernel, b.q, b.k, b.v, b.out,
        cu_seqlens_q=b.cu_q, cu_seqlens_kv=b.cu_kv, seqlen_k=b.seq, block_table=b.table,
        max_seqlen_q=b.max_q, max_seqlen_kv=b.max_kv, num_kv_heads=b.k.shape[2], lpt=lpt,
    )  # fmt: skip


def reference(b):
    from flyserve.lab.kernels import TorchReference

    ref = torch.empty_like(b.q)
    TorchReference()(
        b.q, b.k, b.v, ref, b.cu_q, b.seq, b.table, b.max_q, b.max_kv, b.q.shape[-1] ** -0.5, True
    )
    return ref


# ----------------------------------------------------------------------------- the call itself


def test_the_call_binds_to_both_revisions_and_computes_the_right_thing(fake):
    kernel = fk.load_flydsl_kernel()
    b = batch([1, 300, 40], [700, 300, 1000])  # a decode row, a fresh prompt, a chunk after 960
    call(kernel, b, lpt=True)
    (kw,) = fake.calls
    assert kw["causal"] is True and kw["cross_seqlen"] is True and kw["kv_cache_layout"] == "linear"
    assert kw["num_kv_splits"] == 1 and kw["seqlen_k"] is b.seq and kw["cu_seqlens_kv"] is b.cu_kv
    assert type(kw["max_seqlen_q"]) is int and type(kw["max_seqlen_kv"]) is int
    assert ("causal_lpt" in kw["__passed__"]) is (fake.revision == PR1056)  # only where it exists
    assert torch.equal(b.out, reference(b))  # every row written, from what the call passed
    call(kernel, b, lpt=False)
    assert fake.calls[-1].get("causal_lpt", False) is False


def test_revision_is_detected_from_the_real_function(fake):
    rev = fk.load_flydsl_kernel().revision
    if fake.revision == MAIN:
        assert (rev.has_causal_lpt, rev.page_sizes, rev.strided_kv) == (False, (64,), False)
        assert "no causal_lpt" in rev.label
    else:
        assert (rev.has_causal_lpt, rev.page_sizes, rev.strided_kv) == (True, (64, 128), True)
        assert "#1056" in rev.label


def test_page_sizes_dualwave_cannot_run_are_never_declared(fake, monkeypatch, gfx950):
    """FlyDSL's open PR #1055 sets ``_PAGED_PAGE_SIZES = (16, 64)`` (a private constant of the
    paged path as a whole); dualwave needs 64 or 128, so 16 must not reach vLLM's block sizes."""
    import sys

    from flyserve.vllm.flydsl import FlyDSLDualwaveBackend

    mod = sys.modules["kernels.attention.flash_attn_interface"]
    monkeypatch.setattr(mod, "_PAGED_PAGE_SIZES", (16, 64), raising=False)
    rev = fk.load_flydsl_kernel().revision
    assert rev.page_sizes == (64,)
    assert FlyDSLDualwaveBackend.get_supported_kernel_block_sizes() == [64]
    monkeypatch.setattr(mod, "_PAGED_PAGE_SIZES", (16, 32), raising=False)
    assert fk.load_flydsl_kernel().revision.page_sizes == ()  # nothing dualwave pages: path off


def test_the_call_made_before_this_contract_is_rejected_by_the_real_signature(fake):
    b = batch([40], [40])
    kw = dict.fromkeys(OLD_SERVING_KEYWORDS)
    kw.update(causal=True, out=b.out, cu_seqlens_q=b.cu_q, cu_seqlens_kv=b.cu_kv, max_seqlen_q=40,
              max_seqlen_kv=40, block_table=b.table, num_kv_heads=2, softmax_scale=128**-0.5, lpt=True)  # fmt: skip
    with pytest.raises(TypeError, match="softmax_scale"):
        fake.fn(b.q, b.k, b.v, **kw)
    kw.pop("softmax_scale")
    with pytest.raises(TypeError, match="lpt"):
        fake.fn(b.q, b.k, b.v, **kw)
    kw.pop("lpt")
    with pytest.raises(PreconditionError, match="block_table and seqlen_k"):
        fake.fn(b.q, b.k, b.v, **kw)  # and without seqlen_k the paged path refuses it


@pytest.mark.parametrize(
    "mutation",
    ["rename:seqlen_k=seqused_k", "rename:cu_seqlens_kv=cu_seqlens_k", "add:softmax_scale", "drop:seqlen_k",
     "drop:cu_seqlens_kv", "drop:max_seqlen_q", "positional"],
)  # fmt: skip
def test_a_renamed_added_or_dropped_keyword_fails(fake, mutation, monkeypatch):
    kernel = fk.load_flydsl_kernel()
    real_fn = kernel.fn

    def mutated(q, k, v, **kw):
        op, _, arg = mutation.partition(":")
        if op == "rename":
            old, new = arg.split("=")
            kw[new] = kw.pop(old)
        elif op == "add":
            kw[arg] = 1.0
        elif op == "drop":
            kw.pop(arg)
        else:
            return real_fn(q, k, v, kw.pop("causal"), **kw)
        return real_fn(q, k, v, **kw)

    with pytest.raises((TypeError, PreconditionError)):
        call(fk.FlyDSLKernel(mutated, kernel.revision), batch([40], [40]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"page": 16}, "page_size"),
        ({"head": 96}, "head_dim"),
        ({"dtype": "float32"}, "dtype"),  # a name: torch is imported when a test runs
    ],
)
def test_preconditions_of_the_paged_path(fake, change, match):
    with pytest.raises(PreconditionError, match=match):
        call(fk.load_flydsl_kernel(), batch([40], [40], **change))


def test_page_128_only_on_pr1056(fake):
    b = batch([40], [300], page=128)
    if fake.revision == MAIN:
        with pytest.raises(PreconditionError, match="page_size"):
            call(fk.load_flydsl_kernel(), b)
    else:
        call(fk.load_flydsl_kernel(), b)
        assert torch.equal(b.out, reference(b))


def test_out_must_be_the_3d_tensor_vllm_passes(fake):
    b = batch([40], [40])
    b.out = torch.empty(40, 8 * 128, dtype=torch.bfloat16)  # a 2-D view is not what FlyDSL writes
    with pytest.raises(PreconditionError, match="out"):
        call(fk.load_flydsl_kernel(), b)


def test_missing_checkout_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_FLYDSL_KERNELS_PATH", str(tmp_path / "nope"))
    monkeypatch.delenv("FLYSERVE_FLYDSL_MODULE", raising=False)
    with pytest.raises(fk.FlyDSLUnavailable, match="VLLM_FLYDSL_KERNELS_PATH"):
        fk.load_flydsl_kernel()


def test_checkout_is_imported_then_taken_off_sys_path(tmp_path, monkeypatch):
    import sys

    pkg = tmp_path / "FlyDSL" / "kernels" / "attention"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "flash_attn_interface.py").write_text(
        "_PAGED_PAGE_SIZE = 64\ndef flydsl_flash_attn_func(q, k, v, *, causal=True, out=None):\n    return out\n"
    )
    monkeypatch.setenv("VLLM_FLYDSL_KERNELS_PATH", str(tmp_path / "FlyDSL"))
    monkeypatch.delenv("FLYSERVE_FLYDSL_MODULE", raising=False)
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    kernel = fk.load_flydsl_kernel()
    assert kernel.fn.__module__ == "kernels.attention.flash_attn_interface"
    assert str(tmp_path / "FlyDSL") not in sys.path
    assert kernel.revision.page_sizes == (64,) and not kernel.revision.has_causal_lpt
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)


# ----------------------------------------------------------------------------- KV layout


def aiter_views(num_kv_heads, block_size=64, head=128, blocks=4):
    """K/V exactly as vLLM 0.32's AITER unified impl splits its cache (B, H, N, 2*hs)."""
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionImpl

    impl = object.__new__(RocmAiterUnifiedAttentionImpl)
    impl.head_size = head
    kv = torch.zeros(blocks, num_kv_heads, block_size, 2 * head, dtype=torch.bfloat16)
    return impl._split_kv_cache(kv)


def test_layout_of_vllms_aiter_cache(fake):
    rev = fk.load_flydsl_kernel().revision
    one_head = fk.kv_layout_problem(*aiter_views(1), rev)
    if fake.revision == MAIN:
        assert "copies them on every call" in one_head  # main copies any strided view
    else:
        assert one_head is None  # PR #1056 addresses a single-head strided cache in place
    two_heads = fk.kv_layout_problem(*aiter_views(2), rev)
    assert two_heads is not None  # head and page strides outside the kernel's fixed ones
    dense = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
    assert fk.kv_layout_problem(dense, dense.clone(), rev) is None
    assert "--block-size 64" in fk.kv_layout_problem(
        torch.zeros(4, 16, 2, 128), torch.zeros(4, 16, 2, 128), rev
    )


def test_layout_check_agrees_with_the_fakes_copy_rule(fake):
    """What kv_layout_problem accepts is exactly what the kernel would not copy."""
    kernel = fk.load_flydsl_kernel()
    for heads in (1, 2):
        k, v = aiter_views(heads)
        b = batch([8], [100], kv_heads=heads)
        b.k, b.v = k, v
        b.table = torch.tensor([[0, 1]], dtype=torch.int32)
        call(kernel, b)
        assert fake.copied[-1] is (fk.kv_layout_problem(k, v, kernel.revision) is not None)


# ----------------------------------------------------------------------------- warm-up


def test_warm_up_reaches_the_dualwave_kernel_with_every_lpt_variant(fake):
    kernel = fk.load_flydsl_kernel()
    page = 128 if fake.revision == PR1056 else 64
    variants = fk.warm_up(
        kernel, dtype=torch.bfloat16, device="cpu", num_heads=8, num_kv_heads=2, head_size=128,
        page_size=page, is_capturing=lambda: False,
    )  # fmt: skip
    assert variants == ([False, True] if fake.revision == PR1056 else [False])
    assert len(fake.calls) == len(variants)
    for kw, lpt in zip(fake.calls, variants, strict=True):
        assert kw["max_seqlen_q"] > fk.LIGHT_MAX_QUERY  # not the paged light kernel
        assert kw["k"].shape[1] == page
        assert kw.get("causal_lpt", False) is lpt
        assert torch.isfinite(kw["out"]).all()
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        fk.warm_up(kernel, dtype=torch.bfloat16, device="cpu", num_heads=8, num_kv_heads=2, head_size=128,
                   page_size=64, is_capturing=lambda: True)  # fmt: skip
    assert len(fake.calls) == len(variants)


# ----------------------------------------------------------------------------- vLLM classes


@pytest.fixture
def flydsl():
    from flyserve.vllm import flydsl

    return flydsl


@pytest.fixture
def gfx950(monkeypatch):
    """GPU 0 reads as a gfx950 (the only arch FlyDSL's page sizes are declared on)."""
    from flyserve.vllm import device

    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx950")


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    from flyserve.vllm.runtime import RankRuntime

    monkeypatch.setenv("FLYSERVE_KERNEL_TIMER_EVERY", "0")
    monkeypatch.delenv("FLYSERVE_SHAPE_LOG", raising=False)
    rt = RankRuntime(state_dir=tmp_path / "state", rank=0, start=False, setup_metrics=False)
    RankRuntime._instance = rt
    yield rt
    RankRuntime.reset_for_tests()


def test_prefix_sum_buffer_is_persistent(flydsl):
    buf = flydsl.PrefixSumBuffer(8, "cpu")
    a = buf.fill(torch.tensor([5, 3, 10], dtype=torch.int32), 3)
    ptr = a.data_ptr()
    assert a.tolist() == [0, 5, 8, 18] and a.dtype == torch.int32
    b = buf.fill(torch.tensor([1, 2], dtype=torch.int32), 2)
    assert b.data_ptr() == ptr and b.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="exceed"):
        buf.fill(torch.ones(9, dtype=torch.int32), 9)


def _builder(flydsl, monkeypatch):
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionMetadataBuilder

    monkeypatch.setattr(
        RocmAiterUnifiedAttentionMetadataBuilder,
        "build",
        lambda self, cpl, cm, fast_build=False: SimpleNamespace(),
    )
    b = object.__new__(flydsl.FlyDSLDualwaveMetadataBuilder)
    b.cu_seqlens_kv = flydsl.PrefixSumBuffer(8, "cpu")
    return b


def test_builder_takes_the_lpt_flag_from_its_bound_routing_not_a_global(flydsl, runtime, monkeypatch):
    from flyserve.policy import ADMITTED, PREFILL, decision_for

    b = _builder(flydsl, monkeypatch)
    cm = SimpleNamespace(seq_lens=torch.tensor([9, 4], dtype=torch.int32), num_reqs=2)
    routing = SimpleNamespace(last_decision=None)
    b.bind_routing(routing)
    for lpt in (True, False):
        routing.last_decision = decision_for(PREFILL, ADMITTED, lpt)
        runtime.last_decision = decision_for(PREFILL, ADMITTED, not lpt)  # the old global: ignored
        md = b.build(0, cm)
        assert md.lpt is lpt and md.cu_seqlens_kv.tolist() == [0, 9, 13]


def test_unbound_builder_is_an_error_not_lpt_false(flydsl, monkeypatch):
    b = _builder(flydsl, monkeypatch)
    with pytest.raises(flydsl.DecisionNotBound, match="bind_routing"):
        b.build(0, SimpleNamespace(seq_lens=torch.tensor([1], dtype=torch.int32), num_reqs=1))


def _impl(flydsl, kernel, *, heads=8, kv_heads=2, head=128):
    impl = object.__new__(flydsl.FlyDSLDualwaveImpl)
    impl.kernel, impl.unavailable = kernel, None
    impl.static_off, impl.static_off_listeners, impl._layout_checked = None, [], False
    impl.num_heads, impl.head_size, impl.num_kv_heads, impl.scale = heads, head, kv_heads, head**-0.5
    return impl


def _vllm_batch(flydsl, b):
    """The metadata FlyDSLDualwaveMetadataBuilder hands the impl, for batch ``b``."""
    return SimpleNamespace(
        num_actual_tokens=b.q.shape[0], query_start_loc=b.cu_q, seq_lens=b.seq, max_query_len=b.max_q,
        max_seq_len=b.max_kv, block_table=b.table, cu_seqlens_kv=b.cu_kv, lpt=True, causal=True,
    )  # fmt: skip


@pytest.fixture
def unified(monkeypatch):
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionImpl

    calls = []

    def forward(self, layer, query, key, value, kv_cache, md, output, *rest):
        calls.append(md)
        output.fill_(3.0)
        return output

    monkeypatch.setattr(RocmAiterUnifiedAttentionImpl, "forward", forward)
    return calls


def _kv_cache_for(b):
    """A (B, H, N, 2*hs) cache whose AITER split gives back b.k / b.v (1 KV head: in place on #1056)."""
    return torch.cat([b.k.transpose(1, 2), b.v.transpose(1, 2)], dim=-1).contiguous()


def test_forward_runs_flydsl_then_reruns_a_failure_on_aiter_and_opens_the_circuit(
    flydsl, fake, runtime, unified
):
    from flyserve.control import ControlPlane

    b = batch([5, 300], [900, 300], kv_heads=1, heads=4)
    impl = _impl(flydsl, fk.load_flydsl_kernel(), heads=4, kv_heads=1)
    md = _vllm_batch(flydsl, b)
    kv = _kv_cache_for(b)
    if fake.revision == MAIN:  # main would copy the strided single-head view: path off, AITER runs
        impl.forward(None, b.q, b.q, b.q, kv, md, b.out)
        assert impl.static_off and "copies" in impl.static_off and unified == [md]
        return
    impl.forward(None, b.q, b.q, b.q, kv, md, b.out)
    assert not unified and torch.equal(b.out, reference(b))  # FlyDSL ran, on the in-place views
    fake.fail = RuntimeError("kernel exploded")
    impl.forward(None, b.q, b.q, b.q, kv, md, b.out)
    assert unified == [md] and torch.all(b.out == 3)  # the batch was re-run, not lost
    assert runtime.local_circuit_open
    snap = ControlPlane(runtime.state_dir).snapshot()
    assert snap.circuit_open and "kernel exploded" in snap.circuit_reason


def test_a_layout_flydsl_would_copy_switches_the_path_off_and_tells_the_routing(flydsl, fake, unified):
    b = batch([300], [300], kv_heads=2, heads=8)
    impl = _impl(flydsl, fk.load_flydsl_kernel())
    heard = []
    impl.static_off_listeners.append(heard.append)
    md = _vllm_batch(flydsl, b)
    kv = _kv_cache_for(b)  # 2 KV heads in vLLM's (B, H, N, 2*hs) cache: outside the paged ABI
    impl.forward(None, b.q, b.q, b.q, kv, md, b.out)
    impl.forward(None, b.q, b.q, b.q, kv, md, b.out)
    assert unified == [md, md] and not fake.calls  # never called FlyDSL, never copied the cache
    assert len(heard) == 1 and heard[0].startswith("KV cache layout")


def test_warm_up_runs_once_per_build_and_its_failure_opens_the_circuit(
    flydsl, fake, runtime, caplog, monkeypatch
):
    from flyserve.control import ControlPlane

    monkeypatch.setattr(flydsl, "_WARMED", {})
    impl = _impl(flydsl, fk.load_flydsl_kernel())
    assert impl.warm_up(torch.bfloat16, 64, "cpu", lambda: False) is True
    n = len(fake.calls)
    assert n >= 1 and _impl(flydsl, impl.kernel).warm_up(torch.bfloat16, 64, "cpu", lambda: False) is True
    assert len(fake.calls) == n  # a second layer with the same build compiles nothing again
    fake.fail = RuntimeError("no code object for gfx942")
    with caplog.at_level(logging.ERROR, logger="flyserve.vllm"):
        ok = impl.warm_up(torch.float16, 64, "cpu", lambda: False)
        again = _impl(flydsl, impl.kernel).warm_up(torch.float16, 64, "cpu", lambda: False)
    assert ok is False and again is False and runtime.local_circuit_open
    assert sum("warm-up failed" in r.getMessage() for r in caplog.records) == 1  # once, not per layer
    snap = ControlPlane(runtime.state_dir).snapshot()
    assert snap.circuit_open and "warm-up" in snap.circuit_reason and "gfx942" in snap.circuit_reason
    assert any("warm-up failed" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- composite and start-up


def test_kernel_block_sizes_declared_to_vllm(flydsl, fake, monkeypatch, gfx950):
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.composite import create_composite_attention_backend
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionBackend
    from vllm.v1.worker.utils import select_common_block_size

    from flyserve.vllm.backends import ROCM_PREFILL_SPEC
    from flyserve.vllm.routing import routing_class

    comp = create_composite_attention_backend(
        RocmAiterUnifiedAttentionBackend, flydsl.FlyDSLDualwaveBackend, name=f"T{fake.revision[:4]}",
        backend_name="CUSTOM", module=__name__, routing_policy=routing_class(ROCM_PREFILL_SPEC, "unified"),
    )  # fmt: skip
    want = [64, 128] if fake.revision == PR1056 else [64]
    assert comp.get_supported_kernel_block_sizes() == want
    assert comp.get_preferred_block_size(16) == 64  # vLLM's default 16 becomes 64 by itself
    assert select_common_block_size(256, [comp]) == max(want)  # hybrid blocks split into pages
    # an operator's --block-size 16: FlyDSL declares nothing, AITER's sizes stand, the path is off
    monkeypatch.setattr(flydsl, "forced_block_size_problem", lambda rev, bs=None: "forced 16")
    sizes = comp.get_supported_kernel_block_sizes()
    assert len(sizes) == 1 and isinstance(sizes[0], MultipleOf) and sizes[0].base == 16
    assert select_common_block_size(16, [comp]) == 16


def test_forced_block_size_is_remembered_past_vllms_current_config(flydsl, fake, monkeypatch, gfx950):
    import vllm.config as vc

    rev = fk.load_flydsl_kernel().revision
    monkeypatch.setattr(flydsl, "_FORCED", {})
    cfg = SimpleNamespace(cache_config=SimpleNamespace(user_specified_block_size=True, block_size=16))
    monkeypatch.setattr(vc, "get_current_vllm_config_or_none", lambda: cfg)
    assert "--block-size 64" in flydsl.forced_block_size_problem(rev)  # while the model is built
    monkeypatch.setattr(vc, "get_current_vllm_config_or_none", lambda: None)
    assert "--block-size 64" in flydsl.forced_block_size_problem(rev)  # later, at KV cache set-up
    sizes = flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes()
    assert [getattr(s, "base", s) for s in sizes] == [16]  # AITER's: vLLM accepts 16, FlyDSL stays off
    cfg.cache_config.user_specified_block_size = False  # no --block-size: vLLM picks FlyDSL's size
    monkeypatch.setattr(vc, "get_current_vllm_config_or_none", lambda: cfg)
    assert flydsl.forced_block_size_problem(rev) is None
    monkeypatch.setattr(vc, "get_current_vllm_config_or_none", lambda: None)
    assert flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes()[0] == 64


def test_forced_block_size_problem_names_the_flag(flydsl, fake):
    rev = fk.load_flydsl_kernel().revision
    assert flydsl.forced_block_size_problem(rev, 64) is None
    assert "--block-size 64" in flydsl.forced_block_size_problem(rev, 16)
    assert flydsl.forced_block_size_problem(rev, 128) is None  # 128 = 2 pages of 64 on main
    assert flydsl.page_size_for(128, rev) == (128 if fake.revision == PR1056 else 64)


def test_missing_flydsl_declines_with_one_line_naming_the_variable(flydsl, monkeypatch, caplog, tmp_path):
    from flyserve.vllm import backends, device

    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx950")
    monkeypatch.setenv("VLLM_FLYDSL_KERNELS_PATH", str(tmp_path / "absent"))
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        st = backends.rocm_prefill_status()
    assert st.off_reason and "VLLM_FLYDSL_KERNELS_PATH" in st.off_reason
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "VLLM_FLYDSL_KERNELS_PATH" in lines[0] and "AITER unified" in lines[0]
    assert flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes()[0].base == 16


def test_non_gfx950_declines(fake, monkeypatch, caplog):
    from flyserve.vllm import backends, device

    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx942")
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        st = backends.rocm_prefill_status()
    assert "gfx942" in st.off_reason and st.revision is None
    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx950")
    st = backends.rocm_prefill_status()
    assert st.off_reason is None and st.revision == fk.load_flydsl_kernel().revision.label
    assert st.config_problems(SimpleNamespace(cache_config=SimpleNamespace(block_size=16)))[0].count(
        "--block-size 64"
    )


def test_bind_group_hands_over_the_routing_and_applies_the_verdicts(flydsl, fake, runtime):
    from flyserve.vllm.backends import PrefillStatus, _bind_group

    causal = _impl(flydsl, fk.load_flydsl_kernel())
    layer = SimpleNamespace(impl=SimpleNamespace(causal_impl=causal))
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"l0": layer}))
    routing = SimpleNamespace(layer_names=["l0"], problems=[], unsupported=False, rt=runtime)
    child = SimpleNamespace(bound=None)
    child.bind_routing = lambda r: setattr(child, "bound", r)
    builder = SimpleNamespace(routing=routing, general_builder=object(), causal_builder=child)
    status = PrefillStatus("flydsl-dualwave", "rev-x", None, lambda c: ["block size 16 ... --block-size 64"])
    _bind_group(builder, cfg, status)
    assert child.bound is routing
    assert routing.unsupported and routing.problems == ["block size 16 ... --block-size 64"]
    causal.switch_off("KV cache layout: x")
    assert routing.problems[-1] == "KV cache layout: x"
    assert runtime.control.report_dict()["prefill_kernel"] == {
        "kernel": "flydsl-dualwave", "revision": "rev-x", "off_reason": None,
    }  # fmt: skip


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
    assert cls.general_backend_cls is RocmAiterUnifiedAttentionBackend
    assert cls.causal_backend_cls is flydsl.FlyDSLDualwaveBackend
    assert cls.get_name() == "CUSTOM"
    assert (
        flydsl.FlyDSLDualwaveBackend.get_builder_cls().__mro__[1].__name__
        == "RocmAiterUnifiedAttentionMetadataBuilder"
    )
    # a head size FlyDSL lacks must not refuse the composite: the routing reports it 'unsupported'
    assert cls.supports_head_size(96) and cls.supports_head_size(128)


def test_a_kernel_missing_at_start_is_one_log_line_not_one_per_group(flydsl, runtime, caplog):
    from flyserve.vllm.backends import PrefillStatus, _bind_group

    status = PrefillStatus("flydsl-dualwave", None, "FlyDSL not importable: ... VLLM_FLYDSL_KERNELS_PATH ...")
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    with caplog.at_level(logging.INFO, logger="flyserve.vllm"):
        for g in range(3):
            routing = SimpleNamespace(layer_names=[f"g{g}"], problems=[], unsupported=False, rt=runtime)
            builder = SimpleNamespace(routing=routing, general_builder=object(), causal_builder=object())
            _bind_group(builder, cfg, status)
            assert routing.unsupported and routing.problems == [status.off_reason]
    assert caplog.records == []  # rocm_prefill_status logged it once already
    assert runtime.control.report_dict()["prefill_kernel"]["off_reason"] == status.off_reason


def test_a_layer_flydsl_cannot_run_is_not_warmed_up(flydsl, fake, runtime, monkeypatch):
    """Head size 96 (or another scale, fp32...) is reported 'unsupported' by the routing; warming it up
    would raise and open the circuit for every other layer."""
    monkeypatch.setattr(flydsl, "_WARMED", {})
    impl = _impl(flydsl, fk.load_flydsl_kernel(), head=96)
    impl.alibi_slopes = impl.sinks = None
    impl.logits_soft_cap, impl.sliding_window, impl.kv_cache_dtype = 0, (-1, -1), "auto"
    assert any("head size 96" in p for p in impl.ineligible(torch.bfloat16))
    monkeypatch.setattr(
        "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionImpl.process_weights_after_loading",
        lambda self, dtype: None,
    )
    impl.process_weights_after_loading(torch.bfloat16)
    assert not fake.calls and not runtime.local_circuit_open
    ok = _impl(flydsl, impl.kernel)
    ok.alibi_slopes = ok.sinks = None
    ok.logits_soft_cap, ok.sliding_window, ok.kv_cache_dtype = 0, (-1, -1), "auto"
    assert ok.ineligible(torch.bfloat16) == [] and ok.ineligible(torch.float32) != []


def _loaded_impl(flydsl, kv_heads, monkeypatch):
    """An impl as vLLM loads it (the parent's weight step stubbed, no vLLM config: block 64)."""
    monkeypatch.setattr(flydsl, "_WARMED", {})
    monkeypatch.setattr(
        "vllm.v1.attention.backends.rocm_aiter_unified_attn.RocmAiterUnifiedAttentionImpl.process_weights_after_loading",
        lambda self, dtype: None,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    impl = _impl(flydsl, fk.load_flydsl_kernel(), kv_heads=kv_heads)
    impl.alibi_slopes = impl.sinks = None
    impl.logits_soft_cap, impl.sliding_window, impl.kv_cache_dtype = 0, (-1, -1), "auto"
    return impl


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_warm_up_runs_only_where_the_layout_lets_the_path_run(flydsl, fake, runtime, monkeypatch, kv_heads):
    """vLLM 0.32's AITER cache hands strided K/V views: FlyDSL main copies any of them, #1056 reads
    them in place with one KV head per rank only. Elsewhere the path is off before it ever runs, so
    compiling dualwave variants for it is wasted start-up time (and a failure would open the circuit)."""
    monkeypatch.setattr(flydsl, "_on_gfx950", lambda: True, raising=False)
    warmed = []
    monkeypatch.setattr(flydsl.FlyDSLDualwaveImpl, "warm_up", lambda self, *a: warmed.append(a) or True)
    impl = _loaded_impl(flydsl, kv_heads, monkeypatch)
    impl.process_weights_after_loading(torch.bfloat16)
    runs = fake.revision == PR1056 and kv_heads == 1
    assert bool(warmed) is runs
    assert (impl.static_off is None) is runs
    if not runs:
        assert impl.static_off.startswith("KV cache layout") and not runtime.local_circuit_open


def test_no_warm_up_and_aiters_block_sizes_on_another_gpu(flydsl, fake, runtime, monkeypatch):
    """FlyDSL importable on a gfx942: the path is declined at start, so neither warm-up nor FlyDSL's
    page sizes (docs/vllm.md: a non-gfx950 GPU gets AITER's sizes)."""
    from flyserve.vllm import device

    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx942")
    warmed = []
    monkeypatch.setattr(flydsl.FlyDSLDualwaveImpl, "warm_up", lambda self, *a: warmed.append(a) or True)
    impl = _loaded_impl(flydsl, 1, monkeypatch)
    impl.process_weights_after_loading(torch.bfloat16)
    assert not warmed and not fake.calls
    sizes = flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes()
    assert len(sizes) == 1 and sizes[0].base == 16  # AITER's MultipleOf(16)
    monkeypatch.setattr(device, "gpu_arch", lambda: "gfx950")
    assert flydsl.FlyDSLDualwaveBackend.get_supported_kernel_block_sizes()[0] == 64
