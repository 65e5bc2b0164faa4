"""What `flyserve top`'s two readers of the sidecar share (stream.py holds GET /dispatch-stats/stream
open, autopilot_poll.py asks GET /autopilot every few seconds): one daemon thread that the drawing
loop starts and stops and never waits on, the rule for the bearer token, and the parse of a body.

The token rule: each request first goes without the token and is sent again with it only when that
same request to --url (not a redirect: none is followed) is answered 401, a proxy in front that
guards reads. The client takes no proxy from the environment, so the token never goes to another
host or port than the one asked.
"""

from __future__ import annotations

import threading
from typing import Any, Self


class BackgroundReader:
    """A daemon thread that runs ``_run`` until ``stop()``; ``_lock`` guards what it keeps for
    ``latest()``, which the subclass defines (each reports what it read its own way)."""

    def __init__(self, url: str, *, token: str | None, thread_name: str) -> None:
        self.url = url.rstrip("/")
        self._token = token or None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        raise NotImplementedError

    def _headers(self, accept: str, *, with_token: bool) -> dict[str, str]:
        """The request's headers: no compressed answer, and the token only when asked to send it."""
        headers = {"Accept": accept, "Accept-Encoding": "identity"}
        if with_token and self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _token_wanted(self, endpoint: Any, response: Any, *, with_token: bool) -> bool:
        """True when a request without the token, one being given, was answered 401 by the endpoint's
        own origin: then the caller asks once more with it."""
        if response.status_code != 401 or with_token or self._token is None:
            return False
        origin = (endpoint.scheme, endpoint.host, endpoint.port)
        return (response.url.scheme, response.url.host, response.url.port) == origin


def direct_client(timeout: Any) -> Any:
    """An httpx client that follows no redirect and, given an explicit transport, takes no proxy
    from the environment."""
    import httpx

    return httpx.Client(timeout=timeout, transport=httpx.HTTPTransport(), follow_redirects=False)


def parse_object(data: str | bytes, *, source: str) -> dict[str, Any] | None:
    """``data`` as a JSON object within the state files' caps, or None (not UTF-8, not JSON, not an
    object, nesting past the caps, NaN, a number of thousands of digits)."""
    from flyserve.files import safe_read

    try:
        doc = safe_read.parse_json(data, source=source)
    except safe_read.SafeReadError:
        return None
    return doc if isinstance(doc, dict) else None
