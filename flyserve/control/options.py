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
