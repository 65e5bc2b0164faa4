"""The stable vocabulary of paths and reasons.

These strings are Prometheus label values and dashboard legends: renaming one is a
breaking change for every operator's alerts. Add new ones at the end; never rename.
"""

from typing import Final

UNIFIED: Final = "unified"
"""The general kernel: AITER unified attention on gfx950, TRITON_ATTN on CUDA."""
PREFILL: Final = "prefill"
"""The causal prefill specialist: FlyDSL dualwave on gfx950, FLASH_ATTN (FA3) on CUDA."""

PATHS: Final = (UNIFIED, PREFILL)

# The path's child index inside a vLLM composite backend.
VARIANT: Final = {UNIFIED: 0, PREFILL: 1}

NO_PREFILL_ROWS: Final = "no_prefill_rows"
"""max_query_len < min_query_len: the batch takes decode_path (the CUDA-graph variant)."""
DISABLED: Final = "disabled"
"""prefill_enabled is false."""
NOT_CAUSAL: Final = "not_causal"
"""The prefill kernel is causal only."""
CONTEXT_TOO_LONG: Final = "context_too_long"
"""max_seq_len above the max_seq_len limit, or above the prefill kernel's own KV limit (set by
the vLLM routing: FlyDSL's 131072 tokens; see flyserve.vllm.flydsl_kernel.MAX_KV_LEN)."""
SHORT_CONTEXT: Final = "short_context"
"""max_seq_len below min_seq_len: too little KV work for the prefill kernel to win."""
LOW_OCCUPANCY: Final = "low_occupancy"
"""num_heads * num_actual_tokens below min_qblock_rows * block_m: too few q-blocks to fill the GPU."""
TOO_MANY_DECODE_ROWS: Final = "too_many_decode_rows"
"""More decode rows than decode_rows_base * max(1, max_seq_len // decode_ctx_unit)."""
ADMITTED: Final = "admitted"
"""Every check passed: the prefill path runs the batch."""
UNSUPPORTED: Final = "unsupported"
"""Set by the vLLM routing, not by decide(): the layer group's static configuration
(dtype, head size, alibi, sinks, soft-cap, sliding window, quantised KV) rules the prefill kernel out."""
CIRCUIT_OPEN: Final = "circuit_open"
"""Set by the vLLM routing, not by decide(): the prefill path raised and its circuit breaker is open."""

REASONS: Final = (
    NO_PREFILL_ROWS,
    DISABLED,
    NOT_CAUSAL,
    CONTEXT_TOO_LONG,
    SHORT_CONTEXT,
    LOW_OCCUPANCY,
    TOO_MANY_DECODE_ROWS,
    ADMITTED,
    UNSUPPORTED,
    CIRCUIT_OPEN,
)

LPT_MODES: Final = ("auto", "always", "never")
DECODE_PATHS: Final = PATHS
