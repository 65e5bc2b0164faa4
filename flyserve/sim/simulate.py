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
a model's, without a GPU. ``--truth-costs NAME|PATH`` and ``--noise-cv X`` make those measured
times another table's, times lognormal noise (flyserve/sim/kernel_times.py): measurement that can
disagree with the table the samples and the sidecar price with.

``--workload`` also takes a recorded shape log (a JSONL file, flyserve.lab.workloads.load_trace).

The parts: args.py (SimulateArgs, validate), rank.py (a rank process: its command line and its
loop), kernel_times.py (the cost model's kernel times), this module (the parent: start, restart,
progress, stop; ``python -m flyserve.sim.simulate`` is a rank process) and cli.py (the command).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flyserve.sim.args import SimulateArgs, validate
from flyserve.sim.rank import rank_command

ENGINE_STAGGER_S = 0.37
"""Engine e's step 0 is this much later than engine e-1's: engines do not step in lockstep."""


def prepare_state_dir(state_dir: Path) -> None:
    """Create the layout and drop metric files of processes that are gone (an earlier run)."""
    from flyserve.control import StateDir
    from flyserve.telemetry.metrics import wipe_metrics_dir

    sd = StateDir(state_dir)
    for d in (sd.path, sd.metrics_dir, sd.ranks_dir, sd.control_dir):
        d.mkdir(parents=True, exist_ok=True)
    wipe_metrics_dir(sd.metrics_dir, only_dead=True)


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
    from flyserve.control.state_files import read_json

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
        + _measured_text(args)
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
                    try:  # the state directory: one reader (safe_read via state_files.read_json)
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


def _measured_text(args: SimulateArgs) -> str:
    """The progress header's words on the measured kernel times when they are not the priced ones."""
    parts = []
    if args.truth_costs is not None:
        parts.append(f"measured times from truth table {args.truth_costs}")
    if args.noise_cv > 0:
        parts.append(f"noise CV {args.noise_cv:g} (seed {args.noise_seed})")
    return "".join(f", {p}" for p in parts)


def _report_name(sl: RankSlot) -> str:
    return f"{sl.rank}.json" if sl.engine == 0 else f"{sl.engine}-{sl.rank}.json"


def _reported_pid(state_dir: Path, sl: RankSlot) -> int | None:
    """The pid in the rank's report: a restarted rank is killed again only once it is up (it has
    written its metric files and reported), as a worker that crashes mid-run."""
    from flyserve.control.state_files import read_json

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
    from flyserve.sim.rank import rank_main

    sys.exit(rank_main(sys.argv[1:]))
