"""Cost tables and the cost model: they live in flyserve.pricing (the sidecar prices live
traffic with them and imports nothing from lab); re-exported here for lab code and scripts."""

from flyserve.pricing.costs import (
    KINDS,
    CostEntry,
    CostModel,
    CostTable,
    CostTableError,
    available_costs,
    costs_dirs,
    load_costs,
)

__all__ = [
    "KINDS",
    "CostEntry",
    "CostModel",
    "CostTable",
    "CostTableError",
    "available_costs",
    "costs_dirs",
    "load_costs",
]
