"""`flyserve simulate`."""

from __future__ import annotations

from typing import Annotated

import typer

from flyserve.control.options import StateDirArg
from flyserve.terminal.printable import printable_block


def simulate(
    state_dir: StateDirArg = None,
    ranks: Annotated[
        int,
        typer.Option(
            "--ranks",
            min=1,
            help="Rank processes per engine (engine e: ranks e*N..e*N+N-1; 256 in all at most).",
        ),
    ] = 2,
    engines: Annotated[
        int,
        typer.Option(
            "--engines",
            min=1,
            help="Data-parallel engines, each with its own ranks and its own step counter.",
        ),
    ] = 1,
    restart_every: Annotated[
        float,
        typer.Option(
            "--restart-every",
            min=0.0,
            help="Kill one running rank (SIGKILL, as a crash) every this many seconds and start it again as "
            "a new process (0: never). Needs --max-restarts.",
        ),
    ] = 0.0,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", min=0, help="Stop restarting ranks after this many restarts.")
    ] = 0,
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            help="Named workload: seed-{8k,32k,60k}-c{8,32} (flyserve.lab.workloads), or a recorded shape "
            "log (a .jsonl file).",
        ),
    ] = "seed-8k-c8",
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Engine steps per rank (the trace repeats).")
    ] = 1000,
    step_interval: Annotated[
        float,
        typer.Option(
            "--step-interval", min=0.0, max=60.0, help="Seconds per engine step (0: as fast as possible)."
        ),
    ] = 0.05,
    profile: Annotated[str, typer.Option("--profile", help="Threshold profile of the ranks.")] = "gfx950",
    num_heads: Annotated[
        int | None,
        typer.Option(
            "--num-heads",
            min=1,
            help="Query heads per rank (default: the --costs table's, else the seed's 16).",
        ),
    ] = None,
    costs: Annotated[
        str | None,
        typer.Option(
            "--costs",
            help="Cost table (name or JSON path): each rank's shape samples carry a kernel time from its "
            "model, so `flyserve sidecar --costs` can check drift without a GPU.",
        ),
    ] = None,
    drift: Annotated[
        list[str] | None,
        typer.Option(
            "--drift",
            help="PATH=FACTOR (repeatable, e.g. prefill=1.5): multiply that path's modelled kernel "
            "times, a planted drift for the drift alert. Needs --costs.",
        ),
    ] = None,
    kernel_timer_every: Annotated[
        int,
        typer.Option(
            "--kernel-timer-every",
            min=0,
            help="With --costs: one step in N also puts its modelled kernel time into "
            "flyserve_kernel_seconds, as the GPU kernel timer would (0: off). A model, not a measurement.",
        ),
    ] = 0,
    truth_costs: Annotated[
        str | None,
        typer.Option(
            "--truth-costs",
            help="Cost table (name or JSON path) the measured kernel times (--kernel-timer-every's) come "
            "from, while the samples and the sidecar price with --costs: a table that disagrees plants "
            "advice that measurement refutes. Same layer and only shapes --costs has (default: --costs).",
        ),
    ] = None,
    noise_cv: Annotated[
        float,
        typer.Option(
            "--noise-cv",
            min=0.0,
            max=1.0,
            help="Multiply each measured kernel time by lognormal noise of mean 1 and this coefficient "
            "of variation (0: none, exact times). Needs --kernel-timer-every.",
        ),
    ] = 0.0,
    noise_seed: Annotated[
        int,
        typer.Option(
            "--noise-seed",
            min=0,
            help="Seed of the noise (each rank draws its own stream from it): the same seed, the same times.",
        ),
    ] = 0,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet", "-q", help="No progress line every 2 s (for `simulate ... &` in a terminal)."
        ),
    ] = False,
) -> None:
    """Play vLLM ranks (N per engine, E engines): feed a workload's batch shapes through the real policy, recorder and control."""
    from flyserve.control.initialise import implicit_note, resolve
    from flyserve.sim.args import SimulateArgs, parse_drift
    from flyserve.sim.simulate import simulate as run
    from flyserve.startup.checks import StartupError, check_profile

    try:  # first: a bad profile is the first (and only) line, before any rank starts
        check_profile(profile, setting="--profile")
    except StartupError:
        raise typer.Exit(2) from None
    try:
        planted = parse_drift(drift or [])
        heads = num_heads if num_heads is not None else _table_heads(costs)
    except ValueError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None
    sd, implicit = resolve(state_dir)
    if implicit:
        typer.echo(printable_block(implicit_note(sd)), err=True)
    args = SimulateArgs(
        state_dir=sd,
        ranks=ranks,
        workload=workload,
        steps=steps,
        step_interval_s=step_interval,
        profile=profile,
        num_heads=heads,
        costs=costs,
        drift=planted,
        engines=engines,
        restart_every_s=restart_every,
        max_restarts=max_restarts,
        kernel_timer_every=kernel_timer_every,
        truth_costs=truth_costs,
        noise_cv=noise_cv,
        noise_seed=noise_seed,
    )
    try:
        code = run(
            args,
            echo=lambda s: typer.echo(printable_block(s), err=False),  # the ranks' files are in it
            progress_every_s=float("inf") if quiet else 2.0,
        )
    except ValueError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _table_heads(costs: str | None) -> int:
    """The default --num-heads: the cost table's layer, so its model prices what the ranks run."""
    if costs is None:
        return 16
    from flyserve.pricing.costs import CostTableError, load_costs

    try:
        return load_costs(costs).num_heads
    except CostTableError as exc:
        raise ValueError(f"--costs: {exc}") from None


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
