"""flyserve arms: requests, retries with backoff, resumable results, against fake servers.

Retries use httpx.MockTransport (exact control of each failure); the whole comparison runs
against the fake OpenAI app in arms_fake_openai over httpx's ASGI transport (no sockets).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest
from arms_fake_openai import FakeState, make_app

from flyserve.arms.client import (
    ArmServerError,
    RequestSpec,
    RetryPolicy,
    build_request,
    parse_response,
    post_with_retries,
)
from flyserve.arms.compare import ArmsInputError, CompareSettings, check_answers, check_base_url, compare
from flyserve.arms.extract import NumberExtractor
from flyserve.arms.prompts import PromptFileError, PromptItem, parse_prompts
from flyserve.arms.results import ResultsFile, ResultsFileError

NO_JITTER = RetryPolicy(retries=4, base_delay=0.5, max_delay=30.0, jitter=0.0)


class Sleeps:
    """Records the backoff delays instead of sleeping."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, d: float) -> None:
        self.delays.append(d)


def run_post(handler, policy=NO_JITTER):
    sleeps = Sleeps()
    retried: list[str] = []

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await post_with_retries(
                client,
                "http://arm-a/v1/completions",
                {"x": 1},
                arm="a",
                policy=policy,
                rng=random.Random(0),
                sleep=sleeps,
                on_retry=retried.append,
            )

    return asyncio.run(go()), sleeps.delays, retried


def test_transient_errors_are_retried_with_exponential_backoff():
    # 503, a refused connection, 429, 502, then success: 4 retries, delays 0.5, 1, 2, 4.
    script = iter(["503", "connect", "429", "502", "ok"])
    attempts = []

    def handler(request: httpx.Request) -> httpx.Response:
        step = next(script)
        attempts.append(step)
        if step == "connect":
            raise httpx.ConnectError("refused", request=request)
        if step == "ok":
            return httpx.Response(200, json={"fine": True})
        return httpx.Response(int(step), text="busy")

    data, delays, retried = run_post(handler)
    assert data == {"fine": True}
    assert attempts == ["503", "connect", "429", "502", "ok"]
    assert delays == [0.5, 1.0, 2.0, 4.0]
    assert "HTTP 503" in retried[0] and "ConnectError" in retried[1] and "retry 4/4" in retried[3]


def test_backoff_is_capped_and_jittered_within_bounds():
    p = RetryPolicy(retries=10, base_delay=1.0, max_delay=5.0, jitter=0.25)
    rng = random.Random(1)
    delays = [p.delay(i, rng) for i in range(8)]
    for i, d in enumerate(delays):
        nominal = min(5.0, 2**i)
        assert 0.75 * nominal <= d <= 1.25 * nominal


def test_retry_after_is_honoured():
    script = iter([429, 200])

    def handler(request):
        code = next(script)
        if code == 429:
            return httpx.Response(429, headers={"retry-after": "3"}, text="slow down")
        return httpx.Response(200, json={})

    _, delays, _ = run_post(handler)
    assert delays == [3.0]


def test_client_errors_are_not_retried():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(400, text='{"error": "max_tokens too large"}')

    with pytest.raises(ArmServerError, match=r"arm A: .*HTTP 400 \(not retried\).*max_tokens too large"):
        run_post(handler)
    assert len(calls) == 1


def test_retries_run_out():
    def handler(request):
        raise httpx.ReadTimeout("slow", request=request)

    with pytest.raises(ArmServerError, match="failed 3 times; last: ReadTimeout"):
        run_post(handler, RetryPolicy(retries=2, jitter=0.0))


def test_requests_are_deterministic_and_carry_logprobs():
    spec = RequestSpec(max_tokens=16, top_logprobs=4, seed=11)
    path, body = build_request(PromptItem(0, 1, "0", prompt="Q", stop=("Question:",)), "m", spec)
    assert path == "/completions"
    assert body == {
        "model": "m",
        "max_tokens": 16,
        "temperature": 0,
        "seed": 11,
        "n": 1,
        "stream": False,
        "stop": ["Question:"],
        "prompt": "Q",
        "logprobs": 4,
    }
    path, body = build_request(PromptItem(0, 1, "0", messages=({"role": "user", "content": "Q"},)), "m", spec)
    assert path == "/chat/completions"
    assert body["logprobs"] is True and body["top_logprobs"] == 4 and body["temperature"] == 0
    assert body["messages"] == [{"role": "user", "content": "Q"}]


