"""`flyserve flydsl compile` (typer): the command around ``flyserve.doctor.compile``."""

from __future__ import annotations

import json
import os
from typing import Any

import typer

from flyserve.doctor import compile as cc
from flyserve.terminal.printable import printable_block

flydsl_app = typer.Typer(
    help="FlyDSL (ROCm gfx950 prefill kernel): checks that need no GPU.", no_args_is_help=True
)


def _geometry(
    model_config: str | None, tp: int, dtype: str, num_heads: int | None, num_kv_heads: int | None,
    head_size: int | None,
) -> cc.Geometry:  # fmt: skip
    flags = (num_heads, num_kv_heads, head_size)
    if model_config is not None:
        if any(f is not None for f in flags):
            raise cc.CompileCheckError(
                "give --model-config or --num-heads/--num-kv-heads/--head-size, not both"
            )
        return cc.geometry_from_hf_config(model_config, tp=tp, dtype=dtype)
    if any(f is None for f in flags):
        raise cc.CompileCheckError(
            "give the model: --model-config PATH/config.json (with --tp), or all of --num-heads, --num-kv-heads, "
            "--head-size (per rank)"
        )
    return cc.Geometry(num_heads, num_kv_heads, head_size, cc.resolve_dtype(dtype, None), source="flags")  # type: ignore[arg-type]


def _progress(i: int, n: int, v: cc.Variant, r: cc.VariantResult | None) -> None:
    if r is None:
        typer.echo(printable_block(f"[{i + 1}/{n}] {v.name}: compiling ..."), err=True)
    else:
        line = f"[{i + 1}/{n}] {v.name}: {r.status} in {r.wall_s:.1f} s, {r.summary}"
        typer.echo(printable_block(line), err=True)


