"""A prefill path refused at start leaves a running server on the unified path, the reason in
/dispatch-stats and in the log (real `vllm serve` on CPU).

The CPU pair stands in for ROCm's: FLYSERVE_CPU_PREFILL_UNAVAILABLE declares the prefill kernel
unavailable at start through the same code as a missing FlyDSL (backends.PrefillStatus ->
_bind_group: every layer group 'unsupported', the rank reports off_reason), and
FLYSERVE_CPU_PREFILL_WARMUP_FAIL makes the start-up warm-up raise through the same
breaker.warm_up_failed as a FlyDSL warm-up failure (the circuit opens with the reason).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from flyserve.control import ControlPlane
from flyserve.vllm.launch import TINY_SERVE_ARGS, VllmServer, flyserve_env

pytestmark = pytest.mark.e2e


def _rank_reports(state):
    out = []
    for p in (state / "ranks").glob("*.json"):
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return out


def test_refused_prefill_path_keeps_serving_on_unified(tiny_model, tmp_path):
    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    state = tmp_path / "state"
    ControlPlane(state, profile="cpu-tiny").reload(actor="e2e", startup=True)
    env = flyserve_env(
        state,
        "cpu-tiny",
        FLYSERVE_CPU_PREFILL_UNAVAILABLE="kernel not installed",
        FLYSERVE_CPU_PREFILL_WARMUP_FAIL="no code object for this arch",
    )
    server = VllmServer(tiny_model, list(TINY_SERVE_ARGS), env=env, log_path=tmp_path / "vllm.log")
    server.start(timeout=420)
    try:
        with httpx.Client(timeout=120) as c:
            for n in (300, 40, 400, 260):  # prompts long enough to be prefill batches
                body = {
                    "model": "tiny",
                    "prompt": list(range(10, 10 + n)),
                    "max_tokens": 4,
                    "ignore_eos": True,
                }
                r = c.post(f"{server.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text[:300]
        deadline = time.monotonic() + 60  # ranks report about once a second
        while time.monotonic() < deadline:
            if any((r.get("prefill_kernel") or {}).get("off_reason") for r in _rank_reports(state)):
                break
            time.sleep(0.5)
        settings = SidecarSettings(
            state_dir=state, share_control_metrics=False, stats_ttl_s=0.0, metrics_ttl_s=0.0
        )
        with TestClient(create_app(settings)) as sidecar:
            stats = sidecar.get("/dispatch-stats").json()
        assert server.alive()
    finally:
        server.stop()
    pk = stats["ranks"][0]["prefill_kernel"]
    assert pk["kernel"] == "cpu-sdpa-prefill" and "kernel not installed" in pk["off_reason"]
    assert stats["thresholds"]["circuit_open"] is True  # the warm-up failure opened the circuit
    snap = ControlPlane(state).snapshot()
    assert "warm-up" in snap.circuit_reason and "no code object" in snap.circuit_reason
    totals = stats["totals"]
    assert totals["decisions"].get("prefill", 0) == 0 and totals["decisions"].get("unified", 0) > 0
    assert totals["reasons"].get("unsupported", 0) > 0  # batches with prefill rows, refused statically
    log = (tmp_path / "vllm.log").read_text(errors="replace")
    assert "prefill path unavailable" in log and "warm-up failed" in log
