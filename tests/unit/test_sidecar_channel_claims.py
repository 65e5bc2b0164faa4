"""channel/status.json is shown as claims, never as fact: whoever can write the state directory can
write it, so /dispatch-stats checks its time against the reader's clock, its versions against the
control plane's current one, and the engines, workers and hosts it names against this node's own
rank reports - and bounds what it shows. Forged files here: a node that never existed, version
10**9, a time in the future, a huge engines list, documents that are not objects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane, RankControl
from flyserve.control.paths import StateDir
from flyserve.control.reports import HOST
from flyserve.sidecar.channel_view import (
    FUTURE_SLACK_S,
    MAX_ENGINES,
    MAX_HOST_CHARS,
    MAX_WORKERS,
    STALE_AFTER_S,
    Witnesses,
    read_channel_view,
)

NOW = 1_800_000_000.0


def _worker(rank: int, engine: int, host: str = "node0", applied: int = 2) -> dict[str, Any]:
    return {"rank": rank, "engine": engine, "host": host, "pid": 100 + rank, "step": 50,
            "applied_version": applied, "applied_step": 40, "decisions": {"unified": 3.0}}  # fmt: skip


def _status(**over: Any) -> dict[str, Any]:
    """An honest pusher's status (flyserve.vllm.channel_pusher.ChannelPusher.status) at NOW."""
    doc: dict[str, Any] = {
        "mode": "engine channel", "pid": 4242, "time": NOW - 1.0, "pushed_version": 2, "pushes": 2,
        "split_steps": 0, "errors": 0, "last_error": "", "reported_at": NOW - 1.5,
        "engines": [{"engine": 0, "confirmed_version": 2, "from_step": 40, "unconfirmed": [],
                     "error": None, "workers": [_worker(0, 0), _worker(1, 0)]}],
    }  # fmt: skip
    doc.update(over)
    return doc


def _write(sd: StateDir, doc: Any) -> None:
    path = sd.path / "channel" / "status.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))


@pytest.fixture
def sd(tmp_path: Path) -> StateDir:
    return StateDir(tmp_path / "state")


WITNESSES = Witnesses.of([(0, 0, "node0"), (0, 1, "node0")])


def test_an_honest_status_is_fresh_possible_verified_and_confirmed(sd: StateDir) -> None:
    _write(sd, _status())
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None
    assert (view.age_s, view.future, view.stale, view.time) == (1.0, False, False, NOW - 1.0)
    assert (view.reports_age_s, view.reports_stale) == (1.5, False)
    assert view.control_version == 2 and view.pushed_confirmed and view.impossible == []
    assert view.unverified_hosts == [] and view.engines_left_out == 0
    (engine,) = view.engines
    assert engine.confirmed and engine.verified and not engine.impossible
    assert all(w.verified and not w.impossible for w in engine.workers)


def test_an_engine_on_a_node_no_rank_report_names_is_unverified(sd: StateDir) -> None:
    ghost = {"engine": 7, "confirmed_version": 2, "from_step": 1, "unconfirmed": [],
             "workers": [_worker(56, 7, host="ghost-node")]}  # fmt: skip
    _write(sd, _status(engines=[*_status()["engines"], ghost]))
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None
    got = {e.engine: e for e in view.engines}
    assert got[0].verified and not got[7].verified
    assert not got[7].workers[0].verified
    assert view.unverified_hosts == ["ghost-node"]


def test_a_worker_claimed_on_another_host_than_its_rank_report_is_unverified(sd: StateDir) -> None:
    _write(sd, _status(engines=[{"engine": 0, "workers": [_worker(0, 0, host="elsewhere")]}]))
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None
    assert view.engines[0].verified and not view.engines[0].workers[0].verified
    assert view.unverified_hosts == ["elsewhere"]


