"""`flyserve demo --autopilot`: the demo ends with an autopilot trial instead of the manual advice.

The sidecar starts with the autopilot off and the knobs the advice can move opened to it (a bounds
file written into the demo's work directory). After the two halves of the workload the demo turns
it on (authenticated ``POST /autopilot/mode {"mode": "auto"}``) and keeps the traffic going: the
trigger reads the live regret and the advice, starts a trial of the advice's change, the engine's
steps alternate between the current thresholds and the candidate in blocks of ``BLOCK_STEPS``, and
the sequential test promotes or rolls back on the kernel times vLLM's ranks measured in those
blocks (never on the cost table). The demo prints the trial as it runs (``GET /autopilot``), the
decision with its statistic, and the regret before the trial and in one more round after it.

On the CPU the kernel times are those of the prefill stand-in and vLLM's own unified kernel
(flyserve/vllm/cpu_prefill.py): the trial measures which of the two is faster *here*, as it would
on a GPU, and says nothing about gfx950.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flyserve.demo.advice import priced_seconds, regret_between
from flyserve.demo.procs import get_json

BLOCK_STEPS = 32
"""K: engine steps per block (about 3 s of the trial's traffic at ~0.1 s a step). vLLM times every
step in the demo (FLYSERVE_KERNEL_TIMER_EVERY=1), so a block holds 32 kernel samples (8 needed to
count). Measured: with K = 16 and the first halves' traffic a block held 16 to 463 tokens, the
kernel time per token moved by up to 5x between blocks of the same arm and the step-time guardrail
rolled the trial back on the traffic's burstiness after 5 pairs; with K = 64 and TRIAL_WORKLOAD
every block held 5,000-6,200 tokens and its kernel time per token varied by about 7%."""
TRIAL_WORKLOAD = {"input_len": 480, "output_len": 4, "range_ratio": 0.2, "burstiness": 50.0}
"""The traffic while the trial runs: prompts of 384-576 tokens (two prefill chunks each at vLLM's
256-token budget), few output tokens, arrivals almost even (vllm bench serve's --burstiness 50; 1 is
Poisson). Measured with the first halves' traffic (32-288 prompt tokens, 12 out, Poisson): a block of
64 steps held 380 to 1307 tokens, a fixed cost per timed forward (20-45 us) dominated the kernel
time per token, and after 10 pairs the effect (-7%) was still inside a band open on one side."""
STEP_TIME_LIMIT = 10.0
"""The step-time guardrail's ratio in the demo (the default is 1.5): vLLM, the benchmark client and
the sidecar's advice fits share the CPU, and single blocks measured 3.2x and 4.7x their neighbour's
mean step time with no arm to blame (two trials rolled back on that alone)."""
TIMER_EVERY = 1
MIN_PRICED_SAMPLES = 200
"""The demo's steps are a few hundred a minute: the trigger's default (1000) would wait for minutes."""
INTERVAL_S = 0.5
DEFAULT_ROUNDS = 8
"""Rounds of traffic (each as long as a half of the workload) the trial may take before the demo
pauses the autopilot. The test's band is open until about 30 pairs at the default mixture (docs/
autopilot.md, "Defaults and why"); at ~6 s a pair on two cores a decision takes some minutes."""

# The knobs the demo opens to the autopilot: every run-time knob the advice can move, over its
# whole range (an operator would open less). prefill_enabled may go either way.
BOUNDS_YAML = """\
prefill_enabled: {min: false, max: true}
min_seq_len: {min: 0, max: 1000000}
max_seq_len: {min: 0, max: 1000000}
min_qblock_rows: {min: 0, max: 1000000}
decode_rows_base: {min: 0, max: 1000000}
decode_ctx_unit: {min: 1, max: 1000000}
"""


def sidecar_args(work: Path) -> list[str]:
    """The sidecar's autopilot flags: off until the demo turns it on, the bounds, the trial's K."""
    bounds = work / "autopilot-bounds.yaml"
    bounds.write_text(BOUNDS_YAML)
    return [
        "--autopilot", "off", "--autopilot-bounds", str(bounds),
        "--autopilot-block-steps", str(BLOCK_STEPS), "--autopilot-window", "60s",
        "--autopilot-min-priced-samples", str(MIN_PRICED_SAMPLES),
        "--autopilot-interval", str(INTERVAL_S), "--autopilot-cooldown", "3600",
        "--autopilot-step-time-limit", str(STEP_TIME_LIMIT),
    ]  # fmt: skip


def _post(url: str, token: str, path: str, body: Any = None) -> dict[str, Any]:
    import httpx

    r = httpx.post(
        f"{url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
        trust_env=False,  # the token goes to the sidecar, never to $HTTP(S)_PROXY
        follow_redirects=False,
    )
    if r.status_code != 200:
        raise RuntimeError(f"POST {path} answered {r.status_code}: {r.text[:300]}")
    got: dict[str, Any] = r.json()
    return got


def _pct(x: float | None) -> str:
    return "n/a (nothing priced)" if x is None else f"{x:.1%}"


def _effect(x: object) -> str:
    return f"{x:+.1%}" if isinstance(x, int | float) else "-"


def trial_line(status: dict[str, Any], elapsed_s: float) -> str:
    """One line of the running autopilot: its state, the trial's arm, pairs and running statistic."""
    t = status.get("trial")
    if not isinstance(t, dict):
        why = status.get("last_refusal") or ""
        return f"[{elapsed_s:4.0f}s] autopilot {status.get('state')}" + (f": {why}" if why else "")
    lo_hi = t.get("interval") or [None, None]
    return (
        f"[{elapsed_s:4.0f}s] trial {t.get('id')} {t.get('changed')}: {t.get('pairs')} pairs, arm now "
        f"{'candidate' if t.get('arm_now') == 1 else 'current'}, effect {_effect(t.get('estimate'))} "
        f"[{_effect(lo_hi[0])}, {_effect(lo_hi[1])}] ({t.get('verdict')})"
    )


