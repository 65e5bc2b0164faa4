"""Connections that open /dispatch-stats/stream and never read cannot hold the stream slots: against
the real processes (`flyserve sidecar` under uvicorn beside `flyserve simulate`, tests/integration/
_attack_rig.py), more raw sockets than there are slots send the stream's GET with a small receive
buffer and never read, and keep coming back. Within a bounded wait a fresh client still gets an
event, /readyz answers 200, a PATCH with the token is applied by both ranks at one step, every
non-reader is dropped by the server, and flyserve_sidecar_stream_reclaims_total counts them.

The hub's rules one by one, without a server: tests/unit/test_sidecar_stream_reclaim.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from _attack_rig import patch_and_time_apply, rig
from _live_sidecar import wait_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

SLOTS = 8
NON_READERS = SLOTS + 4
STREAM_GET = b"GET /dispatch-stats/stream?interval=0.05 HTTP/1.1\r\nHost: stalled\r\n\r\n"


def reclaims(url: str, reason: str | None = None) -> float:
    """flyserve_sidecar_stream_reclaims_total for ``reason`` (None: every stream dropped, that is
    every reason but "full", a new stream refused)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "flyserve_sidecar_stream_reclaims_total"
        and (s.labels.get("reason") == reason or (reason is None and s.labels.get("reason") != "full"))
    )


def open_non_reader(port: int) -> socket.socket:
    """A stream request from a client that never reads: the receive buffer is set small before the
    connection (so the window it advertises stays small) and nothing is ever received."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.sendall(STREAM_GET)
    except OSError:
        s.close()
        raise
    return s


TCP_CLOSED_BY_PEER = (7, 8)  # TCP_CLOSE (reset), TCP_CLOSE_WAIT (closed): linux/tcp_states.h


def closed_by_peer(s: socket.socket) -> bool:
    """The server reset or closed the connection, told by the kernel's TCP state (TCP_INFO's first
    byte): nothing is read, so a non-reader stays one while it is asked."""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)[0] in TCP_CLOSED_BY_PEER
    except OSError:
        return True


def first_event_s(url: str, *, timeout: float) -> float:
    """Seconds until a fresh client's first stats event (raises if none came within ``timeout``).
    A 503 (every slot held, none stalled yet: the non-readers just opened) is retried after its
    Retry-After, within ``timeout``, as a client is told to."""
    t0 = time.monotonic()
    while True:
        with httpx.stream("GET", url + "/dispatch-stats/stream?max_events=1", timeout=timeout) as resp:
            if resp.status_code == 503 and time.monotonic() - t0 < timeout:
                time.sleep(min(float(resp.headers["Retry-After"]), 1.0))
                continue
            assert resp.status_code == 200, resp.read()[:300]
            for line in resp.iter_lines():
                if line.startswith("event: stats"):
                    return time.monotonic() - t0
                assert time.monotonic() - t0 < timeout, "no stats event in time"
        raise AssertionError("the stream ended without a stats event")


class NonReaders:
    """``n`` non-reading stream clients, each one the server closes replaced within 0.5 s, until stop()."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.socks: list[socket.socket] = []
        self.opened = 0
        self.retired: list[socket.socket] = []  # closed by the server, kept for the checks
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._keep_up, daemon=True, name="non-readers")

    def start(self) -> None:
        for _ in range(self.n):
            self._add()
        self._thread.start()

    def _add(self) -> None:
        try:
            s = open_non_reader(self.port)
        except OSError:
            return
        with self._lock:
            self.socks.append(s)
            self.opened += 1

    def _keep_up(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                for s in list(self.socks):
                    if closed_by_peer(s):
                        self.socks.remove(s)
                        s.close()
                missing = self.n - len(self.socks)
            for _ in range(missing):
                if self._stop.is_set():
                    break
                self._add()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()
            self.socks.clear()


def test_clients_that_never_read_cannot_hold_the_stream_slots(tmp_path: Path) -> None:
    args = ("--max-streams", str(SLOTS), "--stream-min-interval", "0.05", "--stream-write-timeout", "2")
    with rig(tmp_path, *args) as r:
        base = reclaims(r.url)
        flood = NonReaders(r.port, NON_READERS)
        extra: list[socket.socket] = []
        try:
            flood.start()
            assert flood.opened == NON_READERS, flood.opened
            # More non-readers than slots: the slots are theirs now; a fresh reader still gets in
            # (the slot of one that has stopped draining; a 503 at most while none has yet).
            took = [first_event_s(r.url, timeout=10)]
            ready = httpx.get(r.url + "/readyz", timeout=5)
            assert ready.status_code == 200, ready.text[:300]
            m = patch_and_time_apply(r, 4096)
            assert m.ok and m.applied_steps == (m.effective_step, m.effective_step), m
            # Every non-reader is dropped (backlog, or stalled: a write or a queue not draining) and
            # counted, while the flood keeps replacing them.
            wait_for(
                lambda: reclaims(r.url) - base >= NON_READERS, timeout=30, what="the non-readers reclaimed"
            )
            took.append(first_event_s(r.url, timeout=10))
            assert httpx.get(r.url + "/readyz", timeout=5).status_code == 200
            # And the server closes their connections (not only frees their slots): a fresh batch
            # of non-readers, each reset or closed within a bounded wait.
            extra = [open_non_reader(r.port) for _ in range(SLOTS)]
            wait_for(
                lambda: all(closed_by_peer(s) for s in extra), timeout=30, what="the server to drop them"
            )
            print(f"\nfresh client's first event after {[round(t, 3) for t in took]} s; "
                  f"{reclaims(r.url) - base:.0f} streams reclaimed; PATCH applied in {m.apply_s:.2f} s")  # fmt: skip
        finally:
            flood.stop()
            for s in extra:
                with contextlib.suppress(OSError):
                    s.close()


def test_a_stream_whose_send_blocks_is_dropped_at_the_write_deadline(tmp_path: Path) -> None:
    """With the backlog bound out of reach, the write deadline alone: the non-readers' kernel
    buffers fill, the server's next send blocks, and within --stream-write-timeout of that the
    connection is reset, the send returns and the slot is free."""
    args = ("--max-streams", "4", "--stream-min-interval", "0.05", "--stream-write-timeout", "1",
            "--stream-max-queued", "1000000")  # fmt: skip
    with rig(tmp_path, *args) as r:
        base = reclaims(r.url, "stalled")
        socks: list[socket.socket] = []
        try:
            socks = [open_non_reader(r.port) for _ in range(4)]
            # A few MB each at ~20 events/s before a send blocks (the kernel's autotuned send buffer).
            wait_for(lambda: reclaims(r.url, "stalled") - base >= 4, timeout=120, what="4 stalled streams")
            wait_for(
                lambda: all(closed_by_peer(s) for s in socks), timeout=10, what="the server to reset them"
            )
            assert first_event_s(r.url, timeout=10) < 10
            assert httpx.get(r.url + "/readyz", timeout=5).status_code == 200
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()
