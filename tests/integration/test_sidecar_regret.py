"""The live loop without a GPU: `flyserve simulate --costs h200 --drift prefill=1.5` (real rank
processes, the real policy, recorder and shape samples) read by the sidecar app started with
``costs="h200"``: /dispatch-stats' regret equals `flyserve replay` on the same steps, advice is
fitted, applied through PATCH with its If-Match, and the regret it leaves is the oracle; drift and
the priced-seconds counters reach /metrics.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _live_ranks import vouched_ranks
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from typer.testing import CliRunner

from flyserve.cli import app as cli
from flyserve.lab.replay import model_price, price_trace, replay
from flyserve.lab.workloads import Trace, workload
from flyserve.policy import Thresholds
from flyserve.pricing.costs import CostModel, load_costs
from flyserve.sidecar.app import create_app
from flyserve.sidecar.settings import SidecarSettings
from flyserve.thresholds_files import load_profile

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TOKEN = "t0ken-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STEPS = 1000  # under the simulator's 1024-line sample ring: every step is in the files at the end
runner = CliRunner()


@pytest.fixture
def simulated(tmp_path) -> Iterator[Path]:
    """A fresh state directory per test: one test applies advice, another must still see it unapplied.
    The finished ranks are stood in for by live reports (samples count only from live ranks)."""
    state = tmp_path / "state"
    r = runner.invoke(
        cli,
        [
            "simulate", "--state-dir", str(state), "--ranks", "2", "--workload", "seed-8k-c32",
            "--steps", str(STEPS), "--step-interval", "0", "--profile", "gfx950",
            "--costs", "h200", "--drift", "prefill=1.5",
        ],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "kernel times from cost table h200, drift prefill=1.5" in r.output
    with vouched_ranks(state, (0, 1), step=STEPS):
        yield state


def _client(state: Path) -> TestClient:
    settings = SidecarSettings(
        state_dir=state,
        profile="gfx950",
        token=SecretStr(TOKEN),
        share_control_metrics=False,
        stats_ttl_s=0.0,
        metrics_ttl_s=0.0,
        costs="h200",
        advice_deadline_s=120.0,  # a loaded CI machine: wait for the fit rather than get a 503
    )
    return TestClient(create_app(settings))


def _replay(t: Thresholds):
    tr = workload("seed-8k-c32")
    trace = Trace("prefix", tr.steps[:STEPS])
    costs = price_trace(trace, model_price(CostModel(load_costs("h200"))))
    return replay(trace, t, costs, num_heads=32)


def test_live_regret_equals_replay_and_advice_applies(simulated: Path):
    with _client(simulated) as c:
        stats = c.get("/dispatch-stats").json()
        reg = stats["regret"]
        assert reg["costs"] == "h200" and reg["unpriceable"] is None
        w = reg["windows"]["900s"]
        expected = _replay(load_profile("gfx950"))
        assert w["samples"] == STEPS  # 2 TP ranks, each step priced once
        assert w["routed_over_oracle"] == pytest.approx(expected.routed_over_oracle, rel=1e-9)
        assert w["always_unified_s"] == pytest.approx(expected.unified_s, rel=1e-9)
        assert w["prefill_batches"]["routed_over_oracle"] == pytest.approx(
            expected.extra["prefill_batches_routed_over_oracle"], rel=1e-9
        )
        # The planted drift: prefill kernel times 1.5x the model, unified as modelled.
        assert w["drift"]["prefill"]["median_ratio"] == pytest.approx(1.5)
        assert w["drift"]["unified"]["median_ratio"] == pytest.approx(1.0)

        metrics = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(c.get("/metrics").text)
            for s in fam.samples
        }
        assert metrics[("flyserve_cost_drift_ratio", (("path", "prefill"),))] == pytest.approx(1.5)
        routed = metrics[("flyserve_priced_attention_seconds_total", (("policy", "routed"),))]
        oracle = metrics[("flyserve_priced_attention_seconds_total", (("policy", "oracle"),))]
        assert routed > oracle > 0 and math.isfinite(routed)

        adv = c.get("/thresholds/advice").json()
        assert adv["samples"] == STEPS and adv["thresholds_version"] == 0
        assert adv["changes"] and "decode_path" not in adv["changes"]
        assert adv["before"]["prefill_batches"]["routed_over_oracle"] > 1.5
        assert adv["after"]["prefill_batches"]["routed_over_oracle"] == pytest.approx(1.0, abs=0.02)
        assert adv["patch"]["headers"] == {"If-Match": '"0"'}
        assert len(adv["shapes"]) == 100 and adv["shapes_total"] == STEPS
        assert all(len(s["query_lens"]) == len(s["seq_lens"]) for s in adv["shapes"])

        p = adv["patch"]
        r = c.request(p["method"], p["path"], json=p["body"], headers={**AUTH, **p["headers"]})
        assert r.status_code == 200, r.text
        # The same If-Match again is stale: advice never overwrites a change made since.
        r = c.request(p["method"], p["path"], json=p["body"], headers={**AUTH, **p["headers"]})
        assert r.status_code == 409

        again = c.get("/thresholds/advice").json()
        assert again["thresholds_version"] == 1 and again["changes"] == {} and again["patch"] is None
        assert again["before"]["prefill_batches"]["routed_over_oracle"] == pytest.approx(1.0, abs=0.02)
        # Replay under the thresholds now in force confirms it.
        now = load_profile("gfx950").merged(p["body"])
        assert _replay(now).extra["prefill_batches_routed_over_oracle"] == pytest.approx(1.0, abs=0.02)


def test_advice_without_costs_is_a_409(tmp_path: Path):
    s = SidecarSettings(state_dir=tmp_path, share_control_metrics=False)
    with TestClient(create_app(s)) as c:
        r = c.get("/thresholds/advice")
        assert r.status_code == 409 and "--costs" in r.json()["detail"]
        assert c.get("/dispatch-stats").json()["regret"] is None
        assert c.get("/thresholds/advice?window=7d").status_code == 422


def test_advice_with_nothing_priced_yet_is_a_409(tmp_path: Path):
    s = SidecarSettings(state_dir=tmp_path, share_control_metrics=False, costs="h200")
    with TestClient(create_app(s)) as c:
        r = c.get("/thresholds/advice")
        assert r.status_code == 409 and "no priced shapes" in r.json()["detail"]


def test_bad_costs_and_drift_flags_fail_early(tmp_path: Path):
    r = runner.invoke(cli, ["sidecar", "--state-dir", str(tmp_path), "--costs", "nope"])
    assert r.exit_code == 2 and "--costs" in r.output and "h200" in r.output  # names what exists
    base = ["simulate", "--state-dir", str(tmp_path), "--steps", "5"]
    r = runner.invoke(cli, [*base, "--costs", "h200", "--drift", "prefil=1.5"])
    assert r.exit_code == 2 and "--drift" in r.output
    r = runner.invoke(cli, [*base, "--costs", "h200", "--drift", "prefill=-1"])
    assert r.exit_code == 2 and "--drift" in r.output
    r = runner.invoke(cli, [*base, "--drift", "prefill=1.5"])
    assert r.exit_code == 2 and "needs --costs" in r.output
    r = runner.invoke(cli, [*base, "--costs", "h200", "--num-heads", "16"])
    assert r.exit_code == 2 and "--num-heads 16" in r.output and "32 query heads" in r.output
    assert not (tmp_path / "ranks").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_thresholds_advise_cli_against_a_real_sidecar(simulated: Path, tmp_path: Path):
    """`flyserve sidecar --costs h200` under uvicorn, `flyserve thresholds advise --url` reading it."""
    port = _free_port()
    log = tmp_path / "sidecar.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "FLYSERVE_STATE_DIR")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flyserve.cli", "sidecar", "--state-dir", str(simulated),
             "--port", str(port), "--profile", "gfx950", "--costs", "h200", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:  # bounded: the sidecar's start-up on a loaded 2-core machine
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            r = runner.invoke(cli, ["thresholds", "advise", "--url", url, "--shapes", "3"])
            assert r.exit_code == 0, r.output
            assert "routed/oracle, batches with prefill:" in r.output
            knobs = r.output.split("fixed at start):\n")[1].split("apply")[0]
            assert "min_qblock_rows" in knobs and "decode_path" not in knobs
            assert "curl -X PATCH" in r.output and 'If-Match: "' in r.output
            assert "newest 3 of" in r.output
            r = runner.invoke(cli, ["thresholds", "advise", "--url", url, "--json"])
            assert r.exit_code == 0 and json.loads(r.output)["patch"]["body"]
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    r = runner.invoke(
        cli, ["thresholds", "advise", "--url", f"http://127.0.0.1:{_free_port()}", "--timeout", "2"]
    )
    assert r.exit_code == 1 and "cannot reach the sidecar" in r.output
