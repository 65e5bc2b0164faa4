"""A tiny OpenAI-compatible fake server for the arms tests (completions and chat, with logprobs).

Deterministic answers, so the expected figures are known:
- every response is [" The", " answer", " is", " N"] with N = len(prompt text);
- arm B says " N+1" instead when the prompt contains "flip" (the final answer changes);
- arm B says " was" instead of " is" when the prompt contains "tie" (a divergence at position 2 at
  a margin of exactly 0 in both arms' distributions; the answer is unchanged).
The arm is taken from the Host header ("arm-a"/"arm-b") or fixed per app. `fail` injects errors:
fail(arm, call_number) -> an HTTP status to answer instead, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

MARGIN = 1.0


def answer_tokens(text: str, arm: str) -> tuple[list[str], list[list[tuple[str, float]]]]:
    n = len(text)
    last = f" {n + 1}" if arm == "b" and "flip" in text else f" {n}"
    third = " was" if arm == "b" and "tie" in text else " is"
    tokens = [" The", " answer", third, last]
    tops: list[list[tuple[str, float]]] = []
    for i, tok in enumerate(tokens):
        if i == 2 and "tie" in text:
            tops.append([(" is", -0.5), (" was", -0.5)] if arm == "a" else [(" was", -0.5), (" is", -0.5)])
        else:
            tops.append([(tok, -0.25), ("<alt>", -0.25 - MARGIN)])
    return tokens, tops


@dataclass
class FakeState:
    arm: str | None = None
    fail: Callable[[str, int], int | None] | None = None
    calls: dict[str, int] = field(default_factory=lambda: {"a": 0, "b": 0})
    bodies: list[dict] = field(default_factory=list)


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    def arm_of(request: Request) -> str:
        if state.arm:
            return state.arm
        return "b" if request.headers.get("host", "").startswith("arm-b") else "a"

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [{"id": f"tiny-{arm_of(request)}", "object": "model"}]}

    async def common(request: Request):
        arm = arm_of(request)
        state.calls[arm] += 1
        body = await request.json()
        state.bodies.append({"arm": arm, **body})
        if state.fail:
            status = state.fail(arm, state.calls[arm])
            if status:
                return (
                    arm,
                    body,
                    JSONResponse({"error": {"message": f"injected {status}"}}, status_code=status),
                )
        return arm, body, None

    @app.post("/v1/completions")
    async def completions(request: Request):
        arm, body, failed = await common(request)
        if failed:
            return failed
        tokens, tops = answer_tokens(body["prompt"], arm)
        k = body["max_tokens"]
        tokens, tops = tokens[:k], tops[:k]
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "text": "".join(tokens),
                    "finish_reason": "length",
                    "logprobs": {
                        "tokens": tokens,
                        "token_logprobs": [t[0][1] for t in tops],
                        "top_logprobs": [dict(t[: body["logprobs"]]) for t in tops],
                        "text_offset": list(range(len(tokens))),
                    },
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3 + len(tokens)},
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arm, body, failed = await common(request)
        if failed:
            return failed
        tokens, tops = answer_tokens(body["messages"][-1]["content"], arm)
        k = body["max_tokens"]
        tokens, tops = tokens[:k], tops[:k]
        content = [
            {
                "token": tok,
                "logprob": alts[0][1],
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in alts[: body["top_logprobs"]]],
            }
            for tok, alts in zip(tokens, tops, strict=True)
        ]
        return {
            "id": "chat-1",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(tokens)},
                    "finish_reason": "length",
                    "logprobs": {"content": content},
                }
            ],
        }

    return app
