"""`flyserve thresholds ...`: the commands, their output and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flyserve.control import ControlPlane
from flyserve.control.cli import register

app = typer.Typer()
register(app)
runner = CliRunner()


def run(*args: str, code: int = 0) -> str:
    res = runner.invoke(app, ["thresholds", *args])
    assert res.exit_code == code, (res.exit_code, res.output)
    return res.output


@pytest.fixture(autouse=True)
def shared_metrics_calls(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The commands share their reload counts through <state>/metrics; in this test process that
    would switch every other test's metrics to files, so record the call instead (the real switch
    is exercised by the `watch` subprocess test below)."""
    import flyserve.telemetry.metrics as tm

    calls: list[Path] = []
    monkeypatch.setattr(tm, "setup_multiprocess", lambda d, **kw: calls.append(Path(d)) or Path(d))
    return calls


@pytest.fixture
def sd(tmp_path: Path) -> str:
    """An initialised state directory (what a running server or `flyserve init` leaves)."""
    path = str(tmp_path / "state")
    assert runner.invoke(app, ["init", "--state-dir", path]).exit_code == 0
    return path


def test_changing_commands_share_their_metrics_through_the_state_dir(
    sd: str, shared_metrics_calls: list
) -> None:
    run("show", "--state-dir", sd)
    assert shared_metrics_calls == []
    run("set", "min_seq_len=2048", "--state-dir", sd)
    assert shared_metrics_calls == [Path(sd) / "metrics"]


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_set_show_unset_history_rollback(sd: str, tmp_path: Path) -> None:
    out = run("set", "min_seq_len=2048", "lpt=never", "--state-dir", sd, "--actor", "alice")
    assert "published version 1" in out and "min_seq_len: 1536 -> 2048" in out and "lpt: auto -> never" in out
    shown = json.loads(run("show", "--state-dir", sd, "--json"))
    assert shown["version"] == 1 and shown["actor"] == "alice" and shown["source"] == "cli"
    assert shown["provenance"]["min_seq_len"] == "override" and shown["thresholds"]["lpt"] == "never"
    assert "min_seq_len" in run("show", "--state-dir", sd)
    run("unset", "lpt", "--state-dir", sd)
    assert ControlPlane(sd).snapshot().thresholds.lpt == "auto"
    hist = json.loads(run("history", "--state-dir", sd, "--json"))
    assert [h["version"] for h in hist] == [1, 2]
    table = run("history", "--state-dir", sd)
    assert "thresholds history" in table and "alice" in table
    out = run("rollback", "1", "--state-dir", sd, "--json")
    res = json.loads(out)
    assert res["changed"] and res["snapshot"]["source"] == "rollback" and res["snapshot"]["version"] == 3
    assert res["diff"] == {"lpt": {"old": "auto", "new": "never"}}
    entries = [json.loads(ln) for ln in run("audit", "--state-dir", sd).splitlines()]
    assert [e["action"] for e in entries] == ["set", "set", "rollback"]


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_errors_name_the_field_and_exit_non_zero(sd: str) -> None:
    run("set", "min_seq_len=4096", "--state-dir", sd)
    before = Path(sd, "control", "current.json").read_bytes()
    out = run("set", "min_seq_len=lots", "--state-dir", sd, code=1)
    assert "min_seq_len" in out and "unchanged" in out
    assert "unknown key" in run("set", "nope=1", "--state-dir", sd, code=1)
    assert "KEY=VALUE" in run("set", "min_seq_len", "--state-dir", sd, code=1)
    assert "decode_path" in run("set", "decode_path=prefill", "--state-dir", sd, code=1)
    cfg = Path(sd).parent / "dp.yaml"
    cfg.write_text("decode_path: prefill\n")
    assert "restart" in run("reload", "--config", str(cfg), "--state-dir", sd, code=1)
    assert "decode_path: unified -> prefill" in run(
        "reload", "--config", str(cfg), "--server-stopped", "--state-dir", sd
    )
    before = Path(sd, "control", "current.json").read_bytes()
    assert "conflict" in run("set", "min_seq_len=5000", "--if-match", "7", "--state-dir", sd, code=3)
    assert "not in history" in run("rollback", "99", "--state-dir", sd, code=1)
    assert "missing" in run("reload", "--config", str(Path(sd) / "nope.yaml"), "--state-dir", sd, code=2)
    assert Path(sd, "control", "current.json").read_bytes() == before


def test_dry_run_and_unchanged(sd: str) -> None:
    assert "dry run" in run("set", "min_seq_len=4096", "--dry-run", "--state-dir", sd)
    assert not Path(sd, "control", "current.json").exists()
    run("set", "min_seq_len=4096", "--state-dir", sd)
    assert "unchanged" in run("set", "min_seq_len=4096", "--state-dir", sd)


def test_reload_and_circuit(sd: str, tmp_path: Path) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_qblock_rows: 16\n")
    assert "min_qblock_rows: 48 -> 16" in run("reload", "--config", str(cfg), "--state-dir", sd)
    assert "circuit_open: False -> True" in run(
        "circuit", "open", "--reason", "kernel fault", "--state-dir", sd
    )
    assert ControlPlane(sd).snapshot().circuit_open
    assert "circuit OPEN" in run("show", "--state-dir", sd)
    run("circuit", "close", "--state-dir", sd)
    assert not ControlPlane(sd).snapshot().circuit_open
    # the file path was recorded: a plain reload finds it again
    cfg.write_text("min_qblock_rows: 20\n")
    assert "min_qblock_rows: 16 -> 20" in run("reload", "--state-dir", sd)


