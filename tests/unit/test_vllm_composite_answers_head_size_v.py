"""vLLM 0.34's ``AttentionBackend.supports_head_size_v``: flyserve's composites answer for both kernels.

vLLM asks it of an explicitly chosen backend (``--attention-backend CUSTOM``) for a model whose V head
size differs from K's (vllm/model_executor/models/mimo_v2.py:325 in the 0.34.0 wheel) and, on a no,
gives those layers a DiffKV backend with a warning of its own. vLLM's composite does not forward the
question (the 0.34 record: not among its members), so without an answer of flyserve's the base's
``head_size_v == head_size`` would decide, silently.

The installed vLLM is 0.32 (no such method on any child); 0.34's answers are replayed from its source
where a child has one: AITER unified's ``head_size_v <= head_size`` (rocm_aiter_unified_attn.py:92).
"""

from __future__ import annotations

import inspect
import json
import logging

import pytest
from _support import REPO, module_requires

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
required_modules = module_requires("vllm")  # imported when a test runs, not at collection

RECORD_034 = json.loads(
    (REPO / "tests" / "data" / "contracts" / "vllm_touchpoints" / "0.34.0.json").read_text(encoding="utf-8")
)


@pytest.fixture
def composite(tmp_path, monkeypatch):
    from flyserve.vllm import backends

    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(backends, "_BUILT", {})
    return backends.build_composite


def test_vllm_034_asks_and_its_composite_does_not_answer():
    tps = RECORD_034["touchpoints"]
    assert tps["AttentionBackend"]["members"]["supports_head_size_v"]["params"] == [
        "cls",
        "head_size",
        "head_size_v",
    ]
    assert "supports_head_size_v" not in tps["composite backend"]["members"]


@pytest.mark.parametrize("kind", ["cpu", "cuda", "rocm"])
def test_the_composite_takes_the_parameters_vllm_passes(composite, kind):
    cls = composite(kind)
    params = list(inspect.signature(cls.supports_head_size_v).parameters)
    assert params == ["head_size", "head_size_v"]  # a classmethod: (cls, head_size, head_size_v)


def test_on_a_vllm_without_the_question_k_and_v_share_one_head_size(composite, caplog):
    cls = composite("cpu")
    assert cls.supports_head_size_v(128, 128) is True
    with caplog.at_level(logging.WARNING, logger="flyserve.vllm"):
        assert cls.supports_head_size_v(192, 128) is False
        assert cls.supports_head_size_v(192, 128) is False
    lines = [r.getMessage() for r in caplog.records if "declines V head size" in r.getMessage()]
    assert len(lines) == 1  # once per geometry
    assert "FlyserveCpuAttention declines V head size 128 with K head size 192" in lines[0]
    assert "CPUAttentionBackend and CpuPrefillBackend cannot serve it" in lines[0]


def test_rocm_declines_what_flydsl_cannot_run_even_where_aiter_can(composite, monkeypatch, caplog):
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import RocmAiterUnifiedAttentionBackend

    from flyserve.vllm.backends import child_takes_head_size_v
    from flyserve.vllm.flydsl import FlyDSLDualwaveBackend

    # 0.34's AITER unified: V may be narrower than K (its cache is split at head_size)
    monkeypatch.setattr(
        RocmAiterUnifiedAttentionBackend,
        "supports_head_size_v",
        classmethod(lambda cls, head_size, head_size_v: head_size_v <= head_size),
        raising=False,
    )
    assert child_takes_head_size_v(RocmAiterUnifiedAttentionBackend, 192, 128) is True
    assert child_takes_head_size_v(FlyDSLDualwaveBackend, 192, 128) is False  # one head dim for q, k, v
    cls = composite("rocm")
    assert cls.supports_head_size_v(128, 128) is True
    with caplog.at_level(logging.WARNING, logger="flyserve.vllm"):
        assert cls.supports_head_size_v(192, 128) is False
    (line,) = [r.getMessage() for r in caplog.records if "declines V head size" in r.getMessage()]
    assert ": FlyDSLDualwaveBackend cannot serve it" in line and "neither routes nor counts" in line


def test_the_mimo_caller_reads_the_answer_from_the_class_vllm_registered(composite):
    """The one caller in 0.34 asks ``requested.get_class()``: CUSTOM's registered class, flyserve's
    composite, whose own method answers (not the base's inherited one)."""
    cls = composite("cpu")
    assert "supports_head_size_v" in cls.__dict__
