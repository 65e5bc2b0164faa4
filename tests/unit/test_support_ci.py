"""Under CI (FLYSERVE_CI=1) a dependency that cannot be imported fails the run; elsewhere it skips.

The check runs pytest in a subprocess on a real test module (tests/unit/test_vllm_plugin.py) with a
``vllm`` on the path whose import raises, as a broken install would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs pytest in a subprocess

ROOT = Path(__file__).resolve().parents[2]


def _run_plugin_tests(tmp_path: Path, *, ci: str | None) -> subprocess.CompletedProcess[str]:
    broken = tmp_path / "broken"
    (broken / "vllm").mkdir(parents=True)
    (broken / "vllm" / "__init__.py").write_text("raise ImportError('vllm is broken on purpose')\n")
    env = {k: v for k, v in os.environ.items() if k != "FLYSERVE_CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(broken), str(ROOT), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["FLYSERVE_CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_vllm_plugin.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize("ci", ["1", "true"])
def test_a_broken_vllm_fails_the_run_under_ci(tmp_path: Path, ci: str):
    r = _run_plugin_tests(tmp_path, ci=ci)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "vllm is broken on purpose" in r.stdout
    assert "FLYSERVE_CI is set" in r.stdout
    assert " passed" not in r.stdout.splitlines()[-1]


@pytest.mark.parametrize("ci", [None, "0"])
def test_a_broken_vllm_skips_outside_ci_naming_the_cause(tmp_path: Path, ci: str | None):
    r = _run_plugin_tests(tmp_path, ci=ci)
    assert r.returncode in (0, 5), r.stdout[-2000:]  # 5: every test of the module skipped
    assert "skipped" in r.stdout.splitlines()[-1]
    assert "vllm is broken on purpose" in r.stdout
