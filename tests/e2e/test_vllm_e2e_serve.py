"""`vllm serve` (real, CPU) with flyserve's backend; a threshold flip through the CLI mid-serving.

Clients keep sending completions while `flyserve thresholds set prefill_enabled=false` runs;
every request must succeed, and from the step the new version applies on, every batch with a
prefill row takes the unified path (reason `disabled`), while before it the prefill path ran.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

import pytest

from flyserve.control import ControlPlane
from flyserve.vllm.launch import TINY_SERVE_ARGS, VllmServer, flyserve_env

pytestmark = pytest.mark.e2e

SERVE_ARGS = list(TINY_SERVE_ARGS)


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    state = tmp / "state"
    ControlPlane(state, profile="cpu-tiny").reload(actor="e2e", startup=True)
    env = flyserve_env(state, "cpu-tiny", FLYSERVE_SHAPE_LOG=str(tmp / "shapes.jsonl"))
    server = VllmServer(tiny_model, SERVE_ARGS, env=env, log_path=tmp / "vllm.log")
    server.start(timeout=420)
    try:
        yield server, state, tmp
    finally:
        server.stop()
    assert not server.alive()


class Clients:
    """A few threads sending completions until stopped; every response is kept."""

    def __init__(self, url: str, n: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.results: list[tuple[int, str]] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set():
                prompt = [rng.randrange(10, 2000) for _ in range(rng.choice((8, 40, 120, 260, 400)))]
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "temperature": 0,
                }
                try:
                    r = c.post(f"{self.url}/v1/completions", json=body)
                    outcome = (r.status_code, r.text[:200] if r.status_code != 200 else "")
                except httpx.HTTPError as exc:
                    outcome = (0, repr(exc))
                with self.lock:
                    self.results.append(outcome)

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def wait_until(pred, timeout: float, step: float = 0.5) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(step)
    return pred()


def applied_version(state: Path) -> int:
    try:
        return min(json.loads(p.read_text())["applied_version"] for p in (state / "ranks").glob("*.json"))
    except (OSError, ValueError, KeyError):
        return -1


def test_threshold_flip_mid_serving_changes_routing_and_no_request_fails(served):
    server, state, tmp = served
    with Clients(server.url) as clients:
        assert wait_until(lambda: len(clients.results) >= 12, 120), "no traffic"
        flip = subprocess.run(
            [sys.executable, "-m", "flyserve.cli", "thresholds", "set", "prefill_enabled=false",
             "--state-dir", str(state), "--actor", "e2e", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert flip.returncode == 0, flip.stderr
        new_version = ControlPlane(state).snapshot().version
        assert wait_until(lambda: applied_version(state) >= new_version, 60), (
            "the rank never applied the flip"
        )
        n_at_flip = len(clients.results)
        assert wait_until(lambda: len(clients.results) >= n_at_flip + 12, 120), (
            "traffic stopped after the flip"
        )
    assert clients.results and all(code == 200 for code, _ in clients.results), [
        r for r in clients.results if r[0] != 200
    ][:3]
    time.sleep(1.0)  # the shape log is flushed about twice a second
    rows = [json.loads(x) for x in (tmp / "shapes.jsonl").read_text().splitlines()[1:] if x.strip()]
    prefill_rows = [r for r in rows if max(r["query_lens"]) > 1]
    before = [r for r in prefill_rows if r["version"] < new_version]
    after = [r for r in prefill_rows if r["version"] == new_version]
    assert any(r["path"] == "prefill" for r in before), "the prefill path never ran before the flip"
    assert after, "no prefill batch after the flip"
    assert {(r["path"], r["reason"]) for r in after} == {("unified", "disabled")}
    # Versions only move forward along the steps: one switch point, the same for every later step.
    switch = min(r["step"] for r in rows if r["version"] == new_version)
    assert all(r["version"] == new_version for r in rows if r["step"] >= switch)


def test_server_answers_chat_with_the_tokenizers_template(served):
    import httpx

    server, _, _ = served
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "route this"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
