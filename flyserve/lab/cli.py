"""Commands of the lab: ``flyserve replay`` (CPU, from a cost table, or live on a GPU) and
``flyserve calibrate`` (GPU). Heavy imports (torch, kernels, matplotlib) happen inside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from flyserve.lab.workloads import DEFAULT_MAX_NUM_BATCHED_TOKENS, workload_names
from flyserve.terminal.printable import printable, printable_block, printable_text

ALL = "all"


def _fail(msg: str, code: int = 2) -> None:
    typer.secho(printable_block(f"error: {msg}"), fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def replay_cmd(
    trace: Annotated[
        str | None, typer.Argument(help="A shape log (JSONL, see flyserve.lab.workloads) or a workload name.")
    ] = None,
    workload: Annotated[
        list[str] | None,
        typer.Option(
            "--workload", "-w", help=f"Named workload(s): {', '.join(workload_names())}, or '{ALL}'."
        ),
    ] = None,
    profile: Annotated[
        list[str] | None,
        typer.Option(
            "--profile",
            "-p",
            help="Thresholds profile name or YAML path; repeat to compare. Default: gfx950.",
        ),
    ] = None,
    costs: Annotated[
        str, typer.Option("--costs", help="Cost table name (config/costs) or JSON path.")
    ] = "h200",
    block_size: Annotated[
        int | None,
        typer.Option("--block-size", help="Which block size of the cost table to use (default: its first)."),
    ] = None,
    live: Annotated[
        bool,
        typer.Option(
            "--live", help="Time every distinct batch on this machine's GPU instead of a cost table."
        ),
    ] = False,
    max_num_batched_tokens: Annotated[
        int, typer.Option("--max-num-batched-tokens", help="Scheduler token budget for named workloads.")
    ] = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    num_heads: Annotated[
        int | None,
        typer.Option("--num-heads", min=1, help="Query heads per rank (default: the cost table's)."),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of the table.")
    ] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write a bar chart (PNG/SVG/PDF; needs matplotlib).")
    ] = None,
) -> None:
    """Replay a trace through thresholds: routed vs always-unified, always-prefill and the oracle.

    Times are one attention layer call per step, summed over the trace, priced by the cost
    table's interpolating model (no GPU) or measured live (--live). routed/oracle = 1.0 means the
    thresholds never sent a batch to the slower kernel.
    """
    from flyserve.lab.costs import CostModel, CostTableError, load_costs
    from flyserve.lab.replay import model_price, plot_results, replay_many
    from flyserve.lab.workloads import TraceError, load_trace
    from flyserve.lab.workloads import workload as make_workload
    from flyserve.policy import ThresholdsError
    from flyserve.thresholds_files import load_profile

    names = list(workload or [])
    if ALL in names:
        names = workload_names()
    if trace is None and not names:
        _fail("give a TRACE file or --workload NAME (see --help)")
    try:
        traces = [make_workload(n, max_num_batched_tokens=max_num_batched_tokens) for n in names]
        if trace is not None:
            traces.insert(
                0,
                make_workload(trace, max_num_batched_tokens=max_num_batched_tokens)
                if trace in workload_names()
                else load_trace(trace),
            )
    except TraceError as exc:
        _fail(str(exc))
    try:
        profiles = {
            Path(p).stem if p.endswith((".yaml", ".yml")) else p: load_profile(p)
            for p in (profile or ["gfx950"])
        }
    except ThresholdsError as exc:
        _fail(str(exc))

    if live:
        from flyserve.lab.bench import GpuUnavailable, LivePricer

        try:
            pricer = LivePricer.for_platform(num_heads=num_heads or 32, block_size=block_size or 16)
        except GpuUnavailable as exc:
            _fail(str(exc), 3)
        price = pricer.price
        heads = pricer.num_heads
        source = f"live on {pricer.device_name}"
    else:
        try:
            table = load_costs(costs)
            model = CostModel(table, block_size=block_size)
        except CostTableError as exc:
            _fail(str(exc))
        price = model_price(model)
        heads = num_heads or table.num_heads
        source = f"cost table {table.name} ({table.meta.get('gpu', '?')}, block size {model.block_size})"

    results = []
    for t in traces:
        results.extend(replay_many(t, profiles, price, num_heads=heads))

    if plot is not None:
        try:
            plot_results(results, str(plot))
        except ImportError:
            _fail("--plot needs matplotlib (pip install 'flyserve[lab]')")
    if json_out:
        docs = [r.to_json() for r in results]
        out = dict(docs[0], source=source) if len(docs) == 1 else {"source": source, "results": docs}
        sys.stdout.write(json.dumps(out, indent=1, sort_keys=True) + "\n")
        return
    _print_table(results, source)


def _print_table(results, source: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # The cost table's name and GPU and the trace's name are files' words: Text, never markup.
    title = f"flyserve replay ({printable(source, 1024)}); ms per attention layer, summed over steps"
    table = Table(title=Text(title))
    for col in (
        "trace",
        "profile",
        "steps",
        "routed",
        "unified",
        "prefill",
        "oracle",
        "routed/oracle",
        "prefill ratio",
        "reasons",
    ):
        table.add_column(col, justify="left" if col in ("trace", "profile", "reasons") else "right")
    for r in results:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items(), key=lambda kv: -kv[1]))
        table.add_row(
            printable_text(r.trace),
            printable_text(r.profile),
            str(r.steps),
            f"{r.routed_s * 1e3:.1f}",
            f"{r.unified_s * 1e3:.1f}",
            f"{r.prefill_s * 1e3:.1f}",
            f"{r.oracle_s * 1e3:.1f}",
            f"{r.routed_over_oracle:.4f}",
            f"{r.prefill_ratio:.3f}",
            printable_text(reasons, 1024),
        )
    Console(width=None if sys.stdout.isatty() else 180).print(table)


def calibrate_cmd(
    out_profile: Annotated[
        Path, typer.Option("--out-profile", help="Where to write the fitted profile YAML.")
    ],
    out_costs: Annotated[
        Path, typer.Option("--out-costs", help="Where to write the measured cost table (JSON).")
    ],
    grid: Annotated[
        str, typer.Option("--grid", help="Shape grid: 'default', 'quick' (a smoke test) or a JSON file.")
    ] = "default",
    block_size: Annotated[
        list[int] | None,
        typer.Option(
            "--block-size", help="KV block size(s) to measure (repeat). Default: 16; cpu: 128 (one only)."
        ),
    ] = None,
    num_heads: Annotated[
        int | None,
        typer.Option(
            "--num-heads", min=1, help="Query heads (default: Llama-3.1-8B's 32; cpu: the tiny model's 4)."
        ),
    ] = None,
    num_kv_heads: Annotated[
        int | None, typer.Option("--num-kv-heads", min=1, help="KV heads (default 8; cpu: 2).")
    ] = None,
    head_size: Annotated[int | None, typer.Option("--head-size", min=1, help="Default 128; cpu: 32.")] = None,
    platform: Annotated[
        str,
        typer.Option(
            "--platform",
            help="Kernel pair: cuda (Triton unified + FA3), rocm, or cpu (vLLM's CPU attention + "
            "flyserve's CPU SDPA prefill path; grids 'cpu', 'cpu-quick').",
        ),
    ] = "cuda",
    base_profile: Annotated[
        str, typer.Option("--base-profile", help="Profile whose unfitted knobs (block_m, lpt) are kept.")
    ] = "gfx950",
    block_m: Annotated[
        int | None, typer.Option("--block-m", min=1, help="Prefill kernel q-block rows (FA3 on Hopper: 128).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Skip shapes already in the partial results file.")
    ] = False,
    partial: Annotated[
        Path | None,
        typer.Option("--partial", help="Partial results (JSONL). Default: <out-costs>.partial.jsonl"),
    ] = None,
) -> None:
    """Time both kernel paths over a grid of shapes on this GPU and fit the thresholds to it.

    Every shape is checked against a float32 torch reference (outputs poisoned with NaN first);
    a wrong or NaN output stops the run. Writes the cost table and a profile whose header says
    the command, date, GPU and kernel versions. Exit codes: 3 no GPU, 4 kernel unavailable,
    5 a kernel produced a wrong result.
    """
    from flyserve.lab.calibrate import CalibrationError, run_calibration

    command = "flyserve calibrate " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else [])
    if platform == "cpu":
        from flyserve.lab.cpu_calibrate import CPU_LAYER, run_cpu_calibration

        if block_size and len(block_size) > 1:
            _fail("--block-size: the CPU calibration measures one block size", 2)
        try:
            summary = run_cpu_calibration(
                out_profile=out_profile,
                out_costs=out_costs,
                grid="cpu" if grid == "default" else grid,
                block_size=block_size[0] if block_size else CPU_LAYER["block_size"],
                num_heads=num_heads or CPU_LAYER["num_heads"],
                num_kv_heads=num_kv_heads or CPU_LAYER["num_kv_heads"],
                head_size=head_size or CPU_LAYER["head_size"],
                base_profile=base_profile if base_profile != "gfx950" else "cpu-tiny",
                command=command,
                echo=lambda s: typer.echo(printable_block(s)),
            )
        except CalibrationError as exc:
            _fail(str(exc), exc.exit_code)
        typer.echo(printable_block(summary))
        return
    try:
        summary = run_calibration(
            out_profile=out_profile,
            out_costs=out_costs,
            grid=grid,
            block_sizes=tuple(block_size or [16]),
            num_heads=num_heads or 32,
            num_kv_heads=num_kv_heads or 8,
            head_size=head_size or 128,
            platform=platform,
            base_profile=base_profile,
            block_m=block_m,
            resume=resume,
            partial=partial,
            command=command,
        )
    except CalibrationError as exc:
        _fail(str(exc), exc.exit_code)
    typer.echo(printable_block(summary))


def register(app: typer.Typer) -> None:
    app.command("replay")(replay_cmd)
    app.command("calibrate")(calibrate_cmd)
