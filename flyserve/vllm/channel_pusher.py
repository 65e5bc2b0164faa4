"""The API-server side of the engine channel: watch the store, push each new version to every worker.

Runs as one asyncio task in vLLM's API server (flyserve.vllm.endpoint_plugin starts it). It stats
control/current.json every ``poll_s``; on a new version it pushes every version it has not pushed
yet, oldest first (intermediate ones from history, so no worker skips one), all in one collective
RPC. vLLM runs the RPC between two engine steps on every worker; each worker answers with its step,
so the pusher records the exact boundary and whether all workers agreed on it.

What it leaves in the state directory (the sidecar and the tests read these; nothing else does):
  channel/status.json   mode, pid, time, last pushed version, the workers' last answers, counts
  channel/pushes.jsonl  one line per pushed version: version, sha256, time, every worker's answer

No vLLM import here: ``rpc`` is any ``async (method, [json_doc, ...]) -> list[answer]``, so the unit
tests drive the pusher with an in-process fake and the e2e tests with the real engine client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyserve.control.errors import ControlIOError
from flyserve.control.paths import StateDir
from flyserve.control.rank import ENGINE_CHANNEL
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.store import Store, atomic_write
from flyserve.vllm.engine_channel import MAX_DOCS, METHOD

log = logging.getLogger("flyserve.vllm")

Rpc = Callable[[str, list[str]], Awaitable[list[Any]]]

DEFAULT_POLL_S = 0.05
"""A stat of current.json every 50 ms: a few microseconds of the API server's loop each time, and
a change reaches the workers within one poll plus one engine step."""
STATUS_EVERY_S = 5.0
RETRY_MAX_S = 5.0


def channel_dir(state_dir: StateDir) -> Path:
    return state_dir.path / "channel"


def status_path(state_dir: StateDir) -> Path:
    return channel_dir(state_dir) / "status.json"


def pushes_path(state_dir: StateDir) -> Path:
    return channel_dir(state_dir) / "pushes.jsonl"


@dataclass(frozen=True, slots=True)
class Push:
    """One version pushed to every worker, and what each answered."""

    version: int
    sha256: str
    answers: tuple[dict[str, Any], ...]

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(int(a.get("step", -1)) for a in self.answers)

    @property
    def same_step(self) -> bool:
        """Every worker answered from the same step (so all apply from the same next step)."""
        return len(set(self.steps)) == 1


def _small(answer: Any) -> dict[str, Any]:
    """A worker's answer, reduced to known fields of bounded size (it is input like any other)."""
    if not isinstance(answer, dict):
        return {"why": "not an answer", "error": repr(answer)[:200]}
    out = {k: answer[k] for k in ("rank", "engine", "step", "version") if k in answer}
    results = answer.get("results")
    out["results"] = [
        {"version": r.get("version"), "applied": bool(r.get("applied")), "why": str(r.get("why"))[:40]}
        for r in (results if isinstance(results, list) else [])[:MAX_DOCS]
        if isinstance(r, dict)
    ]
    if "why" in answer:
        out["why"] = str(answer["why"])[:40]
    if "error" in answer:
        out["error"] = str(answer["error"])[:300]
    return out


