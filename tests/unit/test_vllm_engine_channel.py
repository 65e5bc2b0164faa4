"""The engine channel without a vLLM engine: RankControl.apply_pushed, the worker method's input
checks, and the ChannelPusher driving in-process "workers" (each a RankControl stepping in lock step)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _support import require_module

from flyserve.control import ControlPlane, RankControl
from flyserve.control.rank_modes import ENGINE_CHANNEL, FILE_POLLING
from flyserve.policy.thresholds import ThresholdsError
from flyserve.vllm import channel_pusher, endpoint_plugin
from flyserve.vllm.channel_pusher import ChannelPusher, pushes_path, status_path
from flyserve.vllm.engine_channel import MAX_DOCS, METHOD, _from_step, parse_doc, parse_docs


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="cpu-tiny", step_margin=8, lead_s=0.0)
    p.reload(actor="startup", startup=True)
    return p


# ---------------------------------------------------------------------- RankControl.apply_pushed


def test_a_pushed_version_applies_from_the_next_step_and_a_lower_one_is_refused(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    for step in range(1, 11):
        rc.current(step)
    assert rc.mode == FILE_POLLING
    v2 = plane.apply_overrides({"min_seq_len": 1024}, actor="a").snapshot
    v3 = plane.apply_overrides({"min_seq_len": 3000}, actor="a").snapshot
    assert rc.apply_pushed(v3) == (True, "applied")
    assert rc.mode == ENGINE_CHANNEL
    assert rc.snapshot.version == 3 and rc.snapshot.effective_step == 11 and rc.applied_step == 11
    assert rc.snapshot.step_for(rc.engine) == 11 and rc.report_dict()["effective_step"] == 11
    assert rc.applied[-1] == (3, 11, 11)
    assert rc.current(11).thresholds.min_seq_len == 3000
    assert rc.apply_pushed(v2) == (False, "lower version")
    assert rc.apply_pushed(v3) == (False, "already applied")
    forged = v3.replace(overrides={"min_seq_len": 7})  # same version number, other content
    assert rc.apply_pushed(forged) == (False, "same version, other content")
    assert rc.current(12).version == 3 and rc.current(12).thresholds.min_seq_len == 3000
    assert rc.report_dict()["control_mode"] == ENGINE_CHANNEL


def test_switching_to_the_channel_drops_queued_file_versions_and_stops_the_file_poll(
    plane: ControlPlane,
) -> None:
    rc = RankControl(plane.state_dir, 0, report=False)
    rc.current(1)
    plane.store.write_rank_report({"rank": 9, "step": 1, "time": 0.0 + __import__("time").time()}, rank=9)
    plane.apply_overrides({"min_seq_len": 1024}, actor="a")  # effective at step 9 by the file path
    rc.poll()
    assert rc._pending and rc._pending[0].version == 2
    assert rc.apply_pushed(None) == (False, "switched")
    assert not rc._pending
    assert [rc.current(s).version for s in range(2, 20)] == [1] * 18  # the queued v2 never applies
    plane.apply_overrides({"min_seq_len": 3000}, actor="a")
    rc.poll()  # a poll in channel mode reads nothing and queues nothing
    assert not rc._pending and rc.current(30).version == 1
    assert rc.report_dict()["control_mode"] == ENGINE_CHANNEL


# ---------------------------------------------------------------------- the worker method's input


def test_parse_doc_verifies_the_pushed_snapshot(plane: ControlPlane) -> None:
    snap = plane.snapshot()
    assert parse_doc(snap.to_json()) == snap
    assert parse_doc(None) is None
    tampered = json.loads(snap.to_json())
    tampered["thresholds"]["min_seq_len"] = 1
    with pytest.raises(ThresholdsError) as e:
        parse_doc(json.dumps(tampered))
    assert e.value.field == "sha256"
    for bad in ("{not json", "[1, 2]", "x" * (65 << 10), 17):
        with pytest.raises(ThresholdsError) as e:
            parse_doc(bad)  # type: ignore[arg-type]
        assert e.value.field == "<snapshot>" and len(str(e.value)) < 400


def test_parse_docs_takes_all_or_nothing(plane: ControlPlane) -> None:
    good = plane.snapshot().to_json()
    assert parse_docs(None) == [] and parse_docs([]) == []
    assert [s.version for s in parse_docs([good, good])] == [1, 1]
    with pytest.raises(ThresholdsError):
        parse_docs([good, "{torn"])  # one bad document: none is returned, so none is applied
    for bad in (good, [good] * (MAX_DOCS + 1), {"a": good}):
        with pytest.raises(ThresholdsError) as e:
            parse_docs(bad)  # type: ignore[arg-type]
        assert e.value.field == "<snapshots>"


def test_the_worker_method_applies_in_order_and_a_bad_push_changes_nothing(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flyserve.vllm import engine_channel
    from flyserve.vllm.runtime import RankRuntime

    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    rt = RankRuntime(state_dir=plane.state_dir.path, rank=1, start=False, setup_metrics=False)
    monkeypatch.setattr(RankRuntime, "_instance", rt)
    for step in range(1, 6):
        rt.control.current(step)
    v2 = plane.apply_overrides({"min_seq_len": 200}, actor="a").snapshot
    v3 = plane.apply_overrides({"min_seq_len": 300}, actor="a").snapshot
    bad = engine_channel._worker_method(object(), [v2.to_json(), "{torn"])
    assert bad["why"] == "invalid" and bad["results"] == [] and len(bad["error"]) <= 300
    assert rt.control.snapshot.version == 1 and rt.control.mode == FILE_POLLING  # nothing changed
    ok = engine_channel._worker_method(object(), [v2.to_json(), v3.to_json()])
    assert (ok["rank"], ok["step"], ok["version"]) == (1, 5, 3)
    assert ok["results"] == [
        {"version": 2, "applied": True, "why": "applied", "from_step": 6},
        {"version": 3, "applied": True, "why": "applied", "from_step": 6},
    ]
    assert rt.control.mode == ENGINE_CHANNEL and rt.control.current(6).thresholds.min_seq_len == 300
    again = engine_channel._worker_method(object(), [v2.to_json()])
    assert again["results"] == [{"version": 2, "applied": False, "why": "lower version", "from_step": 6}]
    rt.control.current(7)
    repeat = engine_channel._worker_method(object(), [v3.to_json()])  # a retried push: the step it applied at
    assert repeat["results"] == [{"version": 3, "applied": False, "why": "already applied", "from_step": 6}]
    assert rt.control.current(7).version == 3


@pytest.mark.slow  # importing vLLM runs `uname -p` (its platform probe)
def test_install_adds_the_method_vllm_resolves_on_every_worker() -> None:
    require_module("vllm")
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from flyserve.vllm import engine_channel

    assert engine_channel.install() is True
    assert engine_channel.install() is True  # idempotent
    assert getattr(WorkerWrapperBase, METHOD) is engine_channel._worker_method


# ---------------------------------------------------------------------- the pusher


class Workers:
    """N ranks of one engine, stepping together; rpc() runs the push on each, as vLLM does between
    two steps, and answers with each rank's step."""

    def __init__(self, plane: ControlPlane, n: int = 2) -> None:
        self.ranks = [RankControl(plane.state_dir, r, report=False) for r in range(n)]
        self.step = 0
        self.calls: list[str | None] = []
        self.fail_next = 0

    def advance(self, k: int = 1) -> None:
        for _ in range(k):
            self.step += 1
            for rc in self.ranks:
                rc.current(self.step)

    async def rpc(self, method: str, docs: list[str]) -> list[dict[str, Any]]:
        assert method == METHOD
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("engine busy")
        self.calls.append(list(docs))
        snaps = parse_docs(docs)
        out = []
        for rc in self.ranks:
            results = []
            if not snaps:
                rc.apply_pushed(None)
            for snap in snaps:
                applied, why = rc.apply_pushed(snap)
                results.append({"version": snap.version, "applied": applied, "why": why,
                                "from_step": _from_step(rc, snap.version)})  # fmt: skip
            out.append({"rank": rc.rank, "engine": rc.engine, "pid": 1, "step": rc.step,
                        "version": rc.snapshot.version, "results": results})  # fmt: skip
        return out


