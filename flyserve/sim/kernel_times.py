"""The kernel times a simulated rank reports, without a kernel to time: the cost table's (``--costs``)
price of each step's batch on the path it ran, times ``--drift``. Every shape sample carries it (a
model, labelled so in docs/operations.md), and with ``--kernel-timer-every N`` one step in N also
puts it into ``flyserve_kernel_seconds{path,rank}``, where the GPU timer puts a measured one."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from flyserve.pricing.costs import CostModel, CostTableError, load_costs


def load_pricing(name_or_path: str) -> CostModel:
    """The --costs table's model; ValueError naming --costs (the loader refuses a missing file, a
    FIFO, a link to a device, a file over 16 MiB and any bad field, each by name)."""
    try:
        return CostModel(load_costs(name_or_path))
    except CostTableError as exc:
        raise ValueError(f"--costs: {exc}") from None


class KernelTimes:
    """One rank's modelled and measured kernel times (see the module docstring)."""

    def __init__(self, pricing: CostModel, *, drift: Mapping[str, float] | None = None) -> None:
        self.pricing = pricing
        self.drift = dict(drift or {})

    def modelled(self, query_lens: np.ndarray, seq_lens: np.ndarray, path: str) -> float:
        """The cost table's seconds for this batch on ``path``, times the planted drift."""
        return self.pricing.predict(query_lens, seq_lens, path) * self.drift.get(path, 1.0)

    def measured(self, query_lens: np.ndarray, seq_lens: np.ndarray, path: str, modelled: float) -> float:
        """What the GPU timer would measure: the modelled time itself."""
        return modelled
