"""ControlPlane: layers and provenance, idempotency, rollback, optimistic locking, decode_path, circuit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flyserve.control import (
    ConfigSnapshot,
    ControlIOError,
    ControlPlane,
    DecodePathChangeRefused,
    StateDir,
    VersionConflict,
    default_state_dir,
)
from flyserve.policy import Thresholds, ThresholdsError
from flyserve.thresholds_files import load_profile


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    p = tmp_path / "cfg" / "flyserve.yaml"
    p.parent.mkdir()
    p.write_text("min_seq_len: 2048\nlpt: never\n")
    return p


@pytest.fixture
def plane(tmp_path: Path, cfg: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "state", config_file=cfg)


def test_default_state_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLYSERVE_STATE_DIR", raising=False)
    monkeypatch.setenv("FLYSERVE_INSTANCE", "blue")
    assert default_state_dir() == Path("/dev/shm/flyserve/blue")
    monkeypatch.delenv("FLYSERVE_INSTANCE")
    assert default_state_dir() == Path("/dev/shm/flyserve/default")
    monkeypatch.setenv("FLYSERVE_STATE_DIR", "/srv/x")
    assert default_state_dir() == Path("/srv/x")
    sd = StateDir("/srv/x")
    assert sd.current_json == Path("/srv/x/control/current.json")
    assert sd.thresholds_yaml == Path("/srv/x/control/thresholds.yaml")
    assert sd.audit_log == Path("/srv/x/audit.jsonl")
    assert (sd.ranks_dir, sd.metrics_dir) == (Path("/srv/x/ranks"), Path("/srv/x/metrics"))


def test_nothing_published_is_version_zero_from_the_profile(tmp_path: Path) -> None:
    p = ControlPlane(tmp_path / "s")
    s = p.snapshot()
    assert (s.version, s.source, s.thresholds) == (0, "default", load_profile("gfx950"))
    assert not (tmp_path / "s").exists(), "reading must not create the state directory"


def test_layers_provenance_and_fallback_to_the_file(plane: ControlPlane, cfg: Path) -> None:
    r = plane.reload(actor="boot", startup=True)
    s = r.snapshot
    assert s.version == 1 and s.source == "file"
    assert s.thresholds.min_seq_len == 2048 and s.thresholds.lpt == "never"
    assert s.provenance["min_seq_len"] == "file" and s.provenance["block_m"] == "profile"
    r = plane.apply_overrides({"min_seq_len": 4096}, actor="alice")
    assert r.changed and r.diff == {"min_seq_len": (2048, 4096)}
    assert r.snapshot.provenance["min_seq_len"] == "override"
    assert r.snapshot.conflicts == {"min_seq_len": {"file": 2048, "override": 4096}}
    # A file edit does not discard the override; the disagreement is reported, and audited.
    cfg.write_text("min_seq_len: 3000\nlpt: never\n")
    r = plane.reload(actor="watcher")
    assert r.snapshot.thresholds.min_seq_len == 4096
    assert dict(r.snapshot.conflicts["min_seq_len"]) == {"file": 3000, "override": 4096}
    assert plane.audit_log()[-1]["conflicts"] == {"min_seq_len": {"file": 3000, "override": 4096}}
    # Clearing the override falls back to the file's (new) value.
    r = plane.unset_overrides(["min_seq_len"], actor="alice")
    assert r.snapshot.thresholds.min_seq_len == 3000 and r.snapshot.provenance["min_seq_len"] == "file"
    assert not r.snapshot.conflicts
    # PATCH with null clears too; PUT replaces the whole override layer.
    plane.apply_overrides({"min_qblock_rows": 16, "lpt": "always"}, actor="bob")
    r = plane.apply_overrides({"lpt": None}, actor="bob")
    assert dict(r.snapshot.overrides) == {"min_qblock_rows": 16}
    r = plane.replace({"decode_rows_base": 4}, actor="bob")
    assert dict(r.snapshot.overrides) == {"decode_rows_base": 4}
    assert r.snapshot.thresholds.min_qblock_rows == Thresholds().min_qblock_rows


def test_same_content_is_not_a_new_version(plane: ControlPlane) -> None:
    v1 = plane.reload(actor="a").snapshot
    assert not plane.reload(actor="b").changed
    r = plane.apply_overrides({"min_seq_len": 2048}, actor="c")  # same value, but a new layer -> new version
    assert r.changed and r.diff == {} and r.snapshot.provenance["min_seq_len"] == "override"
    again = plane.apply_overrides({"min_seq_len": 2048}, actor="c")
    assert not again.changed and again.snapshot.version == r.snapshot.version == v1.version + 1
    assert [s.version for s in plane.history()] == [1, 2]


def test_published_files_agree_and_verify(plane: ControlPlane) -> None:
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    sd = plane.state_dir
    cur = json.loads(sd.current_json.read_text())
    assert cur["version"] == s.version and cur["sha256"] == s.sha256 and "effective_step" in cur
    assert Thresholds.from_yaml_text(sd.thresholds_yaml.read_text()) == s.thresholds
    assert ConfigSnapshot.from_dict(cur) == s
    cur["thresholds"]["min_seq_len"] = 1  # a hand edit that the hash does not cover
    with pytest.raises(ThresholdsError) as ei:
        ConfigSnapshot.from_dict(cur)
    assert ei.value.field == "sha256"
    assert not list(sd.control_dir.glob(".*.tmp")), "no temp file left behind"


def test_rollback_is_a_new_version_with_the_old_values(plane: ControlPlane, cfg: Path) -> None:
    plane.reload(actor="a")  # v1: file
    plane.apply_overrides({"min_qblock_rows": 8}, actor="a")  # v2
    v2 = plane.snapshot()
    plane.apply_overrides({"min_qblock_rows": 99, "lpt": "always"}, actor="a")  # v3
    cfg.write_text("min_seq_len: 5000\n")
    plane.reload(actor="a")  # v4
    r = plane.rollback(2, actor="oncall")
    s = r.snapshot
    assert (s.version, s.source, s.actor) == (5, "rollback", "oncall")
    assert s.thresholds == v2.thresholds
    assert s.conflicts["min_seq_len"] == {"file": 5000, "override": 2048}  # the file moved on: reported
    assert not plane.rollback(2, actor="oncall").changed  # already there
    with pytest.raises(ThresholdsError) as ei:
        plane.rollback(42, actor="oncall")
    assert ei.value.field == "version"


def test_history_keeps_the_last_n(tmp_path: Path) -> None:
    p = ControlPlane(tmp_path / "s", history_keep=3)
    for n in range(6):
        p.apply_overrides({"min_qblock_rows": n}, actor="a")
    assert [s.version for s in p.history()] == [4, 5, 6]
    with pytest.raises(ThresholdsError):
        p.rollback(1, actor="a")


def test_if_match_refuses_a_stale_writer(plane: ControlPlane) -> None:
    v = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot.version
    plane.apply_overrides({"min_qblock_rows": 4}, actor="b", if_match=v)
    with pytest.raises(VersionConflict) as ei:
        plane.apply_overrides({"min_qblock_rows": 5}, actor="c", if_match=v)
    assert (ei.value.expected, ei.value.current) == (v, v + 1)
    assert plane.snapshot().thresholds.min_qblock_rows == 4
    assert plane.audit_log()[-1]["result"] == "conflict"
    for change in (
        lambda: plane.reload(actor="c", if_match=v),
        lambda: plane.set_circuit(True, actor="c", if_match=v),
        lambda: plane.rollback(1, actor="c", if_match=v),
        lambda: plane.replace({}, actor="c", if_match=v),
    ):
        with pytest.raises(VersionConflict):
            change()
    assert plane.snapshot().version == v + 1


def test_dry_run_publishes_nothing(plane: ControlPlane) -> None:
    plane.reload(actor="a")
    before = plane.state_dir.current_json.read_bytes()
    r = plane.apply_overrides({"min_seq_len": 9000}, actor="a", dry_run=True)
    assert r.dry_run and r.changed and r.diff == {"min_seq_len": (2048, 9000)}
    assert plane.state_dir.current_json.read_bytes() == before
    with pytest.raises(ThresholdsError):
        plane.apply_overrides({"min_seq_len": -1}, actor="a", dry_run=True)


def test_decode_path_is_fixed_while_serving_but_not_at_startup(plane: ControlPlane, cfg: Path) -> None:
    plane.reload(actor="a")
    with pytest.raises(DecodePathChangeRefused) as ei:
        plane.apply_overrides({"decode_path": "prefill"}, actor="a")
    assert (
        ei.value.field == "decode_path" and "CUDA graphs" in ei.value.reason and "restart" in ei.value.reason
    )
    assert isinstance(ei.value, ThresholdsError)
    cfg.write_text("decode_path: prefill\n")
    with pytest.raises(DecodePathChangeRefused):
        plane.reload(actor="watcher")
    assert plane.snapshot().thresholds.decode_path == "unified"
    # A restarted server re-reads the file before capturing graphs: that may change it.
    assert plane.reload(actor="startup", startup=True).snapshot.thresholds.decode_path == "prefill"


def test_circuit_breaker_opens_and_closes(plane: ControlPlane) -> None:
    plane.reload(actor="a")
    r = plane.set_circuit(True, actor="rank3", reason="prefill kernel raised RuntimeError")
    assert r.snapshot.circuit_open and r.diff == {"circuit_open": (False, True)}
    assert r.snapshot.circuit_reason.startswith("prefill kernel")
    assert not plane.set_circuit(True, actor="rank1", reason="again").changed
    r = plane.set_circuit(False, actor="oncall")
    assert not r.snapshot.circuit_open and r.snapshot.circuit_reason == ""
    # A rollback restores thresholds, never the circuit's state.
    plane.set_circuit(True, actor="rank3", reason="x")
    assert plane.rollback(1, actor="oncall").snapshot.circuit_open


def rank_report(rank: int, step: int, now: float, **kw: object) -> dict[str, object]:
    """A report as a live RankControl in this process writes it (measured idle rate by default)."""
    from flyserve.control.reports import HOST, PIDNS, own_proc_start

    return {
        "rank": rank,
        "engine": 0,
        "pid": os.getpid(),
        "started": now - 600,
        "step": step,
        "steps_per_s": 0.0,
        "time": now,
        "host": HOST,
        "pidns": PIDNS,
        "proc_start": own_proc_start(),
        **kw,
    }


def test_effective_step_is_past_the_live_ranks_only(tmp_path: Path) -> None:
    p = ControlPlane(tmp_path / "s", step_margin=8, rank_stale_after_s=30)
    now = p._clock()
    p.store.write_rank_report(rank_report(0, 500, now), rank=0)
    p.store.write_rank_report(rank_report(1, 480, now), rank=1)
    p.store.write_rank_report(rank_report(2, 10**9, now - 3600, started=0.0), rank=2)  # long dead
    s = p.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s.effective_step == 508 and s.step_for(0) == 508


def test_an_engine_restart_resets_the_step_floor(tmp_path: Path) -> None:
    """After an engine restart on the same state dir (steps from 0 again, the current version
    loaded at start) a change would otherwise get the old generation's effective_step."""
    p = ControlPlane(tmp_path / "s", step_margin=8, rank_stale_after_s=30)
    now = p._clock()
    p.store.write_rank_report(rank_report(0, 3577, now), rank=0)
    assert p.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot.effective_step == 3585
    p.store.write_rank_report(rank_report(0, 262, now, applied_version=1, started=now - 5), rank=0)
    assert p.apply_overrides({"min_seq_len": 5000}, actor="a").snapshot.effective_step == 270
    # A rank that still has the previous version pending gets no floor from it: the
    # rank applies the newer version at its own step and the pending one with it (RankControl).
    p.store.write_rank_report(rank_report(0, 100, now, applied_version=1, started=now - 5), rank=0)
    assert p.apply_overrides({"min_seq_len": 5100}, actor="a").snapshot.effective_step == 108


