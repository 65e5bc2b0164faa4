"""Replay and history: every decision of a run recomputed from the audit log alone.

What must hold: the records a run writes (through the store's own audit writer) replay to the same
decisions, every one; a tampered record (a pair, a statistic, a verdict, a guardrail's figure,
a dropped chunk) is flagged even when the attacker recomputes the digests; a bad record (NaN,
Infinity, a 5000-digit number, a huge list, a wrong type, an unknown or missing key) is named by
line and field, never a crash; `flyserve autopilot replay` exits 1 on either.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from autopilot_rig import Run, block, config
from typer.testing import CliRunner

from flyserve.autopilot import audit_records as rec
from flyserve.autopilot import controller as ap
from flyserve.autopilot.actions import AwaitApproval, Promote, Rollback
from flyserve.autopilot.cli import autopilot_app
from flyserve.autopilot.inputs import Mode
from flyserve.autopilot.replay import replay
from flyserve.control.store import Store


def a_run() -> Run:
    """Five trials: promoted (auto), rolled back by the test, by a guardrail, promoted on approval
    (trial mode), ended by the kill switch; with the mode records between."""
    run = Run(config())
    run.set_mode(Mode.AUTO)
    spec = run.start()
    assert isinstance(run.run_blocks(spec, 0.20, random.Random(1))[0], Promote)
    run.now += run.cfg.cooldown_s
    spec = run.start()
    assert isinstance(run.run_blocks(spec, -0.10, random.Random(3))[0], Rollback)
    run.now += run.cfg.cooldown_s
    spec = run.start()
    run.run_blocks(spec, 0.0, random.Random(5), until=6)

    def slow_steps(s, b, now, pt):  # type: ignore[no-untyped-def]
        m = block(s, b, now, pt)
        return replace(m, step_s=0.030 * (2.0 if m.arm == 1 else 1.0))

    assert isinstance(run.run_blocks(spec, 0.0, random.Random(5), first=6, measure=slow_steps)[0], Rollback)
    run.set_mode(Mode.TRIAL)
    run.now += run.cfg.cooldown_s
    spec = run.start()
    assert isinstance(run.run_blocks(spec, 0.20, random.Random(2))[0], AwaitApproval)
    assert isinstance(run.apply(ap.approve(run.cfg, run.state, spec.trial_id, run.now, "alice")), Promote)
    run.now += run.cfg.cooldown_s
    spec = run.start()
    run.run_blocks(spec, 0.0, random.Random(6), until=8)
    assert isinstance(run.apply(ap.kill(run.cfg, run.state, run.now)), Rollback)
    return run


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return a_run().records


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An initialised state directory (as a sidecar leaves it): the commands refuse any other."""
    monkeypatch.delenv("FLYSERVE_AUDIT_DIR", raising=False)
    (tmp_path / "control").mkdir()
    return tmp_path


def write(state_dir: Path, records: list[dict[str, Any]]) -> None:
    """Through the store's writer: the lines the sidecar will append, an operator's change among them."""
    store = Store(state_dir)
    store.audit(
        {"id": "c1", "time": 1.0, "actor": "alice", "source": "api", "result": "applied", "version": 3}
    )
    for r in records:
        assert store.audit(r)


def lines_of(records: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(r, sort_keys=True) for r in records]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(autopilot_app, list(args))


# ---------------------------------------------------------------------- agreement


def test_replay_agrees_with_every_decision_of_a_run(records, state_dir):
    write(state_dir, records)
    result = invoke("replay", "--state-dir", str(state_dir))
    assert result.exit_code == 0, result.output
    assert "5 decisions replayed, 0 bad records: all agree" in result.output
    doc = json.loads(invoke("replay", "--state-dir", str(state_dir), "--json").output)
    assert doc["ok"] is True
    got = [
        (t["decision"]["verdict"], t["decision"]["source"], t["decision"]["action"]) for t in doc["trials"]
    ]
    assert got == [
        ("promote", "test", "promote"),
        ("rollback", "test", "rollback"),
        ("rollback", "guardrail", "rollback"),
        ("promote", "test", "await-approval"),
        ("rollback", "operator", "rollback"),
    ]
    assert all(t["agrees"] is True for t in doc["trials"])
    assert doc["trials"][3]["approval"] == {"action": "promote", "actor": "alice"}


