"""`flyserve top` against whatever listens on the port: a line that never ends costs bounded memory
and the reader picks up at the next newline; a payload that is not a JSON object (an array, a
string, a number, nesting past the caps, NaN) is counted and skipped; a payload of the wrong types
is drawn anyway; and no escape sequence or rich markup from the stream reaches the screen."""

from __future__ import annotations

import io
import json
import random
import threading
import time
import tracemalloc
from typing import Any

import pytest
import typer
from rich.console import Console
from scripted_http import scripted_server, sse_head, wait_until
from typer.testing import CliRunner

from flyserve.top.sse import Dropped, iter_lines, iter_sse_data
from flyserve.top.stream import StatsStream
from flyserve.top.view import MAX_ROWS, Connection, render

MARKUP = "[red]R[/red][link=http://evil.example]L[/link]:warning:"
CONTROLS = (
    "\x1b]52;c;ZXZpbA==\x07"  # OSC 52: write the clipboard
    "\x1b[2J\x1b[H\x1b]0;pwned\x1b\\"  # clear the screen, set the window title
    "\x1bP+q\x1b\\\x9b31m\x9d0;t\x9c"  # DCS; C1 CSI and OSC
    "\u202e\u2066\u200b\x7f\r\n"  # bidi override and isolate, zero width, DEL, CR LF
)
HOSTILE = MARKUP + CONTROLS
RAW = ("\x1b", "\x07", "\x9b", "\x9d", "\x9c", "\u202e", "\u2066", "\u200b", "\x7f", "\r")

GOOD = {
    "thresholds": {"version": 3, "effective_step": 9, "source": "api", "profile": "gfx950", "overrides": {}},
    "live_ranks": 1,
    "ranks_agree": True,
    "control_mode": "engine channel",
    "late_applies": 0,
    "engines": [{"engine": 0, "ranks": [0], "ranks_agree": True, "totals": {"batches": 5}, "windows": {}}],
    "ranks": [{"engine": 0, "rank": 0, "pid": 7, "step": 10, "age_s": 0.5, "totals": {"batches": 5}}],
    "regret": None,
    "errors": [],
}


def _screen(stats: Any, conn: Connection | None = None, window: str = "60s") -> str:
    """What a terminal would be sent: a real terminal console (so rich would write links and styles),
    with colours off so that any ESC left is one that came from the payload."""
    out = io.StringIO()
    c = Console(file=out, width=400, force_terminal=True, color_system=None, legacy_windows=False)
    c.print(render(stats, window, conn or Connection("http://127.0.0.1:9400", events=1)))
    return out.getvalue()


def _raw_in(text: str) -> list[str]:
    return sorted({f"U+{ord(c):04X}" for c in text if c in RAW})


# ----------------------------------------------------------------------------- bounded reading


def test_a_line_that_never_ends_costs_bounded_memory_and_the_next_line_is_read() -> None:
    chunk = b"x" * (1 << 20)

    def endless_then_an_event():
        yield b"data: "
        for _ in range(256):  # 256 MiB without a newline
            yield chunk
        yield b'\n\ndata: {"ok": 1}\n\n'

    dropped = Dropped()
    tracemalloc.start()
    try:
        got = list(iter_sse_data(iter_lines(endless_then_an_event(), dropped=dropped), dropped=dropped))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == ['{"ok": 1}']
    assert dropped.lines == 1
    assert peak < 40 << 20, f"peak {peak >> 20} MiB while skipping a 256 MiB line"


def test_an_event_that_never_ends_is_dropped_and_counted() -> None:
    many = [f"data: {'y' * 100}" for _ in range(10_000)] + ["", "data: last", ""]
    dropped = Dropped()
    assert list(iter_sse_data(iter(many), dropped=dropped, max_event=64 << 10)) == ["last"]
    assert dropped.events == 1


def test_line_endings_and_a_line_cut_across_chunks() -> None:
    chunks = [b"data: a", b"b\r", b"\ndata: c\rdata: d\n", b"\n", b"data: e\r\n\r\n"]
    dropped = Dropped()
    assert list(iter_sse_data(iter_lines(chunks, dropped=dropped))) == ["ab\nc\nd", "e"]
    assert dropped.lines == 0


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_an_endless_line_from_a_real_socket_is_dropped_and_the_reader_resyncs() -> None:
    def handler(req, conn) -> None:
        conn.sendall(sse_head())
        conn.sendall(b"event: stats\ndata: ")
        block = b"z" * (64 << 10)
        for _ in range(192):  # 12 MiB on one line, past the 8 MiB line bound
            conn.sendall(block)
        conn.sendall(b"\n\n")
        conn.sendall(b"event: stats\ndata: " + json.dumps({**GOOD, "live_ranks": 7}).encode() + b"\n\n")
        time.sleep(2.0)  # keep the connection while the test looks

    with scripted_server(handler) as srv:
        stream = StatsStream(srv.url, interval=0.05).start()
        try:
            assert wait_until(lambda: stream.latest().stats is not None), stream.latest()
            lt = stream.latest()
        finally:
            stream.stop()
    assert lt.stats["live_ranks"] == 7 and lt.events == 1
    assert lt.oversize >= 1
    assert "1 oversize lines or events dropped" in _screen(
        lt.stats, Connection(srv.url, events=lt.events, oversize=lt.oversize)
    )


# ----------------------------------------------------------------------------- any payload

