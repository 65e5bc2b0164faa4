"""`flyserve arms compare`: is a routing change an accuracy change?

Registered from flyserve/cli.py's table of contents. Everything heavy (httpx clients,
matplotlib) is imported inside the command so `flyserve --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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
            "Default: <prompts file>.arms-results.jsonl",
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
    from flyserve.arms.compare import run_compare_cli

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


def register(app: typer.Typer) -> None:
    app.add_typer(arms_app, name="arms")
