"""`flyserve`: the command line.

Each area registers its own commands (``register(app)`` in its ``cli`` module), so this file
stays a table of contents and heavy imports (torch, vllm, uvicorn) happen only inside the
command that needs them.
"""

from __future__ import annotations

import importlib

import typer


def _flags_take_no_value() -> None:
    """typer 0.29's rich help prints every flag as ``--json <bool>``, which reads as "takes a value",
    so users typed ``--json true`` and got an error. A flag shows no value type here (plain click
    help never did)."""
    from typer.core import TyperOption

    show_type = getattr(TyperOption, "display_type_rich", None)
    if show_type is None or getattr(show_type, "_flyserve_flags", False):
        return  # a typer without it (before 0.29: seen on a machine with an older one) shows no <bool>

    def display_type_rich(self: TyperOption, ctx: object) -> str | None:
        return None if self.is_flag else show_type(self, ctx)

    display_type_rich._flyserve_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()

app = typer.Typer(
    name="flyserve",
    help="Observable, runtime-tunable dual-kernel attention dispatch for vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# The order commands register in. `flyserve --help` lists the plain commands in this order first,
# then the groups (thresholds, fleet, dashboards, arms, autopilot, flydsl) in this order.
_COMMAND_MODULES = (
    "flyserve.thresholds_files.cli",  # check-config, profiles
    # init; thresholds show|set|unset|rollback|reload|history|repair|audit|watch|circuit open|close
    "flyserve.control.cli",
    # sidecar; thresholds advise; autopilot status|mode|pause|resume|kill|approve (the sidecar's routes)
    "flyserve.sidecar.cli",
    "flyserve.sim.cli",  # simulate
    "flyserve.explain.cli",  # explain
    "flyserve.top.cli",  # top
    "flyserve.fleet.cli",  # fleet status|rules|queries
    "flyserve.dashboards.cli",  # dashboards build
    "flyserve.lab.cli",  # replay, calibrate
    "flyserve.arms.cli",  # arms compare
    "flyserve.autopilot.cli",  # autopilot trials|history|replay (the group; the sidecar adds its clients)
    "flyserve.demo.cli",  # demo
    "flyserve.doctor.cli",  # doctor, flydsl compile
)

for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
