"""`flyserve autopilot trials|history|replay`: the autopilot's decision code on synthetic switchback
trials; the trials an audit log records, and their decisions recomputed from it.

Registered from flyserve/cli.py's table of contents. The statistics are in flyserve.autopilot.sequential,
the synthetic blocks in flyserve.autopilot.trials; docs/autopilot.md has the table this prints. The
audit's records are built by flyserve.autopilot.audit_records and read back by audit_parse, the
recomputation flyserve.autopilot.replay.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flyserve.control.options import StateDirArg
from flyserve.terminal.printable import printable, printable_block, printable_text

if TYPE_CHECKING:  # imported where they are used
    from rich.console import Console

    from flyserve.autopilot.replay import ReplayReport, TrialReplay
    from flyserve.autopilot.sequential import SequentialConfig

autopilot_app = typer.Typer(
    name="autopilot",
    help="The autopilot: thresholds tuned by measurement (docs/autopilot.md).",
    no_args_is_help=True,
)

_DEFAULT_EFFECTS = (0.02,)


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(printable_block(f"error: {msg}"), fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _scenario_name(effect: float) -> str:
    if effect == 0:
        return "A/A"
    return f"{abs(effect) * 100:.4g}% {'better' if effect > 0 else 'worse'}"


def _command_line(argv: dict[str, object]) -> str:
    """The command line that reproduces this run (defaults spelled out)."""
    parts = ["flyserve", "autopilot", "trials"]
    for flag, value in argv.items():
        if isinstance(value, bool):
            if value:
                parts.append(flag)
        elif isinstance(value, list | tuple):
            for v in value:
                parts += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
        else:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(parts)


@autopilot_app.command("trials")
def trials_cmd(
    trials: Annotated[
        int, typer.Option("--trials", help="Trials per scenario (A/A and each --effect).")
    ] = 1000,
    effect: Annotated[
        list[float] | None,
        typer.Option(
            "--effect",
            help="True relative speed-up of the candidate (0.02: 2% faster, -0.10: 10% slower); repeat for "
            "more scenarios. An A/A scenario (effect 0) always runs. Default: 0.02.",
        ),
    ] = None,
    cv: Annotated[
        float, typer.Option("--cv", help="Block-to-block coefficient of variation of one arm's measurement.")
    ] = 0.10,
    noise: Annotated[
        str, typer.Option("--noise", help="gpu (heavy tails, stalls, drift) or gaussian.")
    ] = "gpu",
    shape_r2: Annotated[
        float,
        typer.Option(
            "--shape-r2",
            help="Share of a block's variance from its batches' shape, which the covariate predicts (0-0.99).",
        ),
    ] = 0.0,
    cuped: Annotated[
        bool, typer.Option("--cuped/--no-cuped", help="Adjust by the covariate (CUPED).")
    ] = False,
    confidence: Annotated[float | None, typer.Option("--confidence", help="The test's confidence.")] = None,
    min_effect: Annotated[
        float | None, typer.Option("--min-effect", help="Speed-up needed for a promotion (0.005: 0.5%).")
    ] = None,
    max_pairs: Annotated[int | None, typer.Option("--max-pairs", help="Budget in block pairs.")] = None,
    mixture_sd: Annotated[
        float | None, typer.Option("--mixture-sd", help="The mixture's sd over the standardised effect.")
    ] = None,
    abort_margin: Annotated[
        float | None, typer.Option("--abort-margin", help="Slowdown that aborts (0.10: 10% slower).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic blocks (>= 0).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    no_progress: Annotated[
        bool, typer.Option("--no-progress", help="No progress bar (e.g. in CI logs).")
    ] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Exit 1 when a target this run covers (docs/autopilot.md) is missed or unproven."
        ),
    ] = False,
) -> None:
    """Run the real decision code on synthetic paired blocks: false promotion (A/A), power and false
    rollback (a faster candidate), blocks to decision.

    Every trial is looked at after every pair of blocks, as the autopilot will. Exit codes: 0 done;
    1 (--check) a target missed; 2 bad input."""
    from dataclasses import asdict, fields

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flyserve.autopilot.sequential import SequentialConfig, SequentialConfigError
    from flyserve.autopilot.trials import SyntheticBlocks, run_scenario, targets

    if trials < 1:
        _fail(f"--trials: must be >= 1, got {trials}")
    if seed < 0:
        _fail(f"--seed: must be >= 0, got {seed}")
    overrides: dict[str, Any] = {  # SequentialConfig checks each value's type
        "confidence": confidence,
        "min_effect": min_effect,
        "max_pairs": max_pairs,
        "mixture_sd": mixture_sd,
        "abort_margin": abort_margin,
    }
    try:
        config = SequentialConfig(cuped=cuped, **{k: v for k, v in overrides.items() if v is not None})
        effects = [0.0] + [e for e in dict.fromkeys(effect or _DEFAULT_EFFECTS) if e != 0]
        scenarios = [SyntheticBlocks(effect=e, cv=cv, noise=noise, shape_r2=shape_r2) for e in effects]
    except SequentialConfigError as exc:
        _fail(f"{_flag(exc.field)}: {str(exc).split(': ', 1)[1]}")

    err = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=no_progress,
    )
    results = []
    try:
        with bar:
            for s in scenarios:
                task = bar.add_task(_scenario_name(s.effect), total=trials)
                results.append(
                    run_scenario(config, s, trials, seed, progress=functools.partial(bar.advance, task))
                )
    except KeyboardInterrupt:
        _fail("interrupted", 130)

    cfg = {f.name: getattr(config, f.name) for f in fields(config)}
    command = _command_line(
        {
            "--trials": trials,
            "--effect": [e for e in effects if e != 0] or [0.0],
            "--cv": cv,
            "--noise": noise,
            "--shape-r2": shape_r2,
            "--cuped": cuped,
            **{_flag(k): cfg[k] for k in overrides},
            "--seed": seed,
        }
    )
    rows = [r.to_dict(config) for r in results]
    checked = targets(results)
    if as_json:
        doc = {
            "command": command,
            "config": cfg,
            "blocks": {k: v for k, v in asdict(scenarios[0]).items() if k != "effect"},
            "seed": seed,
            "scenarios": rows,
            "targets": checked,
        }
        typer.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        _print_table(Console(), rows, checked, command, config)
    if check and not all(t["met"] is True for t in checked):
        raise typer.Exit(1)


def _num(v: float) -> str:
    """A share as a percentage number: 1 decimal; exactly 0 and 100 bare; never rounded to either."""
    if v == 0 or v == 1:
        return f"{v * 100:.0f}"
    x = v * 100
    return "<0.1" if x < 0.05 else (">99.9" if x >= 99.95 else f"{x:.1f}")


def _pct(v: float) -> str:
    return _num(v) + "%"


def _print_table(
    console: Console,
    rows: list[dict[str, Any]],
    checked: list[dict[str, Any]],
    command: str,
    config: SequentialConfig,
) -> None:
    from rich import box
    from rich.table import Table

    first = rows[0]
    t = Table(
        title=f"autopilot trials: {first['trials']} per scenario, CV {first['cv']:g}, {first['noise']} noise, "
        f"shape r2 {first['shape_r2']:g}, cuped {'on' if config.cuped else 'off'}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="95% CI: of the promote rate (Wilson); p50, p90: block pairs to the decision",
        caption_justify="left",
    )
    for col in ("scenario", "promote", "95% CI", "rollback", "abort", "inconcl.", "p50", "p90"):
        t.add_column(col, justify="left" if col == "scenario" else "right", no_wrap=True)
    for r in rows:
        lo, hi = r["promote_ci95"]
        t.add_row(
            _scenario_name(r["effect"]),
            _pct(r["promote"]),
            f"{_num(lo)}-{_pct(hi)}",
            _pct(r["rollback"]),
            _pct(r["abort"]),
            _pct(r["inconclusive"]),
            f"{r['pairs_median']:.0f}",
            f"{r['pairs_p90']:.0f}",
        )
    console.print(t)
    console.print(
        printable_text(
            f"confidence {config.confidence:g}, min effect {config.min_effect:g}, budget {config.max_pairs} "
            f"pairs, mixture sd {config.mixture_sd:g}, abort margin {config.abort_margin:g}",
            None,
        )
    )
    for c in checked:
        mark = {True: "met", False: "MISSED", None: "unproven"}[c["met"]]
        note = f" ({c['note']})" if c.get("note") else ""
        console.print(
            printable_text(f"{mark}: {c['target']}: {_pct(c['value'])}{note}", None),
            style={True: None, False: "red", None: "yellow"}[c["met"]],
        )
    console.print(printable_text(f"rerun: {command}", None), soft_wrap=True)


def _report(state_dir: Path | None) -> ReplayReport:
    """The audit log of ``state_dir`` (default: the default state directory, named on stderr),
    replayed. A directory that is missing or not a state directory is refused (exit 2, as
    `flyserve thresholds history` does): read as empty, a typo'd path said "all agree"."""
    from flyserve.autopilot.audit_log import audit_log_path, read_audit_lines
    from flyserve.autopilot.replay import replay
    from flyserve.control.options import checked_state_dir

    where = checked_state_dir(state_dir, write=False)
    try:
        lines = read_audit_lines(where)
    except (OSError, ValueError) as exc:
        _fail(f"cannot read the audit log {printable(audit_log_path(where))}: {printable(exc)}")
    return replay(lines)


