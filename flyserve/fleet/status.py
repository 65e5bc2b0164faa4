"""`flyserve fleet status`: each replica's numbers from Prometheus, and which replicas disagree.

A reader of Prometheus' HTTP API (GET /api/v1/query), nothing else: it asks the per-replica
expressions of flyserve.fleet.promql at its own window (so it works without the recording rules),
joins them by target labels and decides which replicas disagree with the rest:

* content: its thresholds fingerprint is not the fleet's most common one (none is while two contents
  tie), or its own ranks disagree;
* kernel time per token: above the median of the replicas by more than ``margin``.

Whatever answers at --prometheus is the network: every answer is read with a size cap and one
deadline for the whole read, checked for the shape of a Prometheus vector, and every label printed
goes through flyserve.terminal.printable (cli.py).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import httpx

from flyserve.fleet import promql as q

MAX_ANSWER_BYTES: Final = 8 << 20
"""One query's answer; a fleet of 1,000 replicas with a dozen labels each is ~1 MB."""
MAX_SERIES: Final = 20_000
MAX_REPLICAS: Final = 5_000
"""Replicas one status shows; more and the matchers should narrow the fleet."""
WINDOW_RE: Final = re.compile(r"^[1-9][0-9]{0,5}(s|m|h)$")
DEFAULT_MARGIN: Final = 0.10
DEFAULT_SEEN: Final = "15m"
NOT_JOINED: Final = frozenset({"__name__", "state", "path"})
"""Labels the expressions add beside the target labels a replica is known by."""


class FleetError(Exception):
    """Prometheus could not be asked, or did not answer as Prometheus does; the message says which."""


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


def _bounded_get(client: httpx.Client, url: str, params: dict[str, str], deadline: float) -> bytes:
    body = bytearray()
    left = deadline - time.monotonic()
    if left <= 0:
        raise FleetError("timed out before asking Prometheus")
    with client.stream("GET", url, params=params, timeout=left) as r:
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_ANSWER_BYTES:
                raise FleetError(
                    f"Prometheus' answer is larger than {MAX_ANSWER_BYTES >> 20} MiB: narrow --match"
                )
            if time.monotonic() > deadline:
                raise FleetError("Prometheus did not answer within --timeout")
        status = r.status_code
    if status != 200:
        detail = ""
        try:
            doc = json.loads(body)
            if isinstance(doc, dict) and isinstance(doc.get("error"), str):
                detail = ": " + doc["error"][:500]
        except ValueError:
            pass
        raise FleetError(f"Prometheus answered HTTP {status}{detail}")
    return bytes(body)


