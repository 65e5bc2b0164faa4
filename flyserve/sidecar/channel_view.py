"""The engine view of /dispatch-stats: what the engine channel's pusher last knew of every engine.

The pusher (flyserve.vllm.channel_pusher, in vLLM's API server) leaves channel/status.json in the
head node's state directory: per engine, the version it confirmed and the step it is in force
from, the versions it has not confirmed, and each worker's last report, fetched by RPC through the
engine channel - so ranks on other nodes (whose state directories this sidecar cannot read) show
here. The file is input like any other: bounded, typed, anything else is dropped and named.

Anyone who can write the state directory can write this file too, so everything in it is shown as
a claim, checked against what this sidecar can see for itself:

* its age comes from the file's own time, bounded by this reader's clock: a time in the future is
  shown as such (``future``, ``age_s`` null), never as an age of 0 that a far-future forgery would
  keep for ever; an old one is ``stale``;
* every version it claims is checked against the control plane's current version, read *after*
  the file (the pusher only pushes versions the control plane had issued before it wrote, so an
  honest status is never above it): one above is ``impossible`` and never counts as a
  confirmation;
* engines, workers and hosts it names are ``verified`` only where a live rank report of this
  node (ranks/*.json) names them too - engines on other nodes never are, and that is all it means;
* sizes are bounded (engines, workers, strings) and what was left out is counted.

Nothing here feeds serving or threshold changes: it is what /dispatch-stats shows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from flyserve.control.paths import StateDir
from flyserve.control.state_files import MAX_JSON_BYTES
from flyserve.files import safe_read
from flyserve.sidecar.models import ChannelEngineView, ChannelView, ChannelWorkerView

SOURCE = "channel/status.json"
MAX_ENGINES = 256
"""Engines shown: far above any real data-parallel size; the rest are counted in engines_left_out."""
MAX_WORKERS_PER_ENGINE = 256
MAX_WORKERS = 1024
"""Workers shown over all engines: a 1 MiB status can list ~10,000, and every /dispatch-stats
request and stream event carries the view."""
MAX_UNCONFIRMED = 64
MAX_DECISIONS = 8
MAX_HOST_CHARS = 64
MAX_ERROR_CHARS = 300
MAX_NAMED = 32
"""Impossible claims and unverified hosts named at most (the per-entry flags cover the rest)."""
MAX_INDEX = 1 << 20
"""Engine and rank indices at or above this are no real deployment's (the pusher's bound too)."""
STALE_AFTER_S = 15.0
"""The pusher rewrites its status at least every 5 s (and after every push and 2 s report round,
flyserve.vllm.channel_pusher): a status three writes late says nothing current of the engines."""
FUTURE_SLACK_S = 2.0
"""A time at most this far ahead of the reader's clock counts as now: the pusher runs on this
host, so only rounding or a clock step puts it ahead. Further ahead, it is a time in the future."""


@dataclass(frozen=True, slots=True)
class Witnesses:
    """What this node's live rank reports can vouch for: the engines, (engine, rank) pairs and hosts
    they name. A report is itself a claim (RankView.liveness says how far it is confirmed); it is
    still one the status file's writer would have to forge as well."""

    engines: frozenset[int] = frozenset()
    workers: frozenset[tuple[int, int]] = frozenset()
    hosts: frozenset[str] = frozenset()
    host_of: dict[tuple[int, int], str] = field(default_factory=dict)

    @classmethod
    def of(cls, reports: Iterable[tuple[int, int, str]]) -> Witnesses:
        """From (engine, rank, host) of each live rank report (host "" when it names none)."""
        host_of = {(e, r): h for e, r, h in reports}
        return cls(
            engines=frozenset(e for e, _ in host_of),
            workers=frozenset(host_of),
            hosts=frozenset(h for h in host_of.values() if h),
            host_of=host_of,
        )

    def worker(self, engine: int | None, rank: int, host: str | None) -> bool:
        """A report of this engine and rank, from the same host where both name one."""
        if engine is None or (engine, rank) not in self.workers:
            return False
        seen = self.host_of.get((engine, rank), "")
        return not (host and seen and host[:MAX_HOST_CHARS] != seen[:MAX_HOST_CHARS])


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _index(x: Any) -> int | None:
    """An engine or rank index: an int in [0, MAX_INDEX)."""
    v = _int(x)
    return v if v is not None and 0 <= v < MAX_INDEX else None


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _text(x: Any, n: int) -> str | None:
    return x[:n] if isinstance(x, str) else None


