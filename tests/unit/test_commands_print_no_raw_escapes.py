"""Every command that prints what others wrote (the state directory's versions, rank reports, history
and audit log; config and cost files; the sidecar's and an arm's answers) prints it through
flyserve.terminal.printable: no raw ESC, C1, DEL, bidi or zero-width character reaches the terminal, rich
markup prints literally, and what was there shows as an escape (``\\x1b``)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import typer
from scripted_http import answer, scripted_server
from typer.testing import CliRunner

from flyserve.control import ControlPlane

REPO = Path(__file__).resolve().parents[2]
OSC52 = "\x1b]52;c;ZXZpbA==\x07"
HOSTILE = (
    f"{OSC52}\x1b[2J\x1b]0;pwned\x1b\\\x9b31m\u202e\u2066\u200b\x7f"
    "[red]RED[/red][link=http://evil.example]L[/link]"
)
IN_A_NAME = f"{OSC52}\x1b[2J\u202e[red]RED[bold]"  # a file name holds no '/'
RAW = ("\x1b", "\x07", "\x9b", "\x9d", "\x9c", "\u202e", "\u2066", "\u200b", "\x7f")
SHOWN = "\\x1b]52;c;ZXZpbA==\\x07"

runner = CliRunner()


def _app(*registers) -> typer.Typer:
    app = typer.Typer()
    for register in registers:
        register(app)
    app.command("noop-for-subcommands")(lambda: None)
    return app


def _clean(output: str) -> None:
    raw = sorted({f"U+{ord(c):04X}" for c in output if c in RAW})
    assert raw == [], f"raw {raw} in:\n{output!r}"


def _invoke(app: typer.Typer, args: list[str], code: int | None = 0, **kw) -> str:
    res = runner.invoke(app, args, env={"COLUMNS": "400", **kw.pop("env", {})}, **kw)
    if code is not None:
        assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    _clean(res.output)
    return res.output


@pytest.fixture(autouse=True)
def no_shared_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The changing commands would switch this test process's metrics to files (test_control_cli)."""
    import flyserve.telemetry.metrics as tm

    monkeypatch.setattr(tm, "setup_multiprocess", lambda d, **kw: Path(d))


@pytest.fixture
def hostile_state(tmp_path: Path) -> Path:
    """A state directory whose actor, circuit reason, rank report and a history file name carry
    escape sequences and markup (anyone who can write the directory can leave these)."""
    sd = tmp_path / "state"
    plane = ControlPlane(sd, step_margin=8, lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="alice" + HOSTILE, source="cli")
    plane.set_circuit(True, actor="bob" + HOSTILE, reason="why" + HOSTILE, source="cli")
    now = time.time()
    report = {"rank": 0, "engine": 0, "pid": os.getpid(), "time": now, "started": now - 10, "step": 5}
    (sd / "ranks").mkdir(exist_ok=True)
    (sd / "ranks" / "0.json").write_text(
        json.dumps({**report, "applied_version": 2, "applied_step": HOSTILE})
    )
    return sd


def test_thresholds_show_history_and_audit(hostile_state: Path) -> None:
    from flyserve.control.cli import register

    app = _app(register)
    sd = str(hostile_state)
    show = _invoke(app, ["thresholds", "show", "--state-dir", sd])
    assert "bob" + SHOWN in show and "why" + SHOWN in show and "since step " + SHOWN in show
    assert "[red]RED[/red][link=http://evil.example]L[/link]" in show
    history = _invoke(app, ["thresholds", "history", "--state-dir", sd])
    assert "alice\\x1b" in history.replace("\n", "").replace("│", "").replace(" ", "")
    audit = _invoke(app, ["thresholds", "audit", "--state-dir", sd])
    assert "\\u001b]52;c;ZXZpbA==\\u0007" in audit  # JSON lines: escaped by JSON itself
    for as_json in (["show", "--json"], ["history", "--json"]):
        _invoke(app, ["thresholds", *as_json, "--state-dir", sd])


def test_thresholds_repair_names_a_hostile_file_name_escaped(hostile_state: Path) -> None:
    from flyserve.control.cli import register

    (hostile_state / "control" / "history" / f"7{IN_A_NAME}.json").write_text("{")
    out = _invoke(_app(register), ["thresholds", "repair", "--state-dir", str(hostile_state)])
    assert f"7{SHOWN}" in out and "[red]RED[bold]" in out


def test_check_config_names_a_hostile_file_escaped(tmp_path: Path) -> None:
    from flyserve.thresholds_files.cli import register

    good = tmp_path / f"ok{IN_A_NAME}.yaml"
    good.write_text("min_seq_len: 2048\n")
    out = _invoke(_app(register), ["check-config", str(good)])
    # the name is the table's title, wrapped at the table's width and each line centred: how long
    # tmp_path is (an xdist worker's is longer) decides where it breaks and how much padding comes in
    out = "".join(out.split())
    assert f"ok{SHOWN}" in out and "[red]RED[bold]" in out
    bad = tmp_path / f"bad{IN_A_NAME}.yaml"
    bad.write_text('"\\e]52;c;ZXZpbA==\\a\\u202e[red]x[/red]": 1\nmin_seq_len: [1\n')
    _invoke(_app(register), ["check-config", str(bad)], code=1)


def test_explain_names_a_hostile_cost_table_escaped(tmp_path: Path, hostile_state: Path) -> None:
    from flyserve.explain.cli import register

    table = tmp_path / f"t{IN_A_NAME}.json"
    shutil.copy(REPO / "config" / "costs" / "h200.json", table)
    args = ["explain", "--query-lens", "1,2048", "--seq-lens", "900,4096", "--num-heads", "32"]
    out = _invoke(_app(register), [*args, "--costs", str(table)])
    assert f"costs t{SHOWN}" in out
    out = _invoke(_app(register), [*args, "--version", "2", "--state-dir", str(hostile_state)])
    assert "version 2 of" in out


