"""`flyserve demo` sends the sidecar's bearer token with its PATCHes: to the sidecar itself, never
to a proxy named by $HTTP(S)_PROXY (httpx's default trust_env takes one) nor where a redirect points."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from flyserve.demo import advice
from flyserve.demo.cli import Sidecar, _change_thresholds

ANSWER = {"thresholds": {"version": 2}, "diff": {}}


def _ok(method: str, url: str) -> httpx.Response:
    return httpx.Response(200, json=ANSWER, request=httpx.Request(method, url))


def test_the_demos_patch_takes_no_proxy_and_no_redirect(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def patch(url: str, **kw: Any) -> httpx.Response:
        seen.update(kw)
        return _ok("PATCH", url)

    monkeypatch.setattr(httpx, "patch", patch)
    _change_thresholds(Sidecar("http://127.0.0.1:9", "t" * 24), {"min_seq_len": 4096}, lambda *_: None)
    assert seen["trust_env"] is False and seen["follow_redirects"] is False
    assert seen["headers"]["Authorization"].startswith("Bearer ")


def test_the_demos_advice_patch_takes_no_proxy_and_no_redirect(monkeypatch: pytest.MonkeyPatch) -> None:
    from flyserve.sidecar import advice_client

    seen: dict[str, Any] = {}
    adv = {
        "samples": 1,
        "changes": {},
        "before": {"routed_over_oracle": 1.0},
        "after": {"routed_over_oracle": 1.0},
        "restart": [],
        "patch": {"method": "PATCH", "path": "/thresholds", "body": {}, "headers": {"If-Match": '"1"'}},
    }

    def request(method: str, url: str, **kw: Any) -> httpx.Response:
        seen.update(kw)
        return _ok(method, url)

    monkeypatch.setattr(advice, "priced_seconds", lambda url: {})
    monkeypatch.setattr(advice_client, "fetch_advice", lambda *a, **k: httpx.Response(200, json=adv))
    monkeypatch.setattr(httpx, "request", request)
    advice.advice_phase("http://127.0.0.1:9", "t" * 24, {}, dict, lambda *_: None)
    assert seen["trust_env"] is False and seen["follow_redirects"] is False