def test_a_version_the_control_plane_never_issued_is_impossible_and_confirms_nothing(sd: StateDir) -> None:
    big = 10**9
    engines = [
        {
            "engine": 0,
            "confirmed_version": big,
            "unconfirmed": [big + 1],
            "workers": [_worker(0, 0, applied=big)],
        },
        {"engine": 1, "confirmed_version": 2, "workers": [_worker(1, 1)]},
    ]
    _write(sd, _status(pushed_version=big, engines=engines))
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None
    assert view.pushed_version == big  # shown as claimed ...
    assert not view.pushed_confirmed  # ... never counted
    assert view.impossible_count == 4 and len(view.impossible) == 4
    assert "pushed_version 1000000000 > control version 2" in view.impossible
    assert "engine 0 rank 0 applied_version 1000000000 > control version 2" in view.impossible
    got = {e.engine: e for e in view.engines}
    assert got[0].impossible and got[0].workers[0].impossible and not got[0].confirmed
    # Engine 1's own claim is possible, but a file that claims one version never issued confirms nothing.
    assert not got[1].impossible and not got[1].confirmed


def test_the_control_version_is_read_after_the_file(sd: StateDir) -> None:
    """A version published between reading the status and reading current.json: the status (read
    first) cannot be above the later control version, so it is never flagged."""
    _write(sd, _status(pushed_version=3))
    reads: list[int] = []

    def control() -> int:
        reads.append(1)
        return 3

    view = read_channel_view(sd, now=NOW, control_version=control, witnesses=WITNESSES)
    assert view is not None and reads == [1] and view.pushed_confirmed and view.impossible == []


def test_a_time_in_the_future_is_shown_as_such_never_as_age_zero(sd: StateDir) -> None:
    _write(sd, _status(time=NOW + 10**6, reported_at=NOW + 10**6))
    for now in (NOW, NOW + 60.0, NOW + 3600.0):  # however long one waits, it stays "future"
        view = read_channel_view(sd, now=now, control_version=2, witnesses=WITNESSES)
        assert view is not None
        assert view.age_s is None and view.future and view.stale, view
        assert view.reports_age_s is None and view.reports_future and view.reports_stale
        assert not view.pushed_confirmed and not any(e.confirmed for e in view.engines)


def test_a_time_just_ahead_of_the_clock_counts_as_now(sd: StateDir) -> None:
    _write(sd, _status(time=NOW + FUTURE_SLACK_S / 2))
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None and view.age_s == 0.0 and not view.future and not view.stale


@pytest.mark.parametrize("time_field", [NOW - STALE_AFTER_S - 1.0, None, "yesterday", True])
def test_an_old_or_missing_time_is_stale_and_confirms_nothing(sd: StateDir, time_field: Any) -> None:
    _write(sd, _status(time=time_field))
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None and view.stale and not view.future
    assert not view.pushed_confirmed and not view.engines[0].confirmed
    assert view.engines[0].verified  # what the rank reports vouch for does not age with the file


def test_a_huge_engines_list_is_bounded_and_counted(sd: StateDir) -> None:
    long_host = "h" * 100
    engines: list[Any] = [
        {"engine": e, "workers": [{"rank": e * 8 + r, "engine": e, "host": long_host} for r in range(8)]}
        for e in range(300)
    ]
    engines[0] |= {"error": "x" * 10_000, "unconfirmed": list(range(1000))}
    engines[0]["workers"][0]["decisions"] = {str(i): 1 for i in range(100)}
    engines.insert(1, {"engine": 0, "confirmed_version": 1})  # a repeated index: the first one wins
    engines += [{"engine": 1000 + i} for i in range(20_000)]
    _write(sd, _status(engines=engines))
    assert (sd.path / "channel" / "status.json").stat().st_size < 1 << 20  # under the reader's cap
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None
    assert len(view.engines) == MAX_ENGINES and view.engines_left_out == len(engines) - MAX_ENGINES
    assert view.engines[0].confirmed_version is None  # the first entry for engine 0, not the repeat
    workers = [w for e in view.engines for w in e.workers]
    assert len(workers) == MAX_WORKERS and view.workers_left_out == MAX_ENGINES * 8 - MAX_WORKERS
    assert all(len(w.host or "") == MAX_HOST_CHARS and len(w.decisions) <= 8 for w in workers)
    assert len(view.engines[0].error or "") == 300 and len(view.engines[0].unconfirmed) == 64
    assert view.unverified_hosts == [long_host[:MAX_HOST_CHARS]]
    assert len(view.model_dump_json()) < 1_000_000


