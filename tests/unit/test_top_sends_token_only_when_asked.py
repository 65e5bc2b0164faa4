"""`flyserve top` and the bearer token: never sent on the sidecar's open stream, sent on a 401 from
the --url it was given (and only there), asked again on each reconnect, never after a redirect nor
through a proxy from the environment. The servers are real sockets on 127.0.0.1."""

from __future__ import annotations

import json

import httpx
import pytest
import typer
from scripted_http import answer, scripted_server, sse_head, wait_until
from typer.testing import CliRunner

from flyserve.top.stream import StatsStream

pytestmark = pytest.mark.slow  # real HTTP servers on 127.0.0.1

TOKEN = "s3cret-token-for-the-guarded-stream"
EVENT = b"data: " + json.dumps({"live_ranks": 1, "ranks": [], "engines": []}).encode() + b"\n\n"


def _one_event(conn) -> None:
    conn.sendall(sse_head() + EVENT)  # then the connection closes: top reconnects a second later


def test_the_open_stream_never_gets_the_token() -> None:
    with scripted_server(lambda req, conn: _one_event(conn)) as srv:
        stream = StatsStream(srv.url, interval=0.05, token=TOKEN).start()
        try:
            assert wait_until(lambda: stream.latest().events >= 2)  # a reconnect too
        finally:
            stream.stop()
    assert len(srv.requests) >= 2
    assert [r.headers.get("authorization") for r in srv.requests] == [None] * len(srv.requests)


def test_a_401_from_the_url_itself_gets_the_token_and_each_reconnect_asks_again() -> None:
    def guarded(req, conn) -> None:
        if req.headers.get("authorization") == f"Bearer {TOKEN}":
            _one_event(conn)
        else:
            answer(conn, "401 Unauthorized", b'{"detail": "token"}', "WWW-Authenticate: Bearer\r\n")

    with scripted_server(guarded) as srv:
        stream = StatsStream(srv.url, interval=0.05, token=TOKEN).start()
        try:
            assert wait_until(lambda: stream.latest().events >= 2), stream.latest()
        finally:
            stream.stop()
    sent = [r.headers.get("authorization") for r in srv.requests[:4]]
    assert sent == [None, f"Bearer {TOKEN}", None, f"Bearer {TOKEN}"]
    assert all(r.line.startswith("GET /dispatch-stats/stream?") for r in srv.requests)


def test_a_refused_token_is_sent_once_per_connection_and_said() -> None:
    with scripted_server(lambda req, conn: answer(conn, "401 Unauthorized")) as srv:
        stream = StatsStream(srv.url, interval=0.05, token=TOKEN).start()
        try:
            assert wait_until(lambda: len(srv.requests) >= 4)
            assert wait_until(lambda: "refused the token" in (stream.latest().error or ""))
        finally:
            stream.stop()
    sent = [r.headers.get("authorization") for r in srv.requests[:4]]
    assert sent == [None, f"Bearer {TOKEN}", None, f"Bearer {TOKEN}"]


def test_without_a_token_a_401_says_which_it_needs() -> None:
    with scripted_server(lambda req, conn: answer(conn, "401 Unauthorized")) as srv:
        stream = StatsStream(srv.url, interval=0.05).start()
        try:
            assert wait_until(
                lambda: "--token-file or $FLYSERVE_SIDECAR_TOKEN" in (stream.latest().error or "")
            )
        finally:
            stream.stop()
    assert all("authorization" not in r.headers for r in srv.requests)


def test_a_redirect_is_not_followed_so_the_token_cannot_go_elsewhere() -> None:
    with scripted_server(lambda req, conn: answer(conn, "401 Unauthorized")) as elsewhere:

        def redirect(req, conn) -> None:
            answer(
                conn, "307 Temporary Redirect", headers=f"Location: {elsewhere.url}/dispatch-stats/stream\r\n"
            )

        with scripted_server(redirect) as srv:
            stream = StatsStream(srv.url, interval=0.05, token=TOKEN).start()
            try:
                assert wait_until(
                    lambda: "redirect (HTTP 307), not followed" in (stream.latest().error or "")
                )
                assert wait_until(lambda: len(srv.requests) >= 2)
            finally:
                stream.stop()
    assert elsewhere.requests == []
    assert all("authorization" not in r.headers for r in srv.requests)


def test_no_proxy_from_the_environment_sees_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    with scripted_server(lambda req, conn: answer(conn, "401 Unauthorized")) as proxy:
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        with scripted_server(lambda req, conn: _one_event(conn)) as srv:
            with httpx.Client(timeout=5) as plain:  # what a default client does here: goes to the proxy
                plain.get(f"{srv.url}/dispatch-stats")
            assert len(proxy.requests) == 1 and srv.requests == []
            stream = StatsStream(srv.url, interval=0.05, token=TOKEN).start()
            try:
                assert wait_until(lambda: stream.latest().events >= 1), stream.latest()
            finally:
                stream.stop()
    assert len(proxy.requests) == 1  # only the plain client's
    assert all("authorization" not in r.headers for r in srv.requests)


def test_help_says_when_the_token_is_sent() -> None:
    from flyserve.top.cli import register

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    shown = " ".join(CliRunner().invoke(app, ["top", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "only when --url itself answers 401" in shown.replace("│ ", "").replace(" │", "")
    assert "Redirects are not followed" in shown
