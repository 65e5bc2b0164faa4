"""The autopilot's HTTP surface in-process (TestClient): GET /autopilot's shape, the token on every
change (401 without, 403 wrong), 422 naming the field, 404 for an unknown trial id; the
`flyserve autopilot status|mode|pause|resume|kill|approve` client against the same app; the
--autopilot-bounds reader; the sidecar's defaults against AutopilotConfig's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer
from fastapi.testclient import TestClient
from pydantic import SecretStr
from typer.testing import CliRunner

from flyserve.autopilot.inputs import AutopilotConfig, KnobBound
from flyserve.sidecar import autopilot_cli
from flyserve.sidecar.app import create_app
from flyserve.sidecar.autopilot_bounds import BoundsError, read_bounds
from flyserve.sidecar.cli import AUTOPILOT_DEFAULTS
from flyserve.sidecar.settings import SidecarSettings

TOKEN = "t" * 24
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STATUS_KEYS = {
    "mode",
    "paused",
    "state",
    "trial",
    "proposal",
    "last_refusal",
    "owed_publish",
    "last_decisions",
    "exploration_bound",
}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = SidecarSettings(
        state_dir=tmp_path / "state", token=SecretStr(TOKEN), share_control_metrics=False
    )
    with TestClient(create_app(settings)) as c:
        yield c


def test_get_autopilot_is_open_and_off_by_default(client: TestClient) -> None:
    r = client.get("/autopilot")
    assert r.status_code == 200
    st = r.json()
    assert set(st) == STATUS_KEYS
    assert st["mode"] == "off" and st["state"] == "off" and st["trial"] is None and st["last_decisions"] == []
    assert "bounds" in st["last_refusal"]
    # off: the autopilot's thread never ran, so the plan's expected share is not measured yet
    assert st["exploration_bound"] == {"expected_share": None, "limit": 0.005}


@pytest.mark.parametrize(
    "path",
    [
        "/autopilot/mode",
        "/autopilot/pause",
        "/autopilot/resume",
        "/autopilot/kill",
        "/autopilot/approve/ap-1-1",
    ],
)
def test_every_change_needs_the_token(client: TestClient, path: str) -> None:
    body = {"mode": "advise"} if path.endswith("mode") else None
    assert client.post(path, json=body).status_code == 401
    assert (
        client.post(path, json=body, headers={"Authorization": "Bearer wrong-token-wrong"}).status_code == 403
    )
    assert client.get("/autopilot").json()["mode"] == "off"


@pytest.mark.parametrize(
    ("body", "field"),
    [({"mode": "fast"}, "mode"), ({}, "mode"), ({"mode": "auto", "x": 1}, "x"), ({"mode": 1}, "mode")],
)
def test_a_bad_mode_body_is_422_naming_the_field(client: TestClient, body: dict, field: str) -> None:
    r = client.post("/autopilot/mode", json=body, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == field


def test_mode_pause_resume_kill(client: TestClient) -> None:
    st = client.post("/autopilot/mode", json={"mode": "trial"}, headers=AUTH).json()
    assert st["mode"] == "trial" and st["state"] in ("idle", "cooldown")
    assert client.post("/autopilot/pause", headers=AUTH).json()["paused"] is True
    assert client.post("/autopilot/resume", headers=AUTH).json()["paused"] is False
    st = client.post("/autopilot/kill", headers=AUTH).json()
    assert st["mode"] == "off" and st["state"] == "off"


def test_approving_an_unknown_trial_is_404(client: TestClient) -> None:
    r = client.post("/autopilot/approve/ap-1-1", headers=AUTH)
    assert r.status_code == 404 and "ap-1-1" in r.json()["detail"]
    assert client.post("/autopilot/approve/..%2F..", headers=AUTH).status_code in (404, 422)


def test_the_routes_are_in_the_openapi_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/autopilot", "/autopilot/mode", "/autopilot/kill", "/autopilot/approve/{trial_id}"):
        assert p in paths


def test_the_cli_talks_to_the_sidecar(
    client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(autopilot_cli, "make_client", lambda url: client)
    monkeypatch.setattr(client, "close", lambda: None)  # the command's `with` must leave the app open
    monkeypatch.setattr(client, "__exit__", lambda *a: None, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    app = typer.Typer()
    autopilot_cli.register(app)
    run = CliRunner().invoke
    got = run(app, ["status"])
    assert got.exit_code == 0 and "mode off" in got.output
    got = run(app, ["mode", "advise", "--token-file", str(token_file), "--json"])
    assert got.exit_code == 0 and '"mode": "advise"' in got.output
    assert run(app, ["pause", "--token-file", str(token_file)]).exit_code == 0
    assert run(app, ["resume", "--token-file", str(token_file)]).exit_code == 0
    got = run(app, ["approve", "ap-3-1", "--token-file", str(token_file)])
    assert got.exit_code == 1 and "404" in got.output
    got = run(app, ["kill", "--token-file", str(token_file)])
    assert got.exit_code == 0 and "mode off" in got.output
    monkeypatch.delenv("FLYSERVE_SIDECAR_TOKEN", raising=False)
    assert run(app, ["kill"]).exit_code == 2


def test_the_bounds_file_is_read_and_bad_entries_are_refused_by_name(tmp_path: Path) -> None:
    good = tmp_path / "bounds.yaml"
    good.write_text("min_seq_len: {min: 256, max: 8192}\nblock_m: {min: 64, max: 512}\n")
    assert dict(read_bounds(good)) == {"min_seq_len": KnobBound(256, 8192), "block_m": KnobBound(64, 512)}
    for text, field in [
        ("decode_path: {min: 0, max: 1}\n", "decode_path"),
        ("min_seq_len: {min: 10, max: 5}\n", "min_seq_len.max"),
        ("min_seq_len: {min: -1, max: 5}\n", "min_seq_len.min"),
        ("min_seq_len: {min: 1, max: 1e400}\n", "min_seq_len.max"),
        ("min_seq_len: {min: 1}\n", "min_seq_len.max"),
        ("min_seq_len: {min: 1, max: 2, step: 3}\n", "min_seq_len.step"),
        ("nope: {min: 1, max: 2}\n", "nope"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(BoundsError) as got:
            read_bounds(bad)
        assert got.value.field == field, text


def test_a_non_string_key_in_a_bound_is_unknown_not_missing(tmp_path: Path) -> None:
    """``3: 4`` beside min and max was reported as "field 'min_seq_len.3': missing"."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("min_seq_len: {min: 1, max: 2, 3: 4}\n")
    with pytest.raises(BoundsError) as got:
        read_bounds(bad)
    assert (got.value.field, got.value.reason) == ("min_seq_len.3", "unknown key")
    bad.write_text("min_seq_len: {max: 2}\n")
    with pytest.raises(BoundsError) as got:
        read_bounds(bad)
    assert (got.value.field, got.value.reason) == ("min_seq_len.min", "missing")


