"""The HTTP side of `flyserve arms compare`: identical deterministic requests, retried with backoff.

Only transient failures are retried (a connect error, a timeout, a dropped connection, HTTP 408,
429 or 5xx): a 4xx means the request is wrong and would fail the same way every time, so it stops
the comparison at once with the server's message. Backoff doubles from `base_delay` up to
`max_delay` with +-25% jitter (several clients retrying in step would hit a recovering server
together); a 429's Retry-After, when given in seconds, is honoured if longer.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from flyserve.arms.prompts import PromptItem

TRANSIENT_STATUS = frozenset({408, 429})
_TRANSIENT_ERRORS = (httpx.TransportError,)  # connect/read/write errors, timeouts, protocol errors


class ArmServerError(RuntimeError):
    """An arm answered wrongly or kept failing; names the arm and the reason."""

    def __init__(self, arm: str, reason: str) -> None:
        self.arm = arm
        self.reason = reason
        super().__init__(f"arm {arm.upper()}: {reason}")


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.25

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Delay before retry number `attempt` (0-based): base * 2**attempt, capped, jittered."""
        d = min(self.max_delay, self.base_delay * (2**attempt))
        return d * (1 + self.jitter * (2 * rng.random() - 1)) if self.jitter else d


@dataclass(frozen=True)
class RequestSpec:
    """What every request carries besides the prompt: identical for both arms and every run."""

    max_tokens: int
    top_logprobs: int
    seed: int


def build_request(item: PromptItem, model: str, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
    """(path below /v1, JSON body). Temperature 0 and a fixed seed: the same request every time."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "seed": spec.seed,
        "n": 1,
        "stream": False,
    }
    if item.stop:
        body["stop"] = list(item.stop)
    if item.prompt is not None:
        body["prompt"] = item.prompt
        body["logprobs"] = spec.top_logprobs
        return "/completions", body
    body["messages"] = [dict(m) for m in item.messages or ()]
    body["logprobs"] = True
    body["top_logprobs"] = spec.top_logprobs
    return "/chat/completions", body


def parse_response(item: PromptItem, data: Any, arm: str) -> dict[str, Any]:
    """Extract text, tokens and top alternatives; ArmServerError naming the missing field otherwise."""

    def bad(why: str) -> ArmServerError:
        return ArmServerError(arm, f"prompt {item.id} (line {item.line}): unexpected response: {why}")

    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise bad("no choices[0]") from None
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise bad("choices[0].logprobs missing (does the server support logprobs?)")
    tokens: list[str] = []
    tops: list[list[list[Any]]] = []
    if item.prompt is not None:
        text = choice.get("text")
        toks, top = lp.get("tokens"), lp.get("top_logprobs")
        if not isinstance(text, str) or not isinstance(toks, list) or not isinstance(top, list):
            raise bad("completions choice needs text, logprobs.tokens and logprobs.top_logprobs")
        if len(toks) != len(top):
            raise bad(f"{len(toks)} tokens but {len(top)} top_logprobs entries")
        for t, alts in zip(toks, top, strict=True):
            tokens.append(str(t))
            tops.append([[str(k), float(v)] for k, v in (alts or {}).items()])
    else:
        text = (choice.get("message") or {}).get("content")
        content = lp.get("content")
        if not isinstance(text, str) or not isinstance(content, list):
            raise bad("chat choice needs message.content and logprobs.content")
        for entry in content:
            try:
                tokens.append(str(entry["token"]))
                tops.append([[str(a["token"]), float(a["logprob"])] for a in entry.get("top_logprobs") or []])
            except (KeyError, TypeError, ValueError):
                raise bad("logprobs.content entries need token and top_logprobs[{token, logprob}]") from None
    return {
        "text": text,
        "tokens": tokens,
        "top_logprobs": tops,
        "finish_reason": choice.get("finish_reason"),
        "usage": data.get("usage"),
    }


SleepFn = Callable[[float], Awaitable[None]]


async def post_with_retries(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    arm: str,
    policy: RetryPolicy,
    rng: random.Random,
    sleep: SleepFn = asyncio.sleep,
    on_retry: Callable[[str], None] | None = None,
) -> Any:
    """POST, retrying transient failures; return the decoded JSON body."""
    last = ""
    for attempt in range(policy.retries + 1):
        retry_after = 0.0
        try:
            resp = await client.post(url, json=body)
        except _TRANSIENT_ERRORS as exc:
            last = f"{type(exc).__name__}: {exc}".rstrip(": ")
        else:
            if resp.status_code < 400:
                try:
                    return resp.json()
                except ValueError:
                    raise ArmServerError(
                        arm, f"{url} answered {resp.status_code} with a body that is not JSON"
                    ) from None
            detail = resp.text[:300].strip()
            if resp.status_code not in TRANSIENT_STATUS and resp.status_code < 500:
                raise ArmServerError(arm, f"{url} answered HTTP {resp.status_code} (not retried): {detail}")
            last = f"HTTP {resp.status_code}: {detail}"
            try:
                retry_after = float(resp.headers.get("retry-after", 0))
            except ValueError:
                retry_after = 0.0
        if attempt == policy.retries:
            break
        delay = max(policy.delay(attempt, rng), min(retry_after, policy.max_delay))
        if on_retry:
            on_retry(f"arm {arm.upper()}: {last}; retry {attempt + 1}/{policy.retries} in {delay:.2f}s")
        await sleep(delay)
    raise ArmServerError(arm, f"{url} failed {policy.retries + 1} times; last: {last}")


async def discover_model(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    arm: str,
    policy: RetryPolicy,
    rng: random.Random,
    sleep: SleepFn,
) -> str:
    """The first model id of GET {base}/models (what `vllm serve` serves)."""
    url = f"{base_url}/models"
    last = ""
    for attempt in range(policy.retries + 1):
        try:
            resp = await client.get(url)
            if resp.status_code == 200:
                ids = [m["id"] for m in resp.json().get("data", []) if isinstance(m, dict) and "id" in m]
                if not ids:
                    raise ArmServerError(arm, f"{url} lists no models; pass --model")
                return str(ids[0])
            if resp.status_code not in TRANSIENT_STATUS and resp.status_code < 500:
                raise ArmServerError(arm, f"{url} answered HTTP {resp.status_code}; pass --model")
            last = f"HTTP {resp.status_code}"
        except _TRANSIENT_ERRORS as exc:
            last = f"{type(exc).__name__}: {exc}".rstrip(": ")
        except ValueError:
            raise ArmServerError(arm, f"{url} did not answer JSON; pass --model") from None
        if attempt < policy.retries:
            await sleep(policy.delay(attempt, rng))
    raise ArmServerError(arm, f"{url} failed {policy.retries + 1} times; last: {last}")
