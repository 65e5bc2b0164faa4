"""The engine channel with data parallel, without vLLM: several engines, each with its own workers
and its own step counter, behind a DP-client-shaped fake (vLLM 0.32's DPLBAsyncMPClient answers
collective_rpc with the FIRST engine's result only). Every engine must confirm every version, at
one step per engine; /dispatch-stats shows every engine and worker from the pusher's status."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flyserve.control import ControlPlane, RankControl
from flyserve.control.rank_modes import ENGINE_CHANNEL
from flyserve.vllm import endpoint_plugin
from flyserve.vllm.channel_answers import by_engine
from flyserve.vllm.channel_pusher import ChannelPusher, pushes_path, status_path
from flyserve.vllm.engine_channel import METHOD, REPORT_METHOD, _from_step, parse_docs


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="cpu-tiny", step_margin=8, lead_s=0.0)
    p.reload(actor="startup", startup=True)
    return p


class Engine:
    """One DP engine: ``tp`` workers stepping together, at this engine's own pace."""

    def __init__(self, plane: ControlPlane, index: int, tp: int = 2) -> None:
        self.index = index
        self.ranks = [
            RankControl(plane.state_dir, index * tp + r, engine=index, report=False) for r in range(tp)
        ]
        self.step = 0
        self.fail_next = 0

    def advance(self, k: int = 1) -> None:
        for _ in range(k):
            self.step += 1
            for rc in self.ranks:
                rc.current(self.step)

    def collective_rpc(self, method: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        """What the engine core does with a utility "collective_rpc": run it on every worker."""
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError(f"engine {self.index} died")
        out = []
        for rc in self.ranks:
            if method == REPORT_METHOD:
                out.append({**rc.report_dict(), "host": f"node{self.index}", "decisions": {"unified": 3.0}})
                continue
            assert method == METHOD
            snaps = parse_docs(args[0])
            results = []
            if not snaps:
                rc.apply_pushed(None)
            for snap in snaps:
                applied, why = rc.apply_pushed(snap)
                results.append({"version": snap.version, "applied": applied, "why": why,
                                "from_step": _from_step(rc, snap.version)})  # fmt: skip
            out.append({"rank": rc.rank, "engine": self.index, "pid": 1, "host": f"node{self.index}",
                        "step": rc.step, "version": rc.snapshot.version, "results": results})  # fmt: skip
        return out


class DPClient:
    """Shaped like vLLM 0.32's DPLBAsyncMPClient: core_engines (2-byte little-endian identities),
    engine_ranks_managed, _call_utility_async(method, *args, engine=...), and collective_rpc_async
    that sends to every engine but returns the first engine's result."""

    def __init__(self, engines: list[Engine], client_index: int = 0) -> None:
        self.engines = {e.index.to_bytes(2, "little"): e for e in engines}
        self.core_engines = list(self.engines)
        self.engine_ranks_managed = [e.index for e in engines]
        self.client_index = client_index

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        assert method == "collective_rpc"
        name, timeout, rpc_args, kwargs = args
        assert timeout is None and kwargs is None
        await asyncio.sleep(0)
        return self.engines[engine].collective_rpc(name, tuple(rpc_args))

    async def collective_rpc_async(self, method, timeout=None, args=(), kwargs=None):
        results = await asyncio.gather(
            *(self._call_utility_async("collective_rpc", method, timeout, args, kwargs, engine=i)
              for i in self.core_engines)
        )  # fmt: skip
        return results[0]  # "Only the result from the first engine is returned."


class AsyncLLMLike:
    def __init__(self, core: DPClient) -> None:
        self.engine_core = core

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return await self.engine_core.collective_rpc_async(method, timeout, args, kwargs)


def run_plugin(plane: ControlPlane, client: AsyncLLMLike, monkeypatch, until) -> Any:
    monkeypatch.setenv("FLYSERVE_STATE_DIR", str(plane.state_dir.path))

    async def scenario() -> Any:
        p = endpoint_plugin.plugin()
        await p.init_state(client, SimpleNamespace(), SimpleNamespace(distributed_executor_backend="mp"))
        for _ in range(500):
            if p.pusher is None or until(p):
                break
            await asyncio.sleep(0.01)
        p.stop.set()
        if p.task is not None:
            await asyncio.wait_for(p.task, 10)
        return p

    return asyncio.run(scenario())


@pytest.mark.slow  # the plugin imports vLLM (6 s on the 2-core VM)
def test_every_engine_of_a_dp_client_gets_each_version_not_only_the_first(plane, monkeypatch):
    """Before: the plugin pushed through collective_rpc, which answered for engine 0 only; engine
    1's workers were never checked, and the pusher recorded 'every worker answered'."""
    engines = [Engine(plane, 0), Engine(plane, 1)]
    engines[0].advance(5)
    engines[1].advance(40)  # engines step on their own: engine 1 is 35 steps ahead
    plane.apply_overrides({"min_seq_len": 200}, actor="a")
    p = run_plugin(
        plane, AsyncLLMLike(DPClient(engines)), monkeypatch, lambda p: p.pusher.pushed_version == 2
    )
    assert p.pusher.pushed_version == 2
    lines = [json.loads(x) for x in pushes_path(plane.state_dir).read_text().splitlines()]
    last = lines[-1]
    assert last["version"] == 2
    assert [(e["engine"], e["from_step"], e["same_step"]) for e in last["engines"]] == [
        (0, 6, True),
        (1, 41, True),
    ]
    assert sorted(a["rank"] for a in last["answers"]) == [0, 1, 2, 3]
    for e in engines:
        assert {rc.mode for rc in e.ranks} == {ENGINE_CHANNEL}
        assert {rc.current(e.step + 1).version for rc in e.ranks} == {2}


def test_a_version_is_pushed_only_when_every_engine_confirmed_it(plane):
    engines = [Engine(plane, 0), Engine(plane, 1)]
    for e in engines:
        e.advance(3)

    async def rpc(method: str, docs: list[str]) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for e in engines:
            try:
                out[e.index] = e.collective_rpc(method, (docs,))
            except RuntimeError as exc:
                out[e.index] = exc
        return out

    pusher = ChannelPusher(plane.state_dir, rpc, engines=(0, 1))
    asyncio.run(pusher.sync_once())
    plane.apply_overrides({"min_seq_len": 300}, actor="a")
    engines[1].fail_next = 1
    with pytest.raises(
        RuntimeError, match=r"engine\(s\) \[1\] did not confirm: engine 1: RuntimeError: engine 1 died"
    ):
        asyncio.run(pusher.sync_once())
    assert pusher.pushed_version == 1 and pusher.unconfirmed() == {1: [2]}
    view = {e["engine"]: e for e in pusher.engine_view()}
    assert view[0]["confirmed_version"] == 2 and view[0]["from_step"] == 4 and view[0]["unconfirmed"] == []
    assert view[1]["confirmed_version"] == 1 and view[1]["unconfirmed"] == [2] and "died" in view[1]["error"]
    engines[0].advance(7)  # engine 0 keeps stepping under version 2 while engine 1 is retried
    engines[1].advance(2)
    assert asyncio.run(pusher.sync_once()) == 1
    assert pusher.pushed_version == 2 and pusher.unconfirmed() == {}
    line = json.loads(pushes_path(plane.state_dir).read_text().splitlines()[-1])
    # Engine 0's confirmation stands at the step it applied at (its retry answered "already applied").
    assert [(e["engine"], e["from_step"]) for e in line["engines"]] == [(0, 4), (1, 6)]


def test_an_engine_missing_from_the_answers_is_not_confirmed(plane):
    engine0 = Engine(plane, 0)

    async def first_only(method: str, docs: list[str]) -> list[Any]:
        return engine0.collective_rpc(method, (docs,))  # the DP client's first-result answer

    pusher = ChannelPusher(plane.state_dir, first_only, engines=(0, 1))
    with pytest.raises(RuntimeError, match=r"\[1\].*no answer"):
        asyncio.run(pusher.sync_once())
    assert pusher.pushed_version == -1


@pytest.mark.slow  # the plugin imports vLLM (6 s on the 2-core VM)
def test_only_api_server_0_pushes(plane, monkeypatch):
    engines = [Engine(plane, 0), Engine(plane, 1)]
    p = run_plugin(plane, AsyncLLMLike(DPClient(engines, client_index=1)), monkeypatch, lambda p: True)
    assert p.pusher is None and p.task is None
    assert {rc.mode for e in engines for rc in e.ranks} == {"file polling"}


@pytest.mark.slow  # the plugin imports vLLM (6 s on the 2-core VM)
def test_reports_through_the_channel_show_every_engine_in_dispatch_stats(plane, monkeypatch):
    from fastapi.testclient import TestClient

    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    engines = [Engine(plane, 0, tp=1), Engine(plane, 1, tp=1)]
    engines[0].advance(3)
    engines[1].advance(9)
    monkeypatch.setattr("flyserve.vllm.channel_pusher.REPORT_EVERY_S", 0.0)
    p = run_plugin(
        plane,
        AsyncLLMLike(DPClient(engines)),
        monkeypatch,
        lambda p: p.pusher.reported_at > 0 and status_path(plane.state_dir).exists(),
    )
    p.pusher.write_status()
    settings = SidecarSettings(state_dir=plane.state_dir.path, profile="cpu-tiny", share_control_metrics=False,
                               stats_ttl_s=0.0, metrics_ttl_s=0.0)  # fmt: skip
    with TestClient(create_app(settings)) as c:
        stats = c.get("/dispatch-stats").json()
    ch = stats["channel"]
    assert ch["pushed_version"] == 1 and ch["split_steps"] == 0
    got = {e["engine"]: e for e in ch["engines"]}
    assert sorted(got) == [0, 1]
    assert [(w["rank"], w["host"], w["step"]) for w in got[0]["workers"]] == [(0, "node0", 3)]
    assert [(w["rank"], w["host"], w["step"]) for w in got[1]["workers"]] == [(1, "node1", 9)]
    assert got[1]["workers"][0]["decisions"] == {"unified": 3.0}
    assert got[1]["confirmed_version"] == 1 and got[1]["unconfirmed"] == []


def test_a_bad_channel_status_is_named_and_changes_nothing(plane):
    from flyserve.sidecar.channel_view import read_channel_view

    path = status_path(plane.state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"engines": [{"engine": 0, "workers": [{"rank": "x"}, {"rank": 2, "step": 1e400}]}]})
    )
    with pytest.raises(ValueError, match="status.json"):
        read_channel_view(plane.state_dir)  # 1e400: non-finite
    path.write_text(json.dumps({"time": 1.0, "engines": [{"engine": 0, "unconfirmed": ["a", 3],
                                                          "workers": [{"rank": "x"}, {"rank": 2}]}, "junk"]}))  # fmt: skip
    view = read_channel_view(plane.state_dir, now=2.0)
    assert view is not None and view.age_s == 1.0
    assert [(e.engine, e.unconfirmed, [w.rank for w in e.workers]) for e in view.engines] == [(0, [3], [2])]


def test_by_engine_groups_and_bounds_answers():
    assert by_engine([{"engine": 1, "rank": 1}, {"rank": 0}]) == {
        1: [{"engine": 1, "rank": 1}],
        0: [{"rank": 0}],
    }
    got = by_engine({0: [1], 1: RuntimeError("x"), "2": [], 3: "junk"})
    assert got == {0: [1], 1: "RuntimeError: x", 3: "not a list of worker answers"}
