"""`flyserve thresholds show|history|audit`: what the state directory holds, read only."""

from __future__ import annotations

import json
from typing import Any

import typer

from flyserve.control.cli_common import JsonOpt, fail, plane_for
from flyserve.control.options import StateDirArg, checked_state_dir
from flyserve.terminal.printable import printable, printable_text

_RANK_FIELDS = ("rank", "engine", "pid", "step", "applied_version", "applied_step")


def show(state_dir: StateDirArg = None, as_json: bool = JsonOpt) -> None:
    """The current version: every threshold, the layer that set it, and any file/override conflict."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from flyserve.control.errors import ControlIOError

    sd = checked_state_dir(state_dir, write=False)
    try:
        plane = plane_for(sd)
        s = plane.snapshot()
        ranks = plane.store.rank_reports()
    except ControlIOError as exc:
        raise fail(f"error: {exc}", 2) from None
    if as_json:
        typer.echo(json.dumps({**s.to_dict(), "ranks": ranks}, indent=2, default=str))
        return
    # Every value below is the state directory's (anyone who can write it): Text, never markup.
    by = f" by {printable(s.actor)}" if s.actor else ""
    title = f"thresholds version {s.version} ({printable(s.source)}{by})"
    if s.version == 0:
        title += (
            f" - nothing published yet in {printable(plane.state_dir.path, None)}; "
            f"profile {printable(s.profile)} defaults"
        )
    t = Table(title=Text(title))
    for col in ("key", "value", "set by", "note"):
        t.add_column(col)
    for k, v in s.thresholds.model_dump().items():
        note = ""
        if k in s.conflicts:
            note = f"file says {printable(s.conflicts[k]['file'])}"
        t.add_row(printable_text(k), printable_text(v), printable_text(s.provenance[k]), Text(note))
    c = Console()
    c.print(t)
    c.print(
        Text(
            f"effective from engine step {printable(s.effective_step)}; sha256 {printable(s.sha256[:16])}; "
            f"profile {printable(s.profile)}; file {printable(s.config_file or '-', None)}"
        )
    )
    if s.circuit_open:
        c.print(
            Text.assemble(
                ("circuit OPEN", "red"),
                f": prefill path off on every rank ({printable(s.circuit_reason or 'no reason')})",
            )
        )
    for r in ranks:
        f = {k: printable(r.get(k), 64) for k in _RANK_FIELDS}
        c.print(
            Text(
                f"rank {f['rank']} (engine {f['engine']}, pid {f['pid']}): step {f['step']}, "
                f"version {f['applied_version']} since step {f['applied_step']}"
            )
        )


def _first_version_changes(s: Any) -> str:
    """What the oldest version shown changed, against its profile's defaults (version 0): without
    this, version 1 read "-" although it is the change that matters most."""
    from flyserve.policy.thresholds import ThresholdsError
    from flyserve.thresholds_files import load_profile

    try:
        base = load_profile(s.profile)
    except ThresholdsError:
        return f"first version (profile {s.profile} not found here)"
    diff = ", ".join(f"{k} {a}->{b}" for k, (a, b) in base.diff(s.thresholds).items())
    if s.circuit_open:
        diff = ", ".join(x for x in (diff, "circuit open") if x)
    return f"{diff} (vs profile {s.profile})" if diff else f"profile {s.profile} defaults"


def history(
    state_dir: StateDirArg = None,
    limit: int = typer.Option(20, "--limit", "-n", help="Show at most this many recent versions."),
    as_json: bool = JsonOpt,
) -> None:
    """Recent versions, oldest first, with what each changed."""
    from rich.console import Console
    from rich.table import Table

    from flyserve.control.errors import ControlIOError

    sd = checked_state_dir(state_dir, write=False)
    try:
        snaps = plane_for(sd).history(limit + 1)
    except ControlIOError as exc:
        raise fail(f"error: {exc}", 2) from None
    if as_json:
        typer.echo(json.dumps([s.to_dict() for s in snaps[-limit:]], indent=2, default=str))
        return
    t = Table(title="thresholds history")
    for col in ("version", "time (UTC)", "source", "actor", "from step", "changed"):
        t.add_column(col)
    for prev, s in zip([None, *snaps], snaps, strict=False):
        if prev is None and len(snaps) > limit:
            continue
        changes = (
            (_first_version_changes(s) if s.version == 1 else "")
            if prev is None
            else ", ".join(f"{k} {a}->{b}" for k, (a, b) in prev.thresholds.diff(s.thresholds).items())
        )
        if prev is not None and prev.circuit_open != s.circuit_open:
            changes = ", ".join(
                x for x in (changes, f"circuit {'open' if s.circuit_open else 'closed'}") if x
            )
        cells = (s.version, s.time_iso, s.source, s.actor, s.effective_step, changes or "-")
        t.add_row(*(printable_text(x, 1024) for x in cells))
    Console().print(t)


def audit(
    state_dir: StateDirArg = None,
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="Show at most this many recent entries."),
) -> None:
    """The audit log's recent entries (JSON lines): every change tried, accepted or not."""
    from flyserve.control.errors import ControlIOError

    try:
        entries = plane_for(checked_state_dir(state_dir, write=False)).audit_log(limit)
    except ControlIOError as exc:
        raise fail(f"error: {exc}", 2) from None
    for e in entries:
        typer.echo(json.dumps(e, sort_keys=True, default=str))
