"""The autopilot end to end: a real `flyserve sidecar --autopilot auto --costs h200` beside a real
`flyserve simulate --costs h200 --truth-costs T --kernel-timer-every 1 --noise-cv 0.1`.

The workload is one batch shape, over and over (15 decode rows and four 8k prefill chunks): the
gfx950 profile routes it to the unified kernel, and the h200 table prices the prefill path at about
a ninth of that, so live regret is large and the advice moves it to prefill. What the ranks measure
comes from the truth table T alone: the h200 table with every prefill time scaled so that, for this
shape, prefill takes 0.8 of unified (the candidate 20% faster: promoted) or 1.1 (10% slower:
rolled back, the operator's version again). Then `flyserve autopilot replay` recomputes every
decision from the audit log and agrees. Waits are on conditions, with deadlines."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from _live_sidecar import CLI, read_rank_reports, sidecar_beside_simulator, wait_for

from flyserve.autopilot.audit_records import GUARDRAILS
from flyserve.policy.thresholds import START_ONLY_FIELDS, Thresholds
from flyserve.pricing.costs import CostModel, load_costs
from flyserve.thresholds_files import load_profile

TOKEN = "autopilot-live-token-0123456789"
QUERY_LENS = [1] * 11 + [11, 8192, 8192, 8192, 8170]
SEQ_LENS = [8195, 8195, 8195, 8195, 8194, 8194, 8194, 8193, 8193, 8193, 8193, 8192, 8192, 8192, 8192, 8170]


def _trace(tmp: Path) -> Path:
    path = tmp / "one-shape.jsonl"
    lines = [json.dumps({"step": s, "query_lens": QUERY_LENS, "seq_lens": SEQ_LENS}) for s in range(8)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _truth(tmp: Path, prefill_over_unified: float) -> Path:
    """The h200 table with every prefill time scaled so that prefill / unified for the trace's
    shape is ``prefill_over_unified`` (a truth table re-times the pricing table's shapes)."""
    table = load_costs("h200")
    model = CostModel(table)
    q, s = np.array(QUERY_LENS), np.array(SEQ_LENS)
    ratio = model.predict(q, s, "prefill") / model.predict(q, s, "unified")
    doc = json.loads(table.to_json())
    for e in doc["entries"]:
        e["ms"]["prefill"] *= prefill_over_unified / ratio
    path = tmp / f"truth-{prefill_over_unified}.json"
    path.write_text(json.dumps(doc))
    return path


def _bounds(tmp: Path) -> Path:
    """Every run-time integer knob opened wide: the advice decides which it moves."""
    knobs = [
        k for k, f in Thresholds.model_fields.items() if f.annotation is int and k not in START_ONLY_FIELDS
    ]
    path = tmp / "bounds.yaml"
    path.write_text("".join(f"{k}: {{min: 0, max: 1000000}}\n" for k in knobs))
    return path


def _status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/autopilot", timeout=10).json()


def _thresholds(url: str) -> dict[str, Any]:
    return httpx.get(url + "/thresholds", timeout=10).json()


def _args(tmp: Path, prefill_over_unified: float) -> tuple[list[str], list[str]]:
    """The sidecar's and the simulator's arguments."""
    sidecar_args = [
        "--profile", "gfx950", "--costs", "h200",
        "--autopilot", "auto", "--autopilot-bounds", str(_bounds(tmp)),
        "--autopilot-block-steps", "16", "--autopilot-max-blocks", "3000",
        "--autopilot-min-priced-samples", "300", "--autopilot-window", "60s",
        "--autopilot-interval", "0.25",
    ]  # fmt: skip
    simulate_args = [
        "--workload", str(_trace(tmp)), "--steps", "200000", "--step-interval", "0.005",
        "--profile", "gfx950", "--costs", "h200", "--kernel-timer-every", "1",
        "--truth-costs", str(_truth(tmp, prefill_over_unified)), "--noise-cv", "0.1", "--noise-seed", "3",
    ]  # fmt: skip
    return sidecar_args, simulate_args


def _run(tmp: Path, prefill_over_unified: float) -> tuple[str, float | None, Path, dict[str, Any]]:
    """One sidecar and simulator; returns (the decision, its effect estimate, the state directory,
    GET /thresholds after it)."""
    sidecar_args, simulate_args = _args(tmp, prefill_over_unified)
    with sidecar_beside_simulator(tmp, TOKEN, sidecar_args=sidecar_args, simulate_args=simulate_args) as both:
        url = both.sidecar.url
        started = wait_for(
            lambda: _status(url)["state"] == "running" and _status(url)["trial"],
            timeout=60,
            what="a trial to start",
            every=0.25,
        )
        assert started
        trial = _status(url)["trial"]
        assert trial["changed"] and all(len(v) == 2 for v in trial["changed"].values())
        decided = wait_for(
            lambda: _status(url)["last_decisions"], timeout=60, what="the trial's decision", every=0.25
        )
        last = decided[0]  # type: ignore[index]
        assert last["trial_id"] == trial["id"]
        # decided by the test on measured pairs, not by a guardrail (samples stopped, p99, ...)
        assert last["pairs"] >= 2 and last["reason"] not in GUARDRAILS, last
        after = _thresholds(url)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert (
            "flyserve_autopilot_trials_total" in metrics
            and 'flyserve_autopilot_mode{mode="auto"} 1.0' in metrics
        )
        return last["decision"], last["effect"], both.sidecar.state, after


def _trial_in_force(state: Path) -> bool:
    return json.loads((state / "control" / "current.json").read_text()).get("trial") is not None


def _replay_agrees(state: Path) -> None:
    r = subprocess.run(
        [*CLI, "autopilot", "replay", "--state-dir", str(state), "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_candidate_measured_20_percent_faster_is_promoted(tmp_path: Path) -> None:
    decision, effect, state, after = _run(tmp_path, 0.8)
    assert decision == "promote" and effect is not None and effect < -0.1
    assert after["source"] == "autopilot" and not _trial_in_force(state)
    assert after["values"] != load_profile("gfx950").model_dump()
    _replay_agrees(state)


def test_a_table_favoured_candidate_measured_10_percent_worse_is_rolled_back(tmp_path: Path) -> None:
    decision, effect, state, after = _run(tmp_path, 1.1)
    assert decision == "rollback" and effect is not None and effect > 0.0
    assert after["values"] == load_profile("gfx950").model_dump() and not _trial_in_force(state)
    _replay_agrees(state)


def test_a_sidecar_killed_mid_trial_has_its_trial_ended_by_the_ranks_within_its_lease(tmp_path: Path) -> None:
    """kill -9 of the sidecar while a trial runs, and no sidecar again: engine 0's rank 0 (file
    polling) sees the trial's lease go unrenewed (control.trial_lease) and publishes the version
    again without the trial, audited, which both ranks apply; the thresholds in force are the
    operator's. The arms measure alike here (a truth ratio of 1), so the test cannot decide before
    the kill."""
    sidecar_args, simulate_args = _args(tmp_path, 1.0)
    with sidecar_beside_simulator(
        tmp_path, TOKEN, sidecar_args=[*sidecar_args, "--autopilot-lease", "2"], simulate_args=simulate_args
    ) as both:
        url, state = both.sidecar.url, both.sidecar.state
        wait_for(
            lambda: _status(url)["state"] == "running" and _status(url)["trial"],
            timeout=60,
            what="a trial to start",
            every=0.25,
        )
        trial_id = _status(url)["trial"]["id"]
        both.sidecar.proc.kill()
        both.sidecar.proc.wait(timeout=30)
        assert _trial_in_force(state), "the trial ended before the kill: nothing left to test"
        killed_at = time.monotonic()
        wait_for(lambda: not _trial_in_force(state), timeout=60, what="the trial to end without its sidecar")
        took = time.monotonic() - killed_at
        cur = json.loads((state / "control" / "current.json").read_text())
        assert cur["actor"] == "autopilot-lease" and cur["source"] == "rollback"
        assert Thresholds.model_validate(cur["thresholds"]) == load_profile("gfx950")
        audit = [json.loads(line) for line in (state / "audit.jsonl").read_text().splitlines()]
        ended = [a for a in audit if a.get("actor") == "autopilot-lease" and a.get("result") == "success"]
        assert len(ended) == 1 and ended[0]["request"]["trial"] == trial_id, ended
        assert "was not renewed" in ended[0]["request"]["reason"]
        wait_for(
            lambda: all(
                r.get("applied_version") == cur["version"] and r.get("trial") is None
                for r in read_rank_reports(state / "ranks").values()
            ),
            timeout=60,
            what="both ranks to run the version without the trial",
        )
        # the lease is 2 s and the rank looks once a second: well under the 60 s the waits allow
        assert took < 30, took
