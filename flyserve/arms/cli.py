"""`flyserve arms compare`: is a routing change an accuracy change?

Registered from flyserve/cli.py's table of contents; the command and its body (progress bar,
report, exit codes) are here, the comparison itself in flyserve.arms.compare. Everything heavy
(httpx clients, numpy, matplotlib) is imported inside the command so `flyserve --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flyserve.terminal.printable import printable_text

if TYPE_CHECKING:
    from rich.text import Text

arms_app = typer.Typer(
    name="arms",
    help="Compare two serving arms (two OpenAI-compatible servers, same model, different routing) "
    "token by token, against each arm's own run-to-run noise.",
    no_args_is_help=True,
)


@arms_app.command("compare")
def compare(
    a: Annotated[
        str, typer.Option("--a", help="Arm A base URL, ending in /v1 (the reference arm, e.g. the baseline).")
    ],
    b: Annotated[str, typer.Option("--b", help="Arm B base URL, ending in /v1 (the candidate arm).")],
    prompts: Annotated[
        Path,
        typer.Option(
            "--prompts",
            help="JSONL file: one object a line with `prompt` (completions API) or `messages` (chat API), "
            "an optional `answer`, `id` and `stop`.",
        ),
    ],
    runs: int = typer.Option(2, "--runs", min=1, help="Runs per arm (K). K >= 2 gives the noise floor."),
    concurrency: int = typer.Option(
        8, "--concurrency", min=1, help="Requests in flight per arm (both arms see the same load)."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Model name sent to both arms. Default: the first id of each arm's /v1/models."
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="max_tokens of every request."),
    top_logprobs: int = typer.Option(
        5, "--top-logprobs", min=2, max=20, help="Top alternatives per token (>= 2: the margin needs two)."
    ),
    seed: int = typer.Option(0, "--seed", help="The `seed` sent with every request (temperature is 0)."),
    results: Annotated[
        Path | None,
        typer.Option(
            "--results",
            help="Resumable raw results (JSONL). A re-run skips (arm, run, prompt) already recorded. "
            "Default: $XDG_STATE_HOME/flyserve/arms/<prompts name>-<hash>.arms-results.jsonl "
            "(~/.local/state/...; never inside a checkout).",
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the report as JSON to this path.")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Write a plot of the divergence-margin distribution (PNG/SVG/PDF; needs matplotlib).",
        ),
    ] = None,
    extractor: str = typer.Option(
        "number",
        "--extractor",
        help="Final-answer extractor: number (gsm8k: after '####', else the last number), exact "
        "(the whole stripped text) or regex:<pattern> (last match; first group if any).",
    ),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0, help="Seconds per request before a retry."),
    retries: int = typer.Option(
        5, "--retries", min=0, help="Retries per request on connect errors, timeouts, 429 and 5xx."
    ),
    bootstrap: int = typer.Option(
        10000, "--bootstrap", min=100, help="Bootstrap resamples for the significance tests (fixed RNG seed)."
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar (e.g. in CI logs)."),
) -> None:
    """Send identical deterministic requests to both arms K times, align the responses token by token and
    report divergence, margins, answer changes, the self-divergence noise floor and paired-bootstrap tests.

    Exit codes: 0 done; 1 bad input (prompts file, flags, results file of another comparison);
    3 a server kept failing (everything received so far is in the results file: re-run to resume).
    """
    code = run_compare_cli(
        a=a,
        b=b,
        prompts=prompts,
        runs=runs,
        concurrency=concurrency,
        model=model,
        max_tokens=max_tokens,
        top_logprobs=top_logprobs,
        seed=seed,
        results=results,
        json_path=json_path,
        plot=plot,
        extractor=extractor,
        timeout=timeout,
        retries=retries,
        bootstrap=bootstrap,
        progress=not no_progress,
    )
    if code:
        raise typer.Exit(code)


def run_compare_cli(
    *,
    a: str,
    b: str,
    prompts: Path,
    runs: int,
    concurrency: int,
    model: str | None,
    max_tokens: int,
    top_logprobs: int,
    seed: int,
    results: Path | None,
    json_path: Path | None,
    plot: Path | None,
    extractor: str,
    timeout: float,
    retries: int,
    bootstrap: int,
    progress: bool,
) -> int:
    """The command's body: returns the exit code (0 ok, 1 bad input, 3 a server kept failing, 130 Ctrl-C)."""
    import asyncio

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flyserve.arms.client import ArmServerError, RequestSpec, RetryPolicy
    from flyserve.arms.compare import (
        ArmsInputError,
        CompareSettings,
        ProgressFn,
        check_answers,
        check_base_url,
        compare,
    )
    from flyserve.arms.extract import ExtractorError, make_extractor
    from flyserve.arms.prompts import PromptFileError, load_prompts
    from flyserve.arms.report import render_table, write_json, write_plot
    from flyserve.arms.results import ResultsFileError, default_results_path, recorded_responses
    from flyserve.arms.stats import ARMS

    err = Console(stderr=True)
    try:
        ext = make_extractor(extractor)
        settings = CompareSettings(
            a=check_base_url(a, "--a"),
            b=check_base_url(b, "--b"),
            runs=runs,
            concurrency=concurrency,
            model=model,
            spec=RequestSpec(max_tokens=max_tokens, top_logprobs=top_logprobs, seed=seed),
            timeout=timeout,
            retry=RetryPolicy(retries=retries),
            resamples=bootstrap,
        )
        items = load_prompts(prompts)
        check_answers(items, ext)
    except (ExtractorError, ArmsInputError, PromptFileError) as exc:
        err.print(_error(exc))
        return 1
    results_path = results or default_results_path(prompts)
    if settings.a == settings.b:
        err.print("note: --a and --b are the same server: this measures its noise only")

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        disable=not progress,
    )

    def factory(totals: dict[str, int]) -> ProgressFn:
        tasks = {arm: bar.add_task(f"arm {arm.upper()}", total=totals[arm]) for arm in ARMS}

        def update(arm: str, completed: int) -> None:
            bar.update(tasks[arm], completed=completed)

        return update

    try:
        with bar:
            report = asyncio.run(
                compare(
                    items,
                    results_path,
                    settings,
                    ext,
                    progress_factory=factory,
                    on_note=lambda m: err.print(printable_text(m, 4096)),
                )
            )
    except ResultsFileError as exc:
        err.print(_error(exc))
        return 1
    except OSError as exc:  # the results file's directory is missing or read-only, the disk is full
        err.print(_error(f"--results {results_path}: {exc}"))
        return 1
    except ArmServerError as exc:
        err.print(_error(exc))  # the arm's own words (an error body) are in it
        err.print(printable_text(_saved_note(results_path, recorded_responses(results_path)), None))
        return 3
    except KeyboardInterrupt:
        note = _saved_note(results_path, recorded_responses(results_path))
        err.print(printable_text("interrupted: " + note, None))
        return 130
    out = Console()
    render_table(report, out)
    if json_path:
        try:
            write_json(report, json_path)
        except OSError as exc:
            err.print(_error(f"--json {json_path}: {exc}"))
            return 1
        err.print(printable_text(f"report: {json_path}", None))
    if plot:
        try:
            write_plot(report, plot)
        except (RuntimeError, OSError, ValueError) as exc:  # ValueError: matplotlib's unknown format
            err.print(_error(exc))
            return 1
        err.print(printable_text(f"plot: {plot}", None))
    return 0


def _error(exc: object) -> Text:
    """An error line: the message may hold a server's or a file's words, so it is Text (never
    markup) through flyserve.terminal.printable."""
    from rich.text import Text

    return Text.assemble(("error", "red"), ": ", printable_text(exc, 4096))


def _saved_note(path: Path, recorded: int | None) -> str:
    """What was kept, without pointing at a file that does not exist (a DNS failure before the
    first response writes none)."""
    if recorded is None:
        return "no response was received, so no results file was written"
    if recorded == 0:
        return f"no response was received yet ({path} holds only its header)"
    return f"the {recorded} response(s) received so far are in {path}: run the same command again to resume"


def register(app: typer.Typer) -> None:
    app.add_typer(arms_app, name="arms")
