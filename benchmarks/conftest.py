"""The benchmarks run in two modes.

* Quick (CI, the default ``--benchmark-disable`` of pyproject.toml): pytest-benchmark calls each
  function once. The ``benchmark`` fixture below first makes one plain call and asserts that the
  benchmarked call returns the same, so a benchmark measures the function it claims to, and a broken
  one fails CI instead of timing an exception path.
* Measured (``scripts/run_benchmarks.py``, ``--benchmark-enable``): the same checks, then rounds.

``benchmark.assert_effect_per_call(delta)`` checks an effect each call adds once (a counter): in quick
mode it must equal the number of calls, the plain one included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _support import fast_tier_guard  # tests/ is on pythonpath (pyproject.toml)
from pytest_benchmark.fixture import BenchmarkFixture


def same(a: Any, b: Any) -> bool:
    """Equality that also holds for numpy arrays and tuples of them."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class CheckedBenchmark(BenchmarkFixture):
    """pytest-benchmark's fixture, with one plain reference call checked against the benchmarked one.

    A subclass (pytest-benchmark accepts only its own fixture type), switched in on the fixture object
    pytest-benchmark built, so every option and the results table stay its own."""

    calls: int | None

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        expected = fn(*args, **kwargs)
        if self.disabled:  # quick mode: one call, counted (a counting wrapper would skew real rounds)

            def counted(*a: Any, **kw: Any) -> Any:
                self.calls = (self.calls or 0) + 1
                return fn(*a, **kw)

            self.calls = 1  # the plain call above
            got = super().__call__(counted, *args, **kwargs)
        else:
            self.calls = None  # pytest-benchmark's rounds, warm-up and calibration: not counted
            got = super().__call__(fn, *args, **kwargs)
        assert same(got, expected), f"benchmarked call returned {got!r}, the plain call {expected!r}"
        return got

    def assert_effect_per_call(self, delta: float) -> None:
        """An effect that every call adds once (a counter): exactly once per call in quick mode, and at
        least the plain call plus one benchmarked call when measured."""
        if self.calls is not None:
            assert delta == self.calls, (delta, self.calls)
        else:
            assert delta >= 2, delta


@pytest.fixture
def benchmark(benchmark: BenchmarkFixture) -> CheckedBenchmark:
    benchmark.__class__ = CheckedBenchmark
    benchmark.calls = 0
    return benchmark  # type: ignore[return-value]


# The benchmarks are in the fast tier (pytest -m "not slow"); tests/conftest.py's guard, here too: one
# that starts a subprocess or connects a socket fails unless marked slow.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with fast_tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with fast_tier_guard(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with fast_tier_guard(item):
        return (yield)
