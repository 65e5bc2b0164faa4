"""What `flyserve top` draws from one /dispatch-stats payload: a pure function of (payload, window,
connection state), so the layout is tested without a terminal and the live loop only redraws.

A field the payload leaves null is shown with why (``regret: not priced: the sidecar runs without
--costs``), never as a bare zero: a zero would read as "all is well".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

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


@dataclass(frozen=True)
class Connection:
    """What the stream reader knows: the sidecar's URL, the last error (None: connected), when the
    last payload came (monotonic seconds ago), and how many came."""

    url: str
    error: str | None = None
    age_s: float | None = None
    events: int = 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: Any) -> str:
    return "-" if x is None else str(x)


def _totals(block: dict[str, Any] | None, window: str) -> dict[str, Any] | None:
    if block is None:
        return None
    if window == "total":
        return block.get("totals")
    return (block.get("windows") or {}).get(window)


def _reasons(t: dict[str, Any] | None) -> str:
    """The fallback reasons with a count, biggest first (admitted and no_prefill_rows are not fallbacks)."""
    if not t:
        return "-"
    rs = t.get("reasons") or {}
    got = sorted(((n, r) for r in FALLBACK_REASONS if (n := rs.get(r) or 0) > 0), reverse=True)
    return ", ".join(f"{r} {n}" for n, r in got[:3]) or "none"


def _shares(t: dict[str, Any] | None) -> tuple[str, str, str]:
    """(batches, prefill share of all batches, prefill share of batches with a prefill row)."""
    if not t:
        return "-", "-", "-"
    return (
        str(t.get("batches", 0)),
        _pct(t.get("prefill_ratio")),
        _pct(t.get("prefill_ratio_of_prefill_batches")),
    )


def header(stats: dict[str, Any] | None, window: str, conn: Connection) -> Text:
    line = Text()
    line.append("flyserve top", style="bold")
    line.append(f"  {conn.url}\n")
    if conn.error is not None:
        line.append(conn.error, style="bold red")
    elif stats is None:
        line.append("waiting for the first event", style="yellow")
    else:
        age = "" if conn.age_s is None else f" ({conn.age_s:.0f}s ago)"
        line.append(f"live, {conn.events} events{age}", style="green")
    line.append(f"\nwindow: {window}  [w] next window  [q] quit")
    return line


def thresholds_line(stats: dict[str, Any]) -> Text:
    th = stats.get("thresholds")
    out = Text()
    if th is None:
        errs = "; ".join(stats.get("errors") or []) or "the control plane could not be read"
        out.append(f"thresholds: unknown ({errs[:160]})", style="red")
    else:
        over = th.get("overrides") or {}
        shown = ", ".join(f"{k}={v}" for k, v in list(over.items())[:4]) or "none"
        out.append(
            f"thresholds version {th.get('version')} (effective step {th.get('effective_step')}, "
            f"{th.get('source')}, profile {th.get('profile')}), overrides: {shown}"
        )
        if th.get("circuit_open"):
            out.append("  circuit OPEN (prefill path off)", style="bold red")
    agree = stats.get("ranks_agree")
    out.append(
        f"\ncontrol mode: {stats.get('control_mode') or '- (no live rank)'}   live ranks: {stats.get('live_ranks', 0)}   "
        f"ranks agree: {'-' if agree is None else ('yes' if agree else 'NO')}   late applies: {stats.get('late_applies', 0)}"
    )
    return out


def engines_table(stats: dict[str, Any], window: str) -> Table:
    t = Table(title=f"engines ({window})", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("engine", "ranks", "agree", "batches", "prefill", "prefill of eligible", "top fallbacks"):
        t.add_column(col, no_wrap=True)
    for e in stats.get("engines") or []:
        w = _totals(e, window)
        b, share, share_pf = _shares(w)
        agree = e.get("ranks_agree")
        t.add_row(
            str(e.get("engine")),
            ",".join(map(str, e.get("ranks") or [])),
            "-" if agree is None else ("yes" if agree else "NO"),
            b,
            share,
            share_pf,
            _reasons(w),
        )
    return t


def ranks_table(stats: dict[str, Any]) -> Table:
    t = Table(title="ranks (since start)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("engine", "rank", "pid", "step", "version", "applied@", "mode", "circuit", "late", "prefill"):
        t.add_column(col, no_wrap=True)
    t.add_column("top fallbacks", no_wrap=True)
    t.add_column("report", no_wrap=True, overflow="ellipsis")
    for r in stats.get("ranks") or []:
        tot = r.get("totals")
        _b, share, _s = _shares(tot)
        circuit = r.get("circuit_open")
        age = r.get("age_s")
        t.add_row(
            _num(r.get("engine")),
            _num(r.get("rank")),
            _num(r.get("pid")),
            _num(r.get("step")),
            _num(r.get("applied_version")),
            _num(r.get("applied_step")),
            r.get("control_mode") or "-",
            "-" if circuit is None else ("OPEN" if circuit else "closed"),
            _num(r.get("late_applies")),
            share,
            _reasons(tot),
            ("STALE " if r.get("stale") else "") + ("never" if age is None else f"{age:.1f}s ago"),
        )
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
    name = REGRET_WINDOW[window]
    w = (reg.get("windows") or {}).get(name) or {}
    ro = w.get("routed_over_oracle")
    pb = (w.get("prefill_batches") or {}).get("routed_over_oracle")
    out.append(f"regret ({name}, cost table {reg.get('costs')}): ")
    if ro is None:
        why = reg.get("unpriceable")
        out.append("nothing priced yet" + (f" ({why[:120]})" if why else ""), style="yellow")
    else:
        style = "green" if ro - 1 < 0.05 else ("yellow" if ro - 1 < 0.2 else "bold red")
        out.append(f"{ro - 1:.1%}", style=style)
        out.append(
            f"  routed/oracle {ro:.3f} over {w.get('samples', 0)} samples; batches with a prefill row "
            f"{'-' if pb is None else f'{pb:.3f}'} (the rest take decode_path: a restart)"
        )
    drift = w.get("drift") or {}
    parts = []
    for path in ("unified", "prefill"):
        d = drift.get(path) or {}
        m = d.get("median_ratio")
        parts.append(f"{path} {'-' if m is None else f'{m:.2f}'} ({d.get('samples', 0)} samples)")
    out.append("\ndrift (measured/predicted): " + ", ".join(parts))
    return out


def render(stats: dict[str, Any] | None, window: str, conn: Connection) -> Group:
    """The whole screen for one payload (None before the first)."""
    parts: list[Any] = [header(stats, window, conn)]
    if stats is not None:
        parts += [
            thresholds_line(stats),
            engines_table(stats, window),
            ranks_table(stats),
            regret_text(stats, window),
        ]
        errs = stats.get("errors") or []
        if errs:
            parts.append(Text("errors: " + "; ".join(e[:120] for e in errs[:3]), style="red"))
    return Group(*parts)
