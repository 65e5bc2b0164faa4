"""Facts about an AMDGPU code object (HSA ELF), read from its metadata note with no LLVM tool.

The compiler records each kernel's resource use in the code object itself: an ELF note of type
``NT_AMDGPU_METADATA`` (32, owner "AMDGPU") whose payload is MessagePack (code object v3+), the same
data ``llvm-readelf --notes`` prints as YAML. Reading it here keeps `flyserve flydsl compile`
free of a binutils dependency and lets the unit tests parse a recorded code object in CI.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import Any

NT_AMDGPU_METADATA = 32
ELF_MAGIC = b"\x7fELF"
SHT_NOTE = 7


class CodeObjectError(ValueError):
    """The bytes are not an ELF64 code object with an AMDGPU metadata note."""


@dataclass(frozen=True, slots=True)
class KernelFacts:
    """One kernel's resource use, as the compiler recorded it."""

    symbol: str
    target: str
    code_object_bytes: int
    vgprs: int
    agprs: int
    sgprs: int
    lds_bytes: int
    scratch_bytes: int
    vgpr_spills: int
    sgpr_spills: int
    wavefront_size: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kernel_facts(blob: bytes) -> list[KernelFacts]:
    """Every kernel in the code object ``blob`` with its metadata (raises CodeObjectError)."""
    meta = amdgpu_metadata(blob)
    target = str(meta.get("amdhsa.target", ""))
    kernels = meta.get("amdhsa.kernels")
    if not isinstance(kernels, list) or not kernels:
        raise CodeObjectError("the AMDGPU metadata has no amdhsa.kernels")
    out = []
    for k in kernels:
        if not isinstance(k, dict):
            raise CodeObjectError("an amdhsa.kernels entry is not a map")
        out.append(
            KernelFacts(
                symbol=str(k.get(".name", "")),
                target=target,
                code_object_bytes=len(blob),
                vgprs=int(k.get(".vgpr_count", 0)),
                agprs=int(k.get(".agpr_count", 0)),
                sgprs=int(k.get(".sgpr_count", 0)),
                lds_bytes=int(k.get(".group_segment_fixed_size", 0)),
                scratch_bytes=int(k.get(".private_segment_fixed_size", 0)),
                vgpr_spills=int(k.get(".vgpr_spill_count", 0)),
                sgpr_spills=int(k.get(".sgpr_spill_count", 0)),
                wavefront_size=int(k.get(".wavefront_size", 0)),
            )
        )
    return out


def amdgpu_metadata(blob: bytes) -> dict[str, Any]:
    """The decoded ``NT_AMDGPU_METADATA`` note of an ELF64 little-endian code object."""
    if len(blob) < 64 or blob[:4] != ELF_MAGIC:
        raise CodeObjectError("not an ELF file")
    if blob[4] != 2 or blob[5] != 1:
        raise CodeObjectError("not a 64-bit little-endian ELF")
    e_shoff = struct.unpack_from("<Q", blob, 0x28)[0]
    e_shentsize, e_shnum = struct.unpack_from("<HH", blob, 0x3A)
    if e_shoff == 0 or e_shentsize < 64 or e_shoff + e_shnum * e_shentsize > len(blob):
        raise CodeObjectError("ELF section table out of range")
    for i in range(e_shnum):
        base = e_shoff + i * e_shentsize
        sh_type = struct.unpack_from("<I", blob, base + 4)[0]
        if sh_type != SHT_NOTE:
            continue
        off, size = struct.unpack_from("<QQ", blob, base + 0x18)
        for name, ntype, desc in _notes(blob[off : off + size]):
            if name == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                value = MsgPackReader(desc).read()
                if not isinstance(value, dict):
                    raise CodeObjectError("the AMDGPU metadata is not a map")
                return value
    raise CodeObjectError("no AMDGPU metadata note (code object v2 or not an AMDGPU ELF)")


def _notes(data: bytes) -> list[tuple[bytes, int, bytes]]:
    out, pos = [], 0
    while pos + 12 <= len(data):
        namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
        pos += 12
        name = data[pos : pos + namesz].rstrip(b"\0")
        pos += (namesz + 3) & ~3
        desc = data[pos : pos + descsz]
        pos += (descsz + 3) & ~3
        out.append((name, ntype, desc))
    return out


class MsgPackReader:
    """A MessagePack decoder for the subset AMDGPU metadata uses (maps, arrays, strings, ints,
    bools, floats, binary); anything else is a CodeObjectError."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CodeObjectError("truncated MessagePack")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack(">" + fmt, self._take(struct.calcsize(">" + fmt)))[0]

    def read(self) -> Any:
        b = self._take(1)[0]
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x80 <= b <= 0x8F:
            return self._map(b & 0x0F)
        if 0x90 <= b <= 0x9F:
            return [self.read() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self._take(b & 0x1F).decode("utf-8", "replace")
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in simple:
            return simple[b]
        sized = {
            0xC4: ("B", "bin"), 0xC5: ("H", "bin"), 0xC6: ("I", "bin"),
            0xD9: ("B", "str"), 0xDA: ("H", "str"), 0xDB: ("I", "str"),
            0xDC: ("H", "array"), 0xDD: ("I", "array"), 0xDE: ("H", "map"), 0xDF: ("I", "map"),
        }  # fmt: skip
        if b in sized:
            fmt, kind = sized[b]
            n = self._unpack(fmt)
            if kind == "bin":
                return self._take(n)
            if kind == "str":
                return self._take(n).decode("utf-8", "replace")
            if kind == "array":
                return [self.read() for _ in range(n)]
            return self._map(n)
        scalars = {0xCA: "f", 0xCB: "d", 0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q",
                   0xD0: "b", 0xD1: "h", 0xD2: "i", 0xD3: "q"}  # fmt: skip
        if b in scalars:
            return self._unpack(scalars[b])
        raise CodeObjectError(f"unsupported MessagePack type byte 0x{b:02x}")

    def _map(self, n: int) -> dict[Any, Any]:
        out = {}
        for _ in range(n):
            key = self.read()
            out[key if isinstance(key, (str, int)) else str(key)] = self.read()
        return out
