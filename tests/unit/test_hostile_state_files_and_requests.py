"""Hostile files in the state directory and hostile requests to the sidecar and the CLI: a FIFO, a
symlink or an endless file where a rank report, a metrics file, the token file or the audit log
should be; a metrics file with a lying header; thousands of stale rank files; a repeated
Authorization or If-Match header, an undecodable body, a key given twice; control characters in an
actor; state directories made 0700. Each test plants one such input and pins what is done with it
instead of blocking, following the link or answering 500. Blocking reads run in a daemon thread with
a generous deadline, so a reader that blocks fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flyserve.control import ControlPlane
from flyserve.control.state_files import read_json
from flyserve.control.store import Store

DEADLINE_S = 20.0


def finishes(fn: Callable[[], Any], deadline_s: float = DEADLINE_S) -> Any:
    """fn()'s result, or a test failure if it has not returned within ``deadline_s`` (it blocked)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    assert not t.is_alive(), f"{fn} blocked for more than {deadline_s}s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def live_report(rank: int, step: int = 100) -> dict[str, Any]:
    now = time.time()
    return {
        "rank": rank,
        "engine": 0,
        "pid": os.getpid(),
        "host": "",
        "started": now - 10,
        "time": now,
        "step": step,
        "applied_version": 1,
        "steps_per_s": 10.0,
    }


# ---------------------------------------------------------------- a FIFO among the rank reports


def test_read_json_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "9.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        finishes(lambda: read_json(fifo))


def test_a_fifo_in_ranks_is_skipped_and_live_ranks_still_count(tmp_path: Path) -> None:
    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    store = Store(plane.state_dir)
    store.write_rank_report(live_report(0), rank=0)
    os.mkfifo(plane.state_dir.ranks_dir / "9.json")
    assert finishes(lambda: store.live_ranks()) == 1
    v = finishes(lambda: plane.apply_overrides({"min_seq_len": 3000}, actor="t"))
    assert v.changed and v.snapshot.thresholds.min_seq_len == 3000


# ---------------------------------------------------------------- a metrics file with a lying header


def _forged_counter_file(metrics_dir: Path) -> Path:
    """A counter file whose header says 2^31-1 bytes are used; the file holds 4096."""
    metrics_dir.mkdir(parents=True, exist_ok=True)
    f = metrics_dir / "counter_667.db"
    f.write_bytes(struct.pack("i", 2**31 - 1) + b"\0" * 4092)
    return f


def test_a_lying_metrics_header_is_skipped_by_dispatch_stats(tmp_path: Path) -> None:
    from flyserve.sidecar import stats
    from flyserve.telemetry import multiprocess

    _forged_counter_file(tmp_path / "metrics")
    assert stats.read_counters(tmp_path / "metrics") == {}
    assert "counter_667.db" in multiprocess.SKIPPED_FILES


def test_a_lying_metrics_header_is_left_out_of_a_scrape(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from flyserve.telemetry.multiprocess import SoundFilesCollector

    _forged_counter_file(tmp_path / "metrics")
    reg = CollectorRegistry()
    SoundFilesCollector(reg, path=str(tmp_path / "metrics"))
    assert generate_latest(reg) == b""


# ---------------------------------------------------------------- thousands of stale rank files


def test_stale_rank_files_are_capped_and_odd_names_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flyserve.control import rank_files

    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    store = Store(plane.state_dir)
    ranks = plane.state_dir.ranks_dir
    ranks.mkdir(parents=True, exist_ok=True)
    stale = dict(live_report(0), time=time.time() - 3600)
    body = json.dumps(stale)
    old = time.time() - 3600
    for i in range(600):
        f = ranks / f"{i + 10}.json"
        f.write_text(body)
        os.utime(f, (old, old))
    for odd in ("99999.json", "²³.json", "x.json", "1-2-3.json"):
        (ranks / odd).write_text(body)
    store.write_rank_report(live_report(0), rank=0)  # the newest file
    # Count the reads where rank_files looks its reader up (rank_files.read_json_owned).
    reads: list[Path] = []
    real = rank_files.read_json_owned
    monkeypatch.setattr(rank_files, "read_json_owned", lambda p: reads.append(p) or real(p))
    assert store.live_ranks() == 1
    assert reads and len(reads) <= 256
    assert {p.name for p in reads}.isdisjoint({"99999.json", "²³.json", "x.json", "1-2-3.json"})
    assert store.skipped_rank_files >= 600 + 4 - 256


# ---------------------------------------------------------------- a token file that is not a file


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "huge"])
def test_a_token_file_that_is_not_a_small_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    from flyserve.sidecar.settings import TokenError, read_token

    if kind == "fifo":
        f = tmp_path / "token"
        os.mkfifo(f)
    elif kind == "huge":
        f = tmp_path / "token"
        f.write_text("t" * 100_000)
    else:
        f = tmp_path / "token"
        f.symlink_to(kind)
    with pytest.raises(TokenError, match="--token-file") as e:
        finishes(lambda: read_token(f, env={}))
    assert "regular file" in str(e.value) or "larger than" in str(e.value)


