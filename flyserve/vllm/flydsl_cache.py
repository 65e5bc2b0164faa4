"""FlyDSL's kernel cache, checked before flyserve lets FlyDSL load it.

What FlyDSL does with the folder, read from its source (``python/flydsl/compiler/jit_function.py``
``JitCacheManager`` and ``JitFunction._ensure_cache_manager``, ``jit_executor.py``
``CompiledArtifact``, ``utils/file.py`` ``atomic_write``; ROCm/FlyDSL main 11c4174d and the
flydsl 0.4.2 wheel, jit_function.py lines 991-1115 and 1390-1406 there; flydsl 0.5.0 names its
folders and entries otherwise and unpickles only the entry a key names: ``flyserve.vllm.flydsl_layout``
has both layouts, and this check reads either):

* one folder per JIT function and build, ``{cache dir}/{function}_{manager_key}/``, where
  ``manager_key`` hashes the flydsl wheel, the kernel's sources and its closure's scalars (page size,
  LPT, heads, head size: what one variant of flyserve's call fixes);
* in it one ``{sha256(str(cache key))[:16]}.pkl`` per specialization, the key holding the target
  (``GPUTarget(backend='rocm', arch='gfx950', ...)``), the dtypes and which dims are dynamic; written
  0600 through a same-folder temporary ``.{name}.*.tmp``, with ``{name}.lock`` beside it (FlyDSL
  opens it read-write, creating it, even to read);
* the ``.pkl`` is ``pickle.dump`` of a ``flydsl.compiler.jit_executor.CompiledArtifact``: a dict
  state with the lowered MLIR module (``ir_zlib`` zlib-compressed in 0.4.2, ``ir_text`` before),
  whose ``#gpu.object<#rocdl.target<chip = "gfx950", ...>, bin = ...>`` carries the code object,
  the names of post-load processors (imported by name when unpickled) and link libraries;
* at a JIT function's first call ``load_all()`` runs ``pickle.load`` on **every** ``*.pkl`` of its
  folder, whatever its name; a hit then parses the module and JIT-compiles its host code.

So whoever can write the folder runs code in the server, twice over (the unpickle, then the host
code of the module). The checks below run before flyserve points FlyDSL at a folder:

1. the location: the folder and every directory above it (as written and as resolved) owned by
   this user or root; the folder itself not a symlink and not group- or world-writable; a directory
   above it writable by others only with the sticky bit (then only an entry's owner may rename or
   remove it, so the path cannot be swapped); a folder not made yet needs its nearest existing
   parent not writable by others at all (else a stranger could make it first);
2. what is inside: function folders holding files, nothing deeper; each one owned by this user or
   root, not group- or world-writable, a directory or a regular file (no symlink, FIFO, socket,
   device), a file at most MAX_ENTRY_BYTES, at most MAX_FILES in all;
3. each entry, read without running it (an unpickler whose only global is a stand-in for
   CompiledArtifact): a FlyDSL artifact whose module targets exactly the serving arch, with no link
   libraries and post-load processors only from FlyDSL or its kernels; and where flyserve's
   manifest lists it, the bytes it listed.

The check is about who could have written the folder, not a sandbox: an artifact that passes is
still code, trusted because only this user or root can have put it there. A refusal raises
CacheRefused naming the folder and the reason, never a file's contents.

The manifest (MANIFEST_NAME in the cache folder, written by `flyserve flydsl compile --cache-dir`;
FlyDSL reads only the function folders) says which variant each entry was compiled for, from the
cache keys FlyDSL computed in the compile, and the key inputs it was built with (flydsl release,
layout, device-bitcode fingerprint: ``flyserve.vllm.flydsl_key``): the warm-up's log line and the
compile report count the entries for this deployment's variants apart from entries for other
variants and unlisted ones, and, given this host's key inputs, the stale entries (another flydsl's
layout or release, another ROCm's bitcode) that can never be a hit here apart from them all.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import stat
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyserve.files import safe_read
from flyserve.files.atomic import atomic_write
from flyserve.vllm.flydsl_key import KeyInputs, stale_reason
from flyserve.vllm.flydsl_layout import layout_of_entry

TARGET_ARCH = "gfx950"
MANIFEST_NAME = "flyserve-cache.json"
MANIFEST_FORMAT = "flyserve-flydsl-cache"
MANIFEST_VERSION = 1
MAX_ENTRY_BYTES = 64 << 20  # a dualwave artifact is about 15 KB; the cap is only against a huge file
MAX_IR_BYTES = 64 << 20  # the decompressed module (a zlib bomb stops here)
MAX_FILES = 4096
MAX_MANIFEST_BYTES = 8 << 20
ARTIFACT_GLOBAL = ("flydsl.compiler.jit_executor", "CompiledArtifact")
PROCESSOR_MODULES = ("flydsl.", "kernels.")  # where FlyDSL's own post-load processors live
VARIANT_FIELDS = ("num_heads", "num_kv_heads", "head_size", "dtype", "page_size")
_ENTRY_PATH = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*/(?:[0-9a-f]{16}|[0-9a-f]{64})\.pkl")  # 0.4.2 | 0.5.0
_TARGET = re.compile(r"#rocdl\.target<([^<>]*)>")
_CHIP = re.compile(r'\bchip\s*=\s*"([^"]*)"')
_ARCH_NAME = re.compile(r"gfx[0-9a-z]{2,6}")
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class CacheRefused(Exception):
    """A FlyDSL cache folder flyserve will not let FlyDSL load: ``path`` the folder, ``reason`` why
    (which component or entry, and what is wrong with it; never what a file holds)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


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


