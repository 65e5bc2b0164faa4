"""The vllm.general_plugins entry point: off by default, registers the CPU composite when enabled."""

from __future__ import annotations

import importlib.metadata

import pytest
from _support import module_requires

pytestmark = pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
required_modules = module_requires("vllm")  # imported when a test runs, not at collection


@pytest.fixture
def overrides(monkeypatch):
    from vllm.v1.attention.backends import registry

    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", dict(registry._ATTN_OVERRIDES))
    return registry


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.value == "flyserve.vllm.plugin:register" for ep in eps)


def test_disabled_by_default(monkeypatch, overrides):
    from flyserve.vllm import plugin

    monkeypatch.delenv("FLYSERVE_ATTENTION", raising=False)
    plugin.register()
    E = overrides.AttentionBackendEnum
    assert E.CUSTOM not in overrides._ATTN_OVERRIDES and E.CPU_ATTN not in overrides._ATTN_OVERRIDES


def test_enabled_on_cpu_registers_custom_and_cpu_attn(monkeypatch, overrides, tmp_path):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from flyserve.vllm import backends, plugin, startup_phase

    monkeypatch.setenv("FLYSERVE_ATTENTION", "1")
    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    # the start-up hooks land on vLLM's wrapper class: put it back as it was afterwards
    monkeypatch.setattr(WorkerWrapperBase, "execute_model", WorkerWrapperBase.execute_model)
    monkeypatch.setattr(WorkerWrapperBase, "compile_or_warm_up_model", None, raising=False)
    monkeypatch.delattr(WorkerWrapperBase, "compile_or_warm_up_model")
    monkeypatch.setattr(startup_phase, "PHASE", startup_phase.StartupPhase())
    plugin.register()
    assert startup_phase.PHASE.installed and not startup_phase.PHASE.serving_now()
    assert WorkerWrapperBase.__dict__["compile_or_warm_up_model"]._flyserve_warm_up
    assert WorkerWrapperBase.__dict__["execute_model"]._flyserve_first_step
    E = overrides.AttentionBackendEnum
    path = "flyserve.vllm.backends.FlyserveCpuAttention"
    assert overrides._ATTN_OVERRIDES[E.CUSTOM] == path == overrides._ATTN_OVERRIDES[E.CPU_ATTN]
    cls = E.CPU_ATTN.get_class()  # what vLLM's CPU platform will load
    assert cls is backends.FlyserveCpuAttention and cls.get_name() == "CUSTOM"
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from flyserve.vllm.cpu_prefill import CpuPrefillBackend

    assert cls.general_backend_cls is CPUAttentionBackend and cls.causal_backend_cls is CpuPrefillBackend
    # vLLM's composite builder, subclassed only to hand the routing to the child builders at start
    assert cls.get_builder_cls().__mro__[1].__name__ == "CompositeAttentionMetadataBuilder"
    assert cls.prefill_status.off_reason is None and cls.prefill_status.kernel == "cpu-sdpa-prefill"


def test_cuda_pair_composes(tmp_path, monkeypatch):
    """TRITON_ATTN + FLASH_ATTN form a real composite (shared cache layout, separate cache update).
    Not run on a GPU here; this only checks that vLLM's factory accepts the pair."""
    from flyserve.vllm import backends

    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(backends, "_BUILT", {})
    cls = backends.build_composite("cuda")
    general, causal, _ = backends._children("cuda")
    assert cls.general_backend_cls is general and cls.causal_backend_cls is causal
    assert general.get_name() == "TRITON_ATTN" and causal.get_name() == "FLASH_ATTN"
    assert cls.get_name() == "CUSTOM" and cls.__name__ == "FlyserveCudaAttention"


def test_start_publishes_the_operator_file_before_capture(tmp_path, monkeypatch, caplog):
    """$FLYSERVE_CONFIG is published when the backend is built, decode_path included (the one moment
    it may change), once however many workers do it; a bad file is logged and changes nothing."""
    from flyserve.control import ControlPlane
    from flyserve.vllm.backends import start_decode_path

    state = tmp_path / "state"
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("decode_path: prefill\nmin_seq_len: 64\n")
    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(state))
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    monkeypatch.setenv("FLYSERVE_CONFIG", str(cfg))
    assert start_decode_path() == "prefill"
    assert start_decode_path() == "prefill"  # a second worker: same content, no new version
    snap = ControlPlane(state, profile="cpu-tiny").snapshot()
    assert snap.version == 1 and snap.thresholds.min_seq_len == 64 and snap.source == "file"
    cfg.write_text("decode_path: sideways\n")
    with caplog.at_level("ERROR", logger="flyserve.vllm"):
        assert start_decode_path() == "prefill"
    assert "decode_path" in caplog.text
    assert ControlPlane(state, profile="cpu-tiny").snapshot().version == 1