def test_a_symlinked_token_file_is_still_read(tmp_path: Path) -> None:
    from flyserve.sidecar.settings import read_token

    (tmp_path / "secret").write_text("s3cr3t-token-value-long-enough-0123456789\n")
    (tmp_path / "token").symlink_to(tmp_path / "secret")
    tok = read_token(tmp_path / "token", env={})
    assert tok is not None and tok.get_secret_value() == "s3cr3t-token-value-long-enough-0123456789"


# ---------------------------------------------------------------- a symlinked audit log


def _plane_with_symlinked_audit(tmp_path: Path) -> tuple[ControlPlane, Path]:
    """A plane with one published change whose audit.jsonl was replaced by a link to a decoy."""
    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="t")
    decoy = tmp_path / "decoy"
    decoy.write_text("precious\n")
    plane.state_dir.audit_log.unlink()
    plane.state_dir.audit_log.symlink_to(decoy)
    return plane, decoy


def test_a_symlinked_audit_log_is_not_followed(tmp_path: Path) -> None:
    plane, decoy = _plane_with_symlinked_audit(tmp_path)
    # The writer holding the lock sets the link aside (never following it) and begins a new log:
    # a planted link must not refuse every change, circuit open included.
    assert plane.set_circuit(True, actor="t", reason="drill").snapshot.circuit_open
    assert decoy.read_text() == "precious\n"
    aside = list(plane.state_dir.audit_log.parent.glob("audit.jsonl.not-regular.*"))
    assert [a.is_symlink() for a in aside] == [True]
    assert not plane.state_dir.audit_log.is_symlink()
    assert [e["result"] for e in plane.audit_log()] == ["success"]


def test_a_symlinked_audit_log_is_not_followed_outside_the_lock(tmp_path: Path) -> None:
    """A line written without the writers' lock (a refused change's) never renames anything: the
    link stays, is not followed, and the entry goes to the process log."""
    from flyserve.control import ControlIOError

    plane, decoy = _plane_with_symlinked_audit(tmp_path)
    assert plane.store.audit({"action": "set", "result": "invalid"}) is False
    assert plane.state_dir.audit_log.is_symlink() and decoy.read_text() == "precious\n"
    with pytest.raises(ControlIOError):
        plane.audit_log()


# ---------------------------------------------------------------- the audit log's readers


def _plane_with_audit(tmp_path: Path) -> ControlPlane:
    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="t")
    plane.state_dir.audit_log.unlink()
    return plane


def test_audit_reads_do_not_follow_a_symlink(tmp_path: Path) -> None:
    """`thresholds audit`, repair and the version floor read audit.jsonl: a symlink to a decoy is
    refused with the file named (read), or witnesses nothing (the floor), never followed."""
    from flyserve.control import ControlIOError

    plane = _plane_with_audit(tmp_path)
    decoy = tmp_path / "decoy.jsonl"
    decoy.write_text(json.dumps({"version": 999, "result": "success", "id": "x"}) + "\n")
    plane.state_dir.audit_log.symlink_to(decoy)
    with pytest.raises(ControlIOError, match="audit log: audit.jsonl: a symlink"):
        plane.audit_log()
    assert plane.store.max_audited_version() == 0  # the decoy's version 999 is not taken
    assert decoy.read_text().count("\n") == 1


def test_audit_reads_refuse_a_fifo(tmp_path: Path) -> None:
    """A FIFO with no writer as audit.jsonl (an open() that blocked for ever): refused at once."""
    from flyserve.control import ControlIOError

    plane = _plane_with_audit(tmp_path)
    os.mkfifo(plane.state_dir.audit_log)
    with pytest.raises(ControlIOError, match="not a regular file"):
        finishes(plane.audit_log)
    assert finishes(plane.store.max_audited_version) == 0