# ----------------------------------------------------------------------------- the location


def trusted_owners() -> frozenset[int]:
    """Who may own the folder and its entries: this process's user, and root (who can write anything anyway)."""
    return frozenset({os.geteuid(), 0})


def _lstat(path: Path) -> os.stat_result | None:
    """The path's own stat (a link is not followed), or None when it does not exist."""
    return _stat(path, follow_symlinks=False)


def _stat(path: Path, *, follow_symlinks: bool = True) -> os.stat_result | None:
    """os.stat, or None when the path does not exist; any other error refuses the cache."""
    try:
        return os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CacheRefused(str(path), f"cannot be examined ({exc.strerror or type(exc).__name__})") from None


def _owner_problem(st: os.stat_result) -> str | None:
    if st.st_uid in trusted_owners():
        return None
    return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"


def _folder_problem(st: os.stat_result) -> str | None:
    """Why a folder FlyDSL reads entries from is not private: any write by another user could add one."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink (FlyDSL would follow it wherever it is pointed)"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    return _owner_problem(st)


def _ancestor_problem(st: os.stat_result) -> str | None:
    """Why a directory above the folder would let a stranger swap the path below it."""
    owner = _owner_problem(st)
    if owner or stat.S_ISLNK(st.st_mode):  # a link's own mode means nothing; its owner and parent do
        return owner
    if st.st_mode & _WRITABLE_BY_OTHERS and not st.st_mode & stat.S_ISVTX:
        return f"group- or world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _ancestors(root: Path) -> list[Path]:
    """Every directory above ``root``, as written and as resolved (a symlinked parent is checked on
    both sides: the link where it sits, and what it leads to)."""
    resolved = Path(os.path.realpath(root.parent))
    return list(dict.fromkeys((*root.parents, resolved, *resolved.parents)))


def check_location(root: Path) -> None:
    """Raise CacheRefused unless ``root`` and every directory above it are as the module docstring says."""
    st = _lstat(root)
    if st is not None:
        problem = _folder_problem(st)
        if problem:
            raise CacheRefused(str(root), f"the cache directory is {problem}")
    else:
        base = next((p for p in root.parents if _lstat(p) is not None), Path("/"))
        bst = _stat(base)  # a link there is checked with the ancestors below
        problem = _folder_problem(bst) if bst is not None else "a dangling symlink"
        if problem:
            raise CacheRefused(
                str(root), f"does not exist yet and {base}, where it would be made, is {problem}"
            )
    for parent in _ancestors(root):
        pst = _lstat(parent)
        problem = _ancestor_problem(pst) if pst is not None else None
        if problem:
            raise CacheRefused(str(root), f"{parent} (above the cache directory) is {problem}")


# ----------------------------------------------------------------------------- what is inside


def _node_problem(st: os.stat_result) -> str | None:
    """Why one thing inside the cache is refused (a folder: FlyDSL's function folder; else a file)."""
    if stat.S_ISDIR(st.st_mode):
        return _folder_problem(st)
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file (a {_kind(st.st_mode)})"
    if st.st_mode & _WRITABLE_BY_OTHERS:
        return f"group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_size > MAX_ENTRY_BYTES:
        return f"larger than {MAX_ENTRY_BYTES} bytes ({st.st_size})"
    return _owner_problem(st)


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):  # fmt: skip
        if test(mode):
            return word
    return "special file"


