"""A live flyserve stack for the dashboard checks and pictures: the real sidecar (uvicorn, started
with `flyserve sidecar`), `flyserve simulate` playing the ranks, and a real Prometheus
(/usr/bin/prometheus) scraping the sidecar every second, all on 127.0.0.1 in a temporary
directory, all stopped by ``LiveStack.close()``.

Used by tests/integration/test_dashboards_live.py and scripts/render_dashboards.py.

Kernel times: `flyserve simulate` runs no kernels (so it records no kernel times, rightly). To give
the Kernel paths panels real series to show, ``kernel-load`` (this file run as a script) times a
small numpy stand-in attention (causal over the batch's query tokens for the prefill path, a
plain softmax(QK^T)V for the unified path; shapes from the same workload, capped) with the host
clock, for rank 0, and observes the times into the real ``flyserve_kernel_seconds`` histogram in
the state directory's metrics files, like the kernel timer does. These are CPU stand-in times,
not GPU kernel measurements, and are labelled as such wherever they are shown.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
SCRAPE_INTERVAL_S = 1
RATE_INTERVAL = "4s"  # what Grafana's $__rate_interval is for a 1 s scrape (4 x scrape interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(
    what: str, ok, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(httpx.HTTPError, OSError):
            if ok():
                return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s:\n{tail}")


def _stop(proc: subprocess.Popen | None, timeout_s: float = 8.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


@dataclass
class LiveStack:
    """sidecar + simulate + kernel stand-in + Prometheus. Use as a context manager."""

    ranks: int = 2
    workload: str = "seed-8k-c8"
    steps: int = 9000
    step_interval_s: float = 0.01
    kernel_load_s: float = 90.0
    keep_dir: Path | None = None
    root: Path = field(init=False)
    state_dir: Path = field(init=False)
    sidecar_port: int = field(init=False)
    prom_port: int = field(init=False)
    token: str = field(init=False)
    started_at: float = field(init=False)
    _procs: dict[str, subprocess.Popen] = field(init=False, default_factory=dict)
    _logs: dict[str, Any] = field(init=False, default_factory=dict)
    _tmp: Any = field(init=False, default=None)

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed in close()
        self._logs[name] = log
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env or os.environ.copy(),
            start_new_session=True,  # its own process group: _stop() ends it and its children
        )
        self._procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        p = self.root / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def start(self) -> None:
        if not Path(PROMETHEUS).is_file():
            raise FileNotFoundError(f"{PROMETHEUS} missing: install Debian's `prometheus` package")
        if self.keep_dir is not None:
            self.root = Path(self.keep_dir)
            self.root.mkdir(parents=True, exist_ok=True)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="flyserve-dash-")
            self.root = Path(self._tmp.name)
        self.state_dir = self.root / "state"
        self.state_dir.mkdir()
        self.token = secrets.token_hex(16)
        token_file = self.root / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        env = os.environ.copy()
        env.pop("FLYSERVE_STATE_DIR", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env["PYTHONUNBUFFERED"] = "1"
        self._env = env
        cli = [sys.executable, "-m", "flyserve.cli"]

        self.sidecar_port = free_port()
        # The "What the thresholds cost" panels need a sidecar that prices samples (--costs). The
        # scenario's ranks play a 16-head layer; the H200 table was measured with 32, so the sidecar
        # would rightly refuse it: a copy relabelled for 16 heads checks the panels' plumbing only
        # (the simulator prices its kernel times with it too, so the drift panel has its 1.0).
        costs_doc = json.loads((REPO / "config" / "costs" / "h200.json").read_text())
        costs_doc["meta"]["num_heads"] = 16
        costs_file = self.root / "costs-plumbing-16-heads.json"
        costs_file.write_text(json.dumps(costs_doc))
        sidecar = self._spawn(
            "sidecar",
            [
                *cli,
                "sidecar",
                "--state-dir",
                str(self.state_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.sidecar_port),
                "--token-file",
                str(token_file),
                "--stale-after",
                "3",
                "--costs",
                str(costs_file),
                "--log-level",
                "warning",
            ],
            env,
        )
        _wait(
            "sidecar",
            lambda: httpx.get(f"{self.sidecar_url}/healthz", timeout=1).status_code == 200,
            30,
            sidecar,
            self.root / "sidecar.log",
        )

        self.started_at = time.time()
        self._spawn(
            "simulate",
            [
                *cli,
                "simulate",
                "--state-dir",
                str(self.state_dir),
                "--ranks",
                str(self.ranks),
                "--workload",
                self.workload,
                "--steps",
                str(self.steps),
                "--step-interval",
                str(self.step_interval_s),
                "--costs",  # samples carry modelled kernel times: the drift panel's input
                str(costs_file),
            ],
            env,
        )
        one_thread = {**env, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._spawn(
            "kernel-load",
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "kernel-load",
                "--state-dir",
                str(self.state_dir),
                "--workload",
                self.workload,
                "--seconds",
                str(self.kernel_load_s),
            ],
            one_thread,
        )

        self.prom_port = free_port()
        prom_dir = self.root / "prometheus"
        prom_dir.mkdir()
        cfg = yaml.safe_load((REPO / "config" / "prometheus.yml").read_text())
        cfg["global"]["scrape_interval"] = f"{SCRAPE_INTERVAL_S}s"
        cfg["global"]["evaluation_interval"] = f"{SCRAPE_INTERVAL_S}s"
        cfg["global"]["scrape_timeout"] = f"{SCRAPE_INTERVAL_S}s"
        cfg["rule_files"] = [str(REPO / "config" / "alerts.yml")]
        (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "flyserve"]
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{self.sidecar_port}"]
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        prom = self._spawn(
            "prometheus",
            [
                PROMETHEUS,
                f"--config.file={prom_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={prom_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.prom_port}",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ],
            env,
        )
        _wait(
            "prometheus",
            lambda: httpx.get(f"{self.prom_url}/-/ready", timeout=1).status_code == 200,
            30,
            prom,
            self.root / "prometheus.log",
        )

    def close(self) -> None:
        for name in ("simulate", "kernel-load", "prometheus", "sidecar"):
            _stop(self._procs.get(name))
        for log in self._logs.values():
            with contextlib.suppress(OSError):
                log.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- talking to it -----------------------------------------------------------------------

    @property
    def sidecar_url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar_port}"

    @property
    def prom_url(self) -> str:
        return f"http://127.0.0.1:{self.prom_port}"

    def patch_thresholds(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.patch(
            f"{self.sidecar_url}/thresholds",
            json=body,
            timeout=10,
            headers={"Authorization": f"Bearer {self.token}"},
        )

    def circuit(self, open_: bool) -> subprocess.CompletedProcess:
        """`flyserve thresholds circuit open|close` against the state directory (the operator's CLI)."""
        argv = [
            sys.executable,
            "-m",
            "flyserve.cli",
            "thresholds",
            "circuit",
            "open" if open_ else "close",
            "--state-dir",
            str(self.state_dir),
            "--actor",
            "dashboards-test",
        ]
        if open_:
            argv += ["--reason", "dashboards integration test"]
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=self._env, check=False
        )

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = httpx.get(f"{self.prom_url}/api/v1/query", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"query failed: {expr}\n{body}")
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
        r = httpx.get(
            f"{self.prom_url}/api/v1/query_range",
            timeout=30,
            params={"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"},
        )
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"query_range failed: {expr}\n{body}")
        return body["data"]["result"]

    def label_values(self, selector: str, label: str) -> list[str]:
        r = httpx.get(f"{self.prom_url}/api/v1/series", params={"match[]": selector}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"series failed: {selector}\n{body}")
        return sorted({s[label] for s in body["data"] if label in s})

    def wait_for(self, what: str, expr: str, timeout_s: float = 30.0) -> None:
        """Until the instant query returns a non-zero, finite sample."""

        def ok() -> bool:
            return any(_finite(float(s["value"][1])) and float(s["value"][1]) != 0 for s in self.query(expr))

        _wait(what, ok, timeout_s)

    def rules(self) -> list[dict]:
        body = httpx.get(f"{self.prom_url}/api/v1/rules", timeout=10).json()
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict]:
        return httpx.get(f"{self.prom_url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]


# ----------------------------------------------------------------------------- the scenario


@dataclass
class Scenario:
    """What run_scenario did, with wall-clock times (Unix seconds) of each event."""

    start: float
    events: list[tuple[float, str]] = field(default_factory=list)
    responses: dict[str, Any] = field(default_factory=dict)
    alert_states: dict[str, set[str]] = field(default_factory=dict)
    end: float = 0.0

    def at(self, name: str) -> float:
        return next(t for t, n in self.events if n == name)


def run_scenario(stack: LiveStack, *, phase_s: float = 8.0, log=print) -> Scenario:
    """Baseline, circuit open/close, a thresholds change that refuses every prefill (with an
    invalid change refused in the middle), the change undone: about 5 x ``phase_s`` seconds.

    The seed workloads' prefills come in bursts (seed-60k-c32: steps 0-60 of every 600), so the
    stack should step fast enough (0.01 s a step: a burst every 6 s) for each phase to see one."""
    stack.wait_for(
        "first dispatch decisions in Prometheus",
        f"sum(rate(flyserve_dispatch_decisions_total[{RATE_INTERVAL}]))",
        timeout_s=40,
    )
    sc = Scenario(start=stack.started_at)

    def mark(name: str) -> None:
        sc.events.append((time.time(), name))
        log(f"  {time.time() - sc.start:5.1f}s {name}")

    def watch_alerts(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for a in stack.alerts():
                sc.alert_states.setdefault(a["labels"]["alertname"], set()).add(a["state"])
            time.sleep(0.5)

    mark("baseline")
    time.sleep(phase_s)
    r = stack.circuit(True)
    if r.returncode != 0:
        raise RuntimeError(f"circuit open failed: {r.stdout}{r.stderr}")
    mark("circuit open")
    watch_alerts(phase_s)
    # Each phase ends on what Prometheus shows, not on a clock: the tests bound their windows by
    # these "seen" events (a loaded machine stretches a phase instead of failing it).
    stack.wait_for("the open circuit in Prometheus", "min(flyserve_circuit_open)", timeout_s=120)
    mark("circuit open seen")
    r = stack.circuit(False)
    if r.returncode != 0:
        raise RuntimeError(f"circuit close failed: {r.stdout}{r.stderr}")
    mark("circuit closed")
    stack.wait_for("the closed circuit in Prometheus", "max(flyserve_circuit_open) == bool 0", timeout_s=120)
    mark("circuit closed seen")
    time.sleep(phase_s / 2)
    r = stack.patch_thresholds({"min_seq_len": 100000})
    sc.responses["collapse"] = (r.status_code, r.json())
    mark("min_seq_len=100000 (every prefill refused)")
    time.sleep(phase_s / 2)
    r = stack.patch_thresholds({"min_seq_len": -5})
    sc.responses["invalid"] = (r.status_code, r.json())
    mark("invalid change (422)")
    watch_alerts(1.5 * phase_s)  # the refusing change lasts 2 phases: bursts of prefills are seconds apart
    # ... and at least until both ranks run it and a batch with prefill rows was refused under it.
    version = sc.responses["collapse"][1]["thresholds"]["version"]
    stack.wait_for(
        "both ranks on the refusing version",
        f"count(flyserve_thresholds_version >= {version}) == bool 2",
        timeout_s=120,
    )
    stack.wait_for(
        "a prefill batch refused (short_context) under the refusing version",
        f'sum(increase(flyserve_dispatch_decisions_total{{reason="short_context"}}[{RATE_INTERVAL}]))',
        timeout_s=120,
    )
    mark("refusal seen")
    r = stack.patch_thresholds({"min_seq_len": None})
    sc.responses["undo"] = (r.status_code, r.json())
    mark("override dropped (back to the profile)")
    watch_alerts(phase_s)
    sc.end = time.time()
    mark("end")
    return sc


# ----------------------------------------------------------------------------- Grafana's variables


_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((?P<expr>.*),\s*(?P<label>\w+)\s*\)\s*$", re.DOTALL)


def regex_of(values: list[str]) -> str:
    """A multi-value variable the way Grafana formats it for Prometheus: escaped, (a|b)."""
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", v) for v in values]
    return "(" + "|".join(escaped) + ")" if len(escaped) != 1 else escaped[0]


def resolve_variables(stack: LiveStack, model: dict) -> dict[str, list[str]]:
    """Evaluate the dashboard's query variables (label_values) in order, as Grafana does."""
    values: dict[str, list[str]] = {}
    for var in model["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = _LABEL_VALUES.match(var["query"])
        if not m:
            raise ValueError(f"variable {var['name']}: unsupported query {var['query']!r}")
        selector = substitute(m.group("expr"), values)
        values[var["name"]] = stack.label_values(selector, m.group("label"))
    return values


def substitute(expr: str, values: dict[str, list[str]], *, range_s: float | None = None) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    if range_s is not None:
        out = out.replace("$__range", f"{max(1, int(range_s))}s")
    for name in sorted(values, key=len, reverse=True):
        out = out.replace(f"${{{name}}}", regex_of(values[name])).replace(f"${name}", regex_of(values[name]))
    return out


def _finite(x: float) -> bool:
    return math.isfinite(x)


def samples(result: list[dict]) -> Iterator[tuple[dict, float, float]]:
    """(labels, time, value) of an instant or range result."""
    for series in result:
        points = series.get("values") or [series["value"]]
        for t, v in points:
            yield series["metric"], float(t), float(v)


# ----------------------------------------------------------------------------- kernel stand-in


def kernel_load(state_dir: Path, workload_name: str, seconds: float, rate_hz: float = 10.0) -> None:
    """Time a numpy stand-in attention per path (host clock) into flyserve_kernel_seconds{rank="0"}.

    The two paths are timed in turn (each on the next trace step the policy sends to it), so both
    have samples all the time although the workload's prefills come in bursts; the dashboards'
    time share weights each path's mean by its real decision rate, so the mix here does not matter.
    """
    import numpy as np

    from flyserve.control import StateDir
    from flyserve.lab.workloads import workload
    from flyserve.policy import BatchShape, decide
    from flyserve.telemetry import metrics
    from flyserve.thresholds_files import load_profile

    state = StateDir(state_dir)
    metrics.setup_multiprocess(state.metrics_dir)
    thresholds = load_profile("gfx950")
    steps: dict[str, list] = {"unified": [], "prefill": []}
    for ts in workload(workload_name):
        shape = BatchShape.from_query_lens(
            ts.query_lens, max_seq_len=ts.max_seq_len, num_heads=16, thresholds=thresholds
        )
        steps[decide(shape, thresholds).path].append((shape.num_actual_tokens, ts.max_seq_len))
    hist = {p: metrics.KERNEL_SECONDS.labels(p, "0") for p in steps}
    rng = np.random.default_rng(0)
    d = 64
    stop = False

    def _stop(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    end = time.monotonic() + seconds
    i = 0
    while not stop and time.monotonic() < end:
        path = ("unified", "prefill")[i % 2]
        tokens, max_seq_len = steps[path][(i // 2) % len(steps[path])]
        i += 1
        t = int(min(tokens, 128))
        ctx = int(max(t, min(max_seq_len, 1024)))
        q = rng.standard_normal((t, d), dtype=np.float32)
        k = rng.standard_normal((ctx, d), dtype=np.float32)
        v = rng.standard_normal((ctx, d), dtype=np.float32)
        t0 = time.perf_counter_ns()
        s = q @ k.T
        if path == "prefill":  # causal: query row j sees the context up to its own position
            s[np.triu_indices(t, ctx - t + 1, m=ctx)] = -np.inf
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=1, keepdims=True)
        _ = s @ v
        hist[path].observe((time.perf_counter_ns() - t0) / 1e9)
        time.sleep(1.0 / rate_hz)


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description="flyserve dashboards live-stack helpers (internal)")
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernel-load", help="time a numpy stand-in attention into flyserve_kernel_seconds")
    k.add_argument("--state-dir", type=Path, required=True)
    k.add_argument("--workload", required=True)
    k.add_argument("--seconds", type=float, required=True)
    a = p.parse_args(argv)
    if a.cmd == "kernel-load":
        kernel_load(a.state_dir, a.workload, a.seconds)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(_main(sys.argv[1:]))


__all__ = [
    "LiveStack",
    "Scenario",
    "free_port",
    "regex_of",
    "resolve_variables",
    "run_scenario",
    "samples",
    "substitute",
]
