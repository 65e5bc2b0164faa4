"""`flyserve sidecar` (and `flyserve thresholds advise`, which reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from flyserve.control.options import StateDirArg
from flyserve.control.trial_lease import DEFAULT_TTL_S as LEASE_TTL_S
from flyserve.control.trial_lease import MAX_TTL_S as MAX_LEASE_TTL_S
from flyserve.control.trial_lease import MIN_TTL_S as MIN_LEASE_TTL_S
from flyserve.terminal.printable import install_log_filter, printable_block

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""--log-level's values: uvicorn.config.LOG_LEVELS' names (trace is uvicorn's own level, below
debug), restated so that every `flyserve` command does not import uvicorn (a test checks they agree)."""


class AUTOPILOT_DEFAULTS:
    """AutopilotConfig's defaults, restated: importing it here would load the autopilot (and numpy)
    for every `flyserve` command (tests/unit/test_sidecar_autopilot_cli.py checks they agree)."""

    block_steps = 32
    plan_blocks = 3000
    cooldown_s = 600.0
    regret_bound = 0.03
    min_saving = 0.005
    min_priced_samples = 1000
    max_exploration_share = 0.005
    p99_ratio_limit = 1.5


def sidecar(
    state_dir: StateDirArg = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Bind address. Loopback by default: put a network policy in front first."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port.")] = 9400,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="File whose first line is the bearer token for mutations (chmod 600). Else "
            "$FLYSERVE_SIDECAR_TOKEN; with neither, every mutation is refused (403).",
        ),
    ] = None,
    actor_name: Annotated[
        str | None,
        typer.Option(
            "--actor-name",
            help="Name recorded as the actor of changes made with the token (audit log, GET /thresholds). "
            "Default: a keyed hash of the token (key: <state>/control/actor.key, 0600), never checkable "
            "offline against a token guess.",
        ),
    ] = None,
    profile: Annotated[
        str, typer.Option("--profile", help="Threshold profile under the overrides.")
    ] = "gfx950",
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config-file",
            help="Operator thresholds file ($FLYSERVE_CONFIG). Watched: edits, ConfigMap symlink swaps and "
            "SIGHUP publish it to every rank; POST /reload re-reads it on demand.",
            envvar="FLYSERVE_CONFIG",
        ),
    ] = None,
    config_poll: Annotated[
        float,
        typer.Option("--config-poll", min=0.1, help="Seconds between backstop re-reads of --config-file."),
    ] = 5.0,
    stream_interval: Annotated[
        float, typer.Option("--stream-interval", min=0.05, help="Seconds between SSE events.")
    ] = 2.0,
    stale_after: Annotated[
        float, typer.Option("--stale-after", min=0.5, help="Seconds before a silent rank is stale.")
    ] = 5.0,
    step_margin: Annotated[
        int | None,
        typer.Option(
            "--step-margin",
            min=1,
            help="Engine steps between the highest reported step and a new version's effective step "
            "(default: the control plane's). Must cover ~2 s of steps.",
        ),
    ] = None,
    stats_ttl: Annotated[
        float,
        typer.Option(
            "--stats-ttl",
            min=0.0,
            max=60.0,
            help="Seconds a computed /dispatch-stats is reused (0: recompute on every request).",
        ),
    ] = 0.5,
    metrics_ttl: Annotated[
        float,
        typer.Option(
            "--metrics-ttl", min=0.0, max=60.0, help="Seconds a /metrics exposition is reused (0: never)."
        ),
    ] = 1.0,
    costs: Annotated[
        str | None,
        typer.Option(
            "--costs",
            help="Cost table (name under config/costs, e.g. h200, or a JSON path) measured for the "
            "serving layer (heads, head size, block size): prices the sampled shapes live for the "
            "regret section of /dispatch-stats, GET /thresholds/advice and the drift gauge.",
        ),
    ] = None,
    stream_min_interval: Annotated[
        float,
        typer.Option(
            "--stream-min-interval",
            min=0.05,
            help="Floor on a stream client's ?interval= (one payload per tick is shared by all streams).",
        ),
    ] = 0.5,
    max_streams: Annotated[
        int,
        typer.Option(
            "--max-streams",
            min=1,
            help="Concurrent SSE streams. At the cap a new one takes the slot of the most-stalled "
            "stream (one not reading), else of the oldest stream open over --stream-lease; with "
            "neither it gets 503 and Retry-After.",
        ),
    ] = 64,
    stream_lease: Annotated[
        float,
        typer.Option(
            "--stream-lease",
            help="Seconds (> 0) a stream holds its slot for sure: at --max-streams with no stream "
            "stalled, a new one takes the slot of the oldest stream open longer than this (that "
            "stream ends; flyserve top reconnects), so slow readers cannot hold every slot.",
        ),
    ] = 120.0,
    stream_write_timeout: Annotated[
        float,
        typer.Option(
            "--stream-write-timeout",
            min=0.5,
            help="Seconds an SSE event's write may take; a stream whose client does not read for longer "
            "is dropped and its slot freed.",
        ),
    ] = 10.0,
    stream_max_queued: Annotated[
        int,
        typer.Option(
            "--stream-max-queued",
            min=1,
            help="SSE events' worth of bytes that may wait unsent for one client; with more it is "
            "dropped and its slot freed.",
        ),
    ] = 16,
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections",
            min=8,
            help="Concurrent connections and requests. At the cap a new connection evicts the oldest one "
            "that has not sent a whole request head; a request over the cap gets 503 at once, except "
            "/healthz, /readyz and changes with the valid token.",
        ),
    ] = 512,
    head_timeout: Annotated[
        float,
        typer.Option(
            "--head-timeout",
            min=0.5,
            help="Seconds a connection has to send a whole request head (request line and headers); "
            "a slower one is dropped.",
        ),
    ] = 5.0,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            min=0.5,
            help="Seconds a client has to send a whole request (head and body); a slower one is dropped.",
        ),
    ] = 10.0,
    compact_interval: Annotated[
        float,
        typer.Option(
            "--compact-interval",
            min=0.0,
            help="Seconds between compactions of dead processes' metric files in <state>/metrics "
            "(merged into one archive per kind, totals unchanged; 0: never).",
        ),
    ] = 60.0,
    switch_interval_ms: Annotated[
        float,
        typer.Option(
            "--switch-interval-ms",
            min=0.0,
            max=100.0,
            help="Python's thread switch interval for this process, 0.1-100 ms (0: Python's own, 5 ms). The "
            "sidecar's background refresher and compactor are CPU-bound Python; each time a request's "
            "thread waits for the interpreter lock behind them it waits up to this long, several "
            "times per request (docs/performance.md section 12 measures it).",
        ),
    ] = 1.0,
    autopilot: Annotated[
        str,
        typer.Option(
            "--autopilot",
            help="The autopilot's mode (docs/autopilot.md): off (default: nothing), advise (proposals "
            "only), trial (runs trials; a promotion waits for POST /autopilot/approve), auto.",
            envvar="FLYSERVE_AUTOPILOT",
        ),
    ] = "off",
    autopilot_bounds: Annotated[
        Path | None,
        typer.Option(
            "--autopilot-bounds",
            help="YAML knob -> {min, max}: the knobs the autopilot may move, and how far. Without it "
            "the autopilot moves no knob.",
            envvar="FLYSERVE_AUTOPILOT_BOUNDS",
        ),
    ] = None,
    autopilot_block_steps: Annotated[
        int,
        typer.Option("--autopilot-block-steps", min=1, max=1 << 20, help="Engine steps per trial block (K)."),
    ] = AUTOPILOT_DEFAULTS.block_steps,
    autopilot_max_blocks: Annotated[
        int,
        typer.Option(
            "--autopilot-max-blocks", min=2, help="Blocks a trial may run (even): the test's budget, twice."
        ),
    ] = AUTOPILOT_DEFAULTS.plan_blocks,
    autopilot_max_exploration_share: Annotated[
        float,
        typer.Option(
            "--autopilot-max-exploration-share",
            help="A trial starts only when its expected extra cost (the worse arm's blocks times its "
            "slowdown) is at most this share of its plan's attention time, 0-1 exclusive "
            '(docs/autopilot.md, "The exploration-cost bound").',
        ),
    ] = AUTOPILOT_DEFAULTS.max_exploration_share,
    autopilot_step_time_limit: Annotated[
        float,
        typer.Option(
            "--autopilot-step-time-limit",
            min=1.0,
            max=100.0,
            help="Step-time guardrail: two candidate blocks in a row whose mean step time is above this "
            "many times the current arm's roll the trial back. Raise it where host stalls are common.",
        ),
    ] = AUTOPILOT_DEFAULTS.p99_ratio_limit,
    autopilot_cooldown: Annotated[
        float, typer.Option("--autopilot-cooldown", min=0.0, help="Seconds with no new trial after one ends.")
    ] = AUTOPILOT_DEFAULTS.cooldown_s,
    autopilot_regret_bound: Annotated[
        float,
        typer.Option("--autopilot-regret-bound", min=0.0, help="A trial starts only above this live regret."),
    ] = AUTOPILOT_DEFAULTS.regret_bound,
    autopilot_min_saving: Annotated[
        float,
        typer.Option(
            "--autopilot-min-saving", min=0.0, max=1.0, help="... and an advice saving of at least this."
        ),
    ] = AUTOPILOT_DEFAULTS.min_saving,
    autopilot_min_priced_samples: Annotated[
        int,
        typer.Option(
            "--autopilot-min-priced-samples", min=1, help="... over at least this many priced samples."
        ),
    ] = AUTOPILOT_DEFAULTS.min_priced_samples,
    autopilot_window: Annotated[
        str,
        typer.Option(
            "--autopilot-window", help="The regret and advice window the trigger reads: 60s or 900s."
        ),
    ] = "900s",
    autopilot_interval: Annotated[
        float,
        typer.Option("--autopilot-interval", min=0.05, max=60.0, help="Seconds between autopilot ticks."),
    ] = 1.0,
    autopilot_lease: Annotated[
        float,
        typer.Option(
            "--autopilot-lease",
            min=MIN_LEASE_TTL_S,
            max=MAX_LEASE_TTL_S,
            help="Seconds a running trial outlives a silent sidecar: the runner renews its lease every "
            "tick, and once it is this old (or 5 ticks, if longer) the engine's side publishes the "
            "version again without the trial.",
        ),
    ] = LEASE_TTL_S,
    log_level: Annotated[
        str, typer.Option("--log-level", help=f"uvicorn/flyserve log level: {', '.join(LOG_LEVELS)}.")
    ] = "info",
) -> None:
    """Serve /dispatch-stats, /thresholds and /metrics next to vLLM (uvicorn, one worker)."""
    import logging

    import uvicorn

    from flyserve.control.initialise import StateDirError, implicit_note, initialise, resolve
    from flyserve.sidecar.app import create_app
    from flyserve.sidecar.listen import BindError, bind
    from flyserve.sidecar.server import server_config
    from flyserve.sidecar.settings import SidecarSettings, TokenError, read_token
    from flyserve.startup.checks import StartupError, check_profile

    if log_level.lower() not in LOG_LEVELS:  # else logging's "Unknown level" traceback
        typer.echo(
            printable_block(f"error: --log-level: must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}"),
            err=True,
        )
        raise typer.Exit(2)
    log_level = log_level.lower()  # uvicorn's table is lower case only
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # flyserve's records name config keys, state files and rank reports' words: escaped (uvicorn's not)
    install_log_filter(*logging.getLogger().handlers)

    def err(message: str, err: bool = False) -> None:
        """Startup lines: the token file's, the cost table's and the state directory's words are in
        some of them, so through flyserve.terminal.printable."""
        typer.echo(printable_block(message), err=err)

    try:  # first: a bad profile is the first (and only) line, before anything starts
        check_profile(profile, setting="--profile")
    except StartupError:
        raise typer.Exit(2) from None
    if not (switch_interval_ms == 0 or 0.1 <= switch_interval_ms <= 100):
        # Python takes 1e-9 and then switches threads without end; an older click lets nan through
        # its range check (nan compares False both ways), so the range is checked here too.
        err("error: --switch-interval-ms: 0 (Python's own) or 0.1-100 ms", err=True)
        raise typer.Exit(2)
    if not stream_lease > 0:  # nan too
        err(f"error: --stream-lease: must be more than 0 seconds, got {stream_lease:g}", err=True)
        raise typer.Exit(2)
    try:
        token = read_token(token_file)
    except TokenError as exc:
        err(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if actor_name is not None:
        from flyserve.sidecar.actor import ActorNameError, check_actor_name

        try:
            check_actor_name(actor_name)
        except ActorNameError as exc:
            err(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    if costs is not None:
        from flyserve.pricing.costs import CostModel, CostTableError, load_costs

        try:
            CostModel(load_costs(costs))  # a table that cannot build a model is refused now, not per request
        except CostTableError as exc:
            err(f"error: --costs: {exc}", err=True)
            raise typer.Exit(2) from None
    if autopilot not in ("off", "advise", "trial", "auto"):
        err(f"error: --autopilot: must be off, advise, trial or auto, got {autopilot!r}", err=True)
        raise typer.Exit(2)
    if autopilot_window not in ("60s", "900s"):
        err(f"error: --autopilot-window: must be 60s or 900s, got {autopilot_window!r}", err=True)
        raise typer.Exit(2)
    if autopilot_max_blocks % 2:
        err(
            f"error: --autopilot-max-blocks: must be even (blocks come in pairs), got {autopilot_max_blocks}",
            err=True,
        )
        raise typer.Exit(2)
    if not 0.0 < autopilot_max_exploration_share < 1.0:  # nan too: it compares False both ways
        err(
            "error: --autopilot-max-exploration-share: must be more than 0 and less than 1, "
            f"got {autopilot_max_exploration_share:g}",
            err=True,
        )
        raise typer.Exit(2)
    if autopilot != "off" and costs is None:  # the trigger prices its samples by the cost table
        err("warning: no --costs: the autopilot starts no trial (too few priced samples)", err=True)
    bounds: dict[str, Any] = {}
    if autopilot_bounds is not None:
        from flyserve.sidecar.autopilot_bounds import BoundsError, read_bounds

        try:
            bounds = dict(read_bounds(autopilot_bounds))
        except BoundsError as exc:
            err(f"error: --autopilot-bounds: {exc}", err=True)
            raise typer.Exit(2) from None
    elif autopilot != "off":
        err("warning: no --autopilot-bounds: the autopilot moves no knob", err=True)
    try:  # before saying where it listens: a port in use is the message, naming --port
        sock = bind(host, port)
    except BindError as exc:
        err(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    sd, implicit = resolve(state_dir)
    if implicit:
        err(implicit_note(sd), err=True)
    try:
        if initialise(sd):
            err(f"initialised state directory {sd}", err=True)
    except StateDirError as exc:
        sock.close()
        err(f"error: --state-dir: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = SidecarSettings(
        state_dir=sd,
        profile=profile,
        config_file=config_file,
        config_poll_s=config_poll,
        token=token,
        actor_name=actor_name,
        stream_interval_s=max(stream_interval, stream_min_interval),
        stream_min_interval_s=stream_min_interval,
        max_streams=max_streams,
        stream_write_timeout_s=stream_write_timeout,
        stream_lease_s=stream_lease,
        stream_max_queued_events=stream_max_queued,
        stale_after_s=stale_after,
        step_margin=step_margin,
        stats_ttl_s=stats_ttl,
        metrics_ttl_s=metrics_ttl,
        costs=costs,
        max_requests=max_connections,
        compact_interval_s=compact_interval,
        autopilot=autopilot,
        autopilot_bounds=bounds,
        autopilot_block_steps=autopilot_block_steps,
        autopilot_max_blocks=autopilot_max_blocks,
        autopilot_max_exploration_share=autopilot_max_exploration_share,
        autopilot_step_time_limit=autopilot_step_time_limit,
        autopilot_cooldown_s=autopilot_cooldown,
        autopilot_regret_bound=autopilot_regret_bound,
        autopilot_min_saving=autopilot_min_saving,
        autopilot_min_priced_samples=autopilot_min_priced_samples,
        autopilot_window=autopilot_window,
        autopilot_interval_s=autopilot_interval,
        autopilot_lease_s=autopilot_lease,
    )
    if token is None:
        err("warning: no token (--token-file or $FLYSERVE_SIDECAR_TOKEN): mutations are disabled", err=True)
    if host not in ("127.0.0.1", "::1", "localhost"):
        err(
            f"warning: binding {host}: anyone who can reach it can read stats; guard it with a network policy",
            err=True,
        )
    app = create_app(settings)
    config = server_config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        request_timeout_s=request_timeout,
        head_timeout_s=head_timeout,
        max_connections=max_connections,
    )

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Tell open SSE streams to end now, so graceful shutdown does not wait for them.
            app.state.shutting_down.set()
            super().handle_exit(sig, frame)

    import sys

    if switch_interval_ms > 0:
        sys.setswitchinterval(switch_interval_ms / 1000.0)  # the whole process: it is the sidecar's own
    switch_ms = sys.getswitchinterval() * 1000.0
    typer.echo(f"flyserve sidecar on http://{host}:{port} (state {sd}; thread switch interval {switch_ms:g} ms)",
               err=True)  # fmt: skip
    _Server(config).run(sockets=[sock])


def register(app: typer.Typer) -> None:
    from flyserve.autopilot.cli import autopilot_app
    from flyserve.control.cli import thresholds_app
    from flyserve.sidecar import autopilot_cli
    from flyserve.sidecar.advise_cli import advise

    app.command("sidecar")(sidecar)
    thresholds_app.command("advise")(advise)  # reads the sidecar's live window, so it lives here
    autopilot_cli.register(autopilot_app)  # status, mode, pause, resume, kill, approve: the sidecar's routes
