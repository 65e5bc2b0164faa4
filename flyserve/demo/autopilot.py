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

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flyserve.demo.advice import priced_seconds, regret_between
from flyserve.demo.procs import get_json, send_authenticated
from flyserve.demo.workload import Workload

BLOCK_STEPS = 32
"""K: engine steps per block, about half a second of the trial rounds' traffic (~100 engine steps a
second on two cores). vLLM times every step in the demo (FLYSERVE_KERNEL_TIMER_EVERY=1), so a block
holds 32 kernel samples (8 needed to count). The test's band is open until about 30 pairs whatever
the effect, so K sets how soon the demo can decide: a round of traffic gave about 4 pairs at K = 128
and about 15 at K = 32.

Measured on two cores with no planted slowdown: with K = 16 and the plain demo's traffic a block
held 16 to 463 tokens and the kernel time per token of one arm's blocks moved by up to 5x; with
K = 32 and WORKLOAD blocks held 32 to 879 tokens and 3 to 27 ms mean step times, and after 104 pairs
the test's band on the effect was still -28% to +35%; K = 128 narrowed it to -11.6% to +2.5% after
123 pairs, and found nothing. With the planted slowdown (PREFILL_REPEAT 4) the effect is -64% at
K = 128 and -69% to -75% at K = 32, and a pair's log ratio has an sd of about 0.18 at K = 128 (23
pairs) and 0.36 to 0.48 at K = 32 (28-30 pairs): far inside what 30 pairs resolve, so K = 32, and
the demo promoted after 28-30 pairs, in two rounds, in each of 3 runs (docs/autopilot.md, "The demo
on a real vLLM")."""
WORKLOAD = Workload(input_len=480, output_len=32, range_ratio=0.2, burstiness=50.0, max_concurrency=16)
"""The traffic with --autopilot: prompts of 384-576 tokens (two prefill chunks each at vLLM's
256-token budget) beside up to 15 requests decoding, arrivals almost even (vllm bench serve's
--burstiness 50; 1 is Poisson), so that most prefill chunks share their batch with decode rows and
two blocks of a pair see alike traffic. Measured with the plain demo's traffic (32-288 prompt
tokens, 12 out, Poisson, 8 at once): a block of 16 steps held 16 to 463 tokens, and the kernel time
per token of blocks of one arm moved by up to 5x."""
STEP_TIME_LIMIT = 3.0
"""The step-time guardrail's ratio in the demo (the default is 1.5): vLLM, the benchmark client and
the sidecar's advice fits share two cores, and the traffic in a block varies (with K = 32 blocks held
32 to 879 tokens and mean step times of 3 to 27 ms with no arm to blame). Single blocks measured
3.2x, 4.7x and over 10x their neighbour (a stall, an idle gap between rounds of traffic); the
guardrail needs two candidate blocks in a row (AutopilotConfig.step_time_blocks), and at K = 32 two
in a row still measured 6.5x and 4.1x: hence K = 128 then, and this limit. K = 32 is safe again with
the trial rounds' traffic (ROUND_RATE_FACTOR, and no lone first request): the two rollbacks measured
at K = 32 with the planted slowdown were both a candidate block over the idle gap between rounds
(20x, its seconds counted as step time) followed by one against a current block of lone decode
steps (3 ms a step: 8.3x at 2 requests a second, 3.4x after the benchmark's lone first request)."""
TIMER_EVERY = 1
ROUND_RATE_FACTOR = 3.0
"""The trial rounds send requests this many times as fast as the demo's two halves (6 a second at
the default --request-rate), and without the benchmark's lone first request (its ready check: vLLM
has answered all along). At 2 a second the engine idled between requests and ran them mostly one at
a time: a block of 32 steps was sometimes one request's lone decode steps (3 ms a step) and
sometimes an idle gap's seconds (the ranks time a block's two boundaries), so the step-time
guardrail compared traffic, not arms (STEP_TIME_LIMIT). Busier rounds also hold more steps: about
1,500 a round of 15 s instead of 1,050."""
PREFILL_REPEAT = 4
"""The demo's planted slowdown (--autopilot-prefill-repeat): the CPU prefill stand-in computes each
batch this many times. Without it the engine measured the two CPU kernels alike (123 pairs: -4.8%,
band -11.6% to +2.5%; docs/autopilot.md) while the CPU cost table has them 5-10x apart, so no trial
could promote anything."""
MIN_PRICED_SAMPLES = 200
"""The demo's steps are a few hundred a minute: the trigger's default (1000) would wait for minutes."""
INTERVAL_S = 0.5
DEFAULT_ROUNDS = 5
"""Rounds of traffic (each as long as a half of the workload) the trial may take before the demo
pauses the autopilot. The test's band is open until about 30 pairs at the default mixture (docs/
autopilot.md, "Defaults and why"); at K = 32 a round of 15 s gives about 15 pairs (about 4 at
K = 128), so 5 rounds hold about 60 pairs: the planted slowdown promoted after 28-30, in two rounds."""

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