def test_history_lists_every_trial_and_mode_change(records, state_dir):
    write(state_dir, records)
    result = invoke("history", "--state-dir", str(state_dir))
    assert result.exit_code == 0, result.output
    out = result.output
    for n in range(1, 6):
        assert f"ap-3-{n}: over v3" in out
    assert "min_seq_len 1536->2048" in out and "approval: promote by alice" in out
    assert "mode (set): off -> auto" in out and "mode (kill): trial -> off" in out
    doc = json.loads(invoke("history", "--state-dir", str(state_dir), "--json").output)
    assert [t["trial"] for t in doc["trials"]] == [f"ap-3-{n}" for n in range(1, 6)]
    assert doc["trials"][2]["decision"]["guardrail"]["name"] == rec.STEP_TIME


def test_no_audit_log_is_no_record(state_dir):
    result = invoke("history", "--state-dir", str(state_dir))
    assert result.exit_code == 0 and "no autopilot records" in result.output
    assert invoke("replay", "--state-dir", str(state_dir)).exit_code == 0


@pytest.mark.parametrize("command", ["history", "replay"])
def test_a_missing_or_uninitialised_state_dir_is_refused_by_name(command, tmp_path):
    """A typo'd path used to read as an empty log: "0 decisions replayed ... all agree", exit 0."""
    missing = tmp_path / "typo"
    result = invoke(command, "--state-dir", str(missing))
    assert result.exit_code == 2 and str(missing) in result.output and "does not exist" in result.output
    assert not missing.exists()
    bare = tmp_path / "bare"
    bare.mkdir()
    result = invoke(command, "--state-dir", str(bare))
    assert result.exit_code == 2 and "is not a flyserve state directory" in result.output


@pytest.mark.parametrize("command", ["history", "replay"])
def test_the_default_state_dir_is_named_when_used_implicitly(command, state_dir, monkeypatch):
    import flyserve.control.initialise as init_mod

    monkeypatch.delenv("FLYSERVE_STATE_DIR", raising=False)
    monkeypatch.setattr(init_mod, "default_state_dir", lambda: state_dir)
    result = invoke(command)
    assert result.exit_code == 0, result.output
    assert f"state directory: {state_dir} (the default" in result.output


def test_a_running_trial_is_neither_agreeing_nor_disagreeing(records):
    last_start = max(i for i, r in enumerate(records) if r["kind"] == rec.START)
    report = replay(lines_of(records[: last_start + 1]))
    assert report.ok and report.trials[-1].agrees is None


# ---------------------------------------------------------------------- tampering


def _index(records: list[dict[str, Any]], kind: str, trial: str) -> int:
    return next(i for i, r in enumerate(records) if r["kind"] == kind and r["trial"] == trial)


def _tampered(records: list[dict[str, Any]], i: int, **changes: Any) -> list[dict[str, Any]]:
    out = [dict(r) for r in records]
    out[i] = {**out[i], **changes}
    return out


def _problems(records: list[dict[str, Any]], trial: str) -> list[str]:
    report = replay(lines_of(records))
    assert not report.ok
    [t] = [t for t in report.trials if t.trial == trial]
    assert t.agrees is False
    return t.problems


def test_a_tampered_pair_is_flagged(records):
    i = _index(records, rec.PAIRS, "ap-3-2")
    pairs = [list(p) for p in records[i]["pairs"]]
    pairs[0][1] *= 0.5
    assert any("digest" in p for p in _problems(_tampered(records, i, pairs=pairs), "ap-3-2"))


