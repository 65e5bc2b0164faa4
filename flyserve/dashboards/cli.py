"""`flyserve dashboards build`: write (or check) the generated Grafana dashboards.

The JSON under dashboards/ is generated from flyserve.dashboards; ``--check`` is what CI and the
unit test run, so an edited dashboard module with stale JSON (or hand-edited JSON) fails loudly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _build(
    out: Annotated[Path, typer.Option("--out", help="Directory for the dashboard JSON files.")] = Path(
        "dashboards"
    ),
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Write nothing; exit 1 if any file under --out differs from the generated JSON."
        ),
    ] = False,
) -> None:
    """Generate the Grafana dashboards (Dispatch overview, Kernel paths, Control plane, Fleet) as JSON."""
    from flyserve.dashboards import build as dashboards

    if out.exists() and not out.is_dir():
        typer.echo(f"error: --out {out} exists and is not a directory", err=True)
        raise typer.Exit(2)
    changed = dashboards.write(out, check=check)
    names = [f.filename for f in dashboards.build_all()]
    if check:
        if changed:
            for path in changed:
                typer.echo(f"stale: {path} differs from the generated dashboard", err=True)
            typer.echo("run `flyserve dashboards build` and commit the result", err=True)
            raise typer.Exit(1)
        typer.echo(f"ok: {len(names)} dashboards in {out} are up to date")
        return
    for name in names:
        state = "written" if out / name in changed else "unchanged"
        typer.echo(f"{state}: {out / name}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Grafana dashboards generated from code (grafana-foundation-sdk).", no_args_is_help=True
    )
    group.command("build")(_build)
    app.add_typer(group, name="dashboards")
