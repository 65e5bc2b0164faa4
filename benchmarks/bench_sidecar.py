"""Sidecar latency under a bounded local load (a script, not a test): prints a table.

    .venv/bin/python benchmarks/bench_sidecar.py [--ranks 8] [--rate 200] [--duration 10]

Starts `flyserve simulate` (N rank processes, seed-32k-c32) and the real sidecar (uvicorn, one
worker, 127.0.0.1, free port), waits until every rank reports, then drives each endpoint with an
open-loop load: request i is sent at t0 + i / rate whatever happened before (no coordinated
omission), and its latency is measured from that scheduled time to the last byte of the answer.
Rows: /dispatch-stats and /metrics with the sidecar's caches (defaults: stats TTL 0.5 s, metrics
TTL 1 s, refreshed in the background while in use), /dispatch-stats without any cache (TTL 0:
every request reads every rank's files, so the cost of the computation itself is visible), and
/healthz as the floor (uvicorn + FastAPI + the load generator itself). Everything (load generator, sidecar, ranks) shares this machine's
CPUs: on a small machine the numbers include that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx  # set-up only; the load itself uses the minimal client below
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from _live_sidecar import CLI, LiveSidecar, stop_process
from _live_sidecar import start_sidecar as start_live_sidecar

TOKEN = "bench-token-0123456789abcdef"
STEP_INTERVAL_S = 0.05  # the simulated ranks of bench_sidecar.py and bench_sidecar_streams.py


def start_sidecar(tmp: Path, *extra: str) -> LiveSidecar:
    """The sidecar under load: `flyserve sidecar --state-dir tmp/state *extra` as the live tests
    start it (127.0.0.1, a free port, the token in tmp/token, its output in tmp/sidecar.log),
    returned once /healthz answers; stopped again if it exits or is not up in 90 s."""
    return start_live_sidecar(tmp, TOKEN, *extra, timeout=90)


def stop(p: subprocess.Popen) -> None:
    """SIGTERM, 15 s for a clean exit, then SIGKILL."""
    stop_process(p, term_wait_s=15, kill_wait_s=5)


def start_ranks(state: Path, log: Path, ranks: int, workload: str, seconds: float) -> subprocess.Popen:
    """`flyserve simulate` with ``ranks`` ranks replaying ``workload``, a step every STEP_INTERVAL_S for
    about ``seconds``, its output appended to ``log``."""
    steps = int(seconds / STEP_INTERVAL_S)
    return subprocess.Popen(
        [*CLI, "simulate", "--state-dir", str(state), "--ranks", str(ranks), "--workload", workload,
         "--steps", str(steps), "--step-interval", str(STEP_INTERVAL_S)],
        stdout=log.open("a"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_ranks(base: str, want: int, sim: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Until the sidecar at ``base`` counts ``want`` live ranks; SystemExit naming ``log`` if the
    simulator exits first or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base + "/dispatch-stats", timeout=10).json()["live_ranks"] >= want:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or sim.poll() is not None:
            raise SystemExit(f"{want} ranks did not come up (see {log})")
        time.sleep(0.5)


class Conn:
    """One keep-alive HTTP/1.1 connection with a minimal client: the load generator shares the CPUs
    with the server, so it must cost far less per request than httpx does (measured: several ms)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def get(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status


async def drive(
    host: str, port: int, path: str, rate: float, duration: float
) -> tuple[np.ndarray, int, float]:
    """Open-loop load; returns (latencies in s of the 200 answers, errors, achieved rate).

    Request i is due at t0 + i / rate; its latency runs from that time to the last body byte, so
    time spent waiting for a free connection or a busy server counts (no coordinated omission).
    """
    n = int(rate * duration)
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    pool: asyncio.Queue[Conn] = asyncio.Queue()
    for _ in range(32):
        pool.put_nowait(Conn(*await asyncio.open_connection(host, port)))
    lat: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.2

    async def one(i: int) -> None:
        nonlocal errors
        due = t0 + i / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        conn = await pool.get()
        try:
            status = await asyncio.wait_for(conn.get(request), 10.0)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
            status = 0
            conn.writer.close()
            conn = Conn(*await asyncio.open_connection(host, port))
        pool.put_nowait(conn)
        if status == 200:
            lat.append(loop.time() - due)
        else:
            errors += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    took = loop.time() - t0
    while not pool.empty():
        pool.get_nowait().writer.close()
    return np.array(lat), errors, n / took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second, per endpoint run")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per endpoint run")
    ap.add_argument("--workload", default="seed-32k-c32")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="flyserve-bench-sidecar-"))
    state, log = tmp / "state", tmp / "bench.log"
    runs = [("/dispatch-stats", 0.5), ("/metrics", 0.5), ("/dispatch-stats", 0.0), ("/healthz", 0.5)]
    sim = start_ranks(state, log, args.ranks, args.workload, args.duration * len(runs) + 120)
    rows = []
    sidecar = None
    try:
        for path, ttl in runs:
            sc = start_sidecar(tmp, "--stats-ttl", str(ttl), "--metrics-ttl", "1.0" if ttl > 0 else "0")
            sidecar, port, base = sc.proc, sc.port, sc.url
            wait_ranks(base, args.ranks, sim, log, timeout=90)
            httpx.get(base + path, timeout=5)  # warm-up
            lat, errors, achieved = asyncio.run(drive("127.0.0.1", port, path, args.rate, args.duration))
            size = len(httpx.get(base + path, timeout=5).content)
            rows.append((path, ttl, achieved, len(lat), errors, lat, size))
            stop(sidecar)
            sidecar = None
    finally:
        if sidecar is not None:
            stop(sidecar)
        stop(sim)

    print(f"\nflyserve sidecar latency: {args.ranks} simulated ranks ({args.workload}), open loop "
          f"{args.rate:g} req/s x {args.duration:g} s per row")  # fmt: skip
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          "load generator, sidecar and ranks share it\n")  # fmt: skip
    hdr = f"| {'endpoint':<16} | {'stats TTL':>9} | {'req/s':>6} | {'ok':>5} | {'err':>3} | {'p50 ms':>7} | " \
          f"{'p99 ms':>7} | {'max ms':>7} | {'bytes':>6} |"  # fmt: skip
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for path, ttl, achieved, ok, errors, lat, size in rows:
        p50, p99, mx = (np.percentile(lat, [50, 99, 100]) * 1e3) if len(lat) else (float("nan"),) * 3
        print(f"| {path:<16} | {ttl:>7g} s | {achieved:>6.0f} | {ok:>5} | {errors:>3} | {p50:>7.2f} | "
              f"{p99:>7.2f} | {mx:>7.2f} | {size:>6} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
