"""flyserve's manifest of a FlyDSL cache folder (MANIFEST_NAME, written by `flyserve flydsl compile`).

It says which variant each entry was compiled for, from the cache keys FlyDSL computed in the
compile, with the sha256 of the entry's bytes and the key inputs it was built with
(flyserve.vllm.flydsl_key): FlyDSL reads only the function folders, so the manifest is flyserve's
own record, checked like any other file in the folder (a document flyserve did not write refuses
the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from flyserve.files import safe_read
from flyserve.files.atomic import atomic_write
from flyserve.vllm.flydsl_cache.contents import MAX_ENTRY_BYTES
from flyserve.vllm.flydsl_cache.refused import CacheRefused
from flyserve.vllm.flydsl_key import KeyInputs

MANIFEST_NAME = "flyserve-cache.json"
MANIFEST_FORMAT = "flyserve-flydsl-cache"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 8 << 20
VARIANT_FIELDS = ("num_heads", "num_kv_heads", "head_size", "dtype", "page_size")
_ENTRY_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/(?:[0-9a-f]{16}|[0-9a-f]{64})\.pkl")  # 0.4.2 | 0.5.0


def _manifest_problem(doc: Any) -> str | None:
    """Why a manifest document is not one flyserve wrote (field names only)."""
    if (
        not isinstance(doc, dict)
        or doc.get("format") != MANIFEST_FORMAT
        or doc.get("version") != MANIFEST_VERSION
    ):
        return f"not a {MANIFEST_FORMAT} version {MANIFEST_VERSION} document"
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return "field 'entries' is not an object"
    for rel, rec in entries.items():
        if not _ENTRY_PATH.fullmatch(rel):
            return "an entry name that is not '<function folder>/<16 or 64 hex>.pkl'"
        if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str):
            return f"entry {rel}: no sha256"
        if not isinstance(rec.get("variants"), list) or not all(isinstance(v, dict) for v in rec["variants"]):
            return f"entry {rel}: field 'variants' is not a list of objects"
        if "key" in rec and KeyInputs.from_record(rec["key"]) is None:
            return f"entry {rel}: field 'key' is not an object of strings"
    return None


def read_manifest(root: Path) -> dict[str, dict[str, Any]]:
    """flyserve's manifest of the folder ({} when there is none); raises CacheRefused if unreadable."""
    try:
        doc = safe_read.read_json(root / MANIFEST_NAME, MAX_MANIFEST_BYTES, source=MANIFEST_NAME)
    except safe_read.SafeReadError as exc:
        raise CacheRefused(str(root), f"{MANIFEST_NAME}: {exc.reason}") from None
    if doc is None:
        return {}
    problem = _manifest_problem(doc)
    if problem:
        raise CacheRefused(str(root), f"{MANIFEST_NAME}: {problem}")
    return doc["entries"]


def variant_record(variant: Mapping[str, Any]) -> dict[str, Any]:
    """What the manifest keeps of a compiled variant: its name, geometry, page size and LPT value."""
    return {
        "name": variant.get("name"),
        **{k: variant.get(k) for k in VARIANT_FIELDS},
        "lpt": variant.get("lpt"),
    }


def record_entries(
    root: str | os.PathLike[str],
    observed: Iterable[tuple[str, str | None, Mapping[str, Any]]],
    *,
    key: KeyInputs | None = None,
) -> int:
    """Add (entry, arch from its cache key, variant) rows to the folder's manifest: the entries a
    compile just produced or loaded, each with the sha256 of its bytes and, given, the key inputs the
    compile had (``key``: an entry built elsewhere then reads as stale, not warm). Rows for files
    that are not there are skipped. Written through a temporary and a rename; returns the entries
    listed."""
    path = Path(os.path.abspath(root))
    entries = read_manifest(path)
    for rel, arch, variant in observed:
        if not _ENTRY_PATH.fullmatch(rel):
            continue
        try:
            got = safe_read.read_file(path / rel, MAX_ENTRY_BYTES, source=rel)
        except safe_read.SafeReadError as exc:
            raise CacheRefused(str(path), f"{rel}: {exc.reason}") from None
        if got is None:
            continue
        digest = hashlib.sha256(got[0]).hexdigest()
        rec = entries.get(rel)
        if rec is None or rec.get("sha256") != digest:
            rec = entries[rel] = {"sha256": digest, "arch": arch, "variants": []}
            if key is not None:
                rec["key"] = key.as_dict()
        record = variant_record(variant)
        if record not in rec["variants"]:
            rec["variants"].append(record)
    _write_manifest(path, {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "entries": entries})
    return len(entries)


def _write_manifest(root: Path, doc: dict[str, Any]) -> None:
    """Replace the manifest in one rename (a reader sees the old one or the new one), mode 0644."""
    atomic_write(root / MANIFEST_NAME, json.dumps(doc, indent=1, sort_keys=True) + "\n", durable=False)
