"""A rank that starts (a restart, a new DP engine) believes only what the live ranks it joins believe.

A forged chain of history names stepping by at most MAX_VERSION_STEP, with a matching current.json,
looks credible by its names alone. Running ranks refuse it (they anchor on what they applied); a
rank that started beside it used to take it, report it as applied and become the plane's anchor,
so the running ranks then refused every later change. Now a starting rank - and the engine-channel
pusher - anchors on the live, confirmed ranks' applied versions (control.version_trust.confirmed_anchor).

Every report here is written by this test process, so the process table confirms it."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane
from flyserve.control.rank import RankControl
from flyserve.control.reports import HOST, PIDNS, own_proc_start
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.version_trust import MAX_VERSION_STEP
from flyserve.files.atomic import atomic_write
from flyserve.thresholds_files import load_profile
from flyserve.vllm.channel_pusher import ChannelPusher
from flyserve.vllm.engine_channel import METHOD, _from_step, parse_docs

NEAR_LIMIT = 10**18 - 2


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="gfx950", step_margin=8, lead_s=0.0)
    for v in (3000, 3100, 3200):
        p.apply_overrides({"min_seq_len": v}, actor="op")
    assert p.snapshot().version == 3
    return p


def forged(version: int) -> ConfigSnapshot:
    """Valid content and a correct sha256: whoever can write the state directory can make one."""
    return ConfigSnapshot.build(
        version=version, thresholds=load_profile("gfx950").merged({"min_seq_len": 7}),
        source="api", actor="forger", time=1.0, effective_step=0, profile="gfx950",
        overrides={"min_seq_len": 7},
    )  # fmt: skip


def plant_chain(plane: ControlPlane, versions: list[int]) -> int:
    """History files named ``versions`` and a current.json at the last: the chain as a forger plants it."""
    for v in versions:
        atomic_write(plane.state_dir.history_file(v), forged(v).to_json())
    atomic_write(plane.state_dir.current_json, forged(versions[-1]).to_json())
    assert plane.store.version_floor() == versions[-1]  # the names alone look credible
    return versions[-1]


def far_chain() -> list[int]:
    """Out of reach of a rank at 3: the first link is above the highest version it would stand on."""
    return [3 + k * MAX_VERSION_STEP for k in range(1, 6)]


def near_chain() -> list[int]:
    """The near forged chain: 5, 1000004, 2000003, ...: its first link is within a rank at 3's reach."""
    return [5 + k * (MAX_VERSION_STEP - 1) for k in range(6)]


def running_rank(plane: ControlPlane, rank: int = 0) -> RankControl:
    rc = RankControl(plane.state_dir, rank=rank, profile="gfx950")
    rc.poll()  # its report: this process (confirmed), applied_version 3
    rc.current(1)
    assert rc.snapshot.version == 3
    return rc


def settle(*ranks: RankControl, step: int = 10**6) -> set[int]:
    for rc in ranks:
        rc.poll()
        rc.current(step)
    return {rc.snapshot.version for rc in ranks}


# ---------------------------------------------------------------- a starting rank


def test_a_rank_starting_beside_a_forged_chain_starts_where_its_live_peer_runs(plane: ControlPlane) -> None:
    r0 = running_rank(plane)
    top = plant_chain(plane, far_chain())
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert r1.snapshot.version == 3 and r1.snapshot.thresholds.min_seq_len == 3200
    assert settle(r0, r1) == {3}  # neither applies the forgery later either
    assert r1.report_dict()["applied_version"] == 3
    assert top not in {v for v, _, _ in r1.applied}


def test_a_rank_starting_beside_the_near_chain_stops_at_the_first_link_it_can_believe(
    plane: ControlPlane,
) -> None:
    """5 continues 3 (a forger can publish a valid change, as `thresholds set` can): the newest
    version the starting rank believes, where the plane stands too. 1000004 does not."""
    r0 = running_rank(plane)
    plant_chain(plane, near_chain())
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert r1.snapshot.version == 5
    r1.poll()
    # Both ranks' reports (3 and 5) count; the plane stays within what the lower one believes.
    res = plane.apply_overrides({"min_seq_len": 3300}, actor="op")
    assert res.snapshot.version == 6
    assert settle(r0, r1) == {6}
    assert r0.snapshot.thresholds.min_seq_len == 3300


