"""`flyserve sidecar` / `flyserve simulate`: bad flags and files fail early, naming what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flyserve.cli import app

runner = CliRunner()


def test_sidecar_refuses_unreadable_or_short_token(tmp_path: Path):
    r = runner.invoke(app, ["sidecar", "--state-dir", str(tmp_path), "--token-file", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "--token-file" in r.output and "cannot read" in r.output
    short = tmp_path / "tok"
    short.write_text("abc\n")
    r = runner.invoke(app, ["sidecar", "--state-dir", str(tmp_path), "--token-file", str(short)])
    assert r.exit_code == 2 and "at least 16" in r.output


def test_sidecar_refuses_a_file_as_state_dir(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    r = runner.invoke(app, ["sidecar", "--state-dir", str(f)], env={"FLYSERVE_SIDECAR_TOKEN": "x" * 20})
    assert r.exit_code == 2 and "not a directory" in r.output


def test_sidecar_has_no_token_flag():
    r = runner.invoke(app, ["sidecar", "--help"])
    assert r.exit_code == 0 and "--token-file" in r.output and "--token " not in r.output


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_simulate_validates_before_starting_anything(tmp_path: Path):
    r = runner.invoke(
        app, ["simulate", "--state-dir", str(tmp_path), "--workload", "seed-9k-c1", "--steps", "5"]
    )
    assert r.exit_code == 2 and "--workload" in r.output and "seed-8k-c8" in r.output
    r = runner.invoke(app, ["simulate", "--state-dir", str(tmp_path), "--profile", "nope", "--steps", "5"])
    assert r.exit_code == 2 and "--profile" in r.output
    r = runner.invoke(app, ["simulate", "--state-dir", str(tmp_path), "--ranks", "0"])
    assert r.exit_code == 2
    assert not (tmp_path / "ranks").exists()  # nothing was started


@pytest.mark.slow  # runs the command in a subprocess
def test_simulate_one_rank_runs_the_real_path(tmp_path: Path):
    """One rank, a few steps, no sleeping: counters, report and shape sample appear; exit 0."""
    from flyserve.sidecar.stats import read_counters
    from flyserve.telemetry.shape_sample import read_shape_samples

    r = runner.invoke(
        app,
        ["simulate", "--state-dir", str(tmp_path), "--ranks", "1", "--steps", "40", "--step-interval", "0"],
    )
    assert r.exit_code == 0, r.output
    assert "simulate: done" in r.output
    c = read_counters(tmp_path / "metrics")
    assert sum(c[0].decisions.values()) == 40
    assert (tmp_path / "ranks" / "0.json").is_file()
    assert [s.step for s in read_shape_samples(tmp_path, limit=5)] == [39, 38, 37, 36, 35]


# ----------------------------------------------------------------------------- fail fast


def _sidecar_proc(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0):
    """The real command in a subprocess (bounded): its stderr, in order, and exit code."""
    import os
    import subprocess
    import sys

    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "flyserve.cli", "sidecar", *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
        env=full_env,
    )


@pytest.mark.slow  # runs the command in a subprocess
def test_sidecar_with_an_unknown_profile_fails_first_with_one_error_line(tmp_path: Path):
    """`--profile gfx955` started and answered /healthz 200; only GET /thresholds (422) told."""
    p = _sidecar_proc("--profile", "gfx955", "--state-dir", str(tmp_path / "s"), "--port", "1")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("ERROR") and "'gfx955'" in lines[0] and "gfx950" in lines[0]
    assert "--profile" in lines[0] and not (tmp_path / "s").exists()


@pytest.mark.slow  # runs the command in a subprocess
def test_simulate_with_an_unknown_profile_logs_one_error_line_first(tmp_path: Path):
    import subprocess
    import sys

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "flyserve.cli",
            "simulate",
            "--profile",
            "mi355",
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR") and "'mi355'" in lines[0]
    assert "cpu-tiny" in lines[0] and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # runs the command in a subprocess
def test_sidecar_port_in_use_names_the_flag_before_any_listening_line(tmp_path: Path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        p = _sidecar_proc(
            "--state-dir", str(tmp_path), "--port", str(port), env={"FLYSERVE_SIDECAR_TOKEN": "t" * 20}
        )
    finally:
        taken.close()
    assert p.returncode == 2, p.stderr
    assert f"--port {port}" in p.stderr and "already in use" in p.stderr
    assert "sidecar on http" not in p.stderr  # never claimed to listen


@pytest.mark.slow  # runs the command in a subprocess
def test_simulate_quiet_prints_no_progress(tmp_path: Path):
    r = runner.invoke(
        app,
        ["simulate", "--state-dir", str(tmp_path), "--ranks", "1", "--steps", "30", "--step-interval", "0.1",
         "--quiet"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "simulate: done" in r.output and "  step " not in r.output


# ----------------------------------------------------------------------------- the switch interval


@pytest.mark.slow  # 0.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_sidecar_switch_interval_out_of_range_names_the_flag(tmp_path: Path):
    for bad in ("500", "-1", "nan", "inf", "1e-9"):
        r = runner.invoke(app, ["sidecar", "--state-dir", str(tmp_path / "s"), "--switch-interval-ms", bad])
        assert r.exit_code == 2 and "--switch-interval-ms" in r.output, (bad, r.output)
        assert list(tmp_path.iterdir()) == [], bad  # refused before anything was created


@pytest.mark.slow  # runs the command in a subprocess
def test_sidecar_sets_and_says_its_thread_switch_interval(tmp_path: Path):
    """The real process: its start line carries the interval it runs with (Python's default is 5 ms;
    docs/performance.md section 12: 1 ms took the 64-rank p99 of /dispatch-stats from 31 to 9.9 ms)."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from flyserve.vllm.launch import free_port

    def start_line(*flags: str) -> str:
        port = free_port()
        p = subprocess.Popen(
            [sys.executable, "-m", "flyserve.cli", "sidecar", "--state-dir", str(tmp_path / "s"), "--port",
             str(port), *flags],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env={**os.environ, "FLYSERVE_SIDECAR_TOKEN": "t" * 24},
        )  # fmt: skip
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(p.stderr or ()), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and p.poll() is None:
                started = [line for line in list(lines) if "sidecar on http" in line]
                if started:
                    return started[0]
                time.sleep(0.1)
            return "".join(lines)  # exited or silent for 120 s: what it said, for the assertion
        finally:
            p.terminate()
            p.wait(timeout=30)

    assert "thread switch interval 2.5 ms" in start_line("--switch-interval-ms", "2.5")
    assert "thread switch interval 1 ms" in start_line()  # the default
    assert "thread switch interval 5 ms" in start_line("--switch-interval-ms", "0")  # Python's own