def age_of(t: Any, now: float) -> tuple[float | None, bool]:
    """(age_s, future) of a claimed time: age null with no usable time, and also (with future
    True) for a time more than FUTURE_SLACK_S ahead of ``now``."""
    v = _number(t)
    if v is None:
        return None, False
    if v - now > FUTURE_SLACK_S:
        return None, True
    return round(max(0.0, now - v), 3), False


@dataclass(slots=True)
class _Judge:
    """The checks one status read is put through, and what they found (impossible claims named,
    entries left out counted)."""

    control_version: int | None
    witnesses: Witnesses
    fresh: bool
    impossible: list[str] = field(default_factory=list)
    impossible_count: int = 0
    workers_kept: int = 0

    def above(self, version: int | None, what: str) -> bool:
        """True when ``version`` is one the control plane has not issued (named in impossible)."""
        if version is None or self.control_version is None or version <= self.control_version:
            return False
        self.impossible_count += 1
        if len(self.impossible) < MAX_NAMED:
            self.impossible.append(f"{what} {version} > control version {self.control_version}")
        return True

    def counts(self, version: int | None, impossible: bool) -> bool:
        """A claimed version counts as a confirmation: the status fresh, the version one the
        control plane issued (known), the claim not impossible."""
        return (
            self.fresh
            and not impossible
            and version is not None
            and self.control_version is not None
            and 0 <= version <= self.control_version
        )