def test_parse_response_rejects_missing_logprobs():
    item = PromptItem(0, 3, "q", prompt="Q")
    with pytest.raises(ArmServerError, match=r"prompt q \(line 3\).*logprobs missing"):
        parse_response(item, {"choices": [{"text": "x", "logprobs": None}]}, "b")
    with pytest.raises(ArmServerError, match="no choices"):
        parse_response(item, {"choices": []}, "b")


def test_prompt_file_errors_name_every_bad_line():
    lines = [
        '{"prompt": "ok", "answer": 3}',
        "",
        "{not json",
        '{"prompt": "a", "messages": []}',
        '{"messages": [{"role": "user"}]}',
        '{"prompt": "b", "answer": [1]}',
        '{"prompt": "c", "id": 0}',
        "[1, 2]",
    ]
    text = "\n".join(lines)
    with pytest.raises(PromptFileError) as info:
        parse_prompts(text)
    lines = [ln for ln, _ in info.value.errors]
    assert lines == [3, 4, 5, 6, 7, 8]
    msg = str(info.value)
    assert "line 3: not valid JSON" in msg
    assert "line 5: `messages[0].content` must be a string" in msg
    assert "line 7: duplicate id '0' (first on line 1)" in msg
    items = parse_prompts(
        '{"prompt": "x", "answer": 3}\n\n{"messages": [{"role": "user", "content": "y"}]}\n'
    )
    assert [(i.index, i.line, i.api, i.answer) for i in items] == [
        (0, 1, "completions", "3"),
        (1, 3, "chat", None),
    ]
    with pytest.raises(PromptFileError, match="empty"):
        parse_prompts("\n\n")


def test_flags_are_checked():
    assert check_base_url("http://127.0.0.1:8000/v1/", "--a") == "http://127.0.0.1:8000/v1"
    with pytest.raises(ArmsInputError, match="--b: .* must be the API base ending in /v1"):
        check_base_url("http://127.0.0.1:8000", "--b")
    with pytest.raises(ArmsInputError, match="--a: .*not an http"):
        check_base_url("127.0.0.1:8000/v1", "--a")
    with pytest.raises(ArmsInputError, match="line 4: answer 'n/a' gives no number answer"):
        check_answers((PromptItem(0, 4, "x", prompt="p", answer="n/a"),), NumberExtractor())


# ------------------------------------------------------------------- the whole comparison, fake server

PROMPTS = [
    '{"prompt": "plain one", "answer": "9"}',  # len 9: both arms right
    '{"prompt": "flip this", "answer": "9"}',  # len 9: B says 10 -> wrong
    '{"prompt": "a tie here", "answer": "10"}',  # len 10: B says " was": diverges, answer unchanged
    '{"messages": [{"role": "user", "content": "chat plain"}], "answer": "10"}',
]


def settings(**kw) -> CompareSettings:
    base = {
        "a": "http://arm-a/v1",
        "b": "http://arm-b/v1",
        "runs": 2,
        "concurrency": 2,
        "spec": RequestSpec(max_tokens=8, top_logprobs=2, seed=0),
        "retry": RetryPolicy(retries=3, jitter=0.0),
        "resamples": 500,
    }
    base.update(kw)
    return CompareSettings(**base)


def run_compare(state: FakeState, results: Path, notes: list[str] | None = None, **kw):
    items = parse_prompts("\n".join(PROMPTS))
    transport = httpx.ASGITransport(app=make_app(state))
    return asyncio.run(
        compare(
            items,
            results,
            settings(**kw),
            NumberExtractor(),
            transport=transport,
            sleep=Sleeps(),
            on_note=(notes.append if notes is not None else None),
        )
    )


def expected_figures(report: dict) -> None:
    # 4 prompts x 2x2 cross pairs = 16. "flip" and "tie" diverge in all 4 pairs: 8/16.
    assert report["pairs_compared"] == 16
    assert report["diverged_share"] == 0.5
    assert report["answer_changed_share"] == 4 / 16  # only "flip"
    assert report["first_divergence_positions"] == [3] * 4 + [2] * 4
    assert report["divergence_margins"] == [1.0] * 4 + [0.0] * 4
    assert report["margin_zero_share"] == 0.5
    assert report["self_divergence_share"] == {"a": 0.0, "b": 0.0}
    assert report["accuracy"] == {"a": 1.0, "b": 0.75}
    assert report["arms"]["a"]["model"] == "tiny-a" and report["arms"]["b"]["model"] == "tiny-b"