def _pct_change(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.2f}%"


def _trial_doc(t: TrialReplay) -> dict[str, Any]:
    s, d = t.start, t.decision
    return {
        "trial": t.trial,
        "started": None if s is None else s.time,
        "mode": None if s is None else s.mode,
        "operator_version": None if s is None else s.operator_version,
        "changes": None if s is None else {k: list(v) for k, v in s.changes.items()},
        "blocks": None if s is None else s.blocks,
        "block_steps": None if s is None else s.block_steps,
        "pairs": len(t.pairs),
        "decision": None
        if d is None
        else {
            "time": d.time,
            "verdict": d.verdict,
            "reason": d.reason,
            "source": d.source,
            "action": d.action,
            "estimate": d.statistic.estimate,
            "lower": d.statistic.lower,
            "upper": d.statistic.upper,
            "result_version": d.result_version,
            "guardrail": None
            if d.guardrail is None
            else {"name": d.guardrail.name, "value": d.guardrail.value, "limit": d.guardrail.limit},
        },
        "approval": None if t.approval is None else {"action": t.approval.action, "actor": t.approval.actor},
        "agrees": t.agrees,
        "problems": t.problems,
    }


def _trial_line(t: TrialReplay) -> str:
    s, d = t.start, t.decision
    changes = "?" if s is None else ", ".join(f"{k} {a}->{b}" for k, (a, b) in s.changes.items())
    head = f"{t.trial}: over v{s.operator_version} ({s.mode}), {changes}" if s else f"{t.trial}: (no start)"
    if d is None:
        return f"{head}; running, {len(t.pairs)} pairs so far"
    tail = f"; {d.verdict} ({d.reason}, by {d.source}) after {d.statistic.pairs} pairs, "
    tail += f"estimate {_pct_change(d.statistic.estimate)}, action {d.action}"
    if d.result_version is not None:
        tail += f" -> v{d.result_version}"
    if t.approval is not None:
        tail += f"; approval: {t.approval.action}" + (f" by {t.approval.actor}" if t.approval.actor else "")
    return head + tail


