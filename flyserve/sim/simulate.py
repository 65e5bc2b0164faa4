"""`flyserve simulate`: processes that play the ranks of vLLM engines, without vLLM.

Each rank process runs the real per-step path of flyserve's routing, once per engine step:

    snap  = control.current(step)                       # RankControl: the step-synchronised switch
    shape = BatchShape.from_query_lens(...)             # the named workload's step (lab.workloads)
    d     = decide(shape, snap.thresholds)              # the real policy
    recorder.record(d, shape, step, snap.version)       # the real DispatchRecorder -> <state>/metrics

so the sidecar, Prometheus and the dashboards see exactly what they would see next to vLLM. All
ranks replay the same trace step for step (TP ranks see the same batch), and step ``s`` replays
trace step ``s % len(trace)``: the decisions of a run can be recomputed from (workload, steps,
thresholds history), which is what the integration tests do.

With ``--engines E`` there are E data-parallel engines of N ranks each, as vLLM runs them: rank
``engine * N + tp_rank`` (unique across engines, as flyserve.vllm.runtime numbers real workers),
each engine on its own schedule (engine ``e`` starts ENGINE_STAGGER_S * e later), so engines are
at different step numbers at any moment and each applies a version at its own step. With
``--restart-every S`` the parent kills one running rank every S seconds (SIGKILL, as a crashed
worker dies: no exit handler runs) and starts it again as a new process that rejoins its engine's
schedule at the current step, up to ``--max-restarts``: each restart leaves the dead process's
metric files behind, which is what the sidecar's compaction (flyserve.telemetry.compaction) is for.

Ranks also keep a bounded sample of recent shapes in ``<state>/shapes/`` (flyserve.telemetry.shape_sample)
for the sidecar's dry runs and live pricing: every step, with its rows' query and context lengths
and the path it ran. Kernel times are not measured: there is no kernel here, so ``kernels`` in
/dispatch-stats stays at count 0. With ``--costs NAME`` each sample carries a kernel time from that
cost model, times ``--drift PATH=FACTOR`` if given: a planted, known drift, so the sidecar's drift
check and its alert can be exercised end to end without a GPU (it is labelled a model, not a
measurement, in docs/operations.md). With ``--kernel-timer-every N`` as well, one step in N also
puts that modelled time into ``flyserve_kernel_seconds{path,rank}``, where the GPU kernel timer puts
its measured one on a real engine: the fleet's kernel time per token (docs/fleet.md) then has data,
a model's, without a GPU.

``--workload`` also takes a recorded shape log (a JSONL file, flyserve.lab.workloads.load_trace).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RANK_MODULE = "flyserve.sim.simulate"
SAMPLE_CAPACITY = 1024
"""Shape-sample lines a simulated rank keeps (it samples every step and flushes once a second)."""
MAX_RANKS = 256
"""Rank processes one simulation may start (engines x ranks): each is a Python process of ~40 MB."""
ENGINE_STAGGER_S = 0.37
"""Engine e's step 0 is this much later than engine e-1's: engines do not step in lockstep."""


@dataclass(frozen=True)
class SimulateArgs:
    state_dir: Path
    ranks: int
    workload: str
    steps: int
    step_interval_s: float = 0.05
    profile: str = "gfx950"
    num_heads: int = 16
    engine: int = 0
    costs: str | None = None
    drift: tuple[tuple[str, float], ...] = ()
    engines: int = 1
    restart_every_s: float = 0.0
    max_restarts: int = 0
    kernel_timer_every: int = 0

    @property
    def total_ranks(self) -> int:
        return self.engines * self.ranks


# ----------------------------------------------------------------------------- one rank


def run_rank(args: SimulateArgs, rank: int, start_at: float, *, join: bool = False) -> int:
    """One rank's loop. Returns its exit code; stops early (cleanly) on SIGTERM/SIGINT.

    ``join``: a restarted rank; it starts at the step its engine's schedule is at now, not at 0,
    as a replaced worker finds its engine mid-run."""
    from flyserve.control import RankControl, StateDir
    from flyserve.lab.workloads import trace_from
    from flyserve.policy import NO_PREFILL_ROWS, PREFILL, UNIFIED, BatchShape, decide, decision_for
    from flyserve.policy.vocabulary import CIRCUIT_OPEN
    from flyserve.telemetry import metrics
    from flyserve.telemetry.recorder import DispatchRecorder
    from flyserve.telemetry.shape_sample import ShapeSampleWriter

    stop = False

    def _stop(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)

    state = StateDir(args.state_dir)
    metrics.setup_multiprocess(state.metrics_dir)  # the parent wiped dead files before starting us
    trace = trace_from(args.workload)
    control = RankControl(state, rank, engine=args.engine, profile=args.profile).start()
    recorder = DispatchRecorder(rank)
    shapes = ShapeSampleWriter(state.path, rank=rank, engine=args.engine, capacity=SAMPLE_CAPACITY)
    model = None
    if args.costs is not None:
        from flyserve.pricing.costs import CostModel, load_costs

        table = load_costs(args.costs)
        model = CostModel(table)
        shapes.set_layer(head_size=table.meta.get("head_size"), block_size=model.block_size)
    drift = dict(args.drift)
    timed_every = args.kernel_timer_every if model is not None else 0
    kernel_hist = {p: metrics.KERNEL_SECONDS.labels(p, str(rank)) for p in (UNIFIED, PREFILL)}
    circuit = decision_for(UNIFIED, CIRCUIT_OPEN)
    circuit_state: bool | None = None  # what flyserve_circuit_open{rank} says now
    n = len(trace)
    heads = args.num_heads
    first = 0
    if join and args.step_interval_s > 0:
        first = min(args.steps, max(0, int((time.time() - start_at) / args.step_interval_s) + 1))
    # Wall-clock schedule shared by all ranks (start_at), so TP ranks step together.
    try:
        while time.time() < start_at and not stop:
            time.sleep(min(0.05, max(0.0, start_at - time.time())))
        next_flush = time.monotonic() + 0.5
        anchor = start_at  # step s is due at anchor + s * interval on every rank
        late_s = 5 * args.step_interval_s
        for step in range(first, args.steps):
            if stop:
                break
            ts = trace[step % n]
            snap = control.current(step)
            if snap.circuit_open != circuit_state:  # rare: the gauge follows the breaker
                circuit_state = snap.circuit_open
                recorder.set_circuit_open(circuit_state)
            t = snap.thresholds
            shape = BatchShape.from_query_lens(
                ts.query_lens, max_seq_len=ts.max_seq_len, num_heads=heads, thresholds=t
            )
            d = decide(shape, t)
            if snap.circuit_open and d.path == PREFILL and d.reason != NO_PREFILL_ROWS:
                d = circuit  # what the vLLM routing does while its breaker is open
            recorder.record(d, shape, step, snap.version)
            kernel_s = None
            if model is not None:  # the modelled kernel time of the path this step ran
                kernel_s = model.predict(ts.query_lens, ts.seq_lens, d.path) * drift.get(d.path, 1.0)
                if timed_every and step % timed_every == 0:  # what the GPU timer observes, modelled
                    kernel_hist[d.path].observe(kernel_s)
            shapes.add(
                step, ts.query_lens, ts.max_seq_len, heads, True, ts.seq_lens, d.path, time.time(), kernel_s
            )
            now = time.monotonic()
            if now >= next_flush:
                shapes.flush()
                next_flush = now + 1.0
            if args.step_interval_s > 0:
                delay = anchor + (step + 1) * args.step_interval_s - time.time()
                if delay > 0:
                    time.sleep(delay)
                elif delay < -late_s:
                    # Behind (a slow start, a busy CPU): drop the backlog instead of bursting, as a
                    # real engine would; a burst would also inflate the steps_per_s the control
                    # plane sizes effective_step with.
                    anchor -= delay
    finally:
        shapes.flush()
        control.stop()  # writes a last report with the final step
    return 0


def _rank_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {RANK_MODULE}", description="one simulated rank (internal)")
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-interval", type=float, required=True)
    p.add_argument("--profile", required=True)
    p.add_argument("--num-heads", type=int, required=True)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--costs", default=None)
    p.add_argument("--drift", action="append", default=[])
    p.add_argument("--engine", type=int, default=0)
    p.add_argument("--join", action="store_true")
    p.add_argument("--kernel-timer-every", type=int, default=0)
    a = p.parse_args(argv)
    args = SimulateArgs(
        a.state_dir,
        a.ranks,
        a.workload,
        a.steps,
        a.step_interval,
        a.profile,
        a.num_heads,
        engine=a.engine,
        costs=a.costs,
        drift=parse_drift(a.drift),
        kernel_timer_every=a.kernel_timer_every,
    )
    return run_rank(args, a.rank, a.start_at, join=a.join)


# ----------------------------------------------------------------------------- the parent


def parse_drift(items: list[str]) -> tuple[tuple[str, float], ...]:
    """``["prefill=1.5"]`` -> ``(("prefill", 1.5),)``; ValueError naming --drift otherwise."""
    import math

    from flyserve.policy.vocabulary import PATHS

    out: dict[str, float] = {}
    for item in items:
        path, sep, factor = item.partition("=")
        try:
            f = float(factor)
        except ValueError:
            f = math.nan
        if not sep or path not in PATHS or not math.isfinite(f) or f <= 0:
            raise ValueError(
                f"--drift {item!r}: expected PATH=FACTOR with PATH one of {', '.join(PATHS)} "
                "and FACTOR a positive number (e.g. prefill=1.5)"
            )
        out[path] = f
    return tuple(sorted(out.items()))


def validate(args: SimulateArgs) -> None:
    """Refuse bad arguments before any process starts; raises ValueError naming the option."""
    from flyserve.lab.workloads import TraceError, load_trace, workload_names
    from flyserve.policy.thresholds import ThresholdsError
    from flyserve.thresholds_files import load_profile

    if args.ranks < 1:
        raise ValueError(f"--ranks must be >= 1 (got {args.ranks})")
    if args.engines < 1:
        raise ValueError(f"--engines must be >= 1 (got {args.engines})")
    if args.total_ranks > MAX_RANKS:
        raise ValueError(
            f"--engines {args.engines} x --ranks {args.ranks} = {args.total_ranks} rank processes; "
            f"at most {MAX_RANKS} (one Python process each)"
        )
    if args.restart_every_s < 0 or args.restart_every_s > 3600:
        raise ValueError(f"--restart-every must be between 0 and 3600 seconds (got {args.restart_every_s})")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0 (got {args.max_restarts})")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {args.steps})")
    if args.step_interval_s < 0 or args.step_interval_s > 60:
        raise ValueError(f"--step-interval must be between 0 and 60 seconds (got {args.step_interval_s})")
    if args.num_heads < 1:
        raise ValueError(f"--num-heads must be >= 1 (got {args.num_heads})")
    if args.workload not in workload_names():
        if not args.workload.endswith(".jsonl"):
            raise ValueError(
                f"--workload: unknown workload {args.workload!r} (known: {', '.join(workload_names())}, "
                "or a shape log ending in .jsonl)"
            )
        try:
            if not len(load_trace(args.workload)):
                raise TraceError(f"{Path(args.workload).name}: no steps")
        except TraceError as exc:
            raise ValueError(f"--workload: {exc}") from None
    if args.kernel_timer_every < 0:
        raise ValueError(f"--kernel-timer-every must be >= 0 (got {args.kernel_timer_every})")
    if args.kernel_timer_every and args.costs is None:
        raise ValueError("--kernel-timer-every needs --costs (the timings are the cost model's)")
    try:
        load_profile(args.profile)
    except ThresholdsError as exc:  # names the profile
        raise ValueError(f"--profile: {exc}") from None
    if args.drift and args.costs is None:
        raise ValueError("--drift needs --costs (the drift multiplies the cost model's kernel times)")
    if args.costs is not None:
        from flyserve.pricing.costs import CostModel, CostTableError, load_costs

        try:
            table = load_costs(args.costs)
            CostModel(table)
        except CostTableError as exc:
            raise ValueError(f"--costs: {exc}") from None
        if table.num_heads != args.num_heads:
            raise ValueError(
                f"--num-heads {args.num_heads} does not match cost table {table.name!r} "
                f"({table.num_heads} query heads per rank): the model would price another layer"
            )


def prepare_state_dir(state_dir: Path) -> None:
    """Create the layout and drop metric files of processes that are gone (an earlier run)."""
    from flyserve.control import StateDir
    from flyserve.telemetry.metrics import wipe_metrics_dir

    sd = StateDir(state_dir)
    for d in (sd.path, sd.metrics_dir, sd.ranks_dir, sd.control_dir):
        d.mkdir(parents=True, exist_ok=True)
    wipe_metrics_dir(sd.metrics_dir, only_dead=True)


def rank_command(
    args: SimulateArgs, rank: int, start_at: float, *, engine: int = 0, join: bool = False
) -> list[str]:
    """The command line of one rank process; ``rank`` is the global rank (engine * ranks + tp rank)."""
    return [
        sys.executable, "-m", RANK_MODULE,
        "--state-dir", str(args.state_dir), "--rank", str(rank), "--ranks", str(args.ranks),
        "--engine", str(engine), *(["--join"] if join else []),
        "--workload", args.workload, "--steps", str(args.steps),
        "--step-interval", repr(args.step_interval_s), "--profile", args.profile,
        "--num-heads", str(args.num_heads), "--start-at", repr(start_at),
        *(["--costs", args.costs] if args.costs is not None else []),
        *(a for path, f in args.drift for a in ("--drift", f"{path}={f!r}")),
        *(["--kernel-timer-every", str(args.kernel_timer_every)] if args.kernel_timer_every else []),
    ]  # fmt: skip


@dataclass(frozen=True)
class RankSlot:
    """Where one rank process belongs: global rank, engine, and the engine's step-0 time."""

    rank: int
    engine: int
    start_at: float


