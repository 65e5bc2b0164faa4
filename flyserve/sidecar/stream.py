"""StreamHub: one /dispatch-stats payload per tick, shared by every SSE client.

When each SSE client computed (or fetched) its own payload on its own timer, with no floor on the
interval, three unauthenticated streams at ``?interval=0.000001`` held the sidecar at 99% CPU and
100 clients raised /dispatch-stats p99 from 4.6 ms to 201 ms. So one task computes the payload
every ``tick_s`` (the interval floor) while at least one client listens, clients wait on
it, and the number of concurrent streams is capped.

A cap alone let ``max_streams`` connections that never read hold every slot for good: each one's
send blocks once its buffers are full, and nothing ends it. So slots are reclaimed:

* on every tick, with or without new clients, a client whose write of an event has not completed
  within ``write_timeout_s`` is dropped ("stalled"), and so is one with more than
  ``max_queued_events`` events' worth of bytes queued and unsent on its connection ("backlog": the
  kernel's send buffer can hold megabytes, so a non-reader's writes may keep completing for minutes);
* at the cap, a new client takes the slot of a client that is not draining sooner than that: one
  whose write has waited over ``stall_s`` or with over ``lag_events`` events queued unsent, the
  most stalled first ("stalled");
* at the cap with no stalled client, a new client takes the slot of the oldest client that has held
  its slot for over ``lease_s`` ("lease"): clients that read but ask for ``?interval=3600`` (or do not
  read behind a large receive buffer) never look stalled, and would otherwise hold every slot for up
  to an hour. The ended client's stream closes; ``flyserve top`` reconnects (once a second);
* at the cap with no stalled client and none past its lease the new one is refused (StreamsFull:
  the route answers 503 with Retry-After), counted as "full". A stream within its lease that reads
  is never ended for a newcomer: evicting the oldest at once let a burst of new connections push out
  every healthy reader (``flyserve top`` starved);
* a dropped client's connection is aborted (the server's ``Connection``), which also wakes a send
  blocked on it, and the drop (or refusal) is counted (flyserve_sidecar_stream_reclaims_total).

Only slots taken with ``evictable=True`` are reclaimed: their holder ends itself once
``client.dropped`` is set (the route does). A slot taken without that is only ever given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from flyserve.telemetry import metrics as tm

log = logging.getLogger("flyserve.sidecar")

DEFAULT_WRITE_TIMEOUT_S = 10.0
"""An event's write that takes longer: the client has not read for that long with its buffers full."""
DEFAULT_MAX_QUEUED_EVENTS = 16
"""Events' worth of bytes queued unsent for one client (32 s of events at the default 2 s interval):
a reader this far behind is not keeping up; it is dropped and may reconnect."""
DEFAULT_STALL_S = 1.0
"""At the cap: a write waiting this long (never more than write_timeout_s) marks a client stalled,
whose slot a new client may take. A reader's write completes at once: the kernel takes the bytes."""
DEFAULT_LAG_EVENTS = 2
"""At the cap: more events' worth of bytes than this queued unsent (never more than
max_queued_events) marks a client stalled. A reader's queue is empty between events."""
DEFAULT_LEASE_S = 120.0
"""At the cap with no stalled client: a slot held longer than this may be taken by a new client
(the oldest first), so clients that read slowly (``?interval=3600``) cannot hold every slot for good."""
RECLAIM_REASONS = ("stalled", "backlog", "lease", "full")
"""stalled, backlog, lease: a stream ended to free its slot; full: a new stream refused (503), none
stalled and none past its lease."""
RECLAIM_LOG_EVERY_S = 10.0


class StreamsFull(Exception):
    """Every stream slot is taken and none can be reclaimed (the caller answers 503)."""


class Connection(Protocol):
    """What the hub may do to a stream's connection (flyserve.sidecar.server.stream_connection)."""

    def queued_bytes(self) -> int | None:
        """Bytes written to the connection and not yet taken by the client; None: unknown."""

    def abort(self) -> None:
        """Close the connection now, discarding what is queued (a blocked send returns)."""