def test_pusher_attaches_then_pushes_every_version_in_order(plane: ControlPlane) -> None:
    w = Workers(plane)
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    w.advance(5)
    assert asyncio.run(pusher.sync_once()) == 1  # attach: the current version, already applied
    assert all(rc.mode == ENGINE_CHANNEL for rc in w.ranks) and pusher.pushed_version == 1
    assert asyncio.run(pusher.sync_once()) == 0 and len(w.calls) == 1  # nothing new: no RPC
    for v in (200, 300, 400):  # three versions between two rounds: none may be skipped
        plane.apply_overrides({"min_seq_len": v}, actor="a")
    w.advance(3)
    assert asyncio.run(pusher.sync_once()) == 3
    assert len(w.calls) == 2, "what piled up goes in one RPC"
    assert [json.loads(d)["version"] for d in w.calls[1]] == [2, 3, 4]
    assert [rc.applied[-3:] for rc in w.ranks] == [[(2, 9, 9), (3, 9, 9), (4, 9, 9)]] * 2
    w.advance(1)
    assert {rc.snapshot.thresholds.min_seq_len for rc in w.ranks} == {400}
    lines = [json.loads(x) for x in pushes_path(plane.state_dir).read_text().splitlines()]
    assert [(x["version"], x["same_step"]) for x in lines] == [(1, True), (2, True), (3, True), (4, True)]
    assert [a["step"] for a in lines[-1]["answers"]] == [8, 8]
    status = json.loads(status_path(plane.state_dir).read_text())
    assert status["mode"] == ENGINE_CHANNEL and status["pushed_version"] == 4 and status["split_steps"] == 0