def test_state_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(tmp_path / "env-state"))
    assert "env-state" in runner.invoke(app, ["init"]).output
    out = run("set", "min_seq_len=3000")
    assert "the default" not in out  # chosen through the environment: not implicit
    assert ControlPlane(tmp_path / "env-state").snapshot().thresholds.min_seq_len == 3000


@pytest.mark.slow  # runs `flyserve thresholds watch` in a subprocess
def test_watch_runs_until_sigterm_and_reloads_on_edit_and_sighup(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    cfg = tmp_path / "cfg" / "flyserve.yaml"
    cfg.parent.mkdir()
    cfg.write_text("min_seq_len: 2000\n")
    state = tmp_path / "state"
    plane = ControlPlane(state)

    def wait_for(cond, timeout_s: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.05)
        return False

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from flyserve.control.cli import thresholds_app; thresholds_app()",
            "watch",
            "--config",
            str(cfg),
            "--state-dir",
            str(state),
            "--poll-interval",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert wait_for(lambda: plane.snapshot().thresholds.min_seq_len == 2000)
        cfg.write_text("min_seq_len: 2500\n")
        assert wait_for(lambda: plane.snapshot().thresholds.min_seq_len == 2500)
        # the audit line follows the publish: wait for it before counting
        assert wait_for(lambda: plane.audit_log()[-1].get("version") == plane.snapshot().version)
        n = len(plane.audit_log())
        proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: [e["result"] for e in plane.audit_log()[n:]] == ["unchanged"])
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "watching" in out
        # Its reload counts went to the shared metrics directory, where the sidecar reads them.
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=str(state / "metrics"))
        ok = reg.get_sample_value("flyserve_config_reloads_total", {"result": "success", "source": "file"})
        assert ok == 3  # the start, the edit, SIGHUP (unchanged content still validates: success)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# ----------------------------------------------------------------------------- the state directory


def test_changing_commands_refuse_a_directory_that_was_never_initialised(tmp_path: Path) -> None:
    """A typo'd --state-dir used to be created, "published version 1 ... effective from engine step
    8" printed, exit 0, while the real server saw nothing."""
    typo = tmp_path / "typo"
    for args in (
        ["set", "min_seq_len=4096"],
        ["unset", "lpt"],
        ["rollback", "1"],
        ["reload"],
        ["circuit", "open"],
    ):
        out = run(*args, "--state-dir", str(typo), code=2)
        assert str(typo) in out and "flyserve init" in out, (args, out)
    assert not typo.exists()  # nothing was created
    plain = tmp_path / "plain"
    plain.mkdir()  # exists, but no server or `init` laid it out
    out = run("set", "min_seq_len=4096", "--state-dir", str(plain), code=2)
    assert "not a flyserve state directory" in out and list(plain.iterdir()) == []


def test_create_flag_and_init_make_a_state_directory(tmp_path: Path) -> None:
    new = tmp_path / "new"
    assert "published version 1" in run("set", "min_seq_len=4096", "--state-dir", str(new), "--create")
    assert ControlPlane(new).snapshot().thresholds.min_seq_len == 4096
    other = tmp_path / "other"
    res = runner.invoke(app, ["init", "--state-dir", str(other)])
    assert res.exit_code == 0 and f"initialised state directory {other}" in res.output
    assert "already initialised" in runner.invoke(app, ["init", "--state-dir", str(other)]).output
    run("set", "min_seq_len=4096", "--state-dir", str(other))
    f = tmp_path / "file"
    f.write_text("x")
    res = runner.invoke(app, ["init", "--state-dir", str(f)])
    assert res.exit_code == 2 and "not a directory" in res.output


def test_read_commands_exit_non_zero_on_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    for args in (["show"], ["history"], ["audit"]):
        out = run(*args, "--state-dir", str(missing), code=2)
        assert str(missing) in out and "does not exist" in out, (args, out)
    assert not missing.exists()


def test_the_default_state_directory_is_printed_when_used_implicitly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flyserve.control.initialise as init_mod

    monkeypatch.delenv("FLYSERVE_STATE_DIR", raising=False)
    monkeypatch.setattr(init_mod, "default_state_dir", lambda: tmp_path / "dflt")
    out = run("show", code=2)
    assert f"state directory: {tmp_path / 'dflt'} (the default" in out
    out = run("set", "min_seq_len=4096", "--create")
    assert f"state directory: {tmp_path / 'dflt'} (the default" in out and "published version 1" in out


def test_history_says_what_version_1_changed(sd: str) -> None:
    """Version 1 showed `changed: -`; it is compared with its profile's defaults (version 0)."""
    run("set", "min_seq_len=4096", "--state-dir", sd)
    run("set", "lpt=never", "--state-dir", sd)
    out = runner.invoke(app, ["thresholds", "history", "--state-dir", sd], env={"COLUMNS": "200"}).output
    rows = [ln for ln in out.splitlines() if ln.startswith("│ 1 ")]
    assert rows and "1536->4096" in rows[0], rows


def test_json_is_a_flag_in_help() -> None:
    """`--json <bool>` in --help read as "takes a value"; `--json true` then failed."""
    from flyserve.cli import app as flyserve_app

    res = runner.invoke(flyserve_app, ["thresholds", "show", "--help"], env={"COLUMNS": "120"})
    line = next(ln for ln in res.output.splitlines() if "--json" in ln)
    assert "<bool>" not in line and "Print JSON" in line
    assert "<path>" in next(ln for ln in res.output.splitlines() if "--state-dir" in ln)
