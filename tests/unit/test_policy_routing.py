"""flyserve.policy.routing: the one route-and-price loop (live costs, restart advice, replay, fit)."""

from __future__ import annotations

import pytest

from flyserve.policy import PREFILL, UNIFIED, decide
from flyserve.policy.routing import Rows, decisions_under, paths_under, routed_seconds
from flyserve.thresholds_files import load_profile


def test_paths_are_decides_own_and_depend_on_the_thresholds():
    t = load_profile("gfx950")
    batches = [Rows([4096], 4096, 32), Rows([1] * 8, 300, 32), Rows([512, 1, 1], 512, 32)]
    direct = [decide(b.shape(t), t) for b in batches]
    assert decisions_under(batches, t) == direct
    assert paths_under(batches, t) == [d.path for d in direct]
    off = t.merged({"prefill_enabled": False})
    assert paths_under(batches, off) == [UNIFIED] * 3
    assert PREFILL in paths_under(batches, t)  # the long prefill qualifies under the seed's thresholds


def test_routed_seconds_takes_each_batchs_price_on_its_path():
    prices = [(1.0, 0.25), (2.0, 8.0), (0.5, 0.125)]
    assert routed_seconds(prices, [PREFILL, UNIFIED, PREFILL]) == 0.25 + 2.0 + 0.125
    assert routed_seconds(prices, [UNIFIED] * 3) == 3.5
    with pytest.raises(ValueError):
        routed_seconds(prices, [UNIFIED])  # a path per price, or it is not a routing