def test_a_status_over_the_size_cap_is_refused_by_name(sd: StateDir) -> None:
    _write(sd, _status(engines=[{"engine": e, "error": "x" * 1000} for e in range(2000)]))
    with pytest.raises(ValueError, match=r"channel/status\.json.*larger than"):
        read_channel_view(sd, now=NOW, control_version=2)


def test_entries_with_absurd_indices_are_left_out_and_counted(sd: StateDir) -> None:
    _write(sd, _status(engines=[{"engine": -1}, {"engine": 10**20}, {"engine": True}, "junk", {"engine": 3}]))
    view = read_channel_view(sd, now=NOW, control_version=2, witnesses=WITNESSES)
    assert view is not None and [e.engine for e in view.engines] == [3] and view.engines_left_out == 4


@pytest.mark.parametrize("doc", ["[1, 2]", '"status"', "42", "null", "true"])
def test_a_document_that_is_not_an_object_is_named_and_refused(sd: StateDir, doc: str) -> None:
    _write(sd, doc)
    with pytest.raises(ValueError, match=r"channel/status\.json.*not a JSON object"):
        read_channel_view(sd, now=NOW, control_version=2)


def test_without_a_control_version_or_witnesses_nothing_is_confirmed_or_verified(sd: StateDir) -> None:
    _write(sd, _status())
    view = read_channel_view(sd, now=NOW)
    assert view is not None and view.control_version is None and not view.pushed_confirmed
    assert view.impossible == [] and not view.engines[0].confirmed and not view.engines[0].verified


# ----------------------------------------------------------------- through /dispatch-stats


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="cpu-tiny", step_margin=8, lead_s=0.0)
    p.reload(actor="startup", startup=True)
    return p


def _dispatch_stats(plane: ControlPlane) -> dict[str, Any]:
    from fastapi.testclient import TestClient

    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    settings = SidecarSettings(state_dir=plane.state_dir.path, profile="cpu-tiny", share_control_metrics=False,
                               stats_ttl_s=0.0, metrics_ttl_s=0.0)  # fmt: skip
    with TestClient(create_app(settings)) as c:
        got = c.get("/dispatch-stats")
        assert got.status_code == 200, got.text[:300]
        return got.json()


def test_dispatch_stats_checks_a_forged_status_against_the_store_and_the_rank_reports(plane) -> None:
    import time

    RankControl(plane.state_dir, 0, engine=0, report=False).write_report()  # this node's one real rank
    current = plane.snapshot().version
    ghost = {"engine": 7, "confirmed_version": 10**9, "workers": [_worker(56, 7, "ghost-node", current)]}
    honest = {
        "engine": 0,
        "confirmed_version": current,
        "workers": [_worker(0, 0, host=HOST, applied=current)],
    }
    _write(plane.state_dir, _status(time=time.time() + 10**6, pushed_version=10**9, engines=[honest, ghost]))
    ch = _dispatch_stats(plane)["channel"]
    assert ch["control_version"] == current
    assert ch["age_s"] is None and ch["future"] is True and ch["stale"] is True
    assert ch["pushed_version"] == 10**9 and ch["pushed_confirmed"] is False
    assert ch["impossible_count"] == 2 and ch["unverified_hosts"] == ["ghost-node"]
    got = {e["engine"]: e for e in ch["engines"]}
    assert got[0]["verified"] is True and got[0]["workers"][0]["verified"] is True
    assert got[7]["verified"] is False and got[7]["impossible"] is True
    assert not any(e["confirmed"] for e in ch["engines"])


def test_dispatch_stats_names_a_status_that_is_not_an_object_and_still_answers(plane) -> None:
    _write(plane.state_dir, "[" + ",".join(["{}"] * 1000) + "]")
    stats = _dispatch_stats(plane)
    assert stats["channel"] is None
    assert any("channel/status.json" in e and "not a JSON object" in e for e in stats["errors"]), stats[
        "errors"
    ]
    assert stats["thresholds"] is not None  # the rest of the page is unaffected
