"""`flyserve init` and `flyserve thresholds repair`: make a state directory, or make one consistent."""

from __future__ import annotations

import json

import typer

from flyserve.control.cli_common import JsonOpt, echo, fail, plane_for
from flyserve.control.options import StateDirArg


def repair_cmd(
    state_dir: StateDirArg = None,
    profile: str | None = typer.Option(
        None, "--profile", help="Profile to fall back on when nothing readable is left (default gfx950)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Make the state directory consistent from what is readable: rebuild a lost or damaged
    current.json from history, set aside damaged history files, remove a killed writer's temp and
    orphan files, complete its audit entries. Prints what it did and what it dropped (the sidecar
    runs the same at start)."""
    from flyserve.control.errors import ControlIOError
    from flyserve.control.repair import repair

    try:
        report = repair(plane_for(state_dir, **({"profile": profile} if profile else {})))
    except ControlIOError as exc:
        raise fail(f"error: {exc}", 2) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    if not report.changed:
        echo(f"consistent: version {report.version}, nothing to repair")
        return
    for a in report.actions:
        echo(f"repaired: {a}")
    for d in report.dropped:
        echo(f"dropped: {d}")
    echo(f"current version {report.version}")


def init(state_dir: StateDirArg = None) -> None:
    """Create a state directory, for `thresholds ...` before any server has started one.

    A server (sidecar, simulate, vLLM with FLYSERVE_ATTENTION=1) creates its own when it starts.
    """
    from flyserve.control.initialise import StateDirError, implicit_note, initialise, resolve

    path, implicit = resolve(state_dir)
    if implicit:
        echo(implicit_note(path), err=True)
    try:
        created = initialise(path)
    except StateDirError as exc:
        raise fail(f"error: {exc}", 2) from None
    echo(f"{'initialised' if created else 'already initialised:'} state directory {path}")
