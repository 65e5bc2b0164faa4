"""tests/conftest.py orders a run fast to slow: unit, benchmarks, integration, e2e, gpu."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _support import REPO, TIERS, tier_of


def test_tier_of_each_directory():
    assert [
        tier_of(REPO / d / "test_x.py")
        for d in ("tests/unit", "benchmarks", "tests/integration", "tests/e2e", "tests/gpu")
    ] == list(range(len(TIERS)))
    assert tier_of(Path("/elsewhere/test_x.py")) == len(TIERS)


@pytest.mark.slow  # runs pytest in a subprocess
def test_a_whole_run_is_collected_fast_to_slow():
    """Real test files, named slow-first on the command line: collected fast-first."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/e2e/test_vllm_e2e_demo.py",
            "tests/integration/test_arms_cli.py",
            "benchmarks/test_bench_policy.py",
            "tests/unit/test_policy_rules.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert ids, r.stdout[-2000:] + r.stderr[-2000:]
    tiers = [tier_of(REPO / line.split("::")[0]) for line in ids]
    assert tiers == sorted(tiers)
    assert sorted(set(tiers)) == [TIERS.index(t) for t in ("unit", "benchmarks", "integration", "e2e")]