def decision_lines(decision: dict[str, Any], trial: dict[str, Any] | None) -> list[str]:
    """The decision in words: the verdict, why, on how many block pairs, the measured effect."""
    changed = (trial or {}).get("changed")
    return [
        f"[+] autopilot decision on trial {decision.get('trial_id')}"
        + (f" {changed}" if changed else "")
        + f": {decision.get('decision')} ({decision.get('reason')}) after {decision.get('pairs')} block pairs;",
        (
            f"    measured effect {_effect(decision.get('effect'))} kernel time per token (negative: the "
            f"candidate was faster); thresholds now version {decision.get('result_version')}"
        ),
    ]


class TrialWatch:
    """Polls GET /autopilot for the traffic loop's live lines and keeps the last running trial seen
    (after the decision the status shows none: the report needs what it moved and its pairs)."""

    def __init__(self, sidecar_url: str, t0: float, echo: Callable[[str], Any]) -> None:
        self.url, self.t0, self.echo = sidecar_url, t0, echo
        self.trial: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any]:
        status = get_json(f"{self.url}/autopilot") or {}
        if isinstance(status.get("trial"), dict):
            self.trial = status["trial"]
        return status

    def tick(self) -> None:
        status = self.poll()
        if status:
            self.echo(trial_line(status, time.monotonic() - self.t0))


def first_decision(status: dict[str, Any]) -> dict[str, Any] | None:
    """The oldest of the last decisions: the demo's one trial (newest first in the status)."""
    decisions = status.get("last_decisions")
    if not isinstance(decisions, list) or not decisions or not isinstance(decisions[-1], dict):
        return None
    got: dict[str, Any] = decisions[-1]
    return got


def autopilot_phase(
    sidecar_url: str,
    token: str,
    priced_at_start: dict[str, float],
    run_round: Callable[[int, str, Callable[[], None]], dict[str, Any]],
    echo: Callable[[str], Any],
    t0: float,
    max_rounds: int = DEFAULT_ROUNDS,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Regret so far; the autopilot on; rounds of traffic until its first decision (at most
    ``max_rounds``, then a pause rolls the trial back); one more round under the result for the regret after. The rounds' phase dicts and
    the report (trial, decision, regret before and after)."""
    before = priced_seconds(sidecar_url)
    regret_before = regret_between(priced_at_start, before)
    echo(f"[+] what the thresholds cost so far (steps priced by the CPU table): regret {_pct(regret_before)}")
    echo("[+] autopilot on: POST /autopilot/mode {'mode': 'auto'} (it measures; the table only proposes) ...")
    _post(sidecar_url, token, "/autopilot/mode", {"mode": "auto"})
    watch = TrialWatch(sidecar_url, t0, echo)
    rounds: list[dict[str, Any]] = []
    decision: dict[str, Any] | None = None
    for r in range(max_rounds):
        rounds.append(run_round(3 + r, f"trial-{r + 1}", watch.tick))
        decision = first_decision(watch.poll())
        if decision is not None:
            break
    if decision is None and watch.trial is not None:
        # The demo ends here whatever the test says: a pause rolls the running trial back to the
        # operator's version at once, audited as the operator's decision (replay checks it too).
        echo(
            f"[+] no decision by the test within {max_rounds} rounds of traffic: {trial_line(watch.poll(), 0.0)}"
        )
        echo("    POST /autopilot/pause: the trial is rolled back to the operator's thresholds now")
        _post(sidecar_url, token, "/autopilot/pause")
        decision = first_decision(watch.poll())
    report: dict[str, Any] = {"regret_before": regret_before, "decision": decision, "trial": watch.trial}
    if decision is None:
        echo(f"[+] no autopilot trial: {trial_line(watch.poll(), 0.0)} (the trigger's last refusal)")
        return rounds, report
    for line in decision_lines(decision, watch.trial):
        echo(line)
    at_decision = priced_seconds(sidecar_url)
    rounds.append(run_round(3 + len(rounds), "after-trial", watch.tick))
    report["regret_after"] = regret_between(at_decision, priced_seconds(sidecar_url))
    report["thresholds_version"] = (get_json(f"{sidecar_url}/thresholds") or {}).get("version")
    echo(
        f"[+] regret before the trial {_pct(regret_before)}; with the autopilot's result in force "
        f"(this round only) {_pct(report['regret_after'])}"
    )
    return rounds, report
