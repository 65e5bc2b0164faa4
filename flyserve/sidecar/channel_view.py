"""The engine view of /dispatch-stats: what the engine channel's pusher last knew of every engine.

The pusher (flyserve.vllm.channel_pusher, in vLLM's API server) leaves channel/status.json in the
head node's state directory: per engine, the version it confirmed and the step it is in force
from, the versions it has not confirmed, and each worker's last report, fetched by RPC through the
engine channel - so ranks on other nodes (whose state directories this sidecar cannot read) show
here. The file is input like any other: bounded, typed, anything else is dropped and named.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from flyserve.control.paths import StateDir
from flyserve.control.store import read_json
from flyserve.sidecar.models import ChannelEngineView, ChannelView, ChannelWorkerView

MAX_ENGINES = 1024
MAX_WORKERS = 256


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _text(x: Any, n: int) -> str | None:
    return x[:n] if isinstance(x, str) else None


def _worker(d: Any) -> ChannelWorkerView | None:
    if not isinstance(d, dict) or _int(d.get("rank")) is None:
        return None
    decisions = d.get("decisions")
    rate = d.get("steps_per_s")
    return ChannelWorkerView(
        rank=d["rank"],
        engine=_int(d.get("engine")),
        host=_text(d.get("host"), 64),
        pid=_int(d.get("pid")),
        step=_int(d.get("step")),
        applied_version=_int(d.get("applied_version")),
        applied_step=_int(d.get("applied_step")),
        control_mode=_text(d.get("control_mode"), 64),
        steps_per_s=float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None,
        decisions={
            str(k)[:32]: float(v)
            for k, v in (decisions.items() if isinstance(decisions, dict) else ())
            if isinstance(v, int | float) and not isinstance(v, bool)
        },
    )


def _engine(d: Any) -> ChannelEngineView | None:
    if not isinstance(d, dict) or _int(d.get("engine")) is None:
        return None
    unconfirmed = d.get("unconfirmed")
    workers = d.get("workers")
    return ChannelEngineView(
        engine=d["engine"],
        confirmed_version=_int(d.get("confirmed_version")),
        from_step=_int(d.get("from_step")),
        unconfirmed=[
            v for v in (unconfirmed if isinstance(unconfirmed, list) else [])[:64] if _int(v) is not None
        ],
        error=_text(d.get("error"), 300),
        workers=[
            w for w in (_worker(x) for x in (workers if isinstance(workers, list) else [])[:MAX_WORKERS]) if w
        ],
    )


def read_channel_view(state_dir: StateDir, *, now: float | None = None) -> ChannelView | None:
    """channel/status.json as a ChannelView; None when there is no engine channel (no file).
    Raises ValueError naming the file when it is not a status document."""
    path = state_dir.path / "channel" / "status.json"
    d = read_json(path)
    if d is None:
        return None
    now = time.time() if now is None else now
    t = d.get("time")
    engines = d.get("engines")
    try:
        return ChannelView(
            pid=_int(d.get("pid")),
            age_s=round(max(0.0, now - float(t)), 3) if isinstance(t, int | float) else None,
            pushed_version=_int(d.get("pushed_version")),
            pushes=_int(d.get("pushes")) or 0,
            split_steps=_int(d.get("split_steps")) or 0,
            errors=_int(d.get("errors")) or 0,
            last_error=_text(d.get("last_error"), 300) or None,
            engines=[
                e
                for e in (_engine(x) for x in (engines if isinstance(engines, list) else [])[:MAX_ENGINES])
                if e
            ],
        )
    except (ValidationError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"channel/status.json: not an engine-channel status ({type(exc).__name__})"
        ) from None
