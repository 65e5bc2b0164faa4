"""Bind the sidecar's socket before saying where it listens.

uvicorn binds inside ``Server.run()``, after the CLI has printed its URL: a port in use printed
"flyserve sidecar on http://127.0.0.1:9400" first and ``[Errno 98] address already in use`` after,
with no hint. Binding here first gives one clear error naming ``--port``; uvicorn then serves on
the socket it is handed (``Server.run(sockets=[sock])``).
"""

from __future__ import annotations

import errno
import socket


class BindError(OSError):
    """The address cannot be bound; the message names --host/--port and what to do."""


def bind(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for host:port, with SO_REUSEADDR as uvicorn sets it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"--host {host}: cannot resolve ({exc.strerror or exc})") from None
    family, kind, proto, _name, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise BindError(
                f"--port {port}: {host}:{port} is already in use (another sidecar?); "
                "stop it or choose a free port with --port"
            ) from None
        raise BindError(f"--host {host} --port {port}: cannot bind ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock
