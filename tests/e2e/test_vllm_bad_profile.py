"""A real `vllm serve` with FLYSERVE_PROFILE=mi355 stops at once, its cause in one ERROR line
(before: a 275-line log, cause at line 56, "Engine core initialization failed" at the end)."""

from __future__ import annotations

import os
import subprocess

import pytest
from _support import require_module

from flyserve.vllm.launch import vllm_command

pytestmark = pytest.mark.e2e


def test_vllm_serve_with_an_unknown_profile_fails_first_with_one_line(tmp_path):
    require_module("vllm")
    env = {**os.environ, "FLYSERVE_ATTENTION": "1", "FLYSERVE_PROFILE": "mi355",
           "FLYSERVE_STATE_DIR": str(tmp_path / "state")}  # fmt: skip
    p = subprocess.run(
        [*vllm_command(), "serve", str(tmp_path / "no-model"), "--port", "1"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    out = (p.stdout + p.stderr).splitlines()
    errors = [ln for ln in out if "ERROR" in ln]
    assert errors == [
        "ERROR flyserve.startup: FLYSERVE_PROFILE: unknown profile 'mi355' (available: cpu-tiny, gfx950, h200)"
    ]
    assert len(out) <= 5, out  # the cause, not a log to search
    assert not (tmp_path / "state").exists()
