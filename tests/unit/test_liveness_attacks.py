"""In one process: forged rank reports must not pin the effective step
(and its bound holds whatever they say), the rank-report reader cannot be gamed by mtimes or
names, and `repair` judges an unfinished publish by what records it, not by its history file.
The same attacks against the real simulator and sidecar: tests/integration/test_liveness_attacks_live.py."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _rank_liveness
import pytest
from _rank_liveness import CLOCK, LEAD_S, STEP_MARGIN, forged_report

from flyserve.control import ControlPlane
from flyserve.control.effective import CONSENSUS_S, CONSENSUS_STEPS, plan_steps
from flyserve.control.reports import HOST, PIDNS, RankReport, own_proc_start, parse_report, proc_start_ticks

# The frozen clock, the plane on it and a live non-rank process (shared with
# test_liveness_confirms_the_ranks_own_process.py): bound here so that pytest finds them.
frozen_clock = _rank_liveness.frozen_clock
plane = _rank_liveness.plane
other_process = _rank_liveness.other_process


def real_report(rank: int, *, step: int = 2000, rate: float | None = 20.0, **over: Any) -> dict[str, Any]:
    """As a rank of this process writes it: this host, this pid namespace, a live pid."""
    now = CLOCK.now
    d = {"pid": os.getpid(), "host": HOST, "pidns": PIDNS, "proc_start": own_proc_start(), "rank": rank, "engine": 0,
         "started": now - 100.0, "step": step, "steps_per_s": rate, "applied_version": 0, "time": now}  # fmt: skip
    d.update(over)
    return d


def bound_steps(step: int, rate: float) -> int:
    """effective.py's bound for an honest rank at ``step`` (projected to now) stepping at ``rate``."""
    return (
        step
        + math.ceil(rate * CONSENSUS_S)
        + max(STEP_MARGIN, CONSENSUS_STEPS)
        + max(STEP_MARGIN, math.ceil(2 * rate * LEAD_S))
    )


# ---------------------------------------------------------------- liveness: what the process table says


@pytest.mark.slow  # python subprocesses (live and dead pids)
def test_liveness_is_confirmed_only_by_the_process_table(tmp_path: Path, other_process: int) -> None:
    from flyserve.control.reports import Liveness, is_live, liveness

    now = CLOCK.now

    def rep(**over: Any) -> RankReport:
        r = parse_report(real_report(0, **over), now=now, file_uid=over.pop("uid", os.getuid()))
        assert r is not None
        return r

    assert liveness(rep(), now=now, stale_after_s=30) is Liveness.CONFIRMED
    assert liveness(rep(host="elsewhere"), now=now, stale_after_s=30) is Liveness.UNCONFIRMED
    assert liveness(rep(pidns="pid:[1]"), now=now, stale_after_s=30) is Liveness.UNCONFIRMED
    assert liveness(rep(time=now - 31), now=now, stale_after_s=30) is Liveness.GONE
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    assert liveness(rep(pid=dead.pid), now=now, stale_after_s=30) is Liveness.GONE
    # A pid that is alive but run by another uid than the file's owner is not the rank's.
    r = parse_report(
        real_report(0, pid=other_process, proc_start=proc_start_ticks(other_process)),
        now=now,
        file_uid=os.getuid() + 1,
    )
    assert r is not None and liveness(r, now=now, stale_after_s=30) is Liveness.UNCONFIRMED
    # The stable entry point other modules call (shape samples from live ranks only).
    far = rep(host="elsewhere")
    assert is_live(far, now=now, stale_after_s=30) and not is_live(
        far, now=now, stale_after_s=30, confirmed_only=True
    )
    assert is_live(rep(), now=now, stale_after_s=30, confirmed_only=True)


# ---------------------------------------------------------------- forged reports do not pin


