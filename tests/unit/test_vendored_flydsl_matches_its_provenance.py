"""The FlyDSL files vendored under third_party/flydsl/<rev>/ (what CI compiles flyserve's call
against: it cannot reach github.com) are the named commit's, byte for byte, and cannot drift
silently: every file has its sha256 in PROVENANCE.json, nothing unlisted sits beside them, and a
copy whose files changed loses its commit label instead of keeping it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from flyserve.vllm import flydsl_kernel as fk
from flyserve.vllm import flydsl_tree

REPO = Path(__file__).resolve().parents[2]
VENDOR = REPO / "third_party" / "flydsl"
# The two pinned revisions (scripts/flydsl-compile-setup.sh FLYDSL_REVS; results/flydsl/README.md)
PINNED = {
    "943152de": "943152de799bf9983ab2028629c6e523abd199a7",
    "11c4174d": "11c4174d82b7491c2d08d5828a254183f2a8b959",
}


def _vendor_script():
    spec = importlib.util.spec_from_file_location("flydsl_vendor", REPO / "scripts" / "flydsl_vendor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rev", sorted(PINNED))
def test_each_vendored_file_has_the_sha256_its_provenance_names(rev):
    root = VENDOR / rev
    record = json.loads((root / "PROVENANCE.json").read_text())
    assert record["repository"] == "https://github.com/ROCm/FlyDSL" and record["commit"] == PINNED[rev]
    on_disk = sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    assert on_disk == sorted([*record["files"], "PROVENANCE.json"])  # nothing unlisted, nothing missing
    for name, digest in record["files"].items():
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest, name
    assert flydsl_tree.provenance_problem(root) == (record, None)
    assert flydsl_tree.checkout_commit(root) == PINNED[rev]  # no .git: the provenance's commit


@pytest.mark.parametrize("rev", sorted(PINNED))
def test_the_vendored_set_is_the_vendor_scripts_list_and_carries_the_license(rev):
    record = json.loads((VENDOR / rev / "PROVENANCE.json").read_text())
    assert sorted(record["files"]) == sorted([*_vendor_script().FILES, "LICENSE"])
    assert "Apache License" in (VENDOR / rev / "LICENSE").read_text()
    text = (VENDOR / "LICENSE-2.0.txt").read_text()
    assert (
        "Apache License" in text
        and "Version 2.0, January 2004" in text
        and "END OF TERMS AND CONDITIONS" in text
    )


def test_the_setup_scripts_default_revisions_are_vendored():
    setup = (REPO / "scripts" / "flydsl-compile-setup.sh").read_text()
    assert "REVS=${FLYDSL_REVS:-943152de 11c4174d}" in setup and "third_party/flydsl/" in setup
    assert sorted(p.name for p in VENDOR.iterdir() if p.is_dir()) == sorted(PINNED)


def _copy(tmp_path: Path, rev: str = "943152de") -> Path:
    dst = tmp_path / f"FlyDSL-{rev}"
    shutil.copytree(VENDOR / rev, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def test_a_copy_with_one_byte_changed_loses_its_commit(tmp_path):
    root = _copy(tmp_path)
    assert flydsl_tree.checkout_commit(root) == PINNED["943152de"]
    utils = root / "kernels" / "attention" / "flash_attn_utils.py"
    utils.write_bytes(utils.read_bytes() + b"\n")
    _, problem = flydsl_tree.provenance_problem(root)
    assert (
        problem
        == "kernels/attention/flash_attn_utils.py differs from commit 943152de's (sha256 in PROVENANCE.json)"
    )
    assert flydsl_tree.checkout_commit(root) is None
    rev = fk.FlyDSLRevision(True, (64, 128), True, str(root / "kernels/attention/flash_attn_interface.py"))
    assert rev.label.endswith("commit unknown (not a git checkout)")


def test_a_missing_file_or_a_record_naming_a_path_outside_loses_the_commit(tmp_path):
    root = _copy(tmp_path)
    (root / "kernels" / "common" / "mem_ops.py").unlink()
    assert flydsl_tree.provenance_problem(root)[1].startswith("kernels/common/mem_ops.py is missing")
    root = _copy(tmp_path / "b")
    record = json.loads((root / "PROVENANCE.json").read_text())
    record["files"]["../outside.py"] = "0" * 64
    (root / "PROVENANCE.json").write_text(json.dumps(record))
    assert "outside the copy" in flydsl_tree.provenance_problem(root)[1]
    assert flydsl_tree.checkout_commit(root) is None
    (root / "PROVENANCE.json").write_text("{not json")
    assert flydsl_tree.checkout_commit(root) is None


def test_a_git_checkout_still_reads_its_own_commit_first(tmp_path):
    """A .git wins over a PROVENANCE.json (a clone is what it has checked out)."""
    root = _copy(tmp_path)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text(PINNED["11c4174d"] + "\n")
    assert flydsl_tree.checkout_commit(root) == PINNED["11c4174d"]
