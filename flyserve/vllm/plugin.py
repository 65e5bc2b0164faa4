"""The ``vllm.general_plugins`` entry point (declared in pyproject.toml).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers).
It does nothing unless flyserve attention is enabled (``FLYSERVE_ATTENTION=1``), so merely
having flyserve installed never changes how vLLM runs.
"""

from __future__ import annotations

import logging
import os
import sys

ENABLE_ENV = "FLYSERVE_ATTENTION"
LOG_LEVEL_ENV = "FLYSERVE_LOG_LEVEL"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def show_logs() -> None:
    """Send the ``flyserve`` loggers to stderr in vLLM's processes (vLLM configures only its own
    ``vllm`` logger, so without this the rank's start line, the mode in force and every applied
    version would be dropped). Level: $FLYSERVE_LOG_LEVEL, default INFO. Idempotent. The records are
    escaped (flyserve.terminal.printable.install_log_filter): they quote state files and the engine channel;
    vLLM's own loggers are left as vLLM formats them."""
    from flyserve.terminal.printable import install_log_filter

    root = logging.getLogger("flyserve")
    if any(getattr(h, "_flyserve", False) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler._flyserve = True  # type: ignore[attr-defined]
    handler.setFormatter(
        logging.Formatter(f"(flyserve pid={os.getpid()}) %(levelname)s %(asctime)s [%(name)s] %(message)s")
    )
    install_log_filter(handler)
    root.addHandler(handler)
    root.setLevel((os.environ.get(LOG_LEVEL_ENV) or "INFO").upper())


def register() -> None:
    """Register flyserve's composite attention backend for this platform, the engine channel's
    worker method (flyserve.vllm.engine_channel) and the hooks that tell vLLM's start-up batches from
    serving ones (flyserve.vllm.startup_phase), when enabled."""
    if not enabled():
        return
    _check_profile_or_exit()
    from flyserve.vllm import startup_phase
    from flyserve.vllm.backends import register_for_current_platform
    from flyserve.vllm.engine_channel import install

    show_logs()
    register_for_current_platform()
    install()
    startup_phase.install()


def _check_profile_or_exit() -> None:
    """A bad FLYSERVE_PROFILE ends the process here, with one ERROR line naming it and the profiles
    available. vLLM calls register() while it builds its argument parser, so this is the first
    thing that fails; found later, it was line 56 of a 275-line log ending in "Engine core
    initialization failed"."""
    from flyserve.startup.checks import StartupError, check_profile
    from flyserve.vllm.runtime import PROFILE_ENV, profile_name

    try:
        check_profile(profile_name(), setting=PROFILE_ENV)
    except StartupError:
        raise SystemExit(2) from None
