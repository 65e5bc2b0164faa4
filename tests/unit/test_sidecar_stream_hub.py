"""StreamHub: one payload computation per tick however many SSE clients wait on it."""

from __future__ import annotations

import asyncio

import pytest

from flyserve.sidecar.stream import StreamHub, StreamsFull


def test_many_clients_share_one_computation_per_tick() -> None:
    calls: list[int] = []

    def compute() -> bytes:
        calls.append(1)
        return f"payload {len(calls)}".encode()

    async def scenario() -> list[list[int]]:
        hub = StreamHub(compute, tick_s=0.05, max_streams=50)
        seen: list[list[int]] = []

        async def client() -> None:
            mine, last = [], 0
            for _ in range(3):
                got = None
                while got is None:
                    got = await hub.next(last, timeout_s=5)
                last = got[0]
                mine.append(last)
            seen.append(mine)

        for _ in range(40):
            hub.subscribe()
        await asyncio.gather(*(client() for _ in range(40)))
        for _ in range(40):
            hub.unsubscribe()
        return seen

    seen = asyncio.run(scenario())
    assert len(seen) == 40 and all(s == sorted(set(s)) for s in seen)
    # 40 clients x 3 events, but payloads are computed per tick, not per client
    assert len(calls) <= max(max(s) for s in seen) + 1 < 40


def test_streams_over_the_cap_are_refused_and_slots_come_back() -> None:
    async def scenario() -> None:
        hub = StreamHub(lambda: b"x", tick_s=0.05, max_streams=2)
        hub.subscribe()
        hub.subscribe()
        with pytest.raises(StreamsFull):
            hub.subscribe()
        hub.unsubscribe()
        hub.subscribe()  # a slot came back
        hub.unsubscribe()
        hub.unsubscribe()
        assert hub.clients == 0

    asyncio.run(scenario())