def rank_slots(args: SimulateArgs, start_at: float) -> list[RankSlot]:
    """Engine e's ranks are e * ranks .. e * ranks + ranks - 1 (flyserve.vllm.runtime's numbering)."""
    return [
        RankSlot(e * args.ranks + r, e, start_at + e * ENGINE_STAGGER_S)
        for e in range(args.engines)
        for r in range(args.ranks)
    ]


def simulate(args: SimulateArgs, *, echo=print, progress_every_s: float = 2.0) -> int:
    """Start the ranks, print progress, restart ranks if asked, wait for them. 0 if every rank
    finished cleanly (a rank killed on purpose by a restart does not count as a failure).

    Bounded: each rank runs ``steps`` steps; the parent waits at most steps * interval + 120 s
    after the last engine's start. Ctrl-C / SIGTERM stops the ranks (SIGTERM, then SIGKILL after 5 s).
    """
    from flyserve.control.store import read_json

    validate(args)
    prepare_state_dir(args.state_dir)
    total = args.total_ranks
    # Rank start-up (imports, trace generation) takes about a second each on a small machine.
    start_at = time.time() + 1.5 + 0.25 * total
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # flyserve picks its own metrics dir explicitly
    slots = rank_slots(args, start_at)
    procs = {
        sl.rank: subprocess.Popen(rank_command(args, sl.rank, sl.start_at, engine=sl.engine), env=env)
        for sl in slots
    }
    killed: list[subprocess.Popen] = []  # restarted ranks' old processes (reaped, never failures)
    engines_text = (
        f"{args.engines} engine(s) x {args.ranks} rank(s)"
        if args.engines > 1
        else f"{args.ranks} rank(s) of engine 0"
    )
    echo(
        f"simulate: {engines_text}, workload {args.workload}, {args.steps} steps "
        f"every {args.step_interval_s}s, profile {args.profile}, {args.num_heads} heads; state {args.state_dir}"
        + (f"; kernel times from cost table {args.costs}" if args.costs else "")
        + (f", drift {', '.join(f'{p}={f}' for p, f in args.drift)}" if args.drift else "")
        + (
            f", 1 step in {args.kernel_timer_every} into flyserve_kernel_seconds"
            if args.kernel_timer_every and args.costs
            else ""
        )
        + (
            f"; a rank killed and restarted every {args.restart_every_s:g}s, at most {args.max_restarts}"
            if args.restart_every_s > 0 and args.max_restarts > 0
            else ""
        )
    )
    echo("  pids: " + " ".join(str(p.pid) for p in procs.values()))
    last_start = start_at + (args.engines - 1) * ENGINE_STAGGER_S
    deadline = time.monotonic() + (last_start - time.time()) + args.steps * args.step_interval_s + 120.0
    interrupted = False
    restarts = 0
    restarting = args.restart_every_s > 0 and args.max_restarts > 0
    next_restart = time.time() + max(args.restart_every_s, start_at - time.time())
    victim = 0

    def _term(signum, frame):
        nonlocal interrupted
        interrupted = True

    old = signal.signal(signal.SIGTERM, _term)
    next_report = time.monotonic() + progress_every_s
    try:
        while any(p.poll() is None for p in procs.values()):
            if interrupted or time.monotonic() > deadline:
                break
            time.sleep(0.05 if restarting else 0.1)
            if restarting and restarts < args.max_restarts and time.time() >= next_restart:
                next_restart += args.restart_every_s
                for _ in range(total):  # the next rank that is up (it reported), round robin
                    sl = slots[victim % total]
                    victim += 1
                    p = procs[sl.rank]
                    if p.poll() is None and _reported_pid(args.state_dir, sl) == p.pid:
                        p.kill()  # SIGKILL: no atexit, its files stay as a crashed worker's do
                        p.wait(timeout=10)
                        killed.append(p)
                        procs[sl.rank] = subprocess.Popen(
                            rank_command(args, sl.rank, sl.start_at, engine=sl.engine, join=True), env=env
                        )
                        restarts += 1
                        break
            if time.monotonic() >= next_report:
                next_report += progress_every_s
                steps = []
                for sl in slots:
                    try:  # the state directory: one reader (safe_read via store.read_json)
                        d = read_json(args.state_dir / "ranks" / _report_name(sl)) or {}
                        steps.append(int(d.get("step", 0)))
                    except (OSError, ValueError, TypeError):
                        pass
                alive = sum(1 for p in procs.values() if p.poll() is None)
                hi = max(steps) if steps else 0
                echo(
                    f"  step {hi + 1 if steps else 0}/{args.steps}, {alive}/{total} rank(s) running"
                    + (f", {restarts} restart(s)" if restarting else "")
                )
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, old)
        _stop_all(list(procs.values()))
    bad = [(r, p.returncode) for r, p in sorted(procs.items()) if p.returncode != 0]
    if interrupted:
        echo("simulate: interrupted; ranks stopped")
        return 130
    if bad:
        echo("simulate: rank(s) failed: " + ", ".join(f"rank {r} exit {c}" for r, c in bad))
        return 1
    echo(
        f"simulate: done, {total} rank(s) x {args.steps} steps"
        + (f", {restarts} restart(s)" if restarting else "")
    )
    return 0


def _report_name(sl: RankSlot) -> str:
    return f"{sl.rank}.json" if sl.engine == 0 else f"{sl.engine}-{sl.rank}.json"


def _reported_pid(state_dir: Path, sl: RankSlot) -> int | None:
    """The pid in the rank's report: a restarted rank is killed again only once it is up (it has
    written its metric files and reported), as a worker that crashes mid-run."""
    from flyserve.control.store import read_json

    try:
        return int((read_json(state_dir / "ranks" / _report_name(sl)) or {}).get("pid"))
    except (OSError, ValueError, TypeError):
        return None


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
