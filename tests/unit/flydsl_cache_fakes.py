"""FlyDSL's kernel cache as FlyDSL writes and reads it, for tests that run without FlyDSL.

* ``artifact_bytes``: a cache entry as flydsl 0.4.2 writes it, ``pickle.dump`` of a
  ``flydsl.compiler.jit_executor.CompiledArtifact`` whose state is what its ``__getstate__`` returns
  (the lowered module zlib-compressed, with its ``#rocdl.target<chip = ...>``). Built from pickle
  opcodes, so no flydsl module is needed to write it; the same opcodes FlyDSL's class gives
  (tests/data/flydsl_cache/compiled-artifact-flydsl-0.4.2.pkl is that class's own output).
* ``FakeFlyDSLCache``: stands in for ``flydsl_flash_attn_func`` with FlyDSL's cache behaviour
  (jit_function.py ``_ensure_cache_manager`` / ``JitCacheManager``): at a build's first call it
  reads ``FLYDSL_RUNTIME_CACHE_DIR``, runs ``pickle.load`` on every ``.pkl`` of the build's function
  folder (``load_all``: a planted payload runs here, as in FlyDSL), then loads the entry its key
  names or writes one (0600 through a temporary, with a 0644 ``.lock``), as a compile does.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import zlib
from pathlib import Path
from typing import Any

FUNCTION = "launch_flash_attn_dualwave_swp"
ENTRY = "3a4665933b24458b.pkl"  # the key hash of the warm-up's specialization (results/flydsl/warm-start.txt)


def module_text(arch: str = "gfx950") -> str:
    """A lowered module as FlyDSL keeps it: the code object in a gpu.binary with its ROCm target."""
    return (
        "module attributes {gpu.container_module} {\n"
        f'  gpu.binary @kernels [#gpu.object<#rocdl.target<chip = "{arch}", flags = {{unsafe_math}}>, '
        'bin = "\\7FELF\\02\\01">]\n}\n'
    )


def artifact_bytes(arch: str = "gfx950", **state: Any) -> bytes:
    """The bytes of one cache entry for ``arch``; ``state`` overrides fields of the artifact's state."""
    full: dict[str, Any] = {
        "ir_zlib": zlib.compress(module_text(arch).encode()),
        "entry": FUNCTION,
        "processor_refs": [],
        "link_libs": [],
        "uses_explicit_module": False,
        "ktrace_names": {},
        "ktrace_traced": False,
        "ktrace_buffer_config": None,
        **state,
    }
    body = pickle.dumps(full, protocol=3)  # 3: bytes as bytes, and no frames to splice around
    assert body[:2] == b"\x80\x03" and body[-1:] == b"."
    # PROTO 3, GLOBAL CompiledArtifact, EMPTY_TUPLE, NEWOBJ, <state>, BUILD, STOP: what pickling an
    # object with __getstate__ gives (FlyDSL's protocol 4 names the class with STACK_GLOBAL instead)
    return b"\x80\x03cflydsl.compiler.jit_executor\nCompiledArtifact\n)\x81" + body[2:-1] + b"b."


class _Payload:
    """A planted entry: unpickling it makes ``marker`` (a directory), the proof that it ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def planted_bytes(marker: Path) -> bytes:
    """A pickle that runs code when loaded (os.mkdir of ``marker``)."""
    return pickle.dumps(_Payload(marker))


def write_entry(folder: Path, name: str = ENTRY, data: bytes | None = None) -> Path:
    """One entry as FlyDSL's atomic_write leaves it (0600), with its 0644 lock file."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(artifact_bytes() if data is None else data)
    path = folder / name
    os.replace(tmp, path)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    os.close(lock)
    return path


class FakeFlyDSLCache:
    """``flydsl_flash_attn_func(q, k, v, **kw)`` with FlyDSL's disk cache; one build per LPT value."""

    def __init__(self) -> None:
        self.pointed_at: list[str | None] = []  # the cache dir each build opened
        self.compiled: list[bool] = []  # per call: True compiled, False loaded
        self._opened: dict[bool, Path | None] = {}

    def _open(self, lpt: bool) -> Path | None:
        """A build's first call: where its folder is, and load_all() of it."""
        root = os.environ.get("FLYDSL_RUNTIME_CACHE_DIR", str(Path.home() / ".flydsl" / "cache"))
        self.pointed_at.append(root or None)
        if not root:
            return None
        folder = Path(root) / f"{FUNCTION}_lpt{int(lpt)}"
        for entry in sorted(folder.glob("*.pkl")) if folder.is_dir() else []:
            with contextlib.suppress(Exception), open(entry, "rb") as fh:  # load_all swallows a bad entry
                pickle.load(fh)  # what FlyDSL does: the tests show flyserve never lets it reach a bad folder
        return folder

    def __call__(self, q: Any, k: Any, v: Any, **kw: Any) -> None:
        lpt = bool(kw.get("causal_lpt", False))
        if lpt not in self._opened:
            self._opened[lpt] = self._open(lpt)
        folder = self._opened[lpt]
        hit = folder is not None and (folder / ENTRY).exists()
        if folder is not None and not hit:
            write_entry(folder)
        self.compiled.append(not hit)
