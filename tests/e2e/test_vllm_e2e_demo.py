"""`flyserve demo`, briefly, as a user runs it: real vllm serve + sidecar + vllm bench serve."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_demo_runs_both_paths_and_the_threshold_change_moves_the_ratio(tiny_model, tmp_path):
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "flyserve.cli", "demo", "--duration", "24", "--model-dir", str(tiny_model),
         "--summary-json", str(summary_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]", "stopping vllm serve", "stopping sidecar"):
        assert step in out
    assert "deliberately simple stand-in" in out  # the CPU prefill kernel's times are not a verdict
    assert "| this phase: " in out and "| totals: " in out  # live lines keep the two apart
    assert "the sidecar was at http://127.0.0.1:" in out and "stops with the demo" in out
    s = json.loads(summary_path.read_text())
    assert s["requests"]["sent"] == s["requests"]["completed"] > 0 and s["requests"]["failed"] == 0
    assert s["decisions_by_path"]["prefill"] > 0 and s["decisions_by_path"]["unified"] > 0
    stats = s["dispatch_stats"]
    assert stats["totals"]["batches"] == sum(s["decisions_by_path"].values())
    before, after, advised = s["phases"]
    # The advice phase (flyserve.demo.advice): the sidecar priced the engine's sampled steps with the
    # measured CPU table; cpu-tiny sends prefill batches to the slower SDPA stand-in, so there was
    # regret; advice was applied through PATCH with If-Match (version 3) and the round after it
    # had less.
    assert stats["thresholds"]["version"] == 3 and advised["advice"]["thresholds_version"] == 2
    assert advised["advice"]["changes"] and "decode_path" not in advised["advice"]["changes"]
    assert advised["regret_before"] > 0.05
    assert advised["regret_after"] is not None and advised["regret_after"] < advised["regret_before"]
    assert "[+] regret with the advice in force" in out
    assert stats["regret"]["costs"] == "cpu" and stats["regret"]["unpriceable"] is None
    # Drift on a real engine: the kernel timer's step-tagged times (one layer's attention forward,
    # every 16th step) joined with those steps' shape samples give a finite measured/predicted median
    # (the value of flyserve_cost_drift_ratio) for at least one path.
    drift = stats["regret"]["windows"]["900s"]["drift"]
    finite = {
        p: d["median_ratio"] for p, d in drift.items() if d["samples"] and d["median_ratio"] is not None
    }
    assert finite and all(math.isfinite(r) and r > 0 for r in finite.values()), drift
    assert before["prefill_ratio_of_prefill_batches"] > after["prefill_ratio_of_prefill_batches"]

    # The flip raised min_seq_len (96 -> 256): a larger share of the batches with a prefill row falls
    # back for short context. Shares, not counts: the phases' batch counts depend on the machine's speed.
    def short_share(phase: dict) -> float:
        return phase["reasons"].get("short_context", 0) / max(1, phase["batches_with_prefill_rows"])

    assert short_share(after) > short_share(before)
