"""`flyserve doctor` checks vLLM's own call of AITER's unified_attention against the installed aiter.

vLLM 0.34 passes ``shuffled_kv_cache=`` there (rocm_aiter_unified_attn.py:312-333 in the 0.34.0 wheel);
an aiter without the keyword fails inside vLLM on the first forward. The reader is run on the installed
vLLM 0.32's real backend source; 0.34's call is replayed as data (its keywords, read from the wheel),
in a module written here, since vLLM's code is not kept in this repository.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from _support import module_requires
from contract_fakes import AITER_CONTRACT, fake_function, load_contract

from flyserve.doctor import aiter_calls, checks

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
required_modules = module_requires("vllm")  # imported when a test runs, not at collection

CALL_034 = (
    "q", "k", "v", "out", "cu_seqlens_q", "max_seqlen_q", "seqused_k", "max_seqlen_k", "softmax_scale",
    "causal", "alibi_slopes", "window_size", "block_table", "softcap", "q_descale", "k_descale", "v_descale",
    "sinks", "output_scale", "shuffled_kv_cache",
)  # fmt: skip
"""The keywords of vLLM 0.34.0's causal AITER call, in order (scripts/contracts/vllm_upstream.py prints them)."""


def backend_module(keywords: tuple[str, ...]) -> str:
    """A module shaped like vLLM's AITER backend: aiter's function imported in __init__, stored on self,
    called by keyword; and vLLM's own Triton kernel of the same name, which is not aiter's."""
    kw = ", ".join(f"{k}=None" for k in keywords)
    return f"""
class Impl:
    def __init__(self):
        from aiter.ops.triton.unified_attention import unified_attention
        self.unified_attention = unified_attention

    def forward(self, causal):
        if causal:
            self.unified_attention({kw})
        else:
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention as triton_ua
            triton_ua(q=None, extra_vllm_only=None)
"""


def aiter_at(contract: dict):
    return lambda module: fake_function(contract, lambda a: None)


def without(contract: dict, name: str) -> dict:
    return {**contract, "parameters": [p for p in contract["parameters"] if p["name"] != name]}


def test_the_reader_finds_the_installed_vllms_call():
    path, text = aiter_calls.installed_backend_source()
    assert path.name == "rocm_aiter_unified_attn.py"
    (call,) = aiter_calls.aiter_calls(text)  # the causal call; the Triton fallback is vLLM's own kernel
    assert call.module == "aiter.ops.triton.unified_attention" and call.positional == 0
    assert set(CALL_034) - set(call.keywords) == {"shuffled_kv_cache"}  # 0.32 does not pass it yet
    assert "q" in call.keywords and "output_scale" in call.keywords


def test_vllm_034s_call_binds_to_the_recorded_aiter():
    source = (Path("rocm_aiter_unified_attn.py"), backend_module(CALL_034))
    (call,) = aiter_calls.aiter_calls(source[1])
    assert call.keywords == CALL_034
    status, detail, _ = aiter_calls.assess_vllm_aiter_call(source, aiter_at(load_contract(AITER_CONTRACT)))
    assert status == "ok" and "20 keywords" in detail


def test_an_aiter_without_shuffled_kv_cache_fails_naming_the_keyword():
    source = (Path("rocm_aiter_unified_attn.py"), backend_module(CALL_034))
    old = without(load_contract(AITER_CONTRACT), "shuffled_kv_cache")
    status, detail, fix = aiter_calls.assess_vllm_aiter_call(source, aiter_at(old))
    assert status == "fail"
    assert "keyword(s) shuffled_kv_cache= missing" in detail and "TypeError on its first forward" in detail
    assert "e4048607" in fix
    # the installed vLLM 0.32's call does not pass it: the same old aiter serves it
    assert aiter_calls.assess_vllm_aiter_call(None, aiter_at(old))[0] == "ok"


def test_an_aiter_taking_kwargs_accepts_any_keyword():
    source = (Path("x.py"), backend_module(("q", "brand_new")))
    missing, error = aiter_calls.unbound(aiter_calls.aiter_calls(source[1])[0], lambda q, **kw: None)
    assert missing == [] and error is None


def test_no_aiter_importable_is_a_warning_not_a_guess():
    status, detail, _ = aiter_calls.assess_vllm_aiter_call()  # no aiter on this machine
    assert status == "warn" and "not compared" in detail and "not importable" in detail


def test_the_doctors_rocm_lines_include_vllms_call(monkeypatch):
    monkeypatch.setitem(
        sys.modules,
        "aiter.ops.triton.unified_attention",
        types.SimpleNamespace(unified_attention=fake_function(load_contract(AITER_CONTRACT), lambda a: None)),
    )
    line = {c.name: c for c in checks.rocm_pair_checks("gfx950")}["rocm-vllm-aiter-call"]
    assert line.status == "ok" and "binds to the installed aiter" in line.detail
