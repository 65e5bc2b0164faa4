"""`flyserve demo` sends the sidecar's bearer token with its PATCHes and the autopilot's POSTs (one
helper: flyserve.demo.procs.send_authenticated): to the sidecar itself, never to a proxy named by
$HTTP(S)_PROXY (httpx's default trust_env takes one) nor where a redirect points."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from flyserve.demo import advice
from flyserve.demo.cli import Sidecar, _change_thresholds

ANSWER = {"thresholds": {"version": 2}, "diff": {}}


def _ok(method: str, url: str) -> httpx.Response:
    return httpx.Response(200, json=ANSWER, request=httpx.Request(method, url))


def _recording_request(seen: dict[str, Any]) -> Any:
    def request(method: str, url: str, **kw: Any) -> httpx.Response:
        seen.update(kw, method=method, url=url)
        return _ok(method, url)

    return request


def test_the_demos_patch_takes_no_proxy_and_no_redirect(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(httpx, "request", _recording_request(seen))
    _change_thresholds(Sidecar("http://127.0.0.1:9", "t" * 24), {"min_seq_len": 4096}, lambda *_: None)
    assert seen["trust_env"] is False and seen["follow_redirects"] is False
    assert seen["headers"]["Authorization"].startswith("Bearer ")
    assert (seen["method"], seen["url"]) == ("PATCH", "http://127.0.0.1:9/thresholds")


def test_the_autopilot_demos_posts_take_no_proxy_and_no_redirect(monkeypatch: pytest.MonkeyPatch) -> None:
    from flyserve.demo import autopilot

    seen: dict[str, Any] = {}
    monkeypatch.setattr(httpx, "request", _recording_request(seen))
    autopilot._post("http://127.0.0.1:9", "t" * 24, "/autopilot/mode", {"mode": "auto"})
    assert seen["trust_env"] is False and seen["follow_redirects"] is False
    assert seen["headers"] == {"Authorization": "Bearer " + "t" * 24}
    assert (seen["method"], seen["url"], seen["json"]) == (
        "POST",
        "http://127.0.0.1:9/autopilot/mode",
        {"mode": "auto"},
    )


def test_a_refused_request_names_method_path_and_status_not_the_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flyserve.demo.procs import send_authenticated

    def refused(method: str, url: str, **kw: Any) -> httpx.Response:
        return httpx.Response(401, text="unauthorized " + "x" * 1000, request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", refused)
    with pytest.raises(RuntimeError) as e:
        send_authenticated("POST", "http://127.0.0.1:9/autopilot/pause", "t" * 24)
    assert str(e.value).startswith("POST /autopilot/pause answered 401: unauthorized")
    assert "t" * 24 not in str(e.value) and len(str(e.value)) < 400


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

    monkeypatch.setattr(advice, "priced_seconds", lambda url: {})
    monkeypatch.setattr(advice_client, "fetch_advice", lambda *a, **k: httpx.Response(200, json=adv))
    monkeypatch.setattr(httpx, "request", _recording_request(seen))
    advice.advice_phase("http://127.0.0.1:9", "t" * 24, {}, dict, lambda *_: None)
    assert seen["trust_env"] is False and seen["follow_redirects"] is False
