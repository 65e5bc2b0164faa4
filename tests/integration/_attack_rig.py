"""A live rig for floods and state-directory attacks: `flyserve sidecar --costs h200` and `flyserve
simulate` (two ranks) on one state directory, a /healthz prober, a timed PATCH, and the attacks themselves.

Shared by tests/integration/test_sidecar_floods_live.py (which asserts the acceptance: /healthz
under 1 s, the PATCH applied within the documented bound) and benchmarks/bench_sidecar_under_attack.py
(which prints the numbers). Everything binds 127.0.0.1 on ports chosen free at run time, every
loop is bounded, and every process started is stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import resource
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _live_sidecar import (
    STEP_INTERVAL_S,
    read_rank_reports,
    sidecar_beside_simulator,
    wait_for,
    wait_ranks_at_speed,
)

from flyserve.control.effective import CONSENSUS_S, CONSENSUS_STEPS
from flyserve.control.plane import DEFAULT_LEAD_S

TOKEN = "flood-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STEP_MARGIN = 8
REPORT_LAG_S = 1.5  # a rank writes its report about once a second: the apply is seen that much later


def raise_fd_limit(want: int = 4096) -> None:
    """Room for a flood of client sockets in this process (and the children it starts)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def effective_bound_s(rate: float) -> float:
    """control/effective.py's bound (docs/operations.md) in seconds for a rank stepping at ``rate``:
    CONSENSUS_S + 2 * lead_s + (max(margin, CONSENSUS_STEPS) + 2) steps."""
    return CONSENSUS_S + 2 * DEFAULT_LEAD_S + (max(STEP_MARGIN, CONSENSUS_STEPS) + 2) / rate


def apply_bound_s(rate: float) -> float:
    """effective_bound_s plus the time a rank takes to report the apply (REPORT_LAG_S)."""
    return effective_bound_s(rate) + REPORT_LAG_S


@dataclass
class Rig:
    url: str
    port: int
    state: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def real_reports(self) -> dict[int, dict]:
        """The simulator's two ranks, read from their files (not through the code under test)."""
        return read_rank_reports(self.state / "ranks")


@contextlib.contextmanager
def rig(tmp: Path, *sidecar_args: str) -> Iterator[Rig]:
    """The sidecar (--costs h200) and a two-rank simulator, ranks past their first measured rate."""
    raise_fd_limit()
    with sidecar_beside_simulator(
        tmp,
        TOKEN,
        sidecar_args=("--step-margin", str(STEP_MARGIN), "--costs", "h200", *sidecar_args),
        simulate_args=(
            "--steps",
            "1000000",
            "--step-interval",
            str(STEP_INTERVAL_S),
            "--costs",
            "h200",
            "--workload",
            "seed-8k-c32",
        ),
    ) as both:
        r = Rig(both.sidecar.url, both.sidecar.port, both.sidecar.state, both.procs)
        wait_ranks_at_speed(r.real_reports)
        yield r


# ---------------------------------------------------------------- measuring


@dataclass
class Probe:
    """/healthz on a fresh connection every ``every`` s (as a kubelet probes): each answer's time,
    or what went wrong (a failure's time is the probe's timeout)."""

    times: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        xs = sorted(self.times)
        return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def healthz_once(port: int, timeout: float) -> int:
    """One GET /healthz on a fresh connection, as a kubelet probes: the status (0: no answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n" not in head and len(head) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _probe_loop(port: int, every: float, timeout: float, stop: Any, out: Any) -> None:
    """In its own process (the attack's client threads must not slow the prober's own GIL), on
    raw sockets (no client library's set-up time in the numbers)."""
    times: list[float] = []
    failures: list[str] = []
    while not stop.is_set():
        t = time.monotonic()
        try:
            status = healthz_once(port, timeout)
            times.append(time.monotonic() - t)
            if status != 200:
                failures.append(f"status {status}")
        except OSError as exc:
            times.append(time.monotonic() - t)
            failures.append(type(exc).__name__)
        stop.wait(every)
    out.send((times, failures))
    out.close()


@contextlib.contextmanager
def recording_healthz(
    url: str, times: list[float], failures: list[str], every: float = 0.2
) -> Iterator[None]:
    """GET ``url``/healthz every ``every`` s in a thread while the block runs: each answer's time
    into ``times``, each failure (a status other than 200, an HTTP error's name) into ``failures``."""
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    status = c.get(url + "/healthz").status_code
                    times.append(time.monotonic() - t)
                    if status != 200:
                        failures.append(f"status {status}")
                except httpx.HTTPError as exc:
                    failures.append(type(exc).__name__)
                stop.wait(every)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


@contextlib.contextmanager
def probing(port: int, *, every: float = 0.2, timeout: float = 5.0) -> Iterator[Probe]:
    """/healthz probed from a separate process (as a kubelet would) while the block runs."""
    probe = Probe()
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe_loop, args=(port, every, timeout, stop, send), daemon=True)
    proc.start()
    try:
        yield probe
    finally:
        stop.set()
        if recv.poll(timeout + 30):
            probe.times, probe.failures = recv.recv()
        else:
            probe.failures.append("the probe process sent nothing")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


