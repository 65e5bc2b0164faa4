"""Which ``aiter`` this Python would import: AMD's, or the unrelated package that owns the name on PyPI.

Why: ``pip install aiter`` installs Richard Kiss's "Useful patterns building upon asynchronous
iterators" (aiter 0.13.20191203, github.com/richardkiss/aiter), not AMD's kernel library. AMD's is not on
PyPI: it is built from source (github ROCm/aiter, distribution ``amd-aiter``) or comes inside ROCm's vLLM
images. With the wrong one, ``import aiter`` works and vLLM's ``ROCM_AITER_UNIFIED_ATTN`` fails later
with "No module named 'aiter.ops'", which names neither cause nor fix.

Read from the file system and the installed distributions' metadata only: nothing is imported (AMD's
``aiter/__init__`` loads torch and its JIT machinery; the doctor must not depend on that to say which
package it is).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

UNRELATED_DIST = "aiter"
UNRELATED_SUMMARY = "asynchronous iterators"
"""In the summary of PyPI's aiter ("Useful patterns building upon asynchronous iterators.")."""
UNRELATED_HOME = "github.com/richardkiss/aiter"
UNRELATED_MODULES = ("map_aiter.py", "azip.py", "iter_to_aiter.py")
"""Modules of PyPI's aiter package; AMD's has none of them."""
AMD_DIST = "amd-aiter"
AMD_SOURCE = "github.com/ROCm/aiter"
AMD_OPS = ("ops", "triton")
"""AMD's layout: the kernels vLLM imports live under aiter/ops/triton/."""


@dataclass(frozen=True, slots=True)
class AiterPackage:
    """What ``import aiter`` would load: ``kind`` absent, amd, unrelated (PyPI's async-iterator
    library) or mixed (AMD's files, with PyPI's distribution installed over the same folder)."""

    kind: Literal["absent", "amd", "unrelated", "mixed"]
    where: str = ""
    distribution: str = ""
    """``name version`` of the distribution that says it provides the module, if any."""
    why: str = ""


def _metadata(name: str) -> importlib.metadata.PackageMetadata | None:
    try:
        return importlib.metadata.metadata(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _is_unrelated(meta: importlib.metadata.PackageMetadata | None) -> bool:
    if meta is None:
        return False
    summary = (meta.get("Summary") or "").lower()
    home = " ".join(meta.get_all("Home-page") or []) + " " + " ".join(meta.get_all("Project-URL") or [])
    return UNRELATED_SUMMARY in summary or UNRELATED_HOME in home.lower()


def identify() -> AiterPackage:
    """Which ``aiter`` this interpreter finds first on ``sys.path``, and what says so."""
    try:
        spec = importlib.util.find_spec("aiter")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return AiterPackage("absent")
    dirs = [Path(d) for d in (spec.submodule_search_locations or [])]
    where = str(dirs[0]) if dirs else str(spec.origin or "?")
    pypi = _metadata(UNRELATED_DIST)
    amd = _metadata(AMD_DIST)
    unrelated_dist = pypi if _is_unrelated(pypi) else None
    dist = ""
    if amd is not None:
        dist = f"{AMD_DIST} {amd.get('Version')}"
    elif unrelated_dist is not None:
        dist = f"{UNRELATED_DIST} {unrelated_dist.get('Version')}"
    has_ops = any(d.joinpath(*AMD_OPS).is_dir() for d in dirs)
    iterator_modules = sorted({m for d in dirs for m in UNRELATED_MODULES if (d / m).is_file()})
    if not has_ops:
        why = f"no {'/'.join(('aiter', *AMD_OPS))}/ package"
        if iterator_modules:
            why += f"; it has {', '.join(iterator_modules)}, modules of PyPI's async-iterator library"
        if unrelated_dist is not None:
            why += f"; the installed distribution {dist} says: {unrelated_dist.get('Summary')!r}"
        return AiterPackage("unrelated", where, dist, why)
    if unrelated_dist is not None:
        why = (
            f"AMD's files, but PyPI's unrelated {UNRELATED_DIST} {unrelated_dist.get('Version')} is installed "
            "too: it shares the aiter/ folder, and uninstalling either removes the other's files"
        )
        return AiterPackage("mixed", where, dist, why)
    return AiterPackage("amd", where, dist, "")


def assess(found: AiterPackage | None = None) -> tuple[Literal["ok", "warn"], str, str] | None:
    """The doctor's ``aiter-package`` line as (status, detail, fix); None when no ``aiter`` is importable
    (on ROCm, rocm-unified then fails with the install hint; elsewhere nothing needs aiter)."""
    found = found if found is not None else identify()
    origin = f"AMD's aiter is not on PyPI: build it from {AMD_SOURCE} or use a ROCm vLLM image"
    if found.kind == "absent":
        return None
    if found.kind == "amd":
        return "ok", f"{found.where}: AMD's aiter ({found.distribution or 'no distribution metadata'})", ""
    if found.kind == "mixed":
        return (
            "warn",
            f"{found.where}: {found.why}",
            (f"pip uninstall {UNRELATED_DIST} {AMD_DIST}, then reinstall AMD's ({origin})"),
        )
    return (
        "warn",
        (
            f"{found.where} is not AMD's aiter: {found.why}. The PyPI name 'aiter' belongs to an unrelated "
            "async-iterator library; vLLM's ROCM_AITER_UNIFIED_ATTN cannot import its kernels from it"
        ),
        f"pip uninstall {UNRELATED_DIST}; {origin}",
    )