def test_after_such_a_start_the_plane_accepts_a_change_and_circuit_open(plane: ControlPlane) -> None:
    r0 = running_rank(plane)
    plant_chain(plane, far_chain())
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert settle(r0, r1) == {3}  # both reports say 3
    assert plane.apply_overrides({"min_seq_len": 3300}, actor="op").snapshot.version == 4
    assert settle(r0, r1, step=2 * 10**6) == {4}
    res = plane.set_circuit(True, actor="op", reason="forgery drill")
    assert res.snapshot.version == 5 and res.snapshot.circuit_open
    assert settle(r0, r1, step=3 * 10**6) == {5}
    assert r0.snapshot.circuit_open and r1.snapshot.circuit_open


def test_a_rank_that_starts_at_version_0_takes_no_forged_push(plane: ControlPlane) -> None:
    """Nothing readable at its start (current.json and history damaged): it runs the profile at
    version 0, and a push is still judged by what its live peer applied."""
    running_rank(plane)
    top = plant_chain(plane, far_chain())
    for v in plane.store.history_versions():
        if v <= 3:
            plane.state_dir.history_file(v).write_text("{torn")
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert r1.snapshot.version == 0
    assert r1.apply_pushed(forged(top)) == (False, "implausible version")
    assert r1.apply_pushed(forged(4)) == (True, "applied")


def test_a_confirmed_report_claiming_a_version_past_the_history_chain_is_no_anchor(
    plane: ControlPlane,
) -> None:
    """A report of a live local process whose applied_version no chain on record reaches (near the
    numeric limit) would let the starting rank believe anything: it does not count."""
    atomic_write(plane.state_dir.history_file(NEAR_LIMIT), forged(NEAR_LIMIT).to_json())
    atomic_write(plane.state_dir.current_json, forged(NEAR_LIMIT).to_json())
    plane.store.write_rank_report(report(applied_version=NEAR_LIMIT), rank=7)
    assert [r.applied_version for r in plane.store.reports()] == [NEAR_LIMIT]  # read, and live
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert r1.snapshot.version == 3


def report(*, applied_version: int, age_s: float = 0.0, rank: int = 7) -> dict[str, Any]:
    now = time.time()
    return {
        "pid": os.getpid(), "host": HOST, "pidns": PIDNS, "proc_start": own_proc_start(),
        "rank": rank, "engine": 0, "started": now - 600.0, "step": 10, "applied_version": applied_version,
        "time": now - age_s, "steps_per_s": None, "late_applies": 0,
    }  # fmt: skip


# ---------------------------------------------------------------- legitimate starts