NOT_OBJECTS = [
    b"[1, 2, 3]",
    b'"a string"',
    b"42",
    b"null",
    b"true",
    b"NaN",
    b'{"live_ranks": NaN}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"live_ranks": ' + b"9" * 5000 + b"}",
    b"{not json",
]


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_payloads_that_are_not_objects_are_counted_and_the_last_good_one_stays() -> None:
    looked = threading.Event()

    def handler(req, conn) -> None:
        conn.sendall(sse_head())
        conn.sendall(b"data: " + json.dumps({**GOOD, "live_ranks": 1}).encode() + b"\n\n")
        for p in NOT_OBJECTS:
            conn.sendall(b"event: stats\ndata: " + p + b"\n\n")
        looked.wait(20.0)  # the test has seen the malformed ones before the last good one comes
        conn.sendall(b"data: " + json.dumps({**GOOD, "live_ranks": 9}).encode() + b"\n\n")
        time.sleep(2.0)

    with scripted_server(handler) as srv:
        stream = StatsStream(srv.url, interval=0.05).start()
        try:
            assert wait_until(lambda: stream.latest().malformed == len(NOT_OBJECTS)), stream.latest()
            middle = stream.latest()
            looked.set()
            assert wait_until(lambda: stream.latest().events == 2), stream.latest()
            lt = stream.latest()
        finally:
            stream.stop()
    assert middle.stats["live_ranks"] == 1 and "not a JSON object" in (middle.error or "")
    assert lt.stats["live_ranks"] == 9 and lt.error is None
    shown = _screen(lt.stats, Connection(srv.url, events=2, malformed=lt.malformed))
    assert f"{len(NOT_OBJECTS)} malformed events (not a JSON object) skipped" in shown
    assert "live ranks: 9" in shown


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "big", "float", "nan", "bool", "none", "list", "dict"]
    k = rng.choice(kinds if depth < 3 else kinds[:7])
    if k == "str":
        return rng.choice([HOSTILE, "", "x" * 5000, "60s"])
    if k == "int":
        return rng.choice([0, -1, 7, 2**63])
    if k == "big":
        return 10**400
    if k == "float":
        return rng.choice([0.5, -1e308, 1e308])
    if k == "nan":
        return rng.choice([float("nan"), float("inf"), float("-inf")])
    if k == "bool":
        return rng.choice([True, False])
    if k == "none":
        return None
    if k == "list":
        return [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = [
        "totals",
        "windows",
        "60s",
        "reasons",
        "short_context",
        "batches",
        "overrides",
        "drift",
        "unified",
    ]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _every_field(stats: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """GOOD's shape with one value at a time (and at random others) replaced by junk."""
    out = json.loads(json.dumps(stats))
    blocks = [out, out["thresholds"], out["engines"][0], out["ranks"][0]]
    for b in blocks:
        for key in list(b):
            if rng.random() < 0.4:
                b[key] = _junk(rng)
    return out


@pytest.mark.slow  # 6.6 s on the 2-core VM (fast-tier tests take under 0.3 s)
def test_the_view_draws_any_payload() -> None:
    rng = random.Random(20240611)
    for i in range(400):
        stats = _every_field(GOOD, rng) if i % 4 else _junk(rng)
        for window in ("60s", "total"):
            shown = _screen(stats, window=window)
            assert "flyserve top" in shown and _raw_in(shown) == [], (stats, _raw_in(shown))
    assert "malformed event: the payload is not a JSON object" in _screen([1, 2])
    many = {**GOOD, "ranks": [GOOD["ranks"][0]] * (MAX_ROWS + 50), "engines": "not a list"}
    assert "... 50 more" in _screen(many)


@pytest.mark.parametrize(
    "hostile", [MARKUP + CONTROLS, CONTROLS + MARKUP], ids=["markup-first", "controls-first"]
)
def test_escape_sequences_in_every_field_never_reach_the_screen(hostile: str) -> None:
    """Each order once: a table cell is cut at 48 characters, so each part must come first once."""

    def poison(x: Any) -> Any:
        if isinstance(x, dict):
            return {**{k: poison(v) for k, v in x.items()}, hostile: hostile}
        if isinstance(x, list):
            return [poison(v) for v in x] + [hostile]
        return hostile

    stats = poison(GOOD)
    stats["thresholds"]["overrides"] = {hostile: hostile}
    stats["errors"] = [hostile]
    stats["regret"] = {
        "costs": hostile,
        "unpriceable": hostile,
        "windows": {"60s": {"routed_over_oracle": None}},
    }
    stats["engines"][0]["windows"] = {"60s": {"batches": hostile, "reasons": {"short_context": hostile}}}
    conn = Connection(hostile, error=hostile, events=1)
    for window in ("60s", "total"):
        shown = _screen(stats, conn, window)
        assert _raw_in(shown) == [], _raw_in(shown)
        assert "\x1b]8;" not in shown  # rich wrote no hyperlink
        assert MARKUP in shown
        assert "\\x1b]52;c;ZXZpbA==\\x07" in shown


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_top_once_prints_no_raw_escape_from_the_stream() -> None:
    from flyserve.top.cli import register

    poisoned = {**GOOD, "control_mode": HOSTILE, "errors": [HOSTILE]}
    poisoned["thresholds"] = {**GOOD["thresholds"], "source": HOSTILE, "overrides": {HOSTILE: HOSTILE}}

    def handler(req, conn) -> None:
        conn.sendall(sse_head())
        conn.sendall(b"data: " + json.dumps(poisoned).encode() + b"\n\n")
        time.sleep(2.0)

    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # two commands: typer keeps the `top` subcommand name
    with scripted_server(handler) as srv:
        res = CliRunner().invoke(
            app, ["top", "--url", srv.url, "--once", "--interval", "0.05"], env={"COLUMNS": "300"}
        )
    assert res.exit_code == 0, res.output
    assert _raw_in(res.output) == [] and "\\x1b]52;c;ZXZpbA==\\x07" in res.output
    assert "[red]R[/red]" in res.output
