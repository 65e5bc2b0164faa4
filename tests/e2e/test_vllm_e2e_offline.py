"""Real vLLM on the CPU, offline LLM(...), chunked prefill, one engine for the whole module.

What is checked (tests/e2e/vllm_offline_runner.py drives the engine):
- every request of every phase completes (routing by policy, forced unified, forced prefill,
  a failing prefill kernel, after the circuit is closed again);
- each decision the routing recorded equals decide() applied to the shape vLLM passed, under the
  thresholds version in force at that step; the Prometheus counters equal those decisions;
- the two CPU paths agree numerically on the batches the prefill path ran (bf16 tolerance);
- a failing prefill kernel opens the circuit for every rank through the control plane, its
  batches are re-run on the unified kernel, and closing the circuit restores the prefill path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from flyserve.policy import BatchShape, Thresholds, decide
from flyserve.thresholds_files import load_profile
from flyserve.vllm.launch import flyserve_env

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
HEADS = 4  # flyserve.vllm.tiny_model.HEADS


def _run(tiny_model, tmp: Path) -> dict:
    state = tmp / "state"
    out = tmp / "result.json"
    env = flyserve_env(
        state,
        "cpu-tiny",
        FLYSERVE_SHAPE_LOG=str(tmp / "shapes.jsonl"),
        FLYSERVE_CPU_COMPARE=str(tmp / "compare.jsonl"),
        FLYSERVE_CPU_PREFILL_FAIL_FILE=str(tmp / "fail-now"),
        FLYSERVE_KERNEL_TIMER_EVERY="4",
    )
    log = tmp / "engine.log"
    with open(log, "wb") as f:
        proc = subprocess.run(
            [sys.executable, str(HERE / "vllm_offline_runner.py"), str(tiny_model), str(state), str(out)],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=False,
        )
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return {
        "result": json.loads(out.read_text()),
        "shapes": [json.loads(x) for x in (tmp / "shapes.jsonl").read_text().splitlines()[1:] if x.strip()],
        "compare": [json.loads(x) for x in (tmp / "compare.jsonl").read_text().splitlines() if x.strip()],
        "state": state,
        "log": text,
    }


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    return _run(tiny_model, tmp_path_factory.mktemp("offline"))


def phases(engine) -> dict:
    return {p["name"]: p for p in engine["result"]["phases"]}


def phase_rows(engine, name: str) -> list[dict]:
    """Shape-log lines of the steps of one phase (steps after the previous phase's last one)."""
    names = [p["name"] for p in engine["result"]["phases"]]
    i = names.index(name)
    lo = engine["result"]["phases"][i - 1]["last_step"] if i else 0
    hi = engine["result"]["phases"][i]["last_step"]
    return [s for s in engine["shapes"] if lo < s["step"] <= hi]


def test_every_request_completes_in_every_phase(engine):
    ph = phases(engine)
    assert list(ph) == ["default", "unified", "prefill", "failing", "closed"]
    for p in ph.values():
        assert p["finished"] == p["requests"], p
        assert p["output_tokens"] == [16] * p["requests"], p


def test_chunked_prefill_made_mixed_batches(engine):
    mixed = [s for s in engine["shapes"] if max(s["query_lens"]) > 1 and min(s["query_lens"]) == 1]
    assert len(mixed) >= 5


def test_recorded_decisions_equal_decide_on_vllms_shapes(engine):
    thresholds = {h["version"]: Thresholds.parse(h["thresholds"]) for h in engine["result"]["history"]}
    thresholds.setdefault(0, load_profile("cpu-tiny"))
    opened_after, closed_at = _circuit_window(engine)
    checked = circuit_rows = 0
    for s in engine["shapes"]:
        t = thresholds[s["version"]]
        shape = BatchShape.from_query_lens(
            s["query_lens"], max_seq_len=s["max_seq_len"], num_heads=HEADS, thresholds=t
        )
        assert s["max_seq_len"] == max(s["seq_lens"])
        d = decide(shape, t)
        if s["reason"] == "circuit_open":
            # The breaker overrides an admitted batch, nothing else; it runs on unified; and only
            # while the circuit is open: after the kernel started failing, before the rank applied
            # the version that closed it.
            assert d.reason == "admitted", s
            assert s["path"] == "unified", s
            assert s["step"] > opened_after, (s, opened_after)
            assert s["version"] < closed_at, (s, closed_at)
            circuit_rows += 1
            continue
        assert (s["path"], s["reason"]) == (d.path, d.reason), s
        checked += 1
    assert checked >= 20
    assert circuit_rows >= 1


def _circuit_window(engine) -> tuple[int, int]:
    """(last step before the prefill kernel started failing, the version that closed the circuit)."""
    history = engine["result"]["history"]
    opened = [h["version"] for h in history if h["circuit_open"]]
    assert opened, "the control plane never published an open circuit"
    closed_at = min(h["version"] for h in history if h["version"] > opened[0] and not h["circuit_open"])
    return phases(engine)["prefill"]["last_step"], closed_at


def test_prometheus_counters_equal_the_recorded_decisions(engine):
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(engine["state"] / "metrics"))
    counted: Counter = Counter()
    for metric in reg.collect():
        if metric.name == "flyserve_dispatch_decisions":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    counted[(sample.labels["path"], sample.labels["reason"])] += int(sample.value)
    logged = Counter((s["path"], s["reason"]) for s in engine["shapes"])
    assert counted == logged
    timed = [m for m in reg.collect() if m.name == "flyserve_kernel_seconds"]
    counts = {s.labels["path"]: s.value for m in timed for s in m.samples if s.name.endswith("_count")}
    assert counts.get("unified", 0) > 0 and counts.get("prefill", 0) > 0  # both paths were timed


