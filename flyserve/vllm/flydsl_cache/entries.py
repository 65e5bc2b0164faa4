"""Check 3 of the FlyDSL cache check: each entry, read without running it.

An entry is ``pickle.dump`` of FlyDSL's CompiledArtifact, and FlyDSL unpickles every one of a
function folder at its first call. Here an unpickler whose only global is an inert stand-in for
CompiledArtifact reads the state, and the lowered module it holds must target exactly the serving
arch, with no link libraries and post-load processors only from FlyDSL or its kernels.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flyserve.files import safe_read
from flyserve.vllm.flydsl_cache.contents import MAX_ENTRY_BYTES, node_problem
from flyserve.vllm.flydsl_cache.refused import CacheRefused

MAX_IR_BYTES = 64 << 20  # the decompressed module (a zlib bomb stops here)
ARTIFACT_GLOBAL = ("flydsl.compiler.jit_executor", "CompiledArtifact")
PROCESSOR_MODULES = ("flydsl.", "kernels.")  # where FlyDSL's own post-load processors live

_TARGET = re.compile(r"#rocdl\.target<([^<>]*)>")
_CHIP = re.compile(r'\bchip\s*=\s*"([^"]*)"')
_ARCH_NAME = re.compile(r"gfx[0-9a-z]{2,6}")


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
    problem = node_problem(st)
    if problem:
        raise CacheRefused(str(root), f"{rel} is {problem}")
    state = artifact_state(raw)
    if state is None:
        raise CacheRefused(
            str(root), f"{rel} is not a FlyDSL cache entry (a pickle that is not a CompiledArtifact)"
        )
    return state, hashlib.sha256(raw).hexdigest()