def test_a_tampered_pair_with_recomputed_digests_still_disagrees(records):
    """The attacker recomputes the chunk's digest and every chain after it: the statistic the
    decision recorded no longer follows from the pairs."""
    out = [dict(r) for r in records]
    i = _index(out, rec.PAIRS, "ap-3-1")
    pairs = [(a, b * 1.5) for a, b in out[i]["pairs"]]
    chain = rec.ZERO_CHAIN
    for j, r in enumerate(out):
        if r["kind"] == rec.PAIRS and r["trial"] == "ap-3-1":
            ps = pairs if j == i else [tuple(p) for p in r["pairs"]]
            out[j] = rec.pairs_record(
                time=r["time"], trial="ap-3-1", first=r["first"], pairs=ps, previous_chain=chain
            )
            chain = out[j]["chain"]
        if r["kind"] == rec.DECISION and r["trial"] == "ap-3-1":
            out[j] = {**r, "chain": chain}
    problems = _problems(out, "ap-3-1")
    assert any(p.startswith("statistic.") or "the test decides" in p for p in problems)


def test_a_tampered_verdict_statistic_or_guardrail_is_flagged(records):
    d1 = _index(records, rec.DECISION, "ap-3-1")
    assert _problems(_tampered(records, d1, verdict="rollback", action="rollback"), "ap-3-1")
    stat = {**records[d1]["statistic"], "estimate": -0.5}
    assert any("statistic.estimate" in p for p in _problems(_tampered(records, d1, statistic=stat), "ap-3-1"))
    d3 = _index(records, rec.DECISION, "ap-3-3")
    g = {**records[d3]["guardrail"], "value": 1.2}
    assert any("does not breach" in p for p in _problems(_tampered(records, d3, guardrail=g), "ap-3-3"))
    d2 = _index(records, rec.DECISION, "ap-3-2")
    assert _problems(_tampered(records, d2, source="operator", reason="paused"), "ap-3-2")


def test_a_dropped_pair_summary_is_flagged(records):
    i = _index(records, rec.PAIRS, "ap-3-1")
    problems = _problems(records[:i] + records[i + 1 :], "ap-3-1")
    assert any("missing or repeated" in p or "chain" in p for p in problems)


def test_the_command_exits_1_on_a_tampered_record(records, state_dir):
    d1 = _index(records, rec.DECISION, "ap-3-1")
    write(state_dir, _tampered(records, d1, reason="worse"))
    result = invoke("replay", "--state-dir", str(state_dir))
    assert result.exit_code == 1
    assert "DISAGREES: ap-3-1" in result.output and "NOT all agree" in result.output


# ---------------------------------------------------------------------- bad records, by name