@flydsl_app.command("compile")
def compile_command(
    model_config: str | None = typer.Option(
        None, "--model-config", help="The model's Hugging Face config.json."
    ),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel size: heads and KV heads per rank."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the config's torch_dtype), bf16, f16 or fp32."),
    num_heads: int | None = typer.Option(
        None, "--num-heads", min=1, help="Query heads per rank (no config)."
    ),
    num_kv_heads: int | None = typer.Option(
        None, "--num-kv-heads", min=1, help="KV heads per rank (no config)."
    ),
    head_size: int | None = typer.Option(None, "--head-size", min=1, help="Head size (no config)."),
    page_size: list[int] | None = typer.Option(  # noqa: B008 - typer's idiom for a repeatable option
        None, "--page-size", help="Only this page size (repeatable); default: every size the revision takes."
    ),
    batch: list[str] | None = typer.Option(  # noqa: B008 - typer's idiom for a repeatable option
        None, "--batch", help="Only these batches (repeatable): warm-up, serve, short, light; default all."
    ),
    wrong_calls: bool = typer.Option(
        False, "--wrong-calls", help="Also make four wrong calls (page 16, head 96, fp32, extra keyword)."
    ),
    cache_dir: str | None = typer.Option(
        None,
        "--cache-dir",
        help="Write the compiled kernels to this FlyDSL cache (FLYDSL_RUNTIME_CACHE_DIR); refused unless only "
        "this user or root can write it (FlyDSL unpickles what it finds there).",
    ),
    run_only: bool = typer.Option(
        False,
        "--run-only",
        help="With --cache-dir: FlyDSL's run-only mode, every variant must load, none compile.",
    ),
    kernels_path: str | None = typer.Option(
        None, "--kernels-path", help="FlyDSL checkout (default $VLLM_FLYDSL_KERNELS_PATH)."
    ),
    rocm_path: str | None = typer.Option(
        None, "--rocm-path", help="Folder with amdgcn/bitcode/ and llvm/bin/ld.lld (default $ROCM_PATH)."
    ),
    save_objects: str | None = typer.Option(
        None, "--save-objects", help="Write each code object here (.hsaco)."
    ),
    jobs: int = typer.Option(
        1,
        "--jobs",
        "-j",
        min=1,
        max=cc.MAX_JOBS,
        help="Variants compiled at once, each in its own process (about 420 MB each): up to the cores "
        "and memory this machine can spare. Same statuses for any number; times grow with contention.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    json_file: str | None = typer.Option(None, "--json-out", help="Also write the JSON report to this file."),
) -> None:
    """Compile flyserve's FlyDSL call for gfx950 with FlyDSL's own compiler, on this CPU.

    Every variant the deployment runs (warm-up and serving batches, each page size, LPT on and off,
    the light kernel) compiles in its own process through flyserve's call_paged; per variant ok or
    FlyDSL's message and the code object's facts. Exit 1 if a variant fails or the server would
    refuse the cache the run built, 2 if the machine or the arguments cannot run the check or the
    --cache-dir is refused (owner, mode, symlink, an entry not FlyDSL's for gfx950: the reason is
    printed). Progress goes to stderr.
    """
    kernels_path = kernels_path or os.environ.get("VLLM_FLYDSL_KERNELS_PATH")
    rocm_path = rocm_path or os.environ.get("ROCM_PATH")
    try:
        if run_only and not cache_dir:
            raise cc.CompileCheckError("--run-only needs --cache-dir (the cache the kernels are loaded from)")
        batch = batch or []
        unknown = sorted(set(batch) - set(cc.BATCHES))
        if unknown:
            raise cc.CompileCheckError(f"--batch {unknown}: the batches are {', '.join(cc.BATCHES)}")
        geometry = _geometry(model_config, tp, dtype, num_heads, num_kv_heads, head_size)
        cc.check_cache_arg(cache_dir)  # before any child points FlyDSL at it
        problems = cc.check_machine(kernels_path, rocm_path)
        if problems:
            raise cc.CompileCheckError(
                "this machine cannot run the compile check:\n  " + "\n  ".join(problems)
            )
        assert kernels_path and rocm_path  # check_machine said so
        env = cc.child_env(
            kernels_path=kernels_path, rocm_path=rocm_path, cache_dir=cache_dir, run_only=run_only
        )
        info = cc.read_revision(env)
        rev: dict[str, Any] = info["revision"]
        pages = page_size or rev["page_sizes"]
        bad = [p for p in pages if p not in rev["page_sizes"]]
        if bad:
            raise cc.CompileCheckError(f"--page-size {bad}: this FlyDSL pages {rev['page_sizes']} only")
    except cc.CompileCheckError as exc:
        typer.echo(printable_block(f"flyserve flydsl compile: {exc}"), err=True)
        raise typer.Exit(2) from None
    variants = cc.plan_variants(
        geometry, page_sizes=pages, has_causal_lpt=rev["causal_lpt"], wrong_calls=wrong_calls
    )
    if batch:
        variants = [v for v in variants if v.batch in batch or v.batch == "wrong"]
    typer.echo(
        printable_block(
            f"{len(variants)} variants of {os.path.basename(os.path.abspath(kernels_path))} ({rev['label']}), "
            f"one process each (~420 MB, 5-30 s on 2 cores), {jobs} at a time"
        ),
        err=True,
    )
    results = cc.run_variants(
        variants, env, cached=bool(cache_dir), save_objects=save_objects, progress=_progress, jobs=jobs
    )
    cache = cc.cache_after_run(cache_dir, results, cc.deployment_of(geometry, pages), cc.key_of(info))
    rep = cc.report(geometry=geometry, info=info, kernels_path=kernels_path, results=results, cache_dir=cache_dir,
                    run_only=run_only, cache=cache)  # fmt: skip
    if json_file:
        with open(json_file, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(rep, indent=1) + "\n")
    # The checkout's revision, the model config's fields and the compiler's words: through printable.
    typer.echo(json.dumps(rep, indent=1) if json_out else printable_block(cc.render(rep)))
    raise typer.Exit(1 if cc.failed(rep) else 0)


def register(app: typer.Typer) -> None:
    app.add_typer(flydsl_app, name="flydsl")
