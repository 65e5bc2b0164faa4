"""A forged current.json (or history entry) cannot pin the control plane: ranks, the plane and
repair believe only versions that continue the sequence on record, and only content the plane could
have published (control.version_trust, snapshot.check_layers).

Each forgery here has a correct sha256: whoever can write the state directory can compute it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane
from flyserve.control.errors import ControlIOError
from flyserve.control.rank import RankControl
from flyserve.control.repair import repair
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.version_trust import (
    FIRST_VERSION_CEILING,
    MAX_VERSION_STEP,
    believed,
    credible_max,
)
from flyserve.files.atomic import atomic_write
from flyserve.policy.thresholds import ThresholdsError
from flyserve.thresholds_files import load_profile

NEAR_LIMIT = 10**18 - 2


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    p = ControlPlane(tmp_path / "state", profile="gfx950", step_margin=8, lead_s=0.0)
    p.apply_overrides({"min_seq_len": 3000}, actor="op")
    p.apply_overrides({"min_seq_len": 3100}, actor="op")
    p.apply_overrides({"min_seq_len": 3200}, actor="op")
    assert p.snapshot().version == 3
    return p


def forged(version: int, **over: Any) -> ConfigSnapshot:
    """A snapshot with a valid sha256 and whatever else a forger chooses."""
    args: dict[str, Any] = {
        "version": version, "thresholds": load_profile("gfx950"), "source": "api", "actor": "forger",
        "time": 1.0, "effective_step": 0, "profile": "gfx950",
    }  # fmt: skip
    args.update(over)
    return ConfigSnapshot.build(**args)


def plant(plane: ControlPlane, snap: ConfigSnapshot, *, with_history: bool = True) -> None:
    if with_history:
        atomic_write(plane.state_dir.history_file(snap.version), snap.to_json())
    atomic_write(plane.state_dir.current_json, snap.to_json())


def running_rank(plane: ControlPlane) -> RankControl:
    rc = RankControl(plane.state_dir, rank=0, profile="gfx950")
    rc.poll()
    rc.current(1)
    assert rc.snapshot.version == 3
    return rc


# ---------------------------------------------------------------- the sequence rules


def test_credible_max_stops_at_the_first_gap() -> None:
    assert credible_max([1, 2, 3, NEAR_LIMIT]) == 3
    assert credible_max([50_000_001, 50_000_002]) == 50_000_002  # pruned history: a real chain
    assert credible_max([FIRST_VERSION_CEILING + 1]) == 0
    assert credible_max([3, 3 + MAX_VERSION_STEP, 3 + 3 * MAX_VERSION_STEP]) == 3 + MAX_VERSION_STEP
    assert credible_max([]) == 0


def test_believed_allows_one_step_above_the_anchor_and_no_more() -> None:
    assert believed(3 + MAX_VERSION_STEP, 3)
    assert not believed(4 + MAX_VERSION_STEP, 3)
    assert believed(FIRST_VERSION_CEILING, 0) and not believed(FIRST_VERSION_CEILING + 1, 0)
    assert not believed(-1, 0)


# ---------------------------------------------------------------- a version near the numeric limit


def test_a_running_rank_does_not_apply_a_forged_version_near_the_limit(plane: ControlPlane) -> None:
    rc = running_rank(plane)
    plant(plane, forged(NEAR_LIMIT))
    rc.poll()
    rc.current(10**6)
    assert rc.snapshot.version == 3


def test_after_a_forgery_near_the_limit_circuit_open_is_accepted_and_applied(plane: ControlPlane) -> None:
    """Was: 'version numbers exhausted' for every change, circuit open included, until restart."""
    rc = running_rank(plane)
    plant(plane, forged(NEAR_LIMIT))
    res = plane.set_circuit(True, actor="op", reason="forgery drill")
    assert res.snapshot.version == 4 and res.snapshot.circuit_open
    rc.poll()
    rc.current(10**6)
    assert rc.snapshot.version == 4 and rc.snapshot.circuit_open


def test_rollback_to_a_known_version_is_accepted_after_a_forgery(plane: ControlPlane) -> None:
    plant(plane, forged(NEAR_LIMIT))
    res = plane.rollback(1, actor="op")
    assert res.snapshot.version == 4
    assert res.snapshot.thresholds.min_seq_len == 3000


def test_the_plane_falls_back_to_the_newest_credible_history_entry(plane: ControlPlane) -> None:
    plant(plane, forged(NEAR_LIMIT))
    snap = plane.snapshot()
    assert snap.version == 3 and snap.thresholds.min_seq_len == 3200
    assert plane.store.version_floor() == 3


def test_a_rank_that_starts_beside_a_forgery_starts_where_the_plane_stands(plane: ControlPlane) -> None:
    plant(plane, forged(NEAR_LIMIT))
    rc = RankControl(plane.state_dir, rank=1, profile="gfx950")
    assert rc.snapshot.version == 3 and rc.snapshot.thresholds.min_seq_len == 3200


def test_repair_undoes_a_forged_current_version(plane: ControlPlane) -> None:
    plant(plane, forged(NEAR_LIMIT))
    report = repair(plane)
    assert report.version == 3
    assert any("damaged or forged" in a and "does not continue" in a for a in report.actions), report
    assert any("kept as" in d and ".stray" in d for d in report.dropped), report
    cur = json.loads(plane.state_dir.current_json.read_text())
    assert cur["version"] == 3
    assert not plane.state_dir.history_file(NEAR_LIMIT).exists()
    assert plane.apply_overrides({"min_seq_len": 3300}, actor="op").snapshot.version == 4
    assert not repair(plane).changed  # consistent afterwards


def test_a_forged_chain_of_history_names_does_not_lift_the_plane_above_its_confirmed_ranks(
    plane: ControlPlane,
) -> None:
    """History files one MAX_VERSION_STEP apart form a chain the names alone cannot refute; a
    confirmed live rank's applied version can: the plane numbers from what its ranks believe."""
    rc = running_rank(plane)  # its report (this process, confirmed) says applied_version 3
    top = 3 + 3 * MAX_VERSION_STEP
    for v in (3 + MAX_VERSION_STEP, 3 + 2 * MAX_VERSION_STEP):
        atomic_write(plane.state_dir.history_file(v), forged(v).to_json())
    plant(plane, forged(top))
    res = plane.set_circuit(True, actor="op")
    assert res.snapshot.version == 4
    rc.poll()
    rc.current(10**6)
    assert rc.snapshot.version == 4


