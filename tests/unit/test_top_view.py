"""`flyserve top`'s screen from one payload (flyserve.top.view): null fields say why, the window picks
the numbers, and the SSE parser splits events as the sidecar writes them."""

from __future__ import annotations

from rich.console import Console

from flyserve.top.stream import iter_sse_data
from flyserve.top.view import Connection, render


def _text(stats, window="60s", conn=None) -> str:
    c = Console(width=160, record=True, color_system=None)
    c.print(render(stats, window, conn or Connection("http://127.0.0.1:9400", events=1)))
    return c.export_text()


def _totals(batches: int, short: int) -> dict:
    return {
        "batches": batches,
        "reasons": {"admitted": batches - short, "short_context": short, "no_prefill_rows": 0},
        "prefill_ratio": (batches - short) / batches,
        "prefill_ratio_of_prefill_batches": (batches - short) / batches,
    }


STATS = {
    "thresholds": {
        "version": 3,
        "effective_step": 1200,
        "source": "api",
        "profile": "gfx950",
        "overrides": {"min_seq_len": 4096},
    },
    "live_ranks": 1,
    "ranks_agree": True,
    "control_mode": "engine channel",
    "late_applies": 2,
    "engines": [
        {
            "engine": 0,
            "ranks": [0],
            "ranks_agree": True,
            "totals": _totals(100, 40),
            "windows": {"60s": _totals(10, 1), "300s": _totals(50, 20), "900s": _totals(90, 30)},
        }
    ],
    "ranks": [
        {
            "engine": 0,
            "rank": 0,
            "pid": 7,
            "step": 1300,
            "applied_version": 3,
            "applied_step": 1200,
            "circuit_open": True,
            "control_mode": "engine channel",
            "late_applies": 2,
            "age_s": 0.4,
            "stale": False,
            "totals": _totals(100, 40),
        }
    ],
    "regret": None,
    "errors": [],
}


def test_the_window_picks_the_numbers_and_every_field_is_shown():
    s60 = _text(STATS, "60s")
    assert (
        "thresholds version 3 (effective step 1200, api, profile gfx950), overrides: min_seq_len=4096" in s60
    )
    assert "control mode: engine channel" in s60 and "late applies: 2" in s60 and "OPEN" in s60
    assert "engines (60s)" in s60 and "short_context 1" in s60 and "90.0%" in s60
    s300 = _text(STATS, "300s")
    assert "engines (300s)" in s300 and "short_context 20" in s300 and "60.0%" in s300
    assert "short_context 40" in _text(STATS, "total")


def test_missing_fields_say_why():
    shown = _text(
        {
            **STATS,
            "thresholds": None,
            "control_mode": None,
            "ranks_agree": None,
            "errors": ["control: state directory unreadable"],
        }
    )
    assert "regret: not priced: the sidecar runs without --costs" in shown
    assert "thresholds: unknown (control: state directory unreadable)" in shown
    assert "control mode: - (no live rank)" in shown and "ranks agree: -" in shown
    away = _text(
        None,
        conn=Connection(
            "http://127.0.0.1:1",
            error="sidecar at http://127.0.0.1:1 not reachable (connection refused), retrying",
        ),
    )
    assert "not reachable (connection refused), retrying" in away and "engines" not in away
    regret = {
        "costs": "h200",
        "unpriceable": "cost table 'h200' was measured with 32 query heads per rank; the ranks run 16",
        "windows": {"60s": {"routed_over_oracle": None}},
    }
    assert "nothing priced yet (cost table 'h200' was measured with 32" in _text({**STATS, "regret": regret})


def test_sse_events_are_split_on_blank_lines():
    lines = [
        "event: stats",
        "id: 0",
        'data: {"a": 1}',
        "",
        ": comment",
        "event: stats",
        "data: [1,",
        "data: 2]",
        "",
    ]
    assert list(iter_sse_data(iter(lines))) == ['{"a": 1}', "[1,\n2]"]
