"""Start, wait for and stop the real processes a live test runs: `flyserve sidecar` on a port the
OS picks (127.0.0.1, a token file of mode 0600), `flyserve simulate` ranks on its state directory,
a wait on a condition with a deadline, and a SIGTERM-then-SIGKILL stop.

One copy for the live tests, benchmarks/ and scripts/ that start these processes (benchmarks and
scripts put this folder on sys.path), so that a change to how the sidecar is started, or how long
a stop may take, is made once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CLI = (sys.executable, "-m", "flyserve.cli")
STEP_INTERVAL_S = 0.02  # the simulated engine: about 50 steps/s


def free_port() -> int:
    """A port of 127.0.0.1 the OS has just handed out (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], object], *, timeout: float, what: str, every: float = 0.1) -> object:
    """``pred()``'s first true value, polled every ``every`` s; TimeoutError naming ``what`` past
    ``timeout`` s (a test fails on it; a caller that measures may catch it)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def stop_process(p: subprocess.Popen, *, term_wait_s: float = 20.0, kill_wait_s: float = 10.0) -> None:
    """SIGTERM, ``term_wait_s`` for a clean exit, then SIGKILL: nothing a test starts outlives it."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=term_wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=kill_wait_s)


def read_rank_reports(ranks_dir: Path, ranks: Sequence[int] = (0, 1)) -> dict[int, dict]:
    """The ranks' report files in ``ranks_dir`` (a state directory's ranks/), read as JSON, not
    through the code under test; a rank whose file is missing or half written is left out."""
    out = {}
    for r in ranks:
        with contextlib.suppress(OSError, ValueError):
            out[r] = json.loads((ranks_dir / f"{r}.json").read_text())
    return out


def sidecar_env() -> dict[str, str]:
    """This process's environment less FLYSERVE_SIDECAR_TOKEN: the token comes from --token-file."""
    return {k: v for k, v in os.environ.items() if k != "FLYSERVE_SIDECAR_TOKEN"}


@dataclass
class LiveSidecar:
    url: str
    port: int
    state: Path
    proc: subprocess.Popen
    log: Path


def start_sidecar(
    tmp: Path, token: str, *extra: str, wrap: Sequence[str] = (), timeout: float = 90
) -> LiveSidecar:
    """`flyserve sidecar --state-dir tmp/state` on a free port, its token in tmp/token (0600), its
    output in tmp/sidecar.log, run under ``wrap`` (a command that execs the rest) when given;
    returned once /healthz answers 200. Stopped again if it exits or never answers."""
    state = tmp / "state"
    token_file = tmp / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    cmd = [*wrap, *CLI, "sidecar", "--state-dir", str(state), "--host", "127.0.0.1", "--port", str(port),
           "--token-file", str(token_file), "--log-level", "warning", *extra]  # fmt: skip
    log = tmp / "sidecar.log"
    proc = subprocess.Popen(cmd, env=sidecar_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    sc = LiveSidecar(f"http://127.0.0.1:{port}", port, state, proc, log)

    def up() -> bool:
        assert proc.poll() is None, f"sidecar exited during start-up: {log.read_text()[-2000:]}"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(sc.url + "/healthz", timeout=2).status_code == 200
        return False

    try:
        wait_for(up, timeout=timeout, what="the sidecar's /healthz", every=0.2)
    except BaseException:
        stop_process(proc)
        raise
    return sc


def start_simulator(tmp: Path, state: Path, *args: str) -> subprocess.Popen:
    """`flyserve simulate --state-dir state --ranks 2 --quiet *args`, its output in tmp/simulate.log."""
    return subprocess.Popen(
        [*CLI, "simulate", "--state-dir", str(state), "--ranks", "2", "--quiet", *args],
        stdout=(tmp / "simulate.log").open("w"),
        stderr=subprocess.STDOUT,
    )


@dataclass
class SidecarAndRanks:
    """A sidecar and a two-rank simulator on one state directory; ``procs`` stopped last first."""

    sidecar: LiveSidecar
    procs: list[subprocess.Popen] = field(default_factory=list)


@contextlib.contextmanager
def sidecar_beside_simulator(
    tmp: Path,
    token: str,
    *,
    sidecar_args: Sequence[str] = (),
    simulate_args: Sequence[str] = (),
    wrap: Sequence[str] = (),
) -> Iterator[SidecarAndRanks]:
    """start_sidecar, then start_simulator on its state directory; every process stopped at the end."""
    sc = start_sidecar(tmp, token, *sidecar_args, wrap=wrap)
    both = SidecarAndRanks(sc, [sc.proc])
    try:
        both.procs.append(start_simulator(tmp, sc.state, *simulate_args))
        yield both
    finally:
        for p in reversed(both.procs):
            stop_process(p)


def wait_ranks_at_speed(
    reports: Callable[[], dict[int, dict]], step_interval_s: float = STEP_INTERVAL_S, timeout: float = 90
) -> None:
    """Both ranks report a step rate of at least half the simulated one (1 / ``step_interval_s``).

    At speed, not only measured: a rank's first rate can come from a window that holds its slow
    start (a CI run: a PATCH at once got an 18-step margin for the 3 s lead, so about 6 steps/s,
    for ranks stepping at 50/s, and both ranks applied it 13 steps late). The tests that wait on
    this are about attacks, not that."""
    wait_for(
        lambda: (
            len(got := reports()) == 2
            and all((d.get("steps_per_s") or 0) >= 0.5 / step_interval_s for d in got.values())
        ),
        timeout=timeout,
        what="both ranks to report a step rate of at least half the simulated one",
        every=0.2,
    )
