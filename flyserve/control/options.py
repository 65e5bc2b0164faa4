"""The command-line options every command that touches a state directory shares, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

STATE_DIR_HELP = (
    "The state directory the server's ranks and the sidecar share (default: $FLYSERVE_STATE_DIR, "
    "else /dev/shm/flyserve/$FLYSERVE_INSTANCE)."
)

StateDirArg = Annotated[
    Path | None,
    typer.Option("--state-dir", envvar="FLYSERVE_STATE_DIR", help=STATE_DIR_HELP, show_default=False),
]
"""``state_dir: StateDirArg = None`` in a typer command; None: the default state directory
(flyserve.control.paths.default_state_dir, which reads the same variables)."""


def checked_state_dir(state_dir: Path | None, *, write: bool, create: bool = False) -> Path:
    """The state directory a command uses, checked: exit 2 naming it when it is missing or not
    initialised (flyserve.control.initialise), so a typo'd path is refused instead of read as
    empty; the default is printed when it is used implicitly. Shared by `flyserve thresholds`
    and `flyserve autopilot history|replay`."""
    from flyserve.control.initialise import (
        StateDirError,
        implicit_note,
        require_for_read,
        require_for_write,
        resolve,
    )
    from flyserve.terminal.printable import printable_block

    path, implicit = resolve(state_dir)
    if implicit:
        typer.echo(printable_block(implicit_note(path)), err=True)
    try:
        return require_for_write(path, create=create) if write else require_for_read(path)
    except StateDirError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None