def test_forged_reports_from_another_host_do_not_move_the_step_of_confirmed_ranks(
    plane: ControlPlane,
) -> None:
    """Three plausible forgeries outvoted two real ranks: effective_step near 1e11 (was)."""
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r), rank=r)
    for r in (2, 3, 4):
        plane.store.write_rank_report(forged_report(r), rank=r)
    res = plane.set_circuit(True, actor="a", reason="forged")
    assert 2000 < res.snapshot.effective_step <= 2000 + max(STEP_MARGIN, math.ceil(20 * LEAD_S))
    entry = plane.audit_log()[-1]
    assert entry["ranks"] == {"confirmed": 2, "unconfirmed": 3, "unconfirmed_ignored": 3}


@pytest.mark.slow  # python subprocesses (live and dead pids)
def test_local_forgeries_with_live_pids_are_capped_within_the_bound(
    plane: ControlPlane, other_process: int
) -> None:
    """A forger on this host, as the ranks' user, naming a live pid: confirmed like a rank, so only
    the anchor at the lowest rank bounds it - within the documented bound, however many."""
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r), rank=r)
    for r in range(2, 12):
        forged = real_report(
            r,
            pid=other_process,
            step=10**9,
            rate=10_000.0,
            started=CLOCK.now - 200_000,
            proc_start=proc_start_ticks(other_process),
        )
        plane.store.write_rank_report(forged, rank=r)
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert 2000 < s.effective_step <= bound_steps(2000, 20.0), s.effective_step


def test_with_only_unconfirmed_ranks_the_bound_still_holds(plane: ControlPlane) -> None:
    """Ranks in another pid namespace (a container that does not share it): none confirmed; the
    forgeries are as unconfirmed as they are, and the lowest rank still anchors the step."""
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r, pidns="pid:[4026531999]"), rank=r)
    for r in (2, 3, 4):
        plane.store.write_rank_report(forged_report(r), rank=r)
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert 2000 < s.effective_step <= bound_steps(2000, 20.0), s.effective_step


@pytest.mark.slow  # 0.4 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_the_bound_holds_for_any_forged_reports() -> None:
    """effective.py's bound, over random sets of forged reports (any step, rate, class, engine)
    next to one honest rank: effective_step <= its projection + the bound."""
    rng = random.Random(22)
    now = 1_800_000_000.0

    def mk(rank: int, step: int, rate: float | None, host: str, age: float) -> RankReport:
        d = {"pid": os.getpid(), "host": host, "pidns": PIDNS, "proc_start": own_proc_start(), "rank": rank, "engine": 0,
             "started": now - 10**6, "step": step, "steps_per_s": rate, "time": now - age}  # fmt: skip
        r = parse_report(d, now=now)
        assert r is not None
        return r

    forged_rates = [None, 0.0, 5.0, 10_000.0]
    for _ in range(500):
        rate = rng.choice([0.0, 1.0, 10.0, 200.0, 2000.0, None])
        age = rng.uniform(0, 2)
        honest_host = rng.choice([HOST, "far"])
        honest = mk(0, rng.randrange(0, 10**6), rate, honest_host, age)
        # A forgery the process table confirms (naming a live pid of the reader's uid, in a file of
        # a trusted uid) is the ranks' own user: out of scope when the honest rank is unconfirmed
        # (docs/operations.md, "Where the bound does not hold"); next to a confirmed honest rank it
        # is capped by it.
        hosts = [HOST, "x"] if honest_host == HOST else ["x"]
        forged = [
            mk(
                r,
                rng.randrange(0, 10**10),
                rng.choice(forged_rates),
                rng.choice(hosts),
                rng.uniform(0, 29),
            )
            for r in range(1, rng.randrange(2, 40))
        ]
        plan = plan_steps(
            [honest, *forged], now=now, stale_after_s=30, step_margin=STEP_MARGIN, lead_s=LEAD_S
        )
        r = 500.0 if rate is None else rate
        p = honest.step + math.ceil(r * age)
        assert plan.engine_steps["0"] <= bound_steps(p, r), (rate, age, plan)


