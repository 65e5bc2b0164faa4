"""The API-server side of the engine channel: watch the store, push each new version to every worker.

Runs as one asyncio task in vLLM's API server (flyserve.vllm.endpoint_plugin starts it). It stats
control/current.json every ``poll_s``; on a new version it pushes every version it has not pushed
yet, oldest first (intermediate ones from history, so no worker skips one), all in one collective
RPC. vLLM runs the RPC between two engine steps on every worker; each worker answers with its step,
so the pusher records the exact boundary and whether all workers agreed on it.

Data parallel: every engine is its own engine core with its own step counter, and vLLM's DP client
returns only the first engine's answer to a collective RPC. So ``rpc`` may answer per engine
(``{engine: [worker answers] | exception}``, what flyserve.vllm.endpoint_plugin gets by calling the
collective RPC on each engine core) and a version counts as pushed only when EVERY expected engine
confirmed it: each of its workers has it in force from one step (``from_step``, the engine's own
step). An engine that failed is retried with the whole batch; the engines that had applied it
answer "already applied" with the step they applied it at, so their confirmation stands. The
answers are bounded and grouped per engine by flyserve.vllm.channel_answers before they are judged.

What it leaves in the state directory (the sidecar and the tests read these; nothing else does):
  channel/status.json   mode, pid, time, last pushed version, counts, per engine: the version it
                        confirmed and from which step, its workers' last reports (rank, host, step,
                        applied version, dispatch counters: through the report RPC, so ranks on other
                        nodes are seen too), and the versions it has not confirmed yet
  channel/pushes.jsonl  one line per version once every engine confirmed it: version, sha256, time,
                        per engine {engine, from_step, same_step, workers}, and every worker's answer

No vLLM import here: ``rpc`` is any ``async (method, [json_doc, ...]) -> list[answer] | {engine:
[answer]}``, so the unit tests drive the pusher with an in-process fake and the e2e tests with the
real engine client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from flyserve.control.errors import ControlIOError
from flyserve.control.paths import StateDir
from flyserve.control.rank_modes import ENGINE_CHANNEL
from flyserve.control.snapshot import ConfigSnapshot
from flyserve.control.store import Store
from flyserve.control.trial_lease import LeaseKeeper
from flyserve.control.version_trust import live_anchor
from flyserve.files.atomic import atomic_write
from flyserve.vllm.channel_answers import Push, by_engine, small_answer, small_report
from flyserve.vllm.engine_channel import MAX_DOCS, METHOD

log = logging.getLogger("flyserve.vllm")

Rpc = Callable[[str, list[str]], Awaitable[Any]]
"""(method, docs) -> the workers' answers: a list (one engine, or grouped by each answer's "engine")
or {engine: [answers] | BaseException}."""
ReportRpc = Callable[[], Awaitable[Any]]
"""() -> every worker's REPORT_METHOD answer, in the same shapes as Rpc."""

DEFAULT_POLL_S = 0.05
"""A stat of current.json every 50 ms: a few microseconds of the API server's loop each time, and
a change reaches the workers within one poll plus one engine step."""
STATUS_EVERY_S = 5.0
LEASE_CHECK_EVERY_S = 1.0
"""How often the autopilot's lease is looked at while a trial is in force (control.trial_lease)."""
REPORT_EVERY_S = 2.0
"""One report RPC every 2 s: vLLM runs it between two steps on every worker (microseconds each)."""
RETRY_MAX_S = 5.0
PEER_STALE_AFTER_S = 30.0
"""A rank report older than this is no live rank the pusher anchors on before its first push (the
control plane's default rank_stale_after_s)."""


def channel_dir(state_dir: StateDir) -> Path:
    return state_dir.path / "channel"


def status_path(state_dir: StateDir) -> Path:
    return channel_dir(state_dir) / "status.json"


def pushes_path(state_dir: StateDir) -> Path:
    return channel_dir(state_dir) / "pushes.jsonl"


