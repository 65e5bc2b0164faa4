"""Log lines, error messages and the advise command's curl line are safe for a terminal and a shell.

An unknown key of a config file, an HTTP body or a state file, a file name in a log line, the
``patch`` of an answer at --url: all written by someone else. An ESC in them must reach the operator's
terminal (or journal) only as the text ``\\x1b``, and nothing in a printed command may run when the
operator pastes it.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from scripted_http import answer, scripted_server
from typer.testing import CliRunner

from flyserve.policy.errors import ThresholdsError, redact_field
from flyserve.policy.thresholds import FIELDS, unknown_key_error
from flyserve.terminal import printable as pr

REPO = Path(__file__).resolve().parents[2]
OSC52 = "\x1b]52;c;ZXZpbA==\x07"  # writes "evil" to the clipboard of a terminal that obeys it
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u200b")


def _clean(text: str) -> None:
    assert not any(c in text for c in RAW), repr(text)


@pytest.fixture
def log_filter() -> Iterator[None]:
    """install_log_filter() for one test: the filters it puts on flyserve's loggers come off again."""
    pr.install_log_filter()
    yield
    for name in list(logging.Logger.manager.loggerDict):
        if pr._is_flyserve(name):
            logging.getLogger(name).removeFilter(pr.LOG_FILTER)


def _capture(logger: logging.Logger, *, filtered: bool = False) -> tuple[io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if filtered:
        handler.addFilter(pr.LOG_FILTER)
    logger.addHandler(handler)
    return out, handler


# --- redact_field and ThresholdsError -------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [f"<{OSC52}>", "<\x1b[2J>", "<[red]x[/red]>", "<\u202eabc>", "min_seq_len\n", "<a\x07>"],
)
def test_redact_field_names_a_hostile_placeholder_only_by_length(name: str) -> None:
    shown = redact_field(name)
    assert shown == f"<key of {len(name)} chars>"
    _clean(shown)


@pytest.mark.parametrize(
    "name", ["<document>", "<file>", "<unknown key of 12 chars>", "min_seq_len", "If-Match", "file.<body>"]
)
def test_redact_field_still_shows_names_and_flyserve_s_placeholders(name: str) -> None:
    assert redact_field(name) == name


def test_a_thresholds_error_escapes_its_reasons_and_source() -> None:
    exc = ThresholdsError([("<document>", f"malformed YAML: {OSC52}")], source=f"/etc/{OSC52}.yaml")
    _clean(str(exc))
    assert "\\x1b]52" in str(exc) and "\\x1b]52" in exc.reason and "\\x1b]52" in exc.source


# --- unknown_key_error ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "min_seq_le\x1b",  # a typo of min_seq_len, close enough to be suggested
        f"min_seq_len{OSC52}",
        "\x1b]0;pwned\x07",
        "\u202emin_seq_len",
        "x" * 5000 + "\x1b[2J",
    ],
)
def test_unknown_key_error_shows_a_hostile_key_escaped_and_bounded(key: str) -> None:
    field, reason = unknown_key_error(key)
    _clean(field + reason)
    assert len(field) <= 64
    m = re.search(r"did you mean '([^']*)'", reason)
    assert m is None or m.group(1) in FIELDS
    exc = ThresholdsError([(field, reason)], source="api")  # how every caller raises it
    _clean(str(exc))
    assert len(str(exc)) < 1000


def test_unknown_key_error_suggests_a_known_key_for_a_plain_typo() -> None:
    assert unknown_key_error("min_seq_lenn") == ("min_seq_lenn", "unknown key (did you mean 'min_seq_len'?)")


