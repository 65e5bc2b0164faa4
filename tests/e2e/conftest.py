"""Shared fixtures of the real-vLLM end-to-end tests: one tiny model per session."""

from __future__ import annotations

import os

import pytest
from _support import require_module


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    require_module("vllm")
    from flyserve.vllm.tiny_model import build_tiny_model

    cache = os.environ.get("FLYSERVE_TINY_MODEL_DIR")
    return build_tiny_model(cache or tmp_path_factory.mktemp("tiny-model"))
