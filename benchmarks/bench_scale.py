"""The sidecar at 64 ranks with 100 rank restarts, side by side with 2 ranks (a script, not a test):
prints a table.

    .venv/bin/python benchmarks/bench_scale.py [--rate 50] [--duration 20] [--restart-every 1.2]

In one run, one after the other on the same machine:

1. ``2 ranks``: `flyserve simulate --ranks 2` and the real sidecar (`flyserve sidecar`, its defaults:
   stats TTL 0.5 s, metrics TTL 1 s, ``--compact-interval 5``);
2. ``8x8, restarting``: `flyserve simulate --engines 8 --ranks 8 --restart-every S --max-restarts 100`
   (64 rank processes; every S seconds one is SIGKILLed and started again as a new process, as a
   crashed worker would be), measured while the restarts go on;
3. ``8x8, after 100 restarts``: the same processes once the 100th restart is done and a compaction
   has run.

Each row drives /dispatch-stats, then /metrics, with an open-loop load (request i is due at
t0 + i / rate; its latency runs from that time to the last byte: queueing counts), through the
minimal keep-alive client of bench_sidecar.py. Meanwhile a watcher process samples, once a second, the
number of ``*.db`` files in ``<state>/metrics`` and the sum of ``flyserve_dispatch_decisions_total``
in /metrics (it must never go down: a compaction that lost or double counted would show). Every
step of every rank is one decision, so that sum grows by about 2 per rank per second.
Everything (load generator, sidecar, ranks) shares this machine's CPUs. The simulated ranks run
at ``--ranks-nice`` (10): they stand in for vLLM workers, which run on CPUs of their own next to
their GPUs, and 64 of them take more than a core of a 2-core machine; niced, they still run, but
the sidecar's latency is not mostly a measure of the simulator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sidecar import drive, start_sidecar, stop, wait_ranks

STEP_INTERVAL = 0.5  # 64 processes on a small machine: 2 steps per second per rank


def decisions_total(body: str) -> float:
    return sum(
        float(line.rpartition(" ")[2])
        for line in body.splitlines()
        if line.startswith("flyserve_dispatch_decisions_total{")
    )


def _watch(metrics_dir: str, base: str, stop_event: Any, out: str) -> None:
    """Once a second: file count of <state>/metrics and the decisions total /metrics shows, written
    to ``out`` (JSON) after each sample. A process of its own: fetching and parsing a 736 KB body
    in the load generator's process would hold its GIL and add to the latencies it measures."""
    files: list[int] = []
    totals: list[float] = []
    drops: list[tuple[float, float]] = []
    with httpx.Client(timeout=10) as c:
        while not stop_event.wait(1.0):
            files.append(sum(1 for n in os.listdir(metrics_dir) if n.endswith(".db")))
            try:
                t = decisions_total(c.get(base + "/metrics").text)
            except httpx.HTTPError:
                continue
            if totals and t < totals[-1]:
                drops.append((totals[-1], t))
            totals.append(t)
            tmp = out + ".tmp"
            Path(tmp).write_text(json.dumps({"files": files, "totals": totals, "drops": drops}))
            os.replace(tmp, out)


class Watcher:
    """The _watch process and what it wrote last."""

    def __init__(self, metrics_dir: Path, base: str, out: Path) -> None:
        self.out = out
        self.stop_event = multiprocessing.Event()
        self.proc = multiprocessing.Process(
            target=_watch, args=(str(metrics_dir), base, self.stop_event, str(out)), daemon=True
        )

    def start(self) -> None:
        self.proc.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.kill()

    def data(self) -> dict[str, list]:
        try:
            return json.loads(self.out.read_text())
        except (OSError, ValueError):
            return {"files": [], "totals": [], "drops": []}


def measure(base: str, port: int, rate: float, duration: float) -> list[tuple[str, np.ndarray, int, int]]:
    out = []
    for path in ("/dispatch-stats", "/metrics"):
        httpx.get(base + path, timeout=10)  # warm-up: the caches start being refreshed
        time.sleep(1.0)
        lat, errors, _ = asyncio.run(drive("127.0.0.1", port, path, rate, duration))
        size = len(httpx.get(base + path, timeout=10).content)
        out.append((path, lat, errors, size))
    return out