def test_cli_imports_with_a_typer_that_has_no_rich_type_display(monkeypatch):
    """typer before 0.29 has no TyperOption.display_type_rich (a lent machine had 0.27.2): importing
    flyserve.cli raised AttributeError there, so no command ran at all."""
    from typer.core import TyperOption

    from flyserve import cli

    for cls in TyperOption.__mro__:  # typer 0.29 defines it on TyperOption and its base
        if "display_type_rich" in vars(cls):
            monkeypatch.delattr(cls, "display_type_rich")
    cli._flags_take_no_value()  # no AttributeError
    assert not hasattr(TyperOption, "display_type_rich")


# ----------------------------------------------------------------------------- --log-level


def test_the_log_levels_are_uvicorns() -> None:
    from uvicorn.config import LOG_LEVELS as UVICORN_LEVELS

    from flyserve.sidecar.cli import LOG_LEVELS

    assert set(LOG_LEVELS) == set(UVICORN_LEVELS)


@pytest.mark.slow  # 1 s on the 2-core VM: the sidecar command's imports (fast-tier tests take under 0.3 s)
def test_sidecar_refuses_an_unknown_log_level_naming_the_flag(tmp_path: Path):
    """logging.basicConfig raised "ValueError: Unknown level: 'LOUD'" as a traceback."""
    r = runner.invoke(app, ["sidecar", "--state-dir", str(tmp_path / "s"), "--log-level", "loud"])
    assert r.exit_code == 2, r.output  # a traceback is exit code 1
    assert "--log-level" in r.output and "'loud'" in r.output
    assert "critical, error, warning, info, debug, trace" in r.output
    assert list(tmp_path.iterdir()) == []  # refused before anything was created


@pytest.mark.slow  # 1 s on the 2-core VM: the sidecar command's imports (fast-tier tests take under 0.3 s)
def test_sidecar_warns_when_the_autopilot_runs_without_costs(tmp_path: Path):
    """Without a cost table the trigger refuses every trial with "too few priced samples", forever.
    A bad --autopilot-bounds file stops the command right after the warnings, before it listens."""
    bad = tmp_path / "bounds.yaml"
    bad.write_text("nope: {min: 1, max: 2}\n")

    def out(*flags: str) -> str:
        r = runner.invoke(
            app, ["sidecar", "--state-dir", str(tmp_path / "s"), "--autopilot-bounds", str(bad), *flags]
        )
        assert r.exit_code == 2 and "--autopilot-bounds" in r.output, r.output
        return r.output

    assert "warning: no --costs" in out("--autopilot", "advise")
    assert "no --costs" not in out("--autopilot", "advise", "--costs", "h200")
    assert "no --costs" not in out("--autopilot", "off")
