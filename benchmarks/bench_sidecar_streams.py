"""/dispatch-stats latency with 100 SSE clients attached vs idle (a script, not a test): prints a table.

    .venv/bin/python benchmarks/bench_sidecar_streams.py [--ranks 2] [--rate 50] [--duration 10] [--clients 100]

With a payload computed per SSE client, /dispatch-stats p99 went from 4.6 ms (idle) to 201 ms with
100 clients, and three clients at ?interval=0.000001 held the sidecar at 99% CPU. This starts
`flyserve simulate` and one real sidecar (uvicorn, 127.0.0.1, default settings), then in ONE run
drives /dispatch-stats with the open-loop load of bench_sidecar.py (latency from the scheduled send
time, no coordinated omission) three times: with no stream open, with N clients on
/dispatch-stats/stream at the default interval, and with N clients asking for ?interval=0.000001.
The SSE clients run in the same event loop as the load generator and only read and count. Load
generator, sidecar and ranks share the machine's CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_sidecar import drive, start_ranks, start_sidecar, stop, wait_ranks


async def with_streams(port: int, clients: int, query: str, rate: float, duration: float):
    """Open ``clients`` SSE streams, wait until each got its first event, then drive /dispatch-stats."""
    events = [0] * clients
    opened = []

    async def reader(i: int) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        opened.append(w)
        w.write(f"GET /dispatch-stats/stream{query} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        while True:
            line = await r.readline()
            if not line:
                return
            if line.startswith(b"event: stats"):
                events[i] += 1

    tasks = [asyncio.create_task(reader(i)) for i in range(clients)]
    deadline = time.monotonic() + 60
    while min(events) == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    first = sum(events)
    lat, errors, achieved = await drive("127.0.0.1", port, "/dispatch-stats", rate, duration)
    received = sum(events) - first
    for t in tasks:
        t.cancel()
    for w in opened:
        w.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    return lat, errors, achieved, received


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rate", type=float, default=50.0, help="/dispatch-stats requests per second, per row")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per row")
    ap.add_argument("--clients", type=int, default=100, help="SSE clients in the loaded rows")
    ap.add_argument("--workload", default="seed-8k-c8")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="flyserve-bench-streams-"))
    state, log = tmp / "state", tmp / "bench.log"
    sim = start_ranks(state, log, args.ranks, args.workload, args.duration * 3 + 180)
    sidecar = None
    rows = []
    try:
        sc = start_sidecar(tmp, "--stats-ttl", "0.5", "--metrics-ttl", "1.0")
        sidecar, port, base = sc.proc, sc.port, sc.url
        wait_ranks(base, args.ranks, sim, log, timeout=90)
        httpx.get(base + "/dispatch-stats", timeout=5)  # warm-up
        lat, err, ach = asyncio.run(drive("127.0.0.1", port, "/dispatch-stats", args.rate, args.duration))
        rows.append(("idle", 0, lat, err, ach, 0))
        for label, query in (("default interval", ""), ("?interval=0.000001", "?interval=0.000001")):
            lat, err, ach, got = asyncio.run(
                with_streams(port, args.clients, query, args.rate, args.duration)
            )
            rows.append((label, args.clients, lat, err, ach, got))
        lat, err, ach = asyncio.run(drive("127.0.0.1", port, "/dispatch-stats", args.rate, args.duration))
        rows.append(("idle again", 0, lat, err, ach, 0))  # drift of the shared machine over the run
    finally:
        if sidecar is not None:
            stop(sidecar)
        stop(sim)

    print(f"\n/dispatch-stats under SSE load: {args.ranks} simulated ranks ({args.workload}), open loop "
          f"{args.rate:g} req/s x {args.duration:g} s per row, one sidecar, one run")  # fmt: skip
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          "load generator, SSE clients, sidecar and ranks share it\n")  # fmt: skip
    idle_p99 = max(np.percentile(rows[0][2], 99), np.percentile(rows[-1][2], 99)) * 1e3
    hdr = "| streams | SSE clients | req/s | ok | err | p50 ms | p99 ms | p99 / idle (worse of the two) | SSE events read |"
    print(hdr)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, clients, lat, err, ach, got in rows:
        p50, p99 = np.percentile(lat, [50, 99]) * 1e3 if len(lat) else (float("nan"),) * 2
        print(f"| {label} | {clients} | {ach:.0f} | {len(lat)} | {err} | {p50:.2f} | {p99:.2f} | "
              f"{p99 / idle_p99:.2f}x | {got} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
