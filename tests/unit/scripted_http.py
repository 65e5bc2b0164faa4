"""A raw HTTP server on 127.0.0.1 (a port from the OS) that answers each request as a test scripts it.

Raw sockets rather than http.server: a hostile peer is one that breaks HTTP's and SSE's habits (a
line that never ends, bytes no framework would send), and the test must write exactly those bytes.
Every connection's handler is the test's own bounded function; the server stops on exit, and a
handler blocked on a send to a client that left ends with the client's socket.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Request:
    """What one request sent: its request line and its headers (lower-cased names)."""

    line: str
    headers: dict[str, str]


@dataclass
class Served:
    """The server's address and every request it was sent, in order."""

    url: str
    requests: list[Request] = field(default_factory=list)


Handler = Callable[[Request, socket.socket], None]
"""Writes the whole answer to the socket (the server closes it afterwards)."""


def _read_head(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk or len(data) > 64 << 10:
            return None
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {}
    for h in head[1:]:
        name, _, value = h.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Request(head[0], headers)


@contextmanager
def scripted_server(handler: Handler, *, max_connections: int = 50) -> Iterator[Served]:
    """Serve ``handler`` on 127.0.0.1 until the block ends (at most ``max_connections`` accepted)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    served = Served(f"http://127.0.0.1:{listener.getsockname()[1]}")
    stop = threading.Event()
    open_conns: list[socket.socket] = []

    def one(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10.0)
            try:
                req = _read_head(conn)
                if req is None:
                    return
                served.requests.append(req)
                handler(req, conn)
            except OSError:
                pass  # the client went away: its answer no longer matters

    def accept() -> None:
        for _ in range(max_connections):
            while not stop.is_set():
                try:
                    conn, _addr = listener.accept()
                    break
                except TimeoutError:
                    continue
            else:
                return
            open_conns.append(conn)
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield served
    finally:
        stop.set()
        acceptor.join(5)
        listener.close()
        for c in open_conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def sse_head(extra: str = "") -> bytes:
    """The head of a 200 event stream that ends when the connection closes."""
    return (
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        f"Connection: close\r\n{extra}\r\n"
    ).encode()


def answer(conn: socket.socket, status: str, body: bytes = b"", headers: str = "") -> None:
    """A whole answer with a body of known length."""
    conn.sendall(
        f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n".encode()
        + body
    )


def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``cond`` every 20 ms until it holds (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False
