"""Hostile clients and files against the real sidecar (uvicorn subprocess on 127.0.0.1): slow
connections, greedy SSE clients, poisoned rank reports, huge numbers, and a state directory damaged
before start. Every wait polls for the event with a generous deadline; nothing asserts on speed."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _live_sidecar import LiveSidecar, stop_process
from _live_sidecar import start_sidecar as start_live_sidecar
from _live_sidecar import wait_for as _wait_for

from flyserve.control import ControlPlane

pytestmark = pytest.mark.integration

TOKEN = "attack-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


wait_for = functools.partial(_wait_for, every=0.2)
Sidecar = LiveSidecar


def start_sidecar(
    tmp_path: Path, *extra: str, nofile: int | None = None, config: Path | None = None
) -> Sidecar:
    """The sidecar with this file's token; ``nofile``: under that fd limit (a wrapper sets it, then
    execs the sidecar); ``config``: with --config-file."""
    if config is not None:
        extra = (*extra, "--config-file", str(config))
    wrap: tuple[str, ...] = ()
    if nofile is not None:
        wrapper = (
            "import os, resource, sys; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
            "os.execv(sys.executable, sys.argv[1:])"
        )
        wrap = (sys.executable, "-c", wrapper)
    return start_live_sidecar(tmp_path, TOKEN, *extra, wrap=wrap)


def stop(sc: Sidecar) -> None:
    stop_process(sc.proc, kill_wait_s=5)


def healthz_ok(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------- slow connections


def test_a_half_sent_request_is_dropped_by_the_server(tmp_path: Path, stopper: list) -> None:
    sc = start_sidecar(tmp_path)
    stopper.append(sc)
    s = socket.create_connection(("127.0.0.1", sc.port), timeout=5)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    s.settimeout(2)
    deadline = time.monotonic() + 90  # the server's request deadline is 10 s
    closed = False
    while time.monotonic() < deadline and not closed:
        try:
            closed = s.recv(1024) == b""
        except TimeoutError:
            continue
        except ConnectionResetError:
            closed = True
    s.close()
    assert closed, "the server kept a half-sent request open for 90 s"


def test_slow_connections_at_the_fd_limit_do_not_keep_healthz_down(tmp_path: Path, stopper: list) -> None:
    """More half-sent requests than the sidecar has file descriptors (RLIMIT_NOFILE 128): /healthz
    must answer again once the request deadline has dropped them, while they are still held open."""
    sc = start_sidecar(tmp_path, nofile=128)
    stopper.append(sc)
    held = []
    try:
        for _ in range(160):
            try:
                c = socket.create_connection(("127.0.0.1", sc.port), timeout=5)
                c.sendall(b"GET /dispatch-stats HTTP/1.1\r\nHost: x\r\n")
                held.append(c)
            except OSError:
                break
        assert len(held) >= 100
        wait_for(lambda: healthz_ok(sc.url), timeout=120, what="/healthz with 160 slow connections open")
    finally:
        for c in held:
            c.close()


# ---------------------------------------------------------------- SSE


def read_events(url: str, n: int, params: dict[str, str]) -> list[dict]:
    events = []
    with httpx.Client(timeout=60) as c, c.stream("GET", url + "/dispatch-stats/stream", params=params) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) >= n:
                    break
    return events


def test_a_tiny_stream_interval_is_floored(tmp_path: Path, stopper: list) -> None:
    sc = start_sidecar(tmp_path, "--stats-ttl", "0")  # the default floor: 0.5 s
    stopper.append(sc)
    events = read_events(sc.url, 4, {"interval": "0.000001"})
    times = [e["time"] for e in events]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.45, gaps  # a lower bound: a slow machine only makes the gaps longer


_RECLAIMS = re.compile(r'^flyserve_sidecar_stream_reclaims_total\{reason="(\w+)"\} (\S+)$', re.MULTILINE)


def stream_reclaims(url: str) -> dict[str, float]:
    """flyserve_sidecar_stream_reclaims_total by reason."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in _RECLAIMS.finditer(text)}


class StreamReader:
    """A stream client that reads every event, in a thread, until stop() (or an error)."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval = url, interval
        self.events = 0
        self.status: int | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="stream-reader")
        self._thread.start()

    def _read(self) -> None:
        try:
            params = {"interval": str(self.interval)}
            with httpx.stream("GET", self.url + "/dispatch-stats/stream", params=params, timeout=30) as r:
                self.status = r.status_code
                for line in r.iter_lines():  # an event every interval: the stop flag is seen within one
                    if line.startswith("event: stats"):
                        self.events += 1
                    if self._stop.is_set():
                        return
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def open_non_reader(port: int) -> socket.socket:
    """A stream request from a client that never reads (its receive buffer set small first)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /dispatch-stats/stream?interval=0.05 HTTP/1.1\r\nHost: stalled\r\n\r\n")
    return s


def closed_by_peer(s: socket.socket) -> bool:
    """The server reset or closed the connection (TCP_INFO's state: TCP_CLOSE or TCP_CLOSE_WAIT)."""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)[0] in (7, 8)
    except OSError:
        return True


def test_a_stream_over_the_cap_is_refused_while_every_stream_reads(tmp_path: Path, stopper: list) -> None:
    """At --max-streams with no stream stalled, a new stream gets 503 with Retry-After (counted as
    "full"); no reading stream is ended for it (evicting the oldest let new connections push out
    every reader); /healthz answers; slots come back when the streams end."""
    sc = start_sidecar(tmp_path, "--max-streams", "2")
    stopper.append(sc)
    with httpx.Client(timeout=30) as c:
        with (
            c.stream("GET", sc.url + "/dispatch-stats/stream") as a,
            c.stream("GET", sc.url + "/dispatch-stats/stream") as b,
        ):
            assert a.status_code == b.status_code == 200
            with c.stream("GET", sc.url + "/dispatch-stats/stream?interval=3600") as third:  # no body read
                assert third.status_code == 503, third.status_code
                # a slot frees within seconds: an hour's interval is not an hour's wait
                assert 1 <= int(third.headers["Retry-After"]) <= 10, third.headers
            assert c.get(sc.url + "/healthz").status_code == 200
            assert next(a.iter_lines(), None) is not None and next(b.iter_lines(), None) is not None
        assert stream_reclaims(sc.url) == {"stalled": 0.0, "backlog": 0.0, "lease": 0.0, "full": 1.0}
        # slots come back when the streams end
        wait_for(lambda: read_events(sc.url, 1, {}) != [], timeout=30, what="a stream slot after two closed")


def test_a_burst_of_new_streams_at_the_cap_cannot_push_out_the_readers(tmp_path: Path, stopper: list) -> None:
    """Every slot held by a client that reads (flyserve top): a burst of new stream connections gets
    503 with Retry-After, each counted as "full", and the readers keep receiving events throughout."""
    sc = start_sidecar(tmp_path, "--max-streams", "2", "--stream-min-interval", "0.1")
    stopper.append(sc)
    readers = [StreamReader(sc.url, 0.1) for _ in range(2)]
    try:
        wait_for(lambda: all(r.events >= 2 for r in readers), timeout=30, what="both readers' events")

        def newcomer(_: int) -> tuple[int, str | None]:
            with httpx.stream("GET", sc.url + "/dispatch-stats/stream", timeout=30) as r:  # no body read
                return r.status_code, r.headers.get("Retry-After")

        seen = [r.events for r in readers]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(newcomer, range(24)))
        assert all(status == 503 and (after or "").isdigit() for status, after in answers), answers
        wait_for(
            lambda: all(r.events >= n + 5 for r, n in zip(readers, seen, strict=True)),
            timeout=30,
            what="the readers' events after the burst",
        )
        assert [r.error for r in readers] == [None, None]
        assert stream_reclaims(sc.url) == {"stalled": 0.0, "backlog": 0.0, "lease": 0.0, "full": 24.0}
    finally:
        for r in readers:
            r.stop()


def test_at_the_cap_a_new_stream_takes_the_slot_of_the_one_that_does_not_read(
    tmp_path: Path, stopper: list
) -> None:
    """One slot held by a reader, one by a client that never reads. With the tick's own bounds out
    of reach (the hub never drops it by itself here), a new stream is refused while the non-reader
    still drains, and once its queue stops draining the new stream takes its slot: the non-reader's
    connection is reset and counted as "stalled", the reader keeps its slot and its events."""
    args = ("--max-streams", "2", "--stream-min-interval", "0.05",
            "--stream-write-timeout", "600", "--stream-max-queued", "1000000")  # fmt: skip
    sc = start_sidecar(tmp_path, *args)
    stopper.append(sc)
    reader = StreamReader(sc.url, 0.05)
    stuck: socket.socket | None = None
    try:
        wait_for(lambda: reader.events >= 2, timeout=30, what="the reader's events")
        stuck = open_non_reader(sc.port)

        def newcomer_gets_in() -> bool:
            r = httpx.get(sc.url + "/dispatch-stats/stream", params={"max_events": "1"}, timeout=30)
            assert r.status_code in (200, 503), r.text[:300]
            return r.status_code == 200 and "event: stats" in r.text

        wait_for(newcomer_gets_in, timeout=60, what="a new stream to take the non-reader's slot")
        wait_for(lambda: closed_by_peer(stuck), timeout=10, what="the server to reset the non-reader")
        seen = reader.events
        wait_for(lambda: reader.events >= seen + 5, timeout=30, what="the reader's events after")
        assert reader.error is None
        got = stream_reclaims(sc.url)
        assert (got["stalled"], got["backlog"]) == (1.0, 0.0), got
    finally:
        reader.stop()
        if stuck is not None:
            stuck.close()


def test_slow_readers_at_the_cap_give_their_slot_up_once_past_the_lease(
    tmp_path: Path, stopper: list
) -> None:
    """Every slot held by a client that reads but asks for ?interval=3600: never stalled, it would
    hold its slot for an hour and a real `flyserve top` would get 503 all that time. With
    --stream-lease 2 a newcomer that retries gets in within seconds, taking the oldest slot (that
    stream ends; counted as "lease")."""
    sc = start_sidecar(tmp_path, "--max-streams", "2", "--stream-lease", "2")
    stopper.append(sc)
    readers = [StreamReader(sc.url, 3600) for _ in range(2)]
    try:
        wait_for(lambda: all(r.events >= 1 for r in readers), timeout=30, what="both readers' first event")
        statuses: list[int] = []

        def newcomer_gets_in() -> bool:
            r = httpx.get(sc.url + "/dispatch-stats/stream", params={"max_events": "1"}, timeout=30)
            assert r.status_code in (200, 503), r.text[:300]
            statuses.append(r.status_code)
            return r.status_code == 200 and "event: stats" in r.text

        wait_for(newcomer_gets_in, timeout=10, what="a new stream to take a slot past its lease", every=0.25)
        got = stream_reclaims(sc.url)
        assert got["lease"] >= 1.0 and (got["stalled"], got["backlog"]) == (0.0, 0.0), got
        assert got["full"] == statuses.count(503), (got, statuses)
        # the stream whose slot was taken has ended (its client, flyserve top, reconnects)
        wait_for(lambda: any(not r._thread.is_alive() for r in readers), timeout=10, what="a reader's end")
    finally:
        stop(sc)  # first: the slow readers' reads then end at once
        for r in readers:
            r.stop()


# ---------------------------------------------------------------- bad input


def test_poisoned_rank_reports_never_make_a_500(tmp_path: Path, stopper: list) -> None:
    sc = start_sidecar(tmp_path)
    stopper.append(sc)
    ranks = sc.state / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    now = time.time()
    base = {"pid": 1, "engine": 0, "applied_version": 0, "started": now - 60, "time": now}
    (ranks / "0.json").write_text(
        json.dumps({**base, "rank": 0, "step": 5}).replace('"step": 5', '"step": Infinity')
    )
    (ranks / "1.json").write_text(json.dumps({**base, "rank": 1, "step": 5, "steps_per_s": 1e308}))
    (ranks / "2.json").write_text(
        json.dumps({**base, "rank": 2, "step": 5}).replace('"rank": 2', '"rank": 1e400')
    )
    (ranks / "3.json").write_text(json.dumps({**base, "rank": 3, "step": 10**9}))
    with httpx.Client(base_url=sc.url, timeout=30) as c:
        for path in ("/dispatch-stats", "/readyz", "/metrics", "/thresholds"):
            r = c.get(path)
            assert r.status_code < 500 or (path == "/readyz" and r.status_code == 503), (path, r.text[:300])
        r = c.patch("/thresholds", json={"min_seq_len": 2048}, headers=AUTH)
        assert r.status_code == 200, r.text[:300]
    out = subprocess.run(
        [sys.executable, "-m", "flyserve.cli", "thresholds", "set", "min_seq_len=4096", "--state-dir", str(sc.state)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_huge_integers_are_a_422_naming_the_field(tmp_path: Path, stopper: list) -> None:
    cfg = tmp_path / "flyserve.yaml"
    cfg.write_text("min_seq_len: 2048\n")
    sc = start_sidecar(tmp_path, config=cfg)
    stopper.append(sc)
    with httpx.Client(base_url=sc.url, timeout=30) as c:
        r = c.patch(
            "/thresholds", content=b'{"min_seq_len": ' + b"9" * 5000 + b"}",
            headers={**AUTH, "Content-Type": "application/json"},
        )  # fmt: skip
        assert 400 <= r.status_code < 500 and len(r.text) < 2000, (r.status_code, r.text[:300])
        r = c.patch("/thresholds", json={"block_m": 2**70}, headers=AUTH)
        assert r.status_code == 422 and r.json()["field"] == "block_m"
        cfg.write_text("min_seq_len: " + "9" * 5000 + "\n")
        r = c.post("/reload", headers=AUTH)
        assert r.status_code == 422 and len(r.text) < 2000, r.text[:300]
        r = c.post("/thresholds/rollback", json={"version": True}, headers=AUTH)
        assert r.status_code == 422, r.text[:300]
    audit = [json.loads(ln) for ln in (sc.state / "audit.jsonl").read_text().splitlines()]
    assert any(e.get("result") == "invalid" and e.get("source") == "file" for e in audit)


# ---------------------------------------------------------------- damaged state at start


def test_the_sidecar_repairs_a_damaged_state_dir_at_start(tmp_path: Path, stopper: list) -> None:
    state = tmp_path / "state"
    plane = ControlPlane(state)
    for n in (2048, 3000, 4000):
        plane.apply_overrides({"min_seq_len": n}, actor="a")
    (state / "control" / "current.json").write_text('{"version": 3, "thr')  # truncated
    (state / "control" / "history" / "00000001.json").write_text("garbage")
    sc = start_sidecar(tmp_path)
    stopper.append(sc)
    with httpx.Client(base_url=sc.url, timeout=30) as c:
        r = c.get("/thresholds")
        assert r.status_code == 200 and r.json()["version"] == 3 and r.json()["values"]["min_seq_len"] == 4000
        assert c.get("/thresholds/history").status_code == 200
        r = c.patch("/thresholds", json={"min_seq_len": 5000}, headers=AUTH)
        assert r.status_code == 200 and r.json()["thresholds"]["version"] == 4
    assert json.loads((state / "control" / "current.json").read_text())["version"] == 4


# ---------------------------------------------------------------- one huge header


def test_a_single_header_over_16_kib_is_refused(tmp_path: Path, stopper: list) -> None:
    sc = start_sidecar(tmp_path)
    stopper.append(sc)
    try:  # the server may answer and close before the client has sent it all: a reset is a refusal
        status = httpx.get(sc.url + "/thresholds", headers={"X-Big": "a" * 100_000}, timeout=20).status_code
    except httpx.TransportError:
        status = -1
    assert status in (400, 431, -1), status  # was 200: the head arrived in one read
    r = httpx.get(sc.url + "/thresholds", headers={"X-Small": "a" * 8000}, timeout=20)
    assert r.status_code == 200
    assert healthz_ok(sc.url)


# ---------------------------------------------------------------- a FIFO among the rank reports


def test_a_fifo_in_ranks_blocks_no_endpoint_and_no_writer(tmp_path: Path, stopper: list) -> None:
    sc = start_sidecar(tmp_path)
    stopper.append(sc)
    (sc.state / "ranks").mkdir(parents=True, exist_ok=True)
    os.mkfifo(sc.state / "ranks" / "9.json")
    for path in ("/readyz", "/dispatch-stats", "/metrics"):
        r = httpx.get(sc.url + path, timeout=30)  # the unfixed sidecar never answered
        assert r.status_code in (200, 503), (path, r.status_code)
    r = httpx.patch(sc.url + "/thresholds", json={"min_seq_len": 3000}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.patch(sc.url + "/thresholds", json={"min_seq_len": 3001}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text  # the writers' lock was not left held