@dataclass(eq=False, slots=True)
class StreamClient:
    """One stream's slot: when it opened, the write in progress, why the hub ended it."""

    opened_at: float
    evictable: bool
    connection: Connection | None = None
    writing_since: float | None = None
    event_bytes: int = 0
    dropped: str | None = None
    """The reclaim reason once the hub has ended this stream; its holder then stops."""

    def stalled_for(self, now: float) -> float:
        """Seconds its current write has been waiting (0 when none is)."""
        return 0.0 if self.writing_since is None else max(0.0, now - self.writing_since)

    def queued_events(self) -> float:
        """Events' worth of bytes queued unsent on its connection (0 when unknown)."""
        if self.connection is None or self.event_bytes <= 0:
            return 0.0
        try:
            queued = self.connection.queued_bytes()
        except Exception:  # noqa: BLE001 - a connection being torn down answers nothing useful
            return 0.0
        return 0.0 if queued is None else queued / self.event_bytes


class StreamHub:
    """Shared payload source for SSE clients. Lives on one event loop (the server's)."""

    def __init__(
        self,
        compute: Callable[[], bytes],
        *,
        tick_s: float,
        max_streams: int,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS,
        stall_s: float = DEFAULT_STALL_S,
        lag_events: float = DEFAULT_LAG_EVENTS,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compute = compute
        self.tick_s = float(tick_s)
        self.max_streams = int(max_streams)
        self.write_timeout_s = float(write_timeout_s)
        self.max_queued_events = int(max_queued_events)
        self.stall_s = min(float(stall_s), self.write_timeout_s)
        self.lag_events = min(float(lag_events), float(self.max_queued_events))
        if not float(lease_s) > 0:  # nan too
            raise ValueError(f"lease_s must be > 0 seconds, got {lease_s!r}")
        self.lease_s = float(lease_s)
        self._clock = clock
        self._slots: list[StreamClient] = []
        self.computed = 0  # payloads computed since start (benchmarks and tests read it)
        self.reclaimed = dict.fromkeys(RECLAIM_REASONS, 0)
        self._unlogged = dict.fromkeys(RECLAIM_REASONS, 0)
        self._logged_at = 0.0
        self._seq = 0
        self._payload = b""
        self._published: asyncio.Event | None = None  # set (and replaced) by each new payload
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def clients(self) -> int:
        """Slots taken now."""
        return len(self._slots)

    # ------------------------------------------------------------------ slots

    def subscribe(self, connection: Connection | None = None, *, evictable: bool = False) -> StreamClient:
        """Take a stream slot. At the cap, take a stalled client's, else the oldest one's past its
        lease (module docstring); raise StreamsFull (counted "full") when there is neither.
        ``connection``: what a drop aborts;
        ``evictable``: the holder ends itself once ``dropped`` is set, so the slot may be taken."""
        self.reap()
        if len(self._slots) >= self.max_streams:
            victim, reason = self._victim(), "stalled"
            if victim is None:
                victim, reason = self._lease_victim(), "lease"
            if victim is None:
                self._count("full")
                raise StreamsFull(
                    f"{self.max_streams} streams already open, none of them stalled or open over "
                    f"{self.lease_s:g} s"
                )
            self._drop(victim, reason)
        client = StreamClient(opened_at=self._clock(), evictable=evictable, connection=connection)
        self._slots.append(client)
        loop = asyncio.get_running_loop()
        if self._published is None or self._loop is not loop:  # a new event loop (a test client's portal)
            self._published, self._loop, self._task = asyncio.Event(), loop, None
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())
        return client

    def unsubscribe(self, client: StreamClient | None = None) -> None:
        """Give a slot back (``client``'s; without one, the newest slot that cannot be evicted).
        Giving back a slot the hub already reclaimed does nothing."""
        if client is None:
            client = next((c for c in reversed(self._slots) if not c.evictable), None)
            client = client or (self._slots[-1] if self._slots else None)
        if client is not None and client in self._slots:
            self._slots.remove(client)
        if not self._slots and self._task is not None:
            self._task.cancel()
            self._task = None

    def sending(self, client: StreamClient, size: int) -> None:
        """``client``'s event of ``size`` bytes is being written (call right before the yield)."""
        client.writing_since = self._clock()
        client.event_bytes = max(1, int(size))

    def sent(self, client: StreamClient) -> None:
        """The write ``sending`` announced has completed."""
        client.writing_since = None

    # ------------------------------------------------------------------ reclaiming

    def reap(self) -> int:
        """Drop every evictable client that is stalled or backlogged now; the number dropped."""
        now = self._clock()
        dropped = 0
        for c in list(self._slots):
            if not c.evictable:
                continue
            if c.stalled_for(now) > self.write_timeout_s:
                self._drop(c, "stalled")
            elif c.queued_events() > self.max_queued_events:
                self._drop(c, "backlog")
            else:
                continue
            dropped += 1
        return dropped

    def _victim(self) -> StreamClient | None:
        """The slot a new client may take at the cap: of the evictable clients that are stalled (a
        write waiting over ``stall_s``, or over ``lag_events`` queued unsent), the longest-waiting
        write, then the most events behind; None when none is stalled (a reader is never taken)."""
        now = self._clock()
        scored = [(c.stalled_for(now), c.queued_events(), c) for c in self._slots if c.evictable]
        stalled = [t for t in scored if t[0] > self.stall_s or t[1] > self.lag_events]
        return max(stalled, key=lambda t: (t[0], t[1]))[2] if stalled else None

    def _lease_victim(self) -> StreamClient | None:
        """The slot a new client may take at the cap when none is stalled: the evictable client that
        has held its slot the longest, if that is over ``lease_s``; None otherwise."""
        now = self._clock()
        expired = [c for c in self._slots if c.evictable and now - c.opened_at > self.lease_s]
        return min(expired, key=lambda c: c.opened_at) if expired else None

    def _drop(self, client: StreamClient, reason: str) -> None:
        """End ``client``'s stream: its slot is free at once, its connection aborted, the drop counted."""
        client.dropped = reason
        if client in self._slots:
            self._slots.remove(client)
        if client.connection is not None:
            with contextlib.suppress(Exception):
                client.connection.abort()
        self._count(reason)

    def _count(self, reason: str) -> None:
        """Count a drop or a refusal (flyserve_sidecar_stream_reclaims_total) and maybe log it."""
        self.reclaimed[reason] += 1
        tm.SIDECAR_STREAM_RECLAIMS.labels(reason).inc()
        self._log_reclaim(reason)

    def _log_reclaim(self, reason: str) -> None:
        """One summary line at most every RECLAIM_LOG_EVERY_S (a flood is many drops)."""
        self._unlogged[reason] += 1
        now = self._clock()
        if now - self._logged_at < RECLAIM_LOG_EVERY_S:
            return
        self._logged_at = now
        summary = ", ".join(f"{n} {r}" for r, n in self._unlogged.items() if n)
        self._unlogged = dict.fromkeys(RECLAIM_REASONS, 0)
        log.warning(
            "sidecar: stream slots reclaimed or new streams refused (%s): clients that do not read "
            "their stream, or more readers than --max-streams?",
            summary,
        )

    # ------------------------------------------------------------------ payloads

    async def next(self, after: int, timeout_s: float) -> tuple[int, bytes] | None:
        """The first payload with a sequence number above ``after`` (None after ``timeout_s``).

        It waits on an Event, never a lock: with an asyncio.Condition waited on through
        wait_for(), a stream's task cancelled inside it (its client gone, a reclaimed stream's
        task group cancelled) released the lock once too often ("Lock is not acquired"), and
        a lock left held the other way round would freeze every stream."""
        if self._seq <= after:
            assert self._published is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._published.wait(), timeout_s)
        return (self._seq, self._payload) if self._seq > after else None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._slots:
            started = loop.time()
            try:
                payload = await asyncio.to_thread(self._compute)
            except Exception:
                log.exception("stream payload failed")
            else:
                self.computed += 1
                assert self._published is not None
                self._seq += 1
                self._payload = payload
                self._published.set()  # wakes every waiter of this payload; later ones wait on the next
                self._published = asyncio.Event()
            self.reap()
            await asyncio.sleep(max(0.0, self.tick_s - (loop.time() - started)))
