"""The one error of the FlyDSL cache check: every step raises it, every caller catches the type."""

from __future__ import annotations


class CacheRefused(Exception):
    """A FlyDSL cache folder flyserve will not let FlyDSL load: ``path`` the folder, ``reason`` why
    (which component or entry, and what is wrong with it; never what a file holds)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")