def test_the_sidecar_s_422_for_a_hostile_key_is_escaped(tmp_path: Path) -> None:
    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    token = "t0ken-for-tests-0123456789"
    settings = SidecarSettings(
        state_dir=tmp_path,
        token=SecretStr(token),
        share_control_metrics=False,
        stats_ttl_s=0.0,
        metrics_ttl_s=0.0,
    )
    with TestClient(create_app(settings)) as c:
        for key in ("min_seq_le\x1b", f"k{OSC52}"):
            r = c.patch("/thresholds", json={key: 1}, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 422, r.text
            body = r.json()
            _clean(json.dumps(body, ensure_ascii=False))
            assert body["field"].startswith("<") and body["errors"][0]["field"] == body["field"]


# --- log records ----------------------------------------------------------------------------------


def test_a_flyserve_log_record_with_an_osc52_argument_comes_out_escaped(log_filter: None) -> None:
    log = logging.getLogger("flyserve.sidecar")
    out, handler = _capture(log)  # a plain handler: the logger's filter escapes before any handler
    try:
        log.warning("reloading %s failed: %s", f"/state/{OSC52}.json", "line\nforged INFO line")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    _clean(text)
    assert "\\x1b]52;c;ZXZpbA==\\x07" in text
    assert text.count("\n") == 1 and "line\\x0aforged" in text  # one record, one line


def test_a_traceback_in_a_flyserve_log_record_is_escaped(log_filter: None) -> None:
    log = logging.getLogger("flyserve.control")
    out, handler = _capture(log)
    try:
        try:
            raise ValueError(f"bad file {OSC52}")
        except ValueError:
            log.exception("reload failed")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    _clean(text)
    assert "Traceback" in text and "\\x1b]52" in text


def test_a_logger_made_later_is_escaped_by_flyserve_s_handler() -> None:
    """A logger's filter misses its children's records; the handler flyserve sets up has it too."""
    log = logging.getLogger("flyserve.made_after_install")
    out, handler = _capture(log, filtered=True)
    try:
        log.error("%s", OSC52)
    finally:
        log.removeHandler(handler)
    _clean(out.getvalue())
    assert "\\x1b]52" in out.getvalue()


def test_other_loggers_records_pass_untouched() -> None:
    log = logging.getLogger("vllm.not_flyserve")
    record = log.makeRecord(log.name, logging.INFO, __file__, 1, "%s", (OSC52,), None)
    assert pr.LOG_FILTER.filter(record) and record.getMessage() == OSC52


def test_the_filter_costs_nothing_for_a_record_never_made(
    log_filter: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(pr.PrintableLogFilter, "filter", lambda self, r: calls.append(r) or True)
    log = logging.getLogger("flyserve.vllm")
    monkeypatch.setattr(log, "level", logging.INFO)
    # whatever earlier tests left: a dictConfig that disabled existing loggers, logging.disable()
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(logging.root.manager, "disable", logging.NOTSET)
    log._cache.clear()  # isEnabledFor's cache, filled under the state before
    for _ in range(1000):
        log.debug("step %d", 1)  # the per-step hot path at the default level
    assert calls == []
    log.warning("emitted")
    assert calls  # the filter is reached once per handler or logger it is on


def test_every_flyserve_logger_gets_the_filter_at_install() -> None:
    """install_log_filter names flyserve's loggers so one imported later has its filter already."""
    named = set()
    for path in (REPO / "flyserve").rglob("*.py"):
        named |= set(re.findall(r'getLogger\("(flyserve[a-z_.]*)"\)', path.read_text()))
    assert named and named <= {pr.LOGGER, *pr._LOGGERS}, sorted(named - {pr.LOGGER, *pr._LOGGERS})


def test_the_vllm_plugin_s_handler_escapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from flyserve.vllm.plugin import show_logs

    root = logging.getLogger("flyserve")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    show_logs()
    (handler,) = root.handlers
    out = io.StringIO()
    handler.setStream(out)  # type: ignore[attr-defined]
    try:
        logging.getLogger("flyserve.vllm.later_child").warning("rank report %s", OSC52)
    finally:
        for name in list(logging.Logger.manager.loggerDict):
            if pr._is_flyserve(name):
                logging.getLogger(name).removeFilter(pr.LOG_FILTER)
    _clean(out.getvalue())
    assert "\\x1b]52" in out.getvalue()


# --- flyserve thresholds advise: the curl line -----------------------------------------------------


def _advice(patch: dict) -> dict:
    ratio = {
        "routed_over_oracle": 1.2,
        "samples": 3,
        "prefill_batches": {"routed_over_oracle": 1.1, "samples": 2},
    }
    return {
        "samples": 3,
        "window": "900s",
        "thresholds_version": 4,
        "stale": False,
        "before": ratio,
        "after": ratio,
        "changes": {"min_seq_len": [2048, 4096]},
        "patch": patch,
        "restart": [],
        "shapes": [],
        "shapes_total": 0,
    }


def _patch(**kw) -> dict:
    return {
        "method": "PATCH",
        "path": "/thresholds",
        "headers": {"If-Match": "4"},
        "body": {"min_seq_len": 4096},
        **kw,
    }


def _advise(adv: dict) -> tuple[int, str]:
    import typer

    from flyserve.control.cli import register as control
    from flyserve.sidecar.cli import register as sidecar

    app = typer.Typer()
    control(app)
    sidecar(app)
    body = json.dumps(adv).encode()
    with scripted_server(lambda req, conn: answer(conn, "200 OK", body)) as srv:
        res = CliRunner().invoke(app, ["thresholds", "advise", "--url", srv.url, "--timeout", "5"])
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
@pytest.mark.parametrize(
    "patch",
    [
        _patch(method="PATCH; rm -rf ~"),
        _patch(method="$(touch x)"),
        _patch(method="DELETE"),
        _patch(path="/thresholds; rm -rf ~"),
        _patch(path="/reload"),
    ],
)
def test_advise_refuses_a_forged_method_or_path(patch: dict) -> None:
    code, out = _advise(_advice(patch))
    assert code == 1, out
    assert "not a PATCH or PUT of /thresholds" in out and "not printed" in out
    assert "curl" not in out


def _curl_line(out: str) -> str:
    (line,) = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("curl ")]
    return line


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_advise_quotes_a_hostile_body_so_the_shell_expands_nothing(tmp_path: Path) -> None:
    hostile = "'$(touch x)'`touch y`;touch z"
    code, out = _advise(_advice(_patch(method="PUT", body={"min_seq_len": hostile})))
    assert code == 0, out
    line = _curl_line(out)
    words = shlex.split(line)
    assert words[:3] == ["curl", "-X", "PUT"]
    assert json.loads(words[words.index("-d") + 1]) == {"min_seq_len": hostile}
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    assert subprocess.run([bash, "-n", "-c", line], check=False, capture_output=True).returncode == 0
    # Run it for real with curl a function that prints its arguments: the body arrives literally
    # and nothing was touched.
    run = subprocess.run(
        [bash, "-c", 'curl() { printf "%s\\n" "$@"; }; ' + line],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "FLYSERVE_SIDECAR_TOKEN": "tok"},
    )
    assert run.returncode == 0, run.stderr
    args = run.stdout.splitlines()
    assert json.loads(args[args.index("-d") + 1]) == {"min_seq_len": hostile}
    assert list(tmp_path.iterdir()) == []
