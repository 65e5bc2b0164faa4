"""The README's tour is examples/tour.sh, and this test runs it: every line, in a shell that stops at
the first failing one, from the repository root, with no activated venv (a tour that names files
that do not exist or assumes an activated venv fails here)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOUR = REPO / "examples" / "tour.sh"

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_shows_the_tour_script_verbatim():
    readme = (REPO / "README.md").read_text()
    m = re.search(r"<!-- include: examples/tour.sh -->\n```bash\n(.*?)```", readme, re.DOTALL)
    assert m, "README.md lost its tour block"
    assert m.group(1) == TOUR.read_text()
    for line in TOUR.read_text().splitlines():  # every path the tour names is in the repository
        for path in re.findall(r"\b(examples/[\w.-]+)", line):
            assert (REPO / path).is_file(), path


def test_the_tour_runs_line_by_line():
    flyserve = REPO / ".venv" / "bin" / "flyserve"
    assert flyserve.exists(), f"{flyserve} is missing: run `bash scripts/setup.sh` first"
    port = _free_port()
    env = {**os.environ, "TOUR_PORT": str(port), "PYTHONPATH": str(REPO)}
    env.pop("VIRTUAL_ENV", None)
    p = subprocess.run(
        ["bash", "-e", "-x", str(TOUR)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = p.stdout
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    trace = [ln for ln in p.stderr.splitlines() if ln.startswith("+ ")]
    assert trace[-1] == "+ kill %1 %2", trace[-5:]  # with -e, reaching the last line means all ran
    # what each line is there to show
    for evidence in (
        "examples/my-thresholds.yaml: valid (base profile gfx950)",  # check-config
        "initialised state directory",  # init
        '"ready":true',  # simulate + sidecar: ranks report
        "4 live ranks",  # /dispatch-stats
        "published version 1",  # thresholds set
        "PATCH /thresholds: 200",  # the HTTP API with the token
        "thresholds history",  # history
        "flyserve replay",  # replay
    ):
        assert evidence in out, (evidence, out[-3000:])
    # dashboards build: one line per dashboard the repository ships (dashboards/*.json)
    assert out.count("written: ") == len(list((REPO / "dashboards").glob("*.json"))) == 4
    assert "  step " not in out  # simulate --quiet kept its progress off the terminal
    # the background servers were stopped by the tour's last line
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                break
        time.sleep(0.2)
    else:
        pytest.fail(f"the tour's sidecar still listens on {port}")