@pytest.mark.slow  # a python subprocess (a dead rank)
def test_poisoned_and_dead_rank_reports_do_not_pin_the_effective_step(tmp_path: Path) -> None:
    """A stray ranks/7.json with step 1e9, or Infinity/1e308/1e400
    values, or the report of a process that is gone, must not move effective_step (nor raise)."""
    import subprocess
    import sys

    p = ControlPlane(tmp_path / "s", step_margin=8, rank_stale_after_s=30)
    now = p._clock()
    p.store.write_rank_report(rank_report(0, 100, now), rank=0)
    ranks = p.state_dir.ranks_dir
    (ranks / "7.json").write_text(json.dumps({"rank": 7, "step": 1_000_000_000, "time": now}))
    (ranks / "8.json").write_text(json.dumps(rank_report(8, 10**9, now)))  # 10^9 steps in 600 s
    (ranks / "9.json").write_text(json.dumps(rank_report(9, 5, now)).replace('"step": 5', '"step": Infinity'))
    (ranks / "10.json").write_text(json.dumps(rank_report(10, 5, now, steps_per_s=1e308)))
    (ranks / "11.json").write_text(json.dumps(rank_report(11, 5, now)).replace('"rank": 11', '"rank": 1e400'))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    (ranks / "12.json").write_text(json.dumps(rank_report(12, 50_000, now, pid=int(gone.stdout))))
    s = p.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s.effective_step == 108
    assert p.store.live_ranks(now=now) == 1
    assert p.set_circuit(True, actor="a", reason="x").snapshot.effective_step == 108