@dataclass(frozen=True)
class Apply:
    status: int
    version: int | None
    apply_s: float | None  # publish -> both ranks report it applied (None: not within the bound)
    bound_s: float
    applied_steps: tuple[int, ...] = ()
    effective_step: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.apply_s is not None and self.apply_s <= self.bound_s


def patch_and_time_apply(r: Rig, value: int) -> Apply:
    """PATCH with the token on a fresh connection, then wait for both ranks to report the version."""
    rate = min(d.get("steps_per_s") or 1.0 for d in r.real_reports().values())
    bound = apply_bound_s(rate)
    try:
        resp = httpx.patch(r.url + "/thresholds", json={"min_seq_len": value}, headers=AUTH, timeout=30)
    except httpx.HTTPError:
        return Apply(0, None, None, bound)
    if resp.status_code != 200:
        return Apply(resp.status_code, None, None, bound)
    published = time.monotonic()
    snap = resp.json()["thresholds"]

    def applied() -> bool:
        got = r.real_reports()
        return len(got) == 2 and all(d.get("applied_version") == snap["version"] for d in got.values())

    try:
        wait_for(applied, timeout=bound + 30, what="both ranks to apply", every=0.05)
    except TimeoutError:
        return Apply(200, snap["version"], None, bound, (), snap["effective_step"])
    took = time.monotonic() - published
    steps = tuple(sorted(d.get("applied_step") for d in r.real_reports().values()))
    return Apply(200, snap["version"], took, bound, steps, snap["effective_step"])


# ---------------------------------------------------------------- attacks


class Attack:
    """Runs in background threads between start() and stop(); ``sent`` counts its requests."""

    name = "baseline"

    def __init__(self, url: str, port: int, state: Path | None = None) -> None:
        self.url, self.port, self.state = url, port, state
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.sent = 0
        self.statuses: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.statuses[what] = self.statuses.get(what, 0) + 1

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(40)

    def _spawn(self, target: Callable[[], None], n: int = 1) -> None:
        for i in range(n):
            t = threading.Thread(target=target, daemon=True, name=f"{self.name}-{i}")
            t.start()
            self.threads.append(t)


