"""Replay: every autopilot decision recomputed from the audit log alone, and the trials' history.

For each trial the start record gives the test's settings and the guardrails' limits; its
pair-summary records give every pair, each chunk with its sha256 and a chain digest over all of
them (a dropped, reordered or edited chunk breaks the chain). The decision is then recomputed:

* decided by the test: feeding the pairs to ``sequential.decide`` one by one must give its first
  final decision at the last pair, with the recorded verdict, reason and statistic (or, "plan
  ended", no final decision and the whole plan's blocks seen; "runner lagged", no final decision
  and fewer blocks seen than the plan has);
* decided by a guardrail: the test must not have decided before the last pair, and the recorded
  figure must breach the recorded limit (p99 and samples-stopped limits: the start's settings);
* ended by the operator (pause, kill switch, mode, freeze, an operator change): the test must not
  have decided before.

Pure: ``replay(lines)`` takes the log's lines; reading them is flyserve.autopilot.audit_log's job.
A line that is not JSON but names an autopilot kind, or an autopilot record the parser refuses, is
a bad record, named by its line and field; other lines (the operators' changes) are not ours.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from flyserve.autopilot import audit_parse as parsed
from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import controller
from flyserve.autopilot.sequential import Decision, SequentialState, decide
from flyserve.files.safe_read import loads_record

OPERATOR_REASONS = frozenset(
    (
        controller.PAUSED,
        controller.KILLED,
        controller.MODE_CHANGED,
        controller.FROZEN,
        controller.OPERATOR_CHANGE,
    )
)


@dataclass(frozen=True)
class BadRecord:
    line: int
    field: str
    reason: str


@dataclass
class TrialReplay:
    """One trial as the audit tells it, and whether its decision recomputes."""

    trial: str
    start: parsed.StartRecord | None = None
    start_line: int = 0
    pairs: list[tuple[float, float]] = field(default_factory=list)
    chain: str = rec.ZERO_CHAIN
    decision: parsed.DecisionRecord | None = None
    approval: parsed.ApprovalRecord | None = None
    problems: list[str] = field(default_factory=list)
    recomputed: Decision | None = None

    @property
    def agrees(self) -> bool | None:
        """True: the decision recomputes; False: it does not, or the trial's records are
        inconsistent; None: no decision yet and nothing wrong."""
        if self.problems:
            return False
        return None if self.decision is None else True


@dataclass
class ReplayReport:
    trials: list[TrialReplay]
    bad: list[BadRecord]
    modes: list[tuple[int, parsed.ModeRecord]]

    @property
    def ok(self) -> bool:
        return not self.bad and all(t.agrees is not False for t in self.trials)


def read_records(lines: Iterable[str]) -> tuple[list[tuple[int, parsed.AuditRecord]], list[BadRecord]]:
    """The autopilot's records among the log's lines (numbered from 1, oldest first), and the bad ones."""
    good: list[tuple[int, parsed.AuditRecord]] = []
    bad: list[BadRecord] = []
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            obj = loads_record(text)
        except (ValueError, RecursionError) as exc:
            if rec.PREFIX in text:
                bad.append(BadRecord(n, "<line>", f"not readable JSON ({str(exc)[:80]})"))
            continue
        if not isinstance(obj, dict):
            continue
        kind = obj.get("kind")
        ours = isinstance(kind, str) and kind.startswith(rec.PREFIX)
        if not ours and not (kind is not None and rec.PREFIX in text):
            continue  # an operator's change or another writer's line
        try:
            good.append((n, parsed.parse_record(obj)))
        except rec.AuditRecordError as exc:
            bad.append(BadRecord(n, exc.field, exc.reason))
    return good, bad


def _same(recorded: float | None, computed: float) -> bool:
    if recorded is None:
        return not math.isfinite(computed)
    return math.isfinite(computed) and math.isclose(recorded, computed, rel_tol=1e-12, abs_tol=1e-15)


def _check_statistic(t: TrialReplay, d: parsed.DecisionRecord, computed: Decision) -> None:
    s = d.statistic
    if s.pairs != computed.pairs:
        t.problems.append(f"statistic: {s.pairs} pairs recorded, {computed.pairs} in the pair-summaries")
    for name, got, want in (
        ("estimate", s.estimate, computed.estimate),
        ("lower", s.lower, computed.lower),
        ("upper", s.upper, computed.upper),
    ):
        if not _same(got, want):
            t.problems.append(f"statistic.{name}: recorded {got!r}, recomputed {want!r}")


def _recheck(t: TrialReplay) -> None:
    """Recompute the trial's decision from its start and pairs; note every disagreement."""
    d, s = t.decision, t.start
    assert d is not None and s is not None
    if d.chain != t.chain:
        t.problems.append("decision: its chain digest does not match the pair-summaries")
    state = SequentialState()
    computed = decide(s.test, state)
    first_final: int | None = None
    try:
        for i, (cur, cand) in enumerate(t.pairs, 1):
            state = state.update(s.test, cur, cand)
            computed = decide(s.test, state)
            if computed.final and first_final is None:
                first_final = i
    except ValueError as exc:
        t.problems.append(f"pairs: {exc}")
        return
    t.recomputed = computed
    _check_statistic(t, d, computed)
    n = len(t.pairs)
    final_before_last = first_final is not None and first_final < n
    if d.source == rec.BY_TEST and d.reason == controller.PLAN_ENDED:
        if first_final is not None:
            t.problems.append(f"plan ended: the test had decided at pair {first_final}")
        if d.blocks < s.blocks:
            t.problems.append(f"plan ended: {d.blocks} blocks seen of {s.blocks}")
        if d.verdict != "inconclusive":
            t.problems.append(f"plan ended: verdict {d.verdict}, not inconclusive")
    elif d.source == rec.BY_TEST and d.reason == controller.RUNNER_LAGGED:
        if first_final is not None:
            t.problems.append(f"runner lagged: the test had decided at pair {first_final}")
        if d.blocks >= s.blocks:
            t.problems.append(f"runner lagged: all {s.blocks} blocks seen")
        if d.verdict != "inconclusive":
            t.problems.append(f"runner lagged: verdict {d.verdict}, not inconclusive")
    elif d.source == rec.BY_TEST:
        if first_final != n or n == 0:
            where = "never" if first_final is None else f"at pair {first_final}"
            t.problems.append(f"the test decides {where}, the record says at pair {n}")
        elif (d.verdict, d.reason) != (computed.verdict.value, computed.reason):
            t.problems.append(
                f"verdict: recorded {d.verdict} ({d.reason}), recomputed {computed.verdict.value} "
                f"({computed.reason})"
            )
    else:
        # A guardrail is checked before the test on the same block; the operator acts between blocks,
        # so a test that had decided (at any pair) would have ended the trial first.
        if final_before_last or (d.source == rec.BY_OPERATOR and first_final is not None):
            t.problems.append(f"the test had decided at pair {first_final}, before the {d.source}")
        if d.verdict != "rollback":
            t.problems.append(f"a {d.source} decision must roll back, recorded {d.verdict}")
        if d.source == rec.BY_GUARDRAIL:
            _recheck_guardrail(t, d, s)
        elif d.source == rec.BY_PUBLISH:
            if d.guardrail is not None or not d.reason.startswith(controller.START_NOT_PUBLISHED):
                t.problems.append(f"publish decision with reason {d.reason!r}")
            if d.blocks or t.pairs or d.result_version is not None:
                t.problems.append("a trial whose start was not published has no block, pair or version")
        elif d.guardrail is not None or d.reason not in OPERATOR_REASONS:
            t.problems.append(f"operator decision with reason {d.reason!r}")
    promote = d.verdict == "promote"
    if promote != (d.action in ("promote", "await-approval")):
        t.problems.append(f"action {d.action} does not follow verdict {d.verdict}")


