"""The ``vllm.general_plugins`` entry point (declared in pyproject.toml).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers).
It does nothing unless flyserve attention is enabled (``FLYSERVE_ATTENTION=1``), so merely
having flyserve installed never changes how vLLM runs.
"""

from __future__ import annotations

import os

ENABLE_ENV = "FLYSERVE_ATTENTION"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """Register flyserve's composite attention backend for this platform (when enabled)."""
    if not enabled():
        return
    from flyserve.vllm.backends import register_for_current_platform

    register_for_current_platform()
