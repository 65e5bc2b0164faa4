"""FlyDSL's disk cache in this process: where it is, what it holds, and pointing FlyDSL elsewhere.

FlyDSL's cache (flydsl 0.4.2 and 0.5.0 utils/env.py RuntimeEnvManager) is on by default: one folder
per JIT function (0.4.2: and build) under the cache dir, one ``<key hash>.pkl`` per compiled
specialization (compiler/jit_function.py JitCacheManager; both layouts: flydsl_layout.py; what
loading one runs: flydsl_cache/). A warm-up that adds no file compiled nothing. FlyDSL reads the
variables below on every access and opens a JIT function's cache folder at its first call: setting
them before the warm-up's first call decides where that build's kernels are read from.

Before FlyDSL opens the folder, ``checked_cache`` runs flyserve.vllm.flydsl_cache's check on it; a
folder that fails is never handed to FlyDSL.
"""

from __future__ import annotations

import logging
import os
import tempfile

from flyserve.vllm.flydsl_cache import CacheCheck, CacheRefused, check_cache_dir

log = logging.getLogger("flyserve.vllm")

CACHE_DIR_ENV = "FLYDSL_RUNTIME_CACHE_DIR"
CACHE_ENABLE_ENV = "FLYDSL_RUNTIME_ENABLE_CACHE"
RUN_ONLY_ENV = "FLYDSL_RUNTIME_RUN_ONLY"  # reads the disk cache even with the cache switched off
PRIVATE_CACHE_PREFIX = "flyserve-flydsl-cache-"


def _env_flag(name: str, default: bool) -> bool:
    """A FlyDSL OptBool: only 1/true/yes/on are true; unset is the default."""
    raw = os.environ.get(name)
    return default if raw is None else raw.lower() in ("1", "true", "yes", "on")


def flydsl_cache_dir() -> str | None:
    """Where FlyDSL reads and writes compiled kernels in this process (None: its cache is off)."""
    if not _env_flag(CACHE_ENABLE_ENV, True) and not _env_flag(RUN_ONLY_ENV, False):
        return None
    root = os.environ.get(CACHE_DIR_ENV)
    if root is None:
        return os.path.join(os.path.expanduser("~"), ".flydsl", "cache")
    return root or None  # set but empty: FlyDSL keeps no disk cache


def flydsl_cache_entries() -> frozenset[str] | None:
    """The compiled specializations in FlyDSL's disk cache now (None: the cache is off)."""
    root = flydsl_cache_dir()
    if root is None:
        return None
    try:
        return frozenset(
            f"{d.name}/{f.name}"
            for d in os.scandir(root)
            if d.is_dir()
            for f in os.scandir(d.path)
            if f.name.endswith(".pkl")
        )
    except OSError:  # no cache folder yet
        return frozenset()


def checked_cache() -> CacheCheck | None:
    """FlyDSL's cache folder for this process, checked (flydsl_cache.check_cache_dir) before FlyDSL
    opens it. A folder that fails is never handed to FlyDSL: it is pointed at a fresh private folder
    instead (``use_private_cache``) and one warning names the folder and the reason. Never raises:
    a bad cache costs a compile, not the server. None: no disk cache, or the one refused."""
    root = flydsl_cache_dir()
    if root is None:
        return None
    try:
        return check_cache_dir(root)
    except CacheRefused as exc:
        reason = exc.reason
    except Exception as exc:  # noqa: BLE001 - a check that breaks refuses; serving goes on
        reason = f"it could not be checked ({type(exc).__name__})"
    log.warning(
        "flyserve: FlyDSL cache %s not loaded: %s; FlyDSL compiles into %s instead (docs/vllm.md, "
        "\"The cache is code\")",
        root, reason, use_private_cache(),
    )  # fmt: skip
    return None


def use_private_cache() -> str:
    """Point FlyDSL at a new folder only this user can write (mkdtemp: 0700); where that cannot be
    made, at no disk cache (an empty cache dir). Returns what it was pointed at, for the log."""
    try:
        private = tempfile.mkdtemp(prefix=PRIVATE_CACHE_PREFIX)
    except OSError:
        os.environ[CACHE_DIR_ENV] = ""
        return "no disk cache (no private folder could be made)"
    os.environ[CACHE_DIR_ENV] = private
    return private