def test_compare_end_to_end_on_the_fake_server(tmp_path):
    state = FakeState()
    report = run_compare(state, tmp_path / "r.jsonl")
    expected_figures(report)
    assert state.calls == {"a": 8, "b": 8}
    # Identical requests to both arms: same bodies apart from the discovered model name.
    a_bodies = sorted(
        json.dumps({**b, "arm": "", "model": ""}, sort_keys=True) for b in state.bodies if b["arm"] == "a"
    )
    b_bodies = sorted(
        json.dumps({**b, "arm": "", "model": ""}, sort_keys=True) for b in state.bodies if b["arm"] == "b"
    )
    assert a_bodies == b_bodies
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "header" and len(lines) == 1 + 16


def test_resume_after_a_server_failure(tmp_path):
    results = tmp_path / "r.jsonl"
    # Arm B answers 400 from its 6th call on: the comparison stops with what it has.
    broken = FakeState(fail=lambda arm, n: 400 if arm == "b" and n >= 6 else None)
    with pytest.raises(ArmServerError, match="arm B"):
        run_compare(broken, results, concurrency=1)
    recorded = len(results.read_text().splitlines()) - 1
    assert 5 <= recorded < 16
    healthy = FakeState()
    notes: list[str] = []
    report = run_compare(healthy, results, notes)
    # Only the missing (arm, run, prompt) were sent again.
    assert sum(healthy.calls.values()) == 16 - recorded
    assert any(f"resuming: {recorded} of 16" in n for n in notes)
    expected_figures(report)
    # A third run has nothing to send.
    again = FakeState()
    expected_figures(run_compare(again, results))
    assert again.calls == {"a": 0, "b": 0}


def test_transient_failures_are_retried_inside_a_comparison(tmp_path):
    state = FakeState(fail=lambda arm, n: 503 if n in (1, 2) else None)
    report = run_compare(state, tmp_path / "r.jsonl")
    expected_figures(report)
    assert state.calls == {"a": 10, "b": 10}  # 8 answers + 2 refused per arm


def test_truncated_last_line_is_reported_and_resent(tmp_path):
    results = tmp_path / "r.jsonl"
    run_compare(FakeState(), results)
    lines = results.read_text().splitlines(keepends=True)
    last = json.loads(lines[-1])
    results.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # a crash mid-write
    notes: list[str] = []
    state = FakeState()
    report = run_compare(state, results, notes)
    assert any("line 17 is truncated or corrupt" in n for n in notes)
    assert state.calls[last["arm"]] == 1 and sum(state.calls.values()) == 1
    expected_figures(report)
    assert all(json.loads(ln) for ln in results.read_text().splitlines())


def test_damage_before_the_last_line_is_an_error(tmp_path):
    results = tmp_path / "r.jsonl"
    run_compare(FakeState(), results)
    lines = results.read_text().splitlines(keepends=True)
    lines[3] = "garbage\n"
    results.write_text("".join(lines))
    with pytest.raises(ResultsFileError, match="line 4 is not a valid record"):
        run_compare(FakeState(), results)


def test_results_of_another_comparison_are_refused(tmp_path):
    results = tmp_path / "r.jsonl"
    run_compare(FakeState(), results)
    before = results.read_text()
    with pytest.raises(ResultsFileError, match="recorded max_tokens=8 but this comparison has max_tokens=4"):
        run_compare(FakeState(), results, spec=RequestSpec(max_tokens=4, top_logprobs=2, seed=0))
    assert results.read_text() == before  # nothing half-changed


def test_more_runs_extend_the_file(tmp_path):
    results = tmp_path / "r.jsonl"
    run_compare(FakeState(), results, runs=1)
    state = FakeState()
    report = run_compare(state, results, runs=3)
    assert state.calls == {"a": 8, "b": 8}  # runs 1 and 2 only
    assert report["runs"] == 3 and report["pairs_compared"] == 4 * 9


def test_header_only_file_resumes(tmp_path):
    results = tmp_path / "r.jsonl"
    items = parse_prompts("\n".join(PROMPTS))
    rf = ResultsFile.open(results, {"prompts_sha256": "x"})
    assert rf.records == {} and len(items) == 4
    assert results.read_text().count("\n") == 1


def test_the_shipped_example_is_valid():
    from flyserve.arms.prompts import load_prompts

    items = load_prompts(Path(__file__).resolve().parents[2] / "examples" / "gsm8k_sample.jsonl")
    keys = [NumberExtractor().normalize_answer(i.answer) for i in items]
    assert keys == ["48", "6", "150", "40", "115", "30", "400", "46", "81"]
    assert {i.api for i in items} == {"completions", "chat"}
