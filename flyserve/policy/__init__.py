"""The pure decision core: which kernel path runs a batch, and why.

numpy, pydantic and PyYAML only; nothing here imports torch, vllm or anything above it
(control, telemetry, sidecar, vllm, lab all import this package, never the reverse), and nothing
here reads a file: flyserve.thresholds_files finds and reads profiles and hands policy the bytes.
"""

from flyserve.policy.rules import Decision, decide, decision_for
from flyserve.policy.shape import BatchShape
from flyserve.policy.thresholds import Thresholds, ThresholdsError
from flyserve.policy.vocabulary import (
    ADMITTED,
    CIRCUIT_OPEN,
    CONTEXT_TOO_LONG,
    DISABLED,
    LOW_OCCUPANCY,
    NO_PREFILL_ROWS,
    NOT_CAUSAL,
    PATHS,
    PREFILL,
    REASONS,
    SHORT_CONTEXT,
    TOO_MANY_DECODE_ROWS,
    UNIFIED,
    UNSUPPORTED,
)

__all__ = [
    "ADMITTED",
    "CIRCUIT_OPEN",
    "CONTEXT_TOO_LONG",
    "DISABLED",
    "LOW_OCCUPANCY",
    "NOT_CAUSAL",
    "NO_PREFILL_ROWS",
    "PATHS",
    "PREFILL",
    "REASONS",
    "SHORT_CONTEXT",
    "TOO_MANY_DECODE_ROWS",
    "UNIFIED",
    "UNSUPPORTED",
    "BatchShape",
    "Decision",
    "Thresholds",
    "ThresholdsError",
    "decide",
    "decision_for",
]
