"""`flyserve arms compare` as a command against two real uvicorn fake servers on 127.0.0.1.

The fake (tests/unit/arms_fake_openai.py) answers deterministically, so the exit codes, the
report on the terminal, the JSON and the plot are checked against known figures.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import typer
import uvicorn
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from typing import Self

from arms_fake_openai import FakeState, make_app

from flyserve.arms.cli import register

pytestmark = pytest.mark.integration

PROMPTS = [
    '{"prompt": "plain one", "answer": "9"}',
    '{"prompt": "flip this", "answer": "9"}',
    '{"prompt": "a tie here", "answer": "10"}',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, state: FakeState) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(make_app(state), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("fake server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def servers():
    a, b = FakeState(arm="a"), FakeState(arm="b")
    with ServerThread(a) as sa, ServerThread(b) as sb:
        yield sa, sb, a, b


@pytest.fixture(autouse=True)
def _state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Default results files go under $XDG_STATE_HOME: keep them in this test's directory."""
    home = tmp_path / "xdg-state"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home


def cli(*args: str):
    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)  # a second command keeps `arms` a sub-command
    return CliRunner().invoke(app, ["arms", "compare", *args])


def write_prompts(tmp_path: Path, lines=PROMPTS) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_compare_writes_table_json_and_plot(servers, tmp_path):
    sa, sb, a, b = servers
    prompts = write_prompts(tmp_path)
    out_json, out_plot = tmp_path / "report.json", tmp_path / "margins.png"
    r = cli(
        "--a", sa.url, "--b", sb.url, "--prompts", str(prompts), "--runs", "2", "--max-tokens", "8",
        "--top-logprobs", "2", "--json", str(out_json), "--plot", str(out_plot), "--no-progress",
        "--bootstrap", "500",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "responses that diverge" in r.output and "divergence vs noise" in r.output
    rep = json.loads(out_json.read_text())
    for key in (
        "prompts", "runs", "diverged_share", "answer_changed_share", "first_divergence_positions",
        "divergence_margins", "self_divergence_share", "accuracy",
    ):  # fmt: skip
        assert key in rep
    # 3 prompts x 4 cross pairs; "flip" and "tie" diverge in all their pairs.
    assert rep["prompts"] == 3 and rep["runs"] == 2
    assert rep["diverged_share"] == 8 / 12
    assert rep["answer_changed_share"] == 4 / 12
    assert rep["divergence_margins"] == [1.0] * 4 + [0.0] * 4
    assert rep["accuracy"] == {"a": 1.0, "b": 2 / 3}
    assert rep["self_divergence_share"] == {"a": 0.0, "b": 0.0}
    assert out_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert a.calls["a"] == 6 and b.calls["b"] == 6
    # The default results file is under $XDG_STATE_HOME, not beside the prompts; a re-run sends nothing.
    from flyserve.arms.results import default_results_path

    assert default_results_path(prompts).is_file()
    assert not list(tmp_path.glob("*.arms-results.jsonl"))
    r2 = cli("--a", sa.url, "--b", sb.url, "--prompts", str(prompts), "--max-tokens", "8", "--top-logprobs", "2",
             "--no-progress", "--bootstrap", "500")  # fmt: skip
    assert r2.exit_code == 0, r2.output
    assert "resuming: 12 of 12" in r2.output
    assert a.calls["a"] == 6 and b.calls["b"] == 6


def test_bad_prompts_file_exits_1_naming_the_line(servers, tmp_path):
    sa, sb, a, _ = servers
    prompts = write_prompts(tmp_path, [PROMPTS[0], '{"answer": "3"}'])
    r = cli("--a", sa.url, "--b", sb.url, "--prompts", str(prompts), "--no-progress")
    assert r.exit_code == 1
    assert "line 2: needs exactly one of `prompt`" in r.output
    assert a.calls["a"] == 0


def test_bad_flag_values_exit_1(servers, tmp_path):
    sa, sb, _, _ = servers
    prompts = write_prompts(tmp_path)
    r = cli("--a", sa.url.removesuffix("/v1"), "--b", sb.url, "--prompts", str(prompts), "--no-progress")
    assert r.exit_code == 1 and "--a:" in r.output
    r = cli(
        "--a", sa.url, "--b", sb.url, "--prompts", str(prompts), "--extractor", "regex:(", "--no-progress"
    )
    assert r.exit_code == 1 and "--extractor" in r.output


def test_a_failing_server_exits_3_and_keeps_what_it_got(servers, tmp_path):
    sa, sb, _, b = servers
    b.fail = lambda arm, n: 400 if n >= 2 else None
    prompts = write_prompts(tmp_path)
    results = tmp_path / "res.jsonl"
    r = cli("--a", sa.url, "--b", sb.url, "--prompts", str(prompts), "--results", str(results),
            "--concurrency", "1", "--max-tokens", "8", "--top-logprobs", "2", "--no-progress")  # fmt: skip
    assert r.exit_code == 3
    assert "arm B" in r.output and "HTTP 400" in r.output and "resume" in r.output
    kept = [json.loads(x) for x in results.read_text().splitlines()[1:]]
    assert any(rec["arm"] == "b" for rec in kept)


def test_unreachable_server_exits_3(tmp_path):
    prompts = write_prompts(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    r = cli("--a", dead, "--b", dead, "--prompts", str(prompts), "--model", "m", "--retries", "1",
            "--timeout", "2", "--no-progress")  # fmt: skip
    assert r.exit_code == 3
    assert "ConnectError" in r.output


def test_unwritable_results_exits_1(servers, tmp_path):
    sa, sb, _, _ = servers
    prompts = write_prompts(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = cli("--a", sa.url, "--b", sb.url, "--prompts", str(prompts), "--results", str(blocker / "r.jsonl"),
            "--no-progress")  # fmt: skip
    assert r.exit_code == 1 and "--results" in r.output


def test_registered_in_the_flyserve_command():
    from flyserve.cli import app

    r = CliRunner().invoke(app, ["arms", "compare", "--help"])
    assert r.exit_code == 0, r.output
    for flag in (
        "--a",
        "--b",
        "--prompts",
        "--runs",
        "--concurrency",
        "--results",
        "--json",
        "--plot",
        "--extractor",
    ):
        assert flag in r.output


def test_a_dns_failure_names_no_results_file_that_does_not_exist(tmp_path, _state_home):
    """After a DNS failure the command names no results file that does not exist."""
    prompts = write_prompts(tmp_path, PROMPTS[:1])
    r = cli(
        "--a", "http://flyserve-no-such-host.invalid:8000/v1", "--b", "http://flyserve-no-such-host.invalid:8001/v1",
        "--prompts", str(prompts), "--retries", "0", "--timeout", "5", "--no-progress",
    )  # fmt: skip
    assert r.exit_code == 3, r.output
    assert "no results file was written" in r.output and "so far are in" not in r.output
    assert not list(
        tmp_path.rglob("*.arms-results.jsonl")
    )  # neither beside the prompts nor in the state home


def test_default_results_path_is_outside_the_prompts_directory(tmp_path):
    from flyserve.arms.results import default_results_path

    prompts = write_prompts(tmp_path, PROMPTS)
    env = {"XDG_STATE_HOME": str(tmp_path / "st")}
    p = default_results_path(prompts, env)
    assert p.parent == tmp_path / "st" / "flyserve" / "arms" and p.name.startswith("prompts-")
    assert default_results_path(prompts, env) == p  # the same command resumes the same file
    other = tmp_path / "sub"
    other.mkdir()
    assert default_results_path(write_prompts(other, PROMPTS), env) != p
    assert default_results_path(prompts, {"HOME": str(tmp_path / "h")}).is_relative_to(
        tmp_path / "h" / ".local"
    )
