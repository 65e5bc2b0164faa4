"""`flyserve thresholds show|set|unset|rollback|history|reload|audit|circuit`: the control plane on
the command line, working directly on the state directory (same code path as the sidecar's HTTP API).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import typer

from flyserve.control.options import StateDirArg
from flyserve.terminal.printable import install_log_filter, printable, printable_block, printable_text

thresholds_app = typer.Typer(
    name="thresholds",
    help="Show and change the dispatch thresholds of a running server (validated, versioned, audited).",
    no_args_is_help=True,
)
circuit_app = typer.Typer(
    name="circuit", help="Open or close the prefill path's circuit breaker.", no_args_is_help=True
)
thresholds_app.add_typer(circuit_app, name="circuit")


def _default_actor() -> str:
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


def _plane(state_dir: Path | None, **kw: Any) -> Any:
    from flyserve.control.plane import ControlPlane

    return ControlPlane(state_dir, **kw)


def _writer(state_dir: Path | None, **kw: Any) -> Any:
    """A plane for a command that changes something: its flyserve_config_* counts go to the state
    directory's metrics/ (where the sidecar's /metrics reads them), not into this short-lived process."""
    plane = _plane(state_dir, **kw)
    try:
        from flyserve.telemetry.metrics import setup_multiprocess

        free = shutil.disk_usage(plane.state_dir.path).free if plane.state_dir.path.exists() else None
        if free is not None and free < _METRICS_MIN_FREE_BYTES:
            # prometheus_client mmaps its files: a write to a page a full tmpfs cannot back kills
            # the process with SIGBUS ("Bus error", rc 135) instead of raising ENOSPC.
            _echo(f"warning: reload metrics not shared (only {free} bytes free)", err=True)
            return plane
        setup_multiprocess(plane.state_dir.metrics_dir)
    except OSError as exc:  # an unwritable state dir: the change itself will say so
        _echo(f"warning: reload metrics not shared ({exc.strerror or exc})", err=True)
    return plane


_METRICS_MIN_FREE_BYTES = 4 << 20


def _echo(message: str, *, err: bool = False) -> None:
    """A line (or lines) of text for a person: the values in it come from the state directory and
    the operator's files, so no escape sequence in them reaches the terminal (flyserve.terminal.printable)."""
    typer.echo(printable_block(message), err=err)


def _fail(message: str, code: int) -> typer.Exit:
    _echo(message, err=True)
    return typer.Exit(code)


def _state(state_dir: Path | None, *, write: bool, create: bool = False) -> Path:
    """The state directory to use, checked (exit 2 naming it when it is missing or not initialised);
    the default is printed when it is used implicitly."""
    from flyserve.control.initialise import (
        StateDirError,
        implicit_note,
        require_for_read,
        require_for_write,
        resolve,
    )

    path, implicit = resolve(state_dir)
    if implicit:
        _echo(implicit_note(path), err=True)
    try:
        return require_for_write(path, create=create) if write else require_for_read(path)
    except StateDirError as exc:
        raise _fail(f"error: {exc}", 2) from None


def _run_change(fn: Any, as_json: bool) -> None:
    """Run a change; map each error to a clear message and exit code (1 invalid, 2 I/O, 3 conflict)."""
    from flyserve.control.errors import ControlIOError, VersionConflict
    from flyserve.policy.thresholds import ThresholdsError

    try:
        res = fn()
    except ThresholdsError as exc:
        raise _fail(f"invalid: {exc}\nthe running thresholds are unchanged", 1) from None
    except ControlIOError as exc:
        raise _fail(f"error: {exc}\nthe running thresholds are unchanged", 2) from None
    except VersionConflict as exc:
        raise _fail(f"conflict: {exc}", 3) from None
    if as_json:
        typer.echo(json.dumps(res.to_dict(), indent=2, default=str))
        return
    s = res.snapshot
    if not res.changed:
        _echo(f"unchanged: version {s.version} already has this content")
        return
    head = "dry run, would publish" if res.dry_run else "published"
    _echo(
        f"{head} version {s.version} (source {printable(s.source)}, effective from engine step "
        f"{s.effective_step})"
    )
    for k, (a, b) in res.diff.items():
        _echo(f"  {printable(k)}: {printable(a)} -> {printable(b)}")
    for k, c in s.conflicts.items():
        _echo(
            f"  note: {printable(k)}: the file says {printable(c['file'])}, the override "
            f"{printable(c['override'])} wins "
            f"(`flyserve thresholds unset {printable(k)}` to take the file's value)"
        )


def _parse_assignments(pairs: list[str]) -> dict[str, Any]:
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


_RANK_FIELDS = ("rank", "engine", "pid", "step", "applied_version", "applied_step")