def test_a_forged_audit_line_does_not_set_the_version_floor(tmp_path: Path) -> None:
    plane = ControlPlane(tmp_path / "state", profile="gfx950", lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="op")
    plane.store.audit({"action": "set", "result": "success", "version": NEAR_LIMIT})
    plane.state_dir.current_json.write_text("{torn")  # damaged: the audit log is the last witness
    for v in plane.store.history_versions():
        plane.state_dir.history_file(v).unlink()
    assert plane.store.max_audited_version() == 1
    assert plane.apply_overrides({"min_seq_len": 3100}, actor="op").snapshot.version == 2


def test_a_pushed_version_far_above_the_applied_one_is_refused(plane: ControlPlane) -> None:
    rc = running_rank(plane)
    assert rc.apply_pushed(None) == (False, "switched")
    assert rc.apply_pushed(forged(3 + MAX_VERSION_STEP + 1)) == (False, "implausible version")
    assert rc.apply_pushed(forged(4)) == (True, "applied")


# ---------------------------------------------------------------- content the plane could not publish


@pytest.mark.slow  # 0.5 s on the 2-core VM (fast-tier tests take under 0.3 s)
@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"profile": "no-such-profile"}, "profile"),
        ({"overrides": {"not_a_threshold": 1}}, "overrides.not_a_threshold"),
        ({"file_values": {"min_seq_len": "many"}}, "min_seq_len"),
        # the override layer says 5000, the effective thresholds the profile's value
        ({"overrides": {"min_seq_len": 5000}}, "min_seq_len"),
    ],
    ids=["unknown-profile", "unknown-override-key", "invalid-file-value", "layers-disagree"],
)
def test_content_the_plane_could_not_publish_is_refused_everywhere(
    plane: ControlPlane, over: dict[str, Any], field: str
) -> None:
    snap = forged(4, **over)
    with pytest.raises(ThresholdsError) as err:
        ConfigSnapshot.from_dict(snap.to_dict())
    assert field in str(err.value)
    rc = running_rank(plane)
    plant(plane, snap)
    with pytest.raises(ControlIOError):
        plane.store.read_current()
    rc.poll()
    rc.current(10**6)
    # The rank keeps what it runs; only a profile it cannot load is not its to judge (it may lack
    # the plane's profile file): the plane refuses it, and the next change supersedes it.
    assert rc.snapshot.version == (4 if field == "profile" else 3)
    # Every change still goes through (was: every change refused, and `repair` said consistent).
    assert plane.apply_overrides({"min_seq_len": 3300}, actor="op").snapshot.version == 5
    plant(plane, snap)
    report = repair(plane)
    assert report.version == 5 and any("damaged or forged" in a for a in report.actions), report


