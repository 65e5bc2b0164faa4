"""What every `flyserve thresholds` command shares: its options, the plane it works through, how it
prints (every value escaped) and how a change's result or error becomes lines and an exit code. The
state directory's check is flyserve.control.options.checked_state_dir (`flyserve autopilot` uses it too).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import typer

from flyserve.terminal.printable import printable, printable_block


def default_actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


ActorOpt = typer.Option(None, "--actor", help="Who makes the change, for the audit log (default user@host).")
JsonOpt = typer.Option(False, "--json", help="Print JSON instead of a table.")
IfMatchOpt = typer.Option(
    None, "--if-match", help="Refuse (exit 3) unless the current version is this one (optimistic locking)."
)
DryRunOpt = typer.Option(False, "--dry-run", help="Validate and show the diff; publish nothing.")
CreateOpt = typer.Option(
    False,
    "--create",
    help="Initialise the state directory if it is not one yet (else a typo'd path is refused).",
)
AssignmentsArg = typer.Argument(
    ..., metavar="KEY=VALUE", help="KEY=VALUE pairs, e.g. min_seq_len=2048 lpt=never."
)
KeysArg = typer.Argument(
    ...,
    metavar="KEY",
    help="Keys whose override to clear (each falls back to the file's value, else the profile's).",
)
ConfigOpt = typer.Option(
    None,
    "--config",
    envvar="FLYSERVE_CONFIG",
    help="The operator's config file (default: the path the current version was loaded from).",
)


def plane_for(state_dir: Path | None, **kw: Any) -> Any:
    from flyserve.control.plane import ControlPlane

    return ControlPlane(state_dir, **kw)


def writer_for(state_dir: Path | None, **kw: Any) -> Any:
    """A plane for a command that changes something: its flyserve_config_* counts go to the state
    directory's metrics/ (where the sidecar's /metrics reads them), not into this short-lived process."""
    plane = plane_for(state_dir, **kw)
    try:
        from flyserve.telemetry.metrics import setup_multiprocess

        free = shutil.disk_usage(plane.state_dir.path).free if plane.state_dir.path.exists() else None
        if free is not None and free < _METRICS_MIN_FREE_BYTES:
            # prometheus_client mmaps its files: a write to a page a full tmpfs cannot back kills
            # the process with SIGBUS ("Bus error", rc 135) instead of raising ENOSPC.
            echo(f"warning: reload metrics not shared (only {free} bytes free)", err=True)
            return plane
        setup_multiprocess(plane.state_dir.metrics_dir)
    except OSError as exc:  # an unwritable state dir: the change itself will say so
        echo(f"warning: reload metrics not shared ({exc.strerror or exc})", err=True)
    return plane


_METRICS_MIN_FREE_BYTES = 4 << 20


def echo(message: str, *, err: bool = False) -> None:
    """A line (or lines) of text for a person: the values in it come from the state directory and
    the operator's files, so no escape sequence in them reaches the terminal (flyserve.terminal.printable)."""
    typer.echo(printable_block(message), err=err)


def fail(message: str, code: int) -> typer.Exit:
    echo(message, err=True)
    return typer.Exit(code)


def run_change(fn: Any, as_json: bool) -> None:
    """Run a change; map each error to a clear message and exit code (1 invalid, 2 I/O, 3 conflict)."""
    from flyserve.control.errors import ControlIOError, VersionConflict
    from flyserve.policy.thresholds import ThresholdsError

    try:
        res = fn()
    except ThresholdsError as exc:
        raise fail(f"invalid: {exc}\nthe running thresholds are unchanged", 1) from None
    except ControlIOError as exc:
        raise fail(f"error: {exc}\nthe running thresholds are unchanged", 2) from None
    except VersionConflict as exc:
        raise fail(f"conflict: {exc}", 3) from None
    if as_json:
        typer.echo(json.dumps(res.to_dict(), indent=2, default=str))
        return
    s = res.snapshot
    if not res.changed:
        echo(f"unchanged: version {s.version} already has this content")
        return
    head = "dry run, would publish" if res.dry_run else "published"
    echo(
        f"{head} version {s.version} (source {printable(s.source)}, effective from engine step "
        f"{s.effective_step})"
    )
    for k, (a, b) in res.diff.items():
        echo(f"  {printable(k)}: {printable(a)} -> {printable(b)}")
    for k, c in s.conflicts.items():
        echo(
            f"  note: {printable(k)}: the file says {printable(c['file'])}, the override "
            f"{printable(c['override'])} wins "
            f"(`flyserve thresholds unset {printable(k)}` to take the file's value)"
        )


def parse_assignments(pairs: list[str]) -> dict[str, Any]:
    """KEY=VALUE with the config file's scalars (flyserve.policy.safe_yaml: 2048 is an int, true a
    bool, auto and 25:36 strings; a 5000-digit integer is refused, naming the key)."""
    from flyserve.policy.safe_yaml import parse_scalar
    from flyserve.policy.thresholds import ThresholdsError

    out: dict[str, Any] = {}
    for p in pairs:
        key, eq, raw = p.partition("=")
        if not eq or not key.strip():
            raise ThresholdsError([(p[:48], "expected KEY=VALUE")], source="command line")
        k = key.strip()
        if k in out:  # otherwise the last one would silently win
            raise ThresholdsError([(k[:48], "given more than once")], source="command line")
        try:
            value = parse_scalar(raw) if raw.strip() else raw
        except ThresholdsError as exc:
            raise ThresholdsError([(k, exc.reason)], source="command line") from None
        if isinstance(value, int) and not isinstance(value, bool) and not _DECIMAL.fullmatch(raw.strip()):
            # 0x1000 was taken as 4096 and 0o17 as 15; the HTTP API takes decimal JSON numbers only
            raise ThresholdsError([(k, "write integers in decimal")], source="command line")
        out[k] = value
    return out


_DECIMAL = re.compile(r"[-+]?[0-9]+", re.ASCII)
