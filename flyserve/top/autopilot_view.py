"""`flyserve top`'s autopilot lines from what GET /autopilot answered: a pure function, tested without
a terminal or a sidecar.

The mode and state always; for a running trial (or one whose promotion awaits approval) its id, the
knobs it moves, the pairs so far, the arm the engine runs now, the estimate with its interval and the
verdict; otherwise the last decision and the last refusal. Every value reaches the screen through
flyserve.terminal.printable and is read by type (flyserve.top.payload): an answer of the wrong shape
shows "?" or "-" where a value was expected, never an error.
"""

from __future__ import annotations

import math
import time
from typing import Any

from rich.text import Text

from flyserve.terminal.printable import printable
from flyserve.top.autopilot_poll import AutopilotSeen
from flyserve.top.payload import as_dict, as_list, real

CELL = 48
"""Characters of one value from the answer (an id, a knob, a reason is much shorter)."""
MAX_KNOBS = 8
"""Knobs shown of a trial's changes: the thresholds have about a dozen."""
ARMS = {-1: "none", 0: "current", 1: "candidate"}
"""arm_now as the sidecar numbers it (its gauge flyserve_autopilot_arm too)."""


def _field(x: Any, limit: int = CELL) -> str:
    return "-" if x is None else printable(x, limit)


def _relative(x: Any) -> str:
    """A relative change (-0.02: 2% faster) as a signed percentage."""
    v = real(x)
    if v is None or math.isnan(v):
        return "-" if x is None else "?"
    if math.isinf(v):
        return "+inf" if v > 0 else "-inf"
    return f"{v:+.2%}"


def _interval(x: Any) -> str:
    bounds = as_list(x)
    if len(bounds) != 2:
        return "[?]"
    lo, hi = (("open" if b is None else _relative(b)) for b in bounds)
    return f"[{lo}, {hi}]"


def _changes(changed: Any) -> str:
    """``{knob: [current, candidate]}`` as ``knob current -> candidate, ...``."""
    parts = []
    items = list(as_dict(changed).items())
    for knob, pair in items[:MAX_KNOBS]:
        values = as_list(pair)
        if len(values) == 2:
            parts.append(f"{printable(knob, CELL)} {_field(values[0])} -> {_field(values[1])}")
        else:
            parts.append(f"{printable(knob, CELL)} ?")
    if len(items) > MAX_KNOBS:
        parts.append(f"... {len(items) - MAX_KNOBS} more")
    return ", ".join(parts) or "nothing"


def _arm(x: Any) -> str:
    if isinstance(x, int) and not isinstance(x, bool) and x in ARMS:
        return ARMS[x]
    return _field(x)


def _when(x: Any) -> str:
    """A decision's time: epoch seconds as UTC, a string as sent."""
    v = real(x)
    if v is None:
        return _field(x)
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v))
    except (OverflowError, OSError, ValueError):
        return "?"


def _trial_lines(out: Text, trial: dict[str, Any], awaiting: bool) -> None:
    blocks = real(trial.get("blocks"))
    budget = "" if blocks is None or blocks < 2 else f" of {int(blocks) // 2}"
    out.append(f"\ntrial {_field(trial.get('id'))}: {_changes(trial.get('changed'))}")
    out.append(
        f"\n  pairs {_field(trial.get('pairs'))}{budget} ({_field(trial.get('block_steps'))}-step blocks), "
        f"arm now {_arm(trial.get('arm_now'))}; estimate {_relative(trial.get('estimate'))} "
        f"{_interval(trial.get('interval'))} (candidate's kernel time per token against current)"
    )
    verdict = _field(trial.get("verdict"))
    reason = trial.get("reason")
    out.append(f"\n  verdict {verdict}" + (f" ({_field(reason, 120)})" if reason else ""))
    if awaiting:
        out.append(
            "\n  promotion awaits an approval; the engine runs the operator's version meanwhile",
            style="bold yellow",
        )


def _last_decision(out: Text, body: dict[str, Any]) -> None:
    decisions = as_list(body.get("last_decisions"))
    if not decisions:
        out.append("\nno decision yet", style="dim")
        return
    d = as_dict(decisions[0])  # newest first, as GET /autopilot lists them
    out.append(
        f"\nlast decision: trial {_field(d.get('trial_id'))} {_field(d.get('decision'))} "
        f"({_field(d.get('reason'), 120)}) after {_field(d.get('pairs'))} pairs, "
        f"effect {_relative(d.get('effect'))}, at {_when(d.get('at'))}, "
        f"version {_field(d.get('result_version'))}"
    )


def _answer_text(body: dict[str, Any]) -> Text:
    out = Text()
    mode, state = body.get("mode"), body.get("state")
    out.append(f"autopilot: mode {_field(mode)}", style="dim" if mode == "off" else "")
    if body.get("paused") is True:
        out.append("  PAUSED", style="bold yellow")
    out.append(f"  state {_field(state)}")
    trial = body.get("trial")
    if isinstance(trial, dict):
        _trial_lines(out, trial, awaiting=state == "awaiting_approval")
    else:
        proposal = body.get("proposal")
        if isinstance(proposal, dict):
            shown = proposal.get("changed", proposal.get("changes"))
            out.append(f"\nproposal: {_changes(shown) if isinstance(shown, dict) else 'see GET /autopilot'}")
        _last_decision(out, body)
    refusal = body.get("last_refusal")
    if refusal is not None and not isinstance(trial, dict):
        out.append(f"\nlast refusal: {_field(refusal, 160)}", style="dim")
    return out


def autopilot_text(seen: AutopilotSeen) -> Text:
    """The autopilot's lines for what the last ask of GET /autopilot gave."""
    if seen.kind == "waiting":
        return Text("autopilot: asking the sidecar (GET /autopilot)", style="dim")
    if seen.kind == "absent":
        return Text("autopilot: not available on this sidecar (GET /autopilot: 404)", style="dim")
    if seen.kind == "malformed":
        return Text(
            f"autopilot: malformed answer from GET /autopilot ({_field(seen.detail, 120)}); ignored",
            style="yellow",
        )
    if seen.kind == "failed" or seen.body is None:
        return Text(f"autopilot: {_field(seen.detail, 160)}", style="yellow")
    return _answer_text(seen.body)