def parse_vector(body: bytes) -> list[Sample]:
    """The samples of an instant-query answer; FleetError if it is not one."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise FleetError("the answer is not JSON: is --prometheus a Prometheus server?") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        err = doc.get("error") if isinstance(doc, dict) else None
        raise FleetError(f"Prometheus refused the query: {str(err)[:500] if err else 'no status success'}")
    data = doc.get("data")
    if (
        not isinstance(data, dict)
        or data.get("resultType") != "vector"
        or not isinstance(data.get("result"), list)
    ):
        raise FleetError("the answer is not an instant vector")
    result = data["result"]
    if len(result) > MAX_SERIES:
        raise FleetError(f"the answer has {len(result)} series (at most {MAX_SERIES}): narrow --match")
    out = []
    for item in result:
        metric = item.get("metric") if isinstance(item, dict) else None
        value = item.get("value") if isinstance(item, dict) else None
        if (
            not isinstance(metric, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items())
            or not isinstance(value, list)
            or len(value) != 2
            or not isinstance(value[1], str)
        ):
            raise FleetError("a series of the answer is not a Prometheus sample")
        try:
            v = float(value[1])
        except ValueError:
            raise FleetError("a sample's value is not a number") from None
        out.append(Sample(dict(metric), v))
    return out


class Prometheus:
    """Instant queries against one Prometheus, under one deadline for all of them."""

    def __init__(self, url: str, *, timeout_s: float, transport: httpx.BaseTransport | None = None) -> None:
        if not re.match(r"^https?://[^\s/]+", url):
            raise FleetError(f"--prometheus must be an http(s) URL (got {url[:200]!r})")
        self.endpoint = url.rstrip("/") + "/api/v1/query"
        self.deadline = time.monotonic() + timeout_s
        # No proxy or credentials from the environment, no redirects: ask only the server named.
        self.client = httpx.Client(trust_env=False, follow_redirects=False, transport=transport)

    def query(self, expr: str) -> list[Sample]:
        try:
            return parse_vector(_bounded_get(self.client, self.endpoint, {"query": expr}, self.deadline))
        except httpx.TimeoutException:
            raise FleetError("Prometheus did not answer within --timeout") from None
        except httpx.HTTPError as exc:
            raise FleetError(
                f"cannot reach Prometheus at {self.endpoint}: {type(exc).__name__}: {exc}"
            ) from None

    def close(self) -> None:
        self.client.close()


# ----------------------------------------------------------------------------- the fleet


@dataclass
class Replica:
    labels: dict[str, str]
    name: str = ""
    scrape_up: float | None = None
    ranks: int | None = None
    live_ranks: int | None = None
    ranks_agree: float | None = None
    version: int | None = None
    fingerprint: float | None = None
    kernel_us_per_token: float | None = None
    kernel_us_per_token_by_path: dict[str, float] = field(default_factory=dict)
    regret: float | None = None
    fallback_ratio: float | None = None
    late_applies_per_s: float | None = None
    health: str = ""
    disagrees: list[str] = field(default_factory=list)

    @property
    def content(self) -> str:
        return content_text(self.fingerprint)


def content_text(fp: float | None) -> str:
    """The fingerprint as `flyserve thresholds show` prints a sha256's start (13 hex digits)."""
    if fp is None or not math.isfinite(fp):
        return "-"
    if fp == -1:
        return "mixed"
    if fp < 0 or fp >= 2**52 or fp != int(fp):
        return "invalid"
    return f"{int(fp):013x}"


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in NOT_JOINED))


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


@dataclass
class FleetStatus:
    window: str
    margin: float
    replicas: list[Replica]
    majority_content: str | None
    median_kernel_us_per_token: float | None

    @property
    def disagreeing(self) -> list[Replica]:
        return [r for r in self.replicas if r.disagrees]

    @property
    def unhealthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.health != "ok"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "margin": self.margin,
            "majority_content": self.majority_content,
            "median_kernel_us_per_token": self.median_kernel_us_per_token,
            "replicas": [{**asdict(r), "content": r.content} for r in self.replicas],
        }


def _names(replicas: Iterable[Replica]) -> None:
    """pod, else instance; the job (then every label) added where that is not unique."""
    rs = list(replicas)
    for r in rs:
        r.name = (
            r.labels.get("pod")
            or r.labels.get("instance")
            or ",".join(f"{k}={v}" for k, v in sorted(r.labels.items()))
        )
    counts = Counter(r.name for r in rs)
    for r in rs:
        if counts[r.name] > 1:
            r.name = ",".join(f"{k}={v}" for k, v in sorted(r.labels.items()))


