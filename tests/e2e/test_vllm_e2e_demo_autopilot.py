"""`flyserve demo --autopilot` on a real vLLM engine on the CPU: the autopilot trials the advice's
change inside the engine, the engine's own ranks time the blocks, and the decision the demo reports
is the one the audit log replays and the version in force carries.

What the test does not assert: which way the trial goes. On this CPU the kernel times of the prefill
stand-in and vLLM's unified kernel per token are close and noisy (docs/autopilot.md, "The demo on a
real vLLM"): a decision of the test, a guardrail's, or the demo's own pause are all outcomes the
demo reports; each must be the one the records and the engine show."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flyserve.control import Store

pytestmark = pytest.mark.e2e

OPERATOR_VERSION = 2  # the demo's live change (flyserve.demo.cli FLIP): the trial's current arm


def test_demo_autopilot_trials_the_advice_on_real_vllm_and_the_audit_replays_it(tiny_model, tmp_path):
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "flyserve.cli", "demo", "--autopilot", "--duration", "30", "--autopilot-rounds", "2",
         "--model-dir", str(tiny_model), "--summary-json", str(summary_path), "--keep"],
        capture_output=True, text=True, timeout=900, check=False, env=dict(os.environ),
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert summary_path.is_file(), out[-4000:]
    s = json.loads(summary_path.read_text())
    work = Path(s["work_dir"])
    try:
        state = work / "state"
        replay = subprocess.run(
            [sys.executable, "-m", "flyserve.cli", "autopilot", "replay", "--state-dir", str(state), "--json"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        history = subprocess.run(
            [sys.executable, "-m", "flyserve.cli", "autopilot", "history", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        store = Store(state)
        in_force = store.read_current()
        operator = store.read_version(OPERATOR_VERSION)
        rank_reports = [json.loads(p.read_text()) for p in sorted((state / "ranks").glob("*.json"))]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    assert proc.returncode == 0, out[-4000:]
    assert "[+] autopilot on: POST /autopilot/mode" in out
    ap = s["autopilot"]
    trial, decision = ap["trial"], ap["decision"]
    # The trigger started a trial over the operator's version, moving what the advice moved.
    assert trial is not None and trial["id"].startswith(f"ap-{OPERATOR_VERSION}-"), out[-4000:]
    assert trial["operator_version"] == OPERATOR_VERSION and trial["changed"]
    assert "decode_path" not in trial["changed"]  # a restart-only knob is never trialled
    # The real engine's rank timed the blocks: its report carries the trial's blocks with kernel
    # samples, and the runner paired them.
    blocks = [b for r in rank_reports for b in ((r.get("trial_blocks") or {}).get("blocks") or [])]
    assert blocks and all(b["samples"] >= 1 and b["tokens"] >= 1 for b in blocks)
    assert {b["arm"] for b in blocks} == {0, 1}
    # A decision was reported, and the audit log replays every decision it holds.
    assert decision is not None and decision["trial_id"] == trial["id"], out[-4000:]
    assert decision["decision"] in ("promote", "rollback", "inconclusive")
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-2000:]
    doc = json.loads(replay.stdout)
    assert [t["trial"] for t in doc["trials"]] == [trial["id"]]
    assert all(t["agrees"] for t in doc["trials"])
    assert trial["id"] in history.stdout
    # The version in force is the decision's: the candidate when promoted, else the operator's
    # thresholds again, and no trial left in it.
    assert in_force is not None and operator is not None and in_force.trial is None
    changed = {k: v[1] for k, v in trial["changed"].items()}
    if decision["decision"] == "promote":
        assert {k: getattr(in_force.thresholds, k) for k in changed} == changed
        assert ap["regret_after"] is not None  # priced by the table, over one round: reported, not ranked
    else:
        assert in_force.thresholds == operator.thresholds
    assert s["requests"]["failed"] == 0
