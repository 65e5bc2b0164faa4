"""A clone with nothing beside it works: the tests' data is inside the repository, no
committed file names a path of the machine it was written on, and the setup script leaves the
host's processes alone. (.ci/run also runs the whole suite from a clone alone in an empty
directory.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", ".venv-checkov", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
             ".benchmarks", "results", "dist", "build"}  # fmt: skip
TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".cfg", ""}


def _files() -> list[Path]:
    """The files a clone carries: tracked, or untracked and not ignored (git's own view, so an
    ignored build folder such as .flydsl/ or a venv never counts, whatever its name)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
            timeout=60,
        )
        .stdout.decode()
        .split("\0")
    )
    out = []
    for name in listed:
        if not name:
            continue
        rel = Path(name)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        p = REPO / rel
        if p.is_file() and not p.is_symlink() and p.suffix in TEXT_SUFFIXES:
            out.append(p)
    return out


@pytest.mark.slow  # runs git
def test_nothing_reads_a_shared_directory_beside_the_checkout():
    pattern = re.compile(r"""(\.\./shared|["']shared["']\s*[,)/]|/\s*["']shared["'])""")
    bad = []
    for p in _files():
        if p.suffix not in (".py", ".sh") or p.name == "test_fresh_clone.py":
            continue
        code = "\n".join(ln.split("#", 1)[0] for ln in p.read_text().splitlines())  # a comment reads nothing
        if pattern.search(code):
            bad.append(str(p.relative_to(REPO)))
    assert bad == []


@pytest.mark.slow  # runs git
def test_no_file_names_a_path_of_this_machine():
    pattern = re.compile(r"(?<![\w.])/(work|root)/\w")
    bad = []
    for p in _files():
        if p.name == "test_fresh_clone.py":
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{p.relative_to(REPO)}:{n}")
    assert bad == []


def test_setup_kills_no_host_process_by_name():
    """setup.sh used `pkill -x prometheus`, ending anyone's Prometheus on the host."""
    for script in [REPO / "scripts" / "setup.sh", *(REPO / ".ci").iterdir()]:
        text = "\n".join(ln.split("#", 1)[0] for ln in script.read_text().splitlines())  # code, not comments
        assert not re.search(r"\b(pkill|killall)\b", text), script


def test_the_test_data_is_in_the_repository():
    for name in ("seed_dispatch_cases.json", "h200_vllm_kernel_pair.json", "podmonitor-crd-v0.93.0.yaml"):
        assert (REPO / "tests" / "data" / name).is_file(), name
