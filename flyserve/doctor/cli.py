"""`flyserve doctor` (typer) and ``python -m flyserve.doctor`` (argparse, for machines without typer)."""

from __future__ import annotations

import json
import platform
import sys
import time
from typing import Any

import typer

from flyserve.doctor.checks import Check, platform_kind, run_checks
from flyserve.terminal.printable import printable_block

MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def report(*, run: bool, block_size: int | None) -> dict[str, Any]:
    checks = run_checks(block_size=block_size)
    runs = []
    if run:
        from flyserve.doctor.timing import run_pair

        kind, _ = platform_kind()
        runs = [r.as_dict() for r in run_pair(kind, block_size=block_size or 64)]
        if not runs:
            checks.append(Check("run", "warn", f"--run: no GPU kernel pair on platform {kind}: nothing timed",
                                "run it on a CUDA (H100/H200) or ROCm gfx950 machine"))  # fmt: skip
        for r in runs:
            checks.append(Check(f"run-{r['path']}", r["status"], f"{r['kernel']}: " + (
                f"median {r['median_us']:.1f} us, " if r["median_us"] is not None else "") + r["detail"]))  # fmt: skip
    counts = {s: sum(1 for c in checks if c.status == s) for s in ("ok", "warn", "fail")}
    return {
        "format": "flyserve-doctor",
        "version": 1,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "python": platform.python_version(),
        "checks": [c.as_dict() for c in checks],
        "run": runs,
        "summary": counts,
    }


def render(rep: dict[str, Any]) -> str:
    lines = [f"flyserve doctor  {rep['time']}  host {rep['host']}  python {rep['python']}", ""]
    width = max(len(c["name"]) for c in rep["checks"])
    for c in rep["checks"]:
        lines.append(f"  {MARK[c['status']]}  {c['name']:<{width}}  {c['detail']}")
        if c["fix"] and c["status"] != "ok":
            lines.append(f"        {'':<{width}}  fix: {c['fix']}")
    if len(rep["run"]) == 2 and all(r["median_us"] for r in rep["run"]):
        u, p = rep["run"]
        lines.append(f"\n  prefill / unified time on this batch: {p['median_us'] / u['median_us']:.2f}x")
    s = rep["summary"]
    lines.append(f"\n{s['ok']} ok, {s['warn']} warn, {s['fail']} fail")
    return "\n".join(lines)


def doctor(
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON (for scripts)."),
    run: bool = typer.Option(
        False, "--run", help="With a GPU: time one small call of each kernel path against a torch reference."
    ),
    block_size: int | None = typer.Option(
        None,
        "--block-size",
        min=1,
        help="Check this KV block size (vLLM's --block-size) instead of the default.",
    ),
) -> None:
    """Check this machine for flyserve: versions, platform, the kernel pair, vLLM plugin, state.

    Each line is ok / WARN / FAIL with the fix. Exit status 1 if anything FAILs.
    """
    rep = report(run=run, block_size=block_size)
    typer.echo(json.dumps(rep, indent=1) if json_out else printable_block(render(rep)))
    raise typer.Exit(1 if rep["summary"]["fail"] else 0)


def register(app: typer.Typer) -> None:
    from flyserve.doctor import compile_cli

    app.command("doctor")(doctor)
    compile_cli.register(app)  # `flyserve flydsl compile`


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m flyserve.doctor", description="flyserve doctor")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--run", action="store_true", help="time one small call of each path (GPU)")
    p.add_argument("--block-size", type=int, default=None, help="check this KV block size")
    a = p.parse_args(argv)
    if a.block_size is not None and a.block_size < 1:
        p.error("--block-size must be a positive integer")
    rep = report(run=a.run, block_size=a.block_size)
    print(json.dumps(rep, indent=1) if a.json else printable_block(render(rep)))
    return 1 if rep["summary"]["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
