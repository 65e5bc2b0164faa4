"""Stream slots held by clients that do not read come back: a stalled write or a backlog drops the
client (its connection aborted, the drop counted); at the cap a new client takes the slot of the
most-stalled client (a write waiting over stall_s, or over lag_events queued), and with none stalled
it takes the slot of the oldest client open over lease_s (counted "lease"); with neither it is
refused (counted "full"): a client that reads is never ended for a newcomer within its lease.

The same against the real server and raw sockets: tests/integration/test_sidecar_stalled_streams_live.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from flyserve.sidecar.stream import StreamClient, StreamHub, StreamsFull
from flyserve.telemetry import metrics as tm


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeConnection:
    """What flyserve.sidecar.server.StreamConnection offers the hub, with a settable queue."""

    def __init__(self, queued: int | None = 0) -> None:
        self.queued = queued
        self.aborted = 0

    def queued_bytes(self) -> int | None:
        return self.queued

    def abort(self) -> None:
        self.aborted += 1


def _run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())


def _reclaims(reason: str) -> float:
    return tm.SIDECAR_STREAM_RECLAIMS.labels(reason)._value.get()


def _hub(clock: Clock, **kw: Any) -> StreamHub:
    kw = {"tick_s": 0.05, "max_streams": 4, "write_timeout_s": 5.0, "max_queued_events": 4} | kw
    return StreamHub(lambda: b"x" * 100, clock=clock, **kw)


def test_a_write_that_does_not_complete_in_time_drops_the_client() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock)
        conn = FakeConnection()
        stuck = hub.subscribe(conn, evictable=True)
        reading = hub.subscribe(FakeConnection(), evictable=True)
        before = _reclaims("stalled")
        hub.sending(stuck, 120)
        hub.sending(reading, 120)
        hub.sent(reading)  # its write completed
        clock.t += 4.9
        assert hub.reap() == 0 and stuck.dropped is None  # within the bound
        clock.t += 0.2
        assert hub.reap() == 1
        assert stuck.dropped == "stalled" and reading.dropped is None
        assert conn.aborted == 1 and hub.clients == 1 and hub.reclaimed["stalled"] == 1
        assert _reclaims("stalled") == before + 1
        hub.unsubscribe(stuck)  # its generator's finally: the slot is already free, nothing changes
        assert hub.clients == 1
        hub.unsubscribe(reading)
        assert hub.clients == 0

    _run(scenario)


def test_too_many_events_queued_unsent_drops_the_client() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock)
        behind, fine = FakeConnection(), FakeConnection()
        a = hub.subscribe(behind, evictable=True)
        b = hub.subscribe(fine, evictable=True)
        for c in (a, b):  # both writes complete (the kernel took the bytes) ...
            hub.sending(c, 1000)
            hub.sent(c)
        behind.queued, fine.queued = 4 * 1000 + 1, 3 * 1000  # ... but only one client reads them
        assert hub.reap() == 1
        assert (a.dropped, b.dropped) == ("backlog", None) and behind.aborted == 1 and fine.aborted == 0
        hub.unsubscribe(b)

    _run(scenario)


def _full_hub(clock: Clock) -> tuple[StreamHub, list[StreamClient], list[FakeConnection]]:
    hub = _hub(clock, max_streams=3)
    conns = [FakeConnection() for _ in range(3)]
    clients = []
    for c in conns:
        clients.append(hub.subscribe(c, evictable=True))
        clock.t += 1.0
    return hub, clients, conns


def test_at_the_cap_a_new_client_takes_the_most_stalled_streams_slot() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub, (oldest, mid, newest), conns = _full_hub(clock)
        before = _reclaims("stalled")
        hub.sending(newest, 100)
        clock.t += 1.0
        hub.sending(mid, 100)  # stalled too, for less long
        clock.t += 1.5  # both past stall_s (1 s), neither past write_timeout_s (5 s)
        fresh = hub.subscribe(FakeConnection(), evictable=True)
        assert newest.dropped == "stalled" and conns[2].aborted == 1
        assert oldest.dropped is None and mid.dropped is None and fresh.dropped is None
        assert hub.clients == 3 and _reclaims("stalled") == before + 1

    _run(scenario)


def test_at_the_cap_a_client_lagging_past_lag_events_is_stalled_and_the_most_behind_goes() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub, (oldest, mid, newest), conns = _full_hub(clock)
        for c in (oldest, mid, newest):
            hub.sending(c, 100)
            hub.sent(c)
        conns[0].queued, conns[1].queued = 250, 350  # 2.5 and 3.5 events behind: past lag_events (2)
        hub.subscribe(FakeConnection(), evictable=True)
        assert mid.dropped == "stalled" and oldest.dropped is None and newest.dropped is None

    _run(scenario)


def test_at_the_cap_with_every_client_reading_a_new_client_is_refused_and_counted_full() -> None:
    """The old policy evicted the oldest here: a burst of new clients pushed out every reader."""

    async def scenario() -> None:
        clock = Clock()
        hub, clients, conns = _full_hub(clock)
        for c in clients:
            hub.sending(c, 100)
            hub.sent(c)
        conns[0].queued = 200  # two events not yet acknowledged: at lag_events, not past it
        hub.sending(clients[1], 100)  # a write in progress, for under stall_s
        clock.t += 0.9
        before = _reclaims("full")
        for _ in range(10):
            with pytest.raises(StreamsFull):
                hub.subscribe(FakeConnection(), evictable=True)
        assert all(c.dropped is None for c in clients) and not any(c.aborted for c in conns)
        assert hub.clients == 3 and hub.reclaimed["full"] == 10 and _reclaims("full") == before + 10
        clock.t += 0.2  # clients[1]'s write has now waited past stall_s: its slot may be taken
        hub.subscribe(FakeConnection(), evictable=True)
        assert clients[1].dropped == "stalled" and hub.clients == 3

    _run(scenario)


def test_at_the_cap_slots_that_cannot_be_evicted_are_never_taken() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock, max_streams=1)
        held = hub.subscribe()
        hub.sending(held, 100)
        clock.t += 4.0  # stalled, but its holder does not end itself on ``dropped``
        with pytest.raises(StreamsFull):
            hub.subscribe(FakeConnection(), evictable=True)
        assert held.dropped is None

    _run(scenario)


def test_the_hub_reclaims_on_its_own_tick_without_a_new_client() -> None:
    async def scenario() -> None:
        hub = StreamHub(lambda: b"payload", tick_s=0.02, max_streams=4, write_timeout_s=0.1)
        conn = FakeConnection()
        stuck = hub.subscribe(conn, evictable=True)
        keeper = hub.subscribe(FakeConnection(), evictable=True)  # keeps the hub's task running
        hub.sending(stuck, 10)
        for _ in range(100):  # bounded: 2 s at most
            if stuck.dropped is not None:
                break
            await asyncio.sleep(0.02)
        assert stuck.dropped == "stalled" and conn.aborted == 1 and hub.clients == 1
        hub.unsubscribe(keeper)
        assert hub.clients == 0

    _run(scenario)


def test_a_connection_that_cannot_say_its_queue_is_judged_by_its_writes_alone() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock)
        c = hub.subscribe(FakeConnection(queued=None), evictable=True)
        hub.sending(c, 100)
        hub.sent(c)
        clock.t += 3600.0
        assert hub.reap() == 0 and c.dropped is None
        hub.unsubscribe(c)

    _run(scenario)


def _reading(hub: StreamHub, clients: list[StreamClient]) -> None:
    """Every client's last write completed and nothing queued: none of them is stalled."""
    for c in clients:
        hub.sending(c, 100)
        hub.sent(c)


