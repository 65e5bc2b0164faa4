"""check_cache_dir: the three checks in order, and what a folder that passed holds.

CacheCheck counts the entries of a folder that passed: for this deployment's variants, for other
variants, not listed by the manifest, and (given this host's key inputs) stale; Deployment is the
variants one deployment runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyserve.vllm.flydsl_cache.contents import scan_entries
from flyserve.vllm.flydsl_cache.entries import artifact_problem, read_entry
from flyserve.vllm.flydsl_cache.location import check_location, lstat_or_none
from flyserve.vllm.flydsl_cache.manifest import read_manifest
from flyserve.vllm.flydsl_cache.refused import CacheRefused
from flyserve.vllm.flydsl_key import KeyInputs, stale_reason
from flyserve.vllm.flydsl_layout import layout_of_entry

TARGET_ARCH = "gfx950"


@dataclass(frozen=True, slots=True)
class Deployment:
    """The variants one deployment runs: an entry listed for one of them is one of its kernels."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: str  # bf16 | f16 | fp32
    page_sizes: tuple[int, ...]

    def runs(self, variant: Mapping[str, Any]) -> bool:
        """Whether a manifest's variant record is one this deployment runs (either LPT value)."""
        return (
            variant.get("num_heads") == self.num_heads
            and variant.get("num_kv_heads") == self.num_kv_heads
            and variant.get("head_size") == self.head_size
            and variant.get("dtype") == self.dtype
            and variant.get("page_size") in self.page_sizes
        )


@dataclass(frozen=True, slots=True)
class CacheCheck:
    """A folder that passed: its entries (each read and found to be for ``arch``) and what flyserve's
    manifest says each was compiled for."""

    root: str
    arch: str
    entries: tuple[str, ...]  # "<function folder>/<key hash>.pkl"
    listed: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    built: Mapping[str, KeyInputs] = field(default_factory=dict)  # the key inputs the manifest names

    def stale(self, host: KeyInputs | None) -> dict[str, str]:
        """Entry -> why it can never be a hit on a host with these key inputs ("another flydsl",
        "another ROCm"); entries that can, or cannot be told, are not in it."""
        out = {}
        for entry in self.entries:
            layout = layout_of_entry(entry)
            why = stale_reason(self.built.get(entry), host, layout.name if layout else None)
            if why:
                out[entry] = why
        return out

    def counts(self, deployment: Deployment | None, host: KeyInputs | None = None) -> dict[str, int]:
        """Entries for this deployment's variants, for other variants, and not listed (variant unknown);
        given the host's key inputs, also the stale ones (counted in none of the other three)."""
        stale = self.stale(host) if host is not None else {}
        mine = other = unlisted = 0
        for entry in self.entries:
            if entry in stale:
                continue
            variants = self.listed.get(entry)
            if not variants:
                unlisted += 1
            elif deployment is not None and any(deployment.runs(v) for v in variants):
                mine += 1
            else:
                other += 1
        out = {"entries": len(self.entries), "for_this_deployment": mine, "other_variants": other,
               "unlisted": unlisted}  # fmt: skip
        if host is not None:
            out["stale"] = len(stale)
            out["stale_flydsl"] = sum(1 for why in stale.values() if why == "another flydsl")
            out["stale_rocm"] = sum(1 for why in stale.values() if why == "another ROCm")
        return out

    def describe(self, deployment: Deployment | None, host: KeyInputs | None = None) -> str:
        """One phrase for a log line or a report: only this deployment's entries count as its warm
        kernels; stale ones (given the host's key inputs) are named apart, never as warm."""
        c = self.counts(deployment, host)
        if not c["entries"]:
            return "no entries"
        text = (
            f"all {c['entries']} for {self.arch}: {c['for_this_deployment']} listed for this deployment's "
            f"variants, {c['other_variants']} for other variants (not counted), {c['unlisted']} not listed "
            "by `flyserve flydsl compile`"
        )
        if c.get("stale"):
            text += (
                f", {c['stale']} stale ({c['stale_flydsl']} from another flydsl, {c['stale_rocm']} from another "
                "ROCm: never a hit here)"
            )
        return text


def check_cache_dir(root: str | os.PathLike[str], *, arch: str = TARGET_ARCH) -> CacheCheck:
    """Check a FlyDSL cache folder (location, contents, every entry, the manifest) before FlyDSL is
    pointed at it. Raises CacheRefused; a folder not made yet passes with no entries."""
    path = Path(os.path.abspath(root))
    try:
        return _check(path, arch)
    except OSError as exc:  # anything the steps did not foresee still refuses, naming the folder
        raise CacheRefused(str(path), f"cannot be examined ({exc.strerror or type(exc).__name__})") from None


def _check(path: Path, arch: str) -> CacheCheck:
    """check_cache_dir's steps, in order: location, contents, entries against the manifest."""
    check_location(path)
    if lstat_or_none(path) is None:
        return CacheCheck(str(path), arch, ())
    entries = scan_entries(path)
    manifest = read_manifest(path)
    listed: dict[str, tuple[Mapping[str, Any], ...]] = {}
    built: dict[str, KeyInputs] = {}
    for rel in entries:
        state, digest = read_entry(path, rel)
        problem = artifact_problem(state, arch)
        if problem:
            raise CacheRefused(str(path), f"entry {rel} is {problem}")
        rec = manifest.get(rel)
        if rec is None:
            continue
        if rec["sha256"] != digest:
            raise CacheRefused(str(path), f"entry {rel} changed since `flyserve flydsl compile` listed it")
        if rec.get("arch") not in (None, arch):
            raise CacheRefused(str(path), f"entry {rel} is listed for another arch, not {arch}")
        listed[rel] = tuple(rec["variants"])
        inputs = KeyInputs.from_record(rec.get("key"))
        if inputs is not None:
            built[rel] = inputs
    return CacheCheck(str(path), arch, tuple(entries), listed, built)
