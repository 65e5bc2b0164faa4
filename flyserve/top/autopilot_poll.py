"""`flyserve top`'s reader of GET /autopilot: one daemon thread asks every few seconds (not on every
frame: the answer moves once a block, the stream's payload once a second) and keeps what it saw; the
drawing loop only reads ``latest()``.

Nothing the port answers is trusted, as with the stream (flyserve.top.stream): the body is read up to
``MAX_BODY_BYTES`` within ``READ_DEADLINE_S`` and parsed with the state files' caps, and only a JSON
object is kept. A 404 is an older sidecar without the autopilot: said once, as a state, never as a
stream of errors. The thread, the token rule (sent only when --url itself answers 401, no redirect
followed, no proxy taken from the environment) and the parse are the stream's (flyserve.top.reader).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from flyserve.top.reader import BackgroundReader, direct_client, parse_object

POLL_S = 5.0
"""Seconds between two asks: a trial's block is tens of seconds, a decision rarer still."""
MAX_BODY_BYTES = 256 << 10
"""One answer: a trial, a proposal and a few decisions are a few kB; more is not the sidecar."""
READ_DEADLINE_S = 5.0
"""One ask, head and body: a peer that sends a byte now and then is cut off here."""

Kind = Literal["waiting", "answer", "absent", "malformed", "failed"]


@dataclass(frozen=True)
class AutopilotSeen:
    """What the last ask gave: ``answer`` (``body`` is the JSON object), ``absent`` (404: a sidecar
    without the autopilot), ``malformed`` (not a JSON object, too large, compressed: ``detail`` says
    which), ``failed`` (no answer: ``detail`` says why), or ``waiting`` before the first."""

    kind: Kind
    body: dict[str, Any] | None = None
    detail: str | None = None


WAITING = AutopilotSeen("waiting")


def parse_body(data: bytes) -> dict[str, Any] | None:
    """The answer as a JSON object within the state files' caps, or None (not UTF-8, not JSON, not
    an object, nesting past the caps, NaN, a number of thousands of digits)."""
    return parse_object(data, source="GET /autopilot")


def seen_from(status: int, body: bytes | None, why_not: str | None = None) -> AutopilotSeen:
    """What one answer means: the status code and the body read (None: ``why_not`` says why not)."""
    if status == 404:
        return AutopilotSeen("absent")
    if status == 401:
        return AutopilotSeen(
            "failed",
            detail="GET /autopilot wants a token (HTTP 401): --token-file or $FLYSERVE_SIDECAR_TOKEN",
        )
    if status != 200:
        return AutopilotSeen("failed", detail=f"GET /autopilot answered HTTP {status}")
    if body is None:
        return AutopilotSeen("malformed", detail=why_not or "no body")
    doc = parse_body(body)
    if doc is None:
        return AutopilotSeen("malformed", detail="not a JSON object")
    return AutopilotSeen("answer", body=doc)


class AutopilotPoll(BackgroundReader):
    """Asks GET /autopilot every ``every`` seconds in a daemon thread; ``latest()`` from any thread."""

    def __init__(self, url: str, *, every: float = POLL_S, token: str | None = None) -> None:
        super().__init__(url, token=token, thread_name="flyserve-top-autopilot")
        self.every = every
        self._latest = WAITING

    def latest(self) -> AutopilotSeen:
        with self._lock:
            return self._latest

    def _set(self, seen: AutopilotSeen) -> None:
        with self._lock:
            self._latest = seen

    def _run(self) -> None:
        import httpx

        endpoint = httpx.URL(f"{self.url}/autopilot")
        timeout = httpx.Timeout(connect=2.0, read=READ_DEADLINE_S, write=2.0, pool=2.0)
        while not self._stop.is_set():
            try:
                with direct_client(timeout) as c:
                    seen = self._ask(c, endpoint, with_token=False)
                    if seen is None:  # --url answered 401 and a token is given: once more with it
                        seen = self._ask(c, endpoint, with_token=True)
                    if seen is not None:
                        self._set(seen)
            except httpx.TimeoutException:
                self._set(AutopilotSeen("failed", detail="GET /autopilot did not answer in time"))
            except httpx.HTTPError as exc:
                self._set(AutopilotSeen("failed", detail=f"GET /autopilot failed ({type(exc).__name__})"))
            except Exception as exc:  # noqa: BLE001 - whatever the peer sends, the poll lives on
                self._set(AutopilotSeen("failed", detail=f"GET /autopilot failed ({type(exc).__name__})"))
            self._stop.wait(self.every)

    def _ask(self, client: Any, endpoint: Any, *, with_token: bool) -> AutopilotSeen | None:
        """One request; None when it went without the token, one is given, and --url itself (no
        redirect is followed) answered 401: then the caller asks once more with it."""
        headers = self._headers("application/json", with_token=with_token)
        with client.stream("GET", endpoint, headers=headers) as r:
            if self._token_wanted(endpoint, r, with_token=with_token):
                return None
            if r.status_code == 401 and with_token:
                return AutopilotSeen("failed", detail="GET /autopilot refused the token (HTTP 401)")
            if r.status_code != 200:
                return seen_from(r.status_code, None)
            if r.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
                return seen_from(200, None, "a compressed body (not read)")
            body, why_not = _bounded_body(r.iter_raw())
            return seen_from(200, body, why_not)


def _bounded_body(chunks: Any) -> tuple[bytes | None, str | None]:
    """The body from raw chunks, or None and why: over ``MAX_BODY_BYTES``, or still coming after
    ``READ_DEADLINE_S`` (a peer that drips bytes under the read timeout)."""
    deadline = time.monotonic() + READ_DEADLINE_S
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        if len(buf) > MAX_BODY_BYTES:
            return None, f"over {MAX_BODY_BYTES >> 10} KiB"
        if time.monotonic() > deadline:
            return None, f"still coming after {READ_DEADLINE_S:.0f} s"
    return bytes(buf), None