def test_a_damaged_current_json_is_replaced_from_history(plane: ControlPlane) -> None:
    v = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    plane.state_dir.current_json.write_text('{"version": 1, "thr')  # torn
    assert plane.snapshot() == v
    r = plane.apply_overrides({"min_qblock_rows": 4}, actor="a")
    assert r.snapshot.version == v.version + 1 and plane.store.read_current() == r.snapshot


def test_unreadable_state_is_an_io_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ControlIOError):
        ControlPlane(blocker).apply_overrides({"min_seq_len": 4096}, actor="a")


def test_a_success_sets_the_last_success_timestamp(plane: ControlPlane) -> None:
    import time

    from flyserve.telemetry.metrics import CONFIG_LAST_SUCCESS

    t0 = time.time()
    plane.apply_overrides({"min_seq_len": 4096}, actor="a")
    (value,) = [s.value for m in CONFIG_LAST_SUCCESS.collect() for s in m.samples]
    assert t0 <= value <= time.time()


def test_effective_step_is_sized_in_time_from_the_ranks_step_rate(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    p = ControlPlane(tmp_path / "s", step_margin=8, lead_s=3.0, clock=lambda: now)
    # Reported half a second ago at 100 steps/s: the rank is at about 1050 by now.
    p.store.write_rank_report(rank_report(0, 1000, now - 0.5, steps_per_s=100.0), rank=0)
    # No rate is believed above twice the engine's slowest (60/s allows 120/s).
    p.store.write_rank_report(rank_report(1, 1040, now, steps_per_s=60.0), rank=1)
    s = p.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s.effective_step == 1050 + 300  # projected step + ceil(100/s * 3 s)


def test_the_first_version_may_not_change_decode_path_under_running_ranks(tmp_path: Path) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("decode_path: prefill\n")
    p = ControlPlane(tmp_path / "s", config_file=cfg)
    p.store.write_rank_report(rank_report(0, 5, p._clock()), rank=0)  # a rank started on gfx950
    with pytest.raises(DecodePathChangeRefused):
        p.reload(actor="late-watcher")
    fresh = ControlPlane(tmp_path / "s2", config_file=cfg)  # nothing running yet: allowed
    assert fresh.reload(actor="startup").snapshot.thresholds.decode_path == "prefill"
