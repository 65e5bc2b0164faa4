"""fetch_advice: GET /thresholds/advice the way the sidecar asks clients to.

The sidecar fits on one worker thread with a 2 s deadline (flyserve.sidecar.advice_worker): while
a fit runs, the answer is the last fit marked ``stale: true``, or 503 with Retry-After before the
first. A reader that wants the current fit waits as told and asks again, within its own timeout.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

RETRY_STATUSES = frozenset({503})
MAX_RETRY_AFTER_S = 10.0


def _retry_after(r: httpx.Response) -> float:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.1, float(r.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def fetch_advice(url: str, params: dict[str, Any], *, timeout: float) -> httpx.Response:
    """The first fresh 200 (or any non-503 error) within ``timeout``; else the last answer (a stale
    200 or the 503). Raises httpx.HTTPError when the sidecar cannot be reached."""
    endpoint = url.rstrip("/") + "/thresholds/advice"
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        r = httpx.get(endpoint, params=params, timeout=max(0.1, left))
        stale = r.status_code == 200 and bool(r.json().get("stale"))
        if r.status_code not in RETRY_STATUSES and not stale:
            return r
        pause = _retry_after(r) if r.status_code in RETRY_STATUSES else 0.5
        if time.monotonic() + pause >= deadline:
            return r
        time.sleep(pause)