def test_unconfirmed_reports_with_a_low_step_or_a_slow_rate_do_not_pull_a_confirmed_engine_down() -> None:
    """Two confirmed ranks at step ~10,000 and 50 steps/s; forged reports "from another host" at
    step 0 or with a rate of 0.001 steps/s. Was: the lowest projection of every live rank anchored
    the engine, so the change's step landed far in the past (each rank applied at its own next
    step: not one step; seen in benchmarks/bench_sidecar_under_attack.py). Now an engine with a
    confirmed rank is planned from its confirmed ranks alone: exactly as without the forgeries."""
    now = 1_800_000_000.0

    def mk(rank: int, step: int, rate: float | None, host: str) -> RankReport:
        d = {"pid": os.getpid(), "host": host, "pidns": PIDNS, "proc_start": own_proc_start(), "rank": rank,
             "engine": 0, "started": now - 600, "step": step, "steps_per_s": rate, "time": now - 0.5}  # fmt: skip
        r = parse_report(d, now=now)
        assert r is not None
        return r

    honest = [mk(0, 10_000, 50.0, HOST), mk(1, 10_010, 50.0, HOST)]
    kw = {"now": now, "stale_after_s": 30, "step_margin": STEP_MARGIN, "lead_s": LEAD_S}
    alone = plan_steps(honest, **kw).engine_steps["0"]
    for forged in (
        [mk(2, 0, 50.0, "x")],
        [mk(2, 10_000, 0.001, "x")],
        [mk(r, 0, 0.001, "x") for r in (2, 3, 4)],
    ):
        plan = plan_steps([*honest, *forged], **kw)
        assert plan.engine_steps["0"] == alone, (forged, plan)
        assert plan.unconfirmed_ignored == len(forged)
    assert alone >= 10_010 + math.ceil(50.0 * 0.5) + math.ceil(50.0 * LEAD_S)


def test_a_forgery_over_a_live_ranks_own_file_contradicts_its_history(tmp_path: Path) -> None:
    """Rank 0's own file rewritten with its confirmed pid and start time but a step 1e9: the reader
    saw that process at step 2000 a moment ago, so the report is refused (replaced by the rank's last
    credible report, so the rank stays live at its own step), and its next own report is believed."""
    now = [time.time()]
    plane = ControlPlane(tmp_path / "state", step_margin=STEP_MARGIN, lead_s=LEAD_S, clock=lambda: now[0])
    started = now[0] - 200_000  # so that step 1e9 passes parse_report's own limit
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r, started=started, time=now[0]), rank=r)
    assert [r.step for r in plane.store.reports(now=now[0])] == [2000, 2000]
    now[0] += 1.0
    plane.store.write_rank_report(real_report(0, started=started, step=10**9, time=now[0]), rank=0)
    assert sorted((r.rank, r.step) for r in plane.store.reports(now=now[0])) == [(0, 2000), (1, 2000)]
    assert plane.store.skipped_rank_files == 1
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s.effective_step == 2000 + 20 + math.ceil(20 * LEAD_S)  # rank 1 projected 1 s on: as without it
    now[0] += 1.0
    plane.store.write_rank_report(real_report(0, started=started, step=2020, time=now[0]), rank=0)
    assert sorted(r.step for r in plane.store.reports(now=now[0])) == [2000, 2020]


def test_a_forged_applied_version_does_not_exhaust_version_numbers(plane: ControlPlane) -> None:
    """A report "from another host" claiming version 10**18 - 1 applied, next to confirmed ranks:
    the next version was 10**18, refused as exhausted - every change refused while it stayed."""
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r), rank=r)
    plane.store.write_rank_report(forged_report(2, applied_version=10**18 - 1), rank=2)
    assert plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot.version == 1


# ---------------------------------------------------------------- the reader is not gamed by mtimes