def test_policy_routing_used_both_paths(engine):
    paths = Counter(s["path"] for s in phase_rows(engine, "default"))
    assert paths["prefill"] >= 2 and paths["unified"] >= 2


def test_forced_unified_and_forced_prefill(engine):
    for name, want in (("unified", ("unified", "disabled")), ("prefill", ("prefill", "admitted"))):
        v = phases(engine)[name]["version"]
        rows = [s for s in phase_rows(engine, name) if max(s["query_lens"]) > 1 and s["version"] == v]
        assert len(rows) >= 3, name
        assert {(s["path"], s["reason"]) for s in rows} == {want}, name


def test_cpu_paths_agree_numerically(engine):
    cmp = engine["compare"]
    assert len(cmp) >= 10
    for c in cmp:
        # bf16 outputs: one ulp at the reference's magnitude is 2**-8 * |x|; allow a few.
        assert c["max_abs"] <= 1e-3 + 2**-6 * c["ref_max"], c
    assert any(c["num_reqs"] > 1 and c["max_query_len"] > 1 for c in cmp)  # mixed batches too


def test_failing_prefill_kernel_opens_the_circuit_without_losing_a_batch(engine):
    res = engine["result"]
    assert res["circuit_after_failure"]["open"] is True
    assert "injected failure" in res["circuit_after_failure"]["reason"]
    ph = phases(engine)
    assert ph["failing"]["finished"] == ph["failing"]["requests"]
    failing_steps = [s for s in phase_rows(engine, "failing") if s["reason"] == "circuit_open"]
    assert failing_steps, "after the failure, admitted batches must be reported as circuit_open"
    assert "circuit OPEN" in engine["log"]
    # Closed again by the operator: the prefill path is used again.
    v = ph["closed"]["version"]
    after = [s for s in phase_rows(engine, "closed") if max(s["query_lens"]) > 1 and s["version"] == v]
    assert after and {(s["path"], s["reason"]) for s in after} == {("prefill", "admitted")}


def test_shape_samples_carry_what_live_pricing_needs(engine):
    """The 1-in-8 samples the sidecar prices hold, for their step, exactly the rows' query and
    context lengths and the path the shape log (every step) recorded, and the layer vLLM runs."""
    from flyserve.telemetry.shape_sample import read_shape_samples

    samples = read_shape_samples(engine["state"], limit=100_000)
    logged = {s["step"]: s for s in engine["shapes"]}
    assert len(samples) >= 10
    for s in samples:
        row = logged[s.step]
        assert list(s.query_lens) == row["query_lens"] and list(s.seq_lens) == row["seq_lens"], s.step
        assert s.path == row["path"], s.step
        assert s.head_size is not None and s.block_size is not None and s.time is not None


def test_live_regret_and_advice_on_the_real_cpu_engine(engine):
    """The sidecar prices the real engine's sampled steps with the measured CPU table (its layer
    matches: 4 heads, head size 32, block 128): cpu-tiny sends prefill batches to the SDPA stand-in,
    which the table measured slower, so there is regret; advice routes those batches to vLLM's CPU
    kernel and, on the same shapes, leaves none."""
    from _live_ranks import vouched_ranks
    from fastapi.testclient import TestClient

    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.settings import SidecarSettings

    s = SidecarSettings(
        state_dir=engine["state"], profile="cpu-tiny", share_control_metrics=False, costs="cpu"
    )
    # The engine has finished; samples count only from live ranks: this test
    # process stands in for its one rank, as tests/_live_ranks.py explains.
    last = max(x["step"] for x in engine["shapes"])
    with vouched_ranks(engine["state"], (0,), step=last), TestClient(create_app(s)) as c:
        reg = c.get("/dispatch-stats").json()["regret"]
        assert reg["unpriceable"] is None, reg
        w = reg["windows"]["900s"]
        assert w["samples"] >= 10 and w["routed_over_oracle"] > 1.0
        adv = c.get("/thresholds/advice").json()
        assert adv["changes"] and "decode_path" not in adv["changes"]
        assert adv["before"]["routed_over_oracle"] > 1.0
        assert adv["after"]["routed_over_oracle"] == pytest.approx(1.0)