@autopilot_app.command("history")
def history_cmd(
    state_dir: StateDirArg = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of lines.")] = False,
) -> None:
    """The trials the audit log records, oldest first: what each changed, how it ended, and the
    autopilot's mode changes. Bad records are named (exit 1). Exit codes: 0 read; 1 a bad record;
    2 the log cannot be read."""
    report = _report(state_dir)
    if as_json:
        doc = {
            "trials": [_trial_doc(t) for t in report.trials],
            "modes": [
                {
                    "line": n,
                    "time": m.time,
                    "from": m.mode_before,
                    "to": m.mode,
                    "paused": m.paused,
                    "reason": m.reason,
                }
                for n, m in report.modes
            ],
            "bad_records": [{"line": b.line, "field": b.field, "reason": b.reason} for b in report.bad],
        }
        typer.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        if not report.trials and not report.modes and not report.bad:
            typer.echo("no autopilot records in the audit log")
        for n, m in report.modes:
            paused = ", paused" if m.paused else ""
            typer.echo(printable_block(f"mode ({m.reason}): {m.mode_before} -> {m.mode}{paused} (line {n})"))
        for t in report.trials:
            typer.echo(printable_block(_trial_line(t)))
        for b in report.bad:
            typer.secho(
                printable_block(f"bad record, line {b.line}: field '{b.field}': {b.reason}"), fg="red"
            )
    if report.bad:
        raise typer.Exit(1)


@autopilot_app.command("replay")
def replay_cmd(
    state_dir: StateDirArg = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of lines.")] = False,
) -> None:
    """Recompute every trial's decision from the audit log alone (docs/autopilot.md, "The audit, history and replay") and
    say whether it agrees. Exit codes: 0 every decision agrees; 1 one disagrees or a record is bad
    (each named); 2 the log cannot be read."""
    report = _report(state_dir)
    if as_json:
        doc = {
            "ok": report.ok,
            "trials": [_trial_doc(t) for t in report.trials],
            "bad_records": [{"line": b.line, "field": b.field, "reason": b.reason} for b in report.bad],
        }
        typer.echo(json.dumps(doc, indent=2, allow_nan=False))
    else:
        for t in report.trials:
            mark = {True: "agrees", False: "DISAGREES", None: "running"}[t.agrees]
            what = "no decision yet" if t.decision is None else f"{t.decision.verdict} ({t.decision.reason})"
            typer.echo(printable_block(f"{mark}: {t.trial}: {what}, {len(t.pairs)} pairs"))
            for p in t.problems:
                typer.echo(printable_block(f"  {p}"))
        for b in report.bad:
            typer.secho(
                printable_block(f"bad record, line {b.line}: field '{b.field}': {b.reason}"), fg="red"
            )
        decided = sum(1 for t in report.trials if t.decision is not None)
        verdict = "all agree" if report.ok else "NOT all agree"
        typer.echo(f"{decided} decisions replayed, {len(report.bad)} bad records: {verdict}")
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(autopilot_app, name="autopilot")
