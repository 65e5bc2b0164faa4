"""`flyserve top` as a person uses it: in a terminal (tmux), against a live `flyserve simulate` and a
live `flyserve sidecar`. Keys go in with send-keys, what the person sees comes back with
capture-pane: the message while the sidecar is away, the live view once it is up, the window toggle,
a thresholds change reaching the screen, and `q` / Ctrl-C leaving the terminal as it was found.

tmux is a system package (scripts/setup.sh installs it); under FLYSERVE_CI its absence fails the run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _support import require_binary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flyserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "flyserve.cli", *args]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    """A process in its own group (the simulator has rank children), output to ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


class Pane:
    """One tmux session on a private server socket: keys in, screen out."""

    def __init__(self, tmux: str, socket_name: str, name: str) -> None:
        self.tmux, self.socket, self.name = tmux, socket_name, name

    def _run(self, *args: str) -> str:
        r = subprocess.run(
            [self.tmux, "-L", self.socket, "-f", "/dev/null", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    def start(self, command: str) -> None:
        self._run("new-session", "-d", "-s", self.name, "-x", "160", "-y", "50", command)

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", self.name, *keys)

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", self.name)

    def wait_for(self, ok: Callable[[str], bool], what: str, timeout: float = 40.0) -> str:
        deadline = time.monotonic() + timeout
        shown = ""
        while time.monotonic() < deadline:
            shown = self.screen()
            if ok(shown):
                return shown
            time.sleep(0.25)
        raise AssertionError(f"the pane never showed {what}; it shows:\n{shown}")


@pytest.fixture
def tmux_socket() -> Iterator[str]:
    """A private tmux server for this test, killed afterwards (whatever the test left in it)."""
    name = f"flyserve-top-test-{os.getpid()}"
    try:
        yield name
    finally:
        tmux = shutil.which("tmux")
        if tmux is not None:
            subprocess.run([tmux, "-L", name, "kill-server"], check=False, capture_output=True, timeout=10)


_TERMINAL_MODE = re.compile(r"^-?icanon$", re.MULTILINE)
"""The line _top_command's stty prints after top exits: icanon (restored) or -icanon (left in cbreak)."""


def _top_command(url: str) -> str:
    """top, then what a person would see after it: its exit status and whether the terminal is back in
    canonical mode (cbreak mode leaves '-icanon'), then a pause so the pane stays to be read."""
    env = f"PYTHONPATH={REPO}" + (f":{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else "")
    top = " ".join(_flyserve("top", "--url", url, "--interval", "0.25"))
    # -u COLUMNS/LINES: the test process's values (80x24) reach the pane through tmux's environment,
    # and rich would draw for them instead of the pane's own size.
    return f"env -u COLUMNS -u LINES {env} {top}; echo EXIT=$?; stty -a | tr ' ;' '\\n\\n' | grep -x -- '-*icanon'; sleep 120"


def test_top_in_a_terminal_against_a_live_simulator_and_sidecar(tmp_path: Path, tmux_socket: str) -> None:
    tmux = require_binary("tmux", install="install Debian's `tmux` package (scripts/setup.sh does)")
    sock = tmux_socket
    state, port = tmp_path / "state", free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    try:
        # The sidecar is not up yet: top says so and keeps trying.
        pane = Pane(tmux, sock, "top")
        pane.start(_top_command(url))
        pane.wait_for(
            lambda s: f"sidecar at {url} not reachable (connection refused), retrying" in s,
            "the away message",
        )

        procs.append(
            _start(
                _flyserve(
                    "simulate", "--state-dir", str(state), "--ranks", "2", "--workload", "seed-60k-c32",
                    "--steps", "100000", "--step-interval", "0.02", "--profile", "gfx950", "--costs", "h200",
                    "--quiet",
                ),
                tmp_path / "simulate.log",
            )
        )  # fmt: skip
        procs.append(
            _start(
                _flyserve(
                    "sidecar", "--state-dir", str(state), "--port", str(port), "--profile", "gfx950",
                    "--costs", "h200", "--stream-min-interval", "0.2", "--log-level", "warning",
                ),
                tmp_path / "sidecar.log",
            )
        )  # fmt: skip
        shown = pane.wait_for(
            lambda s: "live ranks: 2" in s and "thresholds version 0 " in s and "regret (60s" in s,
            "the live view",
        )
        assert "not reachable" not in shown and "file polling" in shown
        assert re.search(r"window: 60s", shown) and "engines (60s)" in shown
        assert "ranks (since start)" in shown and "drift (measured/predicted)" in shown

        # w cycles the window: 60s -> 300s -> 900s -> since start -> 60s.
        for expected in ("300s", "900s", "total", "60s"):
            pane.keys("w")
            pane.wait_for(
                lambda s, e=expected: f"window: {e} " in s and f"engines ({e})" in s, f"window {expected}"
            )
        # ... and the regret follows it to the 15-minute window for 300s and up.
        pane.keys("w")
        pane.wait_for(lambda s: "window: 300s" in s and "regret (900s" in s, "the 900s regret window")
        pane.keys("w", "w")
        pane.wait_for(lambda s: "window: total" in s, "the since-start window")

        # A thresholds change while top runs: the screen shows the new version, the override, ranks that
        # applied it, and the fallback it causes (seed-60k prefills come in bursts every ~630 steps, 13 s here,
        # all under min_seq_len 100000).
        r = subprocess.run(
            _flyserve("thresholds", "set", "min_seq_len=100000", "--state-dir", str(state)),
            check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr

        def rank_rows(screen: str) -> list[str]:  # the rank rows that show applied version 1
            return [ln for ln in screen.splitlines() if re.match(r"^\s*0\s+[01]\s+\d+\s+\d+\s+1\s", ln)]

        # Both ranks apply at the effective step; a rank whose last report (once a second) came before
        # it still shows version 0: wait for both rows, not for the first frame with the new version.
        shown = pane.wait_for(
            lambda s: (
                "thresholds version 1 " in s
                and "min_seq_len=100000" in s
                and "short_context" in s
                and len(rank_rows(s)) == 2
            ),
            "version 1 applied by both ranks and its fallbacks",
            timeout=60,
        )

        # The sidecar goes away: top says so (keeping the last numbers), and comes back with it.
        _stop(procs.pop())
        pane.wait_for(lambda s: "not reachable (connection refused), retrying" in s, "the away message again")

        # q: top exits 0 and the terminal is back in canonical mode with echo.
        pane.keys("q")
        # stty's line comes after EXIT=: wait for both (either mode), then check which
        shown = pane.wait_for(lambda s: "EXIT=" in s and _TERMINAL_MODE.search(s), "top's exit")
        assert "EXIT=0" in shown and re.search(r"^icanon$", shown, re.MULTILINE), shown
        assert "flyserve top" not in shown  # the alternate screen is gone: the shell's screen is back

        # Ctrl-C: the same clean exit (status 130, terminal restored, no traceback).
        pane2 = Pane(tmux, sock, "top2")
        pane2.start(_top_command(url))
        pane2.wait_for(lambda s: "flyserve top" in s, "the second top")
        time.sleep(0.5)
        pane2.keys("C-c")
        shown = pane2.wait_for(lambda s: "EXIT=" in s and _TERMINAL_MODE.search(s), "top's exit on Ctrl-C")
        assert "EXIT=130" in shown and re.search(r"^icanon$", shown, re.MULTILINE), shown
        assert "Traceback" not in shown
    finally:
        for p in reversed(procs):
            _stop(p)


def test_top_once_prints_one_screen_and_says_when_the_sidecar_is_away() -> None:
    """--once (a script's view): exit 1 with the away message when nothing answers."""
    url = f"http://127.0.0.1:{free_port()}"
    r = subprocess.run(
        _flyserve("top", "--url", url, "--once", "--interval", "0.05"),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert f"sidecar at {url} not reachable (connection refused), retrying" in r.stdout
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=1)
