"""Cost of the per-step policy work on a 256-row batch, beside a bare np.diff of the same array.

Run: .venv/bin/python -m pytest benchmarks/test_bench_policy.py --benchmark-enable
The ratio (shape + decide) / np.diff is what docs/performance.md quotes; absolute CPU times
on this 2-core VM are indicative only.
"""

from __future__ import annotations

import numpy as np
import pytest

from flyserve.policy import BatchShape, decide
from flyserve.thresholds_files import load_profile

SEED = load_profile("gfx950")
# A chunked-prefill step: 248 decode rows, then 8 prefill chunks of 1024 tokens.
_LENS = np.array([1] * 248 + [1024] * 8, dtype=np.int32)
QSL = np.concatenate([[0], np.cumsum(_LENS)]).astype(np.int32)


@pytest.mark.benchmark(group="policy-256-rows")
def test_bare_np_diff(benchmark):
    assert np.array_equal(benchmark(np.diff, QSL), _LENS)


@pytest.mark.benchmark(group="policy-256-rows")
def test_shape_from_query_start_loc(benchmark):
    shape = benchmark(
        lambda: BatchShape.from_query_start_loc(QSL, max_seq_len=61440, num_heads=16, thresholds=SEED)
    )
    assert shape == BatchShape.from_query_lens(_LENS, max_seq_len=61440, num_heads=16, thresholds=SEED)
    assert shape.num_actual_tokens == int(_LENS.sum())


@pytest.mark.benchmark(group="policy-256-rows")
def test_shape_plus_decide(benchmark):
    def step():
        return decide(
            BatchShape.from_query_start_loc(QSL, max_seq_len=61440, num_heads=16, thresholds=SEED), SEED
        )

    d = benchmark(step)
    assert d.path in ("prefill", "unified")


@pytest.mark.benchmark(group="policy-256-rows")
def test_decide_only(benchmark):
    s = BatchShape.from_query_start_loc(QSL, max_seq_len=61440, num_heads=16, thresholds=SEED)
    assert benchmark(decide, s, SEED) is decide(s, SEED)
