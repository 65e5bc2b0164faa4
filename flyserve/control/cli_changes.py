"""`flyserve thresholds set|unset|rollback|reload|watch|circuit open|close`: the commands that
publish a version (the same code path as the sidecar's HTTP API).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import typer

from flyserve.control.cli_common import (
    ActorOpt,
    AssignmentsArg,
    ConfigOpt,
    CreateOpt,
    DryRunOpt,
    IfMatchOpt,
    JsonOpt,
    KeysArg,
    default_actor,
    echo,
    fail,
    parse_assignments,
    plane_for,
    run_change,
    writer_for,
)
from flyserve.control.options import StateDirArg, checked_state_dir
from flyserve.terminal.printable import install_log_filter


def set_(
    assignments: list[str] = AssignmentsArg,
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    if_match: int | None = IfMatchOpt,
    dry_run: bool = DryRunOpt,
    as_json: bool = JsonOpt,
    create: bool = CreateOpt,
) -> None:
    """Override thresholds (the highest layer). All pairs are validated together; a bad one changes nothing."""
    from flyserve.policy.thresholds import ThresholdsError

    try:
        changes = parse_assignments(assignments)
    except ThresholdsError as exc:
        raise fail(f"invalid: {exc}", 1) from None
    _publish_overrides(changes, state_dir, actor, if_match, dry_run, as_json, create)


def unset(
    keys: list[str] = KeysArg,
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    if_match: int | None = IfMatchOpt,
    dry_run: bool = DryRunOpt,
    as_json: bool = JsonOpt,
    create: bool = CreateOpt,
) -> None:
    """Clear overrides."""
    # None clears a key's override (ControlPlane.unset_overrides is this same call).
    _publish_overrides(dict.fromkeys(keys), state_dir, actor, if_match, dry_run, as_json, create)


def _publish_overrides(
    changes: dict[str, Any],
    state_dir: Path | None,
    actor: str | None,
    if_match: int | None,
    dry_run: bool,
    as_json: bool,
    create: bool,
) -> None:
    """Lay ``changes`` over the override layer (a None value clears that key's override) and print
    the result: `set` and `unset`."""
    sd = checked_state_dir(state_dir, write=True, create=create)
    run_change(
        lambda: writer_for(sd).apply_overrides(
            changes, actor=actor or default_actor(), source="cli", if_match=if_match, dry_run=dry_run
        ),
        as_json,
    )


def rollback(
    version: int = typer.Argument(..., help="The version whose thresholds to restore (see `history`)."),
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    if_match: int | None = IfMatchOpt,
    dry_run: bool = DryRunOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Publish a new version (source rollback) with the thresholds of an earlier one."""
    sd = checked_state_dir(state_dir, write=True)
    run_change(
        lambda: writer_for(sd).rollback(
            version, actor=actor or default_actor(), if_match=if_match, dry_run=dry_run
        ),
        as_json,
    )


def reload(
    config: Path | None = ConfigOpt,
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    as_json: bool = JsonOpt,
    server_stopped: bool = typer.Option(
        False,
        "--server-stopped",
        help="The server is stopped: take --profile as the base and allow a decode_path change "
        "(ranks read it when they start, before capturing CUDA graphs).",
    ),
    profile: str | None = typer.Option(
        None, "--profile", help="Base profile with --server-stopped (default: the current version's)."
    ),
    create: bool = CreateOpt,
) -> None:
    """Re-read the operator's config file now (what a file watcher or SIGHUP does)."""
    sd = checked_state_dir(state_dir, write=True, create=create)
    if profile is None:
        profile = plane_for(sd).snapshot().profile
    run_change(
        lambda: writer_for(sd, config_file=config, profile=profile).reload(
            actor=actor or default_actor(), startup=server_stopped
        ),
        as_json,
    )


def watch(
    config: Path | None = ConfigOpt,
    state_dir: StateDirArg = None,
    profile: str = typer.Option("gfx950", "--profile", help="Profile under the file, for the first version."),
    poll_interval: float = typer.Option(
        5.0, "--poll-interval", min=0.05, help="Seconds between polls (the backstop to directory events)."
    ),
    actor: str | None = ActorOpt,
) -> None:
    """Keep the published thresholds equal to the config file: directory watch (catches a Kubernetes
    ConfigMap's symlink swap), a periodic poll, and SIGHUP. Runs until SIGTERM or Ctrl-C."""
    import signal
    import threading

    from flyserve.control.errors import ControlIOError
    from flyserve.control.watcher import Watcher
    from flyserve.policy.thresholds import ThresholdsError

    if config is None:
        raise fail("error: --config (or $FLYSERVE_CONFIG) is required", 2)
    log = logging.getLogger("flyserve.control")
    log.setLevel(logging.INFO)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    # its lines name the config file's fields and the state directory's files: escaped
    install_log_filter(handler)
    log.addHandler(handler)
    # A long-running publisher, like the sidecar: it initialises its state directory.
    plane = writer_for(
        checked_state_dir(state_dir, write=True, create=True), profile=profile, config_file=config
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    w = Watcher(plane, poll_interval_s=poll_interval, actor=actor or f"watcher@{socket.gethostname()}")
    w.install_sighup()
    try:
        w.start()
    except (ThresholdsError, ControlIOError) as exc:  # start() only reports; keep watching anyway
        log.error("%s", exc)
    echo(f"watching {config} -> {plane.state_dir.path} (poll every {poll_interval:g}s; SIGHUP reloads)")
    try:
        while not done.wait(1.0):
            pass
    finally:
        w.stop()


def _circuit(open_: bool, state_dir: Path | None, actor: str | None, reason: str, as_json: bool) -> None:
    sd = checked_state_dir(state_dir, write=True)
    run_change(
        lambda: writer_for(sd).set_circuit(
            open_, actor=actor or default_actor(), reason=reason, source="cli"
        ),
        as_json,
    )


def circuit_open(
    reason: str = typer.Option(
        "opened by an operator", "--reason", help="Why (shown in `show` and audited)."
    ),
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Turn the prefill path off on every rank (decisions report reason circuit_open)."""
    _circuit(True, state_dir, actor, reason, as_json)


def circuit_close(
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Let the prefill path run again."""
    _circuit(False, state_dir, actor, "", as_json)
