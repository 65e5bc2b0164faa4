"""Stray history file names (non-ASCII digits, 20- and 30-digit numbers) against the real sidecar
(uvicorn subprocess on 127.0.0.1): they must not stop it starting nor push versions out of the
range If-Match and rollback accept."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_sidecar_attacks_live import AUTH, start_sidecar

from flyserve.control import ControlPlane

pytestmark = pytest.mark.integration


def test_stray_history_names_neither_stop_the_sidecar_nor_move_versions(
    tmp_path: Path, stopper: list
) -> None:
    state = tmp_path / "state"
    ControlPlane(state).apply_overrides({"min_seq_len": 2048}, actor="a")
    hist = state / "control" / "history"
    for name in ("²³.json", "٣٣.json", "99999999999999999999.json", "1" * 30 + ".json"):
        (hist / name).touch()
    sc = start_sidecar(tmp_path)  # repair at start raised ValueError on '²³.json': it never came up
    stopper.append(sc)
    with httpx.Client(base_url=sc.url, timeout=30) as c:
        assert c.get("/thresholds/history").status_code == 200  # was 500
        r = c.patch("/thresholds", json={"min_seq_len": 3000}, headers={**AUTH, "If-Match": '"1"'})
        assert r.status_code == 200 and r.json()["thresholds"]["version"] == 2  # was 34 or 10^20
        r = c.patch("/thresholds", json={"min_seq_len": 3001}, headers={**AUTH, "If-Match": '"2"'})
        assert r.status_code == 200 and r.json()["thresholds"]["version"] == 3  # If-Match was a 422
        r = c.post("/thresholds/rollback", json={"version": 1}, headers=AUTH)
        assert r.status_code == 200, r.text
    assert not (hist / "²³.json").exists() and (hist / "²³.json.stray").exists()  # set aside at start
