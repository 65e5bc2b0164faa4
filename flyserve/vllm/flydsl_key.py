"""What FlyDSL's cache key depends on that differs between machines: the flydsl release, its cache
layout, and (from flydsl 0.5.0) the ROCm device bitcode. Computed here without FlyDSL's compiler,
so a server and `flyserve doctor` can tell a cache built elsewhere from a warm one.

The bitcode fingerprint is flydsl 0.5.0's own (``compiler/backends/rocm.py`` ``_hash_device_bitcode``,
lines 23-32): sha256 over every ``{root}/amdgcn/bitcode/*.bc`` in name order, each as its name, a NUL
byte and its bytes. ``toolkit_fingerprint`` (201-211) takes the root from the native
``_mlirDialectsFlyROCDL.rocm_path()``, which returns ``$ROCM_PATH`` as it is and ``''`` when unset
(measured with the 0.5.0 wheel). It goes into ``_flydsl_key`` and so into every entry's name: a
cache built on a CPU machine with Debian's bitcode never hits on a ROCm host. flydsl 0.4.2 does not
hash the bitcode (its entries then hit on any ROCm, with the builder's device library linked in).

Each entry `flyserve flydsl compile` lists carries the inputs it was built with (``KeyInputs``);
``stale_reason`` compares them with this host's.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from flyserve.vllm.flydsl_layout import BY_NAME, CacheLayout, installed_layout

TESTED_FLYDSL = ("0.4.2", "0.5.0")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # what FlyDSL hashes when the folder holds no .bc
MAX_BITCODE_BYTES = 1 << 30  # a ROCm's device library is tens of MB; the cap only stops a runaway read


def flydsl_version() -> str | None:
    """The installed flydsl wheel's version (None: not installed)."""
    try:
        return version("flydsl")
    except PackageNotFoundError:
        return None


def is_tested(v: str | None) -> bool:
    """Whether flyserve was tested with this flydsl release."""
    return v in TESTED_FLYDSL


def bitcode_root() -> str:
    """The ROCm root FlyDSL reads the device bitcode from: its own answer where the 0.5.0 native
    module is importable, else what that answer is (``$ROCM_PATH``, or '' when unset)."""
    try:
        from flydsl._mlir._mlir_libs import _mlirDialectsFlyROCDL

        return str(_mlirDialectsFlyROCDL.rocm_path())
    except Exception:  # noqa: BLE001 - flydsl absent, 0.4.2 (no such function), or not loadable
        return os.environ.get("ROCM_PATH", "")


def bitcode_fingerprint(root: str | os.PathLike[str]) -> str:
    """FlyDSL 0.5.0's fingerprint of the device bitcode under ``root`` (sha256 hex; EMPTY_SHA256 when
    there is none, as FlyDSL computes it then)."""
    h = hashlib.sha256()
    total = 0
    for path in sorted(Path(root, "amdgcn", "bitcode").glob("*.bc")):
        data = path.read_bytes()
        total += len(data)
        if total > MAX_BITCODE_BYTES:
            raise OSError(f"more than {MAX_BITCODE_BYTES} bytes of bitcode under {root}")
        h.update(path.name.encode() + b"\0" + data)
    return h.hexdigest()


def short(fingerprint: str | None) -> str:
    """A fingerprint as reports show it (12 hex), with the empty one named."""
    if not fingerprint:
        return "unknown"
    if fingerprint == EMPTY_SHA256:
        return "none (no amdgcn/bitcode/*.bc)"
    return fingerprint[:12]


@dataclass(frozen=True, slots=True)
class KeyInputs:
    """The inputs of FlyDSL's cache key that a builder and a server can disagree on."""

    flydsl: str | None
    layout: str | None  # a flydsl_layout name
    bitcode: str | None  # sha256 hex of the device bitcode (None: not computed)
    kernels: str | None = None  # the FlyDSL checkout's revision label (its sources are in the key too)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, rec: Any) -> KeyInputs | None:
        """From a manifest record; None when it holds none (an entry listed before they were kept)."""
        if not isinstance(rec, Mapping):
            return None
        vals = {k: rec.get(k) for k in ("flydsl", "layout", "bitcode", "kernels")}
        if not all(v is None or isinstance(v, str) for v in vals.values()):
            return None
        return cls(**vals)

    def describe(self) -> str:
        """The inputs for a report line."""
        layout = BY_NAME.get(self.layout or "")
        tested = (
            "tested" if is_tested(self.flydsl) else f"not tested: flyserve knows {', '.join(TESTED_FLYDSL)}"
        )
        bitcode = short(self.bitcode) + (
            "" if layout is None or layout.bitcode_in_key else ", not in the key"
        )
        parts = [f"flydsl {self.flydsl or '?'} ({tested})", f"layout {self.layout or 'unknown'}",
                 f"bitcode {bitcode}"]  # fmt: skip
        if self.kernels:
            parts.append(f"kernels {self.kernels}")
        return ", ".join(parts)


def host_key_inputs(*, layout: CacheLayout | None = None, kernels: str | None = None) -> KeyInputs:
    """This machine's inputs: the installed flydsl, its layout (detected unless given) and, where
    that layout hashes it, the bitcode FlyDSL would read. Never raises."""
    lay = layout if layout is not None else installed_layout()
    bitcode = None
    if lay is not None and lay.bitcode_in_key:
        try:
            bitcode = bitcode_fingerprint(bitcode_root())
        except OSError:
            bitcode = None
    return KeyInputs(flydsl_version(), lay.name if lay is not None else None, bitcode, kernels)


def stale_reason(built: KeyInputs | None, host: KeyInputs | None, entry_layout: str | None) -> str | None:
    """Why an entry can never be a hit on this host (None: it can, or it cannot be told).

    ``entry_layout`` comes from the entry's name; ``built`` from the manifest (when listed).
    """
    if host is None or host.layout is None:
        return None
    if entry_layout is not None and entry_layout != host.layout:
        return "another flydsl"  # the folder layout of another release: never looked up
    if built is None:
        return None
    if built.flydsl and host.flydsl and built.flydsl != host.flydsl:
        return "another flydsl"
    layout = BY_NAME.get(host.layout)
    if (
        layout is not None
        and layout.bitcode_in_key
        and built.bitcode
        and host.bitcode
        and built.bitcode != host.bitcode
    ):
        return "another ROCm"
    return None