def test_at_the_cap_with_none_stalled_the_oldest_stream_past_its_lease_is_taken_counted_lease() -> None:
    """Readers at ?interval=3600 never look stalled: without a lease they held every slot for an hour."""

    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock, max_streams=3, lease_s=60.0)
        conns = [FakeConnection() for _ in range(3)]
        oldest = hub.subscribe(conns[0], evictable=True)
        clock.t += 10.0
        mid = hub.subscribe(conns[1], evictable=True)
        clock.t += 10.0
        newest = hub.subscribe(conns[2], evictable=True)
        _reading(hub, [oldest, mid, newest])
        clock.t += 50.5  # oldest open 70.5 s, mid 60.5 s: both past the lease; newest 50.5 s
        before, full_before = _reclaims("lease"), _reclaims("full")
        first = hub.subscribe(FakeConnection(), evictable=True)
        assert oldest.dropped == "lease" and conns[0].aborted == 1
        assert mid.dropped is None and newest.dropped is None and first.dropped is None
        second = hub.subscribe(FakeConnection(), evictable=True)  # the next oldest past its lease
        assert mid.dropped == "lease" and conns[1].aborted == 1 and newest.dropped is None
        assert hub.clients == 3 and hub.reclaimed["lease"] == 2 and hub.reclaimed["stalled"] == 0
        assert _reclaims("lease") == before + 2 and _reclaims("full") == full_before
        # newest (50.5 s) and the two newcomers (0 s) are within their lease: the next one is refused
        with pytest.raises(StreamsFull):
            hub.subscribe(FakeConnection(), evictable=True)
        assert newest.dropped is None and first.dropped is None and second.dropped is None

    _run(scenario)