@thresholds_app.command("show")
def show(state_dir: StateDirArg = None, as_json: bool = JsonOpt) -> None:
    """The current version: every threshold, the layer that set it, and any file/override conflict."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from flyserve.control.errors import ControlIOError

    sd = _state(state_dir, write=False)
    try:
        plane = _plane(sd)
        s = plane.snapshot()
        ranks = plane.store.rank_reports()
    except ControlIOError as exc:
        raise _fail(f"error: {exc}", 2) from None
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


@thresholds_app.command("set")
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
        changes = _parse_assignments(assignments)
    except ThresholdsError as exc:
        raise _fail(f"invalid: {exc}", 1) from None
    sd = _state(state_dir, write=True, create=create)
    _run_change(
        lambda: _writer(sd).apply_overrides(
            changes, actor=actor or _default_actor(), source="cli", if_match=if_match, dry_run=dry_run
        ),
        as_json,
    )


@thresholds_app.command("unset")
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
    sd = _state(state_dir, write=True, create=create)
    _run_change(
        lambda: _writer(sd).unset_overrides(
            keys, actor=actor or _default_actor(), source="cli", if_match=if_match, dry_run=dry_run
        ),
        as_json,
    )


@thresholds_app.command("rollback")
def rollback(
    version: int = typer.Argument(..., help="The version whose thresholds to restore (see `history`)."),
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    if_match: int | None = IfMatchOpt,
    dry_run: bool = DryRunOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Publish a new version (source rollback) with the thresholds of an earlier one."""
    sd = _state(state_dir, write=True)
    _run_change(
        lambda: _writer(sd).rollback(
            version, actor=actor or _default_actor(), if_match=if_match, dry_run=dry_run
        ),
        as_json,
    )


@thresholds_app.command("reload")
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
    sd = _state(state_dir, write=True, create=create)
    if profile is None:
        profile = _plane(sd).snapshot().profile
    _run_change(
        lambda: _writer(sd, config_file=config, profile=profile).reload(
            actor=actor or _default_actor(), startup=server_stopped
        ),
        as_json,
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


@thresholds_app.command("history")
def history(
    state_dir: StateDirArg = None,
    limit: int = typer.Option(20, "--limit", "-n", help="Show at most this many recent versions."),
    as_json: bool = JsonOpt,
) -> None:
    """Recent versions, oldest first, with what each changed."""
    from rich.console import Console
    from rich.table import Table

    from flyserve.control.errors import ControlIOError

    sd = _state(state_dir, write=False)
    try:
        snaps = _plane(sd).history(limit + 1)
    except ControlIOError as exc:
        raise _fail(f"error: {exc}", 2) from None
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


@thresholds_app.command("repair")
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
        report = repair(_plane(state_dir, **({"profile": profile} if profile else {})))
    except ControlIOError as exc:
        raise _fail(f"error: {exc}", 2) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    if not report.changed:
        _echo(f"consistent: version {report.version}, nothing to repair")
        return
    for a in report.actions:
        _echo(f"repaired: {a}")
    for d in report.dropped:
        _echo(f"dropped: {d}")
    _echo(f"current version {report.version}")


@thresholds_app.command("audit")
def audit(
    state_dir: StateDirArg = None,
    limit: int = typer.Option(20, "--limit", "-n", min=1, help="Show at most this many recent entries."),
) -> None:
    """The audit log's recent entries (JSON lines): every change tried, accepted or not."""
    from flyserve.control.errors import ControlIOError

    try:
        entries = _plane(_state(state_dir, write=False)).audit_log(limit)
    except ControlIOError as exc:
        raise _fail(f"error: {exc}", 2) from None
    for e in entries:
        typer.echo(json.dumps(e, sort_keys=True, default=str))


@thresholds_app.command("watch")
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
        raise _fail("error: --config (or $FLYSERVE_CONFIG) is required", 2)
    log = logging.getLogger("flyserve.control")
    log.setLevel(logging.INFO)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    # its lines name the config file's fields and the state directory's files: escaped
    install_log_filter(handler)
    log.addHandler(handler)
    # A long-running publisher, like the sidecar: it initialises its state directory.
    plane = _writer(_state(state_dir, write=True, create=True), profile=profile, config_file=config)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    w = Watcher(plane, poll_interval_s=poll_interval, actor=actor or f"watcher@{socket.gethostname()}")
    w.install_sighup()
    try:
        w.start()
    except (ThresholdsError, ControlIOError) as exc:  # start() only reports; keep watching anyway
        log.error("%s", exc)
    _echo(f"watching {config} -> {plane.state_dir.path} (poll every {poll_interval:g}s; SIGHUP reloads)")
    try:
        while not done.wait(1.0):
            pass
    finally:
        w.stop()


def _circuit(open_: bool, state_dir: Path | None, actor: str | None, reason: str, as_json: bool) -> None:
    sd = _state(state_dir, write=True)
    _run_change(
        lambda: _writer(sd).set_circuit(open_, actor=actor or _default_actor(), reason=reason, source="cli"),
        as_json,
    )


@circuit_app.command("open")
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


@circuit_app.command("close")
def circuit_close(
    state_dir: StateDirArg = None,
    actor: str | None = ActorOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Let the prefill path run again."""
    _circuit(False, state_dir, actor, "", as_json)


def init(state_dir: StateDirArg = None) -> None:
    """Create a state directory, for `thresholds ...` before any server has started one.

    A server (sidecar, simulate, vLLM with FLYSERVE_ATTENTION=1) creates its own when it starts.
    """
    from flyserve.control.initialise import StateDirError, implicit_note, initialise, resolve

    path, implicit = resolve(state_dir)
    if implicit:
        _echo(implicit_note(path), err=True)
    try:
        created = initialise(path)
    except StateDirError as exc:
        raise _fail(f"error: {exc}", 2) from None
    _echo(f"{'initialised' if created else 'already initialised:'} state directory {path}")


def register(app: typer.Typer) -> None:
    # The commands print their own clear errors; keep the library's log lines off the terminal.
    logging.getLogger("flyserve.control").addHandler(logging.NullHandler())
    app.command("init")(init)
    app.add_typer(thresholds_app, name="thresholds")
