"""Which folder layout a flydsl release gives its kernel cache, told apart by name and by feature.

Two layouts, read from the flydsl wheels' ``compiler/jit_function.py``:

* ``build-folders`` (flydsl 0.4.2, lines 991-1115 and 1380-1406): one folder per JIT function *and
  build*, ``{function}_{manager_key}/`` (``manager_key``, 32 hex, 607-633, hashes the wheel, the
  kernel's sources and its closure), one ``{sha256(str(key))[:16]}.pkl`` per specialization; at a function's first call
  ``load_all()`` unpickles every ``.pkl`` of its folder.
* ``function-folders`` (flydsl 0.5.0, lines 720-838, 1016-1031, 1194-1207): one folder per JIT
  function, ``{function}/``, one ``{sha256(flydsl_key + "\\n" + artifact_key)}.pkl`` (64 hex) per
  specialization, where ``flydsl_key`` (``_flydsl_key_cached``, 258-317) fingerprints the wheel's
  Python files, its native libraries' digests, its version and the ROCm device bitcode, and
  ``artifact_key`` (``_artifact_cache_key``, 515-549) the traced module and its pipeline. Only the
  file a key names is unpickled, on a lookup.

Each release reads only its own layout: an entry of the other one is never a hit, so flyserve counts
it stale instead of warm. A cache is detected from its entries' names; the installed flydsl from the
functions its ``jit_function`` module has (no version is trusted to imply a layout), so a release
that moves them again is reported as unknown rather than misread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """One flydsl cache layout: how an entry is named and what FlyDSL loads from a folder."""

    name: str
    flydsl: str  # the release it was read from
    entry: re.Pattern[str]  # "<function folder>/<name>.pkl"
    bitcode_in_key: bool  # whether the ROCm device bitcode is part of the key (a miss when it differs)
    loads_every_entry: bool  # whether a function's first call unpickles every entry of its folder

    def describe(self) -> str:
        """One phrase for a report: the layout, and what a different ROCm means under it."""
        if self.bitcode_in_key:
            return f"{self.name} (flydsl {self.flydsl}: one folder per function, the key hashes the ROCm bitcode)"
        return (
            f"{self.name} (flydsl {self.flydsl}: one folder per function and build, bitcode not in the key)"
        )


BUILD_FOLDERS = CacheLayout(
    "build-folders", "0.4.2", re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*_[0-9a-f]{32}/[0-9a-f]{16}\.pkl"),
    bitcode_in_key=False, loads_every_entry=True,
)  # fmt: skip
FUNCTION_FOLDERS = CacheLayout(
    "function-folders", "0.5.0", re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/[0-9a-f]{64}\.pkl"),
    bitcode_in_key=True, loads_every_entry=False,
)  # fmt: skip
LAYOUTS = (BUILD_FOLDERS, FUNCTION_FOLDERS)
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def layout_of_entry(rel: str) -> CacheLayout | None:
    """The layout an entry's name ("<function folder>/<name>.pkl") belongs to, or None."""
    return next((layout for layout in LAYOUTS if layout.entry.fullmatch(rel)), None)


def detect_layout(jit_function: ModuleType) -> CacheLayout | None:
    """The layout of the flydsl whose ``flydsl.compiler.jit_function`` module this is, from what it
    has: 0.5.0's module-level ``_disk_cache_key``, or 0.4.2's ``JitCacheManager.load_all`` with
    ``JitFunction._build_full_cache_key``. None: neither (a flydsl that moved them again)."""
    if callable(getattr(jit_function, "_disk_cache_key", None)) and callable(
        getattr(jit_function, "_artifact_cache_key", None)
    ):
        return FUNCTION_FOLDERS
    jf, manager = getattr(jit_function, "JitFunction", None), getattr(jit_function, "JitCacheManager", None)
    if hasattr(jf, "_build_full_cache_key") and hasattr(manager, "load_all"):
        return BUILD_FOLDERS
    return None


def installed_layout() -> CacheLayout | None:
    """The installed flydsl's layout (None: flydsl absent, not importable here, or unknown)."""
    try:
        from flydsl.compiler import jit_function
    except Exception:  # noqa: BLE001 - absent, or a wheel failing to import on this machine
        return None
    return detect_layout(jit_function)
