"""The ``--cache-dir`` folder: checked before a child is pointed at it, listed and counted after.

FlyDSL unpickles what it finds in its cache, so the folder is refused (naming the path and the
reason) unless flyserve.vllm.flydsl_cache would load it; after the run the entries the children's
cache keys name go into flyserve's manifest with their variant.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flyserve.doctor.compile.errors import CompileCheckError
from flyserve.doctor.compile.geometry import Geometry
from flyserve.doctor.compile.results import VariantResult
from flyserve.vllm import flydsl_cache
from flyserve.vllm.flydsl_key import KeyInputs


def check_cache_arg(cache_dir: str | None) -> None:
    """Refuse a ``--cache-dir`` FlyDSL must not load (CompileCheckError naming the path and the reason)."""
    if not cache_dir:
        return
    try:
        flydsl_cache.check_cache_dir(cache_dir)
    except flydsl_cache.CacheRefused as exc:
        raise CompileCheckError(
            f"--cache-dir {exc.path} refused: {exc.reason}. FlyDSL unpickles what it finds there, so only "
            'this user or root may be able to write it (docs/vllm.md, "The cache is code")'
        ) from None


def deployment_of(geometry: Geometry, page_sizes: Iterable[int]) -> flydsl_cache.Deployment:
    """The variants this run's deployment serves, as the cache check counts them."""
    g = geometry
    return flydsl_cache.Deployment(
        g.num_heads, g.num_kv_heads, g.head_size, g.dtype, tuple(sorted(set(page_sizes)))
    )


def observed_entries(results: list[VariantResult]) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(entry, arch of its cache key, variant) of every cache entry a variant that ran as planned used."""
    rows = []
    for r in results:
        if r.status != "ok" or r.variant.batch == "wrong":
            continue
        for e in r.child.get("cache_entries") or []:
            if isinstance(e, dict) and isinstance(e.get("path"), str):
                rows.append((e["path"], e.get("arch"), r.variant.as_dict()))
    return rows


def cache_after_run(
    cache_dir: str | None,
    results: list[VariantResult],
    deployment: flydsl_cache.Deployment,
    key: KeyInputs | None = None,
) -> dict[str, Any] | None:
    """List this run's entries in the folder's manifest (with the key inputs this run had), then
    check the folder again as the server will: the counts (entries for this deployment, for other
    variants, not listed and, given ``key``, stale for this flydsl and bitcode), or the refusal."""
    if not cache_dir:
        return None
    try:
        flydsl_cache.record_entries(cache_dir, observed_entries(results), key=key)
        check = flydsl_cache.check_cache_dir(cache_dir)
    except flydsl_cache.CacheRefused as exc:
        return {"refused": exc.reason}
    except OSError as exc:
        return {"refused": f"the manifest could not be written ({exc.strerror or type(exc).__name__})"}
    return {"arch": check.arch, **check.counts(deployment, key), "describe": check.describe(deployment, key)}
