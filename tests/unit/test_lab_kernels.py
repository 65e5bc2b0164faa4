"""flyserve.lab.kernels: the torch reference against a naive dense implementation (CPU), and the
exact calls each adapter makes into its kernel module (fake modules: aiter, FlyDSL and the CUDA
kernels cannot run here)."""

from __future__ import annotations

import ast
import inspect
import math
import types
from pathlib import Path

import pytest
from _support import require_module

from flyserve.lab.kernels import (
    FlyDSLDualwave,
    KernelUnavailable,
    get_kernel,
    kernel_names,
)

torch = require_module("torch")

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


class _Recorder:
    """A stand-in kernel. With ``signature`` (the real kernel's), each call is bound to it first, so
    an argument the kernel does not take, or a required one left out, fails the call as it would on
    the GPU."""

    def __init__(self, signature: inspect.Signature | None = None):
        self.calls = []
        self.signature = signature

    def __call__(self, *args, **kwargs):
        if self.signature is not None:
            self.signature.bind(*args, **kwargs)  # TypeError on a mismatch
        self.calls.append((args, kwargs))


def _fake_module(monkeypatch, name, attr, signature=None):
    rec = _Recorder(signature)
    monkeypatch.setitem(__import__("sys").modules, name, types.SimpleNamespace(**{attr: rec}))
    return rec


def _installed_vllm_source(relpath: str) -> Path:
    vllm = require_module("vllm")
    path = Path(vllm.__file__).parent / relpath
    assert path.is_file(), f"the installed vLLM has no {relpath}"
    return path