def test_a_rank_joining_during_a_change_applies_the_current_version(
    plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    """Its peer still runs N (3) while the plane has just published N + 1: the join takes N + 1
    from current.json itself (no refusal logged, no stand-in from history)."""
    r0 = running_rank(plane)
    plane.apply_overrides({"min_seq_len": 3300}, actor="op")
    caplog.set_level(logging.ERROR, logger="flyserve")
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert r1.snapshot.version == 4 and r1.snapshot.thresholds.min_seq_len == 3300
    assert settle(r0, r1) == {4}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_rank_starting_with_no_peers_applies_the_current_version(
    plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="flyserve")
    r1 = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert r1.snapshot.version == 3 and r1.snapshot.thresholds.min_seq_len == 3200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_restarted_rank_does_not_anchor_on_stale_reports(tmp_path: Path) -> None:
    """After a restart the old reports are stale: a current.json far above them (history pruned to
    its newest entry) is still believed; the chain of history names decides, as without peers."""
    plane = ControlPlane(tmp_path / "state", profile="gfx950", lead_s=0.0)
    v = 50_000_001
    snap = ConfigSnapshot.build(
        version=v, thresholds=load_profile("gfx950"), source="api", actor="op", time=1.0,
        effective_step=0, profile="gfx950",
    )  # fmt: skip
    atomic_write(plane.state_dir.history_file(v), snap.to_json())
    atomic_write(plane.state_dir.current_json, snap.to_json())
    plane.store.write_rank_report(report(applied_version=3, age_s=120.0, rank=0), rank=0)
    assert [r.applied_version for r in plane.store.reports()] == [3]  # read, but stale
    rc = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert rc.snapshot.version == v


# ---------------------------------------------------------------- the engine-channel pusher


class Workers:
    """Ranks of one engine answering the push RPC as vLLM's workers do (apply_pushed each)."""

    def __init__(self, ranks: list[RankControl]) -> None:
        self.ranks = ranks
        self.pushed: list[list[int]] = []

    async def rpc(self, method: str, docs: list[str]) -> list[dict[str, Any]]:
        assert method == METHOD
        snaps = parse_docs(docs)
        self.pushed.append([s.version for s in snaps])
        out = []
        for rc in self.ranks:
            if not snaps:
                rc.apply_pushed(None)
            results = []
            for s in snaps:
                applied, why = rc.apply_pushed(s)
                results.append({"version": s.version, "applied": applied, "why": why,
                                "from_step": _from_step(rc, s.version)})  # fmt: skip
            out.append({"rank": rc.rank, "engine": rc.engine, "pid": 1, "step": rc.step,
                        "version": rc.snapshot.version, "results": results})  # fmt: skip
        return out


def test_the_pusher_does_not_push_a_forged_jump(plane: ControlPlane) -> None:
    w = Workers([running_rank(plane)])
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    assert asyncio.run(pusher.sync_once()) == 1 and pusher.pushed_version == 3
    top = plant_chain(plane, far_chain())
    assert asyncio.run(pusher.sync_once()) == 0
    assert asyncio.run(pusher.sync_once()) == 0  # refused again, not pushed on a later round
    assert pusher.pushed_version == 3 and not any(top in p for p in w.pushed)
    assert plane.apply_overrides({"min_seq_len": 3300}, actor="op").snapshot.version == 4
    assert asyncio.run(pusher.sync_once()) == 1 and w.pushed[-1] == [4]
    assert w.ranks[0].snapshot.version == 4


def test_the_pusher_anchors_on_what_it_pushed_when_no_rank_report_is_confirmed(
    plane: ControlPlane,
) -> None:
    """Workers on another node (no report in this state directory): what the pusher pushed is the
    anchor, not the chain of history names."""
    rc = RankControl(plane.state_dir, rank=0, profile="gfx950", report=False)
    w = Workers([rc])
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    assert asyncio.run(pusher.sync_once()) == 1 and pusher.pushed_version == 3
    top = plant_chain(plane, far_chain())
    assert asyncio.run(pusher.sync_once()) == 0
    assert pusher.pushed_version == 3 and not any(top in p for p in w.pushed)


def test_a_pusher_starting_beside_a_forged_chain_anchors_on_the_live_ranks(plane: ControlPlane) -> None:
    w = Workers([running_rank(plane)])
    top = plant_chain(plane, far_chain())
    pusher = ChannelPusher(plane.state_dir, w.rpc)
    assert asyncio.run(pusher.sync_once()) == 0
    assert not any(top in p for p in w.pushed) and w.ranks[0].snapshot.version == 3
    assert plane.set_circuit(True, actor="op").snapshot.version == 4
    assert asyncio.run(pusher.sync_once()) == 1 and w.pushed[-1] == [4]
    assert w.ranks[0].snapshot.circuit_open
    status = json.loads((plane.state_dir.path / "channel" / "status.json").read_text())
    assert status["pushed_version"] == 4