_READ_DEV_ZERO = """
import sys
from pathlib import Path
from flyserve.control import ControlIOError, ControlPlane
plane = ControlPlane(Path(sys.argv[1]), step_margin=8, lead_s=0.0)
assert plane.store.max_audited_version() == 0
try:
    plane.audit_log()
except ControlIOError as exc:
    print("refused:", exc)
"""


@pytest.mark.slow  # a python subprocess
def test_audit_reads_refuse_an_endless_file(tmp_path: Path) -> None:
    """audit.jsonl a symlink to /dev/zero: a plain read reads without end and fills the reader's
    memory (seen: the OOM killer took a 24 GB test process). Run in a child capped at
    1 GiB of address space, so a regression fails this test instead of the machine."""
    import resource
    import subprocess
    import sys

    plane = _plane_with_audit(tmp_path)
    plane.state_dir.audit_log.symlink_to("/dev/zero")
    cap = 1 << 30

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    r = subprocess.run(
        [sys.executable, "-c", _READ_DEV_ZERO, str(plane.state_dir.path)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused: cannot read the audit log: audit.jsonl: a symlink" in r.stdout


def test_a_huge_audit_log_is_read_from_its_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the newest bytes are read (AUDIT_READ_MAX; with a limit, four lines' worth per entry):
    the newest entries come back whole, a line cut by the window is dropped, not half-parsed."""
    from flyserve.control import audit_log

    plane = _plane_with_audit(tmp_path)
    lines = [
        json.dumps({"version": v, "result": "success", "id": f"c{v}", "pad": "x" * 200})
        for v in range(1, 2001)
    ]
    plane.state_dir.audit_log.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(audit_log, "AUDIT_READ_MAX", 10_000)  # about 40 lines of this log
    got = plane.audit_log()
    assert 30 < len(got) < 50
    assert [e["version"] for e in got] == list(range(2001 - len(got), 2001))  # whole, newest, in order
    assert [e["version"] for e in plane.audit_log(5)] == [1996, 1997, 1998, 1999, 2000]
    assert plane.store.max_audited_version() == 2000
    # A window that starts exactly at a line keeps that line (the byte before it ends a line).
    tail = lines[-5:]
    monkeypatch.setattr(audit_log, "AUDIT_READ_MAX", sum(len(x) + 1 for x in tail))
    assert [e["version"] for e in plane.audit_log()] == [1996, 1997, 1998, 1999, 2000]


def test_cli_audit_names_the_refused_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flyserve.cli import app

    plane = _plane_with_audit(tmp_path)
    decoy = tmp_path / "decoy.jsonl"
    decoy.write_text(json.dumps({"version": 7, "result": "success"}) + "\n")
    plane.state_dir.audit_log.symlink_to(decoy)
    r = CliRunner().invoke(app, ["thresholds", "audit", "--state-dir", str(plane.state_dir.path)])
    assert r.exit_code == 2
    assert "audit.jsonl: a symlink" in r.output and "Traceback" not in r.output


# ---------------------------------------------------------------- repeated Authorization / If-Match


TOKEN = "t0ken-for-tests-0123456789"


@pytest.fixture
def sidecar_client(tmp_path: Path):
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    s = SidecarSettings(state_dir=tmp_path, token=SecretStr(TOKEN), share_control_metrics=False,
                        stats_ttl_s=0.0, metrics_ttl_s=0.0)  # fmt: skip
    with TestClient(create_app(s)) as c:
        yield c


def test_skipped_files_are_exported(sidecar_client, tmp_path: Path, monkeypatch) -> None:
    """What the sidecar skipped (a poisoned metrics file, odd or implausible rank reports) is
    exported, not only logged: flyserve_sidecar_ignored_files{kind} on /metrics."""
    from flyserve.telemetry import multiprocess

    monkeypatch.setattr(multiprocess, "SKIPPED_FILES", set())
    _forged_counter_file(tmp_path / "metrics")
    ranks = tmp_path / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    Store(ControlPlane(tmp_path, step_margin=8, lead_s=0.0).state_dir).write_rank_report(
        live_report(0), rank=0
    )
    for odd in ("x.json", "99999.json", "notes.txt"):
        (ranks / odd).write_text("{}")
    (ranks / "3.json").write_text(json.dumps(dict(live_report(3), step=10**15)))  # implausible step
    (ranks / "4.json").write_text("{not json")

    def gauge(kind: str) -> float:
        body = sidecar_client.get("/metrics").text
        line = next(
            ln
            for ln in body.splitlines()
            if ln.startswith(f'flyserve_sidecar_ignored_files{{kind="{kind}"}}')
        )
        return float(line.rsplit(" ", 1)[1])

    assert sidecar_client.get("/dispatch-stats").status_code == 200  # reads the metrics files
    assert gauge("metrics") == 1.0
    assert gauge("rank_reports") == 5.0  # 3 odd names + 1 implausible + 1 unreadable
    (ranks / "4.json").unlink()
    assert gauge("rank_reports") == 4.0  # the last look's count, not a running total


def _broken_entry_counter_file(metrics_dir: Path) -> Path:
    """A counter file with a true header and one entry whose key is not UTF-8."""
    metrics_dir.mkdir(parents=True, exist_ok=True)
    body = struct.pack("i", 50) + b"\xff" * 46
    data = struct.pack("i", 8 + len(body)) + b"\0" * 4 + body
    f = metrics_dir / "counter_669.db"
    f.write_bytes(data + b"\0" * (4096 - len(data)))
    return f


@pytest.mark.slow  # 0.3 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_a_broken_metrics_entry_is_left_out_of_a_scrape(sidecar_client, tmp_path: Path, monkeypatch) -> None:
    """A true header over an entry prometheus_client cannot parse would make every /metrics a 500;
    the file is left out, the rest is scraped, the gauge counts it."""
    from flyserve.telemetry import multiprocess

    monkeypatch.setattr(multiprocess, "SKIPPED_FILES", set())
    assert sidecar_client.get("/metrics").status_code == 200
    _broken_entry_counter_file(tmp_path / "metrics")
    r = sidecar_client.get("/metrics")
    assert r.status_code == 200 and "flyserve_sidecar_requests_total" in r.text
    assert 'flyserve_sidecar_ignored_files{kind="metrics"} 1.0' in r.text
    assert multiprocess.SKIPPED_FILES == {"counter_669.db"}


def test_a_metrics_file_being_created_is_not_counted(tmp_path: Path, monkeypatch) -> None:
    """prometheus_client creates a file, truncates it (a zero header), then writes the header: a
    scrape in between sees no entries, and nothing skipped (it is not a bad file)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from flyserve.sidecar import stats
    from flyserve.telemetry import multiprocess
    from flyserve.telemetry.multiprocess import SoundFilesCollector

    monkeypatch.setattr(multiprocess, "SKIPPED_FILES", set())
    m = tmp_path / "metrics"
    m.mkdir()
    (m / "counter_1.db").write_bytes(b"")
    (m / "counter_2.db").write_bytes(b"\0" * 4096)
    reg = CollectorRegistry()
    SoundFilesCollector(reg, path=str(m))
    assert generate_latest(reg) == b""
    assert stats.read_counters(m) == {}
    assert multiprocess.SKIPPED_FILES == set()


def test_rank_report_gauge_follows_ranks_dir_and_ignores_temp_files(sidecar_client, tmp_path: Path) -> None:
    """ranks/ removed: the last look found nothing to skip (0, not the previous count); a rank's
    own atomic-write temp file (a dot file) is not counted; repair removes an old one."""
    import re

    from flyserve.control.repair import repair

    def gauge() -> float:
        body = sidecar_client.get("/metrics").text
        return float(re.search(r'flyserve_sidecar_ignored_files\{kind="rank_reports"\} (\S+)', body).group(1))

    ranks = tmp_path / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (ranks / f"junk{i}").write_text("x")
    tmp = ranks / ".0.json.abcd.tmp"
    tmp.write_text("{")
    assert gauge() == 3.0
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    report = repair(ControlPlane(tmp_path, step_margin=8, lead_s=0.0))
    assert not tmp.exists() and any("ranks/.0.json.abcd.tmp" in d for d in report.dropped)
    for i in range(3):
        (ranks / f"junk{i}").unlink()
    ranks.rmdir()
    assert gauge() == 0.0


def test_repair_says_what_it_did_when_the_audit_log_is_refused(tmp_path: Path) -> None:
    """A symlinked audit.jsonl: repair still rebuilds current.json, and reports the audit log as not
    read instead of ending in an error that hides the rest."""
    from flyserve.control.repair import repair

    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    for v in (3000, 3001, 3002):
        plane.apply_overrides({"min_seq_len": v}, actor="t")
    plane.state_dir.current_json.unlink()
    plane.state_dir.audit_log.unlink()
    plane.state_dir.audit_log.symlink_to(tmp_path / "decoy")
    report = repair(plane)
    assert plane.state_dir.current_json.exists() and report.version == 3
    assert any("audit log not read" in d and "symlink" in d for d in report.dropped)
    assert not (tmp_path / "decoy").exists()


def test_deeply_nested_json_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """A short audit line or rank report of 1000 '[' (under every size cap): skipped, not a
    RecursionError out of `thresholds audit`, repair or /dispatch-stats."""
    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="t")
    nested = "[" * 100_000 + "]" * 100_000
    with plane.state_dir.audit_log.open("a") as f:
        f.write(nested + "\n")
    assert [e.get("result") for e in plane.audit_log()] == ["success"]
    assert plane.store.max_audited_version() == 1
    ranks = plane.state_dir.ranks_dir
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / "0.json").write_text(nested[:60_000])
    with pytest.raises(ValueError, match="nested too deeply|Expecting"):
        read_json(ranks / "0.json")
    assert plane.store.rank_reports() == [] and plane.store.skipped_rank_files == 1


@pytest.mark.parametrize(
    "headers",
    [
        [("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer wrong")],
        [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {TOKEN}")],
        [("Authorization", f"Bearer {TOKEN}"), ("If-Match", "0"), ("If-Match", "7")],
    ],
)
def test_a_repeated_authorization_or_if_match_is_a_400(sidecar_client, headers) -> None:
    r = sidecar_client.patch("/thresholds", json={"min_seq_len": 3000}, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["field"] in ("Authorization", "If-Match")
    assert sidecar_client.get("/thresholds").json()["version"] == 0  # nothing changed


# ---------------------------------------------------------------- bodies that are not one JSON object


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b"{bad", b'{"min_seq_len": 3000'])
def test_an_undecodable_body_is_a_400(sidecar_client, body: bytes) -> None:
    r = sidecar_client.patch("/thresholds", content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "<body>"


def test_a_key_given_twice_in_a_json_body_is_refused_naming_it(sidecar_client) -> None:
    r = sidecar_client.patch("/thresholds", content=b'{"min_seq_len":1,"min_seq_len":3000}', headers=AUTH)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "min_seq_len"
    assert sidecar_client.get("/thresholds").json()["version"] == 0


# ---------------------------------------------------------------- the CLI's KEY=VALUE, actors, modes


def test_cli_refuses_a_key_given_twice_and_non_decimal_integers() -> None:
    from flyserve.control.cli_common import parse_assignments as _parse_assignments
    from flyserve.policy import ThresholdsError

    with pytest.raises(ThresholdsError, match="min_seq_len.*more than once"):
        _parse_assignments(["min_seq_len=3010", "min_seq_len=3011"])
    for raw in ("0x1000", "0o17"):
        with pytest.raises(ThresholdsError, match="min_seq_len.*decimal"):
            _parse_assignments([f"min_seq_len={raw}"])
    assert _parse_assignments(["min_seq_len=4096", "lpt=auto"]) == {"min_seq_len": 4096, "lpt": "auto"}


def test_control_characters_in_an_actor_are_escaped_by_show_and_history(tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from flyserve.control.cli import register

    app = typer.Typer()
    register(app)
    plane = ControlPlane(tmp_path / "state", step_margin=8, lead_s=0.0)
    plane.apply_overrides({"min_seq_len": 3000}, actor="evil\x1b[2J\x1b[31m[bold]x\n")
    for cmd in ("show", "history"):
        res = CliRunner().invoke(app, ["thresholds", cmd, "--state-dir", str(plane.state_dir.path)])
        assert res.exit_code == 0, res.output
        assert "\x1b" not in res.output
        assert "\\x1b" in res.output


def test_state_dirs_created_by_set_create_and_the_sidecar_are_0700(tmp_path: Path) -> None:
    from flyserve.control.initialise import require_for_write
    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    old = os.umask(0o022)
    try:
        require_for_write(tmp_path / "a" / "state", create=True)
        create_app(SidecarSettings(state_dir=tmp_path / "b" / "state", share_control_metrics=False))
        ControlPlane(tmp_path / "c" / "state").apply_overrides({"min_seq_len": 3000}, actor="t")
    finally:
        os.umask(old)
    for d in ("a", "b", "c"):
        assert (tmp_path / d / "state").stat().st_mode & 0o777 == 0o700, d
