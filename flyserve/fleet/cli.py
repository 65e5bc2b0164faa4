"""`flyserve fleet status|rules|queries`: the fleet as Prometheus sees it (docs/fleet.md)."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Annotated

import typer

from flyserve.terminal.printable import printable, printable_block, printable_text

if TYPE_CHECKING:  # imported where it is used (httpx)
    from flyserve.fleet.status import FleetStatus

fleet_app = typer.Typer(
    help="Many replicas through Prometheus: status, the recording rules, the rollout analysis queries.",
    no_args_is_help=True,
)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


@fleet_app.command("status")
def status(
    prometheus: Annotated[
        str,
        typer.Option(
            "--prometheus",
            envvar="FLYSERVE_PROMETHEUS_URL",
            help="Prometheus' URL ($FLYSERVE_PROMETHEUS_URL).",
        ),
    ],
    match: Annotated[
        str,
        typer.Option(
            "--match",
            help='Label matchers that pick the fleet\'s targets, without braces (e.g. namespace="prod", job="flyserve").',
        ),
    ] = "",
    window: Annotated[
        str, typer.Option("--window", help="Rate window of every number (30s, 5m, 1h): the rules use 5m.")
    ] = "5m",
    seen: Annotated[
        str,
        typer.Option(
            "--seen", help="List every replica that reported within this long (a stopped one as failing)."
        ),
    ] = "15m",
    margin: Annotated[
        float,
        typer.Option(
            "--margin",
            min=0.0,
            max=10.0,
            help="Kernel time per token above the median by more than this disagrees.",
        ),
    ] = 0.10,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, max=300.0, help="Seconds for all of Prometheus' answers.")
    ] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    paths: Annotated[
        bool, typer.Option("--paths", help="A column of kernel time per token per path.")
    ] = False,
) -> None:
    """Each replica's version, content, kernel time per token, regret and health, and who disagrees.

    A replica disagrees when its thresholds content is not the fleet's most common one, or its kernel
    time per token is above the median by more than --margin. Exit 0: every replica healthy and
    agreeing; 1: some disagree or are unhealthy; 2: Prometheus could not be asked."""
    from flyserve.fleet.status import FleetError, Prometheus, fleet_status

    # click's range check lets NaN through (NaN fails every comparison)
    for flag, value in (("--margin", margin), ("--timeout", timeout)):
        if not math.isfinite(value):
            typer.echo(f"error: {flag}: must be a finite number, got {value}", err=True)
            raise typer.Exit(2)
    try:
        prom = Prometheus(prometheus, timeout_s=timeout)
    except FleetError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None
    try:
        st = fleet_status(prom, window=window, matchers=match, margin=margin, seen_window=seen)
    except FleetError as exc:
        typer.echo(printable_block(f"error: {exc}"), err=True)
        raise typer.Exit(2) from None
    finally:
        prom.close()
    if as_json:
        # ensure_ascii: every label from the network leaves as \u escapes, never as a raw control.
        typer.echo(json.dumps(st.to_dict(), indent=2, ensure_ascii=True, allow_nan=False, default=str))
    else:
        _print_table(st, paths=paths)
    raise typer.Exit(1 if st.disagreeing or st.unhealthy else 0)


def _print_table(st: FleetStatus, *, paths: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not st.replicas:
        console.print(
            printable_text(f"no flyserve replica reported to this Prometheus in the last {st.window}"),
            style="yellow",
        )
        return
    t = Table(title=f"fleet: {len(st.replicas)} replicas, {st.window} window", title_justify="left")
    cols = [
        "replica",
        "health",
        "version",
        "content",
        "us/token",
        "regret",
        "fallback",
        "late/s",
        "disagrees",
    ]
    if paths:
        cols.insert(5, "us/token by path")
    for col in cols:
        t.add_column(col, overflow="fold")
    for r in st.replicas:
        cells = [
            r.name,
            r.health,
            "-" if r.version is None else str(r.version),
            r.content,
            _num(r.kernel_us_per_token, ".4g"),
            _num(r.regret, ".2%"),
            _num(r.fallback_ratio, ".1%"),
            _num(r.late_applies_per_s, ".3g"),
            ", ".join(w.split(":")[0] for w in r.disagrees) or "-",
        ]
        if paths:
            cells.insert(
                5, ", ".join(f"{p} {v:.4g}" for p, v in sorted(r.kernel_us_per_token_by_path.items())) or "-"
            )
        style = "red" if r.disagrees else ("yellow" if r.health != "ok" else None)
        t.add_row(*(printable_text(c, 512) for c in cells), style=style)
    console.print(t)
    median = _num(st.median_kernel_us_per_token, ".4g")
    console.print(
        printable_text(
            f"most common content: {st.majority_content or 'none (a tie, or no healthy replica)'}; "
            f"median kernel time per token: {median} us"
        )
    )
    for r in st.disagreeing:
        console.print(printable_text(f"{r.name}: " + "; ".join(r.disagrees), 1024), style="red")
    for r in st.unhealthy:
        console.print(printable_text(f"{r.name}: {r.health}", 1024), style="yellow")


@fleet_app.command("rules")
def rules_cmd() -> None:
    """Print config/fleet_rules.yml (the recording rules, 5m windows) for Prometheus' rule_files."""
    from flyserve.fleet.rules import render

    typer.echo(render(), nl=False)


@fleet_app.command("queries")
def queries_cmd(
    engine: Annotated[
        str,
        typer.Option("--engine", help="argo (Argo Rollouts AnalysisTemplate) or flagger (MetricTemplate)."),
    ] = "argo",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """The canary-vs-stable analysis queries as ENGINE's templates carry them (deploy/ holds them verbatim)."""
    from flyserve.fleet.queries import ENGINES, QUERIES, render

    if engine not in ENGINES:
        typer.echo(
            f"error: --engine must be one of {', '.join(ENGINES)} (got {printable(engine, 40)})", err=True
        )
        raise typer.Exit(2)
    if as_json:
        doc = [
            {"name": q.name, "pass_max": q.pass_max, "meaning": q.meaning, "query": render(q, engine)}
            for q in QUERIES
        ]
        typer.echo(json.dumps(doc, indent=2))
        return
    typer.echo(f"# {ENGINES[engine].note}")
    for q in QUERIES:
        typer.echo(
            f"\n# {q.name}: passes when the one value is <= {q.pass_max:g}; no value is no data, never a pass."
        )
        typer.echo(f"# {q.meaning}")
        typer.echo(render(q, engine))


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