BIG = "9" * 5000


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda t: t.replace('"time": ', '"time": NaN, "x": ', 1), "<line>"),
        (lambda t: t.replace('"time": ', '"time": Infinity, "x": ', 1), "<line>"),
        (lambda t: t.replace('"blocks": 600', f'"blocks": {BIG}', 1), "<line>"),
        (lambda t: t.replace('"blocks": 600', '"blocks": 1e400', 1), "<line>"),
        (lambda t: t.replace('"blocks": 600', '"blocks": 600.0', 1), "blocks"),
        (lambda t: t.replace('"blocks": 600', '"blocks": true', 1), "blocks"),
        (lambda t: t.replace('"seed": ', '"seed": -', 1), "seed"),
        (lambda t: t.replace('"schema": 1', '"schema": 2', 1), "schema"),
        (lambda t: t.replace('"mode": "auto"', '"mode": "yolo"', 1), "mode"),
        (lambda t: t.replace('"trial": "ap-3-1"', '"trial": "../../etc"', 1), "trial"),
        (lambda t: t.replace('"trial": "ap-3-1"', '"trial": ["ap-3-1"]', 1), "trial"),
        (lambda t: t.replace('"changes": {', '"changes": {"nope": [1, 2], ', 1), "changes.nope"),
        (
            lambda t: t.replace(
                '"changes": {', '"changes": {"block_m": [' + ",".join(["1"] * 5000) + "], ", 1
            ),
            "changes.block_m",
        ),
        (lambda t: t.replace('"confidence": 0.95', '"confidence": 7', 1), "test.confidence"),
        (lambda t: t.replace('"confidence": 0.95', '"confidence": "high"', 1), "test.confidence"),
        (
            lambda t: t.replace('"p99_ratio_limit": 1.5', '"p99_ratio_limit": null', 1),
            "guard.p99_ratio_limit",
        ),
        (lambda t: t.replace('"seed": ', '"extra": 1, "seed": ', 1), "extra"),
        (lambda t: t.replace('"regret": ', '"x_regret": ', 1), "x_regret"),
        (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "regret"}), "regret"),
        (lambda t: t.replace("{", '{"truncated": true, ', 1), "truncated"),
    ],
)
def test_a_bad_start_record_is_named_never_a_crash(records, edit, field):
    text = edit(json.dumps(records[1], sort_keys=True))
    report = replay([text, *lines_of(records[2:])])
    assert not report.ok
    assert [(b.line, b.field) for b in report.bad] == [(1, field)]
    # The trial's later records have no start to belong to: named as such, not trusted.
    [t] = [t for t in report.trials if t.trial == "ap-3-1"]
    assert t.agrees is False


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"pairs": [[1e-6, 1e-6]] * (rec.PAIRS_PER_RECORD + 1)}, "pairs"),
        ({"pairs": [[1e-6, -1.0]]}, "pairs.0.1"),
        ({"pairs": [[1e-6, "1e-6"]]}, "pairs.0.1"),
        ({"pairs": [[1e-6]]}, "pairs.0"),
        ({"pairs": "[]"}, "pairs"),
        ({"digest": "A" * 64}, "digest"),
        ({"first": -1}, "first"),
        ({"first": 2**70}, "first"),
    ],
)
def test_a_bad_pair_summary_is_named(records, changes, field):
    i = _index(records, rec.PAIRS, "ap-3-1")
    report = replay(lines_of(_tampered(records, i, **changes)))
    assert [b.field for b in report.bad] == [field] and not report.ok


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"verdict": "maybe"}, "verdict"),
        ({"reason": "x" * 1000}, "reason"),
        ({"reason": "\x1b[31mred"}, "reason"),
        ({"statistic": {"pairs": 1}}, "statistic.estimate"),
        ({"statistic": [1, 2]}, "statistic"),
        ({"guardrail": {"name": "vibes", "value": 1, "limit": 0}}, "guardrail.name"),
        ({"result_version": 1.5}, "result_version"),
        ({"chain": None}, "chain"),
    ],
)
def test_a_bad_decision_record_is_named(records, changes, field):
    i = _index(records, rec.DECISION, "ap-3-1")
    report = replay(lines_of(_tampered(records, i, **changes)))
    assert [b.field for b in report.bad] == [field] and not report.ok


def test_unreadable_lines_that_name_the_autopilot_are_bad_and_others_are_not_ours(records, state_dir):
    lines = [
        "not json at all",
        '{"kind": "autopilot.trial.start", "schema": 1',  # torn
        "[1, 2, 3]",
        '{"kind": 5, "note": "autopilot.x"}',
        "{" * 100_000,
        *lines_of(records),
    ]
    report = replay(lines)
    assert [(b.line, b.field) for b in report.bad] == [(2, "<line>"), (4, "kind")]
    assert all(t.agrees for t in report.trials)
    (state_dir / "audit.jsonl").write_text("\n".join(lines) + "\n")
    result = invoke("replay", "--state-dir", str(state_dir))
    assert result.exit_code == 1 and "bad record, line 2: field '<line>'" in result.output


def test_an_audit_log_that_is_not_a_regular_file_is_refused_by_name(state_dir):
    (state_dir / "elsewhere").write_text("")
    (state_dir / "audit.jsonl").symlink_to(state_dir / "elsewhere")
    result = invoke("replay", "--state-dir", str(state_dir))
    assert result.exit_code == 2 and "cannot read the audit log" in result.output
