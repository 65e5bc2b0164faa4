"""`flyserve doctor`'s flydsl row: the installed flydsl, whether flyserve was tested with it, the
cache layout it uses, and FlyDSL's cache folder compared with this host's own ROCm.

Why a row of its own: flydsl 0.5.0 keeps its cache in another layout than 0.4.2 and hashes the
ROCm device bitcode into every entry's name, so a cache built with another flydsl, or on another
ROCm (a CPU builder with Debian's bitcode), is never a hit here although its files are there. The
row says how many entries of the folder this host can use, from the names and flyserve's manifest,
without loading any (flydsl_cache.check_cache_dir). Never raises.
"""

from __future__ import annotations

from flyserve.vllm import flydsl_cache, flydsl_key
from flyserve.vllm.flydsl_kernel import flydsl_cache_dir

FIX_VERSION = "pip install 'flydsl>=0.4.2,<0.6' (flyserve is tested with 0.4.2 and 0.5.0)"
FIX_STALE = (
    "rebuild the cache on this image with its own ROCm: `flyserve flydsl compile --cache-dir ...` "
    '(docs/vllm.md, "Warm start")'
)


def cache_phrase(host: flydsl_key.KeyInputs) -> tuple[str, int]:
    """(what the cache folder holds for this host, how many of its entries are stale here)."""
    root = flydsl_cache_dir()
    if root is None:
        return "FlyDSL's disk cache is off", 0
    try:
        check = flydsl_cache.check_cache_dir(root)
    except flydsl_cache.CacheRefused as exc:
        return f"cache {root} would not be loaded: {exc.reason}", 0
    if not check.entries:
        return f"cache {root}: no entries", 0
    c = check.counts(None, host)
    built = {
        b.bitcode
        for rel, b in check.built.items()
        if b.bitcode and check.stale(host).get(rel) == "another ROCm"
    }
    text = (
        f"cache {root}: {c['entries']} entries, {c['entries'] - c['stale']} usable here, {c['stale']} stale "
        f"({c['stale_flydsl']} from another flydsl, {c['stale_rocm']} from another ROCm"
    )
    if built:
        text += f": built with bitcode {', '.join(sorted(flydsl_key.short(b) for b in built))}"
    text += f"; this host's bitcode {flydsl_key.short(host.bitcode)})"
    return text, c["stale"]


def flydsl_status() -> tuple[str, str, str]:
    """The flydsl row as (status, detail, fix), as ``vllm_versions.assess`` returns its row: the
    doctor wraps it in its Check (this module imports nothing of the doctor's)."""
    try:
        version = flydsl_key.flydsl_version()
        if version is None:
            return ("ok", ("not installed (only the ROCm prefill path and `flyserve flydsl compile` "
                         "need it)"), FIX_VERSION)  # fmt: skip
        layout = flydsl_key.installed_layout()
        host = flydsl_key.host_key_inputs(layout=layout)
        tested = flydsl_key.is_tested(version)
        head = f"flydsl {version} ({'tested' if tested else 'not tested: flyserve knows 0.4.2 and 0.5.0'})"
        if layout is None:
            return ("warn", (f"{head}; cache layout unknown (its jit_function has neither 0.4.2's "
                         "nor 0.5.0's cache-key functions)"), FIX_VERSION)  # fmt: skip
        phrase, stale = cache_phrase(host)
        detail = f"{head}; cache layout {layout.describe()}; {phrase}"
        if not tested:
            return ("warn", detail, FIX_VERSION)
        if stale:
            return ("warn", detail, FIX_STALE)
        return ("ok", detail, "")
    except Exception as exc:  # noqa: BLE001 - a check that cannot run is a finding, not a crash
        return ("fail", f"{type(exc).__name__}: {exc}"[:400], "")
