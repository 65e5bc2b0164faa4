"""`flyserve top`: the live view, keys (`w` next window, `q` quit) and a terminal left as it was found.

The terminal is put in cbreak mode (keys arrive one by one, unechoed; Ctrl-C still interrupts) and
drawn on the alternate screen; both are undone in ``finally``, on `q`, Ctrl-C or an error alike.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_URL = "http://127.0.0.1:9400"


@contextlib.contextmanager
def keys_from(fd: int) -> Iterator[Callable[[float], str | None]]:
    """A ``read(timeout) -> str | None`` of single keys from ``fd``, in cbreak mode when it is a tty
    (restored on exit). Without a tty no key ever arrives (Ctrl-C still ends the view)."""
    if not os.isatty(fd):

        def no_key(timeout: float) -> str | None:
            time.sleep(timeout)
            return None

        yield no_key
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def read(timeout: float) -> str | None:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            b = os.read(fd, 1)
            return b.decode("utf-8", errors="replace") if b else None

        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def top(
    url: Annotated[
        str, typer.Option("--url", envvar="FLYSERVE_SIDECAR_URL", help="The sidecar ($FLYSERVE_SIDECAR_URL).")
    ] = DEFAULT_URL,
    interval: Annotated[
        float,
        typer.Option(
            "--interval", min=0.05, max=60.0, help="Seconds between updates (the sidecar's floor applies)."
        ),
    ] = 1.0,
    window: Annotated[str, typer.Option("--window", help="First window: 60s, 300s, 900s or total.")] = "60s",
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="Bearer token (else $FLYSERVE_SIDECAR_TOKEN) for a sidecar behind something that guards "
            "reads: the sidecar's own stream is open, so each connection asks without it and sends it only "
            "when --url itself answers 401. Redirects are not followed and no proxy from the environment "
            "is used: the token goes to no other host or port.",
        ),
    ] = None,
    once: Annotated[
        bool,
        typer.Option(
            "--once", help="Print one screen from the first event and exit (no keys, no live view)."
        ),
    ] = False,
) -> None:
    """A live terminal view of the sidecar's /dispatch-stats/stream: per engine and rank the path shares,
    fallback reasons, late applies, circuit, control mode, thresholds version and effective step, regret
    and drift; and the autopilot (GET /autopilot, asked every few seconds): its mode and state, a running
    trial's pairs, arm and estimate, or its last decision. Keys: w cycles the window (60s, 300s, 900s,
    since start), q quits."""
    from rich.console import Console
    from rich.live import Live

    from flyserve.top.autopilot_poll import AutopilotPoll
    from flyserve.top.stream import StatsStream
    from flyserve.top.view import WINDOWS, Connection, render

    if window not in WINDOWS:
        typer.echo(f"error: --window must be one of {', '.join(WINDOWS)} (got {window!r})", err=True)
        raise typer.Exit(2)
    token = None
    if token_file is not None or os.environ.get("FLYSERVE_SIDECAR_TOKEN"):
        from flyserve.sidecar.settings import TokenError, read_token

        try:
            secret = read_token(token_file)
        except TokenError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        token = secret.get_secret_value() if secret is not None else None
    stream = StatsStream(url, interval=interval, token=token).start()
    autopilot = AutopilotPoll(url, token=token).start()
    console = Console()

    def frame(win: str):
        lt = stream.latest()
        age = None if lt.received_at is None else time.monotonic() - lt.received_at
        conn = Connection(url, lt.error, age, lt.events, lt.malformed, lt.oversize)
        return render(lt.stats, win, conn, autopilot.latest()), lt.events + lt.malformed + lt.oversize

    if once:
        deadline = time.monotonic() + max(5.0, interval * 4)
        while stream.latest().stats is None and time.monotonic() < deadline:
            time.sleep(0.05)
        asked_by = min(deadline, time.monotonic() + 2.0)  # the autopilot's first answer, briefly
        while autopilot.latest().kind == "waiting" and time.monotonic() < asked_by:
            time.sleep(0.05)
        shown, _ = frame(window)
        console.print(shown)
        stream.stop()
        autopilot.stop()
        raise typer.Exit(0 if stream.latest().stats is not None else 1)

    win_i = WINDOWS.index(window)
    interrupted = False
    try:
        with (
            keys_from(sys.stdin.fileno()) as read_key,
            Live(
                frame(WINDOWS[win_i])[0], console=console, screen=True, auto_refresh=False, transient=True
            ) as live,
        ):
            seen, last_draw = -1, 0.0
            while True:
                k = read_key(0.1)
                if k in ("q", "Q"):
                    break
                moved = k in ("w", "W")
                if moved:
                    win_i = (win_i + 1) % len(WINDOWS)
                now = time.monotonic()
                shown, events = frame(WINDOWS[win_i])
                if moved or events != seen or now - last_draw >= 1.0:  # the "s ago" and errors move too
                    live.update(shown, refresh=True)
                    seen, last_draw = events, now
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stream.stop()
        autopilot.stop()
    raise typer.Exit(130 if interrupted else 0)


def register(app: typer.Typer) -> None:
    app.command("top")(top)
