"""`flyserve check-config` and `flyserve profiles`."""

from __future__ import annotations

from pathlib import Path

import typer

from flyserve.terminal.printable import printable, printable_text


def check_config(
    path: Path = typer.Argument(  # noqa: B008 - typer's own idiom, as for every option below
        ..., help="A thresholds YAML file (a profile or an operator's config file)."
    ),
    base: str = typer.Option(
        "gfx950",
        "--base",
        help="Profile whose values fill the keys the file leaves out (the layering the control plane uses).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the effective values as JSON."),
) -> None:
    """Validate a thresholds file and print the effective values. Exit 1 naming the field if it is bad."""
    import json

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from flyserve.policy.thresholds import Thresholds, ThresholdsError
    from flyserve.thresholds_files.read import load_profile, read_yaml_file

    err = Console(stderr=True)
    try:
        base_t = load_profile(base)
        data = read_yaml_file(path)
        effective = base_t.merged(data, source=str(path))
    except ThresholdsError as exc:
        err.print(Text.assemble(("invalid", "red"), f": {printable(exc, 4096)}"))  # names the file's fields
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(effective.model_dump(), indent=2))
        return
    table = Table(title=Text(f"{printable(path, None)}: valid (base profile {printable(base)})"))
    table.add_column("key")
    table.add_column("value", justify="right")
    table.add_column("set by")
    defaults = Thresholds().model_dump()
    for k, v in effective.model_dump().items():
        layer = "file" if k in data else f"profile {base}"
        mark = "" if v == defaults[k] else " *"
        table.add_row(printable_text(k), printable_text(f"{v}{mark}"), printable_text(layer))
    Console().print(table)
    Console().print("* differs from the seed (gfx950) default")


def profiles() -> None:
    """List the named threshold profiles and where they live."""
    from flyserve.thresholds_files.locate import available_profiles, profile_path

    for name in available_profiles():
        typer.echo(f"{printable(name)}\t{printable(profile_path(name), None)}")


def register(app: typer.Typer) -> None:
    app.command("check-config")(check_config)
    app.command("profiles")(profiles)
