"""What one `flyserve simulate` run is asked to do (SimulateArgs) and the checks it passes before
any process starts (validate): every refusal is a ValueError naming the option, so the command
prints one line and no rank is left half started."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

MAX_RANKS = 256
"""Rank processes one simulation may start (engines x ranks): each is a Python process of ~40 MB."""


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
    truth_costs: str | None = None
    """The cost table the *measured* kernel times come from (None: the --costs table)."""
    noise_cv: float = 0.0
    """Coefficient of variation of the lognormal noise on each measured kernel time (0: none)."""
    noise_seed: int = 0

    @property
    def total_ranks(self) -> int:
        return self.engines * self.ranks


def parse_drift(items: list[str]) -> tuple[tuple[str, float], ...]:
    """``["prefill=1.5"]`` -> ``(("prefill", 1.5),)``; ValueError naming --drift otherwise."""
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
    _validate_measurement(args)
    try:
        load_profile(args.profile)
    except ThresholdsError as exc:  # names the profile
        raise ValueError(f"--profile: {exc}") from None
    if args.drift and args.costs is None:
        raise ValueError("--drift needs --costs (the drift multiplies the cost model's kernel times)")
    if args.costs is not None:
        from flyserve.sim.kernel_times import load_pricing, load_truth

        pricing = load_pricing(args.costs)
        if pricing.table.num_heads != args.num_heads:
            raise ValueError(
                f"--num-heads {args.num_heads} does not match cost table {pricing.table.name!r} "
                f"({pricing.table.num_heads} query heads per rank): the model would price another layer"
            )
        if args.truth_costs is not None:
            load_truth(pricing, args.truth_costs)  # at start: a mismatch is never found mid-run


def _validate_measurement(args: SimulateArgs) -> None:
    """--truth-costs, --noise-cv, --noise-seed: what the timed steps' measured kernel times are."""
    from flyserve.sim.kernel_times import NOISE_CV_MAX, NOISE_SEED_MAX

    cv = args.noise_cv
    if (
        not isinstance(cv, int | float)
        or isinstance(cv, bool)
        or not math.isfinite(cv)
        or not 0 <= cv <= NOISE_CV_MAX
    ):
        raise ValueError(f"--noise-cv must be a finite number from 0 to {NOISE_CV_MAX:g} (got {cv!r})")
    if not 0 <= args.noise_seed <= NOISE_SEED_MAX:
        raise ValueError(f"--noise-seed must be an integer from 0 to 2**64 - 1 (got {args.noise_seed})")
    asked = [
        flag for flag, on in (("--truth-costs", args.truth_costs is not None), ("--noise-cv", cv > 0)) if on
    ]
    for flag in asked:
        if args.costs is None:
            raise ValueError(f"{flag} needs --costs (it changes the cost model's measured kernel times)")
        if not args.kernel_timer_every:
            raise ValueError(
                f"{flag} needs --kernel-timer-every (only the timed steps' kernel times are measured)"
            )