def restarts_done(log: Path) -> int:
    """The simulator's progress lines say how many restarts it did."""
    n = 0
    for line in log.read_text(errors="replace").splitlines()[-50:]:
        if "restart(s)" in line:
            try:
                n = int(line.rsplit(",", 1)[1].split()[0])
            except (IndexError, ValueError):
                pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=50.0, help="requests per second per endpoint and row")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per endpoint and row")
    ap.add_argument("--restart-every", type=float, default=1.2)
    ap.add_argument("--restarts", type=int, default=100)
    ap.add_argument("--compact-interval", type=float, default=5.0)
    ap.add_argument("--switch-interval-ms", type=float, default=1.0,
                    help="the sidecar's --switch-interval-ms (0: Python's default 5 ms)")  # fmt: skip
    ap.add_argument("--ranks-nice", type=int, default=10, help="nice value of the simulated ranks (0: none)")
    args = ap.parse_args()
    nice = ["nice", "-n", str(args.ranks_nice)] if args.ranks_nice else []
    tmp = Path(tempfile.mkdtemp(prefix="flyserve-bench-scale-"))
    rows: list[tuple[str, str, np.ndarray, int, int, str]] = []
    notes: list[str] = []
    t_start = time.time()
    sidecar_args = ("--compact-interval", str(args.compact_interval), "--stale-after", "10",
                    "--switch-interval-ms", str(args.switch_interval_ms))  # fmt: skip

    # ------------------------------------------------------------------ 2 ranks
    phase = tmp / "2-ranks"
    phase.mkdir()
    state, log = phase / "state", tmp / "bench-2.log"
    sim = subprocess.Popen(
        [*nice, sys.executable, "-m", "flyserve.cli", "simulate", "--state-dir", str(state), "--ranks", "2",
         "--workload", "seed-32k-c32", "--steps", "400", "--step-interval", str(STEP_INTERVAL)],
        stdout=log.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    sidecar = None
    try:
        sc = start_sidecar(phase, *sidecar_args)
        sidecar, port, base = sc.proc, sc.port, sc.url
        wait_ranks(base, 2, sim, log)
        files = sum(1 for n in os.listdir(state / "metrics") if n.endswith(".db"))
        for path, lat, errors, size in measure(base, port, args.rate, args.duration):
            rows.append(("2 ranks", path, lat, errors, size, f"{files}"))
    finally:
        if sidecar is not None:
            stop(sidecar)
        stop(sim)

    # ------------------------------------------------------------------ 8 engines x 8 ranks
    phase = tmp / "8x8"
    phase.mkdir()
    state, log = phase / "state", tmp / "bench-64.log"
    steps = int((args.restarts * args.restart_every + 8 * args.duration + 400) / STEP_INTERVAL)
    sim = subprocess.Popen(
        [*nice, sys.executable, "-m", "flyserve.cli", "simulate", "--state-dir", str(state), "--engines", "8",
         "--ranks", "8", "--workload", "seed-32k-c32", "--steps", str(steps),
         "--step-interval", str(STEP_INTERVAL), "--restart-every", str(args.restart_every),
         "--max-restarts", str(args.restarts)],
        stdout=log.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    sidecar = None
    watcher = None
    try:
        sc = start_sidecar(phase, *sidecar_args)
        sidecar, port, base = sc.proc, sc.port, sc.url
        wait_ranks(base, 60, sim, log)  # a restarting rank is missing for a second or two
        watcher = Watcher(state / "metrics", base, tmp / "watch.json")
        watcher.start()
        r0 = restarts_done(log)
        for path, lat, errors, size in measure(base, port, args.rate, args.duration):
            rows.append(
                ("8x8, restarting", path, lat, errors, size, f"max {max(watcher.data()['files'] or [0])}")
            )
        notes.append(f"restarts during the 'restarting' rows: {r0} -> {restarts_done(log)}")
        deadline = time.monotonic() + args.restarts * args.restart_every * 3 + 300
        while restarts_done(log) < args.restarts:
            if time.monotonic() > deadline or sim.poll() is not None:
                raise SystemExit(f"the simulator did not reach {args.restarts} restarts (see {log})")
            time.sleep(2.0)
        time.sleep(args.compact_interval + 8.0)  # the last restarted rank is up, one compaction has run
        files_after = sum(1 for n in os.listdir(state / "metrics") if n.endswith(".db"))
        for path, lat, errors, size in measure(base, port, args.rate, args.duration):
            rows.append(("8x8, after 100 restarts", path, lat, errors, size, f"{files_after}"))
        stats = httpx.get(base + "/dispatch-stats", timeout=10).json()
        notes.append(
            f"after: live ranks {stats['live_ranks']}, engines {len(stats['engines'])}, "
            f"metrics files {files_after} (max seen {max(watcher.data()['files'] or [0])}), "
            f"{sum(1 for n in os.listdir(state / 'metrics') if n.endswith('_dead.db'))} archives"
        )
        watcher.stop()
        w = watcher.data()
        notes.append(
            f"decisions total in /metrics sampled {len(w['totals'])} times: "
            f"{w['totals'][0]:.0f} -> {w['totals'][-1]:.0f}, went down {len(w['drops'])} time(s)"
        )
    finally:
        if watcher is not None:
            watcher.stop()
        if sidecar is not None:
            stop(sidecar)
        stop(sim)

    print(
        f"\nflyserve sidecar at scale: open loop {args.rate:g} req/s x {args.duration:g} s per endpoint and "
        f"row; restarts every {args.restart_every:g} s (SIGKILL + a new process), --compact-interval "
        f"{args.compact_interval:g}; steps every {STEP_INTERVAL} s; ranks at nice {args.ranks_nice}; "
        f"sidecar --switch-interval-ms {args.switch_interval_ms:g}"
    )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load "
        f"average {os.getloadavg()[0]:.1f} at the end; run {time.time() - t_start:.0f} s; load generator, "
        "sidecar and ranks share it\n"
    )
    print("| ranks | endpoint | ok | err | p50 ms | p95 ms | p99 ms | max ms | body bytes | metrics files |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for who, path, lat, errors, size, files in rows:
        p50, p95, p99, mx = (np.percentile(lat, [50, 95, 99, 100]) * 1e3) if len(lat) else (float("nan"),) * 4
        print(
            f"| {who} | `{path}` | {len(lat)} | {errors} | {p50:.2f} | {p95:.2f} | {p99:.2f} | {mx:.2f} | "
            f"{size} | {files} |"
        )
    print()
    for n in notes:
        print("- " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