def _scan(folder: Path) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each thing in ``folder``, symlinks not followed."""
    try:
        with os.scandir(folder) as it:
            return [(e.name, e.stat(follow_symlinks=False)) for e in it]
    except OSError as exc:
        raise CacheRefused(str(folder), f"cannot be listed ({exc.strerror or type(exc).__name__})") from None


def scan_entries(root: Path) -> list[str]:
    """The ``.pkl`` entries under ``root`` ("<function folder>/<name>.pkl"), after checking every file
    and folder there; raises CacheRefused on the first one refused."""
    entries: list[str] = []
    files = 0
    for name, st in sorted(_scan(root)):
        files += 1
        problem = _node_problem(st)
        if problem:
            raise CacheRefused(str(root), f"{name} is {problem}")
        if not stat.S_ISDIR(st.st_mode):
            continue
        inside = _scan(root / name)
        if files + len(inside) > MAX_FILES:
            raise CacheRefused(str(root), f"holds more than {MAX_FILES} files")
        for inner, ist in sorted(inside):
            files += 1
            rel = f"{name}/{inner}"
            if stat.S_ISDIR(ist.st_mode):
                raise CacheRefused(
                    str(root), f"{rel} is a directory inside a function folder (FlyDSL makes none)"
                )
            problem = _node_problem(ist)
            if problem:
                raise CacheRefused(str(root), f"{rel} is {problem}")
            if inner.endswith(".pkl"):
                entries.append(rel)
    return entries


# ----------------------------------------------------------------------------- each entry


class _ArtifactState:
    """Stands in for FlyDSL's CompiledArtifact while an entry is read: keeps the state, runs nothing."""

    __slots__ = ("state",)

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _EntryUnpickler(pickle.Unpickler):
    """Resolves no global but CompiledArtifact, and that one to the inert stand-in: a pickle naming
    anything else (os.system, builtins.exec, ...) stops before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ARTIFACT_GLOBAL:
            return _ArtifactState
        raise pickle.UnpicklingError("a global other than FlyDSL's CompiledArtifact")


def artifact_state(raw: bytes) -> dict[str, Any] | None:
    """The state dict of a pickled CompiledArtifact, or None when ``raw`` is anything else."""
    try:
        obj = _EntryUnpickler(io.BytesIO(raw)).load()
    except Exception:  # noqa: BLE001 - any malformed or foreign pickle is simply "not an artifact"
        return None
    state = getattr(obj, "state", None) if isinstance(obj, _ArtifactState) else None
    return state if isinstance(state, dict) else None


def _inflate(packed: Any) -> str | None:
    """A zlib-compressed module's text, bounded; None if it is not one."""
    if not isinstance(packed, bytes):
        return None
    try:
        d = zlib.decompressobj()
        text = d.decompress(packed, MAX_IR_BYTES)
        if d.unconsumed_tail:
            return None
        return text.decode("utf-8")
    except (zlib.error, UnicodeDecodeError):
        return None


def _module_text(state: Mapping[str, Any]) -> str | None:
    """The lowered module FlyDSL would parse from the artifact, bounded; None if it holds none.

    flydsl 0.4.2's ``CompiledArtifact.__setstate__`` takes ``ir_zlib`` whenever the key is there
    and ``ir_text`` only without it; FlyDSL main (11c4174d) reads ``ir_text`` alone. So an entry
    with both is judged by both: they must be the same module (else None: a planted ``ir_text``
    for the serving arch must not vouch for an ``ir_zlib`` that 0.4.2 would load instead)."""
    text = state.get("ir_text")
    if "ir_zlib" not in state:
        return text if isinstance(text, str) else None
    packed = _inflate(state["ir_zlib"])
    if packed is None or ("ir_text" in state and text != packed):
        return None
    return packed


def module_targets(text: str) -> set[str]:
    """The chips of every ``#rocdl.target<...>`` in a module's text (a name that is not a gfx arch shows as ``?``)."""
    chips = {m.group(1) for t in _TARGET.finditer(text) for m in _CHIP.finditer(t.group(1))}
    return {c if _ARCH_NAME.fullmatch(c) else "?" for c in chips}


def artifact_problem(state: Mapping[str, Any], arch: str) -> str | None:
    """Why an artifact is not one of FlyDSL's kernels for ``arch`` (None: it is)."""
    text = _module_text(state)
    if text is None and "ir_zlib" in state and "ir_text" in state and _inflate(state["ir_zlib"]) is not None:
        return "an artifact whose ir_text and ir_zlib are different modules (FlyDSL versions load different ones)"
    if text is None or not isinstance(state.get("entry"), str):
        return "not a FlyDSL artifact (no compiled module)"
    targets = module_targets(text)
    if not targets:
        return "a module with no ROCm target"
    if targets != {arch}:
        return f"compiled for {', '.join(sorted(targets))}, not {arch}"
    if state.get("link_libs"):
        return "an artifact with link libraries (FlyDSL never caches those; they would be loaded)"
    refs = state.get("processor_refs", [])
    if not isinstance(refs, list) or not all(
        isinstance(r, str) and r.startswith(PROCESSOR_MODULES) for r in refs
    ):
        return "an artifact whose post-load processors are not FlyDSL's (they are imported by name)"
    return None


def read_entry(root: Path, rel: str) -> tuple[dict[str, Any], str]:
    """(artifact state, sha256 of its bytes) of one entry, read without following a link or
    blocking; raises CacheRefused if the file changed kind or owner since it was listed."""
    try:
        got = safe_read.read_file(root / rel, MAX_ENTRY_BYTES, source=rel)
    except safe_read.SafeReadError as exc:
        raise CacheRefused(str(root), f"{rel}: {exc.reason}") from None
    if got is None:
        raise CacheRefused(str(root), f"{rel} vanished while the cache was checked")
    raw, st = got
    problem = _node_problem(st)
    if problem:
        raise CacheRefused(str(root), f"{rel} is {problem}")
    state = artifact_state(raw)
    if state is None:
        raise CacheRefused(
            str(root), f"{rel} is not a FlyDSL cache entry (a pickle that is not a CompiledArtifact)"
        )
    return state, hashlib.sha256(raw).hexdigest()


# ----------------------------------------------------------------------------- the manifest


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
    if _lstat(path) is None:
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
