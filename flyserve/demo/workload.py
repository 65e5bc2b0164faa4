"""What the demo's `vllm bench serve` offers: one frozen value, shared by the story (cli.py) and the
autopilot round (autopilot.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths, their spread, the arrivals' shape and how many run at once."""

    input_len: int = 160
    output_len: int = 12
    range_ratio: float = 0.8
    """Lengths uniform in [len * (1 - r), len * (1 + r)]: 32-288 prompt tokens by default."""
    burstiness: float = 1.0
    """1: Poisson arrivals; larger: more even."""
    max_concurrency: int = 8
