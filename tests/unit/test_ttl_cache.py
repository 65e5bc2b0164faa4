"""TtlCache.invalidate() while a refresh is running: the refresh began before the change (a PATCH of
the thresholds), so what it computed is the old payload and must not be stored as fresh. Before, it
was stored with a new timestamp and /dispatch-stats showed the previous version for TTL + max_stale."""

from __future__ import annotations

import threading

from flyserve.sidecar.cache import TtlCache


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Source:
    """A compute that reads the current payload at its start, then blocks until released."""

    def __init__(self) -> None:
        self.payload = "v1"
        self.block = False
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> str:
        seen = self.payload
        if self.block:
            self.started.set()
            assert self.release.wait(5.0), "test never released the compute"
        return seen


def test_a_refresh_running_across_invalidate_does_not_store_the_old_payload() -> None:
    clock, src = _Clock(), _Source()
    cache: TtlCache[str] = TtlCache(src, ttl_s=1.0, clock=clock, max_stale_s=5.0)
    assert cache.get() == "v1"
    clock.t += 0.9  # past half the TTL: the background refresher recomputes
    src.block = True
    refresher = threading.Thread(target=cache.refresh_if_used, args=(10.0,))
    refresher.start()
    try:
        assert src.started.wait(5.0)
        src.payload = "v2"  # the PATCH lands while the refresh holds the old payload
        cache.invalidate()
    finally:
        src.release.set()
        refresher.join(5.0)
    assert not refresher.is_alive()
    src.block = False
    assert cache.get() == "v2"  # not the stale "v1" the refresh computed before the change


def test_a_get_running_across_invalidate_returns_its_value_but_does_not_store_it() -> None:
    clock, src = _Clock(), _Source()
    cache: TtlCache[str] = TtlCache(src, ttl_s=1.0, clock=clock)
    src.block = True
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(cache.get()))
    reader.start()
    try:
        assert src.started.wait(5.0)
        src.payload = "v2"
        cache.invalidate()
    finally:
        src.release.set()
        reader.join(5.0)
    assert got == ["v1"]  # the caller that asked before the change gets what it computed
    src.block = False
    assert cache.get() == "v2"


def test_without_invalidate_the_value_is_reused_within_the_ttl() -> None:
    clock, src = _Clock(), _Source()
    cache: TtlCache[str] = TtlCache(src, ttl_s=1.0, clock=clock)
    assert cache.get() == "v1"
    src.payload = "v2"
    clock.t += 0.5
    assert cache.get() == "v1"  # cached: the generation check stores an unchanged generation's value
    cache.invalidate()
    assert cache.get() == "v2"