def _recheck_guardrail(t: TrialReplay, d: parsed.DecisionRecord, s: parsed.StartRecord) -> None:
    g = d.guardrail
    if g is None or g.name != d.reason:
        t.problems.append("guardrail decision without its guardrail's figure")
        return
    if not g.breached:
        t.problems.append(f"{g.name}: figure {g.value:g} does not breach limit {g.limit:g}")
    allowed = {
        rec.P99: (s.guard["p99_ratio_limit"],),
        rec.STEP_TIME: (s.guard["p99_ratio_limit"],),
        rec.SAMPLES_STOPPED: (s.guard["max_empty_blocks"], s.guard["block_timeout_s"]),
        rec.CIRCUIT_OPENED: (1.0,),
    }.get(g.name)
    if allowed is not None and g.limit not in allowed:
        t.problems.append(f"{g.name}: limit {g.limit:g} is not the trial's setting")
    if g.name == rec.FALLBACK_RATE and g.limit < s.guard["fallback_rate_excess"]:
        t.problems.append(f"{g.name}: limit below the trial's allowance")
    if g.name == rec.ERROR_RATE and g.limit < s.guard["error_rate_excess"]:
        t.problems.append(f"{g.name}: limit below the trial's allowance")


def replay(lines: Iterable[str]) -> ReplayReport:
    """Every trial of the log, its decision recomputed (see the module's docstring)."""
    records, bad = read_records(lines)
    trials: dict[str, TrialReplay] = {}
    modes: list[tuple[int, parsed.ModeRecord]] = []
    for n, r in records:
        if isinstance(r, parsed.ModeRecord):
            modes.append((n, r))
            continue
        t = trials.get(r.trial)
        if isinstance(r, parsed.StartRecord):
            if t is not None:
                t.problems.append(f"line {n}: a second start for this trial id")
                continue
            trials[r.trial] = TrialReplay(r.trial, start=r, start_line=n)
            continue
        if t is None:
            t = trials[r.trial] = TrialReplay(r.trial)
            t.problems.append(f"line {n}: records without a start")
            continue
        if t.start is None:
            continue
        if isinstance(r, parsed.PairsRecord):
            if t.decision is not None:
                t.problems.append(f"line {n}: pairs after the decision")
            elif r.first != len(t.pairs):
                t.problems.append(
                    f"line {n}: pairs from {r.first}, expected {len(t.pairs)} (missing or repeated)"
                )
            elif rec.pairs_digest(r.pairs) != r.digest:
                t.problems.append(f"line {n}: the pairs do not match their digest")
            elif rec.chain_digest(t.chain, r.digest) != r.chain:
                t.problems.append(f"line {n}: the chain digest does not follow the one before")
            else:
                t.pairs.extend(r.pairs)
                t.chain = r.chain
        elif isinstance(r, parsed.DecisionRecord):
            if t.decision is not None:
                t.problems.append(f"line {n}: a second decision")
                continue
            t.decision = r
            _recheck(t)
        elif isinstance(r, parsed.ApprovalRecord):
            if t.decision is None or t.decision.action != "await-approval" or t.approval is not None:
                t.problems.append(f"line {n}: an approval no decision awaited")
            else:
                t.approval = r
    _check_mode_records(trials.values(), modes)
    return ReplayReport(trials=list(trials.values()), bad=bad, modes=modes)


MODE_REASON_OF = {controller.PAUSED: "pause", controller.KILLED: "kill", controller.MODE_CHANGED: "set"}
"""The mode record an operator decision with this reason comes with (written at the same time)."""


def _check_mode_records(trials: Iterable[TrialReplay], modes: list[tuple[int, parsed.ModeRecord]]) -> None:
    seen = {(m.reason, m.time) for _, m in modes}
    for t in trials:
        d = t.decision
        if d is None or d.source != rec.BY_OPERATOR or d.reason not in MODE_REASON_OF:
            continue
        if (MODE_REASON_OF[d.reason], d.time) not in seen:
            t.problems.append(
                f"{d.reason}: no mode record ({MODE_REASON_OF[d.reason]}) at the decision's time"
            )