class ChannelPusher:
    """Watches one state directory and pushes versions through ``rpc``. One per API server."""

    def __init__(
        self,
        state_dir: StateDir | str | os.PathLike[str],
        rpc: Rpc,
        *,
        poll_s: float = DEFAULT_POLL_S,
        engines: tuple[int, ...] | None = None,
        report_rpc: ReportRpc | None = None,
        report_every_s: float = REPORT_EVERY_S,
    ):
        """``engines``: the engine indices every version must reach (the DP client's engines); None
        takes the engines of the first answer. ``report_rpc``: the workers' reports, every
        ``report_every_s`` seconds, for the engine view in status.json (None: no reports)."""
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
        self._refused: tuple[int, int, int] | None = None  # the last current.json refused (logged once)
        self._start_anchor: int | None = None  # what live ranks applied, read once before the first push
        self._start_anchor_read = False
        self._status_at = 0.0
        self.engines: tuple[int, ...] | None = tuple(sorted(set(engines))) if engines else None
        self.report_rpc = report_rpc
        self.report_every_s = float(report_every_s)
        self._report_at = 0.0
        # Per engine: (version, from_step) it last confirmed; its workers' last reports and when.
        self.confirmed: dict[int, tuple[int, int | None]] = {}
        self.reports: dict[int, list[dict[str, Any]]] = {}
        self.report_errors: dict[int, str] = {}
        self.reported_at = 0.0
        self.engine_errors: dict[int, str] = {}  # engines whose last push failed, and why
        # Versions pushed but not yet confirmed by every engine: {version: {engine: record}}
        self._partial: dict[int, dict[int, dict[str, Any]]] = {}
        self._trial_in_force = False  # the newest version pushed carries an autopilot trial
        self._lease_at = 0.0
        self._lease_keeper: LeaseKeeper | None = None

    # ------------------------------------------------------------------ one round

    def _current_key(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.state_dir.current_json)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _anchor(self) -> int | None:
        """The version current.json must continue (control.version_trust): the last one pushed once
        there is one (a forged jump is never pushed to the engines); before, the highest version the
        live confirmed ranks applied (read once), and with none the chain of history names (None)."""
        if self.pushed_version > 0:
            return self.pushed_version
        if not self._start_anchor_read:
            self._start_anchor_read = True
            try:
                now = time.time()
                self._start_anchor = live_anchor(
                    self.store.reports(now=now),
                    now=now,
                    stale_after_s=PEER_STALE_AFTER_S,
                    record=self.store.version_floor(),
                )
            except (OSError, ControlIOError) as exc:
                log.error("flyserve engine channel: cannot read the rank reports: %s", exc)
        return self._start_anchor

    def _to_push(self, key: tuple[int, int, int] | None = None) -> list[ConfigSnapshot] | None:
        """Versions above the last pushed one, oldest first; None if the store cannot be read now or
        current.json is not believed (logged once per ``key``, the file's stat)."""
        try:
            cur = self.store.read_current(anchor=self._anchor())
        except ControlIOError as exc:
            if key is None or key != self._refused:
                log.error("flyserve engine channel: %s; pushing nothing this round", exc)
            self._refused = key
            return None
        if cur is None or cur.version <= self.pushed_version:
            return []
        if self.pushed_version < 0:
            return [cur]
        # attached: fill the gap from history so no worker skips a version
        return self.store.versions_up_to(cur, after=self.pushed_version)

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
        snaps = await asyncio.to_thread(self._to_push, key)  # file reads stay off the server's loop
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
            self._trial_in_force = batch[-1].trial is not None
        self._seen = key
        if snaps:
            await asyncio.to_thread(self.write_status)
        return len(snaps)

    def _expected(self, groups: Mapping[int, Any]) -> tuple[int, ...]:
        if self.engines is None:
            self.engines = tuple(sorted(groups)) or (0,)
            log.info("flyserve engine channel: engines %s", list(self.engines))
        return self.engines

    async def _push(self, batch: list[ConfigSnapshot]) -> None:
        """Push ``batch`` to every engine; returns once every expected engine confirmed every version.
        Raises (the caller retries the batch) naming the engines that did not."""
        groups = by_engine(await self.rpc(METHOD, [s.to_json() for s in batch]))
        expected = self._expected(groups)
        failed: dict[int, str] = {}
        answered: dict[int, list[dict[str, Any]]] = {}
        for e in expected:
            g = groups.get(e)
            if g is None:
                failed[e] = "no answer"
            elif isinstance(g, str):
                failed[e] = g
            elif not g:
                failed[e] = "no worker answered"
            else:
                answers = [small_answer(a) for a in g]
                bad = [a for a in answers if "error" in a or "why" in a]
                if bad:
                    failed[e] = f"a worker refused the push: {bad[0]}"[:300]
                else:
                    answered[e] = answers
        for e, why in failed.items():
            self.engine_errors[e] = why
        if not batch:
            if failed:
                raise RuntimeError(
                    f"engine(s) {sorted(failed)} did not attach: {next(iter(failed.values()))}"
                )
            n = sum(len(a) for a in answered.values())
            log.info(
                "flyserve engine channel: attached to %d worker(s) of %d engine(s), nothing published yet",
                n,
                len(answered),
            )
            return
        lines = []
        for snap in batch:
            partial = self._partial.setdefault(snap.version, {})
            for e, answers in answered.items():
                if e in partial:
                    continue  # confirmed by an earlier round of this push; keep its first record
                rec = self._engine_record(e, snap, answers)
                if rec is None:
                    failed.setdefault(e, f"a worker of engine {e} did not confirm version {snap.version}")
                    continue
                partial[e] = rec
                self.confirmed[e] = (snap.version, rec["from_step"])
                self.engine_errors.pop(e, None)
                if not rec["same_step"]:
                    self.split_steps += 1
                    log.error(
                        "flyserve engine channel: version %d reached engine %d's workers at different steps %s",
                        snap.version,
                        e,
                        [w["from_step"] for w in rec["workers"]],
                    )
            if all(e in partial for e in expected):
                engines = [partial[e] for e in expected]
                self._partial.pop(snap.version, None)
                flat = [w for rec in engines for w in rec["workers"]]
                push = Push(snap.version, snap.sha256, tuple(flat))
                self.last = push
                self.pushes += 1
                lines.append({"version": snap.version, "sha256": snap.sha256, "time": time.time(),
                              "engines": engines, "answers": flat,
                              "same_step": all(r["same_step"] for r in engines)})  # fmt: skip
        if lines:
            log.info(
                "flyserve engine channel: version(s) %d..%d confirmed by %d engine(s), in force from "
                "step(s) %s",
                lines[0]["version"],
                lines[-1]["version"],
                len(expected),
                {r["engine"]: r["from_step"] for r in lines[-1]["engines"]},
            )
            await asyncio.to_thread(self._record, lines)
        if failed:
            first = min(failed)
            raise RuntimeError(f"engine(s) {sorted(failed)} did not confirm: engine {first}: {failed[first]}")

    def _engine_record(
        self, engine: int, snap: ConfigSnapshot, answers: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """One engine's confirmation of ``snap``, or None when a worker does not have it in force."""
        workers = []
        for a in answers:
            r = next((r for r in a["results"] if r.get("version") == snap.version), None)
            if r is None:
                return None
            confirmed = r.get("applied") or r.get("why") == "already applied"
            if not confirmed or r.get("from_step") is None and not r.get("applied"):
                return None
            from_step = r.get("from_step")
            if from_step is None:  # an older worker's answer: applied from its next step
                from_step = int(a.get("step", -1)) + 1
            workers.append({"rank": a.get("rank"), "engine": engine, "host": a.get("host"),
                            "step": a.get("step"), "from_step": from_step,
                            "applied": r.get("applied"), "why": r.get("why")})  # fmt: skip
        steps = {w["from_step"] for w in workers}
        return {
            "engine": engine,
            "from_step": min(steps),
            "same_step": len(steps) == 1,
            "workers": workers,
        }

    def unconfirmed(self) -> dict[int, list[int]]:
        """{engine: versions pushed to it that it has not confirmed}, engines with none left out."""
        out: dict[int, list[int]] = {}
        for v, partial in sorted(self._partial.items()):
            for e in self.engines or ():
                if e not in partial:
                    out.setdefault(e, []).append(v)
        return out

    # ------------------------------------------------------------------ reports

    async def report_once(self) -> int:
        """Ask every worker for its report (REPORT_METHOD); the number of workers that answered."""
        if self.report_rpc is None:
            return 0
        self._report_at = time.monotonic()
        groups = by_engine(await self.report_rpc())
        reports: dict[int, list[dict[str, Any]]] = {}
        errors: dict[int, str] = {}
        for e in sorted(set(groups) | set(self.engines or ())):
            g = groups.get(e)
            if g is None or isinstance(g, str):
                errors[e] = g or "no answer"
                continue
            reports[e] = [small_report(a) for a in g]
        self.reports, self.report_errors, self.reported_at = reports, errors, time.time()
        return sum(len(r) for r in reports.values())

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
            "engines": self.engine_view(),
            "unconfirmed": {str(e): v for e, v in self.unconfirmed().items()},
            "reported_at": self.reported_at or None,
        }

    def engine_view(self) -> list[dict[str, Any]]:
        """Per engine: the version it confirmed last and from which step, the versions it has not
        confirmed, its last push error, and its workers' last reports (through the engine channel)."""
        unconfirmed = self.unconfirmed()
        out = []
        for e in sorted(set(self.engines or ()) | set(self.reports) | set(self.confirmed)):
            version, from_step = self.confirmed.get(e, (None, None))
            out.append({
                "engine": e,
                "confirmed_version": version,
                "from_step": from_step,
                "unconfirmed": unconfirmed.get(e, []),
                "error": self.engine_errors.get(e) or self.report_errors.get(e),
                "workers": self.reports.get(e, []),
            })  # fmt: skip
        return out

    def write_status(self) -> None:
        self._status_at = time.monotonic()
        try:
            atomic_write(status_path(self.state_dir), json.dumps(self.status(), sort_keys=True))
        except OSError as exc:
            log.error("flyserve engine channel: cannot write its status: %s", exc)

    def end_trial_if_lease_expired(self) -> int | None:
        """The autopilot's lease (control.trial_lease), kept here with the engine channel: a trial in
        force whose sidecar stopped renewing it is published again without the trial; the next poll
        pushes that version to every worker at one step. The new version, or None."""
        if self._lease_keeper is None:
            self._lease_keeper = LeaseKeeper(self.state_dir)
        return self._lease_keeper.check()  # never raises, never waits long for the writers' lock

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
            if self.report_rpc is not None and time.monotonic() - self._report_at >= self.report_every_s:
                try:
                    await self.report_once()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - reports are observability only
                    self.report_errors = {e: str(exc)[:300] for e in self.engines or (0,)}
                await asyncio.to_thread(self.write_status)
            if self._trial_in_force and time.monotonic() - self._lease_at >= LEASE_CHECK_EVERY_S:
                self._lease_at = time.monotonic()
                await asyncio.to_thread(self.end_trial_if_lease_expired)
            if time.monotonic() - self._status_at >= STATUS_EVERY_S:
                await asyncio.to_thread(self.write_status)
            try:
                await asyncio.wait_for(stop.wait(), timeout=backoff)
            except TimeoutError:
                pass
