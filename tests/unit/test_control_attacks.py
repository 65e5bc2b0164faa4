"""The control plane under attack and careless operation. Each test names the attack it reproduces
and pins what the control plane does instead of what the attack would make it do."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from flyserve.control import ControlIOError, ControlPlane, VersionConflict
from flyserve.policy import Thresholds, ThresholdsError
from flyserve.thresholds_files import load_profile

MAX_AUDIT_LINE = 8192  # flyserve.control.audit_log.MAX_AUDIT_LINE (checked in the test that uses it)


def repair(plane: ControlPlane):  # imported late: each test fails on its own before the fix
    from flyserve.control.repair import repair as run

    return run(plane)


def parse_mapping(text: str) -> dict:

    from flyserve.policy.safe_yaml import parse_mapping as parse_yaml_mapping

    return parse_yaml_mapping(text)


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)


# ---------------------------------------------------------------- versions only go up


def test_a_deleted_current_json_does_not_restart_versions_or_lose_layers(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2048}, actor="a")
    v2 = plane.apply_overrides({"lpt": "never"}, actor="a").snapshot
    first = plane.state_dir.history_file(1).read_bytes()
    plane.state_dir.current_json.unlink()
    r = plane.apply_overrides({"min_qblock_rows": 4}, actor="a").snapshot
    assert r.version == v2.version + 1  # not 1 again
    assert plane.state_dir.history_file(1).read_bytes() == first  # never overwritten
    assert dict(r.overrides) == {"min_seq_len": 2048, "lpt": "never", "min_qblock_rows": 4}


def test_truncated_current_and_no_history_still_serves_and_publishes_above(plane: ControlPlane) -> None:
    for n in (2048, 3000, 4000):
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    plane.state_dir.current_json.write_text('{"version": 3, "thr')
    for f in plane.state_dir.history_dir.iterdir():
        f.unlink()
    s = plane.snapshot()  # used to raise ControlIOError (503 for ever)
    assert s.version == 3 and s.thresholds == load_profile("gfx950")  # numbered from the audit log
    r = plane.apply_overrides({"min_seq_len": 5000}, actor="a").snapshot
    assert r.version == 4 and plane.store.read_current() == r


def test_one_garbage_history_file_does_not_hide_the_rest(plane: ControlPlane) -> None:
    for n in (2048, 3000):
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    plane.state_dir.history_file(1).write_text("garbage")
    assert [s.version for s in plane.history()] == [2]


def test_repair_rebuilds_current_sets_aside_garbage_and_says_what_it_dropped(plane: ControlPlane) -> None:
    for n in (2048, 3000, 4000):
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    plane.state_dir.current_json.write_text("{")
    plane.state_dir.history_file(3).write_text("garbage")
    (plane.state_dir.control_dir / ".current.json.abc.tmp").write_text("x")
    report = repair(plane)
    assert report.version == 2 and plane.store.read_current().version == 2
    assert any("rebuilt it from history version 2" in a for a in report.actions)
    assert any("history version 3" in d for d in report.dropped)
    assert any("temp file" in d for d in report.dropped)
    assert not list(plane.state_dir.control_dir.glob(".*.tmp"))
    assert (plane.state_dir.history_dir / "00000003.json.bad").exists()
    assert plane.apply_overrides({"min_seq_len": 5000}, actor="a").snapshot.version == 4  # above the bad one
    assert plane.audit_log()[-2]["action"] == "repair"
    assert not repair(plane).changed


def test_repair_with_nothing_readable_publishes_the_profile_above_every_audited_version(
    plane: ControlPlane,
) -> None:
    for n in (2048, 3000):
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    plane.state_dir.current_json.write_text("")
    for f in plane.state_dir.history_dir.iterdir():
        f.unlink()
    report = repair(plane)
    assert report.version == 3 and any("override" in d for d in report.dropped)


def test_orphan_history_is_removed_and_a_write_ahead_entry_is_completed(plane: ControlPlane) -> None:
    """What a writer killed mid-publish leaves (the kill itself: tests/integration/test_control_attacks_live.py)."""
    v1 = plane.apply_overrides({"min_seq_len": 2048}, actor="a").snapshot
    orphan = v1.replace(version=2)
    plane.state_dir.history_file(2).write_text(orphan.to_json())
    plane.store.audit({"id": "w1", "action": "set", "result": "publishing", "version": 2})
    plane.store.audit({"id": "w0", "action": "set", "result": "publishing", "version": 1})
    report = repair(plane)
    assert not plane.state_dir.history_file(2).exists()
    raw = plane.store.read_audit(raw=True)
    done = {e["id"]: e["result"] for e in raw if e.get("recovered")}
    assert done == {"w1": "abandoned", "w0": "success"}
    assert report.changed


# ---------------------------------------------------------------- YAML and numbers


def test_a_yaml_bomb_is_refused_at_once_with_a_small_message(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    bomb = "\n".join(lines) + "\n"
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(bomb)
    p = ControlPlane(tmp_path / "s", config_file=cfg)
    t0 = time.monotonic()
    with pytest.raises(ThresholdsError) as e:
        p.reload(actor="w")
    assert time.monotonic() - t0 < 30  # generous: the unfixed loader never returned
    assert "aliases" in str(e.value) and len(str(e.value)) < 1000
    assert len(json.dumps(p.audit_log()[-1])) < 2000


def test_huge_and_out_of_range_integers_are_refused_naming_the_field(
    plane: ControlPlane, tmp_path: Path
) -> None:
    with pytest.raises(ThresholdsError) as e:
        parse_mapping("min_seq_len: " + "9" * 5000 + "\n")
    assert "5000 digits" in str(e.value) and len(str(e.value)) < 1000
    for key in ("block_m", "max_seq_len", "decode_ctx_unit"):
        with pytest.raises(ThresholdsError) as e:
            plane.apply_overrides({key: 2**70}, actor="a")
        assert e.value.field == key
    with pytest.raises(ThresholdsError) as e:
        plane.apply_overrides({"min_seq_len": 10**5000}, actor="a")
    assert e.value.field == "min_seq_len" and len(str(e.value)) < 1000
    assert plane.audit_log()[-1]["result"] == "invalid"  # audited, not a traceback


def test_smaller_sexagesimal_and_duplicate_keys(tmp_path: Path) -> None:
    with pytest.raises(ThresholdsError) as e:
        Thresholds.from_yaml_text("min_seq_len: 25:36\n")
    assert "min_seq_len" in str(e.value)  # a string, not 1536
    with pytest.raises(ThresholdsError) as e:
        Thresholds.from_yaml_text("min_seq_len: 2048\nmin_seq_len: 4096\n")
    assert "duplicate key 'min_seq_len'" in str(e.value)
    assert parse_mapping("lpt: no\n") == {"lpt": "no"}  # YAML 1.1 would say False


def test_smaller_a_huge_string_value_makes_a_bounded_audit_line(plane: ControlPlane) -> None:
    with pytest.raises(ThresholdsError) as e:
        plane.apply_overrides({"lpt": "x" * 50_000_000}, actor="a")
    assert len(str(e.value)) < 1000
    from flyserve.control.audit_log import MAX_AUDIT_LINE as limit

    assert limit == MAX_AUDIT_LINE
    line = plane.state_dir.audit_log.read_text().splitlines()[-1]
    assert len(line) < MAX_AUDIT_LINE and json.loads(line)["request"]["lpt"] == "a string of 50000000 chars"
    long_actor = plane.store.audit({"actor": "a", "request": {"k": ["y" * 100] * 1000}})
    assert long_actor and len(plane.state_dir.audit_log.read_text().splitlines()[-1]) < MAX_AUDIT_LINE


def test_smaller_a_dry_run_with_a_stale_if_match_is_not_audited(plane: ControlPlane) -> None:
    plane.apply_overrides({"min_seq_len": 2048}, actor="a")
    before = len(plane.audit_log())
    with pytest.raises(VersionConflict):
        plane.apply_overrides({"min_seq_len": 4096}, actor="a", if_match=0, dry_run=True)
    assert len(plane.audit_log()) == before


# ---------------------------------------------------------------- files that are not config files


def test_a_symlink_to_a_secrets_file_never_echoes_its_content(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = tmp_path / "shadow"
    secret.write_text(
        "block_m: SECRET_hash_6aef09d1c2\nSECRET$6$line:of:root: x\n"
        "daemon: $6$SECRETsalt$hashhashhash:19000:0:99999:7:::\n"
    )
    link = tmp_path / "flyserve.yaml"
    link.symlink_to(secret)
    p = ControlPlane(tmp_path / "s", config_file=link)
    with caplog.at_level(logging.DEBUG), pytest.raises(ThresholdsError) as e:
        p.reload(actor="w")
    assert "SECRET" not in str(e.value)
    assert "SECRET" not in p.state_dir.audit_log.read_text()
    assert "SECRET" not in caplog.text
    assert p.state_dir.audit_log.stat().st_mode & 0o007 == 0  # not world-readable


def test_a_fifo_or_directory_is_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    p = ControlPlane(tmp_path / "s", config_file=fifo)
    with pytest.raises(ThresholdsError) as e:
        p.reload(actor="w")  # the unfixed reader blocked here for ever
    assert "not a regular file" in str(e.value)
    with pytest.raises(ThresholdsError):
        ControlPlane(tmp_path / "s", config_file=tmp_path).reload(actor="w")


def test_a_huge_config_file_is_refused_without_taking_the_lock(tmp_path: Path) -> None:
    cfg = tmp_path / "big.yaml"
    with open(cfg, "w") as f:
        f.write("min_seq_len: 2048\n")
        f.write(("#" * 1023 + "\n") * (3 * 1024))  # 3 MiB of comments
    p = ControlPlane(tmp_path / "s", config_file=cfg)
    with pytest.raises(ThresholdsError) as e:
        p.reload(actor="w")
    assert "larger than" in str(e.value)


def test_io_errors_are_control_io_errors_not_tracebacks(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ControlIOError):
        ControlPlane(blocker / "sub").apply_overrides({"min_seq_len": 2048}, actor="a")