def test_pusher_with_nothing_published_switches_the_workers_only(tmp_path: Path) -> None:
    plane = ControlPlane(tmp_path / "empty", profile="cpu-tiny")
    w = Workers(plane)
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    assert asyncio.run(pusher.sync_once()) == 0
    assert w.calls == [[]] and all(rc.mode == ENGINE_CHANNEL for rc in w.ranks)
    plane.reload(actor="startup", startup=True)
    assert asyncio.run(pusher.sync_once()) == 1 and {rc.snapshot.version for rc in w.ranks} == {1}


def test_a_split_step_is_counted_and_logged(plane: ControlPlane, caplog: pytest.LogCaptureFixture) -> None:
    w = Workers(plane)
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    asyncio.run(pusher.sync_once())
    w.ranks[1].current(w.step + 1)  # rank 1 one step ahead: what an unordered executor could cause
    plane.apply_overrides({"min_seq_len": 200}, actor="a")
    asyncio.run(pusher.sync_once())
    assert pusher.split_steps == 1 and pusher.last is not None and not pusher.last.same_step
    assert "different steps" in caplog.text


def test_a_failed_push_is_retried_and_a_refusing_worker_is_an_error(plane: ControlPlane) -> None:
    w = Workers(plane)
    pusher = ChannelPusher(plane.state_dir, w.rpc, poll_s=0.01)
    asyncio.run(pusher.sync_once())
    plane.apply_overrides({"min_seq_len": 200}, actor="a")
    w.fail_next = 2

    async def run_until_pushed() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(pusher.run(stop))
        for _ in range(500):  # bounded: 2 failures, back-off 0.02 + 0.04 s, then the push
            if pusher.pushed_version == 2:
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(run_until_pushed())
    assert pusher.pushed_version == 2 and pusher.errors == 2 and "engine busy" in pusher.last_error
    assert {rc.snapshot.version for rc in w.ranks} == {2}

    async def refusing(method: str, docs: list[str]) -> list[dict[str, Any]]:
        return [{"rank": 0, "step": 3, "why": "invalid", "error": "field 'sha256': mismatch" + "x" * 5000}]

    plane.apply_overrides({"min_seq_len": 3000}, actor="a")
    bad = ChannelPusher(plane.state_dir, refusing)
    with pytest.raises(RuntimeError, match="refused") as e:
        asyncio.run(bad.sync_once())
    assert len(str(e.value)) < 600 and bad.pushed_version == -1