def test_doctor_prints_a_hostile_config_path_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flyserve.doctor.cli as doctor_cli
    from flyserve.doctor import checks

    bad = tmp_path / f"cfg{IN_A_NAME}.yaml"
    bad.write_text("min_seq_len: [\n")
    monkeypatch.setenv("FLYSERVE_CONFIG", str(bad))
    monkeypatch.setattr(doctor_cli, "run_checks", lambda **kw: [checks.check_config_file()])
    out = _invoke(_app(doctor_cli.register), ["doctor"], code=1)
    assert f"cfg{SHOWN}" in out and "FAIL" in out


def test_sidecar_start_errors_name_a_hostile_cost_table_escaped(tmp_path: Path) -> None:
    from flyserve.sidecar.cli import register

    bad = tmp_path / f"c{IN_A_NAME}.json"
    bad.write_text("{not json")
    out = _invoke(
        _app(register),
        ["sidecar", "--state-dir", str(tmp_path / "s"), "--costs", str(bad)],
        code=2,
    )
    assert SHOWN in out


def _advice() -> dict:
    ratio = {
        "routed_over_oracle": 1.2,
        "samples": 3,
        "prefill_batches": {"routed_over_oracle": 1.1, "samples": 2},
    }
    return {
        "samples": 3,
        "window": "900s" + HOSTILE,
        "thresholds_version": HOSTILE,
        "stale": False,
        "before": ratio,
        "after": ratio,
        "changes": {HOSTILE: [HOSTILE, 2048]},
        "patch": {
            "method": "PATCH",
            "path": "/thresholds",
            "headers": {"If-Match": HOSTILE},
            "body": {"a": 1},
        },
        "restart": [{"knob": HOSTILE, "current": 1, "advised": HOSTILE, "saving": 0.1, "how": HOSTILE}],
        "shapes": [],
        "shapes_total": 0,
    }


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_advise_prints_a_hostile_answer_escaped_and_a_non_object_as_an_error() -> None:
    from flyserve.control.cli import register as control
    from flyserve.sidecar.cli import register as sidecar

    app = _app(control, sidecar)
    answers = {
        "advice": (b"200 OK", json.dumps(_advice()).encode()),
        "array": (b"200 OK", b"[1, 2, 3]"),
        "string": (b"200 OK", b'"advice"'),
        "refused": (b"422 Unprocessable Entity", json.dumps({"detail": HOSTILE}).encode()),
    }
    for name, (status, body) in answers.items():
        with scripted_server(lambda req, conn, s=status, b=body: answer(conn, s.decode(), b)) as srv:
            out = _invoke(app, ["thresholds", "advise", "--url", srv.url, "--timeout", "5"], code=None)
        if name == "advice":
            assert SHOWN in out and "[red]RED[/red]" in out, out
        elif name == "refused":
            assert "HTTP 422" in out and SHOWN in out
        else:
            assert "the answer is not advice" in out and "Traceback" not in out


def _arms_report(model: str) -> dict:
    pair = {"a": 0.0, "b": 0.0}
    return {
        "prompts": 1,
        "runs": 2,
        "self_divergence_share": pair,
        "self_answer_changed_share": pair,
        "diverged_share": 0.0,
        "answer_changed_share": 0.0,
        "answer_changed_given_diverged_share": None,
        "first_divergence_position_median": None,
        "margin_median": None,
        "margin_zero_share": None,
        "divergences_without_margin": 0,
        "logprob_drift": {},
        "accuracy": None,
        "tests": {"divergence_vs_noise": {"statement": "no difference" + HOSTILE}},
        "arms": {
            "a": {"url": "http://127.0.0.1:1/v1", "model": model},
            "b": {"url": HOSTILE, "model": model},
        },
    }


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_arms_report_and_errors_print_a_server_s_words_escaped(tmp_path: Path) -> None:
    from rich.console import Console

    from flyserve.arms.cli import register
    from flyserve.arms.report import render_table

    console = Console(record=True, width=400, force_terminal=True, color_system=None)
    render_table(_arms_report("model" + HOSTILE), console)
    out = console.export_text(styles=False)
    _clean(out)
    assert "model" + SHOWN in out and "[red]RED[/red]" in out

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    body = b'{"error": "' + HOSTILE.encode() + b'"}'  # raw bytes, as a hostile server sends them
    with scripted_server(lambda req, conn: answer(conn, "400 Bad Request", body)) as srv:
        base = srv.url + "/v1"
        args = ["arms", "compare", "--a", base, "--b", base, "--prompts", str(prompts), "--model", "m"]
        out = _invoke(
            _app(register),
            [*args, "--runs", "1", "--retries", "0", "--no-progress", "--results", str(tmp_path / "r")],
            code=None,
        )
    assert "HTTP 400" in out and SHOWN in out and "[red]RED[/red]" in out


def test_replay_prints_a_hostile_cost_table_gpu_escaped(tmp_path: Path) -> None:
    from flyserve.lab.cli import register

    doc = json.loads((REPO / "config" / "costs" / "h200.json").read_text())
    doc["meta"]["gpu"] = HOSTILE
    table = tmp_path / "t.json"
    table.write_text(json.dumps(doc))
    out = _invoke(_app(register), ["replay", "--workload", "seed-8k-c8", "--costs", str(table)])
    assert SHOWN in out and "[red]RED[/red][link=http://evil.example]L[/link]" in out
