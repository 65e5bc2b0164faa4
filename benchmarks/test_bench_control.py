"""Cost of RankControl.current(step) (the control plane's share of the per-step hot path), beside
a bare attribute read and the decide() call it precedes.

Run: .venv/bin/python -m pytest benchmarks/test_bench_control.py --benchmark-enable
Group control-per-step: the three side by side; the ratios current()/attribute and current()/decide
come from one run. Absolute CPU times on the 2-core CI VM are indicative only.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from flyserve.control import ControlPlane, RankControl
from flyserve.policy import BatchShape, decide


@pytest.fixture(scope="module")
def rank(tmp_path_factory: pytest.TempPathFactory) -> RankControl:
    state: Path = tmp_path_factory.mktemp("state")
    ControlPlane(state).apply_overrides({"min_seq_len": 2048}, actor="bench")
    return RankControl(state, 0, report=False)


class _Holder:
    def __init__(self, snap: object) -> None:
        self.snapshot = snap


@pytest.mark.benchmark(group="control-per-step")
def test_bare_attribute_read(benchmark, rank: RankControl) -> None:
    h = _Holder(rank.snapshot)
    assert benchmark(lambda: h.snapshot) is rank.snapshot


@pytest.mark.benchmark(group="control-per-step")
def test_rank_control_current(benchmark, rank: RankControl) -> None:
    steps = itertools.count()
    snap = benchmark(lambda: rank.current(next(steps)))
    assert snap.version == 1 and snap.thresholds.min_seq_len == 2048  # the published override


@pytest.mark.benchmark(group="control-per-step")
def test_decide_mixed_batch(benchmark, rank: RankControl) -> None:
    shape = BatchShape.from_query_lens([1] * 24 + [2048] * 4, max_seq_len=16384, num_heads=16)
    t = rank.snapshot.thresholds
    d = benchmark(lambda: decide(shape, t))
    assert d.path in ("prefill", "unified")
