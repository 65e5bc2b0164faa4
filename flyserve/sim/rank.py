"""One simulated rank: its process's command line (rank_command, written by the parent;
rank_main, read by the child) and its loop (run_rank), the per-step path of flyserve's routing
without vLLM (flyserve/sim/simulate.py's docstring tells the whole simulation)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flyserve.sim.args import SimulateArgs, parse_drift
from flyserve.sim.kernel_times import KernelTimes, MeasurementNoise, load_pricing, load_truth

RANK_MODULE = "flyserve.sim.simulate"
"""What ``python -m`` runs for a rank (simulate.py hands its argv to rank_main): a rank process's
command line names flyserve.sim.simulate, which is how tests and operators tell it in ``ps``."""
SAMPLE_CAPACITY = 1024
"""Shape-sample lines a simulated rank keeps (it samples every step and flushes once a second)."""


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
    # No block step time: a simulated step's wall time is its schedule's interval (and the host's
    # scheduling when behind), never the arm's work, so the step-time guardrail would judge the host.
    control = RankControl(state, rank, engine=args.engine, profile=args.profile, block_clock=None).start()
    recorder = DispatchRecorder(rank)
    # a trial block's fallbacks: the recorder's count at its two boundaries (a simulated kernel never raises)
    control.count_blocks_with(lambda: (recorder.fallbacks(), 0))
    shapes = ShapeSampleWriter(state.path, rank=rank, engine=args.engine, capacity=SAMPLE_CAPACITY)
    kernel = rank_kernel_times(args, rank)
    if kernel is not None:
        model = kernel.pricing
        shapes.set_layer(head_size=model.table.meta.get("head_size"), block_size=model.block_size)
    timed_every = args.kernel_timer_every if kernel is not None else 0
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
            if kernel is not None:  # the modelled kernel time of the path this step ran
                kernel_s = kernel.modelled(ts.query_lens, ts.seq_lens, d.path)
                if timed_every and step % timed_every == 0:  # what the GPU timer observes
                    measured = kernel.measured(ts.query_lens, ts.seq_lens, d.path, kernel_s)
                    kernel_hist[d.path].observe(measured)
                    # a trial's block sums its timed samples (the autopilot pairs them): here, not per step
                    control.record_kernel_sample(step, measured, int(ts.query_lens.sum()))
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
        *(["--truth-costs", args.truth_costs] if args.truth_costs is not None else []),
        *(["--noise-cv", repr(args.noise_cv), "--noise-seed", str(args.noise_seed)] if args.noise_cv else []),
    ]  # fmt: skip


@dataclass(frozen=True)
class RankArgv:
    """What a rank process's command line says: the run's SimulateArgs and the rank's place in it."""

    args: SimulateArgs
    rank: int
    start_at: float
    join: bool


def parse_rank_argv(argv: list[str]) -> RankArgv:
    """rank_command's list (without its interpreter and module) back into what it was made from."""
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
    p.add_argument("--truth-costs", default=None)
    p.add_argument("--noise-cv", type=float, default=0.0)
    p.add_argument("--noise-seed", type=int, default=0)
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
        truth_costs=a.truth_costs,
        noise_cv=a.noise_cv,
        noise_seed=a.noise_seed,
    )
    return RankArgv(args, a.rank, a.start_at, a.join)


def rank_main(argv: list[str]) -> int:
    """A rank process: its command line back into SimulateArgs, then its loop."""
    r = parse_rank_argv(argv)
    return run_rank(r.args, r.rank, r.start_at, join=r.join)


def rank_kernel_times(args: SimulateArgs, rank: int) -> KernelTimes | None:
    """What this rank reports kernel times with (None without --costs), built by the loaders
    validate() ran before any rank started; the noise stream is the rank's own."""
    if args.costs is None:
        return None
    pricing = load_pricing(args.costs)
    truth = load_truth(pricing, args.truth_costs) if args.truth_costs is not None else None
    noise = MeasurementNoise(args.noise_cv, args.noise_seed, stream=rank) if args.noise_cv > 0 else None
    return KernelTimes(pricing, truth=truth, drift=dict(args.drift), noise=noise)