class ChannelPusher:
    """Watches one state directory and pushes versions through ``rpc``. One per API server."""

    def __init__(
        self, state_dir: StateDir | str | os.PathLike[str], rpc: Rpc, *, poll_s: float = DEFAULT_POLL_S
    ):
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
        self.state_dir = StateDir(state_dir)
        self.store = Store(self.state_dir)
        self.rpc = rpc
        self.poll_s = float(poll_s)
        self.pushed_version = -1  # -1: not attached yet (the first round switches every worker)
        self.last: Push | None = None
        self.pushes = 0
        self.split_steps = 0  # pushes whose workers answered from different steps (must stay 0)
        self.errors = 0
        self.last_error = ""
        self._seen: tuple[int, int, int] | None = None
        self._status_at = 0.0

    # ------------------------------------------------------------------ one round

    def _current_key(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.state_dir.current_json)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _to_push(self) -> list[ConfigSnapshot] | None:
        """Versions above the last pushed one, oldest first; None if the store cannot be read now."""
        try:
            cur = self.store.read_current()
        except ControlIOError as exc:
            log.error("flyserve engine channel: %s; pushing nothing this round", exc)
            return None
        if cur is None or cur.version <= self.pushed_version:
            return []
        out = [cur]
        if self.pushed_version >= 0:  # attached: fill the gap from history so no worker skips a version
            for v in range(cur.version - 1, self.pushed_version, -1):
                try:
                    old = self.store.read_version(v)
                except ControlIOError:
                    old = None
                if old is None:
                    break
                out.insert(0, old)
        return out

    async def sync_once(self) -> int:
        """Push what is new (the first call attaches every worker); the number of versions pushed.

        Everything published since the last push goes in one RPC (at most MAX_DOCS versions each),
        applied in order between the same two steps: under a burst of changes the pusher catches up
        in one step instead of one step per version. Raises what ``rpc`` raises (the caller
        retries); versions count as pushed only once every worker answered, and a worker answers a
        repeat with "already applied".
        """
        key = self._current_key()
        if self.pushed_version >= 0 and key == self._seen:
            return 0
        snaps = await asyncio.to_thread(self._to_push)  # file reads stay off the server's loop
        if snaps is None:
            return 0
        if self.pushed_version < 0 and not snaps:
            await self._push([])  # nothing published yet: switch the workers, no version
            self.pushed_version = 0
            await asyncio.to_thread(self.write_status)
        for i in range(0, len(snaps), MAX_DOCS):
            batch = snaps[i : i + MAX_DOCS]
            await self._push(batch)
            self.pushed_version = batch[-1].version
        self._seen = key
        if snaps:
            await asyncio.to_thread(self.write_status)
        return len(snaps)

    async def _push(self, batch: list[ConfigSnapshot]) -> None:
        raw = await self.rpc(METHOD, [s.to_json() for s in batch])
        answers = [_small(a) for a in (raw if isinstance(raw, list) else [raw])]
        bad = [a for a in answers if "error" in a or "why" in a]
        if bad or not answers:
            raise RuntimeError(f"a worker refused the push: {bad[0] if bad else 'no answer'}")
        if not batch:
            log.info("flyserve engine channel: attached to %d worker(s), nothing published yet", len(answers))
            return
        lines = []
        for snap in batch:
            per_worker = []
            for a in answers:
                r = next((r for r in a["results"] if r.get("version") == snap.version), None)
                if r is None:
                    raise RuntimeError(
                        f"worker rank {a.get('rank')} did not answer for version {snap.version}"
                    )
                per_worker.append({"rank": a.get("rank"), "engine": a.get("engine"), "step": a.get("step"),
                                   "applied": r.get("applied"), "why": r.get("why")})  # fmt: skip
            push = Push(snap.version, snap.sha256, tuple(per_worker))
            self.last = push
            self.pushes += 1
            if not push.same_step:
                self.split_steps += 1
                log.error(
                    "flyserve engine channel: version %d reached the workers at different steps %s",
                    snap.version,
                    push.steps,
                )
            lines.append({"version": snap.version, "sha256": snap.sha256, "time": time.time(),
                          "answers": per_worker, "same_step": push.same_step})  # fmt: skip
        applied = sum(1 for a in answers for r in a["results"] if r.get("applied"))
        log.info(
            "flyserve engine channel: version(s) %d..%d pushed to %d worker(s) (%d applications), "
            "in force from step(s) %s",
            batch[0].version,
            batch[-1].version,
            len(answers),
            applied,
            sorted({int(a.get("step", -1)) + 1 for a in answers}),
        )
        await asyncio.to_thread(self._record, lines)

    def _record(self, lines: list[dict[str, Any]]) -> None:
        try:
            path = pushes_path(self.state_dir)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
        except OSError as exc:
            log.error("flyserve engine channel: cannot record a push: %s", exc)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        last = self.last
        return {
            "mode": ENGINE_CHANNEL,
            "pid": os.getpid(),
            "time": time.time(),
            "pushed_version": self.pushed_version,
            "pushes": self.pushes,
            "split_steps": self.split_steps,
            "errors": self.errors,
            "last_error": self.last_error,
            "workers": [] if last is None else list(last.answers),
        }

    def write_status(self) -> None:
        self._status_at = time.monotonic()
        try:
            atomic_write(status_path(self.state_dir), json.dumps(self.status(), sort_keys=True))
        except OSError as exc:
            log.error("flyserve engine channel: cannot write its status: %s", exc)

    # ------------------------------------------------------------------ the task

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Poll and push until ``stop`` is set (or the task is cancelled with the server's loop)."""
        stop = stop or asyncio.Event()
        backoff = self.poll_s
        while not stop.is_set():
            try:
                await self.sync_once()
                backoff = self.poll_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving; retry with a growing pause
                self.errors += 1
                self.last_error = str(exc)[:300]
                log.error(
                    "flyserve engine channel: push failed (%s); retrying in %.2f s", self.last_error, backoff
                )
                await asyncio.to_thread(self.write_status)
                backoff = min(RETRY_MAX_S, backoff * 2)
            if time.monotonic() - self._status_at >= STATUS_EVERY_S:
                await asyncio.to_thread(self.write_status)
            try:
                await asyncio.wait_for(stop.wait(), timeout=backoff)
            except TimeoutError:
                pass
