"""vLLM's own multi-node data-parallel launch as two "nodes" on one machine, with no
shared disk: each node its own state directory, its own `flyserve sidecar`, and a real Prometheus
scraping both sidecars.

  head   vllm serve MODEL --data-parallel-size 2 --data-parallel-size-local 1
                          --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P
         (API server + engine 0; its FLYSERVE_STATE_DIR holds the store; VLLM_CPU_OMP_THREADS_BIND=0)
  node 1 vllm serve MODEL --headless --data-parallel-start-rank 1 (same DP flags)
         (engine 1 only; its own FLYSERVE_STATE_DIR; VLLM_CPU_OMP_THREADS_BIND=1)

Checked: thresholds changed on the head reach engine 1 on node 1 (it cannot read the head's state
directory) and both engines confirm every version at one step each; every batch each engine logged
ran under its engine's version in force; the head's /dispatch-stats shows both engines and both
ranks through the engine channel (the report RPC), while each node's state directory holds only its
own rank's report; each node's sidecar exposes only its own rank on /metrics, and one Prometheus
query over both gives the cluster-wide prefill share, equal (within 0.02) to the share of both
nodes' shape logs; the dashboards' rate-based share expression answers over both instances too.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from _support import require_binary
from test_vllm_e2e_data_parallel import HEADS
from test_vllm_e2e_engine_channel import KEEP_ALIVE_ENV, Load, StepTail, read_rows, wait_for

from flyserve.control import ControlPlane
from flyserve.policy import BatchShape, decide
from flyserve.vllm.launch import TINY_SERVE_ARGS, VllmServer, flyserve_env, free_port, vllm_command

pytestmark = pytest.mark.e2e

CHANGES = 20
REPO = Path(__file__).resolve().parents[2]


def dp_args(rpc_port: int) -> list[str]:
    args = [*TINY_SERVE_ARGS, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port)]  # fmt: skip
    args[args.index("--kv-cache-memory-bytes") + 1] = str(128 << 20)
    return args


def spawn(name: str, argv: list[str], tmp: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it; closed with the test's tmp
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    import signal

    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def start_sidecar(state: Path, tmp: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = spawn(name, [sys.executable, "-m", "flyserve.cli", "sidecar", "--state-dir", str(state),
                        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], tmp)  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"sidecar {name} exited: {(tmp / f'{name}.log').read_text()[-2000:]}")
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, f"sidecar {name}", 60)
    return proc, url


def start_prometheus(targets: list[str], tmp: Path) -> tuple[subprocess.Popen, str]:
    prom = require_binary("prometheus")
    port = free_port()
    cfg = yaml.safe_load((REPO / "config" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["scrape_timeout"] = "1s"
    cfg.pop("rule_files", None)
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "flyserve"]
    job["static_configs"] = [{"targets": targets}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    proc = spawn("prometheus", [prom, f"--config.file={tmp / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp / 'prom-data'}",
                                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], tmp)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _ok(f"{url}/-/ready"), "prometheus", 60)
    return proc, url


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def prom_query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def test_two_nodes_without_a_shared_disk_every_engine_every_rank(tiny_model, tmp_path):
    tmp = tmp_path
    head_state, node_state = tmp / "head-state", tmp / "node1-state"
    first = ControlPlane(head_state, profile="cpu-tiny").reload(actor="e2e", startup=True).snapshot
    rpc_port = free_port()
    plugins = "flyserve,flyserve-endpoint"
    node_env = flyserve_env(node_state, "cpu-tiny", FLYSERVE_SHAPE_LOG=str(tmp / "node1-shapes-{rank}.jsonl"),
                            FLYSERVE_LOG_LEVEL="INFO", VLLM_CPU_OMP_THREADS_BIND="1", VLLM_PLUGINS=plugins)  # fmt: skip
    head_env = flyserve_env(head_state, "cpu-tiny", FLYSERVE_SHAPE_LOG=str(tmp / "head-shapes-{rank}.jsonl"),
                            FLYSERVE_LOG_LEVEL="INFO", VLLM_CPU_OMP_THREADS_BIND="0", VLLM_PLUGINS=plugins,
                            **KEEP_ALIVE_ENV)  # fmt: skip
    procs: list[subprocess.Popen] = []
    node1 = spawn(
        "node1",
        [*vllm_command(), "serve", str(tiny_model), "--headless", "--data-parallel-start-rank", "1",
         *dp_args(rpc_port)],
        tmp,
        node_env,
    )  # fmt: skip
    procs.append(node1)
    head = VllmServer(tiny_model, dp_args(rpc_port), env=head_env, log_path=tmp / "head.log")
    logs = [tmp / "head-shapes-0.jsonl", tmp / "node1-shapes-1.jsonl"]
    try:
        head.start(timeout=600)
        assert node1.poll() is None, (tmp / "node1.log").read_text()[-3000:]
        head_sidecar, head_url = start_sidecar(head_state, tmp, "sidecar-head")
        node_sidecar, node_url = start_sidecar(node_state, tmp, "sidecar-node1")
        procs += [head_sidecar, node_sidecar]
        prom, prom_url = start_prometheus(
            [head_url.removeprefix("http://"), node_url.removeprefix("http://")], tmp
        )
        procs.append(prom)

        plane = ControlPlane(head_state, profile="cpu-tiny")
        rng = random.Random(23)
        changes = []
        with Load(head.url, n=3) as load:
            t_load = time.monotonic()
            tail = StepTail(logs)
            for _ in range(CHANGES):
                seen = tail.poll()
                wait_for(lambda seen=seen: tail.poll() > seen, "a step", 180)
                time.sleep(rng.uniform(0.1, 0.5))
                snap = plane.apply_overrides(
                    {"min_seq_len": rng.choice((64, 96, 128, 200, 300, 500)),
                     "prefill_enabled": rng.random() < 0.75}, actor="e2e-23-nodes"
                ).snapshot  # fmt: skip
                changes.append((snap.version, snap.thresholds))
            last = changes[-1][0]
            wait_for(
                lambda: tail.all_at(last),
                f"both engines to log a step of version {last}",
                240,
            )
            # Prometheus needs a few scrapes of the rates over the load (1 s interval, 4 s window).
            time.sleep(max(0.0, 8.0 - (time.monotonic() - t_load)))
            share_expr = 'sum(rate(flyserve_dispatch_decisions_total{path="prefill"}[30s])) / sum(rate(flyserve_dispatch_decisions_total[30s]))'
            by_instance = prom_query(prom_url, "sum by (instance, rank) (flyserve_dispatch_decisions_total)")
            share = prom_query(prom_url, share_expr)
        time.sleep(2.5)  # a report round after the load stopped
        head_stats = httpx.get(f"{head_url}/dispatch-stats", timeout=30).json()
        node_stats = httpx.get(f"{node_url}/dispatch-stats", timeout=30).json()
        head_metrics = httpx.get(f"{head_url}/metrics", timeout=30).text
        node_metrics = httpx.get(f"{node_url}/metrics", timeout=30).text
        time.sleep(2.0)  # two more scrapes: the counters Prometheus holds catch up with the last steps
        totals = prom_query(prom_url, "sum by (path) (flyserve_dispatch_decisions_total)")
        whole_share = prom_query(
            prom_url,
            'sum(flyserve_dispatch_decisions_total{path="prefill"}) / sum(flyserve_dispatch_decisions_total)',
        )
    finally:
        head.stop()
        for p in reversed(procs):
            stop(p)
    head_log = (tmp / "head.log").read_text(errors="replace")
    node_log = (tmp / "node1.log").read_text(errors="replace")
    assert load.codes and all(c == 200 for c in load.codes), (set(load.codes), load.failures[:5])
    versions = [v for v, _ in changes]

    # Every version confirmed by both engines (engine 1 on node 1), each at one step of its own.
    pushes = {}
    for line in (head_state / "channel" / "pushes.jsonl").read_text().splitlines():
        p = json.loads(line)
        pushes[p["version"]] = p
    bounds: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for v in versions:
        assert [e["engine"] for e in pushes[v]["engines"]] == [0, 1], pushes[v]
        for e in pushes[v]["engines"]:
            assert e["same_step"] and [w["rank"] for w in e["workers"]] == [e["engine"]]
            bounds[e["engine"]].append((e["from_step"], v))
    history = {first.version: first.thresholds, **dict(changes)}
    for e, path in enumerate(logs):
        rows = read_rows(path)
        assert rows and {x["rank"] for x in rows} == {e}

        b = sorted(bounds[e])

        def in_force(step: int, b=b) -> int:
            cur = 1
            for s, v in b:
                if s <= step:
                    cur = v
            return cur

        wrong = [
            (x["step"], x["version"], in_force(x["step"]))
            for x in rows
            if x["version"] != in_force(x["step"])
        ]
        assert not wrong, f"engine {e}: (step, logged, in force) {wrong[:5]}"
        for x in rows:
            t = history[x["version"]]
            d = decide(BatchShape.from_query_lens(x["query_lens"], max_seq_len=x["max_seq_len"], num_heads=HEADS,
                                                  thresholds=t), t)  # fmt: skip
            assert (x["path"], x["reason"]) == (d.path, d.reason), x

    # No shared disk: each node's state directory holds its own rank's report only.
    assert sorted(p.name for p in (head_state / "ranks").iterdir()) == ["0.json"]
    assert sorted(p.name for p in (node_state / "ranks").iterdir()) == ["1-1.json"]
    # Node 1's own store never held the head's versions (its sidecar published its profile only).
    node_snap = ControlPlane(node_state, profile="cpu-tiny").snapshot()
    assert node_snap.version < versions[-1] and node_snap.sha256 not in {
        pushes[v]["sha256"] for v in versions
    }

    # The head sees both engines and both ranks through the engine channel.
    ch = head_stats["channel"]
    assert [e["engine"] for e in ch["engines"]] == [0, 1]
    for e in ch["engines"]:
        assert e["confirmed_version"] == versions[-1] and e["unconfirmed"] == [] and e["error"] is None
        (w,) = e["workers"]
        assert (w["rank"], w["engine"], w["applied_version"], w["control_mode"]) == (
            e["engine"], e["engine"], versions[-1], "engine channel")  # fmt: skip
        assert sum(w["decisions"].values()) > 0
    assert [r["rank"] for r in head_stats["ranks"]] == [0]  # files: the head's own node only
    assert [r["rank"] for r in node_stats["ranks"]] == [1] and node_stats["channel"] is None

    # Each node's sidecar exposes only its own rank; Prometheus tells them apart by instance.
    assert "flyserve_dispatch_decisions_total{" in head_metrics and 'rank="1"' not in head_metrics
    assert 'rank="0"' not in node_metrics and 'rank="1"' in node_metrics
    seen = {(s["metric"]["instance"], s["metric"]["rank"]) for s in by_instance}
    assert seen == {(head_url.removeprefix("http://"), "0"), (node_url.removeprefix("http://"), "1")}, seen
    (s,) = share
    cluster_share = float(s["value"][1])
    paths = {t["metric"]["path"]: float(t["value"][1]) for t in totals}
    rows_all = [x for p in logs for x in read_rows(p)]
    logged = sum(x["path"] == "prefill" for x in rows_all) / len(rows_all)
    print(
        f"\ntwo nodes: {len(versions)} versions confirmed by both engines; steps logged "
        f"{[len(read_rows(p)) for p in logs]}; Prometheus prefill share over both nodes (30 s rate) "
        f"{cluster_share:.3f}; over the run {float(whole_share[0]['value'][1]):.3f}; decisions by path {paths}; "
        f"shape logs' prefill share {logged:.3f}"
    )
    assert 0.0 <= cluster_share <= 1.0
    (w,) = whole_share  # one query, both nodes: the cluster-wide prefill share of the run
    assert abs(float(w["value"][1]) - logged) <= 0.02, (w, logged)
    # The counters Prometheus last scraped from both nodes add up to what both shape logs hold
    # (the last scrape may miss the final second's steps; no rank is counted twice).
    assert 0.9 * len(rows_all) <= sum(paths.values()) <= len(rows_all)
    assert "to every worker of engines [0, 1]" in head_log
    assert node_log.count("thresholds now come through the engine channel") == 1


def test_file_polling_across_nodes_is_refused_at_start(tiny_model, tmp_path):
    """Both nodes without the endpoint plugin: node 1's worker (engine 1, local engine 0) refuses at
    start with a message naming the fix; node 1 stops (the head would wait for engine 1 in vain)."""
    rpc_port = free_port()
    env = flyserve_env(tmp_path / "node1-state", "cpu-tiny", VLLM_CPU_OMP_THREADS_BIND="1", VLLM_PLUGINS="flyserve",
                       VLLM_ENGINE_READY_TIMEOUT_S="300")  # fmt: skip
    head_env = flyserve_env(tmp_path / "head-state", "cpu-tiny", VLLM_CPU_OMP_THREADS_BIND="0",
                            VLLM_PLUGINS="flyserve")  # fmt: skip
    node1 = spawn("node1", [*vllm_command(), "serve", str(tiny_model), "--headless", "--data-parallel-start-rank",
                            "1", *dp_args(rpc_port)], tmp_path, env)  # fmt: skip
    head = spawn("head", [*vllm_command(), "serve", str(tiny_model), "--port", str(free_port()),
                          *dp_args(rpc_port)], tmp_path, head_env)  # fmt: skip
    try:
        wait_for(lambda: node1.poll() is not None, "node 1 to refuse and exit", 400)
    finally:
        stop(node1)
        stop(head)
    log = (tmp_path / "node1.log").read_text(errors="replace")
    # vLLM's headless launcher exits (with status 0, as observed with 0.32) once its engine core died
    # of the worker's refusal; the refusal is what the log must carry.
    assert "this vLLM launch spans nodes (data-parallel engine 1 is local engine 0 of its node" in log
    assert "which cannot cross nodes" in log and "VLLM_PLUGINS=flyserve,flyserve-endpoint" in log