def fleet_status(
    prom: Prometheus,
    *,
    window: str = "5m",
    matchers: str = "",
    margin: float = DEFAULT_MARGIN,
    seen_window: str = DEFAULT_SEEN,
) -> FleetStatus:
    """``window``: of every rate; ``seen_window``: a replica that reported within it is listed (a
    stopped one as "scrape failing" or "not scraped", not left out)."""
    for name, w in (("--window", window), ("--seen", seen_window)):
        if not WINDOW_RE.match(w):
            raise FleetError(f"{name} must be a duration like 30s, 5m or 1h (got {w[:40]!r})")
    if "{" in matchers or "}" in matchers:
        raise FleetError('--match takes label matchers without braces, e.g. namespace="prod"')
    m = matchers
    seen = prom.query(q.seen(seen_window, m))
    by_key: dict[tuple[tuple[str, str], ...], Replica] = {}
    for s in seen:
        k = _key(s.labels)
        by_key.setdefault(k, Replica(labels=dict(k)))
        if len(by_key) > MAX_REPLICAS:
            raise FleetError(f"more than {MAX_REPLICAS} replicas: narrow --match")

    def each(expr: str):
        for s in prom.query(expr):
            r = by_key.get(_key(s.labels))
            if r is not None:
                yield r, s

    for r, s in each(q.scrape_up(seen_window, m)):
        r.scrape_up = s.value
    for r, s in each(q.ranks(m)):
        if math.isfinite(s.value):
            if s.labels.get("state") == "all":
                r.ranks = int(s.value)
            elif s.labels.get("state") == "live":
                r.live_ranks = int(s.value)
    for r, s in each(q.ranks_agree(m)):
        r.ranks_agree = _finite(s.value)
    for r, s in each(q.thresholds_version(m)):
        r.version = int(s.value) if math.isfinite(s.value) else None
    for r, s in each(q.fingerprint_value(m)):
        r.fingerprint = s.value if math.isfinite(s.value) else None
    for r, s in each(q.kernel_us_per_token(window, m)):
        r.kernel_us_per_token = _finite(s.value)
    for r, s in each(q.kernel_us_per_token_by_path(window, m)):
        if math.isfinite(s.value) and s.labels.get("path"):
            r.kernel_us_per_token_by_path[s.labels["path"]] = s.value
    for r, s in each(q.regret(window, m)):
        r.regret = _finite(s.value)
    for r, s in each(q.fallback_ratio(window, m)):
        r.fallback_ratio = _finite(s.value)
    for r, s in each(q.late_applies(window, m)):
        r.late_applies_per_s = _finite(s.value)

    replicas = sorted(by_key.values(), key=lambda r: tuple(sorted(r.labels.items())))
    _names(replicas)
    for r in replicas:
        r.health = _health(r)
    majority = _majority(
        r.content for r in replicas if r.health == "ok" and r.content not in ("-", "mixed", "invalid")
    )
    kernels = [r.kernel_us_per_token for r in replicas if r.kernel_us_per_token is not None]
    median = statistics.median(kernels) if kernels else None
    for r in replicas:
        if r.health != "ok":
            continue
        if r.content == "mixed":
            r.disagrees.append("content: its ranks run different contents")
        elif majority is not None and r.content != majority:
            r.disagrees.append(f"content: {r.content}, the fleet's most common is {majority}")
        if (
            median is not None
            and median > 0  # a fleet of idle replicas: nothing to be a multiple of
            and r.kernel_us_per_token is not None
            and r.kernel_us_per_token > median * (1 + margin)
        ):
            r.disagrees.append(
                f"kernel: {r.kernel_us_per_token / median:.2f}x the median time per token (margin {margin:.0%})"
            )
    return FleetStatus(window, margin, replicas, majority, median)


def _majority(contents: Iterable[str]) -> str | None:
    """The most common content; None with none, or while two tie."""
    top = Counter(contents).most_common(2)
    if not top or (len(top) == 2 and top[0][1] == top[1][1]):
        return None
    return top[0][0]


def _health(r: Replica) -> str:
    if r.scrape_up is None:
        return "not scraped"  # its target is gone (Prometheus no longer lists it)
    if r.scrape_up == 0:
        return "scrape failing"
    if r.ranks is None or r.live_ranks is None or r.ranks == 0:
        return "no ranks"
    if r.live_ranks == 0:
        return "no live rank"
    if r.live_ranks < r.ranks:
        return f"ranks stale ({r.ranks - r.live_ranks} of {r.ranks})"
    if r.ranks_agree == 0:
        return "ranks disagree"
    return "ok"