def planted_line(prefill_repeat: int) -> str | None:
    """The demo's disclosure of its planted slowdown, or None when there is none (repeat 1)."""
    if prefill_repeat <= 1:
        return None
    return (
        f"      planted: the CPU prefill stand-in computes each batch {prefill_repeat} times "
        "(--autopilot-prefill-repeat), so that the trial has a real difference to measure"
    )


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


def _post(url: str, token: str, path: str, body: Any = None) -> None:
    send_authenticated("POST", f"{url}{path}", token, body)


def _pct(x: float | None) -> str:
    return "n/a (nothing priced)" if x is None else f"{x:.1%}"


# Whatever answers at the sidecar's URL wrote the bodies read here: every field is read by type, a
# list where an object belongs reads as empty, a number that is not a finite one shows "-", a text
# is cut short. An odd answer costs a line of the demo's report, never the demo.


def _obj(x: object) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _text(x: object, limit: int = 160) -> str:
    return str(x)[:limit]


def _effect(x: object) -> str:
    ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and abs(x) < 1e6
    return f"{x:+.1%}" if ok else "-"


def trial_line(status: dict[str, Any], elapsed_s: float) -> str:
    """One line of the running autopilot: its state, the trial's arm, pairs and running statistic."""
    t = status.get("trial")
    if not isinstance(t, dict):
        if status.get("paused") is True:
            return f"[{elapsed_s:4.0f}s] autopilot paused ({_text(status.get('state'), 32)})"
        why = _text(status.get("last_refusal") or "")
        return f"[{elapsed_s:4.0f}s] autopilot {_text(status.get('state'), 32)}" + (f": {why}" if why else "")
    iv = t.get("interval")
    lo, hi = iv if isinstance(iv, list) and len(iv) == 2 else (None, None)
    return (
        f"[{elapsed_s:4.0f}s] trial {_text(t.get('id'), 48)} {_text(t.get('changed'))}: "
        f"{_text(t.get('pairs'), 12)} pairs, arm now {'candidate' if t.get('arm_now') == 1 else 'current'}, "
        f"effect {_effect(t.get('estimate'))} [{_effect(lo)}, {_effect(hi)}] ({_text(t.get('verdict'), 32)})"
    )


def decision_lines(decision: dict[str, Any], trial: dict[str, Any] | None) -> list[str]:
    """The decision in words: the verdict, why, on how many block pairs, the measured effect."""
    changed = _obj(trial).get("changed")
    return [
        f"[+] autopilot decision on trial {_text(decision.get('trial_id'), 48)}"
        + (f" {_text(changed)}" if changed else "")
        + f": {_text(decision.get('decision'), 32)} ({_text(decision.get('reason'), 80)}) after "
        f"{_text(decision.get('pairs'), 12)} block pairs;",
        (
            f"    measured effect {_effect(decision.get('effect'))} kernel time per token (negative: the "
            f"candidate was faster); thresholds now version {_text(decision.get('result_version'), 24)}"
        ),
    ]


class TrialWatch:
    """Polls GET /autopilot for the traffic loop's live lines and keeps the last running trial seen
    (after the decision the status shows none: the report needs what it moved and its pairs)."""

    def __init__(self, sidecar_url: str, t0: float, echo: Callable[[str], Any]) -> None:
        self.url, self.t0, self.echo = sidecar_url, t0, echo
        self.trial: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any]:
        status = _obj(get_json(f"{self.url}/autopilot"))
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
    ``max_rounds``, then a pause rolls the trial back); one more round under the result for the
    regret after. The rounds' phase dicts and the report (trial, decision, regret before and after)."""
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
    report["thresholds_version"] = _obj(get_json(f"{sidecar_url}/thresholds")).get("version")
    echo(
        f"[+] regret before the trial {_pct(regret_before)}; with the autopilot's result in force "
        f"(this round only) {_pct(report['regret_after'])}"
    )
    return rounds, report
