"""The real sidecar (uvicorn, subprocess, 127.0.0.1, free port) with `flyserve simulate` behind it.

Checks what the sidecar reports against what the simulated ranks decided, recomputed here with
decide() over the same workload trace and the thresholds history (old values before the
effective step, new ones from it).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from _live_sidecar import start_sidecar, stop_process
from _live_sidecar import wait_for as _wait_for

from flyserve.lab.workloads import workload
from flyserve.policy import BatchShape, Thresholds, decide
from flyserve.thresholds_files import load_profile

pytestmark = pytest.mark.integration

TOKEN = "integration-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STEP_MARGIN = 150  # the least margin; the control plane also sizes it by the ranks' step rate


@dataclass
class Sidecar:
    url: str
    state: Path
    proc: subprocess.Popen
    log: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0)


def _stop(proc: subprocess.Popen) -> None:
    stop_process(proc, term_wait_s=15, kill_wait_s=5)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    sc = start_sidecar(tmp_path, TOKEN, "--stale-after", "2", "--stream-interval", "0.5",
                       "--step-margin", str(STEP_MARGIN), timeout=60)  # fmt: skip
    try:
        yield Sidecar(sc.url, sc.state, sc.proc, sc.log)
    finally:
        _stop(sc.proc)


def start_simulate(state: Path, *, ranks: int, name: str, steps: int, interval: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flyserve.cli", "simulate", "--state-dir", str(state), "--ranks", str(ranks),
           "--workload", name, "--steps", str(steps), "--step-interval", str(interval)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


wait_for = functools.partial(_wait_for, every=0.2)


def expected_decisions(name: str, steps: int, switches: list[tuple[int, Thresholds]]) -> collections.Counter:
    """decide() over the trace, with the thresholds in force at each step (switches sorted by step)."""
    trace = workload(name)
    out: collections.Counter = collections.Counter()
    for s in range(steps):
        t = [th for at, th in switches if at <= s][-1]
        ts = trace[s % len(trace)]
        d = decide(
            BatchShape.from_query_lens(ts.query_lens, max_seq_len=ts.max_seq_len, num_heads=16, thresholds=t),
            t,
        )
        out[(d.path, d.reason)] += 1
    return out


def _pause_ranks(stats: dict) -> list[int]:
    """SIGSTOP every rank process of the stats (checked to be our simulator's); their pids."""
    pids = [r["pid"] for r in stats["ranks"]]
    for pid in pids:
        assert b"flyserve.sim.simulate" in Path(f"/proc/{pid}/cmdline").read_bytes()
        os.kill(pid, signal.SIGSTOP)
    return pids


def _resume(pids: list[int]) -> None:
    while pids:
        try:
            os.kill(pids.pop(), signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_stats_match_decisions_and_patch_switches_all_ranks_at_one_step(sidecar: Sidecar):
    name, steps, ranks = "seed-60k-c32", 800, 3
    sim = start_simulate(sidecar.state, ranks=ranks, name=name, steps=steps, interval=0.02)
    paused: list[int] = []
    try:
        with sidecar.client() as c:

            def ranks_past(n: int):
                s = c.get("/dispatch-stats").json()
                live = [r for r in s["ranks"] if not r["stale"]]
                return s if len(live) == ranks and min(r["step"] or 0 for r in live) >= n else None

            seen = wait_for(lambda: ranks_past(70), timeout=60, what="3 ranks past step 70")
            # Hold the ranks (SIGSTOP) while the change is made, so where they are when it is published
            # does not depend on how fast this machine answers HTTP: the second wave's prefill batches
            # (steps 601..661) always come after the effective step.
            paused = _pause_ranks(seen)
            # A dry run: the diff and the routing change on recent shapes; nothing applied.
            r = c.patch("/thresholds", params={"dry_run": "true"}, json={"min_seq_len": 65536},
                        headers=AUTH | {"If-Match": "0"})  # fmt: skip
            assert r.status_code == 200, r.text
            dry = r.json()
            assert dry["dry_run"] and dry["diff"] == {"min_seq_len": [1536, 65536]}
            rc = dry["routing_change"]
            # Which recent steps the sample holds depends on timing; what the change does to them does
            # not: every context of this workload is < 65536, so each prefill batch would flip, and
            # nothing else would change.
            assert rc["samples"] > 0, rc
            assert rc["proposed"] == {"unified": rc["samples"], "prefill": 0}, rc
            assert rc["changed"] == rc["current"]["prefill"], rc
            assert set(rc["transitions"]) <= {"prefill/admitted -> unified/short_context"}, rc
            assert c.get("/thresholds").json()["version"] == 0
            assert c.get("/thresholds/history").json()["entries"] == []

            r = c.patch("/thresholds", json={"min_seq_len": 65536}, headers=AUTH | {"If-Match": "0"})
            assert r.status_code == 200, r.text
            snap = r.json()["thresholds"]
            assert snap["version"] == 1
            effective = snap["effective_step"]
            _resume(paused)
            held_at = max(r["step"] for r in seen["ranks"])
            assert held_at + STEP_MARGIN <= effective < 601, (held_at, effective)

        out, _ = sim.communicate(timeout=120)
        assert sim.returncode == 0, out
        assert "simulate: done" in out

        with sidecar.client() as c:
            # A page computed after the ranks' last reports: the cache may serve one up to its TTL
            # plus the refresher's grace (2 s) old on a busy machine (sidecar/cache.py).
            s = wait_for(
                lambda: (
                    (p := c.get("/dispatch-stats").json())["ranks"]
                    and len(p["ranks"]) == ranks
                    and all(rv["step"] == steps - 1 for rv in p["ranks"])
                    and p
                ),
                timeout=15,
                what="a page with every rank's last step",
            )
            time.sleep(3.5)  # past the /metrics TTL and its grace: a body computed after the last reports
            metrics_text = c.get("/metrics").text
    finally:
        _resume(paused)
        _stop(sim)

    # Every rank switched at the same step, the one the control plane chose.
    assert len(s["ranks"]) == ranks
    for rv in s["ranks"]:
        assert (rv["applied_version"], rv["applied_step"], rv["step"]) == (1, effective, steps - 1), rv
    # The ranks have finished: on a loaded machine their last reports may already be stale, and then
    # nobody is live to agree (null), not "true" by default.
    assert s["ranks_agree"] is (True if s["live_ranks"] else None), (s["live_ranks"], s["ranks_agree"])

    old = load_profile("gfx950")
    new = old.merged({"min_seq_len": 65536})
    exp = expected_decisions(name, steps, [(0, old), (effective, new)])
    totals = s["totals"]
    assert totals["batches"] == steps  # one engine: each step counted once, not once per rank
    for reason in totals["reasons"]:
        assert totals["reasons"][reason] == sum(v for (_, r), v in exp.items() if r == reason), reason
    for path in ("unified", "prefill"):
        assert totals["decisions"][path] == sum(v for (p, _), v in exp.items() if p == path), path
    exp_prefill = sum(v for (p, _), v in exp.items() if p == "prefill")
    assert totals["prefill_ratio"] == pytest.approx(exp_prefill / steps)
    # What the policy predicts from the switch on: no prefill batch (every context < 65536), so all
    # prefill batches of the run are the ones before the effective step.
    before = expected_decisions(name, effective, [(0, old)])
    assert exp_prefill == sum(v for (p, _), v in before.items() if p == "prefill") > 0
    assert totals["reasons"]["short_context"] > 0
    # Each rank's own counters are identical (TP ranks decide the same).
    assert all(rv["totals"] == s["ranks"][0]["totals"] for rv in s["ranks"])
    # The 60 s window covers the whole short run.
    assert s["windows"]["60s"]["batches"] == steps
    # /metrics carries the ranks' counters with the same numbers.
    line = (
        f'flyserve_dispatch_decisions_total{{path="prefill",rank="0",reason="admitted"}} {float(exp_prefill)}'
    )
    assert line in metrics_text
    assert "flyserve_sidecar_requests_total" in metrics_text


def test_killed_rank_is_stale_not_an_error(sidecar: Sidecar):
    sim = start_simulate(sidecar.state, ranks=2, name="seed-8k-c8", steps=3000, interval=0.02)
    try:
        with sidecar.client() as c:

            def both_live():
                s = c.get("/dispatch-stats").json()
                return s if s["live_ranks"] == 2 else None

            s = wait_for(both_live, timeout=60, what="2 live ranks")
            victim = next(r for r in s["ranks"] if r["rank"] == 1)
            cmdline = Path(f"/proc/{victim['pid']}/cmdline").read_bytes()
            assert b"flyserve.sim.simulate" in cmdline  # only ever kill our own rank process
            os.kill(victim["pid"], signal.SIGKILL)

            def one_stale():
                r = c.get("/dispatch-stats")
                assert r.status_code == 200
                st = r.json()
                by = {v["rank"]: v for v in st["ranks"]}
                return st if by[1]["stale"] and not by[0]["stale"] else None

            s1 = wait_for(one_stale, timeout=15, what="rank 1 stale")
            assert s1["live_ranks"] == 1 and not s1["errors"]
            assert c.get("/readyz").status_code == 200
            # The live rank keeps counting. A cached page may be served up to its TTL plus the
            # refresher's grace (2 s) old on a busy machine (sidecar/cache.py), so wait, bounded.
            s2 = wait_for(
                lambda: (
                    (s := c.get("/dispatch-stats").json())["totals"]["batches"] > s1["totals"]["batches"]
                    and s
                ),
                timeout=15,
                what="the live rank's batches to grow",
            )
            assert s2["engines"][0]["representative_rank"] == 0
            wait_for(
                lambda: 'flyserve_rank_up{rank="1"} 0.0' in c.get("/metrics").text,
                timeout=15,
                what="rank 1 down in /metrics",
            )
    finally:
        _stop(sim)
    assert sim.returncode != 0  # interrupted, with a rank killed: not a clean run


def test_auth_conflict_validation_and_size_errors(sidecar: Sidecar):
    with sidecar.client() as c:
        assert c.patch("/thresholds", json={"lpt": "never"}).status_code == 401
        assert (
            c.patch("/thresholds", json={"lpt": "never"}, headers={"Authorization": "Bearer x"}).status_code
            == 403
        )
        r = c.patch("/thresholds", json={"lpt": "sometimes"}, headers=AUTH)
        assert r.status_code == 422 and r.json()["field"] == "lpt"
        assert (
            c.patch("/thresholds", json={"lpt": "never"}, headers=AUTH | {"If-Match": "0"}).status_code == 200
        )
        r = c.patch("/thresholds", json={"lpt": "always"}, headers=AUTH | {"If-Match": "0"})
        assert r.status_code == 409
        r = c.put("/thresholds", content=b'{"lpt": "' + b"x" * 100_000 + b'"}', headers=AUTH)
        assert r.status_code == 413
        assert c.get("/thresholds").json()["values"]["lpt"] == "never"
        # Reload results, counted by the control plane inside the sidecar, reach /metrics (within
        # its TTL plus the refresher's grace on a busy machine).
        text = wait_for(
            lambda: (
                (t := c.get("/metrics").text)
                and 'flyserve_config_reloads_total{result="success",source="api"} 1.0' in t
                and 'flyserve_config_reloads_total{result="invalid",source="api"} 1.0' in t
                and t
            ),
            timeout=15,
            what="the reload counters in /metrics",
        )
        assert text
    # The token is never on a command line.
    assert TOKEN.encode() not in Path(f"/proc/{sidecar.proc.pid}/cmdline").read_bytes()


def test_shutdown_does_not_hang_on_open_stream(sidecar: Sidecar):
    with (
        httpx.Client(base_url=sidecar.url, timeout=10.0) as c,
        c.stream("GET", "/dispatch-stats/stream") as r,
    ):
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"totals"' in first
        sidecar.proc.send_signal(signal.SIGTERM)
        # The server ends the stream: the chunked body closes properly (a stream cut off by
        # uvicorn's graceful-shutdown timeout raises RemoteProtocolError here instead).
        rest = list(lines)
        sidecar.proc.wait(timeout=60)
    # uvicorn re-raises the captured SIGTERM after its graceful shutdown: -15 is the clean exit.
    assert sidecar.proc.returncode in (0, -signal.SIGTERM)
    # Whatever arrived after the first event is whole events, each a complete stats payload.
    data = [line[len("data: ") :] for line in rest if line.startswith("data: ")]
    assert all(json.loads(d)["totals"] is not None for d in data), data
    log = sidecar.log.read_text()
    # uvicorn logs this when its graceful timeout (5 s) cancels a task: the stream did not end on its own.
    assert "graceful shutdown exceeded" not in log and "Traceback" not in log, log
