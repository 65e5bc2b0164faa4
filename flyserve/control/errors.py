"""The control plane's errors, each mapping to one HTTP status in the sidecar.

ThresholdsError (from flyserve.policy) -> 422, DecodePathChangeRefused (a ThresholdsError) -> 422,
VersionConflict -> 409, ControlIOError -> 503. Every one is raised before anything is published,
so the running snapshot is never half-changed.
"""

from __future__ import annotations

from flyserve.policy.thresholds import ThresholdsError


class DecodePathChangeRefused(ThresholdsError):
    """decode_path cannot change while serving: CUDA graphs are captured for no-prefill batches at start."""

    def __init__(self, old: str, new: str, *, source: str | None = None) -> None:
        super().__init__(
            [
                (
                    "decode_path",
                    (
                        f"cannot change at run time ({old!r} -> {new!r}): CUDA graphs for batches with no "
                        "prefill row are captured at server start; change it in the config file and restart"
                    ),
                )
            ],
            source=source,
        )
        self.old, self.new = old, new


class VersionConflict(RuntimeError):
    """The caller's If-Match version is not the current one (someone else published in between)."""

    def __init__(self, expected: int, current: int) -> None:
        super().__init__(f"version conflict: expected version {expected}, current version is {current}")
        self.expected, self.current = expected, current


class ControlIOError(OSError):
    """The state directory could not be read or written (not writable, full, locked too long)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return self.message if self.path is None else f"{self.message} ({self.path})"
