"""Half-open connections, advice floods, big-number bodies, a keyed actor and "expensive work never
runs where probes are answered", against the real processes: `flyserve sidecar --costs h200`
beside `flyserve simulate` (two ranks).

While each flood runs, /healthz is probed on a fresh connection every 0.2 s and must answer 200 in
under 1 s, and a PATCH with the token must be applied by both ranks, at one step, within the bound
docs/operations.md states ("How a version reaches the ranks"). Without these defences: ~530
half-open connections made every request answer 503; 45 GET /thresholds/advice timed out every
endpoint."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from _attack_rig import (
    AUTH,
    TOKEN,
    AdviceFlood,
    Apply,
    BigBodyFlood,
    HalfOpenFlood,
    Probe,
    patch_and_time_apply,
    probing,
    rig,
)
from _live_sidecar import wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def assert_probes_and_apply(probe: Probe, m: Apply) -> None:
    assert probe.times and not probe.failures, probe.failures[:5]
    assert probe.quantile(0.99) < 1.0 and max(probe.times) < 1.0, sorted(probe.times)[-5:]
    assert m.status == 200 and m.apply_s is not None, m
    assert m.apply_s <= m.bound_s, m
    assert m.applied_steps == (m.effective_step, m.effective_step), m  # one step on both ranks
    print(f"\n/healthz p50 {probe.quantile(0.5) * 1e3:.0f} ms p99 {probe.quantile(0.99) * 1e3:.0f} ms; {m}")


def test_six_hundred_half_open_connections_keep_neither_probes_nor_a_patch_out(tmp_path: Path) -> None:
    with rig(tmp_path) as r:
        flood = HalfOpenFlood(r.url, r.port, n=600)
        flood.start()
        try:
            assert flood.opened >= 550, flood.opened
            time.sleep(1.0)
            with probing(r.port) as probe:
                time.sleep(2.0)
                ready = httpx.get(r.url + "/readyz", timeout=5)
                m = patch_and_time_apply(r, 4096)
                time.sleep(1.0)
            assert ready.status_code == 200, ready.text[:300]
            assert_probes_and_apply(probe, m)
            # The flood did reach the cap: the oldest half-open connections were evicted for new ones.
            assert metric(r.url, "flyserve_sidecar_dropped_connections_total", reason="evicted") > 0
        finally:
            flood.stop()


def test_a_connection_that_sends_no_head_is_dropped_at_the_head_deadline(tmp_path: Path) -> None:
    with rig(tmp_path, "--head-timeout", "1", "--request-timeout", "30") as r:
        s = socket.create_connection(("127.0.0.1", r.port), timeout=5)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        s.settimeout(0.5)
        t0 = time.monotonic()

        def closed() -> bool:
            try:
                return s.recv(1024) == b""
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        wait_for(closed, timeout=20, what="the server to drop a head unfinished after 1 s", every=0)
        took = time.monotonic() - t0
        s.close()
        assert took < 25, took  # the request deadline (30 s) did not do it: the head deadline did
        assert metric(r.url, "flyserve_sidecar_dropped_connections_total", reason="head_timeout") >= 1


def test_45_concurrent_advice_requests_never_hold_up_probes_or_a_patch(tmp_path: Path) -> None:
    with rig(tmp_path) as r:
        wait_for(lambda: (r.state / "shapes").is_dir(), timeout=30, what="shape samples")
        flood = AdviceFlood(r.url, r.port, n=45)
        flood.start()
        try:
            with probing(r.port) as probe:
                time.sleep(3.0)
                stats = httpx.get(r.url + "/dispatch-stats", timeout=5)
                m = patch_and_time_apply(r, 4096)
                time.sleep(3.0)
        finally:
            flood.stop()
        assert stats.status_code == 200
        assert_probes_and_apply(probe, m)
        # Every advice request was answered (fresh, stale or 503 + Retry-After), none timed out.
        assert flood.sent >= 45 and set(flood.statuses) <= {"200", "200-stale", "503", "409"}, flood.statuses


def test_big_numbers_and_deep_nesting_are_named_and_the_actor_is_keyed(tmp_path: Path) -> None:
    with rig(tmp_path) as r:
        with httpx.Client(base_url=r.url, timeout=30) as c:
            for method, path, key in (
                ("PATCH", "/thresholds", "min_seq_len"),
                ("PUT", "/thresholds", "min_seq_len"),
                ("POST", "/thresholds/rollback", "version"),
            ):
                body = b'{"' + key.encode() + b'": ' + b"9" * 5000 + b"}"
                got = c.request(
                    method, path, content=body, headers={**AUTH, "Content-Type": "application/json"}
                )
                assert got.status_code == 422 and got.json()["field"] == key, (path, got.text[:300])
                assert "number too long" in got.json()["detail"] and "99999" not in got.text
                got = c.request(
                    method,
                    path,
                    content=b"[" * 5000 + b"]" * 5000,
                    headers={"Content-Type": "application/json"},
                )
                assert got.status_code == 400 and "nesting too deep" in got.json()["detail"], got.text[:300]
        flood = BigBodyFlood(r.url, r.port, n=8)
        flood.start()
        try:
            with probing(r.port) as probe:
                time.sleep(2.0)
                m = patch_and_time_apply(r, 4096)
        finally:
            flood.stop()
        assert_probes_and_apply(probe, m)
        assert set(flood.statuses) <= {"400", "422"} and flood.sent > 10, flood.statuses
        # The actor shown to anyone is not a plain hash of the token.
        actor = httpx.get(r.url + "/thresholds", timeout=10).json()["actor"]
        assert actor.startswith("token-hmac:") and hashlib.sha256(TOKEN.encode()).hexdigest()[:8] not in actor
        audit = [json.loads(ln) for ln in (r.state / "audit.jsonl").read_text().splitlines()]
        assert TOKEN not in json.dumps(audit) and actor in {e.get("actor") for e in audit}