def test_the_sidecar_defaults_are_the_state_machines() -> None:
    cfg = AutopilotConfig()
    settings = SidecarSettings(state_dir=Path("state"))
    assert settings.autopilot == "off"
    assert settings.autopilot_config() == cfg
    for name in (
        "block_steps",
        "plan_blocks",
        "cooldown_s",
        "regret_bound",
        "min_saving",
        "min_priced_samples",
        "max_exploration_share",
        "p99_ratio_limit",
    ):
        assert getattr(AUTOPILOT_DEFAULTS, name) == getattr(cfg, name), name


@pytest.mark.parametrize(
    "answer",
    [
        {"mode": "trial", "trial": {"id": "ap-1", "changed": ["min_seq_len", 1, 2]}},
        {"mode": "trial", "trial": {"id": "ap-1", "changed": {"min_seq_len": 5}}},
        {"mode": "trial", "proposal": {"id": "ap-1", "changed": "x"}},
        {"mode": "auto", "last_decisions": 7},
        {"mode": "auto", "last_decisions": [{"effect": 10**400}, {"effect": "fast"}, 3]},
        {"mode": "trial", "trial": {"id": "ap-1", "estimate": 10**400, "changed": None}},
        {"mode": "trial", "trial": {"id": "ap-1", "estimate": float("nan")}},
        {"mode": "trial", "trial": {"id": "ap-1", "estimate": float("-inf")}},
        {"mode": ["a"], "paused": "yes", "trial": [], "proposal": 3, "last_refusal": {"a": 1}},
    ],
)
def test_the_status_of_an_odd_answer_prints_and_never_crashes(answer: dict) -> None:
    """Whatever answers at --url wrote the status: a list where an object belongs, an int where a
    list belongs, 10**400 (too large for a float) each print as "?" or "-"."""
    text = autopilot_cli.render(answer)
    assert text.startswith("autopilot: mode ")


def test_the_status_reads_a_huge_estimate_as_unknown() -> None:
    text = autopilot_cli.render({"mode": "trial", "trial": {"id": "ap-1", "estimate": 10**400}})
    assert "estimate ? (negative" in text
    text = autopilot_cli.render({"mode": "trial", "trial": {"id": "ap-1", "estimate": -0.0123}})
    assert "estimate -1.23% (negative" in text


def test_the_client_takes_no_proxy_from_the_environment_and_follows_no_redirect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The token would go to $HTTPS_PROXY, or to wherever a redirect points."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with autopilot_cli.make_client("http://sidecar.example:9400") as c:
        assert c.trust_env is False and c.follow_redirects is False
        assert c._transport_for_url(c.base_url) is c._transport  # no proxy mounted for it


@pytest.mark.parametrize("trial_id", ["../thresholds", "a?b=1", "a/b", "", "-x", "a" * 65, "é"])
def test_approve_refuses_a_trial_id_that_is_not_one_before_any_request(
    trial_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_client(url: str) -> None:
        raise AssertionError("no request may be made")

    monkeypatch.setattr(autopilot_cli, "make_client", no_client)
    monkeypatch.setenv("FLYSERVE_SIDECAR_TOKEN", TOKEN)
    app = typer.Typer()
    autopilot_cli.register(app)
    got = CliRunner().invoke(app, ["approve", "--", trial_id])
    assert got.exit_code == 2 and "TRIAL_ID" in got.output, got.output


def test_the_url_comes_from_the_environment_as_for_top(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def record(url: str) -> httpx.Client:
        seen.append(url)
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(autopilot_cli, "make_client", record)
    monkeypatch.setenv("FLYSERVE_SIDECAR_URL", "http://sidecar.example:9401")
    app = typer.Typer()
    autopilot_cli.register(app)
    got = CliRunner().invoke(app, ["status"])
    assert got.exit_code == 2 and seen == ["http://sidecar.example:9401"]
