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
    _check_profile_or_exit()
    from flyserve.vllm.backends import register_for_current_platform

    register_for_current_platform()


def _check_profile_or_exit() -> None:
    """A bad FLYSERVE_PROFILE ends the process here, with one ERROR line naming it and the profiles
    available. vLLM calls register() while it builds its argument parser, so this is the first
    thing that fails; found later, it was line 56 of a 275-line log ending in "Engine core
    initialization failed"."""
    from flyserve.startup_checks import StartupError, check_profile
    from flyserve.vllm.runtime import PROFILE_ENV, profile_name

    try:
        check_profile(profile_name(), setting=PROFILE_ENV)
    except StartupError:
        raise SystemExit(2) from None
