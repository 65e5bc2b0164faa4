"""The sidecar app in-process (TestClient): auth, If-Match, dry runs, 413/422, OpenAPI, SSE, rank staleness."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from flyserve.control import ControlPlane, StateDir
from flyserve.sidecar.app import create_app
from flyserve.sidecar.settings import SidecarSettings, TokenError, read_token
from flyserve.telemetry.shape_sample import ShapeSampleWriter, read_shape_samples

TOKEN = "t0ken-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_settings(state_dir: Path, **kw) -> SidecarSettings:
    return SidecarSettings(
        state_dir=state_dir,
        token=SecretStr(TOKEN),
        share_control_metrics=False,
        stats_ttl_s=0.0,
        metrics_ttl_s=0.0,
        **kw,
    )


@pytest.fixture
def client(tmp_path: Path):
    app = create_app(make_settings(tmp_path))
    with TestClient(app) as c:
        yield c


def write_rank(state: Path, rank: int, *, step: int, version: int, age_s: float = 0.0) -> None:
    d = state / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{rank}.json").write_text(
        json.dumps(
            {"pid": 1000 + rank, "rank": rank, "engine": 0, "step": step, "applied_version": version,
             "applied_step": 5, "circuit_open": False, "time": time.time() - age_s,
             "started": time.time() - age_s - 600}
        )
    )  # fmt: skip


# ----------------------------------------------------------------------------- auth


def test_mutations_need_a_valid_token(client: TestClient):
    r = client.patch("/thresholds", json={"min_seq_len": 2048})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = client.patch("/thresholds", json={"min_seq_len": 2048}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403
    r = client.post("/reload", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401
    assert client.get("/thresholds").json()["version"] == 0  # nothing changed


def test_no_token_configured_disables_mutations(tmp_path: Path):
    s = SidecarSettings(state_dir=tmp_path, share_control_metrics=False)
    with TestClient(create_app(s)) as c:
        r = c.patch("/thresholds", json={"min_seq_len": 2048}, headers=AUTH)
        assert r.status_code == 403 and "disabled" in r.json()["detail"]


def test_patch_applies_through_the_control_plane_with_audit(client: TestClient, tmp_path: Path):
    r = client.patch("/thresholds", json={"min_seq_len": 4096}, headers=AUTH | {"If-Match": '"0"'})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["changed"] and body["diff"] == {"min_seq_len": [1536, 4096]}
    assert body["thresholds"]["version"] == 1
    assert body["thresholds"]["differs_from_profile"]["min_seq_len"] == {
        "value": 4096, "default": 1536, "provenance": "override"
    }  # fmt: skip
    g = client.get("/thresholds")
    assert g.json()["values"]["min_seq_len"] == 4096 and g.headers["etag"] == '"1"'
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert (
        audit[-1]["actor"] == client.app.state.actor_id
        and TOKEN not in (tmp_path / "audit.jsonl").read_text()
    )
    # null drops the override again
    r = client.patch("/thresholds", json={"min_seq_len": None}, headers=AUTH)
    assert r.json()["thresholds"]["values"]["min_seq_len"] == 1536


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_if_match_mismatch_is_409_and_changes_nothing(client: TestClient):
    assert client.patch("/thresholds", json={"min_seq_len": 4096}, headers=AUTH).status_code == 200
    r = client.patch("/thresholds", json={"min_seq_len": 8192}, headers=AUTH | {"If-Match": "0"})
    assert r.status_code == 409 and r.json()["field"] == "If-Match"
    assert client.get("/thresholds").json()["values"]["min_seq_len"] == 4096
    r = client.patch("/thresholds", json={"min_seq_len": 8192}, headers=AUTH | {"If-Match": "abc"})
    assert r.status_code == 422 and r.json()["field"] == "If-Match"


@pytest.mark.slow  # 0.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"min_seq_len": "big"}, "min_seq_len"),
        ({"min_seq_len": -1}, "min_seq_len"),
        ({"block_m": 300}, "block_m"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"decode_path": "prefill"}, "decode_path"),
        ({"min_seq_len": 200000}, "min_seq_len"),  # > max_seq_len
    ],
)
def test_bad_values_are_422_naming_the_field(client: TestClient, body: dict, field: str):
    assert client.patch("/thresholds", json={"lpt": "never"}, headers=AUTH).status_code == 200
    r = client.patch("/thresholds", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and r.json()["errors"][0]["reason"]
    assert client.get("/thresholds").json()["version"] == 1  # running state never half-changed


def test_non_object_body_is_422(client: TestClient):
    r = client.put("/thresholds", json=[1, 2], headers=AUTH)
    assert r.status_code == 422 and r.json()["errors"]
    r = client.post("/thresholds/rollback", json={"version": "x"}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "version"


def test_body_size_limit_is_413(tmp_path: Path):
    with TestClient(create_app(make_settings(tmp_path, max_body_bytes=1024))) as c:
        big = json.dumps({"lpt": "auto", "pad": "x" * 5000})
        r = c.put("/thresholds", content=big, headers=AUTH | {"Content-Type": "application/json"})
        assert r.status_code == 413

        def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 500

        r = c.put("/thresholds", content=chunks(), headers=AUTH | {"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.get("/thresholds").json()["version"] == 0


def test_dry_run_reports_routing_change_and_applies_nothing(client: TestClient, tmp_path: Path):
    write_rank(tmp_path, 0, step=20, version=0)  # samples count only from live ranks
    w = ShapeSampleWriter(tmp_path, rank=0)
    for step in range(10):  # 8k-context prefill batches that the gfx950 profile admits
        w.add(step, [4096, 4096], 8192, 16)
    w.add(10, [1] * 8, 8192, 16)
    w.flush()
    r = client.patch(
        "/thresholds?dry_run=true", json={"min_seq_len": 16384}, headers=AUTH | {"If-Match": "0"}
    )
    assert r.status_code == 200, r.text
    b = r.json()
    assert b["dry_run"] and b["changed"] and b["diff"] == {"min_seq_len": [1536, 16384]}
    rc = b["routing_change"]
    assert rc["samples"] == 11 and rc["current"] == {"unified": 1, "prefill": 10}
    assert rc["proposed"] == {"unified": 11, "prefill": 0} and rc["changed"] == 10
    assert rc["transitions"] == {"prefill/admitted -> unified/short_context": 10}
    # nothing published, nothing audited as a change
    assert client.get("/thresholds").json()["version"] == 0
    assert not StateDir(tmp_path).current_json.exists()
    assert client.get("/thresholds/history").json()["entries"] == []


def test_rollback_and_history(client: TestClient):
    client.patch("/thresholds", json={"min_seq_len": 4096}, headers=AUTH)
    client.patch("/thresholds", json={"min_seq_len": 8192}, headers=AUTH)
    hist = client.get("/thresholds/history").json()["entries"]
    assert [e["version"] for e in hist] == [1, 2]
    r = client.post("/thresholds/rollback", json={"version": 1}, headers=AUTH | {"If-Match": "2"})
    assert r.status_code == 200, r.text
    assert r.json()["thresholds"]["values"]["min_seq_len"] == 4096
    assert r.json()["thresholds"]["source"] == "rollback"
    r = client.post("/thresholds/rollback", json={"version": 99}, headers=AUTH)
    assert r.status_code == 422 and r.json()["field"] == "version"


def test_reload_reads_the_config_file(tmp_path: Path):
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 3000\n")
    settings = make_settings(tmp_path / "state", config_file=cfg, watch_config=False)
    with TestClient(create_app(settings)) as c:
        r = c.post("/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        t = c.get("/thresholds").json()
        assert t["values"]["min_seq_len"] == 3000
        assert t["differs_from_profile"]["min_seq_len"]["provenance"] == "file"
        cfg.write_text("min_seq_len: 5000\n")
        r = c.post("/reload?dry_run=true", headers=AUTH | {"If-Match": "1"})
        assert r.status_code == 200 and r.json()["diff"] == {"min_seq_len": [3000, 5000]}
        assert c.get("/thresholds").json()["values"]["min_seq_len"] == 3000  # dry run: unchanged
        cfg.write_text("min_seq_len: [\n")
        r = c.post("/reload", headers=AUTH)
        assert r.status_code == 422 and "malformed" in r.json()["detail"]
        assert c.post("/reload", headers=AUTH | {"If-Match": "7"}).status_code == 409


@pytest.mark.slow  # 1.9 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_config_file_is_watched_without_a_reload_call(tmp_path: Path):
    """An edit of the operator's file reaches the published thresholds with no POST /reload, and a
    bad edit changes nothing (the running values stay, the invalid reload is audited)."""
    cfg = tmp_path / "cfg" / "flyserve.yaml"
    cfg.parent.mkdir()
    cfg.write_text("min_seq_len: 3000\n")
    settings = make_settings(tmp_path / "state", config_file=cfg, config_poll_s=0.2)

    def wait_for(pred, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            v = c.get("/thresholds").json()
            if pred(v):
                return v
            time.sleep(0.05)
        raise AssertionError(f"not reached in {timeout_s}s: {v}")

    with TestClient(create_app(settings)) as c:
        v = wait_for(lambda t: t["values"]["min_seq_len"] == 3000)
        assert v["source"] == "file"
        first = v["version"]
        cfg.write_text("min_seq_len: 4000\n")
        v = wait_for(lambda t: t["values"]["min_seq_len"] == 4000)
        assert v["version"] == first + 1
        cfg.write_text("min_seq_len: -1\n")  # invalid: nothing may change
        audit = tmp_path / "state" / "audit.jsonl"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and '"invalid"' not in audit.read_text():
            time.sleep(0.05)
        assert '"invalid"' in audit.read_text()
        v = c.get("/thresholds").json()
        assert (v["version"], v["values"]["min_seq_len"]) == (first + 1, 4000)


# ----------------------------------------------------------------------------- stats / ops


def test_dispatch_stats_ranks_agree_is_null_without_a_live_rank(client: TestClient, tmp_path: Path):
    """With 0 live ranks, ranks_agree is null, not true ("all is well")."""
    s = client.get("/dispatch-stats").json()
    assert (s["live_ranks"], s["ranks_agree"]) == (0, None)
    write_rank(tmp_path, 0, step=10, version=0, age_s=60)  # only a stale rank: still nobody live
    s = client.get("/dispatch-stats").json()
    assert (s["live_ranks"], s["ranks_agree"]) == (0, None)
    write_rank(tmp_path, 1, step=10, version=0)
    assert client.get("/dispatch-stats").json()["ranks_agree"] is True


def test_dispatch_stats_ranks_stale_and_agreement(client: TestClient, tmp_path: Path):
    write_rank(tmp_path, 0, step=50, version=1)
    write_rank(tmp_path, 1, step=50, version=1)
    write_rank(tmp_path, 2, step=10, version=0, age_s=60)  # silent for a minute: stale, not an error
    r = client.get("/dispatch-stats")
    assert r.status_code == 200, r.text
    s = r.json()
    by_rank = {v["rank"]: v for v in s["ranks"]}
    assert [by_rank[i]["stale"] for i in range(3)] == [False, False, True]
    assert s["live_ranks"] == 2 and s["ranks_agree"] is True  # the stale rank does not count
    assert set(s["windows"]) == {"60s", "300s", "900s"}
    assert s["thresholds"]["version"] == 0 and s["thresholds"]["sha256"]
    write_rank(tmp_path, 1, step=51, version=2)
    assert client.get("/dispatch-stats").json()["ranks_agree"] is False
    # a rank that applied a version late says so: per rank and in total
    report = json.loads((tmp_path / "ranks" / "1.json").read_text())
    (tmp_path / "ranks" / "1.json").write_text(json.dumps({**report, "late_applies": 2}))
    client.app.state.stats.invalidate()
    s = client.get("/dispatch-stats").json()
    assert s["late_applies"] == 2 and {v["rank"]: v["late_applies"] for v in s["ranks"]}[1] == 2
    (tmp_path / "ranks" / "3.json").write_text("{torn")  # a half-written file is skipped
    assert client.get("/dispatch-stats").status_code == 200


def test_readyz_needs_a_live_rank(client: TestClient, tmp_path: Path):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["detail"] == "no live rank"
    write_rank(tmp_path, 0, step=1, version=0)
    assert client.get("/readyz").status_code == 200


def test_metrics_has_sidecar_and_rank_gauges(client: TestClient, tmp_path: Path):
    write_rank(tmp_path, 0, step=1, version=0)
    client.get("/dispatch-stats")
    text = client.get("/metrics").text
    assert 'flyserve_sidecar_requests_total{code="200",method="GET",route="/dispatch-stats"}' in text
    assert "flyserve_sidecar_request_seconds_bucket" in text
    assert 'flyserve_rank_up{rank="0"} 1.0' in text
    assert "flyserve_ranks_agree 1.0" in text


@pytest.mark.slow  # 1.1 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_sse_stream_sends_the_payload(client: TestClient):
    with client.stream("GET", "/dispatch-stats/stream?interval=0.05&max_events=3") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert len(events) == 3
    assert "totals" in json.loads(events[0][len("data: ") :])


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_openapi_security_only_on_mutations(client: TestClient):
    spec = client.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            mutating = method in ("put", "patch", "post")
            assert bool(op.get("security")) == mutating, (method, path)
    assert "DispatchStats" in spec["components"]["schemas"]


# ----------------------------------------------------------------------------- settings, shapes


def test_read_token_sources(tmp_path: Path):
    f = tmp_path / "tok"
    f.write_text(TOKEN + "\n")
    os.chmod(f, 0o600)
    assert read_token(f, env={}).get_secret_value() == TOKEN
    assert read_token(None, env={"FLYSERVE_SIDECAR_TOKEN": TOKEN}).get_secret_value() == TOKEN
    assert read_token(None, env={}) is None
    f.write_text("short")
    with pytest.raises(TokenError, match="at least"):
        read_token(f, env={})
    with pytest.raises(TokenError, match="cannot read"):
        read_token(tmp_path / "missing", env={})


def test_shape_samples_round_trip_and_dedup(tmp_path: Path):
    for rank in (0, 1):  # two TP ranks sample the same steps
        w = ShapeSampleWriter(tmp_path, rank=rank, capacity=4)
        for step in range(6):
            w.add(step, [1, 2, 3], 100 + step, 16)
        w.flush()
    got = read_shape_samples(tmp_path, limit=100)
    assert [s.step for s in got] == [5, 4, 3, 2]  # capacity 4, deduplicated across ranks, newest first
    assert got[0].query_lens == (1, 2, 3) and got[0].max_seq_len == 105
    (tmp_path / "shapes" / "0-0.jsonl").write_text('{"bad": 1}\nnot json\n')
    assert len(read_shape_samples(tmp_path, limit=100)) == 4


def test_control_plane_is_the_one_writing(tmp_path: Path):
    """A change made by the CLI's control plane is what the sidecar shows (one source of truth)."""
    ControlPlane(tmp_path).apply_overrides({"lpt": "never"}, actor="cli-test", source="cli")
    with TestClient(create_app(make_settings(tmp_path))) as c:
        t = c.get("/thresholds").json()
    assert t["values"]["lpt"] == "never" and t["source"] == "cli" and t["actor"] == "cli-test"


