"""/metrics with thousands of dead processes' metric files, before and after compaction (a script,
not a test): prints a table.

    .venv/bin/python benchmarks/bench_metrics_files.py [--dead 750] [--live 64] [--rounds 15]

One real process writes one rank's files through flyserve's metrics backend (counters, histograms,
live gauges and the control plane's max gauge: 4 files, as a rank process writes); they are cloned into ``--live`` processes that are alive
(this script's own pid space is not needed: the pids are marked alive by the compaction's
``is_alive``) and ``--dead`` processes that are gone (4 files each: 750 dead processes are
3,000 files), each with a rank label out of the live ones, as restarts of those ranks would
leave them. Then, in-process, without HTTP (the cost of building the exposition body is what a
scrape waits for):

* prometheus_client's ``MultiProcessCollector`` + ``generate_latest`` (what prometheus_client
  alone serves), and ``FilesExposition`` (flyserve's /metrics now), over every file;
* ``compact()`` once (timed), then both again over the compacted directory.

Each row: median, p95 and max over ``--rounds`` calls (the first call of FilesExposition parses
every file and is reported apart), the body size and the file count.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LIVE_PID_BASE = 4_000_000  # above any pid_max: the compaction is told which of these are alive
DEAD_PID_BASE = 5_000_000

WRITER = textwrap.dedent(
    """
    import os, sys
    from flyserve.telemetry import metrics as tm
    tm.setup_multiprocess(sys.argv[1])
    r = "0"
    for path, reason in (("prefill", "chunk"), ("unified", "decode_only"), ("unified", "short_context")):
        tm.DISPATCH_DECISIONS.labels(path, reason, r).inc(100)
    for path in ("prefill", "unified"):
        tm.DISPATCH_TOKENS.labels(path, r).inc(10_000)
        tm.DISPATCH_ROWS.labels(path, "prefill", r).inc(50)
        tm.DISPATCH_ROWS.labels(path, "decode", r).inc(500)
        for i in range(20):
            tm.DISPATCH_QUERY_TOKENS.labels(path, r).observe(37 * (i + 1))
            tm.DISPATCH_MAX_SEQ_LEN.labels(path, r).observe(911 * (i + 1))
            tm.KERNEL_SECONDS.labels(path, r).observe(0.0003 * (i + 1))
    tm.DISPATCH_LPT.labels("lpt", r).inc(3)
    tm.ENGINE_STEP.labels(r).set(1000)
    tm.THRESHOLDS_VERSION.labels(r).set(2)
    tm.CIRCUIT_OPEN.labels(r).set(0)
    tm.LATE_APPLIES.labels(r).inc(0)
    os._exit(0)
    """
)


def make_files(d: Path, live: int, dead: int) -> None:
    from flyserve.telemetry.prom import encode_values_file, read_values_file

    src = d / "src"
    src.mkdir()
    subprocess.run(
        [sys.executable, "-c", WRITER, str(src)],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
    )
    templates = {}
    for f in src.glob("*.db"):
        kind = f.name.rsplit("_", 1)[0]  # counter, histogram, gauge_<mode>
        templates[kind] = [(k, v, ts) for k, v, ts, _ in read_values_file(f)]
    metrics = d / "metrics"
    metrics.mkdir()

    def clone(pid: int, rank: int) -> None:
        for kind, entries in templates.items():
            out = [(k.replace('"rank": "0"', f'"rank": "{rank}"'), v, ts) for k, v, ts in entries]
            (metrics / f"{kind}_{pid}.db").write_bytes(encode_values_file(out))

    for i in range(live):
        clone(LIVE_PID_BASE + i, i)
    for i in range(dead):
        clone(DEAD_PID_BASE + i, i % live)


def timed(fn, rounds: int) -> tuple[np.ndarray, bytes]:  # type: ignore[no-untyped-def]
    out = b""
    lat = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = fn()
        lat.append(time.perf_counter() - t)
    return np.array(lat), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dead", type=int, default=750, help="dead processes (4 files each)")
    ap.add_argument("--live", type=int, default=64, help="live rank processes (4 files each)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    from flyserve.telemetry.compaction import compact
    from flyserve.telemetry.files_exposition import FilesExposition

    tmp = Path(tempfile.mkdtemp(prefix="flyserve-bench-files-"))
    make_files(tmp, args.live, args.dead)
    metrics = tmp / "metrics"
    live_pids = set(range(LIVE_PID_BASE, LIVE_PID_BASE + args.live))

    def prom() -> bytes:
        reg = CollectorRegistry()
        MultiProcessCollector(reg, path=str(metrics))
        return generate_latest(reg)

    rows = []

    def measure(state: str) -> None:
        n_files = sum(1 for n in os.listdir(metrics) if n.endswith(".db"))
        lat, body = timed(prom, args.rounds)
        rows.append((state, "prometheus_client collector", n_files, lat, len(body), None))
        fx = FilesExposition(metrics)
        t = time.perf_counter()
        fx.text()
        first = time.perf_counter() - t
        lat, body2 = timed(fx.text, args.rounds)
        assert sorted(body2.decode().splitlines()) == sorted(body.decode().splitlines())
        rows.append((state, "FilesExposition (the sidecar)", n_files, lat, len(body2), first))

    measure("before compaction")
    t = time.perf_counter()
    report = compact(metrics, is_alive=lambda pid: pid in live_pids)
    took = time.perf_counter() - t
    measure("after compaction")

    print(
        f"\n/metrics body build: {args.live} live rank processes + {args.dead} dead ones "
        f"({4 * args.dead} files), {args.rounds} rounds each, in-process (no HTTP)"
    )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        f"compaction: {took * 1e3:.0f} ms, {report.merged} files merged, {report.dropped} dropped, "
        f"{report.files_before} -> {report.files_after} files\n"
    )
    print("| state | exposition | files | p50 ms | p95 ms | max ms | first call ms | body bytes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for state, how, n, lat, size, first in rows:
        p50, p95, mx = np.percentile(lat, [50, 95, 100]) * 1e3
        f = f"{first * 1e3:.0f}" if first is not None else "-"
        print(f"| {state} | {how} | {n} | {p50:.0f} | {p95:.0f} | {mx:.0f} | {f} | {size} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
