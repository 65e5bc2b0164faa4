"""``python -m flyserve.lab calibrate|replay ...``: the lab's commands without the rest of the CLI
(the GPU machine runs this: it needs only torch, numpy, pydantic, PyYAML, typer and rich)."""

import typer

from flyserve.lab.cli import register

app = typer.Typer(
    name="flyserve-lab", no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False
)
register(app)

if __name__ == "__main__":
    app()
