"""`flyserve top`'s autopilot lines: drawn from GET /autopilot's answer (a running trial, a promotion
awaiting approval, the autopilot off, an older sidecar's 404, a malformed answer), every value through
the terminal sanitiser; and the poll that asks for it every few seconds, bounded, trusting nothing."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest
from rich.console import Console
from scripted_http import answer, scripted_server, wait_until

from flyserve.top.autopilot_poll import MAX_BODY_BYTES, WAITING, AutopilotPoll, AutopilotSeen, seen_from
from flyserve.top.view import Connection, render

MARKUP = "[red]R[/red][link=http://evil.example]L[/link]:warning:"
CONTROLS = "\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m\u202e\u200b\x7f\r\n"
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\u200b", "\x7f", "\r")
TOKEN = "s3cret-token-for-the-guarded-autopilot"

STATS = {
    "thresholds": {"version": 3, "effective_step": 9, "source": "api", "profile": "gfx950", "overrides": {}},
    "live_ranks": 1,
    "ranks_agree": True,
    "control_mode": "engine channel",
    "engines": [],
    "ranks": [],
    "regret": None,
    "errors": [],
}

DECISION = {
    "trial_id": "ap-3-1",
    "decision": "rolled_back",
    "reason": "worse",
    "pairs": 14,
    "effect": 0.031,
    "at": 1_700_000_000,
    "result_version": 3,
}

RUNNING = {
    "mode": "auto",
    "paused": False,
    "state": "running",
    "trial": {
        "id": "ap-3-2",
        "changed": {"min_seq_len": [4096, 2048], "max_decode_rows": [8, 16]},
        "block_steps": 200,
        "blocks": 96,
        "pairs": 11,
        "arm_now": 1,
        "estimate": -0.0234,
        "interval": [-0.05, 0.004],
        "verdict": "continue",
        "reason": None,
    },
    "proposal": None,
    "last_refusal": None,
    "last_decisions": [DECISION],
}


def _screen(seen: AutopilotSeen | None, *, terminal: bool = False) -> str:
    """The screen as a terminal would get it (terminal: a real one, colours off, so any ESC left
    came from the answer) or as plain text."""
    out = io.StringIO()
    c = Console(file=out, width=300, force_terminal=terminal, color_system=None, legacy_windows=False)
    c.print(render(STATS, "60s", Connection("http://127.0.0.1:9400", events=1), seen))
    return out.getvalue()


def _answer(body: Any) -> AutopilotSeen:
    return seen_from(200, json.dumps(body).encode())


def test_a_running_trial_shows_its_knobs_pairs_arm_estimate_and_verdict() -> None:
    shown = _screen(_answer(RUNNING))
    assert "autopilot: mode auto  state running" in shown
    assert "trial ap-3-2: min_seq_len 4096 -> 2048, max_decode_rows 8 -> 16" in shown
    assert "pairs 11 of 48 (200-step blocks), arm now candidate" in shown
    assert "estimate -2.34% [-5.00%, +0.40%]" in shown
    assert "verdict continue" in shown
    assert "last decision" not in shown  # the trial, not the history, while one runs
    # under the thresholds line, above the engines
    assert shown.index("thresholds version 3") < shown.index("autopilot:") < shown.index("engines")


def test_an_open_interval_and_a_gauge_arm_are_said_in_words() -> None:
    trial = {**RUNNING["trial"], "interval": [None, None], "arm_now": 0, "estimate": None}
    shown = _screen(_answer({**RUNNING, "trial": trial}))
    assert "arm now current; estimate - [open, open]" in shown


def test_a_promotion_awaiting_approval_says_the_operators_version_runs() -> None:
    trial = {**RUNNING["trial"], "verdict": "promote", "reason": "better", "arm_now": -1}
    body = {**RUNNING, "mode": "trial", "state": "awaiting_approval", "trial": trial}
    shown = _screen(_answer(body))
    assert "mode trial  state awaiting_approval" in shown
    assert "arm now none" in shown
    assert "verdict promote (better)" in shown
    assert "promotion awaits an approval; the engine runs the operator's version meanwhile" in shown


def test_idle_shows_the_last_decision_and_the_last_refusal() -> None:
    older = {**DECISION, "trial_id": "ap-2-1", "decision": "promoted"}
    body = {
        **RUNNING,
        "state": "cooldown",
        "trial": None,
        "paused": True,
        "last_refusal": "cool-down: 412 s left",
        "last_decisions": [DECISION, older],  # newest first
    }
    shown = _screen(_answer(body))
    assert "autopilot: mode auto  PAUSED  state cooldown" in shown
    assert (
        "last decision: trial ap-3-1 rolled_back (worse) after 14 pairs, effect +3.10%, "
        "at 2023-11-14 22:13:20 UTC, version 3"
    ) in shown
    assert "ap-2-1" not in shown
    assert "last refusal: cool-down: 412 s left" in shown


def test_off_with_no_history_and_a_proposal_in_advise_mode() -> None:
    off = {"mode": "off", "paused": False, "state": "off", "trial": None, "proposal": None,
           "last_refusal": None, "last_decisions": []}  # fmt: skip
    shown = _screen(_answer(off))
    assert "autopilot: mode off  state off" in shown and "no decision yet" in shown
    advise = {
        **off,
        "mode": "advise",
        "state": "idle",
        "proposal": {"changed": {"min_seq_len": [4096, 2048]}},
    }
    assert "proposal: min_seq_len 4096 -> 2048" in _screen(_answer(advise))


def test_an_older_sidecar_a_malformed_answer_and_no_answer_are_one_line_each() -> None:
    absent = _screen(seen_from(404, None))
    assert [line for line in absent.splitlines() if "autopilot" in line] == [  # once, in place of the section
        "autopilot: not available on this sidecar (GET /autopilot: 404)"
    ]
    assert "autopilot: not available on this sidecar (GET /autopilot: 404)" in absent
    for body in (b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe", b'{"a": NaN}', b"[" * 200 + b"]" * 200):
        shown = _screen(seen_from(200, body))
        assert "autopilot: malformed answer from GET /autopilot (not a JSON object); ignored" in shown, body
    big = _screen(seen_from(200, None, f"over {MAX_BODY_BYTES >> 10} KiB"))
    assert "malformed answer from GET /autopilot (over 256 KiB)" in big
    assert "autopilot: GET /autopilot answered HTTP 500" in _screen(seen_from(500, None))
    assert "autopilot: asking the sidecar" in _screen(WAITING)
    assert "autopilot" not in _screen(None)  # a caller that does not ask draws no section


@pytest.mark.parametrize(
    "body",
    [
        {"mode": 7, "paused": "yes", "state": ["x"], "trial": "not an object", "last_decisions": {"a": 1}},
        {**RUNNING, "trial": {"changed": [1, 2], "interval": "wide", "pairs": 10**400, "estimate": "big"}},
        {**RUNNING, "trial": {**RUNNING["trial"], "changed": {"k": "v", "j": [1, 2, 3]}, "blocks": -4}},
        {**RUNNING, "trial": None, "last_decisions": ["x", None], "proposal": [1]},
        {**RUNNING, "trial": None, "last_decisions": [{**DECISION, "at": 1e300, "effect": 1e308 * 10}]},
    ],
    ids=["wrong-types", "trial-wrong-types", "odd-changes", "odd-decisions", "huge-time"],
)
def test_an_answer_of_the_wrong_shape_is_drawn_anyway(body: dict[str, Any]) -> None:
    shown = _screen(AutopilotSeen("answer", body=body))
    assert "autopilot: mode" in shown and "could not be drawn" not in shown


def test_many_knobs_are_cut() -> None:
    trial = {**RUNNING["trial"], "changed": {f"knob{i}": [i, i + 1] for i in range(40)}}
    shown = _screen(_answer({**RUNNING, "trial": trial}))
    assert "knob7 7 -> 8, ... 32 more" in shown and "knob8 " not in shown


@pytest.mark.parametrize(
    "hostile", [MARKUP + CONTROLS, CONTROLS + MARKUP], ids=["markup-first", "controls-first"]
)
def test_escape_sequences_in_every_field_never_reach_the_screen(hostile: str) -> None:
    trial = {key: hostile for key in RUNNING["trial"]}
    trial["changed"] = {hostile: [hostile, hostile]}
    trial["interval"] = [hostile, hostile]
    decision = {key: hostile for key in DECISION}
    bodies = [
        {"mode": hostile, "paused": True, "state": hostile, "trial": trial},
        {
            "mode": hostile,
            "state": hostile,
            "trial": None,
            "proposal": {"changed": {hostile: [hostile, hostile]}},
            "last_refusal": hostile,
            "last_decisions": [decision],
        },
    ]
    seens = [AutopilotSeen("answer", body=b) for b in bodies]
    seens += [AutopilotSeen("malformed", detail=hostile), AutopilotSeen("failed", detail=hostile)]
    for seen in seens:
        shown = _screen(seen, terminal=True)
        assert sorted({f"U+{ord(c):04X}" for c in shown if c in RAW}) == []
        assert "\x1b]8;" not in shown  # rich wrote no hyperlink
        assert "\\x1b]52;c;ZXZpbA==\\x07" in shown or "\\x1b[2J" in shown


# ----------------------------------------------------------------------------- the poll


def _poll(url: str, *, token: str | None = None) -> AutopilotPoll:
    return AutopilotPoll(url, every=0.05, token=token).start()


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_the_poll_reads_the_answer_and_asks_again_every_period() -> None:
    def handler(req, conn) -> None:
        answer(conn, "200 OK", json.dumps(RUNNING).encode(), "Content-Type: application/json\r\n")

    with scripted_server(handler) as srv:
        poll = AutopilotPoll(srv.url, every=0.3).start()
        try:
            assert wait_until(lambda: poll.latest().kind == "answer"), poll.latest()
            time.sleep(1.0)
        finally:
            poll.stop()
    assert poll.latest().body == RUNNING
    assert all(r.line.startswith("GET /autopilot ") for r in srv.requests)
    assert 2 <= len(srv.requests) <= 6  # every 0.3 s, not as fast as it can


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_a_404_is_absent_and_a_body_over_the_bound_is_malformed() -> None:
    with scripted_server(lambda req, conn: answer(conn, "404 Not Found", b'{"detail":"Not Found"}')) as srv:
        poll = _poll(srv.url)
        try:
            assert wait_until(lambda: len(srv.requests) >= 3)
        finally:
            poll.stop()
    assert poll.latest() == AutopilotSeen("absent")

    huge = b'{"mode": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    with scripted_server(lambda req, conn: answer(conn, "200 OK", huge)) as srv:
        poll = _poll(srv.url)
        try:
            assert wait_until(lambda: poll.latest().kind == "malformed"), poll.latest()
        finally:
            poll.stop()
    assert poll.latest().detail == "over 256 KiB"


@pytest.mark.slow  # a real HTTP server on 127.0.0.1
def test_the_token_goes_only_to_a_401_from_the_url_itself() -> None:
    def guarded(req, conn) -> None:
        if req.headers.get("authorization") == f"Bearer {TOKEN}":
            answer(conn, "200 OK", json.dumps(RUNNING).encode())
        else:
            answer(conn, "401 Unauthorized", b'{"detail": "token"}', "WWW-Authenticate: Bearer\r\n")

    with scripted_server(guarded) as srv:
        poll = _poll(srv.url, token=TOKEN)
        try:
            assert wait_until(lambda: len(srv.requests) >= 4)
        finally:
            poll.stop()
    assert poll.latest().kind == "answer"
    sent = [r.headers.get("authorization") for r in srv.requests[:4]]
    assert sent == [None, f"Bearer {TOKEN}", None, f"Bearer {TOKEN}"]

    with scripted_server(
        lambda req, conn: answer(conn, "302 Found", b"", "Location: http://evil/\r\n")
    ) as srv:
        poll = _poll(srv.url, token=TOKEN)
        try:
            assert wait_until(lambda: len(srv.requests) >= 2)
        finally:
            poll.stop()
    assert [r.headers.get("authorization") for r in srv.requests] == [None] * len(srv.requests)
    assert poll.latest() == AutopilotSeen("failed", detail="GET /autopilot answered HTTP 302")
