"""The actor id shown on unauthenticated GET /thresholds must not be checkable
offline against a token guess (it was the first 8 hex of sha256(token))."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from flyserve.control import ControlPlane
from flyserve.sidecar.actor import (
    ActorNameError,
    check_actor_name,
    key_path,
    load_or_create_key,
    token_actor_id,
)
from flyserve.sidecar.app import create_app
from flyserve.sidecar.settings import SidecarSettings

TOKEN = "t0ken-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _app(state: Path, **kw) -> TestClient:
    s = SidecarSettings(
        state_dir=state,
        token=SecretStr(TOKEN),
        share_control_metrics=False,
        stats_ttl_s=0.0,
        metrics_ttl_s=0.0,
        **kw,
    )
    return TestClient(create_app(s))


def test_get_thresholds_shows_no_plain_hash_of_the_token(tmp_path: Path) -> None:
    with _app(tmp_path) as c:
        assert c.patch("/thresholds", json={"min_seq_len": 4096}, headers=AUTH).status_code == 200
        actor = c.get("/thresholds").json()["actor"]
    plain = hashlib.sha256(TOKEN.encode()).hexdigest()
    assert actor.startswith("token-hmac:")
    assert plain[:8] not in actor and plain[:16] not in actor
    # The id depends on a key kept in the state directory, 0600: without it a guess cannot be checked.
    key = key_path(tmp_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert actor == token_actor_id(TOKEN, bytes.fromhex(key.read_text().strip()))
    assert actor != token_actor_id(TOKEN, os.urandom(32))


def test_the_key_is_made_once_and_ids_stay_stable_across_restarts(tmp_path: Path) -> None:
    with _app(tmp_path) as c:
        first = c.app.state.actor_id
    key = key_path(tmp_path).read_text()
    with _app(tmp_path) as c:
        assert c.app.state.actor_id == first
    assert key_path(tmp_path).read_text() == key


def test_an_operator_name_replaces_the_hash(tmp_path: Path) -> None:
    with _app(tmp_path, actor_name="ops-oncall") as c:
        assert c.patch("/thresholds", json={"min_seq_len": 4096}, headers=AUTH).status_code == 200
        assert c.get("/thresholds").json()["actor"] == "ops-oncall"
    audit = [json.loads(ln) for ln in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert audit[-1]["actor"] == "ops-oncall"
    with pytest.raises(ActorNameError) as e:
        check_actor_name("x" * 65 + "\n")
    assert "xxxx" not in str(e.value)


def test_old_audit_entries_keep_their_ids(tmp_path: Path) -> None:
    """A version written before (``token:<8 hex>``) keeps its id in history and audit next to new ones."""
    ControlPlane(tmp_path).apply_overrides({"min_seq_len": 2048}, actor="token:1a2b3c4d")
    with _app(tmp_path) as c:
        assert c.patch("/thresholds", json={"min_seq_len": 4096}, headers=AUTH).status_code == 200
        entries = c.get("/thresholds/history").json()["entries"]
        new = c.app.state.actor_id
    assert [e["actor"] for e in entries[-2:]] == ["token:1a2b3c4d", new]
    audit = [json.loads(ln) for ln in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert {"token:1a2b3c4d", new} <= {e.get("actor") for e in audit}


@pytest.mark.parametrize("kind", ["symlink", "fifo", "garbage"])
def test_an_unusable_key_file_is_never_followed_or_waited_on(tmp_path: Path, kind: str) -> None:
    path = key_path(tmp_path)
    path.parent.mkdir(parents=True)
    if kind == "symlink":
        (tmp_path / "elsewhere").write_text("00" * 32)
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("not hex")
    a, b = load_or_create_key(tmp_path), load_or_create_key(tmp_path)
    assert len(a) == 32 and a != b and a != bytes(32)  # a key for this run only, never the file's
