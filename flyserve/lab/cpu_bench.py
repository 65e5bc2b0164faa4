"""The CPU kernel pair, called directly on a paged cache: what `flyserve calibrate --platform cpu` times.

The pair the CPU composite routes between (flyserve.vllm.backends): vLLM's CPU attention
(``ops.cpu_attention_with_kv_cache``, with the scheduler metadata vLLM's builder makes) and
flyserve's CPU SDPA prefill path (``CpuPrefillImpl._sdpa_forward``, the same code the engine runs).
Both read one cache in vLLM's CPU layout ``[blocks, kv_heads, block_size, 2 * head_size]``, so a
shape is timed on exactly the two calls a served batch would make; each shape is first checked by
running both on the same data and comparing (they must agree: they are the two halves of a
composite, and the engine already checks them against each other, FLYSERVE_CPU_COMPARE).

Imports torch and vllm at import: lab only, never the sidecar or the core.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from flyserve.policy import PREFILL, UNIFIED
from flyserve.vllm.cpu_prefill import CpuPrefillImpl

if hasattr(torch.cpu, "_init_amx"):
    # The kernel OS permission for AMX tiles: vLLM's CPU worker has it by the time it runs attention;
    # a bare process that calls the AMX kernel without it dies of SIGILL (seen on this CI VM).
    torch.cpu._init_amx()

AGREE_TOL = 2e-2
"""Largest |general - prefill| / max|general| accepted (bf16 outputs of two different kernels)."""


@dataclass(frozen=True)
class CpuLayout:
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def isa(self) -> str:
        return _get_attn_isa(self.dtype, self.block_size, self.head_size, "auto")


class CpuBatch:
    """One batch on its own cache: tensors both kernels read, built once, reused for every call."""

    def __init__(self, lay: CpuLayout, query_lens: list[int], seq_lens: list[int], *, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        bs = lay.block_size
        nbs = [-(-s // bs) for s in seq_lens]
        self.lay = lay
        self.kv_cache = (
            torch.randn(sum(nbs), lay.num_kv_heads, bs, 2 * lay.head_size, generator=g) * 0.5
        ).to(lay.dtype)
        table = torch.zeros(len(seq_lens), max(nbs), dtype=torch.int32)
        start = 0
        for i, nb in enumerate(nbs):
            table[i, :nb] = torch.arange(start, start + nb, dtype=torch.int32)
            start += nb
        self.block_table = table
        self.qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        n = int(sum(query_lens))
        self.query = (torch.randn(n, lay.num_heads, lay.head_size, generator=g) * 0.5).to(lay.dtype)
        self.out = {p: torch.empty_like(self.query) for p in (UNIFIED, PREFILL)}
        self.scale = lay.head_size**-0.5
        self.sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens),
            num_heads=lay.num_heads,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_size,
            seq_lens=self.seq_lens,
            dtype=lay.dtype,
            query_start_loc=self.qsl,
            causal=True,
            sliding_window_size=-1,
            isa=lay.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            dynamic_causal=None,
            kv_cache_dtype="auto",
        )
        impl = CpuPrefillImpl.__new__(CpuPrefillImpl)  # only the fields _sdpa_forward reads
        impl.head_size, impl.num_heads, impl.scale = lay.head_size, lay.num_heads, self.scale
        self._impl = impl
        self._layer = SimpleNamespace(isa=lay.isa)
        self._md = SimpleNamespace(
            causal=True,
            dynamic_causal=None,
            num_actual_tokens=n,
            query_start_loc=self.qsl,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
        )

    def run(self, path: str) -> torch.Tensor:
        out = self.out[path]
        if path == PREFILL:
            self._impl._sdpa_forward(
                self._layer, self.query, self.kv_cache, self._md, out.view(out.shape[0], -1)
            )
            return out
        kv = self.kv_cache.view(self.kv_cache.shape[0], self.lay.num_kv_heads, self.lay.block_size * 2, -1)
        key_cache, value_cache = kv.chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(
            query=self.query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=self.qsl,
            seq_lens=self.seq_lens,
            scale=self.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=self.block_table,
            softcap=0,
            scheduler_metadata=self.sched,
            s_aux=None,
            dynamic_causal=None,
            k_scale=1.0,
            v_scale=1.0,
            kv_cache_dtype="auto",
        )
        return out

    def agreement(self) -> float:
        """|prefill - general| / max|general| over every output element."""
        a = self.run(UNIFIED).float()
        b = self.run(PREFILL).float()
        return float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))


def time_path(batch: CpuBatch, path: str, *, min_reps: int = 5, budget_s: float = 0.25) -> dict[str, float]:
    """Median wall time of one call (perf_counter around a synchronous CPU call), after one warm-up."""
    batch.run(path)
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 200):
        t0 = time.perf_counter_ns()
        batch.run(path)
        times.append((time.perf_counter_ns() - t0) / 1e9)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "reps": len(times),
    }


def cpu_info() -> dict[str, Any]:
    import platform

    import vllm

    return {
        "gpu": f"none (CPU: {platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "triton": "-",
    }
