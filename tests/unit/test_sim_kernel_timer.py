"""flyserve simulate --kernel-timer-every (modelled kernel times into flyserve_kernel_seconds) and a
recorded shape log as --workload: what the fleet's kernel time per token needs without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flyserve.lab.workloads import WorkloadSpec, generate
from flyserve.policy import BatchShape, decide
from flyserve.pricing.costs import CostModel, load_costs
from flyserve.sim.args import SimulateArgs, validate
from flyserve.sim.rank import rank_command
from flyserve.telemetry.files_exposition import FilesExposition
from flyserve.thresholds_files import load_profile

pytestmark = pytest.mark.timeout(120)


def _args(**kw) -> SimulateArgs:  # type: ignore[no-untyped-def]
    base = {"state_dir": Path("/nonexistent"), "ranks": 1, "workload": "seed-8k-c8", "steps": 10}
    return SimulateArgs(**{**base, **kw})


def test_the_timer_needs_costs_and_a_count():
    with pytest.raises(ValueError, match="--kernel-timer-every needs --costs"):
        validate(_args(kernel_timer_every=4))
    with pytest.raises(ValueError, match="--kernel-timer-every must be >= 0"):
        validate(_args(kernel_timer_every=-1, costs="h200", num_heads=32, profile="h200"))
    cmd = rank_command(_args(kernel_timer_every=4, costs="h200"), 0, 1.0)
    assert cmd[cmd.index("--kernel-timer-every") + 1] == "4"
    assert "--kernel-timer-every" not in rank_command(_args(), 0, 1.0)


def test_a_workload_that_is_neither_a_name_nor_a_shape_log_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match=r"--workload: unknown workload 'nope' .*\.jsonl"):
        validate(_args(workload="nope"))
    with pytest.raises(ValueError, match="--workload: missing.jsonl: no such file"):
        validate(_args(workload=str(tmp_path / "missing.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "query_lens": [1], "seq_lens": []}\n')
    with pytest.raises(ValueError, match="--workload: "):
        validate(_args(workload=str(bad)))


@pytest.mark.slow  # runs `flyserve simulate` in a subprocess
def test_a_shape_log_replays_and_every_step_is_timed_with_the_cost_model(tmp_path: Path):
    trace = generate(WorkloadSpec(4096, 8, 4, num_requests=8, range_ratio=0.5), name="t")
    log = tmp_path / "t.jsonl"
    log.write_text(trace.to_jsonl())
    state = tmp_path / "state"
    steps = len(trace)
    r = subprocess.run(
        [sys.executable, "-m", "flyserve.cli", "simulate", "--state-dir", str(state), "--ranks", "1",
         "--workload", str(log), "--steps", str(steps), "--step-interval", "0", "--profile", "h200",
         "--costs", "h200", "--kernel-timer-every", "1", "-q"],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 step in 1 into flyserve_kernel_seconds" in r.stdout
    text = FilesExposition(state / "metrics").text().decode()
    got = {}
    for line in text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"flyserve_kernel_seconds_{part}{{"):
                path = line.split('path="')[1].split('"')[0]
                got[(part, path)] = float(line.rsplit(" ", 1)[1])
    # What the model says of the same steps, routed by the same thresholds.
    table = load_costs("h200")
    model, t = CostModel(table), load_profile("h200")
    want: dict[tuple[str, str], float] = {}
    for ts in trace:
        d = decide(
            BatchShape.from_query_lens(ts.query_lens, max_seq_len=ts.max_seq_len, num_heads=32, thresholds=t),
            t,
        )
        want[("sum", d.path)] = want.get(("sum", d.path), 0.0) + model.predict(
            ts.query_lens, ts.seq_lens, d.path
        )
        want[("count", d.path)] = want.get(("count", d.path), 0.0) + 1
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-9), key
    assert sum(v for (part, _), v in got.items() if part == "count") == steps