def test_files_dated_ahead_do_not_push_live_ranks_out(plane: ControlPlane) -> None:
    ranks = plane.state_dir.ranks_dir
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r), rank=r)
    ahead = time.time() + 3600
    for i in range(300):
        f = ranks / f"{1000 + i}.json"
        f.write_text('{"garbage": ' + str(i) + "}")
        os.utime(f, (ahead, ahead))
    assert plane.store.live_ranks() == 2  # was 0: the 256 "newest" were all garbage
    s = plane.apply_overrides({"min_seq_len": 4096}, actor="a").snapshot
    assert s.effective_step > 2000  # was below the ranks' steps: each applied at its own
    assert plane.store.skipped_rank_files >= 300


def test_fresh_garbage_under_valid_names_is_read_after_the_ranks(plane: ControlPlane) -> None:
    """Names and mtimes are anyone's: 600 files touched 'now' under rank names, and names that are
    not the writer's (leading zeros, an engine-0 prefix, a report under another rank's name)."""
    ranks = plane.state_dir.ranks_dir
    for r in (0, 1):
        plane.store.write_rank_report(real_report(r), rank=r)
    for i in range(600):
        (ranks / f"{7 + i % 9}-{20 + i}.json").write_text(json.dumps(forged_report(20 + i)))
    for name in ("00.json", "0-1.json", "01.json"):
        (ranks / name).write_text(json.dumps(real_report(1, step=10**6)))
    (ranks / "5.json").write_text(json.dumps(real_report(0, step=10**6)))  # rank 0's under 5's name
    got = sorted((r.rank, r.step) for r in plane.store.reports() if r.step < 10**6)
    assert got == [(0, 2000), (1, 2000)]
    assert all(r.step < 10**6 for r in plane.store.reports())


# ---------------------------------------------------------------- repair's verdict on an unfinished publish


def _drop_success_line(plane: ControlPlane, version: int) -> None:
    """As if the writer of ``version`` was killed after current.json, before its completion line."""
    log = plane.state_dir.audit_log
    lines = log.read_text().splitlines(keepends=True)
    keep = [ln for ln in lines if not (json.loads(ln).get("version") == version and '"success"' in ln)]
    assert len(keep) == len(lines) - 1
    log.write_text("".join(keep))


def test_a_version_in_force_whose_history_was_pruned_is_not_recorded_abandoned(tmp_path: Path) -> None:
    from flyserve.control.repair import repair

    plane = ControlPlane(tmp_path / "state", history_keep=2)
    for n in (2000, 3000, 4000):  # v1..v3; v3's writer "killed" before its success line
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    _drop_success_line(plane, 3)
    for n in (5000, 6000, 7000):  # v4 is computed from v3; history keeps v5, v6 only
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    assert not plane.store.history_file_exists(3)
    repair(plane)
    completions = [e for e in plane.store.read_audit(raw=True) if e.get("recovered")]
    assert [(e["version"], e["result"]) for e in completions] == [(3, "success")]  # was "abandoned"


def test_a_version_never_in_force_whose_history_file_stayed_is_abandoned(tmp_path: Path) -> None:
    """The other half: a writer killed after the history file, before current.json; the next writer
    numbers above it (never making it current). Its history file exists below current."""
    from flyserve.control import snapshot_files
    from flyserve.control.repair import repair

    plane = ControlPlane(tmp_path / "state")
    plane.apply_overrides({"min_seq_len": 2000}, actor="a")
    real = snapshot_files.atomic_write

    def killed_after_history(path: Path, data: Any, **kw: Any) -> None:
        real(path, data, **kw)
        if path.parent.name == "history":
            raise KeyboardInterrupt  # stands in for kill -9: nothing after it runs

    snapshot_files.atomic_write = killed_after_history
    try:
        with pytest.raises(KeyboardInterrupt):
            plane.apply_overrides({"min_seq_len": 3000}, actor="doomed")
    finally:
        snapshot_files.atomic_write = real
    assert plane.snapshot().version == 1 and plane.store.history_file_exists(2)
    assert plane.apply_overrides({"min_seq_len": 4000}, actor="a").snapshot.version == 3
    repair(plane)
    completions = [e for e in plane.store.read_audit(raw=True) if e.get("recovered")]
    assert [(e["version"], e["result"]) for e in completions] == [(2, "abandoned")]  # was "success"
