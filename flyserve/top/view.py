"""What `flyserve top` draws from one /dispatch-stats payload: a pure function of (payload, window,
connection state), so the layout is tested without a terminal and the live loop only redraws.

A field the payload leaves null is shown with why (``regret: not priced: the sidecar runs without
--costs``), never as a bare zero: a zero would read as "all is well".

The payload comes from whatever answers on the port: every value is read by type (a string where a
number belongs shows as "?", a list where an object belongs as nothing), every string reaches the
screen through flyserve.terminal.printable (no escape sequence, no rich markup, bounded), long tables are
cut, and a section that still cannot be drawn says so in place of itself: the view never dies of a
payload.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from flyserve.terminal.printable import printable, printable_text
from flyserve.top.autopilot_poll import AutopilotSeen
from flyserve.top.autopilot_view import autopilot_text
from flyserve.top.payload import as_dict, as_list, fixed, real

WINDOWS = ("60s", "300s", "900s", "total")
"""The `w` key cycles these: /dispatch-stats' windows, then the counters since start."""
REGRET_WINDOW = {"60s": "60s", "300s": "900s", "900s": "900s", "total": "900s"}
"""The sidecar prices 1 min and 15 min windows: the nearest one covering the dispatch window."""
FALLBACK_REASONS = (
    "disabled",
    "not_causal",
    "context_too_long",
    "short_context",
    "low_occupancy",
    "too_many_decode_rows",
    "unsupported",
    "circuit_open",
)
MAX_ROWS = 256
"""Rows of the engines and ranks tables: more than a screen, far fewer than a hostile payload's."""
CELL = 48
"""Characters of one table cell from the payload."""


@dataclass(frozen=True)
class Connection:
    """What the stream reader knows: the sidecar's URL, the last error (None: connected), when the
    last payload came (monotonic seconds ago), how many came, how many were not a JSON object
    (malformed) and how many lines or events were dropped for their size (oversize)."""

    url: str
    error: str | None = None
    age_s: float | None = None
    events: int = 0
    malformed: int = 0
    oversize: int = 0


def _pct(x: Any) -> str:
    if x is None:
        return "-"
    v = real(x)
    return "?" if v is None else f"{v:.1%}"


def _num(x: Any) -> str:
    return "-" if x is None else printable(x, CELL)


def _count(x: Any) -> float:
    """A count to compare and sort by: anything not a number counts as none."""
    v = real(x)
    return 0.0 if v is None or math.isnan(v) else v


def _totals(block: dict[str, Any] | None, window: str) -> dict[str, Any] | None:
    if block is None:
        return None
    block = as_dict(block)
    got = block.get("totals") if window == "total" else as_dict(block.get("windows")).get(window)
    return got if isinstance(got, dict) else None


def _reasons(t: dict[str, Any] | None) -> str:
    """The fallback reasons with a count, biggest first (admitted and no_prefill_rows are not fallbacks)."""
    if not t:
        return "-"
    rs = as_dict(t.get("reasons"))
    got = sorted(((n, r) for r in FALLBACK_REASONS if (n := _count(rs.get(r))) > 0), reverse=True)
    return ", ".join(f"{r} {printable(rs[r], 24)}" for _n, r in got[:3]) or "none"


def _shares(t: dict[str, Any] | None) -> tuple[str, str, str]:
    """(batches, prefill share of all batches, prefill share of batches with a prefill row)."""
    if not t:
        return "-", "-", "-"
    return (
        printable(t.get("batches", 0), CELL),
        _pct(t.get("prefill_ratio")),
        _pct(t.get("prefill_ratio_of_prefill_batches")),
    )


