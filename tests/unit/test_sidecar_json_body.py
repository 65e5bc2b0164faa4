"""A 5000-digit number or 5000-deep nesting in any JSON body is a 400/422 naming
the field (or the body) and the reason, never the value, never a 500 or a RecursionError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from flyserve.sidecar.app import create_app
from flyserve.sidecar.json_body import KEY_PLACEHOLDER, MAX_DEPTH, check_json_body
from flyserve.sidecar.settings import SidecarSettings

TOKEN = "t0ken-for-tests-0123456789"
JSON_AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
DIGITS = b"9" * 5000


def test_a_long_integer_is_refused_naming_its_field() -> None:
    r = check_json_body(b'{"min_seq_len": ' + DIGITS + b"}")
    assert r is not None and r.status == 422 and r.field == "min_seq_len"
    assert "number too long" in r.detail and "9999" not in r.detail


def test_a_long_number_deep_inside_is_named_by_its_path() -> None:
    r = check_json_body(b'{"a": {"b": [1, 2, -' + DIGITS + b"]}}")
    assert r is not None and r.field == "a.b[2]", r
    r = check_json_body(b'{"x": 1.' + DIGITS + b"}")
    assert r is not None and r.field == "x" and "number too long" in r.detail


def test_deep_nesting_is_refused_naming_the_body() -> None:
    for depth in (MAX_DEPTH + 1, 900, 5000, 200_000):
        r = check_json_body(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
        assert r is not None and r.status == 400 and r.field == "<body>", depth
        assert "nesting too deep" in r.detail


def test_ordinary_bodies_pass() -> None:
    assert check_json_body(b'{"min_seq_len": 2048, "lpt": "auto", "x": [1.5, null, {"y": true}]}') is None
    assert check_json_body(b"") is None
    assert check_json_body(b'{"v": ' + b"9" * 20 + b"}") is None


@pytest.fixture
def client(tmp_path: Path):
    settings = SidecarSettings(
        state_dir=tmp_path,
        token=SecretStr(TOKEN),
        share_control_metrics=False,
        stats_ttl_s=0.0,
        metrics_ttl_s=0.0,
    )
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize(
    ("method", "path"),
    [("PATCH", "/thresholds"), ("PUT", "/thresholds"), ("POST", "/thresholds/rollback")],
)
def test_every_json_endpoint_names_the_field_of_a_5000_digit_number(
    client: TestClient, method: str, path: str
) -> None:
    key = b"version" if path.endswith("rollback") else b"min_seq_len"
    r = client.request(method, path, content=b'{"' + key + b'": ' + DIGITS + b"}", headers=JSON_AUTH)
    assert r.status_code == 422, (r.status_code, r.text[:300])
    body = r.json()
    assert body["field"] == key.decode() and "number too long" in body["detail"]
    assert "99999" not in r.text and len(r.text) < 1000


@pytest.mark.parametrize(
    ("method", "path"),
    [("PATCH", "/thresholds"), ("PUT", "/thresholds"), ("POST", "/thresholds/rollback")],
)
def test_every_json_endpoint_refuses_5000_deep_nesting(client: TestClient, method: str, path: str) -> None:
    r = client.request(method, path, content=b"[" * 5000 + b"]" * 5000, headers=JSON_AUTH)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["field"] == "<body>" and "nesting too deep" in r.json()["detail"]


def test_a_known_field_given_twice_is_named() -> None:
    r = check_json_body(b'{"min_seq_len": 1, "min_seq_len": 2}')
    assert r is not None and r.status == 422 and r.field == "min_seq_len"
    assert "more than once" in r.detail


@pytest.mark.parametrize(
    "key",
    [
        "x" * 40,  # an identifier, but longer than 32 characters
        "<script>alert(1)</script>",
        "secret token=abc",
        "9starts_with_a_digit",
        "caf\u00e9",
        "",
    ],
)
def test_a_key_that_is_not_a_short_identifier_is_never_echoed(key: str) -> None:
    """The body is unauthenticated: a duplicate key or a key on the path to a too-long number was
    quoted back (up to 64 characters a level). Now it is `<key>`; known field names still appear."""
    k = json.dumps(key).encode()
    dup = check_json_body(b"{" + k + b": 1, " + k + b": 2}")
    assert dup is not None and dup.status == 422 and dup.field == "<key>"
    assert f"'{KEY_PLACEHOLDER}'" in dup.detail
    long = check_json_body(b'{"a": {' + k + b": [" + DIGITS + b"]}}")
    assert long is not None and long.status == 422 and long.field == "a.<key>[0]", long
    for r in (dup, long):
        if key:
            assert key not in r.detail and key not in r.field
