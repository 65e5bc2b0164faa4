"""`flyserve thresholds show|set|unset|rollback|history|reload|audit|circuit`: the control plane on
the command line, working directly on the state directory (same code path as the sidecar's HTTP API).

This module is the command table; the commands live by group: cli_views (show, history, audit: read
only), cli_changes (set, unset, rollback, reload, watch, circuit: they publish), cli_state_dir (init,
repair); cli_common holds what they share.
"""

from __future__ import annotations

import logging

import typer

from flyserve.control.cli_changes import (
    circuit_close,
    circuit_open,
    reload,
    rollback,
    set_,
    unset,
    watch,
)
from flyserve.control.cli_state_dir import init, repair_cmd
from flyserve.control.cli_views import audit, history, show

thresholds_app = typer.Typer(
    name="thresholds",
    help="Show and change the dispatch thresholds of a running server (validated, versioned, audited).",
    no_args_is_help=True,
)
circuit_app = typer.Typer(
    name="circuit", help="Open or close the prefill path's circuit breaker.", no_args_is_help=True
)
thresholds_app.add_typer(circuit_app, name="circuit")

# Registered in this order, the order `--help` lists them in.
thresholds_app.command("show")(show)
thresholds_app.command("set")(set_)
thresholds_app.command("unset")(unset)
thresholds_app.command("rollback")(rollback)
thresholds_app.command("reload")(reload)
thresholds_app.command("history")(history)
thresholds_app.command("repair")(repair_cmd)
thresholds_app.command("audit")(audit)
thresholds_app.command("watch")(watch)
circuit_app.command("open")(circuit_open)
circuit_app.command("close")(circuit_close)


def register(app: typer.Typer) -> None:
    # The commands print their own clear errors; keep the library's log lines off the terminal.
    logging.getLogger("flyserve.control").addHandler(logging.NullHandler())
    app.command("init")(init)
    app.add_typer(thresholds_app, name="thresholds")
