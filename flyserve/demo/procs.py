"""The demo's processes: start, wait for, poll and stop them (every one bound to 127.0.0.1, every
wait bounded), so flyserve/demo/cli.py reads as the story it tells."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any


class Stack:
    """Subprocesses to stop on the way out, last started first."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Callable[[], Any]]] = []

    def push(self, name: str, stopper: Callable[[], Any]) -> None:
        self.items.append((name, stopper))

    def close(self, echo: Callable[[str], Any]) -> None:
        while self.items:
            name, stop = self.items.pop()
            echo(f"stopping {name} ...")
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                echo(f"  {name}: {exc}")


def stop_popen(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def get_json(url: str, timeout: float = 5.0) -> dict | None:
    """GET a JSON body; None on any error or non-200 (the caller decides what a miss means)."""
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def send_authenticated(
    method: str, url: str, token: str, body: Any = None, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """One authenticated request to the demo's own sidecar: the token in the Authorization header,
    never to $HTTP(S)_PROXY (trust_env off) nor to where a redirect points; the JSON answer of a
    200, else a RuntimeError naming the method, the path and the status (the body cut to 300)."""
    import httpx

    r = httpx.request(
        method,
        url,
        json=body,
        headers={**(headers or {}), "Authorization": f"Bearer {token}"},
        timeout=10,
        trust_env=False,
        follow_redirects=False,
    )
    if r.status_code != 200:
        path = httpx.URL(url).path
        raise RuntimeError(f"{method} {path} answered {r.status_code}: {r.text[:300]}")
    doc = r.json()
    return doc if isinstance(doc, dict) else {}


def wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll ``url`` until it answers 200; raise if ``proc`` exits first or ``timeout`` passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        if get_json(url, timeout=2.0) is not None:
            return
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f} s")
