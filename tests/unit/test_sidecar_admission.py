"""AdmissionMiddleware: over the request cap an anonymous request is a 503 at
once, while /healthz, /readyz and changes with the valid token are always admitted."""

from __future__ import annotations

import asyncio

from flyserve.sidecar.middleware import AdmissionMiddleware

TOKEN = b"t0ken-for-tests-0123456789"


def _scope(method: str, path: str, auth: bytes | None = None) -> dict:
    headers = [(b"host", b"x")] + ([(b"authorization", b"Bearer " + auth)] if auth is not None else [])
    return {"type": "http", "method": method, "path": path, "headers": headers}


def test_over_the_cap_only_probes_and_token_changes_get_in() -> None:
    async def run() -> dict[str, int]:
        release = asyncio.Event()
        entered: list[str] = []

        async def app(scope, receive, send) -> None:
            entered.append(scope["path"])
            if scope["path"] == "/slow":
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = AdmissionMiddleware(app, max_requests=1, token=TOKEN)

        async def call(scope: dict) -> int:
            got: list[int] = []

            async def send(msg: dict) -> None:
                if msg["type"] == "http.response.start":
                    got.append(msg["status"])

            async def receive() -> dict:
                return {"type": "http.request", "body": b"", "more_body": False}

            await mw(scope, receive, send)
            return got[0]

        slow = asyncio.create_task(call(_scope("GET", "/slow")))
        await asyncio.sleep(0.01)
        assert mw.in_flight == 1
        out = {
            "anonymous": await call(_scope("GET", "/thresholds")),
            "wrong token": await call(_scope("PATCH", "/thresholds", b"wrong-token-0123456789")),
            "healthz": await call(_scope("GET", "/healthz")),
            "readyz": await call(_scope("GET", "/readyz")),
            "token patch": await call(_scope("PATCH", "/thresholds", TOKEN)),
        }
        release.set()
        await slow
        out["after"] = await call(_scope("GET", "/thresholds"))
        assert mw.in_flight == 0
        return out

    assert asyncio.run(run()) == {
        "anonymous": 503,
        "wrong token": 503,
        "healthz": 200,
        "readyz": 200,
        "token patch": 200,
        "after": 200,
    }
