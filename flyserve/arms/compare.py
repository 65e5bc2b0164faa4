"""`flyserve arms compare`: is a routing change an accuracy change?

The seed A/B (vLLM pull request 53335) ran gsm8k once per arm: 0.9469 on the baseline kernel,
0.9325 with the prefill kernel, stderr about 0.006. Token by token 80% of answers diverged
somewhere, but only 6% of those changed the final answer, at a median top-two logprob margin of
0.25 with a quarter of divergences at exactly 0: near-ties re-rolled, not worse reasoning. One run
per arm cannot say whether 1.4 points is the kernel or the noise. This tool sends the same
deterministic requests to both arms K times, so each arm's run-to-run divergence (the noise floor)
is measured next to the cross-arm divergence, and tests both differences by a paired bootstrap.

Modules: prompts (the JSONL input), client (HTTP, retries), results (the resumable
raw file), align (token alignment, margins), extract (final answers), stats (figures,
tests), report (table, JSON, plot). This one runs them in order; cli registers the command.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flyserve.arms.client import (
    ArmServerError,
    RequestSpec,
    RetryPolicy,
    SleepFn,
    build_request,
    discover_model,
    parse_response,
    post_with_retries,
)
from flyserve.arms.extract import Extractor
from flyserve.arms.prompts import PromptItem, prompts_fingerprint
from flyserve.arms.results import ResultsFile
from flyserve.arms.stats import ARMS, BOOTSTRAP_SEED, analyze

__all__ = [
    "ArmServerError",
    "CompareSettings",
    "check_base_url",
    "collect",
    "compare",
    "report_from_results",
]

#: A progress callback: (arm, number of responses now recorded for that arm).
ProgressFn = Callable[[str, int], None]


class ArmsInputError(ValueError):
    """Bad flags or files; the message names the flag, field or line."""


def check_base_url(url: str, flag: str) -> str:
    """An http(s) base URL ending in /v1 (what `vllm serve` exposes); returned without a trailing slash."""
    u = url.rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ArmsInputError(f"{flag}: {url!r} is not an http:// or https:// URL")
    if not u.endswith("/v1"):
        raise ArmsInputError(
            f"{flag}: {url!r} must be the API base ending in /v1, e.g. http://127.0.0.1:8000/v1"
        )
    return u


@dataclass(frozen=True)
class CompareSettings:
    a: str
    b: str
    runs: int = 2
    concurrency: int = 8
    model: str | None = None
    spec: RequestSpec = field(default_factory=lambda: RequestSpec(max_tokens=256, top_logprobs=5, seed=0))
    timeout: float = 300.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    resamples: int = 10000
    bootstrap_seed: int = BOOTSTRAP_SEED

    def url(self, arm: str) -> str:
        return self.a if arm == "a" else self.b


def check_answers(items: Sequence[PromptItem], extractor: Extractor) -> None:
    """An answer key the extractor cannot read would silently count every response wrong."""
    bad = [
        (it.line, f"answer {it.answer!r} gives no {extractor.name} answer")
        for it in items
        if it.answer is not None and extractor.normalize_answer(it.answer) is None
    ]
    if bad:
        raise ArmsInputError(
            "answer keys unusable:\n" + "\n".join(f"  line {ln}: {why}" for ln, why in bad[:20])
        )


async def collect(
    items: Sequence[PromptItem],
    results: ResultsFile,
    settings: CompareSettings,
    models: dict[str, str],
    clients: dict[str, httpx.AsyncClient],
    *,
    sleep: SleepFn = asyncio.sleep,
    progress: ProgressFn | None = None,
    on_retry: Callable[[str], None] | None = None,
) -> int:
    """Fill the results file: every (arm, run, prompt) not yet recorded. Returns the number sent.

    Runs go one after another; within a run both arms are served at once, each with at most
    `concurrency` requests in flight, so the two arms see the same load (batching changes numerics).
    The first non-transient failure cancels what is in flight and raises ArmServerError; everything
    received before it is already in the file.
    """
    sems = {arm: asyncio.Semaphore(settings.concurrency) for arm in ARMS}
    done = {
        arm: sum(1 for (a, r, p) in results.records if a == arm and r < settings.runs and p < len(items))
        for arm in ARMS
    }
    rng = random.Random(0)  # jitter only; the requests themselves carry the fixed seed
    sent = 0

    async def one(arm: str, run: int, item: PromptItem) -> None:
        nonlocal sent
        path, body = build_request(item, models[arm], settings.spec)
        async with sems[arm]:
            t0 = time.perf_counter()
            data = await post_with_retries(
                clients[arm],
                settings.url(arm) + path,
                body,
                arm=arm,
                policy=settings.retry,
                rng=rng,
                sleep=sleep,
                on_retry=on_retry,
            )
            elapsed = time.perf_counter() - t0
        parsed = parse_response(item, data, arm)
        results.append(
            {
                "arm": arm,
                "run": run,
                "prompt": item.index,
                "prompt_id": item.id,
                **parsed,
                "elapsed_s": round(elapsed, 4),
            }
        )
        sent += 1
        done[arm] += 1
        if progress:
            progress(arm, done[arm])

    for run in range(settings.runs):
        todo = [(arm, it) for arm in ARMS for it in items if not results.has(arm, run, it.index)]
        if not todo:
            continue
        try:
            async with asyncio.TaskGroup() as tg:
                for arm, it in todo:
                    tg.create_task(one(arm, run, it))
        except* ArmServerError as group:
            raise group.exceptions[0] from None
    return sent


def report_from_results(
    items: Sequence[PromptItem], results: ResultsFile, settings: CompareSettings, extractor: Extractor
) -> dict[str, Any]:
    """Recompute every figure from the raw records (never from in-memory state of the run)."""
    responses = {
        key: resp for key, resp in results.records.items() if key[1] < settings.runs and key[2] < len(items)
    }
    report = analyze(
        items, responses, settings.runs, extractor, resamples=settings.resamples, seed=settings.bootstrap_seed
    )
    report["arms"] = {
        arm: {"url": settings.url(arm), "model": results.header.get(f"model_{arm}")} for arm in ARMS
    }
    report["request"] = {
        "temperature": 0,
        "seed": settings.spec.seed,
        "max_tokens": settings.spec.max_tokens,
        "top_logprobs": settings.spec.top_logprobs,
    }
    report["results_file"] = str(results.path)
    return report


async def compare(
    items: Sequence[PromptItem],
    results_path: Path,
    settings: CompareSettings,
    extractor: Extractor,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    sleep: SleepFn = asyncio.sleep,
    progress_factory: Callable[[dict[str, int]], ProgressFn] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Discover models, open/resume the results file, collect what is missing, and report."""
    note = on_note or (lambda _msg: None)
    limits = httpx.Limits(
        max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency
    )
    timeout = httpx.Timeout(settings.timeout, connect=min(10.0, settings.timeout))
    clients = {arm: httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) for arm in ARMS}
    try:
        models: dict[str, str] = {}
        for arm in ARMS:
            if settings.model:
                models[arm] = settings.model
            else:
                models[arm] = await discover_model(
                    clients[arm],
                    settings.url(arm),
                    arm=arm,
                    policy=settings.retry,
                    rng=random.Random(0),
                    sleep=sleep,
                )
        header = {
            "prompts_sha256": prompts_fingerprint(tuple(items)),
            "prompts": len(items),
            "model_a": models["a"],
            "model_b": models["b"],
            "max_tokens": settings.spec.max_tokens,
            "top_logprobs": settings.spec.top_logprobs,
            "seed": settings.spec.seed,
            "a": settings.a,
            "b": settings.b,
        }
        results = ResultsFile.open(results_path, header)
        for msg in results.notes:
            note(msg)
        already = len([k for k in results.records if k[1] < settings.runs and k[2] < len(items)])
        if already:
            note(
                f"resuming: {already} of {2 * settings.runs * len(items)} responses already in {results_path}"
            )
        totals = {arm: settings.runs * len(items) for arm in ARMS}
        progress = progress_factory(totals) if progress_factory else None
        await collect(
            items, results, settings, models, clients, sleep=sleep, progress=progress, on_retry=note
        )
    finally:
        for c in clients.values():
            await c.aclose()
    return report_from_results(items, results, settings, extractor)
