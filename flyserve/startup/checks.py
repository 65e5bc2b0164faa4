"""Checks every flyserve process makes before it starts anything, so a mistake is the first line
of output and not something found later.

Before this, ``flyserve sidecar --profile gfx955`` started and answered /healthz 200 (only GET
/thresholds said 422), and vLLM with ``FLYSERVE_PROFILE=mi355`` died with a 275-line log whose cause
was at line 56.
"""

from __future__ import annotations

import logging

from flyserve.terminal.printable import LOG_FILTER

log = logging.getLogger("flyserve.startup")


class StartupError(RuntimeError):
    """A start-up check failed; the message is one line naming the setting and the fix."""


def profile_problem(name: str) -> str | None:
    """None when ``name`` is a usable profile (a shipped name, or a thresholds file path), else one
    line naming it and the ones available."""
    from flyserve.policy.thresholds import ThresholdsError
    from flyserve.thresholds_files import available_profiles, load_profile

    try:
        load_profile(name)
    except ThresholdsError as exc:
        if exc.field == "profile":  # an unknown name
            return f"unknown profile {name!r} (available: {', '.join(available_profiles()) or 'none'})"
        return f"profile {name!r} is not valid: {exc}"
    return None


def check_profile(name: str, *, setting: str) -> None:
    """Log one ERROR line naming the setting, the profile and those available, and raise
    StartupError, when ``name`` is not a usable profile."""
    problem = profile_problem(name)
    if problem is None:
        return
    message = f"{setting}: {problem}"
    _ensure_visible(log)
    log.error("%s", message)
    raise StartupError(message)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (a test runner swaps it), like logging's lastResort."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.addFilter(LOG_FILTER)  # the line names a profile as given: escaped

    @property
    def stream(self):  # logging reads this attribute
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _ensure_visible(logger: logging.Logger) -> None:
    """The one ERROR line must reach the terminal whatever logging set-up the process has (none yet
    in a CLI command; uvicorn's or vLLM's later): this logger writes to stderr itself."""
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
        logger.propagate = False