class HalfOpenFlood(Attack):
    """``n`` raw connections, half sending a partial request head, half nothing; closed ones are
    reopened every 0.5 s, so the flood stays at ``n`` (as an attacker would keep it)."""

    name = "half-open flood"

    def __init__(self, url: str, port: int, state: Path | None = None, n: int = 600) -> None:
        super().__init__(url, port, state)
        self.n = n
        self.socks: list[socket.socket] = []
        self.opened = self.reopened = 0

    def _open(self, i: int) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            if i % 2 == 0:
                s.sendall(b"GET /dispatch-stats HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            s.setblocking(False)
            self.opened += 1
            return s
        except OSError:
            return None

    def start(self) -> None:
        for i in range(self.n):
            s = self._open(i)
            if s is not None:
                self.socks.append(s)
        self._spawn(self._keep_up)

    def _keep_up(self) -> None:
        while not self.stop_event.wait(0.5):
            live = [s for s in self.socks if s.fileno() >= 0]
            readable, _, _ = select.select(live, [], [], 0) if live else ([], [], [])
            for s in readable:
                with contextlib.suppress(OSError):
                    s.close()
            self.socks = [s for s in self.socks if s.fileno() >= 0]
            while len(self.socks) < self.n and not self.stop_event.is_set():
                s = self._open(len(self.socks))
                if s is None:
                    break
                self.socks.append(s)
                self.reopened += 1

    def stop(self) -> None:
        super().stop()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()


class AdviceFlood(Attack):
    """``n`` unauthenticated clients asking GET /thresholds/advice in a loop."""

    name = "advice flood"

    def __init__(self, url: str, port: int, state: Path | None = None, n: int = 45) -> None:
        super().__init__(url, port, state)
        self.n = n

    def start(self) -> None:
        self._spawn(self._loop, self.n)

    def _loop(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.stop_event.is_set():
                try:
                    r = c.get(self.url + "/thresholds/advice")
                    self.count(
                        str(r.status_code)
                        + ("-stale" if r.status_code == 200 and r.json().get("stale") else "")
                    )
                except httpx.HTTPError as exc:
                    self.count(type(exc).__name__)
                self.sent += 1


class BigBodyFlood(Attack):
    """``n`` clients sending PATCH bodies with a 5000-digit integer or 5000-deep nesting, no token."""

    name = "big-number bodies"
    BODIES = (b'{"min_seq_len": ' + b"9" * 5000 + b"}", b"[" * 5000 + b"]" * 5000)

    def __init__(self, url: str, port: int, state: Path | None = None, n: int = 8) -> None:
        super().__init__(url, port, state)
        self.n = n

    def start(self) -> None:
        self._spawn(self._loop, self.n)

    def _loop(self) -> None:
        with httpx.Client(timeout=30) as c:
            i = 0
            while not self.stop_event.is_set():
                try:
                    r = c.patch(
                        self.url + "/thresholds",
                        content=self.BODIES[i % 2],
                        headers={"Content-Type": "application/json"},
                    )
                    self.count(str(r.status_code))
                except httpx.HTTPError as exc:
                    self.count(type(exc).__name__)
                self.sent += 1
                i += 1


class _StateFiles(Attack):
    """Writes into the state directory (as anyone who can write there could) until stopped."""

    def _state(self) -> Path:
        assert self.state is not None, "a state-directory attack needs the rig's state directory"
        return self.state

    def _forge_reports(self, ranks: tuple[int, ...], report: Callable[[int, float], dict]) -> None:
        """Reports for ``ranks`` under their own names, rewritten every 0.5 s until stopped."""
        ranks_dir = self._state() / "ranks"

        def loop() -> None:
            while not self.stop_event.is_set():
                now = time.time()
                for rank in ranks:
                    tmp = ranks_dir / f".forge-{rank}.tmp"
                    with contextlib.suppress(OSError):
                        tmp.write_text(json.dumps(report(rank, now)))
                        os.replace(tmp, ranks_dir / f"{rank}.json")
                        self.sent += 1
                self.stop_event.wait(0.5)

        self._spawn(loop)

    def _cleanup(self, paths: list[Path]) -> None:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()


def _elsewhere(rank: int, now: float, *, step: int, started: float) -> dict:
    return {"pid": 4242 + rank, "host": "elsewhere", "pidns": "", "rank": rank, "engine": 0,
            "started": started, "step": step, "applied_version": 0, "time": now}  # fmt: skip


class ShapeFilesAndAdvice(_StateFiles, AdviceFlood):
    """A FIFO and a /dev/zero symlink in shapes/ under two fresh forged ranks' names (so the
    sampler opens them), while 45 unauthenticated clients loop GET /thresholds/advice."""

    name = "FIFO + /dev/zero in shapes/, advice flood"

    def start(self) -> None:
        shapes = self._state() / "shapes"
        shapes.mkdir(exist_ok=True)
        self.paths = [shapes / "0-2.jsonl", shapes / "0-3.jsonl"]
        os.mkfifo(self.paths[0])
        self.paths[1].symlink_to("/dev/zero")
        rank_files = [self._state() / "ranks" / f"{r}.json" for r in (2, 3)]
        self.paths += rank_files
        self._forge_reports((2, 3), lambda r, now: _elsewhere(r, now, step=0, started=now - 60))
        super().start()

    def stop(self) -> None:
        super().stop()
        self._cleanup(self.paths)


class ForgedReports(_StateFiles):
    """Three plausible forged rank reports ("another host", started 2020-01-01, step 1e11),
    refreshed every 0.5 s: more than the two real ranks."""

    name = "3 forged rank reports (step 1e11)"

    def start(self) -> None:
        self.paths = [self._state() / "ranks" / f"{r}.json" for r in (2, 3, 4)]
        self._forge_reports(
            (2, 3, 4), lambda r, now: _elsewhere(r, now, step=10**11, started=1_577_836_800.0)
        )

    def stop(self) -> None:
        super().stop()
        self._cleanup(self.paths)


class FutureRankFiles(_StateFiles):
    """300 garbage files named like rank reports, dated an hour ahead."""

    name = "300 garbage rank files dated +1 h"

    def start(self) -> None:
        ranks_dir = self._state() / "ranks"
        self.paths = []
        ahead = time.time() + 3600
        for engine in range(1, 31):
            for rank in range(10):
                path = ranks_dir / f"{engine}-{rank}.json"
                path.write_bytes(os.urandom(64))
                os.utime(path, (ahead, ahead))
                self.paths.append(path)
                self.sent += 1

    def stop(self) -> None:
        super().stop()
        self._cleanup(self.paths)


class ForgedSamples(_StateFiles):
    """A fresh forged rank (4) whose shapes file holds 300 plausible prefill samples it
    never routed, rewritten every 2 s, while 4 clients ask for advice (refused: 409, "samples")."""

    name = "forged shape samples, advice asked"

    def start(self) -> None:
        shapes = self._state() / "shapes"
        shapes.mkdir(exist_ok=True)
        self.paths = [shapes / "0-4.jsonl", self._state() / "ranks" / "4.json"]
        self._forge_reports((4,), lambda r, now: _elsewhere(r, now, step=0, started=now - 60))
        row = {"query_lens": [1] * 31 + [1024], "max_seq_len": 9216, "num_heads": 32, "causal": True,
               "seq_lens": [8192] * 31 + [9216], "path": "prefill", "head_size": 128, "block_size": 16}  # fmt: skip

        def samples() -> None:
            i = 0
            while not self.stop_event.is_set():
                now = time.time()
                lines = "".join(
                    json.dumps({"step": 10**6 + i + k, "time": round(now - 0.005 * k, 3)} | row) + "\n"
                    for k in range(300)
                )
                with contextlib.suppress(OSError):
                    self.paths[0].write_text(lines)
                i += 300
                self.stop_event.wait(2.0)

        def ask() -> None:
            with httpx.Client(timeout=30) as c:
                while not self.stop_event.is_set():
                    try:
                        self.count(
                            str(c.get(self.url + "/thresholds/advice", params={"window": "60s"}).status_code)
                        )
                    except httpx.HTTPError as exc:
                        self.count(type(exc).__name__)
                    self.sent += 1
                    self.stop_event.wait(0.25)

        self._spawn(samples)
        self._spawn(ask, 4)

    def stop(self) -> None:
        super().stop()
        self._cleanup(self.paths)


ATTACKS: dict[str, type[Attack]] = {
    "baseline": Attack,
    "shapes": ShapeFilesAndAdvice,
    "half-open": HalfOpenFlood,
    "forged-reports": ForgedReports,
    "future-files": FutureRankFiles,
    "advice": AdviceFlood,
    "big-bodies": BigBodyFlood,
    "forged-samples": ForgedSamples,  # last: its samples stay in the 900 s window (advice then refuses)
}
"""The floods, the big-number bodies and the state-directory attacks, each a row of the benchmark;
the state-directory attacks (shape files, forged reports, future rank files, forged samples) write
into the rig's state directory and remove what they wrote."""
