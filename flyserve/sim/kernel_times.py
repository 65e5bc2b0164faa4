"""The kernel times a simulated rank reports, without a kernel to time.

Two numbers per step, from two cost tables that may disagree:

* the *modelled* time: the pricing table's (``--costs``) price of the batch on the path it ran,
  times ``--drift``; every shape sample carries it (a model, labelled so in docs/operations.md),
  as the sidecar prices with that same table;
* the *measured* time, on the steps the GPU timer would time (one in ``--kernel-timer-every``): what
  ``flyserve_kernel_seconds{path,rank}`` gets. It is the truth table's (``--truth-costs``, default:
  the pricing table) price times ``--drift``, times lognormal noise of mean 1 and coefficient of
  variation ``--noise-cv``. A truth table other than the pricing table plants advice that
  measurement refutes: the sidecar prices a candidate with one table, the timer measures another.

With the defaults (no truth table, no noise) the measured time is the modelled one, bit for bit.
The noise comes from a numpy Generator seeded with (``--noise-seed``, rank): a run is
reproducible, ranks draw independent streams, and a restarted rank starts its stream again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from flyserve.pricing.costs import CostEntry, CostModel, CostTable, CostTableError, load_costs

NOISE_CV_MAX = 1.0
"""The largest --noise-cv: a kernel whose time varies by more than its mean is not a timing."""
NOISE_SEED_MAX = (1 << 64) - 1
_LAYER_FIELDS = ("num_heads", "num_kv_heads", "head_size")
"""The meta fields that say which attention layer a table prices: a truth table must price the same."""


def lognormal_params(cv: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with mean 1 and coefficient of variation ``cv``:
    sigma^2 = log(1 + cv^2), mu = -sigma^2 / 2 (then E = exp(mu + sigma^2/2) = 1)."""
    var = math.log1p(cv * cv)
    return -var / 2.0, math.sqrt(var)


class MeasurementNoise:
    """Multiplicative noise of a measured kernel time: lognormal, mean 1, coefficient of variation
    ``cv``, drawn one factor at a time from a Generator seeded with (seed, stream)."""

    def __init__(self, cv: float, seed: int, stream: int = 0) -> None:
        self.cv = cv
        self.mu, self.sigma = lognormal_params(cv)
        self._rng = np.random.default_rng([seed, stream])

    def factor(self) -> float:
        return float(self._rng.lognormal(self.mu, self.sigma))


def load_pricing(name_or_path: str) -> CostModel:
    """The --costs table's model; ValueError naming --costs (the loader refuses a missing file, a
    FIFO, a link to a device, a file over 16 MiB and any bad field, each by name)."""
    try:
        return CostModel(load_costs(name_or_path))
    except CostTableError as exc:
        raise ValueError(f"--costs: {exc}") from None


def load_truth(pricing: CostModel, name_or_path: str) -> CostModel:
    """The --truth-costs table's model at the pricing model's block size; ValueError naming
    --truth-costs, at start, if it cannot be read or prices what the pricing table does not."""
    try:
        table = load_costs(name_or_path)
        model = CostModel(table, block_size=pricing.block_size)
    except CostTableError as exc:
        raise ValueError(f"--truth-costs: {exc}") from None
    problem = truth_mismatch(pricing.table, table)
    if problem is not None:
        raise ValueError(f"--truth-costs: {problem}")
    return model


def truth_mismatch(pricing: CostTable, truth: CostTable) -> str | None:
    """Why ``truth`` cannot stand for the measurements of what ``pricing`` prices, or None.

    A truth table re-times the pricing table: the same layer (heads, KV heads, head size) and only
    shapes the pricing table has (kind, query and context lengths, block size). Every entry of a
    loaded table names each path once (the loader refuses any other path), so the paths agree."""
    for key in _LAYER_FIELDS:
        if truth.meta.get(key) != pricing.meta.get(key):
            return (
                f"table {truth.name!r} field 'meta.{key}' differs from cost table {pricing.name!r}: "
                "it would measure another layer than the one priced"
            )
    known = {_shape_key(pricing, e) for e in pricing.entries}
    for i, e in enumerate(truth.entries):
        if _shape_key(truth, e) not in known:
            return (
                f"table {truth.name!r} entries[{i}] is a shape (kind, query_lens, seq_lens, block_size) "
                f"cost table {pricing.name!r} does not have: a truth table re-times the pricing table's shapes"
            )
    return None


def _shape_key(table: CostTable, e: CostEntry) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    return (e.kind, e.query_lens, e.seq_lens, table.block_size_of(e))


class KernelTimes:
    """One rank's modelled and measured kernel times (see the module docstring)."""

    def __init__(
        self,
        pricing: CostModel,
        *,
        truth: CostModel | None = None,
        drift: Mapping[str, float] | None = None,
        noise: MeasurementNoise | None = None,
    ) -> None:
        self.pricing = pricing
        self.truth = truth
        self.drift = dict(drift or {})
        self.noise = noise

    def modelled(self, query_lens: np.ndarray, seq_lens: np.ndarray, path: str) -> float:
        """The pricing table's seconds for this batch on ``path``, times the planted drift."""
        return self.pricing.predict(query_lens, seq_lens, path) * self.drift.get(path, 1.0)

    def measured(self, query_lens: np.ndarray, seq_lens: np.ndarray, path: str, modelled: float) -> float:
        """What the GPU timer would measure: the truth table's seconds (``modelled`` when there is
        none: no second prediction), times the drift, times one noise factor."""
        if self.truth is None:
            t = modelled
        else:
            t = self.truth.predict(query_lens, seq_lens, path) * self.drift.get(path, 1.0)
        return t if self.noise is None else t * self.noise.factor()
