"""The attacker review of issue 13 (items 1-4): version numbering and effective-step plausibility.
Each test reproduces one finding; each failed before its fix."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane
from flyserve.control.reports import HOST, PIDNS


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)


def live_report(plane: ControlPlane, rank: int, **fields: Any) -> dict[str, Any]:
    """A report as a live rank of this process writes it (pid alive on this host)."""
    now = time.time()
    d = {
        "pid": os.getpid(),
        "host": HOST,
        "pidns": PIDNS,
        "rank": rank,
        "engine": 0,
        "started": now - 100.0,
        "step": 2000,
        "steps_per_s": 20.0,
        "applied_version": 1,
        "time": now,
    }
    d.update(fields)
    plane.store.write_rank_report(d, rank=rank)
    return d


# ---------------------------------------------------------------- 2: ranks' applied version is a floor


def test_2_versions_do_not_restart_below_what_live_ranks_applied(plane: ControlPlane) -> None:
    for n in range(5):
        plane.apply_overrides({"min_seq_len": 2000 + n}, actor="a")
    live_report(plane, 0, applied_version=5)
    live_report(plane, 1, applied_version=5)
    # current.json garbage, history and the audit log gone
    sd = plane.state_dir
    for f in sd.history_dir.iterdir():
        f.unlink()
    sd.current_json.write_text("garbage")
    sd.audit_log.unlink()
    r = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert r.version == 6  # was 1: every rank (on v5) ignored it


def test_2_a_dead_or_stale_rank_does_not_raise_the_floor(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    live_report(plane, 0, applied_version=500, time=time.time() - 300)  # stale
    r = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert r.version == 2


# ---------------------------------------------------------------- 3, 4: history file names


@pytest.mark.parametrize("name", ["99999999999999999999.json", "1" * 30 + ".json", "99999999999999999999.json.bad"])
def test_3_a_stray_huge_history_name_never_counts_as_a_version(plane: ControlPlane, name: str) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    (plane.state_dir.history_dir / name).touch()
    r = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert r.version == 2
    rep = plane_repair(plane)
    assert r.version == rep.version == 2
    assert plane.apply_overrides({"min_seq_len": 2002}, actor="a").snapshot.version == 3
    assert plane.rollback(1, actor="a").snapshot.version == 4


def test_3_repair_sets_a_stray_name_aside(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    (plane.state_dir.history_dir / "99999999999999999999.json").touch()
    rep = plane_repair(plane)
    assert any("not a version number" in d for d in rep.dropped)
    assert (plane.state_dir.history_dir / "99999999999999999999.json.stray").exists()
    assert not (plane.state_dir.history_dir / "99999999999999999999.json").exists()


@pytest.mark.parametrize("name", ["²³.json", "٣٣.json", "+5.json", " 7.json", "0.json"])
def test_4_non_ascii_digit_history_names_are_ignored(plane: ControlPlane, name: str) -> None:
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    (plane.state_dir.history_dir / name).touch()
    assert [s.version for s in plane.history()] == [1]  # raised ValueError ('²³')
    r = plane.apply_overrides({"min_seq_len": 2001}, actor="a").snapshot
    assert r.version == 2  # '٣٣' made it 34
    assert plane.rollback(1, actor="a").snapshot.version == 3
    plane_repair(plane)
    assert plane.apply_overrides({"min_seq_len": 2002}, actor="a").snapshot.version == 4


def plane_repair(plane: ControlPlane):
    from flyserve.control.repair import repair

    return repair(plane)
