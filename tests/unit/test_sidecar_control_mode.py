"""/dispatch-stats says which mode brings versions to the ranks: "engine channel" or "file polling"."""

from __future__ import annotations

import json
import time
from pathlib import Path

from fastapi.testclient import TestClient
from pydantic import SecretStr

from flyserve.sidecar.app import create_app
from flyserve.sidecar.settings import SidecarSettings


def write_rank(state: Path, rank: int, mode: object, *, age_s: float = 0.0) -> None:
    d = state / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    doc = {"pid": 1000 + rank, "rank": rank, "engine": 0, "step": 10, "applied_version": 1,
           "applied_step": 5, "circuit_open": False, "control_mode": mode, "time": time.time() - age_s,
           "started": time.time() - age_s - 600}  # fmt: skip
    (d / f"{rank}.json").write_text(json.dumps(doc))


def stats(state: Path) -> dict:
    settings = SidecarSettings(
        state_dir=state,
        token=SecretStr("t0ken-for-tests-0123456789"),
        share_control_metrics=False,
        stats_ttl_s=0.0,
        metrics_ttl_s=0.0,
    )
    with TestClient(create_app(settings)) as c:
        r = c.get("/dispatch-stats")
        assert r.status_code == 200
        return r.json()


def test_control_mode_of_the_live_ranks(tmp_path: Path) -> None:
    assert stats(tmp_path)["control_mode"] is None  # no rank yet
    write_rank(tmp_path, 0, "engine channel")
    write_rank(tmp_path, 1, "engine channel")
    write_rank(tmp_path, 2, "file polling", age_s=3600)  # stale: a previous run's leftover
    got = stats(tmp_path)
    assert got["control_mode"] == "engine channel"
    assert [r["control_mode"] for r in got["ranks"]] == ["engine channel", "engine channel", "file polling"]
    write_rank(tmp_path, 1, "file polling")  # one rank never switched: visible, not averaged away
    assert stats(tmp_path)["control_mode"] == "mixed"


def test_an_unknown_mode_in_a_report_is_not_echoed(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, "<script>" + "x" * 10_000)
    write_rank(tmp_path, 1, ["file polling"])
    got = stats(tmp_path)
    assert [r["control_mode"] for r in got["ranks"]] == [None, None]
    assert got["control_mode"] is None
    write_rank(tmp_path, 2, "file polling")  # a report from before this field: older ranks
    assert stats(tmp_path)["control_mode"] == "file polling"