def test_poll_interval_must_be_positive(plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        ChannelPusher(plane.state_dir, Workers(plane).rpc, poll_s=0)
    monkeypatch.setenv(endpoint_plugin.POLL_ENV, "soon")
    with pytest.raises(ValueError, match=endpoint_plugin.POLL_ENV):
        endpoint_plugin.poll_interval()
    monkeypatch.setenv(endpoint_plugin.POLL_ENV, "-1")
    with pytest.raises(ValueError, match=endpoint_plugin.POLL_ENV):
        endpoint_plugin.poll_interval()
    monkeypatch.setenv(endpoint_plugin.POLL_ENV, "0.2")
    assert endpoint_plugin.poll_interval() == 0.2
    monkeypatch.delenv(endpoint_plugin.POLL_ENV)
    assert endpoint_plugin.poll_interval() == channel_pusher.DEFAULT_POLL_S


# ---------------------------------------------------------------------- the endpoint plugin


@pytest.mark.slow  # the plugin imports vLLM (6 s on the 2-core VM)
def test_endpoint_plugin_attaches_before_init_state_returns(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flyserve")
    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(plane.state_dir.path))
    w = Workers(plane)

    class EngineClient:
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            assert timeout is None  # a timed-out RPC leaves its late answer on vLLM's queue
            return await w.rpc(method, *args)

    async def scenario() -> None:
        p = endpoint_plugin.plugin()
        state = SimpleNamespace()
        await p.init_state(EngineClient(), state, SimpleNamespace(distributed_executor_backend="ray"))
        assert all(rc.mode == ENGINE_CHANNEL for rc in w.ranks)  # attached before serving starts
        assert state.flyserve_channel is p.pusher and p.task is not None
        plane.apply_overrides({"min_seq_len": 200}, actor="a")
        for _ in range(1000):
            if p.pusher.pushed_version == 2:
                break
            await asyncio.sleep(0.01)
        p.stop.set()
        await asyncio.wait_for(p.task, 10)

    asyncio.run(scenario())
    assert {rc.snapshot.version for rc in w.ranks} == {2}
    assert "mode engine channel" in caplog.text  # Ray with RayExecutorV2 (0.32's default) keeps the channel

    async def legacy_ray() -> None:
        monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
        monkeypatch.setattr(endpoint_plugin, "_vllm_version", lambda: "0.32.0+cpu")
        p = endpoint_plugin.plugin()
        state = SimpleNamespace()
        await p.init_state(EngineClient(), state, SimpleNamespace(distributed_executor_backend="ray"))
        assert p.task is None and p.pusher is None and not hasattr(state, "flyserve_channel")

    calls = len(w.calls)
    asyncio.run(legacy_ray())
    assert len(w.calls) == calls  # nothing pushed
    assert "NOT started: executor RayDistributedExecutor" in caplog.text

    async def no_engine() -> None:
        p = endpoint_plugin.plugin()
        await p.init_state(None, SimpleNamespace(), SimpleNamespace())
        assert p.task is None

    asyncio.run(no_engine())


def test_endpoint_entry_point_is_declared() -> None:
    import importlib.metadata

    eps = importlib.metadata.entry_points(group="vllm.endpoint_plugins")
    assert any(
        ep.name == "flyserve-endpoint" and ep.value == "flyserve.vllm.endpoint_plugin:plugin" for ep in eps
    )
    p = endpoint_plugin.plugin()
    assert p.name == "flyserve-endpoint" and p.required_tasks is None


def test_flyserve_routes_in_vllms_server_are_opt_in_and_keep_the_auth(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(plane.state_dir.path))
    monkeypatch.setenv("FLYSERVE_PROFILE", "cpu-tiny")
    monkeypatch.delenv(endpoint_plugin.ROUTES_ENV, raising=False)
    off = FastAPI()
    endpoint_plugin.plugin().attach_router(off)
    assert TestClient(off).get("/flyserve/dispatch-stats").status_code == 404

    token = "t0ken-for-tests-0123456789"
    monkeypatch.setenv(endpoint_plugin.ROUTES_ENV, "1")
    monkeypatch.setenv("FLYSERVE_SIDECAR_TOKEN", token)
    app = FastAPI()
    p = endpoint_plugin.plugin()
    p.attach_router(app)
    asyncio.run(p.init_state(None, SimpleNamespace(), SimpleNamespace()))  # no engine: routes only
    try:
        c = TestClient(app)
        r = c.get("/flyserve/dispatch-stats")
        assert r.status_code == 200 and r.json()["thresholds"]["version"] == 1
        assert c.patch("/flyserve/thresholds", json={"min_seq_len": 200}).status_code == 401
        bad = c.patch(
            "/flyserve/thresholds", json={"min_seq_len": 200}, headers={"Authorization": "Bearer x"}
        )
        assert bad.status_code == 403 and token not in bad.text
        ok = c.patch(
            "/flyserve/thresholds", json={"min_seq_len": 200}, headers={"Authorization": f"Bearer {token}"}
        )
        assert ok.status_code == 200, ok.text
        assert plane.snapshot().version == 2 and plane.snapshot().thresholds.min_seq_len == 200
        assert (
            c.patch(
                "/flyserve/thresholds", json={"min_seq_len": -1}, headers={"Authorization": f"Bearer {token}"}
            ).json()["field"]
            == "min_seq_len"
        )
    finally:
        p.routes_app.state.stats.stop()


def test_the_pusher_ends_a_trial_whose_lease_expired_and_pushes_that_at_one_step(plane: ControlPlane) -> None:
    """With the engine channel the ranks do not read the store: the pusher keeps the autopilot's
    lease (control.trial_lease). A trial whose sidecar is gone is published again without the
    trial, and the next round pushes that to every worker at one step."""
    from flyserve.control.snapshot import Trial
    from flyserve.control.trial_lease import ACTOR, write_lease

    w = Workers(plane)
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    asyncio.run(pusher.sync_once())
    cur = plane.snapshot()
    candidate = cur.thresholds.merged({"min_seq_len": cur.thresholds.min_seq_len + 512})
    plane.publish_autopilot(cur.thresholds, trial=Trial("ap-1-1", 3, 4, 20, candidate), request={})
    write_lease(plane.state_dir, "ap-1-1", now=time.time())
    w.advance(2)
    asyncio.run(pusher.sync_once())
    assert all(rc.snapshot.trial is not None for rc in w.ranks)
    assert pusher.end_trial_if_lease_expired() is None  # renewed just now
    write_lease(plane.state_dir, "ap-1-1", now=time.time() - 60, ttl_s=10.0)  # the sidecar went away
    ended = pusher.end_trial_if_lease_expired()
    assert ended == 3 and plane.snapshot().trial is None and plane.snapshot().actor == ACTOR
    w.advance(1)
    assert asyncio.run(pusher.sync_once()) == 1
    w.advance(1)
    assert {(rc.snapshot.version, rc.snapshot.trial) for rc in w.ranks} == {(3, None)}
    assert {rc.applied[-1] for rc in w.ranks} == {(3, w.step, w.step)}
    assert not pusher._trial_in_force