def header(stats: dict[str, Any] | None, window: str, conn: Connection) -> Text:
    line = Text()
    line.append("flyserve top", style="bold")
    line.append(f"  {printable(conn.url)}\n")
    if conn.error is not None:
        line.append(printable(conn.error, 400), style="bold red")
    elif stats is None:
        line.append("waiting for the first event", style="yellow")
    else:
        age = "" if conn.age_s is None else f" ({conn.age_s:.0f}s ago)"
        line.append(f"live, {conn.events} events{age}", style="green")
    skipped = []
    if conn.malformed:
        skipped.append(f"{conn.malformed} malformed events (not a JSON object) skipped")
    if conn.oversize:
        skipped.append(f"{conn.oversize} oversize lines or events dropped")
    if skipped:
        line.append("\n" + "; ".join(skipped), style="yellow")
    line.append(f"\nwindow: {window}  [w] next window  [q] quit")
    return line


def thresholds_line(stats: dict[str, Any]) -> Text:
    th = stats.get("thresholds")
    out = Text()
    if not isinstance(th, dict):
        errs = "; ".join(printable(e, 160) for e in as_list(stats.get("errors"))[:16])
        errs = errs or "the control plane could not be read"
        out.append(f"thresholds: unknown ({errs[:160]})", style="red")
    else:
        over = as_dict(th.get("overrides"))
        shown = ", ".join(f"{printable(k, CELL)}={printable(v, CELL)}" for k, v in list(over.items())[:4])
        out.append(
            f"thresholds version {_num(th.get('version'))} (effective step {_num(th.get('effective_step'))}, "
            f"{_num(th.get('source'))}, profile {_num(th.get('profile'))}), overrides: {shown or 'none'}"
        )
        if th.get("circuit_open"):
            out.append("  circuit OPEN (prefill path off)", style="bold red")
    agree = stats.get("ranks_agree")
    mode = printable(stats.get("control_mode"), CELL) if stats.get("control_mode") else "- (no live rank)"
    out.append(
        f"\ncontrol mode: {mode}   live ranks: {_num(stats.get('live_ranks', 0))}   "
        f"ranks agree: {'-' if agree is None else ('yes' if agree else 'NO')}   "
        f"late applies: {_num(stats.get('late_applies', 0))}"
    )
    return out


def _cells(*values: str) -> list[Text]:
    return [printable_text(v, None) for v in values]  # each bounded where it was made


def _more_row(t: Table, rows: list[Any]) -> None:
    if len(rows) > MAX_ROWS:
        t.add_row(*_cells(f"... {len(rows) - MAX_ROWS} more", *[""] * (len(t.columns) - 1)))