def _decisions(d: Any) -> dict[str, float]:
    if not isinstance(d, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in d.items():
        x = _number(v)
        if x is not None:
            out[str(k)[:32]] = x
            if len(out) >= MAX_DECISIONS:
                break
    return out


def _worker(d: Any, engine: int, judge: _Judge) -> ChannelWorkerView | None:
    rank = _index(d.get("rank")) if isinstance(d, dict) else None
    if rank is None:
        return None
    own_engine = _int(d.get("engine"))
    host = _text(d.get("host"), MAX_HOST_CHARS)
    applied = _int(d.get("applied_version"))
    impossible = judge.above(applied, f"engine {engine} rank {rank} applied_version")
    return ChannelWorkerView(
        rank=rank,
        engine=own_engine,
        host=host,
        pid=_int(d.get("pid")),
        step=_int(d.get("step")),
        applied_version=applied,
        applied_step=_int(d.get("applied_step")),
        control_mode=_text(d.get("control_mode"), 64),
        steps_per_s=_number(d.get("steps_per_s")),
        decisions=_decisions(d.get("decisions")),
        impossible=impossible,
        verified=(own_engine is None or own_engine == engine) and judge.witnesses.worker(engine, rank, host),
    )


def _workers(raw: Any, engine: int, judge: _Judge) -> tuple[list[ChannelWorkerView], int]:
    """The engine's workers within the caps, and how many entries were left out."""
    items = raw if isinstance(raw, list) else []
    out: list[ChannelWorkerView] = []
    for x in items:
        if len(out) >= MAX_WORKERS_PER_ENGINE or judge.workers_kept >= MAX_WORKERS:
            break
        w = _worker(x, engine, judge)
        if w is not None:
            out.append(w)
            judge.workers_kept += 1
    return out, len(items) - len(out)


def _engine(d: Any, judge: _Judge) -> ChannelEngineView | None:
    engine = _index(d.get("engine")) if isinstance(d, dict) else None
    if engine is None:
        return None
    unconfirmed_raw = d.get("unconfirmed")
    unconfirmed = [
        v for v in (unconfirmed_raw if isinstance(unconfirmed_raw, list) else [])[:MAX_UNCONFIRMED]
        if _int(v) is not None
    ]  # fmt: skip
    confirmed_version = _int(d.get("confirmed_version"))
    impossible = judge.above(confirmed_version, f"engine {engine} confirmed_version")
    for v in unconfirmed:
        impossible = judge.above(v, f"engine {engine} unconfirmed") or impossible
    workers, left_out = _workers(d.get("workers"), engine, judge)
    impossible = impossible or any(w.impossible for w in workers)
    return ChannelEngineView(
        engine=engine,
        confirmed_version=confirmed_version,
        from_step=_int(d.get("from_step")),
        unconfirmed=unconfirmed,
        error=_text(d.get("error"), MAX_ERROR_CHARS),
        workers=workers,
        impossible=impossible,
        confirmed=judge.counts(confirmed_version, impossible),  # settled once the whole file is read
        verified=engine in judge.witnesses.engines,
        workers_left_out=left_out,
    )


def _engines(raw: Any, judge: _Judge) -> tuple[list[ChannelEngineView], int, int]:
    """Engines within the caps (the first entry of an index wins), entries left out, and workers
    left out over all of them (of the engines not shown, none are counted: they were not read)."""
    items = raw if isinstance(raw, list) else []
    out: list[ChannelEngineView] = []
    seen: set[int] = set()
    for x in items:
        if len(out) >= MAX_ENGINES:
            break
        e = _engine(x, judge)
        if e is not None and e.engine not in seen:
            seen.add(e.engine)
            out.append(e)
    return out, len(items) - len(out), sum(e.workers_left_out for e in out)


def _unverified_hosts(engines: list[ChannelEngineView], witnesses: Witnesses) -> list[str]:
    named = {w.host for e in engines for w in e.workers if w.host}
    return sorted(h for h in named if h not in witnesses.hosts)[:MAX_NAMED]


def _control(control_version: int | Callable[[], int | None] | None) -> int | None:
    got = control_version() if callable(control_version) else control_version
    return _int(got)


def read_status(state_dir: StateDir) -> dict[str, Any] | None:
    """channel/status.json's document through flyserve.files.safe_read (no symlinks, regular file,
    size, depth and number caps); None when there is none. A document that is not a JSON object
    (``null`` included: it is no absent file) raises ValueError naming the file."""
    raw = safe_read.read_bytes(state_dir.path / "channel" / "status.json", MAX_JSON_BYTES, source=SOURCE)
    if raw is None:
        return None
    d = safe_read.parse_json(raw, source=SOURCE)
    if not isinstance(d, dict):
        raise safe_read.SafeReadError(SOURCE, "not a JSON object", "<document>")
    return d


def read_channel_view(
    state_dir: StateDir,
    *,
    now: float | None = None,
    control_version: int | Callable[[], int | None] | None = None,
    witnesses: Witnesses | None = None,
) -> ChannelView | None:
    """channel/status.json as a ChannelView; None when there is no engine channel (no file).
    Raises ValueError naming the file when it is not a status document.

    ``control_version``: the control plane's current version, or a callable that reads it; a
    callable is called after the file is read, so a version published between the two reads can
    never make an honest status look impossible. None: versions are not checked (and none counts
    as confirmed). ``witnesses``: this node's live rank reports (None: nothing is verified)."""
    d = read_status(state_dir)
    if d is None:
        return None
    now = time.time() if now is None else now
    age, future = age_of(d.get("time"), now)
    reports_age, reports_future = age_of(d.get("reported_at"), now)
    stale = age is None or age > STALE_AFTER_S
    try:
        judge = _Judge(_control(control_version), witnesses or Witnesses(), fresh=not stale)
        pushed = _int(d.get("pushed_version"))
        pushed_impossible = judge.above(pushed, "pushed_version")
        engines, engines_left_out, workers_left_out = _engines(d.get("engines"), judge)
        if judge.impossible_count:  # a file that claims one version never issued confirms nothing
            engines = [e.model_copy(update={"confirmed": False}) for e in engines]
        return ChannelView(
            pid=_int(d.get("pid")),
            age_s=age,
            pushed_version=pushed,
            pushes=_int(d.get("pushes")) or 0,
            split_steps=_int(d.get("split_steps")) or 0,
            errors=_int(d.get("errors")) or 0,
            last_error=_text(d.get("last_error"), MAX_ERROR_CHARS) or None,
            engines=engines,
            time=_number(d.get("time")),
            future=future,
            stale=stale,
            stale_after_s=STALE_AFTER_S,
            reported_at=_number(d.get("reported_at")),
            reports_age_s=reports_age,
            reports_future=reports_future,
            reports_stale=reports_age is None or reports_age > STALE_AFTER_S,
            control_version=judge.control_version,
            pushed_confirmed=judge.counts(pushed, pushed_impossible or judge.impossible_count > 0),
            impossible=judge.impossible,
            impossible_count=judge.impossible_count,
            unverified_hosts=_unverified_hosts(engines, judge.witnesses),
            engines_left_out=engines_left_out,
            workers_left_out=workers_left_out,
        )
    except (ValidationError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{SOURCE}: not an engine-channel status ({type(exc).__name__})") from None
