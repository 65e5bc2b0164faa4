"""The rollout analysis, for real: a real Prometheus scrapes four simulated replicas, one on a bad version.

Four replicas, each a real `flyserve sidecar --costs h200` (uvicorn) over its own state directory fed
by a real `flyserve simulate --costs h200 --kernel-timer-every 1` rank (the cost model's kernel time of
every step goes into flyserve_kernel_seconds, where the GPU timer puts a measured one). All replay the
same prefill-heavy shape log (generated here: 4k +-50% prompts, short answers) under the h200 profile.

Each sidecar reads its thresholds file (--config-file, as from a ConfigMap), which it publishes at start:

* r0 and r2 start with the fleet's file (``lpt: auto``): version 1;
* r3 is the planted bad version: its file also sets ``max_seq_len: 4096``, which sends every batch
  with a context over 4096 tokens, long prefills included, to the unified (Triton) kernel, the slow
  path for them on an H200: about 6x the kernel time per token by the cost model. Version 1 too: a
  version number says nothing of the content;
* r1 starts on an older file (``lpt: never``) and picks up the fleet's by its file watcher, as a pod
  whose ConfigMap was updated does: version 2 with everyone else's content, which must not count as
  a difference.

One real Prometheus (Debian's package) scrapes them every second and evaluates config/fleet_rules.yml,
with every 5m rate window shortened to RATE_WINDOW in a test copy (the 5-minute windows themselves are
covered by promtool's unit tests, config/fleet_rules_test.yml). Then:

1. the analysis queries of flyserve.fleet.queries, the ones deploy/'s AnalysisTemplate and
   MetricTemplate carry, with each replica in turn as the canary against the good others: r3 fails
   on kernel time per token and regret, every good replica passes every query;
2. flyserve:fleet_mixed_versions flags r3 only, and `flyserve fleet status` names r3 alone;
3. r2's sidecar dies (SIGKILL): every query with r2 as the canary, alone or beside r1, gives no data,
   never a pass, while r1 alone still passes; `fleet status` says r2's scrape fails.

Everything binds to 127.0.0.1 on ports the OS gave; every wait is on a condition with a deadline;
every process is stopped at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from _dashboards_live import _wait, free_port
from _prometheus_live import LiveProcesses, start_prometheus
from typer.testing import CliRunner

from flyserve.fleet import queries, rules
from flyserve.lab.workloads import WorkloadSpec, generate
from tests._support import require_binary

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
REPLICAS = ("r0", "r1", "r2", "r3")
BAD = "r3"
SILENT = "r2"
GOOD = tuple(r for r in REPLICAS if r != BAD)
RATE_WINDOW = "10s"
FLEET_FILE = "lpt: auto\n"  # the fleet's thresholds file: the h200 profile's own value
STEP_INTERVAL_S = 0.02  # 50 steps/s: the 138-step trace ~3.6 times per rate window


def _test_rules(dest: Path) -> Path:
    text = (REPO / "config" / "fleet_rules.yml").read_text()
    assert text == rules.render() and text.count("[5m]") >= 10  # the shipped windows
    path = dest / "fleet_rules.yml"
    path.write_text(text.replace("[5m]", f"[{RATE_WINDOW}]"))
    return path


def test_the_analysis_flags_the_bad_version_passes_the_good_and_gives_no_data_for_a_silent_replica(
    tmp_path: Path,
):
    prometheus = require_binary("prometheus")
    t_start = time.monotonic()
    processes = LiveProcesses(tmp_path)
    spawn, procs = processes.spawn, processes.procs
    cli = [sys.executable, "-m", "flyserve.cli"]
    trace = tmp_path / "prefill-heavy.jsonl"
    spec = WorkloadSpec(4096, 16, 8, num_requests=64, range_ratio=0.5, seed=1)
    trace.write_text(generate(spec, name="prefill-heavy").to_jsonl())
    ports = {r: free_port() for r in REPLICAS}
    state = {r: tmp_path / r for r in REPLICAS}
    config = {r: tmp_path / f"{r}-thresholds.yaml" for r in REPLICAS}

    def write_config(r: str, text: str) -> None:  # whole or not at all, as a ConfigMap swap
        tmp = config[r].with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, config[r])

    for r in REPLICAS:
        write_config(r, {BAD: FLEET_FILE + "max_seq_len: 4096\n", "r1": "lpt: never\n"}.get(r, FLEET_FILE))
    timings: dict[str, float] = {}
    try:
        for r in REPLICAS:
            spawn(
                f"sidecar-{r}",
                [*cli, "sidecar", "--state-dir", str(state[r]), "--host", "127.0.0.1", "--port", str(ports[r]),
                 "--profile", "h200", "--config-file", str(config[r]), "--config-poll", "0.5",
                 "--costs", "h200", "--log-level", "warning"],
            )  # fmt: skip

        # Prometheus from the start; the windows judged below lie wholly after the last change.
        targets = [{"targets": [f"127.0.0.1:{ports[r]}"], "labels": {"replica": r}} for r in REPLICAS]
        prom = start_prometheus(processes, prometheus, _test_rules, targets)

        # A rank starts once its sidecar has published the file (a rank that starts first would
        # learn of version 1 late).
        for r in REPLICAS:
            _wait(
                f"sidecar {r}",
                lambda p=ports[r]: httpx.get(f"http://127.0.0.1:{p}/healthz", timeout=1).status_code == 200,
                60,
                procs[f"sidecar-{r}"],
                tmp_path / f"sidecar-{r}.log",
            )
            spawn(
                f"simulate-{r}",
                [*cli, "simulate", "--state-dir", str(state[r]), "--ranks", "1", "--workload", str(trace),
                 "--steps", "100000", "--step-interval", str(STEP_INTERVAL_S), "--profile", "h200",
                 "--costs", "h200", "--kernel-timer-every", "1", "-q"],
            )  # fmt: skip

        def applied(r: str) -> int | None:
            body = httpx.get(f"http://127.0.0.1:{ports[r]}/dispatch-stats", timeout=2).json()
            versions = {v["applied_version"] for v in body["ranks"] if not v["stale"]}
            return versions.pop() if len(versions) == 1 else None

        for r in REPLICAS:
            _wait(
                f"{r}'s rank",
                lambda r=r: applied(r) == 1,
                60,
                procs[f"simulate-{r}"],
                tmp_path / f"simulate-{r}.log",
            )
        write_config("r1", FLEET_FILE)  # the ConfigMap update reaches r1
        try:  # the watcher publishes in about a second; the deadline is for a loaded CI machine
            r1_log = tmp_path / "sidecar-r1.log"
            _wait("r1 at version 2", lambda: applied("r1") == 2, 60, procs["sidecar-r1"], r1_log)
        except TimeoutError as exc:  # say where it stopped: published or not, applied or not
            seen = {}
            for what in ("thresholds", "dispatch-stats"):
                try:
                    seen[what] = httpx.get(f"http://127.0.0.1:{ports['r1']}/{what}", timeout=5).json()
                except (httpx.HTTPError, ValueError) as err:
                    seen[what] = repr(err)
            ranks = seen["dispatch-stats"].get("ranks") if isinstance(seen["dispatch-stats"], dict) else None
            th = seen["thresholds"]
            th = {k: th.get(k) for k in ("version", "source", "values")} if isinstance(th, dict) else th
            raise AssertionError(f"{exc}\nthresholds: {th}\nranks: {ranks}") from exc
        timings["versions applied"] = time.monotonic() - t_start
        for r in REPLICAS:  # what each runs: the h200 profile under its file
            th = httpx.get(f"http://127.0.0.1:{ports[r]}/thresholds", timeout=2).json()
            assert th["profile"] == "h200" and th["source"] == "file", th
            assert th["values"]["max_seq_len"] == (4096 if r == BAD else 0), th
        _wait(
            "prometheus",
            lambda: httpx.get(f"{prom}/-/ready", timeout=1).status_code == 200,
            60,
            procs["prometheus"],
        )

        def query(expr: str) -> list[dict]:
            body = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=5).json()
            assert body["status"] == "success", body
            return body["data"]["result"]

        def by_replica(expr: str) -> dict[str, float]:
            return {s["metric"]["replica"]: float(s["value"][1]) for s in query(expr)}

        # Full rate windows for every replica, wholly at the version now in force: a sample on (almost)
        # every second of the last RATE_WINDOW + 2 s with no version change among them, and its kernel
        # time per token, regret and content recorded.
        span = int(RATE_WINDOW.rstrip("s")) + 2
        settled = (
            f"(count_over_time({rules.THRESHOLDS_VERSION}[{span}s]) >= {span - 1})"
            f" and (changes({rules.THRESHOLDS_VERSION}[{span}s]) == 0)"
        )
        # Prometheus must hold the version each replica runs now: a window settled on r1's version 1
        # (its last scrape before the change was seen, on a loaded machine) is settled too.
        versions_now = {r: (2 if r == "r1" else 1) for r in REPLICAS}
        _wait(
            "full rate windows of every replica at its version now",
            lambda: (
                by_replica(rules.THRESHOLDS_VERSION) == versions_now
                and all(
                    set(by_replica(e)) == set(REPLICAS)
                    for e in (settled, rules.KERNEL_US_PER_TOKEN, rules.REGRET, rules.FINGERPRINT_INFO)
                )
            ),
            90,
        )
        timings["windows full"] = time.monotonic() - t_start

        kernel = by_replica(rules.KERNEL_US_PER_TOKEN)
        print("kernel us/token per replica:", {r: round(kernel[r], 5) for r in REPLICAS})
        good_mean = sum(kernel[r] for r in GOOD) / len(GOOD)
        for r in GOOD:  # the good replicas agree closely: one workload, one routing
            assert kernel[r] == pytest.approx(good_mean, rel=0.05), kernel
        assert kernel[BAD] > 3 * good_mean, kernel  # the model says ~6x
        by_path = query(f'{rules.KERNEL_US_PER_TOKEN_BY_PATH}{{replica="{BAD}"}}')
        assert {s["metric"]["path"] for s in by_path} == {"unified", "prefill"}
        assert by_replica(rules.THRESHOLDS_VERSION) == versions_now
        contents = {s["metric"]["replica"]: s["metric"]["fingerprint"] for s in query(rules.FINGERPRINT_INFO)}
        assert len({contents[r] for r in GOOD}) == 1 and contents[BAD] != contents["r0"]  # r1: same content
        assert by_replica(rules.MIXED_VERSIONS) == {"r0": 0, "r1": 0, "r2": 0, "r3": 1}
        per_version = {
            s["metric"]["fingerprint"]: float(s["value"][1]) for s in query(rules.VERSION_REPLICAS)
        }
        assert per_version == {contents["r0"]: 3.0, contents[BAD]: 1.0}
        per_version = {
            s["metric"]["fingerprint"]: float(s["value"][1]) for s in query(rules.VERSION_KERNEL_US_PER_TOKEN)
        }
        assert per_version[contents[BAD]] > 3 * per_version[contents["r0"]]

        # 1. each replica as the canary against the good others
        def verdicts(canary: str, stable: tuple[str, ...]) -> dict[str, tuple[str, list[float]]]:
            out = {}
            for q in queries.QUERIES:
                expr = q.render(f'replica=~"{canary}"', f'replica=~"{"|".join(stable)}"')
                values = [float(s["value"][1]) for s in query(expr)]
                out[q.name] = (queries.judge(q, values), values)
            return out

        for r in REPLICAS:
            got = verdicts(r, tuple(g for g in GOOD if g != r))
            if r == BAD:
                assert got["kernel-time-per-token"][0] == "fail", got
                assert got["kernel-time-per-token"][1][0] > 3, got
                assert got["regret"][0] == "fail", got
                assert got["late-applies"][0] == "pass" and got["canary-contents"][0] == "pass", got
            else:
                assert {k: v for k, (v, _) in got.items()} == dict.fromkeys(got, "pass"), (r, got)
        timings["analysis judged"] = time.monotonic() - t_start

        def fleet_status() -> dict[str, dict]:
            from flyserve.cli import app  # in this process: the command as the CLI runs it, no start-up

            res = CliRunner().invoke(
                app, ["fleet", "status", "--prometheus", prom, "--window", RATE_WINDOW, "--json"]
            )
            assert res.exit_code == 1, res.output  # 1: a replica disagrees or is unhealthy
            st = json.loads(res.output)
            assert st["majority_content"] == queries_content(contents["r0"])
            return {x["labels"]["replica"]: x for x in st["replicas"]}

        # 2. the fleet view names the bad replica alone
        by_name = fleet_status()
        assert [n for n, x in by_name.items() if x["disagrees"]] == [BAD]
        assert [w.split(":")[0] for w in by_name[BAD]["disagrees"]] == ["content", "kernel"]
        assert {x["health"] for x in by_name.values()} == {"ok"}
        assert by_name["r1"]["version"] == 2 and by_name["r1"]["content"] == by_name["r0"]["content"]
        assert by_name[BAD]["regret"] > 0.5 and by_name["r0"]["regret"] == pytest.approx(0.0, abs=1e-6)

        # 3. a replica dies (SIGKILL, as a crash): no data, never a pass
        dead = procs.pop(f"sidecar-{SILENT}")
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(timeout=10)
        _wait(f"{SILENT}'s numbers to go", lambda: SILENT not in by_replica(rules.REPLICA_LIVE), 30)
        assert SILENT not in by_replica(rules.KERNEL_US_PER_TOKEN)  # at once, not a rate window later
        for canary in (SILENT, f"r1|{SILENT}"):
            got = verdicts(canary, ("r0",))
            assert {k: v for k, (v, _) in got.items()} == dict.fromkeys(got, "no data"), (canary, got)
        got = verdicts("r1", ("r0",))  # r1 alone still passes: the silence is r2's only
        assert {v for v, _ in got.values()} == {"pass"}, got
        by_name = fleet_status()
        assert (
            by_name[SILENT]["health"] == "scrape failing" and by_name[SILENT]["kernel_us_per_token"] is None
        )
        timings["silent replica judged"] = time.monotonic() - t_start
        print("timings (s since start): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    finally:
        processes.stop_all()


def queries_content(fingerprint_label: str) -> str:
    """count_values' decimal fingerprint as `fleet status` prints it (13 hex digits)."""
    return f"{int(fingerprint_label):013x}"