def engines_table(stats: dict[str, Any], window: str) -> Table:
    t = Table(title=f"engines ({window})", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("engine", "ranks", "agree", "batches", "prefill", "prefill of eligible", "top fallbacks"):
        t.add_column(col, no_wrap=True)
    engines = as_list(stats.get("engines"))
    for e in engines[:MAX_ROWS]:
        e = as_dict(e)
        w = _totals(e, window)
        b, share, share_pf = _shares(w)
        agree = e.get("ranks_agree")
        t.add_row(
            *_cells(
                printable(e.get("engine"), CELL),
                printable(",".join(map(str, as_list(e.get("ranks"))[:64])), CELL),
                "-" if agree is None else ("yes" if agree else "NO"),
                b,
                share,
                share_pf,
                _reasons(w),
            )
        )
    _more_row(t, engines)
    return t


def _age(r: dict[str, Any]) -> str:
    age = r.get("age_s")
    return ("STALE " if r.get("stale") else "") + ("never" if age is None else f"{fixed(age, '.1f')}s ago")


def ranks_table(stats: dict[str, Any]) -> Table:
    t = Table(title="ranks (since start)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("engine", "rank", "pid", "step", "version", "applied@", "mode", "circuit", "late", "prefill"):
        t.add_column(col, no_wrap=True)
    t.add_column("top fallbacks", no_wrap=True)
    t.add_column("report", no_wrap=True, overflow="ellipsis")
    ranks = as_list(stats.get("ranks"))
    for r in ranks[:MAX_ROWS]:
        r = as_dict(r)
        tot = r.get("totals") if isinstance(r.get("totals"), dict) else None
        _b, share, _s = _shares(tot)
        circuit = r.get("circuit_open")
        t.add_row(
            *_cells(
                _num(r.get("engine")),
                _num(r.get("rank")),
                _num(r.get("pid")),
                _num(r.get("step")),
                _num(r.get("applied_version")),
                _num(r.get("applied_step")),
                printable(r.get("control_mode"), CELL) if r.get("control_mode") else "-",
                "-" if circuit is None else ("OPEN" if circuit else "closed"),
                _num(r.get("late_applies")),
                share,
                _reasons(tot),
                _age(r),
            )
        )
    _more_row(t, ranks)
    return t


def regret_text(stats: dict[str, Any], window: str) -> Text:
    reg = stats.get("regret")
    out = Text()
    if reg is None:
        out.append(
            "regret: not priced: the sidecar runs without --costs (start it with --costs <table>)",
            style="dim",
        )
        return out
    reg = as_dict(reg)
    name = REGRET_WINDOW[window]
    w = as_dict(as_dict(reg.get("windows")).get(name))
    ro = real(w.get("routed_over_oracle"))
    pb = real(as_dict(w.get("prefill_batches")).get("routed_over_oracle"))
    out.append(f"regret ({name}, cost table {printable(reg.get('costs'), CELL)}): ")
    if ro is None:
        why = reg.get("unpriceable")
        out.append("nothing priced yet" + (f" ({printable(why, 120)})" if why else ""), style="yellow")
    else:
        style = "green" if ro - 1 < 0.05 else ("yellow" if ro - 1 < 0.2 else "bold red")
        out.append(f"{ro - 1:.1%}", style=style)
        out.append(
            f"  routed/oracle {ro:.3f} over {_num(w.get('samples', 0))} samples; batches with a prefill row "
            f"{'-' if pb is None else f'{pb:.3f}'} (the rest take decode_path: a restart)"
        )
    drift = as_dict(w.get("drift"))
    parts = []
    for path in ("unified", "prefill"):
        d = as_dict(drift.get(path))
        m = d.get("median_ratio")
        parts.append(f"{path} {'-' if m is None else fixed(m, '.2f')} ({_num(d.get('samples', 0))} samples)")
    out.append("\ndrift (measured/predicted): " + ", ".join(parts))
    return out


def _errors_text(stats: dict[str, Any]) -> Text | None:
    errs = as_list(stats.get("errors"))
    if not errs:
        return None
    return Text("errors: " + "; ".join(printable(e, 120) for e in errs[:3]), style="red")


def _section(draw: Callable[[], Any], what: str) -> Any:
    """``draw()``, or a line saying that this part of the payload is malformed: a shape the typed
    reads above did not foresee costs one section, never the view."""
    try:
        return draw()
    except Exception as exc:  # noqa: BLE001 - any payload, any failure: say so and draw the rest
        return Text(f"malformed event: the {what} could not be drawn ({type(exc).__name__})", style="red")


def render(
    stats: dict[str, Any] | None, window: str, conn: Connection, autopilot: AutopilotSeen | None = None
) -> Group:
    """The whole screen for one payload (None before the first); with ``autopilot`` (what the last
    ask of GET /autopilot gave), the autopilot's lines under the thresholds."""
    parts: list[Any] = [header(stats if isinstance(stats, dict) else None, window, conn)]
    if stats is not None and not isinstance(stats, dict):
        parts.append(Text("malformed event: the payload is not a JSON object", style="red"))
    elif stats is not None:
        parts.append(_section(lambda: thresholds_line(stats), "thresholds"))
        if autopilot is not None:
            parts.append(_section(lambda: autopilot_text(autopilot), "autopilot"))
        parts += [
            _section(lambda: engines_table(stats, window), "engines table"),
            _section(lambda: ranks_table(stats), "ranks table"),
            _section(lambda: regret_text(stats, window), "regret"),
        ]
        errs = _section(lambda: _errors_text(stats), "errors")
        if errs is not None:
            parts.append(errs)
    return Group(*parts)