def test_streams_within_their_lease_are_never_taken_the_newcomer_is_refused_full() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock, max_streams=2, lease_s=60.0)
        conns = [FakeConnection(), FakeConnection()]
        clients = [hub.subscribe(c, evictable=True) for c in conns]
        _reading(hub, clients)
        clock.t += 60.0  # exactly the lease: not past it
        before = _reclaims("full")
        for _ in range(5):
            with pytest.raises(StreamsFull, match="60 s"):
                hub.subscribe(FakeConnection(), evictable=True)
        assert all(c.dropped is None for c in clients) and not any(c.aborted for c in conns)
        assert hub.reclaimed["full"] == 5 and hub.reclaimed["lease"] == 0 and _reclaims("full") == before + 5

    _run(scenario)


def test_a_stalled_client_is_taken_before_one_past_its_lease() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock, max_streams=2, lease_s=60.0)
        old_conn, young_conn = FakeConnection(), FakeConnection()
        old = hub.subscribe(old_conn, evictable=True)
        _reading(hub, [old])
        clock.t += 100.0
        young = hub.subscribe(young_conn, evictable=True)
        hub.sending(young, 100)  # its write waits past stall_s, not past write_timeout_s
        clock.t += 2.0
        hub.subscribe(FakeConnection(), evictable=True)
        assert young.dropped == "stalled" and old.dropped is None and old_conn.aborted == 0
        assert hub.reclaimed["stalled"] == 1 and hub.reclaimed["lease"] == 0

    _run(scenario)


def test_slots_that_cannot_be_evicted_are_never_taken_for_their_lease() -> None:
    async def scenario() -> None:
        clock = Clock()
        hub = _hub(clock, max_streams=1, lease_s=1.0)
        held = hub.subscribe()
        clock.t += 3600.0
        with pytest.raises(StreamsFull):
            hub.subscribe(FakeConnection(), evictable=True)
        assert held.dropped is None

    _run(scenario)


@pytest.mark.parametrize("lease", [0.0, -1.0, float("nan")])
def test_a_lease_that_is_not_positive_is_refused(lease: float) -> None:
    with pytest.raises(ValueError, match="lease_s must be > 0"):
        StreamHub(lambda: b"", tick_s=0.1, max_streams=1, lease_s=lease)