def test_ttl_cache_serves_stale_while_one_caller_refreshes():
    import threading

    from flyserve.sidecar.cache import TtlCache

    now = [0.0]
    calls = []
    gate = threading.Event()

    def compute():
        calls.append(now[0])
        if len(calls) == 2:
            gate.wait(5)  # the refresh is slow
        return len(calls)

    c = TtlCache(compute, 1.0, clock=lambda: now[0])
    assert c.get() == 1 and c.get() == 1 and calls == [0.0]
    now[0] = 2.0  # stale
    t = threading.Thread(target=c.get)
    t.start()
    while len(calls) < 2:
        time.sleep(0.01)
    assert c.get() == 1  # another caller is refreshing: the stale value, at once
    gate.set()
    t.join(5)
    assert c.get() == 2
    c.invalidate()
    assert c.get() == 3
    assert TtlCache(compute, 0.0).get() == 4  # TTL 0: always computed


def test_ttl_cache_serves_a_late_refreshers_value_instead_of_computing_in_the_request():
    """With a background refresher running late (a busy machine), a request that finds the value
    just past its TTL gets it at once (requests paying the computation set the p99 of
    /dispatch-stats with 64 ranks); past max_stale_s, or with no refresher, it computes."""
    from flyserve.sidecar.cache import TtlCache

    now = [0.0]
    calls: list[float] = []

    def compute():
        calls.append(now[0])
        return len(calls)

    c = TtlCache(compute, 0.5, clock=lambda: now[0], max_stale_s=2.5)
    assert c.get() == 1
    now[0] = 1.0  # past the TTL, no refresher ever ran: computed as before
    assert c.get() == 2
    c.refresh_if_used(idle_s=30.0)  # the refresher: 0.0 s old (< TTL / 2), so it does not compute
    assert calls == [0.0, 1.0]
    now[0] = 2.0  # 1 s old, the refresher seen 1 s ago: served, not computed
    assert c.get() == 2 and calls == [0.0, 1.0]
    assert c.refresh_if_used(idle_s=30.0) and c.get() == 3  # the refresher computes it
    now[0] = 6.0  # the refresher stopped 4 s ago: the request computes
    assert c.get() == 4