def test_the_plane_publishes_only_what_passes_its_own_read_check(plane: ControlPlane) -> None:
    """Every version the plane publishes reads back through the same checks (no self-refusal)."""
    plane.reload(actor="op")
    plane.apply_overrides({"lpt": "never", "min_seq_len": None}, actor="op")
    plane.set_circuit(True, actor="op", reason="drill")
    plane.rollback(2, actor="op")
    for snap in plane.history():
        ConfigSnapshot.from_dict(snap.to_dict())
    assert plane.store.read_current() is not None


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-dev-zero", "directory"])
def test_a_planted_audit_log_does_not_refuse_circuit_open(plane: ControlPlane, kind: str) -> None:
    """The write-ahead audit line comes before every publish: a FIFO, link or directory planted as
    audit.jsonl once refused every change. The writer holding the lock sets it aside instead."""
    import os

    log = plane.state_dir.audit_log
    log.unlink()
    if kind == "fifo":
        os.mkfifo(log)
    elif kind == "directory":
        log.mkdir()
    else:
        log.symlink_to("/dev/zero")
    res = plane.set_circuit(True, actor="op", reason="drill")
    assert res.snapshot.version == 4 and res.snapshot.circuit_open
    assert log.is_file() and not log.is_symlink()
    assert len(list(log.parent.glob("audit.jsonl.not-regular.*"))) == 1
    assert [(e["action"], e["result"]) for e in plane.audit_log()] == [("circuit", "success")]


def test_a_rollback_is_accepted_whatever_decode_path_the_current_version_carries(plane: ControlPlane) -> None:
    """decode_path is fixed at start; a rollback keeps the running value instead of being refused
    (a forged current.json that changed it once made every rollback a DecodePathChangeRefused)."""
    profile_path = load_profile("gfx950").decode_path
    other = next(p for p in ("unified", "prefill") if p != profile_path)
    thresholds = load_profile("gfx950").merged({"decode_path": other})
    plant(plane, forged(4, thresholds=thresholds, overrides={"decode_path": other}))
    assert plane.snapshot().version == 4  # valid content, a believed version: it stands
    res = plane.rollback(1, actor="op")
    assert res.snapshot.version == 5
    assert res.snapshot.thresholds.min_seq_len == 3000
    assert res.snapshot.thresholds.decode_path == other  # the running value, not refused


def test_a_null_current_json_is_damaged_not_missing(plane: ControlPlane) -> None:
    """JSON null once read as "no file": the plane said nothing was ever published."""
    rc = running_rank(plane)
    plane.state_dir.current_json.write_text("null")
    with pytest.raises(ControlIOError, match="null"):
        plane.store.read_current()
    assert plane.snapshot().version == 3
    rc.poll()
    assert rc.snapshot.version == 3
    assert any("damaged" in a for a in repair(plane).actions)


def test_a_directory_planted_at_the_set_aside_name_does_not_refuse_changes(plane: ControlPlane) -> None:
    import os

    log = plane.state_dir.audit_log
    log.unlink()
    os.mkfifo(log)
    (log.parent / "audit.jsonl.not-regular").mkdir()
    (log.parent / "audit.jsonl.not-regular" / "x").write_text("x")
    assert plane.set_circuit(True, actor="op").snapshot.circuit_open


def test_a_rank_without_the_plane_profile_file_still_applies_versions(tmp_path: Path) -> None:
    """The sidecar's profile may come from its own FLYSERVE_PROFILE_PATH; a rank lacking that file
    checks the layers over the effective values instead of refusing every version."""
    plane = ControlPlane(tmp_path / "state", profile="gfx950", lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="op")
    snap = plane.snapshot()
    site = forged(2, profile="site-only", overrides={"min_seq_len": 3000},
                  thresholds=snap.thresholds)  # fmt: skip
    plant(plane, site)
    rc = RankControl(plane.state_dir, rank=0, profile="gfx950")
    assert rc.snapshot.version == 2
    with pytest.raises(ControlIOError):  # the plane, which builds the next change from it, loads it
        plane.store.read_current()