def _signature_from_source(path: Path, func: str) -> inspect.Signature:
    """A function's signature read with ast (for a module that cannot be imported on a CPU host)."""
    node = next(
        n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == func
    )
    a = node.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    params = [
        inspect.Parameter(
            arg.arg,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None if i >= first_default else inspect.Parameter.empty,
        )
        for i, arg in enumerate(positional)
    ]
    params += [
        inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, default=None if d is not None else inspect.Parameter.empty)
        for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    if a.kwarg is not None:
        params.append(inspect.Parameter(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _args(causal=True):
    q, kc, vc, cu, su, table = _paged([1, 6], [7, 6])
    out = torch.empty_like(q)
    return (q, kc, vc, out, cu, su, table, 6, 7, 1 / math.sqrt(D), causal)


def test_triton_unified_call(monkeypatch):
    """The call binds to the installed vLLM's unified_attention, with the 3D-kernel buffers sized by
    the constants of vLLM's own TritonAttentionMetadataBuilder (read from vLLM, not retyped here)."""
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    rec = _fake_module(
        monkeypatch,
        "vllm.v1.attention.ops.triton_unified_attention",
        "unified_attention",
        inspect.signature(unified_attention),
    )
    a = _args()
    get_kernel("triton_unified")(*a)
    ((args, kw),) = rec.calls
    assert args == ()
    assert kw["q"] is a[0] and kw["k"] is a[1] and kw["v"] is a[2] and kw["out"] is a[3]
    assert kw["cu_seqlens_q"] is a[4] and kw["seqused_k"] is a[5] and kw["block_table"] is a[6]
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"]) == (6, 7, a[9], True)
    assert kw["window_size"] == (-1, -1) and kw["softcap"] == 0 and kw["q_descale"] is None
    assert kw["alibi_slopes"] is None and kw["sinks"] is None and kw["output_scale"] is None
    threshold = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // HKV
    segments = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    assert kw["seq_threshold_3D"] == threshold and kw["num_par_softmax_segments"] == segments
    assert tuple(kw["softmax_segm_output"].shape) == (threshold, H, segments, D)
    assert tuple(kw["softmax_segm_max"].shape) == (threshold, H, segments)
    assert tuple(kw["k_descale"].shape) == (2, HKV) and float(kw["k_descale"].max()) == 1.0


def test_fa3_call(monkeypatch):
    """The call binds to the installed vLLM's flash_attn_varlen_func (its source: the module needs
    the CUDA extension to import)."""
    sig = _signature_from_source(
        _installed_vllm_source("vllm_flash_attn/flash_attn_interface.py"), "flash_attn_varlen_func"
    )
    assert {"q", "fa_version", "seqused_k", "block_table"} <= set(sig.parameters)  # the right function
    rec = _fake_module(monkeypatch, "vllm.vllm_flash_attn", "flash_attn_varlen_func", sig)
    a = _args(causal=False)
    get_kernel("fa3")(*a)
    ((args, kw),) = rec.calls
    assert args == ()
    assert kw["fa_version"] == 3
    assert kw["q"] is a[0] and kw["k"] is a[1] and kw["v"] is a[2] and kw["out"] is a[3]
    assert kw["cu_seqlens_q"] is a[4] and kw["seqused_k"] is a[5] and kw["block_table"] is a[6]
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"], kw["softmax_scale"], kw["causal"]) == (6, 7, a[9], False)
    assert kw["window_size"] == [-1, -1] and kw["softcap"] == 0.0 and kw["alibi_slopes"] is None
    assert "cu_seqlens_k" not in kw  # paged: the KV lengths come from seqused_k


def test_a_call_the_kernel_cannot_take_is_caught(monkeypatch):
    """The signature-bound fake bites: an unknown keyword and a missing required argument both fail."""
    sig = inspect.signature(lambda q, k, *, causal=False: None)
    rec = _Recorder(sig)
    rec(1, 2, causal=True)
    with pytest.raises(TypeError):
        rec(1, 2, dropout=0.0)
    with pytest.raises(TypeError):
        rec(1)


def test_aiter_call(monkeypatch):
    rec = _fake_module(monkeypatch, "aiter.ops.triton.unified_attention", "unified_attention")
    a = _args()
    get_kernel("aiter_unified")(*a)
    ((args, kw),) = rec.calls
    assert args == ()
    assert kw["q"] is a[0] and kw["k"] is a[1] and kw["v"] is a[2] and kw["out"] is a[3]
    assert kw["block_table"] is a[6] and kw["seqused_k"] is a[5] and kw["causal"] is True
    assert kw["window_size"] == (-1, -1) and kw["softcap"] == 0 and kw["q_descale"] is None
    assert float(kw["k_descale"]) == 1.0 and float(kw["v_descale"]) == 1.0
    with pytest.raises(ValueError, match="causal-only"):
        get_kernel("aiter_unified")(*_args(causal=False))


def test_flydsl_call(monkeypatch):
    rec = _fake_module(monkeypatch, "kernels.attention.flash_attn_interface", "flydsl_flash_attn_func")
    a = _args()
    get_kernel("flydsl_dualwave")(*a)
    ((args, kw),) = rec.calls
    assert args[:3] == (a[0], a[1], a[2])
    assert kw == {
        "causal": True,
        "num_kv_heads": HKV,
        "cu_seqlens_q": a[4],
        "max_seqlen_q": 6,
        "max_seqlen_kv": 7,
        "cross_seqlen": True,
        "block_table": a[6],
        "seqlen_k": a[5],
        "kv_cache_layout": "linear",
        "out": a[3],
    }
    bad = list(a)
    bad[9] = 0.5
    with pytest.raises(ValueError, match="softmax scale"):
        get_kernel("flydsl_dualwave")(*bad)


def test_missing_kernels_fail_clearly(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "aiter", None)
    with pytest.raises(KernelUnavailable, match="aiter"):
        get_kernel("aiter_unified")
    for m in FlyDSLDualwave.modules:
        monkeypatch.setitem(__import__("sys").modules, m, None)
    with pytest.raises(KernelUnavailable, match="FlyDSL"):
        get_kernel("flydsl_dualwave")
    with pytest.raises(KernelUnavailable, match="unknown kernel"):
        get_kernel("nope")
    assert set(kernel_names()) >= {"triton_unified", "fa3", "aiter_unified", "flydsl_dualwave", "torch_ref"}
