"""Copy the part of a FlyDSL revision that flyserve's call imports into third_party/flydsl/<rev>/.

    python scripts/flydsl_vendor.py FLYDSL_GIT REV [REV...]

FLYDSL_GIT is a git directory or clone of https://github.com/ROCm/FlyDSL holding the revisions.
Writes third_party/flydsl/<rev[:8]>/kernels/... (the files in FILES, byte for byte as `git show
<rev>:<path>` gives them) and third_party/flydsl/<rev[:8]>/PROVENANCE.json (the repository, the full
commit, its date and subject, and a sha256 per file) and FlyDSL's LICENSE at that commit beside them
(third_party/flydsl/LICENSE-2.0.txt is the Apache License's text it names). Nothing else is touched;
a second run rewrites the same bytes.

Why a subset: the flydsl wheel has no kernels/ package, and CI cannot reach github.com to clone
FlyDSL. FILES is the import closure of ``kernels.attention.flash_attn_interface`` - its top-level
imports and the builders it imports lazily (flash_attn_gfx950, flash_attn_generic,
flash_attn_fp8_gfx950) - and was checked by compiling every variant of `flyserve flydsl compile
--wrong-calls` from the copy, with flydsl 0.4.2 and 0.5.0 (third_party/flydsl/README.md).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPOSITORY = "https://github.com/ROCm/FlyDSL"
FILES = (
    "kernels/__init__.py",
    "kernels/attention/__init__.py",
    "kernels/attention/flash_attn_fp8_gfx950.py",
    "kernels/attention/flash_attn_generic.py",
    "kernels/attention/flash_attn_gfx950.py",
    "kernels/attention/flash_attn_interface.py",
    "kernels/attention/flash_attn_utils.py",
    "kernels/common/__init__.py",
    "kernels/common/buffer_ops.py",
    "kernels/common/kernels_common.py",
    "kernels/common/mem_ops.py",
    "kernels/common/tensor_shim.py",
)
VENDOR = Path(__file__).resolve().parents[1] / "third_party" / "flydsl"


def git(gitdir: str, *args: str) -> bytes:
    return subprocess.run(["git", "-C", gitdir, *args], capture_output=True, check=True, timeout=120).stdout


def vendor(gitdir: str, rev: str) -> Path:
    commit = git(gitdir, "rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    date, _, subject = git(gitdir, "log", "-1", "--format=%cI %s", commit).decode().strip().partition(" ")
    out = VENDOR / commit[:8]
    files = {}
    for name in FILES:
        data = git(gitdir, "show", f"{commit}:{name}")
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[name] = hashlib.sha256(data).hexdigest()
    licence = git(gitdir, "show", f"{commit}:LICENSE")
    (out / "LICENSE").write_bytes(licence)
    provenance = {
        "repository": REPOSITORY,
        "commit": commit,
        "commit_date": date,
        "subject": subject,
        "license": "Apache-2.0: LICENSE is FlyDSL's LICENSE at this commit, ../LICENSE-2.0.txt the license's text",
        "what": "the import closure of kernels.attention.flash_attn_interface (scripts/flydsl_vendor.py FILES), "
        "byte for byte; the rest of the tree is not here",
        "files": {**files, "LICENSE": hashlib.sha256(licence).hexdigest()},
    }
    (out / "PROVENANCE.json").write_text(json.dumps(provenance, indent=1) + "\n")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    gitdir, *revs = argv
    for rev in revs:
        print(vendor(gitdir, rev).relative_to(VENDOR.parents[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
