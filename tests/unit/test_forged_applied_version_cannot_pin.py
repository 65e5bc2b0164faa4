"""A forged rank report's ``applied_version`` cannot number the next change out of the ranks' reach.

"Confirmed" says only that the report names a live process of a trusted uid: a forger of the same
uid names its own process (here: this test process). Such a report claiming 10**18 - 2, or just
past what the real ranks believe (MAX_VERSION_STEP above their version), made the plane number
the next change above it: every rank refused it as implausible, the change said it succeeded, and
every later change, ``circuit open`` included, found its number "already in history". An
unconfirmed claim of exactly MAX_VERSION_STEP above the record did the same (one past the ranks'
reach). Now the plane counts confirmed claims only up to what every confirmed rank believes, and
unconfirmed ones up to one below the readers' step."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from flyserve.control import ControlPlane
from flyserve.control.rank import RankControl
from flyserve.control.reports import HOST, PIDNS, own_proc_start
from flyserve.control.version_trust import MAX_VERSION_STEP


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="gfx950", step_margin=8, lead_s=0.0)
    for v in (3000, 3100, 3200):
        p.apply_overrides({"min_seq_len": v}, actor="op")
    assert p.snapshot().version == 3
    return p


def forge_report(plane: ControlPlane, applied_version: int, *, local: bool) -> None:
    now = time.time()
    doc = {
        "pid": os.getpid(), "host": HOST if local else "elsewhere", "pidns": PIDNS if local else "x",
        "proc_start": own_proc_start(), "rank": 7, "engine": 0, "started": now - 10, "step": 0,
        "applied_version": applied_version, "time": now,
    }  # fmt: skip
    plane.state_dir.ranks_dir.mkdir(parents=True, exist_ok=True)
    (plane.state_dir.ranks_dir / "7.json").write_text(json.dumps(doc))


def assert_changes_reach(plane: ControlPlane, rc: RankControl) -> None:
    for open_ in (True, False, True):
        res = plane.set_circuit(open_, actor="op", reason="test")
        rc.poll()
        rc.current(max(rc.step + 1, res.snapshot.step_for(0)))  # the engine reaches its step
        assert rc.snapshot.version == res.snapshot.version
        assert rc.snapshot.circuit_open is open_


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize("claim", [10**18 - 2, 3 + MAX_VERSION_STEP])
def test_a_confirmed_forgery_beside_a_running_rank(plane: ControlPlane, claim: int) -> None:
    rc = RankControl(plane.state_dir, rank=0, profile="gfx950")
    rc.poll()
    rc.current(1)
    forge_report(plane, claim, local=True)
    assert {r.applied_version for r in plane.store.reports()} == {3, claim}  # both confirmed
    assert_changes_reach(plane, rc)


def test_an_unconfirmed_claim_one_step_above_the_record(plane: ControlPlane) -> None:
    rc = RankControl(plane.state_dir, rank=0, profile="gfx950", report=False)  # a rank it cannot see
    rc.poll()
    rc.current(1)
    forge_report(plane, 3 + MAX_VERSION_STEP, local=False)
    assert_changes_reach(plane, rc)


def test_planted_history_names_do_not_lift_the_plane_beside_ranks_it_cannot_confirm(
    plane: ControlPlane,
) -> None:
    """Ranks in another pid namespace: their fresh reports are unconfirmed. Three planted names
    1,000,000 apart (empty ``*.bad`` files: a credible chain of names) once lifted the plane's
    floor to 3,000,000, so ``circuit open`` was published as 3000001, the rank at 3 refused it and
    every later change, and ``repair`` found nothing to do. The lowest fresh report anchors now."""
    rc = RankControl(plane.state_dir, rank=0, profile="gfx950", report=False)  # its report: below
    rc.poll()
    rc.current(1)
    for name in ("01000002", "02000001", "03000000"):
        (plane.state_dir.history_dir / f"{name}.json.bad").write_text("")
    for open_ in (True, False, True):
        forge_report(plane, rc.snapshot.version, local=False)  # the real rank, seen from elsewhere
        res = plane.set_circuit(open_, actor="op", reason="test")
        assert res.snapshot.version <= rc.snapshot.version + MAX_VERSION_STEP, res.snapshot.version
        rc.poll()
        rc.current(max(rc.step + 1, res.snapshot.step_for(0)))
        assert (rc.snapshot.version, rc.snapshot.circuit_open) == (res.snapshot.version, open_)
